// Megatron's mixture-of-experts layers in its `torch` checkpoints (MoELayer with a TopKRouter, SequentialMLP
// experts on one expert-parallel rank and SharedExpertMLP shared experts): the args that mark them, written and
// read, and what ptk's MoE layers cannot compute refused naming the argument.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/status.h"
#include "interop/megatron_common.h"
#include "trainer/run_settings.h"

namespace ptk::megatron {
namespace {

// The load-balancing types with a coefficient above 0, in Megatron's order, each with its coefficient.
std::vector<std::pair<std::string, double>> BalanceTypes(const GPTConfig& c) {
  std::vector<std::pair<std::string, double>> out;
  if (c.moe_aux_loss_coeff > 0) out.emplace_back("aux_loss", c.moe_aux_loss_coeff);
  if (c.moe_seq_aux_loss_coeff > 0) out.emplace_back("seq_aux_loss", c.moe_seq_aux_loss_coeff);
  if (c.moe_global_aux_loss_coeff > 0) out.emplace_back("global_aux_loss", c.moe_global_aux_loss_coeff);
  return out;
}

// args.moe_router_load_balancing_type and args.moe_aux_loss_coeff as Megatron-LM's arguments.py leaves them: one
// type and its coefficient as a str and a float, two or more as lists of as many.
void SetBalanceArgs(const GPTConfig& c, PyValue* a) {
  const auto types = BalanceTypes(c);
  if (types.size() <= 1) {
    torchfmt::DictSet(a, "moe_router_load_balancing_type", torchfmt::MakeStr(types.empty() ? "none" : types[0].first));
    torchfmt::DictSet(a, "moe_aux_loss_coeff", torchfmt::MakeFloat(types.empty() ? 0.0 : types[0].second));
    return;
  }
  std::vector<torchfmt::PyRef> names, coeffs;
  for (const auto& [t, v] : types) {
    names.push_back(torchfmt::MakeStr(t));
    coeffs.push_back(torchfmt::MakeFloat(v));
  }
  torchfmt::DictSet(a, "moe_router_load_balancing_type", torchfmt::MakeList(std::move(names)));
  torchfmt::DictSet(a, "moe_aux_loss_coeff", torchfmt::MakeList(std::move(coeffs)));
}

// The types and coefficients of args (a str and a number, or lists of as many) into `c`; a type ptk lacks, or
// lists of different lengths, into `why`.
void ReadBalanceArgs(const PyValue* args, GPTConfig* c, std::vector<std::string>* why) {
  std::vector<std::string> types;
  std::vector<double> coeffs;
  if (const PyValue* t = args->Get("moe_router_load_balancing_type"); t && t->kind == PyValue::Kind::kList) {
    for (const torchfmt::PyRef& v : t->items) types.push_back(v->kind == PyValue::Kind::kStr ? v->s : "?");
  } else {
    types.push_back(StrAttr(args, "moe_router_load_balancing_type").value_or("aux_loss"));
  }
  if (const PyValue* k = args->Get("moe_aux_loss_coeff"); k && k->kind == PyValue::Kind::kList) {
    for (const torchfmt::PyRef& v : k->items) coeffs.push_back(v->IsNumber() ? v->Number() : 0.0);
  } else {
    coeffs.push_back(NumAttr(args, "moe_aux_loss_coeff").value_or(0.0));
  }
  if (types.size() != coeffs.size()) {
    why->push_back(fmt::format("--moe-router-load-balancing-type of {} types with {} --moe-aux-loss-coeff values",
                               types.size(), coeffs.size()));
    return;
  }
  c->moe_aux_loss_coeff = c->moe_seq_aux_loss_coeff = c->moe_global_aux_loss_coeff = 0;
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] == "aux_loss") {
      c->moe_aux_loss_coeff = coeffs[i];
    } else if (types[i] == "seq_aux_loss") {
      c->moe_seq_aux_loss_coeff = coeffs[i];
    } else if (types[i] == "global_aux_loss") {
      c->moe_global_aux_loss_coeff = coeffs[i];
    } else if (types[i] != "none") {
      why->push_back("--moe-router-load-balancing-type " + types[i]);
    }
  }
}

