// Megatron-core's dropless token-choice top-k mixture-of-experts MLP on the CPU (fp32 for training,
// double for the finite-difference checks): the router (a linear layer without bias, hidden -> E,
// softmax scores, top-k; the probabilities a softmax over the k chosen logits, or with pre_softmax
// the chosen entries of the softmax over all E), the tokens sent to their k experts (each expert's
// rows in token order, Megatron's permute), each expert the dense MLP's shape without biases with
// its output's rows scaled by the token's probability after the activation (MLP's per_token_scale),
// the outputs added back per token; the switch-style load-balancing loss
// (switch_load_balancing_loss_func) and its gradient. With sigmoid, Megatron's sigmoid score function.
// Also the router z-loss (z_loss_func) and its gradient, the top-k probabilities' scaling factor and
// group-limited routing (group_limited_topk).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ptk::cpu {

enum class MlpActivation { kGelu, kGeluExact, kSquaredRelu, kSwiglu };

struct MoeSettings {
  int64_t experts = 0, topk = 2;
  int64_t ffn = 0;           // each expert's ffn width (--moe-ffn-hidden-size); fc1 has 2 x ffn rows under SwiGLU
  bool pre_softmax = false;  // softmax scores only
  // Megatron's --moe-router-score-function sigmoid: scores sigmoid(logits), the top-k's probabilities
  // those scores over their sum (+1e-20; the score itself at k = 1), the load-balancing loss's scores
  // each token's sigmoids over their sum (+1e-20).
  bool sigmoid = false;
  // Megatron's --moe-router-topk-scaling-factor (0: none): the chosen experts' probabilities times it.
  double scaling = 0;
  // Megatron's group-limited routing (group_topk 0: none): the experts in `groups` equal groups, each token's
  // experts chosen among the group_topk groups of the largest sums of their topk / group_topk largest
  // scores. The load-balancing loss still counts each token's plain top-k (compute_routing_scores_for_aux_loss).
  int64_t groups = 0, group_topk = 0;
  // Aux-loss-free routing (sigmoid only): the experts' bias (E floats) added to the scores that choose the top k,
  // not to the probabilities; the load-balancing losses then count each token's plain top-k. Null: none.
  const float* expert_bias = nullptr;
  MlpActivation activation = MlpActivation::kGelu;
  // Megatron's --moe-expert-capacity-factor (below 0: none, dropless) and --moe-token-drop-policy position
  // (false: probs): the slots over each expert's capacity dropped (moe_capacity_cpu.h); sample_rows: each
  // sample's positions among the router's rows (0: all of them, one sample), Megatron's token order.
  double capacity_factor = -1;
  bool drop_by_position = false;
  int64_t sample_rows = 0;
  // Tensor ranks (--sequence-parallel): Megatron's router sees each rank's own positions [r·t/T, (r+1)·t/T) of
  // every sample (t = sample_rows), so each of the `shards` ranks' rows takes its own capacity from its own tokens
  // and drops in its own token order (router.py's apply_router_token_dropping on the local hidden states).
  int64_t shards = 1;
  int64_t fc1_rows() const { return (activation == MlpActivation::kSwiglu ? 2 : 1) * ffn; }
  // One expert's fc1 (fc1_rows, c) then fc2 (c, ffn) weights: the experts lie one after another.
  int64_t expert_floats(int64_t c) const { return fc1_rows() * c + c * ffn; }
};

// One MoE layer's pass over n tokens: the routing and what the experts' backward reads.
template <typename T>
struct MoeActivations {
  int64_t n = 0;
  std::vector<T> logits;        // (n, E) the router's
  std::vector<T> scores;        // (n, E) softmax over all experts (the aux loss's, pre_softmax's)
  std::vector<T> gates;         // (n, E) under sigmoid: sigmoid(logits) (scores then holds them normalised)
  std::vector<T> prob;          // (n, K) the chosen experts' probabilities
  std::vector<int32_t> expert;  // (n, K) the chosen experts, by descending score
  // The n·K rows sent to the experts: row r is slot order[r] (token order[r] / K), expert e's rows
  // [begin[e], begin[e + 1]) in token order.
  std::vector<int64_t> order, begin;
  std::vector<uint8_t> dropped;        // (n, K) with a capacity: the slots over it (1), sent to no expert; else empty
  std::vector<T> x, fc1, act, scaled;  // per row: the input (c), fc1's output, the activation, x prob
  std::vector<T> out, dout, dact, dfc1, dx, dprob, dlogits;  // per row scratch, and (n, K), (n, E) gradients
  // Context parallelism: the tokens each expert got over the context group's ranks (E of them) and the group's
  // tokens, Megatron's global_tokens_per_expert and total_num_tokens: the load-balancing loss's counts (its
  // value and gradient then this rank's part of the whole sequence's). Empty (MoeRouterForward clears it): this
  // rank's own. Under group-limited routing MoeRouterForward fills it with this rank's plain top-k counts (and
  // group_n with n), which the load-balancing loss counts instead of the dispatch's.
  std::vector<double> group_count;
  double group_n = 0;
  double AuxCount(int64_t e) const {
    return group_count.empty() ? static_cast<double>(begin[e + 1] - begin[e])
                               : group_count[static_cast<std::size_t>(e)];
  }
  double AuxTokens() const { return group_count.empty() ? static_cast<double>(n) : group_n; }
  // The seq_aux_loss's and global_aux_loss's gradient (trainer/cpu/moe_balance.cpp): d(objective) / d(scores[i,
  // e]) beyond aux_loss's, one row of E per group of balance_tokens consecutive tokens (a sequence's, or all n).
  // Empty: none.
  std::vector<double> balance_grad;
  int64_t balance_tokens = 0;
  double BalanceGrad(int64_t i, int64_t e, int64_t E) const {
    return balance_grad.empty() ? 0.0 : balance_grad[static_cast<std::size_t>(i / balance_tokens * E + e)];
  }
};

