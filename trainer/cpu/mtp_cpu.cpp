// Multi-token prediction on the CPU (megatron-core 0.16.1's MultiTokenPredictionBlock and GPTModel._postprocess):
// depth k (0-based) embeds the input tokens and positions rolled left k + 1 times (the last position zero, as
// roll_tensor), normalises them (enorm) and the previous hidden states (hnorm: the decoder's output after its final
// norm for the first depth, the previous depth's after its final_layernorm), projects [embedding, hidden] with
// eh_proj (2h -> h, no bias), runs its transformer layer and final_layernorm, and the shared output layer gives
// logits scored against the labels and loss mask rolled likewise. Each depth's masked token losses weigh
// mtp_loss_scaling_factor / mtp_num_layers x GPTModel::SetMtpLossScale's scale, over the depth's tokens unless
// per token (MTPLossAutoScaler). The transformer layer and head run through the model's own passes
// (RunForward / RunBackward) on a one-layer layout of the depth's tensors swapped in for the pass: an MoE layer's
// router, experts and shared experts (its balance state, expert bias and aux losses at index layers + k:
// moe_layer_offset_) or multi-latent attention (the main pass's rotary tables) as the decoder's.
// Under sequence parallelism (megatron-core's MultiTokenPredictionLayer with config.sequence_parallel) each tensor
// rank holds its t / T positions of every sample for the depth's norms, its layer's residual stream and the
// hidden states it takes (the decoder's, or the previous depth's, final norm output: this rank's positions): the
// embedding is summed whole (its dropout keyed by the whole sample's places) and this rank's positions kept; eh_proj,
// a column-parallel linear with sequence parallelism, gathers [embedding, hidden] over the positions, its output
// columns are gathered over the ranks (gather_from_tensor_model_parallel_region) and this rank's positions kept
// (scatter_to_sequence_parallel_region). Backward mirrors it: the output's gradient gathered over the positions,
// this rank's columns through eh_proj, the input's gradient reduce-scattered to this rank's positions; the norms'
// weight gradients are this rank's positions' share (summed over the tensor group as the decoder's norms').
#include <algorithm>
#include <cstring>
#include <utility>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cpu/tensor_parallel_cpu.h"

