// The CUDA ops of the GPT trainer, one file per op (<op>_cuda.cu) beside its CPU op
// (trainer/cpu/<op>_cpu.cpp), launchers in the CPU op's argument order plus the context (stream,
// handles, workspace). T is the activation type: float (fp32 mode, compared tightly with the CPU
// ops), __nv_bfloat16 (--bf16) or __half (--fp16). Master weights, gradients, AdamW moments,
// LayerNorm statistics, softmax and losses are fp32 in every mode. Every pointer is device memory
// unless said otherwise. As on the CPU, backward functions accumulate (+=) into parameter
// gradients; what they do to input gradients is said per op. Reductions are in a fixed order:
// the same inputs give the same bits, run after run (no atomics whose order varies).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/cuda/cuda_common.h"
#include "trainer/op_types.h"

namespace ptk::cuda {

// ---- matmul_cuda.cu (cuBLASLt) -----------------------------------------------------------------
// out(n, oc) = inp(n, ic) @ w(oc, ic)^T + bias(oc)   (bias may be null; fp32 accumulation, no TF32
// in fp32 mode). With gelu_out: out receives the pre-activation and gelu_out(n, oc) = gelu(out)
// (cuBLASLt's GELU_AUX_BIAS epilogue where it applies, else a separate GELU kernel).
template <typename T>
absl::Status MatmulForward(T* out, const T* inp, const T* w, const T* bias, int64_t n, int64_t ic, int64_t oc,
                           const CudaContext& ctx, T* gelu_out = nullptr);
// dinp(n, ic) = dout @ w  (assigned when accumulate_dinp is false, else added);
// dw(oc, ic) += dout^T @ inp in fp32; dbias(oc) += column sums of dout in fp32.
// dinp or dbias may be null. With gelu_pre (the (n, ic) pre-activation of a GELU whose output was
// inp of this product; not with accumulate_dinp), dinp = (dout @ w) * gelu'(gelu_pre): in bf16/fp16
// through cuBLASLt's DGELU epilogue (aux = gelu_pre: the derivative taken from the fp32
// accumulator, one rounding), else (fp32, or no algorithm) the product then GeluBackward (the
// product rounded to T first).
template <typename T>
absl::Status MatmulBackward(T* dinp, float* dw, float* dbias, const T* dout, const T* inp, const T* w, int64_t n,
                            int64_t ic, int64_t oc, const CudaContext& ctx, bool accumulate_dinp = false,
                            const T* gelu_pre = nullptr);
// dbias(oc) += column sums of dout(n, oc) in fp32: MatmulBackward's bias gradient alone (the same
// order; sequence parallelism's row-parallel biases, from this rank's rows).
template <typename T>
absl::Status BiasBackward(float* dbias, const T* dout, int64_t n, int64_t oc, const CudaContext& ctx);

// ---- layernorm_cuda.cu (forward), layernorm_backward_cuda.cu -----------------------------------
// out(n, c) = (inp - mean) * rstd * w + b with fp32 statistics mean(n), rstd(n); w, b fp32 (the
// master weights: LayerNorm parameters are never rounded). Statistics summed in double, as the CPU
// op; mean and rstd may be null (evaluation).
template <typename T>
absl::Status LayerNormForward(T* out, float* mean, float* rstd, const T* inp, const float* w, const float* b, int64_t n,
                              int64_t c, double eps, const CudaContext& ctx);
// Hidden dropout fused into a LayerNorm kernel. The n rows are tokens of n / seq_len samples; token
// row i is masked with its sample's stream streams[i / seq_len] (device memory) at index
// (i % seq_len) * c + j (TokenDropoutAt of trainer/counter_rng.h): the masks DropoutRows draws over
// rows of seq_len * c, kept elements scaled by 1/(1-p) in fp32. p = 0: no dropout.
struct LnDropout {
  const uint64_t* streams = nullptr;
  int64_t seq_len = 1;
  double p = 0.0;
  uint64_t seed = 0;
};
// The residual add fused in front: resid_out = a + b (rounded to T), then out = LayerNorm(resid_out).
// resid_out may be a or b. With drop.p > 0, resid_out = a + dropout(b), dropout(b) rounded to T
// first: bitwise DropoutRows over b and then this without dropout (b itself is not changed).
template <typename T>
absl::Status ResidualLayerNormForward(T* resid_out, T* out, float* mean, float* rstd, const T* a, const T* b,
                                      const float* w, const float* bias, int64_t n, int64_t c, double eps,
                                      const CudaContext& ctx, const LnDropout& drop = {});
// inout = dropout(inout) in place, then out = LayerNorm(inout): bitwise DropoutRows and then
// LayerNormForward (the embedding's dropout and the first LayerNorm).
template <typename T>
absl::Status DropoutLayerNormForward(T* inout, T* out, float* mean, float* rstd, const float* w, const float* bias,
                                     int64_t n, int64_t c, double eps, const LnDropout& drop, const CudaContext& ctx);
// dinp(n, c) += d(out)/d(inp) applied to dout; dw, db (fp32) +=, without atomics: per-block
// partials in `scratch` (LayerNormBackwardScratch(n, c) floats of device memory), then summed in
// a fixed order. c is limited by the shared memory per block (2c floats: c <= ~28k on sm_90).
// With drop.p > 0 (and only then) dbranch(n, c) = dropout(dinp) as stored (rounded to T), the
// gradient of the dropped branch whose residual sum was inp: bitwise a copy of dinp through
// DropoutRows. dbranch may be dinp (then dinp keeps only the masked gradient).
template <typename T>
absl::Status LayerNormBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                               const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                               const CudaContext& ctx, T* dbranch = nullptr, const LnDropout& drop = {});
int64_t LayerNormBackwardScratch(int64_t n, int64_t c);

