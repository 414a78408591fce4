// The parameter layout every backend, checkpoints, interop/, ZeRO-1 (param_shard) and the gradient
// buckets share: the model's configuration and Megatron-core's parameter names, shapes, offsets in
// the one flat buffer, and init. It knows nothing of a backend or a model object, so the trainer's
// lower rooms (the shard, the buckets) need not reach up to the model for it. A tensor- or
// pipeline-parallel partition is meant to be a view of this table (which rank holds which slice of
// which tensor), not another table.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/op_types.h"

namespace ptk {

// Megatron's --normalization and --position-embedding-type.
enum class Normalization { kLayerNorm, kRMSNorm };
enum class PositionEmbedding { kLearnedAbsolute, kRope, kNone };

struct GPTConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t ffn_hidden_size = 0;  // Megatron's default: 4 * hidden_size
  int64_t seq_length = 0;
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;         // the tokenizer's
  int64_t padded_vocab_size = 0;  // rounded up to --make-vocab-size-divisible-by
  bool untie_embeddings_and_output_weights = false;
  double layernorm_epsilon = 1e-5;
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  double init_method_std = 0.02;
  bool recompute_activations = false;  // attention probabilities recomputed in backward (selective)
  // The Llama line (Megatron's defaults: GPT-3's model). layernorm_epsilon is the epsilon of either norm.
  Normalization normalization = Normalization::kLayerNorm;
  PositionEmbedding position_embedding = PositionEmbedding::kLearnedAbsolute;
  double rotary_base = 10000.0;
  double rotary_percent = 1.0;    // the rotated share of each head's channels
  bool use_rope_scaling = false;  // Llama 3.x's frequency scaling (rope_scaling_factor, original context 8192)
  bool swiglu = false;            // fc1 gives [gate; up] (2 x ffn_hidden_size rows), fc2 takes silu(gate) * up
  int64_t num_query_groups = 0;   // 0: one key/value head per query head (multi-head attention)
  int64_t kv_channels = 0;        // the head dimension; 0: hidden_size / num_attention_heads
  bool add_bias_linear = true;    // biases of QKV, proj, fc1, fc2
  bool add_qkv_bias = false;      // the QKV bias even without add_bias_linear
  // Megatron's --rope-scaling-factor (Llama 3.1's 8, Llama 3.2 1B/3B's 32), read with use_rope_scaling only.
  double rope_scaling_factor = 8.0;
  // Megatron's --rotary-seq-len-interpolation-factor: positions divided by it (linear interpolation); 0: none.
  double rotary_seq_len_interpolation_factor = 0;
  // Megatron's --rotary-interleaved: channels (2i, 2i + 1) rotated together (Meta's layout), not (i, i + rd/2).
  bool rotary_interleaved = false;
  // Megatron's --qk-layernorm (Qwen3's q_norm / k_norm): the configuration's norm over each query and
  // each key head's head_dim channels after the QKV projection, before RoPE; one weight (and, for
  // LayerNorm, bias) of head_dim for all query heads, one for all key heads.
  bool qk_layernorm = false;
  // Megatron's --qk-l2-norm (Llama 4's; megatron-core's L2Norm as q_layernorm and k_layernorm): each query and key
  // head times rsqrt(mean(x^2) + layernorm_epsilon), no weights, after the QKV projection, before RoPE.
  bool qk_l2_norm = false;
  // Megatron's --attention-output-gate (Qwen3-Next's gated attention): the QKV projection also gives a gate head per
  // query head (rows per query group: its query heads, their gate heads, the key, the value), and the core
  // attention's output is multiplied by sigmoid(gate) before linear_proj.
  bool attention_output_gate = false;
  // Megatron's --squared-relu: the MLP's activation relu(x)^2 instead of GELU (not with swiglu).
  bool squared_relu = false;
  // Megatron's GELU MLP without its fused bias-GELU kernel (--no-bias-gelu-fusion, or
  // --disable-bias-linear, which turns the fusion off): torch's exact GELU, x/2 (1 + erf(x / sqrt 2)),
  // instead of the tanh approximation (not with swiglu or squared_relu).
  bool gelu_exact = false;
  // Megatron's --apply-layernorm-1p (TransformerConfig.layernorm_zero_centered_gamma): every norm
  // (input, pre-MLP, final, the query and key norms) scales by 1 + weight, its weight initialised to 0.
  bool apply_layernorm_1p = false;
  // Megatron's --init-method-xavier-uniform: every weight matrix (embeddings, QKV, proj, fc1, fc2, the
  // output layer) drawn from U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the whole tensor.
  bool init_method_xavier_uniform = false;
  // Megatron's --embedding-init-method-std (TransformerConfig.embedding_init_method_std): the word and position
  // embeddings' N(0, std), 0 for Megatron's None (init_method_std's, or xavier_uniform's under that flag). Under
  // xavier_uniform a value other than init_method_std draws the embeddings from this normal, as megatron-core's
  // __post_init__ does; the same value keeps them uniform. The output layer's init is init_method_std's either way.
  double embedding_init_method_std = 0;
  // Megatron's mixture of experts (--num-experts; 0: every MLP dense): in each MoE layer
  // (moe_layer_pattern: one 0/1 entry per layer, empty for every layer) a router (num_experts x
  // hidden, no bias) sends each token to its moe_router_topk experts, each an MLP of the dense one's
  // activation with moe_ffn_hidden_size (0: ffn_hidden_size) and no biases (trainer/cpu/moe_cpu.h).
  // moe_router_pre_softmax: the probabilities are the softmax over all experts' logits, not over the
  // chosen ones'. moe_aux_loss_coeff: the switch load-balancing loss's weight (0: none).
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;
  bool moe_router_pre_softmax = false;
  // --moe-router-score-function sigmoid (softmax otherwise; pre_softmax is then not read, as Megatron).
  bool moe_router_sigmoid = false;
  double moe_aux_loss_coeff = 0;
  std::vector<int> moe_layer_pattern;
  // --moe-z-loss-coeff (0: none): the router z-loss's weight (a training setting, as the aux loss's).
  double moe_z_loss_coeff = 0;
  // --moe-router-topk-scaling-factor (0: none): the chosen experts' probabilities times it.
  double moe_router_topk_scaling_factor = 0;
  // Group-limited routing (--moe-router-num-groups, --moe-router-group-topk; group topk 0: none).
  int64_t moe_router_num_groups = 0, moe_router_group_topk = 0;
  // Load balancing (trainer/cpu/moe_balance.cpp): --moe-router-load-balancing-type seq_aux_loss's and
  // global_aux_loss's coefficients (0: that type is off; moe_aux_loss_coeff is aux_loss's), and aux-loss-free
  // routing (--moe-router-enable-expert-bias, sigmoid scores only): a per-layer expert bias added to the scores
  // that choose the top k, moved by moe_router_bias_update_rate after each step (training settings, as the loss's).
  double moe_seq_aux_loss_coeff = 0, moe_global_aux_loss_coeff = 0;
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  // Megatron's shared experts (--moe-shared-expert-intermediate-size; 0: none): in each MoE layer a dense MLP of
  // this width (the experts' activation, no biases) on every token beside the routed experts, its output added to
  // theirs; with moe_shared_expert_gate (--moe-shared-expert-gate) scaled by sigmoid(x . gate_weight) per token.
  int64_t moe_shared_expert_intermediate_size = 0;
  bool moe_shared_expert_gate = false;
  // --moe-expert-capacity-factor (below 0: none, dropless; a training setting, as Megatron's) and
  // --moe-token-drop-policy position (false: probs): the slots over each expert's capacity dropped.
  double moe_expert_capacity_factor = -1;
  bool moe_token_drop_position = false;
  // Megatron's multi-latent attention (--multi-latent-attention, MLATransformerConfig; DeepSeek-V2/V3):
  // each layer's attention is MLASelfAttention of megatron-core's local spec (trainer/cpu/mla_cpu.h):
  // queries from linear_q_proj, or through a q_lora_rank latent (0: Megatron's None); keys and values
  // through a kv_lora_rank latent whose projection also gives the shared rotary key of
  // qk_pos_emb_head_dim channels; per head qk_head_dim + qk_pos_emb_head_dim query and key channels and
  // v_head_dim value channels; with qk_layernorm the norms of both latents (q_layernorm, kv_layernorm).
  // The rotary embedding is MLA's own (whatever position_embedding is): --rope-type rope (mla_yarn false)
  // or yarn, and the softmax scale mscale^2 / sqrt(qk + pe) with mscale = _yarn_get_mscale(
  // rotary_scaling_factor, mscale_all_dim). Megatron-LM's defaults.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;
  int64_t qk_pos_emb_head_dim = 64;
  int64_t v_head_dim = 128;
  bool mla_yarn = true;  // MLATransformerConfig's rope_type default
  double rotary_scaling_factor = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  // Megatron's multi-token prediction (--mtp-num-layers, megatron-core's MultiTokenPredictionBlock; trainer/cpu/
  // mtp_cpu.cpp): mtp_num_layers depths after the decoder, each predicting one token further; their losses
  // weigh mtp_loss_scaling_factor / mtp_num_layers. 0: none.
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  // Megatron's sliding window attention (--window-size W,0, --window-attn-skip-freq; CPU backend): on the layers
  // window_layer() names, a query attends the window_left keys before it and itself (-1: no window anywhere).
  // window_pattern: one 0/1 entry per layer (1: windowed), empty for every layer.
  int64_t window_left = -1;
  std::vector<int> window_pattern;
  // --window-attn-skip-freq N's N (0: a list pattern, or none): the multi-token prediction depths' layers, which
  // megatron-core numbers num_layers + k + 1 after the decoder's, have the window where (that number) % N != 0.
  int64_t window_skip_freq = 0;
  // Megatron's --softmax-type (megatron-core's DotProductAttention): vanilla, off-by-one (a zero logit per
  // head beside each row's scores in its softmax) or learnable (that logit the layer's softmax_offset parameter,
  // one per head, core_attention.softmax_offset in the state dict).
  std::string softmax_type = "vanilla";

