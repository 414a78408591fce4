// GPTConfig's checks: every setting and combination the model implements, worded by setting.
#include <cmath>
#include <string>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/model_limits.h"
#include "trainer/mtp_layout.h"
#include "trainer/param_layout.h"

namespace ptk {

// Worded by setting (GPTConfig's names, which are Megatron's argument names): a library knows no flags;
// ptk-train's flag resolution turns each name into its flag.
absl::Status GPTConfig::Validate() const {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  auto at_least_1 = [&](const char* name, int64_t v) { return bad(fmt::format("{} {}: must be at least 1", name, v)); };
  if (num_layers < 1) return at_least_1("num_layers", num_layers);
  PTK_RETURN_IF_ERROR(ValidateMtpConfig(*this));
  if (softmax_type != "vanilla" && softmax_type != "off-by-one" && softmax_type != "learnable")
    return bad("softmax_type " + softmax_type + ": vanilla, off-by-one or learnable");
  if (window_left < -1) return bad(fmt::format("window_left {}: at least 0 (or -1: no window)", window_left));
  if (!window_pattern.empty() && static_cast<int64_t>(window_pattern.size()) != num_layers)
    return bad(fmt::format("window_pattern has {} entries for num_layers {}: one per layer", window_pattern.size(),
                           num_layers));
  if (window_left >= 0 && !window_pattern.empty() && window_skip_freq == 0 && mtp_num_layers > 0)
    return bad(
        "window_pattern (a list window_attn_skip_freq) with mtp_num_layers: megatron-core's "
        "is_layer_window_attention indexes the list at the depths' layer numbers, num_layers + 1 on, past its "
        "num_layers entries (IndexError); give a count");
  if (hidden_size < 1) return at_least_1("hidden_size", hidden_size);
  if (num_attention_heads < 1) return at_least_1("num_attention_heads", num_attention_heads);
  if (kv_channels < 0)
    return bad(
        fmt::format("kv_channels {}: must be at least 1 (or 0: hidden_size / num_attention_heads)", kv_channels));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    return bad(fmt::format("num_attention_heads {} does not divide hidden_size {}", num_attention_heads, hidden_size));
  if (num_query_groups < 0 || (num_query_groups > 0 && num_attention_heads % num_query_groups != 0))
    return bad(fmt::format("num_query_groups {} does not divide num_attention_heads {}", num_query_groups,
                           num_attention_heads));
  if (rope()) {
    if (!(rotary_base > 0 && std::isfinite(rotary_base)))
      return bad(fmt::format("rotary_base {}: must be positive", rotary_base));
    if (!(rotary_percent > 0 && rotary_percent <= 1))
      return bad(fmt::format("rotary_percent {}: must be in (0, 1]", rotary_percent));
    if (!(rope_scaling_factor > 0 && std::isfinite(rope_scaling_factor)))
      return bad(fmt::format("rope_scaling_factor {}: must be positive", rope_scaling_factor));
    if (!(rotary_seq_len_interpolation_factor >= 0 && std::isfinite(rotary_seq_len_interpolation_factor)))
      return bad(fmt::format("rotary_seq_len_interpolation_factor {}: must be positive (0: none)",
                             rotary_seq_len_interpolation_factor));
    if (rotary_dim() < 2 || rotary_dim() % 2 != 0)
      return bad(
          fmt::format("rotary_percent {} of head dimension {} rotates {} channels: must be an even number, at least 2",
                      rotary_percent, head_dim(), rotary_dim()));
  }
  if (ffn_hidden_size < 1) return at_least_1("ffn_hidden_size", ffn_hidden_size);
  if (squared_relu && swiglu) return bad("squared_relu with swiglu: Megatron asserts not both (one MLP activation)");
  if (gelu_exact && (swiglu || squared_relu))
    return bad(fmt::format("gelu_exact with {}: one MLP activation", swiglu ? "swiglu" : "squared_relu"));
  if (seq_length < 1) return at_least_1("seq_length", seq_length);
  if (max_position_embeddings < seq_length)
    return bad(
        fmt::format("max_position_embeddings {} is less than seq_length {}", max_position_embeddings, seq_length));
  if (vocab_size < 1) return at_least_1("vocab_size", vocab_size);
  if (padded_vocab_size < vocab_size)
    return bad(fmt::format("padded_vocab_size {} is less than vocab_size {}", padded_vocab_size, vocab_size));
  if (hidden_dropout < 0 || hidden_dropout >= 1)
    return bad(fmt::format("hidden_dropout {}: must be in [0, 1)", hidden_dropout));
  if (attention_dropout < 0 || attention_dropout >= 1)
    return bad(fmt::format("attention_dropout {}: must be in [0, 1)", attention_dropout));
  if (!(layernorm_epsilon > 0 && layernorm_epsilon <= kGptConfigMaxLayerNormEpsilon))
    return bad(
        fmt::format("layernorm_epsilon {}: must be in (0, {}]", layernorm_epsilon, kGptConfigMaxLayerNormEpsilon));
  if (!(init_method_std > 0 && init_method_std <= kGptConfigMaxInitMethodStd))
    return bad(fmt::format("init_method_std {}: must be in (0, {}]", init_method_std, kGptConfigMaxInitMethodStd));
  if (!(embedding_init_method_std >= 0 && embedding_init_method_std <= kGptConfigMaxInitMethodStd))
    return bad(fmt::format("embedding_init_method_std {}: must be in (0, {}] (0: init_method_std's)",
                           embedding_init_method_std, kGptConfigMaxInitMethodStd));
  if (qk_l2_norm && qk_layernorm)  // megatron-core's specs then build L2Norm alone, --qk-layernorm's norms left out
    return bad("qk_l2_norm with qk_layernorm: megatron-core replaces the query and key norms by the L2 norm; give one");
  PTK_RETURN_IF_ERROR(ValidateMla());
  return ValidateMoe();
}

std::string GPTConfig::WindowSkipFreqSetting() const {
  if (mtp_num_layers > 0 && window_skip_freq > 0) return std::to_string(window_skip_freq);
  std::string layers = "[";
  for (int64_t l = 0; l < num_layers; ++l) layers += fmt::format("{}{}", l ? "," : "", window_layer(l) ? 1 : 0);
  return layers + "]";
}

double GPTConfig::MlaSoftmaxScale() const {
  const double m = rotary_scaling_factor <= 1 ? 1.0 : 0.1 * mscale_all_dim * std::log(rotary_scaling_factor) + 1.0;
  return m * m / std::sqrt(static_cast<double>(mla_q_head_dim()));
}

absl::Status GPTConfig::ValidateMla() const {
  if (!mla()) return absl::OkStatus();
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (attention_output_gate)  // MLATransformerConfig raises NotImplementedError
    return bad("attention_output_gate with multi_latent_attention: megatron-core has no output gate for MLA");
  if (qk_l2_norm) return bad("qk_l2_norm with multi_latent_attention: megatron-core's MLA specs assert it off");
  for (auto [name, v] : {std::pair{"kv_lora_rank", kv_lora_rank},
                         {"qk_head_dim", qk_head_dim},
                         {"qk_pos_emb_head_dim", qk_pos_emb_head_dim},
                         {"v_head_dim", v_head_dim}})
    if (v < 1) return bad(fmt::format("{} {}: must be at least 1", name, v));
  if (q_lora_rank < 0) return bad(fmt::format("q_lora_rank {}: must be at least 1 (or 0: none)", q_lora_rank));
  if (qk_pos_emb_head_dim % 2 != 0)
    return bad(fmt::format("qk_pos_emb_head_dim {}: the rotary channels must be even", qk_pos_emb_head_dim));
  if (!(rotary_base > 0 && std::isfinite(rotary_base)))
    return bad(fmt::format("rotary_base {}: must be positive", rotary_base));
  if (!(rotary_scaling_factor > 0 && std::isfinite(rotary_scaling_factor)))
    return bad(fmt::format("rotary_scaling_factor {}: must be positive", rotary_scaling_factor));
  if (!std::isfinite(mscale) || !std::isfinite(mscale_all_dim))
    return bad(fmt::format("mscale {} and mscale_all_dim {}: must be finite", mscale, mscale_all_dim));
  if (mla_yarn && rotary_scaling_factor > 1 && 0.1 * mscale_all_dim * std::log(rotary_scaling_factor) + 1.0 == 0)
    return bad("mscale_all_dim makes YaRN's concentration factor divide by zero");
  if (rotary_percent != 1.0 || rotary_interleaved || use_rope_scaling || rotary_seq_len_interpolation_factor > 0)
    return bad(
        "multi_latent_attention rotates all qk_pos_emb_head_dim channels, non-interleaved, without Llama 3 scaling or "
        "position interpolation (rotary_percent 1)");
  if (num_query_groups > 0 && num_query_groups != num_attention_heads)
    return bad("multi_latent_attention with num_query_groups: MLA has a key and value per head");
  return absl::OkStatus();
}

absl::Status GPTConfig::ValidateMoe() const {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (num_experts < 0) return bad(fmt::format("num_experts {}: must be at least 1 (or 0: a dense MLP)", num_experts));
  if (!moe()) return absl::OkStatus();
  if (moe_router_topk < 1 || moe_router_topk > num_experts)
    return bad(fmt::format("moe_router_topk {}: must be in [1, num_experts {}]", moe_router_topk, num_experts));
  if (moe_ffn_hidden_size < 0)
    return bad(fmt::format("moe_ffn_hidden_size {}: must be at least 1 (or 0: ffn_hidden_size)", moe_ffn_hidden_size));
  if (!(moe_aux_loss_coeff >= 0 && std::isfinite(moe_aux_loss_coeff)))
    return bad(fmt::format("moe_aux_loss_coeff {}: must be at least 0", moe_aux_loss_coeff));
  if (!(moe_z_loss_coeff >= 0 && std::isfinite(moe_z_loss_coeff)))
    return bad(fmt::format("moe_z_loss_coeff {}: must be at least 0", moe_z_loss_coeff));
  for (double coeff : {moe_seq_aux_loss_coeff, moe_global_aux_loss_coeff, moe_router_bias_update_rate})
    if (!(coeff >= 0 && std::isfinite(coeff)))
      return bad(fmt::format("a load-balancing coefficient or bias update rate of {}: must be at least 0", coeff));
  if (moe_router_enable_expert_bias && !moe_router_sigmoid)
    return bad("moe_router_enable_expert_bias needs the sigmoid score function (Megatron's TransformerConfig)");
  if (!(moe_router_topk_scaling_factor >= 0 && std::isfinite(moe_router_topk_scaling_factor)))
    return bad(
        fmt::format("moe_router_topk_scaling_factor {}: must be above 0 (or 0: none)", moe_router_topk_scaling_factor));
  if (!std::isfinite(moe_expert_capacity_factor))
    return bad(
        fmt::format("moe_expert_capacity_factor {}: must be finite (or below 0: none)", moe_expert_capacity_factor));
  if (moe_router_group_topk != 0) {  // Megatron's checks, and what leaves its top-k without ties of -inf
    const int64_t G = moe_router_num_groups, g = moe_router_group_topk;
    if (G < 1 || num_experts % G != 0 || g < 1 || g > G)
      return bad(
          fmt::format("moe_router_num_groups {} / moe_router_group_topk {}: the groups must divide num_experts "
                      "{} and the chosen groups be at most the groups",
                      G, g, num_experts));
    if (moe_router_topk < g || moe_router_topk > g * (num_experts / G))
      return bad(
          fmt::format("moe_router_topk {} with moe_router_group_topk {} of {} groups of {} experts: each chosen "
                      "group gives topk / group_topk (at least 1) experts to its score, and the chosen groups "
                      "hold at least topk experts",
                      moe_router_topk, g, G, num_experts / G));
  }
  if (!moe_layer_pattern.empty() && static_cast<int64_t>(moe_layer_pattern.size()) != num_layers)
    return bad(fmt::format("moe_layer_freq has {} entries for num_layers {}: one per layer", moe_layer_pattern.size(),
                           num_layers));
  for (int v : moe_layer_pattern)
    if (v != 0 && v != 1) return bad(fmt::format("moe_layer_freq entry {}: each is 0 (dense) or 1 (experts)", v));
  if (moe_shared_expert_intermediate_size < 0)
    return bad(fmt::format("moe_shared_expert_intermediate_size {}: must be at least 1 (or 0: no shared experts)",
                           moe_shared_expert_intermediate_size));
  if (add_bias_linear)
    return bad(
        "num_experts with add_bias_linear: the mixture-of-experts layers are implemented without biases "
        "(disable_bias_linear)");
  return absl::OkStatus();
}

}  // namespace ptk
