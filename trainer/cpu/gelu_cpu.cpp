// Megatron's bias-GELU activation (the tanh approximation) and torch's exact erf GELU (Megatron's
// unfused GELU MLP, --no-bias-gelu-fusion), forward and backward. In fp32 the tanh GELU's
// formula runs on vector lanes with cpu_lanes.h's tanh (libm's scalar tanhf was about a tenth of a
// 6-layer step); in double (the finite-difference tests) with the C library's. The exact GELU runs the
// C library's erf and exp one element at a time (op_math.h's GeluExactValue / GeluExactDerivative).
#include <tbb/parallel_for.h>

#include <algorithm>

#include "trainer/cpu/cpu_lanes.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kBlock = 4096;

using lanes::FastTanh;
using lanes::kLanes;
using lanes::Lanes;
using lanes::Load;
using lanes::Store;

// One block: the lanes, then the tail one float at a time (the same operations, so the same bits).
__attribute__((target_clones("avx512f", "avx2", "default"))) void GeluBlock(float* out, const float* inp, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(out + i, GeluValueWith<float>(Load(inp + i), FastTanh{}));
  for (; i < n; ++i) out[i] = GeluValueWith<float>(inp[i], FastTanh{});
}
__attribute__((target_clones("avx512f", "avx2", "default"))) void GeluBackwardBlock(float* dinp, const float* inp,
                                                                                    const float* dout, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    Store(dinp + i, Load(dout + i) * GeluDerivativeWith<float>(Load(inp + i), FastTanh{}));
  for (; i < n; ++i) dinp[i] = dout[i] * GeluDerivativeWith<float>(inp[i], FastTanh{});
}
void GeluBlock(double* out, const double* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = GeluValue(inp[i]);
}
void GeluBackwardBlock(double* dinp, const double* inp, const double* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * GeluDerivative(inp[i]);
}

// f(begin, count) over blocks of kBlock elements, in parallel (the same blocks for any thread count).
template <typename F>
void ForEachBlock(int64_t n, const F& f) {
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t begin = blk * kBlock;
    f(begin, std::min(n, begin + kBlock) - begin);
  });
}

}  // namespace

template <typename T>
void GeluForward(T* out, const T* inp, int64_t n) {
  ForEachBlock(n, [&](int64_t begin, int64_t count) { GeluBlock(out + begin, inp + begin, count); });
}

template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  ForEachBlock(
      n, [&](int64_t begin, int64_t count) { GeluBackwardBlock(dinp + begin, inp + begin, dout + begin, count); });
}

template <typename T>
void GeluExactForward(T* out, const T* inp, int64_t n) {
  ForEachBlock(n, [&](int64_t begin, int64_t count) {
    for (int64_t i = begin; i < begin + count; ++i) out[i] = GeluExactValue(inp[i]);
  });
}

template <typename T>
void GeluExactBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  ForEachBlock(n, [&](int64_t begin, int64_t count) {
    for (int64_t i = begin; i < begin + count; ++i) dinp[i] = dout[i] * GeluExactDerivative(inp[i]);
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
