// Test helper for the models' PyTorch goldens (tests/data/trainer/NAME.json and NAME.bin, written by
// tests/support/gen_trainer_goldens.py and gen_llama_golden.py): the reference's tensors by key, its
// configuration, the optimizer and schedule it ran, its micro-batches, and the relative error the
// tests bound.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <simdjson.h>

#include "tests/test_util.h"
#include "trainer/gpt_model.h"
#include "trainer/lr_schedule.h"
#include "trainer/train_step.h"

namespace ptk::testing {

inline double RelError(const float* a, const std::vector<float>& b);

struct Golden {
  simdjson::dom::parser parser;
  simdjson::dom::element meta;
  std::string blob;

  explicit Golden(const std::string& name) {
    const std::string base = SourceDir() + "/tests/data/trainer/" + name;
    meta = parser.load(base + ".json");
    // The script that wrote it, by its path in this tree (a moved script, its reference followed).
    std::string_view generator;
    EXPECT_FALSE(meta["generator"].get(generator)) << base << ".json: no generator";
    EXPECT_TRUE(Exists(SourceDir() + "/" + std::string(generator)))
        << base << ".json: its generator " << generator << " is not in the tree";
    std::ifstream f(base + ".bin", std::ios::binary);
    blob.assign(std::istreambuf_iterator<char>(f), {});
  }
  template <typename T>
  std::vector<T> Tensor(const std::string& key) {
    simdjson::dom::element e = meta["tensors"][key];
    int64_t n = 1;
    for (auto d : e["shape"].get_array()) n *= int64_t(d.get_int64());
    std::vector<T> v(static_cast<size_t>(n));
    std::memcpy(v.data(), blob.data() + int64_t(e["offset"].get_int64()), n * sizeof(T));
    return v;
  }
  int64_t Int(const char* k) { return meta["config"][k].get_int64(); }
  double Num(const char* k) { return meta["config"][k].get_double(); }

  // The model's shape every golden records (layers, width, heads, MLP, sequence and position table, the vocabulary
  // and its padding), the rest GPTConfig's defaults.
  GPTConfig Shape() {
    GPTConfig c;
    c.num_layers = Int("num_layers");
    c.hidden_size = Int("hidden_size");
    c.num_attention_heads = Int("num_attention_heads");
    c.ffn_hidden_size = Int("ffn_hidden_size");
    c.seq_length = Int("seq_length");
    c.max_position_embeddings = Int("max_position_embeddings");
    c.vocab_size = Int("vocab_size");
    c.padded_vocab_size = Int("padded_vocab_size");
    return c;
  }

  // Shape() with what the attention variants' goldens (gated_attention, mla) record besides: the initialisation, the
  // linear biases, the MLP (SwiGLU, or GELU as torch computes it exactly without the bias-GELU fusion), the norm
  // and the position embedding; untied output weights and no dropout.
  GPTConfig AttentionShape() {
    auto cfg = meta["config"];
    auto str = [&](const char* k) { return std::string(cfg[k].get_string().value()); };
    GPTConfig c = Shape();
    c.init_method_std = Num("init_method_std");
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = cfg["add_bias_linear"].get_bool();
    c.swiglu = cfg["swiglu"].get_bool();
    c.gelu_exact = !c.swiglu;
    c.hidden_dropout = c.attention_dropout = 0.0;
    c.normalization = str("normalization") == "RMSNorm" ? Normalization::kRMSNorm : Normalization::kLayerNorm;
    c.position_embedding =
        str("position_embedding_type") == "rope" ? PositionEmbedding::kRope : PositionEmbedding::kLearnedAbsolute;
    return c;
  }
  // megatron-core's tensor names, in its order (param_order).
  std::vector<std::string> ParamOrder() {
    std::vector<std::string> names;
    for (auto e : meta["param_order"].get_array()) names.emplace_back(e.get_string().value());
    return names;
  }
  // The shape of megatron-core's tensor `name` (its initial value's, "init:NAME").
  std::vector<int64_t> InitShape(const std::string& name) {
    std::vector<int64_t> shape;
    for (auto d : meta["tensors"]["init:" + name]["shape"].get_array()) shape.push_back(int64_t(d));
    return shape;
  }

