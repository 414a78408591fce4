// Hugging Face DeepseekV3ForCausalLM -> ptk: config.json as ptk's multi-latent attention model (refused naming the
// key where ptk would compute another), and the flags and settings of the imported checkpoint.
#include <cmath>
#include <map>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/hf_deepseek_v3.h"
#include "interop/hf_llama.h"
#include "trainer/cpu/mla_cpu.h"

namespace ptk::hf_detail {
namespace {

// DeepseekV3Config's dimensions (absent keys: its defaults).
absl::Status ReadDeepseekDims(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 61));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 7168));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 128));
  int64_t kv_heads = 0;
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &kv_heads, c->num_attention_heads));
  if (kv_heads != c->num_attention_heads)
    return r.Bad(fmt::format(
        "num_key_value_heads {} is not num_attention_heads {}: ptk's multi-latent attention has a key and a value "
        "per head",
        kv_heads, c->num_attention_heads));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->ffn_hidden_size, 18432));
  PTK_RETURN_IF_ERROR(r.GetInt("moe_intermediate_size", &c->moe_ffn_hidden_size, 2048));
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 4096));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 129280));
  PTK_RETURN_IF_ERROR(r.GetInt("kv_lora_rank", &c->kv_lora_rank, 512));
  c->q_lora_rank = 0;  // null: q_proj
  if (simdjson::dom::element e; r.Find("q_lora_rank", &e) || !r.Present("q_lora_rank"))
    PTK_RETURN_IF_ERROR(r.GetInt("q_lora_rank", &c->q_lora_rank, 1536));
  PTK_RETURN_IF_ERROR(r.GetInt("qk_nope_head_dim", &c->qk_head_dim, 128));
  PTK_RETURN_IF_ERROR(r.GetInt("qk_rope_head_dim", &c->qk_pos_emb_head_dim, 64));
  PTK_RETURN_IF_ERROR(r.GetInt("v_head_dim", &c->v_head_dim, 128));
  if (c->qk_pos_emb_head_dim % 2 != 0)
    return r.Bad(fmt::format("qk_rope_head_dim {}: the rotary channels come in pairs", c->qk_pos_emb_head_dim));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool flag = false;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, &flag, "true or false"));
  c->untie_embeddings_and_output_weights = !flag;
  PTK_RETURN_IF_ERROR(r.Get("attention_bias", false, &flag, "true or false"));
  if (flag)
    return r.Bad(
        "attention_bias true: ptk's multi-latent attention has no biases (q_a_proj, kv_a_proj_with_mqa, o_proj)");
  PTK_RETURN_IF_ERROR(r.Get("rope_interleave", true, &flag, "true or false"));
  if (!flag)
    return r.Bad(
        "rope_interleave false: ptk's multi-latent attention gathers each rotary pair (2i, 2i + 1) as "
        "apply_rotary_pos_emb_interleave does (rope_interleave true)");
  return absl::OkStatus();
}

