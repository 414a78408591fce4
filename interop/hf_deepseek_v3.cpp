// ptk's multi-latent attention models -> Hugging Face DeepseekV3ForCausalLM: the export's checks, config.json and
// the tensors in DeepSeek-V3's names (both directions of the mapping).
#include "interop/hf_deepseek_v3.h"

#include <algorithm>
#include <map>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/mla_cpu.h"

namespace ptk::hf_detail {
namespace {

// The experts' and the MLA rotary embedding's reasons (CheckDeepseekV3Exportable's second half).
void AppendDeepseekMoeRefusals(const GPTConfig& c, std::vector<std::string>* why) {
  if (!c.moe()) return;
  if (!c.moe_router_sigmoid)
    why->push_back("--moe-router-score-function softmax (DeepSeek-V3 routes by sigmoid scores)");
  const int64_t s = c.moe_shared_expert_intermediate_size, f = c.moe_ffn();
  if (s == 0)
    why->push_back("no --moe-shared-expert-intermediate-size (DeepseekV3MoE always adds its shared experts)");
  else if (s % f != 0)
    why->push_back(
        fmt::format("--moe-shared-expert-intermediate-size {} (DeepSeek-V3's shared experts are n_shared_experts x "
                    "moe_intermediate_size {} wide)",
                    s, f));
  if (c.moe_shared_expert_gate) why->push_back("--moe-shared-expert-gate (DeepSeek-V3's shared experts have no gate)");
  int64_t k = 0;  // first_k_dense_replace
  while (k < c.num_layers && !c.moe_layer(k)) ++k;
  for (int64_t l = k; l < c.num_layers; ++l)
    if (!c.moe_layer(l)) {
      why->push_back(fmt::format(
          "--moe-layer-freq with dense layer {} after MoE layer {} (DeepSeek-V3's dense layers are its first "
          "first_k_dense_replace)",
          l, k));
      break;
    }
  const bool grouped = c.moe_router_group_topk > 0 && c.moe_router_group_topk < c.moe_router_num_groups;
  if (grouped && c.moe_router_topk != 2 * c.moe_router_group_topk)
    why->push_back(fmt::format(
        "--moe-router-topk {} with --moe-router-group-topk {} (transformers scores a group by its top 2 experts, "
        "megatron-core by its top topk / group_topk = {})",
        c.moe_router_topk, c.moe_router_group_topk, c.moe_router_topk / c.moe_router_group_topk));
  if (c.num_experts / (grouped ? c.moe_router_num_groups : 1) < 2)
    why->push_back(fmt::format("{} expert(s) per group (transformers scores each group by its top 2)",
                               c.num_experts / (grouped ? c.moe_router_num_groups : 1)));
}

void AppendDeepseekRopeRefusals(const GPTConfig& c, std::vector<std::string>* why) {
  const double f = c.rotary_scaling_factor;
  if (f <= 1) return;
  if (!c.mla_yarn && c.mscale_all_dim != 0)
    why->push_back(fmt::format(
        "--rope-type rope with --rotary-scaling-factor {} and --mscale-all-dim {} (transformers scales the softmax "
        "by mscale_all_dim only with YaRN's rope_scaling)",
        Num(f), Num(c.mscale_all_dim)));
  const double max = static_cast<double>(c.max_position_embeddings);
  if (c.mla_yarn && max != static_cast<double>(kMlaYarnOriginalContext) &&
      max != f * static_cast<double>(kMlaYarnOriginalContext))
    why->push_back(fmt::format(
        "--rope-type yarn with --rotary-scaling-factor {} and --max-position-embeddings {} (transformers' YaRN takes "
        "its factor as max_position_embeddings / original_max_position_embeddings, ptk's original context is {}: "
        "give {} or {})",
        Num(f), c.max_position_embeddings, kMlaYarnOriginalContext, kMlaYarnOriginalContext,
        f * static_cast<double>(kMlaYarnOriginalContext)));
}

std::string Join(const std::vector<std::string>& why) {
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return list;
}

}  // namespace

absl::Status CheckDeepseekV3Exportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (!c.mla()) why.push_back("no --multi-latent-attention (DeepSeek-V3's attention is MLA)");
  if (c.normalization != Normalization::kRMSNorm)
    why.push_back("--normalization LayerNorm (DeepSeek-V3 normalizes with RMSNorm)");
  if (c.position_embedding == PositionEmbedding::kLearnedAbsolute)
    why.push_back("--position-embedding-type learned_absolute (DeepSeek-V3 has MLA's rotary positions only)");
  if (!c.swiglu)
    why.push_back(
        fmt::format("{} MLPs without --swiglu (DeepSeek-V3's are SwiGLU's)", c.squared_relu ? "squared-ReLU" : "GELU"));
  if (c.add_bias_linear || c.add_qkv_bias) why.push_back("linear biases (DeepSeek-V3's are off: attention_bias false)");
  if (!c.qk_layernorm)
    why.push_back(
        "--multi-latent-attention without --qk-layernorm (DeepseekV3Attention always normalizes its latents: "
        "q_a_layernorm, kv_a_layernorm)");
  else if (c.layernorm_epsilon != 1e-6)
    why.push_back(fmt::format(
        "--norm-epsilon {} (DeepseekV3Attention's q_a_layernorm and kv_a_layernorm take epsilon 1e-6 whatever "
        "rms_norm_eps is)",
        Num(c.layernorm_epsilon)));
  AppendDeepseekRopeRefusals(c, &why);
  AppendDeepseekMoeRefusals(c, &why);
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{}: this multi-latent attention model is not one Hugging Face's DeepseekV3ForCausalLM computes: {}",
                  file, Join(why)));
}

