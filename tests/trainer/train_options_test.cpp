// PlanTraining refuses what Megatron's validate_args refuses in the schedule's flags: lengths in the
// unit the run is counted in (iterations with --train-iters, samples with --train-samples), and one
// warm-up. Each of these was taken and silently ignored (the run trained on another schedule than the
// one asked for). And RunTraining's --exit-duration-in-mins, counted from the process's start.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "tests/trainer/gloo_ranks.h"
#include "trainer/train_options.h"
#include "trainer/training.h"

namespace ptk {
namespace {

TrainOptions Small() {
  TrainOptions o;
  o.model.num_layers = 1;
  o.model.hidden_size = 32;
  o.model.num_attention_heads = 2;
  o.model.ffn_hidden_size = 128;
  o.model.seq_length = o.model.max_position_embeddings = 16;
  o.model.vocab_size = 100;
  o.model.padded_vocab_size = 128;
  o.mock_data = true;
  o.micro_batch_size = 2;
  o.global_batch_size = 4;
  o.schedule.max_lr = 1e-3;
  return o;
}

std::string Refusal(const TrainOptions& o) {
  absl::StatusOr<TrainPlan> p = PlanTraining(o, 1);
  EXPECT_FALSE(p.ok());
  if (p.ok()) return "";
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  return std::string(p.status().message());
}

TEST(PlanTraining, ScheduleLengthsInTheOtherUnitAreRefusedAsMegatron) {
  TrainOptions it = Small();
  it.train_iters = 10;
  ASSERT_TRUE(PlanTraining(it, 1).ok());
  TrainOptions o = it;
  o.schedule_options.lr_decay_samples = 40;
  EXPECT_NE(Refusal(o).find("--lr-decay-samples 40: with --train-iters the decay is in iterations"), std::string::npos);
  o = it;
  o.schedule_options.lr_warmup_samples = 4;
  EXPECT_NE(Refusal(o).find("--lr-warmup-samples 4: with --train-iters the warm-up is in iterations"),
            std::string::npos);
  o = it;
  o.schedule_options.lr_warmup_iters = 2;
  o.schedule_options.lr_warmup_fraction = 0.1;
  EXPECT_NE(Refusal(o).find("--lr-warmup-fraction 0.1 and --lr-warmup-iters 2: give one of them"), std::string::npos);
  o = it;
  o.schedule.decay_style = "WSD";
  o.schedule_options.lr_wsd_decay_samples = 8;
  EXPECT_NE(Refusal(o).find("--lr-wsd-decay-samples 8: with --train-iters the WSD anneal is in iterations"),
            std::string::npos);
  // What Megatron takes: a fraction with no warm-up iterations, the WSD anneal in iterations.
  o = it;
  o.schedule_options.lr_warmup_fraction = 0.1;
  EXPECT_TRUE(PlanTraining(o, 1).ok());
  o = it;
  o.schedule.decay_style = "WSD";
  o.schedule_options.lr_wsd_decay_iters = 2;
  EXPECT_TRUE(PlanTraining(o, 1).ok());

  TrainOptions sa = Small();
  sa.train_samples = 40;
  ASSERT_TRUE(PlanTraining(sa, 1).ok());
  o = sa;
  o.schedule_options.lr_decay_iters = 10;
  EXPECT_NE(Refusal(o).find("--lr-decay-iters 10: with --train-samples the decay is in samples"), std::string::npos);
  o = sa;
  o.schedule_options.lr_warmup_iters = 1;
  EXPECT_NE(Refusal(o).find("--lr-warmup-iters 1: with --train-samples the warm-up is in samples"), std::string::npos);
  o = sa;
  o.schedule_options.lr_warmup_samples = 4;
  o.schedule_options.lr_warmup_fraction = 0.25;
  EXPECT_NE(Refusal(o).find("--lr-warmup-fraction 0.25 and --lr-warmup-samples 4: give one of them"),
            std::string::npos);
  o = sa;
  o.schedule.decay_style = "WSD";
  o.schedule_options.lr_wsd_decay_iters = 2;
  EXPECT_NE(Refusal(o).find("--lr-wsd-decay-iters 2: with --train-samples the WSD anneal is in samples"),
            std::string::npos);
  o = sa;
  o.schedule_options.lr_decay_samples = 40;
  o.schedule_options.lr_warmup_samples = 8;
  EXPECT_TRUE(PlanTraining(o, 1).ok());
}

// --lr-warmup-fraction: Megatron's warm-up is lr_warmup_fraction * lr_decay_steps, a float
// (get_optimizer_param_scheduler). ptk truncated it to whole samples: 0.29 of 20 iterations x 4 is 23.2
// samples, 23 here, so every warm-up rate and the whole decay after it differed from Megatron's
// (5.217391E-04 at iteration 1 where megatron-core's OptimizerParamScheduler gives 5.172414E-04).
TEST(PlanTraining, WarmupFractionIsMegatronsUnroundedProduct) {
  TrainOptions o = Small();
  o.train_iters = 20;
  o.schedule.max_lr = 3e-3;
  o.schedule.min_lr = 3e-4;
  o.schedule.decay_style = "cosine";
  o.schedule_options.lr_warmup_fraction = 0.29;
  absl::StatusOr<TrainPlan> p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  const double warmup = 0.29 * 80;  // Megatron's expression, in samples
  EXPECT_EQ(p->schedule.warmup_steps, warmup);
  OptimizerParamScheduler s(p->schedule);
  s.Step(4);
  EXPECT_DOUBLE_EQ(s.lr(), 3e-3 * 4 / warmup);
  s.set_num_steps(24);  // the first iteration past the warm-up: the cosine from where it ends
  const double ratio = (24 - warmup) / (80 - warmup);
  EXPECT_DOUBLE_EQ(s.lr(), 3e-4 + 0.5 * (std::cos(M_PI * ratio) + 1.0) * (3e-3 - 3e-4));
  // With --train-samples too: 0.15 of 50 samples is 7.5.
  o.train_iters = 0;
  o.train_samples = 50;
  o.schedule_options.lr_warmup_fraction = 0.15;
  p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->schedule.warmup_steps, 0.15 * 50);
}

// --weight-decay-incr-style with --train-samples: Megatron's get_optimizer_param_scheduler increments the
// weight decay over --train-samples as given (wd_incr_steps = args.train_samples), not over the whole
// batches of the run. ptk took 48 samples (12 iterations x 4) for --train-samples 50, so the decay reached
// --end-weight-decay at the last iteration where Megatron's stands at 48/50 of the way.
TEST(PlanTraining, WeightDecayIncrementSpansTrainSamplesAsGiven) {
  TrainOptions o = Small();
  o.train_samples = 50;
  o.schedule.wd_incr_style = "linear";
  o.schedule_options.start_weight_decay = 0.0;
  o.schedule_options.end_weight_decay = 0.1;
  absl::StatusOr<TrainPlan> p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->train_iters, 12);
  EXPECT_EQ(p->schedule.wd_incr_steps, 50);
  OptimizerParamScheduler s(p->schedule);
  s.set_num_steps(48);
  EXPECT_DOUBLE_EQ(s.weight_decay(), 0.1 * 48 / 50);
  // With --train-iters: iterations x the global batch.
  o.train_samples = 0;
  o.train_iters = 12;
  p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->schedule.wd_incr_steps, 48);
}

