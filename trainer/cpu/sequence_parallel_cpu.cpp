// Megatron's sequence parallelism on the CPU model (--sequence-parallel with tensor parallelism):
// each tensor rank holds positions [r·t/T, (r+1)·t/T) of every sample for the norms (LayerNorm or
// RMSNorm), dropout and the residual stream, and keeps only those rows of them for backward (the
// activations of these regions are 1/T of one rank's); their norm outputs are all-gathered into one
// transient buffer before the column-parallel products (QKV, fc1, the output layer), and again in
// backward for the products' weight gradients, as Megatron does, and the row-parallel products'
// partial outputs (proj, fc2, the vocabulary-parallel embedding) are reduce-scattered instead of
// all-reduced. Backward mirrors it (an all-gather's gradient is a reduce-scatter and the reverse);
// the norms' gradients, computed on this rank's rows, are summed over the tensor group. Dropout masks keep
// their global index (sample, position, channel), so the masks are one rank's. With context
// parallelism the batch holds a context rank's rows (their positions: context_positions_), which the
// tensor ranks split alike; the attention is the context group's (context_parallel_cpu.cpp).
// Multi-latent attention runs its down projections (whole on every rank) over the gathered rows, as
// Megatron's column-parallel products gather their input; their gradients, every rank's heads' share
// over all rows, are summed over the group as the norms'.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cpu/tensor_parallel_cpu.h"

