// Megatron's multi-latent attention in its `torch` checkpoints (megatron-core 0.16.1's MLASelfAttention, built from
// MLATransformerConfig by Megatron-LM's core_transformer_config_from_args): the args that describe it, written and
// read, the refusals of what ptk's MLA does not compute or the export does not write, and ptk-train's flags for it.
// The tensors' names are MegParams' (interop/megatron_common.cpp).
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/status.h"
#include "interop/megatron_common.h"
#include "trainer/run_settings.h"

namespace ptk::megatron {

// YaRN's settings MLATransformerConfig keeps at its defaults in megatron-core 0.16.1 (Megatron-LM's arguments have no
// flag for them there; later ones name them --yarn-*): ptk's YaRN tables use these.
namespace {
constexpr double kYarnOriginalContext = 4096, kYarnBetaFast = 32, kYarnBetaSlow = 1;
}  // namespace

void SetMlaArgs(const GPTConfig& c, PyValue* a) {
  auto set_i = [&](const char* k, int64_t v) { torchfmt::DictSet(a, k, torchfmt::MakeInt(v)); };
  auto set_f = [&](const char* k, double v) { torchfmt::DictSet(a, k, torchfmt::MakeFloat(v)); };
  torchfmt::DictSet(a, "multi_latent_attention", torchfmt::MakeBool(c.mla()));
  if (!c.mla()) return;
  // --q-lora-rank's default None: linear_q_proj.
  torchfmt::DictSet(a, "q_lora_rank", c.q_lora_rank > 0 ? torchfmt::MakeInt(c.q_lora_rank) : torchfmt::MakeNone());
  set_i("kv_lora_rank", c.kv_lora_rank);
  set_i("qk_head_dim", c.qk_head_dim);
  set_i("qk_pos_emb_head_dim", c.qk_pos_emb_head_dim);
  set_i("v_head_dim", c.v_head_dim);
  torchfmt::DictSet(a, "rope_type", torchfmt::MakeStr(c.mla_yarn ? "yarn" : "rope"));
  set_f("rotary_scaling_factor", c.rotary_scaling_factor);
  set_f("mscale", c.mscale);
  set_f("mscale_all_dim", c.mscale_all_dim);
  torchfmt::DictSet(a, "cache_mla_latents", torchfmt::MakeBool(false));
}

absl::Status ReadMlaArgs(const PyValue* args, const std::string& source, GPTConfig* c) {
  if (!BoolAttr(args, "multi_latent_attention", false)) return absl::OkStatus();
  std::vector<std::string> why;
  c->multi_latent_attention = true;
  // Megatron-LM's defaults where its args lack one (an older Megatron-LM's checkpoint).
  c->q_lora_rank = static_cast<int64_t>(NumAttr(args, "q_lora_rank").value_or(0));  // None: linear_q_proj
  c->kv_lora_rank = static_cast<int64_t>(NumAttr(args, "kv_lora_rank").value_or(32));
  c->qk_head_dim = static_cast<int64_t>(NumAttr(args, "qk_head_dim").value_or(128));
  c->qk_pos_emb_head_dim = static_cast<int64_t>(NumAttr(args, "qk_pos_emb_head_dim").value_or(64));
  c->v_head_dim = static_cast<int64_t>(NumAttr(args, "v_head_dim").value_or(128));
  // args.rope_type None: MLATransformerConfig's default, yarn.
  const std::string rope = StrAttr(args, "rope_type").value_or("yarn");
  if (rope != "rope" && rope != "yarn") why.push_back("--rope-type " + rope);
  c->mla_yarn = rope == "yarn";
  c->rotary_scaling_factor = NumAttr(args, "rotary_scaling_factor").value_or(1.0);
  c->mscale = NumAttr(args, "mscale").value_or(1.0);
  c->mscale_all_dim = NumAttr(args, "mscale_all_dim").value_or(0.0);
  // MLA's own rotary embedding reads rotary_base, rotary_percent and rotary_interleaved whatever the position
  // embedding; GPTModel builds none of its own under MLA, so Llama 3 scaling and interpolation are not read.
  c->rotary_base = NumAttr(args, "rotary_base").value_or(10000.0);
  c->rotary_percent = NumAttr(args, "rotary_percent").value_or(1.0);
  c->rotary_interleaved = BoolAttr(args, "rotary_interleaved", false);
  c->use_rope_scaling = false;
  c->rotary_seq_len_interpolation_factor = 0;
  for (const auto& [key, fallback] : {std::pair{"original_max_position_embeddings", kYarnOriginalContext},
                                      {"yarn_original_max_position_embeddings", kYarnOriginalContext},
                                      {"beta_fast", kYarnBetaFast},
                                      {"yarn_beta_fast", kYarnBetaFast},
                                      {"beta_slow", kYarnBetaSlow},
                                      {"yarn_beta_slow", kYarnBetaSlow}})
    if (auto v = NumAttr(args, key); v && *v != fallback && c->mla_yarn)
      why.push_back(fmt::format("args.{} {} (ptk's YaRN: {})", key, *v, fallback));
  if (BoolAttr(args, "mla_down_proj_fusion", false))
    why.push_back("--mla-down-proj-fusion (the down projections fused into one tensor)");
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "{}: the multi-latent attention model was saved with {}: ptk reads megatron-core's MLASelfAttention with "
      "--rope-type rope or yarn, unfused down projections and megatron-core's YaRN defaults",
      source, fmt::join(why, ", ")));
}

