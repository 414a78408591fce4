// What every CUDA op of the trainer shares: checked calls that turn a failed CUDA, cuBLAS or cuDNN
// call into an absl::Status naming the call, the op and the shapes; the per-model context (stream,
// library handles, workspace); the activation types (fp32, bf16, fp16) and their conversions.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace ptk::cuda {

// "op (shapes): call failed: reason". `where` names the op and its shapes.
absl::Status CudaError(cudaError_t err, std::string_view call, std::string_view where);
absl::Status CublasError(cublasStatus_t err, std::string_view call, std::string_view where);

// The products cuBLASLt had no algorithm for, which ran through cublasGemmEx and the separate bias
// and GELU kernels instead (slower): each distinct one (op, shape, types, epilogue) with its number
// of calls. The first call of each is warned about (matmul_cuda.cu); --ptk-profile-ops prints the
// count.
struct GemmFallbacks {
  std::mutex mu;
  std::map<std::string, int64_t> calls;
  // Records one call; true when `what` is new (the caller warns).
  bool Note(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    return ++calls[what] == 1;
  }
  int64_t distinct() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int64_t>(calls.size());
  }
};

// The state one model's ops share. Created by the model, borrowed by every launcher.
struct CudaContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;  // cuBLASLt / cuDNN workspace
  size_t workspace_bytes = 0;
  void* cudnn = nullptr;       // cudnnHandle_t (kept opaque so this header needs no cudnn.h)
  bool deterministic = false;  // --deterministic-mode: no atomics-ordered reductions, fixed algorithms
  // --disable-bf16-reduced-precision-matmul (with --bf16): the products' split-K partial sums never in
  // a bf16/fp16 output type, only in fp32 (gemm_plan.h's ReductionSchemeMask)
  bool disallow_reduced_precision_reduction = false;
  int sm_major = 0, sm_minor = 0, num_sms = 0;
  GemmFallbacks* fallbacks = nullptr;  // the model's count of cuBLASLt fallbacks (may be null)
};

// Activation types: float (fp32 mode), __nv_bfloat16 (--bf16), __half (--fp16). Arithmetic is fp32.
template <typename T>
__host__ __device__ __forceinline__ float ToFloat(T x) {
  return static_cast<float>(x);
}
template <>
__host__ __device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__host__ __device__ __forceinline__ float ToFloat<__half>(__half x) {
  return __half2float(x);
}
template <typename T>
__host__ __device__ __forceinline__ T FromFloat(float x) {
  return static_cast<T>(x);
}
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);  // round to nearest even
}
template <>
__host__ __device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half(x);  // round to nearest even
}

// cudaDataType of an activation type (for cuBLASLt / cuDNN descriptors).
template <typename T>
constexpr cudaDataType_t CudaDataType();
template <>
constexpr cudaDataType_t CudaDataType<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t CudaDataType<__nv_bfloat16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t CudaDataType<__half>() {
  return CUDA_R_16F;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ptk::cuda

// Returns a Status from the enclosing function when a CUDA runtime call fails.
#define PTK_CUDA_RETURN_IF_ERROR(call, where)                                                       \
  do {                                                                                              \
    cudaError_t ptk_cuda_err_ = (call);                                                             \
    if (ptk_cuda_err_ != cudaSuccess) return ::ptk::cuda::CudaError(ptk_cuda_err_, #call, (where)); \
  } while (0)
// After a kernel launch: a bad configuration shows here, an asynchronous fault at the next sync.
#define PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where) PTK_CUDA_RETURN_IF_ERROR(cudaGetLastError(), (where))
#define PTK_CUBLAS_RETURN_IF_ERROR(call, where)                                                                     \
  do {                                                                                                              \
    cublasStatus_t ptk_cublas_err_ = (call);                                                                        \
    if (ptk_cublas_err_ != CUBLAS_STATUS_SUCCESS) return ::ptk::cuda::CublasError(ptk_cublas_err_, #call, (where)); \
  } while (0)
