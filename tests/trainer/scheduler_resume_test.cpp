// A resume's learning-rate schedule against megatron-core 0.16.1's OptimizerParamScheduler.load_state_dict
// (golden: tests/support/gen_scheduler_resume_golden.py): with neither flag a resume stops exactly where
// Megatron's _check_and_set asserts (every value its state_dict holds, whatever the styles: a longer
// --train-iters under a constant rate too) and names every value that differs; with
// --use-checkpoint-opt_param-scheduler the checkpoint's values of its state_dict and the command line's
// warm-up start and WSD anneal (Megatron records neither); with --override-opt_param-scheduler the
// command line's; and the rates and weight decays that follow, step by step.
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/status.h"
#include "tests/test_util.h"
#include "trainer/lr_schedule.h"

namespace ptk {
namespace {

const std::string kGolden = testing::SourceDir() + "/tests/data/trainer/scheduler_resume.json";

SchedulerConfig ConfigOf(simdjson::dom::element c) {
  SchedulerConfig s;
  s.init_lr = double(c["init_lr"]);
  s.max_lr = double(c["max_lr"]);
  s.min_lr = double(c["min_lr"]);
  s.warmup_steps = double(c["lr_warmup_steps"]);
  s.decay_steps = int64_t(c["lr_decay_steps"]);
  s.decay_style = std::string(std::string_view(c["lr_decay_style"]));
  s.start_wd = double(c["start_wd"]);
  s.end_wd = double(c["end_wd"]);
  s.wd_incr_steps = int64_t(c["wd_incr_steps"]);
  s.wd_incr_style = std::string(std::string_view(c["wd_incr_style"]));
  if (!c["wsd_decay_steps"].is_null()) s.wsd_decay_steps = int64_t(c["wsd_decay_steps"]);
  if (!c["lr_wsd_decay_style"].is_null()) s.wsd_decay_style = std::string(std::string_view(c["lr_wsd_decay_style"]));
  return s;
}

class SchedulerResume : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_FALSE(parser_.load(kGolden).get(root_)) << kGolden; }
  simdjson::dom::parser parser_;
  simdjson::dom::element root_;
};

