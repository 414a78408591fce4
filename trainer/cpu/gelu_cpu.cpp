// Megatron's bias-GELU activation (the tanh approximation) and torch's exact erf GELU, forward and backward.
#include <tbb/parallel_for.h>

#include <algorithm>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kBlock = 4096;
}  // namespace

template <typename T>
void GeluForward(T* out, const T* inp, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) out[i] = GeluValue(inp[i]);
  });
}

template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) dinp[i] = dout[i] * GeluDerivative(inp[i]);
  });
}

template <typename T>
void GeluExactForward(T* out, const T* inp, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) out[i] = GeluExactValue(inp[i]);
  });
}

template <typename T>
void GeluExactBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i) dinp[i] = dout[i] * GeluExactDerivative(inp[i]);
  });
}

template void GeluForward<float>(float*, const float*, int64_t);
template void GeluForward<double>(double*, const double*, int64_t);
template void GeluBackward<float>(float*, const float*, const float*, int64_t);
template void GeluBackward<double>(double*, const double*, const double*, int64_t);
template void GeluExactForward<float>(float*, const float*, int64_t);
template void GeluExactForward<double>(double*, const double*, int64_t);
template void GeluExactBackward<float>(float*, const float*, const float*, int64_t);
template void GeluExactBackward<double>(double*, const double*, const double*, int64_t);

}  // namespace ptk::cpu
