// The CUDA model's memory plan (pure host code).
#include "trainer/cuda/memory_plan.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include <fmt/core.h>

#include "absl/status/statusor.h"
#include "common/status.h"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/mla_plan.h"
#include "trainer/cuda/moe_plan.h"

namespace ptk::cuda {
namespace {
int64_t Align(int64_t x) { return (x + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment; }
}  // namespace

int64_t InputBytes(int64_t n) { return 3 * Align(n * 4) + Align(n * 4); }

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

absl::StatusOr<StageReplan> PlanStageReplan(int64_t planned_b, int64_t planned_t, int64_t b, int64_t t, int slot,
                                            uint64_t live, uint64_t received) {
  if (b < 1 || t < 1) return absl::InvalidArgumentError(fmt::format("a {}x{} micro-batch", b, t));
  if (slot < 0 || slot >= 64) return absl::InvalidArgumentError(fmt::format("activation slot {} of 64", slot));
  StageReplan r;
  if (b <= planned_b && t <= planned_t) return r;
  const uint64_t others_live = live & ~(uint64_t{1} << slot);
  if (others_live != 0) {
    std::string slots;
    for (int k = 0; k < 64; ++k)
      if ((others_live >> k) & 1) slots += fmt::format("{}{}", slots.empty() ? "" : ", ", k);
    return absl::FailedPreconditionError(
        fmt::format("a {}x{} micro-batch is larger than the {}x{} planned while other micro-batches' activations are "
                    "in flight (slots {}): a pipeline step's micro-batches must not grow after the first forward pass",
                    b, t, planned_b, planned_t, slots));
  }
  r.replan = true;
  r.b = std::max(b, planned_b);
  r.t = std::max(t, planned_t);
  for (int k = 0; k < 64; ++k)
    if ((received >> k) & 1) r.carried.push_back(k);
  return r;
}

std::string MemoryPlan::Largest(int count) const {
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return buffers[a].bytes > buffers[b].bytes; });
  std::string out;
  for (int i = 0; i < count && i < static_cast<int>(order.size()); ++i) {
    const PlannedBuffer& p = buffers[order[static_cast<size_t>(i)]];
    if (p.bytes == 0) break;
    out += fmt::format("{}{} {}{}", i ? "; " : "", p.name, FormatBytes(p.bytes),
                       p.lower.empty() ? "" : fmt::format(" (lower: {})", p.lower));
  }
  return out;
}

std::vector<LayerNormRun> LayerNormRuns(const ParamLayout& pl) {
  const int64_t c = pl.config.hidden_size, hd = pl.config.head_dim();
  std::vector<std::pair<int64_t, int64_t>> tensors;  // (start, size)
  for (const LayerParams& lp : pl.layers) {
    for (int64_t o : {lp.ln1_w, lp.ln1_b, lp.ln2_w, lp.ln2_b})
      if (o >= 0) tensors.emplace_back(o, c);  // RMSNorm has no bias (-1)
    for (int64_t o : {lp.q_norm_w, lp.q_norm_b, lp.k_norm_w, lp.k_norm_b})
      if (o >= 0) tensors.emplace_back(o, hd);  // --qk-layernorm's
    for (int64_t o : {lp.mla_q_norm_w, lp.mla_q_norm_b})
      if (o >= 0) tensors.emplace_back(o, pl.config.q_lora_rank);  // multi-latent attention's latent norms
    for (int64_t o : {lp.mla_kv_norm_w, lp.mla_kv_norm_b})
      if (o >= 0) tensors.emplace_back(o, pl.config.kv_lora_rank);
  }
  for (int64_t o : {pl.lnf_w, pl.lnf_b})
    if (o >= 0) tensors.emplace_back(o, c);
  std::sort(tensors.begin(), tensors.end());
  std::vector<LayerNormRun> runs;
  int64_t compact = 0;
  for (const auto& [o, size] : tensors) {
    if (!runs.empty() && runs.back().end == o)
      runs.back().end += size;
    else
      runs.push_back({o, o + size, compact});
    compact += size;
  }
  return runs;
}

