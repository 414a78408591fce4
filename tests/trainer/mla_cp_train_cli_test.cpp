// ptk-train's multi-latent attention with context parallelism (CPU, ranks as processes over loopback gloo): each
// context rank's rows of every sample (Megatron's load-balanced chunks), the query heads qk + pe wide and the value
// heads v wide gathered over the group, the rotary parts by true position. C = 2 gives one rank's lm losses over 6
// iterations with dropout on within 1e-5 relative (fp32 sums in another order: context_parallel_test's
// MultiLatentAttentionMatchesOneRank finds one pass's gradients within 2e-6 of the largest), with plain RoPE and a
// query LoRA, and with YaRN and none; beside 2 tensor ranks too (4 ranks); and a stopped C = 2 run resumes with the
// uninterrupted run's lines character for character.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class MlaContextParallelCli : public testing::RanksTest {
 protected:
  MlaContextParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) +
           " --multi-latent-attention --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 6"
           " --qk-layernorm --normalization RMSNorm " +
           extra;
  }
};

TEST_F(MlaContextParallelCli, TwoContextRanksTrainAsOneRankDoes) {
  for (const std::string flags :
       {"--rope-type rope --q-lora-rank 16", "--rope-type yarn --rotary-scaling-factor 4 --mscale 0.7"}) {
    SCOPED_TRACE(flags);
    auto one = RunCmd(Train(flags));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const auto ref = Losses(one.output);
    ASSERT_EQ(ref.size(), 6u) << one.output;
    std::string out;
    ASSERT_NO_FATAL_FAILURE(
        RunGivingLosses(2, Train(flags + " --context-parallel-size 2"), ref, 6, 1e-5, flags + ", C=2", &out));
    if (flags.find("yarn") != std::string::npos) continue;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4,
                                            Train(flags + " --context-parallel-size 2 --tensor-model-parallel-size 2"),
                                            ref, 6, 1e-5, flags + ", C=2 x T=2", &out));
  }
}

TEST_F(MlaContextParallelCli, AStoppedRunResumesBitForBit) {
  const auto train = [&](const std::string& extra) {
    return Train("--rope-type rope --q-lora-rank 16 --context-parallel-size 2 " + extra, 20);
  };
  ASSERT_NO_FATAL_FAILURE(StopAndResumeAtTheSameSize(2, train, "[ t 1/1, p 1/1 ]", {"mp_rank_00"}, "mp_rank_01"));
}

}  // namespace
}  // namespace ptk
