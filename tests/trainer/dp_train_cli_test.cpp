// ptk-train's data parallelism end to end, ranks as processes over loopback gloo:
// --use-distributed-optimizer (ZeRO-1) at 2 and 3 ranks trains with the bits of the plain
// all-reduce path (losses, weights, moments), and its checkpoints hold the whole state, so a run
// saved by 2 ranks resumes on 3 and on 1 exactly as a plain run does; --overlap-grad-reduce
// (buckets reduced during backward) has the bits of the reduction after backward.
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "indexed_dataset/indexed_dataset.h"
#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

using Saved = testing::SavedCheckpoint;

class DataParallelCli : public testing::RanksTest {
 protected:
  // The documents' ids are below 1000 (WriteLearnableDataset), their EOD the small vocabulary's.
  DataParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 6: 1, 2 and 3 ranks split it evenly. Dropout on (Megatron's defaults). GPT-2's
  // tokenizer cut to a vocabulary of 1000 (SmallVocabFlags, padded to 1024): GPT-2's output layer
  // was nearly all of each iteration and checks nothing about data parallelism.
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return ptk::testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 6 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1"
           " --threads 1 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  Saved Load(const std::string& dir, int64_t iteration) {
    return testing::LoadTinyCheckpoint(dir, iteration, 1000, 1024);
  }
  static std::vector<std::string> LossLines(const std::string& out) { return testing::LogLinesWithoutTimes(out); }
  static void ExpectSameState(const Saved& a, const Saved& b, const std::string& what) {
    EXPECT_EQ(a.state.iteration, b.state.iteration) << what;
    EXPECT_EQ(a.state.consumed_train_samples, b.state.consumed_train_samples) << what;
    EXPECT_EQ(a.state.adam_step, b.state.adam_step) << what;
    EXPECT_TRUE(a.params == b.params) << what << ": weights differ";
    EXPECT_TRUE(a.m == b.m) << what << ": exp_avg differs";
    EXPECT_TRUE(a.v == b.v) << what << ": exp_avg_sq differs";
  }
};

TEST_F(DataParallelCli, DistributedOptimizerHasThePlainPathsBitsAtTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    const std::string w = std::to_string(world);
    auto plain = Ranks(world, Train("--save " + ShellQuote(dir_ / ("plain" + w))));
    ASSERT_NE(plain.output.find(AllZero(world)), std::string::npos) << plain.output << Logs(world);
    auto zero = Ranks(world, Train("--use-distributed-optimizer --save " + ShellQuote(dir_ / ("zero" + w))));
    ASSERT_NE(zero.output.find(AllZero(world)), std::string::npos) << zero.output << Logs(world);
    EXPECT_NE(zero.output.find("distributed optimizer: each of " + w + " ranks keeps"), std::string::npos)
        << zero.output;
    const auto a = LossLines(plain.output), b = LossLines(zero.output);
    ASSERT_EQ(a.size(), 6u) << plain.output;
    EXPECT_EQ(a, b) << "the log lines' losses and norms differ at " << world << " ranks";
    ExpectSameState(Load(dir_ / ("plain" + w), 6), Load(dir_ / ("zero" + w), 6), w + " ranks");
  }
}

