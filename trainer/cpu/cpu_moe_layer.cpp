// The CPU model's mixture-of-experts MLP (Megatron's MoELayer with TopKRouter and SequentialMLP):
// the layer's router and experts over the pre-MLP norm's output (trainer/cpu/moe_cpu.h), the
// load-balancing loss's and the router z-loss's values kept for the log and their gradients injected
// with the step's scale, as Megatron's MoEAuxLossAutoScaler does.
#include <algorithm>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/expert_parallel_cpu.h"
#include "trainer/cpu/moe_balance_cpu.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk {
namespace {
cpu::MoeSettings MoeSettingsOf(const GPTConfig& cf, int64_t tensor_size) {
  cpu::MoeSettings s;
  s.experts = cf.num_experts;
  s.topk = cf.moe_router_topk;
  s.ffn = cf.moe_ffn() / tensor_size;  // a tensor rank's slice of each expert
  s.pre_softmax = cf.moe_router_pre_softmax && !cf.moe_router_sigmoid;
  s.sigmoid = cf.moe_router_sigmoid;
  s.scaling = cf.moe_router_topk_scaling_factor;
  s.groups = cf.moe_router_num_groups;
  s.group_topk = cf.moe_router_group_topk;
  s.capacity_factor = cf.moe_expert_capacity_factor;
  s.drop_by_position = cf.moe_token_drop_position;
  s.shards = tensor_size;  // each tensor rank's positions routed as its own tokens (--sequence-parallel)
  s.activation = cf.swiglu         ? cpu::MlpActivation::kSwiglu
                 : cf.squared_relu ? cpu::MlpActivation::kSquaredRelu
                 : cf.gelu_exact   ? cpu::MlpActivation::kGeluExact
                                   : cpu::MlpActivation::kGelu;
  return s;
}
}  // namespace

absl::Status CpuGPTModel::MoeMlpForward(int64_t l, const LayerParams& lp, const float* x, int64_t n, bool train) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  cpu::MoeSettings s = MoeSettingsOf(cf, tensor_size());
  if (cf.moe_router_enable_expert_bias) s.expert_bias = BalanceOf(l).expert_bias.data();
  s.sample_rows = a.t;  // this rank's positions of a sample (the pass's: an evaluation may be shorter than seq_length)
  if (n % s.sample_rows != 0)
    return absl::InternalError(fmt::format("MoE layer {}: {} rows are not samples of {}", l, n, s.sample_rows));
  cpu::MoeActivations<float>& m = a.moe[static_cast<size_t>(l)];
  const float* P = params_.data();
  cpu::MoeRouterForward(&m, x, P + lp.router_w, n, cf.hidden_size, s);
  if (train) PTK_RETURN_IF_ERROR(MoeBalanceForward(l, &m, s));  // moe_balance.cpp
  if (expert_comm_ != nullptr) {  // expert parallelism: this rank's experts on the expert group's tokens
    if (a.moe_ep.size() < a.moe.size()) a.moe_ep.resize(a.moe.size());
    PTK_RETURN_IF_ERROR(cpu::ExpertParallelForward(a.tmp.data(), &m, &a.moe_ep[static_cast<size_t>(l)], x,
                                                   P + lp.experts, cf.hidden_size, s, expert_comm_, &a.ep_buf));
  } else {
    cpu::MoeExpertsForward(a.tmp.data(), &m, P + lp.experts, cf.hidden_size, s);
  }
  if (lp.shared_fc1 >= 0)  // the shared experts' output added to the routed experts'
    cpu::SharedExpertForward(a.tmp.data(), &a.shared[static_cast<size_t>(l)], x, P + lp.shared_fc1, P + lp.shared_fc2,
                             cpu_model_detail::At(P, lp.shared_gate), n, cf.hidden_size,
                             cpu_model_detail::SharedExpertSettingsOf(cf, tensor_size()));
  // Megatron tracks (and injects) the z-loss and the load-balancing loss only in training passes with a coefficient.
  // Under tensor ranks Megatron logs the last tensor rank's own mean (its z-loss is tracked without a reduce group;
  // the last rank prints), while the gradient, the coefficient over the ranks each on its own tokens, is the whole's.
  if (train && cf.moe_z_loss_coeff > 0)
    moe_z_sum_ += tp() ? cpu::MoeZLossOfShard(m, s, s.shards - 1) : cpu::MoeZLoss(m, s);
  if (!train || cf.moe_aux_loss_coeff <= 0) return absl::OkStatus();
  // The experts' token counts over the whole sequence (Megatron's over the tensor x context group).
  PTK_RETURN_IF_ERROR(cpu::MoeContextAuxCounts(&m, s, context_comm_));
  moe_aux_sum_ += cpu::MoeAuxLoss(m, s);  // with context ranks this rank's part: their sum is the sequence's
  return absl::OkStatus();
}

