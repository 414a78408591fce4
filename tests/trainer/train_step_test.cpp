// The training step's loss scaling (Megatron's fp16 scalers) on the CPU model: a power-of-two
// constant scale changes no bit, an overflow under dynamic scaling is a skipped step that backs
// the scale off, and the dynamic scaler's growth / hysteresis / floor follow Megatron's.
#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/match.h"

#include "common/status.h"
#include "trainer/backend.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

struct Fixture {
  GPTConfig config;
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask;
  std::vector<int64_t> keys;
  Fixture() {
    config.num_layers = 2;
    config.hidden_size = 16;
    config.num_attention_heads = 2;
    config.ffn_hidden_size = 64;
    config.seq_length = config.max_position_embeddings = 8;
    config.vocab_size = 97;
    config.padded_vocab_size = 128;
    config.hidden_dropout = config.attention_dropout = 0.1;
    const int64_t n = 2 * 8;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(static_cast<int32_t>((i * 37 + 5) % 97));
      labels.push_back(static_cast<int32_t>((i * 11 + 3) % 97));
      positions.push_back(static_cast<int32_t>(i % 8));
      mask.push_back(i % 5 == 4 ? 0.0f : 1.0f);
    }
    keys = {3, 4};
  }
  ModelBatch Batch() const {
    return ModelBatch{2, 8, tokens.data(), labels.data(), positions.data(), mask.data(), keys.data()};
  }
};

SchedulerConfig Schedule() {
  SchedulerConfig s;
  s.max_lr = 1e-2;
  s.min_lr = 1e-3;
  s.decay_style = "constant";
  s.decay_steps = 100;
  s.start_wd = s.end_wd = 0.1;
  s.wd_incr_steps = 100;
  return s;
}

std::vector<float> TrainThreeSteps(const LossScaleConfig& ls, std::vector<StepResult>* results = nullptr) {
  Fixture f;
  auto model = CpuGPTModel::Create(f.config);
  EXPECT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->InitWeights(7).ok());
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model->get(), OptimizerConfig{}, Schedule(), comm.get(), ls);
  for (int i = 0; i < 3; ++i) {
    auto r = opt.Step({f.Batch()}, 2, 11);
    EXPECT_TRUE(r.ok()) << r.status();
    if (results) results->push_back(*r);
  }
  return std::vector<float>((*model)->params(), (*model)->params() + (*model)->num_params());
}

// The step reads its losses once (ForwardBackwardDeferred, then TakeLosses): the base class's
// default keeps each micro-batch's LossSum and adds them in call order from zero, the bits of
// ForwardBackward's sums added by the caller; TakeLosses empties what is pending.
TEST(DeferredLosses, TakeLossesAddsTheMicroBatchesInOrder) {
  Fixture f;
  auto a = CpuGPTModel::Create(f.config);
  auto b = CpuGPTModel::Create(f.config);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->InitWeights(7).ok() && (*b)->InitWeights(7).ok());
  double loss = 0, tokens = 0;
  for (uint64_t seed : {1, 2, 3}) {
    auto s = (*a)->ForwardBackward(f.Batch(), 0.25, true, seed);
    ASSERT_TRUE(s.ok()) << s.status();
    loss += s->loss_sum;
    tokens += s->tokens;
    ASSERT_TRUE((*b)->ForwardBackwardDeferred(f.Batch(), 0.25, true, seed).ok());
  }
  auto taken = (*b)->TakeLosses();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->loss_sum, loss);
  EXPECT_EQ(taken->tokens, tokens);
  EXPECT_EQ(tokens, 3 * 13);  // 16 tokens, 3 masked, per micro-batch
  auto again = (*b)->TakeLosses();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->loss_sum, 0.0);
  EXPECT_EQ(again->tokens, 0.0);
  std::vector<float> ga(static_cast<size_t>((*a)->num_params())), gb(ga.size());
  ASSERT_TRUE((*a)->ReadGrads(ga).ok() && (*b)->ReadGrads(gb).ok());
  EXPECT_EQ(ga, gb);
}

TEST(LossScaling, PowerOfTwoConstantScaleChangesNoBit) {
  const std::vector<float> plain = TrainThreeSteps(LossScaleConfig{});
  LossScaleConfig scaled;
  scaled.scale = 1024;  // scaling by 2^k and back is exact in fp32 (no overflow here)
  EXPECT_TRUE(plain == TrainThreeSteps(scaled));
}