TEST_F(DataParallelCli, ShardedStateSavedByTwoRanksResumesOnThreeAndOne) {
  // Saved at iteration 3 by 2 ranks, with and without ZeRO-1: the same file contents.
  for (const char* mode : {"plain", "zero"}) {
    const std::string flag = std::string(mode) == "zero" ? "--use-distributed-optimizer " : "";
    const std::string save = ShellQuote(dir_ / (std::string(mode) + "2"));
    auto r = Ranks(2, Train(flag + "--exit-interval 3 --save " + save));
    ASSERT_NE(r.output.find(AllZero(2)), std::string::npos) << r.output << Logs(2);
    ASSERT_NE(r.output.find("exiting program at iteration 3"), std::string::npos) << r.output;
  }
  ExpectSameState(Load(dir_ / "plain2", 3), Load(dir_ / "zero2", 3), "saved by 2 ranks");
  // Resumed by 3 ranks and by 1, each from its own copy, to iteration 6.
  for (const char* mode : {"plain", "zero"}) {
    const std::string flag = std::string(mode) == "zero" ? "--use-distributed-optimizer " : "";
    for (int world : {3, 1}) {
      const std::string dst = dir_ / (std::string(mode) + "2to" + std::to_string(world));
      ASSERT_EQ(RunCmd("cp -r " + ShellQuote(dir_ / (std::string(mode) + "2")) + " " + ShellQuote(dst)).exit_code, 0);
      auto r = world == 1 ? RunCmd(Train(flag + "--load " + ShellQuote(dst) + " --save " + ShellQuote(dst)))
                          : Ranks(world, Train(flag + "--load " + ShellQuote(dst) + " --save " + ShellQuote(dst)));
      if (world == 1) {
        ASSERT_EQ(r.exit_code, 0) << r.output;
      } else {
        ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
      }
      EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
      EXPECT_EQ(r.output.find("iteration        3/"), std::string::npos) << "the resumed run started over";
    }
  }
  ExpectSameState(Load(dir_ / "plain2to3", 6), Load(dir_ / "zero2to3", 6), "resumed by 3 ranks");
  ExpectSameState(Load(dir_ / "plain2to1", 6), Load(dir_ / "zero2to1", 6), "resumed by 1 rank");
  // The schedule and data position carried over: 6 iterations of 6 samples.
  EXPECT_EQ(Load(dir_ / "zero2to3", 6).state.consumed_train_samples, 36);
}

TEST_F(DataParallelCli, OverlappedReductionHasTheBitsOfAReductionAfterBackward) {
  // 3 ranks: each element's sum in rank order, whole or in buckets; with and without ZeRO-1.
  auto after = Ranks(3, Train("--save " + ShellQuote(dir_ / "after")));
  ASSERT_NE(after.output.find(AllZero(3)), std::string::npos) << after.output << Logs(3);
  for (const char* zero : {"", "--use-distributed-optimizer "}) {
    const std::string save = dir_ / (std::string("overlap") + (*zero ? "zero" : ""));
    auto r =
        Ranks(3, Train(std::string(zero) + "--overlap-grad-reduce --ddp-bucket-size 5000 --save " + ShellQuote(save)));
    ASSERT_NE(r.output.find(AllZero(3)), std::string::npos) << r.output << Logs(3);
    EXPECT_NE(r.output.find("--overlap-grad-reduce: 3 gradient bucket(s) of up to"), std::string::npos) << r.output;
    EXPECT_EQ(LossLines(after.output), LossLines(r.output)) << zero;
    ExpectSameState(Load(dir_ / "after", 6), Load(save, 6), std::string("overlapped ") + zero);
  }
}

