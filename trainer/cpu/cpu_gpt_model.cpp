// Megatron's GPT on the CPU: forward and backward over the fp32 CPU ops (the passes in cpu_gpt_model_pass.cpp),
// parameters, gradients and AdamW moments in host vectors, the activations sized for a micro-batch.
#include "trainer/cpu/cpu_gpt_model.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/moe_capacity_cpu.h"
#include "trainer/cpu/ops_cpu.h"
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
                                                                 bool sequence_parallel, const PipelineStage& stage,
                                                                 Communicator* expert, Communicator* expert_data) {
  const int size = tensor ? tensor->size() : 1, rank = tensor ? tensor->rank() : 0;
  const int ep = expert ? expert->size() : 1;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout,
                       ParamLayout::Create(config, size, rank, stage, ep, ep > 1 ? expert->rank() : 0));
  auto model = std::unique_ptr<CpuGPTModel>(new CpuGPTModel(std::move(layout)));
  if (size > 1) model->tensor_comm_ = tensor;
  if (ep > 1) {
    model->expert_comm_ = expert;
    model->expert_data_comm_ = expert_data;
  }
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
  if (ranges_sharded()) {
    for (const GradRange& g : owned_ranges()) cpu::Scale(grads_.data() + g.begin, g.size(), static_cast<float>(s));
    return absl::OkStatus();
  }
  cpu::Scale(grads_.data() + moments_begin(), moments_size(), static_cast<float>(s));
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AdamWUpdate(const AdamWGroups& groups) {
  float *p = params_.data(), *g = grads_.data(), *m = exp_avg_.data(), *v = exp_avg_sq_.data();
  if (!shard() && !ranges_sharded()) {
    for (const ParamInfo& info : params_info()) {
      const int64_t o = info.offset;
      cpu::AdamW(p + o, g + o, m + o, v + o, info.size, groups.Of(info));
    }
    return absl::OkStatus();
  }
  if (ranges_sharded()) {  // the moments hold the owned ranges, packed
    int64_t at = 0;
    for (const GradRange& r : owned_ranges()) {
      for (const ParamPiece& piece : PiecesIn(layout(), r.begin, r.end)) {
        const int64_t o = piece.offset, k = at + (o - r.begin);
        cpu::AdamW(p + o, g + o, m + k, v + k, piece.size, groups.Of(piece));
      }
      at += r.size();
    }
    return absl::OkStatus();
  }
  // The moments hold the shard's range only.
  const int64_t base = shard()->begin();
  for (const ParamPiece& piece : PiecesIn(layout(), base, shard()->end())) {
    const int64_t o = piece.offset;
    cpu::AdamW(p + o, g + o, m + (o - base), v + (o - base), piece.size, groups.Of(piece));
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ResizeMoments(const ParamShard& shard) {
  exp_avg_.assign(static_cast<size_t>(shard.size()), 0.0f);
  exp_avg_sq_.assign(static_cast<size_t>(shard.size()), 0.0f);
  return absl::OkStatus();
}

absl::Status CpuGPTModel::ResizeMomentsPacked(int64_t n) {
  exp_avg_.assign(static_cast<size_t>(n), 0.0f);
  exp_avg_sq_.assign(static_cast<size_t>(n), 0.0f);
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
  if (config().mla()) PrepareMla(batch.t);
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
  const int64_t T = layout.tensor_size, c = cf.hidden_size, ct = cf.attention_width() / T, qkv = cf.qkv_rows() / T,
                f = cf.ffn_hidden_size / T, f1 = (cf.swiglu ? 2 : 1) * f, vp = cf.padded_vocab_size / T,
                L = static_cast<int64_t>(layout.layers.size());
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
  per_layer(&Activations::qkv, L, n * (qkv - cf.gate_rows() / T));
  const bool gated = cf.attention_output_gate && !cf.mla();
  per_layer(&Activations::gate, gated ? L : 0, n * ct);
  per_layer(&Activations::att_pre, gated ? L : 0, n * ct);
  put(&Activations::qkv_fused, gated ? n * qkv : 0);
  put(&Activations::dgate, gated ? n * ct : 0);
  put(&Activations::l2_ones, cf.qk_l2_norm ? cf.head_dim() : 0);
  if (a != nullptr) std::fill(a->l2_ones.begin(), a->l2_ones.end(), 1.0f);
  // The query and key norms' (--qk-layernorm's, --qk-l2-norm's); MLA's norms are its latents' (MlaActivations).
  const bool qk_norm = (cf.qk_layernorm || cf.qk_l2_norm) && !cf.mla();
  const int64_t qk_rows = qk_norm ? n * (cf.num_attention_heads + cf.query_groups()) / T : 0;
  per_layer(&Activations::qkv_raw, qk_norm ? L : 0, n * qkv);
  per_layer(&Activations::qk_mean,
            cf.qk_layernorm && !cf.mla() && cf.normalization == Normalization::kLayerNorm ? L : 0, qk_rows);
  per_layer(&Activations::qk_rstd, qk_norm ? L : 0, qk_rows);
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
  put(&Activations::dqkv, n * (qkv - cf.gate_rows() / T));
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
  put(&Activations::cp_gather, nw * (qkv - cf.gate_rows() / T));
  put(&Activations::cp_qkv, nw * (qkv - cf.gate_rows() / T));
  put(&Activations::cp_dqkv, nw * (qkv - cf.gate_rows() / T));
  if (a != nullptr) a->moe.assign(static_cast<size_t>(L), {});
  if (a != nullptr) a->shared.assign(static_cast<size_t>(L), {});
  for (int64_t l = l0; l < std::min(l1, L); ++l)  // what MoeActivations holds after a pass (moe_cpu.cpp's sizes)
    if (layout.layers[static_cast<size_t>(l)].router_w >= 0) {
      // A tensor rank's slice of each expert's ffn columns (MoeSettingsOf), as Megatron splits them by the tensor size.
      const int64_t K = cf.moe_router_topk, E = cf.num_experts, fm = cf.moe_ffn() / T, fm1 = (cf.swiglu ? 2 : 1) * fm;
      // With a capacity factor at most capacity rows per expert reach the experts, and the drop marks (bytes)
      // count a quarter float each.
      const bool drop = cf.moe_expert_capacity_factor >= 0;
      const int64_t rows_e =
          drop ? std::min(n * K, E * cpu::MoeExpertCapacity(n, K, E, cf.moe_expert_capacity_factor)) : n * K;
      floats += 3 * n * E + 3 * n * K + rows_e + E + 1 + rows_e * (4 * c + 2 * fm1 + 3 * fm) +
                (drop ? (n * K + 3) / 4 : 0);  // integers counted as floats
      if (cf.moe_shared_expert_intermediate_size > 0)
        floats += cpu::SharedExpertActivationFloats(cpu_model_detail::SharedExpertSettingsOf(cf, T), n, c);
    }
  if (a != nullptr) a->mla.assign(static_cast<size_t>(cf.mla() ? L : 0), {});
  if (cf.mla()) {  // what MlaActivations holds after a pass (mla_cpu.cpp's sizes), and MLA's rotary tables
    cpu::MlaSettings s;
    s.b = b, s.t = t, s.q_lora = cf.q_lora_rank, s.kv_lora = cf.kv_lora_rank, s.pe = cf.qk_pos_emb_head_dim;
    s.norms = cf.qk_layernorm, s.rms = cf.normalization == Normalization::kRMSNorm;
    floats += (std::min(l1, L) - l0) * cpu::MlaActivationFloats(s) + t * s.pe;
  }
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
  for (const auto* layers :
       {&a.resid, &a.resid_mid, &a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.qkv_raw, &a.qk_mean, &a.qk_rstd, &a.probs,
        &a.atty, &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.fc1, &a.gelu, &a.gate, &a.att_pre})
    for (const std::vector<float>& v : *layers) floats += static_cast<int64_t>(v.size());
  for (const auto* v : {&a.lnf,       &a.dact,   &a.rope_cos,  &a.rope_sin,  &a.lnf_mean, &a.lnf_rstd, &a.logits,
                        &a.losses,    &a.dloss,  &a.tmp,       &a.dresid,    &a.dtmp,     &a.dln,      &a.dff,
                        &a.dqkv,      &a.datt,   &a.xent_work, &a.sp_local,  &a.sp_buf,   &a.sp_whole, &a.ln_grads,
                        &a.cp_gather, &a.cp_qkv, &a.cp_dqkv,   &a.qkv_fused, &a.dgate,    &a.l2_ones})
    floats += static_cast<int64_t>(v->size());
  for (const cpu::MoeActivations<float>& m : a.moe) {
    for (const auto* v : {&m.logits, &m.scores, &m.prob, &m.x, &m.fc1, &m.act, &m.scaled, &m.out, &m.dout, &m.dact,
                          &m.dfc1, &m.dx, &m.dprob, &m.dlogits})
      floats += static_cast<int64_t>(v->size());
    floats += static_cast<int64_t>(m.expert.size() + m.order.size() + m.begin.size());
    floats += static_cast<int64_t>((m.dropped.size() + 3) / 4);
  }
  for (const cpu::SharedExpertActivations<float>& m : a.shared) floats += m.Floats();
  for (const cpu::MlaActivations<float>& m : a.mla)
    for (const auto* v : {&m.qd, &m.qn, &m.q_mean, &m.q_rstd, &m.kvd, &m.kvc, &m.kvn, &m.kv_mean, &m.kv_rstd})
      floats += static_cast<int64_t>(v->size());
  floats += static_cast<int64_t>(a.mla_cos.size() + a.mla_sin.size());
  return floats;
}

}  // namespace ptk
