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
  if (kv_channels < 0)
    return bad(
        fmt::format("kv_channels {}: must be at least 1 (or 0: hidden_size / num_attention_heads)", kv_channels));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    return bad(fmt::format("num_attention_heads {} does not divide hidden_size {}", num_attention_heads, hidden_size));
  if (num_query_groups < 0 || (num_query_groups > 0 && num_attention_heads % num_query_groups != 0))
    return bad(fmt::format("num_query_groups {} does not divide num_attention_heads {}", num_query_groups,
                           num_attention_heads));
  if (rope()) {
    if (!(rotary_base > 0 && std::isfinite(rotary_base)))
      return bad(fmt::format("rotary_base {}: must be positive", rotary_base));
    if (!(rotary_percent > 0 && rotary_percent <= 1))
      return bad(fmt::format("rotary_percent {}: must be in (0, 1]", rotary_percent));
    if (rotary_dim() < 2 || rotary_dim() % 2 != 0)
      return bad(
          fmt::format("rotary_percent {} of head dimension {} rotates {} channels: must be an even number, at least 2",
                      rotary_percent, head_dim(), rotary_dim()));
  }
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
  if (config.query_groups() % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("num_query_groups {} is not divisible by tensor size {}", config.query_groups(), tensor_size));
  ParamLayout m;
  m.config = config;
  m.tensor_size = tensor_size;
  m.tensor_rank = tensor_rank;
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, vp = config.padded_vocab_size;
  // This rank's rows of QKV (whole query groups: their query heads, key and value, Megatron's order),
  // the attention's width it holds (proj's columns), fc1's rows ([gate; up] under SwiGLU) and fc2's columns.
  const int64_t T = tensor_size, qkv_t = config.qkv_rows() / T,
                att_t = config.num_attention_heads * config.head_dim() / T, ft = f / T,
                fc1_t = (config.swiglu ? 2 : 1) * ft, vt = vp / T;
  const int fc1_chunks = config.swiglu ? 2 : 1;
  const bool ln = config.normalization == Normalization::kLayerNorm, bias = config.add_bias_linear;
  const double std = config.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double init_std, float init_value = 0.0f,
                 int split = -1, int chunks = 1) {
    ParamInfo p;
    p.tensor_split_dim = T > 1 ? split : -1;
    p.tensor_split_chunks = T > 1 && split == 0 ? chunks : 1;
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
  // A tensor the configuration may leave out: -1 then.
  auto add_if = [&](bool present, auto&&... args) -> int64_t { return present ? add(args...) : -1; };
  m.wte = add("embedding.word_embeddings.weight", {vt, c}, std, 0.0f, 0);
  m.wpe = add_if(config.position_embedding == PositionEmbedding::kLearnedAbsolute,
                 "embedding.position_embeddings.weight", std::vector<int64_t>{config.max_position_embeddings, c}, std);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    std::string p = fmt::format("decoder.layers.{}.", l);
    LayerParams lp;
    lp.ln1_w = add(p + "input_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln1_b = add_if(ln, p + "input_layernorm.bias", std::vector<int64_t>{c}, 0.0);
    lp.qkv_w = add(p + "self_attention.linear_qkv.weight", {qkv_t, c}, std, 0.0f, 0);
    lp.qkv_b =
        add_if(config.qkv_bias(), p + "self_attention.linear_qkv.bias", std::vector<int64_t>{qkv_t}, 0.0, 0.0f, 0);
    lp.proj_w = add(p + "self_attention.linear_proj.weight", {c, att_t}, out_std, 0.0f, 1);
    lp.proj_b = add_if(bias, p + "self_attention.linear_proj.bias", std::vector<int64_t>{c}, 0.0);
    lp.ln2_w = add(p + "pre_mlp_layernorm.weight", {c}, 0.0, 1.0f);
    lp.ln2_b = add_if(ln, p + "pre_mlp_layernorm.bias", std::vector<int64_t>{c}, 0.0);
    lp.fc1_w = add(p + "mlp.linear_fc1.weight", {fc1_t, c}, std, 0.0f, 0, fc1_chunks);
    lp.fc1_b = add_if(bias, p + "mlp.linear_fc1.bias", std::vector<int64_t>{fc1_t}, 0.0, 0.0f, 0, fc1_chunks);
    lp.fc2_w = add(p + "mlp.linear_fc2.weight", {c, ft}, out_std, 0.0f, 1);
    lp.fc2_b = add_if(bias, p + "mlp.linear_fc2.bias", std::vector<int64_t>{c}, 0.0);
    m.layers.push_back(lp);
  }
  m.lnf_w = add("decoder.final_layernorm.weight", {c}, 0.0, 1.0f);
  m.lnf_b = add_if(ln, "decoder.final_layernorm.bias", std::vector<int64_t>{c}, 0.0);
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
  if (p.tensor_split_dim == 0) {  // rows: one contiguous block of each chunk
    const int64_t chunk = p.size / p.tensor_split_chunks;
    return (i / chunk * tensor_size + tensor_rank) * chunk + i % chunk;
  }
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
      const int64_t chunk = p.size / p.tensor_split_chunks;
      for (int64_t i = 0; i < p.size; i += chunk) f(p.offset + i, w.offset + shard.WholeIndex(p, i), chunk);
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
