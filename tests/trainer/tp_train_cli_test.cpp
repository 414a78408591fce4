// ptk-train's tensor parallelism end to end, ranks as processes over loopback gloo: T = 2 and 4
// tensor ranks, and T = 2 x 2 data ranks with ZeRO-1 and --overlap-grad-reduce, give the loss lines
// of one rank within 1e-5 relative over 20 iterations with dropout on (T = 2 and 4 also with
// --sequence-parallel) (a vocabulary of 1000 padded to the
// same size at every T); checkpoints in Megatron's layout (iter_N/mp_rank_TT) resume at the same T
// with the uninterrupted run's lines character for character, and at T = 1 and 4 within 1e-5;
// a tensor rank killed ends every other rank naming it, and its last checkpoint resumes bit for bit;
// sizes that do not divide are refused in one line, exit 2, on every rank.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

class TensorParallelCli : public testing::RanksTest {
 protected:
  // The documents' ids are below 1000 (WriteLearnableDataset), their EOD the small vocabulary's.
  TensorParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 4 of micro-batches of 1; dropout on (Megatron's defaults). GPT-2's tokenizer cut
  // to a vocabulary of 1000 (SmallVocabFlags): the output layer of 50257 made the runs twenty times slower
  // and checks nothing more (the same vocabulary-parallel embedding and cross-entropy, the last rank's
  // slice partly padding).
  // It is padded to 1024 at every T (Megatron pads to a multiple of divisible-by x T).
  std::string Train(int T, const std::string& extra, int64_t iters = 20) {
    return ptk::testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 10 --eval-iters 1 --log-interval 1 --threads 1"
           " --tensor-model-parallel-size " +
           std::to_string(T) + " --make-vocab-size-divisible-by " + std::to_string(512 / T) + " --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  // The one-rank run every test compares with (the same dataset bytes in every test's directory).
  const std::string& OneRank() {
    static std::string out;
    if (out.empty()) {
      auto r = RunCmd(Train(1, ""));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find(" > padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)"), std::string::npos)
          << r.output;
      out = r.output;
    }
    return out;
  }
  // Megatron's Llama line: RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU, 4 query heads in
  // 2 groups, no biases, untied.
  const std::string kLlama =
      "--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --swiglu "
      "--group-query-attention --num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights";
  // Its one-rank run of 10 iterations, which the Llama tests compare with.
  const std::string& OneRankLlama() {
    static std::string out;
    if (out.empty()) {
      auto r = RunCmd(Train(1, kLlama, 10));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      out = r.output;
    }
    return out;
  }
};

TEST_F(TensorParallelCli, TwoAndFourTensorRanksGiveOneRanksLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u) << OneRank();
  EXPECT_LT(one.back().second, one.front().second);
  for (const auto& [T, sp] : {std::pair{2, false}, std::pair{4, false}, std::pair{2, true}, std::pair{4, true}}) {
    const std::string what = std::string("T=") + std::to_string(T) + (sp ? " --sequence-parallel" : "");
    SCOPED_TRACE(what);
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(T, Train(T, sp ? "--sequence-parallel" : ""), one, 20, 1e-5, what, &out));
    EXPECT_NE(out.find("> initialized tensor model parallel with size " + std::to_string(T)), std::string::npos) << out;
    EXPECT_NE(out.find(" > padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)"), std::string::npos);
    // Megatron's line from each tensor rank of the first data-parallel rank: rank 0's own, and the
    // last tensor rank's in its log.
    EXPECT_NE(out.find(" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "),
              std::string::npos);
    EXPECT_NE(Logs(T).find(" > number of parameters on (tensor, pipeline) model parallel rank (" +
                           std::to_string(T - 1) + ", 0): "),
              std::string::npos)
        << Logs(T);
  }
}

