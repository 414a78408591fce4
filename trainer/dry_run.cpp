// ptk-train --dry-run: the layout, Megatron's start-up lines, the parameters of every (tensor,
// pipeline) rank and the memory per GPU of a planned run.
#include "trainer/dry_run.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/numbers.h"
#include "common/status.h"
#include "trainer/parallel_layout.h"
#include "trainer/parallel_params.h"
#include "trainer/param_layout.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

// A launcher variable: unset, or a decimal in [lo, int max], read as TrainingRanksFromEnv reads
// it; anything else is a usage error naming it.
absl::StatusOr<std::optional<int>> EnvInt(const char* name, int lo) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::optional<int64_t> x = ParseInt64(v);
  if (!x) return UsageError(fmt::format("environment: {}={:?} is not an integer", name, std::string(v)));
  const int64_t hi = std::numeric_limits<int>::max();
  if (*x < lo || *x > hi) return UsageError(fmt::format("environment: {}={} is outside [{}, {}]", name, *x, lo, hi));
  return static_cast<int>(*x);
}

// The ranks as runs of consecutive ranks, the first three runs, "..." and the last for more than
// four: "[0-7]", "[0, 8, 16, ..., 56]", "[0-7, 64-71, 128-135, ..., 960-967]", "[0, 960]".
std::string RankList(const std::vector<int>& g) {
  std::vector<std::string> runs;
  for (size_t i = 0; i < g.size();) {
    size_t j = i;
    while (j + 1 < g.size() && g[j + 1] == g[j] + 1) ++j;
    runs.push_back(j == i ? fmt::format("{}", g[i]) : fmt::format("{}-{}", g[i], g[j]));
    i = j + 1;
  }
  if (runs.size() > 4) runs.erase(runs.begin() + 3, runs.end() - 1), runs.insert(runs.end() - 1, "...");
  return fmt::format("[{}]", fmt::join(runs, ", "));
}

// Every group of a kind, or for more than four the first three, "...", and the last.
std::string GroupsLine(const ParallelLayout& layout, ParallelGroup kind, const char* what) {
  const int64_t n = layout.NumGroups(kind);
  const size_t size = layout.GroupAt(kind, 0).size();
  std::string out = fmt::format("  {} groups: {} of {} rank{}:", what, n, size, size == 1 ? "" : "s");
  for (int64_t i = 0; i < n; ++i) {
    if (n > 4 && i == 3) {
      out += " ...";
      i = n - 1;
    }
    out += ' ';
    out += RankList(layout.GroupAt(kind, i));
  }
  return out + "\n";
}

// The dry run prints groups of up to the whole world: a bound on what it is asked to plan.
constexpr int kMaxDryRunWorld = 1 << 20;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The stage's layers holding experts: its MoE layers, and on the last the multi-token prediction depths when they
// are MoE layers (the decoder's last layer's kind).
int64_t ExpertLayersOnStage(const GPTConfig& m, const PipelineStage& stage) {
  const bool last = stage.rank == stage.size - 1;
  return MoeLayersOnStage(m, stage) + (last && m.moe_layer(m.num_layers - 1) ? m.mtp_num_layers : 0);
}
}  // namespace

absl::StatusOr<DryRunCluster> DryRunClusterFromEnv(int gpus_per_node_flag) {
  DryRunCluster c;
  std::optional<int> world, rank;
  PTK_ASSIGN_OR_RETURN(world, EnvInt("WORLD_SIZE", 1));
  if (world) {
    c.world_size = *world;
    c.world_source = "WORLD_SIZE";
    PTK_ASSIGN_OR_RETURN(rank, EnvInt("RANK", 0));
  } else {
    PTK_ASSIGN_OR_RETURN(world, EnvInt("SLURM_STEP_NUM_TASKS", 1));
    if (world) {
      c.world_size = *world;
      c.world_source = "SLURM_STEP_NUM_TASKS";
      PTK_ASSIGN_OR_RETURN(rank, EnvInt("SLURM_PROCID", 0));
    }
  }
  c.rank = rank.value_or(0);
  if (gpus_per_node_flag > 0) {
    c.gpus_per_node = gpus_per_node_flag;
    c.gpus_source = "--gpus-per-node";
    return c;
  }
  for (const char* name : {"LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE"}) {
    std::optional<int> n;
    PTK_ASSIGN_OR_RETURN(n, EnvInt(name, 1));
    if (n) {
      c.gpus_per_node = *n;
      c.gpus_source = name;
      break;
    }
  }
  return c;
}

