// RMSNorm over the last dimension (statistics in double), forward and backward.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kRowBlock = 64;  // fixed blocks: the weight-gradient sums do not depend on threads
}

template <typename T>
void RMSNormForward(T* out, T* rstd, const T* inp, const T* w, int64_t n, int64_t c, double eps, T w_offset) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* x = inp + i * c;
    double ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += static_cast<double>(x[j]) * x[j];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(c) + eps);
    T* y = out + i * c;
    for (int64_t j = 0; j < c; ++j) y[j] = static_cast<T>(x[j] * r) * (w[j] + w_offset);
    rstd[i] = static_cast<T>(r);
  });
}

template <typename T>
void RMSNormBackward(T* dinp, T* dw, const T* dout, const T* inp, const T* w, const T* rstd, int64_t n, int64_t c,
                     T w_offset) {
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<double> part(static_cast<size_t>(blocks * c), 0.0);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    double* pw = part.data() + blk * c;
    const int64_t end = std::min(n, (blk + 1) * kRowBlock);
    for (int64_t i = blk * kRowBlock; i < end; ++i) {
      const T* x = inp + i * c;
      const T* dy = dout + i * c;
      T* dx = dinp + i * c;
      const double r = rstd[i];
      // xhat = x r; dxhat = dy w; dx = r (dxhat - xhat mean(dxhat xhat))
      double dot = 0;
      for (int64_t j = 0; j < c; ++j) {
        const double xhat = x[j] * r;
        dot += static_cast<double>(dy[j]) * (w[j] + w_offset) * xhat;
        pw[j] += dy[j] * xhat;
      }
      dot /= static_cast<double>(c);
      for (int64_t j = 0; j < c; ++j)
        dx[j] += static_cast<T>(r * (static_cast<double>(dy[j]) * (w[j] + w_offset) - x[j] * r * dot));
    }
  });
  for (int64_t j = 0; j < c; ++j) {
    double sw = 0;
    for (int64_t blk = 0; blk < blocks; ++blk) sw += part[blk * c + j];
    dw[j] += static_cast<T>(sw);
  }
}

#define PTK_INSTANTIATE(T)                                                                  \
  template void RMSNormForward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double, T); \
  template void RMSNormBackward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t, T);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
