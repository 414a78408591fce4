// ptk-train's flags of Megatron's Llama line (RMSNorm, rotary embeddings, SwiGLU, grouped-query
// attention, bias-free layers): declared with AddLlamaFlags, turned into the model's settings by
// ResolveLlamaFlags (Megatron's defaults and conventions, usage errors naming the flag).
#include <fmt/core.h>

#include "common/cli.h"
#include "tools/train_flag_parts.h"
#include "tools/train_flags.h"
#include "trainer/backend.h"

namespace ptk {

void AddLlamaFlags(CLI::App* app, TrainFlags* f) {
  GPTConfig& m = f->options.model;
  app->add_option("--position-embedding-type", f->position_embedding_type,
                  "learned_absolute (GPT-3's), rope (rotary, Llama's) or none");
  app->add_flag("--use-rotary-position-embeddings", f->use_rotary_position_embeddings,
                "Megatron's older spelling of --position-embedding-type rope");
  app->add_flag("--no-position-embedding", f->no_position_embedding,
                "No learned position table (Megatron's older spelling of --position-embedding-type none)");
  app->add_option("--normalization", f->normalization, "LayerNorm (GPT-3's) or RMSNorm (Llama's)");
  app->add_option("--rotary-base", m.rotary_base, "RoPE's base (theta; Megatron's default 10000)")
      ->check(cli::Positive());
  app->add_option("--rotary-percent", m.rotary_percent, "Share of each head's channels RoPE rotates, in (0, 1]")
      ->check(cli::RealIn(0, true, 1, false));
  app->add_flag("--use-rope-scaling", m.use_rope_scaling,
                "Llama 3.x's RoPE frequency scaling (--rope-scaling-factor, low/high frequency factors 1/4, original "
                "context 8192)");
  app->add_option("--rope-scaling-factor", m.rope_scaling_factor,
                  "--use-rope-scaling's factor (Megatron's default 8, Llama 3.1's; Llama 3.2 1B/3B use 32)")
      ->check(cli::Positive());
  app->add_option("--rotary-seq-len-interpolation-factor", m.rotary_seq_len_interpolation_factor,
                  "Linear position interpolation: RoPE's positions divided by this factor (default none)")
      ->check(cli::Positive());
  app->add_flag("--rotary-interleaved", m.rotary_interleaved,
                "RoPE rotates pairs of adjacent channels (2i, 2i+1; Meta's original layout), not channel i with i + "
                "d/2");
  app->add_flag("--swiglu", m.swiglu,
                "SwiGLU MLP: fc1 gives [gate; up] (2 x --ffn-hidden-size rows), fc2 takes silu(gate) * up");
  app->add_flag("--group-query-attention", f->group_query_attention,
                "Grouped-query attention: --num-query-groups key/value heads, each shared by a group of query heads");
  app->add_option("--num-query-groups", f->num_query_groups,
                  "Key/value heads with --group-query-attention (Megatron's default 1)")
      ->check(cli::IntIn(1, train_flags::kMaxSize));
  app->add_flag("--disable-bias-linear", f->disable_bias_linear,
                "Linear layers without biases (Llama's; on the GELU MLP the exact erf GELU too, as Megatron, which "
                "turns its fused bias-GELU kernel off without biases)");
  app->add_flag("--add-qkv-bias", m.add_qkv_bias, "A QKV bias even with --disable-bias-linear (Qwen's)");
  app->add_flag("--qk-layernorm", m.qk_layernorm,
                "Normalise each query and key head (--normalization's norm over --kv-channels) before RoPE "
                "(Qwen3's q_norm / k_norm)");
  app->add_flag("--qk-l2-norm", m.qk_l2_norm,
                "Scale each query and key head by rsqrt(mean(x^2) + --norm-epsilon) before RoPE, no weights (Llama 4's "
                "L2 norm; not with --qk-layernorm; CPU backend)");
  app->add_flag("--attention-output-gate", m.attention_output_gate,
                "Gated attention (Qwen3-Next's): the QKV projection also gives a gate head per query head, and the "
                "attention's output is multiplied by sigmoid(gate) before the output projection (CPU backend)");
  app->add_flag("--squared-relu", m.squared_relu, "MLP activation relu(x)^2 instead of GELU (not with --swiglu)");
  app->add_flag("--apply-layernorm-1p", m.apply_layernorm_1p,
                "Every norm (LayerNorm or RMSNorm, with --qk-layernorm the query and key norms too) scales by 1 + "
                "weight, its weight initialised to 0 (Megatron's zero-centred gamma)");
  app->add_flag("--init-method-xavier-uniform", m.init_method_xavier_uniform,
                "Every weight matrix (embeddings, QKV, proj, fc1, fc2, output layer) from xavier-uniform over the "
                "whole tensor, instead of N(0, --init-method-std)");
}

absl::Status ResolveLlamaFlags(const TrainFlags& f, int64_t tp, GPTConfig* m) {
  if (f.normalization == "LayerNorm")
    m->normalization = Normalization::kLayerNorm;
  else if (f.normalization == "RMSNorm")
    m->normalization = Normalization::kRMSNorm;
  else
    return UsageError("--normalization " + f.normalization + ": ptk has LayerNorm and RMSNorm");
  std::string type = f.use_rotary_position_embeddings ? "rope" : f.position_embedding_type;
  if (f.no_position_embedding && type != "rope") type = "none";  // Megatron's validate_args
  if (type == "learned_absolute")
    m->position_embedding = PositionEmbedding::kLearnedAbsolute;
  else if (type == "rope")
    m->position_embedding = PositionEmbedding::kRope;
  else if (type == "none")
    m->position_embedding = PositionEmbedding::kNone;
  else
    return UsageError("--position-embedding-type " + type + ": ptk has learned_absolute, rope and none");
  m->kv_channels = f.kv_channels;
  // Megatron: without --group-query-attention every query head has its key and value head.
  m->num_query_groups = f.group_query_attention ? f.num_query_groups : 0;
  m->add_bias_linear = !f.disable_bias_linear;
  // Megatron's default for SwiGLU: two thirds of 4h (the parameters of a 4h GELU MLP), down to a
  // multiple of 64.
  if (m->ffn_hidden_size == 0 && m->swiglu) m->ffn_hidden_size = (4 * m->hidden_size * 2 / 3) / 64 * 64;
  if (m->squared_relu && m->swiglu)
    return UsageError("--squared-relu with --swiglu: one MLP activation (Megatron asserts not both)");
  // Megatron's GELU MLP is the tanh GELU only through its fused bias-GELU kernel (bias_gelu_impl); without it
  // (--no-bias-gelu-fusion, or no biases: its arguments.py turns the fusion off without them) the MLP calls
  // torch's F.gelu, the exact erf GELU.
  m->gelu_exact = !m->swiglu && !m->squared_relu && (f.compat.contains("--no-bias-gelu-fusion") || !m->add_bias_linear);
  if (m->qk_l2_norm && m->qk_layernorm)  // megatron-core's specs build L2Norm alone, --qk-layernorm's norms left out
    return UsageError(
        "--qk-l2-norm with --qk-layernorm: megatron-core replaces the query and key norms by the L2 "
        "norm (no q_layernorm / k_layernorm weights); give one of them");
  for (const auto& [flag, on] :
       {std::pair{"--attention-output-gate", m->attention_output_gate}, {"--qk-l2-norm", m->qk_l2_norm}})
    if (on && f.mla.on)
      return UsageError(fmt::format("{} with --multi-latent-attention: megatron-core has no {} for MLA", flag,
                                    std::string(flag) == "--qk-l2-norm" ? "query and key L2 norm" : "output gate"));
  if (tp > 1 && m->query_groups() % tp != 0)
    return UsageError(fmt::format("--num-query-groups {} is not divisible by --tensor-model-parallel-size {}",
                                  m->query_groups(), tp));
  return absl::OkStatus();
}

void NoteRotaryFlags(const GPTConfig& m, std::vector<std::string>* notes) {
  // Megatron reads them only where RoPE (and, for the factor, its scaling) is on.
  auto note = [&](bool given, const std::string& flag, const char* needs) {
    if (given) notes->push_back(fmt::format("{}: accepted, no effect without {} (as Megatron)", flag, needs));
  };
  const bool factor = m.rope_scaling_factor != 8.0, interpolation = m.rotary_seq_len_interpolation_factor > 0;
  if (!m.rope()) {
    note(m.rotary_interleaved, "--rotary-interleaved", "--position-embedding-type rope");
    note(interpolation, "--rotary-seq-len-interpolation-factor", "--position-embedding-type rope");
    note(factor, "--rope-scaling-factor", "--position-embedding-type rope");
  } else {
    note(factor && !m.use_rope_scaling, "--rope-scaling-factor", "--use-rope-scaling");
  }
}

}  // namespace ptk
