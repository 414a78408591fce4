// A CPU-backend run's memory, worked out before the model is made, and the check that it fits.
#include "trainer/memory_estimate.h"

#include <algorithm>

#include <fmt/core.h>
#include <tbb/global_control.h>

#include "common/human_format.h"
#include "common/status.h"
#include "trainer/cpu/cpu_gpt_model.h"

namespace ptk {

absl::StatusOr<CpuTrainingMemory> EstimateCpuTrainingMemory(const GPTConfig& model, int tensor_size, int tensor_rank,
                                                            bool sequence_parallel, const PipelineStage& stage,
                                                            int64_t micro_batch_size, int64_t micro_batches,
                                                            bool checkpoints, int microbatch_group_size, int threads,
                                                            int context, int expert_size) {
  PTK_ASSIGN_OR_RETURN(const ParamLayout layout,
                       ParamLayout::Create(model, tensor_size, tensor_rank, stage, expert_size, 0));
  CpuTrainingMemory m;
  m.params = layout.num_params;
  const double n = static_cast<double>(layout.num_params);
  // CpuGPTModel keeps all four buffers whole: a ZeRO-1 shard of the moments reuses their capacity.
  m.weights_and_optimizer = 16 * n;
  const int P = stage.size, p = stage.rank, V = stage.virtual_size;
  const int N = microbatch_group_size > 0 ? microbatch_group_size : P;
  const int64_t mb = std::max<int64_t>(1, micro_batches);
  m.activation_slots = P <= 1  ? 1
                       : V > 1 ? std::min<int64_t>(int64_t{P - p - 1} * 2 + int64_t{V - 1} * N + 1, V * mb)
                               : std::min<int64_t>(P - p, mb);
  const int64_t floats = CpuGPTModel::PlanActivationFloats(layout, sequence_parallel, micro_batch_size, context);
  const int64_t tokens =
      micro_batch_size * model.seq_length / context;  // the targets (int32) and dropout streams (uint64)
  m.activations = static_cast<double>(m.activation_slots) *
                  (4.0 * static_cast<double>(floats) + 4.0 * static_cast<double>(tokens) + 8.0 * micro_batch_size);
  // Multi-token prediction's depths, on the stage that holds them (the last).
  m.activations +=
      4.0 * static_cast<double>(CpuGPTModel::PlanMtpActivationFloats(layout, micro_batch_size, sequence_parallel));
  if (checkpoints) m.checkpoint_copies = 12 * n;
  // Attention's buffers (attention_rows_cpu.cpp; attention_cpu.cpp runs it with every position a query row), one
  // set per thread that runs a task: backward's tasks are the (sequence, query group) pairs, each thread holding
  // 2 t^2 floats; a forward with attention dropout (also backward's recomputation, before backward's buffers
  // exist) the (sequence, head) pairs, t^2.
  // A context rank's (attention_rows_cpu.cpp): its t / C query rows over the t positions.
  const int64_t t = model.seq_length, tq = t / context, heads = model.num_attention_heads / tensor_size;
  const int64_t groups = model.query_groups() / tensor_size;
  const int64_t cpus =
      threads > 0
          ? threads
          : static_cast<int64_t>(tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism));
  const int64_t backward_threads = std::min(cpus, micro_batch_size * groups);
  const int64_t forward_threads = model.attention_dropout > 0 ? std::min(cpus, micro_batch_size * heads) : 0;
  const bool forward_peak = forward_threads > 2 * backward_threads;
  m.attention_threads = forward_peak ? forward_threads : backward_threads;
  m.attention_work = 4.0 * static_cast<double>(tq) * static_cast<double>(t) *
                     static_cast<double>(forward_peak ? forward_threads : 2 * backward_threads);
  return m;
}

std::string TheoreticalMemoryLine(const CpuTrainingMemory& m) {
  constexpr double kMB = 1024.0 * 1024.0;
  return fmt::format(
      "Theoretical memory footprints: weight and optimizer={:.2f} MB, activation={:.2f} MB, total={:.2f} MB",
      m.weights_and_optimizer / kMB, m.activations / kMB, m.total() / kMB);
}

namespace {
// "1000000 parameters: 15.3 MiB for the weights, ...; 3.8 MiB of activations for 2 micro-batches in flight".
std::string NeedDetail(const CpuTrainingMemory& need) {
  return fmt::format(
      "{} parameters: {} for the weights, gradients and AdamW moments; {} of activations for {} micro-batch{} in "
      "flight{}{}",
      need.params, HumanBytes(need.weights_and_optimizer), HumanBytes(need.activations), need.activation_slots,
      need.activation_slots == 1 ? "" : "es",
      need.checkpoint_copies > 0 ? fmt::format("; {} for the checkpoint's copies of the weights and moments",
                                               HumanBytes(need.checkpoint_copies))
                                 : "",
      need.attention_work > 0
          ? fmt::format("; {} for attention's work buffers while it runs ({} thread{})",
                        HumanBytes(need.attention_work), need.attention_threads, need.attention_threads == 1 ? "" : "s")
          : "");
}

constexpr const char* kWhatToChange =
    "use a smaller model, --micro-batch-size or --seq-length, --recompute-activations, or more tensor or pipeline "
    "ranks";
}  // namespace

absl::Status CheckFitsInMemory(const CpuTrainingMemory& need, const AvailableMemory& available, int ranks_on_node,
                               const std::string& ranks_source) {
  const double node_need = need.total() * ranks_on_node;
  if (ranks_on_node > 1 && available.shared_bytes >= 0 && node_need > static_cast<double>(available.shared_bytes))
    return absl::FailedPreconditionError(fmt::format(
        "not enough memory on this node: its {} ranks ({}) need {} together, {} each ({}), and {} is available ({}); "
        "nothing was allocated: start fewer ranks on each node, or {}",
        ranks_on_node, ranks_source, HumanBytes(node_need), HumanBytes(need.total()), NeedDetail(need),
        HumanBytes(static_cast<double>(available.shared_bytes)), available.shared_source, kWhatToChange));
  if (available.bytes < 0 || need.total() <= static_cast<double>(available.bytes)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("not enough memory: this rank needs {} ({}), and {} is available ({}); nothing was allocated: {}",
                  HumanBytes(need.total()), NeedDetail(need), HumanBytes(static_cast<double>(available.bytes)),
                  available.source, kWhatToChange));
}

}  // namespace ptk
