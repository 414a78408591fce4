// ptk-train's --iterations-to-skip against what Megatron's train loop does with it (megatron/training/training.py,
// core_v0.16.1: where the count of iterations done is in the list, dummy_train_step reads the step's micro-batches
// and drops them, the counter and consumed/skipped samples advance, and the loop goes on without train_step, its
// log, evaluation, save or exit check): the skipped global batches never reach a step, a skip leaves the model, the
// moments and the scheduler as they were, a resume from a checkpoint before a skip gives the uninterrupted run's
// bits (one and two data ranks, gradient accumulation), two pipeline stages skip as one, a ramp's skip, the flag's odd
// values; --decrease-batch-size-if-needed, whose cut-off samples count as skipped too; --phase-transition-iterations.
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;
using Saved = testing::SavedCheckpoint;

class IterationsToSkipCli : public testing::RanksTest {
 protected:
  // The documents' ids are below 1000 (WriteLearnableDataset), their EOD the small vocabulary's.
  IterationsToSkipCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 6 of micro-batches of 1: 6 micro-batches a step on one rank, 3 on each of two. Dropout on. The
  // schedule's length is given (8 iterations), so that runs of other lengths share it.
  // `iters` 0: the caller gives --train-samples (and the schedule's length in samples, or none).
  std::string Train(const std::string& extra, int64_t iters = 8) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 6 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-iters 0 --log-interval 1 --threads 1 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") +
           (iters > 0 ? " --lr-decay-iters 8 --train-iters " + std::to_string(iters) : std::string()) + " " + extra;
  }
  Saved Load(const std::string& dir, int64_t iteration) {
    return testing::LoadTinyCheckpoint(dir, iteration, 1000, 1024);
  }
  testing::CommandResult RunAt(int world, const std::string& cmd) {
    return world == 1 ? RunCmd(cmd) : Ranks(world, cmd);
  }
  void ExpectOk(int world, const testing::CommandResult& r) {
    if (world == 1) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
    } else {
      EXPECT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    }
  }
  static void ExpectSameModel(const Saved& a, const Saved& b, const std::string& what) {
    EXPECT_EQ(a.state.adam_step, b.state.adam_step) << what;
    EXPECT_EQ(a.state.scheduler_num_steps, b.state.scheduler_num_steps) << what;
    EXPECT_TRUE(a.params == b.params) << what << ": weights differ";
    EXPECT_TRUE(a.m == b.m) << what << ": exp_avg differs";
    EXPECT_TRUE(a.v == b.v) << what << ": exp_avg_sq differs";
  }
};

std::vector<int> Iterations(const std::vector<std::pair<int, double>>& losses) {
  std::vector<int> v;
  for (const auto& [it, loss] : losses) v.push_back(it);
  return v;
}

TEST_F(IterationsToSkipCli, SkippedBatchesNeverReachAStep) {
  // --lr 0: the weights stay the initial ones, so each logged loss is its own batch's. Skipping the steps that start
  // with 3 and 5 iterations done drops the 4th and 6th batches, and every other step sees the batch it would have.
  const std::string still = "--lr 0 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style constant ";
  auto plain = RunCmd(Train(still));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto skip = RunCmd(Train(still + "--iterations-to-skip 5 3 3"));  // any order, repeats: a set, as Megatron's `in`
  ASSERT_EQ(skip.exit_code, 0) << skip.output;
  const auto all = Losses(plain.output), kept = Losses(skip.output);
  ASSERT_EQ(all.size(), 8u) << plain.output;
  EXPECT_EQ(Iterations(kept), (std::vector<int>{1, 2, 3, 5, 7, 8})) << skip.output;
  for (const auto& [it, loss] : kept)
    EXPECT_EQ(loss, all[static_cast<size_t>(it - 1)].second) << "iteration " << it << " trained on another batch";
  // Megatron's fields: the samples consumed count the skipped ones, which the line shows once there are any.
  EXPECT_NE(skip.output.find("iteration        3/       8 | consumed samples:           18 | elapsed"),
            std::string::npos)
      << skip.output;
  EXPECT_NE(skip.output.find("iteration        5/       8 | consumed samples:           30 | skipped samples:          "
                             "  6 |"),
            std::string::npos)
      << skip.output;
  EXPECT_NE(skip.output.find("done: iteration 8, 48 samples consumed (12 skipped)"), std::string::npos) << skip.output;
}