namespace ptk {

using cpu_model_detail::At;
using cpu_model_detail::NormBackward;
using cpu_model_detail::NormForward;

struct CpuGPTModel::MtpState {
  struct Depth {
    ParamLayout layout;  // the depth's transformer layer as layer 0, its final_layernorm as the final norm
    Activations act;
    std::vector<int32_t> tokens, positions, labels;
    std::vector<float> mask, emb, en, en_mean, en_rstd, hn, hn_mean, hn_rstd, x, dx, demb, dh;
    std::vector<float> proj, whole;   // tensor parallelism: this rank's eh_proj columns, and all ranks' gathered
    std::vector<float> xw, dxw, buf;  // sequence parallelism: x gathered over the positions, its gradient, staging
    double tokens_count = 0;
  };
  std::vector<Depth> depths;
  // Pipeline parallelism: per activation slot the decoder output's gradient from the first depth, which the
  // slot's StageBackward adds to the final norm's output gradient.
  std::vector<std::vector<float>> slot_dh;
};

namespace {
// roll_tensor(shifts=-1) over each sample's row: element i takes i + 1, the last is zero.
template <typename T>
void RollRows(std::vector<T>* out, const T* in, int64_t b, int64_t t) {
  out->resize(static_cast<size_t>(b * t));
  for (int64_t r = 0; r < b; ++r) {
    std::copy(in + r * t + 1, in + (r + 1) * t, out->data() + r * t);
    (*out)[static_cast<size_t>(r * t + t - 1)] = T(0);
  }
}
// Sequence parallelism's positions of a (b, t, w) buffer: this rank's tl = t / T of each sample, from t0.
struct SeqRows {
  int64_t T, me, b, t, tl, t0;
};
// This rank's rows of `whole` into `local` (which may be `whole`: each sample's rows move towards the front).
void TakeRows(const float* whole, float* local, const SeqRows& r, int64_t w) {
  for (int64_t s = 0; s < r.b; ++s)
    std::memmove(local + s * r.tl * w, whole + (s * r.t + r.t0) * w, static_cast<size_t>(r.tl * w) * sizeof(float));
}
// All ranks' rows of `local` (b, tl, w) into `whole` (b, t, w); `buf` stages the collective ([rank][sample][tl][w]).
absl::Status GatherSeqRows(Communicator* comm, const float* local, float* whole, const SeqRows& r, int64_t w,
                           std::vector<float>* buf) {
  const int64_t nl = r.b * r.tl;
  buf->resize(static_cast<size_t>(r.T * nl * w));
  std::copy(local, local + nl * w, buf->begin() + r.me * nl * w);
  std::vector<int64_t> bytes(static_cast<size_t>(r.T), nl * w * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(comm->AllGather(buf->data(), bytes));
  for (int64_t q = 0; q < r.T; ++q)
    for (int64_t s = 0; s < r.b; ++s)
      std::copy_n(buf->begin() + (q * nl + s * r.tl) * w, r.tl * w, whole + (s * r.t + q * r.tl) * w);
  return absl::OkStatus();
}
// `whole` (b, t, w), a partial sum, summed over the ranks into this rank's rows `local` (b, tl, w).
absl::Status ReduceScatterSeqRows(Communicator* comm, const float* whole, float* local, const SeqRows& r, int64_t w,
                                  std::vector<float>* buf) {
  const int64_t nl = r.b * r.tl;
  buf->resize(static_cast<size_t>(r.T * nl * w));
  for (int64_t q = 0; q < r.T; ++q)
    for (int64_t s = 0; s < r.b; ++s)
      std::copy_n(whole + (s * r.t + q * r.tl) * w, r.tl * w, buf->begin() + (q * nl + s * r.tl) * w);
  std::vector<int64_t> counts(static_cast<size_t>(r.T), nl * w);
  PTK_RETURN_IF_ERROR(comm->ReduceScatterSum(buf->data(), counts));
  std::copy_n(buf->begin() + r.me * nl * w, nl * w, local);
  return absl::OkStatus();
}
SeqRows SeqRowsOf(const ModelBatch& batch, bool sequence_parallel, int64_t T, int64_t me) {
  if (!sequence_parallel) return {1, 0, batch.b, batch.t, batch.t, 0};
  return {T, me, batch.b, batch.t, batch.t / T, me * (batch.t / T)};
}
// The depth's embedding dropout (hidden_dropout, as the decoder's embedding), keyed by the depth's layer index.
void EmbeddingDropout(float* x, const ModelBatch& batch, int64_t c, double p, uint64_t seed, int64_t layer) {
  if (p <= 0.0) return;
  for (int64_t r = 0; r < batch.b; ++r)
    cpu::Dropout(
        x + r * batch.t * c, batch.t * c, p, seed,
        DropoutStream(static_cast<uint64_t>(batch.sample_keys[r]), static_cast<uint64_t>(layer), kEmbeddingDropout));
}
// Depth k's transformer layer as layer 0 of a one-layer layout, its final_layernorm as the final norm, the model's
// embeddings and output layer (a tensor-parallel layer under tensor parallelism, as the decoder's).
ParamLayout DepthLayout(const ParamLayout& m, int64_t k) {
  const MtpLayerParams& mp = m.mtp[static_cast<size_t>(k)];
  const int64_t L = m.config.num_layers;
  ParamLayout d;
  d.config = m.config;
  d.layers = {mp.layer};
  d.wte = m.wte;
  d.wpe = m.wpe;
  d.lnf_w = mp.norm_w;
  d.lnf_b = mp.norm_b;
  d.out_w = m.out_w;
  d.num_params = m.num_params;
  d.tensor_size = m.tensor_size;
  d.tensor_rank = m.tensor_rank;
  d.expert_size = m.expert_size;  // expert parallelism: the depth's MoE layer holds this rank's experts
  d.expert_rank = m.expert_rank;
  d.first_layer = L + 1 + k;  // the dropout keys: past the decoder's layers and its embedding's key L
  d.chunk_first_layer = {L + 1 + k};
  return d;
}
}  // namespace

// Swaps depth k's layout and activations in for one of the model's passes (and back when it ends).
class CpuGPTModel::MtpSwap {
 public:
  MtpSwap(CpuGPTModel* m, MtpState::Depth* d, int64_t k) : m_(m), d_(d), act_(m->act_), chunk_(m->chunk_) {
    m_->moe_layer_offset_ = static_cast<int64_t>(m_->layout_.layers.size()) + k;  // the depth's balance state
    std::swap(m_->layout_, d_->layout);
    m_->act_ = &d_->act;
    m_->mtp_pass_ = true;
    m_->chunk_ = 0;  // the interleaved schedule's last model chunk runs the depths: their layout's one chunk
  }
  ~MtpSwap() {
    std::swap(m_->layout_, d_->layout);
    m_->act_ = act_;
    m_->chunk_ = chunk_;
    m_->mtp_pass_ = false;
    m_->moe_layer_offset_ = 0;
  }

