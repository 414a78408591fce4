// LayerNorm over the last dimension (statistics in double), forward and backward.
#include <tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kRowBlock = 64;  // fixed blocks: the weight-gradient sums do not depend on threads
}

template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int64_t n, int64_t c, double eps,
                      T w_offset) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* x = inp + i * c;
    double s = 0;
    for (int64_t j = 0; j < c; ++j) s += x[j];
    double m = s / static_cast<double>(c);
    double v = 0;
    for (int64_t j = 0; j < c; ++j) {
      double d = x[j] - m;
      v += d * d;
    }
    double r = 1.0 / std::sqrt(v / static_cast<double>(c) + eps);
    T* y = out + i * c;
    for (int64_t j = 0; j < c; ++j) y[j] = static_cast<T>((x[j] - m) * r) * (w[j] + w_offset) + b[j];
    mean[i] = static_cast<T>(m);
    rstd[i] = static_cast<T>(r);
  });
}

template <typename T>
void LayerNormBackward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean, const T* rstd,
                       int64_t n, int64_t c, T w_offset) {
  int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<double> part(static_cast<size_t>(blocks * 2 * c), 0.0);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    double* pw = part.data() + blk * 2 * c;
    double* pb = pw + c;
    int64_t end = std::min(n, (blk + 1) * kRowBlock);
    for (int64_t i = blk * kRowBlock; i < end; ++i) {
      const T* x = inp + i * c;
      const T* dy = dout + i * c;
      T* dx = dinp + i * c;
      double m = mean[i], r = rstd[i];
      // dxhat = dy * w; dx = r * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
      double sum_dxhat = 0, sum_dxhat_xhat = 0;
      for (int64_t j = 0; j < c; ++j) {
        double xhat = (x[j] - m) * r;
        double dxhat = static_cast<double>(dy[j]) * (w[j] + w_offset);
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
        pw[j] += dy[j] * xhat;
        pb[j] += dy[j];
      }
      sum_dxhat /= static_cast<double>(c);
      sum_dxhat_xhat /= static_cast<double>(c);
      for (int64_t j = 0; j < c; ++j) {
        double xhat = (x[j] - m) * r;
        double dxhat = static_cast<double>(dy[j]) * (w[j] + w_offset);
        dx[j] += static_cast<T>(r * (dxhat - sum_dxhat - xhat * sum_dxhat_xhat));
      }
    }
  });
  for (int64_t j = 0; j < c; ++j) {
    double sw = 0, sb = 0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      sw += part[blk * 2 * c + j];
      sb += part[blk * 2 * c + c + j];
    }
    dw[j] += static_cast<T>(sw);
    db[j] += static_cast<T>(sb);
  }
}

#define PTK_INSTANTIATE(T)                                                                                  \
  template void LayerNormForward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, double, T); \
  template void LayerNormBackward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t, T);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