double ActivationBytesPerLayer(const GPTConfig& c, int64_t micro_batch_size, int tensor, bool sequence_parallel,
                               bool selective_recompute, int activation_bytes) {
  const double s = static_cast<double>(c.seq_length), b = static_cast<double>(micro_batch_size);
  const double h = static_cast<double>(c.hidden_size), a = static_cast<double>(c.num_attention_heads);
  const double f = static_cast<double>(c.ffn_hidden_size > 0 ? c.ffn_hidden_size : 4 * c.hidden_size);
  const double t = tensor, v = activation_bytes;
  // Outside the tensor-parallel regions: the two LayerNorms' inputs, the QKV and fc1 inputs (4sbh
  // values) and the dropout masks after the projection and fc2 (2sbh bytes).
  const double outside = v * 4 * s * b * h + 2 * s * b * h;
  // Inside: Q, K, V and the projection's input (4sbh; with query groups Q and the projection's input
  // a·kv each, K and V G·kv each), GELU's and fc2's inputs (2sbF; SwiGLU's [gate; up] and fc2's
  // input 3sbF) ...
  const double q = a * static_cast<double>(c.head_dim()), kv = static_cast<double>(c.query_groups() * c.head_dim());
  double mlp = (c.swiglu ? 3 : 2) * s * b * f;
  if (c.moe()) {  // the MoE layers' experts see each token k times (the layers' mean), at most their capacity
    const double E = static_cast<double>(c.num_experts), routed = static_cast<double>(c.moe_router_topk) * s * b;
    const double rows = c.moe_expert_capacity_factor < 0
                            ? routed
                            : std::min(routed, E * std::ceil(routed / E * c.moe_expert_capacity_factor));
    const double moe = rows * (c.swiglu ? 3 : 2) * static_cast<double>(c.moe_ffn()) +
                       (c.swiglu ? 3 : 2) * s * b * static_cast<double>(c.moe_shared_expert_intermediate_size),
                 share = static_cast<double>(c.moe_layers()) / static_cast<double>(c.num_layers);
    mlp = share * moe + (1 - share) * mlp;
  }
  double inside = v * (s * b * (2 * q + 2 * kv) + mlp);
  // --attention-output-gate: the gate's rows of the QKV product and the core attention's output before the gate
  // (the product's other input), a·kv each. A sliding window or a softmax offset leaves the attention core's
  // probabilities whole (s² a row of them: the unfused softmax masks, it does not shrink).
  if (c.attention_output_gate) inside += v * 2 * s * b * q;
  // ... and the attention core: softmax output and dropout output (2as²b values), dropout mask (as²b).
  if (!selective_recompute) inside += (2 * v + 1) * a * s * s * b;
  return (sequence_parallel && tensor > 1 ? outside / t : outside) + inside / t;
}

