// libptk_backend_cuda.so's entry point (backend_module.h): the CUDA model and the NCCL communicator
// behind the interface ptk-train loads.
#include "trainer/cuda/backend_module.h"

#include "trainer/cuda/comm_nccl.h"
#include "trainer/cuda/cuda_gpt_model.h"

namespace ptk::cuda {

CudaModelOptions CudaModelOptionsOf(const ModelOptions& o) {
  CudaModelOptions options;
  options.sync_ops = o.sync_ops;
  options.disable_bf16_reduced_precision_matmul = o.disable_bf16_reduced_precision_matmul;
  options.tensor = o.tensor_comm;
  options.pipeline = o.pipeline_stage;
  options.sequence_parallel = o.sequence_parallel;
  options.context = o.context_comm;
  return options;
}

namespace {

class CudaBackend final : public Backend {
 public:
  int VisibleDeviceCount() const override { return cuda::VisibleDeviceCount(); }
  absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config, const ModelOptions& o) const override {
    return CreateCudaGPTModel(config, o.precision, o.device_index, o.deterministic, o.micro_batch_size, o.profile,
                              CudaModelOptionsOf(o));
  }
  absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options) const override {
    return MakeNcclCommunicator(options);
  }
};

}  // namespace
}  // namespace ptk::cuda

extern "C" __attribute__((visibility("default"))) const ptk::cuda::Backend* ptk_backend_cuda_v11() {
  static const ptk::cuda::CudaBackend backend;
  return &backend;
}