// Megatron's Llama line (RMSNorm, RoPE with Llama 3.1's scaling, SwiGLU, 4 query heads in 2 groups,
// no biases, untied; dropout on) at T=2 with --sequence-parallel: one rank's losses. (T=2 without it,
// the same run with --save, is LlamaLineGivesOneRanksLossesAndResumes's.)
TEST_F(TensorParallelCli, ALlamaLineModelWithSequenceParallelGivesOneRanksLosses) {
  const auto one = Losses(OneRankLlama());
  ASSERT_EQ(one.size(), 10u) << OneRankLlama();
  const std::string what = "Llama line, T=2 --sequence-parallel";
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, kLlama + " --sequence-parallel", 10), one, 10, 1e-5, what, &out));
}

TEST_F(TensorParallelCli, TensorTimesDataRanksWithZeroOneAndOverlapGiveOneRanksLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 20000"), one, 20,
                      1e-5, "T=2 x D=2, ZeRO-1, overlap", &out));
  EXPECT_NE(out.find("tensor parallel: 2 ranks x data parallel: 2 ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("distributed optimizer: each of 2 ranks keeps"), std::string::npos) << out;
}

// Megatron's Llama line (RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU, 4 query heads
// in 2 groups, untied, no biases; dropout on): T = 2, and T = 2 x D = 2 with ZeRO-1, give one rank's
// losses; a checkpoint resumed at T = 2 continues with the uninterrupted run's lines.
TEST_F(TensorParallelCli, LlamaLineGivesOneRanksLossesAndResumes) {
  const std::string llama = " " + kLlama;
  const auto ref = Losses(OneRankLlama());
  ASSERT_EQ(ref.size(), 10u) << OneRankLlama();
  auto t2 = Ranks(2, Train(2, llama + " --save " + ShellQuote(dir_ / "ck") + " --save-interval 5", 10));
  ASSERT_NE(t2.output.find(AllZero(2)), std::string::npos) << t2.output << Logs(2);
  EXPECT_LT(Worst(Losses(t2.output), ref), 1e-5);
  auto dp = Ranks(4, Train(2, llama + " --use-distributed-optimizer", 10));
  ASSERT_NE(dp.output.find(AllZero(4)), std::string::npos) << dp.output << Logs(4);
  EXPECT_LT(Worst(Losses(dp.output), ref), 1e-5);
  std::printf("Llama line: T=2 %.3g, T=2 x D=2 ZeRO-1 %.3g largest relative difference from one rank's losses\n",
              Worst(Losses(t2.output), ref), Worst(Losses(dp.output), ref));
  // Iteration 10 lost: resume from iteration 5's checkpoint.
  std::filesystem::remove_all(dir_ / "ck/iter_0000010");
  testing::WriteFile(dir_ / "ck/latest_checkpointed_iteration.txt", "5");
  auto resumed = Ranks(2, Train(2, llama + " --load " + ShellQuote(dir_ / "ck"), 10));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  const auto whole = Lines(t2.output), again = Lines(resumed.output);
  ASSERT_EQ(whole.size(), 10u);
  ASSERT_EQ(again.size(), 5u) << resumed.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(again[i], whole[5 + i]);
}

// --qk-layernorm (the Llama line with Qwen3's query and key norms): T = 2 gives one rank's losses
// (the norms' gradients summed over the tensor group); its checkpoint of iteration 5 resumed at T = 1
// (the norms whole on every rank: taken from the saved ranks) gives one rank's losses, and at T = 2
// the uninterrupted run's lines.
TEST_F(TensorParallelCli, QKLayerNormGivesOneRanksLossesAndItsCheckpointsReshard) {
  const std::string qwen3 = " " + kLlama + " --qk-layernorm";
  auto one = RunCmd(Train(1, qwen3, 10));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 10u) << one.output;
  auto t2 = Ranks(2, Train(2, qwen3 + " --save " + ShellQuote(dir_ / "ck") + " --save-interval 5", 10));
  ASSERT_NE(t2.output.find(AllZero(2)), std::string::npos) << t2.output << Logs(2);
  EXPECT_LT(Worst(Losses(t2.output), ref), 1e-5);
  std::filesystem::remove_all(dir_ / "ck/iter_0000010");
  testing::WriteFile(dir_ / "ck/latest_checkpointed_iteration.txt", "5");
  auto t1 = RunCmd(Train(1, qwen3 + " --load " + ShellQuote(dir_ / "ck"), 10));
  ASSERT_EQ(t1.exit_code, 0) << t1.output;
  EXPECT_NE(t1.output.find("saved with --tensor-model-parallel-size 2): the saved ranks' slices"), std::string::npos)
      << t1.output;
  ASSERT_EQ(Losses(t1.output).size(), 5u) << t1.output;
  EXPECT_LT(Worst(Losses(t1.output), ref), 1e-5);
  auto resumed = Ranks(2, Train(2, qwen3 + " --load " + ShellQuote(dir_ / "ck"), 10));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  const auto whole = Lines(t2.output), again = Lines(resumed.output);
  ASSERT_EQ(whole.size(), 10u);
  ASSERT_EQ(again.size(), 5u) << resumed.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(again[i], whole[5 + i]);
}