  // The reference's initial weights (tensors "init:NAME") in `layout`'s order, each tensor's size checked.
  std::vector<float> InitWeights(const ParamLayout& layout) {
    std::vector<float> w(static_cast<size_t>(layout.num_params));
    for (const ParamInfo& p : layout.infos) {
      std::vector<float> t = Tensor<float>("init:" + p.name);
      EXPECT_EQ(static_cast<int64_t>(t.size()), p.size) << p.name;
      std::copy(t.begin(), t.end(), w.begin() + p.offset);
    }
    return w;
  }
  // Each of `model`'s weights (a CpuGPTModel's) within `tolerance` relative of the reference's after its steps
  // ("final:NAME"); the largest difference printed.
  template <typename Model>
  void ExpectFinalWeights(Model& model, double tolerance) {
    double worst = 0;
    for (const ParamInfo& p : model.params_info()) {
      const double e = RelError(model.params() + p.offset, Tensor<float>("final:" + p.name));
      EXPECT_LE(e, tolerance) << p.name;
      worst = std::max(worst, e);
    }
    std::printf("largest final weight difference %.3g\n", worst);
  }
  int64_t GlobalBatch() { return Int("micro_batch_size") * Int("num_micro_batches"); }
  // The megatron-core goldens' schedule (gen_moe_golden.py's kind): lr constant over their few steps.
  SchedulerConfig ConstantSchedule() {
    SchedulerConfig s;
    s.init_lr = s.max_lr = Num("lr");
    s.min_lr = Num("min_lr");
    s.decay_steps = 100 * GlobalBatch();
    s.decay_style = "constant";
    s.start_wd = s.end_wd = Num("weight_decay");
    return s;
  }

  // The reference's AdamW (with clipping) and Megatron's cosine schedule, counted in samples.
  OptimizerConfig Optimizer() {
    OptimizerConfig o;
    o.adam_beta1 = Num("adam_beta1");
    o.adam_beta2 = Num("adam_beta2");
    o.adam_eps = Num("adam_eps");
    o.clip_grad = Num("clip_grad");
    return o;
  }
  SchedulerConfig Schedule() {
    SchedulerConfig s;
    s.init_lr = Num("init_lr");
    s.max_lr = Num("lr");
    s.min_lr = Num("min_lr");
    s.warmup_steps = Int("warmup_samples");
    s.decay_steps = Int("decay_samples");
    s.decay_style = "cosine";
    s.start_wd = s.end_wd = Num("weight_decay");
    return s;
  }
};

// megatron-core's parameter count of golden NAME's model (tests/data/trainer/NAME.json): its tensors' sizes, for the
// CLI tests' --dry-run.
inline int64_t MegatronParamCount(const std::string& name) {
  simdjson::dom::parser parser;
  simdjson::dom::element meta = parser.load(SourceDir() + "/tests/data/trainer/" + name + ".json");
  int64_t megatron = 0;
  for (auto e : meta["param_order"].get_array()) {
    int64_t n = 1;
    for (auto d : meta["tensors"]["init:" + std::string(e.get_string().value())]["shape"].get_array()) n *= int64_t(d);
    megatron += n;
  }
  return megatron;
}

// The golden's micro-batches: tensors PREFIX + tokens, labels and loss_mask, num_micro_batches
// micro-batches of micro_batch_size x seq_length a step, positions 0..t-1 in every row.
class GoldenBatches {
 public:
  explicit GoldenBatches(Golden& g, const std::string& prefix = "")
      : tokens_(g.Tensor<int32_t>(prefix + "tokens")),
        labels_(g.Tensor<int32_t>(prefix + "labels")),
        mask_(g.Tensor<float>(prefix + "loss_mask")),
        keys_(static_cast<size_t>(g.Int("micro_batch_size")), 0),
        b_(g.Int("micro_batch_size")),
        t_(g.Int("seq_length")),
        micro_(g.Int("num_micro_batches")) {
    for (int64_t i = 0; i < b_ * t_; ++i) positions_.push_back(static_cast<int32_t>(i % t_));
  }
  GoldenBatches(const GoldenBatches&) = delete;  // the batches point into this
  GoldenBatches& operator=(const GoldenBatches&) = delete;

  ModelBatch Batch(int64_t step, int64_t micro) const {
    const int64_t off = (step * micro_ + micro) * b_ * t_;
    return ModelBatch{
        b_, t_, tokens_.data() + off, labels_.data() + off, positions_.data(), mask_.data() + off, keys_.data()};
  }
  std::vector<ModelBatch> Step(int64_t step) const {
    std::vector<ModelBatch> v;
    for (int64_t m = 0; m < micro_; ++m) v.push_back(Batch(step, m));
    return v;
  }

 private:
  std::vector<int32_t> tokens_, labels_, positions_;
  std::vector<float> mask_;
  std::vector<int64_t> keys_;
  int64_t b_, t_, micro_;
};

// ||a - b|| / ||b||
inline double RelError(const float* a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace ptk::testing