// The experts: DeepseekV3DecoderLayer's rule (layers from first_k_dense_replace on are MoE), sigmoid routing with the
// expert bias, top 2 per group scoring the groups, norm_topk_prob as Megatron renormalises (k above 1).
absl::Status ReadDeepseekMoe(const HfConfigReader& r, GPTConfig* c) {
  int64_t k = 3, shared = 1, groups = 8, group_topk = 4;
  PTK_RETURN_IF_ERROR(r.Get<int64_t>("first_k_dense_replace", 3, &k, "an integer"));
  if (k < 0) return r.Bad(fmt::format("first_k_dense_replace {}: a layer count (at least 0)", k));
  if (k >= c->num_layers) return absl::OkStatus();  // every layer dense: the routing keys unused
  PTK_RETURN_IF_ERROR(r.GetInt("n_routed_experts", &c->num_experts, 256));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts_per_tok", &c->moe_router_topk, 8));
  PTK_RETURN_IF_ERROR(r.Get<int64_t>("n_shared_experts", 1, &shared, "an integer"));
  PTK_RETURN_IF_ERROR(r.GetInt("n_group", &groups, 8));
  PTK_RETURN_IF_ERROR(r.GetInt("topk_group", &group_topk, 4));
  if (c->moe_router_topk > c->num_experts)
    return r.Bad(
        fmt::format("num_experts_per_tok {} is more than n_routed_experts {}", c->moe_router_topk, c->num_experts));
  if (c->num_experts % groups != 0 || c->num_experts / groups < 2 || group_topk > groups)
    return r.Bad(fmt::format(
        "n_group {} and topk_group {} with n_routed_experts {}: transformers needs groups of at least 2 experts",
        groups, group_topk, c->num_experts));
  if (group_topk < groups) {  // limited groups (topk_group = n_group chooses every group: plain top k)
    if (c->moe_router_topk != 2 * group_topk)
      return r.Bad(fmt::format(
          "topk_group {} with num_experts_per_tok {}: transformers scores a group by its top 2 experts, ptk "
          "(megatron-core) by its top num_experts_per_tok / topk_group; the same only when that is 2",
          group_topk, c->moe_router_topk));
    c->moe_router_num_groups = groups, c->moe_router_group_topk = group_topk;
  }
  c->moe_shared_expert_intermediate_size = shared * c->moe_ffn();
  if (shared < 1) return r.Bad(fmt::format("n_shared_experts {}: ptk's DeepSeek-V3 import takes at least one", shared));
  bool norm = true;
  PTK_RETURN_IF_ERROR(r.Get("norm_topk_prob", true, &norm, "true or false"));
  if (norm != (c->moe_router_topk > 1))
    return r.Bad(fmt::format(
        "norm_topk_prob {} with num_experts_per_tok {}: megatron-core's sigmoid routing renormalises the top k "
        "exactly when k is above 1",
        norm ? "true" : "false", c->moe_router_topk));
  double scale = 2.5;
  PTK_RETURN_IF_ERROR(r.GetReal("routed_scaling_factor", 2.5, &scale, 0, true, 1e300, false));
  c->moe_router_topk_scaling_factor = scale == 1.0 ? 0 : scale;
  c->moe_router_sigmoid = true;
  c->moe_router_enable_expert_bias = true;  // e_score_correction_bias
  if (k > 0) {
    c->moe_layer_pattern.assign(static_cast<size_t>(c->num_layers), 1);
    for (int64_t l = 0; l < k; ++l) c->moe_layer_pattern[static_cast<size_t>(l)] = 0;
  }
  return absl::OkStatus();
}