// Faults: a rank killed, or a rank that hangs (stopped), ends the others with exit 1 within
// --distributed-timeout-minutes, their error naming that rank and its host; never a hang. Rank 0
// hanging (it serves the rendezvous) is named as such.
// The timeout bounds every wait of a rank for another: the rendezvous, start-up's collectives (the
// barrier once each rank has its dataset indices) and each of training's. The fault comes once
// the last rank has logged iteration 4 (every rank then trains, past its first evaluation). A killed rank is
// seen at once (its connections close): that case runs under a timeout of a minute, which no
// start-up on a loaded machine meets, and its ranks build the indices that the later cases then
// read from --data-cache-path. A hung rank is seen only when the timeout ends: those cases run under
// 6 s, which leaves start-up (the cached indices read, no index built) and training's collectives
// ample room, and keeps the test short.
TEST_F(DataParallelCli, AKilledOrHungRankEndsTheOthersNamingIt) {
  const std::string host = ptk::testing::ReadFile("/proc/sys/kernel/hostname");
  const std::string h = host.substr(0, host.find('\n'));
  struct Fault {
    const char* signal;
    int victim;
    const char* timeout_minutes;
    int seconds;  // at most, from the signal to the others' exit
    std::string named;
  };
  const Fault faults[] = {
      {"KILL", 1, "1", 10, "rank 1 (host " + h + ") exited (its connection to the rendezvous closed"},
      // Rank 0, which serves the rendezvous: said to have exited too (it said "does not answer: it exited or hangs").
      {"KILL", 0, "1", 10, "rank 0 (which serves the rendezvous) exited (its connection closed"},
      // The 6 s timeout, then the others' diagnosis (at most 5 s) and report.
      {"STOP", 1, "0.1", 30, "rank 1 (host " + h + ") did not report a failure: it hangs"},
      {"STOP", 0, "0.1", 30, "rank 0 (which serves the rendezvous) does not answer: it exited or hangs"},
  };
  for (const Fault& f : faults) {
    const std::string cmd =
        Train(std::string("--use-distributed-optimizer --distributed-timeout-minutes ") + f.timeout_minutes, 100000);
    const std::string port = std::to_string(testing::FreeTestPort());
    std::string script = "export WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; ";
    // The previous fault's logs go first: a background rank truncates its log only once it runs, so
    // the wait below could otherwise find the last case's line and signal a rank that has not yet
    // reached the rendezvous.
    for (int rank : {0, 1, 2}) script += "rm -f " + ShellQuote(RankLog(rank)) + "; ";
    for (int rank : {0, 1, 2})
      script += "RANK=" + std::to_string(rank) + " " + cmd + " > " + ShellQuote(RankLog(rank)) + " 2>&1 & p" +
                std::to_string(rank) + "=$!; ";
    // Once training runs on every rank, the victim gets the signal; the two others must end by
    // themselves.
    const std::string v = std::to_string(f.victim), a = f.victim == 0 ? "1" : "0";
    script += "end=$((SECONDS + 120)); until grep -q 'iteration        4/' " + ShellQuote(RankLog(2)) +
              " || [ $SECONDS -ge $end ]; do sleep 0.05; done; kill -" + f.signal + " $p" + v +
              "; start=$SECONDS; wait $p" + a + "; ra=$?; wait $p2; rb=$?; echo rc=$ra,$rb after=$((SECONDS-start)); " +
              "kill -9 $p" + v + "; wait $p" + v;
    auto r = RunCmd("bash -c " + ShellQuote(script));
    const std::string what = std::string(f.signal) + " rank " + v;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("rc=(\\d+),(\\d+) after=(\\d+)"))) << r.output;
    std::printf("%s: the others exited %s s after the signal\n", what.c_str(), m[3].str().c_str());
    EXPECT_EQ(m[1], "1") << what << Logs(3);
    EXPECT_EQ(m[2], "1") << what << Logs(3);
    // The logs say which wait took so long (a collective's timeout, the diagnosis, the exit).
    EXPECT_LE(std::stoi(m[3]), f.seconds) << what << Logs(3);
    for (const std::string& other : {a, std::string("2")}) {
      const std::string log = ptk::testing::ReadFile(RankLog(std::stoi(other)));
      EXPECT_NE(log.find("failed (a rank died or the network failed)"), std::string::npos) << what << "\n" << log;
      EXPECT_NE(log.find(f.named), std::string::npos) << what << "\n" << log;
    }
  }
}

