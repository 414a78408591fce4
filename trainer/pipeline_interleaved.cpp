// Megatron's interleaved 1F1B schedule (virtual pipeline stages) and the forward-only pass over a
// stage's model chunks.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

// Activations travel forward on one channel, their gradients backward on another: with two stages
// a rank's previous and next stage are the same rank, and one batch may carry both.
constexpr int kForwardChannel = 0, kBackwardChannel = 1;

struct VirtualMicroBatch {
  int micro_batch, chunk;
};

// Megatron's schedule table: micro-batches in groups of `group` (microbatch_group_size_per_vp_stage,
// by default P), each group run through chunk 0, then chunk 1, ...; the last group takes the rest.
std::vector<VirtualMicroBatch> ScheduleTable(int m, int chunks, int group) {
  std::vector<VirtualMicroBatch> table;
  for (int first = 0; first < m; first += group) {
    const int end = first + group >= m ? m : first + group;
    for (int v = 0; v < chunks; ++v)
      for (int k = first; k < end; ++k) table.push_back({k, v});
  }
  return table;
}

const std::vector<ModelBatch>& NoBatches() {
  static const std::vector<ModelBatch> none;
  return none;
}

class InterleavedSchedule {
 public:
  InterleavedSchedule(GPTModel* model, Communicator* pipe, const std::vector<ModelBatch>& mbs,
                      std::span<const double> scales, uint64_t seed, PipelineStats* stats, Timers* timers, int group)
      : InterleavedSchedule(pipe->size(), pipe->rank(), model->layout().virtual_size, static_cast<int>(mbs.size()),
                            group, mbs) {
    model_ = model;
    pipe_ = pipe;
    scales_ = scales;
    seed_ = seed;
    stats_ = stats;
    timers_ = timers;
  }
  // Counting only (no model, no pipeline): Run takes and frees the slots as the schedule would.
  // `group`: the micro-batches of a group (CheckInterleavedMicroBatches has passed them).
  InterleavedSchedule(int P, int r, int V, int m, int group, const std::vector<ModelBatch>& mbs = NoBatches())
      : mbs_(mbs),
        P_(P),
        r_(r),
        V_(V),
        m_(m),
        N_(group),
        total_(m_ * V_),
        table_(ScheduleTable(m_, V_, N_)),
        slot_of_(static_cast<size_t>(V_), std::vector<int>(static_cast<size_t>(m_), -1)),
        free_(static_cast<size_t>(V_)),
        inputs_seen_(static_cast<size_t>(V_), 0),
        grads_seen_(static_cast<size_t>(V_), 0) {}

  absl::Status Run();
  int slots() const { return slots_; }
  void set_before_last_backward(std::function<absl::Status()> f) { before_last_backward_ = std::move(f); }
  void set_order(std::vector<InterleavedPass>* order) { order_ = order; }  // each pass appended as it runs

 private:
  int ChunkOf(int k, bool forward) const {
    const int v = table_[static_cast<size_t>(k % total_)].chunk;
    return forward ? v : V_ - 1 - v;
  }
  int MicroBatchOf(int k) const { return table_[static_cast<size_t>(k)].micro_batch; }
  bool FirstVirtual(int v) const { return r_ == 0 && v == 0; }
  bool LastVirtual(int v) const { return r_ == P_ - 1 && v == V_ - 1; }
  // Megatron's recv_tensor_from_previous_stage: whether the stage receives after virtual
  // micro-batch k (an activation going forward, a gradient going backward), and for which chunk.
  // The first rank's chunk v + 1 takes the last rank's chunk v, P - 1 virtual micro-batches behind.
  std::pair<bool, int> ReceiveAfter(int k, bool forward) const;
  absl::StatusOr<StageExchange> Buffers(int v, int mb);
  absl::Status TakeSlot(int v, int mb);
  absl::Status Forward(int k, const void** out);
  absl::Status Backward(int k, const void** dx);
  // One batch of Megatron's p2p call `timer`: the sends given (null: none), and the receives of
  // the next activation of chunk `in_chunk` and the next gradient of chunk `grad_chunk` (-1: none).
  absl::Status Exchange(const char* timer, const void* out, const void* dx, int in_chunk, int grad_chunk);

