// The CUDA model's setup: the device and its handles, the device memory plan, the micro-batch's inputs.
#include "trainer/cuda/cuda_gpt_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/context_flash_cuda.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/cuda_versions.h"
#include "trainer/cuda/local_rank_device.h"
#include "trainer/op_math.h"

namespace ptk::cuda {

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not sticky, clear it
    return 0;
  }
  return n;
}

namespace model_detail {
namespace {

// The first CUDA model of the process logs the versions it runs with (driver, runtime, cuBLASLt,
// cuDNN, NCCL, the GPU) and warns about each runtime library older than the build's headers.
void LogVersionsOnce(int device) {
  static std::once_flag once;
  std::call_once(once, [device] {
    std::vector<std::string> warnings;
    log::Info("{}", DescribeCudaVersions(QueryCudaVersions(device), &warnings));
    for (const std::string& w : warnings) log::Warning("{}", w);
  });
}

// Moves the allocation *arena (old_bytes; null: none) to a new one of `bytes`, its first `kept` bytes
// (the parameters and the optimizer's state) along, `stream` drained first. Beside the old one where
// the device has room for both; otherwise (re-planning a plan that fills most of the device: a
// pipeline stage's more slots, a larger micro-batch) the kept bytes wait in host memory while the old
// one is freed, and where even then the new one does not fit, an allocation of the old size takes
// them back. Returns whether *arena now has `bytes` (false: no room, *arena the old size, perhaps
// elsewhere, its first `kept` bytes intact).
absl::StatusOr<bool> MoveArena(char** arena, int64_t old_bytes, int64_t bytes, int64_t kept, cudaStream_t stream) {
  char* fresh = nullptr;
  if (cudaMalloc(&fresh, static_cast<size_t>(bytes)) == cudaSuccess) {
    if (*arena) {
      cudaError_t e = cudaMemcpyAsync(fresh, *arena, static_cast<size_t>(kept), cudaMemcpyDeviceToDevice, stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {
        cudaFree(fresh);
        return CudaError(e, "cudaMemcpyAsync", "moving the parameters to a re-planned allocation");
      }
      cudaFree(*arena);
    }
    *arena = fresh;
    return true;
  }
  (void)cudaGetLastError();
  if (!*arena) return false;
  std::unique_ptr<char[]> host(new (std::nothrow) char[static_cast<size_t>(kept)]);
  if (!host) return false;
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "re-planning device memory");
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host.get(), *arena, static_cast<size_t>(kept), cudaMemcpyDeviceToHost),
      fmt::format("keeping the parameters ({}) in host memory while re-planning", FormatBytes(kept)));
  cudaFree(*arena);
  *arena = nullptr;
  bool fits = true;
  if (cudaMalloc(&fresh, static_cast<size_t>(bytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    fits = false;
    if (cudaMalloc(&fresh, static_cast<size_t>(old_bytes)) != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(fmt::format(
          "re-planning device memory: neither the new plan ({}) nor the previous one ({}) could be allocated once the "
          "previous one was freed (another process took the memory?): the model's device state is lost",
          FormatBytes(bytes), FormatBytes(old_bytes)));
    }
  }
  *arena = fresh;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpy(fresh, host.get(), static_cast<size_t>(kept), cudaMemcpyHostToDevice),
                           "putting the parameters back after re-planning");
  return fits;
}

}  // namespace