// ---- embedding_cuda.cu -------------------------------------------------------------------------
// out(n, c) = wte[tokens[i]] + wpe[positions[i]]   (wte, wpe in T: the compute copies; wpe null: no
// position table, rotary or no position embeddings, and positions is not read)
template <typename T>
absl::Status EmbeddingForward(T* out, const int32_t* tokens, const int32_t* positions, const T* wte, const T* wpe,
                              int64_t n, int64_t c, const CudaContext& ctx);
// The deterministic embedding backward's plan: the rows grouped by token id and by position id,
// built on the host from tokens_host / positions_host (a counting sort: ids in increasing order,
// each id's rows in increasing order) and uploaded through pinned staging. Reserve it once for the
// most rows of a micro-batch; it is reused call after call. Two staging buffers taken in turn, each
// rewritten only once its own last upload has completed (its event `uploaded`): a call never waits
// for the previous call's upload, only for the one before it (the device plan is reused in stream
// order).
struct EmbeddingBackwardPlan {
  EmbeddingBackwardPlan() = default;
  ~EmbeddingBackwardPlan();  // frees what Reserve allocated
  EmbeddingBackwardPlan(const EmbeddingBackwardPlan&) = delete;
  EmbeddingBackwardPlan& operator=(const EmbeddingBackwardPlan&) = delete;
  // Two pinned staging buffers and device memory of EmbeddingBackwardPlanInts(max_n) int32 each, on
  // the current device, for up to max_n rows (frees what it held before).
  absl::Status Reserve(int64_t max_n);

  int64_t max_n = 0;
  int32_t* host[2] = {nullptr, nullptr};         // pinned staging, used in turn
  cudaEvent_t uploaded[2] = {nullptr, nullptr};  // each staging's last upload
  int next = 0;                                  // the staging the next call writes
  int32_t* device = nullptr;                     // the plan on the device
  std::vector<int32_t> counts;                   // host scratch of the counting sort (one per id)
};
int64_t EmbeddingBackwardPlanInts(int64_t max_n);
// dwte[tokens[i]] += dout[i], dwpe[positions[i]] += dout[i] in fp32, deterministic: one block per
// (id, channel chunk) adds the id's rows in order of i to the gradient it loads, exactly the CPU
// op's order of additions (fp32: the CPU's bits). tokens_host / positions_host: the ids in host
// memory, from which the plan is built (they are checked against vocab_rows / position_rows: an id
// out of range is an error before anything is launched); tokens / positions (device) are not read.
// With vocab_first >= 0 (tensor parallelism: dwte is the rows [vocab_first, vocab_first +
// vocab_rows) of the padded vocabulary) tokens outside the slice add to dwpe only. dwpe null: no
// position table (positions_host is not read).
// The host waits only for the upload of the call before the previous one (the staging it rewrites).
template <typename T>
absl::Status EmbeddingBackward(float* dwte, float* dwpe, const T* dout, const int32_t* tokens, const int32_t* positions,
                               const int32_t* tokens_host, const int32_t* positions_host, int64_t n, int64_t c,
                               int64_t vocab_rows, int64_t position_rows, EmbeddingBackwardPlan* plan,
                               const CudaContext& ctx, int64_t vocab_first = -1);

