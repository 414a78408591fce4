// The shared experts' gate and the sums that join their output and input gradient to the routed experts'
// (moe_ops_cuda.h), the device twin of trainer/cpu/shared_experts_cpu.cpp's gate. Every sum runs in a fixed
// order (one block per token or per column, a fixed tree): no atomics.
#include <string>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/moe_ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kThreads = 256;

// The block's sum of each thread's v (all threads return it), a fixed tree.
__device__ float BlockSum(float v, float* part) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  const float s = part[0];
  __syncthreads();  // part is read above before the next call overwrites it
  return s;
}

template <typename T>
__global__ void GateForwardKernel(float* gate, const T* x, const T* w, int64_t n, int64_t c) {
  __shared__ float part[kThreads];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    float s = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) s += ToFloat(x[i * c + j]) * ToFloat(w[j]);
    s = BlockSum(s, part);
    if (threadIdx.x == 0) gate[i] = 1.0f / (1.0f + expf(-s));
  }
}

template <typename T>
__global__ void ScaleKernel(float* add, const T* y, const float* gate, int64_t n, int64_t c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n * c; k += stride)
    add[k] = gate != nullptr ? ToFloat(y[k]) * gate[k / c] : ToFloat(y[k]);
}

template <typename T>
__global__ void GateBackwardKernel(float* dlogit, T* dy, const T* dout, const T* y, const float* gate, int64_t n,
                                   int64_t c) {
  __shared__ float part[kThreads];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const float g = gate[i];
    float s = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float d = ToFloat(dout[i * c + j]);
      s += d * ToFloat(y[i * c + j]);
      dy[i * c + j] = FromFloat<T>(d * g);
    }
    s = BlockSum(s, part);
    if (threadIdx.x == 0) dlogit[i] = s * g * (1.0f - g);
  }
}

template <typename T>
__global__ void InputGradKernel(float* dx, const T* src, const float* dlogit, const T* w, int64_t n, int64_t c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n * c; k += stride) {
    float v = dx[k];
    if (dlogit != nullptr) v += dlogit[k / c] * ToFloat(w[k % c]);
    if (src != nullptr) v += ToFloat(src[k]);
    dx[k] = v;
  }
}

// One block per column j: dw[j] += sum_i dlogit[i] x[i, j].
template <typename T>
__global__ void GateWeightGradKernel(float* dw, const float* dlogit, const T* x, int64_t n, int64_t c) {
  __shared__ float part[kThreads];
  for (int64_t j = blockIdx.x; j < c; j += gridDim.x) {
    float s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += dlogit[i] * ToFloat(x[i * c + j]);
    s = BlockSum(s, part);
    if (threadIdx.x == 0) dw[j] += s;
  }
}

}  // namespace

template <typename T>
absl::Status MoeSharedGateForward(float* gate, const T* x, const T* w_gate, int64_t n, int64_t c,
                                  const CudaContext& ctx) {
  auto where = [&] { return fmt::format("MoeSharedGateForward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(gate, "gate", where));
  if (c > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(x, "x", where));
  if (c > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(w_gate, "w_gate", where));
  GateForwardKernel<T>
      <<<kernel::GridBlocks(n, 1, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(gate, x, w_gate, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeSharedScale(float* add, const T* y, const float* gate, int64_t n, int64_t c, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MoeSharedScale<{}>(n={}, c={}{})", kernel::TypeName<T>(), n, c, gate ? ", gated" : "");
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(add, "add", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(y, "y", where));
  ScaleKernel<T>
      <<<kernel::GridBlocks(n * c, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(add, y, gate, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeSharedGateBackward(float* dlogit, T* dy, const T* dout, const T* y, const float* gate, int64_t n,
                                   int64_t c, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("MoeSharedGateBackward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dlogit, "dlogit", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(gate, "gate", where));
  if (c > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(dy, "dy", where));
  if (c > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  if (c > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(y, "y", where));
  GateBackwardKernel<T>
      <<<kernel::GridBlocks(n, 1, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(dlogit, dy, dout, y, gate, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeSharedInputGrad(float* dx, float* dw_gate, const T* src, const float* dlogit, const T* x,
                                const T* w_gate, int64_t n, int64_t c, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MoeSharedInputGrad<{}>(n={}, c={}{})", kernel::TypeName<T>(), n, c,
                       dlogit != nullptr ? ", gated" : "");
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dx, "dx", where));
  if (dlogit != nullptr) {
    PTK_KERNEL_CHECK(kernel::CheckPointer(dw_gate, "dw_gate", where));
    PTK_KERNEL_CHECK(kernel::CheckPointer(x, "x", where));
    PTK_KERNEL_CHECK(kernel::CheckPointer(w_gate, "w_gate", where));
  }
  InputGradKernel<T><<<kernel::GridBlocks(n * c, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      dx, src, dlogit, w_gate, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  if (dlogit == nullptr) return absl::OkStatus();
  GateWeightGradKernel<T>
      <<<kernel::GridBlocks(c, 1, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(dw_gate, dlogit, x, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                         \
  template absl::Status MoeSharedGateForward<T>(float*, const T*, const T*, int64_t, int64_t, const CudaContext&); \
  template absl::Status MoeSharedScale<T>(float*, const T*, const float*, int64_t, int64_t, const CudaContext&);   \
  template absl::Status MoeSharedGateBackward<T>(float*, T*, const T*, const T*, const float*, int64_t, int64_t,   \
                                                 const CudaContext&);                                              \
  template absl::Status MoeSharedInputGrad<T>(float*, float*, const T*, const float*, const T*, const T*, int64_t, \
                                              int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
