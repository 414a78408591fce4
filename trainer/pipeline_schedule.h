// Megatron's pipeline schedules on one stage (forward_backward_pipelining_without_interleaving and
// its forward-only case): the model is this rank's stage (GPTModel::StageForwardExchanged /
// StageBackwardExchanged), `pipeline` the pipeline group (its rank the stage), and each
// micro-batch's activations (GPTModel::StageExchangeFloats: (b, t, hidden), or a sequence-parallel
// shard) and their gradients go to the adjacent stages from and into the buffers the model hands
// per slot (GPTModel::StageBuffers): device memory in the model's dtype through
// Communicator::SendRecvDevice on the model's stream where the communicator sends device memory
// (NCCL), host memory through Communicator::SendRecv otherwise (gloo; the CPU backend).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/timers.h"

namespace ptk {

struct PipelineStats {
  int max_in_flight = 0;  // the most micro-batches whose activations this stage held at once
  // --overlap-grad-reduce: the buckets the last step's last backward launched while it ran (TrainStep).
  int buckets_launched_in_backward = 0;
};

// 1F1B over a step's micro-batches: stage s runs min(P - s - 1, m) warm-up forwards, then one
// forward and one backward at a time, then the remaining backwards; at most P - s micro-batches'
// activations are alive on stage s (P on the first). loss_scales[k] scales micro-batch k's loss
// (its gradient), as ForwardBackward's loss_scale. Backwards run in micro-batch order, so each
// stage adds its gradients in the order one rank does. Returns the masked loss sums on the last
// stage, zero elsewhere. `before_last_backward`, when given, runs just before the backward of the
// last micro-batch (--overlap-grad-reduce arms the bucket reduction there, as Megatron's
// no_sync context ends for the last micro-batch). `timers` (--timing-log-level 2) times each
// forward and backward (forward-compute, backward-compute) and each exchange under the name of
// Megatron's p2p call (forward-recv, forward-send-backward-recv, ...), on the stages that make it.
// `microbatch_group_size` is the interleaved schedule's (below): 1F1B has no groups.
absl::StatusOr<LossSum> ForwardBackwardPipelining(GPTModel* model, Communicator* pipeline,
                                                  const std::vector<ModelBatch>& micro_batches,
                                                  std::span<const double> loss_scales, uint64_t seed,
                                                  PipelineStats* stats = nullptr,
                                                  const std::function<absl::Status()>& before_last_backward = {},
                                                  Timers* timers = nullptr, int microbatch_group_size = 0);

// With model chunks (layout().virtual_size > 1) ForwardBackwardPipelining runs Megatron's
// interleaved 1F1B instead (pipeline_interleaved.cpp): the step's micro-batches in groups of N
// (`microbatch_group_size`, Megatron's microbatch_group_size_per_vp_stage; 0: P, its default), each
// group through chunk 0, then chunk 1, ... (the last group takes the rest); (P - s - 1) * 2 + (V - 1) * N
// warm-up forwards on stage s; the last stage's chunk v sends to the first stage's chunk v + 1 (and its
// gradient back); each chunk's backwards in micro-batch order, whatever N (so the sums, and the
// losses, are the same bits). Each step's sends and receives go as one batch:
// Communicator::BatchSendRecv on host memory (gloo; the CPU backend, the CUDA backend's host
// exchange), BatchSendRecvDevice on the model's stream where the communicator sends device memory
// (NCCL). The model reserves the slots the step takes first (InterleavedSlots,
// GPTModel::ReserveStageSlots). `before_last_backward` (--overlap-grad-reduce) runs before the
// first backward of the step's last micro-batch (chunk V - 1's), and each chunk's ranges are
// reported ready by its own last backward only (GPTModel::SetLastBackwardOfChunk), as Megatron
// starts each model chunk's gradient sync at its last micro-batch's backward.
absl::StatusOr<LossSum> ForwardBackwardInterleaved(GPTModel* model, Communicator* pipeline,
                                                   const std::vector<ModelBatch>& micro_batches,
                                                   std::span<const double> loss_scales, uint64_t seed,
                                                   PipelineStats* stats = nullptr, Timers* timers = nullptr,
                                                   const std::function<absl::Status()>& before_last_backward = {},
                                                   int microbatch_group_size = 0);
// The activation slots ForwardBackwardInterleaved hands stage `rank` of `pipeline_size` with
// `chunks` model chunks over a step of `micro_batches` in groups of `microbatch_group_size` (0: the
// pipeline size) (one more than the largest slot index it passes to StageBuffers; at least `chunks`,
// ForwardInterleaved's): the schedule run without a model or messages. Each chunk reuses only its
// own slots, so this may exceed the virtual micro-batches in flight. InvalidArgument where the
// schedule refuses the step.
absl::StatusOr<int> InterleavedSlots(int pipeline_size, int rank, int chunks, int micro_batches,
                                     int microbatch_group_size = 0);
// One pass of the interleaved schedule on a stage: a forward or a backward of `micro_batch` through
// model chunk `chunk`.
struct InterleavedPass {
  bool forward;
  int micro_batch, chunk;
  bool operator==(const InterleavedPass&) const = default;
};
// The passes ForwardBackwardInterleaved runs on stage `rank`, in order (the schedule run without a
// model or messages, as InterleavedSlots): what Megatron-core's schedule table and its warm-up count
// give that rank (tests/support/dump_megatron_vp_schedule.py writes them). InvalidArgument where the
// schedule refuses the step.
absl::StatusOr<std::vector<InterleavedPass>> InterleavedOrder(int pipeline_size, int rank, int chunks,
                                                              int micro_batches, int microbatch_group_size = 0);
// Megatron's checks of the interleaved schedule's groups: N (`microbatch_group_size`; 0: the default,
// P) between P and the step's micro-batches M, and the last group (M mod N) either empty or of at least
// P micro-batches. With the default that is M a multiple of P. InvalidArgument naming the flags
// otherwise.
absl::Status CheckInterleavedMicroBatches(int micro_batches, int pipeline_size, int microbatch_group_size = 0);

// The stages agree on what crosses between them: this stage's exchange (its wire type and
// element count) and each neighbour's, swapped over `pipeline` (one small host message each way).
// FailedPrecondition naming both stages and both exchanges when a neighbour's differs. The
// schedules below check it before any activation is sent: at every call, or once per exchange
// format with a StageExchangeAgreement.
absl::Status CheckStageExchangeAgreement(Communicator* pipeline, const StageExchange& mine);

// The exchange formats (wire type, element count, host or device memory) a stage has agreed on
// with its neighbours over one pipeline group, kept by a caller of ForwardPipelining across its
// calls (evaluation's micro-batches, a sample's tokens): a format is checked the first time this
// stage exchanges it, and not again. The stages make the same calls with the same shapes (one
// batch, or stand-ins of its sizes; the wire type is fixed by settings checked at start-up), so a
// changed shape or precision is new on every stage and is checked, and refused, on each.
class StageExchangeAgreement {
 public:
  // CheckStageExchangeAgreement unless `mine`'s format was agreed over `pipeline` before (another
  // group forgets the formats of the last).
  absl::Status Check(Communicator* pipeline, const StageExchange& mine);

 private:
  Communicator* pipeline_ = nullptr;
  std::vector<std::tuple<int, int64_t, bool>> agreed_;  // wire, elements, device memory
};

// Forward only (evaluation, no dropout; text samples): each stage passes the micro-batch on. The
// loss sum on the last stage, zero elsewhere; with `logits` the last stage's logits (StageForward).
// With `agreed` the stages' exchange is checked once per format (StageExchangeAgreement), without
// at every call.
absl::StatusOr<LossSum> ForwardPipelining(GPTModel* model, Communicator* pipeline, const ModelBatch& batch,
                                          std::vector<float>* logits = nullptr,
                                          StageExchangeAgreement* agreed = nullptr);
// ForwardPipelining through the model chunks (ForwardPipelining runs it when there are several):
// chunk 0 on every stage, then chunk 1, ..., the last stage's chunk v passing to the first stage's
// chunk v + 1.
absl::StatusOr<LossSum> ForwardInterleaved(GPTModel* model, Communicator* pipeline, const ModelBatch& batch,
                                           std::vector<float>* logits, StageExchangeAgreement* agreed);

}  // namespace ptk