  GPTModel* model_ = nullptr;  // null: counting the slots only
  Communicator* pipe_ = nullptr;
  const std::vector<ModelBatch>& mbs_;
  std::span<const double> scales_;
  uint64_t seed_ = 0;
  PipelineStats* stats_ = nullptr;
  Timers* timers_ = nullptr;
  std::function<absl::Status()> before_last_backward_;  // run once, before the last micro-batch's first backward
  std::vector<InterleavedPass>* order_ = nullptr;
  const int P_, r_, V_, m_, N_, total_;
  std::vector<VirtualMicroBatch> table_;
  std::vector<std::vector<int>> slot_of_;      // [chunk][micro-batch]: its activation slot, -1 none
  std::vector<std::vector<int>> free_;         // each chunk's slots free again
  std::vector<int> inputs_seen_, grads_seen_;  // per chunk: activations / gradients received so far
  int slots_ = 0, in_flight_ = 0;
  bool device_ = false;
  StageExchange format_;
};

std::pair<bool, int> InterleavedSchedule::ReceiveAfter(int k, bool forward) const {
  const bool leading = forward ? r_ == 0 : r_ == P_ - 1;
  if (!leading) return {true, ChunkOf(k + 1, forward)};
  bool receive = k >= P_ - 1;
  int v = receive ? ChunkOf(k - (P_ - 1), forward) : ChunkOf(k + 1, forward);
  if (v == (forward ? V_ - 1 : 0)) receive = false;
  return {receive, forward ? v + 1 : v - 1};
}

absl::StatusOr<StageExchange> InterleavedSchedule::Buffers(int v, int mb) {
  PTK_RETURN_IF_ERROR(model_->SelectChunk(v));
  const int slot = slot_of_[static_cast<size_t>(v)][static_cast<size_t>(mb)];
  if (slot < 0)
    return absl::InternalError(fmt::format("interleaved schedule: chunk {} micro-batch {} has no slot", v, mb));
  PTK_ASSIGN_OR_RETURN(StageExchange e, model_->StageBuffers(mbs_[static_cast<size_t>(mb)], slot, device_));
  if (e.elements != format_.elements || e.wire != format_.wire)
    return absl::InvalidArgumentError(
        fmt::format("pipeline schedule: micro-batches of different shapes ({}x{} exchanges {} elements, the first {})",
                    mbs_[static_cast<size_t>(mb)].b, mbs_[static_cast<size_t>(mb)].t, e.elements, format_.elements));
  return e;
}

absl::Status InterleavedSchedule::TakeSlot(int v, int mb) {
  std::vector<int>& pool = free_[static_cast<size_t>(v)];
  int slot = slots_;
  if (pool.empty()) {
    ++slots_;
  } else {
    slot = pool.back();
    pool.pop_back();
  }
  slot_of_[static_cast<size_t>(v)][static_cast<size_t>(mb)] = slot;
  return model_ ? Buffers(v, mb).status() : absl::OkStatus();
}

absl::Status InterleavedSchedule::Forward(int k, const void** out) {
  const int v = ChunkOf(k, true), mb = MicroBatchOf(k);
  if (order_) order_->push_back({true, mb, v});
  if (FirstVirtual(v)) PTK_RETURN_IF_ERROR(TakeSlot(v, mb));
  if (!model_) {  // counting: any non-null marks a send
    *out = LastVirtual(v) ? nullptr : static_cast<const void*>(this);
    return absl::OkStatus();
  }
  PTK_ASSIGN_OR_RETURN(const StageExchange x, Buffers(v, mb));
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "forward-compute", 2));
  PTK_RETURN_IF_ERROR(model_
                          ->StageForwardExchanged(mbs_[static_cast<size_t>(mb)],
                                                  slot_of_[static_cast<size_t>(v)][static_cast<size_t>(mb)],
                                                  scales_[static_cast<size_t>(mb)], /*train=*/true, seed_,
                                                  /*logits=*/nullptr, /*defer_loss=*/true)
                          .status());
  PTK_RETURN_IF_ERROR(StopTimer(timers_, "forward-compute"));
  ++in_flight_;
  if (stats_) stats_->max_in_flight = std::max(stats_->max_in_flight, in_flight_);
  *out = LastVirtual(v) ? nullptr : x.output;
  return absl::OkStatus();
}