TEST_F(TensorParallelCli, CheckpointsResumeAtTheSameAndOtherTensorSizes) {
  const auto train = [&](const std::string& extra) { return Train(2, extra); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/2, p 1/1 ]", {"mp_rank_00", "mp_rank_01"}, "mp_rank_02"));
  // Another tensor size: the slices put together and cut anew; one rank's losses within 1e-5.
  const auto one = Losses(OneRank());
  for (int T : {1, 4}) {
    const std::string dst = dir_ / ("ck" + std::to_string(T)),
                      what = "T=2 checkpoint resumed at T=" + std::to_string(T);
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(T, Train(T, "--load " + ShellQuote(dst) + " --save " + ShellQuote(dst)),
                                            one, 10, 1e-5, what, &out));
    EXPECT_NE(out.find("saved with --tensor-model-parallel-size 2): the saved ranks' slices"), std::string::npos)
        << out;
    EXPECT_EQ(Losses(out).front().first, 11);
  }
}

// kill -9 of one tensor rank of T = 2 x D = 2 in the middle of training: the three others (its
// tensor peer and the other data-parallel pair) end non-zero within --distributed-timeout-minutes,
// each naming the dead rank; --load of the last checkpoint then continues with the lines of a run
// never interrupted, character for character.
TEST_F(TensorParallelCli, AKilledTensorRankEndsEveryRankAndTheLastCheckpointResumes) {
  const std::string host = ptk::testing::ReadFile("/proc/sys/kernel/hostname");
  const std::string named =
      "rank 1 (host " + host.substr(0, host.find('\n')) + ") exited (its connection to the rendezvous closed";
  // Never ending by itself (the schedule of 100000 iterations in every run below); 12 s timeout.
  const std::string flags = "--distributed-timeout-minutes 0.2 --save-interval 3 --eval-iters 0";
  const std::string ck = dir_ / "ck";
  const std::string cmd = Train(2, flags + " --save " + ShellQuote(ck), 100000);
  std::string script =
      "export WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(testing::FreeTestPort()) + "; ";
  for (int rank = 0; rank < 4; ++rank)
    // The victim runs as the shell's own child (its pid is the one killed); the others under
    // timeout, so that one which hangs exits 124 instead of blocking the test.
    script += "RANK=" + std::to_string(rank) + (rank == 1 ? " " : " timeout 300 ") + cmd + " > " +
              ShellQuote(RankLog(rank)) + " 2>&1 & p" + std::to_string(rank) + "=$!; ";
  // Once a checkpoint is saved, rank 1 (tensor rank 1 of data rank 0) is killed; the others must
  // end by themselves.
  script += "for i in $(seq 600); do grep -q 'successfully saved checkpoint' " + ShellQuote(RankLog(0)) +
            " && break; sleep 0.1; done; kill -KILL $p1; start=$SECONDS; wait $p0; r0=$?; wait $p2; r2=$?; "
            "wait $p3; r3=$?; echo rc=$r0,$r2,$r3 after=$((SECONDS-start)); wait $p1";
  auto killed = RunCmd("bash -c " + ShellQuote(script));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(killed.output, m, std::regex(R"(rc=(\d+),(\d+),(\d+) after=(\d+))"))) << killed.output;
  std::printf("the others exited %s s after the kill\n", m[4].str().c_str());
  for (int i : {1, 2, 3}) {
    const int rank = i == 1 ? 0 : i;
    const std::string log = ptk::testing::ReadFile(RankLog(rank));
    EXPECT_NE(m[i], "0") << "rank " << rank << "\n" << log;
    EXPECT_NE(m[i], "124") << "rank " << rank << " hung\n" << log;
    // Every survivor names rank 1, ranks 2 and 3 too: rank 0 (rank 1's tensor peer) meets the death first, and
    // serves the rendezvous until they have asked which rank went (they said "rank 0 ... exited" when it did not,
    // seen once in CI: RankZeroEndingOnADeathStillTellsTheLaterRanksWhoWentFirst in comm_test).
    EXPECT_NE(log.find(named), std::string::npos) << "rank " << rank << "\n" << log;
  }
  // The closed connection is noticed at once; 30 s leaves room for a loaded CI machine.
  EXPECT_LE(std::stoi(m[4]), 30) << "seconds from the kill to the others' exit";
  auto latest = LatestCheckpointIteration(ck);
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_GE(*latest, 3);
  // Resumed at the same layout to a few iterations past the checkpoint, and a run never
  // interrupted to the same iteration.
  const int64_t end = *latest + 3;
  const std::string until = " --exit-interval " + std::to_string(end);
  auto resumed = Ranks(4, Train(2, flags + until + " --load " + ShellQuote(ck), 100000));
  ASSERT_NE(resumed.output.find(AllZero(4)), std::string::npos) << resumed.output << Logs(4);
  EXPECT_NE(resumed.output.find("loaded checkpoint"), std::string::npos) << resumed.output;
  auto whole = Ranks(4, Train(2, flags + until, 100000));
  ASSERT_NE(whole.output.find(AllZero(4)), std::string::npos) << whole.output << Logs(4);
  const auto again = Lines(resumed.output), uninterrupted = Lines(whole.output);
  ASSERT_EQ(uninterrupted.size(), static_cast<size_t>(end)) << whole.output;
  ASSERT_EQ(again.size(), 3u) << resumed.output;
  EXPECT_EQ(again, std::vector<std::string>(uninterrupted.end() - 3, uninterrupted.end()));
  std::printf("rank 1 killed after iteration %lld's checkpoint: the others ended in %s s; resumed %lld to %lld\n",
              static_cast<long long>(*latest), m[4].str().c_str(), static_cast<long long>(*latest) + 1,
              static_cast<long long>(end));
}

