// ptk's mixture-of-experts Llama line with --qk-layernorm <-> Hugging Face Qwen3MoeForCausalLM: config.json
// (mlp_only_layers from --moe-layer-freq, norm_topk_prob from --moe-router-pre-softmax), the experts' [gate; up]
// split into gate_proj and up_proj (and joined back).
#include "interop/hf_qwen3_moe.h"

#include <fmt/core.h>

#include "common/status.h"
#include "interop/hf_deepseek_v3.h"
#include "interop/hf_llama.h"
#include "interop/hf_mixtral.h"
#include "interop/hf_qwen2_moe.h"

namespace ptk::hf_detail {
namespace {

// Qwen3-MoE's names: mlp.gate, mlp.experts.J.gate_proj, up_proj, down_proj (Qwen3MoeMLP's order).
const ExpertNames kQwen3Moe{"mlp.", "gate_proj", "up_proj", "down_proj", "gate_proj", "up_proj", "down_proj"};

std::string LayerFreq(const GPTConfig& c) {  // as ptk-train records --moe-layer-freq
  std::string f;
  for (int64_t l = 0; l < c.num_layers; ++l) f += fmt::format("{}{}", l ? "," : "[", c.moe_layer(l) ? 1 : 0);
  return f + "]";
}

}  // namespace

void AppendQwenMoeRefusals(const GPTConfig& c, std::string_view cls, std::vector<std::string>* why) {
  if (c.moe_router_sigmoid)
    why->push_back(
        fmt::format("--moe-router-score-function sigmoid ({} routes by a softmax over the experts' logits)", cls));
  if (c.moe_router_topk_scaling_factor > 0)
    why->push_back(fmt::format("--moe-router-topk-scaling-factor {} ({}'s probabilities are not scaled)",
                               Num(c.moe_router_topk_scaling_factor), cls));
  if (c.moe_router_group_topk > 0)
    why->push_back(fmt::format("--moe-router-group-topk {} ({} routes among all experts, not limited groups)",
                               c.moe_router_group_topk, cls));
  if (c.moe_layers() == 0) why->push_back("--moe-layer-freq with no MoE layer");
  if (!c.swiglu)
    why->push_back(
        fmt::format("{} MLPs without --swiglu ({}'s are SwiGLU's)", c.squared_relu ? "squared-ReLU" : "GELU", cls));
  if (c.normalization != Normalization::kRMSNorm)
    why->push_back(fmt::format("--normalization LayerNorm ({} normalizes with RMSNorm)", cls));
  if (c.position_embedding != PositionEmbedding::kRope)
    why->push_back(fmt::format("--position-embedding-type {} ({} has rotary positions only)",
                               c.position_embedding == PositionEmbedding::kNone ? "none" : "learned_absolute", cls));
  else if (c.rotary_percent != 1.0)
    why->push_back(fmt::format("--rotary-percent {} ({} rotates every channel of a head)", Num(c.rotary_percent), cls));
  if (c.rope() && c.use_rope_scaling && c.rotary_seq_len_interpolation_factor > 0)
    why->push_back(
        "--use-rope-scaling with --rotary-seq-len-interpolation-factor (transformers' rope_scaling is one of "
        "llama3 and linear)");
}

absl::Status CheckQwen3MoeExportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (c.moe_shared_expert_intermediate_size > 0)
    why.push_back(fmt::format("--moe-shared-expert-intermediate-size {} (Qwen3-MoE has no shared experts)",
                              c.moe_shared_expert_intermediate_size));
  AppendQwenMoeRefusals(c, "Qwen3-MoE", &why);
  if (c.add_bias_linear || c.add_qkv_bias) why.push_back("linear biases (Qwen3-MoE's linear layers have none)");
  if (why.empty()) return absl::OkStatus();
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return absl::FailedPreconditionError(
      fmt::format("{}: this mixture-of-experts model (--num-experts {} --qk-layernorm) is not one Hugging Face's "
                  "Qwen3MoeForCausalLM computes: {}",
                  file, c.num_experts, list));
}