absl::Status InterleavedSchedule::Backward(int k, const void** dx) {
  const int v = ChunkOf(k, false), mb = MicroBatchOf(k);  // a chunk's backwards in its forwards' order
  if (order_) order_->push_back({false, mb, v});
  int& slot = slot_of_[static_cast<size_t>(v)][static_cast<size_t>(mb)];
  const void* input_grad = static_cast<const void*>(this);  // counting: any non-null marks a send
  if (model_) {
    PTK_ASSIGN_OR_RETURN(const StageExchange x, Buffers(v, mb));
    input_grad = x.input_grad;
    const bool last = mb == m_ - 1;  // the chunk's last backward of the step (micro-batch order)
    if (last && before_last_backward_) {
      PTK_RETURN_IF_ERROR(before_last_backward_());
      before_last_backward_ = nullptr;
    }
    model_->SetLastBackwardOfChunk(last);
    PTK_RETURN_IF_ERROR(StartTimer(timers_, "backward-compute", 2));
    PTK_RETURN_IF_ERROR(model_->StageBackwardExchanged(mbs_[static_cast<size_t>(mb)], slot, /*train=*/true, seed_));
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "backward-compute"));
  }
  if (model_) --in_flight_;
  free_[static_cast<size_t>(v)].push_back(slot);
  slot = -1;
  *dx = FirstVirtual(v) ? nullptr : input_grad;
  return absl::OkStatus();
}

absl::Status InterleavedSchedule::Exchange(const char* timer, const void* out, const void* dx, int in_chunk,
                                           int grad_chunk) {
  const int prev = (r_ + P_ - 1) % P_, next = (r_ + 1) % P_;
  const int64_t bytes = format_.bytes();
  std::vector<Communicator::P2pMessage> batch;
  if (out) batch.push_back({out, nullptr, bytes, next, kForwardChannel});
  if (dx) batch.push_back({dx, nullptr, bytes, prev, kBackwardChannel});
  if (in_chunk >= 0) {  // the chunk's activations arrive in micro-batch order
    const int mb = inputs_seen_[static_cast<size_t>(in_chunk)]++;
    if (mb >= m_) return absl::InternalError("interleaved schedule: an activation past the step's micro-batches");
    PTK_RETURN_IF_ERROR(TakeSlot(in_chunk, mb));
    if (model_) {
      PTK_ASSIGN_OR_RETURN(const StageExchange x, Buffers(in_chunk, mb));
      batch.push_back({nullptr, x.input, bytes, prev, kForwardChannel});
    }
  }
  if (grad_chunk >= 0) {
    const int mb = grads_seen_[static_cast<size_t>(grad_chunk)]++;
    if (mb >= m_) return absl::InternalError("interleaved schedule: a gradient past the step's micro-batches");
    if (model_) {
      PTK_ASSIGN_OR_RETURN(const StageExchange x, Buffers(grad_chunk, mb));
      batch.push_back({nullptr, x.output_grad, bytes, next, kBackwardChannel});
    }
  }
  if (batch.empty() || !model_) return absl::OkStatus();
  PTK_RETURN_IF_ERROR(StartTimer(timers_, timer, 2));
  // Device memory (NCCL): on the passes' stream, in the batch's order (sends, then receives, each
  // forward before backward), which the stages' schedules make alike at both ends of every pair.
  PTK_RETURN_IF_ERROR(format_.stream ? pipe_->BatchSendRecvDevice(batch, format_.stream) : pipe_->BatchSendRecv(batch));
  return StopTimer(timers_, timer);
}