// Routing and token dropping beyond the top k: the z-loss, the scaling factor, group-limited routing, the
// expert bias, the capacity and its drop policy (None where off, as Megatron-LM's defaults).
void SetRoutingArgs(const GPTConfig& c, PyValue* a) {
  auto set = [&](const char* k, torchfmt::PyRef v) { torchfmt::DictSet(a, k, std::move(v)); };
  auto f_or_none = [](bool on, double v) { return on ? torchfmt::MakeFloat(v) : torchfmt::MakeNone(); };
  auto i_or_none = [](bool on, int64_t v) { return on ? torchfmt::MakeInt(v) : torchfmt::MakeNone(); };
  set("moe_z_loss_coeff", f_or_none(c.moe_z_loss_coeff > 0, c.moe_z_loss_coeff));
  set("moe_router_topk_scaling_factor",
      f_or_none(c.moe_router_topk_scaling_factor > 0, c.moe_router_topk_scaling_factor));
  set("moe_router_num_groups", i_or_none(c.moe_router_group_topk > 0, c.moe_router_num_groups));
  set("moe_router_group_topk", i_or_none(c.moe_router_group_topk > 0, c.moe_router_group_topk));
  set("moe_router_enable_expert_bias", torchfmt::MakeBool(c.moe_router_enable_expert_bias));
  set("moe_router_bias_update_rate", torchfmt::MakeFloat(c.moe_router_bias_update_rate));
  set("moe_expert_capacity_factor", f_or_none(c.moe_expert_capacity_factor >= 0, c.moe_expert_capacity_factor));
  set("moe_token_drop_policy", torchfmt::MakeStr(c.moe_token_drop_position ? "position" : "probs"));
  set("moe_pad_expert_input_to_capacity", torchfmt::MakeBool(false));
  set("moe_shared_expert_intermediate_size",
      i_or_none(c.moe_shared_expert_intermediate_size > 0, c.moe_shared_expert_intermediate_size));
  set("moe_shared_expert_gate", torchfmt::MakeBool(c.moe_shared_expert_gate));
  set("moe_shared_expert_overlap", torchfmt::MakeBool(false));
}

void ReadRoutingArgs(const PyValue* args, GPTConfig* c, std::vector<std::string>* why) {
  auto positive = [&](const char* k) { return NumAttr(args, k).value_or(0.0); };
  c->moe_z_loss_coeff = positive("moe_z_loss_coeff");
  c->moe_router_topk_scaling_factor = positive("moe_router_topk_scaling_factor");
  c->moe_router_group_topk = static_cast<int64_t>(positive("moe_router_group_topk"));
  c->moe_router_num_groups = c->moe_router_group_topk > 0 ? static_cast<int64_t>(positive("moe_router_num_groups")) : 0;
  c->moe_router_enable_expert_bias = BoolAttr(args, "moe_router_enable_expert_bias", false);
  c->moe_router_bias_update_rate = NumAttr(args, "moe_router_bias_update_rate").value_or(1e-3);
  const auto capacity = NumAttr(args, "moe_expert_capacity_factor");  // None (or below 0): dropless
  c->moe_expert_capacity_factor = capacity && *capacity >= 0 ? *capacity : -1;
  const std::string policy = StrAttr(args, "moe_token_drop_policy").value_or("probs");
  if (policy != "probs" && policy != "position") why->push_back("--moe-token-drop-policy " + policy);
  c->moe_token_drop_position = c->moe_expert_capacity_factor >= 0 && policy == "position";
  // --moe-pad-expert-input-to-capacity pads each expert's rows with probability 0 (no output): the same math.
  c->moe_shared_expert_intermediate_size = static_cast<int64_t>(positive("moe_shared_expert_intermediate_size"));
  c->moe_shared_expert_gate =
      c->moe_shared_expert_intermediate_size > 0 && BoolAttr(args, "moe_shared_expert_gate", false);
  if (auto jitter = NumAttr(args, "moe_input_jitter_eps"); jitter && *jitter != 0)
    why->push_back(fmt::format("--moe-input-jitter-eps {}", *jitter));
  if (auto dtype = StrAttr(args, "moe_router_dtype"); dtype && *dtype != "fp32")
    why->push_back("--moe-router-dtype " + *dtype);
}

}  // namespace