absl::Status CpuGPTModel::MoeMlpBackward(int64_t l, const LayerParams& lp, const float* x, const float* x_router,
                                         bool train) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const cpu::MoeSettings s = MoeSettingsOf(cf, tensor_size());
  cpu::MoeActivations<float>& m = a.moe[static_cast<size_t>(l)];
  const float* P = params_.data();
  float* G = grads_.data();
  const double aux_grad = train ? cf.moe_aux_loss_coeff * moe_aux_loss_scale_ : 0.0;
  // The z-loss's MoEAuxLossAutoScaler scale is the load-balancing loss's (with --calculate-per-token-loss both are
  // multiplied by the rank's micro-batch tokens); its coefficient over the context ranks (MoeZLossRankCoeff).
  const double z_grad =
      train ? cpu::MoeZLossRankCoeff(cf.moe_z_loss_coeff, cp() ? context_comm_->size() : 1) * moe_aux_loss_scale_ : 0.0;
  std::fill(a.dln.begin(), a.dln.end(), 0.0f);
  for (double& g : m.balance_grad) g *= moe_aux_loss_scale_;  // seq_ and global_aux_loss's (MoeBalanceForward)
  if (lp.shared_fc1 >= 0)  // shared experts: replicated on the expert ranks, each on its own tokens
    cpu::SharedExpertBackward(a.dln.data(), G + lp.shared_fc1, G + lp.shared_fc2,
                              cpu_model_detail::At(G, lp.shared_gate), a.dtmp.data(), &a.shared[static_cast<size_t>(l)],
                              x, P + lp.shared_fc1, P + lp.shared_fc2, cpu_model_detail::At(P, lp.shared_gate), m.n,
                              cf.hidden_size, cpu_model_detail::SharedExpertSettingsOf(cf, tensor_size()));
  if (expert_comm_ != nullptr && !tp())
    return cpu::ExpertParallelBackward(a.dln.data(), G + lp.router_w, G + lp.experts, a.dtmp.data(), &m,
                                       &a.moe_ep[static_cast<size_t>(l)], x, P + lp.router_w, P + lp.experts,
                                       cf.hidden_size, s, aux_grad, z_grad, expert_comm_, &a.ep_buf);
  if (!tp()) {
    cpu::MoeBackward(a.dln.data(), G + lp.router_w, G + lp.experts, a.dtmp.data(), &m, x, P + lp.router_w,
                     P + lp.experts, cf.hidden_size, s, aux_grad, z_grad);
    return absl::OkStatus();
  }
  // Tensor ranks: each rank's experts' slice gives a partial probability gradient, summed over the group (Megatron's
  // all-gathered probabilities' backward) before the router's backward, whose input gradient goes to act_->dtmp.
  // With expert ranks the slices of this rank's local experts run on the expert group's tokens (expert_parallel_cpu.h).
  if (expert_comm_ != nullptr)
    PTK_RETURN_IF_ERROR(cpu::ExpertParallelExpertsBackward(a.dln.data(), G + lp.experts, a.dtmp.data(), &m,
                                                           &a.moe_ep[static_cast<size_t>(l)], P + lp.experts,
                                                           cf.hidden_size, s, expert_comm_, &a.ep_buf));
  else
    cpu::MoeExpertsBackward(a.dln.data(), G + lp.experts, a.dtmp.data(), &m, P + lp.experts, cf.hidden_size, s);
  PTK_RETURN_IF_ERROR(TensorSum(m.dprob.data(), static_cast<int64_t>(m.dprob.size())));
  std::fill(a.dtmp.begin(), a.dtmp.begin() + m.n * cf.hidden_size, 0.0f);
  cpu::MoeRouterBackward(a.dtmp.data(), G + lp.router_w, &m, x_router, P + lp.router_w, cf.hidden_size, s, aux_grad,
                         z_grad);
  return absl::OkStatus();
}

}  // namespace ptk
