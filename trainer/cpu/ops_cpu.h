// The CPU reference ops of the GPT trainer: fp32 for training, double for the finite-difference
// gradient checks. One file per op (<op>_cpu.cpp), forward and backward side by side, so each
// CUDA kernel can sit beside its CPU op. Matrix products go through BLAS (OpenBLAS's cblas);
// row-wise work is threaded with oneTBB over fixed blocks, so results do not depend on the
// number of threads. Backward functions accumulate (+=) into parameter gradients and into input
// gradients unless said otherwise.
#pragma once

#include <cstdint>
#include <functional>

#include "trainer/counter_rng.h"
#include "trainer/op_types.h"

namespace ptk::cpu {

// ---- matmul_cpu.cpp --------------------------------------------------------------------------
// Row-major C(m,n) = alpha * op(A)(m,k) * op(B)(k,n) + beta * C, through cblas_{s,d}gemm. Denormal
// operands and results are taken as 0 (flush-to-zero on the computing thread only: flush_denormals.h).
template <typename T>
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);
// Gemm cuts C into fixed tiles, each one cblas call. GemmTiles makes the calls of the tiles
// needed(row0, rows, col0, cols) accepts only (all when it is empty) and leaves the others' elements as
// they are: each tile it computes is Gemm's call, so its elements are Gemm's bits.
using GemmTileFilter = std::function<bool(int64_t row0, int64_t rows, int64_t col0, int64_t cols)>;
template <typename T>
void GemmTiles(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc, const GemmTileFilter& needed);

// out(n, oc) = inp(n, ic) @ w(oc, ic)^T + bias(oc)   (bias may be null)
template <typename T>
void MatmulForward(T* out, const T* inp, const T* w, const T* bias, int64_t n, int64_t ic, int64_t oc);
// dinp(n, ic) += dout @ w; dw(oc, ic) += dout^T @ inp; dbias(oc) += column sums of dout.
// dinp or dbias may be null.
template <typename T>
void MatmulBackward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int64_t n, int64_t ic,
                    int64_t oc);

// ---- layernorm_cpu.cpp -----------------------------------------------------------------------
// out(n, c) = (inp - mean) * rstd * (w + w_offset) + b; saves mean(n) and rstd(n) for the backward
// pass. w_offset 1: Megatron's --apply-layernorm-1p (zero-centred gamma); the norms below take it too.
template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int64_t n, int64_t c, double eps,
                      T w_offset = T(0));
template <typename T>
void LayerNormBackward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean, const T* rstd,
                       int64_t n, int64_t c, T w_offset = T(0));

// ---- rmsnorm_cpu.cpp -------------------------------------------------------------------------
// RMSNorm (Llama's, Megatron's --normalization RMSNorm): out(n, c) = inp * rstd * (w + w_offset) with
// rstd = 1 / sqrt(mean(inp^2) + eps) (double statistics) saved for backward. No bias.
template <typename T>
void RMSNormForward(T* out, T* rstd, const T* inp, const T* w, int64_t n, int64_t c, double eps, T w_offset = T(0));
template <typename T>
void RMSNormBackward(T* dinp, T* dw, const T* dout, const T* inp, const T* w, const T* rstd, int64_t n, int64_t c,
                     T w_offset = T(0));

// ---- qk_norm_cpu.cpp -------------------------------------------------------------------------
// Megatron's --qk-layernorm over a fused QKV buffer (b, t, qkv_width) in AttentionShape's layout:
// each query head's hd channels normalised with (wq, bq), each key head's with (wk, bk), the value
// heads copied: qkv = norm(raw). LayerNorm with `mean` non-null (weights and biases), RMSNorm with
// `mean`, bq and bk null. Statistics in double, saved per token and normalised head in the row's
// order (b * t * (nh + groups) entries).
template <typename T>
void QKNormForward(T* qkv, T* mean, T* rstd, const T* raw, const T* wq, const T* bq, const T* wk, const T* bk,
                   const AttentionShape& s, double eps, T w_offset = T(0));
// In place on dqkv: the gradient of the normalised buffer in, of `raw` out (the value heads'
// unchanged); the weights' (and LayerNorm's biases') gradients added to dwq, dbq, dwk, dbk (the
// biases' null under RMSNorm).
template <typename T>
void QKNormBackward(T* dqkv, T* dwq, T* dbq, T* dwk, T* dbk, const T* raw, const T* wq, const T* wk, const T* mean,
                    const T* rstd, const AttentionShape& s, T w_offset = T(0));

