// ptk-train's multi-latent attention flags (Megatron's --multi-latent-attention, --q-lora-rank,
// --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim and the rotary settings MLA reads:
// --rope-type, --rotary-scaling-factor, --mscale, --mscale-all-dim): declared, resolved into GPTConfig,
// and what ptk's MLA layers do not run with refused in one line each.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {

using train_flags::IntIn;
using train_flags::kMaxSize;

void AddMlaFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::Mla& m = f->mla;
  app->add_flag("--multi-latent-attention", m.on,
                "Multi-latent attention (DeepSeek-V2/V3, megatron-core's MLASelfAttention): queries and keys/values "
                "through low-rank latents, a shared rotary key; CPU only");
  app->add_option("--q-lora-rank", m.q_lora_rank,
                  "MLA: the queries' latent rank (linear_q_down_proj, q_layernorm, linear_q_up_proj); default none: "
                  "linear_q_proj")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--kv-lora-rank", m.kv_lora_rank, "MLA: the keys' and values' latent rank (default 32)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--qk-head-dim", m.qk_head_dim,
                  "MLA: each query and key head's channels without rotary embedding (default 128)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim,
                  "MLA: each query head's rotary channels, and the shared rotary key's (default 64; even)")
      ->check(IntIn(2, kMaxSize));
  app->add_option("--v-head-dim", m.v_head_dim, "MLA: each value head's channels (default 128)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--rope-type", m.rope_type,
                  "MLA's rotary embedding: yarn (Megatron's default with --multi-latent-attention) or rope; "
                  "without MLA only rope");
  app->add_option("--rotary-scaling-factor", m.rotary_scaling_factor,
                  "MLA: YaRN's scaling factor, and (above 1) with --mscale-all-dim the softmax scale's (default 1)")
      ->check(cli::Positive());
  app->add_option("--mscale", m.mscale, "MLA with YaRN: the concentration factor's mscale (default 1)")
      ->check(cli::RealIn(-1e6, true, 1e6, true));
  app->add_option("--mscale-all-dim", m.mscale_all_dim,
                  "MLA: YaRN's mscale_all_dim, also in the softmax scale mscale^2 / sqrt(qk + pe) (default 0)")
      ->check(cli::RealIn(-1e6, true, 1e6, true));
}

absl::Status ResolveMlaFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Mla& m = f.mla;
  if (!m.rope_type.empty() && m.rope_type != "rope" && m.rope_type != "yarn")
    return UsageError("--rope-type " + m.rope_type + ": rope or yarn (Megatron's choices)");
  if (!m.on) {
    if (m.rope_type == "yarn")
      return UsageError(
          "--rope-type yarn without --multi-latent-attention: Megatron's common attention takes only rope (it "
          "asserts so)");
    const TrainFlags::Mla defaults;
    if (m.q_lora_rank || m.kv_lora_rank != defaults.kv_lora_rank || m.qk_head_dim != defaults.qk_head_dim ||
        m.qk_pos_emb_head_dim != defaults.qk_pos_emb_head_dim || m.v_head_dim != defaults.v_head_dim ||
        m.rotary_scaling_factor != defaults.rotary_scaling_factor || m.mscale != defaults.mscale ||
        m.mscale_all_dim != defaults.mscale_all_dim)
      notes->push_back(
          "--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim, "
          "--rotary-scaling-factor, --mscale, --mscale-all-dim: accepted, no effect without "
          "--multi-latent-attention (as Megatron)");
    return absl::OkStatus();
  }
  if (f.compat.count("--cache-mla-latents") > 0)
    return UsageError(
        "--multi-latent-attention with --cache-mla-latents: an inference setting (megatron-core's MLA asserts it "
        "conflicts with training)");
  if (f.group_query_attention)
    return UsageError(
        "--multi-latent-attention with --group-query-attention: MLA has a key and a value head per query head "
        "(Megatron asserts not both)");
  if (model->rotary_percent != 1.0)
    return UsageError(fmt::format(
        "--multi-latent-attention with --rotary-percent {}: ptk's MLA rotates all --qk-pos-emb-head-dim channels",
        model->rotary_percent));
  for (const auto& [flag, on] :
       {std::pair{"--rotary-interleaved", model->rotary_interleaved},
        {"--use-rope-scaling", model->use_rope_scaling},
        {"--rotary-seq-len-interpolation-factor", model->rotary_seq_len_interpolation_factor > 0}})
    if (on)
      return UsageError(fmt::format(
          "--multi-latent-attention with {}: MLA's rotary embedding is --rope-type rope or yarn (megatron-core's MLA "
          "does not read {})",
          flag, flag));
  if (m.qk_pos_emb_head_dim % 2 != 0)
    return UsageError(fmt::format("--qk-pos-emb-head-dim {}: the rotary channels come in pairs (an even count)",
                                  m.qk_pos_emb_head_dim));
  const bool yarn = m.rope_type != "rope";
  if (yarn && m.rotary_scaling_factor > 1 && (0.1 * m.mscale_all_dim * std::log(m.rotary_scaling_factor) + 1.0) == 0)
    return UsageError("--mscale-all-dim: YaRN's concentration factor would divide by zero");
  model->multi_latent_attention = true;
  model->q_lora_rank = m.q_lora_rank.value_or(0);
  model->kv_lora_rank = m.kv_lora_rank;
  model->qk_head_dim = m.qk_head_dim;
  model->qk_pos_emb_head_dim = m.qk_pos_emb_head_dim;
  model->v_head_dim = m.v_head_dim;
  model->mla_yarn = yarn;
  model->rotary_scaling_factor = m.rotary_scaling_factor;
  model->mscale = m.mscale;
  model->mscale_all_dim = m.mscale_all_dim;
  if (m.rope_type.empty())
    notes->push_back(
        "--multi-latent-attention without --rope-type: yarn, as Megatron's MLATransformerConfig (give --rope-type "
        "rope for plain RoPE)");
  if (!model->qk_layernorm)
    notes->push_back(
        "--multi-latent-attention without --qk-layernorm: no q_layernorm / kv_layernorm on the latents, as "
        "megatron-core's local spec (its TE spec always has them; DeepSeek's recipes give --qk-layernorm)");
  if (!yarn && m.mscale != 1.0)
    notes->push_back("--mscale: accepted, no effect with --rope-type rope (as Megatron: only YaRN reads it)");
  return absl::OkStatus();
}

absl::Status RefuseMlaParallelismAndDevice(const TrainFlags& f, Device device) {
  if (!f.mla.on) return absl::OkStatus();
  // --context-parallel-size and --mtp-num-layers with tensor ranks run (mla_cp_train_cli_test; mtp_parallel_cli_test,
  // mtp_moe_golden_test at two sequence-parallel ranks).
  // The CUDA backend's multi-latent attention (trainer/cuda/cuda_mla_layer.cpp) is data-parallel only.
  if (device == Device::kCpu) return absl::OkStatus();
  const std::pair<const char*, int64_t> sizes[] = {{"--tensor-model-parallel-size", f.tensor_model_parallel_size},
                                                   {"--pipeline-model-parallel-size", f.pipeline_model_parallel_size},
                                                   {"--context-parallel-size", f.context_parallel_size}};
  for (const auto& [flag, size] : sizes)
    if (size > 1)
      return UsageError(fmt::format(
          "--multi-latent-attention on --device cuda with {} {}: the CUDA backend's multi-latent attention is "
          "data-parallel only; train on the CPU (--device cpu, fp32)",
          flag, size));
  return absl::OkStatus();
}

}  // namespace ptk
