// Megatron's GPT on the CPU: parameter layout, init, forward and backward over the CPU ops.
#include "trainer/gpt_model.h"

#include <cmath>
#include <cstring>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/ops_cpu.h"

namespace ptk::trainer {
namespace {

inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Standard normal from a counter (Box-Muller on two 53-bit uniforms).
double CounterNormal(uint64_t key, uint64_t i) {
  uint64_t a = Mix64(key + 2 * i * 0x9e3779b97f4a7c15ULL), b = Mix64(key + (2 * i + 1) * 0x9e3779b97f4a7c15ULL);
  double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

enum Site : uint64_t { kEmbeddingDropout = 0, kAttentionOutDropout = 1, kMlpOutDropout = 2, kAttentionProbs = 3 };

}  // namespace

absl::Status GPTConfig::Validate() const {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (num_layers < 1) return bad("--num-layers must be at least 1");
  if (hidden_size < 1) return bad("--hidden-size must be at least 1");
  if (num_attention_heads < 1 || hidden_size % num_attention_heads != 0)
    return bad(fmt::format("--hidden-size ({}) must be a multiple of --num-attention-heads ({})", hidden_size,
                           num_attention_heads));
  if (ffn_hidden_size < 1) return bad("--ffn-hidden-size must be at least 1");
  if (seq_length < 1) return bad("--seq-length must be at least 1");
  if (max_position_embeddings < seq_length)
    return bad(fmt::format("--max-position-embeddings ({}) must be at least --seq-length ({})", max_position_embeddings,
                           seq_length));
  if (vocab_size < 1 || padded_vocab_size < vocab_size) return bad("the vocabulary size must be at least 1");
  if (hidden_dropout < 0 || hidden_dropout >= 1) return bad("--hidden-dropout must be in [0, 1)");
  if (attention_dropout < 0 || attention_dropout >= 1) return bad("--attention-dropout must be in [0, 1)");
  if (!(layernorm_epsilon > 0)) return bad("--layernorm-epsilon must be positive");
  if (!(init_method_std > 0)) return bad("--init-method-std must be positive");
  return absl::OkStatus();
}

int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by) {
  if (divisible_by <= 1) return vocab_size;
  return (vocab_size + divisible_by - 1) / divisible_by * divisible_by;
}

// Per-layer parameter offsets into the flat buffers.
struct LayerParams {
  int64_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct GPTModel::Activations {
  int64_t b = 0, t = 0;
  std::vector<LayerParams> layers;
  int64_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0, out_w = 0;
  // Per layer (index l): resid[l] is the input of layer l; resid[L] the input of the final norm.
  std::vector<std::vector<float>> resid, resid_mid, ln1, ln1_mean, ln1_rstd, qkv, probs, atty, ln2, ln2_mean, ln2_rstd,
      fc1, gelu;
  std::vector<float> lnf, lnf_mean, lnf_rstd, logits, losses, dloss, tmp, dresid, dtmp, dln, dff, dqkv, datt, scratch;
  std::vector<int32_t> targets;
  std::vector<uint64_t> streams;
};

GPTModel::GPTModel(const GPTConfig& config) : config_(config), act_(std::make_unique<Activations>()) {}
GPTModel::~GPTModel() = default;

absl::StatusOr<std::unique_ptr<GPTModel>> GPTModel::Create(const GPTConfig& config) {
  PTK_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<GPTModel> m(new GPTModel(config));
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, vp = config.padded_vocab_size;
  const double std = config.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double init_std, float init_value = 0.0f) {
    ParamInfo p;
    p.name = name;
    p.shape = std::move(shape);
    p.size = 1;
    for (int64_t d : p.shape) p.size *= d;
    p.offset = offset;
    p.no_weight_decay = p.shape.size() == 1;
    p.init_std = init_std;
    p.init_value = init_value;
    offset += p.size;
    m->infos_.push_back(std::move(p));
    return m->infos_.back().offset;
  };
  Activations& a = *m->act_;
  a.wte = add("embedding.word_embeddings.weight", {vp, c}, std);
  a.wpe = add("embedding.position_embeddings.weight", {config.max_position_embeddings, c}, std);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    std::string p = fmt::format("decoder.layers.{}.", l);
    LayerParams lp;
    lp.ln1_w = add(p + "input_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln1_b = add(p + "input_layernorm.bias", {c}, 0.0);
    lp.qkv_w = add(p + "self_attention.linear_qkv.weight", {3 * c, c}, std);
    lp.qkv_b = add(p + "self_attention.linear_qkv.bias", {3 * c}, 0.0);
    lp.proj_w = add(p + "self_attention.linear_proj.weight", {c, c}, out_std);
    lp.proj_b = add(p + "self_attention.linear_proj.bias", {c}, 0.0);
    lp.ln2_w = add(p + "pre_mlp_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln2_b = add(p + "pre_mlp_layernorm.bias", {c}, 0.0);
    lp.fc1_w = add(p + "mlp.linear_fc1.weight", {f, c}, std);
    lp.fc1_b = add(p + "mlp.linear_fc1.bias", {f}, 0.0);
    lp.fc2_w = add(p + "mlp.linear_fc2.weight", {c, f}, out_std);
    lp.fc2_b = add(p + "mlp.linear_fc2.bias", {c}, 0.0);
    a.layers.push_back(lp);
  }
  a.lnf_w = add("decoder.final_layernorm.weight", {c}, 0.0, 1.0f);
  a.lnf_b = add("decoder.final_layernorm.bias", {c}, 0.0);
  a.out_w = config.untie_embeddings_and_output_weights ? add("output_layer.weight", {vp, c}, std) : a.wte;
  m->params_.assign(static_cast<size_t>(offset), 0.0f);
  m->grads_.assign(static_cast<size_t>(offset), 0.0f);
  return m;
}

const ParamInfo* GPTModel::FindParam(const std::string& name) const {
  for (const ParamInfo& p : infos_)
    if (p.name == name) return &p;
  return nullptr;
}

void GPTModel::InitWeights(uint64_t seed) {
  for (size_t k = 0; k < infos_.size(); ++k) {
    const ParamInfo& p = infos_[k];
    float* w = params_.data() + p.offset;
    if (p.init_std == 0.0) {
      std::fill(w, w + p.size, p.init_value);
      continue;
    }
    uint64_t key = Mix64(seed * 0x9e3779b97f4a7c15ULL + k + 1);
    for (int64_t i = 0; i < p.size; ++i) w[i] = static_cast<float>(p.init_std * CounterNormal(key, i));
  }
}

void GPTModel::ZeroGrads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

absl::Status GPTModel::Prepare(const ModelBatch& batch) {
  const GPTConfig& cf = config_;
  if (batch.b < 1 || batch.t < 1 || batch.t > cf.seq_length)
    return absl::InvalidArgumentError(
        fmt::format("micro-batch of {}x{} tokens for a model of --seq-length {}", batch.b, batch.t, cf.seq_length));
  const int64_t n = batch.b * batch.t;
  for (int64_t i = 0; i < n; ++i) {
    if (batch.tokens[i] < 0 || batch.tokens[i] >= cf.padded_vocab_size || batch.labels[i] < 0 ||
        batch.labels[i] >= cf.padded_vocab_size)
      return absl::InvalidArgumentError(
          fmt::format("sample row {}, position {}: token id {} / label {} outside the vocabulary of {} (padded {}); "
                      "was the data tokenized with another vocabulary?",
                      i / batch.t, i % batch.t, batch.tokens[i], batch.labels[i], cf.vocab_size, cf.padded_vocab_size));
    if (batch.position_ids[i] < 0 || batch.position_ids[i] >= cf.max_position_embeddings)
      return absl::InvalidArgumentError(fmt::format("position id {} outside --max-position-embeddings {}",
                                                    batch.position_ids[i], cf.max_position_embeddings));
  }
  Activations& a = *act_;
  if (a.b == batch.b && a.t == batch.t) return absl::OkStatus();
  a.b = batch.b;
  a.t = batch.t;
  const int64_t c = cf.hidden_size, f = cf.ffn_hidden_size, vp = cf.padded_vocab_size, L = cf.num_layers;
  const int64_t probs = batch.b * cf.num_attention_heads * batch.t * batch.t;
  auto per_layer = [&](std::vector<std::vector<float>>& v, int64_t count, int64_t size) {
    v.assign(static_cast<size_t>(count), std::vector<float>(static_cast<size_t>(size)));
  };
  per_layer(a.resid, L + 1, n * c);
  per_layer(a.resid_mid, L, n * c);
  per_layer(a.ln1, L, n * c);
  per_layer(a.ln1_mean, L, n);
  per_layer(a.ln1_rstd, L, n);
  per_layer(a.qkv, L, n * 3 * c);
  per_layer(a.probs, cf.recompute_activations ? 1 : L, probs);
  per_layer(a.atty, L, n * c);
  per_layer(a.ln2, L, n * c);
  per_layer(a.ln2_mean, L, n);
  per_layer(a.ln2_rstd, L, n);
  per_layer(a.fc1, L, n * f);
  per_layer(a.gelu, L, n * f);
  a.lnf.assign(n * c, 0.0f);
  a.lnf_mean.assign(n, 0.0f);
  a.lnf_rstd.assign(n, 0.0f);
  a.logits.assign(n * vp, 0.0f);
  a.losses.assign(n, 0.0f);
  a.dloss.assign(n, 0.0f);
  a.tmp.assign(n * c, 0.0f);
  a.dresid.assign(n * c, 0.0f);
  a.dtmp.assign(n * c, 0.0f);
  a.dln.assign(n * c, 0.0f);
  a.dff.assign(n * f, 0.0f);
  a.dqkv.assign(n * 3 * c, 0.0f);
  a.datt.assign(n * c, 0.0f);
  a.scratch.assign(2 * batch.t * batch.t, 0.0f);
  a.targets.assign(n, 0);
  a.streams.assign(batch.b, 0);
  return absl::OkStatus();
}

namespace {
// Dropout of a (b, t, c) buffer, each sample row with its own stream.
void DropoutRows(float* x, const ModelBatch& batch, int64_t c, double p, uint64_t seed, uint64_t layer, uint64_t site) {
  if (p <= 0.0) return;
  for (int64_t b = 0; b < batch.b; ++b)
    DropoutCpu(x + b * batch.t * c, batch.t * c, p, seed,
               DropoutStream(static_cast<uint64_t>(batch.sample_keys[b]), layer, site));
}

void AttentionStreams(const ModelBatch& batch, int64_t layer, std::vector<uint64_t>* streams) {
  for (int64_t b = 0; b < batch.b; ++b)
    (*streams)[b] = DropoutStream(static_cast<uint64_t>(batch.sample_keys[b]), layer, kAttentionProbs);
}

// What one forward or backward pass over `batch` works with: tokens n, hidden c, ffn f, padded
// vocab vp, the dropout rates (zero when not training), the attention shape, the layer count.
struct PassDims {
  int64_t n, c, f, vp;
  double hp, ap;
  AttentionShape shape;
  uint64_t layers;
};
PassDims DimsOf(const GPTConfig& cf, const ModelBatch& batch, bool train) {
  return {batch.b * batch.t,
          cf.hidden_size,
          cf.ffn_hidden_size,
          cf.padded_vocab_size,
          train ? cf.hidden_dropout : 0.0,
          train ? cf.attention_dropout : 0.0,
          AttentionShape{batch.b, batch.t, cf.num_attention_heads, cf.head_dim()},
          static_cast<uint64_t>(cf.num_layers)};
}
}  // namespace

void GPTModel::RunForward(const ModelBatch& batch, bool train, uint64_t seed) {
  const GPTConfig& cf = config_;
  Activations& a = *act_;
  const auto [n, c, f, vp, hp, ap, shape, L] = DimsOf(cf, batch, train);
  const float* P = params_.data();

  EmbeddingForwardCpu(a.resid[0].data(), batch.tokens, batch.position_ids, P + a.wte, P + a.wpe, n, c);
  DropoutRows(a.resid[0].data(), batch, c, hp, seed, L, kEmbeddingDropout);
  for (int64_t l = 0; l < cf.num_layers; ++l) {
    const LayerParams& lp = a.layers[l];
    LayerNormForwardCpu(a.ln1[l].data(), a.ln1_mean[l].data(), a.ln1_rstd[l].data(), a.resid[l].data(), P + lp.ln1_w,
                        P + lp.ln1_b, n, c, cf.layernorm_epsilon);
    MatmulForwardCpu(a.qkv[l].data(), a.ln1[l].data(), P + lp.qkv_w, P + lp.qkv_b, n, c, 3 * c);
    if (ap > 0.0) AttentionStreams(batch, l, &a.streams);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    AttentionForwardCpu(a.atty[l].data(), probs, a.qkv[l].data(), shape, ap, seed, a.streams.data());
    MatmulForwardCpu(a.tmp.data(), a.atty[l].data(), P + lp.proj_w, P + lp.proj_b, n, c, c);
    DropoutRows(a.tmp.data(), batch, c, hp, seed, l, kAttentionOutDropout);
    for (int64_t i = 0; i < n * c; ++i) a.resid_mid[l][i] = a.resid[l][i] + a.tmp[i];
    LayerNormForwardCpu(a.ln2[l].data(), a.ln2_mean[l].data(), a.ln2_rstd[l].data(), a.resid_mid[l].data(),
                        P + lp.ln2_w, P + lp.ln2_b, n, c, cf.layernorm_epsilon);
    MatmulForwardCpu(a.fc1[l].data(), a.ln2[l].data(), P + lp.fc1_w, P + lp.fc1_b, n, c, f);
    GeluForwardCpu(a.gelu[l].data(), a.fc1[l].data(), n * f);
    MatmulForwardCpu(a.tmp.data(), a.gelu[l].data(), P + lp.fc2_w, P + lp.fc2_b, n, f, c);
    DropoutRows(a.tmp.data(), batch, c, hp, seed, l, kMlpOutDropout);
    for (int64_t i = 0; i < n * c; ++i) a.resid[l + 1][i] = a.resid_mid[l][i] + a.tmp[i];
  }
  LayerNormForwardCpu(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), a.resid[cf.num_layers].data(), P + a.lnf_w,
                      P + a.lnf_b, n, c, cf.layernorm_epsilon);
  MatmulForwardCpu(a.logits.data(), a.lnf.data(), P + a.out_w, static_cast<const float*>(nullptr), n, c, vp);
}

void GPTModel::RunBackward(const ModelBatch& batch, bool train, uint64_t seed) {
  const GPTConfig& cf = config_;
  Activations& a = *act_;
  const auto [n, c, f, vp, hp, ap, shape, L] = DimsOf(cf, batch, train);
  const float* P = params_.data();
  float* G = grads_.data();

  std::fill(a.dln.begin(), a.dln.end(), 0.0f);
  MatmulBackwardCpu(a.dln.data(), G + a.out_w, static_cast<float*>(nullptr), a.logits.data(), a.lnf.data(), P + a.out_w,
                    n, c, vp);
  std::fill(a.dresid.begin(), a.dresid.end(), 0.0f);
  LayerNormBackwardCpu(a.dresid.data(), G + a.lnf_w, G + a.lnf_b, a.dln.data(), a.resid[cf.num_layers].data(),
                       P + a.lnf_w, a.lnf_mean.data(), a.lnf_rstd.data(), n, c);
  for (int64_t l = cf.num_layers - 1; l >= 0; --l) {
    const LayerParams& lp = a.layers[l];
    // MLP: resid[l+1] = resid_mid + dropout(fc2(gelu(fc1(ln2(resid_mid)))))
    a.dtmp = a.dresid;
    DropoutRows(a.dtmp.data(), batch, c, hp, seed, l, kMlpOutDropout);
    std::fill(a.dff.begin(), a.dff.end(), 0.0f);
    MatmulBackwardCpu(a.dff.data(), G + lp.fc2_w, G + lp.fc2_b, a.dtmp.data(), a.gelu[l].data(), P + lp.fc2_w, n, f, c);
    GeluBackwardCpu(a.dff.data(), a.fc1[l].data(), a.dff.data(), n * f);
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    MatmulBackwardCpu(a.dln.data(), G + lp.fc1_w, G + lp.fc1_b, a.dff.data(), a.ln2[l].data(), P + lp.fc1_w, n, c, f);
    LayerNormBackwardCpu(a.dresid.data(), G + lp.ln2_w, G + lp.ln2_b, a.dln.data(), a.resid_mid[l].data(), P + lp.ln2_w,
                         a.ln2_mean[l].data(), a.ln2_rstd[l].data(), n, c);
    // Attention: resid_mid = resid[l] + dropout(proj(attention(qkv(ln1(resid[l])))))
    a.dtmp = a.dresid;
    DropoutRows(a.dtmp.data(), batch, c, hp, seed, l, kAttentionOutDropout);
    std::fill(a.datt.begin(), a.datt.end(), 0.0f);
    MatmulBackwardCpu(a.datt.data(), G + lp.proj_w, G + lp.proj_b, a.dtmp.data(), a.atty[l].data(), P + lp.proj_w, n, c,
                      c);
    if (ap > 0.0) AttentionStreams(batch, l, &a.streams);
    float* probs = a.probs[cf.recompute_activations ? 0 : l].data();
    if (cf.recompute_activations)  // recompute the probabilities; the output lands in a scratch buffer
      AttentionForwardCpu(a.tmp.data(), probs, a.qkv[l].data(), shape, ap, seed, a.streams.data());
    AttentionBackwardCpu(a.dqkv.data(), a.datt.data(), a.qkv[l].data(), probs, shape, ap, seed, a.streams.data(),
                         a.scratch.data());
    std::fill(a.dln.begin(), a.dln.end(), 0.0f);
    MatmulBackwardCpu(a.dln.data(), G + lp.qkv_w, G + lp.qkv_b, a.dqkv.data(), a.ln1[l].data(), P + lp.qkv_w, n, c,
                      3 * c);
    LayerNormBackwardCpu(a.dresid.data(), G + lp.ln1_w, G + lp.ln1_b, a.dln.data(), a.resid[l].data(), P + lp.ln1_w,
                         a.ln1_mean[l].data(), a.ln1_rstd[l].data(), n, c);
  }
  DropoutRows(a.dresid.data(), batch, c, hp, seed, L, kEmbeddingDropout);
  EmbeddingBackwardCpu(G + a.wte, G + a.wpe, a.dresid.data(), batch.tokens, batch.position_ids, n, c);
}

namespace {
LossSum SumLosses(const std::vector<float>& losses, const float* mask, int64_t n) {
  LossSum s;
  for (int64_t i = 0; i < n; ++i) {
    if (mask[i] == 0.0f) continue;
    s.loss_sum += static_cast<double>(losses[i]) * mask[i];
    s.tokens += mask[i];
  }
  return s;
}
}  // namespace

absl::StatusOr<LossSum> GPTModel::ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                                  uint64_t seed) {
  PTK_RETURN_IF_ERROR(Prepare(batch));
  bool dropout = train && (config_.hidden_dropout > 0 || config_.attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  RunForward(batch, train, seed);
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t;
  for (int64_t i = 0; i < n; ++i) a.dloss[i] = static_cast<float>(batch.loss_mask[i] * loss_scale);
  SoftmaxCrossEntropyFusedCpu(a.logits.data(), a.losses.data(), batch.labels, a.dloss.data(), n,
                              config_.padded_vocab_size);
  LossSum s = SumLosses(a.losses, batch.loss_mask, n);
  RunBackward(batch, train, seed);
  return s;
}

absl::StatusOr<LossSum> GPTModel::Forward(const ModelBatch& batch, std::vector<float>* logits) {
  PTK_RETURN_IF_ERROR(Prepare(batch));
  RunForward(batch, /*train=*/false, 0);
  Activations& a = *act_;
  SoftmaxCrossEntropyForwardCpu(a.losses.data(), a.logits.data(), batch.labels, batch.b * batch.t,
                                config_.padded_vocab_size);
  if (logits) *logits = a.logits;
  return SumLosses(act_->losses, batch.loss_mask, batch.b * batch.t);
}

}  // namespace ptk::trainer
