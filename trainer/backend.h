// Choosing and creating the model's backend: --device cpu|cuda and Megatron's precision flags.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk {

struct BackendOptions {
  Device device = Device::kCpu;
  Precision precision = Precision::kFp32;
  int device_index = 0;          // the CUDA device (the local rank; CUDA_VISIBLE_DEVICES applies)
  bool deterministic = false;    // --deterministic-mode: only bitwise-reproducible kernels
  int64_t micro_batch_size = 1;  // the CUDA backend plans its activations for it
  bool profile = false;          // --ptk-profile-ops: time every op (CUDA events)
  bool sync_ops = false;         // CUDA: synchronise after every op, name the one that fails (PTK_CUDA_SYNC_OPS=1)
  // --disable-bf16-reduced-precision-matmul (set with --bf16 only, as Megatron): the CUDA backend's bf16
  // products reduce their split-K partial sums in fp32, never in bf16. The CPU backend's products
  // accumulate in fp32 anyway.
  bool disable_bf16_reduced_precision_matmul = false;
  // The tensor-parallel group (--tensor-model-parallel-size; null or one rank: none). The CPU
  // backend partitions the model over it (the CUDA backend's must be NCCL's: device collectives).
  Communicator* tensor_comm = nullptr;
  bool sequence_parallel = false;  // --sequence-parallel (with a tensor group)
  // The context-parallel group (--context-parallel-size; null or one rank: none): the model's
  // attention over the whole sequence from this rank's positions. The CUDA backend's needs NCCL
  // (device collectives; it refuses gloo) and runs its attention in fp32 in every precision.
  Communicator* context_comm = nullptr;
  // The expert-parallel and expert-data-parallel groups (--expert-model-parallel-size; null or one rank: none):
  // the CPU model holds this expert rank's experts and dispatches its MoE layers' tokens over expert_comm.
  Communicator* expert_comm = nullptr;
  Communicator* expert_data_comm = nullptr;
  // --pipeline-model-parallel-size: this rank's stage (the whole model by default): the model
  // built is the stage's part (either backend).
  PipelineStage pipeline_stage;
};

// Why the CUDA backend refuses tensor parallelism over gloo (with or without --sequence-parallel)
// (usage errors' text).
extern const char* const kCudaTensorParallelMissing;

namespace cuda {
class Backend;
struct ModelOptions;
}  // namespace cuda

// Whether this build has the CUDA backend (the module lib/ptk/libptk_backend_cuda.so, built where
// nvcc was found).
bool CudaBuilt();
// The CUDA backend, loaded on first use (dlopen; kept for the life of the process): the module is
// found through ptk-train's RUNPATH ($ORIGIN/../lib/ptk), LD_LIBRARY_PATH, then the system's paths.
// FailedPrecondition with one line naming what is missing (the loader's words: the module, or the
// CUDA library it needs) when it cannot be loaded, or when the build has no CUDA backend. Nothing
// else loads a CUDA library: a CPU run never calls this.
absl::StatusOr<const cuda::Backend*> LoadCudaBackend();
// What CreateModel asks of the CUDA backend's module for `backend` (groups of one rank left out);
// trainer/cuda/backend_module.h defines the type.
cuda::ModelOptions CudaModuleOptions(const BackendOptions& backend);
// Whether an NVIDIA driver is installed (/proc/driver/nvidia, /dev/nvidiactl, or WSL's /dev/dxg):
// without one, no CUDA device can be visible, and the CUDA backend is not loaded to find out.
bool NvidiaDriverPresent();
// How many CUDA devices are visible: 0 without the CUDA backend, without a driver or without a
// device (loads the backend only where a driver is installed).
int CudaDeviceCount();
// ptk-train's default --device: cuda where the build has CUDA and a device is visible, else cpu.
Device DefaultDevice();

// The refusals no backend gets around, written here only: --device cuda in a build without CUDA,
// --fp16 / --bf16 on the CPU (fp32 only). Usage errors naming the flag; with !device_given (the
// device was defaulted) the precision refusal says no CUDA device is visible. ptk-train checks this
// before anything is read; CreateModel checks it again.
absl::Status CheckBackendChoice(Device device, Precision precision, bool device_given = true);

// The model on the chosen backend, in one hop from what the plan resolved (`backend` carries the
// micro-batch size the CUDA backend plans its activations for). Never falls back to another backend: --device cuda in a
// build without CUDA, where the CUDA backend cannot be loaded, with no device visible, or --bf16 on a GPU before sm_80
// is an error that says so.
absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config, const BackendOptions& backend);

}  // namespace ptk
