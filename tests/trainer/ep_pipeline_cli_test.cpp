// ptk-train's expert parallelism with pipeline stages (--expert-model-parallel-size with
// --pipeline-model-parallel-size, CPU, ranks as processes over loopback gloo): P = 2 x E = 2 (world 4, each stage's
// MoE layers dispatching over that stage's expert group) trains as P = 2 over two data ranks with every expert on
// each, and as P = 1 x E = 2 (1F1B; interleaved as its P = 2 x D = 2; --overlap-grad-reduce and
// --use-distributed-optimizer give the same lines); its checkpoint in Megatron's per-stage, per-expert-rank files
// (mp_rank_00_PPP_EEE) resumes bit for bit (ZeRO-1's too) and loads at another expert size (E = 2 -> 1 and back);
// what is not implemented is refused in one line naming both flags.
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

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class EpPipelineCli : public testing::EpCliTest {
 protected:
  // 4 layers ([1,0,1,1]: stage 0 one MoE layer and a dense one, stage 1 two MoE layers).
  EpPipelineCli() : EpCliTest(4, " --moe-layer-freq '[1,0,1,1]'") {}
};

constexpr char kPP[] = " --pipeline-model-parallel-size 2";
constexpr char kEP[] = " --expert-model-parallel-size 2";

// P = 2 x E = 2 against P = 2 x D = 2 with every expert on each rank: the same sums in the same order (each
// expert's weight gradient holds the expert group's tokens, then the sum over the expert-data group of one rank:
// the data-parallel sum of the same micro-batches), so every logged value is the same to its 7 digits except where
// the order of the sums differs (the experts' part of the norms added over the expert group first): 1e-6 relative.
// Against P = 1 x E = 2 (the stages' norm parts summed over the pipeline group, not in one pass): 1e-5, as one
// rank against P = 2 (moe_train_cli_test's PipelineStagesTrainAsOneRankDoes).
TEST_F(EpPipelineCli, ExpertRanksOnPipelineStagesTrainAsDataRanksWithEveryExpertDo) {
  auto dense = Ranks(4, Train(kPP));
  ASSERT_NE(dense.output.find(AllZero(4)), std::string::npos) << dense.output << Logs(4);
  auto ep = Ranks(4, Train(std::string(kPP) + kEP));
  ASSERT_NE(ep.output.find(AllZero(4)), std::string::npos) << ep.output << Logs(4);
  ExpectSameFields(dense.output, ep.output, 1e-6, "P = 2 x E = 2 against P = 2 x D = 2");
  auto flat = Ranks(2, Train(kEP));
  ASSERT_NE(flat.output.find(AllZero(2)), std::string::npos) << flat.output << Logs(2);
  ExpectSameFields(flat.output, ep.output, 1e-5, "P = 2 x E = 2 against P = 1 x E = 2");
  // World 8: P = 2 x D = 4 x E = 2, the experts' gradients summed over expert-data groups of 2 ([0, 2], [1, 3] on
  // stage 0, [4, 6], [5, 7] on stage 1, as megatron-core's expert rank generator).
  auto dense8 = Ranks(8, Train(kPP));
  ASSERT_NE(dense8.output.find(AllZero(8)), std::string::npos) << dense8.output << Logs(8);
  auto ep8 = Ranks(8, Train(std::string(kPP) + kEP));
  ASSERT_NE(ep8.output.find(AllZero(8)), std::string::npos) << ep8.output << Logs(8);
  ExpectSameFields(dense8.output, ep8.output, 1e-6, "P = 2 x D = 4 x E = 2 against P = 2 x D = 4");
  // ZeRO-1 there: each stage's expert moments sharded over its expert-data groups of 2, the same lines.
  auto zero8 = Ranks(8, Train(std::string(kPP) + kEP + " --use-distributed-optimizer"));
  ASSERT_NE(zero8.output.find(AllZero(8)), std::string::npos) << zero8.output << Logs(8);
  EXPECT_EQ(Lines(zero8.output), Lines(ep8.output));
  // The interleaved schedule (chunks of one layer: stage 0 MoE layers 0 and 2, stage 1 dense layer 1 and MoE layer
  // 3) against its P = 2 x D = 2 run.
  const std::string interleaved = std::string(kPP) + " --num-layers-per-virtual-pipeline-stage 1";
  auto dense_v = Ranks(4, Train(interleaved));
  ASSERT_NE(dense_v.output.find(AllZero(4)), std::string::npos) << dense_v.output << Logs(4);
  auto ep_v = Ranks(4, Train(interleaved + kEP));
  ASSERT_NE(ep_v.output.find(AllZero(4)), std::string::npos) << ep_v.output << Logs(4);
  ExpectSameFields(dense_v.output, ep_v.output, 1e-6, "interleaved P = 2 x E = 2 against P = 2 x D = 2");
  // --overlap-grad-reduce: each bucket's expert runs over the expert-data group as backward completes it.
  auto overlap = Ranks(4, Train(std::string(kPP) + kEP + " --overlap-grad-reduce --ddp-bucket-size 5000"));
  ASSERT_NE(overlap.output.find(AllZero(4)), std::string::npos) << overlap.output << Logs(4);
  EXPECT_EQ(Lines(overlap.output), Lines(ep.output));
  // --use-distributed-optimizer: each stage's moments sharded over its data and expert-data groups, the same lines.
  auto zero = Ranks(4, Train(std::string(kPP) + kEP + " --use-distributed-optimizer"));
  ASSERT_NE(zero.output.find(AllZero(4)), std::string::npos) << zero.output << Logs(4);
  EXPECT_EQ(Lines(zero.output), Lines(ep.output));
}