template <typename T>
CudaGPTModelImpl<T>::~CudaGPTModelImpl() {
  worker_.reset();
  if (comm_stream_) cudaStreamSynchronize(comm_stream_);
  if (ctx_.stream) cudaStreamSynchronize(ctx_.stream);
  for (cudaEvent_t e : bucket_events_) cudaEventDestroy(e);
  if (comm_done_) cudaEventDestroy(comm_done_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
  for (auto& m : marks_) cudaEventDestroy(m.second);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  for (cudaEvent_t e : inputs_copied_)
    if (e) cudaEventDestroy(e);
  if (arena_) cudaFree(arena_);
  if (adamw_table_) cudaFree(adamw_table_);
  if (ctx_.cudnn) DestroyCudnnHandle(&ctx_);
  if (ctx_.cublaslt) cublasLtDestroy(ctx_.cublaslt);
  if (ctx_.cublas) cublasDestroy(ctx_.cublas);
  if (ctx_.stream) cudaStreamDestroy(ctx_.stream);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Init(int device, bool deterministic, int64_t micro_batch_size, bool profile,
                                       const CudaModelOptions& options) {
  profile_ = profile;
  sync_ops_ = options.sync_ops;
  logits_budget_bytes_ = options.logits_budget_bytes;
  unfused_ = options.unfused;
  host_exchange_ = options.unfused.pipeline_host_exchange;
  sequence_parallel_ = options.sequence_parallel && tensor_size() > 1;
  if (sequence_parallel_ && config().seq_length % tensor_size() != 0)
    return UsageError(
        fmt::format("--sequence-parallel: --seq-length {} is not divisible by the tensor group's {} ranks",
                    config().seq_length, tensor_size()));
  PTK_RETURN_IF_ERROR(SetContext(options.context));
  // The attention variants the CUDA attention lacks (CreateModel and ptk-train refuse them first).
  if (kFlash && config().softmax_sink())
    return absl::UnimplementedError(fmt::format(
        "softmax_type {} in bf16/fp16 on CUDA: cuDNN's fused attention runs without the softmax offset in ptk",
        config().softmax_type));
  if (cp() && (config().window_left >= 0 || config().softmax_sink()))
    return absl::UnimplementedError(
        "window_left / softmax_type with context parallelism on CUDA: its attention has neither");
  if (config().mla() && (tensor_size() > 1 || cp() || layout().pipeline_size > 1))
    return absl::UnimplementedError(
        "multi_latent_attention on CUDA: one tensor, context and pipeline rank only (cuda_mla_layer.cpp)");
  if (logits_budget_bytes_ < 0)
    return absl::InvalidArgumentError(fmt::format("logits budget of {} bytes", logits_budget_bytes_));
  // The caller's device index is the local rank (tools/train_main.cpp): refused where it has no GPU.
  PTK_RETURN_IF_ERROR(
      LocalRankDevice("--device cuda", device, VisibleDeviceCount(), std::getenv("CUDA_VISIBLE_DEVICES")).status());
  PTK_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), fmt::format("selecting CUDA device {}", device));
  cudaDeviceProp prop{};
  PTK_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), fmt::format("properties of device {}", device));
  ctx_.device = device;
  ctx_.sm_major = prop.major;
  ctx_.sm_minor = prop.minor;
  ctx_.num_sms = prop.multiProcessorCount;
  ctx_.deterministic = deterministic;
  ctx_.disallow_reduced_precision_reduction =
      options.disable_bf16_reduced_precision_matmul && std::is_same_v<T, __nv_bfloat16>;
  device_name_ = prop.name;
  LogVersionsOnce(device);
  if (kFlash && prop.major < 8)
    return absl::FailedPreconditionError(
        fmt::format("--{}: cuda:{} ({}) is sm_{}{}; bf16/fp16 training (cuDNN's fused attention) needs sm_80 or newer "
                    "(A100, H100); train in fp32 (no precision flag) on this GPU",
                    PrecisionName(PrecisionOf<T>()), device, prop.name, prop.major, prop.minor));
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking), "creating the stream");
  PTK_CUBLAS_RETURN_IF_ERROR(cublasCreate(&ctx_.cublas), "creating the cuBLAS handle");
  PTK_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx_.cublas, ctx_.stream), "cuBLAS stream");
  // fp32 mode is IEEE fp32: no TF32 (it is the mode compared tightly with the CPU). bf16/fp16 keep
  // cuBLAS's default math mode, which lets their products (cublasGemmEx, the strided-batched
  // fallbacks) use the tensor cores.
  if constexpr (!kFlash)
    PTK_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(ctx_.cublas, CUBLAS_PEDANTIC_MATH), "cuBLAS math mode");
  // torch's own switch for allow_bf16_reduced_precision_reduction = False, for the cublasGemmEx
  // fallbacks; the cuBLASLt products restrict their reduction schemes (matmul_cuda.cu).
  if (ctx_.disallow_reduced_precision_reduction)
    PTK_CUBLAS_RETURN_IF_ERROR(
        cublasSetMathMode(ctx_.cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                                 CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "cuBLAS math mode");
  ctx_.fallbacks = &fallbacks_;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&ctx_.cublaslt), "creating the cuBLASLt handle");
  if (kFlash) PTK_RETURN_IF_ERROR(CreateCudnnHandle(&ctx_));
  return Plan(micro_batch_size, config().seq_length / ContextSize());  // a context rank's positions of a sample
}

