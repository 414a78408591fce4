// What every backend shares: the configuration's checks, the parameter layout and its init, the
// batch checks.
#include "trainer/gpt_model.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/model_limits.h"

namespace ptk {

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
  if (!(layernorm_epsilon > 0 && layernorm_epsilon <= kGptConfigMaxLayerNormEpsilon))
    return bad(fmt::format("--layernorm-epsilon must be in (0, {}]", kGptConfigMaxLayerNormEpsilon));
  if (!(init_method_std > 0 && init_method_std <= kGptConfigMaxInitMethodStd))
    return bad(fmt::format("--init-method-std must be in (0, {}]", kGptConfigMaxInitMethodStd));
  return absl::OkStatus();
}

int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by) {
  if (divisible_by <= 1) return vocab_size;
  return (vocab_size + divisible_by - 1) / divisible_by * divisible_by;
}

std::string_view DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }
std::string_view PrecisionName(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: break;
  }
  return "fp32";
}

absl::StatusOr<ParamLayout> ParamLayout::Create(const GPTConfig& config) {
  PTK_RETURN_IF_ERROR(config.Validate());
  ParamLayout m;
  m.config = config;
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
    m.infos.push_back(std::move(p));
    return m.infos.back().offset;
  };
  m.wte = add("embedding.word_embeddings.weight", {vp, c}, std);
  m.wpe = add("embedding.position_embeddings.weight", {config.max_position_embeddings, c}, std);
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
    m.layers.push_back(lp);
  }
  m.lnf_w = add("decoder.final_layernorm.weight", {c}, 0.0, 1.0f);
  m.lnf_b = add("decoder.final_layernorm.bias", {c}, 0.0);
  m.out_w = config.untie_embeddings_and_output_weights ? add("output_layer.weight", {vp, c}, std) : m.wte;
  m.num_params = offset;
  return m;
}

const ParamInfo* ParamLayout::Find(const std::string& name) const {
  for (const ParamInfo& p : infos)
    if (p.name == name) return &p;
  return nullptr;
}

void ParamLayout::InitWeights(uint64_t seed, std::span<float> out) const {
  for (size_t k = 0; k < infos.size(); ++k) {
    const ParamInfo& p = infos[k];
    float* w = out.data() + p.offset;
    if (p.init_std == 0.0) {
      std::fill(w, w + p.size, p.init_value);
      continue;
    }
    const uint64_t key = InitKey(seed, k);
    for (int64_t i = 0; i < p.size; ++i) w[i] = static_cast<float>(p.init_std * CounterNormal(key, i));
  }
}

absl::Status GPTModel::InitWeights(uint64_t seed) {
  std::vector<float> host(static_cast<size_t>(num_params()));
  layout_.InitWeights(seed, host);
  return WriteParams(host);
}

absl::Status GPTModel::ReadOwnedParams(std::span<float> out) const {
  if (static_cast<int64_t>(out.size()) != moments_size())
    return absl::InvalidArgumentError(
        fmt::format("ReadOwnedParams: {} values for a range of {} parameters", out.size(), moments_size()));
  std::vector<float> all(static_cast<size_t>(num_params()));
  PTK_RETURN_IF_ERROR(ReadParams(all));
  std::copy_n(all.begin() + moments_begin(), moments_size(), out.begin());
  return absl::OkStatus();
}

absl::Status GPTModel::ShardOptimizerState(const ParamShard& shard) {
  if (shard_) return absl::FailedPreconditionError("the optimizer state is sharded already");
  if (shard.num_params != num_params())
    return absl::InvalidArgumentError(
        fmt::format("a shard of {} parameters for a model of {}", shard.num_params, num_params()));
  PTK_RETURN_IF_ERROR(ResizeMoments(shard));
  shard_ = shard;
  return absl::OkStatus();
}

absl::Status GPTModel::StartGradReduction(Communicator* comm, const std::vector<GradRange>& buckets) {
  if (reduce_comm_) return absl::FailedPreconditionError("a gradient reduction is armed already");
  int64_t at = num_params();
  for (const GradRange& b : buckets) {  // contiguous, descending, tiling the buffer
    if (b.end != at || b.begin >= b.end)
      return absl::InvalidArgumentError("gradient buckets must tile the buffer from its end down");
    at = b.begin;
  }
  if (at != 0) return absl::InvalidArgumentError("gradient buckets must tile the buffer from its end down");
  if (ready_order_.empty()) ready_order_ = BackwardReadyOrder(layout_);
  tracker_ = BucketTracker(buckets);
  reduce_comm_ = comm;
  absl::Status st = BeginBucketReduction(buckets);
  if (!st.ok()) reduce_comm_ = nullptr;
  return st;
}

absl::Status GPTModel::FinishGradReduction() {
  if (!reduce_comm_) return absl::FailedPreconditionError("no gradient reduction is armed");
  absl::Status st = EndBucketReduction();
  if (st.ok() && !tracker_.AllDone())
    st = absl::InternalError("backward did not finish every gradient bucket (was ForwardBackward run?)");
  reduce_comm_ = nullptr;
  return st;
}

void GPTModel::GradsReady(size_t index) {
  if (!reduce_comm_) return;
  const GradRange& r = ready_order_[index];
  for (int b : tracker_.MarkReady(r.begin, r.end)) LaunchBucket(b, tracker_.buckets()[static_cast<size_t>(b)]);
}

absl::Status GPTModel::ReduceHostBucket(float* grads, const GradRange& range) {
  if (shard_) return reduce_comm_->ReduceScatterSum(grads + range.begin, shard_->CountsIn(range.begin, range.end));
  return reduce_comm_->AllReduceSum(grads + range.begin, range.size());
}

absl::Status ValidateBatch(const GPTConfig& cf, const ModelBatch& batch) {
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
  return absl::OkStatus();
}

absl::Status GPTModel::ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train,
                                               uint64_t seed) {
  PTK_ASSIGN_OR_RETURN(const LossSum s, ForwardBackward(batch, loss_scale, train, seed));
  deferred_.loss_sum += s.loss_sum;
  deferred_.tokens += s.tokens;
  return absl::OkStatus();
}

absl::StatusOr<LossSum> GPTModel::TakeLosses() {
  const LossSum s = deferred_;
  deferred_ = LossSum{};
  return s;
}

absl::Status GPTModel::ScaledAdamWUpdate(double grad_scale, const AdamWParams& decay, const AdamWParams& no_decay) {
  if (grad_scale != 1.0) PTK_RETURN_IF_ERROR(ScaleGrads(grad_scale));
  return AdamWUpdate(decay, no_decay);
}

}  // namespace ptk