TEST_F(TensorParallelCli, SizesThatDoNotDivideAreRefusedOnEveryRank) {
  // WORLD_SIZE 3 with T = 2; 4 heads with T = 3.
  struct Case {
    int world, T;
    std::string says;
  };
  for (const Case& c : {Case{3, 2, "the world size 3 is not divisible by tensor"},
                        Case{3, 3, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"}}) {
    auto r = Ranks(c.world, Train(c.T, "", 2));
    EXPECT_NE(r.output.find("rc=2 2 2"), std::string::npos) << r.output << Logs(c.world);
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
    for (int rank = 1; rank < c.world; ++rank) {
      const std::string log = ptk::testing::ReadFile(RankLog(rank));
      EXPECT_NE(log.find(c.says), std::string::npos) << "rank " << rank << "\n" << log;
    }
  }
  // The CUDA backend's tensor parallelism (with or without --sequence-parallel) runs over NCCL only:
  // gloo is refused naming what is missing, before any device is looked for.
  auto sp = RunCmd(Train(2, "--device cuda --sequence-parallel --distributed-backend gloo", 2));
  EXPECT_EQ(sp.exit_code, 2) << sp.output;
  EXPECT_NE(sp.output.find("needs NCCL for the tensor group"), std::string::npos) << sp.output;
  auto gloo = RunCmd(Train(2, "--device cuda --distributed-backend gloo", 2));
  EXPECT_EQ(gloo.exit_code, 2) << gloo.output;
  EXPECT_NE(gloo.output.find("needs NCCL for the tensor group"), std::string::npos) << gloo.output;
}

}  // namespace
}  // namespace ptk