 private:
  CpuGPTModel* m_;
  MtpState::Depth* d_;
  Activations* act_;
  int chunk_;
};

void CpuGPTModel::GradsReady(size_t index) {
  if (!mtp_pass_) GPTModel::GradsReady(index);
}

absl::Status CpuGPTModel::MtpForwardBackward(const ModelBatch& batch, bool train, uint64_t seed, LossSum* s) {
  if (cp()) return absl::UnimplementedError("mtp_num_layers: multi-token prediction runs on one context rank");
  PTK_RETURN_IF_ERROR(MtpForward(batch, train, seed, s));
  return MtpBackward(batch, train, seed);
}

absl::Status CpuGPTModel::MtpStageForwardBackward(const ModelBatch& batch, int slot, bool train, uint64_t seed,
                                                  LossSum* s) {
  PTK_RETURN_IF_ERROR(MtpForwardBackward(batch, train, seed, s));
  std::vector<std::vector<float>>& kept = mtp_->slot_dh;
  if (kept.size() <= static_cast<size_t>(slot)) kept.resize(static_cast<size_t>(slot) + 1);
  const SeqRows r = SeqRowsOf(batch, sequence_parallel_, tensor_size(), tensor_rank());  // this rank's positions
  kept[static_cast<size_t>(slot)].assign(dlnf_extra_, dlnf_extra_ + r.b * r.tl * config().hidden_size);
  dlnf_extra_ = nullptr;
  return absl::OkStatus();
}

const float* CpuGPTModel::MtpSlotGrad(int slot) const {
  if (!mtp_ || !chunk_post_process() || static_cast<size_t>(slot) >= mtp_->slot_dh.size()) return nullptr;
  const std::vector<float>& g = mtp_->slot_dh[static_cast<size_t>(slot)];
  return g.empty() ? nullptr : g.data();
}

// The depth's embedding: under tensor parallelism vocabulary-parallel (each rank its rows, summed), as the decoder's.
absl::Status CpuGPTModel::MtpEmbed(float* out, const int32_t* tokens, const int32_t* positions, int64_t n) {
  const int64_t c = config().hidden_size;
  const float* P = params_.data();
  if (!tp()) {
    cpu::EmbeddingForward(out, tokens, positions, P + layout_.wte, At(P, layout_.wpe), n, c);
    return absl::OkStatus();
  }
  const int64_t vt = config().padded_vocab_size / tensor_size();
  cpu::VocabSliceEmbeddingForward(out, tokens, P + layout_.wte, tensor_rank() * vt, vt, n, c);
  PTK_RETURN_IF_ERROR(TensorSum(out, n * c));
  for (int64_t i = 0; i < n && layout_.wpe >= 0; ++i) {
    const float* pos = P + layout_.wpe + static_cast<int64_t>(positions[i]) * c;
    for (int64_t j = 0; j < c; ++j) out[i * c + j] += pos[j];
  }
  return absl::OkStatus();
}

// eh_proj, a column-parallel linear (gather_output false) whose output megatron-core's MultiTokenPredictionLayer
// gathers (gather_from_tensor_model_parallel_region): this rank's h / T output columns, all ranks' gathered. Under
// sequence parallelism its input is gathered over the positions first and its output scattered to them after.
absl::Status CpuGPTModel::MtpProjForward(int64_t k, const ModelBatch& batch) {
  MtpState::Depth* d = &mtp_->depths[static_cast<size_t>(k)];
  const int64_t c = config().hidden_size, w = layout_.mtp[static_cast<size_t>(k)].eh_proj, n = batch.b * batch.t;
  const float* P = params_.data();
  if (!tp()) {
    cpu::MatmulForward(d->act.resid[0].data(), d->x.data(), P + w, static_cast<const float*>(nullptr), n, 2 * c, c);
    return absl::OkStatus();
  }
  const int64_t ct = c / tensor_size();
  const SeqRows r = SeqRowsOf(batch, sequence_parallel_, tensor_size(), tensor_rank());
  const float* x = d->x.data();
  if (sequence_parallel_) {
    d->xw.resize(static_cast<size_t>(2 * n * c));
    PTK_RETURN_IF_ERROR(GatherSeqRows(tensor_comm_, x, d->xw.data(), r, 2 * c, &d->buf));
    x = d->xw.data();
  }
  d->proj.assign(static_cast<size_t>(n * ct), 0.0f);
  cpu::MatmulForward(d->proj.data(), x, P + w, static_cast<const float*>(nullptr), n, 2 * c, ct);
  PTK_RETURN_IF_ERROR(cpu::GatherVocabParallelLogits(d->proj.data(), n, ct, tensor_comm_, &d->whole));
  TakeRows(d->whole.data(), d->act.resid[0].data(), r, c);  // all positions, or this rank's (the scatter)
  return absl::OkStatus();
}

// Backward: the gather's gradient is this rank's columns (split, no sum); the input's gradient, each rank's share
// through its rows of eh_proj, summed over the group (the column-parallel input's all-reduce; under sequence
// parallelism the scatter's gradient gathers the positions first, and the input's is reduce-scattered to them).
absl::Status CpuGPTModel::MtpProjBackward(int64_t k, const ModelBatch& batch) {
  MtpState::Depth* d = &mtp_->depths[static_cast<size_t>(k)];
  const int64_t c = config().hidden_size, w = layout_.mtp[static_cast<size_t>(k)].eh_proj, n = batch.b * batch.t;
  const float* P = params_.data();
  float* G = grads_.data();
  std::fill(d->dx.begin(), d->dx.end(), 0.0f);
  if (!tp()) {
    cpu::MatmulBackward(d->dx.data(), G + w, static_cast<float*>(nullptr), d->act.dresid.data(), d->x.data(), P + w, n,
                        2 * c, c);
    return absl::OkStatus();
  }
  const int64_t ct = c / tensor_size(), j0 = tensor_rank() * ct;
  const SeqRows r = SeqRowsOf(batch, sequence_parallel_, tensor_size(), tensor_rank());
  const float* dout = d->act.dresid.data();
  const float* x = d->x.data();
  float* dx = d->dx.data();
  if (sequence_parallel_) {
    d->whole.resize(static_cast<size_t>(n * c));
    PTK_RETURN_IF_ERROR(GatherSeqRows(tensor_comm_, dout, d->whole.data(), r, c, &d->buf));
    d->dxw.assign(static_cast<size_t>(2 * n * c), 0.0f);
    dout = d->whole.data(), x = d->xw.data(), dx = d->dxw.data();
  }
  d->proj.resize(static_cast<size_t>(n * ct));
  for (int64_t i = 0; i < n; ++i) std::copy_n(dout + i * c + j0, ct, d->proj.begin() + i * ct);
  cpu::MatmulBackward(dx, G + w, static_cast<float*>(nullptr), d->proj.data(), x, P + w, n, 2 * c, ct);
  if (!sequence_parallel_) return TensorSum(d->dx.data(), 2 * n * c);
  return ReduceScatterSeqRows(tensor_comm_, d->dxw.data(), d->dx.data(), r, 2 * c, &d->buf);
}

// Depth k's input up to its layer's residual stream (act.resid[0]): the rolled tokens' embedding (with dropout) and
// the hidden states `hin`, each normalised, concatenated and projected; this rank's positions under sequence
// parallelism (the embedding summed whole, then its rows kept).
absl::Status CpuGPTModel::MtpDepthInput(int64_t k, const ModelBatch& bk, double p, uint64_t seed, const float* hin) {
  const GPTConfig& cf = config();
  MtpState::Depth& d = mtp_->depths[static_cast<size_t>(k)];
  const MtpLayerParams& mp = layout_.mtp[static_cast<size_t>(k)];
  const int64_t n = bk.b * bk.t, c = cf.hidden_size;
  const SeqRows r = SeqRowsOf(bk, sequence_parallel_, tensor_size(), tensor_rank());
  const int64_t rows = r.b * r.tl;
  const float* P = params_.data();
  PTK_RETURN_IF_ERROR(MtpEmbed(d.emb.data(), bk.tokens, bk.position_ids, n));
  EmbeddingDropout(d.emb.data(), bk, c, p, seed, cf.num_layers + 1 + k);
  if (sequence_parallel_) TakeRows(d.emb.data(), d.emb.data(), r, c);  // this rank's positions, at the front
  NormForward(cf, d.en.data(), d.en_mean.data(), d.en_rstd.data(), d.emb.data(), P, mp.enorm_w, mp.enorm_b, rows, c);
  NormForward(cf, d.hn.data(), d.hn_mean.data(), d.hn_rstd.data(), hin, P, mp.hnorm_w, mp.hnorm_b, rows, c);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(d.en.begin() + i * c, d.en.begin() + (i + 1) * c, d.x.begin() + 2 * i * c);
    std::copy(d.hn.begin() + i * c, d.hn.begin() + (i + 1) * c, d.x.begin() + (2 * i + 1) * c);
  }
  return MtpProjForward(k, bk);
}

absl::Status CpuGPTModel::MtpForward(const ModelBatch& batch, bool train, uint64_t seed, LossSum* s) {
  const GPTConfig& cf = config();
  const int64_t N = cf.mtp_num_layers, n = batch.b * batch.t, c = cf.hidden_size;
  const SeqRows r = SeqRowsOf(batch, sequence_parallel_, tensor_size(), tensor_rank());
  const int64_t rows = r.b * r.tl;  // this rank's positions' (all of them without sequence parallelism)
  const double p = train ? cf.hidden_dropout : 0.0;
  if (!mtp_) mtp_ = std::make_shared<MtpState>();
  if (mtp_->depths.size() != static_cast<size_t>(N)) {
    mtp_->depths.assign(static_cast<size_t>(N), {});
    for (int64_t k = 0; k < N; ++k) mtp_->depths[static_cast<size_t>(k)].layout = DepthLayout(layout_, k);
  }
  Activations& main = *act_;
  const int32_t* tokens = batch.tokens;
  const int32_t* positions = batch.position_ids;
  const int32_t* labels = batch.labels;
  const float* mask = batch.loss_mask;
  const float* hin = main.lnf.data();
  s->mtp_losses.assign(static_cast<size_t>(N), 0.0);
  auto fit = [](std::vector<float>& v, int64_t size) { v.assign(static_cast<size_t>(size), 0.0f); };
  for (int64_t k = 0; k < N; ++k) {
    MtpState::Depth& d = mtp_->depths[static_cast<size_t>(k)];
    RollRows(&d.tokens, tokens, batch.b, batch.t);
    RollRows(&d.positions, positions, batch.b, batch.t);
    RollRows(&d.labels, labels, batch.b, batch.t);
    RollRows(&d.mask, mask, batch.b, batch.t);
    tokens = d.tokens.data(), positions = d.positions.data(), labels = d.labels.data(), mask = d.mask.data();
    if (d.act.b != batch.b || d.act.t != batch.t) {
      SizeActivations(d.layout, 0, sequence_parallel_, batch.b, batch.t, 1, &d.act);
      d.act.b = batch.b, d.act.t = batch.t, d.act.chunk = 0;
      for (auto* v : {&d.emb, &d.demb}) fit(*v, n * c);  // whole: the embedding's sum and its backward
      for (auto* v : {&d.en, &d.hn, &d.dh}) fit(*v, rows * c);
      for (auto* v : {&d.en_mean, &d.en_rstd, &d.hn_mean, &d.hn_rstd}) fit(*v, rows);
      for (auto* v : {&d.x, &d.dx}) fit(*v, 2 * rows * c);
    }
    d.act.rope_cos = main.rope_cos;
    d.act.rope_sin = main.rope_sin;
    d.act.mla_cos = main.mla_cos;  // multi-latent attention's rotary tables (PrepareMla's, the batch's length)
    d.act.mla_sin = main.mla_sin;
    ModelBatch bk = batch;
    bk.tokens = tokens, bk.position_ids = positions, bk.labels = labels, bk.loss_mask = mask;
    PTK_RETURN_IF_ERROR(MtpDepthInput(k, bk, p, seed, hin));
    d.tokens_count = 0;
    for (int64_t i = 0; i < n; ++i) d.tokens_count += mask[i];
    const double w = cf.mtp_loss_scaling_factor / static_cast<double>(N) * mtp_loss_scale_ /
                     (mtp_per_token_ ? 1.0 : std::max(d.tokens_count, 1.0));
    {
      MtpSwap swap(this, &d, k);
      PTK_RETURN_IF_ERROR(RunForward(bk, train, seed));
      for (int64_t i = 0; i < n; ++i) d.act.dloss[i] = static_cast<float>(mask[i] * w);
      PTK_RETURN_IF_ERROR(Loss(bk, d.act.dloss.data()));
    }
    // Megatron divides by the depth's tokens unclamped (0/0 when a micro-batch has none); ptk logs 0 then.
    const LossSum ls = SumLosses(d.act.losses, mask, n);
    s->mtp_losses[static_cast<size_t>(k)] = d.tokens_count > 0 ? ls.loss_sum / d.tokens_count : 0.0;
    hin = d.act.lnf.data();
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::MtpBackward(const ModelBatch& batch, bool train, uint64_t seed) {
  const GPTConfig& cf = config();
  const int64_t N = cf.mtp_num_layers, L = cf.num_layers, n = batch.b * batch.t, c = cf.hidden_size;
  const int64_t vt = cf.padded_vocab_size / tensor_size();
  const SeqRows r = SeqRowsOf(batch, sequence_parallel_, tensor_size(), tensor_rank());
  const int64_t rows = r.b * r.tl;
  const double p = train ? cf.hidden_dropout : 0.0;
  const float* P = params_.data();
  float* G = grads_.data();
  Activations& main = *act_;
  for (int64_t k = N - 1; k >= 0; --k) {
    MtpState::Depth& d = mtp_->depths[static_cast<size_t>(k)];
    const MtpLayerParams& mp = layout_.mtp[static_cast<size_t>(k)];
    ModelBatch bk = batch;
    bk.tokens = d.tokens.data(), bk.position_ids = d.positions.data(), bk.labels = d.labels.data();
    bk.loss_mask = d.mask.data();
    dlnf_extra_ = k + 1 < N ? mtp_->depths[static_cast<size_t>(k + 1)].dh.data() : nullptr;
    {
      MtpSwap swap(this, &d, k);
      PTK_RETURN_IF_ERROR(RunBackward(bk, train, seed));
    }
    dlnf_extra_ = nullptr;
    PTK_RETURN_IF_ERROR(MtpProjBackward(k, bk));
    for (int64_t i = 0; i < rows; ++i) {  // dx's halves: the normalised embedding's and hidden states' gradients
      std::copy(d.dx.begin() + 2 * i * c, d.dx.begin() + (2 * i + 1) * c, d.en.begin() + i * c);
      std::copy(d.dx.begin() + (2 * i + 1) * c, d.dx.begin() + (2 * i + 2) * c, d.hn.begin() + i * c);
    }
    std::fill(d.demb.begin(), d.demb.end(), 0.0f);
    NormBackward(cf, d.demb.data(), G, d.en.data(), d.emb.data(), P, mp.enorm_w, mp.enorm_b, d.en_mean.data(),
                 d.en_rstd.data(), rows, c);
    float* demb = d.demb.data();
    if (sequence_parallel_) {  // the embedding's gradient at all positions (its reduce-scatter's gradient)
      d.whole.resize(static_cast<size_t>(n * c));
      PTK_RETURN_IF_ERROR(GatherSeqRows(tensor_comm_, d.demb.data(), d.whole.data(), r, c, &d.buf));
      demb = d.whole.data();
    }
    EmbeddingDropout(demb, batch, c, p, seed, L + 1 + k);
    if (!tp())
      cpu::EmbeddingBackward(G + layout_.wte, At(G, layout_.wpe), demb, bk.tokens, bk.position_ids, n, c);
    else
      cpu::VocabSliceEmbeddingBackward(G + layout_.wte, At(G, layout_.wpe), demb, bk.tokens, bk.position_ids,
                                       tensor_rank() * vt, vt, n, c);
    const float* h = k == 0 ? main.lnf.data() : mtp_->depths[static_cast<size_t>(k - 1)].act.lnf.data();
    std::fill(d.dh.begin(), d.dh.end(), 0.0f);
    NormBackward(cf, d.dh.data(), G, d.hn.data(), h, P, mp.hnorm_w, mp.hnorm_b, d.hn_mean.data(), d.hn_rstd.data(),
                 rows, c);
  }
  dlnf_extra_ = mtp_->depths[0].dh.data();  // the decoder's output: its gradient from the first depth's hnorm
  return absl::OkStatus();
}

int64_t CpuGPTModel::PlanMtpActivationFloats(const ParamLayout& layout, int64_t micro_batch_size,
                                             bool sequence_parallel) {
  const int64_t b = micro_batch_size, t = layout.config.seq_length, n = b * t, c = layout.config.hidden_size;
  const bool sp = sequence_parallel && layout.tensor_size > 1;
  const int64_t rows = sp ? n / layout.tensor_size : n;  // this rank's positions'
  int64_t floats = 0;
  for (size_t k = 0; k < layout.mtp.size(); ++k) {
    floats += SizeActivations(DepthLayout(layout, static_cast<int64_t>(k)), 0, sp, b, t, 1, nullptr);
    // emb, demb (whole); en, hn, dh; x, dx; the norms' statistics; tokens, positions, labels and mask (4 bytes
    // each); under tensor parallelism eh_proj's columns and their gathered whole; under sequence parallelism
    // eh_proj's gathered input, its gradient and the collectives' staging.
    floats += 2 * n * c + 3 * rows * c + 4 * rows * c + 4 * rows + 4 * n +
              (layout.tensor_size > 1 ? n * c / layout.tensor_size + n * c : 0) + (sp ? 6 * n * c : 0);
  }
  return floats + (layout.mtp.empty() ? 0 : rows * c);  // the kept gradient of the decoder's output
}

}  // namespace ptk
