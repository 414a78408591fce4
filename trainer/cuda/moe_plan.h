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
  int64_t rows() const { return n * topk; }
};

// Byte offsets (each MemoryPlan-aligned, 256) into two regions: `saved`, one per MoE layer, what backward
// reads; `scratch`, one for the pass. fp32 unless said; T the activation type.
struct MoeBuffers {
  // saved: logits (n, E) the router's (the z-loss's backward); scores (n, E) (softmax over all experts, or the
  // normalised sigmoids); gates (n, E) sigmoid only
  // (-1 otherwise); prob (n, K) the chosen experts' probabilities (after the scaling factor); expert (n, K)
  // int32; lse (n) the logits' log-sum-exp (the z-loss's); order (rows) int32 the slot of each row; combine
  // (n, K) int32 each token's rows ascending; counts (E) each expert's rows; x (rows, c) T the gathered
  // input; fc1 (rows, fc1_rows) T; act (rows, ffn) T the activation; scaled (rows, ffn) T its rows x prob.
  int64_t logits = 0, scores = 0, gates = -1, prob = 0, expert = 0, lse = 0, order = 0, combine = 0, counts = 0, x = 0,
          fc1 = 0, act = 0, scaled = 0, saved_bytes = 0;
  // scratch: xf (n, c) and wf (E, c) the router's input and weight in fp32, colsum (E) the scores' column sums;
  // rows (rows, c) T the experts' outputs, then the output gradient gathered; dscaled (rows, ffn) T, then
  // the activation's gradient; dfc1 (rows, fc1_rows) T; dx_rows (rows, c) T; dprob (n, K); dlogits (n, E);
  // dx_router (n, c) the router's input gradient.
  int64_t xf = 0, wf = 0, colsum = 0, rows = 0, dscaled = 0, dfc1 = 0, dx_rows = 0, dprob = 0, dlogits = 0,
          dx_router = 0, scratch_bytes = 0;
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
// column sums and the plan's counts: E / (K n^2) sum_e colsum[e] counts[e]; and the gradient unit the
// router's backward multiplies each count by: aux_grad E / (K n^2).
double MoeAuxLossOf(const float* colsum, const MoeDispatchPlan& plan, int64_t n, int64_t topk, int64_t experts);
double MoeAuxUnit(double aux_grad, int64_t n, int64_t topk, int64_t experts);
// The z-loss without its coefficient: the mean over the n tokens of lse^2.
double MoeZLossOf(const float* lse, int64_t n);

}  // namespace ptk::cuda
