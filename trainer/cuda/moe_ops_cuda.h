// The CUDA mixture-of-experts ops (moe_cuda.cu), each the device twin of a piece of trainer/cpu/moe_cpu.cpp;
// the dispatch plan they read is built on the host (moe_plan.h). No op uses atomics: every sum runs in a
// fixed order, so a pass's results are the same bits on every run.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {

// The router's settings the kernels read (cpu::MoeSettings' dropless, ungrouped, unbiased part).
struct MoeRouting {
  int64_t experts = 0, topk = 0;
  bool pre_softmax = false, sigmoid = false;
  float scaling = 0;  // --moe-router-topk-scaling-factor (0: none)
};

// One thread per token, from the fp32 logits (n, E): scores (n, E) (the softmax over all experts, or under
// sigmoid the sigmoids over their sum + 1e-20, gates (n, E) then the sigmoids; gates unused otherwise), the
// top-k expert (n, K) by descending score (the lower index first among equals: softmax without pre_softmax
// picks by logit, pre_softmax by softmax score, sigmoid by sigmoid), prob (n, K) their probabilities (times
// the scaling factor), lse (n) each token's log-sum-exp of its logits.
absl::Status MoeRouteForward(float* scores, float* gates, float* prob, int32_t* expert, float* lse, const float* logits,
                             int64_t n, const MoeRouting& r, const CudaContext& ctx);
// colsum (E) = the scores' sums over the n tokens (one block per expert, a fixed tree).
absl::Status MoeScoreColumnSums(float* colsum, const float* scores, int64_t n, int64_t experts, const CudaContext& ctx);
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
// (before the scaling factor's division), the load-balancing loss's gradient (aux_unit x counts[e] per score:
// counts may be null when aux_unit is 0) and the z-loss's (z_unit x 2 lse softmax(logits)).
absl::Status MoeRouteBackward(float* dlogits, const float* logits, const float* scores, const float* gates,
                              const float* prob, const float* dprob, const int32_t* expert, const float* lse,
                              const float* counts, int64_t n, const MoeRouting& r, float aux_unit, float z_unit,
                              const CudaContext& ctx);

}  // namespace ptk::cuda
