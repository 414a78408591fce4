// Megatron's GPT on the CPU, its passes: the forward pass over the layers to the logits, the loss, the backward pass,
// one micro-batch's forward and backward (CpuGPTModel, cpu_gpt_model.h; sequence parallelism's in
// sequence_parallel_cpu.cpp).
#include "trainer/cpu/cpu_gpt_model.h"

#include <algorithm>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cpu/tensor_parallel_cpu.h"

namespace ptk {

namespace {
// Dropout of a (b, t, c) buffer, each sample row with its own stream; under context parallelism
// (`positions`: each row's place in its sample) each element keyed by its place in the whole sample.
void DropoutRows(float* x, const ModelBatch& batch, int64_t c, double p, uint64_t seed, uint64_t layer, uint64_t site,
                 const std::vector<int64_t>& positions) {
  if (p <= 0.0) return;
  for (int64_t b = 0; b < batch.b; ++b) {
    const uint64_t stream = DropoutStream(static_cast<uint64_t>(batch.sample_keys[b]), layer, site);
    if (positions.empty()) {
      cpu::Dropout(x + b * batch.t * c, batch.t * c, p, seed, stream);
      continue;
    }
    const uint32_t threshold = DropoutKeepThreshold(p);
    const uint64_t key = DropoutKey(seed, stream);
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    for (int64_t i = 0; i < batch.t; ++i) {
      float* row = x + (b * batch.t + i) * c;
      const uint64_t base = static_cast<uint64_t>(positions[static_cast<size_t>(i)] * c);
      for (int64_t j = 0; j < c; ++j)
        row[j] = DropoutKeepKeyed(key, base + static_cast<uint64_t>(j), threshold) ? row[j] * scale : 0.0f;
    }
  }
}

// Head h's mask is stream streams[b] + h: a tensor rank whose first head is `head0` starts there, so
// every head keeps its mask (the global head index) at any tensor size.
void AttentionStreams(const ModelBatch& batch, int64_t layer, int64_t head0, std::vector<uint64_t>* streams) {
  for (int64_t b = 0; b < batch.b; ++b)
    (*streams)[b] = DropoutStream(static_cast<uint64_t>(batch.sample_keys[b]), layer, kAttentionProbs) +
                    static_cast<uint64_t>(head0);
}

// What one forward or backward pass over `batch` works with: tokens n, hidden c, this rank's
// slices of the attention's width ct (its query heads x head dimension), the ffn f and the padded vocab vp (all of them
// at one tensor rank), the dropout rates (zero when not training), this rank's attention heads, the layer count.
struct PassDims {
  int64_t n, c, ct, f, vp;
  double hp, ap;
  AttentionShape shape;
  uint64_t layers;
};
PassDims DimsOf(const ParamLayout& layout, const ModelBatch& batch, bool train) {
  const GPTConfig& cf = layout.config;
  const int64_t T = layout.tensor_size;
  return {batch.b * batch.t,
          cf.hidden_size,
          cf.attention_width() / T,
          cf.ffn_hidden_size / T,
          cf.padded_vocab_size / T,
          train ? cf.hidden_dropout : 0.0,
          train ? cf.attention_dropout : 0.0,
          cf.mla() ? MlaAttentionShape(cf, batch.b, batch.t, T)
                   : AttentionShape{batch.b, batch.t, cf.num_attention_heads / T, cf.head_dim(), cf.query_groups() / T},
          static_cast<uint64_t>(cf.num_layers)};
}
// A row-parallel product's bias, added once after the sum over the tensor group.
void AddBias(float* x, const float* bias, int64_t n, int64_t c) {
  if (!bias) return;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) x[i * c + j] += bias[j];
}
}  // namespace
using cpu_model_detail::At;
using cpu_model_detail::AttentionOut;
using cpu_model_detail::MlpActivationBackward;
using cpu_model_detail::MlpActivationForward;
using cpu_model_detail::NormBackward;
using cpu_model_detail::NormForward;
using cpu_model_detail::OutputGateLayerBackward;
using cpu_model_detail::OutputGateLayerForward;
using cpu_model_detail::QKNormLayerBackward;
using cpu_model_detail::QKNormLayerForward;
using cpu_model_detail::QkvGateSplit;
using cpu_model_detail::QkvMatmulGrad;
using cpu_model_detail::QkvMatmulOut;
using cpu_model_detail::QkvMatmulWidth;

