// The CUDA mixture-of-experts ops (moe_cuda.cu), each the device twin of a piece of trainer/cpu/moe_cpu.cpp;
// the dispatch plan they read is built on the host (moe_plan.h). No op uses atomics: every sum runs in a
// fixed order, so a pass's results are the same bits on every run.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {

// The router's settings the kernels read (cpu::MoeSettings' dropless part).
struct MoeRouting {
  int64_t experts = 0, topk = 0;
  bool pre_softmax = false, sigmoid = false;
  float scaling = 0;  // --moe-router-topk-scaling-factor (0: none)
  // Group-limited routing (group_topk 0: none; at most 64 groups): cpu::MoeSettings' groups and group_topk.
  int64_t groups = 0, group_topk = 0;
  // Aux-loss-free routing (sigmoid only; null: none): the experts' bias (E, on the device) added to the sigmoids
  // that choose the top k, not to the probabilities (cpu::MoeSettings' expert_bias).
  const float* expert_bias = nullptr;
};

// One thread per token, from the fp32 logits (n, E): scores (n, E) (the softmax over all experts, or under
// sigmoid the sigmoids over their sum + 1e-20, gates (n, E) then the sigmoids; gates unused otherwise), the
// top-k expert (n, K) by descending score (the lower index first among equals: softmax without pre_softmax
// picks by logit, pre_softmax by softmax score, sigmoid by sigmoid), prob (n, K) their probabilities (times
// the scaling factor), lse (n) each token's log-sum-exp of its logits. Under group-limited routing the top k
// within the chosen groups (cpu Choose), and plain (n, K; null: not written) each token's plain top-k of its
// scores, the load-balancing loss's routing map.
absl::Status MoeRouteForward(float* scores, float* gates, float* prob, int32_t* expert, float* lse, int32_t* plain,
                             const float* logits, int64_t n, const MoeRouting& r, const CudaContext& ctx);
// colsum (n / per, E) = the scores' sums over each group of `per` consecutive tokens (0: all n, one row), one
// block per group and expert, a fixed tree; InvalidArgument where per does not divide n.
absl::Status MoeScoreColumnSums(float* colsum, const float* scores, int64_t n, int64_t experts, const CudaContext& ctx,
                                int64_t per = 0);
// rows (nrows, c) = src[order[r] / topk]: the tokens gathered into the experts' rows (Megatron's permute).
template <typename T>
absl::Status MoeGatherRows(T* rows, const T* src, const int32_t* order, int64_t nrows, int64_t topk, int64_t c,
                           const CudaContext& ctx);
// scaled (nrows, f) = act x prob[order[r]] (per_token_scale), in fp32 then rounded.
template <typename T>
absl::Status MoeScaleRows(T* scaled, const T* act, const float* prob, const int32_t* order, int64_t nrows, int64_t f,
                          const CudaContext& ctx);
// Backward of MoeScaleRows, one block per row: dprob[order[r]] = sum_j dscaled[r, j] act[r, j] (fp32, a fixed
// tree), then dscaled[r, .] *= prob[order[r]] in place (the activation's gradient).
template <typename T>
absl::Status MoeScaleRowsBackward(float* dprob, T* dscaled, const T* act, const float* prob, const int32_t* order,
                                  int64_t nrows, int64_t f, const CudaContext& ctx);
// The un-permute: out (n, c) = add[i] (fp32; null: 0) + sum over k of rows[combine[i, k]] (each token's rows
// ascending, added in fp32 in that order), rounded to T once.
template <typename T>
absl::Status MoeCombineRows(T* out, const T* rows, const int32_t* combine, const float* add, int64_t n, int64_t topk,
                            int64_t c, const CudaContext& ctx);
// The router's backward, one thread per token (cpu RouterBackward): dlogits (n, E) assigned from dprob (n, K)
// (before the scaling factor's division), the load-balancing losses' gradient d(scores[i, e]) = dscore[i /
// dscore_per, e] (cpu's aux_unit x AuxCount(e) + BalanceGrad(i, e); null: none) and the z-loss's (z_unit x 2 lse
// softmax(logits)).
absl::Status MoeRouteBackward(float* dlogits, const float* logits, const float* scores, const float* gates,
                              const float* prob, const float* dprob, const int32_t* expert, const float* lse,
                              const float* dscore, int64_t dscore_per, int64_t n, const MoeRouting& r, float z_unit,
                              const CudaContext& ctx);

// ---- moe_shared_cuda.cu: the shared experts (trainer/cpu/shared_experts_cpu.h) beside the routed ones ----
// gate (n) = sigmoid(x[i] . w_gate) in fp32, x (n, c), w_gate (1, c) (one block per token, a fixed tree).
template <typename T>
absl::Status MoeSharedGateForward(float* gate, const T* x, const T* w_gate, int64_t n, int64_t c,
                                  const CudaContext& ctx);
// add (n, c) = y (n, c) x gate[i] in fp32 (gate null: y): what MoeCombineRows adds to each token's rows.
template <typename T>
absl::Status MoeSharedScale(float* add, const T* y, const float* gate, int64_t n, int64_t c, const CudaContext& ctx);
// The gate's backward, one block per token: dlogit[i] = (sum_j dout[i, j] y[i, j]) g (1 - g), dy = dout x g.
template <typename T>
absl::Status MoeSharedGateBackward(float* dlogit, T* dy, const T* dout, const T* y, const float* gate, int64_t n,
                                   int64_t c, const CudaContext& ctx);
// dx (n, c) fp32 += src (n, c) (null: none) + dlogit[i] w_gate[j] (dlogit null: none); with dlogit also dw_gate (c)
// += sum_i dlogit[i] x[i, j] (one block per column, a fixed tree).
template <typename T>
absl::Status MoeSharedInputGrad(float* dx, float* dw_gate, const T* src, const float* dlogit, const T* x,
                                const T* w_gate, int64_t n, int64_t c, const CudaContext& ctx);

}  // namespace ptk::cuda
