// The CUDA backend's device memory, planned once from the configuration: every buffer by name
// and size (parameters, the fp32 master copy, gradients, AdamW moments, activations, workspace),
// laid out in one allocation. Pure host code: CI checks the plan without a GPU, and an
// out-of-memory message can name the buffers and what to lower.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/gpt_model.h"

namespace ptk::cuda {

struct PlannedBuffer {
  std::string name;    // e.g. "activations: attention probabilities (per layer)"
  int64_t bytes = 0;   // the whole buffer (all layers)
  int64_t offset = 0;  // from the start of the allocation, kAlignment-aligned
  std::string lower;   // what shrinks it, for the out-of-memory message
};

// Every buffer of the CUDA model; each field is an index into `buffers`.
struct MemoryPlan {
  static constexpr int64_t kAlignment = 256;

  // The shape it was planned for.
  int64_t b = 0, t = 0, n = 0;   // n = b * t tokens
  int64_t logit_chunk_rows = 0;  // rows of the (rows, padded vocab) logits buffer
  int64_t act_bytes = 0;         // bytes of one activation element (4 fp32, 2 bf16/fp16)
  bool flash = false;            // bf16/fp16: fused attention, no t x t matrix
  int64_t probs_layers = 0;      // fp32: layers whose probabilities are kept (1 with recompute)

  std::vector<PlannedBuffer> buffers;
  int64_t total_bytes = 0;