absl::Status CpuGPTModel::RunForward(const ModelBatch& batch, bool train, uint64_t seed) {
  if (sequence_parallel_) return RunForwardSequenceParallel(batch, train, seed);
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const auto [n, c, ct, f, vp, hp, ap, shape, L] = DimsOf(layout_, batch, train);
  const float* P = params_.data();
  const bool tp = this->tp();
  const int64_t head0 = tensor_rank() * shape.nh;
  // Row-parallel products: the partial products summed over the tensor group, then the bias once.
  // One tensor rank keeps the unsplit product with its bias (the same bits as before).
  auto row_parallel = [&](float* out, const float* inp, int64_t w, int64_t bias, int64_t ic) -> absl::Status {
    if (!tp) {
      cpu::MatmulForward(out, inp, P + w, At(P, bias), n, ic, c);
      return absl::OkStatus();
    }
    cpu::MatmulForward(out, inp, P + w, static_cast<const float*>(nullptr), n, ic, c);
    PTK_RETURN_IF_ERROR(TensorSum(out, n * c));
    AddBias(out, At(P, bias), n, c);
    return absl::OkStatus();
  };

  // A later (virtual) pipeline stage starts from the previous one's output, already in resid[l0].
  if (chunk_pre_process() && !mtp_pass_) {
    if (!tp) {
      cpu::EmbeddingForward(a.resid[0].data(), batch.tokens, batch.position_ids, P + layout_.wte, At(P, layout_.wpe), n,
                            c);
    } else {  // vocabulary-parallel: each rank its rows, zeros elsewhere, summed; then the positions
      float* x = a.resid[0].data();
      cpu::VocabSliceEmbeddingForward(x, batch.tokens, P + layout_.wte, tensor_rank() * vp, vp, n, c);
      PTK_RETURN_IF_ERROR(TensorSum(x, n * c));
      for (int64_t i = 0; i < n && layout_.wpe >= 0; ++i) {
        const float* pos = P + layout_.wpe + static_cast<int64_t>(batch.position_ids[i]) * c;
        for (int64_t j = 0; j < c; ++j) x[i * c + j] += pos[j];
      }
    }
    DropoutRows(a.resid[0].data(), batch, c, hp, seed, L, kEmbeddingDropout, context_positions_);
  }
  // This chunk's layers [l0, Ls) of the stage's (all of them without model chunks).
  const int64_t l0 = chunk_layer_begin(), Ls = chunk_layer_end();
  for (int64_t l = l0; l < Ls; ++l) {
    const LayerParams& lp = layout_.layers[l];
    const int64_t gl = GlobalLayer(l);  // the layer's index in the whole model (dropout keys)
    NormForward(cf, a.ln1[l].data(), a.ln1_mean[l].data(), a.ln1_rstd[l].data(), a.resid[l].data(), P, lp.ln1_w,
                lp.ln1_b, n, c);
    if (cf.mla()) {  // multi-latent attention: its own projections and rotary embedding
      MlaQkvForward(l, lp, a.ln1[l].data());
    } else {
      cpu::MatmulForward(QkvMatmulOut(a, l, cf), a.ln1[l].data(), P + lp.qkv_w, At(P, lp.qkv_b), n, c,
                         QkvMatmulWidth(cf, shape));
      QkvGateSplit(cf, a, l, shape);
      QKNormLayerForward(cf, a, l, P, lp, shape);
      if (cf.rope())
        cpu::RopeForward(a.qkv[l].data(), a.rope_cos.data(), a.rope_sin.data(), shape, cf.rotary_dim(),
                         cf.rotary_interleaved);
    }
    if (ap > 0.0) AttentionStreams(batch, gl, head0, &a.streams);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    const AttentionShape core = CoreAttentionShape(shape, l, lp, false);
    if (cp())
      PTK_RETURN_IF_ERROR(ContextAttentionForward(AttentionOut(a, l, cf), probs, a.qkv[l].data(), core, ap, seed));
    else
      cpu::AttentionForward(AttentionOut(a, l, cf), probs, a.qkv[l].data(), core, ap, seed, a.streams.data());
    OutputGateLayerForward(cf, a, l, n, ct);
    PTK_RETURN_IF_ERROR(row_parallel(a.tmp.data(), a.atty[l].data(), lp.proj_w, lp.proj_b, ct));
    DropoutRows(a.tmp.data(), batch, c, hp, seed, gl, kAttentionOutDropout, context_positions_);
    for (int64_t i = 0; i < n * c; ++i) a.resid_mid[l][i] = a.resid[l][i] + a.tmp[i];
    NormForward(cf, a.ln2[l].data(), a.ln2_mean[l].data(), a.ln2_rstd[l].data(), a.resid_mid[l].data(), P, lp.ln2_w,
                lp.ln2_b, n, c);
    if (lp.router_w >= 0) {  // a mixture-of-experts layer
      PTK_RETURN_IF_ERROR(MoeMlpForward(l, lp, a.ln2[l].data(), n, train));
    } else {
      cpu::MatmulForward(a.fc1[l].data(), a.ln2[l].data(), P + lp.fc1_w, At(P, lp.fc1_b), n, c,
                         (cf.swiglu ? 2 : 1) * f);
      MlpActivationForward(cf, a.gelu[l].data(), a.fc1[l].data(), n, f);
      PTK_RETURN_IF_ERROR(row_parallel(a.tmp.data(), a.gelu[l].data(), lp.fc2_w, lp.fc2_b, f));
    }
    DropoutRows(a.tmp.data(), batch, c, hp, seed, gl, kMlpOutDropout, context_positions_);
    for (int64_t i = 0; i < n * c; ++i) a.resid[l + 1][i] = a.resid_mid[l][i] + a.tmp[i];
  }
  if (!chunk_post_process()) return absl::OkStatus();  // resid[Ls] goes to the next stage
  NormForward(cf, a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), a.resid[Ls].data(), P, layout_.lnf_w,
              layout_.lnf_b, n, c);
  // This rank's vocabulary columns of the logits (column-parallel output layer).
  cpu::MatmulForward(a.logits.data(), a.lnf.data(), P + layout_.out_w, static_cast<const float*>(nullptr), n, c, vp);
  return absl::OkStatus();
}