std::string Qwen3MoeConfigJson(const GPTConfig& c, int64_t eod) {
  std::string dense;  // mlp_only_layers, as json.dumps(indent=2) writes the list
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (!c.moe_layer(l)) dense += fmt::format("{}\n    {}", dense.empty() ? "[" : ",", l);
  dense = dense.empty() ? "[]" : dense + "\n  ]";
  return PrettyConfig({
      {"architectures", "[\n    \"Qwen3MoeForCausalLM\"\n  ]"},
      {"attention_bias", Bool(false)},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"decoder_sparse_step", Int(1)},
      {"eos_token_id", Int(eod)},
      {"head_dim", Int(c.head_dim())},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.ffn_hidden_size)},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"max_window_layers", Int(c.num_layers)},
      {"mlp_only_layers", dense},
      {"model_type", Str("qwen3_moe")},
      {"moe_intermediate_size", Int(c.moe_ffn())},
      {"norm_topk_prob", Bool(!c.moe_router_pre_softmax)},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_experts", Int(c.num_experts)},
      {"num_experts_per_tok", Int(c.moe_router_topk)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.query_groups())},
      {"output_router_logits", Bool(false)},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_scaling", RopeScalingJson(c)},
      {"rope_theta", Num(c.rotary_base)},
      {"router_aux_loss_coef", Num(c.moe_aux_loss_coeff)},
      {"sliding_window", "null"},  // ptk's attention is causal over the whole sequence
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"use_sliding_window", Bool(false)},
      {"vocab_size", Int(c.vocab_size)},
  });
}

namespace {

// Qwen3MoeConfig's dimensions (absent keys: its defaults); head_dim any width (--kv-channels), by default
// hidden_size / num_attention_heads as Qwen3MoeAttention takes it.
absl::Status ReadQwen3MoeDims(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 24));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 2048));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 32));
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &c->num_query_groups,
                               r.Present("num_key_value_heads") ? c->num_attention_heads : 4));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->ffn_hidden_size, 6144));
  PTK_RETURN_IF_ERROR(r.GetInt("moe_intermediate_size", &c->moe_ffn_hidden_size, 768));
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 32768));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 151936));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts", &c->num_experts, 128));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts_per_tok", &c->moe_router_topk, 8));
  if (c->moe_router_topk > c->num_experts)
    return r.Bad(fmt::format("num_experts_per_tok {} is more than num_experts {}", c->moe_router_topk, c->num_experts));
  if (c->num_attention_heads % c->num_query_groups != 0)
    return r.Bad(fmt::format("num_key_value_heads {} does not divide num_attention_heads {}", c->num_query_groups,
                             c->num_attention_heads));
  PTK_RETURN_IF_ERROR(r.GetInt("head_dim", &c->kv_channels, c->hidden_size / c->num_attention_heads));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool tie = false;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, &tie, "true or false"));
  c->untie_embeddings_and_output_weights = !tie;
  bool bias = false;
  PTK_RETURN_IF_ERROR(r.Get("attention_bias", false, &bias, "true or false"));
  if (bias)
    return r.Bad(
        "attention_bias true: Qwen3-MoE's q, k, v and o biases without MLP biases are no ptk model (Megatron's "
        "--add-qkv-bias biases q, k and v only)");
  return absl::OkStatus();
}

