// What the hand-written kernels of trainer/cuda/ share (internal to the <op>_cuda.cu files): packs
// of up to 128 bits loaded and stored in one access, sums over a warp or a block in a fixed order
// (the same bits run after run), launch geometry for int64 sizes, the elementwise driver (aligned
// packs in the middle, scalar head and tail) and the argument checks every launcher makes.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda::kernel {

// "fp32", "bf16", "fp16": for the messages that name an op's instantiation.
template <typename T>
constexpr std::string_view TypeName();
template <>
constexpr std::string_view TypeName<float>() {
  return "fp32";
}
template <>
constexpr std::string_view TypeName<__nv_bfloat16>() {
  return "bf16";
}
template <>
constexpr std::string_view TypeName<__half>() {
  return "fp16";
}

// Elements of T in one 128-bit access.
template <typename T>
constexpr int kVec = static_cast<int>(16 / sizeof(T));

// N elements of T stored together, aligned to their size (at most 16 bytes): one load or store.
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

// Loads N consecutive elements at p as floats, in accesses of at most 16 bytes: p must be aligned
// to min(16, N * sizeof(T)) bytes.
template <int N, typename T>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[N]) {
  constexpr int kPer = (N * sizeof(T) > 16) ? static_cast<int>(16 / sizeof(T)) : N;
  static_assert(N % kPer == 0, "a pack is whole 16-byte accesses");
#pragma unroll
  for (int a = 0; a < N; a += kPer) {
    const Pack<T, kPer> pk = *reinterpret_cast<const Pack<T, kPer>*>(p + a);
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[a + k] = ToFloat(pk.v[k]);
  }
}
// Stores N floats rounded to T (round to nearest even) at p, aligned as for LoadFloats.
template <int N, typename T>
__device__ __forceinline__ void StoreFloats(T* p, const float (&in)[N]) {
  constexpr int kPer = (N * sizeof(T) > 16) ? static_cast<int>(16 / sizeof(T)) : N;
  static_assert(N % kPer == 0, "a pack is whole 16-byte accesses");
#pragma unroll
  for (int a = 0; a < N; a += kPer) {
    Pack<T, kPer> pk;
#pragma unroll
    for (int k = 0; k < kPer; ++k) pk.v[k] = FromFloat<T>(in[a + k]);
    *reinterpret_cast<Pack<T, kPer>*>(p + a) = pk;
  }
}

inline bool Aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Sum over a warp along a fixed tree (shfl_down); the total is lane 0's, broadcast to every lane
// so that all lanes use the very same bits. Every lane of the warp must take part.
template <typename V>
__device__ __forceinline__ V WarpSum(V v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return __shfl_sync(0xffffffffu, v, 0);
}

// Sums of two values over the block (blockDim.x a multiple of 32, at most 1024), fixed order;
// every thread gets the totals. `shared` holds 2 * 33 values. Back-to-back calls may reuse it.
template <typename V>
__device__ __forceinline__ void BlockSum2(V& a, V& b, V* shared) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  a = WarpSum(a);
  b = WarpSum(b);
  if (lane == 0) {
    shared[warp] = a;
    shared[33 + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    V x = lane < warps ? shared[lane] : V(0);
    V y = lane < warps ? shared[33 + lane] : V(0);
    x = WarpSum(x);
    y = WarpSum(y);
    if (lane == 0) {
      shared[32] = x;
      shared[65] = y;
    }
  }
  __syncthreads();
  a = shared[32];
  b = shared[65];
}

// The most blocks a grid-stride kernel is given: enough to fill the device many times over.
inline int64_t MaxBlocks(const CudaContext& ctx) { return ctx.num_sms > 0 ? int64_t{ctx.num_sms} * 32 : 8192; }
// Blocks for `work` units of `per_block` each, at least 1, at most `cap`.
inline unsigned GridBlocks(int64_t work, int64_t per_block, int64_t cap) {
  int64_t b = CeilDiv(work, per_block);
  if (b < 1) b = 1;
  if (b > cap) b = cap;
  return static_cast<unsigned>(b);
}
// Threads for `units` per row (a multiple of 32, within [32, max_threads]).
inline int RowThreads(int64_t units, int max_threads) {
  int64_t t = CeilDiv(units, 32) * 32;
  if (t < 32) t = 32;
  if (t > max_threads) t = max_threads;
  return static_cast<int>(t);
}