template <typename T>
std::string CudaGPTModelImpl<T>::Describe() const {
  return fmt::format("cuda:{} ({}, sm_{}{}) {}{}{}{}", ctx_.device, device_name_, ctx_.sm_major, ctx_.sm_minor,
                     PrecisionName(PrecisionOf<T>()), ctx_.deterministic ? ", deterministic" : "",
                     tensor_size() > 1 ? fmt::format(", tensor rank {} of {}{}", tensor_rank(), tensor_size(),
                                                     sequence_parallel_ ? ", sequence parallel" : "")
                                       : "",
                     cp() ? fmt::format(", context rank {} of {}", context_comm_->rank(), context_comm_->size()) : "");
}

template <typename T>
absl::StatusOr<PlanOptions> CudaGPTModelImpl<T>::PlanOptionsFor(int64_t b, int64_t t) {
  PlanOptions o{.precision = PrecisionOf<T>(), .micro_batch_size = b, .seq_length = t};
  o.tensor = tensor_size();
  o.layers = StageLayers();
  if (layout().pipeline_size > 1) {  // the micro-batches in flight on this stage (1F1B): P - s
    o.pipeline_slots = std::max<int64_t>(layout().pipeline_size - layout().pipeline_rank, reserved_slots_);
    o.pipeline_chunks = layout().virtual_size;  // the interleaved schedule: a slot holds one chunk's layers
    o.pipeline_last = layout().post_process;
    o.pipeline_host_exchange = host_exchange_;
  }
  o.sequence_parallel = sequence_parallel_;
  o.context = ContextSize();
  o.context_flash = ContextFlash();
  // SumNonTensorParallelGrads' buffer: sequence parallelism's partial gradients, or the query and
  // key norms' (each tensor rank's heads' share).
  if (tensor_size() > 1)
    for (const GradRange& g : NonTensorParallelGradRanges(layout(), sequence_parallel_))
      o.non_tensor_parallel_grads += g.size();
  // This rank's query heads and groups.
  const AttentionShape shape = ShapeFor(b, t);  // (multi-latent attention's head widths and scale)
  if (config().qk_layernorm && !config().mla()) o.qk_norm_scratch_doubles = QKNormBackwardScratch(shape);
  // Context parallelism runs the fp32 rows attention but in ContextFlash (cuda_context_parallel.cpp).
  o.attention_scratch_floats =
      ContextFlash() ? 0
      : cp()   ? AttentionRowsBackwardScratch(AttentionShape{b, t * ContextSize(), shape.nh, shape.hd, shape.ng}, t)
      : kFlash ? 0
               : AttentionBackwardScratch(shape);
  o.reduce_doubles = SumSquaresPartials(num_params());
  o.padded_params = padded_params_;
  o.moment_params = moment_params_;
  // The norms' backward scratch: LayerNorm's partial sums in floats, RMSNorm's in doubles.
  // Multi-latent attention's latent norms run over q_lora_rank and kv_lora_rank channels.
  const int64_t widest = std::max<int64_t>(config().hidden_size, MlaWidestNorm(config()));
  o.layernorm_scratch_floats =
      Rms() ? 2 * RMSNormBackwardScratch(b * t, widest) : LayerNormBackwardScratch(b * t, widest);
  o.logits_budget_bytes = logits_budget_bytes_;  // 0: from the free memory (PlanMemoryWithin)
  if constexpr (kFlash) {
    if (ContextFlash()) {  // the pairs' cuDNN graphs' workspace (the largest of the forward and backward ones)
      const context_detail::FlashPairShape s{b, t, shape.nh, shape.ng, shape.hd, static_cast<int>(ContextSize())};
      PTK_ASSIGN_OR_RETURN(const int64_t pairs, ContextFlashWorkspaceBytes<T>(s, ctx_));
      o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, pairs);
      return o;
    }
    if (cp()) return o;  // no fused attention: context parallelism's rows attention is the fp32 one
    // cuDNN's fused attention asks for its own workspace (the backward's fp32 dQ accumulator, more
    // in deterministic mode): the plan makes room for the larger of it and the products'. Without
    // attention dropout (and in evaluation) attention runs over the whole micro-batch; with it,
    // training runs one sample per call (AttentionFwd).
    PTK_ASSIGN_OR_RETURN(const int64_t flash, FlashAttentionWorkspaceBytes<T>(shape, 0.0, ctx_));
    o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, flash);
    if (config().window_left >= 0) {  // the sliding window's graphs (cuDNN's diagonal band) may ask for more
      AttentionShape windowed = shape;
      windowed.window = config().window_left;
      PTK_ASSIGN_OR_RETURN(const int64_t band, FlashAttentionWorkspaceBytes<T>(windowed, 0.0, ctx_));
      o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, band);
    }
    if (config().attention_dropout > 0) {
      AttentionShape one = shape;
      one.b = 1;
      PTK_ASSIGN_OR_RETURN(const int64_t bytes, FlashAttentionWorkspaceBytes<T>(one, config().attention_dropout, ctx_));
      o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, bytes);
      if (config().window_left >= 0) {
        one.window = config().window_left;
        PTK_ASSIGN_OR_RETURN(const int64_t band,
                             FlashAttentionWorkspaceBytes<T>(one, config().attention_dropout, ctx_));
        o.workspace_bytes = std::max<int64_t>(o.workspace_bytes, band);
      }
    }
  }
  return o;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Plan(int64_t b, int64_t t) {
  PTK_ASSIGN_OR_RETURN(const PlanOptions o, PlanOptionsFor(b, t));
  size_t free_bytes = 0, total_bytes = 0;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes), "querying free device memory");
  // The LM head in one chunk when the device has room for all its logits (the old allocation,
  // about to be freed, counts as free).
  PTK_ASSIGN_OR_RETURN(MemoryPlan plan,
                       PlanMemoryWithin(config(), num_params(), o,
                                        static_cast<int64_t>(free_bytes) + (arena_ ? plan_.total_bytes : int64_t{0})));
  const int64_t kept = arena_ ? plan_[plan_.exp_avg_sq].offset + plan_[plan_.exp_avg_sq].bytes : 0;
  auto oom = [&](std::string_view why) {
    return absl::ResourceExhaustedError(fmt::format(
        "CUDA out of memory on cuda:{} ({}): the model needs {} for micro-batches of {}x{} ({}), {} free of {}: {}. "
        "Largest buffers: {}",
        ctx_.device, device_name_, FormatBytes(plan.total_bytes), b, t, PrecisionName(PrecisionOf<T>()),
        FormatBytes(static_cast<int64_t>(free_bytes)), FormatBytes(static_cast<int64_t>(total_bytes)), why,
        plan.Largest(4)));
  };
  if (plan.total_bytes > static_cast<int64_t>(free_bytes) + (arena_ ? plan_.total_bytes : 0))
    return oom("lower what the largest buffers name");
  // A re-plan's room counts the old allocation as free (PlanMemoryWithin above): MoveArena frees it
  // first where the new one does not fit beside it.
  PTK_ASSIGN_OR_RETURN(const bool moved,
                       MoveArena(&arena_, arena_ ? plan_.total_bytes : 0, plan.total_bytes, kept, ctx_.stream));
  if (!moved) {
    if (arena_) ctx_.workspace = Buf<void>(plan_.workspace);  // the old plan, perhaps at another address
    return oom("cudaMalloc refused the allocation (fragmentation or another process)");
  }
  plan_ = std::move(plan);
  ctx_.workspace = Buf<void>(plan_.workspace);
  ctx_.workspace_bytes = static_cast<size_t>(plan_[plan_.workspace].bytes);
  if (kept == 0) {
    // A fresh model: zero everything persistent (moments start at zero; parameters are written).
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(arena_, 0, static_cast<size_t>(plan_[plan_.workspace].offset), ctx_.stream),
        "zeroing the model's memory");
  }
  for (int i = 0; i < 2; ++i) {
    PTK_RETURN_IF_ERROR(pinned_[i].Reserve(
        static_cast<size_t>(InputBytes(plan_.n) + StreamTableSize(config().num_layers, plan_.b) * 8)));
    if (!inputs_copied_[i])
      PTK_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&inputs_copied_[i], cudaEventDisableTiming),
                               "creating an input-copy event");
  }
  PTK_RETURN_IF_ERROR(losses_.Reserve(static_cast<size_t>(plan_.n) * sizeof(float)));
  PTK_RETURN_IF_ERROR(embedding_plan_.Reserve(plan_.n));
  if (cp()) PTK_RETURN_IF_ERROR(UploadContextTables());  // this rank's positions' tables (cuda_context_parallel.cpp)
  if (plan_.sink_zeros >= 0)                             // --softmax-type off-by-one: the offset's zeros
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(Buf<float>(plan_.sink_zeros), 0,
                                             static_cast<size_t>(plan_[plan_.sink_zeros].bytes), ctx_.stream),
                             "zeroing the softmax offset");
  if (config().mla()) PTK_RETURN_IF_ERROR(UploadMlaRope());  // cuda_mla_layer.cpp
  std::vector<float> rope;  // cos then sin, as the CPU model's tables (a longer t has the same first rows)
  if (config().rope() && !cp() && !config().mla()) {
    const int64_t half = config().rotary_dim() / 2;
    rope.assign(static_cast<size_t>(2 * plan_.t * half), 0.0f);
    RopeAngleTables(rope.data(), rope.data() + plan_.t * half, plan_.t, config().rotary_dim(),
                    config().rope_settings());
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(plan_.rope_tables), rope.data(), rope.size() * sizeof(float),
                                             cudaMemcpyHostToDevice, ctx_.stream),
                             "copying the rotary embedding tables to the device");
  }
  return Sync("planning device memory");
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Prepare(const ModelBatch& batch, double loss_scale, bool dropout) {
  PTK_RETURN_IF_ERROR(ValidateBatch(config(), batch));
  if (cp() && batch.t != plan_.t)  // the positions' tables are the planned length's
    return absl::InvalidArgumentError(
        fmt::format("context parallelism: a micro-batch of {} positions per sample, where each of the {} context ranks "
                    "holds {} (--seq-length / ranks)",
                    batch.t, ContextSize(), plan_.t));
  if (batch.b > plan_.b || batch.t > plan_.t)
    PTK_RETURN_IF_ERROR(Plan(std::max(batch.b, plan_.b), std::max(batch.t, plan_.t)));
  b_ = batch.b;
  t_ = batch.t;
  n_ = batch.b * batch.t;
  const size_t n = static_cast<size_t>(n_);
  const int64_t stride = AlignUp(static_cast<int64_t>(n) * 4);
  // This slot's previous copy to the device (two micro-batches ago) must have run before the
  // slot is refilled; the stream may still be busy with the previous pass.
  Pinned& pinned = pinned_[input_slot_];
  if (profile_) RecordMark(nullptr);  // the copies below are timed from here ("copies")
  PTK_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(inputs_copied_[input_slot_]), "waiting for an input slot");
  std::memcpy(pinned.at<int32_t>(0), batch.tokens, n * 4);
  std::memcpy(pinned.at<int32_t>(stride), batch.labels, n * 4);
  std::memcpy(pinned.at<int32_t>(2 * stride), batch.position_ids, n * 4);
  float* w = pinned.at<float>(3 * stride);
  for (size_t i = 0; i < n; ++i) w[i] = static_cast<float>(batch.loss_mask[i] * loss_scale);
  const int64_t in_bytes = InputBytes(n_);
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<char>(plan_.inputs), pinned.at<char>(0), static_cast<size_t>(in_bytes),
                                           cudaMemcpyHostToDevice, ctx_.stream),
                           fmt::format("copying a {}x{} micro-batch to the device", b_, t_));
  if (dropout) {
    // A pipeline stage's layers (every model chunk's) are keyed by their index in the whole model,
    // the embedding (the table's last layer) by the model's layer count, as on one stage.
    const int64_t L = StageLayers();
    uint64_t* table = pinned.at<uint64_t>(static_cast<size_t>(in_bytes));
    // Head h's attention mask is stream streams[b] + h: a tensor rank whose first head is head0
    // starts there, so that every head keeps its mask at any tensor size (as the CPU model).
    const uint64_t head0 = static_cast<uint64_t>(tensor_rank() * (config().num_attention_heads / tensor_size()));
    for (int64_t l = 0; l <= L; ++l)
      for (int64_t site = 0; site < 4; ++site)
        for (int64_t r = 0; r < b_; ++r)
          table[StreamIndex(l, site, b_) + r] =
              DropoutStream(static_cast<uint64_t>(batch.sample_keys[r]),
                            static_cast<uint64_t>(l == L ? config().num_layers : GlobalLayer(l)),
                            static_cast<uint64_t>(site)) +
              (site == kAttentionProbs ? head0 : 0);
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(Buf<uint64_t>(plan_.streams), table, static_cast<size_t>(StreamTableSize(L, b_)) * 8,
                        cudaMemcpyHostToDevice, ctx_.stream),
        "copying the dropout streams to the device");
    // cuDNN's attention dropout (bf16/fp16) takes one seed per call, and its mask depends on a
    // sample's place in the call's batch: with dropout, attention runs one sample per call, seeded
    // with the sample's key for the layer, so that the mask depends on (seed, sample, layer)
    // alone (not on the micro-batch size or the data-parallel layout), and backward sees it again.
    flash_keys_.assign(static_cast<size_t>(L * b_), 0);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t r = 0; r < b_; ++r)
        flash_keys_[static_cast<size_t>(l * b_ + r)] = table[StreamIndex(l, kAttentionProbs, b_) + r];
  }
  PTK_RETURN_IF_ERROR(Op("copies", "input copy", absl::OkStatus()));
  PTK_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_copied_[input_slot_], ctx_.stream), "marking an input slot");
  input_slot_ ^= 1;
  tokens_host_ = batch.tokens;
  positions_host_ = batch.position_ids;
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                  \
  template absl::Status CudaGPTModelImpl<T>::Init(int device, bool deterministic, int64_t micro_batch_size, \
                                                  bool profile, const CudaModelOptions& options);           \
  template std::string CudaGPTModelImpl<T>::Describe() const;                                               \
  template absl::StatusOr<PlanOptions> CudaGPTModelImpl<T>::PlanOptionsFor(int64_t b, int64_t t);           \
  template absl::Status CudaGPTModelImpl<T>::Plan(int64_t b, int64_t t);                                    \
  template absl::Status CudaGPTModelImpl<T>::Prepare(const ModelBatch& batch, double loss_scale, bool dropout);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