// ---- activation_cuda.cu (GELU, exact GELU and squared ReLU: one kernel pair, the activation a type) -
// GeluValue / GeluDerivative of trainer/op_math.h in fp32.
template <typename T>
absl::Status GeluForward(T* out, const T* inp, int64_t n, const CudaContext& ctx);
// dinp = dout * gelu'(inp)   (assigns; dinp may equal dout)
template <typename T>
absl::Status GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx);

// torch's exact erf GELU (Megatron's GELU MLP without its fused bias-GELU kernel), as
// cpu::GeluExactForward / GeluExactBackward: GeluExactValue / GeluExactDerivative of trainer/op_math.h in
// fp32 (cuBLASLt's GELU epilogues are the tanh one: a kernel of its own after the fc1 product). The
// backward assigns; dinp may equal dout.
template <typename T>
absl::Status GeluExactForward(T* out, const T* inp, int64_t n, const CudaContext& ctx);
template <typename T>
absl::Status GeluExactBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx);

// Megatron's --squared-relu, as cpu::SquaredReluForward / SquaredReluBackward: SquaredReluValue /
// SquaredReluDerivative of trainer/op_math.h in fp32 (cuBLASLt has no such epilogue: a kernel of its own
// after the fc1 product). The backward assigns; dinp may equal dout.
template <typename T>
absl::Status SquaredReluForward(T* out, const T* inp, int64_t n, const CudaContext& ctx);
template <typename T>
absl::Status SquaredReluBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx);

// ---- norm_offset_cuda.cu ------------------------------------------------------------------------
// out(n) = inp + offset in fp32 (out may be inp): --apply-layernorm-1p's effective norm weights
// 1 + gamma, which the norm kernels above and below read as their weight `w`; their weight gradient
// is the zero-centred weight's, d(1 + gamma) = d gamma.
absl::Status AddWeightOffset(float* out, const float* inp, int64_t n, float offset, const CudaContext& ctx);

// ---- rmsnorm_cuda.cu ---------------------------------------------------------------------------
// The Llama line's norm, as cpu::RMSNormForward: out(n, c) = float(inp * rstd) * w with
// rstd(n) = 1 / sqrt(mean(inp^2) + eps) in double (kept in fp32; may be null: evaluation); w fp32.
template <typename T>
absl::Status RMSNormForward(T* out, float* rstd, const T* inp, const float* w, int64_t n, int64_t c, double eps,
                            const CudaContext& ctx);
// dinp(n, c) += the input gradient (as cpu::RMSNormBackward); dw (fp32) += the weight gradient, summed
// without atomics over 64-row blocks in double into `scratch` (RMSNormBackwardScratch(n, c) doubles
// of device memory) and the blocks in order: the CPU op's order of additions.
// The residual add fused in front, as ResidualLayerNormForward without dropout: resid_out = a + b
// (rounded to T; may be a or b), then out = RMSNorm(resid_out).
template <typename T>
absl::Status ResidualRMSNormForward(T* resid_out, T* out, float* rstd, const T* a, const T* b, const float* w,
                                    int64_t n, int64_t c, double eps, const CudaContext& ctx);
template <typename T>
absl::Status RMSNormBackward(T* dinp, float* dw, const T* dout, const T* inp, const float* w, const float* rstd,
                             int64_t n, int64_t c, double* scratch, const CudaContext& ctx);
int64_t RMSNormBackwardScratch(int64_t n, int64_t c);

// ---- qk_norm_cuda.cu ---------------------------------------------------------------------------
// Megatron's --qk-layernorm, as cpu::QKNormForward / QKNormBackward (statistics fp32 in device
// memory, b * t * (nh + groups) of them; weights and biases fp32 master copies; LayerNorm with `mean`,
// RMSNorm with `mean`, bq, bk null). The backward works in place on dqkv and adds the parameters'
// gradients, summed without atomics over 64-token blocks in double into `scratch`
// (QKNormBackwardScratch(s) doubles) in the CPU op's order. The CUDA model runs it after the QKV
// product (the product kept in qkv_raw for the backward) and before RoPE.
template <typename T>
absl::Status QKNormForward(T* qkv, float* mean, float* rstd, const T* raw, const float* wq, const float* bq,
                           const float* wk, const float* bk, const AttentionShape& s, double eps,
                           const CudaContext& ctx);
