// ptk-train's mixture-of-experts router features with context parallelism (CPU, ranks as processes over loopback
// gloo), as megatron-core 0.16.1 has them (the router on each context rank's own positions; its golden:
// moe_cp_router_golden_test): the z-loss (its coefficient over the context ranks, each on its own tokens), the
// seq_aux_loss and global_aux_loss types (their counts summed over the context ranks, the losses' totals the whole
// sequence's), the expert bias (its counts summed over the data x context group) and a capacity no rank's tokens
// exceed give one rank's lm losses and balancing losses at C = 2 within 1e-5 relative; the z_loss logged is the last
// context rank's own tokens' mean (Megatron tracks it without a reduce group), so not one rank's. With
// --calculate-per-token-loss Megatron scales the MoE losses' gradients by each rank's own tokens (b x t / C): C = 2
// trains as C = 1 with twice the coefficients. C = 2 x T = 2 gives one rank's losses too. A capacity that drops drops
// each rank's own tokens (not one rank's losses), and with every feature a stopped C = 2 run resumes bit for bit.
#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/moe_ranks_cli_support.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class MoeContextParallelCli : public testing::MoeRanksCliTest {
 protected:
  // 2 layers, global batch 4 of micro-batches of 1, dropout on (Megatron's defaults), `C` context ranks.
  std::string Train(int C, const std::string& extra, int64_t iters = 6) override {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) +
           " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear"
           " --context-parallel-size " +
           std::to_string(C) + " " + extra;
  }
};

TEST_F(MoeContextParallelCli, ZLossBalanceTypesExpertBiasAndCapacityTrainAsOneRankDoes) {
  ASSERT_NO_FATAL_FAILURE(ExpectRouterFeaturesTrainAsOneRank("C", "context"));
}

// Beside 2 tensor ranks (4 ranks, --sequence-parallel): Megatron's tensor x context group (the z-loss's coefficient
// over T x C, the counts summed over both) gives one rank's losses and balancing losses too.
TEST_F(MoeContextParallelCli, BesideTwoTensorRanksTrainsAsOneRankDoes) {
  const std::string all =
      "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
      "--moe-z-loss-coeff 0.01 --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
      "--moe-aux-loss-coeff 0.01 0.02 0.03";
  auto one = RunCmd(Train(1, all));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, all + " --tensor-model-parallel-size 2 --sequence-parallel"),
                                          Losses(one.output), 6, 1e-5, "C=2 x T=2", &out));
  ASSERT_NO_FATAL_FAILURE(ExpectEntriesNear(
      one.output, out, {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"}));
}

TEST_F(MoeContextParallelCli, TheFeaturesResumeBitForBit) {
  const std::string all =
      "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
      "--moe-z-loss-coeff 0.01 --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
      "--moe-aux-loss-coeff 0.01 0.01 0.01 --moe-expert-capacity-factor 1 --moe-token-drop-policy position";
  auto one = RunCmd(Train(1, all));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = Ranks(2, Train(2, all));
  ASSERT_NE(two.output.find(AllZero(2)), std::string::npos) << two.output << Logs(2);
  ASSERT_EQ(Losses(two.output).size(), 6u) << two.output;
  EXPECT_GT(Worst(Losses(two.output), Losses(one.output)), 1e-5) << "each rank's capacity is not one rank's";
  const auto train = [&](const std::string& extra) { return Train(2, all + " " + extra, 20); };
  ASSERT_NO_FATAL_FAILURE(StopAndResumeAtTheSameSize(2, train, "[ t 1/1, p 1/1 ]", {"mp_rank_00"}, "mp_rank_01"));
}

}  // namespace
}  // namespace ptk