// SIGTERM (Slurm's pre-emption, or --signal's USR1) to one rank only: the ranks agree through a
// collective, every rank saves the same iteration (ZeRO-1's moments gathered) and exits 0; that
// checkpoint equals an uninterrupted plain run's at the same iteration.
TEST_F(DataParallelCli, ASignalToOneRankSavesTheSameIterationOnAll) {
  const std::string cmd = Train(
      "--use-distributed-optimizer --exit-signal-handler --eval-iters 0 --save " + ShellQuote(dir_ / "sig"), 100000);
  const std::string port = std::to_string(testing::FreeTestPort());
  auto r =
      RunCmd("bash -c " +
             ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; RANK=1 " + cmd + " > " +
                        ShellQuote(dir_ / "r1.log") + " 2>&1 & p1=$!; RANK=0 " + cmd + " > " +
                        ShellQuote(dir_ / "r0.log") + " 2>&1 & p0=$!; end=$((SECONDS + 120)); until grep -q " +
                        "'iteration        5/' " + ShellQuote(dir_ / "r1.log") +
                        " || [ $SECONDS -ge $end ]; do sleep 0.05; done; kill -TERM $p1; wait $p0; rc0=$?; wait $p1; "
                        "echo rc0=$rc0 rc1=$?"));
  const std::string r0 = ptk::testing::ReadFile(dir_ / "r0.log");
  ASSERT_NE(r.output.find("rc0=0 rc1=0"), std::string::npos) << r.output << r0 << Logs(2);
  EXPECT_NE(r0.find("exiting program after receiving SIGTERM."), std::string::npos) << r0;
  auto latest = LatestCheckpointIteration(dir_ / "sig");
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_GE(*latest, 5);
  EXPECT_NE(r0.find("successfully saved checkpoint from iteration " +
                    std::string(7 - std::to_string(*latest).size(), ' ') + std::to_string(*latest)),
            std::string::npos)
      << r0;
  auto plain = Ranks(
      2, Train("--eval-iters 0 --exit-interval " + std::to_string(*latest) + " --save " + ShellQuote(dir_ / "plain"),
               100000));
  ASSERT_NE(plain.output.find(AllZero(2)), std::string::npos) << plain.output << Logs(2);
  ExpectSameState(Load(dir_ / "plain", *latest), Load(dir_ / "sig", *latest), "saved on the signal");
}

// --distributed-backend: gloo for CPU ranks (named in rank 0's line), nccl refused on the CPU and
// in a build without CUDA, as a usage error.
TEST_F(DataParallelCli, DistributedBackendFollowsTheDevice) {
  auto r = Ranks(2, Train("--distributed-backend gloo", 2));
  ASSERT_NE(r.output.find(AllZero(2)), std::string::npos) << r.output << Logs(2);
  EXPECT_NE(r.output.find("data parallel: 2 ranks (torchrun variables), gloo, rendezvous at"), std::string::npos)
      << r.output;
  auto nccl = RunCmd(Train("--device cpu --distributed-backend nccl", 2));
  EXPECT_EQ(nccl.exit_code, 2) << nccl.output;
  EXPECT_NE(nccl.output.find("--distributed-backend nccl needs --device cuda"), std::string::npos) << nccl.output;
  auto bad = RunCmd(Train("--distributed-backend mpi", 2));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  // One process with gloo named: no rendezvous (no port taken), it trains.
  auto one = RunCmd(Train("--distributed-backend gloo", 2));
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.output.find("data parallel"), std::string::npos) << one.output;
}