// Which layers are mixtures: Qwen3MoeDecoderLayer's rule, (l + 1) % decoder_sparse_step == 0 and l not in
// mlp_only_layers.
absl::Status ReadQwenMoeLayers(const HfConfigReader& r, GPTConfig* c) {
  int64_t step = 1;
  PTK_RETURN_IF_ERROR(r.GetInt("decoder_sparse_step", &step, 1));
  std::vector<int> pattern(static_cast<size_t>(c->num_layers));
  for (int64_t l = 0; l < c->num_layers; ++l) pattern[static_cast<size_t>(l)] = (l + 1) % step == 0 ? 1 : 0;
  simdjson::dom::element e;
  if (r.Find("mlp_only_layers", &e)) {
    simdjson::dom::array list;
    if (e.get(list)) return r.Bad("mlp_only_layers is not a list of layer numbers");
    for (simdjson::dom::element x : list) {
      int64_t l = -1;
      if (x.get(l) || l < 0 || l >= c->num_layers)
        return r.Bad(fmt::format("mlp_only_layers entry {} is not a layer number below num_hidden_layers {}",
                                 simdjson::minify(x), c->num_layers));
      pattern[static_cast<size_t>(l)] = 0;
    }
  }
  int64_t moe = 0;
  for (int v : pattern) moe += v;
  if (moe == 0)
    return r.Bad(
        fmt::format("decoder_sparse_step {} and mlp_only_layers leave no layer a mixture of experts (a dense model: "
                    "model_type \"qwen3\")",
                    step));
  if (moe < c->num_layers) c->moe_layer_pattern = std::move(pattern);
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadQwenMoeRouting(const HfConfigReader& r, GPTConfig* c, std::vector<std::string>* notes) {
  PTK_RETURN_IF_ERROR(ReadQwenMoeLayers(r, c));
  bool sliding = false;  // the config drops sliding_window unless use_sliding_window
  PTK_RETURN_IF_ERROR(r.Get("use_sliding_window", false, &sliding, "true or false"));
  if (sliding) return r.Bad("use_sliding_window true: ptk's attention is causal over the whole sequence");
  // The softmax over every expert, the top k renormalised (norm_topk_prob true: Megatron's softmax over the top
  // k's logits, its default) or not (false, the configs' default: --moe-router-pre-softmax).
  bool norm = false;
  PTK_RETURN_IF_ERROR(r.Get("norm_topk_prob", false, &norm, "true or false"));
  c->moe_router_pre_softmax = !norm;
  PTK_RETURN_IF_ERROR(r.GetReal("router_aux_loss_coef", 0.001, &c->moe_aux_loss_coeff, 0, false, 1e300, false));
  bool router_logits = false;
  PTK_RETURN_IF_ERROR(r.Get("output_router_logits", false, &router_logits, "true or false"));
  if (!router_logits && c->moe_aux_loss_coeff > 0)
    notes->push_back(fmt::format(
        "router_aux_loss_coef {}: ptk-train adds the load-balancing loss at that weight (--moe-aux-loss-coeff; "
        "transformers only with output_router_logits); 0 turns it off",
        Num(c->moe_aux_loss_coeff)));
  return absl::OkStatus();
}

absl::StatusOr<GPTConfig> ReadQwen3MoeConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                             std::vector<std::string>* notes) {
  GPTConfig c;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.qk_layernorm = true;  // q_norm and k_norm
  c.add_bias_linear = false;
  c.moe_router_sigmoid = false;
  PTK_RETURN_IF_ERROR(ReadQwen3MoeDims(r, make_vocab_size_divisible_by, &c));
  PTK_RETURN_IF_ERROR(ReadQwenMoeRouting(r, &c, notes));
  PTK_RETURN_IF_ERROR(ReadLlamaCommon(r, &c));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size), hd = static_cast<double>(c.kv_channels),
               implied = static_cast<double>(c.num_layers) *
                             (h * hd * static_cast<double>(2 * c.num_attention_heads + 2 * c.num_query_groups) +
                              3 * h * static_cast<double>(c.ffn_hidden_size) +
                              static_cast<double>(c.num_experts) * (3 * h * static_cast<double>(c.moe_ffn()) + h)) +
                         2 * h * static_cast<double>(c.vocab_size);
  if (implied > 0x1p40)
    return r.Bad(fmt::format(
        "num_hidden_layers {}, hidden_size {}, num_experts {} of moe_intermediate_size {} and vocab_size {} make "
        "{:.3g} parameters: more than ptk can hold",
        c.num_layers, c.hidden_size, c.num_experts, c.moe_ffn(), c.vocab_size, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  return c;
}

// DeepSeek-V3 with multi-latent attention, Qwen3-MoE with --qk-layernorm, Qwen2-MoE with shared experts, Mixtral
// otherwise.
enum class MoeClass { kMixtral, kQwen2Moe, kQwen3Moe, kDeepseekV3 };
MoeClass ClassOf(const GPTConfig& c) {
  return c.mla()                                     ? MoeClass::kDeepseekV3
         : c.qk_layernorm                            ? MoeClass::kQwen3Moe
         : c.moe_shared_expert_intermediate_size > 0 ? MoeClass::kQwen2Moe
                                                     : MoeClass::kMixtral;
}

const char* MoeArchitecture(const GPTConfig& c) {
  switch (ClassOf(c)) {
    case MoeClass::kDeepseekV3: return "DeepseekV3ForCausalLM";
    case MoeClass::kQwen3Moe: return "Qwen3MoeForCausalLM";
    case MoeClass::kQwen2Moe: return "Qwen2MoeForCausalLM";
    default: return "MixtralForCausalLM";
  }
}

absl::Status CheckMoeExportable(const GPTConfig& c, const std::string& file) {
  switch (ClassOf(c)) {
    case MoeClass::kDeepseekV3: return CheckDeepseekV3Exportable(c, file);
    case MoeClass::kQwen3Moe: return CheckQwen3MoeExportable(c, file);
    case MoeClass::kQwen2Moe: return CheckQwen2MoeExportable(c, file);
    default: return CheckMixtralExportable(c, file);
  }
}

std::string MoeConfigJson(const GPTConfig& c, int64_t eod) {
  switch (ClassOf(c)) {
    case MoeClass::kDeepseekV3: return DeepseekV3ConfigJson(c, eod);
    case MoeClass::kQwen3Moe: return Qwen3MoeConfigJson(c, eod);
    case MoeClass::kQwen2Moe: return Qwen2MoeConfigJson(c, eod);
    default: return MixtralConfigJson(c, eod);
  }
}

std::vector<HfTensor> MoeTensorsOf(const GPTConfig& c) {
  switch (ClassOf(c)) {
    case MoeClass::kDeepseekV3: return DeepseekV3TensorsOf(c);
    case MoeClass::kQwen3Moe: return MoeTensorsOf(c, kQwen3Moe);
    case MoeClass::kQwen2Moe: return Qwen2MoeTensorsOf(c);
    default: return MixtralTensorsOf(c);
  }
}

void MapMoeParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  switch (ClassOf(layout.config)) {
    case MoeClass::kDeepseekV3: return MapDeepseekV3Params(layout, params, hf, to_hf);
    case MoeClass::kQwen3Moe:
      MapLlamaParams(layout, params, hf, to_hf);  // sizes every tensor (to HF); the attention and dense layers
      return MapMoeExperts(layout, params, hf, to_hf, kQwen3Moe);
    case MoeClass::kQwen2Moe: return MapQwen2MoeParams(layout, params, hf, to_hf);
    default: return MapMixtralParams(layout, params, hf, to_hf);
  }
}

