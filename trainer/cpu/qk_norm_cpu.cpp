// Megatron's --qk-layernorm: LayerNorm or RMSNorm over each query and key head of the fused QKV
// buffer (statistics in double), forward and backward.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kTokenBlock = 64;  // fixed blocks: the weight-gradient sums do not depend on threads

// Where head `h` of a token's row lies (query heads first in each group, then its key, then its
// value head): the offset of its hd channels, and whether it is a query (0), key (1) or value (2) head.
struct HeadAt {
  int64_t offset;
  int kind;
};
HeadAt Head(const AttentionShape& s, int64_t h) {
  const int64_t per = s.nh / s.groups() + 2, k = h % per;
  return {h * s.hd, k < per - 2 ? 0 : (k == per - 2 ? 1 : 2)};
}
}  // namespace

template <typename T>
void QKNormForward(T* qkv, T* mean, T* rstd, const T* raw, const T* wq, const T* bq, const T* wk, const T* bk,
                   const AttentionShape& s, double eps, T w_offset) {
  const int64_t width = s.qkv_width(), heads = width / s.hd, normed = s.nh + s.groups(), hd = s.hd;
  tbb::parallel_for(int64_t{0}, s.b * s.t, [&](int64_t i) {
    int64_t row = i * normed;  // this token's first statistics entry
    for (int64_t h = 0; h < heads; ++h) {
      const HeadAt at = Head(s, h);
      const T* x = raw + i * width + at.offset;
      T* y = qkv + i * width + at.offset;
      if (at.kind == 2) {
        std::memcpy(y, x, static_cast<size_t>(hd) * sizeof(T));
        continue;
      }
      const T* w = at.kind == 0 ? wq : wk;
      const T* b = at.kind == 0 ? bq : bk;
      double m = 0;
      if (mean) {
        for (int64_t j = 0; j < hd; ++j) m += x[j];
        m /= static_cast<double>(hd);
      }
      double v = 0;
      for (int64_t j = 0; j < hd; ++j) v += (x[j] - m) * (x[j] - m);
      const double r = 1.0 / std::sqrt(v / static_cast<double>(hd) + eps);
      for (int64_t j = 0; j < hd; ++j) y[j] = static_cast<T>((x[j] - m) * r) * (w[j] + w_offset) + (b ? b[j] : T(0));
      if (mean) mean[row] = static_cast<T>(m);
      rstd[row] = static_cast<T>(r);
      ++row;
    }
  });
}

template <typename T>
void QKNormBackward(T* dqkv, T* dwq, T* dbq, T* dwk, T* dbk, const T* raw, const T* wq, const T* wk, const T* mean,
                    const T* rstd, const AttentionShape& s, T w_offset) {
  const int64_t width = s.qkv_width(), heads = width / s.hd, normed = s.nh + s.groups(), hd = s.hd;
  const int64_t n = s.b * s.t, blocks = (n + kTokenBlock - 1) / kTokenBlock;
  // Per block: dwq, dbq, dwk, dbk partial sums.
  std::vector<double> part(static_cast<size_t>(blocks * 4 * hd), 0.0);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    double* pw[2] = {part.data() + blk * 4 * hd, part.data() + blk * 4 * hd + 2 * hd};
    const int64_t end = std::min(n, (blk + 1) * kTokenBlock);
    for (int64_t i = blk * kTokenBlock; i < end; ++i) {
      int64_t row = i * normed;
      for (int64_t h = 0; h < heads; ++h) {
        const HeadAt at = Head(s, h);
        if (at.kind == 2) continue;  // the value heads' gradient passes through unchanged
        const T* x = raw + i * width + at.offset;
        T* dy = dqkv + i * width + at.offset;  // in: d(normalised), out: d(raw)
        const T* w = at.kind == 0 ? wq : wk;
        double* dw = pw[at.kind];
        double* db = dw + hd;
        const double m = mean ? static_cast<double>(mean[row]) : 0.0, r = rstd[row];
        // dxhat = dy w; LayerNorm: dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat)); RMSNorm
        // drops the mean(dxhat) term (no centring).
        double sum_dxhat = 0, sum_dxhat_xhat = 0;
        for (int64_t j = 0; j < hd; ++j) {
          const double xhat = (x[j] - m) * r, dxhat = static_cast<double>(dy[j]) * (w[j] + w_offset);
          sum_dxhat += dxhat;
          sum_dxhat_xhat += dxhat * xhat;
          dw[j] += dy[j] * xhat;
          db[j] += dy[j];
        }
        sum_dxhat = mean ? sum_dxhat / static_cast<double>(hd) : 0.0;
        sum_dxhat_xhat /= static_cast<double>(hd);
        for (int64_t j = 0; j < hd; ++j) {
          const double xhat = (x[j] - m) * r, dxhat = static_cast<double>(dy[j]) * (w[j] + w_offset);
          dy[j] = static_cast<T>(r * (dxhat - sum_dxhat - xhat * sum_dxhat_xhat));
        }
        ++row;
      }
    }
  });
  T* outs[4] = {dwq, dbq, dwk, dbk};
  for (int64_t k = 0; k < 4; ++k) {
    if (!outs[k]) continue;
    for (int64_t j = 0; j < hd; ++j) {
      double sum = 0;
      for (int64_t blk = 0; blk < blocks; ++blk) sum += part[blk * 4 * hd + k * hd + j];
      outs[k][j] += static_cast<T>(sum);
    }
  }
}

#define PTK_INSTANTIATE(T)                                                                                            \
  template void QKNormForward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const AttentionShape&, \
                                 double, T);                                                                          \
  template void QKNormBackward<T>(T*, T*, T*, T*, T*, const T*, const T*, const T*, const T*, const T*,               \
                                  const AttentionShape&, T);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
