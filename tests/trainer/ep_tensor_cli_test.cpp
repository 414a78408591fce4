// ptk-train's expert parallelism with tensor parallelism end to end (--expert-model-parallel-size E with
// --tensor-model-parallel-size T and --sequence-parallel, CPU, ranks as processes over loopback gloo), as
// megatron-core 0.16.1 with its default --expert-tensor-parallel-size T: each expert rank holds its experts' tensor
// slices, its expert group (the E ranks of one tensor rank from the data x context ranks of a stage, its expert rank
// generator's) exchanges the tensor group's gathered tokens, and the slices' outputs are summed over the tensor
// ranks (Megatron's allgather dispatcher over the tensor x expert ranks: the same sums). T x E runs log the lines of
// the same world without expert ranks, a stopped run resumes bit for bit from Megatron's mp_rank_TT[_PPP]_EEE
// files, the checkpoint loads at E = 1 and on one rank, and what Megatron refuses is refused in one line.
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
constexpr char kTP[] = " --tensor-model-parallel-size 2 --sequence-parallel";

class EpTensorCli : public testing::EpCliTest {};

// Against the same world without expert ranks: T = 2 x D = 2 x E = 2 (world 4: expert groups {0, 2} and {1, 3}, one
// per tensor rank) and T = 2 x C = 2 x E = 2 (world 4, the context ranks of each tensor rank its expert group). The
// sums are the same in another order (the experts' slices' outputs summed over the expert group, then the tensor
// group; the norms' squares over the expert group first), which these runs' 7 printed digits do not show: every
// logged value equal as printed (tolerance 0 on the parsed values); and one rank with every expert, its lm losses
// as printed too (moe_tp_train_cli_test allows 1e-5 for the tensor split's sums; these runs show none).
TEST_F(EpTensorCli, ExpertRanksOfTensorSlicesTrainAsWithoutExpertRanks) {
  const std::string ep = " --expert-model-parallel-size 2", c2 = " --context-parallel-size 2";
  const std::string dense = Run(4, kTP);
  const std::string tp_ep = Run(4, std::string(kTP) + ep);
  ExpectSameFields(dense, tp_ep, 0, "T = 2 x D = 2 x E = 2 against T = 2 x D = 2");
  ExpectSameFields(Run(4, kTP + c2), Run(4, kTP + c2 + ep), 0, "T = 2 x C = 2 x E = 2 against T = 2 x C = 2");
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(std::string(kTP) + ep), Losses(one.output), 6, kPrinted,
                                          "T = 2 x E = 2 against one rank", &out));
}

// A stopped T = 2 x E = 2 run resumes bit for bit from Megatron's files (mp_rank_TT_EEE: each tensor rank's slices of
// the dense layers and of its expert rank's experts), written by data rank 0's tensor rank 0; ZeRO-1 and
// --overlap-grad-reduce log the same lines; the checkpoint loads at E = 1 (T = 2: its lines as printed) and on one
// rank (its printed losses too); with stages the files are mp_rank_TT_PPP_EEE.
TEST_F(EpTensorCli, AStoppedRunResumesBitForBitAndLoadsAtOtherExpertSizes) {
  const std::string ep = std::string(kTP) + " --expert-model-parallel-size 2";
  const std::string whole = Run(4, ep);
  Run(4, ep + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck"));
  for (const char* mp : {"mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("ck/iter_0000003/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ck/iter_0000003/mp_rank_00"));
  std::filesystem::copy(dir_ / "ck", dir_ / "ck1", std::filesystem::copy_options::recursive);
  const auto a = Lines(whole), b = Lines(Run(4, ep + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(a.size(), 6u) << whole;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  EXPECT_EQ(Lines(Run(4, ep + " --use-distributed-optimizer")), a);
  EXPECT_EQ(Lines(Run(4, ep + " --overlap-grad-reduce --ddp-bucket-size 5000")), a);
  const auto want = Losses(whole);
  const std::vector<std::pair<int, double>> rest(want.begin() + 3, want.end());
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(std::string(kTP) + " --load " + ShellQuote(dir_ / "ck1")), rest, 3,
                                          kPrinted, "T = 2 x E = 2 checkpoint at T = 2 x E = 1", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(1, Train("--load " + ShellQuote(dir_ / "ck1")), rest, 3, kPrinted, "on one rank", &out));
  // With stages: one file per tensor rank, stage and expert rank.
  Run(8, ep + " --pipeline-model-parallel-size 2 --train-iters 3 --save " + ShellQuote(dir_ / "pp"));
  for (const char* mp : {"mp_rank_00_000_000", "mp_rank_01_000_001", "mp_rank_00_001_001", "mp_rank_01_001_000"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("pp/iter_0000003/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
}

TEST_F(EpTensorCli, WhatMegatronRefusesIsRefusedInOneLine) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags() +
                           " --disable-bias-linear --num-experts 4 --expert-model-parallel-size 2";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --tensor-model-parallel-size 2",
       "usage error: --num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"},
      {std::string(kTP) + " --expert-tensor-parallel-size 1",
       "usage error: --expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2: ptk splits the experts over "
       "the tensor ranks (--expert-tensor-parallel-size equal to the tensor size) only"},
      {std::string(kTP) + " --moe-ffn-hidden-size 45",
       "usage error: --moe-ffn-hidden-size 45 is not divisible by --tensor-model-parallel-size 2"},
      {std::string(kTP) + " --device cuda",
       "usage error: --expert-model-parallel-size 2 with --device cuda: expert parallelism runs on the CPU backend"},
      // One process: T x E ranks at least.
      {kTP,
       "--tensor-model-parallel-size 2 x --expert-model-parallel-size 2: the world size 1 is not divisible by tensor "
       "× pipeline model parallel size 2 × 1 = 2; start a multiple of 4 ranks (this is one process)"},
  };
  for (const auto& [flags, want] : cases) {
    auto c = RunCmd(base + flags);
    EXPECT_EQ(c.exit_code, 2) << flags << "\n" << c.output;
    EXPECT_NE(c.output.find(want), std::string::npos) << flags << "\n" << c.output;
    EXPECT_EQ(c.output.substr(c.output.find('\n') + 1), "Run with --help for more information.\n") << flags;
  }
  // Planned on one process (--dry-run, WORLD_SIZE 8): each tensor rank's expert groups.
  auto plan = RunCmd("WORLD_SIZE=8 " + base + kTP + " --dry-run");
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("expert"), std::string::npos) << plan.output;
}

}  // namespace
}  // namespace ptk
