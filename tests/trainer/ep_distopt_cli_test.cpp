// ptk-train's expert parallelism with --use-distributed-optimizer and --overlap-grad-reduce (CPU, ranks as
// processes over loopback gloo): the dense parameters' AdamW state sharded over the data ranks, the experts'
// over the expert-data ranks (trainer/expert_shard.h). The gradients are summed as without ZeRO-1 and AdamW
// works element by element, so D = 2 x E = 2 and D = 4 x E = 2 log the same lines and save the same checkpoint
// bits as the same runs without it; a stopped run resumes bit for bit and loads at other data and expert
// sizes; a killed rank ends the others.
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/ep_cli_support.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class EpDistOptCli : public testing::EpCliTest {
 protected:
  // Expert rank e's file of DIR's iteration `it` (of E expert ranks): weights and moments.
  static testing::SavedCheckpoint File(const std::string& dir, int64_t it, int E, int e) {
    testing::SavedCheckpoint s;
    auto layout = ParamLayout::Create(Config(), 1, 0, {}, E, e);
    EXPECT_TRUE(layout.ok()) << layout.status();
    const std::string file = dir + fmt::format("/iter_{:07d}/mp_rank_00_{:03d}/model_optim_rng.ptk", it, e);
    const absl::Status st = LoadCheckpointFile(file, it, *layout, &s.params, &s.m, &s.v, &s.state);
    EXPECT_TRUE(st.ok()) << st;
    return s;
  }
  // `world` ranks of EP `flags` with and without ZeRO-1 (`zero1`: --use-distributed-optimizer ...): the same log
  // lines (loss, grad norm, zeros, params norm, load-balancing loss) and the same bits in every expert rank's file.
  void ExpectSameAsWithout(int world, int E, const std::string& zero1, const std::string& what) {
    const std::string ep = "--expert-model-parallel-size " + std::to_string(E);
    const std::string ref = dir_ / (what + "_ref"), got = dir_ / (what + "_z1");
    auto a = Ranks(world, Train(ep + " --save " + ShellQuote(ref)));
    ASSERT_NE(a.output.find(AllZero(world)), std::string::npos) << a.output << Logs(world);
    auto b = Ranks(world, Train(ep + " " + zero1 + " --save " + ShellQuote(got)));
    ASSERT_NE(b.output.find(AllZero(world)), std::string::npos) << b.output << Logs(world);
    const auto want = Lines(a.output), have = Lines(b.output);
    ASSERT_EQ(want.size(), 6u) << a.output;
    EXPECT_EQ(have, want) << what;
    for (int e = 0; e < E; ++e) {
      const testing::SavedCheckpoint x = File(ref, 6, E, e), y = File(got, 6, E, e);
      EXPECT_EQ(x.params, y.params) << what << " expert rank " << e;
      EXPECT_EQ(x.m, y.m) << what << " expert rank " << e;
      EXPECT_EQ(x.v, y.v) << what << " expert rank " << e;
    }
    last_output_ = b.output;
  }
  std::string last_output_;
};