absl::Status CheckMlaExport(const ConvertOptions& o, const GPTConfig& c, const std::string& file) {
  const int64_t tp = o.target_tensor_parallel_size;
  if (!c.mla() || tp <= 1 || o.saver_transformer_impl != "local") return absl::OkStatus();
  // The local spec's down projections are ColumnParallelLinear: megatron-core splits their rows over the ranks.
  const int64_t kv_rows = c.kv_lora_rank + c.qk_pos_emb_head_dim;
  if (kv_rows % tp != 0)
    return UsageError(fmt::format(
        "{}: --target-tensor-parallel-size {} does not divide linear_kv_down_proj's {} rows (kv_lora_rank {} + "
        "qk_pos_emb_head_dim {}), which the local spec's ColumnParallelLinear splits (--saver-transformer-impl "
        "transformer_engine keeps them whole)",
        file, tp, kv_rows, c.kv_lora_rank, c.qk_pos_emb_head_dim));
  if (c.q_lora_rank > 0 && c.q_lora_rank % tp != 0)
    return UsageError(fmt::format(
        "{}: --target-tensor-parallel-size {} does not divide linear_q_down_proj's {} rows (q_lora_rank), which the "
        "local spec's ColumnParallelLinear splits (--saver-transformer-impl transformer_engine keeps them whole)",
        file, tp, c.q_lora_rank));
  return absl::OkStatus();
}

void SplitMlaDown(bool te, std::vector<MegParam>* params) {
  if (te) return;  // TELinear with parallel_mode "duplicated": whole on every rank
  for (MegParam& m : *params)
    if (m.info->name.ends_with(".self_attention.linear_q_down_proj.weight") ||
        m.info->name.ends_with(".self_attention.linear_kv_down_proj.weight"))
      m.split = 0;  // ColumnParallelLinear (gather_output False; MLA gathers the latent after it)
}

void AddMlaSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings) {
  if (!c.mla()) return;
  const Settings mla = MlaRunSettings(c);  // as ptk-train records them, so that a resume compares equal
  settings->insert(settings->end(), mla.begin(), mla.end());
}

std::string MlaTrainFlags(const GPTConfig& c) {
  if (!c.mla()) return "";
  std::string f = fmt::format(
      " --multi-latent-attention --kv-lora-rank {} --qk-head-dim {} --qk-pos-emb-head-dim {} --v-head-dim {} "
      "--rope-type {}",
      c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.mla_yarn ? "yarn" : "rope");
  if (c.q_lora_rank > 0) f += fmt::format(" --q-lora-rank {}", c.q_lora_rank);
  if (c.mla_yarn)
    f += fmt::format(" --rotary-scaling-factor {} --mscale {} --mscale-all-dim {}", c.rotary_scaling_factor, c.mscale,
                     c.mscale_all_dim);
  if (!c.rope()) f += fmt::format(" --rotary-base {}", c.rotary_base);  // MLA's rotary base (the Llama flags' else)
  return f;
}

}  // namespace ptk::megatron
