// What the readers of Megatron-LM checkpoints share (its `torch` format, its `torch_dist` format and
// the distributed optimizer's distrib_optim.pt): the model's parameters as Megatron names and splits
// them, the args Namespace read into a GPTConfig, and the ptk checkpoint written from what was read.
// Internal to interop/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_gpt2.h"
#include "interop/megatron_optim.h"
#include "interop/torch_format.h"
#include "trainer/checkpoint.h"

namespace ptk::megatron {

using torchfmt::PyValue;

std::string ShapeStr(const std::vector<int64_t>& s);
// mp_rank_TT, or mp_rank_TT_PPP with pipeline parallelism.
std::string RankDir(int64_t tp, int64_t pp, int64_t num_pp);
int64_t Elements(const std::vector<int64_t>& s);

// One ptk parameter as Megatron holds it: which pipeline stage, its name there (per layer spec), how
// tensor parallelism splits it.
struct MegParam {
  const ParamInfo* info = nullptr;
  int64_t stage = 0;
  std::string te_name, local_name;  // within the stage (layers renumbered from 0)
  int split = -1;                   // -1 replicated, 0 rows (column-parallel), 1 columns (row-parallel)
  int chunks = 1;                   // split 0: blocks of rows each split across the ranks (SwiGLU's [gate; up])
  bool vocab = false;               // rows are the padded vocabulary
  bool decay = false;               // Megatron's first parameter group (weight decay applies)
  bool expert = false;              // an expert's linear_fc1 or linear_fc2 (SequentialMLP's local_experts.K)
};

// The parameters of a model in ptk's layout order (= Megatron's named_parameters order per stage).
absl::StatusOr<std::vector<MegParam>> MegParams(const ParamLayout& layout, int64_t pp);
// A persistent buffer of megatron-core's state dict that is no parameter: a TopKRouter's expert_bias
// (--moe-router-enable-expert-bias; its local_tokens_per_expert is not persistent), fp32, whole on every tensor
// rank. `name` is ptk's (GPTModel::ReadBuffers), `local_name` the stage's (the same under both layer specs).
struct MegBuffer {
  std::string name, local_name;
  int64_t stage = 0;
  int64_t size = 0;
};
// The expert biases of the model MegParams described as `params` (none without the expert bias).
std::vector<MegBuffer> MegBuffers(const GPTConfig& c, const std::vector<MegParam>& params);
// The parameters of pipeline stage `stage` in megatron-core's named_parameters order (what its
// optimizer's parameter groups and its grad buffers follow, and its state_dict lists): ptk's order
// but for each layer's linear_proj, which Attention builds before SelfAttention builds linear_qkv,
// so it comes before linear_qkv (local names) or before the input LayerNorm linear_qkv holds
// (Transformer Engine's names, `te`).
std::vector<const MegParam*> StageOrder(const std::vector<MegParam>& params, int64_t stage, bool te);
// The shape of a rank's shard of `m` when the vocabulary has `vocab_rows` rows.
std::vector<int64_t> ShardShape(const MegParam& m, int64_t vocab_rows, int64_t tp);
// What the distributed optimizer's grad buffer holds of pipeline stage `stage` of `pp` on a tensor
// rank (of `tp`): StageOrder's parameters (their `te` or local names) at their shards' sizes, the
// vocabulary of `vocab_rows` rows; with tied embeddings over several stages (`tied_copy`) the first
// stage's word embeddings and the last stage's output_layer.weight copy (of `hidden` columns) are
// the shared embedding.
std::vector<DistribParam> StageDistribParams(const std::vector<MegParam>& params, int64_t stage, int64_t pp, bool te,
                                             bool tied_copy, int64_t vocab_rows, int64_t tp, int64_t hidden);
// The grad buffers of pipeline rank `p`'s distrib_optim.pt: one per model chunk (of `vp`), chunk v
// holding StageDistribParams of virtual stage v * pp + p of pp * vp (names prefixed "model{v}." when
// vp > 1, as the import keys an interleaved run's tensors); chunk 0 bucketed as DistribBucketSize(args,
// p) says, the later chunks in one bucket each (Megatron-LM's get_model: disable_bucketing for them).
std::vector<DistribBuffer> RankDistribBuffers(const std::vector<MegParam>& params, int64_t p, int64_t pp, int64_t vp,
                                              bool te, bool tied_copy, int64_t vocab_rows, int64_t tp, int64_t hidden,
                                              const PyValue* args);
// Copies shard `t` of the (rows, cols) matrix `full` (split along `split`) into `shard`, or back
// when `gather`. With split 0 and `chunks` > 1 the rows are that many blocks, each split across the
// ranks, and a shard holds its rows of each block in turn (fc1 of SwiGLU: rank t's [gate_t; up_t]).
void CopyShard(float* full, float* shard, int64_t rows, int64_t cols, int split, int64_t t, int64_t tp, bool gather,
               int chunks = 1);

// Small helpers over pickled values: an attribute of a Namespace (or a dict entry) as a number,
// string or bool; a dict's entry under an integer key.
std::optional<double> NumAttr(const PyValue* ns, const char* key);
std::optional<std::string> StrAttr(const PyValue* ns, const char* key);
bool BoolAttr(const PyValue* ns, const char* key, bool fallback);
const PyValue* IntKey(const PyValue* dict, int64_t key);

// The model Megatron's args describe, checked (features ptk's model lacks refused naming the flag;
// the Llama line's: --normalization, --position-embedding-type, --rotary-base/-percent,
// --use-rope-scaling, --swiglu, --group-query-attention/--num-query-groups, --kv-channels,
// --disable-bias-linear, --add-qkv-bias, --norm-epsilon, read as Megatron names them;
// the vocabulary: --true-vocab-size, args.vocab_size, or GPT-2's), for a checkpoint saved at
// tensor-parallel size `tp`. `source` names the file in errors.
struct MegatronModel {
  GPTConfig config;
  int64_t ckpt_padded = 0;  // args.padded_vocab_size: the rows the checkpoint's vocabulary tensors have
  int64_t divisible = 128;  // args.make_vocab_size_divisible_by
};
absl::StatusOr<MegatronModel> ModelFromArgs(const PyValue* args, const std::string& source, const ConvertOptions& o,
                                            int64_t tp);

// The training state (iteration, samples, seed, schedule, loss scale from `root`'s
// opt_param_scheduler and optimizer.grad_scaler) and the ptk checkpoint of `weights`, `m1`, `m2`
// written into --save-dir; fills s->destination, num_params, train_flags. `reader` reads root's
// tensors (the loss scale). `optimizer_state`: the checkpoint held the AdamW moments; one without
// them is recorded as such (kOptimizerStateSetting), so that ptk-train --load refuses it unless
// --no-load-optim or --finetune, as Megatron's load_checkpoint does. s->release: Megatron's load of a
// release checkpoint, iteration 0 and neither the optimizer state nor the scheduler (the consumed
// samples kept, as its load keeps them).
// What the notes of an import without optimizer state add (SaveImported records it as such).
inline constexpr char kNoOptimizerLoad[] =
    "; ptk-train --load takes it only with --no-load-optim or --finetune, as Megatron's load_checkpoint";
absl::Status SaveImported(const ConvertOptions& o, const PyValue* args, const PyValue& root,
                          torchfmt::TorchArchiveReader* reader, const ParamLayout& layout, int64_t divisible,
                          bool optimizer_state, int64_t adam_step, const std::vector<float>& weights,
                          const std::vector<float>& m1, const std::vector<float>& m2, ConvertSummary* s,
                          ModelBuffers buffers = {});

// Megatron's mixture of experts (interop/megatron_moe.cpp). SetMoeArgs: the args that mark `c`'s MoE layers
// (num_experts, moe_*; one expert rank, SequentialMLP, the experts split over the `tp` tensor ranks), or
// num_experts None for a dense model, into the args Namespace's dict `a`. ReadMoeArgs: the MoE layers args
// describe into `c` (nothing for a dense model; shared experts, the z-loss, scaling, group-limited routing, the
// expert bias, token dropping and the load-balancing types included); what ptk's MoE layers do not compute
// (grouped GEMM, expert parallelism, input jitter, ...) refused naming `source` and each flag.
void SetMoeArgs(const GPTConfig& c, int64_t tp, PyValue* a);
absl::Status ReadMoeArgs(const PyValue* args, const std::string& source, int64_t tp, GPTConfig* c);
// An imported MoE model's settings (as ptk-train records them) and ptk-train's flags for it ("" when dense).
void AddMoeSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings);
std::string MoeTrainFlags(const GPTConfig& c);