  absl::Status Validate() const;
  absl::Status ValidateMoe() const;  // the mixture-of-experts settings (Validate's last part)
  absl::Status ValidateMla() const;  // the multi-latent attention settings
  bool mla() const { return multi_latent_attention; }
  int64_t mla_q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
  // MLA's core attention scale (MultiLatentAttention.softmax_scale).
  double MlaSoftmaxScale() const;
  // The attention's output width (linear_proj's input): heads x head_dim, under MLA heads x v_head_dim.
  int64_t attention_width() const { return num_attention_heads * (mla() ? v_head_dim : head_dim()); }
  bool moe() const { return num_experts > 0; }
  // Megatron's is_layer_window_attention for the 0-based layer l (num_layers + k: multi-token prediction depth k's).
  bool window_layer(int64_t l) const {
    if (window_left < 0 || window_pattern.empty()) return window_left >= 0;
    if (l < static_cast<int64_t>(window_pattern.size())) return window_pattern[static_cast<size_t>(l)] != 0;
    return window_skip_freq > 0 && (l + 1) % window_skip_freq != 0;
  }
  // --window-attn-skip-freq as the settings record it: the layer pattern ("[1,0,1]"), or with multi-token
  // prediction and a count N, N (megatron-core indexes a list at the depths' layer numbers, past its entries).
  std::string WindowSkipFreqSetting() const;
  bool softmax_sink() const { return softmax_type != "vanilla"; }
  bool learnable_softmax() const { return softmax_type == "learnable"; }
  bool moe_layer(int64_t l) const {
    return moe() && (moe_layer_pattern.empty() || moe_layer_pattern[static_cast<size_t>(l)] != 0);
  }
  int64_t moe_layers() const {
    int64_t k = 0;
    for (int64_t l = 0; l < num_layers; ++l) k += moe_layer(l) ? 1 : 0;
    return k;
  }
  int64_t moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_hidden_size; }
  // One expert's floats: fc1 (2 x moe_ffn() rows under SwiGLU, x hidden) and fc2 (hidden x moe_ffn()).
  int64_t expert_floats() const { return ((swiglu ? 2 : 1) + 1) * moe_ffn() * hidden_size; }
  // A MoE layer's shared experts' floats: fc1, fc2 and the gate's weight (0 without shared experts).
  int64_t shared_expert_floats() const {
    return ((swiglu ? 2 : 1) + 1) * moe_shared_expert_intermediate_size * hidden_size +
           (moe_shared_expert_intermediate_size > 0 && moe_shared_expert_gate ? hidden_size : 0);
  }
  // What each norm's weight adds to its input's normalised value: 1 under apply_layernorm_1p.
  float norm_weight_offset() const { return apply_layernorm_1p ? 1.0f : 0.0f; }
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads; }
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  bool qkv_bias() const { return add_bias_linear || add_qkv_bias; }
  bool rope() const { return position_embedding == PositionEmbedding::kRope; }
  // Channels rotated per head (even): int(head_dim * rotary_percent), as Megatron's RotaryEmbedding.
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent); }
  RopeSettings rope_settings() const {
    return {rotary_base, use_rope_scaling ? rope_scaling_factor : 0.0, rotary_seq_len_interpolation_factor,
            rotary_interleaved};
  }
  // Rows of the QKV projection: query heads plus a key and a value head per group.
  // Under MLA the fused buffer the core attention reads (per head its query, key and value).
  int64_t qkv_rows() const {
    if (mla()) return num_attention_heads * (2 * mla_q_head_dim() + v_head_dim);
    return ((attention_output_gate ? 2 : 1) * num_attention_heads + 2 * query_groups()) * head_dim();
  }
  // The gate rows of the QKV projection (--attention-output-gate): one head per query head, else 0.
  int64_t gate_rows() const { return attention_output_gate && !mla() ? num_attention_heads * head_dim() : 0; }
  // Megatron's GPT-3 model (every setting of the Llama line at its default).
  bool gpt3() const {
    return normalization == Normalization::kLayerNorm && position_embedding == PositionEmbedding::kLearnedAbsolute &&
           !swiglu && query_groups() == num_attention_heads && head_dim() * num_attention_heads == hidden_size &&
           add_bias_linear && !qk_layernorm && !mla() && !qk_l2_norm && !attention_output_gate;
  }
};