namespace {

// rope_scaling: null for plain RoPE (and YaRN at factor 1, the same tables), else YaRN's keys with the
// concentration factor given as attention_factor (ptk's mscale(f, mscale) / mscale(f, mscale_all_dim), which
// transformers' defaults give only where both are set).
std::string DeepseekRopeScaling(const GPTConfig& c) {
  const double f = c.rotary_scaling_factor;
  if (!c.mla_yarn || f <= 1) return "null";
  std::vector<std::pair<std::string, std::string>> s = {
      {"attention_factor", Num(cpu::YarnGetMscale(f, c.mscale) / cpu::YarnGetMscale(f, c.mscale_all_dim))},
      {"beta_fast", Num(32.0)},
      {"beta_slow", Num(1.0)},
      {"factor", Num(f)},
      {"mscale", Num(c.mscale)},
      {"mscale_all_dim", Num(c.mscale_all_dim)}};
  if (c.max_position_embeddings != kMlaYarnOriginalContext)  // factor = max_position_embeddings / original
    s.push_back({"original_max_position_embeddings", Int(kMlaYarnOriginalContext)});
  s.push_back({"rope_type", Str("yarn")});
  return PrettyConfig(s, 1);
}

int64_t FirstKDense(const GPTConfig& c) {
  int64_t k = 0;
  while (k < c.num_layers && !c.moe_layer(k)) ++k;
  return k;
}

}  // namespace

std::string DeepseekV3ConfigJson(const GPTConfig& c, int64_t eod) {
  const bool moe = c.moe();  // a dense MLA model: every layer before first_k_dense_replace, the routing unused
  const bool grouped = moe && c.moe_router_group_topk > 0 && c.moe_router_group_topk < c.moe_router_num_groups;
  return PrettyConfig({
      {"architectures", "[\n    \"DeepseekV3ForCausalLM\"\n  ]"},
      {"attention_bias", Bool(false)},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"eos_token_id", Int(eod)},
      {"first_k_dense_replace", Int(FirstKDense(c))},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.ffn_hidden_size)},
      {"kv_lora_rank", Int(c.kv_lora_rank)},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"model_type", Str("deepseek_v3")},
      {"moe_intermediate_size", Int(c.moe_ffn())},
      {"n_group", Int(grouped ? c.moe_router_num_groups : 1)},
      {"n_routed_experts", Int(moe ? c.num_experts : 2)},
      {"n_shared_experts", Int(moe ? c.moe_shared_expert_intermediate_size / c.moe_ffn() : 1)},
      // Megatron renormalises sigmoid scores over the top k for k above 1 (its topk_softmax_with_capacity).
      {"norm_topk_prob", Bool(!moe || c.moe_router_topk > 1)},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_experts_per_tok", Int(moe ? c.moe_router_topk : 1)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.num_attention_heads)},  // MLA: a key and a value per head
      {"pretraining_tp", Int(1)},
      {"q_lora_rank", c.q_lora_rank > 0 ? Int(c.q_lora_rank) : "null"},
      {"qk_nope_head_dim", Int(c.qk_head_dim)},
      {"qk_rope_head_dim", Int(c.qk_pos_emb_head_dim)},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_interleave", Bool(true)},
      {"rope_scaling", DeepseekRopeScaling(c)},
      {"rope_theta", Num(c.rotary_base)},
      {"routed_scaling_factor", Num(c.moe_router_topk_scaling_factor > 0 ? c.moe_router_topk_scaling_factor : 1.0)},
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"topk_group", Int(grouped ? c.moe_router_group_topk : 1)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"v_head_dim", Int(c.v_head_dim)},
      {"vocab_size", Int(c.vocab_size)},
  });
}

