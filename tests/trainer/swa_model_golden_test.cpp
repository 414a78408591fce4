// The CPU model's sliding window attention and softmax types against megatron-core 0.16.1 itself
// (tests/support/gen_swa_golden.py: its GPTModel of the local spec, DotProductAttention with window_size,
// window_attn_skip_freq and softmax_type, its DDP, optimizer and scheduler on the CPU): a window on the layers a
// skip frequency leaves with the learnable softmax offset and grouped-query attention, off-by-one with a list
// pattern, the vanilla softmax windowed on every layer, and the learnable offset without a window. The layout
// (softmax_offset's name, shape and place), the layers megatron-core windows, the first step's lm loss, grad norm
// and every gradient within 1e-5 relative, and three optimizer steps' losses and the weights after them (1e-4:
// Adam's first steps amplify; no weight decay on the 1-D offsets, as Megatron's groups), the MLA and MoE
// goldens' tolerances: fp32 on both sides, only the order of the sums differs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/golden_util.h"
#include "trainer/backend.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::Golden;
using testing::GoldenBatches;
using testing::RelError;

class SwaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto cfg = g_.meta["config"];
    GPTConfig c = g_.Shape();
    c.num_query_groups = g_.Int("num_query_groups");
    c.init_method_std = g_.Num("init_method_std");
    c.untie_embeddings_and_output_weights = true;
    c.gelu_exact = true;  // Megatron's GELU MLP without the bias-GELU fusion: torch's exact GELU
    c.hidden_dropout = c.attention_dropout = 0.0;
    c.softmax_type = std::string(cfg["softmax_type"].get_string().value());
    if (simdjson::dom::array w; !cfg["window_size"].get(w)) {
      c.window_left = int64_t(w.at(0));
      EXPECT_EQ(int64_t(w.at(1)), 0);
      simdjson::dom::element freq = cfg["window_attn_skip_freq"];
      if (freq.is_int64())
        for (int64_t l = 0; l < c.num_layers; ++l) c.window_pattern.push_back((l + 1) % int64_t(freq) != 0 ? 1 : 0);
      if (freq.is_array())
        for (auto v : freq.get_array()) c.window_pattern.push_back(static_cast<int>(int64_t(v)));
    }
    config_ = c;
  }
  std::unique_ptr<CpuGPTModel> MakeModel(const GPTConfig& c) {
    auto m = CpuGPTModel::Create(c);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE((*m)->WriteParams(g_.InitWeights((*m)->layout())).ok());
    return std::move(*m);
  }
  double Want(int64_t step, const char* key) { return g_.meta["steps"].at(step)[key].get_double(); }
  // The first step's largest relative gradient difference from Megatron's, over every tensor.
  double FirstStepGradError(const GPTConfig& c) {
    auto model = MakeModel(c);
    auto comm = MakeLocalCommunicator();
    TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
    EXPECT_TRUE(step.ComputeGradients(batches_.Step(0), 0).ok());
    double worst = 0;
    for (const ParamInfo& p : model->params_info())
      worst = std::max(worst, RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name)));
    return worst;
  }

  Golden g_{GetParam()};
  GoldenBatches batches_{g_};
  GPTConfig config_;
};

TEST_P(SwaGolden, TheLayoutAndWindowedLayersAreMegatronCores) {
  auto layout = ParamLayout::Create(config_);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->infos.size(), g_.meta["param_order"].get_array().size());
  for (const std::string& name : g_.ParamOrder()) {
    const ParamInfo* p = layout->Find(name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_EQ(p->shape, g_.InitShape(name)) << name;
    if (name.ends_with(".softmax_offset")) {
      EXPECT_TRUE(p->no_weight_decay) << name;  // 1-D: Megatron's wd_mult 0
    }
  }
  int64_t l = 0;
  for (auto w : g_.meta["window_layers"].get_array()) EXPECT_EQ(config_.window_layer(l++), bool(w)) << "layer " << l;
}