absl::StatusOr<DryRunPlan> PlanDryRun(const DryRunOptions& o) {
  if (o.cluster.world_size > kMaxDryRunWorld)
    return UsageError(fmt::format("{}={}: --dry-run plans up to {} ranks", o.cluster.world_source, o.cluster.world_size,
                                  kMaxDryRunWorld));
  PTK_ASSIGN_OR_RETURN(const ParallelLayout layout,
                       ParallelLayout::Create(o.cluster.world_size, o.tensor, o.pipeline, o.context, o.expert));
  const int T = o.tensor, P = o.pipeline, D = layout.data_size(), C = layout.context_size();
  DryRunPlan plan;
  plan.data_parallel = D;
  plan.context_parallel = C;
  if (C > 1 && o.model.seq_length % (2 * C) != 0)
    return UsageError(fmt::format("--context-parallel-size {}: --seq-length {} must be a multiple of 2 x {} = {}", C,
                                  o.model.seq_length, C, 2 * C));
  GPTConfig& m = plan.model;
  m = o.model;
  if (m.ffn_hidden_size == 0) m.ffn_hidden_size = 4 * m.hidden_size;
  if (m.max_position_embeddings == 0) m.max_position_embeddings = m.seq_length;
  PTK_ASSIGN_OR_RETURN(m.padded_vocab_size, TensorParallelVocabSize(m.vocab_size, o.make_vocab_size_divisible_by, T));
  if (o.padded_vocab_size > 0) m.padded_vocab_size = o.padded_vocab_size;
  if (absl::Status s = m.Validate(); !s.ok()) return AsUsageError(s);
  PTK_RETURN_IF_ERROR(CheckTensorSplit(m, T));
  PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> stage_layers,
                       PipelineStageLayers(m.num_layers, P, o.first_stage_layers, o.last_stage_layers));
  const int64_t mbs = o.micro_batch_size;
  plan.global_batch_size = o.global_batch_size > 0 ? o.global_batch_size : mbs * D;
  if (plan.global_batch_size % (mbs * D) != 0) {  // the real run's check, on this plan's data-parallel size
    if (!o.decrease_batch_size)
      return UsageError(fmt::format(
          "--global-batch-size {} is not divisible by --micro-batch-size {} times the data-parallel size {} (or give "
          "--decrease-batch-size-if-needed)",
          plan.global_batch_size, mbs, D));
    if (plan.global_batch_size < mbs * D)
      return UsageError(fmt::format(
          "--decrease-batch-size-if-needed: --global-batch-size {} is smaller than --micro-batch-size {} times the "
          "data-parallel size {}: no micro-batch is left",
          plan.global_batch_size, mbs, D));
    plan.decreased_from = plan.global_batch_size;
    plan.global_batch_size = plan.global_batch_size / (mbs * D) * (mbs * D);
  }
  plan.micro_batches = plan.global_batch_size / (mbs * D);
  const int V = o.virtual_size;
  if (V > 1 && (P < 2 || stage_layers.front() % V != 0))
    return UsageError(fmt::format("--num-virtual-stages-per-pipeline-rank {}: {} layers per stage over {} stage(s)", V,
                                  stage_layers.front(), P));
  const int N = o.microbatch_group_size > 0 ? o.microbatch_group_size : P;  // Megatron's groups
  if (V > 1)
    if (absl::Status st = CheckInterleavedMicroBatches(
            static_cast<int>(std::min<int64_t>(plan.micro_batches, std::numeric_limits<int>::max())), P,
            o.microbatch_group_size);
        !st.ok())
      return UsageError(fmt::format("{} (--global-batch-size {} / (--micro-batch-size {} x {} data-parallel ranks))",
                                    StatusMessage(st), plan.global_batch_size, mbs, D));
  plan.sequence_parallel = o.sequence_parallel && T > 1;
  // Megatron's mixed precision keeps fp32 gradients (main_grad) and an fp32 master copy beside
  // Adam's two moments (megatron/training/theoretical_memory_usage.py: 18 bytes, 6 + 12/D with
  // ZeRO-1); in fp32 the weights are the master.
  const bool mixed = o.precision != Precision::kFp32;
  plan.weight_bytes = mixed ? 2 : 4;
  plan.optimizer_bytes = mixed ? 12 : 8;
  plan.activation_bytes = mixed ? 2 : 4;
  const double sb = static_cast<double>(m.seq_length) * mbs, sbh = sb * m.hidden_size;
  for (int p = 0; p < P; ++p) {
    StageMemory st;
    st.layers = stage_layers[p];
    st.params = ParamsOnModelParallelRank(m, T, P, p, st.layers, MoeLayersOnStage(m, StageOf(stage_layers, p, V)));
    // Expert parallelism: the rank holds num_experts / E of each MoE layer's experts (the router keeps a row per
    // expert); ZeRO-1 shards their state over the D·C / E expert-data ranks (Megatron's), the rest's over D·C.
    double expert_params = 0;
    if (m.moe() && o.expert > 1) {
      const int64_t moe = ExpertLayersOnStage(m, StageOf(stage_layers, p, V)), local = m.num_experts / o.expert;
      st.params -= moe * (m.num_experts - local) * m.expert_floats() / T;  // each tensor rank its slices
      expert_params = static_cast<double>(moe * local * m.expert_floats() / T);
    }
    st.in_flight = V > 1 ? std::min<int64_t>((P - p - 1) * 2 + int64_t{V - 1} * N + 1, V * plan.micro_batches)
                         : std::min<int64_t>(P - p, plan.micro_batches);
    // In micro-batches of the whole stage: a virtual micro-batch holds one chunk's layers.
    const double n = static_cast<double>(st.params), in_flight = static_cast<double>(st.in_flight) / V;
    st.weights = n * plan.weight_bytes;
    st.gradients = n * plan.gradient_bytes;
    st.optimizer = n * plan.optimizer_bytes;
    st.optimizer_zero1 = st.optimizer / (D * C);  // Megatron shards it over data × context ranks
    if (expert_params > 0)
      st.optimizer_zero1 = ((n - expert_params) / (D * C) + expert_params / (D * C / o.expert)) * plan.optimizer_bytes;
    // Megatron's terms beyond the layers (theoretical_memory_usage.py), over T: the embedding's
    // input ids and dropout mask per micro-batch in flight, the output layer's input and fp32 logits.
    double extra = 0;
    if (p == 0) extra += in_flight * (8 * sb + sbh);
    if (p == P - 1) extra += 4 * sbh + 4 * sb * static_cast<double>(m.padded_vocab_size);
    extra /= T * C;  // each context rank's positions
    const double layers = static_cast<double>(st.layers) * in_flight;
    st.activations =
        layers * ActivationBytesPerLayer(m, mbs, T, plan.sequence_parallel, false, plan.activation_bytes) / C + extra;
    st.activations_recomputed =
        layers * ActivationBytesPerLayer(m, mbs, T, plan.sequence_parallel, true, plan.activation_bytes) / C + extra;
    st.total = st.weights + st.gradients + (o.use_distributed_optimizer ? st.optimizer_zero1 : st.optimizer) +
               (m.recompute_activations ? st.activations_recomputed : st.activations);
    plan.stages.push_back(st);
  }
  return plan;
}