absl::Status InterleavedSchedule::Run() {
  // Megatron's warm-up: (P - r - 1) * 2 + (V - 1) * N virtual micro-batches, all of them at most.
  const int warmup = std::min((P_ - r_ - 1) * 2 + (V_ - 1) * N_, total_), remaining = total_ - warmup;
  const bool all_warmup = warmup == total_;
  if (model_) {
    PTK_RETURN_IF_ERROR(model_->SelectChunk(0));
    device_ = pipe_->device_collectives();
    PTK_ASSIGN_OR_RETURN(format_, model_->StageBuffers(mbs_[0], 0, device_));
    PTK_RETURN_IF_ERROR(CheckStageExchangeAgreement(pipe_, format_));
  }
  PTK_RETURN_IF_ERROR(Exchange("forward-recv", nullptr, nullptr, FirstVirtual(0) ? -1 : 0, -1));
  const void* out = nullptr;
  const void* dx = nullptr;
  for (int k = 0; k < warmup; ++k) {
    PTK_RETURN_IF_ERROR(Forward(k, &out));
    auto [recv_prev, in_chunk] = ReceiveAfter(k, true);
    if (k == total_ - 1) recv_prev = false;
    const bool last = k == warmup - 1 && !all_warmup;  // the first backward's gradient comes with it
    const int grad_chunk = last && r_ != P_ - 1 ? V_ - 1 : -1;
    PTK_RETURN_IF_ERROR(Exchange(last ? "forward-backward-send-forward-backward-recv" : "forward-send-forward-recv",
                                 out, nullptr, recv_prev ? in_chunk : -1, grad_chunk));
  }
  for (int k = 0; k < remaining; ++k) {
    const int fk = k + warmup;
    PTK_RETURN_IF_ERROR(Forward(fk, &out));
    PTK_RETURN_IF_ERROR(Backward(k, &dx));
    auto [recv_prev, in_chunk] = ReceiveAfter(fk, true);
    auto [recv_next, grad_chunk] = ReceiveAfter(k, false);
    if (k == remaining - 1) recv_prev = false;
    PTK_RETURN_IF_ERROR(Exchange("forward-backward-send-forward-backward-recv", out, dx, recv_prev ? in_chunk : -1,
                                 recv_next ? grad_chunk : -1));
  }
  if (all_warmup && r_ != P_ - 1) PTK_RETURN_IF_ERROR(Exchange("backward-recv", nullptr, nullptr, -1, V_ - 1));
  for (int k = remaining; k < total_; ++k) {
    PTK_RETURN_IF_ERROR(Backward(k, &dx));
    auto [recv_next, grad_chunk] = ReceiveAfter(k, false);
    if (k == total_ - 1) recv_next = false;
    PTK_RETURN_IF_ERROR(Exchange("backward-send-backward-recv", nullptr, dx, -1, recv_next ? grad_chunk : -1));
  }
  for (int v = 0; v < V_; ++v)
    if (inputs_seen_[static_cast<size_t>(v)] != (FirstVirtual(v) ? 0 : m_) ||
        grads_seen_[static_cast<size_t>(v)] != (LastVirtual(v) ? 0 : m_))
      return absl::InternalError(
          fmt::format("interleaved schedule: stage {} chunk {} received {} activations and {} "
                      "gradients of {} micro-batches",
                      r_, v, inputs_seen_[static_cast<size_t>(v)], grads_seen_[static_cast<size_t>(v)], m_));
  return absl::OkStatus();
}

// Drops the losses a failed schedule left with the model (the step fails; the next must not see them).
struct LossesDropped {
  GPTModel* model;
  ~LossesDropped() {
    if (model) (void)model->TakeLosses();
  }
};

// The counting schedule of stage `rank` (no model, no messages) after its checks; `order`, when given,
// takes its passes.
absl::StatusOr<int> CountInterleaved(int pipeline_size, int rank, int chunks, int micro_batches, int group,
                                     std::vector<InterleavedPass>* order) {
  if (pipeline_size < 2 || rank < 0 || rank >= pipeline_size || chunks < 1 || micro_batches < 1 || group < 0)
    return absl::InvalidArgumentError(
        fmt::format("interleaved schedule: stage {} of {}, {} chunks, {} micro-batches in groups of {}", rank,
                    pipeline_size, chunks, micro_batches, group));
  PTK_RETURN_IF_ERROR(CheckInterleavedMicroBatches(micro_batches, pipeline_size, group));
  InterleavedSchedule count(pipeline_size, rank, chunks, micro_batches, group > 0 ? group : pipeline_size);
  count.set_order(order);
  PTK_RETURN_IF_ERROR(count.Run());
  return count.slots();
}

}  // namespace

absl::StatusOr<int> InterleavedSlots(int pipeline_size, int rank, int chunks, int micro_batches,
                                     int microbatch_group_size) {
  PTK_ASSIGN_OR_RETURN(const int slots,
                       CountInterleaved(pipeline_size, rank, chunks, micro_batches, microbatch_group_size, nullptr));
  return std::max(slots, chunks);  // ForwardInterleaved's: chunk v in slot v
}

absl::StatusOr<std::vector<InterleavedPass>> InterleavedOrder(int pipeline_size, int rank, int chunks,
                                                              int micro_batches, int microbatch_group_size) {
  std::vector<InterleavedPass> order;
  PTK_RETURN_IF_ERROR(
      CountInterleaved(pipeline_size, rank, chunks, micro_batches, microbatch_group_size, &order).status());
  return order;
}