template <typename T>
absl::Status QKNormBackward(T* dqkv, float* dwq, float* dbq, float* dwk, float* dbk, const T* raw, const float* wq,
                            const float* wk, const float* mean, const float* rstd, const AttentionShape& s,
                            double* scratch, const CudaContext& ctx);
int64_t QKNormBackwardScratch(const AttentionShape& s);

// With wq = wk = null the weights are ones (Megatron's --qk-l2-norm: megatron-core's L2Norm, RMSNorm's arithmetic with
// unit weights; mean, bq, bk null), and the backward, given null dwq and dwk, adds no parameter gradients (scratch
// may then be null).

// ---- output_gate_cuda.cu -----------------------------------------------------------------------
// Megatron's --attention-output-gate, as cpu::SplitGatedQkv / MergeGatedQkv / OutputGateForward /
// OutputGateBackward: the fused product's rows (per query group: its query heads, their gate heads, its key and
// value heads; b * t rows of s.qkv_width() + s.nh * s.hd) split into qkv (b, t, s.qkv_width()) and gate
// (b, t, s.nh * s.hd), or merged back (the gradients); out = attn * sigmoid(gate) elementwise (n elements), and its
// backward: dgate assigned, dattn (in: the output's gradient) becomes attn's, in place. Sigmoid in fp32.
template <typename T>
absl::Status SplitGatedQkv(T* qkv, T* gate, const T* fused, const AttentionShape& s, const CudaContext& ctx);
template <typename T>
absl::Status MergeGatedQkv(T* fused, const T* qkv, const T* gate, const AttentionShape& s, const CudaContext& ctx);
template <typename T>
absl::Status OutputGateForward(T* out, const T* attn, const T* gate, int64_t n, const CudaContext& ctx);
template <typename T>
absl::Status OutputGateBackward(T* dattn, T* dgate, const T* attn, const T* gate, int64_t n, const CudaContext& ctx);

// ---- rope_cuda.cu ------------------------------------------------------------------------------
// Rotary embedding in place on a fused QKV (b, t, s.qkv_width()) of query groups, as cpu::RopeForward:
// the query and key heads' channels i and i + rd/2 (2i and 2i + 1 `interleaved`) rotated by the fp32
// tables cos/sin (t, rd/2) of cpu::RopeTables (device memory); RopeBackward applies the inverse
// rotation to dqkv.
template <typename T>
absl::Status RopeForward(T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd,
                         bool interleaved, const CudaContext& ctx);
template <typename T>
absl::Status RopeBackward(T* dqkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd,
                          bool interleaved, const CudaContext& ctx);

// ---- swiglu_cuda.cu ----------------------------------------------------------------------------
// out(n, f) = silu(gate) * up over fc1's rows [gate (f); up (f)], SiluValue of trainer/op_math.h in
// fp32; the backward assigns dinp(n, 2f).
template <typename T>
absl::Status SwigluForward(T* out, const T* inp, int64_t n, int64_t f, const CudaContext& ctx);
template <typename T>
absl::Status SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t n, int64_t f, const CudaContext& ctx);

// ---- qkv_layout_cuda.cu ------------------------------------------------------------------------
// A fused QKV (b, t, s.qkv_width()) from Megatron's order (per query group: its query heads, then its
// key and value heads) to heads first (the nh query heads, then the groups' key heads, then their
// value heads: one head stride each, as cuDNN's fused attention reads grouped-query attention), and
// back. Copies (out and the input differ).
template <typename T>
absl::Status QkvGroupsToHeads(T* out, const T* qkv, const AttentionShape& s, const CudaContext& ctx);
template <typename T>
absl::Status QkvHeadsToGroups(T* out, const T* heads, const AttentionShape& s, const CudaContext& ctx);