// An expert MLP's activation (the experts' and the shared experts'): out (rows, f) from fc1's output in (rows, fc1
// width: 2f under SwiGLU), and its backward: din (rows, fc1 width) assigned from dout (rows, f).
template <typename T>
void MlpActivationForward(MlpActivation act, T* out, const T* in, int64_t rows, int64_t f);
template <typename T>
void MlpActivationBackward(MlpActivation act, T* din, const T* in, const T* dout, int64_t rows, int64_t f);

// The router and the dispatch: `a` sized and filled from x (n, c) and the router's weight (E, c).
template <typename T>
void MoeRouterForward(MoeActivations<T>* a, const T* x, const T* w_router, int64_t n, int64_t c, const MoeSettings& s);
// The load-balancing loss of the pass without its coefficient (what Megatron logs as
// load_balancing_loss): E / (K n^2) · sum_e (sum over tokens of scores[., e]) · (tokens sent to e); n and
// the counts the context group's where `a` holds them (group_count).
template <typename T>
double MoeAuxLoss(const MoeActivations<T>& a, const MoeSettings& s);
// The router z-loss of the pass without its coefficient (what Megatron logs as z_loss): the mean over the
// tokens of logsumexp(logits)^2.
template <typename T>
double MoeZLoss(const MoeActivations<T>& a, const MoeSettings& s);
// The same mean over one tensor rank's rows only (positions [shard·t/shards, (shard+1)·t/shards) of each sample of
// t = s.sample_rows rows): the z-loss Megatron logs under tensor ranks, each rank's own (router.py's apply_z_loss).
template <typename T>
double MoeZLossOfShard(const MoeActivations<T>& a, const MoeSettings& s, int64_t shard);
// The experts: out (n, c) assigned, from x (n, c) and the experts' weights (E x expert_floats).
template <typename T>
void MoeExpertsForward(T* out, MoeActivations<T>* a, const T* w_experts, int64_t c, const MoeSettings& s);
// The whole layer's backward from dout (n, c): dx (n, c) accumulated with the experts' and the
// router's input gradients, dw_router (E, c) and dw_experts accumulated. aux_grad: d(objective) /
// d(load-balancing loss without its coefficient), i.e. coefficient x the loss's weight (0: none); z_grad
// likewise the z-loss's (MoeZLoss).
// MoeBackward's two halves, for expert parallelism (the experts on the tokens gathered from the expert
// group, the router on this rank's own). The experts': dx (n, c) accumulated through the experts, dw_experts
// accumulated, a->dprob (n, K) assigned (0 for the slots of experts `a` holds no rows of). `a` may hold rows
// of only some slots (an expert rank's: begin[s.experts] rows, s.experts its local experts).
template <typename T>
void MoeExpertsBackward(T* dx, T* dw_experts, const T* dout, MoeActivations<T>* a, const T* w_experts, int64_t c,
                        const MoeSettings& s);
// The router's: from a->dprob, the load-balancing loss and the z-loss, dx (n, c) and dw_router (E, c) accumulated.
template <typename T>
void MoeRouterBackward(T* dx, T* dw_router, MoeActivations<T>* a, const T* x, const T* w_router, int64_t c,
                       const MoeSettings& s, double aux_grad, double z_grad = 0);
template <typename T>
void MoeBackward(T* dx, T* dw_router, T* dw_experts, const T* dout, MoeActivations<T>* a, const T* x, const T* w_router,
                 const T* w_experts, int64_t c, const MoeSettings& s, double aux_grad, double z_grad = 0);

}  // namespace ptk::cpu