AttentionShape CpuGPTModel::CoreAttentionShape(const AttentionShape& shape, int64_t l, const LayerParams& lp,
                                               bool backward) {
  const GPTConfig& cf = config();
  AttentionShape core = shape;
  // A depth's pass (multi-token prediction, one stage) runs the layer Megatron numbers after the decoder's.
  if (cf.window_layer(mtp_pass_ ? moe_layer_offset_ : GlobalLayer(l))) core.window = cf.window_left;
  if (lp.softmax_offset >= 0) {
    core.sink = params_.data() + lp.softmax_offset;
    if (backward) core.dsink = grads_.data() + lp.softmax_offset;
  } else if (cf.softmax_sink()) {
    zero_sink_.assign(static_cast<size_t>(shape.nh), 0.0f);
    core.sink = zero_sink_.data();
  }
  return core;
}

absl::Status CpuGPTModel::LayerAttentionBackward(int64_t l, const LayerParams& lp, const AttentionShape& shape,
                                                 double ap, uint64_t seed) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
  const AttentionShape fwd = CoreAttentionShape(shape, l, lp, false), core = CoreAttentionShape(shape, l, lp, true);
  if (cf.recompute_activations && cp())  // recompute the probabilities; the output lands in a scratch buffer
    PTK_RETURN_IF_ERROR(ContextAttentionForward(a.tmp.data(), probs, a.qkv[l].data(), fwd, ap, seed));
  else if (cf.recompute_activations)
    cpu::AttentionForward(a.tmp.data(), probs, a.qkv[l].data(), fwd, ap, seed, a.streams.data());
  if (cp())
    PTK_RETURN_IF_ERROR(ContextAttentionBackward(a.dqkv.data(), a.datt.data(), a.qkv[l].data(), probs, core, ap, seed));
  else
    cpu::AttentionBackward(a.dqkv.data(), a.datt.data(), a.qkv[l].data(), probs, core, ap, seed, a.streams.data());
  if (cf.mla()) return absl::OkStatus();  // MLA's rotary embedding is in its projections' backward
  if (cf.rope())
    cpu::RopeBackward(a.dqkv.data(), a.rope_cos.data(), a.rope_sin.data(), shape, cf.rotary_dim(),
                      cf.rotary_interleaved);
  QKNormLayerBackward(cf, a, l, params_.data(), grads_.data(), lp, shape);
  return absl::OkStatus();
}