// ---- output_gate_cpu.cpp ---------------------------------------------------------------------
// --attention-output-gate: the QKV product with gate heads, fused (b * t rows; per query group its query heads,
// their gate heads, the key, the value head: Megatron's linear_qkv rows) split into the QKV buffer of
// AttentionShape's layout and the gate (b * t rows of nh x hd, the query heads' order), and back (gradients).
template <typename T>
void SplitGatedQkv(T* qkv, T* gate, const T* fused, const AttentionShape& s);
template <typename T>
void MergeGatedQkv(T* fused, const T* qkv, const T* gate, const AttentionShape& s);
// out = attn * sigmoid(gate) over n values; backward: dgate assigned, dattn (the output's gradient in) scaled in
// place to the attention output's.
template <typename T>
void OutputGateForward(T* out, const T* attn, const T* gate, int64_t n);
template <typename T>
void OutputGateBackward(T* dattn, T* dgate, const T* attn, const T* gate, int64_t n);

// ---- rope_cpu.cpp ----------------------------------------------------------------------------
// Rotary position embedding (Megatron's apply_rotary_pos_emb) of the query and key heads of a fused
// QKV buffer (b, t, qkv_width) in AttentionShape's layout, in place: pair i of each head rotated by
// its angle at the token's place in its sequence, the pair channels i and i + rd/2 (Megatron's default
// rotate-half form) or, `interleaved`, channels 2i and 2i + 1 (--rotary-interleaved, Meta's original
// layout); channels from rd on untouched, the value heads untouched.
// The tables cos/sin (t, rd/2) hold fp32 cos and sin of position * RopeInverseFrequency (op_math.h).
void RopeTables(float* cos, float* sin, int64_t t, int64_t rd, const RopeSettings& r);
template <typename T>
void RopeForward(T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd, bool interleaved);
// The gradient through it (the inverse rotation), in place on dqkv.
template <typename T>
void RopeBackward(T* dqkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd, bool interleaved);

// ---- swiglu_cpu.cpp --------------------------------------------------------------------------
// SwiGLU over fc1's rows [gate (f); up (f)] of each token (Megatron's torch.chunk order):
// out(n, f) = silu(gate) * up.
template <typename T>
void SwigluForward(T* out, const T* inp, int64_t n, int64_t f);
// dinp(n, 2f) is assigned.
template <typename T>
void SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t n, int64_t f);

// ---- embedding_cpu.cpp -----------------------------------------------------------------------
// out(n, c) = wte[tokens[i]] + wpe[positions[i]]   (wpe, dwpe null: no position embedding)
template <typename T>
void EmbeddingForward(T* out, const int32_t* tokens, const int32_t* positions, const T* wte, const T* wpe, int64_t n,
                      int64_t c);
template <typename T>
void EmbeddingBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, const int32_t* positions, int64_t n,
                       int64_t c);

// ---- gelu_cpu.cpp ----------------------------------------------------------------------------
// Megatron's fused bias-GELU: the tanh approximation.
template <typename T>
void GeluForward(T* out, const T* inp, int64_t n);
// dinp = dout * gelu'(inp)   (assigns, does not accumulate)
template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n);
// torch's exact GELU (Megatron's GELU MLP without the fused kernel): out = inp/2 (1 + erf(inp / sqrt 2)).
template <typename T>
void GeluExactForward(T* out, const T* inp, int64_t n);
// dinp = dout * (Phi(inp) + inp phi(inp))   (assigns; dinp may be dout)
template <typename T>
void GeluExactBackward(T* dinp, const T* inp, const T* dout, int64_t n);

// ---- squared_relu_cpu.cpp --------------------------------------------------------------------
// Megatron's --squared-relu MLP activation: out = relu(inp)^2.
template <typename T>
void SquaredReluForward(T* out, const T* inp, int64_t n);
// dinp = dout * 2 relu(inp)   (assigns; dinp may be dout)
template <typename T>
void SquaredReluBackward(T* dinp, const T* inp, const T* dout, int64_t n);

// ---- dropout_cpu.cpp -------------------------------------------------------------------------
// Counter-based dropout: element i of stream `stream` is kept when a hash of (seed, stream, i)
// falls below 1-p, so the same mask comes back in backward and in recomputation, for any
// thread count. Kept elements are scaled by 1/(1-p).
// The keys (DropoutKey, DropoutStream, DropoutKeepThreshold) are in trainer/counter_rng.h.
// inout(n) *= mask / (1 - p), in place (forward and backward are the same operation).
template <typename T>
void Dropout(T* inout, int64_t n, double p, uint64_t seed, uint64_t stream);

