// Megatron's non-interleaved 1F1B schedule and the forward-only pass over a pipeline's stages.
#include "trainer/pipeline_schedule.h"

#include <algorithm>
#include <string>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {
namespace {

// One stage's messages: Megatron's p2p_communication helpers over the pipeline group, on the
// buffers of the model's exchange (`format`: their size, and the stream of device memory), each timed
// (level 2) under its Megatron name where it exchanges anything.
class StageLinks {
 public:
  StageLinks(Communicator* pipe, const StageExchange& format, Timers* timers = nullptr)
      : pipe_(pipe),
        bytes_(format.bytes()),
        stream_(format.stream),
        stage_(pipe->rank()),
        last_(pipe->size() - 1),
        timers_(timers) {}
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == last_; }
  absl::Status RecvForward(void* x) { return first() ? Ok() : Call("forward-recv", nullptr, -1, x, stage_ - 1); }
  absl::Status SendForward(const void* y) { return last() ? Ok() : Call("forward-send", y, stage_ + 1, nullptr, -1); }
  absl::Status SendForwardRecvBackward(const void* y, void* dy) {
    return last() ? Ok() : Call("forward-send-backward-recv", y, stage_ + 1, dy, stage_ + 1);
  }
  absl::Status SendBackwardRecvForward(const void* dx, void* x) {
    return first() ? Ok() : Call("backward-send-forward-recv", dx, stage_ - 1, x, stage_ - 1);
  }
  absl::Status RecvBackward(void* dy) { return last() ? Ok() : Call("backward-recv", nullptr, -1, dy, stage_ + 1); }
  absl::Status SendBackward(const void* dx) {
    return first() ? Ok() : Call("backward-send", dx, stage_ - 1, nullptr, -1);
  }

 private:
  static absl::Status Ok() { return absl::OkStatus(); }
  // A timer's stop synchronises the device (Timers), so a device exchange queued on the stream is
  // timed to its end.
  absl::Status Call(const char* timer, const void* send, int dst, void* recv, int src) {
    const int64_t out = send ? bytes_ : 0, in = recv ? bytes_ : 0;
    PTK_RETURN_IF_ERROR(StartTimer(timers_, timer, 2));
    PTK_RETURN_IF_ERROR(stream_ ? pipe_->SendRecvDevice(send, out, dst, recv, in, src, stream_)
                                : pipe_->SendRecv(send, out, dst, recv, in, src));
    return StopTimer(timers_, timer);
  }
  Communicator* pipe_;
  int64_t bytes_;
  void* stream_;
  int stage_, last_;
  Timers* timers_;
};

// What a stage tells its neighbours of its exchange (CheckStageExchangeAgreement).
struct WireFormat {
  int64_t magic = 0, wire = 0, elements = 0, device = 0;
};
constexpr int64_t kWireMagic = 0x657069702d6b7470;  // "ptk-pipe"

std::string DescribeWire(const WireFormat& w) {
  const std::string type = w.wire >= 0 && w.wire <= static_cast<int64_t>(Precision::kFp16)
                               ? std::string(PrecisionName(static_cast<Precision>(w.wire)))
                               : fmt::format("wire type {}", w.wire);
  return fmt::format("{} activations of {} elements ({} memory)", type, w.elements, w.device ? "device" : "host");
}

// The buffers of micro-batch k (slot k % slots), of the first micro-batch's exchange.
absl::StatusOr<StageExchange> BuffersOf(GPTModel* model, const ModelBatch& mb, int slot, bool device,
                                        const StageExchange& format) {
  PTK_ASSIGN_OR_RETURN(StageExchange e, model->StageBuffers(mb, slot, device));
  if (e.elements != format.elements || e.wire != format.wire || e.stream != format.stream)
    return absl::InvalidArgumentError(
        fmt::format("pipeline schedule: micro-batches of different shapes ({}x{} exchanges {} elements, the first {})",
                    mb.b, mb.t, e.elements, format.elements));
  return e;
}

// Drops the losses a failed schedule left with the model (the step fails; the next must not see them).
struct LossesKept {
  GPTModel* model;
  ~LossesKept() {
    if (model) (void)model->TakeLosses();
  }
};

}  // namespace

