// Megatron's --squared-relu MLP activation (relu(x)^2), forward and backward.
#include <tbb/parallel_for.h>

#include <algorithm>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kBlock = 4096;
}  // namespace

template <typename T>
void SquaredReluForward(T* out, const T* inp, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) out[i] = SquaredReluValue(inp[i]);
  });
}

template <typename T>
void SquaredReluBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) dinp[i] = dout[i] * SquaredReluDerivative(inp[i]);
  });
}

template void SquaredReluForward<float>(float*, const float*, int64_t);
template void SquaredReluForward<double>(double*, const double*, int64_t);
template void SquaredReluBackward<float>(float*, const float*, const float*, int64_t);
template void SquaredReluBackward<double>(double*, const double*, const double*, int64_t);

}  // namespace ptk::cpu
