// Megatron's bias-GELU activation: the tanh approximation, forward and backward.
#include <tbb/parallel_for.h>

#include <algorithm>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk {
namespace {
constexpr int64_t kBlock = 4096;
}  // namespace

template <typename T>
void GeluForwardCpu(T* out, const T* inp, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) out[i] = GeluValue(inp[i]);
  });
}

template <typename T>
void GeluBackwardCpu(T* dinp, const T* inp, const T* dout, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) dinp[i] = dout[i] * GeluDerivative(inp[i]);
  });
}

template void GeluForwardCpu<float>(float*, const float*, int64_t);
template void GeluForwardCpu<double>(double*, const double*, int64_t);
template void GeluBackwardCpu<float>(float*, const float*, const float*, int64_t);
template void GeluBackwardCpu<double>(double*, const double*, const double*, int64_t);

}  // namespace ptk