void SetMoeArgs(const GPTConfig& c, int64_t tp, PyValue* a) {
  auto set_i = [&](const char* k, int64_t v) { torchfmt::DictSet(a, k, torchfmt::MakeInt(v)); };
  auto set_s = [&](const char* k, const std::string& v) { torchfmt::DictSet(a, k, torchfmt::MakeStr(v)); };
  auto set_b = [&](const char* k, bool v) { torchfmt::DictSet(a, k, torchfmt::MakeBool(v)); };
  auto set_none = [&](const char* k) { torchfmt::DictSet(a, k, torchfmt::MakeNone()); };
  if (!c.moe()) {
    set_none("num_experts");
    return;
  }
  set_i("num_experts", c.num_experts);
  set_i("moe_ffn_hidden_size", c.moe_ffn());
  set_i("moe_router_topk", c.moe_router_topk);
  SetBalanceArgs(c, a);
  set_s("moe_router_score_function", c.moe_router_sigmoid ? "sigmoid" : "softmax");
  set_b("moe_router_pre_softmax", c.moe_router_pre_softmax);
  if (c.moe_layer_pattern.empty()) {
    set_i("moe_layer_freq", 1);
  } else {  // Megatron's parsed --moe-layer-freq: the list of 0 and 1
    std::vector<torchfmt::PyRef> freq;
    for (int v : c.moe_layer_pattern) freq.push_back(torchfmt::MakeInt(v));
    torchfmt::DictSet(a, "moe_layer_freq", torchfmt::MakeList(std::move(freq)));
  }
  set_b("moe_grouped_gemm", false);  // SequentialMLP: local_experts.K.linear_fc1/linear_fc2
  set_i("expert_model_parallel_size", 1);
  set_i("expert_tensor_parallel_size", tp);
  set_s("moe_token_dispatcher_type", "allgather");
  set_none("moe_input_jitter_eps");
  set_s("moe_router_dtype", "fp32");  // ptk's router computes in fp32
  SetRoutingArgs(c, a);
}

absl::Status ReadMoeArgs(const PyValue* args, const std::string& source, int64_t tp, GPTConfig* c) {
  const auto experts = NumAttr(args, "num_experts");
  if (!experts || *experts <= 0) return absl::OkStatus();
  c->num_experts = static_cast<int64_t>(*experts);
  c->moe_router_topk = static_cast<int64_t>(NumAttr(args, "moe_router_topk").value_or(2));
  c->moe_ffn_hidden_size = static_cast<int64_t>(NumAttr(args, "moe_ffn_hidden_size").value_or(c->ffn_hidden_size));
  const std::string score = StrAttr(args, "moe_router_score_function").value_or("softmax");
  c->moe_router_sigmoid = score == "sigmoid";
  c->moe_router_pre_softmax = BoolAttr(args, "moe_router_pre_softmax", false);
  std::vector<std::string> why;
  ReadBalanceArgs(args, c, &why);
  if (score != "softmax" && score != "sigmoid") why.push_back("--moe-router-score-function " + score);
  if (const PyValue* freq = args->Get("moe_layer_freq"); freq && freq->kind == PyValue::Kind::kList) {
    for (const torchfmt::PyRef& v : freq->items)
      c->moe_layer_pattern.push_back(v->IsInt() ? static_cast<int>(v->i) : -1);
    if (static_cast<int64_t>(c->moe_layer_pattern.size()) != c->num_layers)
      why.push_back(
          fmt::format("--moe-layer-freq of {} entries for {} layers", c->moe_layer_pattern.size(), c->num_layers));
  } else if (auto f = NumAttr(args, "moe_layer_freq"); f && *f != 1) {
    const auto every = static_cast<int64_t>(*f);
    for (int64_t l = 0; l < c->num_layers; ++l) c->moe_layer_pattern.push_back(every > 0 && l % every == 0 ? 1 : 0);
  }
  if (BoolAttr(args, "moe_grouped_gemm", false))
    why.push_back("--moe-grouped-gemm (its experts' weights are stacked as linear_fc1.weight0...)");
  if (auto ep = NumAttr(args, "expert_model_parallel_size"); ep && *ep != 1)
    why.push_back(fmt::format("--expert-model-parallel-size {}", *ep));
  if (auto etp = NumAttr(args, "expert_tensor_parallel_size"); etp && *etp != static_cast<double>(tp))
    why.push_back(fmt::format("--expert-tensor-parallel-size {} (the tensor size is {})", *etp, tp));
  ReadRoutingArgs(args, c, &why);
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{}: the mixture of experts was trained with {}: ptk's MoE layers are SequentialMLP experts on one "
                  "expert rank (and SharedExpertMLP shared experts), routed by an fp32 softmax or sigmoid top k",
                  source, fmt::join(why, ", ")));
}

