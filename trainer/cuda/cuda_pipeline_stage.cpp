// The CUDA model as one pipeline stage (the CPU's trainer/cpu/pipeline_stage_cpu.cpp on the GPU): a
// micro-batch's pass over this stage's layers, from the previous stage's output to the next stage's
// input. Each micro-batch in flight keeps its activations on the device in a slot of its own (the
// memory plan's pipeline_slots: P - s of them on stage s); the inputs and dropout streams are
// copied again for the backward. The activations and their gradients cross the stage boundary
// directly (StageBuffers): the schedule receives the previous stage's output into the slot's
// residual stream (its first layer's input), sends the slot's last layer's output from there, and
// receives and sends the gradients in the residual gradient buffer, in the model's dtype (bf16
// goes as bf16), with NCCL on the compute stream: no host copy, no synchronisation per exchange,
// and the last stage's losses kept for the schedule's end (KeepLosses). The host exchange is kept as the oracle
// and for host communicators (gloo): fp32 host spans (exact for bf16 and fp16 values), cast
// through pipeline_exchange, the stream synchronised at each exchange
// (CudaModelOptions::unfused.pipeline_host_exchange).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::model_detail {
namespace {
absl::Status CheckActivation(std::string_view what, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("{}: {} floats where this stage exchanges {}", what, got, want));
}
}  // namespace