std::vector<HfTensor> DeepseekV3TensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, heads = c.num_attention_heads, pe = c.qk_pos_emb_head_dim;
  const int64_t V = c.vocab_size;
  std::vector<HfTensor> t;
  t.push_back({"model.embed_tokens.weight", {V, h}, {}});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string a = fmt::format("model.layers.{}.self_attn.", l), m = fmt::format("model.layers.{}.mlp.", l);
    if (c.q_lora_rank > 0) {
      t.push_back({a + "q_a_proj.weight", {c.q_lora_rank, h}, {}});
      t.push_back({a + "q_a_layernorm.weight", {c.q_lora_rank}, {}});
      t.push_back({a + "q_b_proj.weight", {heads * c.mla_q_head_dim(), c.q_lora_rank}, {}});
    } else {
      t.push_back({a + "q_proj.weight", {heads * c.mla_q_head_dim(), h}, {}});
    }
    t.push_back({a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + pe, h}, {}});
    t.push_back({a + "kv_a_layernorm.weight", {c.kv_lora_rank}, {}});
    t.push_back({a + "kv_b_proj.weight", {heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank}, {}});
    t.push_back({a + "o_proj.weight", {h, heads * c.v_head_dim}, {}});
    auto mlp = [&](const std::string& p, int64_t f) {  // DeepseekV3MLP's registration order
      t.push_back({p + "gate_proj.weight", {f, h}, {}});
      t.push_back({p + "up_proj.weight", {f, h}, {}});
      t.push_back({p + "down_proj.weight", {h, f}, {}});
    };
    if (c.moe_layer(l)) {  // DeepseekV3MoE: experts, gate (its weight, then its buffer), shared_experts
      for (int64_t j = 0; j < c.num_experts; ++j) mlp(fmt::format("{}experts.{}.", m, j), c.moe_ffn());
      t.push_back({m + "gate.weight", {c.num_experts, h}, {}});
      t.push_back({m + "gate.e_score_correction_bias", {c.num_experts}, {}});
      mlp(m + "shared_experts.", c.moe_shared_expert_intermediate_size);
    } else {
      mlp(m, c.ffn_hidden_size);
    }
    t.push_back({fmt::format("model.layers.{}.input_layernorm.weight", l), {h}, {}});
    t.push_back({fmt::format("model.layers.{}.post_attention_layernorm.weight", l), {h}, {}});
  }
  t.push_back({"model.norm.weight", {h}, {}});
  if (c.untie_embeddings_and_output_weights) t.push_back({"lm_head.weight", {V, h}, {}});
  return t;
}