// Megatron's _vocab_size_with_padding.
int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by);

struct ParamInfo {
  std::string name;  // Megatron-core's parameter name
  std::vector<int64_t> shape;
  int64_t offset = 0, size = 0;
  bool no_weight_decay = false;  // biases and LayerNorm parameters (1-D), as Megatron's param groups
  bool qk_layernorm = false;     // the query and key norms' (--apply-wd-to-qk-layernorm decays them)
  // Megatron's is_embedding_or_output_parameter: the word embeddings (and their copy on a last stage with
  // tied embeddings) and the output layer, on --decoupled-lr's schedule (AdamWGroups).
  bool decoupled_lr = false;
  double init_std = 0.0;      // 0: constant init (see init_value)
  double init_uniform = 0.0;  // > 0: U(-init_uniform, init_uniform) instead (xavier-uniform)
  float init_value = 0.0f;
  // Tensor parallelism (Megatron's partition): -1 every tensor rank holds the whole tensor
  // (LayerNorms, position embeddings, the row-parallel layers' biases); 0 each holds a slice of the
  // rows (vocabulary-parallel embedding and output layer, column-parallel QKV and fc1: weights and
  // biases); 1 a slice of the columns (row-parallel proj and fc2 weights). `shape` is the slice's.
  int tensor_split_dim = -1;
  // With tensor_split_dim 0: the tensor is this many blocks of rows, each split across the ranks
  // (SwiGLU's fc1: [gate; up], each rank holding its gate rows and the matching up rows).
  int tensor_split_chunks = 1;
  // Pipeline parallelism with tied embeddings: the last stage's copy of the word embeddings
  // (Megatron's shared output weight). Its gradient is summed with the first stage's over the
  // embedding group; norms and counts of the whole model count it once, on the first stage.
  bool embedding_copy = false;
  // A mixture-of-experts layer's expert weight (Megatron's allreduce=False parameters): with expert
  // parallelism each expert rank holds its experts' only, reduced over the expert-data-parallel group.
  bool expert = false;
};

