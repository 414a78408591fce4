// Megatron's context parallelism on the CPU model (--context-parallel-size, its allgather exchange):
// each context rank holds some positions of every sample (ContextParallelPositions: chunks r and
// 2C − 1 − r of 2C), and runs every op but the attention on them alone. The attention all-gathers
// the fused QKV rows of the context group into the whole samples, in position order, and runs this
// rank's queries over the whole samples' keys and values (cpu::AttentionRowsForward: one rank's
// causal mask by true position and its attention-dropout keys). Backward gathers them again, computes
// this rank's queries' gradients and their share of every position's key and value gradients
// (AttentionRowsBackward), and reduce-scatters that share over the group: each rank's key and value
// rows end as the sum of every rank's share. Every activation, the attention's probabilities
// included (t/C × t per head), is 1/C of one rank's; the gathered QKV is a transient buffer.
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
  const int64_t C = context->size();
  if (config().seq_length % (2 * C) != 0)
    return absl::InvalidArgumentError(fmt::format(
        "--context-parallel-size {}: --seq-length {} must be a multiple of 2 x {}", C, config().seq_length, C));
  if (sequence_parallel_ && config().seq_length / C % tensor_size() != 0)
    return absl::InvalidArgumentError(
        fmt::format("--context-parallel-size {} with --sequence-parallel: a context rank's --seq-length {} / {} "
                    "positions must be a multiple of --tensor-model-parallel-size {}",
                    C, config().seq_length, C, tensor_size()));
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
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, shape.b, shape.t, shape.qkv_width()));
  AttentionShape whole = shape;
  whole.t = shape.t * context_comm_->size();
  cpu::AttentionRowsForward(out, probs, qkv, a.cp_qkv.data(), context_positions_.data(), shape.t, whole, p, seed,
                            a.streams.data());
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ContextAttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                                                   const AttentionShape& shape, double p, uint64_t seed) {
  Activations& a = *act_;
  const int C = context_comm_->size();
  const int64_t t = shape.t, S = t * C, w = shape.qkv_width(), piece = shape.b * t * w;
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, shape.b, t, w));  // the whole samples' keys and values again
  AttentionShape whole = shape;
  whole.t = S;
  // The op assigns the query columns of this rank's rows and the key and value columns of every
  // position; the rest stays zero, so the sum below adds nothing to the query columns.
  std::fill(dqkv, dqkv + piece, 0.0f);
  std::fill(a.cp_dqkv.begin(), a.cp_dqkv.end(), 0.0f);
  cpu::AttentionRowsBackward(dqkv, a.cp_dqkv.data(), dout, qkv, a.cp_qkv.data(), probs, context_positions_.data(), t,
                             whole, p, seed, a.streams.data());
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
  for (int64_t i = 0; i < piece; ++i) dqkv[i] += mine[i];
  return absl::OkStatus();
}

}  // namespace ptk