namespace ptk {
namespace {

struct Rows {
  int64_t T, me, b, t, tl, t0, nl;  // tl positions of each sample from t0: nl = b·tl rows here
  // Context parallelism: each of the batch's t rows' place in the whole sample (empty: row i is i).
  const std::vector<int64_t>* positions;
};
Rows RowsOf(const ModelBatch& batch, int T, int me, const std::vector<int64_t>& positions) {
  const int64_t tl = batch.t / T;
  return {T, me, batch.b, batch.t, tl, me * tl, batch.b * tl, &positions};
}

// Dropout of this rank's rows (b, tl, c), each element keyed by its place in the whole sample.
void DropoutLocal(float* x, const ModelBatch& batch, const Rows& r, int64_t c, double p, uint64_t seed, uint64_t layer,
                  uint64_t site) {
  if (p <= 0.0) return;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  for (int64_t s = 0; s < r.b; ++s) {
    const uint64_t key = DropoutKey(seed, DropoutStream(static_cast<uint64_t>(batch.sample_keys[s]), layer, site));
    float* rows = x + s * r.tl * c;
    for (int64_t k = 0; k < r.tl; ++k) {
      const int64_t at = r.positions->empty() ? r.t0 + k : (*r.positions)[static_cast<size_t>(r.t0 + k)];
      const uint64_t base = static_cast<uint64_t>(at * c);
      for (int64_t j = 0; j < c; ++j) {
        float& v = rows[k * c + j];
        v = DropoutKeepKeyed(key, base + static_cast<uint64_t>(j), threshold) ? v * scale : 0.0f;
      }
    }
  }
}

void AddBiasRows(float* x, const float* bias, int64_t n, int64_t c) {
  if (!bias) return;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) x[i * c + j] += bias[j];
}

// A row-parallel product's bias gradient: the column sums of its output gradient on this rank's
// rows (Megatron adds the bias after the reduce-scatter), in MatmulBackward's order.
void BiasGradRows(float* dbias, const float* dout, int64_t n, int64_t c) {
  if (!dbias) return;
  std::vector<double> acc(static_cast<size_t>(c), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) acc[static_cast<size_t>(j)] += dout[i * c + j];
  for (int64_t j = 0; j < c; ++j) dbias[j] += static_cast<float>(acc[static_cast<size_t>(j)]);
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

absl::Status CpuGPTModel::GatherRows(const float* local, float* whole, const ModelBatch& batch, int64_t c) {
  const Rows r = RowsOf(batch, tensor_size(), tensor_rank(), context_positions_);
  std::vector<float>& buf = act_->sp_buf;  // [rank][sample][tl][c]
  std::copy(local, local + r.nl * c, buf.begin() + r.me * r.nl * c);
  std::vector<int64_t> bytes(static_cast<size_t>(r.T), r.nl * c * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(tensor_comm_->AllGather(buf.data(), bytes));
  for (int64_t q = 0; q < r.T; ++q)
    for (int64_t s = 0; s < r.b; ++s)
      std::memcpy(whole + (s * r.t + q * r.tl) * c, buf.data() + (q * r.nl + s * r.tl) * c,
                  static_cast<size_t>(r.tl * c) * sizeof(float));
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ReduceScatterRows(const float* whole, float* local, const ModelBatch& batch, int64_t c) {
  const Rows r = RowsOf(batch, tensor_size(), tensor_rank(), context_positions_);
  std::vector<float>& buf = act_->sp_buf;
  for (int64_t q = 0; q < r.T; ++q)
    for (int64_t s = 0; s < r.b; ++s)
      std::memcpy(buf.data() + (q * r.nl + s * r.tl) * c, whole + (s * r.t + q * r.tl) * c,
                  static_cast<size_t>(r.tl * c) * sizeof(float));
  std::vector<int64_t> counts(static_cast<size_t>(r.T), r.nl * c);
  PTK_RETURN_IF_ERROR(tensor_comm_->ReduceScatterSum(buf.data(), counts));
  std::copy(buf.begin() + r.me * r.nl * c, buf.begin() + (r.me + 1) * r.nl * c, local);
  return absl::OkStatus();
}

absl::Status CpuGPTModel::LayerNormBackwardRows(float* dinp, int64_t w, int64_t b, const float* dout, const float* inp,
                                                const float* mean, const float* rstd, int64_t rows) {
  const int64_t c = config().hidden_size;
  std::vector<float>& g = act_->ln_grads;
  std::fill(g.begin(), g.end(), 0.0f);
  // This rank's rows' share of the norm's gradients (weight at 0, LayerNorm's bias at c), added to
  // the gradients as Megatron adds a micro-batch's to its main_grad; the sum over the tensor group
  // comes once, after the data-parallel reduction (TrainStep).
  const float* P = params_.data();
  if (config().normalization == Normalization::kRMSNorm)
    cpu::RMSNormBackward(dinp, g.data(), dout, inp, P + w, rstd, rows, c, config().norm_weight_offset());
  else
    cpu::LayerNormBackward(dinp, g.data(), g.data() + c, dout, inp, P + w, mean, rstd, rows, c,
                           config().norm_weight_offset());
  float* G = grads_.data();
  for (int64_t j = 0; j < c; ++j) G[w + j] += g[j];
  if (b >= 0)
    for (int64_t j = 0; j < c; ++j) G[b + j] += g[c + j];
  return absl::OkStatus();
}

// A mixture-of-experts layer's backward from its output's gradient gathered in act_->dtmp: the experts' partial
// input gradient (act_->dln, reduce-scattered by the caller) plus the router's on this rank's rows only (Megatron
// routes each rank's own tokens), its weight gradient from those rows (summed over the tensor group as the norms').
absl::Status CpuGPTModel::MoeBackwardRows(int64_t l, const LayerParams& lp, const ModelBatch& batch, bool train) {
  Activations& a = *act_;
  const Rows r = RowsOf(batch, tensor_size(), tensor_rank(), context_positions_);
  const int64_t c = config().hidden_size, n = batch.b * batch.t;
  float* whole = a.sp_whole.data();
  PTK_RETURN_IF_ERROR(GatherRows(a.ln2[l].data(), whole, batch, c));
  float* mine = a.sp_buf.data();  // the gathered rows with the other ranks' zeroed
  std::fill(mine, mine + n * c, 0.0f);
  for (int64_t s = 0; s < r.b; ++s) {
    const int64_t at = (s * r.t + r.t0) * c;
    std::copy(whole + at, whole + at + r.tl * c, mine + at);
  }
  PTK_RETURN_IF_ERROR(MoeMlpBackward(l, lp, whole, mine, train));
  for (int64_t s = 0; s < r.b; ++s)
    for (int64_t i = (s * r.t + r.t0) * c, e = i + r.tl * c; i < e; ++i) a.dln[i] += a.dtmp[i];
  return absl::OkStatus();
}

absl::Status CpuGPTModel::RunForwardSequenceParallel(const ModelBatch& batch, bool train, uint64_t seed) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const Rows r = RowsOf(batch, tensor_size(), tensor_rank(), context_positions_);
  const int64_t T = r.T, n = batch.b * batch.t, c = cf.hidden_size, ct = cf.attention_width() / T,
                f = cf.ffn_hidden_size / T, f1 = (cf.swiglu ? 2 : 1) * f, vp = cf.padded_vocab_size / T,
                L = cf.num_layers, nl = r.nl;
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  const AttentionShape shape =
      cf.mla() ? MlaAttentionShape(cf, batch.b, batch.t, T)
               : AttentionShape{batch.b, batch.t, cf.num_attention_heads / T, cf.head_dim(), cf.query_groups() / T};
  const float* P = params_.data();
  float* loc = a.sp_local.data();
  float* whole = a.sp_whole.data();  // a norm's output gathered for the product that follows it

  // Embedding: each rank its vocabulary rows, reduce-scattered to this rank's positions, then the
  // position embeddings of those. A later pipeline stage starts from the previous stage's shard of
  // the residual stream (this rank's positions), already in resid[0], as does a multi-token prediction depth
  // (mtp_cpu.cpp: eh_proj's output, this rank's positions).
  if (chunk_pre_process() && !mtp_pass_) {
    cpu::VocabSliceEmbeddingForward(a.tmp.data(), batch.tokens, P + layout_.wte, r.me * vp, vp, n, c);
    float* x = a.resid[0].data();
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.tmp.data(), x, batch, c));
    for (int64_t s = 0; s < r.b && layout_.wpe >= 0; ++s)
      for (int64_t i = 0; i < r.tl; ++i) {
        const float* pos = P + layout_.wpe + static_cast<int64_t>(batch.position_ids[s * r.t + r.t0 + i]) * c;
        float* y = x + (s * r.tl + i) * c;
        for (int64_t j = 0; j < c; ++j) y[j] += pos[j];
      }
    DropoutLocal(x, batch, r, c, hp, seed, L, kEmbeddingDropout);
  }
  // This chunk's layers [l0, Ls) of the stage's (all of them without model chunks).
  const int64_t l0 = chunk_layer_begin(), Ls = chunk_layer_end();
  for (int64_t l = l0; l < Ls; ++l) {
    const LayerParams& lp = layout_.layers[l];
    const int64_t gl = GlobalLayer(l);  // the layer's index in the whole model (dropout keys)
    NormForward(cf, a.ln1[l].data(), a.ln1_mean[l].data(), a.ln1_rstd[l].data(), a.resid[l].data(), P, lp.ln1_w,
                lp.ln1_b, nl, c);
    PTK_RETURN_IF_ERROR(GatherRows(a.ln1[l].data(), whole, batch, c));
    if (cf.mla()) {  // the down projections (whole on every rank) and this rank's heads over the gathered rows
      MlaQkvForward(l, lp, whole);
    } else {
      cpu::MatmulForward(QkvMatmulOut(a, l, cf), whole, P + lp.qkv_w, At(P, lp.qkv_b), n, c, QkvMatmulWidth(cf, shape));
      QkvGateSplit(cf, a, l, shape);
      QKNormLayerForward(cf, a, l, P, lp, shape);
      if (cf.rope())
        cpu::RopeForward(a.qkv[l].data(), a.rope_cos.data(), a.rope_sin.data(), shape, cf.rotary_dim(),
                         cf.rotary_interleaved);
    }
    if (ap > 0.0)
      for (int64_t s = 0; s < batch.b; ++s)
        a.streams[s] = DropoutStream(static_cast<uint64_t>(batch.sample_keys[s]), gl, kAttentionProbs) +
                       static_cast<uint64_t>(r.me * shape.nh);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    const AttentionShape core = CoreAttentionShape(shape, l, lp, false);  // the layer's window and softmax offset
    if (cp())
      PTK_RETURN_IF_ERROR(ContextAttentionForward(AttentionOut(a, l, cf), probs, a.qkv[l].data(), core, ap, seed));
    else
      cpu::AttentionForward(AttentionOut(a, l, cf), probs, a.qkv[l].data(), core, ap, seed, a.streams.data());
    OutputGateLayerForward(cf, a, l, n, ct);
    cpu::MatmulForward(a.tmp.data(), a.atty[l].data(), P + lp.proj_w, static_cast<const float*>(nullptr), n, ct, c);
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.tmp.data(), loc, batch, c));
    AddBiasRows(loc, At(P, lp.proj_b), nl, c);
    DropoutLocal(loc, batch, r, c, hp, seed, gl, kAttentionOutDropout);
    for (int64_t i = 0; i < nl * c; ++i) a.resid_mid[l][i] = a.resid[l][i] + loc[i];
    NormForward(cf, a.ln2[l].data(), a.ln2_mean[l].data(), a.ln2_rstd[l].data(), a.resid_mid[l].data(), P, lp.ln2_w,
                lp.ln2_b, nl, c);
    PTK_RETURN_IF_ERROR(GatherRows(a.ln2[l].data(), whole, batch, c));
    if (lp.router_w >= 0) {  // a mixture-of-experts layer: every rank routes the gathered rows (cpu_moe_layer.cpp)
      PTK_RETURN_IF_ERROR(MoeMlpForward(l, lp, whole, n, train));
    } else {
      cpu::MatmulForward(a.fc1[l].data(), whole, P + lp.fc1_w, At(P, lp.fc1_b), n, c, f1);
      MlpActivationForward(cf, a.gelu[l].data(), a.fc1[l].data(), n, f);
      cpu::MatmulForward(a.tmp.data(), a.gelu[l].data(), P + lp.fc2_w, static_cast<const float*>(nullptr), n, f, c);
    }
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.tmp.data(), loc, batch, c));
    AddBiasRows(loc, At(P, lp.fc2_b), nl, c);
    DropoutLocal(loc, batch, r, c, hp, seed, gl, kMlpOutDropout);
    for (int64_t i = 0; i < nl * c; ++i) a.resid[l + 1][i] = a.resid_mid[l][i] + loc[i];
  }
  if (!chunk_post_process()) return absl::OkStatus();  // resid[Ls], this rank's rows, goes to the next stage
  NormForward(cf, a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), a.resid[Ls].data(), P, layout_.lnf_w,
              layout_.lnf_b, nl, c);
  PTK_RETURN_IF_ERROR(GatherRows(a.lnf.data(), whole, batch, c));
  cpu::MatmulForward(a.logits.data(), whole, P + layout_.out_w, static_cast<const float*>(nullptr), n, c, vp);
  return absl::OkStatus();
}

