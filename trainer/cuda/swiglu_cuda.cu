// SwiGLU on the device, forward and backward, as the CPU op (trainer/cpu/swiglu_cpu.cpp): SiluValue
// and SiluDerivative of trainer/op_math.h in fp32 over fc1's rows [gate (f); up (f)].
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

// One thread per output element (token i, channel j).
template <typename T>
__global__ void SwigluForwardKernel(T* out, const T* inp, int64_t n, int64_t f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n * f; k += stride) {
    const int64_t i = k / f, j = k % f;
    const float gate = ToFloat(inp[i * 2 * f + j]), up = ToFloat(inp[i * 2 * f + f + j]);
    out[k] = FromFloat<T>(SiluValue(gate) * up);
  }
}

template <typename T>
__global__ void SwigluBackwardKernel(T* dinp, const T* inp, const T* dout, int64_t n, int64_t f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n * f; k += stride) {
    const int64_t i = k / f, j = k % f;
    const float gate = ToFloat(inp[i * 2 * f + j]), up = ToFloat(inp[i * 2 * f + f + j]), dy = ToFloat(dout[k]);
    dinp[i * 2 * f + j] = FromFloat<T>(dy * up * SiluDerivative(gate));
    dinp[i * 2 * f + f + j] = FromFloat<T>(dy * SiluValue(gate));
  }
}

}  // namespace

template <typename T>
absl::Status SwigluForward(T* out, const T* inp, int64_t n, int64_t f, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SwigluForward<{}>(n={}, f={})", kernel::TypeName<T>(), n, f); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(f, "f", where));
  if (n == 0 || f == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  constexpr int kThreads = 256;
  SwigluForwardKernel<T>
      <<<kernel::GridBlocks(n * f, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(out, inp, n, f);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t n, int64_t f, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SwigluBackward<{}>(n={}, f={})", kernel::TypeName<T>(), n, f); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(f, "f", where));
  if (n == 0 || f == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dinp, "dinp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  constexpr int kThreads = 256;
  SwigluBackwardKernel<T>
      <<<kernel::GridBlocks(n * f, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(dinp, inp, dout, n, f);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                    \
  template absl::Status SwigluForward<T>(T*, const T*, int64_t, int64_t, const CudaContext&); \
  template absl::Status SwigluBackward<T>(T*, const T*, const T*, int64_t, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