// One pipeline stage's part of the model (Megatron's pipeline parallelism): the transformer layers
// [first_layer, first_layer + num_layers), the embeddings on stage 0, the final norm and the output
// layer on the last stage. The default is the whole model.
// With virtual_size V > 1 (Megatron's interleaved schedule) the stage is V model chunks of
// num_layers / V layers each: chunk v holds virtual stage v * size + rank, the layers
// [(v * size + rank) * n, + n) with n = num_layers / V (every stage as many layers); first_layer is
// chunk 0's. The embeddings are chunk 0's of stage 0, the final norm and output layer chunk V - 1's
// of the last stage.
struct PipelineStage {
  int size = 1, rank = 0;
  int64_t first_layer = 0, num_layers = -1;  // -1: every layer
  int virtual_size = 1;
};
// Stage `rank` of the stages whose layer counts are `stage_layers` (PipelineStageLayers), in
// `virtual_size` model chunks (even stages only).
PipelineStage StageOf(const std::vector<int64_t>& stage_layers, int rank, int virtual_size = 1);
// The mixture-of-experts layers among `stage`'s (its chunks' layers, as ParamLayout cuts them); 0 for a
// dense model.
int64_t MoeLayersOnStage(const GPTConfig& config, const PipelineStage& stage);

// Offsets of one transformer layer's tensors in the flat parameter (and gradient) buffer; -1 for
// a tensor the model has not (biases without add_bias_linear, norm biases under RMSNorm, the query
// and key norms without qk_layernorm).
struct LayerParams {
  int64_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
  int64_t q_norm_w = -1, q_norm_b = -1, k_norm_w = -1, k_norm_b = -1;
  // A mixture-of-experts layer (GPTConfig::moe_layer; fc1 and fc2 are then -1): the router's weight,
  // and the experts' weights (expert j's fc1 then fc2 at experts + j x GPTConfig::expert_floats()).
  int64_t router_w = -1, experts = -1;
  // Its shared experts (GPTConfig::moe_shared_expert_intermediate_size; -1 without): fc1, fc2 and the gate's
  // weight (-1 without moe_shared_expert_gate), after the experts in Megatron's order.
  int64_t shared_fc1 = -1, shared_fc2 = -1, shared_gate = -1;
  // A multi-latent attention layer (GPTConfig::mla; qkv_w and qkv_b are then -1): its projections and
  // latent norms (q_proj without a q_lora_rank, q_down, q_up and q_norm with one; norms with qk_layernorm).
  int64_t mla_q_proj = -1, mla_q_down = -1, mla_q_norm_w = -1, mla_q_norm_b = -1, mla_q_up = -1;
  int64_t mla_kv_down = -1, mla_kv_norm_w = -1, mla_kv_norm_b = -1, mla_kv_up = -1;
  // --softmax-type learnable: the core attention's softmax_offset (this rank's heads), -1 otherwise.
  int64_t softmax_offset = -1;
};

