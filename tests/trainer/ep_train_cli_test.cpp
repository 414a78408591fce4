// ptk-train's expert parallelism end to end (--expert-model-parallel-size, CPU, ranks as processes over loopback
// gloo): D = 2 x E = 2, D = 4 x E = 2 and D = 4 x E = 4 train as the same data ranks with every expert on each
// (the lm loss, grad norm and load_balancing_loss of every iteration and the final weights), the checkpoint in
// Megatron's per-expert-rank files (mp_rank_00_EEE, local expert numbers) resumes bit for bit and loads at
// another expert size (resharded), and what is not implemented is refused in one line naming both flags.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/ep_cli_support.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class EpTrainCli : public testing::EpCliTest {
 protected:
  // The whole model's weights in DIR's checkpoint of `iteration`, put together from its expert ranks' files.
  static std::vector<float> Weights(const std::string& dir, int64_t iteration) {
    auto layout = ParamLayout::Create(Config());
    EXPECT_TRUE(layout.ok()) << layout.status();
    std::vector<float> p, m, v;
    TrainState st;
    const absl::Status s = LoadCheckpoint(dir, iteration, *layout, &p, &m, &v, &st);
    EXPECT_TRUE(s.ok()) << s;
    return p;
  }
  // `world` ranks of `flags` against `ref` (the output of the same run with every expert on each rank, saved in
  // DIR/ref): each log line's lm loss, grad norm, load_balancing_loss, zero count and params norm within 1e-5
  // relative (the same sums in another order: the experts' weight gradients summed over the expert group's
  // tokens at once, the norms' squares over two groups), the final weights within 1e-5.
  void ExpectSameTraining(int world, const std::string& flags, const std::string& ref, const std::string& save,
                          const std::string& what) {
    auto r = Ranks(world, Train(flags + " --save " + ShellQuote(dir_ / save)));
    ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    double worst = 0;
    for (const char* field : {"lm loss", "grad norm", "load_balancing_loss", "num zeros", "params norm"}) {
      const auto want = Field(ref, field), got = Field(r.output, field);
      ASSERT_EQ(want.size(), 6u) << field << "\n" << ref;
      ASSERT_EQ(got.size(), want.size()) << what << " " << field << "\n" << r.output;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << what << " " << field << " line " << i;
        worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
      }
    }
    const std::vector<float> a = Weights(dir_ / "ref", 6), b = Weights(dir_ / save, 6);
    ASSERT_EQ(a.size(), b.size());
    float wmax = 0;
    for (size_t i = 0; i < a.size(); ++i) wmax = std::max(wmax, std::abs(a[i] - b[i]));
    EXPECT_LT(wmax, 1e-5f) << what;
    std::printf("%s: largest relative difference of the logged values %.3g, of the final weights %.3g\n", what.c_str(),
                worst, static_cast<double>(wmax));
  }
};

