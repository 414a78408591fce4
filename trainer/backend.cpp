// The backend factory: the CPU model, or the CUDA model from the CUDA backend's module where the
// build has it (loaded only when asked for: a CPU run loads no CUDA library).
#include "trainer/backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cuda/backend_module.h"

namespace ptk {

bool CudaBuilt() {
#if defined(PTK_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

namespace {

constexpr char kBuiltWithoutCuda[] =
    "this ptk-train was built without CUDA (no nvcc at build time); build with scripts/build.sh -DPTK_CUDA=ON on a "
    "machine with the CUDA toolkit, or train with --device cpu";

absl::StatusOr<const cuda::Backend*> Load() {
  if (!CudaBuilt()) return absl::FailedPreconditionError(kBuiltWithoutCuda);
  // Beside the program itself where it is there (a pack of programs in one folder), else by name:
  // ptk-train's RUNPATH ($ORIGIN/../lib/ptk: the build tree, an installed tree), LD_LIBRARY_PATH (a
  // portable tree's lib/ptk/), the system's paths. RTLD_NOW: a symbol the module cannot resolve is
  // this error, not a crash in the middle of a run.
  std::string path = cuda::kCudaBackendModule;
  std::error_code ec;
  const std::filesystem::path program = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path beside = program.parent_path() / cuda::kCudaBackendModule;
    if (access(beside.c_str(), F_OK) == 0) path = beside.string();
  }
  void* module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (module == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(fmt::format(
        "the CUDA backend cannot be loaded: {}. It is {} in lib/ptk/ beside the bin/ of ptk-train and needs the CUDA "
        "runtime, cuBLAS, cuDNN 9 and NCCL 2 libraries of the CUDA version it was built with (the system's, "
        "LD_LIBRARY_PATH's, or a portable tree's lib/ptk/); without them, train with --device cpu",
        why ? why : "unknown error", cuda::kCudaBackendModule));
  }
  auto entry = reinterpret_cast<cuda::BackendEntryFn>(dlsym(module, cuda::kCudaBackendEntry));
  if (entry == nullptr)
    return absl::FailedPreconditionError(
        fmt::format("the CUDA backend cannot be loaded: {} has no {} (a module of another ptk version?); reinstall "
                    "ptk-train and lib/ptk/ from one build",
                    cuda::kCudaBackendModule, cuda::kCudaBackendEntry));
  return entry();
}

}  // namespace

absl::StatusOr<const cuda::Backend*> LoadCudaBackend() {
  static const absl::StatusOr<const cuda::Backend*> backend = Load();  // once, thread-safe
  return backend;
}

bool NvidiaDriverPresent() {
  for (const char* path : {"/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"})
    if (access(path, F_OK) == 0) return true;
  return false;
}

int CudaDeviceCount() {
  if (!CudaBuilt() || !NvidiaDriverPresent()) return 0;
  auto backend = LoadCudaBackend();
  return backend.ok() ? (*backend)->VisibleDeviceCount() : 0;
}

Device DefaultDevice() { return CudaDeviceCount() > 0 ? Device::kCuda : Device::kCpu; }

absl::Status CheckBackendChoice(Device device, Precision precision, bool device_given) {
  if (device == Device::kCuda && !CudaBuilt()) return UsageError(fmt::format("--device cuda: {}", kBuiltWithoutCuda));
  if (device == Device::kCpu && precision != Precision::kFp32)
    return UsageError(
        fmt::format("--{}: the CPU backend trains in fp32; drop the flag, or train on a GPU (--device cuda){}",
                    PrecisionName(precision), device_given ? "" : " (no CUDA device is visible here)"));
  return absl::OkStatus();
}

const char* const kCudaTensorParallelMissing =
    "--tensor-model-parallel-size above 1 on the CUDA backend needs NCCL for the tensor group "
    "(--distributed-backend nccl, the default with --device cuda); gloo's tensor parallelism runs on the CPU "
    "backend (--device cpu)";

cuda::ModelOptions CudaModuleOptions(const BackendOptions& backend) {
  const bool tp = backend.tensor_comm && backend.tensor_comm->size() > 1;
  cuda::ModelOptions o;
  o.precision = backend.precision;
  o.device_index = backend.device_index;
  o.deterministic = backend.deterministic;
  o.micro_batch_size = backend.micro_batch_size;
  o.profile = backend.profile;
  o.sync_ops = backend.sync_ops;
  o.disable_bf16_reduced_precision_matmul = backend.disable_bf16_reduced_precision_matmul;
  o.tensor_comm = tp ? backend.tensor_comm : nullptr;
  o.pipeline_stage = backend.pipeline_stage;
  o.sequence_parallel = tp && backend.sequence_parallel;
  // Context parallelism: the model refuses what its CUDA path lacks (a group without device collectives: gloo).
  o.context_comm = backend.context_comm && backend.context_comm->size() > 1 ? backend.context_comm : nullptr;
  return o;
}

absl::StatusOr<std::unique_ptr<GPTModel>> CreateModel(const GPTConfig& config, const BackendOptions& backend) {
  // The CUDA backend's MoE layers (trainer/cuda/cuda_moe_model.cpp) are dropless and data-parallel, with aux_loss,
  // seq_aux_loss, the z-loss, shared experts, group-limited routing and the expert bias; the rest runs on the CPU
  // passes (cpu_moe_layer.cpp). ptk-train refuses it by flag first.
  if (config.moe() && backend.device != Device::kCpu) {
    const auto several = [](const Communicator* c) { return c != nullptr && c->size() > 1; };
    const char* missing = several(backend.tensor_comm) || several(backend.context_comm) ||
                                  several(backend.expert_comm) || backend.pipeline_stage.size > 1
                              ? "model parallelism"
                          : config.moe_router_group_topk > 0 && config.moe_router_num_groups > 64
                              ? "group-limited routing over more than 64 groups"
                          : config.moe_expert_capacity_factor >= 0 ? "token dropping"
                          : config.moe_global_aux_loss_coeff > 0   ? "global_aux_loss"
                                                                   : nullptr;
    if (missing != nullptr)
      return absl::UnimplementedError(fmt::format(
          "num_experts {}: the CUDA backend's mixture-of-experts layers have no {}; it runs on the CPU backend",
          config.num_experts, missing));
  }
  // Multi-latent attention: the CUDA model's layers (cuda_mla_layer.cpp) on one tensor, context and pipeline rank;
  // the CPU passes (cpu_mla_layer.cpp) with model parallelism.
  if (config.mla() && backend.device != Device::kCpu) {
    const auto several = [](const Communicator* c) { return c != nullptr && c->size() > 1; };
    if (several(backend.tensor_comm) || several(backend.context_comm) || backend.pipeline_stage.size > 1)
      return absl::UnimplementedError(
          "multi_latent_attention: the CUDA backend's multi-latent attention runs on one tensor, context and pipeline "
          "rank (data parallelism only); with model parallelism it runs on the CPU backend");
  }
  // Multi-token prediction is the CPU model's ForwardBackward's (mtp_cpu.cpp), on one context rank.
  if (config.mtp_num_layers > 0 && backend.device != Device::kCpu)
    return absl::UnimplementedError("mtp_num_layers: multi-token prediction runs on the CPU backend");
  if (config.mtp_num_layers > 0 && backend.context_comm && backend.context_comm->size() > 1)
    return absl::UnimplementedError("mtp_num_layers: multi-token prediction runs on one context rank");
  // The CUDA backend runs the sliding window (fp32 kernels and cuDNN's band) and the softmax offset (the fp32 kernels
  // only), on one context rank.
  const bool on_cuda = backend.device != Device::kCpu;
  const bool context = backend.context_comm && backend.context_comm->size() > 1;
  if (on_cuda && context && (config.window_left >= 0 || config.softmax_sink()))
    return absl::UnimplementedError(
        "window_left / softmax_type with context parallelism: the CUDA backend's context-parallel attention has "
        "neither the sliding window nor the softmax offset");
  if (on_cuda && config.softmax_sink() && backend.precision != Precision::kFp32)
    return absl::UnimplementedError(fmt::format(
        "softmax_type {} in bf16/fp16 on CUDA: cuDNN's fused attention runs without the softmax offset in ptk (fp32 "
        "has it)",
        config.softmax_type));
  PTK_RETURN_IF_ERROR(CheckBackendChoice(backend.device, backend.precision));
  if (backend.device == Device::kCpu) {
    PTK_ASSIGN_OR_RETURN(
        std::unique_ptr<CpuGPTModel> m,
        CpuGPTModel::Create(config, backend.tensor_comm, backend.sequence_parallel, backend.pipeline_stage,
                            backend.expert_comm && backend.expert_comm->size() > 1 ? backend.expert_comm : nullptr,
                            backend.expert_data_comm));
    if (backend.context_comm && backend.context_comm->size() > 1)
      PTK_RETURN_IF_ERROR(m->SetContextParallel(backend.context_comm));
    return std::unique_ptr<GPTModel>(std::move(m));
  }
  const bool tp = backend.tensor_comm && backend.tensor_comm->size() > 1;
  if (tp && !backend.tensor_comm->device_collectives()) return UsageError(kCudaTensorParallelMissing);
  auto cuda = LoadCudaBackend();
  if (!cuda.ok()) return absl::FailedPreconditionError(fmt::format("--device cuda: {}", StatusMessage(cuda.status())));
  return (*cuda)->CreateModel(config, CudaModuleOptions(backend));
}

}  // namespace ptk
