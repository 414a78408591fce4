// The CPU model's load balancing beyond the switch loss (megatron-core 0.16.1's TopKRouter): aux-loss-free
// routing's expert bias (the tokens each expert got, summed over the data group after the step, move it by
// rate x sign(mean - load): get_updated_expert_bias), and the seq_aux_loss and global_aux_loss types
// (switch_load_balancing_loss_func on each sequence's counts, or on the step's data group counts so far).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/moe_balance_cpu.h"
#include "trainer/cpu/moe_cpu.h"
#include "trainer/expert_bias_buffers.h"

namespace ptk {
CpuGPTModel::MoeBalanceState& CpuGPTModel::BalanceOf(int64_t l) {
  const GPTConfig& cf = config();
  const size_t layers = static_cast<size_t>(cf.num_layers + cf.mtp_num_layers);
  if (balance_.size() < layers) balance_.resize(layers);
  MoeBalanceState& st = balance_[static_cast<size_t>(l + moe_layer_offset_)];
  if (cf.moe_router_enable_expert_bias && st.expert_bias.empty()) {
    st.expert_bias.assign(static_cast<size_t>(cf.num_experts), 0.0f);
    st.tokens.assign(static_cast<size_t>(cf.num_experts), 0.0);
  }
  return st;
}

int64_t CpuGPTModel::BalanceLayers() const { return static_cast<int64_t>(layout_.layers.size() + layout_.mtp.size()); }

int64_t CpuGPTModel::RouterOf(int64_t l) const {
  const int64_t L = static_cast<int64_t>(layout_.layers.size());
  return l < L ? layout_.layers[static_cast<size_t>(l)].router_w
               : layout_.mtp[static_cast<size_t>(l - L)].layer.router_w;
}

std::string CpuGPTModel::ExpertBiasName(int64_t l) const {
  if (!config().moe_router_enable_expert_bias || l >= BalanceLayers()) return "";
  const int64_t at = RouterOf(l);
  if (at < 0) return "";
  for (const ParamInfo& p : layout_.infos)
    if (p.offset == at) {
      const std::string weight = "router.weight";
      if (p.name.size() < weight.size()) return "";
      return p.name.substr(0, p.name.size() - std::string("weight").size()) + "expert_bias";
    }
  return "";
}

absl::Status CpuGPTModel::MoeBalanceForward(int64_t l, cpu::MoeActivations<float>* m, const cpu::MoeSettings& s) {
  const GPTConfig& cf = config();
  MoeBalanceState& st = BalanceOf(l);
  const int64_t E = s.experts, n = m->n;
  if (cf.moe_router_enable_expert_bias)  // the dispatch's counts (the biased routing map)
    for (int64_t e = 0; e < E; ++e)
      st.tokens[static_cast<size_t>(e)] += static_cast<double>(m->begin[e + 1] - m->begin[e]);
  const bool seq = cf.moe_seq_aux_loss_coeff > 0, global = cf.moe_global_aux_loss_coeff > 0;
  if (!seq && !global) return absl::OkStatus();
  const int64_t S = seq ? act_->t : n, B = n / S;  // the groups the gradient rows cover: sequences, or all tokens
  m->balance_tokens = S;
  m->balance_grad.assign(static_cast<size_t>(B * E), 0.0);
  if (seq) {  // each sequence's switch loss with its counts over the context ranks, their mean over the sequences
    PTK_ASSIGN_OR_RETURN(const double loss, cpu::MoeSeqAuxLoss(m, s, S, cf.moe_seq_aux_loss_coeff, context_comm_));
    balance_sums_.seq += loss;
  }
  if (global) {  // the data (x context) group's counts of the step's micro-batches so far, averaged
    PTK_ASSIGN_OR_RETURN(const double loss, cpu::MoeGlobalAuxLoss(m, s, cf.moe_global_aux_loss_coeff, moe_data_comm_,
                                                                  &st.global_counts, &st.global_steps));
    balance_sums_.global += loss;
  }
  return absl::OkStatus();
}

MoeBalanceLosses CpuGPTModel::TakeMoeBalanceLosses() { return std::exchange(balance_sums_, MoeBalanceLosses{}); }

absl::Status CpuGPTModel::FinishMoeStep() {
  const GPTConfig& cf = config();
  if (!cf.moe()) return absl::OkStatus();
  for (int64_t l = 0; l < BalanceLayers(); ++l) {  // the decoder's layers, then the MTP depths'
    if (RouterOf(l) < 0) continue;
    MoeBalanceState& st = BalanceOf(l);
    st.global_counts.clear();  // Megatron's reset_global_aux_loss_tracker
    st.global_steps = 0;
    if (!cf.moe_router_enable_expert_bias) continue;
    std::vector<double>& tokens = st.tokens;
    if (moe_data_comm_ != nullptr && moe_data_comm_->size() > 1)
      PTK_RETURN_IF_ERROR(moe_data_comm_->AllReduceSum(tokens.data(), static_cast<int64_t>(tokens.size())));
    // get_updated_expert_bias in fp32: the mean load minus each expert's, its sign times the rate.
    float total = 0;
    for (double t : tokens) total += static_cast<float>(t);
    const float mean = total / static_cast<float>(tokens.size()),
                rate = static_cast<float>(cf.moe_router_bias_update_rate);
    for (size_t e = 0; e < tokens.size(); ++e) {
      const float offset = mean - static_cast<float>(tokens[e]);
      const float sign = offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f;
      st.expert_bias[e] += sign * rate;
    }
    std::fill(tokens.begin(), tokens.end(), 0.0);  // Megatron's reset_model_temporary_tensors
  }
  return absl::OkStatus();
}

ModelBuffers CpuGPTModel::ReadBuffers() const {
  ModelBuffers out;
  for (int64_t l = 0; l < BalanceLayers(); ++l) {
    const std::string name = ExpertBiasName(l);
    if (name.empty()) continue;
    const bool held = static_cast<size_t>(l) < balance_.size() && !balance_[static_cast<size_t>(l)].expert_bias.empty();
    out.emplace_back(name, held ? balance_[static_cast<size_t>(l)].expert_bias
                                : std::vector<float>(static_cast<size_t>(config().num_experts), 0.0f));
  }
  return out;
}

absl::Status CpuGPTModel::WriteBuffers(const ModelBuffers& in) {
  return LoadExpertBiases(
      in, BalanceLayers(), config().num_experts, [&](int64_t l) { return ExpertBiasName(l); },
      [&](int64_t l, const std::vector<float>& v) { BalanceOf(l).expert_bias = v; });
}

}  // namespace ptk