TEST_F(IterationsToSkipCli, ASkipLeavesModelMomentsAndScheduleAsTheyWere) {
  // The last step skipped: the final checkpoint holds the state after the 3 steps that ran, bit for bit, with the
  // counter and the consumed samples one batch further. And the learning rate after a skip is the one the skipped
  // step would have had: the scheduler did not move.
  auto three = RunCmd(Train("--exit-interval 3 --save " + ShellQuote(dir_ / "three"), 4));
  ASSERT_EQ(three.exit_code, 0) << three.output;
  auto skip = RunCmd(Train("--iterations-to-skip 3 --save " + ShellQuote(dir_ / "skip"), 4));
  ASSERT_EQ(skip.exit_code, 0) << skip.output;
  const Saved a = Load(dir_ / "three", 3), b = Load(dir_ / "skip", 4);
  ExpectSameModel(a, b, "after a skipped last step");
  EXPECT_EQ(a.state.consumed_train_samples, 18);
  EXPECT_EQ(b.state.iteration, 4);
  EXPECT_EQ(b.state.consumed_train_samples, 24);
  EXPECT_EQ(b.state.skipped_train_samples, 6);
  EXPECT_EQ(a.state.skipped_train_samples, 0);
  auto lr = [](const std::string& out, int it) {
    const std::string key = "iteration " + std::string(8 - std::to_string(it).size(), ' ') + std::to_string(it) + "/";
    const size_t at = out.find(key), rate = out.find("learning rate: ", at);
    return at == std::string::npos ? std::string("none") : out.substr(rate + 15, 12);
  };
  auto plain = RunCmd(Train(""));
  auto middle = RunCmd(Train("--iterations-to-skip 1"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(middle.exit_code, 0) << middle.output;
  EXPECT_EQ(lr(middle.output, 3), lr(plain.output, 2)) << middle.output;
  EXPECT_EQ(lr(middle.output, 8), lr(plain.output, 7)) << middle.output;
  EXPECT_EQ(lr(middle.output, 2), "none") << "a skipped iteration has no log line";
}

TEST_F(IterationsToSkipCli, ASkippedLastIterationIsSavedAsMegatronSavesIt) {
  // Megatron's pretrain saves after the loop only where `iteration % save_interval != 0`: a skipped last iteration
  // that --save-interval divides (its save was skipped with it) leaves the last checkpoint the one before it; one it
  // does not divide is saved, the skip counted. Without --save-interval (ptk's --save alone) the end is saved.
  for (const auto& [interval, saved] : std::vector<std::pair<int, int>>{{2, 2}, {3, 4}, {0, 4}}) {
    const std::string dir = dir_ / ("every" + std::to_string(interval));
    auto r = RunCmd(Train("--iterations-to-skip 3 --save " + ShellQuote(dir) +
                              (interval > 0 ? " --save-interval " + std::to_string(interval) : std::string()),
                          4));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(testing::ReadFile(dir + "/latest_checkpointed_iteration.txt"), std::to_string(saved))
        << "--save-interval " << interval;
    EXPECT_EQ(testing::Exists(dir + "/iter_0000004"), saved == 4) << "--save-interval " << interval;
    if (saved == 4) {
      EXPECT_EQ(Load(dir, 4).state.skipped_train_samples, 6) << "--save-interval " << interval;
    }
  }
}

TEST_F(IterationsToSkipCli, AResumeBeforeOrAfterASkipGivesTheUninterruptedBits) {
  // One rank (6 micro-batches a step) and two data ranks (3 each): stopped at iteration 2 (before both skips) and
  // at 5 (between them), resumed with the same flag: the uninterrupted run's log lines and final checkpoint.
  const std::string skip = "--iterations-to-skip 3 5 ";
  for (int world : {1, 2}) {
    const std::string w = std::to_string(world), whole = dir_ / ("whole" + w);
    auto u = RunAt(world, Train(skip + "--save " + ShellQuote(whole)));
    ASSERT_NO_FATAL_FAILURE(ExpectOk(world, u));
    const auto lines = Lines(u.output);
    ASSERT_EQ(lines.size(), 6u) << u.output;
    const Saved end = Load(whole, 8);
    EXPECT_EQ(end.state.skipped_train_samples, 12);
    EXPECT_EQ(end.state.consumed_train_samples, 48);
    for (int stop : {2, 5}) {
      const std::string what = w + " rank(s), stopped at " + std::to_string(stop);
      const std::string ck = dir_ / ("ck" + w + "_" + std::to_string(stop));
      auto first = RunAt(world, Train(skip + "--exit-interval " + std::to_string(stop) + " --save " + ShellQuote(ck)));
      ASSERT_NO_FATAL_FAILURE(ExpectOk(world, first));
      EXPECT_EQ(Load(ck, stop).state.skipped_train_samples, stop == 5 ? 6 : 0) << what;
      auto rest = RunAt(world, Train(skip + "--load " + ShellQuote(ck) + " --save " + ShellQuote(ck)));
      ASSERT_NO_FATAL_FAILURE(ExpectOk(world, rest));
      const size_t done = stop == 2 ? 2 : 4;  // log lines before the stop: iterations 1, 2 (and 3, 5)
      EXPECT_EQ(Lines(rest.output), std::vector<std::string>(lines.begin() + static_cast<long>(done), lines.end()))
          << what;
      const Saved resumed = Load(ck, 8);
      ExpectSameModel(end, resumed, what);
      EXPECT_EQ(resumed.state.consumed_train_samples, 48) << what;
      EXPECT_EQ(resumed.state.skipped_train_samples, 12) << what;
    }
  }
}

TEST_F(IterationsToSkipCli, TwoPipelineStagesSkipAsOne) {
  // Two stages: the first reads the batches, the last its stand-ins; both skip the same steps. The losses are one
  // rank's (the stages' sums differ in their last bits at most).
  const std::string small = "--make-vocab-size-divisible-by 512 --iterations-to-skip 3 5 ";
  auto one = RunCmd(Train(small));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(small + "--pipeline-model-parallel-size 2"), Losses(one.output), 6,
                                          1e-6, "P=2 skipping 3 and 5", &out));
  EXPECT_EQ(Iterations(Losses(out)), (std::vector<int>{1, 2, 3, 5, 7, 8})) << out;
}

