// Megatron's context parallelism on the CPU model (--context-parallel-size, its allgather exchange):
// each context rank holds some positions of every sample (ContextParallelPositions: chunks r and
// 2C − 1 − r of 2C), and runs every op but the attention on them alone. The attention all-gathers
// the fused QKV rows of the context group into the whole samples, in position order, runs the
// causal attention over them as one rank would (the same mask, by true position, and the same
// attention-dropout keys), and keeps this rank's rows of its output. Backward puts this rank's
// output gradient at its rows of the whole samples (zeros elsewhere), runs the attention's backward
// over them, and reduce-scatters the QKV gradient over the group: each rank's rows end as the sum
// of every rank's share (its own queries' and the others' queries' gradients of its keys and
// values). The attention's work is the whole samples' on every context rank (the other ops', and
// every activation but the probabilities, are 1/C of one rank's): exact, not yet the cheaper ring.
#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/parallel_layout.h"

namespace ptk {

absl::Status CpuGPTModel::SetContextParallel(Communicator* context) {
  if (context == nullptr || context->size() <= 1) return absl::OkStatus();
  if (sequence_parallel_)
    return absl::FailedPreconditionError("context parallelism with --sequence-parallel is not implemented");
  if (layout_.pipeline_size > 1)
    return absl::FailedPreconditionError("context parallelism with pipeline stages is not implemented");
  const int64_t C = context->size();
  if (config().seq_length % (2 * C) != 0)
    return absl::InvalidArgumentError(fmt::format(
        "--context-parallel-size {}: --seq-length {} must be a multiple of 2 x {}", C, config().seq_length, C));
  context_comm_ = context;
  return absl::OkStatus();
}

absl::Status CpuGPTModel::GatherContextRows(const float* qkv, int64_t b, int64_t t, int64_t w) {
  Activations& a = *act_;
  const int C = context_comm_->size();
  const int64_t piece = b * t * w;
  std::copy(qkv, qkv + piece, a.cp_gather.begin() + context_comm_->rank() * piece);
  const std::vector<int64_t> bytes(static_cast<size_t>(C), piece * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(context_comm_->AllGather(a.cp_gather.data(), bytes));
  // Rank q's row i of sample s is position ContextParallelPositions(q)[i] of the whole sample.
  const int64_t S = t * C;
  for (int q = 0; q < C; ++q) {
    const std::vector<int64_t> pos = ContextParallelPositions(S, C, q);
    for (int64_t s = 0; s < b; ++s)
      for (int64_t i = 0; i < t; ++i) {
        const float* from = a.cp_gather.data() + q * piece + (s * t + i) * w;
        std::copy(from, from + w, a.cp_qkv.begin() + (s * S + pos[static_cast<size_t>(i)]) * w);
      }
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ContextAttentionForward(float* out, float* probs, const float* qkv,
                                                  const AttentionShape& shape, double p, uint64_t seed) {
  Activations& a = *act_;
  const int64_t C = context_comm_->size(), t = shape.t, S = t * C, w = shape.qkv_width(), ct = shape.nh * shape.hd;
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, shape.b, t, w));
  AttentionShape whole = shape;
  whole.t = S;
  cpu::AttentionForward(a.cp_att.data(), probs, a.cp_qkv.data(), whole, p, seed, a.streams.data());
  for (int64_t s = 0; s < shape.b; ++s)
    for (int64_t i = 0; i < t; ++i) {
      const float* from = a.cp_att.data() + (s * S + context_positions_[static_cast<size_t>(i)]) * ct;
      std::copy(from, from + ct, out + (s * t + i) * ct);
    }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ContextAttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                                                   const AttentionShape& shape, double p, uint64_t seed) {
  Activations& a = *act_;
  const int C = context_comm_->size();
  const int64_t t = shape.t, S = t * C, w = shape.qkv_width(), ct = shape.nh * shape.hd, piece = shape.b * t * w;
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, shape.b, t, w));  // the whole samples' rows again
  std::fill(a.cp_att.begin(), a.cp_att.end(), 0.0f);
  for (int64_t s = 0; s < shape.b; ++s)
    for (int64_t i = 0; i < t; ++i) {
      const float* from = dout + (s * t + i) * ct;
      std::copy(from, from + ct, a.cp_att.begin() + (s * S + context_positions_[static_cast<size_t>(i)]) * ct);
    }
  AttentionShape whole = shape;
  whole.t = S;
  cpu::AttentionBackward(a.cp_dqkv.data(), a.cp_att.data(), a.cp_qkv.data(), probs, whole, p, seed, a.streams.data());
  // Rank by rank (each rank's rows in its order) for the reduce-scatter, which sums them in rank order.
  for (int q = 0; q < C; ++q) {
    const std::vector<int64_t> pos = ContextParallelPositions(S, C, q);
    for (int64_t s = 0; s < shape.b; ++s)
      for (int64_t i = 0; i < t; ++i) {
        const float* from = a.cp_dqkv.data() + (s * S + pos[static_cast<size_t>(i)]) * w;
        std::copy(from, from + w, a.cp_gather.begin() + q * piece + (s * t + i) * w);
      }
  }
  const std::vector<int64_t> counts(static_cast<size_t>(C), piece);
  PTK_RETURN_IF_ERROR(context_comm_->ReduceScatterSum(a.cp_gather.data(), counts));
  const float* mine = a.cp_gather.data() + context_comm_->rank() * piece;
  std::copy(mine, mine + piece, dqkv);
  return absl::OkStatus();
}

}  // namespace ptk