// Runs op.template Apply<V>(i) for the elements [i, i + V) of [0, n): V = kV over `packs` aligned
// packs starting at element `head`, V = 1 for the head [0, head) and the tail after the packs
// (fewer than 2 * kV elements, taken by the first threads of the grid).
template <int kV, typename Op>
__global__ void ElementwiseKernel(Op op, int64_t n, int64_t head, int64_t packs) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = tid; k < packs; k += stride) op.template Apply<kV>(head + k * kV);
  const int64_t tail = head + packs * kV;
  const int64_t rest = head + (n - tail);
  if (tid < rest) op.template Apply<1>(tid < head ? tid : tail + (tid - head));
}

// Launches ElementwiseKernel over n elements. `head`: elements before the first one at which every
// pointer the op touches is aligned for kV-element packs; `vec_ok`: whether they all are aligned
// there (else every element goes scalar).
template <int kV, typename Op>
void LaunchElementwise(const Op& op, int64_t n, int64_t head, bool vec_ok, const CudaContext& ctx) {
  constexpr int kThreads = 256;
  if (!vec_ok || head >= n) {
    // all scalar: as packs of one element
    const unsigned blocks = GridBlocks(n, kThreads, MaxBlocks(ctx));
    ElementwiseKernel<1><<<blocks, kThreads, 0, ctx.stream>>>(op, n, 0, n);
    return;
  }
  const int64_t packs = (n - head) / kV;
  const unsigned blocks = GridBlocks(packs, kThreads, MaxBlocks(ctx));
  ElementwiseKernel<kV><<<blocks, kThreads, 0, ctx.stream>>>(op, n, head, packs);
}

// The residual sum a + b in fp32, rounded once (the caller rounds it to T as stored): ResidualAdd
// and the norms with the add fused in front call this one function.
__device__ __forceinline__ float ResidualSum(float a, float b) { return __fadd_rn(a, b); }

// A dropout's value of v: v * scale where kept, else 0, the product rounded once (__fmul_rn: never
// contracted into an add that follows, which nvcc's default --fmad=true may do kernel by kernel).
// DropoutRows and the kernels with dropout fused in (LayerNorm's) call this one function, so a
// fused kernel drops to the very bits of the standalone pass.
__device__ __forceinline__ float DropoutScaled(bool keep, float v, float scale) {
  return keep ? __fmul_rn(v, scale) : 0.0f;
}

// Elements of `elem_bytes` before p reaches a 16-byte boundary (p aligned to elem_bytes).
inline int64_t HeadTo16(const void* p, int64_t elem_bytes) {
  const auto mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
  return mis == 0 ? 0 : (16 - mis) / elem_bytes;
}
// Whether element `index` of an array of `elem_bytes` elements at p is aligned to `bytes` (address
// arithmetic only: index may lie past the end).
inline bool AlignedAt(const void* p, int64_t index, int64_t elem_bytes, int64_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(index * elem_bytes)) %
             static_cast<uintptr_t>(bytes) ==
         0;
}

// Argument checks every launcher makes before it launches anything. `where` is a callable giving
// "Op<type>(shapes)", formatted only when a check fails.
template <typename Where>
absl::Status CheckCount(int64_t v, std::string_view what, const Where& where) {
  if (v >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("{}: {} = {} is negative", where(), what, v));
}
template <typename Where>
absl::Status CheckPointer(const void* p, std::string_view what, const Where& where) {
  if (p != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("{}: {} is null", where(), what));
}

}  // namespace ptk::cuda::kernel

// Returns from the enclosing function when the Status expression (commas allowed) is not ok.
#define PTK_KERNEL_CHECK(...)                              \
  do {                                                     \
    ::absl::Status ptk_check_status_ = (__VA_ARGS__);      \
    if (!ptk_check_status_.ok()) return ptk_check_status_; \
  } while (0)