// The layout's lines: the rank order, a few ranks' coordinates, every kind of group.
std::string LayoutLines(const ParallelLayout& layout, int world) {
  const int T = layout.tensor_size(), C = layout.context_size(), D = layout.data_size(), P = layout.pipeline_size();
  std::string out;
  auto line = [&out](const std::string& s) { out += s + "\n"; };
  if (C == 1)
    line(
        fmt::format("layout: {} ranks = tensor {} x data {} x pipeline {} (Megatron's rank order tp-cp-ep-dp-pp: "
                    "rank = t + {}*d + {}*p)",
                    world, T, D, P, T, T * D));
  else
    line(fmt::format(
        "layout: {} ranks = tensor {} x context {} x data {} x pipeline {} (Megatron's rank order tp-cp-ep-dp-pp: "
        "rank = t + {}*c + {}*d + {}*p)",
        world, T, C, D, P, T, T * C, T * C * D));
  std::vector<int> shown = {0,
                            std::min(1, world - 1),
                            std::min(T, world - 1),
                            std::min(T * C, world - 1),
                            std::min(T * C * D, world - 1),
                            world - 1};
  std::sort(shown.begin(), shown.end());
  shown.erase(std::unique(shown.begin(), shown.end()), shown.end());
  std::string coords;
  for (int r : shown) {
    const RankCoords c = layout.Coords(r);
    coords += C == 1 ? fmt::format("{}rank {} (t {}, d {}, p {})", coords.empty() ? "" : ", ", r, c.tensor, c.data,
                                   c.pipeline)
                     : fmt::format("{}rank {} (t {}, c {}, d {}, p {})", coords.empty() ? "" : ", ", r, c.tensor,
                                   c.context, c.data, c.pipeline);
  }
  line("  " + coords);
  out += GroupsLine(layout, ParallelGroup::kTensor, "tensor");
  out += GroupsLine(layout, ParallelGroup::kData, "data");
  if (C > 1) {
    out += GroupsLine(layout, ParallelGroup::kContext, "context");
    out += GroupsLine(layout, ParallelGroup::kDataContext, "data x context (gradients, ZeRO-1)");
  }
  if (layout.expert_size() > 1) {
    out += GroupsLine(layout, ParallelGroup::kExpert, "expert");
    out += GroupsLine(layout, ParallelGroup::kExpertData, "expert-data (the experts' gradients)");
  }
  out += GroupsLine(layout, ParallelGroup::kPipeline, "pipeline");
  out += GroupsLine(layout, ParallelGroup::kEmbedding, "embedding (first and last stage)");
  out += GroupsLine(layout, ParallelGroup::kModel, "model-parallel (tensor x pipeline)");
  return out;
}