// Where every parameter lives in the one flat buffer: Megatron-core's names and order, shared by
// every backend and by checkpoints.
// One multi-token prediction depth's tensors (megatron-core's MultiTokenPredictionLayer, registered after the
// decoder, before output_layer): enorm, hnorm, eh_proj (hidden x 2 hidden, no bias), its transformer layer and
// final_layernorm. Norm biases -1 under RMSNorm.
struct MtpLayerParams {
  int64_t enorm_w = -1, enorm_b = -1, hnorm_w = -1, hnorm_b = -1, eh_proj = -1, norm_w = -1, norm_b = -1;
  LayerParams layer{};
};

struct ParamLayout {
  GPTConfig config;
  std::vector<ParamInfo> infos;
  std::vector<LayerParams> layers;
  std::vector<MtpLayerParams> mtp;                 // GPTConfig::mtp_num_layers of them (on the last stage only)
  int64_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;  // wpe -1 without learned positions, lnf_b -1 under RMSNorm
  int64_t out_w = 0;                               // == wte when the output layer is tied to the embedding
  int64_t num_params = 0;
  // This layout's tensor rank of tensor_size: the slices (ParamInfo::tensor_split_dim) it holds.
  int tensor_size = 1, tensor_rank = 0;
  // Its pipeline stage: `layers` are the global layers first_layer, first_layer + 1, ...; the
  // embeddings (wte, wpe) only with pre_process (-1 otherwise), the final norm and output layer
  // only with post_process (-1 otherwise; out_w the embedding copy on a last stage with tied
  // embeddings; with multi-token prediction wte that copy too, or untied a copy of its own). whole_index[k]: infos[k]'s
  // index among the whole model's (one stage) infos.
  int pipeline_size = 1, pipeline_rank = 0;
  int64_t first_layer = 0;
  bool pre_process = true, post_process = true;
  // Model chunks (PipelineStage::virtual_size): `layers` holds chunk 0's, then chunk 1's, ...,
  // chunk_layers() each; chunk v's first layer in the whole model is chunk_first_layer[v].
  int virtual_size = 1;
  std::vector<int64_t> chunk_first_layer;
  int64_t chunk_layers() const { return static_cast<int64_t>(layers.size()) / virtual_size; }
  // Whether chunk v embeds the tokens (the first virtual stage) or ends in the loss (the last).
  bool ChunkPreProcess(int v) const { return pre_process && v == 0; }
  bool ChunkPostProcess(int v) const { return post_process && v == virtual_size - 1; }
  // The model chunk of transformer layer `l` of this layout (l / chunk_layers()).
  int ChunkOfLayer(int64_t l) const { return static_cast<int>(l / chunk_layers()); }
  // Expert parallelism (Megatron's --expert-model-parallel-size): expert rank expert_rank of expert_size holds
  // the experts [expert_rank · E / expert_size, + E / expert_size) of each MoE layer, named by their local
  // index (local_experts.J, J from 0) as Megatron's SequentialMLP; every other tensor is whole.
  int expert_size = 1, expert_rank = 0;
  int64_t local_experts() const { return config.num_experts / expert_size; }
  std::vector<size_t> whole_index;
  size_t WholeInfoIndex(size_t k) const { return whole_index.empty() ? k : whole_index[k]; }

