// The configuration's checks and the parameter layout with its init.
#include "trainer/param_layout.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/model_limits.h"

namespace ptk {

// Worded by setting (GPTConfig's names, which are Megatron's argument names): a library knows no flags;
// ptk-train's flag resolution turns each name into its flag.
absl::Status GPTConfig::Validate() const {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  auto at_least_1 = [&](const char* name, int64_t v) { return bad(fmt::format("{} {}: must be at least 1", name, v)); };
  if (num_layers < 1) return at_least_1("num_layers", num_layers);
  if (hidden_size < 1) return at_least_1("hidden_size", hidden_size);
  if (num_attention_heads < 1) return at_least_1("num_attention_heads", num_attention_heads);
  if (hidden_size % num_attention_heads != 0)
    return bad(fmt::format("num_attention_heads {} does not divide hidden_size {}", num_attention_heads, hidden_size));
  if (ffn_hidden_size < 1) return at_least_1("ffn_hidden_size", ffn_hidden_size);
  if (seq_length < 1) return at_least_1("seq_length", seq_length);
  if (max_position_embeddings < seq_length)
    return bad(
        fmt::format("max_position_embeddings {} is less than seq_length {}", max_position_embeddings, seq_length));
  if (vocab_size < 1) return at_least_1("vocab_size", vocab_size);
  if (padded_vocab_size < vocab_size)
    return bad(fmt::format("padded_vocab_size {} is less than vocab_size {}", padded_vocab_size, vocab_size));
  if (hidden_dropout < 0 || hidden_dropout >= 1)
    return bad(fmt::format("hidden_dropout {}: must be in [0, 1)", hidden_dropout));
  if (attention_dropout < 0 || attention_dropout >= 1)
    return bad(fmt::format("attention_dropout {}: must be in [0, 1)", attention_dropout));
  if (!(layernorm_epsilon > 0 && layernorm_epsilon <= kGptConfigMaxLayerNormEpsilon))
    return bad(
        fmt::format("layernorm_epsilon {}: must be in (0, {}]", layernorm_epsilon, kGptConfigMaxLayerNormEpsilon));
  if (!(init_method_std > 0 && init_method_std <= kGptConfigMaxInitMethodStd))
    return bad(fmt::format("init_method_std {}: must be in (0, {}]", init_method_std, kGptConfigMaxInitMethodStd));
  return absl::OkStatus();
}

int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by) {
  if (divisible_by <= 1) return vocab_size;
  return (vocab_size + divisible_by - 1) / divisible_by * divisible_by;
}

absl::StatusOr<ParamLayout> ParamLayout::Create(const GPTConfig& config, int tensor_size, int tensor_rank) {
  PTK_RETURN_IF_ERROR(config.Validate());
  if (tensor_size < 1 || tensor_rank < 0 || tensor_rank >= tensor_size)
    return absl::InvalidArgumentError(fmt::format("tensor rank {} of {}: not a valid rank", tensor_rank, tensor_size));
  if (config.num_attention_heads % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("--num-attention-heads ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.num_attention_heads, tensor_size));
  if (config.ffn_hidden_size % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("--ffn-hidden-size ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.ffn_hidden_size, tensor_size));
  if (config.padded_vocab_size % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("the padded vocabulary ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.padded_vocab_size, tensor_size));
  ParamLayout m;
  m.config = config;
  m.tensor_size = tensor_size;
  m.tensor_rank = tensor_rank;
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, vp = config.padded_vocab_size;
  const int64_t T = tensor_size, ct = c / T, ft = f / T, vt = vp / T;
  const double std = config.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double init_std, float init_value = 0.0f,
                 int split = -1) {
    ParamInfo p;
    p.tensor_split_dim = T > 1 ? split : -1;
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
  m.wte = add("embedding.word_embeddings.weight", {vt, c}, std, 0.0f, 0);
  m.wpe = add("embedding.position_embeddings.weight", {config.max_position_embeddings, c}, std);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    std::string p = fmt::format("decoder.layers.{}.", l);
    LayerParams lp;
    lp.ln1_w = add(p + "input_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln1_b = add(p + "input_layernorm.bias", {c}, 0.0);
    lp.qkv_w = add(p + "self_attention.linear_qkv.weight", {3 * ct, c}, std, 0.0f, 0);
    lp.qkv_b = add(p + "self_attention.linear_qkv.bias", {3 * ct}, 0.0, 0.0f, 0);
    lp.proj_w = add(p + "self_attention.linear_proj.weight", {c, ct}, out_std, 0.0f, 1);
    lp.proj_b = add(p + "self_attention.linear_proj.bias", {c}, 0.0);
    lp.ln2_w = add(p + "pre_mlp_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln2_b = add(p + "pre_mlp_layernorm.bias", {c}, 0.0);
    lp.fc1_w = add(p + "mlp.linear_fc1.weight", {ft, c}, std, 0.0f, 0);
    lp.fc1_b = add(p + "mlp.linear_fc1.bias", {ft}, 0.0, 0.0f, 0);
    lp.fc2_w = add(p + "mlp.linear_fc2.weight", {c, ft}, out_std, 0.0f, 1);
    lp.fc2_b = add(p + "mlp.linear_fc2.bias", {c}, 0.0);
    m.layers.push_back(lp);
  }
  m.lnf_w = add("decoder.final_layernorm.weight", {c}, 0.0, 1.0f);
  m.lnf_b = add("decoder.final_layernorm.bias", {c}, 0.0);
  m.out_w = config.untie_embeddings_and_output_weights ? add("output_layer.weight", {vt, c}, std, 0.0f, 0) : m.wte;
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
    for (int64_t i = 0; i < p.size; ++i)
      w[i] = static_cast<float>(p.init_std * CounterNormal(key, static_cast<uint64_t>(WholeIndex(p, i))));
  }
}

int64_t ParamLayout::WholeIndex(const ParamInfo& p, int64_t i) const {
  if (p.tensor_split_dim == 0) return tensor_rank * p.size + i;  // rows: one contiguous block
  if (p.tensor_split_dim == 1) {
    const int64_t cols = p.shape[1];
    return i / cols * cols * tensor_size + tensor_rank * cols + i % cols;
  }
  return i;
}

namespace {
// Runs of contiguous elements: (shard offset, whole offset, length) for each.
template <typename F>
void ForEachRun(const ParamLayout& shard, F&& f) {
  auto whole = ParamLayout::Create(shard.config);  // the configuration was validated by `shard`
  for (size_t k = 0; k < shard.infos.size(); ++k) {
    const ParamInfo &p = shard.infos[k], &w = whole->infos[k];
    if (p.tensor_split_dim == 1) {
      const int64_t cols = p.shape[1];
      for (int64_t r = 0; r < p.shape[0]; ++r) f(p.offset + r * cols, w.offset + shard.WholeIndex(p, r * cols), cols);
    } else {
      f(p.offset, w.offset + shard.WholeIndex(p, 0), p.size);
    }
  }
}
}  // namespace

void CopyToShard(const ParamLayout& shard_layout, std::span<const float> whole, std::span<float> shard) {
  ForEachRun(shard_layout, [&](int64_t s, int64_t w, int64_t n) {
    std::copy(whole.begin() + w, whole.begin() + w + n, shard.begin() + s);
  });
}

void CopyFromShard(const ParamLayout& shard_layout, std::span<const float> shard, std::span<float> whole) {
  ForEachRun(shard_layout, [&](int64_t s, int64_t w, int64_t n) {
    std::copy(shard.begin() + s, shard.begin() + s + n, whole.begin() + w);
  });
}

}  // namespace ptk