  // Parameters and optimizer. bf16/fp16 under ZeRO-1 (master_sharded): `master` holds the fp32
  // master of this rank's shard only, as Megatron's distributed optimizer keeps it, and
  // `ln_master` the LayerNorms' fp32 weights and biases whole (the kernels read them in fp32;
  // LayerNormParamCount floats, in the layout's order). Otherwise `master` holds every parameter
  // and ln_master is -1.
  bool master_sharded = false;
  int master = -1, ln_master = -1, compute = -1, grads = -1, exp_avg = -1, exp_avg_sq = -1;
  // --apply-layernorm-1p: the norms' weights as the kernels read them, 1 + gamma (LayerNormParamCount
  // floats, ln_master's order; refreshed at each forward pass). -1 without it.
  int norm_eff = -1;
  // Activations kept for backward (per layer unless said otherwise).
  // fc1 is SwiGLU's [gate; up] (twice the ffn width) under --swiglu, gelu its activation's output.
  int resid = -1, resid_mid = -1, ln1 = -1, ln1_stats = -1, qkv = -1, atty = -1, attn_saved = -1, ln2 = -1,
      ln2_stats = -1, fc1 = -1, gelu = -1, lnf = -1, lnf_stats = -1;
  // --qk-layernorm (-1 without): the QKV product before the query and key norms (qkv holds it
  // normalised, then rotated), (L, n, qkv width); the norms' fp32 statistics per layer, token and
  // normalised head (this rank's query heads and groups: qk_rows per token), the mean then rstd under
  // LayerNorm (qk_stats_per_layer floats a layer: 2 x n x qk_rows), rstd alone under RMSNorm.
  int qkv_raw = -1, qk_stats = -1;
  int64_t qk_rows = 0, qk_stats_per_layer = 0;
  // --attention-output-gate (-1 without): per layer the gate (n, attention width) and the core attention's output
  // before it (atty holds the gated output, proj's input); scratch: the fused QKV-and-gate product (its gradient in
  // backward) and the gate's gradient.
  int gate = -1, att_pre = -1, qkv_fused = -1, dgate = -1;
  // --softmax-type off-by-one (-1 otherwise): the offset's zeros, one per head of this rank (fp32, zeroed by Plan).
  int sink_zeros = -1;
  // The Llama line (empty otherwise): RoPE's fp32 cos and sin tables (t, rotary dim / 2) each,
  // computed once on the host; SwiGLU's output gradient (fc2's input gradient, before SwiGLU's
  // backward); with grouped-query attention in bf16/fp16, a layer's QKV and its gradient heads
  // first (cuDNN's layout, QkvGroupsToHeads).
  int rope_tables = -1, dact = -1, qkv_heads = -1, dqkv_heads = -1;
  // Scratch of one pass.
  int logits = -1, losses = -1, dloss = -1, tmp = -1, dresid = -1, dtmp = -1, dln = -1, dff = -1, dqkv = -1, datt = -1,
      attn_scratch = -1, ln_scratch = -1, inputs = -1, streams = -1, reduce = -1, workspace = -1;
  // --qk-layernorm's backward: the weight and bias gradients' per-block partial sums (doubles).
  int qk_scratch = -1;
  // Tensor parallelism (PlanOptions::tensor > 1; else empty): an fp32 (n, hidden) buffer for the
  // group's sums and the vocabulary-parallel loss's per-row statistics.
  int tp_sum = -1, tp_xent = -1;
  int64_t tensor = 1;
  // A pipeline stage (PlanOptions::pipeline_slots > 0; else empty): the activations above (resid
  // through lnf_stats, slot_bytes apart) are slot 0's, `pipeline_slots` holds slots 1.. of the
  // micro-batches in flight; `pipeline_head_grads` (the last stage) each slot's final-norm gradient
  // (n, hidden), which the LM head leaves at the forward for the slot's backward;
  // `pipeline_exchange` the fp32 (n, hidden) activation or gradient to or from the host, cast
  // through it under the host exchange in bf16/fp16 (PlanOptions::pipeline_host_exchange; empty
  // otherwise: the direct exchange receives into and sends from each slot's residual stream, its
  // first and last layer's (n, hidden), and the residual gradient, in the model's dtype, and fp32's
  // host exchange copies straight into them).
  // With model chunks (PlanOptions::pipeline_chunks > 1, Megatron's interleaved schedule) a slot
  // holds one chunk's layers (layers / chunks: the per-layer activations above are that many
  // layers deep; the dropout streams stay the stage's), and `pipeline_output_grads` each slot's
  // output gradient (nr, hidden) for the direct exchange (several wait for their backwards).
  int pipeline_slots = -1, pipeline_head_grads = -1, pipeline_exchange = -1, pipeline_output_grads = -1;
  int64_t slots = 0, slot_bytes = 0, slot_layers = 0;
  // --sequence-parallel (PlanOptions::sequence_parallel with tensor > 1): the residual stream, the
  // residual after attention and the residual gradient hold this rank's n / tensor rows (its
  // positions of every sample); the norms' outputs stay whole (all-gathered, what the column-parallel
  // products and their weight gradients read). sp_stage: the collectives' staging, fp32 (n, hidden),
  // then this rank's rows' positions (int32).
  bool sequence_parallel = false;
  int sp_stage = -1;
  // Tensor parallelism with --sequence-parallel or --qk-layernorm: the partial gradients' one sum
  // over the tensor group after backward (GPTModel::SumNonTensorParallelGrads through
  // AllReduceGradRanges), PlanOptions::non_tensor_parallel_grads floats gathered from their ranges.
  int ntp_grads = -1;
  // Context parallelism (PlanOptions::context > 1; else empty): t is this rank's positions of a sample,
  // the probabilities are (b, heads, t, context * t); cp_positions every rank's positions (int64,
  // ContextParallelPositionTable), cp_gathered the group's QKV rows all-gathered (context pieces of
  // (n, qkv width) fp32; backward's key and value gradient shares), cp_whole and cp_dwhole the whole
  // samples' QKV and their key and value gradients (context * n rows; cp_whole receives the shares).
  // In bf16/fp16 the attention is the same fp32 one (attn_saved holds its probabilities, attn_scratch its
  // backward's scratch): the group's rows are all-gathered in the activation type through cp_whole's room and
  // widened into cp_gathered; cp_rows is this rank's fp32 attention output, then its gradient ((n, heads x
  // head dim)), cp_dqkv its fp32 QKV gradient ((n, qkv width)), both narrowed or widened at the op's edges
  // (-1 in fp32).
  // With context_flash (bf16/fp16 without attention dropout or query groups: cuda_context_parallel.cpp's cuDNN
  // pairs, context_flash.h) attn_saved holds each layer's merged log-sum-exps instead ((2, b, heads, t/2) fp32
  // per layer, every layer: the output and stats kept, nothing recomputed), cp_gathered the group's rows in the
  // activation type, cp_whole this rank's fp32 key/value gradient shares (context pieces), cp_dwhole the others'
  // shares received, cp_rows the fp32 merged output, cp_dqkv the fp32 QKV gradient; cp_part_out a pair's partial
  // output or dQ (n/2, heads x head dim), cp_part_kv its dK and dV (2 x (n/2, groups x head dim)) in the
  // activation type, cp_part_stats its log-sum-exp ((b, heads, t/2) fp32).
  int64_t context = 1;
  bool context_flash = false;
  int cp_positions = -1, cp_gathered = -1, cp_whole = -1, cp_dwhole = -1, cp_rows = -1, cp_dqkv = -1;
  int cp_part_out = -1, cp_part_kv = -1, cp_part_stats = -1;
  // Mixture of experts (GPTConfig::num_experts > 0; else -1): moe_saved holds moe_layers regions of
  // moe_saved_bytes, MoE layer k's (k counting the slot's MoE layers in order) what its backward reads, and
  // moe_scratch one layer's pass scratch (trainer/cuda/moe_plan.h's PlanMoeBuffers).
  int moe_saved = -1, moe_scratch = -1;
  int64_t moe_layers = 0, moe_saved_bytes = 0;
  // Multi-latent attention (GPTConfig::mla; else -1): mla_saved holds a region of mla_saved_bytes per layer of the
  // slot, what its projections' backward reads, mla_scratch one pass's scratch (trainer/cuda/mla_plan.h's
  // PlanMlaBuffers), mla_rope MLA's own rotary tables (fp32 cos, then sin: t x qk_pos_emb_head_dim / 2 each). qkv
  // is then the fused buffer the core attention reads (per head its query, key and value) and atty heads x
  // v_head_dim wide.
  int mla_saved = -1, mla_scratch = -1, mla_rope = -1;
  int64_t mla_saved_bytes = 0;
  // The attention keeps fp32 probabilities (fp32, or context parallelism's rows attention), not statistics.
  bool RowsAttention() const { return !flash || (context > 1 && !context_flash); }