// Under tensor parallelism the LayerNorms, the position embeddings and the row-parallel biases are
// held whole by every tensor rank, and their gradients come out the same on every one without a
// reduction: each is computed from the residual stream's gradient and activations, which every
// rank holds with the same bits (the column-parallel products' input gradients and the row-parallel
// outputs are summed over the group in rank order, which gives every rank the same bits).
// --qk-layernorm's query and key norms are the exception: each rank's gradient is its heads' share,
// summed over the group by the training step (GPTModel::SumNonTensorParallelGrads).
absl::Status CpuGPTModel::RunBackward(const ModelBatch& batch, bool train, uint64_t seed) {
  if (sequence_parallel_) return RunBackwardSequenceParallel(batch, train, seed);
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const auto [n, c, ct, f, vp, hp, ap, shape, L] = DimsOf(layout_, batch, train);
  const float* P = params_.data();
  float* G = grads_.data();
  const int64_t head0 = tensor_rank() * shape.nh;

  // This chunk's layers [l0, Ls) of the stage's (all of them without model chunks).
  const int64_t l0 = chunk_layer_begin(), Ls = chunk_layer_end();
  if (chunk_post_process()) {  // a stage before the last starts from the next stage's gradient, in dresid
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    cpu::MatmulBackward(a.dln.data(), G + layout_.out_w, static_cast<float*>(nullptr), a.logits.data(), a.lnf.data(),
                        P + layout_.out_w, n, c, vp);
    PTK_RETURN_IF_ERROR(TensorSum(a.dln.data(), n * c));
    for (int64_t i = 0; dlnf_extra_ && i < n * c; ++i) a.dln[i] += dlnf_extra_[i];  // multi-token prediction's
    std::fill(a.dresid.begin(), a.dresid.end(), 0.0f);
    NormBackward(cf, a.dresid.data(), G, a.dln.data(), a.resid[Ls].data(), P, layout_.lnf_w, layout_.lnf_b,
                 a.lnf_mean.data(), a.lnf_rstd.data(), n, c);
  }
  GradsReady(0);  // the final LayerNorm (and an untied output layer): --overlap-grad-reduce's buckets
  for (int64_t l = Ls - 1; l >= l0; --l) {
    const LayerParams& lp = layout_.layers[l];
    const int64_t gl = GlobalLayer(l);  // the layer's index in the whole model (dropout keys)
    // MLP: resid[l+1] = resid_mid + dropout(fc2(gelu(fc1(ln2(resid_mid)))))
    a.dtmp = a.dresid;
    DropoutRows(a.dtmp.data(), batch, c, hp, seed, gl, kMlpOutDropout, context_positions_);
    if (lp.router_w >= 0) {  // a mixture-of-experts layer
      PTK_RETURN_IF_ERROR(MoeMlpBackward(l, lp, a.ln2[l].data(), a.ln2[l].data(), train));
    } else {
      float* dact = cf.swiglu ? a.dact.data() : a.dff.data();  // the activation's output gradient
      std::fill(dact, dact + n * f, 0.0f);
      cpu::MatmulBackward(dact, G + lp.fc2_w, At(G, lp.fc2_b), a.dtmp.data(), a.gelu[l].data(), P + lp.fc2_w, n, f, c);
      MlpActivationBackward(cf, a.dff.data(), a.fc1[l].data(), dact, n, f);
      std::fill(a.dln.begin(), a.dln.end(), 0.0f);
      cpu::MatmulBackward(a.dln.data(), G + lp.fc1_w, At(G, lp.fc1_b), a.dff.data(), a.ln2[l].data(), P + lp.fc1_w, n,
                          c, (cf.swiglu ? 2 : 1) * f);
      PTK_RETURN_IF_ERROR(TensorSum(a.dln.data(), n * c));  // column-parallel fc1: its input gradient summed
    }
    NormBackward(cf, a.dresid.data(), G, a.dln.data(), a.resid_mid[l].data(), P, lp.ln2_w, lp.ln2_b,
                 a.ln2_mean[l].data(), a.ln2_rstd[l].data(), n, c);
    // Attention: resid_mid = resid[l] + dropout(proj(attention(qkv(ln1(resid[l])))))
    a.dtmp = a.dresid;
    DropoutRows(a.dtmp.data(), batch, c, hp, seed, gl, kAttentionOutDropout, context_positions_);
    std::fill(a.datt.begin(), a.datt.end(), 0.0f);
    cpu::MatmulBackward(a.datt.data(), G + lp.proj_w, At(G, lp.proj_b), a.dtmp.data(), a.atty[l].data(), P + lp.proj_w,
                        n, ct, c);
    OutputGateLayerBackward(cf, a, l, n, ct);
    if (ap > 0.0) AttentionStreams(batch, gl, head0, &a.streams);
    PTK_RETURN_IF_ERROR(LayerAttentionBackward(l, lp, shape, ap, seed));
    if (cf.mla()) {
      MlaQkvBackward(l, lp, a.ln1[l].data());
    } else {
      std::fill(a.dln.begin(), a.dln.end(), 0.0f);
      cpu::MatmulBackward(a.dln.data(), G + lp.qkv_w, At(G, lp.qkv_b), QkvMatmulGrad(cf, a, shape), a.ln1[l].data(),
                          P + lp.qkv_w, n, c, QkvMatmulWidth(cf, shape));
    }
    // Column-parallel QKV (MLA: its heads' share of the input's gradient): the input gradient summed.
    PTK_RETURN_IF_ERROR(TensorSum(a.dln.data(), n * c));
    NormBackward(cf, a.dresid.data(), G, a.dln.data(), a.resid[l].data(), P, lp.ln1_w, lp.ln1_b, a.ln1_mean[l].data(),
                 a.ln1_rstd[l].data(), n, c);
    GradsReady(static_cast<size_t>(stage_layers() - l));  // layer l
  }
  // A later pipeline stage leaves its input's gradient in dresid, for the previous stage.
  if (chunk_pre_process() && !mtp_pass_) {
    DropoutRows(a.dresid.data(), batch, c, hp, seed, L, kEmbeddingDropout, context_positions_);
    if (!tp())
      cpu::EmbeddingBackward(G + layout_.wte, At(G, layout_.wpe), a.dresid.data(), batch.tokens, batch.position_ids, n,
                             c);
    else
      cpu::VocabSliceEmbeddingBackward(G + layout_.wte, At(G, layout_.wpe), a.dresid.data(), batch.tokens,
                                       batch.position_ids, tensor_rank() * vp, vp, n, c);
  }
  GradsReady(static_cast<size_t>(stage_layers()) + 1);  // the embeddings
  return absl::OkStatus();
}