// Megatron's multi-latent attention (interop/megatron_mla.cpp). SetMlaArgs: args.multi_latent_attention and, for an
// MLA model `c`, MLATransformerConfig's args (q_lora_rank None or a rank, kv_lora_rank, qk_head_dim,
// qk_pos_emb_head_dim, v_head_dim, rope_type, rotary_scaling_factor, mscale, mscale_all_dim) into `a`. ReadMlaArgs:
// those args into `c` (nothing without args.multi_latent_attention), what ptk's MLA does not compute or read (YaRN
// settings other than megatron-core's defaults, fused down projections) refused
// naming `source`. CheckMlaExport: a tensor-parallel target the local spec's down projections do not divide, refused
// naming `file`. SplitMlaDown: the down projections' split in `params` (MegParams') under the `te` or local spec:
// whole on every rank (TELinear, "duplicated") or by rows (ColumnParallelLinear); the up projections and linear_q_proj
// are column-parallel by heads, linear_proj row-parallel, the latent norms whole (MegParams). AddMlaSettings /
// MlaTrainFlags: an
// imported MLA model's settings (as ptk-train records them) and ptk-train's flags for it ("" without MLA).
void SetMlaArgs(const GPTConfig& c, PyValue* a);
absl::Status ReadMlaArgs(const PyValue* args, const std::string& source, GPTConfig* c);
absl::Status CheckMlaExport(const ConvertOptions& o, const GPTConfig& c, const std::string& file);
void SplitMlaDown(bool te, std::vector<MegParam>* params);
void AddMlaSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings);
std::string MlaTrainFlags(const GPTConfig& c);

