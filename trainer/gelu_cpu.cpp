// Megatron's bias-GELU activation: the tanh approximation, forward and backward.
#include <tbb/parallel_for.h>

#include <cmath>

#include "trainer/ops_cpu.h"

namespace ptk::trainer {
namespace {
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
constexpr int64_t kBlock = 4096;
}  // namespace

template <typename T>
void GeluForwardCpu(T* out, const T* inp, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) {
      T x = inp[i];
      T u = static_cast<T>(kSqrt2OverPi) * x * (T(1) + T(0.044715) * x * x);
      out[i] = T(0.5) * x * (T(1) + std::tanh(u));
    }
  });
}

template <typename T>
void GeluBackwardCpu(T* dinp, const T* inp, const T* dout, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) {
      T x = inp[i];
      T u = static_cast<T>(kSqrt2OverPi) * x * (T(1) + T(0.044715) * x * x);
      T th = std::tanh(u);
      T du = static_cast<T>(kSqrt2OverPi) * (T(1) + T(3) * T(0.044715) * x * x);
      T d = T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
      dinp[i] = dout[i] * d;
    }
  });
}

template void GeluForwardCpu<float>(float*, const float*, int64_t);
template void GeluForwardCpu<double>(double*, const double*, int64_t);
template void GeluBackwardCpu<float>(float*, const float*, const float*, int64_t);
template void GeluBackwardCpu<double>(double*, const double*, const double*, int64_t);

}  // namespace ptk::trainer