TEST_F(EpTrainCli, ExpertRanksTrainAsDataRanksWithEveryExpertDo) {
  auto ref = Ranks(2, Train("--save " + ShellQuote(dir_ / "ref")));
  // --log-num-zeros-in-grad and --log-params-norm count each expert once too (ExpectSameTraining's fields).
  ASSERT_NE(ref.output.find(AllZero(2)), std::string::npos) << ref.output << Logs(2);
  ASSERT_NO_FATAL_FAILURE(ExpectSameTraining(2, "--expert-model-parallel-size 2", ref.output, "ep2", "D = 2 x E = 2"));
  // Megatron's layout: one file per expert rank, each holding its two experts as local_experts.0 and .1.
  for (const char* mp : {"mp_rank_00_000", "mp_rank_00_001"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("ep2/iter_0000006/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ep2/iter_0000006/mp_rank_00"));
  auto rank1 = ParamLayout::Create(Config(), 1, 0, {}, 2, 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status own =
      LoadCheckpointFile(dir_ / "ep2/iter_0000006/mp_rank_00_001/model_optim_rng.ptk", 6, *rank1, &p, &m, &v, &st);
  EXPECT_TRUE(own.ok()) << own;
  ASSERT_NO_FATAL_FAILURE(
      ExpectSameTraining(4, "--expert-model-parallel-size 2", ref.output, "ep2d4", "D = 4 x E = 2"));
  ASSERT_NO_FATAL_FAILURE(
      ExpectSameTraining(4, "--expert-model-parallel-size 4", ref.output, "ep4d4", "D = 4 x E = 4"));
  EXPECT_TRUE(std::filesystem::exists(dir_ / "ep4d4/iter_0000006/mp_rank_00_003/model_optim_rng.ptk"));
}

// Token dropping with expert ranks: each rank drops over capacity among its own tokens before the dispatch
// (Megatron's router, as its allgather and alltoall dispatchers see it), so E = 2 trains as two data ranks with
// every expert do; the drop changes the run (its losses not the dropless one's).
TEST_F(EpTrainCli, ExpertRanksDropOverCapacityAsDataRanksDo) {
  const std::string capacity = "--moe-expert-capacity-factor 0.5 --moe-token-drop-policy position ";
  auto ref = Ranks(2, Train(capacity + "--save " + ShellQuote(dir_ / "ref")));
  ASSERT_NE(ref.output.find(AllZero(2)), std::string::npos) << ref.output << Logs(2);
  auto dropless = Ranks(2, Train("", 2));
  ASSERT_NE(dropless.output.find(AllZero(2)), std::string::npos) << dropless.output << Logs(2);
  ASSERT_FALSE(Field(dropless.output, "lm loss").empty()) << dropless.output;
  EXPECT_NE(Field(dropless.output, "lm loss")[0], Field(ref.output, "lm loss").at(0));
  ASSERT_NO_FATAL_FAILURE(
      ExpectSameTraining(2, capacity + "--expert-model-parallel-size 2", ref.output, "ep2", "capacity, D = 2 x E = 2"));
}

TEST_F(EpTrainCli, AStoppedRunResumesBitForBitAndLoadsAtOtherExpertSizes) {
  const std::string ep = "--expert-model-parallel-size 2";
  auto whole = Ranks(2, Train(ep + " --save " + ShellQuote(dir_ / "full")));
  ASSERT_NE(whole.output.find(AllZero(2)), std::string::npos) << whole.output << Logs(2);
  auto first = Ranks(2, Train(ep + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(first.output.find(AllZero(2)), std::string::npos) << first.output << Logs(2);
  auto resumed = Ranks(2, Train(ep + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  const auto a = testing::LogLinesWithoutTimes(whole.output), b = testing::LogLinesWithoutTimes(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  ASSERT_EQ(b.size(), 3u) << resumed.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  // Another expert size puts the experts together from both files (LoadResharded) and cuts its own: one rank
  // with every expert, and two data ranks each with every expert, continue the run.
  const auto want = testing::LossesOf(whole.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(1, Train("--load " + ShellQuote(dir_ / "ck")),
                                          std::vector<std::pair<int, double>>(want.begin() + 3, want.end()), 3, 1e-5,
                                          "E = 2 checkpoint on one rank", &out));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--load " + ShellQuote(dir_ / "ck")),
                                          std::vector<std::pair<int, double>>(want.begin() + 3, want.end()), 3, 1e-5,
                                          "E = 2 checkpoint on two data ranks", &out));
}

TEST_F(EpTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingBothFlags) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags();
  const std::string moe = " --num-experts 4 --disable-bias-linear --expert-model-parallel-size ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {moe + "3", "usage error: --num-experts 4 is not divisible by --expert-model-parallel-size 3"},
      {moe + "0", "--expert-model-parallel-size"},
      {" --expert-model-parallel-size 2", "usage error: --expert-model-parallel-size 2 without --num-experts"},
      // Tensor ranks need --sequence-parallel (as without expert ranks; the rest: ep_tensor_cli_test).
      {moe + "2 --tensor-model-parallel-size 2",
       "usage error: --num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"},
      // With --pipeline-model-parallel-size: ep_pipeline_cli_test; with --context-parallel-size: ep_context_cli_test.
      // --use-distributed-optimizer and --overlap-grad-reduce: ep_distopt_cli_test.
      {moe + "2 --sample-interval 1", "usage error: --expert-model-parallel-size 2 with --sample-interval"},
      {moe + "2 --device cuda",
       "usage error: --expert-model-parallel-size 2 with --device cuda: expert parallelism runs on the CPU backend"},
      {moe + "2 --dry-run --tensor-model-parallel-size 2",
       "--num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"},
      // One process is one data rank: the expert ranks are carved from the data ranks.
      {moe + "2",
       "usage error: --tensor-model-parallel-size 1 x --expert-model-parallel-size 2: --expert-model-parallel-size 2: "
       "the data-parallel size 1 (world size 1 / pipeline size 1) is not divisible by it; start a multiple of 2 ranks "
       "(this is one process)"},
  };
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
  }
}

}  // namespace
}  // namespace ptk