// --start-weight-decay / --end-weight-decay: Megatron's validate_args takes them only with a
// --weight-decay-incr-style that increments (linear, cosine), and then both. ptk took --end-weight-decay
// 0.5 under the default constant style and trained every step with weight decay 0.5 instead of
// --weight-decay's 0.01, and a linear increment from --weight-decay when --start-weight-decay was missing.
TEST(PlanTraining, WeightDecayEndsAreRefusedAsMegatronWithoutAnIncrement) {
  TrainOptions o = Small();
  o.train_iters = 10;
  o.schedule_options.end_weight_decay = 0.5;
  EXPECT_NE(Refusal(o).find("--end-weight-decay 0.5 with --weight-decay-incr-style constant"), std::string::npos)
      << Refusal(o);
  o.schedule_options.end_weight_decay.reset();
  o.schedule_options.start_weight_decay = 0.0;
  EXPECT_NE(Refusal(o).find("--start-weight-decay 0 with --weight-decay-incr-style constant"), std::string::npos)
      << Refusal(o);
  o.schedule.wd_incr_style = "linear";
  EXPECT_NE(Refusal(o).find("--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"),
            std::string::npos)
      << Refusal(o);
  o.schedule_options.end_weight_decay = 0.5;
  absl::StatusOr<TrainPlan> p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->schedule.start_wd, 0.0);
  EXPECT_EQ(p->schedule.end_wd, 0.5);
}

