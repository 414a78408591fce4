// Megatron's GPT on the CPU: forward and backward over the fp32 CPU ops, parameters, gradients and
// AdamW moments in host vectors.
#include "trainer/cpu/cpu_gpt_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cpu/tensor_parallel_cpu.h"
#include "trainer/parallel_layout.h"

namespace ptk {

CpuGPTModel::CpuGPTModel(ParamLayout layout) : GPTModel(std::move(layout)) {
  slots_.push_back(std::make_unique<Activations>());
  act_ = slots_[0].get();
  const size_t n = static_cast<size_t>(num_params());
  params_.assign(n, 0.0f);
  grads_.assign(n, 0.0f);
  exp_avg_.assign(n, 0.0f);
  exp_avg_sq_.assign(n, 0.0f);
}
CpuGPTModel::~CpuGPTModel() = default;

absl::StatusOr<std::unique_ptr<CpuGPTModel>> CpuGPTModel::Create(const GPTConfig& config, Communicator* tensor,
                                                                 bool sequence_parallel, const PipelineStage& stage) {
  const int size = tensor ? tensor->size() : 1, rank = tensor ? tensor->rank() : 0;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(config, size, rank, stage));
  auto model = std::unique_ptr<CpuGPTModel>(new CpuGPTModel(std::move(layout)));
  if (size > 1) model->tensor_comm_ = tensor;
  if (size > 1 && sequence_parallel) {
    if (config.seq_length % size != 0)
      return absl::InvalidArgumentError(
          fmt::format("--sequence-parallel: --seq-length ({}) must be a multiple of --tensor-model-parallel-size ({})",
                      config.seq_length, size));
    model->sequence_parallel_ = true;
  }
  return model;
}

absl::Status CpuGPTModel::TensorSum(float* x, int64_t count) {
  if (!tp()) return absl::OkStatus();
  return tensor_comm_->AllReduceSum(x, count);
}

namespace {
absl::Status CheckSize(const char* what, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("{}: {} values for a model of {} parameters", what, got, want));
}
}  // namespace

