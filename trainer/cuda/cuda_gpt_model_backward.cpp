// The CUDA model's backward pass: from the final norm's output gradient (the LM head's, left by
// RunHead in dln) down to the embeddings, the CPU model's RunBackward over the CUDA ops.
#include <cuda_runtime.h>

#include <type_traits>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/layernorm_oracle.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::model_detail {

template <typename T>
absl::Status CudaGPTModelImpl<T>::MlpBackward(int64_t l, const T* dmlp, bool fc2_bias) {
  const GPTConfig& cf = config();
  if (cf.moe_layer(l)) return MoeMlpBackward(l, dmlp);  // cuda_moe_model.cpp
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  const int64_t n = n_, c = cf.hidden_size, f = cf.ffn_hidden_size / tensor_size();
  T *dln = Buf<T>(plan_.dln), *dff = Buf<T>(plan_.dff);
  float* dfc2_b = fc2_bias ? Grad(lp.fc2_b) : nullptr;
  if (cf.swiglu) {
    // fc2's input gradient (SwiGLU's output gradient), then SwiGLU's backward into fc1's output
    // gradient [dgate; dup] (2f columns).
    T* dact = Buf<T>(plan_.dact);
    PTK_RETURN_IF_ERROR(Op("matmul", "fc2 backward",
                           MatmulBackward<T>(dact, Grad(lp.fc2_w), dfc2_b, dmlp, MlpAct(plan_.gelu, l, n * f),
                                             Compute(lp.fc2_w), n, f, c, ctx_)));
    PTK_RETURN_IF_ERROR(
        Op("swiglu", "swiglu backward", SwigluBackward<T>(dff, MlpAct(plan_.fc1, l, n * 2 * f), dact, n, f, ctx_)));
    return Op("matmul", "fc1 backward",
              MatmulBackward<T>(dln, Grad(lp.fc1_w), Grad(lp.fc1_b), dff, Act(plan_.ln2, l, n * c), Compute(lp.fc1_w),
                                n, c, 2 * f, ctx_));
  }
  if (cf.squared_relu || cf.gelu_exact) {  // fc2's input gradient, then the activation's backward in place
    PTK_RETURN_IF_ERROR(Op("matmul", "fc2 backward",
                           MatmulBackward<T>(dff, Grad(lp.fc2_w), dfc2_b, dmlp, MlpAct(plan_.gelu, l, n * f),
                                             Compute(lp.fc2_w), n, f, c, ctx_)));
    const T* fc1 = MlpAct(plan_.fc1, l, n * f);
    PTK_RETURN_IF_ERROR(
        cf.gelu_exact
            ? Op("gelu_exact", "exact gelu backward", GeluExactBackward<T>(dff, fc1, dff, n * f, ctx_))
            : Op("squared_relu", "squared relu backward", SquaredReluBackward<T>(dff, fc1, dff, n * f, ctx_)));
    return Op("matmul", "fc1 backward",
              MatmulBackward<T>(dln, Grad(lp.fc1_w), Grad(lp.fc1_b), dff, Act(plan_.ln2, l, n * c), Compute(lp.fc1_w),
                                n, c, f, ctx_));
  }
  PTK_RETURN_IF_ERROR(
      Op("matmul", "fc2 backward",
         MatmulBackward<T>(dff, Grad(lp.fc2_w), dfc2_b, dmlp, MlpAct(plan_.gelu, l, n * f), Compute(lp.fc2_w), n, f, c,
                           ctx_, false, unfused_.gelu_backward ? nullptr : MlpAct(plan_.fc1, l, n * f))));
  if (unfused_.gelu_backward)
    PTK_RETURN_IF_ERROR(
        Op("gelu", "gelu backward", GeluBackward<T>(dff, MlpAct(plan_.fc1, l, n * f), dff, n * f, ctx_)));
  return Op("matmul", "fc1 backward",
            MatmulBackward<T>(dln, Grad(lp.fc1_w), Grad(lp.fc1_b), dff, Act(plan_.ln2, l, n * c), Compute(lp.fc1_w), n,
                              c, f, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AttentionBranchBackward(int64_t l, const T* dproj, double ap, uint64_t seed,
                                                          bool proj_bias) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  const AttentionShape shape = Shape();
  const int64_t n = n_, c = cf.hidden_size, ct = OutWidth(shape), qw = shape.qkv_width();
  T *dln = Buf<T>(plan_.dln), *dqkv = Buf<T>(plan_.dqkv), *datt = Buf<T>(plan_.datt);
  PTK_RETURN_IF_ERROR(Op("matmul", "proj backward",
                         MatmulBackward<T>(datt, Grad(lp.proj_w), proj_bias ? Grad(lp.proj_b) : nullptr, dproj,
                                           Act(plan_.atty, l, n * ct), Compute(lp.proj_w), n, ct, c, ctx_)));
  // --attention-output-gate: datt (the gated output's gradient) becomes the core attention's, the gate's in dgate.
  const bool gated = cf.attention_output_gate;
  if (gated)
    PTK_RETURN_IF_ERROR(Op("output_gate", "output gate backward",
                           OutputGateBackward<T>(datt, Buf<T>(plan_.dgate), Act(plan_.att_pre, l, n * ct),
                                                 Act(plan_.gate, l, n * ct), n * ct, ctx_)));
  PTK_RETURN_IF_ERROR(
      Op("attention", "attention backward", AttentionBwd(dqkv, datt, l, LayerShape(l, /*backward=*/true), ap, seed)));
  if (cf.mla()) return MlaQkvBackward(l, dqkv);           // MLA's rotary embedding is in its projections' backward
  PTK_RETURN_IF_ERROR(QkvInputBackward(dqkv, l, shape));  // the gradient of the QKV product's output
  T* dproduct = dqkv;  // with the gate: the QKV and gate gradients merged into the fused product's rows
  if (gated) {
    dproduct = Buf<T>(plan_.qkv_fused);
    PTK_RETURN_IF_ERROR(
        Op("output_gate", "gate merge", MergeGatedQkv<T>(dproduct, dqkv, Buf<T>(plan_.dgate), shape, ctx_)));
  }
  return Op("matmul", gated ? "qkv+gate backward" : "qkv backward",
            MatmulBackward<T>(dln, Grad(lp.qkv_w), Grad(lp.qkv_b), dproduct, Act(plan_.ln1, l, n * c),
                              Compute(lp.qkv_w), n, c, qw + (gated ? ct : 0), ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::RunBackward(bool train, uint64_t seed) {
  if (sequence_parallel_) return RunBackwardSequenceParallel(train, seed);  // cuda_sequence_parallel.cpp
  const GPTConfig& cf = config();
  const ParamLayout& pl = layout();
  // L: the stage's layers (the embedding's dropout streams); the selected chunk's are [l0, l1).
  const int64_t n = n_, c = cf.hidden_size, L = StageLayers(), l0 = chunk_layer_begin(), l1 = chunk_layer_end();
  const bool pre = chunk_pre_process(), post = chunk_post_process();
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  const bool tp = tensor_size() > 1;
  // Under tensor parallelism the norms, the position embeddings and the row-parallel biases are
  // whole on every tensor rank and their gradients come out the same on every one without a
  // reduction (as the CPU model's): each is computed from the residual stream's gradient, which
  // every rank holds with the same bits (the column-parallel products' input gradients are summed
  // over the group by NCCL, whose all-reduce leaves the same bits on every rank).
  const size_t act_bytes = static_cast<size_t>(n * c) * sizeof(T);
  T *dresid = Buf<T>(plan_.dresid), *dtmp = Buf<T>(plan_.dtmp), *dln = Buf<T>(plan_.dln);
  float* scratch = Buf<float>(plan_.ln_scratch);
  // Fused hidden dropout: each LayerNorm's backward also writes the masked gradient of the branch
  // below it into dtmp (the embedding's into dresid itself), where the branch's backward reads it.
  const bool fuse = FuseDropout(hp);
  T* dbranch = fuse ? dtmp : nullptr;

  layer_ = -1;
  // A stage before the last starts from the next stage's gradient, already in dresid (StageBackward).
  if (post) {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dresid, 0, act_bytes, ctx_.stream), "zeroing the residual gradient");
    PTK_RETURN_IF_ERROR(Op(Rms() ? "rmsnorm" : "layernorm", "final norm backward",
                           LnBackward(dresid, Grad(pl.lnf_w), Grad(pl.lnf_b), dln, Act(plan_.resid, l1, n * c),
                                      LnW(pl.lnf_w), Buf<float>(plan_.lnf_stats), Buf<float>(plan_.lnf_stats) + n, n, c,
                                      scratch, ctx_, dbranch, FusedDropout(l1 - 1, kMlpOutDropout, hp, seed))));
  }
  GradsReady(0);  // the final norm (and an untied output layer): --overlap-grad-reduce's buckets
  for (int64_t l = l1 - 1; l >= l0; --l) {
    layer_ = l;
    const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
    // MLP: resid[l+1] = resid_mid + dropout(fc2(act(fc1(ln2(resid_mid)))))
    const T* dmlp = dtmp;  // fused: the masked gradient the LayerNorm above left (none above a stage's output)
    if (!fuse || (l + 1 == l1 && !post)) {
      PTK_ASSIGN_OR_RETURN(dmlp, BranchGrad(dresid, dtmp, act_bytes, l, kMlpOutDropout, hp, seed));
    }
    PTK_RETURN_IF_ERROR(MlpBackward(l, dmlp));
    if (tp) PTK_RETURN_IF_ERROR(TensorSum(dln, n, c, nullptr, nullptr, nullptr));  // column-parallel fc1
    PTK_RETURN_IF_ERROR(Op(Rms() ? "rmsnorm" : "layernorm", "ln2 backward",
                           LnBackward(dresid, Grad(lp.ln2_w), Grad(lp.ln2_b), dln, Act(plan_.resid_mid, l, n * c),
                                      LnW(lp.ln2_w), Stats(plan_.ln2_stats, l), Stats(plan_.ln2_stats, l) + n, n, c,
                                      scratch, ctx_, dbranch, FusedDropout(l, kAttentionOutDropout, hp, seed))));
    // Attention: resid_mid = resid[l] + dropout(proj(attention(rope(qkv(ln1(resid[l]))))))
    const T* dproj = dtmp;
    if (!fuse) {
      PTK_ASSIGN_OR_RETURN(dproj, BranchGrad(dresid, dtmp, act_bytes, l, kAttentionOutDropout, hp, seed));
    }
    PTK_RETURN_IF_ERROR(AttentionBranchBackward(l, dproj, ap, seed));
    if (tp) PTK_RETURN_IF_ERROR(TensorSum(dln, n, c, nullptr, nullptr, nullptr));  // column-parallel QKV
    PTK_RETURN_IF_ERROR(Op(Rms() ? "rmsnorm" : "layernorm", "ln1 backward",
                           LnBackward(dresid, Grad(lp.ln1_w), Grad(lp.ln1_b), dln, Act(plan_.resid, l, n * c),
                                      LnW(lp.ln1_w), Stats(plan_.ln1_stats, l), Stats(plan_.ln1_stats, l) + n, n, c,
                                      scratch, ctx_, l > l0 ? dbranch : (fuse && pre ? dresid : nullptr),
                                      l > l0 ? FusedDropout(l - 1, kMlpOutDropout, hp, seed)
                                      : pre  ? FusedDropout(L, kEmbeddingDropout, hp, seed)
                                             : LnDropout{})));
    GradsReady(static_cast<size_t>(L - l));  // layer l
  }
  layer_ = -1;
  // A later stage leaves its input's gradient in dresid, for the previous stage.
  if (!pre) {
    GradsReady(static_cast<size_t>(L) + 1);  // the embeddings (none here)
    return absl::OkStatus();
  }
  if (!fuse)
    PTK_RETURN_IF_ERROR(Op("dropout", "embedding dropout backward", Dropout(dresid, L, kEmbeddingDropout, hp, seed)));
  PTK_RETURN_IF_ERROR(
      Op("embedding", "embedding backward",
         EmbeddingBackward<T>(Grad(pl.wte), Grad(pl.wpe), dresid, Tokens(), Positions(), tokens_host_, positions_host_,
                              n, c, cf.padded_vocab_size / tensor_size(), cf.max_position_embeddings, &embedding_plan_,
                              ctx_, tp ? tensor_rank() * (cf.padded_vocab_size / tensor_size()) : -1)));
  GradsReady(static_cast<size_t>(L) + 1);  // the embeddings
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<const T*> CudaGPTModelImpl<T>::BranchGrad(const T* dresid, T* dtmp, size_t bytes, int64_t l,
                                                         int64_t site, double p, uint64_t seed) {
  if (p <= 0.0 && !unfused_.residual_grad_copy) return dresid;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dtmp, dresid, bytes, cudaMemcpyDeviceToDevice, ctx_.stream),
                           "copying the residual gradient");
  PTK_RETURN_IF_ERROR(Op("copies", "residual gradient copy", absl::OkStatus()));
  PTK_RETURN_IF_ERROR(Op("dropout",
                         site == kMlpOutDropout ? "mlp-out dropout backward" : "attention-out dropout backward",
                         Dropout(dtmp, l, site, p, seed)));
  return dtmp;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::LnBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                                             const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                                             const CudaContext& ctx, T* dbranch, const LnDropout& drop) {
  if (Rms()) {
    if (dbranch != nullptr || drop.p > 0)
      return absl::InternalError("RMSNorm's backward takes no fused dropout (FuseDropout is false under RMSNorm)");
    // The scratch is planned for the larger of LayerNorm's floats and RMSNorm's doubles (Plan).
    return RMSNormBackward<T>(dinp, dw, dout, inp, w, rstd, n, c, reinterpret_cast<double*>(scratch), ctx);
  }
  if (unfused_.layernorm_rows_in_series)
    return LayerNormBackwardRowsInSeries<T>(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx, dbranch, drop);
  return LayerNormBackward<T>(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx, dbranch, drop);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AttentionBwd(T* dqkv, const T* datt, int64_t l, const AttentionShape& shape,
                                               double ap, uint64_t seed) {
  const int64_t n = n_, c = OutWidth(shape), qw = shape.qkv_width();  // this rank's heads
  const T* qkv = Act(plan_.qkv, l, n * qw);
  const bool recompute = config().recompute_activations;
  // The core attention's output (before --attention-output-gate's gate).
  const int out_index = config().attention_output_gate ? plan_.att_pre : plan_.atty;
  if (cp()) {  // cuda_context_parallel.cpp: bf16/fp16's cuDNN pairs (ContextFlash), else the fp32 rows attention
    float* probs = Buf<float>(plan_.attn_saved) + ContextSavedOffset(l, shape);
    const uint64_t* streams = ap > 0 ? Streams(l, kAttentionProbs) : nullptr;
    // The rows path's probabilities again; fp32's output lands in a scratch buffer, bf16/fp16's fp32 one is
    // dropped. ContextFlash keeps every layer's output and log-sum-exps (as cuDNN's statistics on one GPU).
    if (recompute && !ContextFlash())
      PTK_RETURN_IF_ERROR(ContextAttnFwd(kFlash ? nullptr : Buf<T>(plan_.tmp), probs, qkv, shape, ap, seed, streams));
    return ContextAttnBwd(dqkv, datt, Act(out_index, l, n * c), qkv, probs, shape, ap, seed, streams);
  }
  if constexpr (kFlash) {
    const int64_t nh = shape.nh;
    // Grouped-query attention: cuDNN reads the QKV and writes its gradient heads first; the
    // gradient goes back to Megatron's order after.
    const bool grouped = shape.groups() != nh;
    T* dq = dqkv;
    if (grouped) {
      T* heads = Buf<T>(plan_.qkv_heads);
      PTK_RETURN_IF_ERROR(QkvGroupsToHeads<T>(heads, qkv, shape, ctx_));
      qkv = heads;
      dq = Buf<T>(plan_.dqkv_heads);
    }
    const T* out = Act(out_index, l, n * c);
    const int64_t per_sample = FlashStatsStride(nh, t_);  // as AttentionFwd keeps them
    const float* stats = Buf<float>(plan_.attn_saved) + SlotLayer(l) * b_ * per_sample;
    if (ap <= 0) {
      PTK_RETURN_IF_ERROR(FlashAttentionBackward<T>(dq, datt, out, stats, qkv, shape, 0.0, 0, 0, ctx_));
    } else {
      // Dropout: one sample per call with the forward's key, so the same mask.
      AttentionShape one = shape;  // the layer's window too
      one.b = 1;
      for (int64_t r = 0; r < b_; ++r) {
        const int64_t row = r * t_;
        PTK_RETURN_IF_ERROR(FlashAttentionBackward<T>(dq + row * qw, datt + row * c, out + row * c,
                                                      stats + r * per_sample, qkv + row * qw, one, ap,
                                                      seed ^ flash_keys_[static_cast<size_t>(l * b_ + r)], 0, ctx_));
      }
    }
    if (grouped) PTK_RETURN_IF_ERROR(QkvHeadsToGroups<T>(dqkv, dq, shape, ctx_));
    return absl::OkStatus();
  } else {
    float* probs = Buf<float>(plan_.attn_saved) + (recompute ? 0 : SlotLayer(l)) * b_ * shape.nh * t_ * KeyPositions();
    const uint64_t* streams = ap > 0 ? Streams(l, kAttentionProbs) : nullptr;
    if (recompute) {  // the probabilities again; the output lands in a scratch buffer
      AttentionShape forward = shape;
      forward.dsink = nullptr;
      PTK_RETURN_IF_ERROR(AttentionForward(Buf<float>(plan_.tmp), probs, qkv, forward, ap, seed, streams, ctx_));
    }
    return AttentionBackward(dqkv, datt, qkv, probs, shape, ap, seed, streams, Buf<float>(plan_.attn_scratch), ctx_);
  }
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::QkvInputBackward(T* dqkv, int64_t l, const AttentionShape& shape) {
  const GPTConfig& cf = config();
  if (cf.rope())  // the rotation's transpose
    PTK_RETURN_IF_ERROR(
        Op("rope", "rope backward",
           RopeBackward<T>(dqkv, RopeCos(), RopeSin(), shape, cf.rotary_dim(), cf.rotary_interleaved, ctx_)));
  if (cf.qk_l2_norm)  // no weights: the raw product's gradient only
    return Op("rmsnorm", "q/k l2 norms backward",
              QKNormBackward<T>(dqkv, nullptr, nullptr, nullptr, nullptr, Act(plan_.qkv_raw, l, n_ * shape.qkv_width()),
                                nullptr, nullptr, nullptr, QKRstd(l), shape, nullptr, ctx_));
  if (!cf.qk_layernorm) return absl::OkStatus();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  return Op(Rms() ? "rmsnorm" : "layernorm", "q/k norms backward",
            QKNormBackward<T>(dqkv, Grad(lp.q_norm_w), Grad(lp.q_norm_b), Grad(lp.k_norm_w), Grad(lp.k_norm_b),
                              Act(plan_.qkv_raw, l, n_ * shape.qkv_width()), LnW(lp.q_norm_w), LnW(lp.k_norm_w),
                              QKMean(l), QKRstd(l), shape, Buf<double>(plan_.qk_scratch), ctx_));
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status CudaGPTModelImpl<T>::MlpBackward(int64_t l, const T* dmlp, bool fc2_bias);                     \
  template absl::Status CudaGPTModelImpl<T>::AttentionBranchBackward(int64_t l, const T* dproj, double ap,             \
                                                                     uint64_t seed, bool proj_bias);                   \
  template absl::Status CudaGPTModelImpl<T>::RunBackward(bool train, uint64_t seed);                                   \
  template absl::StatusOr<const T*> CudaGPTModelImpl<T>::BranchGrad(const T* dresid, T* dtmp, size_t bytes, int64_t l, \
                                                                    int64_t site, double p, uint64_t seed);            \
  template absl::Status CudaGPTModelImpl<T>::LnBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp,    \
                                                        const float* w, const float* mean, const float* rstd,          \
                                                        int64_t n, int64_t c, float* scratch, const CudaContext& ctx,  \
                                                        T* dbranch, const LnDropout& drop);                            \
  template absl::Status CudaGPTModelImpl<T>::AttentionBwd(T* dqkv, const T* datt, int64_t l,                           \
                                                          const AttentionShape& shape, double ap, uint64_t seed);      \
  template absl::Status CudaGPTModelImpl<T>::QkvInputBackward(T* dqkv, int64_t l, const AttentionShape& shape);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