// A stopped P = 2 x E = 2 run resumes bit for bit from its files (mp_rank_00_PPP_EEE, Megatron's
// get_checkpoint_name with both ranks); the checkpoint loads at E = 1 (P = 2 over two data ranks) and a P = 2 x
// E = 1 checkpoint at E = 2, each continuing the other's run (1e-6: the norms' sums in another order).
TEST_F(EpPipelineCli, AStoppedRunResumesBitForBitAndLoadsAtOtherExpertSizes) {
  const std::string ep = std::string(kPP) + kEP;
  auto whole = Ranks(4, Train(ep));
  ASSERT_NE(whole.output.find(AllZero(4)), std::string::npos) << whole.output << Logs(4);
  auto first = Ranks(4, Train(ep + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(first.output.find(AllZero(4)), std::string::npos) << first.output << Logs(4);
  for (const char* mp : {"mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"})
    EXPECT_TRUE(std::filesystem::exists(dir_ / ("ck/iter_0000003/" + std::string(mp) + "/model_optim_rng.ptk"))) << mp;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ck/iter_0000003/mp_rank_00_000"));
  std::filesystem::copy(dir_ / "ck", dir_ / "ck1", std::filesystem::copy_options::recursive);
  auto resumed = Ranks(4, Train(ep + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(resumed.output.find(AllZero(4)), std::string::npos) << resumed.output << Logs(4);
  const auto a = Lines(whole.output), b = Lines(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  // Under ZeRO-1 (every moment in the files, put together from the shards): the same resume.
  const std::string zero = ep + " --use-distributed-optimizer";
  auto zero_first = Ranks(4, Train(zero + " --exit-interval 3 --save " + ShellQuote(dir_ / "z")));
  ASSERT_NE(zero_first.output.find(AllZero(4)), std::string::npos) << zero_first.output << Logs(4);
  auto zero_resumed = Ranks(4, Train(zero + " --load " + ShellQuote(dir_ / "z")));
  ASSERT_NE(zero_resumed.output.find(AllZero(4)), std::string::npos) << zero_resumed.output << Logs(4);
  EXPECT_EQ(Lines(zero_resumed.output), std::vector<std::string>(a.begin() + 3, a.end()));
  const auto want = Losses(whole.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(std::string(kPP) + " --load " + ShellQuote(dir_ / "ck1")),
                                          std::vector<std::pair<int, double>>(want.begin() + 3, want.end()), 3, 1e-6,
                                          "P = 2 x E = 2 checkpoint at P = 2 x E = 1", &out));
  // And back: a P = 2 x E = 1 checkpoint at E = 2.
  auto dense = Ranks(4, Train(kPP));
  ASSERT_NE(dense.output.find(AllZero(4)), std::string::npos) << dense.output << Logs(4);
  auto stop = Ranks(4, Train(std::string(kPP) + " --exit-interval 3 --save " + ShellQuote(dir_ / "d")));
  ASSERT_NE(stop.output.find(AllZero(4)), std::string::npos) << stop.output << Logs(4);
  const auto dense_losses = Losses(dense.output);
  ASSERT_EQ(dense_losses.size(), 6u) << dense.output;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(ep + " --load " + ShellQuote(dir_ / "d")),
                      std::vector<std::pair<int, double>>(dense_losses.begin() + 3, dense_losses.end()), 3, 1e-6,
                      "P = 2 x E = 1 checkpoint at P = 2 x E = 2", &out));
}

TEST_F(EpPipelineCli, WhatIsNotImplementedIsRefusedInOneLineNamingBothFlags) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags() + " --num-experts 4 --disable-bias-linear" + kEP + kPP;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --device cuda",
       "usage error: --expert-model-parallel-size 2 with --device cuda: expert parallelism runs on the CPU backend"},
  };
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
    EXPECT_EQ(r.output.substr(r.output.find('\n') + 1), "Run with --help for more information.\n") << flags;
  }
  // P = 2 x E = 2 is planned (--dry-run on one process): the expert groups per stage.
  auto plan = RunCmd("WORLD_SIZE=4 " + base + " --dry-run");
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
}

}  // namespace
}  // namespace ptk