TEST_F(EpDistOptCli, ZeroOneAndOverlapTrainAndSaveTheBitsOfExpertParallelismWithout) {
  ASSERT_NO_FATAL_FAILURE(ExpectSameAsWithout(2, 2, "--use-distributed-optimizer", "d2e2"));
  ASSERT_NO_FATAL_FAILURE(ExpectSameAsWithout(4, 2, "--use-distributed-optimizer", "d4e2"));
  // The dense state over 4 data ranks, the experts' over the 2 ranks of each expert rank (Megatron's).
  EXPECT_NE(last_output_.find("the dense parameters' AdamW state sharded over 4 data-parallel ranks, the experts' "
                              "over 2 expert-data-parallel rank(s)"),
            std::string::npos)
      << last_output_;
  // Buckets of 4096 elements: the expert runs summed over the expert-data group, the rest over the data ranks.
  ASSERT_NO_FATAL_FAILURE(
      ExpectSameAsWithout(4, 2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 4096", "ov"));
  EXPECT_NE(last_output_.find("--overlap-grad-reduce: "), std::string::npos) << last_output_;
  ASSERT_NO_FATAL_FAILURE(ExpectSameAsWithout(4, 4, "--overlap-grad-reduce --ddp-bucket-size 4096", "ove4"));
}

TEST_F(EpDistOptCli, AStoppedRunResumesBitForBitAndLoadsAtOtherSizes) {
  const std::string flags = "--expert-model-parallel-size 2 --use-distributed-optimizer";
  auto whole = Ranks(4, Train(flags + " --save " + ShellQuote(dir_ / "full")));
  ASSERT_NE(whole.output.find(AllZero(4)), std::string::npos) << whole.output << Logs(4);
  auto first = Ranks(4, Train(flags + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(first.output.find(AllZero(4)), std::string::npos) << first.output << Logs(4);
  auto resumed = Ranks(4, Train(flags + " --load " + ShellQuote(dir_ / "ck") + " --save " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(resumed.output.find(AllZero(4)), std::string::npos) << resumed.output << Logs(4);
  const auto a = Lines(whole.output), b = Lines(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  for (int e = 0; e < 2; ++e) {
    const testing::SavedCheckpoint x = File(dir_ / "full", 6, 2, e), y = File(dir_ / "ck", 6, 2, e);
    EXPECT_EQ(x.params, y.params) << e;
    EXPECT_EQ(x.m, y.m) << e;
    EXPECT_EQ(x.v, y.v) << e;
  }
  // Other data and expert sizes load it (the files hold every moment): their losses those of the whole run
  // within 1e-5 relative (the same sums in another order, as ep_train_cli_test's).
  const auto want = testing::LossesOf(whole.output);
  const std::vector<std::pair<int, double>> rest(want.begin() + 3, want.end());
  std::string out;
  for (const auto& [world, other] :
       std::vector<std::pair<int, std::string>>{{2, "--expert-model-parallel-size 2 --use-distributed-optimizer"},
                                                {4, "--expert-model-parallel-size 4 --use-distributed-optimizer"},
                                                {2, "--use-distributed-optimizer"}})
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(world,
                                            Train(other + " --load " + ShellQuote(dir_ / "ck") + " --ckpt-step 3"),
                                            rest, 3, 1e-5, fmt::format("{} ranks, {}", world, other), &out));
}

// A rank killed while training ends the others (exit 1, naming it) instead of hanging them.
TEST_F(EpDistOptCli, AKilledRankEndsTheOthers) {
  const std::string cmd = Train(
      "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 4096 "
      "--distributed-timeout-minutes 1 --eval-iters 0",
      100000);
  const std::string port = std::to_string(testing::FreeTestPort());
  std::string script = "export WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; ";
  for (int rank : {0, 1, 2, 3})
    script += "RANK=" + std::to_string(rank) + " " + cmd + " > " + ShellQuote(RankLog(rank)) + " 2>&1 & p" +
              std::to_string(rank) + "=$!; ";
  script += "end=$((SECONDS + 120)); until grep -q 'iteration        4/' " + ShellQuote(RankLog(3)) +
            " || [ $SECONDS -ge $end ]; do sleep 0.05; done; kill -KILL $p1; wait $p0; r0=$?; wait $p2; r2=$?; "
            "wait $p3; r3=$?; wait $p1; echo rc=$r0,$r2,$r3";
  auto r = RunCmd("bash -c " + ShellQuote(script));
  EXPECT_NE(r.output.find("rc=1,1,1"), std::string::npos) << r.output << Logs(4);
  EXPECT_NE(testing::ReadFile(RankLog(3)).find("iteration        4/"), std::string::npos) << Logs(4);
  for (int rank : {0, 2, 3}) {
    const std::string log = testing::ReadFile(RankLog(rank));
    EXPECT_NE(log.find("failed (a rank died or the network failed)"), std::string::npos) << rank << "\n" << log;
    EXPECT_NE(log.find(") exited (its connection to the rendezvous closed"), std::string::npos) << rank << "\n" << log;
    EXPECT_NE(log.find("rank 1 (host "), std::string::npos) << rank << "\n" << log;
  }
}

// What stays refused with ZeRO-1 or overlap: one line, exit 2, naming both flags.
TEST_F(EpDistOptCli, WhatIsNotImplementedIsStillRefusedInOneLine) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags() +
                           " --num-experts 4 --disable-bias-linear --expert-model-parallel-size 2"
                           " --use-distributed-optimizer --overlap-grad-reduce";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --device cuda",
       "usage error: --expert-model-parallel-size 2 with --device cuda: expert parallelism runs on the CPU backend"},
      // With tensor ranks: ep_tensor_cli_test.
  };
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
    // The reason on one line, then CLI11's pointer to --help.
    EXPECT_EQ(r.output.substr(r.output.find('\n') + 1), "Run with --help for more information.\n") << flags;
  }
}

}  // namespace
}  // namespace ptk