absl::Status CpuGPTModel::ReadParams(std::span<float> out) const {
  PTK_RETURN_IF_ERROR(CheckSize("ReadParams", out.size(), num_params()));
  std::copy(params_.begin(), params_.end(), out.begin());
  return absl::OkStatus();
}
absl::Status CpuGPTModel::WriteParams(std::span<const float> in) {
  PTK_RETURN_IF_ERROR(CheckSize("WriteParams", in.size(), num_params()));
  std::copy(in.begin(), in.end(), params_.begin());
  return absl::OkStatus();
}
absl::Status CpuGPTModel::ReadGrads(std::span<float> out) const {
  PTK_RETURN_IF_ERROR(CheckSize("ReadGrads", out.size(), num_params()));
  std::copy(grads_.begin(), grads_.end(), out.begin());
  return absl::OkStatus();
}
absl::Status CpuGPTModel::ReadMoments(std::span<float> m, std::span<float> v) const {
  PTK_RETURN_IF_ERROR(CheckSize("ReadMoments", m.size(), moments_size()));
  PTK_RETURN_IF_ERROR(CheckSize("ReadMoments", v.size(), moments_size()));
  std::copy(exp_avg_.begin(), exp_avg_.end(), m.begin());
  std::copy(exp_avg_sq_.begin(), exp_avg_sq_.end(), v.begin());
  return absl::OkStatus();
}
absl::Status CpuGPTModel::WriteMoments(std::span<const float> m, std::span<const float> v) {
  PTK_RETURN_IF_ERROR(CheckSize("WriteMoments", m.size(), moments_size()));
  PTK_RETURN_IF_ERROR(CheckSize("WriteMoments", v.size(), moments_size()));
  std::copy(m.begin(), m.end(), exp_avg_.begin());
  std::copy(v.begin(), v.end(), exp_avg_sq_.begin());
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ZeroGrads() {
  std::fill(grads_.begin(), grads_.end(), 0.0f);
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AllReduceGrads(Communicator* comm) { return comm->AllReduceSum(grads_.data(), num_params()); }

absl::StatusOr<double> CpuGPTModel::GradSumSquares() {
  // A last pipeline stage's copy of the tied embeddings is the first stage's to count.
  const int64_t end = layout_.norm_end();
  if (tensor_rank() == 0) return cpu::SumSquares(grads_.data(), end);
  // Another tensor rank: its slices only (tensor rank 0 counts what every rank holds whole).
  double s = 0;
  for (const ParamInfo& p : params_info())
    if (p.tensor_split_dim >= 0 && p.offset < end) s += cpu::SumSquares(grads_.data() + p.offset, p.size);
  return s;
}

absl::Status CpuGPTModel::ScaleGrads(double s) {
  cpu::Scale(grads_.data() + moments_begin(), moments_size(), static_cast<float>(s));
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AdamWUpdate(const AdamWParams& decay, const AdamWParams& no_decay) {
  float *p = params_.data(), *g = grads_.data(), *m = exp_avg_.data(), *v = exp_avg_sq_.data();
  if (!shard()) {
    for (const ParamInfo& info : params_info()) {
      const int64_t o = info.offset;
      cpu::AdamW(p + o, g + o, m + o, v + o, info.size, info.no_weight_decay ? no_decay : decay);
    }
    return absl::OkStatus();
  }
  // The moments hold the shard's range only.
  const int64_t base = shard()->begin();
  for (const ParamPiece& piece : PiecesIn(layout(), base, shard()->end())) {
    const int64_t o = piece.offset;
    cpu::AdamW(p + o, g + o, m + (o - base), v + (o - base), piece.size, piece.no_weight_decay ? no_decay : decay);
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ResizeMoments(const ParamShard& shard) {
  exp_avg_.assign(static_cast<size_t>(shard.size()), 0.0f);
  exp_avg_sq_.assign(static_cast<size_t>(shard.size()), 0.0f);
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ReduceScatterGrads(Communicator* comm) {
  if (!shard()) return absl::FailedPreconditionError("ReduceScatterGrads needs a sharded optimizer state");
  return comm->ReduceScatterSum(grads_.data(), shard()->Counts());
}

absl::Status CpuGPTModel::GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) {
  if (begin < 0 || end > num_params() || begin > end || (begin < end && begin % ParamShard::kAlignment != 0))
    return absl::InvalidArgumentError(
        fmt::format("GradSumSquaresPartials: range [{}, {}) of {} parameters", begin, end, num_params()));
  // The blocks cpu::SumSquares adds over the whole buffer, one partial each (a pipeline stage's
  // embedding copy left out, as GradSumSquares).
  const int64_t counted = layout_.norm_end();
  for (int64_t b = begin; b < end; b += ParamShard::kAlignment) {
    const int64_t e = std::min(b + ParamShard::kAlignment, end);
    if (tensor_rank() == 0) {
      out->push_back(b < counted ? cpu::SumSquares(grads_.data() + b, std::min(e, counted) - b) : 0.0);
      continue;
    }
    double s = 0;  // another tensor rank: its slices only, as GradSumSquares
    for (const ParamPiece& piece : PiecesIn(layout(), b, std::min(e, counted)))
      if (piece.tensor_split_dim >= 0) s += cpu::SumSquares(grads_.data() + piece.offset, piece.size);
    out->push_back(s);
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AllGatherParams(Communicator* comm) {
  if (!shard()) return absl::FailedPreconditionError("AllGatherParams needs a sharded optimizer state");
  std::vector<int64_t> bytes = shard()->Counts();
  for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
  return comm->AllGather(params_.data(), bytes);
}

absl::Status CpuGPTModel::BeginBucketReduction(const std::vector<GradRange>& buckets) {
  buckets_ = buckets;
  worker_ = std::make_unique<BucketWorker>(
      [this](int bucket) { return ReduceHostBucket(grads_.data(), buckets_[static_cast<size_t>(bucket)]); });
  return absl::OkStatus();
}

void CpuGPTModel::LaunchBucket(int bucket, const GradRange&) { worker_->Enqueue(bucket); }

absl::Status CpuGPTModel::EndBucketReduction() {
  absl::Status st = worker_->Finish();
  worker_.reset();
  return st;
}

absl::Status CpuGPTModel::Prepare(const ModelBatch& batch) {
  PTK_RETURN_IF_ERROR(ValidateBatch(config(), batch));
  Activations& a = *act_;
  if (a.b == batch.b && a.t == batch.t && a.chunk == chunk_) return absl::OkStatus();
  a.b = batch.b;
  a.t = batch.t;
  a.chunk = chunk_;
  const int64_t C = cp() ? context_comm_->size() : 1;
  if (cp() && batch.t * C % (2 * C) != 0)
    return absl::InvalidArgumentError(fmt::format(
        "context parallelism: {} positions of a sample on each of {} context ranks do not make 2 x {} equal chunks",
        batch.t, C, C));
  if (cp()) context_positions_ = ContextParallelPositions(batch.t * C, static_cast<int>(C), context_comm_->rank());
  SizeActivations(layout_, chunk_, sequence_parallel_, batch.b, batch.t, C, &a);
  if (config().rope()) {  // the rotary tables of this sequence length (a context rank's: its positions' rows)
    const GPTConfig& cf = config();
    const int64_t half = cf.rotary_dim() / 2;
    std::vector<float> cos(static_cast<size_t>(batch.t * C * half)), sin(cos.size());
    cpu::RopeTables(cos.data(), sin.data(), batch.t * C, cf.rotary_dim(), cf.rope_settings());
    for (int64_t i = 0; i < batch.t; ++i) {
      const int64_t at = (cp() ? context_positions_[static_cast<size_t>(i)] : i) * half;
      std::copy(cos.begin() + at, cos.begin() + at + half, a.rope_cos.begin() + i * half);
      std::copy(sin.begin() + at, sin.begin() + at + half, a.rope_sin.begin() + i * half);
    }
  }
  return absl::OkStatus();
}

int64_t CpuGPTModel::SizeActivations(const ParamLayout& layout, int chunk, bool sequence_parallel, int64_t b, int64_t t,
                                     int64_t context, Activations* a) {
  const GPTConfig& cf = layout.config;
  const int64_t n = b * t;
  int64_t floats = 0;
  // One buffer: counted, and sized in `a` when there is one.
  auto put = [&](std::vector<float> Activations::*field, int64_t size) {
    floats += size;
    if (a != nullptr) (a->*field).assign(static_cast<size_t>(size), 0.0f);
  };
  // This rank's slices under tensor parallelism: heads, ffn columns, vocabulary rows.
  const int64_t T = layout.tensor_size, c = cf.hidden_size, ct = cf.num_attention_heads * cf.head_dim() / T,
                qkv = cf.qkv_rows() / T, f = cf.ffn_hidden_size / T, f1 = (cf.swiglu ? 2 : 1) * f,
                vp = cf.padded_vocab_size / T, L = static_cast<int64_t>(layout.layers.size());
  // Context parallelism: the attention of these t positions over the whole samples (t × context).
  const int64_t probs = b * (cf.num_attention_heads / T) * t * t * context;
  // A slot holds one model chunk's pass: the buffers of its layers [l0, l1) only (every layer
  // without chunks), indexed by the stage's layer.
  const int64_t l0 = chunk * layout.chunk_layers(), l1 = (chunk + 1) * layout.chunk_layers();
  auto per_layer = [&](std::vector<std::vector<float>> Activations::*field, int64_t count, int64_t size) {
    if (a != nullptr) (a->*field).assign(static_cast<size_t>(count), std::vector<float>());
    for (int64_t l = 0; l < count; ++l)
      if (count == 1 || (l >= l0 && l <= l1)) {
        floats += size;
        if (a != nullptr) (a->*field)[static_cast<size_t>(l)].assign(static_cast<size_t>(size), 0.0f);
      }
  };
  // The sequence-parallel region (the residual stream, the norms and their statistics) holds this
  // rank's rows only under sequence parallelism: b x t/T of them.
  const int64_t rows = sequence_parallel ? n / T : n;
  per_layer(&Activations::resid, L + 1, rows * c);
  per_layer(&Activations::resid_mid, L, rows * c);
  per_layer(&Activations::ln1, L, rows * c);
  per_layer(&Activations::ln1_mean, L, rows);
  per_layer(&Activations::ln1_rstd, L, rows);
  per_layer(&Activations::qkv, L, n * qkv);
  const int64_t qk_rows = cf.qk_layernorm ? n * (cf.num_attention_heads + cf.query_groups()) / T : 0;
  per_layer(&Activations::qkv_raw, cf.qk_layernorm ? L : 0, n * qkv);
  per_layer(&Activations::qk_mean, cf.qk_layernorm && cf.normalization == Normalization::kLayerNorm ? L : 0, qk_rows);
  per_layer(&Activations::qk_rstd, cf.qk_layernorm ? L : 0, qk_rows);
  per_layer(&Activations::probs, cf.recompute_activations ? 1 : L, probs);
  per_layer(&Activations::atty, L, n * ct);
  per_layer(&Activations::ln2, L, rows * c);
  per_layer(&Activations::ln2_mean, L, rows);
  per_layer(&Activations::ln2_rstd, L, rows);
  per_layer(&Activations::fc1, L, n * f1);
  per_layer(&Activations::gelu, L, n * f);
  // The final norm, logits and losses only where the pass ends in the loss (the last stage's last
  // chunk): a pipeline stage's other slots never touch them.
  const int64_t head = layout.ChunkPostProcess(chunk) ? 1 : 0;
  put(&Activations::lnf, head * rows * c);
  put(&Activations::lnf_mean, head * rows);
  put(&Activations::lnf_rstd, head * rows);
  put(&Activations::logits, head * n * vp);
  put(&Activations::losses, head * n);
  put(&Activations::dloss, head * n);
  // The vocabulary-parallel cross entropy's work buffer (cpu::VocabParallelCrossEntropy's size).
  put(&Activations::xent_work, head * (T > 1 ? (T + 2) * n : 0));
  put(&Activations::tmp, n * c);
  put(&Activations::dresid, rows * c);
  put(&Activations::dtmp, n * c);
  put(&Activations::dln, n * c);
  put(&Activations::dff, n * f1);
  put(&Activations::dact, cf.swiglu ? n * f : 0);
  put(&Activations::dqkv, n * qkv);
  const int64_t half = cf.rope() ? cf.rotary_dim() / 2 : 0;
  put(&Activations::rope_cos, t * half);
  put(&Activations::rope_sin, t * half);
  put(&Activations::datt, n * ct);
  const bool sp = sequence_parallel;
  put(&Activations::sp_local, sp ? rows * c : 0);
  put(&Activations::sp_buf, sp ? n * c : 0);
  put(&Activations::sp_whole, sp ? n * c : 0);
  put(&Activations::ln_grads, sp ? 2 * c : 0);
  const int64_t nw = context > 1 ? n * context : 0;
  put(&Activations::cp_gather, nw * qkv);
  put(&Activations::cp_qkv, nw * qkv);
  put(&Activations::cp_dqkv, nw * qkv);
  if (a != nullptr) {
    a->targets.assign(static_cast<size_t>(n), 0);
    a->streams.assign(static_cast<size_t>(b), 0);
  }
  return floats;
}

int64_t CpuGPTModel::PlanActivationFloats(const ParamLayout& layout, bool sequence_parallel, int64_t micro_batch_size,
                                          int context) {
  int64_t most = 0;  // the largest of the model chunks' slots
  for (int v = 0; v < layout.virtual_size; ++v)
    most = std::max(most, SizeActivations(layout, v, sequence_parallel && layout.tensor_size > 1, micro_batch_size,
                                          layout.config.seq_length / context, context, nullptr));
  return most;
}

int64_t CpuGPTModel::ActivationFloats() const {
  const Activations& a = *act_;
  int64_t floats = 0;
  for (const auto* layers : {&a.resid, &a.resid_mid, &a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.qkv_raw, &a.qk_mean,
                             &a.qk_rstd, &a.probs, &a.atty, &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.fc1, &a.gelu})
    for (const std::vector<float>& v : *layers) floats += static_cast<int64_t>(v.size());
  for (const auto* v :
       {&a.lnf,       &a.dact,     &a.rope_cos, &a.rope_sin, &a.lnf_mean, &a.lnf_rstd,  &a.logits, &a.losses,
        &a.dloss,     &a.tmp,      &a.dresid,   &a.dtmp,     &a.dln,      &a.dff,       &a.dqkv,   &a.datt,
        &a.xent_work, &a.sp_local, &a.sp_buf,   &a.sp_whole, &a.ln_grads, &a.cp_gather, &a.cp_qkv, &a.cp_dqkv})
    floats += static_cast<int64_t>(v->size());
  return floats;
}

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
          cf.num_attention_heads * cf.head_dim() / T,
          cf.ffn_hidden_size / T,
          cf.padded_vocab_size / T,
          train ? cf.hidden_dropout : 0.0,
          train ? cf.attention_dropout : 0.0,
          AttentionShape{batch.b, batch.t, cf.num_attention_heads / T, cf.head_dim(), cf.query_groups() / T},
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
using cpu_model_detail::MlpActivationBackward;
using cpu_model_detail::MlpActivationForward;
using cpu_model_detail::NormBackward;
using cpu_model_detail::NormForward;
using cpu_model_detail::QKNormLayerBackward;
using cpu_model_detail::QKNormLayerForward;
using cpu_model_detail::QkvProductOut;

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
  if (chunk_pre_process()) {
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
    cpu::MatmulForward(QkvProductOut(a, l, cf), a.ln1[l].data(), P + lp.qkv_w, At(P, lp.qkv_b), n, c,
                       shape.qkv_width());
    QKNormLayerForward(cf, a, l, P, lp, shape);
    if (cf.rope())
      cpu::RopeForward(a.qkv[l].data(), a.rope_cos.data(), a.rope_sin.data(), shape, cf.rotary_dim(),
                       cf.rotary_interleaved);
    if (ap > 0.0) AttentionStreams(batch, gl, head0, &a.streams);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    if (cp())
      PTK_RETURN_IF_ERROR(ContextAttentionForward(a.atty[l].data(), probs, a.qkv[l].data(), shape, ap, seed));
    else
      cpu::AttentionForward(a.atty[l].data(), probs, a.qkv[l].data(), shape, ap, seed, a.streams.data());
    PTK_RETURN_IF_ERROR(row_parallel(a.tmp.data(), a.atty[l].data(), lp.proj_w, lp.proj_b, ct));
    DropoutRows(a.tmp.data(), batch, c, hp, seed, gl, kAttentionOutDropout, context_positions_);
    for (int64_t i = 0; i < n * c; ++i) a.resid_mid[l][i] = a.resid[l][i] + a.tmp[i];
    NormForward(cf, a.ln2[l].data(), a.ln2_mean[l].data(), a.ln2_rstd[l].data(), a.resid_mid[l].data(), P, lp.ln2_w,
                lp.ln2_b, n, c);
    cpu::MatmulForward(a.fc1[l].data(), a.ln2[l].data(), P + lp.fc1_w, At(P, lp.fc1_b), n, c, (cf.swiglu ? 2 : 1) * f);
    MlpActivationForward(cf, a.gelu[l].data(), a.fc1[l].data(), n, f);
    PTK_RETURN_IF_ERROR(row_parallel(a.tmp.data(), a.gelu[l].data(), lp.fc2_w, lp.fc2_b, f));
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
    float* dact = cf.swiglu ? a.dact.data() : a.dff.data();  // the activation's output gradient
    std::fill(dact, dact + n * f, 0.0f);
    cpu::MatmulBackward(dact, G + lp.fc2_w, At(G, lp.fc2_b), a.dtmp.data(), a.gelu[l].data(), P + lp.fc2_w, n, f, c);
    MlpActivationBackward(cf, a.dff.data(), a.fc1[l].data(), dact, n, f);
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    cpu::MatmulBackward(a.dln.data(), G + lp.fc1_w, At(G, lp.fc1_b), a.dff.data(), a.ln2[l].data(), P + lp.fc1_w, n, c,
                        (cf.swiglu ? 2 : 1) * f);
    PTK_RETURN_IF_ERROR(TensorSum(a.dln.data(), n * c));  // column-parallel fc1: its input gradient summed
    NormBackward(cf, a.dresid.data(), G, a.dln.data(), a.resid_mid[l].data(), P, lp.ln2_w, lp.ln2_b,
                 a.ln2_mean[l].data(), a.ln2_rstd[l].data(), n, c);
    // Attention: resid_mid = resid[l] + dropout(proj(attention(qkv(ln1(resid[l])))))
    a.dtmp = a.dresid;
    DropoutRows(a.dtmp.data(), batch, c, hp, seed, gl, kAttentionOutDropout, context_positions_);
    std::fill(a.datt.begin(), a.datt.end(), 0.0f);
    cpu::MatmulBackward(a.datt.data(), G + lp.proj_w, At(G, lp.proj_b), a.dtmp.data(), a.atty[l].data(), P + lp.proj_w,
                        n, ct, c);
    if (ap > 0.0) AttentionStreams(batch, gl, head0, &a.streams);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    if (cf.recompute_activations && cp())  // recompute the probabilities; the output lands in a scratch buffer
      PTK_RETURN_IF_ERROR(ContextAttentionForward(a.tmp.data(), probs, a.qkv[l].data(), shape, ap, seed));
    else if (cf.recompute_activations)
      cpu::AttentionForward(a.tmp.data(), probs, a.qkv[l].data(), shape, ap, seed, a.streams.data());
    if (cp())
      PTK_RETURN_IF_ERROR(
          ContextAttentionBackward(a.dqkv.data(), a.datt.data(), a.qkv[l].data(), probs, shape, ap, seed));
    else
      cpu::AttentionBackward(a.dqkv.data(), a.datt.data(), a.qkv[l].data(), probs, shape, ap, seed, a.streams.data());
    if (cf.rope())
      cpu::RopeBackward(a.dqkv.data(), a.rope_cos.data(), a.rope_sin.data(), shape, cf.rotary_dim(),
                        cf.rotary_interleaved);
    QKNormLayerBackward(cf, a, l, P, G, lp, shape);
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    cpu::MatmulBackward(a.dln.data(), G + lp.qkv_w, At(G, lp.qkv_b), a.dqkv.data(), a.ln1[l].data(), P + lp.qkv_w, n, c,
                        shape.qkv_width());
    PTK_RETURN_IF_ERROR(TensorSum(a.dln.data(), n * c));  // column-parallel QKV: its input gradient summed
    NormBackward(cf, a.dresid.data(), G, a.dln.data(), a.resid[l].data(), P, lp.ln1_w, lp.ln1_b, a.ln1_mean[l].data(),
                 a.ln1_rstd[l].data(), n, c);
    GradsReady(static_cast<size_t>(stage_layers() - l));  // layer l
  }
  // A later pipeline stage leaves its input's gradient in dresid, for the previous stage.
  if (chunk_pre_process()) {
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
  PTK_RETURN_IF_ERROR(RunForward(batch, train, seed));
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t;
  for (int64_t i = 0; i < n; ++i) a.dloss[i] = static_cast<float>(batch.loss_mask[i] * loss_scale);
  PTK_RETURN_IF_ERROR(Loss(batch, a.dloss.data()));
  LossSum s = SumLosses(a.losses, batch.loss_mask, n);
  PTK_RETURN_IF_ERROR(RunBackward(batch, train, seed));
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
