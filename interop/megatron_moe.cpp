// Megatron's mixture-of-experts layers in its `torch` checkpoints (MoELayer with a TopKRouter and SequentialMLP
// experts, one expert-parallel rank): the args that mark them, written and read, and what ptk's MoE layers
// cannot compute refused naming the argument.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/status.h"
#include "interop/megatron_common.h"

namespace ptk::megatron {

void SetMoeArgs(const GPTConfig& c, int64_t tp, PyValue* a) {
  auto set_i = [&](const char* k, int64_t v) { torchfmt::DictSet(a, k, torchfmt::MakeInt(v)); };
  auto set_f = [&](const char* k, double v) { torchfmt::DictSet(a, k, torchfmt::MakeFloat(v)); };
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
  set_f("moe_aux_loss_coeff", c.moe_aux_loss_coeff);
  set_s("moe_router_load_balancing_type", c.moe_aux_loss_coeff > 0 ? "aux_loss" : "none");
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
  for (const char* k : {"moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_z_loss_coeff",
                        "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_router_num_groups",
                        "moe_router_group_topk", "moe_router_dtype"})
    set_none(k);
  set_b("moe_router_enable_expert_bias", false);
}

absl::Status ReadMoeArgs(const PyValue* args, const std::string& source, int64_t tp, GPTConfig* c) {
  const auto experts = NumAttr(args, "num_experts");
  if (!experts || *experts <= 0) return absl::OkStatus();
  c->num_experts = static_cast<int64_t>(*experts);
  c->moe_router_topk = static_cast<int64_t>(NumAttr(args, "moe_router_topk").value_or(2));
  c->moe_ffn_hidden_size = static_cast<int64_t>(NumAttr(args, "moe_ffn_hidden_size").value_or(c->ffn_hidden_size));
  const std::string balancing = StrAttr(args, "moe_router_load_balancing_type").value_or("aux_loss");
  c->moe_aux_loss_coeff = balancing == "none" ? 0.0 : NumAttr(args, "moe_aux_loss_coeff").value_or(0.0);
  const std::string score = StrAttr(args, "moe_router_score_function").value_or("softmax");
  c->moe_router_sigmoid = score == "sigmoid";
  c->moe_router_pre_softmax = BoolAttr(args, "moe_router_pre_softmax", false);
  std::vector<std::string> why;
  if (balancing != "aux_loss" && balancing != "none") why.push_back("--moe-router-load-balancing-type " + balancing);
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
  if (BoolAttr(args, "moe_router_enable_expert_bias", false)) why.push_back("--moe-router-enable-expert-bias");
  for (const char* k :
       {"moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_z_loss_coeff",
        "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_router_num_groups", "moe_router_group_topk"})
    if (auto v = NumAttr(args, k); v && *v != 0) {
      std::string flag = std::string("--") + k;
      for (char& ch : flag)
        if (ch == '_') ch = '-';
      why.push_back(fmt::format("{} {}", flag, *v));
    }
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{}: the mixture of experts was trained with {}: ptk's MoE layers are SequentialMLP experts on one "
                  "expert rank, routed by a softmax or sigmoid top k, dropless",
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
  settings->insert(settings->end(), {{"--num-experts", std::to_string(c.num_experts)},
                                     {"--moe-router-topk", std::to_string(c.moe_router_topk)},
                                     {"--moe-ffn-hidden-size", std::to_string(c.moe_ffn())},
                                     {"--moe-aux-loss-coeff", fmt::format("{}", c.moe_aux_loss_coeff)},
                                     {"--moe-router-score-function", c.moe_router_sigmoid ? "sigmoid" : "softmax"},
                                     {"--moe-router-pre-softmax", c.moe_router_pre_softmax ? "on" : "off"},
                                     {"--moe-layer-freq", LayerFreq(c)}});
}

std::string MoeTrainFlags(const GPTConfig& c) {
  if (!c.moe()) return "";
  std::string f = fmt::format(" --num-experts {} --moe-router-topk {} --moe-ffn-hidden-size {}", c.num_experts,
                              c.moe_router_topk, c.moe_ffn());
  if (c.moe_aux_loss_coeff > 0) f += fmt::format(" --moe-aux-loss-coeff {}", c.moe_aux_loss_coeff);
  if (c.moe_router_sigmoid) f += " --moe-router-score-function sigmoid";
  if (c.moe_router_pre_softmax) f += " --moe-router-pre-softmax";
  if (c.moe_layers() != c.num_layers) f += fmt::format(" --moe-layer-freq \"{}\"", LayerFreq(c));
  return f;
}

}  // namespace ptk::megatron