template <typename T>
absl::Status CudaGPTModelImpl<T>::SelectSlot(int slot, std::string_view what) {
  if (layout().pipeline_size <= 1)
    return absl::FailedPreconditionError(fmt::format("{}: the model is not a pipeline stage", what));
  if (slot < 0 || slot >= plan_.slots || slot >= kMaxSlots)  // slots_live_ has a bit per slot
    return absl::InvalidArgumentError(
        fmt::format("{}: activation slot {} outside the {} this stage keeps (stage {} of {})", what, slot, plan_.slots,
                    layout().pipeline_rank, layout().pipeline_size));
  slot_ = slot;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ReserveStageSlots(int slots) {
  if (layout().pipeline_size <= 1)
    return absl::FailedPreconditionError("ReserveStageSlots: the model is not a pipeline stage");
  if (slots > kMaxSlots)
    return absl::InvalidArgumentError(
        fmt::format("the interleaved pipeline schedule takes {} activation slots on stage {} of {}; the CUDA model "
                    "keeps at most {}: fewer model chunks or micro-batches per step, or a smaller "
                    "--microbatch-group-size-per-virtual-pipeline-stage",
                    slots, layout().pipeline_rank, layout().pipeline_size, kMaxSlots));
  if (slots <= plan_.slots) return absl::OkStatus();
  if (slots_live_ != 0)
    return absl::FailedPreconditionError(
        fmt::format("ReserveStageSlots: {} slots asked for while micro-batches' activations are in flight", slots));
  reserved_slots_ = slots;
  slots_received_ = 0;            // told before the schedule takes any slot: nothing received is pending
  return Plan(plan_.b, plan_.t);  // the parameters move along; no activation is alive
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ExchangeIn(T* dst, std::span<const float> host, std::string_view what) {
  const int64_t count = static_cast<int64_t>(host.size());
  if (count > plan_.n * config().hidden_size)
    return absl::InvalidArgumentError(fmt::format("{}: {} floats exceed the planned exchange buffer", what, count));
  if (!std::is_same_v<T, float> && plan_[plan_.pipeline_exchange].bytes < count * 4)
    return absl::FailedPreconditionError(fmt::format("{}: no host exchange was planned", what));
  float* staged = std::is_same_v<T, float> ? reinterpret_cast<float*>(dst) : Buf<float>(plan_.pipeline_exchange);
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staged, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, ctx_.stream),
      fmt::format("{}: copying {} floats to the device", what, count));
  PTK_RETURN_IF_ERROR(Op("copies", "stage input copy", absl::OkStatus()));
  if constexpr (!std::is_same_v<T, float>)
    PTK_RETURN_IF_ERROR(Op("copies", "stage input cast", CastFromFloat<T>(dst, staged, count, ctx_)));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ExchangeOut(std::span<float> host, const T* src, std::string_view what) {
  const int64_t count = static_cast<int64_t>(host.size());
  if (count > plan_.n * config().hidden_size)
    return absl::InvalidArgumentError(fmt::format("{}: {} floats exceed the planned exchange buffer", what, count));
  const float* staged = reinterpret_cast<const float*>(src);
  if constexpr (!std::is_same_v<T, float>) {
    if (plan_[plan_.pipeline_exchange].bytes < count * 4)
      return absl::FailedPreconditionError(fmt::format("{}: no host exchange was planned", what));
    float* x = Buf<float>(plan_.pipeline_exchange);
    PTK_RETURN_IF_ERROR(Op("copies", "stage output cast", CastToFloat<T>(x, src, count, ctx_)));
    staged = x;
  }
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), staged, host.size() * sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream),
      fmt::format("{}: copying {} floats to the host", what, count));
  PTK_RETURN_IF_ERROR(Op("copies", "stage output copy", absl::OkStatus()));
  return Sync(what);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::PlanStage(const ModelBatch& batch, int slot, std::string_view what) {
  if (batch.b < 1 || batch.t < 1)
    return absl::InvalidArgumentError(fmt::format("{}: a {}x{} micro-batch", what, batch.b, batch.t));
  absl::StatusOr<StageReplan> r =
      PlanStageReplan(plan_.b, plan_.t, batch.b, batch.t, slot, slots_live_, slots_received_);
  if (!r.ok()) return absl::Status(r.status().code(), fmt::format("{}: {}", what, std::string(r.status().message())));
  if (!r->replan) return absl::OkStatus();
  // A larger micro-batch re-plans the device memory, which keeps the parameters only: the inputs
  // received ahead of their forward passes go to the host and back (a re-plan is rare: the first
  // micro-batch of a larger shape).
  std::vector<std::vector<char>> kept;
  PTK_RETURN_IF_ERROR(CarryInputs(r->carried, &kept, /*back=*/false));
  PTK_RETURN_IF_ERROR(Plan(r->b, r->t));
  return CarryInputs(r->carried, &kept, /*back=*/true);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::CarryInputs(const std::vector<int>& slots, std::vector<std::vector<char>>* kept,
                                              bool back) {
  if (slots.empty()) return absl::OkStatus();
  const int selected = slot_;
  kept->resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    slot_ = slots[i];  // Buf: the slot's residual stream, its first layer (the stage's input)
    std::vector<char>& host = (*kept)[i];
    const size_t bytes = static_cast<size_t>(slot_inputs_[static_cast<size_t>(slot_)]) * sizeof(T);
    if (!back) host.resize(bytes);
    const cudaError_t e =
        back ? cudaMemcpyAsync(Buf<T>(plan_.resid), host.data(), bytes, cudaMemcpyHostToDevice, ctx_.stream)
             : cudaMemcpyAsync(host.data(), Buf<T>(plan_.resid), bytes, cudaMemcpyDeviceToHost, ctx_.stream);
    if (e != cudaSuccess) {
      slot_ = selected;
      return CudaError(e, "cudaMemcpyAsync",
                       fmt::format("carrying slot {}'s received input ({} bytes) across a re-plan", slots[i], bytes));
    }
  }
  slot_ = selected;
  // The stream orders the copies after the receives enqueued on it; the host copies are read or
  // freed only after this wait.
  return Sync("carrying received inputs across a re-plan");
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::UseHostExchange(std::string_view what) {
  if (host_exchange_) return absl::OkStatus();
  if (slots_live_ != 0)
    return absl::FailedPreconditionError(fmt::format(
        "{}: the host exchange cannot start while micro-batches' activations are in flight (stage {} of {})", what,
        layout().pipeline_rank, layout().pipeline_size));
  host_exchange_ = true;
  slots_received_ = 0;                                  // the host exchange copies each input in at its forward pass
  if constexpr (kFlash) return Plan(plan_.b, plan_.t);  // pipeline_exchange, for the casts
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<StageExchange> CudaGPTModelImpl<T>::StageBuffers(const ModelBatch& batch, int slot, bool device_memory) {
  if (!device_memory) PTK_RETURN_IF_ERROR(UseHostExchange("StageBuffers (a host communicator)"));
  if (host_exchange_) return GPTModel::StageBuffers(batch, slot, device_memory);
  PTK_RETURN_IF_ERROR(SelectSlot(slot, "StageBuffers"));
  PTK_RETURN_IF_ERROR(PlanStage(batch, slot, "StageBuffers"));
  const uint64_t bit = uint64_t{1} << slot;
  if (!chunk_pre_process() && (slots_live_ & bit) == 0) {
    // The schedule may receive the slot's input now (its forward pass is next for the slot): kept
    // across a re-plan another slot's larger micro-batch may cause before that forward.
    slots_received_ |= bit;
    slot_inputs_[static_cast<size_t>(slot)] = StageExchangeFloats(batch);
  }
  const int64_t c = config().hidden_size;
  StageExchange e;
  e.elements = StageExchangeFloats(batch);
  e.wire = PrecisionOf<T>();
  e.stream = static_cast<void*>(ctx_.stream);
  // The slot's residual stream (SelectSlot): the stage's (chunk's) input is its first layer's, its
  // output its last layer's, where StageForwardPass reads and writes them; the gradients in and out
  // of dresid. With model chunks the output gradient has a buffer per slot: the interleaved schedule
  // may receive several before their backwards, and receives one while dresid's goes out.
  const int64_t rows = StageExchangeFloats(batch) / c;
  if (!chunk_pre_process()) {
    e.input = Act(plan_.resid, chunk_layer_begin(), rows * c);
    e.input_grad = Buf<T>(plan_.dresid);
  }
  if (!chunk_post_process()) {
    e.output = Act(plan_.resid, chunk_layer_end(), rows * c);
    e.output_grad = layout().virtual_size > 1 ? OutputGrad(slot) : Buf<T>(plan_.dresid);
  }
  return e;
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForward(const ModelBatch& batch, int slot,
                                                          std::span<const float> input, std::span<float> output,
                                                          std::optional<double> loss_scale, bool train, uint64_t seed,
                                                          std::vector<float>* logits) {
  PTK_RETURN_IF_ERROR(SelectSlot(slot, "StageForward"));
  PTK_RETURN_IF_ERROR(UseHostExchange("StageForward"));
  return StageForwardPass(batch, slot, input, output, /*direct=*/false, loss_scale, train, seed, logits,
                          /*defer_loss=*/false);
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForwardExchanged(const ModelBatch& batch, int slot,
                                                                   std::optional<double> loss_scale, bool train,
                                                                   uint64_t seed, std::vector<float>* logits,
                                                                   bool defer_loss) {
  if (host_exchange_) return GPTModel::StageForwardExchanged(batch, slot, loss_scale, train, seed, logits, defer_loss);
  return StageForwardPass(batch, slot, {}, {}, /*direct=*/true, loss_scale, train, seed, logits, defer_loss);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::StageBackward(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                                                std::span<float> input_grad, bool train, uint64_t seed) {
  PTK_RETURN_IF_ERROR(SelectSlot(slot, "StageBackward"));
  PTK_RETURN_IF_ERROR(UseHostExchange("StageBackward"));
  return StageBackwardPass(batch, slot, output_grad, input_grad, /*direct=*/false, train, seed);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::StageBackwardExchanged(const ModelBatch& batch, int slot, bool train, uint64_t seed) {
  if (host_exchange_) return GPTModel::StageBackwardExchanged(batch, slot, train, seed);
  return StageBackwardPass(batch, slot, {}, {}, /*direct=*/true, train, seed);
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForwardPass(const ModelBatch& batch, int slot,
                                                              std::span<const float> input, std::span<float> output,
                                                              bool direct, std::optional<double> loss_scale, bool train,
                                                              uint64_t seed, std::vector<float>* logits,
                                                              bool defer_loss) {
  PTK_RETURN_IF_ERROR(SelectSlot(slot, "StageForward"));
  const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  const uint64_t bit = uint64_t{1} << slot;
  PTK_RETURN_IF_ERROR(PlanStage(batch, slot, "StageForward"));
  const int64_t nc = StageExchangeFloats(batch);
  if (!direct) {
    PTK_RETURN_IF_ERROR(CheckActivation("StageForward input", input.size(), chunk_pre_process() ? 0 : nc));
    PTK_RETURN_IF_ERROR(CheckActivation("StageForward output", output.size(), chunk_post_process() ? 0 : nc));
  }
  PTK_RETURN_IF_ERROR(Prepare(batch, loss_scale.value_or(0.0), dropout));
  Begin();
  const int64_t c = config().hidden_size;
  slots_live_ &= ~bit;  // a forward pass over the slot overwrites what it held
  slots_received_ &= ~bit;
  if (!chunk_pre_process() && !direct)
    PTK_RETURN_IF_ERROR(ExchangeIn(Act(plan_.resid, chunk_layer_begin(), nc), input, "StageForward input"));
  PTK_RETURN_IF_ERROR(RunForward(train, seed));
  if (loss_scale) {
    slots_live_ |= bit;
    if (slot_shapes_.size() < static_cast<size_t>(plan_.slots)) slot_shapes_.resize(static_cast<size_t>(plan_.slots));
    slot_shapes_[static_cast<size_t>(slot)] = {batch.b, batch.t};
  }
  if (!chunk_post_process()) {
    // Direct: the output stays in the slot's residual stream, where the schedule sends it from.
    if (!direct)
      PTK_RETURN_IF_ERROR(ExchangeOut(output, Act(plan_.resid, chunk_layer_end(), nc), "StageForward output"));
    return LossSum{};
  }
  // With a loss scale the LM head leaves the final norm's output gradient in dln: the slot keeps it
  // for its backward (another slot's forward may run first).
  PTK_RETURN_IF_ERROR(RunHead(/*backward=*/loss_scale.has_value(), logits));
  if (loss_scale) {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(HeadGrad(slot), Buf<T>(plan_.dln), static_cast<size_t>(n_ * c) * sizeof(T),
                                             cudaMemcpyDeviceToDevice, ctx_.stream),
                             "keeping the LM head's gradient for the slot's backward");
    PTK_RETURN_IF_ERROR(Op("copies", "head gradient copy", absl::OkStatus()));
  }
  if (!defer_loss) return Losses(batch);
  PTK_RETURN_IF_ERROR(KeepLosses(batch));  // no wait: the schedule reads them once it ends
  return LossSum{};
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::StageBackwardPass(const ModelBatch& batch, int slot,
                                                    std::span<const float> output_grad, std::span<float> input_grad,
                                                    bool direct, bool train, uint64_t seed) {
  PTK_RETURN_IF_ERROR(SelectSlot(slot, "StageBackward"));
  const uint64_t bit = uint64_t{1} << slot;
  if ((slots_live_ & bit) == 0)
    return absl::InvalidArgumentError(fmt::format("StageBackward: slot {} holds no forward pass", slot));
  if (slot_shapes_[static_cast<size_t>(slot)] != std::pair<int64_t, int64_t>{batch.b, batch.t})
    return absl::InvalidArgumentError("StageBackward: the batch is not the shape of the slot's forward pass");
  const int64_t nc = StageExchangeFloats(batch);
  if (!direct) {
    PTK_RETURN_IF_ERROR(
        CheckActivation("StageBackward output gradient", output_grad.size(), chunk_post_process() ? 0 : nc));
    PTK_RETURN_IF_ERROR(
        CheckActivation("StageBackward input gradient", input_grad.size(), chunk_pre_process() ? 0 : nc));
  }
  const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  // The inputs and the dropout streams again (the slot's activations stay where its forward left them).
  PTK_RETURN_IF_ERROR(Prepare(batch, 0.0, dropout));
  Begin();
  const int64_t c = config().hidden_size;
  slots_live_ &= ~bit;
  if (!chunk_post_process()) {
    // Direct: the next stage's gradient was received into dresid itself, or with model chunks into
    // the slot's own buffer.
    if (!direct) PTK_RETURN_IF_ERROR(ExchangeIn(Buf<T>(plan_.dresid), output_grad, "StageBackward output gradient"));
    if (direct && layout().virtual_size > 1) {
      PTK_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(Buf<T>(plan_.dresid), OutputGrad(slot), static_cast<size_t>(nc) * sizeof(T),
                          cudaMemcpyDeviceToDevice, ctx_.stream),
          "taking the slot's output gradient");
      PTK_RETURN_IF_ERROR(Op("copies", "output gradient copy", absl::OkStatus()));
    }
  } else {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<T>(plan_.dln), HeadGrad(slot), static_cast<size_t>(n_ * c) * sizeof(T),
                                             cudaMemcpyDeviceToDevice, ctx_.stream),
                             "restoring the slot's LM head gradient");
    PTK_RETURN_IF_ERROR(Op("copies", "head gradient copy", absl::OkStatus()));
  }
  PTK_RETURN_IF_ERROR(RunBackward(train, seed));
  // Direct: the input's gradient stays in dresid, where the schedule sends it from.
  if (!chunk_pre_process() && !direct)
    PTK_RETURN_IF_ERROR(ExchangeOut(input_grad, Buf<T>(plan_.dresid), "StageBackward input gradient"));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n) {
  if (begin < 0 || n < 0 || begin + n > num_params())
    return absl::InvalidArgumentError(
        fmt::format("AllReduceGradRange: [{}, {}) of {} parameters", begin, begin + n, num_params()));
  if (n == 0) return absl::OkStatus();
  // NCCL: on the compute stream, in place, and no host wait: whatever reads these gradients next is
  // ordered after it by the stream (the gradient norm and AdamW run on it; a host read, DownloadRange,
  // synchronises it first; the buckets' stream of --overlap-grad-reduce waits on events recorded on
  // it after the next backward), the next step's zeroing of the gradients too, and the NCCL
  // watchdog times the collective from its event, as it does the all-gather before it.
  if (comm->device_collectives())
    return Op("all-reduce", "embedding group all-reduce",
              comm->AllReduceSumDevice(Grad(begin), n, static_cast<void*>(ctx_.stream)));
  // A host communicator (gloo): through the host (DownloadRange and UploadRange synchronise).
  std::vector<float> host(static_cast<size_t>(n));
  PTK_RETURN_IF_ERROR(DownloadRange(plan_.grads, host.data(), begin, n));
  PTK_RETURN_IF_ERROR(comm->AllReduceSum(host.data(), n));
  return UploadRange(plan_.grads, host.data(), begin, n);
}

// The ranges gathered into the planned ntp_grads buffer on the compute stream (a device copy each),
// one all-reduce of it, scattered back: NCCL in device memory on the compute stream, unstaged; a
// host communicator (gloo) through the host, the gathered buffer down and up once.
template <typename T>
absl::Status CudaGPTModelImpl<T>::AllReduceGradRanges(Communicator* comm, std::span<const GradRange> ranges) {
  PTK_ASSIGN_OR_RETURN(const int64_t total, CheckGradRanges(ranges, num_params()));
  if (total == 0) return absl::OkStatus();
  const int64_t room = plan_.ntp_grads < 0 ? 0 : plan_[plan_.ntp_grads].bytes / static_cast<int64_t>(sizeof(float));
  if (total > room)
    return absl::FailedPreconditionError(
        fmt::format("AllReduceGradRanges: {} gradients to sum, the planned buffer (NonTensorParallelGradRanges', "
                    "after a pass) holds {}",
                    total, room));
  float* buf = Buf<float>(plan_.ntp_grads);
  auto copy = [&](bool gather) -> absl::Status {
    int64_t at = 0;
    for (const GradRange& g : ranges) {
      if (g.size() > 0) {
        float* grad = Grad(g.begin);
        PTK_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(gather ? buf + at : grad, gather ? grad : buf + at,
                            static_cast<size_t>(g.size()) * sizeof(float), cudaMemcpyDeviceToDevice, ctx_.stream),
            fmt::format("{} the gradients [{}, {}) of the coalesced all-reduce", gather ? "gathering" : "scattering",
                        g.begin, g.end));
      }
      at += g.size();
    }
    return absl::OkStatus();
  };
  PTK_RETURN_IF_ERROR(Op("copies", "coalesced gradients gather", copy(true)));
  if (comm->device_collectives()) {  // NCCL: on the compute stream, in place
    PTK_RETURN_IF_ERROR(Op("all-reduce", "coalesced gradients all-reduce",
                           comm->AllReduceSumDevice(buf, total, static_cast<void*>(ctx_.stream))));
  } else {  // a host communicator (gloo): through the host
    if (static_cast<int64_t>(host_grads_.size()) < total) host_grads_.resize(static_cast<size_t>(total));
    PTK_RETURN_IF_ERROR(DownloadRange(plan_.ntp_grads, host_grads_.data(), 0, total));
    PTK_RETURN_IF_ERROR(comm->AllReduceSum(host_grads_.data(), total));
    PTK_RETURN_IF_ERROR(UploadRange(plan_.ntp_grads, host_grads_.data(), 0, total));
  }
  return Op("copies", "coalesced gradients scatter", copy(false));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n) {
  if (!shard()) return absl::FailedPreconditionError("AllGatherGradRange needs a sharded optimizer state");
  if (begin < 0 || n < 0 || begin + n > num_params())
    return absl::InvalidArgumentError(
        fmt::format("AllGatherGradRange: [{}, {}) of {} parameters", begin, begin + n, num_params()));
  if (n == 0 || (comm->size() == 1 && !comm->device_collectives())) return absl::OkStatus();
  // The ranks' ranges ascend: their pieces of [begin, begin + n) lie in rank order.
  std::vector<int64_t> bytes = shard()->CountsIn(begin, begin + n);
  for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
  if (comm->device_collectives()) {  // NCCL: on the compute stream, in place
    PTK_RETURN_IF_ERROR(Op("all-gather", "tied embedding gradient all-gather",
                           comm->AllGatherDevice(Grad(begin), bytes, static_cast<void*>(ctx_.stream))));
    return absl::OkStatus();
  }
  std::vector<float> host(static_cast<size_t>(n));  // a host communicator (gloo): through the host
  PTK_RETURN_IF_ERROR(DownloadRange(plan_.grads, host.data(), begin, n));
  PTK_RETURN_IF_ERROR(comm->AllGather(host.data(), bytes));
  return UploadRange(plan_.grads, host.data(), begin, n);
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status CudaGPTModelImpl<T>::SelectSlot(int slot, std::string_view what);                              \
  template absl::Status CudaGPTModelImpl<T>::ReserveStageSlots(int slots);                                             \
  template absl::Status CudaGPTModelImpl<T>::ExchangeIn(T* dst, std::span<const float> host, std::string_view what);   \
  template absl::Status CudaGPTModelImpl<T>::ExchangeOut(std::span<float> host, const T* src, std::string_view what);  \
  template absl::Status CudaGPTModelImpl<T>::PlanStage(const ModelBatch& batch, int slot, std::string_view what);      \
  template absl::Status CudaGPTModelImpl<T>::CarryInputs(const std::vector<int>& slots,                                \
                                                         std::vector<std::vector<char>>* kept, bool back);             \
  template absl::Status CudaGPTModelImpl<T>::UseHostExchange(std::string_view what);                                   \
  template absl::StatusOr<StageExchange> CudaGPTModelImpl<T>::StageBuffers(const ModelBatch& batch, int slot,          \
                                                                           bool device_memory);                        \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForwardExchanged(                                         \
      const ModelBatch& batch, int slot, std::optional<double> loss_scale, bool train, uint64_t seed,                  \
      std::vector<float>* logits, bool defer_loss);                                                                    \
  template absl::Status CudaGPTModelImpl<T>::StageBackwardExchanged(const ModelBatch& batch, int slot, bool train,     \
                                                                    uint64_t seed);                                    \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForwardPass(                                              \
      const ModelBatch& batch, int slot, std::span<const float> input, std::span<float> output, bool direct,           \
      std::optional<double> loss_scale, bool train, uint64_t seed, std::vector<float>* logits, bool defer_loss);       \
  template absl::Status CudaGPTModelImpl<T>::StageBackwardPass(                                                        \
      const ModelBatch& batch, int slot, std::span<const float> output_grad, std::span<float> input_grad, bool direct, \
      bool train, uint64_t seed);                                                                                      \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::StageForward(                                                  \
      const ModelBatch& batch, int slot, std::span<const float> input, std::span<float> output,                        \
      std::optional<double> loss_scale, bool train, uint64_t seed, std::vector<float>* logits);                        \
  template absl::Status CudaGPTModelImpl<T>::StageBackward(const ModelBatch& batch, int slot,                          \
                                                           std::span<const float> output_grad,                         \
                                                           std::span<float> input_grad, bool train, uint64_t seed);    \
  template absl::Status CudaGPTModelImpl<T>::AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n);         \
  template absl::Status CudaGPTModelImpl<T>::AllReduceGradRanges(Communicator* comm,                                   \
                                                                 std::span<const GradRange> ranges);                   \
  template absl::Status CudaGPTModelImpl<T>::AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
