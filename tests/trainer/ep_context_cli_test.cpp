// ptk-train's expert parallelism with context parallelism end to end (--expert-model-parallel-size E with
// --context-parallel-size C, CPU, ranks as processes over loopback gloo), as megatron-core 0.16.1 lays it out: its
// expert rank generator (tp-ep-dp-pp, cp 1) takes the E ranks of an expert group from the data x context ranks of a
// stage (context fastest), so E may exceed the data ranks. Each context rank routes and dispatches its own
// positions; the experts' gradients are summed over the expert-data group (which holds context ranks), the rest over
// data x context. C x E runs log the lines of the same world without expert ranks, a stopped run resumes bit for bit
// from its per-expert-rank files, the checkpoint loads at E = 1 and on one rank, and bad sizes are refused in one
// line.
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

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

// RunGivingLosses' bound on the largest relative difference (strict): the printed losses equal.
constexpr double kPrinted = 1e-12;

class EpContextCli : public testing::EpCliTest {};

// Against the same world and context size without expert ranks: C = 2 x E = 2 (world 2, the context ranks are the
// expert group), C = 4 x E = 2 (world 4: expert groups {0, 1}, {2, 3}, the experts' gradients summed over context
// ranks {0, 2} and {1, 3}), C = 2 x D = 2 x E = 2 and C = 2 x D = 2 x E = 4 (world 4, E above the data ranks).
// The sums are the same, in another order (the experts' weight gradients add the expert group's tokens in one pass,
// the norms' squares add over the expert group first), which these runs' 7 printed digits do not show: every logged
// value equal as printed (tolerance 0 on the parsed values), and the lm losses of one rank with every expert too.
TEST_F(EpContextCli, ContextRanksAsExpertRanksTrainAsWithoutExpertRanks) {
  const std::string c2 = " --context-parallel-size 2", c4 = " --context-parallel-size 4";
  const std::string dense2 = Run(2, c2);
  ExpectSameFields(dense2, Run(2, c2 + " --expert-model-parallel-size 2"), 0, "C = 2 x E = 2 against C = 2");
  const std::string dense_c4 = Run(4, c4);
  ExpectSameFields(dense_c4, Run(4, c4 + " --expert-model-parallel-size 2"), 0, "C = 4 x E = 2 against C = 4");
  const std::string dense_d2 = Run(4, c2);
  ExpectSameFields(dense_d2, Run(4, c2 + " --expert-model-parallel-size 2"), 0,
                   "C = 2 x D = 2 x E = 2 against C = 2 x D = 2");
  ExpectSameFields(dense_d2, Run(4, c2 + " --expert-model-parallel-size 4"), 0,
                   "C = 2 x D = 2 x E = 4 against C = 2 x D = 2");
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(c2 + " --expert-model-parallel-size 2"), Losses(one.output), 6,
                                          kPrinted, "C = 2 x E = 2 against one rank", &out));
  // Pipeline stages: P = 2 x C = 2 x E = 2 against P = 2 x C = 2, each stage's context ranks its expert group.
  const std::string pp = " --pipeline-model-parallel-size 2";
  ExpectSameFields(Run(4, pp + c2), Run(4, pp + c2 + " --expert-model-parallel-size 2"), 0,
                   "P = 2 x C = 2 x E = 2 against P = 2 x C = 2");
}

// A stopped C = 2 x E = 2 run resumes bit for bit from Megatron's per-expert-rank files (mp_rank_00_EEE; with
// stages mp_rank_00_PPP_EEE), written by data x context rank 0; ZeRO-1 and --overlap-grad-reduce log the same
// lines; the checkpoint loads at E = 1 (C = 2) and on one rank, each continuing the run (its lm losses as printed).
TEST_F(EpContextCli, AStoppedRunResumesBitForBitAndLoadsAtOtherExpertSizes) {
  const std::string ep = " --context-parallel-size 2 --expert-model-parallel-size 2";
  const std::string whole = Run(2, ep);
  Run(2, ep + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck"));
  for (const char* mp : {"mp_rank_00_000", "mp_rank_00_001"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("ck/iter_0000003/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ck/iter_0000003/mp_rank_00"));
  std::filesystem::copy(dir_ / "ck", dir_ / "ck1", std::filesystem::copy_options::recursive);
  const auto a = Lines(whole), b = Lines(Run(2, ep + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(a.size(), 6u) << whole;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  EXPECT_EQ(Lines(Run(2, ep + " --use-distributed-optimizer")), a);
  EXPECT_EQ(Lines(Run(2, ep + " --overlap-grad-reduce --ddp-bucket-size 5000")), a);
  const auto want = Losses(whole);
  const std::vector<std::pair<int, double>> rest(want.begin() + 3, want.end());
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(" --context-parallel-size 2 --load " + ShellQuote(dir_ / "ck1")),
                                          rest, 3, kPrinted, "C = 2 x E = 2 checkpoint at C = 2 x E = 1", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(1, Train("--load " + ShellQuote(dir_ / "ck1")), rest, 3, kPrinted, "on one rank", &out));
  // With stages: one file per stage and expert rank.
  Run(4, ep + " --pipeline-model-parallel-size 2 --train-iters 3 --save " + ShellQuote(dir_ / "pp"));
  for (const char* mp : {"mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("pp/iter_0000003/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
}

TEST_F(EpContextCli, BadSizesAreRefusedInOneLine) {
  const std::string moe = " --num-experts 4 --context-parallel-size 2 --expert-model-parallel-size ";
  // E must divide data x context: 2 ranks at C = 2 have one data rank.
  auto r = Ranks(2, Train(moe + "4"));
  EXPECT_NE(r.output.find("usage error: --tensor-model-parallel-size 1 x --context-parallel-size 2 x "
                          "--expert-model-parallel-size 4: --expert-model-parallel-size 4: the data × context parallel "
                          "size 1 × 2 (world size 2 / tensor × pipeline size 1) is not divisible by it; start a "
                          "multiple of 4 ranks"),
            std::string::npos)
      << r.output << Logs(2);
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags() + " --disable-bias-linear";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {moe + "3", "usage error: --num-experts 4 is not divisible by --expert-model-parallel-size 3"},
      // One process: the lcm of C and E ranks at least.
      {moe + "2",
       "--context-parallel-size 2 x --expert-model-parallel-size 2: the world size 1 is not divisible by tensor × "
       "pipeline model parallel × context parallel size 1 × 1 × 2 = 2; start a multiple of 2 ranks (this is one "
       "process)"},
      {moe + "2 --sample-interval 1",
       "usage error: --expert-model-parallel-size 2 with --sample-interval: expert parallelism is implemented for "
       "training and evaluation only"},
      {moe + "2 --device cuda",
       "usage error: --expert-model-parallel-size 2 with --device cuda: expert parallelism runs on the CPU backend"},
  };
  for (const auto& [flags, want] : cases) {
    auto c = RunCmd(base + flags);
    EXPECT_EQ(c.exit_code, 2) << flags << "\n" << c.output;
    EXPECT_NE(c.output.find(want), std::string::npos) << flags << "\n" << c.output;
    EXPECT_EQ(c.output.substr(c.output.find('\n') + 1), "Run with --help for more information.\n") << flags;
  }
  // Planned on one process (--dry-run, WORLD_SIZE 4): the expert groups of the data x context ranks.
  auto plan = RunCmd("WORLD_SIZE=4 " + base + moe + "4 --dry-run");
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("expert"), std::string::npos) << plan.output;
}

}  // namespace
}  // namespace ptk
