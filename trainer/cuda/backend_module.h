// The CUDA backend as ptk-train sees it: the one entry point of the module libptk_backend_cuda.so,
// which trainer/backend.cpp loads with dlopen only when --device cuda or NCCL asks for it (as ggml
// loads its backends), so that ptk-train starts, and trains on the CPU, where no CUDA library is
// installed. The module and ptk-train come from one build (same compiler, same headers): the
// interface may pass C++ types. Change it only together with kCudaBackendEntry's version.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/cuda/comm_nccl.h"
#include "trainer/cuda/cuda_gpt_model.h"
#include "trainer/gpt_model.h"

namespace ptk::cuda {

// What the module makes: the model (CreateCudaGPTModel's arguments), the NCCL communicator, and
// how many devices are visible (0 without a driver or a device).
struct ModelOptions {
  Precision precision = Precision::kFp32;
  int device_index = 0;
  bool deterministic = false;
  int64_t micro_batch_size = 1;
  bool profile = false;
  bool sync_ops = false;  // PTK_CUDA_SYNC_OPS=1: synchronise after every op, name the one that fails
  // --disable-bf16-reduced-precision-matmul: CudaModelOptions::disable_bf16_reduced_precision_matmul
  bool disable_bf16_reduced_precision_matmul = false;
  Communicator* tensor_comm = nullptr;   // tensor parallelism: the tensor group (NCCL), CudaModelOptions::tensor
  PipelineStage pipeline_stage;          // pipeline parallelism: CudaModelOptions::pipeline
  bool sequence_parallel = false;        // --sequence-parallel over tensor_comm: CudaModelOptions::sequence_parallel
  Communicator* context_comm = nullptr;  // --context-parallel-size: the context group, CudaModelOptions::context
};

// The CUDA model's options from the module's (CudaBackend::CreateModel's).
CudaModelOptions CudaModelOptionsOf(const ModelOptions& o);

class Backend {
 public:
  virtual int VisibleDeviceCount() const = 0;
  virtual absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config,
                                                                const ModelOptions& options) const = 0;
  virtual absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options) const = 0;

 protected:
  ~Backend() = default;  // the module's own static object: never deleted through this interface
};

// The module's file name, and its entry point: extern "C" const Backend* ptk_backend_cuda_v11(void)
// (v2: ModelOptions::tensor_comm; v3: ModelOptions::pipeline_stage; v4: ModelOptions::sequence_parallel;
// v5: GPTModel::StageBuffers and GPTModel::Synchronize, Communicator::SendRecvDevice: virtuals of the classes both
// sides share; v6: GPTModel's sequence_parallel_ member, which the module's model sets; v7:
// GPTModel::AllReduceGradRanges, a virtual, and GPTModel's sequence_parallel_ranges_ member; v8: GPTConfig's
// qk_layernorm and LayerParams' query and key norms, that member renamed non_tensor_parallel_ranges_; v9:
// GPTModel::ReserveStageSlots and Communicator::BatchSendRecvDevice, virtuals; v10: ModelOptions::context_comm;
// v11: ModelOptions::disable_bf16_reduced_precision_matmul).
inline constexpr char kCudaBackendModule[] = "libptk_backend_cuda.so";
inline constexpr char kCudaBackendEntry[] = "ptk_backend_cuda_v11";
using BackendEntryFn = const Backend* (*)();

}  // namespace ptk::cuda

extern "C" const ptk::cuda::Backend* ptk_backend_cuda_v11();
