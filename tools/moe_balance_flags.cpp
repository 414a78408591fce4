// ptk-train's mixture-of-experts load-balancing flags: --moe-router-load-balancing-type (aux_loss,
// seq_aux_loss, global_aux_loss, none; a list of them with as many --moe-aux-loss-coeff values, as Megatron),
// aux-loss-free routing's --moe-router-enable-expert-bias and --moe-router-bias-update-rate, and the
// combinations ptk has not checked against Megatron refused in one line each.
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {

using train_flags::NonNegative;

void AddMoeBalanceFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::Moe& m = f->moe;
  app->add_flag("--moe-router-enable-expert-bias", m.enable_expert_bias,
                "Aux-loss-free load balancing (sigmoid scores only): a per-layer expert bias added to the scores "
                "that choose each token's top k (not to its probabilities), moved after each step by "
                "--moe-router-bias-update-rate x sign(mean load - the expert's load), the loads summed over the "
                "data ranks; saved in checkpoints as decoder.layers.L.mlp.router.expert_bias");
  app->add_option("--moe-router-bias-update-rate", m.bias_update_rate,
                  "The expert bias's step (default 1e-3; with --moe-router-enable-expert-bias)")
      ->check(NonNegative());
}

namespace {
// The coefficient of each type (Megatron's get_aux_loss_coeff): one type and one coefficient, or a list of
// types and as many coefficients.
absl::Status CoefficientsOf(const TrainFlags::Moe& m, GPTConfig* model, std::vector<std::string>* notes) {
  const std::vector<std::string> types =
      m.load_balancing_type.empty() ? std::vector<std::string>{"aux_loss"} : m.load_balancing_type;
  const std::string flags = "--moe-router-load-balancing-type / --moe-aux-loss-coeff";
  if (types.size() > 1 && m.aux_loss_coeff.size() != types.size())
    return UsageError(
        fmt::format("{}: {} types need as many coefficients, one per type in its order (Megatron's TransformerConfig); "
                    "{} given",
                    flags, types.size(), m.aux_loss_coeff.size()));
  if (types.size() == 1 && m.aux_loss_coeff.size() > 1)
    return UsageError(fmt::format("{}: {} coefficients for one type (give one, or a list of as many types)", flags,
                                  m.aux_loss_coeff.size()));
  double* slot = nullptr;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    const double coeff = m.aux_loss_coeff.empty() ? 0.0 : m.aux_loss_coeff[types.size() > 1 ? i : 0];
    if (t == "aux_loss") {
      slot = &model->moe_aux_loss_coeff;
    } else if (t == "seq_aux_loss") {
      slot = &model->moe_seq_aux_loss_coeff;
    } else if (t == "global_aux_loss") {
      slot = &model->moe_global_aux_loss_coeff;
    } else if (t == "none") {
      if (coeff > 0)
        notes->push_back(
            "--moe-aux-loss-coeff: accepted, no effect with --moe-router-load-balancing-type none (as Megatron)");
      continue;
    } else {
      return UsageError("--moe-router-load-balancing-type " + t +
                        ": not implemented; ptk has aux_loss (the switch load-balancing loss), seq_aux_loss (each "
                        "sequence's), global_aux_loss (the global batch's) and none");
    }
    for (size_t j = 0; j < i; ++j)
      if (types[j] == t) return UsageError(fmt::format("--moe-router-load-balancing-type: {} given twice", t));
    *slot = coeff;
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status ResolveMoeBalance(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::Moe& m = f.moe;
  model->moe_aux_loss_coeff = model->moe_seq_aux_loss_coeff = model->moe_global_aux_loss_coeff = 0;
  PTK_RETURN_IF_ERROR(CoefficientsOf(m, model, notes));
  if (m.bias_update_rate && !m.enable_expert_bias)
    notes->push_back(
        "--moe-router-bias-update-rate: accepted, no effect without --moe-router-enable-expert-bias (as Megatron)");
  if (!m.enable_expert_bias) return absl::OkStatus();
  if (!model->moe_router_sigmoid)
    return UsageError(
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron's TransformerConfig: "
        "aux-loss-free routing's expert bias is added to sigmoid scores only)");
  model->moe_router_enable_expert_bias = true;
  model->moe_router_bias_update_rate = m.bias_update_rate.value_or(1e-3);
  if (model->moe_router_bias_update_rate == 0)
    notes->push_back("--moe-router-bias-update-rate 0: the expert bias stays 0 (as Megatron)");
  return absl::OkStatus();
}

absl::Status RefuseMoeBalanceParallelism(const TrainFlags& f) {
  const TrainFlags::Moe& m = f.moe;
  if (m.num_experts == 0) return absl::OkStatus();
  std::vector<std::string> on;
  for (const std::string& t : m.load_balancing_type)
    if (t == "seq_aux_loss" || t == "global_aux_loss") on.push_back("--moe-router-load-balancing-type " + t);
  if (m.enable_expert_bias) on.push_back("--moe-router-enable-expert-bias");
  if (on.empty()) return absl::OkStatus();
  if (f.pipeline_model_parallel_size > 1)
    return UsageError(fmt::format(
        "{} with --pipeline-model-parallel-size {}: ptk has not checked it over pipeline stages (each stage's "
        "routers' counts and biases) against Megatron and refuses it",
        on.front(), f.pipeline_model_parallel_size));
  return absl::OkStatus();
}

}  // namespace ptk
