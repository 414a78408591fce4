// Failed CUDA / cuBLAS calls as absl::Status.
#include <fmt/core.h>

#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {

absl::Status CudaError(cudaError_t err, std::string_view call, std::string_view where) {
  std::string msg = fmt::format("CUDA error in {}: {} failed: {} ({})", where, call, cudaGetErrorString(err),
                                cudaGetErrorName(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status CublasError(cublasStatus_t err, std::string_view call, std::string_view where) {
  return absl::InternalError(
      fmt::format("cuBLAS error in {}: {} failed: {} ({})", where, call, cublasGetStatusString(err),
                  cublasGetStatusName(err)));
}

}  // namespace ptk::cuda
