// The CPU GPT against PyTorch (tests/support/gen_trainer_goldens.py, float64 reference): logits,
// loss and every gradient within 1e-5 relative error, the weights after 10 AdamW steps with
// clipping and Megatron's cosine schedule within 1e-4, for tied and untied output layers.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/golden_util.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::Golden;
using testing::GoldenBatches;
using testing::RelError;

class GptGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    g_ = std::make_unique<Golden>(GetParam());
    GPTConfig c = g_->Shape();
    c.padded_vocab_size = PaddedVocabSize(c.vocab_size, g_->Int("make_vocab_size_divisible_by"));
    ASSERT_EQ(c.padded_vocab_size, g_->Int("padded_vocab_size"));
    c.untie_embeddings_and_output_weights = g_->meta["config"]["untie"].get_bool();
    bool exact = false;  // gpt_gelu_exact: torch's exact GELU (Megatron's --no-bias-gelu-fusion)
    if (g_->meta["config"]["gelu_exact"].get(exact) == simdjson::SUCCESS) c.gelu_exact = exact;
    c.hidden_dropout = c.attention_dropout = 0.0;
    config_ = c;
    batches_ = std::make_unique<GoldenBatches>(*g_);
  }
  std::unique_ptr<CpuGPTModel> MakeModel(bool recompute = false) {
    GPTConfig c = config_;
    c.recompute_activations = recompute;
    auto m = CpuGPTModel::Create(c);
    EXPECT_TRUE(m.ok()) << m.status();
    const std::vector<float> w = g_->InitWeights((*m)->layout());
    std::copy(w.begin(), w.end(), (*m)->params());
    return std::move(*m);
  }
  ModelBatch Batch(int64_t step, int64_t micro) { return batches_->Batch(step, micro); }
  std::vector<ModelBatch> Step(int64_t step) { return batches_->Step(step); }
  OptimizerConfig OptConfig() { return g_->Optimizer(); }
  SchedulerConfig Schedule() { return g_->Schedule(); }

  std::unique_ptr<Golden> g_;
  GPTConfig config_;
  std::unique_ptr<GoldenBatches> batches_;
};

TEST_P(GptGolden, LogitsAndLossMatchPyTorch) {
  auto model = MakeModel();
  std::vector<float> logits;
  auto loss = model->Forward(Batch(0, 0), &logits);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_LE(RelError(logits.data(), g_->Tensor<float>("logits")), 1e-5);
  double want = g_->meta["first_micro_batch_loss"].get_double();
  EXPECT_LE(std::abs(loss->loss_sum / loss->tokens - want) / want, 1e-5);
}

TEST_P(GptGolden, GradientsMatchPyTorch) {
  for (bool recompute : {false, true}) {
    auto model = MakeModel(recompute);
    auto comm = MakeLocalCommunicator();
    TrainStep opt(model.get(), OptConfig(), Schedule(), comm.get());
    auto r = opt.ComputeGradients(Step(0), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->lm_loss(), g_->meta["steps"].at(0)["lm_loss"].get_double(), 1e-5);
    double want_norm = g_->meta["steps"].at(0)["grad_norm"].get_double();
    EXPECT_LE(std::abs(r->grad_norm - want_norm) / want_norm, 1e-5);
    for (const ParamInfo& p : model->params_info()) {
      std::vector<float> want = g_->Tensor<float>("grad:" + p.name);
      EXPECT_LE(RelError(model->grads() + p.offset, want), 1e-5) << p.name << " recompute " << recompute;
    }
  }
}

TEST_P(GptGolden, TenAdamWStepsMatchPyTorch) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model.get(), OptConfig(), Schedule(), comm.get());
  const int64_t steps = g_->Int("steps");
  for (int64_t s = 0; s < steps; ++s) {
    auto r = opt.Step(Step(s), g_->Int("global_batch_size"), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    auto want = g_->meta["steps"].at(s);
    EXPECT_NEAR(r->lr, want["lr"].get_double(), 1e-12) << "step " << s;
    EXPECT_LE(std::abs(r->lm_loss() - want["lm_loss"].get_double()), 1e-4) << "step " << s;
    EXPECT_FALSE(r->skipped);
  }
  for (const ParamInfo& p : model->params_info()) {
    std::vector<float> want = g_->Tensor<float>("final:" + p.name);
    EXPECT_LE(RelError(model->params() + p.offset, want), 1e-4) << p.name;
  }
}

TEST_P(GptGolden, NanLossSkipsTheUpdate) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model.get(), OptConfig(), Schedule(), comm.get());
  ASSERT_TRUE(opt.Step(Step(0), 4, 0).ok());  // one good step first
  const ParamInfo* p = model->FindParam("decoder.final_layernorm.weight");
  ASSERT_NE(p, nullptr);
  model->params()[p->offset] = std::nanf("");
  std::vector<float> before(model->params(), model->params() + model->num_params());
  const int64_t steps_before = opt.scheduler().num_steps(), adam_before = opt.adam_step();
  auto r = opt.Step(Step(1), 4, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_FALSE(std::isfinite(r->grad_norm));
  std::vector<float> after(model->params(), model->params() + model->num_params());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0) << "a NaN step changed weights";
  EXPECT_EQ(opt.scheduler().num_steps(), steps_before);
  EXPECT_EQ(opt.adam_step(), adam_before);
}

INSTANTIATE_TEST_SUITE_P(Trainer, GptGolden, ::testing::Values("gpt_tied", "gpt_untied", "gpt_gelu_exact"));

}  // namespace
}  // namespace ptk