namespace {

// Appends the buffers of a plan, each at the next aligned offset.
struct Adder {
  MemoryPlan* m;
  int64_t offset = 0;
  int operator()(std::string name, int64_t bytes, std::string lower = "") {
    PlannedBuffer p{std::move(name), bytes, offset, std::move(lower)};
    offset += Align(bytes);
    m->buffers.push_back(std::move(p));
    return static_cast<int>(m->buffers.size() - 1);
  }
};

// The parameters and the optimizer: the plan's first buffers, whose offsets do not depend on the
// batch shape.
void AddParameterBuffers(const GPTConfig& cf, int64_t num_params, const PlanOptions& o, Adder& add) {
  MemoryPlan& m = *add.m;
  const int64_t np = o.padded_params > 0 ? o.padded_params : num_params;
  const bool sharded = o.moment_params >= 0;
  const int64_t nm = sharded ? o.moment_params : num_params;
  const std::string model_lower =
      sharded ? "the model size" : "the model size, or --use-distributed-optimizer over several ranks";
  m.master_sharded = sharded && m.flash;
  if (m.master_sharded) {
    m.master = add("parameters (fp32 master, this rank's shard)", nm * 4, model_lower);
    m.ln_master = add("LayerNorm parameters (fp32, all of them)", LayerNormParamCount(cf) * 4, "the model size");
  } else {
    m.master = add("parameters (fp32 master)", np * 4, "the model size");
  }
  if (cf.apply_layernorm_1p)
    m.norm_eff =
        add("norm weights (fp32, 1 + gamma: --apply-layernorm-1p)", LayerNormParamCount(cf) * 4, "the model size");
  m.compute = add(fmt::format("parameters ({} compute copy)", m.flash ? PrecisionName(o.precision) : "fp32"),
                  m.flash ? np * m.act_bytes : 0, "the model size");
  m.grads = add("gradients (fp32)", np * 4, "the model size");
  m.exp_avg = add(sharded ? "AdamW exp_avg (fp32, this rank's shard)" : "AdamW exp_avg (fp32)", nm * 4, model_lower);
  m.exp_avg_sq =
      add(sharded ? "AdamW exp_avg_sq (fp32, this rank's shard)" : "AdamW exp_avg_sq (fp32)", nm * 4, model_lower);
}

// The attention's saved state (MemoryPlan::attn_saved): cuDNN's statistics on one rank, context parallelism's
// cuDNN pairs' log-sum-exps, or the rows attention's fp32 probabilities (L: a slot's layers, nh: this rank's heads).
void AddAttentionSaved(const PlanOptions& o, int64_t L, int64_t nh, const std::string& act_lower, Adder& add) {
  MemoryPlan& m = *add.m;
  const int64_t t = m.t;
  if (m.context_flash)
    m.attn_saved = add("activations: context-parallel attention log-sum-exps (layers of b*heads*t)",
                       L * m.b * nh * t * 4, act_lower);
  else if (!m.RowsAttention())
    m.attn_saved =
        add("activations: flash attention softmax statistics", L * m.b * FlashStatsStride(nh, t) * 4, act_lower);
  else
    m.attn_saved = add(fmt::format("activations: attention probabilities ({} layer(s) of b*heads*t*{}t)",
                                   m.probs_layers, o.context > 1 ? fmt::format("{}", o.context) : ""),
                       m.probs_layers * m.b * nh * t * o.context * t * 4,
                       act_lower + ", or --recompute-activations" +
                           (o.context > 1 ? ", or --context-parallel-size" : ", or --bf16 (fused attention)"));
}

// Context parallelism's buffers (MemoryPlan::cp_*) of qkv-width rows (ct: this rank's attention width; ckv its
// key/value groups' width, nh its heads).
void AddContextBuffers(int64_t context, int64_t qw, int64_t ct, int64_t ckv, int64_t nh, const std::string& act_lower,
                       Adder& add) {
  MemoryPlan& m = *add.m;
  const int64_t whole = context * m.n * qw * 4;  // fp32 rows of the whole samples
  m.cp_positions = add("context parallelism: every rank's positions", context * m.t * 8);
  if (m.context_flash) {
    m.cp_gathered =
        add("context parallelism: the group's QKV rows (all-gathered)", context * m.n * qw * m.act_bytes, act_lower);
    m.cp_whole = add("context parallelism: fp32 key and value gradient shares", whole, act_lower);
    m.cp_dwhole = add("context parallelism: fp32 key and value gradient shares received", whole, act_lower);
    m.cp_rows = add("context parallelism: fp32 attention output", m.n * ct * 4, act_lower);
    m.cp_dqkv = add("context parallelism: fp32 QKV gradient", m.n * qw * 4, act_lower);
    m.cp_part_out =
        add("context parallelism: a pair's output or query gradient", m.n / 2 * ct * m.act_bytes, act_lower);
    m.cp_part_kv = add("context parallelism: a pair's key and value gradients", m.n * ckv * m.act_bytes, act_lower);
    m.cp_part_stats = add("context parallelism: a pair's log-sum-exp", m.b * nh * (m.t / 2) * 4, act_lower);
    return;
  }
  m.cp_gathered = add("context parallelism: the group's QKV rows (all-gathered)", whole, act_lower);
  m.cp_whole = add("context parallelism: the whole samples' QKV", whole, act_lower);
  m.cp_dwhole = add("context parallelism: the whole samples' key and value gradients", whole, act_lower);
  if (!m.flash) return;
  m.cp_rows = add("context parallelism: fp32 attention output / its gradient", m.n * ct * 4, act_lower);
  m.cp_dqkv = add("context parallelism: fp32 QKV gradient", m.n * qw * 4, act_lower);
}

// Tensor parallelism's fp32 sums and loss statistics, sequence parallelism's staging (`nr`: the
// residual stream's rows on this rank), a pipeline stage's slots and exchange.
void AddParallelBuffers(const PlanOptions& o, int64_t nr, int64_t c, const std::string& act_lower, Adder& add) {
  MemoryPlan& m = *add.m;
  const int64_t T = m.tensor, n = m.n, a = m.act_bytes;
  if (T > 1) {
    m.tp_sum = add("tensor parallel: fp32 sums over the tensor group", n * c * 4, act_lower);
    m.tp_xent = add("tensor parallel: vocabulary-parallel loss statistics", (T + 3) * n * 4, act_lower);
    if (m.sequence_parallel)
      m.sp_stage = add("sequence parallel: all-gather / reduce-scatter staging", n * c * 4 + Align(nr * 4), act_lower);
    if (m.sequence_parallel || o.non_tensor_parallel_grads > 0)
      m.ntp_grads = add("tensor parallel: the partial gradients' sum over the tensor group (fp32)",
                        o.non_tensor_parallel_grads * 4, "the model size");
  }
  if (o.pipeline_slots > 0) {
    m.slots = o.pipeline_slots;
    m.pipeline_slots = add(fmt::format("pipeline: activations of {} more micro-batch(es) in flight", m.slots - 1),
                           (m.slots - 1) * m.slot_bytes, act_lower + ", or more pipeline stages");
    m.pipeline_head_grads = add("pipeline: final-norm gradient per micro-batch in flight",
                                o.pipeline_last ? m.slots * Align(n * c * a) : 0, act_lower);
    m.pipeline_exchange = add("pipeline: fp32 staging of the activation exchanged through the host",
                              o.pipeline_host_exchange && m.flash ? n * c * 4 : 0, act_lower);
    m.pipeline_output_grads = add("pipeline: output gradient per micro-batch in flight (model chunks)",
                                  o.pipeline_chunks > 1 && !o.pipeline_host_exchange ? m.slots * Align(nr * c * a) : 0,
                                  act_lower + ", or fewer micro-batches per step");
  }
}

// The passes' scratch buffers (their gradients, backward's partial sums) and the RoPE tables: `nr` the
// residual stream's rows on this rank, ct, qw and f this rank's attention, QKV and ffn widths,
// `grouped` whether query groups differ from heads.
void AddScratchBuffers(const GPTConfig& cf, const PlanOptions& o, int64_t nr, int64_t c, int64_t ct, int64_t qw,
                       int64_t f, bool grouped, const char* rows_note, const std::string& act_lower, Adder& add) {
  MemoryPlan& m = *add.m;
  const int64_t n = m.n, t = m.t, a = m.act_bytes, ff = (cf.swiglu ? 2 : 1) * f;
  // The projections' outputs (n, c); fp32 attention recomputed in backward writes its (n, ct) output here too.
  m.tmp = add("scratch: projection output", n * std::max(c, ct) * a, act_lower);
  m.dresid = add(fmt::format("scratch: residual gradient{}", rows_note), nr * c * a, act_lower);
  m.dtmp = add("scratch: branch gradient", n * c * a, act_lower);
  m.dln = add("scratch: LayerNorm gradient", n * c * a, act_lower);
  m.dff = add("scratch: MLP gradient", n * ff * a, act_lower);
  m.dqkv = add("scratch: QKV gradient", n * qw * a, act_lower);
  m.datt = add("scratch: attention output gradient", n * ct * a, act_lower);
  m.attn_scratch =
      add("scratch: attention backward", m.RowsAttention() ? o.attention_scratch_floats * 4 : 0, act_lower);
  m.ln_scratch = add("scratch: LayerNorm backward partial sums", o.layernorm_scratch_floats * 4, act_lower);
  if (cf.qk_layernorm && !cf.mla())
    m.qk_scratch = add("scratch: query and key norm backward partial sums", o.qk_norm_scratch_doubles * 8, act_lower);
  if (cf.attention_output_gate) {
    m.qkv_fused = add("scratch: QKV and gate product (gated attention)", n * (qw + ct) * a, act_lower);
    m.dgate = add("scratch: attention output gate gradient", n * ct * a, act_lower);
  }
  if (cf.softmax_sink() && !cf.learnable_softmax())
    m.sink_zeros = add("softmax offset zeros (off-by-one)", cf.num_attention_heads / o.tensor * 4);
  if (cf.rope() && !cf.mla())
    m.rope_tables = add("rotary embedding tables (fp32 cos, sin)", 2 * t * (cf.rotary_dim() / 2) * 4);
  if (cf.mla()) {  // multi-latent attention's rotary tables and its projections' scratch (mla_plan.h)
    m.mla_rope = add("multi-latent attention rotary tables (fp32 cos, sin)", 2 * t * (cf.qk_pos_emb_head_dim / 2) * 4);
    m.mla_scratch = add("scratch: multi-latent attention projections",
                        PlanMlaBuffers(MlaShapeOf(cf, m.b, t, o.tensor, a)).scratch_bytes, act_lower);
  }
  if (cf.swiglu) m.dact = add("scratch: SwiGLU output gradient", n * f * a, act_lower);
  if (!m.RowsAttention() && grouped) {
    m.qkv_heads = add("scratch: QKV heads first (grouped-query fused attention)", n * qw * a, act_lower);
    m.dqkv_heads = add("scratch: QKV gradient heads first (grouped-query fused attention)", n * qw * a, act_lower);
  }
}

// The options' shape checks: the sequence, the tensor slices, the chunks, the parameter counts.
absl::Status CheckPlanOptions(const GPTConfig& cf, int64_t num_params, const PlanOptions& o, int64_t t) {
  if (o.micro_batch_size < 1) return absl::InvalidArgumentError("memory plan: micro-batch size must be at least 1");
  if (t < 1 || t > cf.seq_length)
    return absl::InvalidArgumentError(fmt::format("memory plan: sequence length {} outside [1, {}]", t, cf.seq_length));
  if (o.context < 1) return absl::InvalidArgumentError(fmt::format("memory plan: {} context ranks", o.context));
  const int64_t T = o.tensor;
  if (T < 1 || cf.num_attention_heads % T != 0 || cf.query_groups() % T != 0 || cf.ffn_hidden_size % T != 0 ||
      cf.padded_vocab_size % T != 0)
    return absl::InvalidArgumentError(fmt::format(
        "memory plan: heads, query groups, ffn hidden size and padded vocabulary do not divide by tensor size {}", T));
  if (o.sequence_parallel && T > 1 && t % T != 0)
    return absl::InvalidArgumentError(
        fmt::format("memory plan: --sequence-parallel: sequence length {} does not divide by tensor size {}", t, T));
  const int64_t Ls = o.layers >= 0 ? o.layers : cf.num_layers;
  if (o.pipeline_chunks < 1 || Ls % o.pipeline_chunks != 0 || (o.pipeline_chunks > 1 && o.pipeline_slots < 1))
    return absl::InvalidArgumentError(fmt::format("memory plan: {} layers in {} model chunks over {} pipeline slots",
                                                  Ls, o.pipeline_chunks, o.pipeline_slots));
  if (o.padded_params != 0 && o.padded_params < num_params)
    return absl::InvalidArgumentError("memory plan: padded parameter count below the parameter count");
  if (o.moment_params > num_params) return absl::InvalidArgumentError("memory plan: moments beyond the parameters");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MemoryPlan> PlanMemory(const GPTConfig& cf, int64_t num_params, const PlanOptions& o) {
  const int64_t t = o.seq_length > 0 ? o.seq_length : cf.seq_length;
  PTK_RETURN_IF_ERROR(CheckPlanOptions(cf, num_params, o, t));
  MemoryPlan m;
  m.b = o.micro_batch_size;
  m.t = t;
  m.n = m.b * t;
  m.flash = o.precision != Precision::kFp32;
  m.act_bytes = m.flash ? 2 : 4;
  const int64_t T = o.tensor;
  m.tensor = T;
  m.sequence_parallel = o.sequence_parallel && T > 1;
  m.context = o.context;
  m.context_flash = o.context > 1 && m.flash && o.context_flash;
  // This rank's slices: attention width ct (its query heads x head dimension), fused QKV width qw
  // (its query heads and its groups' key and value heads), ffn f (fc1's output ff: twice that
  // under SwiGLU), vocabulary vp.
  // A slot's layers L (a model chunk's with chunks; the stage's otherwise), the stage's Ls.
  const int64_t Ls = o.layers >= 0 ? o.layers : cf.num_layers;
  // Under multi-latent attention ct is heads x v_head_dim and qw the fused buffer the core attention reads.
  const int64_t L = Ls / o.pipeline_chunks, c = cf.hidden_size, hd = cf.head_dim(), nh = cf.num_attention_heads / T,
                ng = cf.query_groups() / T, ct = cf.attention_width() / T,
                qw = cf.mla() ? cf.qkv_rows() / T : (nh + 2 * ng) * hd, f = cf.ffn_hidden_size / T,
                ff = (cf.swiglu ? 2 : 1) * f, vp = cf.padded_vocab_size / T, n = m.n, a = m.act_bytes;
  const bool grouped = ng != nh;
  if (m.context_flash && grouped)
    return absl::InvalidArgumentError("memory plan: context parallelism's cuDNN pairs take no query groups");
  m.probs_layers = m.RowsAttention() ? (cf.recompute_activations ? 1 : L) : 0;
  m.logit_chunk_rows = std::clamp<int64_t>(o.logits_budget_bytes / std::max<int64_t>(1, vp * a), 1, n);
  if (o.pipeline_slots > 0 && !o.pipeline_last) m.logit_chunk_rows = 0;  // the LM head is the last stage's
  Adder add{&m};
  AddParameterBuffers(cf, num_params, o, add);
  const std::string act_lower = "--micro-batch-size or --seq-length";
  const int64_t nr = m.sequence_parallel ? n / T : n;  // the residual stream's rows on this rank
  const char* rows_note = m.sequence_parallel ? " (this rank's positions)" : "";
  m.resid = add(fmt::format("activations: residual stream (layers + 1){}", rows_note), (L + 1) * nr * c * a, act_lower);
  m.resid_mid = add(fmt::format("activations: residual after attention{}", rows_note), L * nr * c * a, act_lower);
  m.ln1 = add("activations: input LayerNorm", L * n * c * a, act_lower);
  m.ln1_stats = add("activations: input LayerNorm statistics", L * 2 * n * 4, act_lower);
  m.qkv = add("activations: QKV", L * n * qw * a, act_lower);
  if ((cf.qk_layernorm || cf.qk_l2_norm) &&
      !cf.mla()) {  // inside the slot's activations: a pipeline stage keeps them per micro-batch
    m.qk_rows = nh + ng;
    m.qk_stats_per_layer = (cf.normalization == Normalization::kRMSNorm || cf.qk_l2_norm ? 1 : 2) * n * m.qk_rows;
    m.qkv_raw = add("activations: QKV before the query and key norms", L * n * qw * a, act_lower);
    m.qk_stats = add("activations: query and key norm statistics", L * m.qk_stats_per_layer * 4, act_lower);
  }
  m.atty = add("activations: attention output", L * n * ct * a, act_lower);
  if (cf.attention_output_gate) {  // --attention-output-gate: the gate and the core attention's output before it
    m.gate = add("activations: attention output gate", L * n * ct * a, act_lower);
    m.att_pre = add("activations: attention output before the gate", L * n * ct * a, act_lower);
  }
  if (cf.mla()) {  // multi-latent attention's latents per layer (mla_plan.h)
    m.mla_saved_bytes = PlanMlaBuffers(MlaShapeOf(cf, m.b, t, T, a)).saved_bytes;
    m.mla_saved = add("activations: multi-latent attention latents", L * m.mla_saved_bytes, act_lower);
  }
  AddAttentionSaved(o, L, nh, act_lower, add);
  m.ln2 = add("activations: pre-MLP LayerNorm", L * n * c * a, act_lower);
  m.ln2_stats = add("activations: pre-MLP LayerNorm statistics", L * 2 * n * 4, act_lower);
  // The dense MLP's fc1 and activation for the slot's dense layers only: a MoE layer keeps its own (moe_saved).
  const int64_t Ld = L - (cf.num_experts > 0 ? MoeLayersIn(cf, 0, L) : 0);
  m.fc1 = add(cf.swiglu         ? "activations: MLP fc1 (SwiGLU's gate and up)"
              : cf.squared_relu ? "activations: MLP fc1 (pre-squared-ReLU)"
                                : "activations: MLP fc1 (pre-GELU)",
              Ld * n * ff * a, act_lower);
  m.gelu = add(cf.swiglu         ? "activations: MLP SwiGLU"
               : cf.squared_relu ? "activations: MLP squared ReLU"
                                 : "activations: MLP GELU",
               Ld * n * f * a, act_lower);
  m.lnf = add("activations: final LayerNorm", n * c * a, act_lower);
  m.lnf_stats = add("activations: final LayerNorm statistics", 2 * n * 4, act_lower);
  m.slot_bytes = add.offset - m[m.resid].offset;
  m.slot_layers = L;
  m.logits = add(fmt::format("logits ({} rows x padded vocabulary {}{})", m.logit_chunk_rows, vp,
                             T > 1 ? " (this rank's slice)" : ""),
                 m.logit_chunk_rows * vp * a, "nothing needed: the logits are computed in chunks");
  m.losses = add("per-token losses", n * 4);
  m.dloss = add("per-token loss weights", n * 4);
  AddScratchBuffers(cf, o, nr, c, ct, qw, f, grouped, rows_note, act_lower, add);
  if (cf.num_experts > 0) {  // the MoE layers' router, dispatch plan and experts' rows (moe_plan.h)
    const MoeBuffers moe = PlanMoeBuffers(MoeShapeOf(cf, n, a));
    m.moe_layers = MoeLayersIn(cf, 0, L);
    m.moe_saved_bytes = moe.saved_bytes;
    m.moe_saved = add("activations: mixture-of-experts layers (routing, dispatch, experts' rows)",
                      m.moe_layers * moe.saved_bytes, act_lower + ", or --moe-router-topk");
    m.moe_scratch = add("scratch: mixture-of-experts layer", moe.scratch_bytes, act_lower);
  }
  m.inputs = add("micro-batch inputs (tokens, labels, positions, loss weights)", InputBytes(n));
  m.streams = add("dropout stream keys", StreamTableSize(Ls, m.b) * 8);
  m.reduce = add("reduction scratch (gradient norm, overflow flag)", (o.reduce_doubles + 2) * 8);
  AddParallelBuffers(o, nr, c, act_lower, add);
  if (o.context > 1) AddContextBuffers(o.context, qw, ct, ng * hd, nh, act_lower, add);
  m.workspace = add("cuBLASLt / cuDNN workspace", o.workspace_bytes);
  m.total_bytes = add.offset;
  return m;
}

int64_t PlanHeadroomBytes(int64_t free_bytes) { return std::max<int64_t>(int64_t{1} << 30, free_bytes / 20); }

absl::StatusOr<MemoryPlan> PlanMemoryWithin(const GPTConfig& cf, int64_t num_params, PlanOptions o,
                                            int64_t free_bytes) {
  if (o.logits_budget_bytes > 0) return PlanMemory(cf, num_params, o);
  // A tensor group's ranks run the vocabulary-parallel loss's collectives per chunk of rows: they must
  // cut the same chunks, which this rank's free memory (another rank's differs) must not decide.
  if (o.tensor > 1) {
    o.logits_budget_bytes = kDefaultLogitsBudget;
    return PlanMemory(cf, num_params, o);
  }
  const int64_t t = o.seq_length > 0 ? o.seq_length : cf.seq_length;
  const int64_t a = o.precision == Precision::kFp32 ? 4 : 2;
  const int64_t row_bytes = std::max<int64_t>(1, cf.padded_vocab_size / std::max<int64_t>(1, o.tensor) * a);
  o.logits_budget_bytes = std::max<int64_t>(1, o.micro_batch_size * t) * row_bytes;  // every row: one chunk
  PTK_ASSIGN_OR_RETURN(MemoryPlan whole, PlanMemory(cf, num_params, o));
  const int64_t room = free_bytes - PlanHeadroomBytes(free_bytes);
  if (whole.total_bytes <= room) return whole;
  // What the other buffers leave, in whole tiles of rows.
  const int64_t others = whole.total_bytes - Align(whole[whole.logits].bytes);
  const int64_t rows = (room - others) / row_bytes / kLogitRowTile * kLogitRowTile;
  o.logits_budget_bytes = std::max({rows, kLogitRowTile}) * row_bytes;
  o.logits_budget_bytes = std::max(o.logits_budget_bytes, kDefaultLogitsBudget / row_bytes * row_bytes);
  return PlanMemory(cf, num_params, o);
}

std::vector<int64_t> LogitChunks(int64_t n, int64_t cap) {
  std::vector<int64_t> chunks;
  if (n <= 0) return chunks;
  cap = std::max<int64_t>(1, cap);
  if (n <= cap) return {n};
  if (cap < kLogitRowTile) {
    const int64_t k = (n + cap - 1) / cap;
    for (int64_t i = 0; i < k; ++i) chunks.push_back(n / k + (i < n % k ? 1 : 0));
    return chunks;
  }
  const int64_t tiles = (n + kLogitRowTile - 1) / kLogitRowTile, per = cap / kLogitRowTile;
  const int64_t k = (tiles + per - 1) / per;
  for (int64_t i = 0; i < k; ++i) chunks.push_back((tiles / k + (i < tiles % k ? 1 : 0)) * kLogitRowTile);
  chunks.back() -= tiles * kLogitRowTile - n;
  return chunks;
}

}  // namespace ptk::cuda