// --rampup-batch-size with one or two numbers: the third was read past the vector's end (a SIGFPE
// with one number; with two, a run of 18 samples for --train-samples 16).
TEST(PlanTraining, ARampOfOtherThanThreeNumbersIsRefused) {
  TrainOptions o = Small();
  o.train_samples = 16;
  o.rampup_batch_size = {2, 2, 8};
  ASSERT_TRUE(PlanTraining(o, 1).ok());
  for (const std::vector<int64_t>& r : {std::vector<int64_t>{2}, std::vector<int64_t>{2, 2}}) {
    o.rampup_batch_size = r;
    EXPECT_NE(Refusal(o).find(": give three numbers, START INCR SAMPLES"), std::string::npos);
  }
  // A number below 1 (the flag's range refuses it; RunTraining's callers are checked here): an increment
  // of 0 was a division by zero (SIGFPE), 0 samples a NaN batch size cast to an integer.
  for (const std::vector<int64_t>& r :
       {std::vector<int64_t>{2, 0, 8}, std::vector<int64_t>{2, 2, 0}, std::vector<int64_t>{0, 2, 8}}) {
    o.rampup_batch_size = r;
    EXPECT_NE(Refusal(o).find("must be at least 1"), std::string::npos);
  }
}

// A --train-samples run sizes its training split and its weight-decay increment by --train-samples
// as given, as Megatron's get_train_valid_test_num_samples and get_optimizer_param_scheduler
// (wd_incr_steps = args.train_samples), with or without a ramp; its iterations consume the whole
// global batches (update_train_iters). The split and the increment were sized by the samples
// consumed: 40 of --train-samples 46 (another sample order, another weight-decay curve), and 44
// with --rampup-batch-size 2 2 16.
TEST(PlanTraining, SampleRunsAreSizedByTrainSamplesAsGiven) {
  TrainOptions o = Small();
  o.global_batch_size = 8;
  o.train_samples = 46;
  absl::StatusOr<TrainPlan> p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->train_iters, 5);
  EXPECT_EQ(p->train_samples, 40);
  EXPECT_EQ(p->train_split_samples, 46);
  EXPECT_EQ(p->schedule.wd_incr_steps, 46);
  o.rampup_batch_size = {2, 2, 16};
  p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->train_iters, 9);
  EXPECT_EQ(p->train_samples, 44);
  EXPECT_EQ(p->train_split_samples, 46);
  EXPECT_EQ(p->schedule.wd_incr_steps, 46);
  // --train-iters: train_iters x global batch for both.
  o.rampup_batch_size.clear();
  o.train_samples = 0;
  o.train_iters = 3;
  p = PlanTraining(o, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->train_split_samples, 24);
  EXPECT_EQ(p->schedule.wd_incr_steps, 24);
}

// --exit-duration-in-mins counts from the process's start (TrainOptions::started: ptk-train's first
// statement), as Megatron's from _TRAIN_START_TIME. It counted from the first iteration: a job whose
// limit the flag was set below ran past it by its start-up (the datasets' indices, a checkpoint's
// load, minutes at scale) and was killed without its save. Here a process started 2 minutes ago with
// a limit of 1 stops after its first iteration.
TEST(RunTraining, ExitDurationCountsFromTheProcessStart) {
  TrainOptions o = Small();
  o.train_iters = 4;
  o.eval_iters = 0;
  o.exit_duration_in_mins = 1;
  o.started = std::chrono::steady_clock::now() - std::chrono::minutes(2);
  std::vector<std::string> lines;
  o.print = [&](const std::string& line) { lines.push_back(line); };
  absl::StatusOr<TrainPlan> plan = PlanTraining(o, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<TrainSummary> s = RunTraining(o, *plan);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->iteration, 1);
  EXPECT_EQ(s->exit_reason.rfind("exiting program after 2.", 0), 0u) << s->exit_reason;
  // Without a process start given, from RunTraining's call: the four iterations run.
  o.started = {};
  s = RunTraining(o, *plan);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->iteration, 4);
  EXPECT_EQ(s->exit_reason, "");
}