// ---- dropout_cuda.cu ---------------------------------------------------------------------------
// The CPU's counter-hash dropout (trainer/counter_rng.h): row r of `rows` rows of `row_len`
// elements uses stream streams[r] (device memory); element i of a row is kept when
// DropoutKeep(seed, streams[r], i, DropoutKeepThreshold(p)), and kept elements are scaled by
// 1/(1-p). The same masks as cpu::Dropout over each row. In place; forward and backward alike.
// index0 > 0: each row is the part of a longer row from element index0 on (a sequence-parallel
// rank's positions of its samples), tested at index0 + i.
template <typename T>
absl::Status DropoutRows(T* inout, int64_t rows, int64_t row_len, const uint64_t* streams, double p, uint64_t seed,
                         const CudaContext& ctx, int64_t index0 = 0);

// ---- attention_cuda.cu -------------------------------------------------------------------------
// Causal self-attention over Megatron's fused QKV layout qkv(b, t, s.qkv_width()): per query group
// (s.groups() of them; one per head without grouped-query attention, qkv(b, t, nh, 3, hd)) its
// nh / groups query heads, then its key and value heads; out(b, t, nh*hd).
// fp32 mode (T = float): batched cuBLAS products and a causal softmax kernel, probs(b, nh, t, t)
// saved for backward; a group's key and value gradients summed over its query heads in head order
// (cpu::AttentionBackward's order); attention dropout with probability p keys stream streams[batch] + head
// (device memory, may be null when p is 0) exactly as cpu::AttentionForward.
absl::Status AttentionForward(float* out, float* probs, const float* qkv, const AttentionShape& s, double p,
                              uint64_t seed, const uint64_t* streams, const CudaContext& ctx);
// dqkv(b, t, 3c) is assigned. scratch: AttentionBackwardScratch(s) floats.
absl::Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                               const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                               float* scratch, const CudaContext& ctx);
int64_t AttentionBackwardScratch(const AttentionShape& s);
// ---- attention_rows_cuda.cu --------------------------------------------------------------------
// cpu::AttentionRowsForward / AttentionRowsBackward in fp32: tq query rows of each sample, q_rows(b, tq,
// s.qkv_width()) with row i at position qpos[i] (device int64) of the whole sample, over whole samples
// kv(b, s.t, s.qkv_width()) (their key and value columns); out(b, tq, nh*hd), probs(b, nh, tq, s.t) kept
// before dropout; row i's causal mask and attention-dropout keys are those of row qpos[i] of AttentionForward.
absl::Status AttentionRowsForward(float* out, float* probs, const float* q_rows, const float* kv, const int64_t* qpos,
                                  int64_t tq, const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                                  const CudaContext& ctx);
// dq_rows' query columns and dkv's key and value columns (every position) are assigned, the rest untouched.
// scratch: AttentionRowsBackwardScratch(s, tq) floats.
absl::Status AttentionRowsBackward(float* dq_rows, float* dkv, const float* dout, const float* q_rows, const float* kv,
                                   const float* probs, const int64_t* qpos, int64_t tq, const AttentionShape& s,
                                   double p, uint64_t seed, const uint64_t* streams, float* scratch,
                                   const CudaContext& ctx);
int64_t AttentionRowsBackwardScratch(const AttentionShape& s, int64_t tq);

// ---- context_parallel_cuda.cu ------------------------------------------------------------------
// Context parallelism's attention on one rank of `context` (the CPU model's ContextAttentionForward /
// Backward without the collectives, which are the caller's). `local` is this rank's shape (local.t of
// each sample's positions); positions(context, local.t) (device int64) holds every rank's
// ContextParallelPositions, rank by rank. gathered: the group's QKV rows all-gathered, context pieces
// of (b, local.t, w) in rank order. whole: (b, context * local.t, w) scratch.
struct ContextAttentionArgs {
  int context = 1, rank = 0;
  const int64_t* positions = nullptr;
};
// out(b, local.t, nh*hd) and probs(b, nh, local.t, context * local.t) of this rank's rows (qkv).
absl::Status ContextAttentionForward(float* out, float* probs, const float* qkv, const float* gathered, float* whole,
                                     const ContextAttentionArgs& cp, const AttentionShape& local, double p,
                                     uint64_t seed, const uint64_t* streams, const CudaContext& ctx);