std::vector<std::pair<std::string, std::string>> MoeSettings(const GPTConfig& c) {
  if (ClassOf(c) == MoeClass::kMixtral) return MixtralSettings(c);
  if (ClassOf(c) == MoeClass::kDeepseekV3) return DeepseekV3Settings(c);
  std::vector<std::pair<std::string, std::string>> s = LlamaSettings(c);
  s.insert(s.end(), {{"--num-experts", Int(c.num_experts)},
                     {"--moe-router-topk", Int(c.moe_router_topk)},
                     {"--moe-ffn-hidden-size", Int(c.moe_ffn())},
                     {"--moe-aux-loss-coeff", fmt::format("{}", c.moe_aux_loss_coeff)},
                     {"--moe-router-score-function", "softmax"},
                     {"--moe-router-pre-softmax", c.moe_router_pre_softmax ? "on" : "off"},
                     {"--moe-layer-freq", c.moe_layers() == c.num_layers ? "1" : LayerFreq(c)}});
  if (c.moe_shared_expert_intermediate_size > 0)
    s.insert(s.end(), {{"--moe-shared-expert-intermediate-size", Int(c.moe_shared_expert_intermediate_size)},
                       {"--moe-shared-expert-gate", c.moe_shared_expert_gate ? "on" : "off"}});
  return s;
}

std::string MoeTrainFlags(const GPTConfig& c) {
  if (ClassOf(c) == MoeClass::kMixtral) return MixtralTrainFlags(c);
  if (ClassOf(c) == MoeClass::kDeepseekV3) return DeepseekV3TrainFlags(c);
  std::string flags =
      LlamaTrainFlags(c) + fmt::format(" --num-experts {} --moe-router-topk {} --moe-ffn-hidden-size {}", c.num_experts,
                                       c.moe_router_topk, c.moe_ffn());
  if (c.moe_aux_loss_coeff > 0) flags += fmt::format(" --moe-aux-loss-coeff {}", c.moe_aux_loss_coeff);
  if (c.moe_router_pre_softmax) flags += " --moe-router-pre-softmax";
  if (c.moe_layers() != c.num_layers) flags += fmt::format(" --moe-layer-freq \"{}\"", LayerFreq(c));
  if (c.moe_shared_expert_intermediate_size > 0)
    flags += fmt::format(" --moe-shared-expert-intermediate-size {}{}", c.moe_shared_expert_intermediate_size,
                         c.moe_shared_expert_gate ? " --moe-shared-expert-gate" : "");
  return flags;
}

}  // namespace ptk::hf_detail
