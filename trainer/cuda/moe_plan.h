// The CUDA backend's mixture-of-experts layer, its host side (plain C++, checked on the CPU): the device
// buffers of one MoE layer (what its forward keeps for backward, and the pass's scratch), laid out from the
// shape, and the dropless dispatch plan built on the host from the router's choices (each expert's rows, the
// permutation of the token slots by expert, each token's rows for the weighted un-permute). The kernels
// (moe_cuda.cu) and the layer (moe_layer_cuda.cpp) read both; trainer/cpu/moe_cpu.cpp's Dispatch is the same
// order: expert e's rows [begin[e], begin[e + 1]) hold its slots in token order.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/param_layout.h"

namespace ptk::cuda {

// One MoE layer on one rank: n tokens of width c, `experts` experts each token goes to `topk` of (dropless:
// n x topk rows), each expert's ffn width `ffn` and fc1's output width fc1_rows (2 x ffn under SwiGLU);
// act_bytes the activation type's size (4 fp32, 2 bf16/fp16); sigmoid: the sigmoid score function (its
// gates kept).
struct MoeShape {
  int64_t n = 0, c = 0, experts = 0, topk = 0, ffn = 0, fc1_rows = 0, act_bytes = 4;
  bool sigmoid = false;
  // Shared experts (--moe-shared-expert-intermediate-size; shared_ffn 0: none): a dense MLP of width shared_ffn
  // (fc1 shared_fc1_rows wide) on every token, with shared_gate its output scaled by sigmoid(x . gate_weight).
  int64_t shared_ffn = 0, shared_fc1_rows = 0;
  bool shared_gate = false;
  bool grouped = false;    // group-limited routing: the load-balancing loss counts each token's plain top-k
  bool biased = false;     // the expert bias (sigmoid): likewise, and the bias uploaded for the router
  int64_t seq_tokens = 0;  // seq_aux_loss (0: none): each sequence's tokens, S (n a multiple of it)
  int64_t seqs() const { return seq_tokens > 0 ? n / seq_tokens : 0; }
  int64_t rows() const { return n * topk; }
};

// Byte offsets (each MemoryPlan-aligned, 256) into two regions: `saved`, one per MoE layer, what backward
// reads; `scratch`, one for the pass. fp32 unless said; T the activation type.
struct MoeBuffers {
  // saved: logits (n, E) the router's (the z-loss's backward); scores (n, E) (softmax over all experts, or the
  // normalised sigmoids); gates (n, E) sigmoid only
  // (-1 otherwise); prob (n, K) the chosen experts' probabilities (after the scaling factor); expert (n, K)
  // int32; lse (n) the logits' log-sum-exp (the z-loss's); order (rows) int32 the slot of each row; combine
  // (n, K) int32 each token's rows ascending; x (rows, c) T the gathered
  // input; fc1 (rows, fc1_rows) T; act (rows, ffn) T the activation; scaled (rows, ffn) T its rows x prob.
  int64_t logits = 0, scores = 0, gates = -1, prob = 0, expert = 0, lse = 0, order = 0, combine = 0, x = 0, fc1 = 0,
          act = 0, scaled = 0;
  // saved, shared experts only (-1 otherwise): shared_fc1 (n, shared_fc1_rows) T, shared_act (n, shared_ffn) T;
  // with the gate also shared_y (n, c) T their fc2's output and shared_gate (n) its sigmoid.
  int64_t shared_fc1 = -1, shared_act = -1, shared_y = -1, shared_gate = -1, saved_bytes = 0;
  // scratch: xf (n, c) and wf (E, c) the router's input and weight in fp32, colsum (E) the scores' column sums;
  // rows (rows, c) T the experts' outputs, then the output gradient gathered; dscaled (rows, ffn) T, then
  // the activation's gradient; dfc1 (rows, fc1_rows) T; dx_rows (rows, c) T; dprob (n, K); dlogits (n, E);
  // dx_router (n, c) the router's input gradient.
  int64_t xf = 0, wf = 0, colsum = 0, rows = 0, dscaled = 0, dfc1 = 0, dx_rows = 0, dprob = 0, dlogits = 0,
          dx_router = 0;
  // scratch: dscore (max(seqs, 1), E) the load-balancing losses' score gradients (MoeScoreGradients: one row per
  // sequence under seq_aux_loss, else one); under group-limited routing, the bias or seq_aux_loss (-1) plain (n, K)
  // int32 each token's plain top-k (the losses' routing map, copied to the host where its counts are taken); under
  // seq_aux_loss (-1 otherwise) seq_colsum (seqs, E) the scores' sums per sequence.
  // With the expert bias (-1 otherwise; plain too) bias (E) its values for the router.
  int64_t dscore = 0, plain = -1, seq_colsum = -1, bias = -1;
  // scratch, shared experts only (-1 otherwise): shared_add (n, c) their output (x the gate) in fp32 for the
  // un-permute (forward; dx_router's place, which only backward uses); shared_dy (n, c) T fc2's output gradient
  // (in forward without the gate fc2's output itself); shared_dact (n, shared_ffn) T; shared_dfc1 (n,
  // shared_fc1_rows) T; shared_dx (n, c) T their input gradient; shared_dlogit (n) the gate's logit gradient
  // (with the gate).
  int64_t shared_add = -1, shared_dy = -1, shared_dact = -1, shared_dfc1 = -1, shared_dx = -1, shared_dlogit = -1,
          scratch_bytes = 0;
};
MoeBuffers PlanMoeBuffers(const MoeShape& s);
// The shape of cf's MoE layers over n tokens at one tensor rank, act_bytes per activation element.
MoeShape MoeShapeOf(const GPTConfig& cf, int64_t n, int64_t act_bytes);
// The MoE layers among the layers [begin, end) of cf.
int64_t MoeLayersIn(const GPTConfig& cf, int64_t begin, int64_t end);

// The dropless dispatch of one pass, from the router's choices expert (n, K): begin (E + 1) each expert's
// first row, order (n K) row r's slot (token order[r] / K), combine (n, K) token i's K rows in ascending
// order (the un-permute adds them in it: a fixed order, no atomics), counts (E) begin's differences.
struct MoeDispatchPlan {
  std::vector<int64_t> begin;
  std::vector<int32_t> order, combine;
  std::vector<float> counts;
};
// InvalidArgument naming the slot where an expert is out of [0, E), or n K does not fit int32.
absl::Status BuildMoeDispatch(MoeDispatchPlan* plan, const int32_t* expert, int64_t n, int64_t topk, int64_t experts);

// The load-balancing loss without its coefficient (trainer/cpu/moe_cpu.h's MoeAuxLoss) from the scores'
// column sums and the experts' counts (the plan's, or MoeRoutingCounts' under group-limited routing): E / (K n^2) sum_e
// colsum[e] counts[e]; and the gradient unit the router's backward multiplies each count by: aux_grad E / (K n^2).
double MoeAuxLossOf(const float* colsum, const std::vector<float>& counts, int64_t n, int64_t topk, int64_t experts);
// Each expert's slots among expert (n, K) per group of `per` consecutive tokens (0: all n): (n / per, E), checked as
// BuildMoeDispatch does: the load-balancing losses' counts from each token's plain top-k (group-limited routing's
// aux_loss, seq_aux_loss's per sequence).
absl::Status MoeRoutingCounts(std::vector<float>* counts, const int32_t* expert, int64_t n, int64_t topk,
                              int64_t experts, int64_t per = 0);
// seq_aux_loss without its coefficient (trainer/cpu/moe_balance.cpp): the switch loss of each of the B = n / S
// sequences on its own counts and score sums (colsum, counts: (B, E)), their mean: E / (K S^2 B) sum colsum counts.
double MoeSeqAuxLossOf(const float* colsum, const std::vector<float>& counts, int64_t n, int64_t topk, int64_t experts,
                       int64_t seq_tokens);
// The load-balancing losses' gradient per score, the router backward's dscore (rows, E), each entry rounded to fp32
// once as the CPU's: aux_unit x aux_counts[e] (MoeAuxUnit) + seq_grad E / (K S^2 B) x seq_counts[b, e] (seq_counts
// empty: none; rows its B, else 1).
std::vector<float> MoeScoreGradients(double aux_unit, const std::vector<float>& aux_counts, double seq_grad,
                                     const std::vector<float>& seq_counts, int64_t n, int64_t topk, int64_t experts,
                                     int64_t seq_tokens);
double MoeAuxUnit(double aux_grad, int64_t n, int64_t topk, int64_t experts);
// The z-loss without its coefficient: the mean over the n tokens of lse^2.
double MoeZLossOf(const float* lse, int64_t n);

}  // namespace ptk::cuda