// rope_scaling: null, or YaRN as ptk's MLA computes it (original context 4096, beta 32 and 1, one factor for the
// frequencies and the softmax scale, the concentration factor mscale(f, mscale) / mscale(f, mscale_all_dim)).
absl::Status ReadDeepseekRope(const HfConfigReader& r, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetReal("rope_theta", 10000.0, &c->rotary_base, 0, true, 1e300, false));
  c->mla_yarn = false;
  simdjson::dom::element e;
  if (!r.Find("rope_scaling", &e)) return absl::OkStatus();
  simdjson::dom::object o;
  if (e.get(o)) return r.Bad("rope_scaling is not an object");
  std::map<std::string_view, double> v;
  std::string_view type;
  for (auto [key, value] : o) {
    if (key == "rope_type" || key == "type") {
      if (value.get(type)) return r.Bad(fmt::format("rope_scaling's {} is not a string", key));
    } else if (!value.is_null()) {
      double x = 0;
      if (value.get(x)) return r.Bad(fmt::format("rope_scaling's {} is not a number", key));
      v[key] = x;
    }
  }
  auto get = [&](std::string_view key, double fallback) { return v.count(key) ? v[key] : fallback; };
  if (type == "default") return absl::OkStatus();
  if (type != "yarn")
    return r.Bad(fmt::format("rope_scaling {:?}: ptk's multi-latent attention takes YaRN's (or none)", type));
  const double factor = get("factor", 1.0), max = static_cast<double>(c->max_position_embeddings);
  const double original = get("original_max_position_embeddings", max);
  const double freq_factor = v.count("original_max_position_embeddings") ? max / original : factor;
  if ((original != static_cast<double>(kMlaYarnOriginalContext) && factor != 1) || freq_factor != factor)
    return r.Bad(fmt::format(
        "rope_scaling yarn with factor {}, original context {} and max_position_embeddings {}: ptk's YaRN has the "
        "original context {} and one factor (max_position_embeddings / original_max_position_embeddings)",
        Num(factor), Num(original), c->max_position_embeddings, kMlaYarnOriginalContext));
  if (get("beta_fast", 32) != 32 || get("beta_slow", 1) != 1)
    return r.Bad("rope_scaling's beta_fast and beta_slow: ptk's YaRN takes 32 and 1");
  const double m = get("mscale", 0), all = get("mscale_all_dim", 0);
  const double hf = v.count("attention_factor")
                        ? v["attention_factor"]
                        : (m != 0 && all != 0 ? cpu::YarnGetMscale(factor, m) / cpu::YarnGetMscale(factor, all)
                                              : cpu::YarnGetMscale(factor, 1));
  if (factor <= 1 && hf != 1)  // ptk's concentration factor is 1 at a factor of 1 or below
    return r.Bad(fmt::format("rope_scaling's attention_factor {} with factor {}: ptk's YaRN scales by 1 there", Num(hf),
                             Num(factor)));
  c->mla_yarn = true;
  c->rotary_scaling_factor = factor;
  c->mscale_all_dim = all;
  // ptk's concentration factor is mscale(f, mscale) / mscale(f, mscale_all_dim): the mscale that gives HF's.
  c->mscale = factor > 1 ? ((hf * cpu::YarnGetMscale(factor, all)) - 1) / (0.1 * std::log(factor)) : 1.0;
  if (factor > 1 && m != 0 && std::abs(c->mscale - m) <= 1e-9 * std::abs(m)) c->mscale = m;  // as written
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GPTConfig> ReadDeepseekV3Config(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                               std::vector<std::string>* notes) {
  GPTConfig c;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.qk_layernorm = true;  // q_a_layernorm, kv_a_layernorm
  c.add_bias_linear = false;
  c.multi_latent_attention = true;
  PTK_RETURN_IF_ERROR(ReadDeepseekDims(r, make_vocab_size_divisible_by, &c));
  PTK_RETURN_IF_ERROR(ReadDeepseekMoe(r, &c));
  std::string_view act;
  PTK_RETURN_IF_ERROR(r.Get("hidden_act", std::string_view("silu"), &act, "a string"));
  if (act != "silu") return r.Bad(fmt::format("hidden_act {:?}: ptk's gated MLP is SwiGLU's (\"silu\")", act));
  PTK_RETURN_IF_ERROR(r.GetReal("rms_norm_eps", 1e-6, &c.layernorm_epsilon, 0, true, kMaxLayerNormEpsilon, false));
  if (c.layernorm_epsilon != 1e-6)
    return r.Bad(fmt::format(
        "rms_norm_eps {}: DeepseekV3Attention's latent norms take 1e-6 whatever it is, ptk one epsilon for every norm",
        Num(c.layernorm_epsilon)));
  PTK_RETURN_IF_ERROR(r.GetReal("attention_dropout", 0.0, &c.attention_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(r.GetReal("initializer_range", 0.02, &c.init_method_std, 0, true, kMaxInitMethodStd, false));
  c.hidden_dropout = 0.0;  // DeepseekV3ForCausalLM has none
  PTK_RETURN_IF_ERROR(ReadDeepseekRope(r, &c));
  const double h = static_cast<double>(c.hidden_size),
               implied = static_cast<double>(c.num_layers) *
                             (h * static_cast<double>(c.ffn_hidden_size) * 3 +
                              static_cast<double>(c.num_experts + 1) * 3 * h * static_cast<double>(c.moe_ffn())) +
                         2 * h * static_cast<double>(c.vocab_size);
  if (implied > 0x1p40)
    return r.Bad(
        fmt::format("num_hidden_layers {}, hidden_size {} and n_routed_experts {} make {:.3g} parameters: "
                    "more than ptk can hold",
                    c.num_layers, c.hidden_size, c.num_experts, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  return c;
}

std::vector<std::pair<std::string, std::string>> DeepseekV3Settings(const GPTConfig& c) {
  std::vector<std::pair<std::string, std::string>> s = LlamaSettings(c);
  auto num = [](double v) { return fmt::format("{}", v); };
  s.insert(s.end(), {{"--multi-latent-attention", "on"},
                     {"--q-lora-rank", c.q_lora_rank > 0 ? Int(c.q_lora_rank) : "None"},
                     {"--kv-lora-rank", Int(c.kv_lora_rank)},
                     {"--qk-head-dim", Int(c.qk_head_dim)},
                     {"--qk-pos-emb-head-dim", Int(c.qk_pos_emb_head_dim)},
                     {"--v-head-dim", Int(c.v_head_dim)},
                     {"--rope-type", c.mla_yarn ? "yarn" : "rope"},
                     {"--rotary-scaling-factor", num(c.rotary_scaling_factor)},
                     {"--mscale", num(c.mscale)},
                     {"--mscale-all-dim", num(c.mscale_all_dim)}});
  if (!c.moe()) return s;
  std::string freq;
  for (int64_t l = 0; l < c.num_layers; ++l) freq += fmt::format("{}{}", l ? "," : "[", c.moe_layer(l) ? 1 : 0);
  s.insert(s.end(), {{"--num-experts", Int(c.num_experts)},
                     {"--moe-router-topk", Int(c.moe_router_topk)},
                     {"--moe-ffn-hidden-size", Int(c.moe_ffn())},
                     {"--moe-router-score-function", "sigmoid"},
                     {"--moe-router-enable-expert-bias", "on"},
                     {"--moe-router-topk-scaling-factor", num(c.moe_router_topk_scaling_factor)},
                     {"--moe-router-num-groups", Int(c.moe_router_num_groups)},
                     {"--moe-router-group-topk", Int(c.moe_router_group_topk)},
                     {"--moe-shared-expert-intermediate-size", Int(c.moe_shared_expert_intermediate_size)},
                     {"--moe-layer-freq", c.moe_layers() == c.num_layers ? "1" : freq + "]"}});
  return s;
}

std::string DeepseekV3TrainFlags(const GPTConfig& c) {
  std::string flags = LlamaTrainFlags(c);  // the dense parts; --qk-layernorm: MLA's latent norms
  flags += fmt::format(
      " --multi-latent-attention --kv-lora-rank {} --qk-head-dim {} --qk-pos-emb-head-dim {} --v-head-dim {} "
      "--rope-type {}",
      c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.mla_yarn ? "yarn" : "rope");
  if (c.q_lora_rank > 0) flags += fmt::format(" --q-lora-rank {}", c.q_lora_rank);
  if (c.mla_yarn)
    flags += fmt::format(" --rotary-scaling-factor {} --mscale {} --mscale-all-dim {}", c.rotary_scaling_factor,
                         c.mscale, c.mscale_all_dim);
  if (!c.moe()) return flags;
  flags += fmt::format(
      " --num-experts {} --moe-router-topk {} --moe-ffn-hidden-size {} --moe-router-score-function sigmoid "
      "--moe-router-enable-expert-bias --moe-shared-expert-intermediate-size {}",
      c.num_experts, c.moe_router_topk, c.moe_ffn(), c.moe_shared_expert_intermediate_size);
  if (c.moe_router_topk_scaling_factor > 0)
    flags += fmt::format(" --moe-router-topk-scaling-factor {}", c.moe_router_topk_scaling_factor);
  if (c.moe_router_group_topk > 0)
    flags += fmt::format(" --moe-router-num-groups {} --moe-router-group-topk {}", c.moe_router_num_groups,
                         c.moe_router_group_topk);
  if (c.moe_layers() != c.num_layers) {
    std::string freq;
    for (int64_t l = 0; l < c.num_layers; ++l) freq += fmt::format("{}{}", l ? "," : "[", c.moe_layer(l) ? 1 : 0);
    flags += fmt::format(" --moe-layer-freq \"{}]\"", freq);
  }
  return flags;
}

}  // namespace ptk::hf_detail