// The exit lines are Megatron's print_datetime lines: "[exiting program after 2.0000...
// minutes] datetime: YYYY-MM-DD HH:MM:SS.ffffff " (the minutes as Python prints a float) and "[exiting
// program at iteration N] datetime: ... ". ptk printed "exiting program after 2.0 minutes" and
// "exiting program at iteration N" bare (and "exiting on signal" for Megatron's "exiting program
// after receiving SIGTERM.": train_cli_test).
TEST(RunTraining, ExitLinesAreMegatronsPrintDatetimeLines) {
  auto exit_line = [](const std::vector<std::string>& lines) {
    for (const std::string& l : lines)
      if (l.find("exiting program") != std::string::npos) return l;
    return std::string("(none)");
  };
  TrainOptions o = Small();
  o.train_iters = 4;
  o.eval_iters = 0;
  o.exit_duration_in_mins = 1;
  o.started = std::chrono::steady_clock::now() - std::chrono::minutes(2);
  std::vector<std::string> lines;
  o.print = [&](const std::string& line) { lines.push_back(line); };
  absl::StatusOr<TrainPlan> plan = PlanTraining(o, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<TrainSummary> s = RunTraining(o, *plan);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::regex datetime(
      " datetime: [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6} $");  // %S.%f, as 0.16.1 prints
  const std::string after = exit_line(lines);
  EXPECT_TRUE(std::regex_search(after, std::regex("^\\[exiting program after 2\\.[0-9]{3,} minutes\\]"))) << after;
  EXPECT_TRUE(std::regex_search(after, datetime)) << after;
  o.exit_duration_in_mins = 0;
  o.exit_interval = 2;
  lines.clear();
  s = RunTraining(o, *plan);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string at = exit_line(lines);
  EXPECT_EQ(at.rfind("[exiting program at iteration 2] datetime: ", 0), 0u) << at;
  EXPECT_TRUE(std::regex_search(at, datetime)) << at;
  EXPECT_EQ(s->exit_reason, "exiting program at iteration 2");
}

// --exit-duration-in-mins over several ranks: Megatron stops once any rank's own time is past the limit
// (each rank's train_time > limit, all-reduced with MAX). ptk compared the ranks' mean: a rank started
// 3 minutes ago beside one started now (a pod scheduled later, a rank that waited at the rendezvous)
// went on at a limit of 2, past the job's deadline the flag was set by. Here the two ranks stop after
// their first iteration.
TEST(RunTraining, ExitDurationStopsWhenAnyRankIsPastIt) {
  TrainOptions base = Small();
  base.train_iters = 4;
  base.eval_iters = 0;
  base.exit_duration_in_mins = 2;
  absl::StatusOr<TrainPlan> plan = PlanTraining(base, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<absl::StatusOr<TrainSummary>> results(2, absl::UnknownError("not run"));
  testing::RunRanks(2, [&](Communicator* comm, int rank) {
    TrainOptions o = base;
    o.comm = comm;
    o.print = [](const std::string&) {};
    o.started = std::chrono::steady_clock::now() - std::chrono::minutes(rank == 0 ? 3 : 0);
    results[static_cast<size_t>(rank)] = RunTraining(o, *plan);
  });
  for (int rank = 0; rank < 2; ++rank) {
    const absl::StatusOr<TrainSummary>& s = results[static_cast<size_t>(rank)];
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->iteration, 1) << "rank " << rank;
    EXPECT_EQ(s->exit_reason.rfind("exiting program after ", 0), 0u) << s->exit_reason;
  }
}

}  // namespace
}  // namespace ptk