absl::Status CpuGPTModel::Loss(const ModelBatch& batch, const float* dloss) {
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t, vp = config().padded_vocab_size;
  if (tp())
    return cpu::VocabParallelCrossEntropy(a.logits.data(), a.losses.data(), batch.labels, dloss, n, vp / tensor_size(),
                                          tensor_rank() * (vp / tensor_size()), tensor_comm_, &a.xent_work);
  if (dloss)
    cpu::SoftmaxCrossEntropyFused(a.logits.data(), a.losses.data(), batch.labels, dloss, n, vp);
  else
    cpu::SoftmaxCrossEntropyForward(a.losses.data(), a.logits.data(), batch.labels, n, vp);
  return absl::OkStatus();
}

absl::StatusOr<LossSum> CpuGPTModel::ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                                     uint64_t seed) {
  if (layout_.pipeline_size > 1) return absl::FailedPreconditionError("a pipeline stage runs StageForward");
  act_ = slots_[0].get();
  PTK_RETURN_IF_ERROR(Prepare(batch));
  bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  moe_aux_sum_ = moe_z_sum_ = 0;
  PTK_RETURN_IF_ERROR(RunForward(batch, train, seed));
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t;
  for (int64_t i = 0; i < n; ++i) a.dloss[i] = static_cast<float>(batch.loss_mask[i] * loss_scale);
  PTK_RETURN_IF_ERROR(Loss(batch, a.dloss.data()));
  LossSum s = SumLosses(a.losses, batch.loss_mask, n);
  if (config().mtp_num_layers > 0) PTK_RETURN_IF_ERROR(MtpForwardBackward(batch, train, seed, &s));
  s.load_balancing_loss = moe_aux_sum_;  // the depths' MoE layers' too
  s.z_loss = moe_z_sum_;
  const absl::Status backward = RunBackward(batch, train, seed);
  dlnf_extra_ = nullptr;
  PTK_RETURN_IF_ERROR(backward);
  return s;
}

absl::StatusOr<LossSum> CpuGPTModel::Forward(const ModelBatch& batch, std::vector<float>* logits) {
  if (layout_.pipeline_size > 1) return absl::FailedPreconditionError("a pipeline stage runs StageForward");
  act_ = slots_[0].get();
  PTK_RETURN_IF_ERROR(Prepare(batch));
  PTK_RETURN_IF_ERROR(RunForward(batch, /*train=*/false, 0));
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t;
  if (logits && tp())  // the whole rows, gathered from the ranks' slices (text samples)
    PTK_RETURN_IF_ERROR(cpu::GatherVocabParallelLogits(a.logits.data(), n, config().padded_vocab_size / tensor_size(),
                                                       tensor_comm_, logits));
  else if (logits)
    *logits = a.logits;
  PTK_RETURN_IF_ERROR(Loss(batch, nullptr));
  return SumLosses(act_->losses, batch.loss_mask, n);
}

}  // namespace ptk