void MapDeepseekV3Params(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size;
  float* P = params->data();
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) {
    if (to_hf) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      t.data.assign(static_cast<size_t>(n), 0.0f);
    }
    by_name[t.name] = &t;
  }
  // The first `n` values of HF tensor `name` (all: n -1) <-> ptk's from `offset`.
  auto copy = [&](const std::string& name, int64_t offset, int64_t n = -1) {
    std::vector<float>& d = by_name.at(name)->data;
    const int64_t count = n < 0 ? static_cast<int64_t>(d.size()) : n;
    if (to_hf) {
      std::copy(P + offset, P + offset + count, d.data());
    } else {
      std::copy(d.data(), d.data() + count, P + offset);
    }
  };
  auto vocab = [&](const std::string& name, int64_t offset) {
    copy(name, offset);  // the first vocab_size rows; on import the padded ones copies of the last, as Megatron's
    if (!to_hf)
      for (int64_t r = c.vocab_size; r < c.padded_vocab_size; ++r)
        std::copy(P + offset + (c.vocab_size - 1) * h, P + offset + c.vocab_size * h, P + offset + r * h);
  };
  auto mlp = [&](const std::string& p, int64_t fc1, int64_t fc2, int64_t f) {
    copy(p + "gate_proj.weight", fc1);  // linear_fc1's rows: [gate; up]
    copy(p + "up_proj.weight", fc1 + f * h);
    copy(p + "down_proj.weight", fc2);
  };
  vocab("model.embed_tokens.weight", layout.wte);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string a = fmt::format("model.layers.{}.self_attn.", l), m = fmt::format("model.layers.{}.mlp.", l);
    if (c.q_lora_rank > 0) {
      copy(a + "q_a_proj.weight", lp.mla_q_down);
      copy(a + "q_a_layernorm.weight", lp.mla_q_norm_w);
      copy(a + "q_b_proj.weight", lp.mla_q_up);
    } else {
      copy(a + "q_proj.weight", lp.mla_q_proj);
    }
    copy(a + "kv_a_proj_with_mqa.weight", lp.mla_kv_down);
    copy(a + "kv_a_layernorm.weight", lp.mla_kv_norm_w);
    copy(a + "kv_b_proj.weight", lp.mla_kv_up);
    copy(a + "o_proj.weight", lp.proj_w);
    if (c.moe_layer(l)) {
      const int64_t f = c.moe_ffn(), s = c.moe_shared_expert_intermediate_size;
      for (int64_t j = 0; j < c.num_experts; ++j) {
        const int64_t fc1 = lp.experts + j * c.expert_floats();
        mlp(fmt::format("{}experts.{}.", m, j), fc1, fc1 + 2 * f * h, f);
      }
      copy(m + "gate.weight", lp.router_w);
      mlp(m + "shared_experts.", lp.shared_fc1, lp.shared_fc2, s);
    } else {
      mlp(m, lp.fc1_w, lp.fc2_w, c.ffn_hidden_size);
    }
    copy(fmt::format("model.layers.{}.input_layernorm.weight", l), lp.ln1_w);
    copy(fmt::format("model.layers.{}.post_attention_layernorm.weight", l), lp.ln2_w);
  }
  copy("model.norm.weight", layout.lnf_w);
  if (c.untie_embeddings_and_output_weights) vocab("lm_head.weight", layout.out_w);
}

std::string ExpertBiasName(const ParamLayout& layout, int64_t l) {
  const int64_t at = layout.layers[static_cast<size_t>(l)].router_w;
  for (const ParamInfo& p : layout.infos)
    if (p.offset == at && p.name.size() > 6) return p.name.substr(0, p.name.size() - 6) + "expert_bias";
  return "";
}

absl::Status MapExpertBiases(const ParamLayout& layout, ModelBuffers* buffers, std::vector<HfTensor>* hf, bool to_hf) {
  const GPTConfig& c = layout.config;
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) by_name[t.name] = &t;
  std::map<std::string, const std::vector<float>*> held;
  for (const auto& [name, values] : *buffers) held[name] = &values;
  ModelBuffers out;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.moe_layer(l)) continue;
    const std::string name = ExpertBiasName(layout, l);
    HfTensor& t = *by_name.at(fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", l));
    if (!to_hf) {
      out.emplace_back(name, t.data);
      continue;
    }
    auto it = held.find(name);
    if (it == held.end()) continue;  // trained without --moe-router-enable-expert-bias: zeros
    if (static_cast<int64_t>(it->second->size()) != c.num_experts)
      return absl::DataLossError(
          fmt::format("buffer {} holds {} values for {} experts", name, it->second->size(), c.num_experts));
    t.data = *it->second;
    held.erase(it);
  }
  if (to_hf && !held.empty())
    return absl::DataLossError(fmt::format(
        "buffer {} is no MoE layer's expert bias: DeepseekV3ForCausalLM has no place for it", held.begin()->first));
  if (!to_hf) *buffers = std::move(out);
  return absl::OkStatus();
}

}  // namespace ptk::hf_detail