absl::StatusOr<std::string> DryRunReport(const DryRunOptions& o) {
  PTK_ASSIGN_OR_RETURN(const DryRunPlan plan, PlanDryRun(o));
  const DryRunCluster& cl = o.cluster;
  PTK_ASSIGN_OR_RETURN(const ParallelLayout layout,
                       ParallelLayout::Create(cl.world_size, o.tensor, o.pipeline, o.context, o.expert));
  const int T = o.tensor, P = o.pipeline, D = plan.data_parallel, C = plan.context_parallel;
  const GPTConfig& m = plan.model;
  std::string out;
  auto line = [&out](const std::string& s) { out += s + "\n"; };
  line(fmt::format("dry run: {} rank{} ({}){}; nothing is built, allocated or read", cl.world_size,
                   cl.world_size == 1 ? "" : "s", cl.world_source,
                   cl.gpus_per_node > 0 ? fmt::format(", {} GPUs per node ({})", cl.gpus_per_node, cl.gpus_source)
                                        : ", GPUs per node not known (LOCAL_WORLD_SIZE, SLURM_GPUS_ON_NODE or "
                                          "--gpus-per-node)"));
  if (cl.gpus_per_node > 0 && T > cl.gpus_per_node)
    line(
        fmt::format("warning: --tensor-model-parallel-size {} is more than the {} GPUs of a node: the tensor-parallel "
                    "collectives of every layer would cross the network (Megatron keeps a tensor group within a node)",
                    T, cl.gpus_per_node));
  if (o.sequence_parallel && T == 1)
    line("note: --sequence-parallel without tensor parallelism: Megatron turns it off (T = 1)");
  // Megatron's start-up lines, in its order.
  line(PaddedVocabLine(m.vocab_size, m.padded_vocab_size));
  line(fmt::format("> initialized tensor model parallel with size {}", T));
  line(fmt::format("> initialized pipeline model parallel with size {}", P));
  out += LayoutLines(layout, cl.world_size);
  if (plan.decreased_from > 0)  // the real run's rank 0 prints Megatron's calculator's line (its missing space too)
    line(
        fmt::format("decreasing batch size from {} to {}to keep divisiblity by micro_batch_size={} * "
                    "data_parallel_size={}",
                    plan.decreased_from, plan.global_batch_size, o.micro_batch_size, D));
  line(fmt::format("batch: global {} = micro-batch {} x {} micro-batch{} x data-parallel {}", plan.global_batch_size,
                   o.micro_batch_size, plan.micro_batches, plan.micro_batches == 1 ? "" : "es", D));
  // Megatron's line from the first data-parallel rank of every (tensor, pipeline) rank.
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < T; ++t) line(ParamCountLine(t, p, plan.stages[p].params));
  line(fmt::format("model: {} parameters ({} tensor x {} pipeline ranks)",
                   ParamsOnModelParallelRank(m, 1, 1, 0, m.num_layers), T, P));

  const bool mixed = o.precision != Precision::kFp32;
  line(fmt::format(
      "memory per GPU in GiB, {}: weights {} B, gradients {} B, optimizer state {} B per parameter ({}); ZeRO-1 "
      "(--use-distributed-optimizer) shards the optimizer state over the {} data-parallel rank{}{}",
      PrecisionName(o.precision), plan.weight_bytes, plan.gradient_bytes, plan.optimizer_bytes,
      mixed ? "fp32 master weights and Adam's two moments" : "Adam's two moments", D, D == 1 ? "" : "s",
      fmt::format("{}{}", C > 1 ? fmt::format(" x {} context ranks", C) : "",
                  m.moe() && o.expert > 1 ? fmt::format(" (the experts' over the {} expert-data-parallel ranks; each "
                                                        "rank holds {} of the {} experts of a MoE layer)",
                                                        D * C / o.expert, m.num_experts / o.expert, m.num_experts)
                                          : "")));
  line(fmt::format(
      "activations: per layer sbh(18 + 4F/h) + 5as^2b bytes, sbh(34 + 5as/h) at F = 4h (Korthikanti et al. 2022, "
      "Table 2; {}-byte activations), split over T {}; --recompute-activations (selective) drops 5as^2b; "
      "s {}, b {}, stage p holds {}, plus Megatron's embedding and output-layer terms{}{}",
      plan.activation_bytes,
      plan.sequence_parallel ? "with --sequence-parallel" : "except 10sbh (no --sequence-parallel)", m.seq_length,
      o.micro_batch_size,
      o.virtual_size > 1
          ? fmt::format("min((P - p - 1) x 2 + (V - 1) x N + 1, V x {}) virtual micro-batches of its {} chunks' "
                        "layers each (the interleaved schedule, V = {}, micro-batch groups of N = {})",
                        plan.micro_batches, o.virtual_size, o.virtual_size,
                        o.microbatch_group_size > 0 ? o.microbatch_group_size : P)
          : fmt::format("min(P - p, {}) micro-batches (1F1B)", plan.micro_batches),
      C > 1 ? fmt::format("; over C = {} context ranks (each s/C positions of a sample)", C) : "",
      m.gpt3() ? ""
               : "; this Llama-line model's Q, K, V and attention output at their heads' widths (4sbh -> sb(2a + "
                 "2G)kv), SwiGLU's gate, up and fc2 inputs 3sbF (2sbF)"));
  line(fmt::format("{:>6} {:>6} {:>12} {:>8} {:>9} {:>9} {:>9} {:>11} {:>10} {:>8}", "stage", "layers", "parameters",
                   "weights", "gradients", "optimizer", "ZeRO-1", "activations", "recomputed", "total"));
  int worst = 0;
  for (int p = 0; p < P; ++p) {
    const StageMemory& st = plan.stages[p];
    if (st.total > plan.stages[worst].total) worst = p;
    line(fmt::format("{:>6} {:>6} {:>12} {:>8.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>11.2f} {:>10.2f} {:>8.2f}", p,
                     st.layers, st.params, st.weights / kGiB, st.gradients / kGiB, st.optimizer / kGiB,
                     st.optimizer_zero1 / kGiB, st.activations / kGiB, st.activations_recomputed / kGiB,
                     st.total / kGiB));
  }
  line(fmt::format("total: as this run is configured ({}, {}); the most loaded GPU is stage {}'s, {:.2f} GiB",
                   o.use_distributed_optimizer ? "--use-distributed-optimizer" : "no --use-distributed-optimizer",
                   m.recompute_activations ? "--recompute-activations" : "no --recompute-activations", worst,
                   plan.stages[worst].total / kGiB));
  return out;
}

}  // namespace ptk
