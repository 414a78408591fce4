// ptk's mixture-of-experts Llama line -> Hugging Face MixtralForCausalLM: config.json, the router and the
// experts' [gate; up] split into w1 and w3.
#include "interop/hf_mixtral.h"

#include <algorithm>
#include <map>

#include <fmt/core.h>

#include "interop/hf_config.h"
#include "interop/hf_llama.h"

namespace ptk::hf_detail {

absl::Status CheckMixtralExportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (c.moe_router_sigmoid)
    why.push_back("--moe-router-score-function sigmoid (Mixtral routes by a softmax over the experts' logits)");
  else if (c.moe_router_pre_softmax)
    why.push_back(
        "--moe-router-pre-softmax (Mixtral renormalises the top k's probabilities to sum to 1: Megatron's softmax "
        "after the top k)");
  if (c.moe_router_topk_scaling_factor > 0)
    why.push_back(fmt::format("--moe-router-topk-scaling-factor {} (Mixtral's probabilities are not scaled)",
                              Num(c.moe_router_topk_scaling_factor)));
  if (c.moe_router_group_topk > 0)
    why.push_back(fmt::format("--moe-router-group-topk {} (Mixtral routes among all experts, not limited groups)",
                              c.moe_router_group_topk));
  if (c.moe_layers() != c.num_layers) {
    std::string layers;
    for (int64_t l = 0; l < c.num_layers; ++l) layers += fmt::format("{}{}", l ? "," : "", c.moe_layer(l) ? 1 : 0);
    why.push_back(fmt::format(
        "--moe-layer-freq [{}] with dense layers (every layer of Mixtral is a mixture of experts)", layers));
  }
  if (!c.swiglu)
    why.push_back(fmt::format("{} experts without --swiglu (Mixtral's experts are SwiGLU's)",
                              c.squared_relu ? "squared-ReLU" : "GELU"));
  if (c.normalization != Normalization::kRMSNorm)
    why.push_back("--normalization LayerNorm (Mixtral normalizes with RMSNorm)");
  if (c.position_embedding != PositionEmbedding::kRope)
    why.push_back(fmt::format("--position-embedding-type {} (Mixtral has rotary positions only)",
                              c.position_embedding == PositionEmbedding::kNone ? "none" : "learned_absolute"));
  else if (c.rotary_percent != 1.0)
    why.push_back(fmt::format("--rotary-percent {} (Mixtral rotates every channel of a head)", Num(c.rotary_percent)));
  if (c.rope() && c.use_rope_scaling)
    why.push_back("--use-rope-scaling (transformers 4.44's Mixtral has no rope_scaling)");
  if (c.rope() && c.rotary_seq_len_interpolation_factor > 0)
    why.push_back("--rotary-seq-len-interpolation-factor (transformers 4.44's Mixtral has no rope_scaling)");
  if (c.add_bias_linear || c.add_qkv_bias) why.push_back("linear biases (Mixtral's linear layers have none)");
  if (c.qk_layernorm) why.push_back("--qk-layernorm (Mixtral has no query and key norms)");
  if (c.head_dim() * c.num_attention_heads != c.hidden_size)
    why.push_back(fmt::format(
        "--kv-channels {} with {} heads of hidden size {} (transformers 4.44's Mixtral takes head_dim = hidden_size / "
        "num_attention_heads)",
        c.head_dim(), c.num_attention_heads, c.hidden_size));
  if (why.empty()) return absl::OkStatus();
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return absl::FailedPreconditionError(fmt::format(
      "{}: this mixture-of-experts model (--num-experts {}) is not one Hugging Face's MixtralForCausalLM computes: {}",
      file, c.num_experts, list));
}

std::string MixtralConfigJson(const GPTConfig& c, int64_t eod) {
  return PrettyConfig({
      {"architectures", "[\n    \"MixtralForCausalLM\"\n  ]"},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"eos_token_id", Int(eod)},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.moe_ffn())},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"model_type", Str("mixtral")},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_experts_per_tok", Int(c.moe_router_topk)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.query_groups())},
      {"num_local_experts", Int(c.num_experts)},
      {"output_router_logits", Bool(false)},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_theta", Num(c.rotary_base)},
      {"router_aux_loss_coef", Num(c.moe_aux_loss_coeff)},
      {"router_jitter_noise", Num(0.0)},
      {"sliding_window", "null"},  // ptk's attention is causal over the whole sequence
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"vocab_size", Int(c.vocab_size)},
  });
}

std::vector<HfTensor> MixtralTensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, f = c.moe_ffn();
  std::vector<HfTensor> t;
  for (HfTensor& x : LlamaTensorsOf(c)) {  // the layers without their MLP
    const std::string name = x.name;
    t.push_back(std::move(x));
    constexpr std::string_view kAfter = ".self_attn.o_proj.weight";  // Mixtral registers the MoE block next
    if (name.size() < kAfter.size() || name.compare(name.size() - kAfter.size(), kAfter.size(), kAfter) != 0) continue;
    const std::string p = name.substr(0, name.size() - kAfter.size()) + ".block_sparse_moe.";
    t.push_back({p + "gate.weight", {c.num_experts, h}, {}});
    for (int64_t j = 0; j < c.num_experts; ++j) {
      const std::string e = fmt::format("{}experts.{}.", p, j);
      t.push_back({e + "w1.weight", {f, h}, {}});
      t.push_back({e + "w2.weight", {h, f}, {}});
      t.push_back({e + "w3.weight", {f, h}, {}});
    }
  }
  return t;
}

void MapMixtralParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf) {
  MapLlamaParams(layout, params, hf, /*to_hf=*/true);  // sizes every tensor; fills the dense parts
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, f = c.moe_ffn();
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) by_name[t.name] = &t;
  auto copy = [&](const std::string& name, int64_t offset) {
    std::vector<float>& d = by_name.at(name)->data;
    std::copy(params->begin() + offset, params->begin() + offset + static_cast<int64_t>(d.size()), d.begin());
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.block_sparse_moe.", l);
    copy(p + "gate.weight", lp.router_w);
    for (int64_t j = 0; j < c.num_experts; ++j) {
      const int64_t fc1 = lp.experts + j * c.expert_floats(), fc2 = fc1 + 2 * f * h;
      const std::string e = fmt::format("{}experts.{}.", p, j);
      copy(e + "w1.weight", fc1);  // linear_fc1's rows: [gate; up]
      copy(e + "w3.weight", fc1 + f * h);
      copy(e + "w2.weight", fc2);
    }
  }
}

}  // namespace ptk::hf_detail