// ---- attention_cpu.cpp -----------------------------------------------------------------------
// Causal self-attention over Megatron's fused QKV layout: qkv(b, t, qkv_width), per query group
// its query heads, then its key and value head (multi-head attention: per head q, k, v).
// out(b, t, nh*hd). probs(b, nh, t, t) receives the softmax (before dropout); attention dropout
// with probability p uses stream streams[batch] + head (streams may be null when p is 0).
// AttentionShape is in trainer/op_types.h (shared with the CUDA ops).
template <typename T>
void AttentionForward(T* out, T* probs, const T* qkv, const AttentionShape& s, double p, uint64_t seed,
                      const uint64_t* streams);
// dqkv(b, t, qkv_width) is assigned (a group's key and value gradients summed over its query
// heads). Each thread works in 2 * t * t elements of its own.
template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* probs, const AttentionShape& s, double p,
                       uint64_t seed, const uint64_t* streams);

// ---- attention_rows_cpu.cpp ------------------------------------------------------------------
// Context parallelism's attention: the queries of tq positions of each sample (q_rows(b, tq,
// qkv_width), row i at position qpos[i] of its sample) over the keys and values of the whole samples
// (kv(b, s.t, qkv_width)), causal by position, with the masks and attention-dropout keys of
// AttentionForward over the whole samples (row i's are those of its row qpos[i]). out(b, tq, nh*hd);
// probs(b, nh, tq, s.t) receives the softmax (before dropout).
// MaskedKeys::kSkip (the default): the scores (forward) and their gradients through the values
// (backward) are not computed in Gemm's tiles whose keys all come after every row's position (masked
// out, as for a context rank's first chunk over the later chunks' keys, or the top right of a long
// sequence's causal mask); the other tiles are the same cblas calls, so every result has kCompute's
// bits (every tile computed, as before; ops_test compares the two). Only sequences of more than one
// of Gemm's column tiles (1024 keys) have such tiles.
enum class MaskedKeys { kSkip, kCompute };
template <typename T>
void AttentionRowsForward(T* out, T* probs, const T* q_rows, const T* kv, const int64_t* qpos, int64_t tq,
                          const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                          MaskedKeys keys = MaskedKeys::kSkip);
// The query columns of dq_rows(b, tq, qkv_width) and the key and value columns of dkv(b, s.t,
// qkv_width) are assigned (these rows' share of the keys' and values' gradients); the other columns
// are left as they are. Each thread works in 2 * tq * s.t elements of its own.
template <typename T>
void AttentionRowsBackward(T* dq_rows, T* dkv, const T* dout, const T* q_rows, const T* kv, const T* probs,
                           const int64_t* qpos, int64_t tq, const AttentionShape& s, double p, uint64_t seed,
                           const uint64_t* streams, MaskedKeys keys = MaskedKeys::kSkip);

// ---- softmax_xent_cpu.cpp --------------------------------------------------------------------
// losses(n) = logsumexp(logits(n, vp)) - logits[target]; every column, padded ones included, is in
// the softmax (as Megatron's vocab-parallel cross entropy).
template <typename T>
void SoftmaxCrossEntropyForward(T* losses, const T* logits, const int32_t* targets, int64_t n, int64_t vp);
// logits(n, vp) is overwritten with dlogits = (softmax - onehot) * dlosses[i].
template <typename T>
void SoftmaxCrossEntropyBackward(T* logits, const int32_t* targets, const T* dlosses, int64_t n, int64_t vp);
// Both at once for training (one exp per logit): losses(n) as the forward, logits overwritten as
// the backward.
template <typename T>
void SoftmaxCrossEntropyFused(T* logits, T* losses, const int32_t* targets, const T* dlosses, int64_t n, int64_t vp);

// ---- adamw_cpu.cpp ---------------------------------------------------------------------------
// AdamW over n elements (AdamWParams in trainer/op_types.h; the element update is AdamWElement
// in trainer/op_math.h).
template <typename T>
void AdamW(T* p, const T* g, T* m, T* v, int64_t n, const AdamWParams& a);

// Sum of squares in double, over fixed blocks (the same bits for any thread count).
template <typename T>
double SumSquares(const T* x, int64_t n);
// x *= s
template <typename T>
void Scale(T* x, int64_t n, T s);

}  // namespace ptk::cpu
