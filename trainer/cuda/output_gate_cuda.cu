// Megatron's --attention-output-gate on the device, as the CPU op (trainer/cpu/output_gate_cpu.cpp): the fused
// QKV-and-gate product's rows split into the QKV layout and the gate (SplitGatedQkv; MergeGatedQkv the gradients
// back), and the core attention's output times sigmoid(gate) (OutputGateForward), its backward in fp32 with the CPU
// op's expression order (every product rounded apart: no contraction into multiply-adds).
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

// Per query group: q its query channels (the gate's as many), f the fused row's group width, w the QKV row's.
struct GateWidths {
  int64_t q, f, w;
};
GateWidths WidthsOf(const AttentionShape& s) {
  const int64_t q = s.nh / s.groups() * s.hd;
  return {q, 2 * q + 2 * s.hd, q + 2 * s.hd};
}

__device__ __forceinline__ float GateSigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// One thread per element of the fused rows (token i, group k, channel j of the group's g.f): where it goes (split)
// or comes from (merge) in the QKV rows or the gate rows.
template <typename T, bool kSplit>
__global__ void GatedQkvKernel(T* fused, T* qkv, T* gate, int64_t rows, int64_t q, int64_t f, int64_t w) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * f; e += stride) {
    const int64_t row = e / f, j = e % f;  // row: token i's group k (i * groups + k)
    T* other = j < q ? qkv + row * w + j : (j < 2 * q ? gate + row * q + (j - q) : qkv + row * w + (j - q));
    if (kSplit)
      *other = fused[e];
    else
      fused[e] = *other;
  }
}

template <typename T>
__global__ void OutputGateForwardKernel(T* out, const T* attn, const T* gate, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = FromFloat<T>(__fmul_rn(ToFloat(attn[i]), GateSigmoid(ToFloat(gate[i]))));
}

// dgate = dy * attn * sg * (1 - sg), dattn = dy * sg (in place on dattn), left to right as the CPU op.
template <typename T>
__global__ void OutputGateBackwardKernel(T* dattn, T* dgate, const T* attn, const T* gate, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float sg = GateSigmoid(ToFloat(gate[i])), dy = ToFloat(dattn[i]);
    dgate[i] = FromFloat<T>(__fmul_rn(__fmul_rn(__fmul_rn(dy, ToFloat(attn[i])), sg), __fsub_rn(1.0f, sg)));
    dattn[i] = FromFloat<T>(__fmul_rn(dy, sg));
  }
}

template <typename Where>
absl::Status CheckGateShape(const AttentionShape& s, const Where& where) {
  PTK_KERNEL_CHECK(kernel::CheckCount(s.b * s.t, "b*t", where));
  if (s.hd < 1 || s.nh < 1 || s.groups() < 1 || s.nh % s.groups() != 0)
    return absl::InvalidArgumentError(where() + ": not a shape of query groups");
  return absl::OkStatus();
}

constexpr int kThreads = 256;

template <typename T, bool kSplit>
absl::Status GatedQkv(T* fused, T* qkv, T* gate, const AttentionShape& s, const CudaContext& ctx, const char* name) {
  auto where = [&] {
    return fmt::format("{}<{}>(b={}, t={}, nh={}, hd={}, groups={})", name, kernel::TypeName<T>(), s.b, s.t, s.nh, s.hd,
                       s.groups());
  };
  PTK_KERNEL_CHECK(CheckGateShape(s, where));
  if (s.b * s.t == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(fused, "fused", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(qkv, "qkv", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(gate, "gate", where));
  const GateWidths g = WidthsOf(s);
  const int64_t rows = s.b * s.t * s.groups();
  GatedQkvKernel<T, kSplit>
      <<<kernel::GridBlocks(rows * g.f, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
          fused, qkv, gate, rows, g.q, g.f, g.w);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status SplitGatedQkv(T* qkv, T* gate, const T* fused, const AttentionShape& s, const CudaContext& ctx) {
  return GatedQkv<T, true>(const_cast<T*>(fused), qkv, gate, s, ctx, "SplitGatedQkv");
}

template <typename T>
absl::Status MergeGatedQkv(T* fused, const T* qkv, const T* gate, const AttentionShape& s, const CudaContext& ctx) {
  return GatedQkv<T, false>(fused, const_cast<T*>(qkv), const_cast<T*>(gate), s, ctx, "MergeGatedQkv");
}

template <typename T>
absl::Status OutputGateForward(T* out, const T* attn, const T* gate, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("OutputGateForward<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(attn, "attn", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(gate, "gate", where));
  OutputGateForwardKernel<T>
      <<<kernel::GridBlocks(n, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(out, attn, gate, n);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status OutputGateBackward(T* dattn, T* dgate, const T* attn, const T* gate, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("OutputGateBackward<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dattn, "dattn", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dgate, "dgate", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(attn, "attn", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(gate, "gate", where));
  OutputGateBackwardKernel<T><<<kernel::GridBlocks(n, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      dattn, dgate, attn, gate, n);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                   \
  template absl::Status SplitGatedQkv<T>(T*, T*, const T*, const AttentionShape&, const CudaContext&);       \
  template absl::Status MergeGatedQkv<T>(T*, const T*, const T*, const AttentionShape&, const CudaContext&); \
  template absl::Status OutputGateForward<T>(T*, const T*, const T*, int64_t, const CudaContext&);           \
  template absl::Status OutputGateBackward<T>(T*, T*, const T*, const T*, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