namespace {

template <typename T>
absl::StatusOr<std::unique_ptr<GPTModel>> Make(const GPTConfig& config, int device, bool deterministic,
                                               int64_t micro_batch_size, bool profile,
                                               const CudaModelOptions& options) {
  Communicator* tensor = options.tensor;
  const int size = tensor ? tensor->size() : 1, rank = tensor ? tensor->rank() : 0;
  if (size > 1 && !tensor->device_collectives())
    return absl::InvalidArgumentError(
        fmt::format("tensor parallelism on CUDA needs NCCL for the tensor group, not {}", tensor->backend()));
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(config, size, rank, options.pipeline));
  auto m = std::make_unique<CudaGPTModelImpl<T>>(std::move(layout));
  if (size > 1) m->SetTensorComm(tensor);
  PTK_RETURN_IF_ERROR(m->Init(device, deterministic, micro_batch_size, profile, options));
  return std::unique_ptr<GPTModel>(std::move(m));
}

}  // namespace
}  // namespace model_detail

absl::StatusOr<std::unique_ptr<GPTModel>> CreateCudaGPTModel(const GPTConfig& config, Precision precision,
                                                             int device_index, bool deterministic,
                                                             int64_t micro_batch_size, bool profile,
                                                             const CudaModelOptions& options) {
  switch (precision) {
    case Precision::kBf16:
      return model_detail::Make<__nv_bfloat16>(config, device_index, deterministic, micro_batch_size, profile, options);
    case Precision::kFp16:
      return model_detail::Make<__half>(config, device_index, deterministic, micro_batch_size, profile, options);
    case Precision::kFp32: break;
  }
  return model_detail::Make<float>(config, device_index, deterministic, micro_batch_size, profile, options);
}

}  // namespace ptk::cuda
