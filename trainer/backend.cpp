// The backend factory: the CPU model, or the CUDA model where the build has it.
#include "trainer/backend.h"

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_gpt_model.h"
#if defined(PTK_WITH_CUDA)
#include "trainer/cuda/cuda_gpt_model.h"
#endif

namespace ptk {

bool CudaBuilt() {
#if defined(PTK_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int CudaDeviceCount() {
#if defined(PTK_WITH_CUDA)
  return cuda::VisibleDeviceCount();
#else
  return 0;
#endif
}

Device DefaultDevice() { return CudaDeviceCount() > 0 ? Device::kCuda : Device::kCpu; }

absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config, const BackendOptions& backend) {
  if (backend.device == Device::kCpu) {
    if (backend.precision != Precision::kFp32)
      return UsageError(fmt::format("--{} needs --device cuda: the CPU backend trains in fp32 only",
                                    PrecisionName(backend.precision)));
    PTK_ASSIGN_OR_RETURN(std::unique_ptr<CpuGPTModel> m, CpuGPTModel::Create(config));
    return std::unique_ptr<GPTModel>(std::move(m));
  }
#if defined(PTK_WITH_CUDA)
  cuda::CudaModelOptions cuda_options;
  cuda_options.sync_ops = backend.sync_ops;
  return cuda::CreateCudaGPTModel(config, backend.precision, backend.device_index, backend.deterministic,
                                  backend.micro_batch_size, backend.profile, cuda_options);
#else
  return absl::FailedPreconditionError(
      "--device cuda: this ptk-train was built without CUDA (no nvcc at build time); build with "
      "scripts/build.sh -DPTK_CUDA=ON on a machine with the CUDA toolkit, or train with --device cpu");
#endif
}

}  // namespace ptk