// dqkv(b, local.t, w): this rank's query gradients (key and value columns zero); shares: context pieces
// of (b, local.t, w) in rank order, this rank's share of each rank's key and value gradients (query
// columns zero), for the exchange. dwhole: scratch as whole; gathered and shares may be one buffer.
// scratch: AttentionRowsBackwardScratch of the whole samples' shape.
absl::Status ContextAttentionBackward(float* dqkv, float* shares, const float* dout, const float* qkv,
                                      const float* gathered, float* whole, float* dwhole, const float* probs,
                                      const ContextAttentionArgs& cp, const AttentionShape& local, double p,
                                      uint64_t seed, const uint64_t* streams, float* scratch, const CudaContext& ctx);
// dqkv(piece) += the ranks' shares of this rank's rows summed in rank order, ((s_0 + s_1) + ...): received
// holds context pieces, rank q's share in piece q, except this rank's own, read from `own` (one piece).
absl::Status AddContextShares(float* dqkv, const float* received, const float* own, const ContextAttentionArgs& cp,
                              int64_t piece, const CudaContext& ctx);

// ---- flash_attention_cuda.cpp ------------------------------------------------------------------
// bf16 / fp16 (T = __nv_bfloat16 or __half): cuDNN's fused flash attention (graph API through
// cudnn-frontend), never a t x t matrix in memory. stats(b, nh, t): fp32 softmax statistics kept
// for backward. Attention dropout, when p > 0, is cuDNN's own (Philox keyed by seed and offset):
// the only mask that differs from the CPU backend's. It depends on a sample's place in the batch,
// so the model calls these one sample at a time (s.b = 1) with the sample's own seed.
// With grouped-query attention (s.groups() < s.nh) qkv and dqkv are heads first (QkvGroupsToHeads:
// Megatron's per-group order has no single head stride for cuDNN), cuDNN's SDPA over nh query heads
// and groups key/value heads; without it, Megatron's layout itself (strided views, no copy).
// The cuDNN handle of a context (ctx->cudnn), on its stream; created by a bf16/fp16 model (flash_graph_cache.cpp:
// destroying it drops the graphs built with it).
absl::Status CreateCudnnHandle(CudaContext* ctx);
void DestroyCudnnHandle(CudaContext* ctx);
// Bytes of ctx.workspace the forward and backward graphs of this shape ask for (the larger; cuDNN's
// backward keeps an fp32 dQ accumulator of b*nh*t*hd floats, or with ctx.deterministic a b*nh*t*t
// bf16/fp16 dP). Builds and caches both graphs; needs the cuDNN handle. A workspace smaller than
// this makes the ops look for a plan that fits, and fail with ResourceExhausted when none does.
template <typename T>
absl::StatusOr<int64_t> FlashAttentionWorkspaceBytes(const AttentionShape& s, double p, const CudaContext& ctx);
template <typename T>
absl::Status FlashAttentionForward(T* out, float* stats, const T* qkv, const AttentionShape& s, double p, uint64_t seed,
                                   uint64_t offset, const CudaContext& ctx);
template <typename T>
absl::Status FlashAttentionBackward(T* dqkv, const T* dout, const T* out, const float* stats, const T* qkv,
                                    const AttentionShape& s, double p, uint64_t seed, uint64_t offset,
                                    const CudaContext& ctx);

// ---- softmax_xent_cuda.cu ----------------------------------------------------------------------
// losses(n) = logsumexp(logits(n, vp)) - logits[target], in fp32 over every column (padded ones
// included), as cpu::SoftmaxCrossEntropyForward.
template <typename T>
absl::Status SoftmaxCrossEntropyForward(float* losses, const T* logits, const int32_t* targets, int64_t n, int64_t vp,
                                        const CudaContext& ctx);
// Both at once (training): losses(n) as the forward, logits overwritten with
// (softmax - onehot) * dlosses[i]. Rows are independent, so the caller may run it on chunks of rows.
template <typename T>
absl::Status SoftmaxCrossEntropyFused(T* logits, float* losses, const int32_t* targets, const float* dlosses, int64_t n,
                                      int64_t vp, const CudaContext& ctx);

// ---- tensor_parallel_cuda.cu -------------------------------------------------------------------
// The twins of trainer/cpu/tensor_parallel_cpu.h's ops; the tensor group's collectives between them
// are the caller's. out(n, c) (fp32) = wte[tokens[i] - v0] for tokens in [v0, v0 + rows), zeros for
// the others (summed over the group, the whole embedding's row).
template <typename T>
absl::Status VocabSliceEmbeddingForward(float* out, const int32_t* tokens, const T* wte, int64_t v0, int64_t rows,
                                        int64_t n, int64_t c, const CudaContext& ctx);