// A rank whose own flag checks fail (--bf16 on a CPU, on one rank only) tells the others through
// the rendezvous store before it exits: every rank ends at once, exit 2, naming that rank and its
// error. Before, the others waited silently for the 5-minute rendezvous timeout (the timeout
// command below turns such a wait into a failure, exit 124).
TEST_F(DataParallelCli, ARankFailingItsOwnChecksEndsEveryRankNamingIt) {
  const std::string cmd = Train("--device cpu", 2);
  const std::string host = ptk::testing::ReadFile("/proc/sys/kernel/hostname");
  const std::string h = host.substr(0, host.find('\n'));
  for (int victim : {1, 0}) {
    SCOPED_TRACE("victim rank " + std::to_string(victim));
    const std::string port = std::to_string(testing::FreeTestPort());
    std::string script = "export WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; ";
    // The previous fault's logs go first: a background rank truncates its log only once it runs, so
    // the wait below could otherwise find the last case's 'training' line and signal a rank that has
    // not yet reached the rendezvous.
    for (int rank : {0, 1, 2}) script += "rm -f " + ShellQuote(dir_ / ("r" + std::to_string(rank) + ".log")) + "; ";
    for (int rank : {0, 1, 2})
      script += "RANK=" + std::to_string(rank) + " timeout 120 " + cmd + (rank == victim ? " --bf16" : "") + " > " +
                ShellQuote(dir_ / ("r" + std::to_string(rank) + ".log")) + " 2>&1 & p" + std::to_string(rank) + "=$!; ";
    script += "wait $p0; r0=$?; wait $p1; r1=$?; wait $p2; echo rc=$r0,$r1,$?";
    auto r = RunCmd("bash -c " + ShellQuote(script));
    EXPECT_NE(r.output.find("rc=2,2,2"), std::string::npos) << r.output << Logs(3);
    const std::string why = "--bf16: the CPU backend trains in fp32";
    const std::string named = "rank " + std::to_string(victim) + " (host " + h + ") stopped before the ranks met: ";
    for (int rank : {0, 1, 2}) {
      const std::string log = ptk::testing::ReadFile(dir_ / ("r" + std::to_string(rank) + ".log"));
      EXPECT_NE(log.find(why), std::string::npos) << "rank " << rank << "\n" << log;
      if (rank != victim) {
        EXPECT_NE(log.find(named + why), std::string::npos) << "rank " << rank << "\n" << log;
      }
    }
  }
}

TEST_F(DataParallelCli, RanksMustAgreeOnTheDistributedOptimizer) {
  const std::string cmd = Train("", 2);
  auto r = RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 PTK_RUN_ID=one MASTER_PORT=" +
                                          std::to_string(testing::FreeTestPort()) + "; RANK=1 " + cmd +
                                          " --use-distributed-optimizer > /dev/null 2>&1 & RANK=0 " + cmd +
                                          "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
  EXPECT_NE(r.output.find("rc0=2 rc1=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 was started with --use-distributed-optimizer on, rank 0 with "
                          "--use-distributed-optimizer off"),
            std::string::npos)
      << r.output;
}

// --log-params-norm and --log-num-zeros-in-grad under ZeRO-1 (each rank's shard, summed over the
// ranks) print what the plain all-reduce path prints, through a --rampup-batch-size ramp (2, 4, 6)
// whose batches the two ranks split alike.
TEST_F(DataParallelCli, ParamsNormZerosAndRampUnderTheDistributedOptimizer) {
  const std::string flags =
      "--log-params-norm --log-num-zeros-in-grad --rampup-batch-size 2 2 8 --train-samples 30 --lr-warmup-iters 0 "
      "--lr-warmup-samples 2";
  // --train-iters of Train() replaced: a ramp is sample-based.
  auto strip_iters = [](std::string cmd) { return std::regex_replace(cmd, std::regex(" --train-iters \\d+"), ""); };
  auto plain = Ranks(2, strip_iters(Train(flags)));
  ASSERT_NE(plain.output.find(AllZero(2)), std::string::npos) << plain.output << Logs(2);
  auto zero1 = Ranks(2, strip_iters(Train(flags + " --use-distributed-optimizer")));
  ASSERT_NE(zero1.output.find(AllZero(2)), std::string::npos) << zero1.output << Logs(2);
  auto fields = [](const std::string& out) {
    std::vector<std::string> v;
    std::regex re(R"(global batch size: +(\d+) \|.*\| num zeros: (\S+) \| params norm: (\S+) \|)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back((*it)[1].str() + " " + (*it)[2].str() + " " + (*it)[3].str());
    return v;
  };
  const std::vector<std::string> a = fields(plain.output), b = fields(zero1.output);
  // The ramp while at most 8 samples are consumed: 2, 2, 4, 6 (14 samples); then (30 - 14) // 6 of 6.
  ASSERT_EQ(a.size(), 6u) << plain.output;
  EXPECT_EQ(a, b) << plain.output << "\n" << zero1.output;
  EXPECT_EQ(a.front().substr(0, 2), "2 ");
  EXPECT_EQ(a.back().substr(0, 2), "6 ");
}

}  // namespace
}  // namespace ptk
