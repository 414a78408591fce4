// AdamW (torch.optim.AdamW semantics), the global squared norm and scaling of gradients.
#include <tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "trainer/ops_cpu.h"

namespace ptk::trainer {
namespace {
constexpr int64_t kBlock = 16384;
}

template <typename T>
void AdamWCpu(T* p, const T* g, T* m, T* v, int64_t n, const AdamWParams& a) {
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(a.step));
  const T decay = static_cast<T>(1.0 - a.lr * a.weight_decay);
  const T b1 = static_cast<T>(a.beta1), b2 = static_cast<T>(a.beta2);
  const T step_size = static_cast<T>(a.lr / bc1);
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T eps = static_cast<T>(a.eps);
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) {
      T gi = g[i];
      p[i] *= decay;
      m[i] = b1 * m[i] + (T(1) - b1) * gi;
      v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
      T denom = std::sqrt(v[i]) / bc2_sqrt + eps;
      p[i] -= step_size * m[i] / denom;
    }
  });
}

template <typename T>
double SumSquaresCpu(const T* x, int64_t n) {
  int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> part(static_cast<size_t>(blocks), 0.0);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    double s = 0;
    for (int64_t i = blk * kBlock; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
    part[blk] = s;
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}

template <typename T>
void ScaleCpu(T* x, int64_t n, T s) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) x[i] *= s;
  });
}

template void AdamWCpu<float>(float*, const float*, float*, float*, int64_t, const AdamWParams&);
template void AdamWCpu<double>(double*, const double*, double*, double*, int64_t, const AdamWParams&);
template double SumSquaresCpu<float>(const float*, int64_t);
template double SumSquaresCpu<double>(const double*, int64_t);
template void ScaleCpu<float>(float*, int64_t, float);
template void ScaleCpu<double>(double*, int64_t, double);

}  // namespace ptk::trainer
