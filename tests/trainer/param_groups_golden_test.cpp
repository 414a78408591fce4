// Megatron's optimizer parameter groups (--decoupled-lr, --decoupled-min-lr, --apply-wd-to-qk-layernorm)
// against megatron-core 0.16.1 itself (golden: tests/support/gen_param_groups_golden.py): each tensor's group
// (rate and weight decay) as its _get_param_groups makes them, every group's learning rate and weight decay
// per iteration exactly as its OptimizerParamScheduler sets them, and the parameters after nine updates of
// the CPU model's AdamW through TrainStep within 1e-6 of torch's AdamW over those groups.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/comm.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

const std::string kGolden = testing::SourceDir() + "/tests/data/trainer/param_groups.json";

std::string Str(simdjson::dom::element e) { return std::string(std::string_view(e)); }

GPTConfig ModelOf(simdjson::dom::element m, bool tied) {
  GPTConfig c;
  c.num_layers = int64_t(m["layers"]);
  c.hidden_size = int64_t(m["hidden"]);
  c.num_attention_heads = int64_t(m["heads"]);
  c.ffn_hidden_size = int64_t(m["ffn"]);
  c.seq_length = c.max_position_embeddings = int64_t(m["positions"]);
  c.vocab_size = c.padded_vocab_size = int64_t(m["vocab"]);
  c.untie_embeddings_and_output_weights = !tied;
  c.qk_layernorm = true;
  return c;
}

SchedulerConfig ScheduleOf(simdjson::dom::element s) {
  SchedulerConfig c;
  c.init_lr = double(s["init_lr"]);
  c.max_lr = double(s["lr"]);
  c.min_lr = double(s["min_lr"]);
  c.warmup_steps = double(int64_t(s["warmup"]));
  c.decay_steps = int64_t(s["decay"]);
  c.decay_style = Str(s["decay_style"]);
  c.wsd_decay_steps = 3;  // the generator's, for WSD
  c.wsd_decay_style = "cosine";
  c.start_wd = double(s["start_wd"]);
  c.end_wd = double(s["end_wd"]);
  c.wd_incr_steps = int64_t(s["wd_steps"]);
  c.wd_incr_style = Str(s["wd_style"]);
  if (!s["decoupled_lr"].is_null()) c.decoupled_lr = double(s["decoupled_lr"]);
  if (!s["decoupled_min_lr"].is_null()) c.decoupled_min_lr = double(s["decoupled_min_lr"]);
  return c;
}

// The generator's formulas (its docstring), in double, rounded to float.
float StartValue(int64_t k, int64_t i) { return static_cast<float>(0.05 * std::sin(0.37 * i + 1.3 * k)); }
float GradValue(int64_t k, int64_t i, int64_t s) {
  return static_cast<float>(0.01 * std::cos(0.21 * i + 0.9 * k + 0.5 * s));
}

class ParamGroupsGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_FALSE(parser_.load(kGolden).get(root_)) << kGolden; }
  simdjson::dom::parser parser_;
  simdjson::dom::element root_;
};