// out(n, c) = round_T(sum + bias[j] + wpe[positions[i]]) (bias, wpe: either may be null; out may
// alias sum when T is float): the finish of a row-parallel product or of the embedding.
template <typename T>
absl::Status TensorSumFinish(T* out, const float* sum, const T* bias, const int32_t* positions, const T* wpe, int64_t n,
                             int64_t c, const CudaContext& ctx);
// The vocabulary-parallel cross-entropy of a (rows, vt) slice whose columns start at v0, in three
// passes around two collectives, as cpu::VocabParallelCrossEntropy: (1) each row's maximum into
// maxima[row] and its target's logit into target[row] (0 when another rank holds it); the caller
// all-gathers the maxima of the ranks into (ranks, rows) and (2) the group's maximum goes to
// global_max, the slice's sum of exp(logit - max) to sums; the caller all-reduces sums and target;
// (3) losses = log(sum) + max - target, and with dlosses the slice is overwritten with its
// gradient (softmax - onehot) * dlosses[row].
template <typename T>
absl::Status VocabParallelXentLocal(float* maxima, float* target, const T* logits, const int32_t* targets, int64_t rows,
                                    int64_t vt, int64_t v0, const CudaContext& ctx);
template <typename T>
absl::Status VocabParallelXentSums(float* global_max, float* sums, const float* maxima, int ranks, const T* logits,
                                   int64_t rows, int64_t vt, const CudaContext& ctx);
template <typename T>
absl::Status VocabParallelXentFinish(T* logits, float* losses, const float* global_max, const float* sums,
                                     const float* target, const int32_t* targets, const float* dlosses, int64_t rows,
                                     int64_t vt, int64_t v0, const CudaContext& ctx);

// ---- adamw_cuda.cu -----------------------------------------------------------------------------
// AdamW over n fp32 elements (AdamWElement of trainer/op_math.h); when p_compute is not null it
// receives the updated weights rounded to T (the compute copy of bf16/fp16 modes).
template <typename T>
absl::Status AdamW(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& a, T* p_compute,
                   const CudaContext& ctx);
// One launch over a table of pieces (adamw_table.h: table_size chunks in device memory): chunk k
// updates parameters [offset, offset + size) of the flat layout with the gradient scaled by
// grad_scale first (g * grad_scale in fp32: Scale's bits, then AdamW's), with the settings of the
// chunk's group (AdamWChunk::group into groups.group). The fp32 master of flat index i is master[i - master_shift], the
// moments m[i - moment_shift] and v[i - moment_shift], the gradient g[i], the compute copy (may be null) p_compute[i].
// The same bits as Scale then AdamW piece by piece.
struct AdamWChunk;
template <typename T>
absl::Status AdamWMulti(const AdamWChunk* table, int64_t table_size, float* master, int64_t master_shift,
                        const float* g, float* m, float* v, int64_t moment_shift, T* p_compute, float grad_scale,
                        const AdamWGroups& groups, const CudaContext& ctx);
// Sum of squares in double over fixed blocks, written to *out (device memory). partials:
// SumSquaresPartials(n) doubles of device scratch.
absl::Status SumSquares(double* out, const float* x, int64_t n, double* partials, const CudaContext& ctx);
int64_t SumSquaresPartials(int64_t n);
// x *= s
absl::Status Scale(float* x, int64_t n, float s, const CudaContext& ctx);

// ---- cast_cuda.cu ------------------------------------------------------------------------------
// out = round-to-nearest-even(in) and back; residual add out = a + b (out may alias a or b).
template <typename T>
absl::Status CastFromFloat(T* out, const float* in, int64_t n, const CudaContext& ctx);
template <typename T>
absl::Status CastToFloat(float* out, const T* in, int64_t n, const CudaContext& ctx);
template <typename T>
absl::Status ResidualAdd(T* out, const T* a, const T* b, int64_t n, const CudaContext& ctx);
// Whether any element of x(n) is NaN or Inf, as 0/1 in *flag (device int).
absl::Status NonFiniteFlag(int* flag, const float* x, int64_t n, const CudaContext& ctx);

}  // namespace ptk::cuda