// Megatron's multi-token prediction (interop/megatron_mtp.cpp). SetMtpArgs: args.mtp_num_layers (None without MTP)
// and mtp_loss_scaling_factor into `a`. ReadMtpArgs: them into `c` (nothing without MTP); each depth's eh_proj is
// column-parallel and its transformer_layer split as a decoder layer (MegParams). CheckMtpExport: what the export does
// not write for an MTP model (the distributed optimizer), refused naming `file`. AddMtpSettings / MtpTrainFlags: an
// imported MTP model's settings (as ptk-train records them) and ptk-train's flags for it ("" without MTP).
void SetMtpArgs(const GPTConfig& c, PyValue* a);
absl::Status ReadMtpArgs(const PyValue* args, GPTConfig* c);
absl::Status CheckMtpExport(const ConvertOptions& o, const GPTConfig& c, const std::string& file);
void AddMtpSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings);
std::string MtpTrainFlags(const GPTConfig& c);

// torch_dist's sharded keys (interop/megatron_dist_keys.cpp). DistKeyOf: the key megatron-core gives `m` (a parameter
// of MegParams(layout, 1), or a MegBuffer's name as both names) under the `te` or local spec, and its indices on the
// key's leading axes: the layer (-1: not stacked; `per_layer`: each layer a key of its own) and the routed expert
// (-1: none). DistModelArgs: `args` without
// the experts' parallel layout (grouped GEMM, the expert-parallel and expert-tensor sizes set to ptk's, each noted in
// `notes`), which torch_dist's global tensors do not depend on.
struct DistKey {
  std::string key;
  int64_t layer = -1, expert = -1;
};
DistKey DistKeyOf(const GPTConfig& c, const MegParam& m, bool te, bool per_layer);
torchfmt::PyRef DistModelArgs(const PyValue* args, int64_t tp, std::vector<std::string>* notes);
// The layers a stacked key's saved slices (`present`, per layer) hold against the `layers` of the model `c` that
// have its parameter: a layer missing, or one saved beside them, refused naming `file` and `key`.
absl::Status CheckStackedLayers(const GPTConfig& c, const std::string& file, const std::string& key,
                                const std::vector<bool>& present, const std::vector<int64_t>& layers);
// fully_sharded_model_space's tensor `v`, saved as `saved` ([X/x, Y/y, ..., x*y*...]), back to `shape` ([X, Y, ...]);
// `where` names it in the refusal of a shape of neither form.
absl::StatusOr<std::vector<float>> Unflatten(const std::vector<float>& v, const std::vector<int64_t>& saved,
                                             const std::vector<int64_t>& shape, const std::string& where);

// A torch_dist checkpoint's iteration directory (.metadata, *.distcp, common.pt) -> a ptk checkpoint
// (interop/megatron_dist.cpp). `iteration` is the tracker's (common.pt's wins unless `release`).
absl::StatusOr<ConvertSummary> ImportFromMegatronDist(const ConvertOptions& o, const std::string& iter_dir,
                                                      int64_t iteration, bool release);

}  // namespace ptk::megatron