absl::Status CheckInterleavedMicroBatches(int micro_batches, int pipeline_size, int microbatch_group_size) {
  const int M = micro_batches, P = pipeline_size, N = microbatch_group_size;
  if (N <= 0) {  // Megatron's default, N = P: M at least P, and no last group short of P
    if (M >= P && M % P == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(fmt::format(
        "the interleaved pipeline schedule runs the micro-batches of a step in groups of "
        "--pipeline-model-parallel-size ({}): {} micro-batches per step (global batch / (micro-batch x data-parallel "
        "ranks)) must be a multiple of it",
        P, M));
  }
  // Megatron-core's two checks of forward_backward_pipelining_with_interleaving, in its order.
  if (N < P || N > M)
    return absl::InvalidArgumentError(fmt::format(
        "--microbatch-group-size-per-virtual-pipeline-stage {}: the micro-batches run in a row on one model chunk "
        "must be from the pipeline size to the micro-batches of a step, [PP={}, M={}] (M = global batch / "
        "(micro-batch x data-parallel ranks))",
        N, P, M));
  if (const int last = M % N; last > 0 && last < P)
    return absl::InvalidArgumentError(fmt::format(
        "--microbatch-group-size-per-virtual-pipeline-stage {}: the last group of the step's {} micro-batches holds "
        "{} (M mod N), fewer than the pipeline size {}: it must be 0 or at least {}, else the stages wait on each "
        "other within it",
        N, M, last, P, P));
  return absl::OkStatus();
}

absl::StatusOr<LossSum> ForwardBackwardInterleaved(GPTModel* model, Communicator* pipeline,
                                                   const std::vector<ModelBatch>& micro_batches,
                                                   std::span<const double> loss_scales, uint64_t seed,
                                                   PipelineStats* stats, Timers* timers,
                                                   const std::function<absl::Status()>& before_last_backward,
                                                   int microbatch_group_size) {
  if (micro_batches.empty()) return LossSum{};
  const int m = static_cast<int>(micro_batches.size()), P = pipeline->size();
  PTK_RETURN_IF_ERROR(CheckInterleavedMicroBatches(m, P, microbatch_group_size));
  PTK_ASSIGN_OR_RETURN(const int slots,
                       InterleavedSlots(P, pipeline->rank(), model->layout().virtual_size, m, microbatch_group_size));
  PTK_RETURN_IF_ERROR(model->ReserveStageSlots(slots));
  LossesDropped kept{model};
  InterleavedSchedule schedule(model, pipeline, micro_batches, loss_scales, seed, stats, timers,
                               microbatch_group_size > 0 ? microbatch_group_size : P);
  schedule.set_before_last_backward(before_last_backward);
  const absl::Status run = schedule.Run();
  model->SetLastBackwardOfChunk(true);
  (void)model->SelectChunk(0);
  PTK_RETURN_IF_ERROR(run);
  kept.model = nullptr;
  return model->TakeLosses();
}

absl::StatusOr<LossSum> ForwardInterleaved(GPTModel* model, Communicator* pipeline, const ModelBatch& batch,
                                           std::vector<float>* logits, StageExchangeAgreement* agreed) {
  const int P = pipeline->size(), r = pipeline->rank(), V = model->layout().virtual_size;
  const int prev = (r + P - 1) % P, next = (r + 1) % P;
  const bool device = pipeline->device_collectives();
  PTK_RETURN_IF_ERROR(model->ReserveStageSlots(V));
  LossSum loss;
  // Device memory (NCCL): on the passes' stream.
  auto send_recv = [&](const Communicator::P2pMessage& m, void* stream) {
    return stream ? pipeline->BatchSendRecvDevice({&m, 1}, stream) : pipeline->BatchSendRecv({&m, 1});
  };
  for (int v = 0; v < V; ++v) {  // chunk v's slot v
    PTK_RETURN_IF_ERROR(model->SelectChunk(v));
    PTK_ASSIGN_OR_RETURN(const StageExchange x, model->StageBuffers(batch, v, device));
    if (v == 0) PTK_RETURN_IF_ERROR(agreed ? agreed->Check(pipeline, x) : CheckStageExchangeAgreement(pipeline, x));
    const Communicator::P2pMessage in{nullptr, x.input, x.bytes(), x.input ? prev : -1, kForwardChannel};
    PTK_RETURN_IF_ERROR(send_recv(in, x.stream));
    PTK_ASSIGN_OR_RETURN(const LossSum l, model->StageForwardExchanged(batch, v, std::nullopt, /*train=*/false, 0,
                                                                       v == V - 1 ? logits : nullptr));
    if (v == V - 1) loss = l;
    const Communicator::P2pMessage out{x.output, nullptr, x.bytes(), x.output ? next : -1, kForwardChannel};
    PTK_RETURN_IF_ERROR(send_recv(out, x.stream));
  }
  PTK_RETURN_IF_ERROR(model->SelectChunk(0));
  return loss;
}

}  // namespace ptk