TEST_P(ParamGroupsGolden, GroupsRatesAndUpdatesAsMegatronCore) {
  const simdjson::dom::element g = root_["cases"][GetParam()], s = g["settings"];
  const bool apply_wd_qk = bool(s["apply_wd_qk"]);
  const SchedulerConfig schedule = ScheduleOf(s);
  ASSERT_TRUE(schedule.Validate().ok());
  auto model = CpuGPTModel::Create(ModelOf(root_["model"], bool(s["tied"])));
  ASSERT_TRUE(model.ok()) << model.status();
  const ParamLayout& layout = (*model)->layout();
  // Megatron's names in sorted order: k of the formulas.
  std::map<std::string, int64_t> key;
  for (simdjson::dom::element n : g["names"].get_array()) key.emplace(Str(n), static_cast<int64_t>(key.size()));
  ASSERT_EQ(key.size(), layout.infos.size());
  // Each tensor's group: megatron-core's max_lr, min_lr and wd_mult for that name.
  AdamWGroups rule;
  rule.apply_wd_to_qk_layernorm = apply_wd_qk;
  for (const ParamInfo& p : layout.infos) {
    ASSERT_TRUE(key.count(p.name)) << p.name;
    const simdjson::dom::element want = g["groups"][p.name];
    const int group = rule.IndexOf(p.no_weight_decay, p.qk_layernorm, p.decoupled_lr);
    EXPECT_EQ(group % 2 == 1, double(want["wd_mult"]) == 0.0) << p.name;
    EXPECT_EQ(group >= 2 ? schedule.decoupled_max() : schedule.max_lr, double(want["max_lr"])) << p.name;
    EXPECT_EQ(group >= 2 ? schedule.decoupled_min() : schedule.min_lr, double(want["min_lr"])) << p.name;
  }
  std::vector<float> params(static_cast<size_t>(layout.num_params));
  for (const ParamInfo& p : layout.infos)
    for (int64_t i = 0; i < p.size; ++i) params[static_cast<size_t>(p.offset + i)] = StartValue(key.at(p.name), i);
  ASSERT_TRUE((*model)->WriteParams(params).ok());
  auto comm = MakeLocalCommunicator();
  OptimizerConfig optimizer;
  optimizer.adam_beta1 = double(s["beta1"]);
  optimizer.adam_beta2 = double(s["beta2"]);
  optimizer.adam_eps = double(s["eps"]);
  optimizer.clip_grad = 0;
  optimizer.apply_wd_to_qk_layernorm = apply_wd_qk;
  TrainStep step(model->get(), optimizer, schedule, comm.get());
  int64_t iteration = 0;
  for (simdjson::dom::element rates : g["rates"].get_array()) {
    ++iteration;
    // Every Megatron group's rate and weight decay for this update: the scheduler's, exactly.
    for (simdjson::dom::element r : rates.get_array()) {
      const bool decoupled = double(r["max_lr"]) != schedule.max_lr || double(r["min_lr"]) != schedule.min_lr;
      const double wd = double(r["wd_mult"]) * step.scheduler().weight_decay();
      EXPECT_EQ(decoupled ? step.scheduler().decoupled_lr() : step.scheduler().lr(), double(r["lr"]))
          << "iteration " << iteration;
      EXPECT_EQ(wd, double(r["weight_decay"])) << "iteration " << iteration;
    }
    for (const ParamInfo& p : layout.infos)
      for (int64_t i = 0; i < p.size; ++i) (*model)->grads()[p.offset + i] = GradValue(key.at(p.name), i, iteration);
    StepResult r;
    r.lr = step.scheduler().lr();
    ASSERT_TRUE(step.ApplyUpdate(r, /*global_batch_size=*/1).ok());
  }
  ASSERT_EQ(iteration, int64_t(s["iterations"]));
  ASSERT_TRUE((*model)->ReadParams(params).ok());
  for (const ParamInfo& p : layout.infos) {
    int64_t i = 0;
    for (simdjson::dom::element v : g["final"][p.name].get_array()) {
      ASSERT_LT(i, p.size) << p.name;
      EXPECT_NEAR(params[static_cast<size_t>(p.offset + i)], double(v), 1e-6) << p.name << "[" << i << "]";
      ++i;
    }
    EXPECT_EQ(i, p.size) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(MegatronCore, ParamGroupsGolden,
                         ::testing::Values("untied_decoupled_qk_wd", "tied_decoupled_lr_only",
                                           "untied_default_groups"));

// The same updates must differ where the groups do: a run without --decoupled-lr moves the embeddings less
// than one with a tripled rate for them, and the other tensors alike (the test above cannot pass by a rule
// that ignores the groups: its decoupled rates would then be --lr's).
TEST(ParamGroups, DecoupledRateMovesOnlyTheEmbeddingAndOutputLayer) {
  GPTConfig c = testing::SmallGpt(1, 8, 2, 8, 16, 16);
  c.ffn_hidden_size = 16;
  c.untie_embeddings_and_output_weights = true;
  std::vector<float> moved[2];
  for (int run = 0; run < 2; ++run) {
    auto model = CpuGPTModel::Create(c);
    ASSERT_TRUE(model.ok());
    const int64_t n = (*model)->num_params();
    ASSERT_TRUE((*model)->WriteParams(std::vector<float>(static_cast<size_t>(n), 0.0f)).ok());
    for (int64_t i = 0; i < n; ++i) (*model)->grads()[i] = 0.01f;
    SchedulerConfig schedule;
    schedule.max_lr = 1e-3;
    schedule.decay_steps = 10;
    schedule.decay_style = "constant";
    if (run == 1) schedule.decoupled_lr = 3e-3;
    auto comm = MakeLocalCommunicator();
    TrainStep step(model->get(), OptimizerConfig{}, schedule, comm.get());
    StepResult r;
    r.lr = step.scheduler().lr();
    ASSERT_TRUE(step.ApplyUpdate(r, 1).ok());
    moved[run].resize(static_cast<size_t>(n));
    ASSERT_TRUE((*model)->ReadParams(moved[run]).ok());
  }
  auto model = CpuGPTModel::Create(c);
  for (const ParamInfo& p : (*model)->layout().infos) {
    const float a = moved[0][static_cast<size_t>(p.offset)], b = moved[1][static_cast<size_t>(p.offset)];
    if (p.decoupled_lr) {
      EXPECT_NEAR(b, 3 * a, 1e-9) << p.name;  // Adam's first step moves by lr (its sign): three times as far
    } else {
      EXPECT_EQ(a, b) << p.name;
    }
  }
}

}  // namespace
}  // namespace ptk