  const PlannedBuffer& operator[](int i) const { return buffers[static_cast<size_t>(i)]; }
  // "name: 1.23 GiB" for the largest buffers, largest first.
  std::string Largest(int count) const;
};

inline constexpr int64_t kDefaultLogitsBudget = int64_t{256} << 20;

struct PlanOptions {
  Precision precision = Precision::kFp32;
  int64_t micro_batch_size = 1;
  int64_t seq_length = 0;                              // 0: the config's
  int64_t logits_budget_bytes = kDefaultLogitsBudget;  // the logits are computed in chunks of rows within this
  int64_t workspace_bytes = 64 << 20;                  // cuBLASLt and cuDNN
  int64_t attention_scratch_floats = 0;                // the fp32 attention backward's (RowsAttention)
  int64_t reduce_doubles = 0;                          // SumSquaresPartials of the parameter count
  // ZeRO-1 (--use-distributed-optimizer): the parameter and gradient buffers padded to the shard
  // layout's padded size (0: the parameter count), the moments for this rank's shard only (-1: all);
  // in bf16/fp16 the fp32 master too.
  int64_t padded_params = 0;
  int64_t moment_params = -1;
  int64_t layernorm_scratch_floats = 0;  // LayerNormBackwardScratch of the tokens and hidden size
  // Tensor parallelism: this rank's slices (heads, ffn columns, vocabulary rows: each / tensor) and
  // the fp32 buffer the tensor group's all-reduces and the vocabulary-parallel loss go through.
  int64_t tensor = 1;
  // A pipeline stage: its transformer layers (-1: the config's num_layers), the micro-batches whose
  // activations it keeps at once (0: not a stage), and whether it is the last (the LM head's
  // gradient kept per slot).
  int64_t layers = -1;
  int64_t pipeline_slots = 0;
  int64_t pipeline_chunks = 1;  // model chunks of the stage (the interleaved schedule); layers divide by it
  bool pipeline_last = false;
  bool pipeline_host_exchange = false;  // CudaModelOptions::unfused.pipeline_host_exchange, or a host communicator
  // Megatron's sequence parallelism on the tensor group (MemoryPlan::sequence_parallel); the
  // sequence length must divide by `tensor`.
  bool sequence_parallel = false;
  // The floats of the gradients summed over the tensor group after backward
  // (NonTensorParallelGradRanges': sequence parallelism's, or --qk-layernorm's query and key norms).
  int64_t non_tensor_parallel_grads = 0;
  int64_t qk_norm_scratch_doubles = 0;  // QKNormBackwardScratch of this rank's shape (--qk-layernorm)
  // Context parallelism's ranks (--context-parallel-size; with sequence_parallel too): seq_length is then this
  // rank's positions of a sample (MemoryPlan::context). context_flash: bf16/fp16's cuDNN pairs (the model sets it
  // with attention dropout 0 and no query groups; MemoryPlan::context_flash).
  int64_t context = 1;
  bool context_flash = false;
};

// Number of uint64 dropout streams a pass keys: per layer (and the embedding, as layer L), four
// sites (embedding, attention output, MLP output, attention probabilities), b rows each.
inline int64_t StreamTableSize(int64_t num_layers, int64_t b) { return (num_layers + 1) * 4 * b; }
inline int64_t StreamIndex(int64_t layer, int64_t site, int64_t b) { return (layer * 4 + site) * b; }

// The bytes a micro-batch's host inputs take in the pinned staging buffer (and on the device):
// tokens, labels, positions (int32) and the per-token loss weights (fp32), 256-byte aligned each.
int64_t InputBytes(int64_t n);

// The norms' parameters (every layer's two, and the final one): weight and bias (LayerNorm) or the
// weight alone (RMSNorm), hidden size each; with --qk-layernorm each layer's query and key norms
// too, head_dim each (whole on every tensor rank).
// Under multi-latent attention --qk-layernorm's are the latent norms instead: q_lora_rank (with one) and
// kv_lora_rank each.
inline int64_t LayerNormParamCount(const GPTConfig& config) {
  const int64_t tensors = config.normalization == Normalization::kRMSNorm ? 1 : 2;
  const int64_t qk = !config.qk_layernorm ? 0
                     : config.mla()       ? config.q_lora_rank + config.kv_lora_rank
                                          : 2 * config.head_dim();
  return tensors * ((2 * config.num_layers + 1) * config.hidden_size + config.num_layers * qk);
}

// Where the norms' parameters lie in the flat layout, as runs of adjacent tensors (a layer's
// LayerNorm weight and bias are neighbours, as are its query and key norms'), in layout order;
// `compact` is the run's start in ln_master, where the runs follow each other. Together they hold
// LayerNormParamCount floats (a pipeline stage's runs, its layers' norms and the final one, fewer).
struct LayerNormRun {
  int64_t begin = 0, end = 0, compact = 0;
};
std::vector<LayerNormRun> LayerNormRuns(const ParamLayout& layout);

absl::StatusOr<MemoryPlan> PlanMemory(const GPTConfig& config, int64_t num_params, const PlanOptions& options);

// The rows of a logits chunk are a multiple of this (a product tile) unless the whole head is one
// chunk or the budget holds fewer rows.
inline constexpr int64_t kLogitRowTile = 128;

// Device memory left outside the plan (cuBLAS, cuDNN and NCCL allocate their own): 1 GiB or 5% of
// the free memory, whichever is larger.
int64_t PlanHeadroomBytes(int64_t free_bytes);

// The plan within `free_bytes` of device memory (a figure from cudaMemGetInfo, or a test's): with
// options.logits_budget_bytes 0, the logits take all n rows (the LM head in one chunk) when
// everything fits within free_bytes less PlanHeadroomBytes; otherwise they take what is left beyond
// the other buffers, in whole tiles of rows (at least one tile, or the default 256 MiB budget
// when that is larger), and the head runs in chunks. A positive logits_budget_bytes is used as
// given (a test hook). Under tensor parallelism (options.tensor > 1) a logits_budget_bytes of 0 is
// the default 256 MiB whatever free_bytes says: the vocabulary-parallel loss's collectives run per
// chunk, so every rank of the tensor group must cut the same chunks, and their free memory differs.
// Whether the plan then fits is the caller's check.
absl::StatusOr<MemoryPlan> PlanMemoryWithin(const GPTConfig& config, int64_t num_params, PlanOptions options,
                                            int64_t free_bytes);

// The LM head's chunks of rows over n rows with a buffer of `cap` rows: as few chunks as fit, in
// balanced sizes, each a whole number of kLogitRowTile tiles (the last one less what n lacks of a
// tile) when cap holds a tile, otherwise sizes that differ by at most one row. Sums to n, each at
// most cap.
std::vector<int64_t> LogitChunks(int64_t n, int64_t cap);

// A pipeline stage's re-plan for a micro-batch larger than the plan (CudaGPTModelImpl::PlanStage,
// before `slot` receives its input or runs its forward pass): the plan is laid out again for the
// larger shape, which keeps the parameters and the optimizer's state and no activation. A slot
// whose forward pass ran (`live`, bit k: slot k; its activations fill every layer until its
// backward) cannot move: refused (FailedPrecondition naming the slots), unless it is `slot` itself
// (its forward pass overwrites it). A slot that has received its input and not yet run its forward
// (`received`: the previous stage's output in its first residual layer, `slot` itself among them)
// is carried: its input copied out before the re-plan and back into the new plan after it, so an
// activation received ahead of its forward is never lost.
struct StageReplan {
  bool replan = false;       // false: the plan holds the micro-batch already
  int64_t b = 0, t = 0;      // the shape to plan (the larger of the plan's and the micro-batch's)
  std::vector<int> carried;  // the received slots whose inputs cross the re-plan, ascending
};
absl::StatusOr<StageReplan> PlanStageReplan(int64_t planned_b, int64_t planned_t, int64_t b, int64_t t, int slot,
                                            uint64_t live, uint64_t received);

// "1.50 GiB", "12.0 MiB", "512 B".
std::string FormatBytes(int64_t bytes);

}  // namespace ptk::cuda