TEST_P(SchedulerResume, AsMegatronsLoadStateDict) {
  const simdjson::dom::element g = root_[GetParam()];
  const SchedulerConfig here = ConfigOf(g["here"]), saved = ConfigOf(g["saved"]);
  // The differences Megatron's check finds, by its names; ptk's own (warm-up start, WSD) never stop a resume.
  std::set<std::string> want, got;
  for (simdjson::dom::element n : g["mismatches"].get_array()) want.insert(std::string(std::string_view(n)));
  for (const SchedulerDifference& d : CompareSchedulers(here, saved, 4))
    if (!d.megatron.empty()) got.insert(d.megatron);
  EXPECT_EQ(got, want);
  const std::pair<const char*, SchedulerOnLoad> modes[] = {{"check", SchedulerOnLoad::kCheck},
                                                           {"use_checkpoint", SchedulerOnLoad::kUseCheckpoint},
                                                           {"override", SchedulerOnLoad::kOverride}};
  for (const auto& [name, mode] : modes) {
    SCOPED_TRACE(name);
    const simdjson::dom::element m = g[name];
    std::vector<std::string> notes;
    absl::StatusOr<SchedulerConfig> r = ResolveResumedScheduler(here, saved, mode, 7, 4, &notes);
    if (bool(m["stops"])) {
      ASSERT_FALSE(r.ok());
      EXPECT_TRUE(IsUsageError(r.status())) << r.status();
      // Megatron's assertion names the first; ptk's line names each, with both values and the two flags.
      for (const SchedulerDifference& d : CompareSchedulers(here, saved, 4)) {
        if (d.megatron.empty()) continue;
        EXPECT_NE(StatusMessage(r.status()).find(d.what + " (" + d.flags + "): " + d.here + " here, " + d.saved),
                  std::string::npos)
            << r.status();
      }
      EXPECT_NE(StatusMessage(r.status()).find("--use-checkpoint-opt_param-scheduler"), std::string::npos);
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    const SchedulerConfig want_config = ConfigOf(m["values"]);
    EXPECT_TRUE(CompareSchedulers(*r, want_config, 4).empty());
    EXPECT_EQ(r->init_lr, want_config.init_lr);
    EXPECT_EQ(r->wsd_decay_steps, want_config.wsd_decay_steps);
    EXPECT_EQ(r->wsd_decay_style, want_config.wsd_decay_style);
    OptimizerParamScheduler s(*r);
    for (simdjson::dom::element p : m["rates"].get_array()) {
      simdjson::dom::array a = p.get_array();
      s.set_num_steps(int64_t(a.at(0)));
      EXPECT_DOUBLE_EQ(s.lr(), double(a.at(1))) << "step " << int64_t(a.at(0));
      EXPECT_DOUBLE_EQ(s.weight_decay(), double(a.at(2))) << "step " << int64_t(a.at(0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, SchedulerResume,
                         ::testing::Values("same", "longer_train_iters", "constant_longer_train_iters",
                                           "constant_other_min_lr", "longer_decay_only", "other_peak_and_style",
                                           "other_weight_decay", "weight_decay_increment", "warmup_fraction",
                                           "other_warmup_init", "other_wsd_anneal", "wsd_longer_train_iters"));

// What ptk adds to Megatron's behaviour: a line for the settings Megatron does not record, which stay this
// command line's under --use-checkpoint-opt_param-scheduler too (ptk took them from the checkpoint).
TEST(SchedulerResumeNotes, TheWarmupStartAndWsdAnnealAreTheCommandLinesAndSaidSo) {
  SchedulerConfig here, saved;
  here.max_lr = saved.max_lr = 1e-3;
  here.decay_steps = saved.decay_steps = 16;
  here.warmup_steps = saved.warmup_steps = 4;
  here.init_lr = 1e-5;
  std::vector<std::string> notes;
  auto r = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kUseCheckpoint, 7, 4, &notes);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->init_lr, 1e-5);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0],
            "this command line's warm-up start 1e-05 (the checkpoint's: 0): Megatron's checkpoint does not record "
            "these, and its resume takes them from the command line");
}

// --decoupled-lr / --decoupled-min-lr: megatron-core keeps them as the embedding and output layer's param
// group max_lr / min_lr, saved in its optimizer and loaded back on resume; ptk checks them as the scheduler's
// values: another one stops a resume (naming both and the flag), --use-checkpoint-opt_param-scheduler takes
// the checkpoint's, --override-opt_param-scheduler the command line's. A minimum without a decoupled rate on
// either side is no difference (it changes nothing there).
TEST(SchedulerResume, DecoupledRatesAreCheckedAsMegatronsGroupRates) {
  SchedulerConfig saved;
  saved.max_lr = 1e-3;
  saved.min_lr = 1e-4;
  saved.decay_steps = 100;
  SchedulerConfig here = saved;
  here.decoupled_min_lr = 5e-5;
  EXPECT_TRUE(CompareSchedulers(here, saved, 0).empty());
  saved.decoupled_lr = 1e-2;
  here.decoupled_lr = 2e-2;
  std::vector<std::string> notes;
  auto check = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kCheck, 7, 0, &notes);
  ASSERT_FALSE(check.ok());
  EXPECT_TRUE(IsUsageError(check.status())) << check.status();
  EXPECT_NE(check.status().message().find("decoupled learning rate (embedding and output layer) (--decoupled-lr): "
                                          "0.02 here, 0.01 in the checkpoint"),
            std::string::npos)
      << check.status();
  EXPECT_NE(check.status().message().find("decoupled minimum learning rate (--decoupled-min-lr): 5e-05 here, none "
                                          "(--min-lr's) in the checkpoint"),
            std::string::npos)
      << check.status();
  auto taken = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kUseCheckpoint, 7, 0, &notes);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->decoupled_lr, 1e-2);
  EXPECT_FALSE(taken->decoupled_min_lr.has_value());
  auto overridden = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kOverride, 7, 0, &notes);
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ(overridden->decoupled_lr, 2e-2);
  EXPECT_EQ(overridden->decoupled_min_lr, 5e-5);
  // A checkpoint without one (an earlier ptk's, or a run on --lr's schedule) against a decoupled run.
  saved.decoupled_lr.reset();
  EXPECT_FALSE(ResolveResumedScheduler(here, saved, SchedulerOnLoad::kCheck, 7, 0, &notes).ok());
}

// The decoupled group's rates: Megatron's get_lr with its max_lr and min_lr, the other settings shared; and
// the values Validate refuses (negative, or a peak below its minimum).
TEST(SchedulerResume, DecoupledGroupFollowsTheSharedScheduleWithItsOwnRates) {
  SchedulerConfig c;
  c.init_lr = 1e-5;
  c.max_lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 4;
  c.decay_steps = 12;
  c.decay_style = "linear";
  c.decoupled_lr = 3e-3;
  c.decoupled_min_lr = 3e-4;
  ASSERT_TRUE(c.Validate().ok());
  OptimizerParamScheduler s(c);
  s.set_num_steps(2);  // half the warm-up, from the shared start
  EXPECT_DOUBLE_EQ(s.decoupled_lr(), 1e-5 + (3e-3 - 1e-5) * 0.5);
  s.set_num_steps(8);  // half the decay
  EXPECT_DOUBLE_EQ(s.decoupled_lr(), 3e-4 + 0.5 * (3e-3 - 3e-4));
  EXPECT_DOUBLE_EQ(s.lr(), 1e-4 + 0.5 * (1e-3 - 1e-4));
  s.set_num_steps(13);
  EXPECT_EQ(s.decoupled_lr(), 3e-4);
  c.decoupled_min_lr.reset();  // --min-lr's then
  s.set_config(c);
  EXPECT_EQ(s.decoupled_lr(), 1e-4);
  c.decoupled_lr.reset();  // --lr's schedule
  s.set_config(c);
  EXPECT_EQ(s.decoupled_lr(), s.lr());
  for (auto [rate, minimum] : {std::pair{-1e-3, 0.0}, {1e-3, -1e-4}, {1e-4, 2e-4}}) {
    SchedulerConfig bad = c;
    bad.decoupled_lr = rate;
    bad.decoupled_min_lr = minimum;
    EXPECT_FALSE(bad.Validate().ok()) << rate << " " << minimum;
  }
}

}  // namespace
}  // namespace ptk
