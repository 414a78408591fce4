// The CUDA model's pass: forward, the LM head and loss in chunks of rows (backward:
// cuda_gpt_model_backward.cpp).
//
// Megatron's GPT on one GPU: the CPU model's pass (trainer/cpu/cpu_gpt_model_pass.cpp) over the CUDA ops,
// with the residual adds (and the hidden dropout in front of them) fused into the LayerNorms, the
// GELU into fc1's epilogue, and the loss over the vocabulary computed in chunks of rows (the LM
// head's backward runs chunk by chunk right after its loss, so no (tokens x vocabulary) matrix is
// ever kept). The Llama line as the CPU model has it: RMSNorm (the residual add fused in; its
// hidden dropout a pass of its own), RoPE in place on the QKV product's output, SwiGLU after fc1,
// grouped-query attention, absent biases and position table skipped, an untied output layer.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

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
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                                             uint64_t seed) {
  const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  PTK_RETURN_IF_ERROR(Prepare(batch, loss_scale, dropout));
  Begin();
  moe_aux_sum_ = moe_z_sum_ = 0;
  PTK_RETURN_IF_ERROR(RunForward(train, seed));
  PTK_RETURN_IF_ERROR(RunHead(/*backward=*/true, nullptr));
  PTK_RETURN_IF_ERROR(RunBackward(train, seed));
  PTK_ASSIGN_OR_RETURN(LossSum losses, Losses(batch));
  losses.load_balancing_loss = std::exchange(moe_aux_sum_, 0.0);  // the MoE layers' (cuda_moe_model.cpp)
  losses.z_loss = std::exchange(moe_z_sum_, 0.0);
  return losses;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train,
                                                          uint64_t seed) {
  const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  PTK_RETURN_IF_ERROR(Prepare(batch, loss_scale, dropout));
  Begin();
  PTK_RETURN_IF_ERROR(RunForward(train, seed));
  PTK_RETURN_IF_ERROR(RunHead(/*backward=*/true, nullptr));
  PTK_RETURN_IF_ERROR(RunBackward(train, seed));
  return KeepLosses(batch);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::KeepLosses(const ModelBatch& batch) {
  const size_t k = pending_losses_, n = static_cast<size_t>(n_);
  if (loss_slots_.size() <= k) loss_slots_.push_back(std::make_unique<Pinned>());
  if (pending_masks_.size() <= k) pending_masks_.resize(k + 1);
  PTK_RETURN_IF_ERROR(loss_slots_[k]->Reserve(n * sizeof(float)));  // slot k holds no pending copy
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(loss_slots_[k]->template at<float>(0), Buf<float>(plan_.losses),
                                           n * sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream),
                           "copying the losses to the host");
  PTK_RETURN_IF_ERROR(Op("copies", "loss copy", absl::OkStatus()));
  pending_masks_[k].assign(batch.loss_mask, batch.loss_mask + n);
  pending_losses_ = k + 1;
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::TakeLosses() {
  const size_t k = pending_losses_;
  pending_losses_ = 0;
  // Those GPTModel kept (a pipeline stage's host exchange: summed as they came), then the pending copies.
  PTK_ASSIGN_OR_RETURN(LossSum total, GPTModel::TakeLosses());
  total.load_balancing_loss += std::exchange(moe_aux_sum_, 0.0);  // the pending passes' MoE layers'
  total.z_loss += std::exchange(moe_z_sum_, 0.0);
  if (k == 0) return total;
  PTK_RETURN_IF_ERROR(Sync(fmt::format("the passes over {} micro-batches of {}x{}", k, b_, t_)));
  for (size_t i = 0; i < k; ++i) {
    const LossSum s = SumLosses(loss_slots_[i]->template at<float>(0), pending_masks_[i]);
    total.loss_sum += s.loss_sum;
    total.tokens += s.tokens;
  }
  return total;
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::Forward(const ModelBatch& batch, std::vector<float>* logits) {
  PTK_RETURN_IF_ERROR(Prepare(batch, 0.0, /*dropout=*/false));
  PTK_RETURN_IF_ERROR(RunForward(/*train=*/false, 0));
  PTK_RETURN_IF_ERROR(RunHead(/*backward=*/false, logits));
  return Losses(batch);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Dropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed) {
  if (p <= 0.0) return absl::OkStatus();
  if (cp()) return ContextDropout(x, 0, t_, layer, site, p, seed);  // keyed by the rows' true positions
  return DropoutRows<T>(x, b_, t_ * config().hidden_size, Streams(layer, site), p, seed, ctx_);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::NormForward(const char* name, T* resid_out, T* out, float* stats, const T* a,
                                              const T* b, int64_t w, int64_t bias, const LnDropout& drop) {
  const int64_t n = n_, c = config().hidden_size;
  const double eps = config().layernorm_epsilon;
  if (Rms()) {
    if (!b) return Op("rmsnorm", name, RMSNormForward<T>(out, stats + n, a, LnW(w), n, c, eps, ctx_));
    return Op("rmsnorm", name, ResidualRMSNormForward<T>(resid_out, out, stats + n, a, b, LnW(w), n, c, eps, ctx_));
  }
  if (!b)
    return Op("layernorm", name, LayerNormForward<T>(out, stats, stats + n, a, LnW(w), Ln(bias), n, c, eps, ctx_));
  return Op(
      "layernorm", name,
      ResidualLayerNormForward<T>(resid_out, out, stats, stats + n, a, b, LnW(w), Ln(bias), n, c, eps, ctx_, drop));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::Fc1Forward(int64_t l) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  const int64_t n = n_, c = cf.hidden_size, f = cf.ffn_hidden_size / tensor_size();
  const T* ln2 = Act(plan_.ln2, l, n * c);
  // cuBLASLt has no squared-ReLU epilogue, and its GELU epilogues are the tanh one: the product, then
  // the activation's kernel.
  if (cf.squared_relu || cf.gelu_exact) {
    T* fc1 = MlpAct(plan_.fc1, l, n * f);
    PTK_RETURN_IF_ERROR(
        Op("matmul", "fc1", MatmulForward<T>(fc1, ln2, Compute(lp.fc1_w), Compute(lp.fc1_b), n, c, f, ctx_)));
    T* act = MlpAct(plan_.gelu, l, n * f);
    if (cf.gelu_exact) return Op("gelu_exact", "exact gelu", GeluExactForward<T>(act, fc1, n * f, ctx_));
    return Op("squared_relu", "squared relu", SquaredReluForward<T>(act, fc1, n * f, ctx_));
  }
  if (!cf.swiglu)
    return Op("matmul", "fc1+gelu",
              MatmulForward<T>(MlpAct(plan_.fc1, l, n * f), ln2, Compute(lp.fc1_w), Compute(lp.fc1_b), n, c, f, ctx_,
                               MlpAct(plan_.gelu, l, n * f)));
  // SwiGLU: fc1 gives this rank's [gate; up] (2f columns), the activation takes silu(gate) * up.
  T* fc1 = MlpAct(plan_.fc1, l, n * 2 * f);
  PTK_RETURN_IF_ERROR(
      Op("matmul", "fc1", MatmulForward<T>(fc1, ln2, Compute(lp.fc1_w), Compute(lp.fc1_b), n, c, 2 * f, ctx_)));
  return Op("swiglu", "swiglu", SwigluForward<T>(MlpAct(plan_.gelu, l, n * f), fc1, n, f, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::RunForward(bool train, uint64_t seed) {
  PTK_RETURN_IF_ERROR(RefreshNormWeights());  // --apply-layernorm-1p: the weights of this step's parameters
  if (sequence_parallel_) return RunForwardSequenceParallel(train, seed);  // cuda_sequence_parallel.cpp
  const GPTConfig& cf = config();
  const ParamLayout& pl = layout();
  // This rank's slices under tensor parallelism (everything at one tensor rank): its query heads and
  // groups (shape), the attention width ct.
  const AttentionShape shape = Shape();
  // L: the stage's layers (the embedding's dropout streams are the table's layer L); the selected
  // model chunk runs the layers [l0, l1) of them (all without chunks).
  const int64_t n = n_, c = cf.hidden_size, ct = OutWidth(shape), L = StageLayers(), l0 = chunk_layer_begin(),
                l1 = chunk_layer_end();
  const bool pre = chunk_pre_process(), post = chunk_post_process();
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  T* tmp = Buf<T>(plan_.tmp);
  const bool tp = tensor_size() > 1;
  // Row-parallel products: the partial products summed over the tensor group, then the bias once.
  auto row_parallel = [&](const char* name, const T* inp, int64_t w, int64_t bias, int64_t k) -> absl::Status {
    if (!tp) return Op("matmul", name, MatmulForward<T>(tmp, inp, Compute(w), Compute(bias), n, k, c, ctx_));
    PTK_RETURN_IF_ERROR(
        Op("matmul", name, MatmulForward<T>(tmp, inp, Compute(w), static_cast<const T*>(nullptr), n, k, c, ctx_)));
    return TensorSum(tmp, n, c, Compute(bias), nullptr, nullptr);
  };
  // Hidden dropout inside the LayerNorm kernels (FusedDropout), else as its own pass.
  const bool fuse = FuseDropout(hp);

  layer_ = -1;
  // A later pipeline stage (or model chunk) starts from the previous one's output, already in resid[l0].
  if (pre && !tp) {
    PTK_RETURN_IF_ERROR(Op("embedding", "embedding",
                           EmbeddingForward<T>(Act(plan_.resid, l0, n * c), Tokens(), Positions(), Compute(pl.wte),
                                               Compute(pl.wpe), n, c, ctx_)));
  } else if (pre) {  // vocabulary-parallel: each rank its rows, zeros elsewhere, summed; then the positions
    const int64_t vt = cf.padded_vocab_size / tensor_size();
    PTK_RETURN_IF_ERROR(Op("embedding", "vocabulary-slice embedding",
                           VocabSliceEmbeddingForward<T>(Buf<float>(plan_.tp_sum), Tokens(), Compute(pl.wte),
                                                         tensor_rank() * vt, vt, n, c, ctx_)));
    PTK_RETURN_IF_ERROR(TensorSum(Act(plan_.resid, l0, n * c), n, c, nullptr, Positions(), Compute(pl.wpe),
                                  /*summed_in_fp32=*/true));
  }
  const LayerParams& first = pl.layers[static_cast<size_t>(l0)];
  if (fuse && pre) {
    PTK_RETURN_IF_ERROR(Op(
        "layernorm", "embedding dropout+ln1",
        DropoutLayerNormForward<T>(Act(plan_.resid, l0, n * c), Act(plan_.ln1, l0, n * c), Stats(plan_.ln1_stats, l0),
                                   Stats(plan_.ln1_stats, l0) + n, LnW(first.ln1_w), Ln(first.ln1_b), n, c,
                                   cf.layernorm_epsilon, FusedDropout(L, kEmbeddingDropout, hp, seed), ctx_)));
  } else {
    if (pre)
      PTK_RETURN_IF_ERROR(
          Op("dropout", "embedding dropout", Dropout(Act(plan_.resid, l0, n * c), L, kEmbeddingDropout, hp, seed)));
    PTK_RETURN_IF_ERROR(NormForward("ln1", nullptr, Act(plan_.ln1, l0, n * c), Stats(plan_.ln1_stats, l0),
                                    Act(plan_.resid, l0, n * c), nullptr, first.ln1_w, first.ln1_b, {}));
  }
  for (int64_t l = l0; l < l1; ++l) {
    layer_ = l;
    const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
    T* atty = Act(plan_.atty, l, n * ct);
    PTK_RETURN_IF_ERROR(SelfAttentionForward(l, ap, seed));
    PTK_RETURN_IF_ERROR(row_parallel("proj", atty, lp.proj_w, lp.proj_b, ct));
    // resid_mid[l] = resid[l] + dropout(tmp): the attention output's dropout, in the kernel when fused.
    if (!fuse)
      PTK_RETURN_IF_ERROR(Op("dropout", "attention-out dropout", Dropout(tmp, l, kAttentionOutDropout, hp, seed)));
    PTK_RETURN_IF_ERROR(NormForward(fuse ? "dropout+residual+ln2" : "residual+ln2", Act(plan_.resid_mid, l, n * c),
                                    Act(plan_.ln2, l, n * c), Stats(plan_.ln2_stats, l), Act(plan_.resid, l, n * c),
                                    tmp, lp.ln2_w, lp.ln2_b, FusedDropout(l, kAttentionOutDropout, hp, seed)));
    if (cf.moe_layer(l)) {  // cuda_moe_model.cpp: the router and experts into tmp
      PTK_RETURN_IF_ERROR(MoeMlpForward(l, train));
    } else {
      PTK_RETURN_IF_ERROR(Fc1Forward(l));
      PTK_RETURN_IF_ERROR(row_parallel("fc2", MlpAct(plan_.gelu, l, n * (cf.ffn_hidden_size / tensor_size())), lp.fc2_w,
                                       lp.fc2_b, cf.ffn_hidden_size / tensor_size()));
    }
    if (!fuse) PTK_RETURN_IF_ERROR(Op("dropout", "mlp-out dropout", Dropout(tmp, l, kMlpOutDropout, hp, seed)));
    // resid[l+1] = resid_mid[l] + dropout(tmp), then the next norm (the next layer's or the final one).
    const bool last = l + 1 == l1;
    // The next norm's weights; a stage (or chunk) before the last has no final norm: the fused
    // kernel still writes the residual (the next stage's input, the same bits as on one stage) and
    // its norm, taken with the chunk's first ln1 weights, lands in the unused lnf buffers.
    const LayerParams* next = last ? (post ? nullptr : &first) : &pl.layers[static_cast<size_t>(l + 1)];
    PTK_RETURN_IF_ERROR(NormForward(fuse ? "dropout+residual+ln" : "residual+ln", Act(plan_.resid, l + 1, n * c),
                                    last ? Buf<T>(plan_.lnf) : Act(plan_.ln1, l + 1, n * c),
                                    last ? Buf<float>(plan_.lnf_stats) : Stats(plan_.ln1_stats, l + 1),
                                    Act(plan_.resid_mid, l, n * c), tmp, next ? next->ln1_w : pl.lnf_w,
                                    next ? next->ln1_b : pl.lnf_b, FusedDropout(l, kMlpOutDropout, hp, seed)));
  }
  layer_ = -1;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SelfAttentionForward(int64_t l, double ap, uint64_t seed) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  const AttentionShape shape = Shape();  // this tensor rank's heads and groups
  const int64_t n = n_, c = cf.hidden_size, qw = shape.qkv_width(), ct = OutWidth(shape);
  if (cf.mla()) {  // multi-latent attention: its own projections and rotary embedding (cuda_mla_layer.cpp)
    PTK_RETURN_IF_ERROR(MlaQkvForward(l));
    return Op("attention", "attention",
              AttentionFwd(Act(plan_.atty, l, n * ct), Act(plan_.qkv, l, n * qw), l, LayerShape(l, false), ap, seed));
  }
  const bool gated = cf.attention_output_gate, normed = cf.qk_layernorm || cf.qk_l2_norm;
  T* qkv = Act(plan_.qkv, l, n * qw);
  // --qk-layernorm / --qk-l2-norm: the product lands in qkv_raw (what the norms' backward reads), normalised into
  // qkv. --attention-output-gate: the product's rows carry the gate's heads too (qkv_fused), split off into gate[l].
  T* product = normed ? Act(plan_.qkv_raw, l, n * qw) : qkv;
  T* gate = gated ? Act(plan_.gate, l, n * ct) : nullptr;
  PTK_RETURN_IF_ERROR(Op("matmul", gated ? "qkv+gate" : "qkv",
                         MatmulForward<T>(gated ? Buf<T>(plan_.qkv_fused) : product, Act(plan_.ln1, l, n * c),
                                          Compute(lp.qkv_w), Compute(lp.qkv_b), n, c, qw + (gated ? ct : 0), ctx_)));
  if (gated)
    PTK_RETURN_IF_ERROR(
        Op("output_gate", "gate split", SplitGatedQkv<T>(product, gate, Buf<T>(plan_.qkv_fused), shape, ctx_)));
  if (cf.qk_layernorm)
    PTK_RETURN_IF_ERROR(Op(Rms() ? "rmsnorm" : "layernorm", "q/k norms",
                           QKNormForward<T>(qkv, QKMean(l), QKRstd(l), product, LnW(lp.q_norm_w), Ln(lp.q_norm_b),
                                            LnW(lp.k_norm_w), Ln(lp.k_norm_b), shape, cf.layernorm_epsilon, ctx_)));
  if (cf.qk_l2_norm)  // megatron-core's L2Norm: RMSNorm's arithmetic with unit weights (null), as the CPU model
    PTK_RETURN_IF_ERROR(Op("rmsnorm", "q/k l2 norms",
                           QKNormForward<T>(qkv, nullptr, QKRstd(l), product, nullptr, nullptr, nullptr, nullptr, shape,
                                            cf.layernorm_epsilon, ctx_)));
  if (cf.rope())  // the query and key heads rotated in place: what attention reads and backward keeps
    PTK_RETURN_IF_ERROR(
        Op("rope", "rope",
           RopeForward<T>(qkv, RopeCos(), RopeSin(), shape, cf.rotary_dim(), cf.rotary_interleaved, ctx_)));
  T* atty = Act(plan_.atty, l, n * ct);
  // The core attention's shape: the layer's sliding window and softmax offset (LayerShape).
  PTK_RETURN_IF_ERROR(Op(
      "attention", "attention",
      AttentionFwd(gated ? Act(plan_.att_pre, l, n * ct) : atty, qkv, l, LayerShape(l, /*backward=*/false), ap, seed)));
  if (!gated) return absl::OkStatus();
  // atty = att_pre * sigmoid(gate): proj's input.
  return Op("output_gate", "output gate",
            OutputGateForward<T>(atty, Act(plan_.att_pre, l, n * ct), gate, n * ct, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::AttentionFwd(T* atty, const T* qkv, int64_t l, const AttentionShape& shape, double ap,
                                               uint64_t seed) {
  if (cp()) {  // cuda_context_parallel.cpp: bf16/fp16's cuDNN pairs (ContextFlash), else the fp32 rows attention
    float* probs = Buf<float>(plan_.attn_saved) + ContextSavedOffset(l, shape);
    return ContextAttnFwd(atty, probs, qkv, shape, ap, seed, ap > 0 ? Streams(l, kAttentionProbs) : nullptr);
  }
  if constexpr (kFlash) {
    const int64_t nh = shape.nh, c = OutWidth(shape), qw = shape.qkv_width();  // this rank's heads
    // Grouped-query attention: cuDNN reads the QKV heads first (a copy; the layer keeps Megatron's order).
    if (shape.groups() != nh) {
      T* heads = Buf<T>(plan_.qkv_heads);
      PTK_RETURN_IF_ERROR(QkvGroupsToHeads<T>(heads, qkv, shape, ctx_));
      qkv = heads;
    }
    // The layer's statistics (each sample's 16-byte aligned: FlashStatsStride).
    const int64_t per_sample = FlashStatsStride(nh, t_);
    float* stats = Buf<float>(plan_.attn_saved) + SlotLayer(l) * b_ * per_sample;
    if (ap <= 0) return FlashAttentionForward<T>(atty, stats, qkv, shape, 0.0, 0, 0, ctx_);
    // Dropout: one sample per call, its own key (Prepare).
    AttentionShape one = shape;  // the layer's window too
    one.b = 1;
    for (int64_t r = 0; r < b_; ++r)
      PTK_RETURN_IF_ERROR(FlashAttentionForward<T>(atty + r * t_ * c, stats + r * per_sample, qkv + r * t_ * qw, one,
                                                   ap, seed ^ flash_keys_[static_cast<size_t>(l * b_ + r)], 0, ctx_));
    return absl::OkStatus();
  } else {
    float* probs = Buf<float>(plan_.attn_saved) +
                   (config().recompute_activations ? 0 : SlotLayer(l)) * b_ * shape.nh * t_ * KeyPositions();
    const uint64_t* streams = ap > 0 ? Streams(l, kAttentionProbs) : nullptr;
    return AttentionForward(atty, probs, qkv, shape, ap, seed, streams, ctx_);
  }
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::RunHead(bool backward, std::vector<float>* logits_out) {
  const GPTConfig& cf = config();
  // vp: this rank's columns of the padded vocabulary under tensor parallelism (column-parallel
  // output layer; no rank holds whole logits), all of them at one tensor rank.
  const int64_t n = n_, c = cf.hidden_size, vp = cf.padded_vocab_size / tensor_size(), out_w = layout().out_w;
  const bool tp = tensor_size() > 1;
  if (!chunk_post_process())
    return absl::FailedPreconditionError(
        "the LM head runs on the last pipeline stage only (its last model chunk; StageForward)");
  T* logits = Buf<T>(plan_.logits);
  const T* lnf = Buf<T>(plan_.lnf);
  float* losses = Buf<float>(plan_.losses);
  if (logits_out) logits_out->assign(static_cast<size_t>(n * vp * tensor_size()), 0.0f);
  std::vector<T> chunk_host;
  layer_ = -1;
  // Balanced chunks of whole tiles (one when the plan had room for every row): each chunk's
  // output-weight gradient is accumulated once, by its dW product.
  int64_t next_row = 0;
  for (const int64_t rows : LogitChunks(n, plan_.logit_chunk_rows)) {
    const int64_t r0 = next_row;
    next_row += rows;
    head_row0_ = r0;
    head_rows_ = rows;
    PTK_RETURN_IF_ERROR(
        Op("matmul", "lm head",
           MatmulForward<T>(logits, lnf + r0 * c, Compute(out_w), static_cast<const T*>(nullptr), rows, c, vp, ctx_)));
    if (backward) {
      if (tp)
        PTK_RETURN_IF_ERROR(VocabParallelLoss(logits, losses + r0, Labels() + r0, LossWeights() + r0, rows));
      else
        PTK_RETURN_IF_ERROR(
            Op("loss", "loss+dlogits",
               SoftmaxCrossEntropyFused<T>(logits, losses + r0, Labels() + r0, LossWeights() + r0, rows, vp, ctx_)));
      PTK_RETURN_IF_ERROR(Op("matmul", "lm head backward",
                             MatmulBackward<T>(Buf<T>(plan_.dln) + r0 * c, Grad(out_w), nullptr, logits, lnf + r0 * c,
                                               Compute(out_w), rows, c, vp, ctx_)));
      continue;
    }
    if (logits_out) {
      chunk_host.resize(static_cast<size_t>(rows * vp));
      PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chunk_host.data(), logits, chunk_host.size() * sizeof(T),
                                               cudaMemcpyDeviceToHost, ctx_.stream),
                               "copying logits to the host");
      PTK_RETURN_IF_ERROR(Sync("copying logits"));
      if (!tp) {
        float* dst = logits_out->data() + r0 * vp;
        for (size_t i = 0; i < chunk_host.size(); ++i) dst[i] = ToFloat(chunk_host[i]);
      } else {  // the whole rows from every rank's slice (text samples), as the CPU model gathers them
        const int Tn = tensor_size();
        std::vector<float> all(static_cast<size_t>(Tn * rows * vp));
        float* mine = all.data() + tensor_rank() * rows * vp;
        for (size_t i = 0; i < chunk_host.size(); ++i) mine[i] = ToFloat(chunk_host[i]);
        const std::vector<int64_t> bytes(static_cast<size_t>(Tn), rows * vp * static_cast<int64_t>(sizeof(float)));
        PTK_RETURN_IF_ERROR(tensor_comm()->AllGather(all.data(), bytes));
        for (int r = 0; r < Tn; ++r)
          for (int64_t i = 0; i < rows; ++i)
            std::copy(all.begin() + (r * rows + i) * vp, all.begin() + (r * rows + i + 1) * vp,
                      logits_out->begin() + (r0 + i) * vp * Tn + r * vp);
      }
    }
    // After the copy: the vocabulary-parallel loss overwrites nothing, the plain one reads only.
    if (tp)
      PTK_RETURN_IF_ERROR(VocabParallelLoss(logits, losses + r0, Labels() + r0, nullptr, rows));
    else
      PTK_RETURN_IF_ERROR(
          Op("loss", "loss", SoftmaxCrossEntropyForward<T>(losses + r0, logits, Labels() + r0, rows, vp, ctx_)));
  }
  // Column-parallel output layer: its input gradient summed over the tensor group.
  // (Sequence parallelism reduce-scatters it instead: RunBackwardSequenceParallel.)
  if (backward && tp && !sequence_parallel_)
    PTK_RETURN_IF_ERROR(TensorSum(Buf<T>(plan_.dln), n, c, nullptr, nullptr, nullptr));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::TensorSum(T* x, int64_t rows, int64_t c, const T* bias, const int32_t* positions,
                                            const T* wpe, bool summed_in_fp32) {
  float* sum = Buf<float>(plan_.tp_sum);
  if (!summed_in_fp32) {
    if constexpr (std::is_same_v<T, float>)
      sum = x;  // fp32: in place
    else
      PTK_RETURN_IF_ERROR(Op("tensor parallel", "to fp32 for the sum", CastToFloat<T>(sum, x, rows * c, ctx_)));
  }
  PTK_RETURN_IF_ERROR(Op("tensor parallel", "all-reduce over the tensor group",
                         tensor_comm()->AllReduceSumDevice(sum, rows * c, ctx_.stream)));
  if (static_cast<void*>(sum) == static_cast<void*>(x) && !bias && !wpe) return absl::OkStatus();
  return Op("tensor parallel", "sum finish", TensorSumFinish<T>(x, sum, bias, positions, wpe, rows, c, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::VocabParallelLoss(T* logits, float* losses, const int32_t* labels,
                                                    const float* dlosses, int64_t rows) {
  const int Tn = tensor_size();
  const int64_t vt = config().padded_vocab_size / Tn, v0 = tensor_rank() * vt;
  // tp_xent: maxima (ranks, rows), then the group's maxima, the sums and the target logits (rows
  // each; the last two adjacent: one all-reduce).
  float* maxima = Buf<float>(plan_.tp_xent);
  float* global = maxima + Tn * rows;
  float* sums = global + rows;
  float* target = sums + rows;
  PTK_RETURN_IF_ERROR(
      Op("loss", "vocab-parallel loss: maxima",
         VocabParallelXentLocal<T>(maxima + tensor_rank() * rows, target, logits, labels, rows, vt, v0, ctx_)));
  const std::vector<int64_t> bytes(static_cast<size_t>(Tn), rows * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(Op("tensor parallel", "all-gather of the row maxima",
                         tensor_comm()->AllGatherDevice(maxima, bytes, ctx_.stream)));
  PTK_RETURN_IF_ERROR(Op("loss", "vocab-parallel loss: sums",
                         VocabParallelXentSums<T>(global, sums, maxima, Tn, logits, rows, vt, ctx_)));
  PTK_RETURN_IF_ERROR(Op("tensor parallel", "all-reduce of the sums and target logits",
                         tensor_comm()->AllReduceSumDevice(sums, 2 * rows, ctx_.stream)));
  return Op("loss", dlosses ? "vocab-parallel loss+dlogits" : "vocab-parallel loss",
            VocabParallelXentFinish<T>(logits, losses, global, sums, target, labels, dlosses, rows, vt, v0, ctx_));
}

template <typename T>
absl::StatusOr<LossSum> CudaGPTModelImpl<T>::Losses(const ModelBatch& batch) {
  const size_t n = static_cast<size_t>(n_);
  float* host = losses_.at<float>(0);
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, Buf<float>(plan_.losses), n * sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream),
      "copying the losses to the host");
  PTK_RETURN_IF_ERROR(Op("copies", "loss copy", absl::OkStatus()));
  PTK_RETURN_IF_ERROR(Sync(fmt::format("the pass over a {}x{} micro-batch", b_, t_)));
  return SumLosses(host, std::span<const float>(batch.loss_mask, n));
}

template <typename T>
LossSum CudaGPTModelImpl<T>::SumLosses(const float* host, std::span<const float> mask) {
  LossSum s;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] == 0.0f) continue;
    s.loss_sum += static_cast<double>(host[i]) * mask[i];
    s.tokens += mask[i];
  }
  return s;
}

#define PTK_INSTANTIATE(T)                                                                                            \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::ForwardBackward(const ModelBatch& batch, double loss_scale,   \
                                                                        bool train, uint64_t seed);                   \
  template absl::Status CudaGPTModelImpl<T>::ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale,      \
                                                                     bool train, uint64_t seed);                      \
  template absl::Status CudaGPTModelImpl<T>::KeepLosses(const ModelBatch& batch);                                     \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::TakeLosses();                                                 \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::Forward(const ModelBatch& batch, std::vector<float>* logits); \
  template absl::Status CudaGPTModelImpl<T>::Dropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed);     \
  template absl::Status CudaGPTModelImpl<T>::NormForward(const char* name, T* resid_out, T* out, float* stats,        \
                                                         const T* a, const T* b, int64_t w, int64_t bias,             \
                                                         const LnDropout& drop);                                      \
  template absl::Status CudaGPTModelImpl<T>::Fc1Forward(int64_t l);                                                   \
  template absl::Status CudaGPTModelImpl<T>::RunForward(bool train, uint64_t seed);                                   \
  template absl::Status CudaGPTModelImpl<T>::AttentionFwd(T* atty, const T* qkv, int64_t l,                           \
                                                          const AttentionShape& shape, double ap, uint64_t seed);     \
  template absl::Status CudaGPTModelImpl<T>::SelfAttentionForward(int64_t l, double ap, uint64_t seed);               \
  template absl::Status CudaGPTModelImpl<T>::RunHead(bool backward, std::vector<float>* logits_out);                  \
  template absl::Status CudaGPTModelImpl<T>::TensorSum(T* x, int64_t rows, int64_t c, const T* bias,                  \
                                                       const int32_t* positions, const T* wpe, bool summed_in_fp32);  \
  template absl::Status CudaGPTModelImpl<T>::VocabParallelLoss(T* logits, float* losses, const int32_t* labels,       \
                                                               const float* dlosses, int64_t rows);                   \
  template absl::StatusOr<LossSum> CudaGPTModelImpl<T>::Losses(const ModelBatch& batch);                              \
  template LossSum CudaGPTModelImpl<T>::SumLosses(const float* host, std::span<const float> mask);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
