// Rotary position embedding on the device, forward and backward, as the CPU op
// (trainer/cpu/rope_cpu.cpp): in place on the fused QKV's query and key heads (each group's query
// heads, then its key head; the value heads untouched), channels i and i + rd/2 of each head (2i and
// 2i + 1 interleaved) rotated by the fp32 tables cos/sin (t, rd/2) of the token's place in its sequence; the rotation
// in fp32.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

// One thread per (token row, rotated head, pair i). sign +1: the rotation; -1: its transpose.
template <typename T>
__global__ void RopeKernel(T* qkv, const float* cos, const float* sin, AttentionShape s, int64_t rd, bool interleaved,
                           float sign) {
  // AttentionShape's methods are host code: its groups() and qkv_width() spelled out.
  const int64_t half = rd / 2, groups = s.ng > 0 ? s.ng : s.nh, per_group = s.nh / groups,
                width = (s.nh + 2 * groups) * s.hd;
  const int64_t heads = groups * (per_group + 1), total = s.b * s.t * heads * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += stride) {
    const int64_t i = k % half, head = (k / half) % heads, row = k / (half * heads);
    const int64_t g = head / (per_group + 1), h = head % (per_group + 1), pos = row % s.t;
    T* x = qkv + row * width + (g * (per_group + 2) + h) * s.hd + (interleaved ? 2 * i : i);
    const int64_t step = interleaved ? 1 : half;
    const float x1 = ToFloat(x[0]), x2 = ToFloat(x[step]), c = cos[pos * half + i], sv = sign * sin[pos * half + i];
    x[0] = FromFloat<T>(x1 * c - x2 * sv);
    x[step] = FromFloat<T>(x2 * c + x1 * sv);
  }
}

template <typename T>
absl::Status Rope(const char* name, T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd,
                  bool interleaved, float sign, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("{}<{}>(b={}, t={}, nh={}, hd={}, groups={}, rd={}{})", name, kernel::TypeName<T>(), s.b, s.t,
                       s.nh, s.hd, s.groups(), rd, interleaved ? ", interleaved" : "");
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(s.b, "b", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(s.t, "t", where));
  if (rd < 2 || rd % 2 != 0 || rd > s.hd || s.nh < 1 || s.groups() < 1 || s.nh % s.groups() != 0)
    return absl::InvalidArgumentError(
        where() + ": the rotated channels must be even, at least 2 and at most hd; the groups must divide nh");
  if (s.b == 0 || s.t == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(qkv, "qkv", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(cos, "cos", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(sin, "sin", where));
  constexpr int kThreads = 256;
  const int64_t total = s.b * s.t * (s.nh + s.groups()) * (rd / 2);
  RopeKernel<T><<<kernel::GridBlocks(total, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      qkv, cos, sin, s, rd, interleaved, sign);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status RopeForward(T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd,
                         bool interleaved, const CudaContext& ctx) {
  return Rope("RopeForward", qkv, cos, sin, s, rd, interleaved, 1.0f, ctx);
}
template <typename T>
absl::Status RopeBackward(T* dqkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd,
                          bool interleaved, const CudaContext& ctx) {
  return Rope("RopeBackward", dqkv, cos, sin, s, rd, interleaved, -1.0f, ctx);
}

#define PTK_INSTANTIATE(T)                                                                                    \
  template absl::Status RopeForward<T>(T*, const float*, const float*, const AttentionShape&, int64_t, bool,  \
                                       const CudaContext&);                                                   \
  template absl::Status RopeBackward<T>(T*, const float*, const float*, const AttentionShape&, int64_t, bool, \
                                        const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