TEST(LossScaling, OverflowIsASkippedStepThatBacksTheScaleOff) {
  LossScaleConfig ls;
  ls.dynamic = true;
  ls.scale = 0x1.0p+140;  // the scaled loss weights overflow fp32
  ls.min_scale = 1.0;
  ls.hysteresis = 1;
  std::vector<StepResult> results;
  const std::vector<float> after = TrainThreeSteps(ls, &results);
  ASSERT_EQ(results.size(), 3u);
  for (const StepResult& r : results) {
    EXPECT_TRUE(r.skipped);
    EXPECT_TRUE(r.overflow) << "an overflow under dynamic scaling is not a NaN stop";
  }
  EXPECT_EQ(results[1].loss_scale, 0x1.0p+139);
  EXPECT_EQ(results[2].loss_scale, 0x1.0p+138);
  // What the log line shows: the scale after the step's backoff, as Megatron logs
  // optimizer.get_loss_scale() after its step (ptk showed the one the step was computed with).
  EXPECT_EQ(results[0].next_loss_scale, 0x1.0p+139);
  EXPECT_EQ(results[2].next_loss_scale, 0x1.0p+137);
  // Nothing was updated: the parameters are the initial ones.
  Fixture f;
  auto init = CpuGPTModel::Create(f.config);
  ASSERT_TRUE(init.ok());
  ASSERT_TRUE((*init)->InitWeights(7).ok());
  EXPECT_TRUE(after == std::vector<float>((*init)->params(), (*init)->params() + (*init)->num_params()));
}

TEST(LossScaling, DynamicScalerFollowsMegatron) {
  LossScaleConfig c;
  c.dynamic = true;
  c.scale = 64;
  c.min_scale = 16;
  c.window = 3;
  c.hysteresis = 2;
  LossScaler s(c);
  s.Update(true);  // first overflow: hysteresis 2 -> 1, scale kept
  EXPECT_EQ(s.scale(), 64);
  s.Update(true);  // hysteresis spent: back off
  EXPECT_EQ(s.scale(), 32);
  s.Update(true);
  EXPECT_EQ(s.scale(), 16);
  s.Update(true);  // floor
  EXPECT_EQ(s.scale(), 16);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 16);
  s.Update(false);  // window good steps: grow, hysteresis restored
  EXPECT_EQ(s.scale(), 32);
  EXPECT_EQ(s.state().hysteresis_tracker, 2);
  s.Update(true);
  EXPECT_EQ(s.scale(), 32);
  LossScaler constant(LossScaleConfig{false, 8.0});
  constant.Update(true);
  EXPECT_EQ(constant.scale(), 8.0);
}

// The backend refusals are written once (CheckBackendChoice): ptk-train's flags and CreateModel
// give the same usage error.
TEST(Backend, RefusalsAreOneUsageError) {
  Fixture f;
  BackendOptions o;
  o.precision = Precision::kBf16;
  auto m = CreateModel(f.config, o);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(IsUsageError(m.status())) << m.status();
  EXPECT_EQ(m.status(), CheckBackendChoice(Device::kCpu, Precision::kBf16));
  EXPECT_NE(m.status().message().find("--bf16: the CPU backend trains in fp32"), std::string::npos) << m.status();
  EXPECT_NE(CheckBackendChoice(Device::kCpu, Precision::kFp16, false).message().find("no CUDA device is visible"),
            std::string::npos);
  EXPECT_TRUE(CheckBackendChoice(Device::kCpu, Precision::kFp32).ok());
  const absl::Status cuda = CheckBackendChoice(Device::kCuda, Precision::kBf16);
  EXPECT_EQ(cuda.ok(), CudaBuilt()) << cuda;
  if (!CudaBuilt()) {
    EXPECT_TRUE(IsUsageError(cuda) && absl::StrContains(cuda.message(), "built without CUDA")) << cuda;
  }
}

TEST(LossScaling, BadSettingsAreUsageErrors) {
  LossScaleConfig c;
  c.scale = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = {};
  c.dynamic = true;
  c.scale = 4;
  c.min_scale = 8;
  EXPECT_FALSE(c.Validate().ok());
  c = {};
  c.window = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = {};
  c.hysteresis = 0;
  EXPECT_FALSE(c.Validate().ok());
  EXPECT_TRUE(LossScaleConfig{}.Validate().ok());
}

}  // namespace
}  // namespace ptk