absl::Status CpuGPTModel::RunBackwardSequenceParallel(const ModelBatch& batch, bool train, uint64_t seed) {
  const GPTConfig& cf = config();
  Activations& a = *act_;
  const Rows r = RowsOf(batch, tensor_size(), tensor_rank(), context_positions_);
  const int64_t T = r.T, n = batch.b * batch.t, c = cf.hidden_size, ct = cf.attention_width() / T,
                f = cf.ffn_hidden_size / T, f1 = (cf.swiglu ? 2 : 1) * f, vp = cf.padded_vocab_size / T,
                L = cf.num_layers, nl = r.nl;
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  const AttentionShape shape =
      cf.mla() ? MlaAttentionShape(cf, batch.b, batch.t, T)
               : AttentionShape{batch.b, batch.t, cf.num_attention_heads / T, cf.head_dim(), cf.query_groups() / T};
  const float* P = params_.data();
  float* G = grads_.data();
  float* loc = a.sp_local.data();
  float* whole = a.sp_whole.data();  // a norm's output gathered again for its product's weight gradient
  float* dresid = a.dresid.data();   // this rank's rows (nl of them)

  // This chunk's layers [l0, Ls) of the stage's (all of them without model chunks).
  const int64_t l0 = chunk_layer_begin(), Ls = chunk_layer_end();
  if (chunk_post_process()) {  // a stage before the last starts from the next stage's gradient, in dresid
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    PTK_RETURN_IF_ERROR(GatherRows(a.lnf.data(), whole, batch, c));
    cpu::MatmulBackward(a.dln.data(), G + layout_.out_w, static_cast<float*>(nullptr), a.logits.data(), whole,
                        P + layout_.out_w, n, c, vp);
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.dln.data(), loc, batch, c));
    for (int64_t i = 0; dlnf_extra_ && i < nl * c; ++i) loc[i] += dlnf_extra_[i];  // multi-token prediction's
    std::fill(dresid, dresid + nl * c, 0.0f);
    PTK_RETURN_IF_ERROR(LayerNormBackwardRows(dresid, layout_.lnf_w, layout_.lnf_b, loc, a.resid[Ls].data(),
                                              a.lnf_mean.data(), a.lnf_rstd.data(), nl));
  }
  GradsReady(0);
  for (int64_t l = Ls - 1; l >= l0; --l) {
    const LayerParams& lp = layout_.layers[l];
    const int64_t gl = GlobalLayer(l);  // the layer's index in the whole model (dropout keys)
    // MLP: its output's gradient (this rank's rows, through dropout) gathered for fc2's backward.
    std::copy(dresid, dresid + nl * c, loc);
    DropoutLocal(loc, batch, r, c, hp, seed, gl, kMlpOutDropout);
    BiasGradRows(At(G, lp.fc2_b), loc, nl, c);  // added to this rank's rows, as Megatron adds it
    PTK_RETURN_IF_ERROR(GatherRows(loc, a.dtmp.data(), batch, c));
    if (lp.router_w >= 0) {
      PTK_RETURN_IF_ERROR(MoeBackwardRows(l, lp, batch, train));
    } else {
      float* dact = cf.swiglu ? a.dact.data() : a.dff.data();  // the activation's output gradient
      std::fill(dact, dact + n * f, 0.0f);
      cpu::MatmulBackward(dact, G + lp.fc2_w, static_cast<float*>(nullptr), a.dtmp.data(), a.gelu[l].data(),
                          P + lp.fc2_w, n, f, c);
      MlpActivationBackward(cf, a.dff.data(), a.fc1[l].data(), dact, n, f);
      std::fill(a.dln.begin(), a.dln.end(), 0.0f);
      PTK_RETURN_IF_ERROR(GatherRows(a.ln2[l].data(), whole, batch, c));
      cpu::MatmulBackward(a.dln.data(), G + lp.fc1_w, At(G, lp.fc1_b), a.dff.data(), whole, P + lp.fc1_w, n, c, f1);
    }
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.dln.data(), loc, batch, c));
    PTK_RETURN_IF_ERROR(LayerNormBackwardRows(dresid, lp.ln2_w, lp.ln2_b, loc, a.resid_mid[l].data(),
                                              a.ln2_mean[l].data(), a.ln2_rstd[l].data(), nl));
    // Attention.
    std::copy(dresid, dresid + nl * c, loc);
    DropoutLocal(loc, batch, r, c, hp, seed, gl, kAttentionOutDropout);
    BiasGradRows(At(G, lp.proj_b), loc, nl, c);
    PTK_RETURN_IF_ERROR(GatherRows(loc, a.dtmp.data(), batch, c));
    std::fill(a.datt.begin(), a.datt.end(), 0.0f);
    cpu::MatmulBackward(a.datt.data(), G + lp.proj_w, static_cast<float*>(nullptr), a.dtmp.data(), a.atty[l].data(),
                        P + lp.proj_w, n, ct, c);
    OutputGateLayerBackward(cf, a, l, n, ct);
    if (ap > 0.0)
      for (int64_t s = 0; s < batch.b; ++s)
        a.streams[s] = DropoutStream(static_cast<uint64_t>(batch.sample_keys[s]), gl, kAttentionProbs) +
                       static_cast<uint64_t>(r.me * shape.nh);
    PTK_RETURN_IF_ERROR(LayerAttentionBackward(l, lp, shape, ap, seed));
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    PTK_RETURN_IF_ERROR(GatherRows(a.ln1[l].data(), whole, batch, c));
    if (cf.mla())  // its heads' share of the input's gradient and of the down projections' and latent norms'
      MlaQkvBackward(l, lp, whole);
    else
      cpu::MatmulBackward(a.dln.data(), G + lp.qkv_w, At(G, lp.qkv_b), QkvMatmulGrad(cf, a, shape), whole, P + lp.qkv_w,
                          n, c, QkvMatmulWidth(cf, shape));
    PTK_RETURN_IF_ERROR(ReduceScatterRows(a.dln.data(), loc, batch, c));
    PTK_RETURN_IF_ERROR(LayerNormBackwardRows(dresid, lp.ln1_w, lp.ln1_b, loc, a.resid[l].data(), a.ln1_mean[l].data(),
                                              a.ln1_rstd[l].data(), nl));
    GradsReady(static_cast<size_t>(stage_layers() - l));
  }
  // A later pipeline stage leaves its input's gradient (this rank's rows) in dresid, for the previous stage (a
  // multi-token prediction depth for its eh_proj).
  if (chunk_pre_process() && !mtp_pass_) {
    DropoutLocal(dresid, batch, r, c, hp, seed, L, kEmbeddingDropout);
    PTK_RETURN_IF_ERROR(GatherRows(dresid, a.dtmp.data(), batch, c));
    cpu::VocabSliceEmbeddingBackward(G + layout_.wte, At(G, layout_.wpe), a.dtmp.data(), batch.tokens,
                                     batch.position_ids, r.me * vp, vp, n, c);
  }
  GradsReady(static_cast<size_t>(stage_layers()) + 1);
  return absl::OkStatus();
}

}  // namespace ptk