absl::Status CheckStageExchangeAgreement(Communicator* pipeline, const StageExchange& mine) {
  const int s = pipeline->rank(), P = pipeline->size();
  const int prev = s > 0 ? s - 1 : -1, next = s + 1 < P ? s + 1 : -1;
  const WireFormat me{kWireMagic, static_cast<int64_t>(mine.wire), mine.elements, mine.stream ? 1 : 0};
  WireFormat from_prev, from_next;
  const int64_t size = sizeof(WireFormat);
  PTK_RETURN_IF_ERROR(pipeline->SendRecv(&me, size, next, &from_prev, size, prev));
  PTK_RETURN_IF_ERROR(pipeline->SendRecv(&me, size, prev, &from_next, size, next));
  for (const auto& [peer, theirs] : {std::pair{prev, from_prev}, std::pair{next, from_next}}) {
    if (peer < 0 || (theirs.magic == kWireMagic && theirs.wire == me.wire && theirs.elements == me.elements)) continue;
    return absl::FailedPreconditionError(fmt::format(
        "pipeline stages {} and {} disagree on the activations they exchange: stage {} sends and receives {}, stage "
        "{} {}; every stage must run the same precision (--bf16 / --fp16 or neither), --sequence-parallel setting and "
        "micro-batch shape",
        std::min(s, peer), std::max(s, peer), s, DescribeWire(me), peer,
        theirs.magic == kWireMagic ? DescribeWire(theirs) : "a message that is no exchange description"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LossSum> ForwardBackwardPipelining(GPTModel* model, Communicator* pipeline,
                                                  const std::vector<ModelBatch>& micro_batches,
                                                  std::span<const double> loss_scales, uint64_t seed,
                                                  PipelineStats* stats,
                                                  const std::function<absl::Status()>& before_last_backward,
                                                  Timers* timers, int microbatch_group_size) {
  const int P = pipeline->size(), s = pipeline->rank();
  const int m = static_cast<int>(micro_batches.size());
  if (loss_scales.size() != micro_batches.size())
    return absl::InvalidArgumentError("ForwardBackwardPipelining: one loss scale per micro-batch");
  if (P != model->layout().pipeline_size || s != model->layout().pipeline_rank)
    return absl::InvalidArgumentError(
        fmt::format("ForwardBackwardPipelining: rank {} of a pipeline group of {} runs stage {} of {}", s, P,
                    model->layout().pipeline_rank, model->layout().pipeline_size));
  if (model->layout().virtual_size > 1)
    return ForwardBackwardInterleaved(model, pipeline, micro_batches, loss_scales, seed, stats, timers,
                                      before_last_backward, microbatch_group_size);
  if (m == 0) return LossSum{};
  // Micro-batch k's activations live in slot k % slots: k's forward comes after the backward of
  // k - slots, the micro-batches in flight being at most warm-up + 1 = P - s.
  const int warmup = std::min(P - s - 1, m), remaining = m - warmup, slots = std::min(P - s, m);
  const bool device = pipeline->device_collectives();
  PTK_ASSIGN_OR_RETURN(const StageExchange format, model->StageBuffers(micro_batches[0], 0, device));
  PTK_RETURN_IF_ERROR(CheckStageExchangeAgreement(pipeline, format));
  StageLinks links(pipeline, format, timers);
  auto buffers = [&](int k) {
    return BuffersOf(model, micro_batches[static_cast<size_t>(k)], k % slots, device, format);
  };
  int in_flight = 0;
  // The last stage's losses are kept by the model until the schedule ends (TakeLosses: no wait for
  // them per micro-batch), added in micro-batch order; a schedule that fails drops them.
  LossesKept kept{model};
  auto forward = [&](int k) -> absl::Status {
    PTK_RETURN_IF_ERROR(StartTimer(timers, "forward-compute", 2));
    PTK_RETURN_IF_ERROR(model
                            ->StageForwardExchanged(micro_batches[static_cast<size_t>(k)], k % slots,
                                                    loss_scales[static_cast<size_t>(k)], /*train=*/true, seed,
                                                    /*logits=*/nullptr, /*defer_loss=*/true)
                            .status());
    PTK_RETURN_IF_ERROR(StopTimer(timers, "forward-compute"));
    ++in_flight;
    if (stats) stats->max_in_flight = std::max(stats->max_in_flight, in_flight);
    return absl::OkStatus();
  };
  auto backward = [&](int k) -> absl::Status {
    --in_flight;
    if (k + 1 == m && before_last_backward) PTK_RETURN_IF_ERROR(before_last_backward());
    PTK_RETURN_IF_ERROR(StartTimer(timers, "backward-compute", 2));
    PTK_RETURN_IF_ERROR(
        model->StageBackwardExchanged(micro_batches[static_cast<size_t>(k)], k % slots, /*train=*/true, seed));
    return StopTimer(timers, "backward-compute");
  };
  for (int i = 0; i < warmup; ++i) {
    PTK_ASSIGN_OR_RETURN(const StageExchange x, buffers(i));
    PTK_RETURN_IF_ERROR(links.RecvForward(x.input));
    PTK_RETURN_IF_ERROR(forward(i));
    PTK_RETURN_IF_ERROR(links.SendForward(x.output));
  }
  if (remaining > 0) {
    PTK_ASSIGN_OR_RETURN(const StageExchange x, buffers(warmup));
    PTK_RETURN_IF_ERROR(links.RecvForward(x.input));
  }
  for (int i = 0; i < remaining; ++i) {
    PTK_RETURN_IF_ERROR(forward(warmup + i));
    PTK_ASSIGN_OR_RETURN(const StageExchange y, buffers(warmup + i));
    PTK_ASSIGN_OR_RETURN(const StageExchange dy, buffers(i));
    PTK_RETURN_IF_ERROR(links.SendForwardRecvBackward(y.output, dy.output_grad));
    PTK_RETURN_IF_ERROR(backward(i));
    if (i + 1 == remaining) {
      PTK_RETURN_IF_ERROR(links.SendBackward(dy.input_grad));
    } else {
      PTK_ASSIGN_OR_RETURN(const StageExchange x, buffers(warmup + i + 1));
      PTK_RETURN_IF_ERROR(links.SendBackwardRecvForward(dy.input_grad, x.input));
    }
  }
  for (int i = 0; i < warmup; ++i) {  // cool-down
    PTK_ASSIGN_OR_RETURN(const StageExchange dy, buffers(remaining + i));
    PTK_RETURN_IF_ERROR(links.RecvBackward(dy.output_grad));
    PTK_RETURN_IF_ERROR(backward(remaining + i));
    PTK_RETURN_IF_ERROR(links.SendBackward(dy.input_grad));
  }
  kept.model = nullptr;
  return model->TakeLosses();
}

absl::Status StageExchangeAgreement::Check(Communicator* pipeline, const StageExchange& mine) {
  if (pipeline != pipeline_) agreed_.clear();
  pipeline_ = pipeline;
  const std::tuple<int, int64_t, bool> format{static_cast<int>(mine.wire), mine.elements, mine.stream != nullptr};
  if (std::find(agreed_.begin(), agreed_.end(), format) != agreed_.end()) return absl::OkStatus();
  PTK_RETURN_IF_ERROR(CheckStageExchangeAgreement(pipeline, mine));
  agreed_.push_back(format);
  return absl::OkStatus();
}

absl::StatusOr<LossSum> ForwardPipelining(GPTModel* model, Communicator* pipeline, const ModelBatch& batch,
                                          std::vector<float>* logits, StageExchangeAgreement* agreed) {
  if (model->layout().virtual_size > 1) return ForwardInterleaved(model, pipeline, batch, logits, agreed);
  PTK_ASSIGN_OR_RETURN(const StageExchange x, model->StageBuffers(batch, 0, pipeline->device_collectives()));
  PTK_RETURN_IF_ERROR(agreed ? agreed->Check(pipeline, x) : CheckStageExchangeAgreement(pipeline, x));
  StageLinks links(pipeline, x);
  PTK_RETURN_IF_ERROR(links.RecvForward(x.input));
  PTK_ASSIGN_OR_RETURN(const LossSum l,
                       model->StageForwardExchanged(batch, 0, std::nullopt, /*train=*/false, 0, logits));
  PTK_RETURN_IF_ERROR(links.SendForward(x.output));
  return l;
}

}  // namespace ptk