// Each log line's iteration, consumed samples and global batch size.
std::vector<std::string> Batches(const std::string& out) {
  std::vector<std::string> v;
  const std::regex re(R"(iteration +\d+/ +\d+ \| consumed samples: +\d+ \|)");
  const std::regex gbs(R"(global batch size: +\d+ \|)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) {
    std::smatch m;
    const std::string rest = out.substr(static_cast<size_t>(it->position()));
    std::regex_search(rest, m, gbs);
    v.push_back(it->str() + " " + m.str());
  }
  return v;
}

TEST_F(IterationsToSkipCli, ARampSkipsTheBatchOfItsPlace) {
  // --rampup-batch-size 2 2 12 to 6: the batch follows the samples consumed, which a skip advances as a step does,
  // so the skipped run's lines show the plain run's consumed samples and batch sizes at the same iterations, and its
  // losses (--lr 0) the plain run's.
  const std::string ramp =
      "--lr 0 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style constant --rampup-batch-size 2 2 12 "
      "--train-samples 40 ";
  auto plain = RunCmd(Train(ramp, 0));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto skip = RunCmd(Train(ramp + "--iterations-to-skip 1 4", 0));
  ASSERT_EQ(skip.exit_code, 0) << skip.output;
  const auto all = Batches(plain.output), kept = Batches(skip.output);
  ASSERT_GE(all.size(), 6u) << plain.output;
  ASSERT_EQ(kept.size(), all.size() - 2) << skip.output;
  std::vector<std::string> expected = all;
  expected.erase(expected.begin() + 4);  // iteration 5
  expected.erase(expected.begin() + 1);  // iteration 2
  EXPECT_EQ(kept, expected);
  const auto losses = Losses(plain.output);
  for (const auto& [it, loss] : Losses(skip.output))
    EXPECT_EQ(loss, losses[static_cast<size_t>(it - 1)].second) << "iteration " << it;
}

// Megatron's --decrease-batch-size-if-needed (its microbatch calculator's running global batch size): a global batch
// of 7 over 2 data ranks of micro-batches of 1 trains on 6 samples an iteration, counts 1 skipped, and otherwise is
// the run of a global batch of 6 (a constant learning rate: the schedule's lengths count global batches of 7).
TEST_F(IterationsToSkipCli, DecreaseBatchSizeIfNeededTrainsTheLargestMultiple) {
  const std::string constant = "--lr-warmup-iters 0 --lr-decay-style constant ";
  auto six = Ranks(2, Train(constant + "--save " + ShellQuote(dir_ / "six"), 4));
  ASSERT_NO_FATAL_FAILURE(ExpectOk(2, six));
  auto seven = Ranks(
      2, Train(constant + "--global-batch-size 7 --decrease-batch-size-if-needed --save " + ShellQuote(dir_ / "seven"),
               4));
  ASSERT_NO_FATAL_FAILURE(ExpectOk(2, seven));
  EXPECT_NE(seven.output.find("decreasing batch size from 7 to 6to keep divisiblity by micro_batch_size=1 * "
                              "data_parallel_size=2"),
            std::string::npos)
      << seven.output;
  EXPECT_NE(seven.output.find("consumed samples:           24 | skipped samples:            4 |"), std::string::npos)
      << seven.output;
  EXPECT_NE(seven.output.find("global batch size:     6 |"), std::string::npos) << seven.output;
  EXPECT_EQ(Losses(seven.output), Losses(six.output));
  const Saved a = Load(dir_ / "six", 4), b = Load(dir_ / "seven", 4);
  ExpectSameModel(a, b, "a global batch of 7 cut to 6");
  EXPECT_EQ(b.state.consumed_train_samples, 24);
  EXPECT_EQ(b.state.skipped_train_samples, 4);
  // Without the flag, or with nothing left, or with a ramp: refused (exit 2) naming why.
  auto plain = Ranks(2, Train("--global-batch-size 7", 4));
  EXPECT_NE(plain.output.find("must be a multiple of --micro-batch-size (1) x data-parallel size (2) (or give "
                              "--decrease-batch-size-if-needed)"),
            std::string::npos)
      << plain.output;
  auto none = RunCmd(Train("--micro-batch-size 8 --decrease-batch-size-if-needed", 4));
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("no micro-batch is left"), std::string::npos) << none.output;
  auto ramp = RunCmd(Train("--decrease-batch-size-if-needed --rampup-batch-size 2 2 12 --train-samples 40", 0));
  EXPECT_EQ(ramp.exit_code, 2) << ramp.output;
  EXPECT_NE(ramp.output.find("--decrease-batch-size-if-needed with --rampup-batch-size is not implemented"),
            std::string::npos)
      << ramp.output;
}