  // The whole model at tensor_size 1; tensor rank `tensor_rank`'s partition otherwise (heads, ffn
  // and the padded vocabulary must divide by tensor_size: InvalidArgument naming the flag).
  // With `stage`: that pipeline stage's part of it.
  // With expert_size above 1: expert rank `expert_rank`'s experts only (num_experts must divide by it).
  static absl::StatusOr<ParamLayout> Create(const GPTConfig& config, int tensor_size = 1, int tensor_rank = 0,
                                            const PipelineStage& stage = {}, int expert_size = 1, int expert_rank = 0);
  // The parameters a norm of the whole model counts on this stage: all but the embedding copy.
  bool CountedInNorms(const ParamInfo& p) const { return !p.embedding_copy; }
  // Where the embedding copy begins (it ends the buffer); num_params without one.
  int64_t norm_end() const { return !infos.empty() && infos.back().embedding_copy ? infos.back().offset : num_params; }
  const ParamInfo* Find(const std::string& name) const;
  // Megatron's init: N(0, std) for weights, the two output projections of every layer with
  // std / sqrt(2 * layers), biases 0, LayerNorm weights 1 (0 under apply_layernorm_1p); with
  // init_method_xavier_uniform every weight matrix uniform (ParamInfo::init_uniform). Deterministic in `seed`; `out`
  // holds num_params floats. A tensor rank's slice holds the elements of the whole model's init (the same bits), so any
  // tensor size starts from the same weights.
  void InitWeights(uint64_t seed, std::span<float> out) const;
  // Element `i` of parameter `info` (of this layout) as an element index of the whole tensor.
  int64_t WholeIndex(const ParamInfo& info, int64_t i) const;
};

// Copies between the whole model (`whole`, a tensor_size-1 one-stage layout's buffer) and one tensor
// rank's slices of one pipeline stage (`shard`, `shard_layout`'s buffer; one configuration).
void CopyToShard(const ParamLayout& shard_layout, std::span<const float> whole, std::span<float> shard);
void CopyFromShard(const ParamLayout& shard_layout, std::span<const float> shard, std::span<float> whole);

}  // namespace ptk