TEST_P(SwaGolden, TheFirstStepsGradientsMatchMegatron) {
  auto model = MakeModel(config_);
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(std::abs(r->lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
  EXPECT_LE(std::abs(r->grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
  double worst = 0;
  for (const ParamInfo& p : model->params_info()) {
    const double e = RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name));
    EXPECT_LE(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("loss %.9g (megatron %.9g), grad norm %.9g (megatron %.9g), largest gradient difference %.3g\n",
              r->lm_loss(), Want(0, "lm_loss"), r->grad_norm, Want(0, "grad_norm"), worst);
}

TEST_P(SwaGolden, ThreeOptimizerStepsMatchMegatron) {
  auto model = MakeModel(config_);
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  const int64_t steps = static_cast<int64_t>(g_.meta["steps"].get_array().size());
  for (int64_t s = 0; s < steps; ++s) {
    auto r = step.Step(batches_.Step(s), g_.GlobalBatch(), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(std::abs(r->lm_loss() - Want(s, "lm_loss")), 1e-5) << "step " << s;
  }
  double worst = 0;
  for (const ParamInfo& p : model->params_info()) {
    const double e = RelError(model->params() + p.offset, g_.Tensor<float>("final:" + p.name));
    // The word embeddings: swa_vanilla's come within 2.6e-4 (their rows of tokens seen once get Adam's
    // m / sqrt(v) of one small gradient, which amplifies the 1e-7 differences of the sums' order); 1e-3 for them.
    EXPECT_LE(e, p.name == "embedding.word_embeddings.weight" ? 1e-3 : 1e-4) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("largest final weight difference %.3g\n", worst);
}

// The comparison sees the window and the softmax: without the window (or with it on every layer), or with the
// other sink, the gradients differ from Megatron's.
TEST_P(SwaGolden, AnotherWindowOrSoftmaxDiffers) {
  GPTConfig c = config_;
  if (c.window_left >= 0) {
    c.window_left = -1;
    EXPECT_GT(FirstStepGradError(c), 1e-3) << "no window";
    if (!config_.window_pattern.empty()) {
      c = config_;
      c.window_pattern.clear();
      EXPECT_GT(FirstStepGradError(c), 1e-3) << "the window on every layer";
    }
  }
  c = config_;
  if (c.softmax_type == "learnable") return;  // its offsets are tensors of the layout: another one misses them
  c.softmax_type = c.softmax_type == "vanilla" ? "off-by-one" : "vanilla";
  EXPECT_GT(FirstStepGradError(c), 1e-3) << c.softmax_type;
}

// What ptk has not for them is refused by the library too, not only by ptk-train's flags.
TEST(SwaModel, OtherBackendsAndModelsAreRefused) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 16;
  c.seq_length = c.max_position_embeddings = 4;
  c.vocab_size = c.padded_vocab_size = 16;
  for (auto variant : {+[](GPTConfig& x) { x.window_left = 1; }, +[](GPTConfig& x) { x.softmax_type = "off-by-one"; },
                       +[](GPTConfig& x) { x.softmax_type = "learnable"; }}) {
    GPTConfig v = c;
    variant(v);
    EXPECT_TRUE(CreateModel(v, BackendOptions{}).ok());
    // The CUDA backend: the window in every precision, the softmax types in fp32 only (refused in bf16/fp16);
    // otherwise refused here for a missing device only, if at all.
    BackendOptions cuda;
    cuda.device = Device::kCuda;
    cuda.precision = Precision::kBf16;
    const absl::Status half = CreateModel(v, cuda).status();
    if (v.softmax_sink()) {
      EXPECT_EQ(half.code(), absl::StatusCode::kUnimplemented) << half;
      EXPECT_NE(std::string(half.message()).find("softmax_type " + v.softmax_type + " in bf16/fp16"), std::string::npos)
          << half;
    } else {
      EXPECT_EQ(std::string(half.message()).find("window_left"), std::string::npos) << half;
    }
    cuda.precision = Precision::kFp32;
    const absl::Status fp32 = CreateModel(v, cuda).status();
    EXPECT_EQ(std::string(fp32.message()).find("softmax_type"), std::string::npos) << fp32;
    EXPECT_EQ(std::string(fp32.message()).find("window_left"), std::string::npos) << fp32;
    for (auto bad : {+[](GPTConfig& x) {
                       x.window_left = 1, x.window_pattern = {1, 0}, x.mtp_num_layers = 1;
                     },
                     +[](GPTConfig& x) { x.window_pattern = {1}; }, +[](GPTConfig& x) { x.softmax_type = "softer"; },
                     +[](GPTConfig& x) { x.window_left = -2; }}) {
      GPTConfig x = v;
      bad(x);
      EXPECT_EQ(ParamLayout::Create(x).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Megatron, SwaGolden,
                         ::testing::Values("swa_learnable", "swa_off_by_one", "swa_vanilla", "swa_learnable_full"));

}  // namespace
}  // namespace ptk