namespace {
std::string LayerFreq(const GPTConfig& c) {
  if (c.moe_layers() == c.num_layers) return "1";
  std::string f;
  for (int64_t l = 0; l < c.num_layers; ++l) f += fmt::format("{}{}", l ? "," : "[", c.moe_layer(l) ? 1 : 0);
  return f + "]";
}
}  // namespace

void AddMoeSettings(const GPTConfig& c, std::vector<std::pair<std::string, std::string>>* settings) {
  if (!c.moe()) return;
  const Settings moe = MoeRunSettings(c);  // as ptk-train records them, so that a resume compares equal
  settings->insert(settings->end(), moe.begin(), moe.end());
}

std::string MoeTrainFlags(const GPTConfig& c) {
  if (!c.moe()) return "";
  std::string f = fmt::format(" --num-experts {} --moe-router-topk {} --moe-ffn-hidden-size {}", c.num_experts,
                              c.moe_router_topk, c.moe_ffn());
  const auto types = BalanceTypes(c);
  if (types.size() == 1 && types[0].first == "aux_loss") {
    f += fmt::format(" --moe-aux-loss-coeff {}", c.moe_aux_loss_coeff);
  } else if (!types.empty()) {
    std::vector<std::string> names, coeffs;
    for (const auto& [t, v] : types) names.push_back(t), coeffs.push_back(fmt::format("{}", v));
    f += fmt::format(" --moe-router-load-balancing-type {} --moe-aux-loss-coeff {}", fmt::join(names, " "),
                     fmt::join(coeffs, " "));
  }
  if (c.moe_router_sigmoid) f += " --moe-router-score-function sigmoid";
  if (c.moe_router_pre_softmax) f += " --moe-router-pre-softmax";
  if (c.moe_layers() != c.num_layers) f += fmt::format(" --moe-layer-freq \"{}\"", LayerFreq(c));
  if (c.moe_z_loss_coeff > 0) f += fmt::format(" --moe-z-loss-coeff {}", c.moe_z_loss_coeff);
  if (c.moe_router_topk_scaling_factor > 0)
    f += fmt::format(" --moe-router-topk-scaling-factor {}", c.moe_router_topk_scaling_factor);
  if (c.moe_router_group_topk > 0)
    f += fmt::format(" --moe-router-num-groups {} --moe-router-group-topk {}", c.moe_router_num_groups,
                     c.moe_router_group_topk);
  if (c.moe_router_enable_expert_bias)
    f +=
        fmt::format(" --moe-router-enable-expert-bias --moe-router-bias-update-rate {}", c.moe_router_bias_update_rate);
  if (c.moe_shared_expert_intermediate_size > 0)
    f += fmt::format(" --moe-shared-expert-intermediate-size {}{}", c.moe_shared_expert_intermediate_size,
                     c.moe_shared_expert_gate ? " --moe-shared-expert-gate" : "");
  if (c.moe_expert_capacity_factor >= 0)
    f += fmt::format(" --moe-expert-capacity-factor {}{}", c.moe_expert_capacity_factor,
                     c.moe_token_drop_position ? " --moe-token-drop-policy position" : "");
  return f;
}

}  // namespace ptk::megatron