// Megatron's --phase-transition-iterations: the run saves and exits at each transition, and each phase reads a
// training split built for its own samples from that split's first sample. At --lr 0 each loss is its batch's: the
// first phase's are a 3-iteration run's (18 samples), the second phase's, resumed, a fresh 5-iteration run's (30).
TEST_F(IterationsToSkipCli, PhaseTransitionsReadEachPhaseFromItsStart) {
  const std::string still = "--lr 0 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style constant ";
  const std::string phases = still + "--train-samples 48 --phase-transition-iterations 3 --save " +
                             ShellQuote(dir_ / "ph") + " --load " + ShellQuote(dir_ / "ph");
  auto first = RunCmd(Train(phases, 0));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("exiting program at iteration 3"), std::string::npos) << first.output;
  auto second = RunCmd(Train(phases, 0));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("this phase trains to iteration 8 on a training split of 30 samples, 0 of them "
                               "consumed"),
            std::string::npos)
      << second.output;
  auto eighteen = RunCmd(Train(still + "--train-samples 18", 0));
  auto thirty = RunCmd(Train(still + "--train-samples 30", 0));
  ASSERT_EQ(eighteen.exit_code, 0) << eighteen.output;
  ASSERT_EQ(thirty.exit_code, 0) << thirty.output;
  EXPECT_EQ(Losses(first.output), Losses(eighteen.output));
  auto shifted = Losses(thirty.output);
  for (auto& [it, loss] : shifted) it += 3;
  EXPECT_EQ(Losses(second.output), shifted);
  EXPECT_EQ(Load(dir_ / "ph", 8).state.consumed_train_samples, 48);
  // Refused: iteration-based training (Megatron's code fails there), another global batch on resume, a bad list.
  auto iters = RunCmd(Train("--phase-transition-iterations 3", 4));
  EXPECT_EQ(iters.exit_code, 2) << iters.output;
  EXPECT_NE(iters.output.find("multi-phase training needs --train-samples"), std::string::npos) << iters.output;
  auto other = RunCmd(Train(phases + " --global-batch-size 4", 0));
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("was saved with --global-batch-size 6, this run has 4"), std::string::npos)
      << other.output;
  auto bad = RunCmd(Train("--train-samples 48 --phase-transition-iterations 3,,5", 0));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("'' is not an integer"), std::string::npos) << bad.output;
}

TEST_F(IterationsToSkipCli, OddValuesAreTakenAsMegatronTakesThem) {
  // A negative number: never the count of iterations done (Megatron accepts it too); a note says so. Numbers past
  // the run skip nothing. No number, or not a number: a usage error (argparse's nargs '+' of int).
  auto neg = RunCmd(Train("--iterations-to-skip -2 100", 2));
  EXPECT_EQ(neg.exit_code, 0) << neg.output;
  EXPECT_NE(neg.output.find("--iterations-to-skip -2: accepted, skips nothing"), std::string::npos) << neg.output;
  EXPECT_EQ(Iterations(Losses(neg.output)), (std::vector<int>{1, 2})) << neg.output;
  // 0: the first step; the start-up lines name the first one that trains.
  auto zero = RunCmd(Train("--iterations-to-skip 0", 2));
  EXPECT_EQ(zero.exit_code, 0) << zero.output;
  EXPECT_EQ(Iterations(Losses(zero.output)), (std::vector<int>{2})) << zero.output;
  EXPECT_NE(zero.output.find("start-up: iteration 2 running"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("start-up: iteration 2 done"), std::string::npos) << zero.output;
  for (const char* bad : {"--iterations-to-skip", "--iterations-to-skip three", "--iterations-to-skip 2.5"}) {
    auto r = RunCmd(Train(bad, 2));
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("--iterations-to-skip"), std::string::npos) << bad << "\n" << r.output;
  }
}

}  // namespace
}  // namespace ptk
