// Failed CUDA / cuBLAS calls as absl::Status; the versions of the libraries loaded.
#include <cudnn.h>
#include <fmt/core.h>
#include <nccl.h>

#include "trainer/cuda/cuda_common.h"
#include "trainer/cuda/cuda_versions.h"

namespace ptk::cuda {

absl::Status CudaError(cudaError_t err, std::string_view call, std::string_view where) {
  std::string msg =
      fmt::format("CUDA error in {}: {} failed: {} ({})", where, call, cudaGetErrorString(err), cudaGetErrorName(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status CublasError(cublasStatus_t err, std::string_view call, std::string_view where) {
  return absl::InternalError(fmt::format("cuBLAS error in {}: {} failed: {} ({})", where, call,
                                         cublasGetStatusString(err), cublasGetStatusName(err)));
}

CudaVersions QueryCudaVersions(int device) {
  CudaVersions v;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  (void)cudaGetLastError();
  v.runtime_headers = CUDART_VERSION;
  int major = 0, minor = 0, patch = 0;
  if (cublasLtGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasLtGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasLtGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
    v.cublaslt = int64_t{major} * 10000 + minor * 100 + patch;
  v.cublaslt_headers = CUBLAS_VERSION;
  v.cudnn = static_cast<int64_t>(cudnnGetVersion());
  v.cudnn_headers = CUDNN_VERSION;
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) v.nccl = nccl;
  v.nccl_headers = NCCL_VERSION_CODE;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    v.gpu = fmt::format("cuda:{} {}, sm_{}{}, {:.1f} GiB", device, prop.name, prop.major, prop.minor,
                        static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  else
    (void)cudaGetLastError();
  return v;
}

}  // namespace ptk::cuda
