// ptk-train's --timing-log-level and --timing-log-option end to end (ranks as processes over
// loopback gloo): after each log line the last rank prints Megatron's timer block with the names of
// the level, in Megatron's order, in the option's format; level 0 prints none; at P = 2 each
// stage's exchanges under the names of Megatron's 1F1B, and the metrics of a timed run are those of
// an untimed one byte for byte; at D = 2 (and ZeRO-1) the data-parallel reductions; at T = 2 with
// --sequence-parallel Megatron's names (its sum over the tensor group timed, never printed); TensorBoard gets
// <name>-time; bad values are refused, and ranks at different levels stop at start-up. Names, order, format and ranks
// only: never the times.
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/timers.h"

namespace ptk {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

// One printed block: its header and its names in order; with --timing-log-option all, each name's ranks.
struct Block {
  std::string header;
  std::vector<std::string> names;
  std::map<std::string, std::set<int>> ranks;
};

// The timer blocks of `out`, each checked to follow a log line (or another block's rank lines).
std::vector<Block> Blocks(const std::string& out) {
  std::vector<Block> blocks;
  std::vector<std::string> lines;
  for (size_t at = 0; at < out.size();) {
    const size_t nl = out.find('\n', at);
    lines.push_back(out.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    at = nl == std::string::npos ? out.size() : nl + 1;
  }
  const std::regex minmax(R"(    (\S+) \.+: \(\d+\.\d\d, \d+\.\d\d\))"), max(R"(    (\S+) \.+: \d+\.\d\d)"),
      all_name(R"(  (\S+):)"), all_rank(R"(     rank +(\d+): \d+\.\d\d)");
  for (std::string& l : lines)  // megatron-core 0.16 logs its blocks through Python's logging
    if (l.rfind(kTimersLogPrefix, 0) == 0) l = l.substr(std::string(kTimersLogPrefix).size());
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& h = lines[i];
    if (h != "(min, max) time across ranks (ms):" && h != "max time across ranks (ms):" &&
        h != "times across ranks (ms):")
      continue;
    Block b;
    b.header = h;
    std::smatch m;
    std::string current;
    for (++i; i < lines.size(); ++i) {
      const std::string& l = lines[i];
      if (h[0] == '(' && std::regex_match(l, m, minmax)) {
        b.names.push_back(m[1]);
      } else if (h[0] == 'm' && std::regex_match(l, m, max)) {
        b.names.push_back(m[1]);
      } else if (h[0] == 't' && std::regex_match(l, m, all_name)) {
        current = m[1];
        b.names.push_back(current);
      } else if (h[0] == 't' && !current.empty() && std::regex_match(l, m, all_rank)) {
        b.ranks[current].insert(std::stoi(m[1]));
      } else {
        break;
      }
    }
    --i;
    blocks.push_back(b);
  }
  return blocks;
}

class TimersCli : public testing::RanksTest {
 protected:
  // The documents' ids are below 1000 (WriteLearnableDataset), their EOD the small vocabulary's.
  TimersCli() : RanksTest(testing::kSmallVocabEod) {}
  // 4 layers; global batch 8 of micro-batches of 1; 4 iterations, a log line every 2. GPT-2's
  // tokenizer cut to a vocabulary of 1000 (SmallVocabFlags): the timers' blocks are the same.
  std::string Train(int P, const std::string& extra) {
    return ptk::testing::Tool("ptk-train") +
           " --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 8 --lr 3e-3 --split 98,2,0 --eval-iters 0 --log-interval 2 --threads 1"
           " --pipeline-model-parallel-size " +
           std::to_string(P) + " --data-path " + ShellQuote(prefix_) + " --data-cache-path " +
           ShellQuote(dir_ / "cache") + " --train-iters 4 " + extra;
  }
};

const std::vector<std::string> kOneRankLevel1 = {"forward-backward", "all-grads-sync", "optimizer-clip-main-grad",
                                                 "optimizer-inner-step", "optimizer"};

TEST_F(TimersCli, OneRankLevelsAndOptions) {
  auto none = RunCmd(Train(1, "--timing-log-level 0"));
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_EQ(Losses(none.output).size(), 3u) << none.output;  // iterations 1, 2 and 4
  EXPECT_TRUE(Blocks(none.output).empty()) << none.output;
  EXPECT_EQ(none.output.find("across ranks"), std::string::npos) << none.output;

  auto one = RunCmd(Train(1, "--timing-log-level 1"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto blocks = Blocks(one.output);
  ASSERT_EQ(blocks.size(), 3u) << one.output;  // one after each log line (1, 2, 4)
  for (const Block& b : blocks) {
    EXPECT_EQ(b.header, "(min, max) time across ranks (ms):");
    EXPECT_EQ(b.names, kOneRankLevel1) << one.output;
  }
  // Each block right after its iteration line.
  EXPECT_TRUE(std::regex_search(
      one.output, std::regex(R"(iteration +2/ +4 [^\n]*\nINFO:megatron\.core\.timers:\(min, max\) time across)")))
      << one.output;

  auto two = RunCmd(Train(1, "--timing-log-level 2 --timing-log-option max --log-num-zeros-in-grad"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  blocks = Blocks(two.output);
  ASSERT_EQ(blocks.size(), 3u) << two.output;
  EXPECT_EQ(blocks[0].header, "max time across ranks (ms):");
  EXPECT_EQ(blocks[0].names,
            (std::vector<std::string>{"forward-backward", "all-grads-sync", "optimizer-clip-main-grad",
                                      "optimizer-count-zeros", "optimizer-inner-step", "optimizer", "batch-generator"}))
      << two.output;

  auto all = RunCmd(Train(1, "--timing-log-level 1 --timing-log-option all"));
  ASSERT_EQ(all.exit_code, 0) << all.output;
  blocks = Blocks(all.output);
  ASSERT_EQ(blocks.size(), 3u) << all.output;
  EXPECT_EQ(blocks[0].header, "times across ranks (ms):");
  EXPECT_EQ(blocks[0].names, kOneRankLevel1);
  for (const auto& [name, ranks] : blocks[0].ranks) EXPECT_EQ(ranks, (std::set<int>{0})) << name;
}

TEST_F(TimersCli, BadValuesAreRefused) {
  for (const std::string bad : {"--timing-log-level 3", "--timing-log-level -1", "--timing-log-option min"}) {
    SCOPED_TRACE(bad);
    auto r = RunCmd(Train(1, bad));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("usage error: " + bad.substr(0, bad.find(' '))), std::string::npos) << r.output;
  }
}

// The gather takes the names of the level, and each level-1 start waits at a barrier over all
// ranks: ranks started at different levels, or some with --no-barrier-with-level-1-timing, stop at
// start-up in one line naming the flag, instead of meeting in the gather with different sizes or
// leaving the others at a barrier.
TEST_F(TimersCli, RanksAtDifferentLevelsStopAtStartUp) {
  const std::string base = Train(1, "");
  struct Case {
    std::string rank1, rank0, named;
  };
  for (const Case& c : {Case{"--timing-log-level 2", "--timing-log-level 1",
                             "rank 1 was started with --timing-log-level 2, rank 0 with --timing-log-level 1"},
                        Case{"--timing-log-level 1 --no-barrier-with-level-1-timing", "--timing-log-level 1",
                             "rank 1 was started with --no-barrier-with-level-1-timing on, rank 0 with "
                             "--no-barrier-with-level-1-timing off"}}) {
    SCOPED_TRACE(c.rank1);
    auto r =
        RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 PTK_RUN_ID=one MASTER_PORT=" +
                                       std::to_string(testing::FreeTestPort()) + "; RANK=1 timeout 300 " + base + " " +
                                       c.rank1 + " > " + ShellQuote(RankLog(1)) + " 2>&1 & RANK=0 timeout 300 " + base +
                                       " " + c.rank0 + "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
    EXPECT_NE(r.output.find("rc0=2 rc1=2"), std::string::npos) << r.output << ReadFile(RankLog(1));
    EXPECT_NE(r.output.find(c.named), std::string::npos) << r.output;
  }
}

// P = 2: the block is the last rank's (stage 1); each exchange under Megatron's name on the stage
// that makes it; the tied embeddings' sum on both; the metrics byte for byte those of an untimed run,
// with the level-1 barriers (the default) and without them.
TEST_F(TimersCli, TwoStagesNameEachStagesExchanges) {
  const std::string plain_metrics = dir_ / "plain.jsonl", timed_metrics = dir_ / "timed.jsonl";
  auto plain = Ranks(2, Train(2, "--metrics-file " + ShellQuote(plain_metrics)));
  ASSERT_NE(plain.output.find(AllZero(2)), std::string::npos) << plain.output << Logs(2);
  auto timed =
      Ranks(2, Train(2, "--timing-log-level 2 --timing-log-option all --metrics-file " + ShellQuote(timed_metrics) +
                            " --tensorboard-dir " + ShellQuote(dir_ / "tb") + " --log-timers-to-tensorboard"));
  ASSERT_NE(timed.output.find(AllZero(2)), std::string::npos) << timed.output << Logs(2);
  EXPECT_EQ(ReadFile(timed_metrics), ReadFile(plain_metrics));
  EXPECT_EQ(Lines(timed.output), Lines(plain.output));
  // Rank 0 is not Megatron's last rank: the blocks, and the log lines they follow, are the last stage's.
  EXPECT_TRUE(Blocks(ReadFile(RankLog(0))).empty()) << ReadFile(RankLog(0));
  EXPECT_TRUE(Lines(ReadFile(RankLog(0))).empty()) << ReadFile(RankLog(0));
  const std::string last = ReadFile(RankLog(1));
  EXPECT_EQ(Lines(last).size(), 3u) << last;
  const auto blocks = Blocks(last);
  ASSERT_EQ(blocks.size(), 3u) << last;
  const std::set<int> both = {0, 1}, first = {0}, second = {1};
  const std::map<std::string, std::set<int>> want = {
      {"forward-backward", both},
      {"embedding-grads-all-reduce", both},
      {"all-grads-sync", both},
      {"optimizer-clip-main-grad", both},
      {"optimizer-inner-step", both},
      {"optimizer", both},
      {"batch-generator", both},
      {"forward-compute", both},
      {"backward-compute", both},
      {"forward-recv", second},
      {"forward-send", first},
      {"backward-recv", first},
      {"backward-send", second},
      {"forward-send-backward-recv", first},
      {"backward-send-forward-recv", second},
  };
  for (const Block& b : blocks) {
    EXPECT_EQ(b.ranks, want) << last;
    EXPECT_EQ(b.names, (std::vector<std::string>{"forward-backward", "embedding-grads-all-reduce", "all-grads-sync",
                                                 "optimizer-clip-main-grad", "optimizer-inner-step", "optimizer",
                                                 "batch-generator", "forward-compute", "backward-compute",
                                                 "forward-recv", "forward-send", "backward-recv", "backward-send",
                                                 "forward-send-backward-recv", "backward-send-forward-recv"}));
  }
  // TensorBoard: the slowest rank's seconds per iteration as <name>-time, beside iteration-time.
  std::string events;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_ / "tb"))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) events += ReadFile(e.path());
  for (const char* tag : {"iteration-time", "forward-backward-time", "forward-recv-time", "backward-send-time"})
    EXPECT_NE(events.find(tag), std::string::npos) << tag;
  // Without the level-1 barriers, the same results too.
  const std::string unbarred_metrics = dir_ / "unbarred.jsonl";
  auto unbarred = Ranks(2, Train(2, "--timing-log-level 1 --no-barrier-with-level-1-timing --metrics-file " +
                                        ShellQuote(unbarred_metrics)));
  ASSERT_NE(unbarred.output.find(AllZero(2)), std::string::npos) << unbarred.output << Logs(2);
  EXPECT_EQ(ReadFile(unbarred_metrics), ReadFile(plain_metrics));
  EXPECT_EQ(Lines(unbarred.output), Lines(plain.output));
}

// P = 4 with tied embeddings: each level-1 start waits at a barrier over all ranks, so every rank
// starts every level-1 timer: the middle stages, which hold no embedding copy, time
// embedding-grads-all-reduce too (as Megatron's), instead of leaving the others at its barrier.
TEST_F(TimersCli, FourStagesMeetAtEveryLevelOneBarrier) {
  auto r = Ranks(4, Train(4, "--timing-log-level 1 --timing-log-option all"));
  ASSERT_NE(r.output.find(AllZero(4)), std::string::npos) << r.output << Logs(4);
  const std::string last = ReadFile(RankLog(3));
  const auto blocks = Blocks(last);
  ASSERT_EQ(blocks.size(), 3u) << last;
  EXPECT_EQ(blocks[0].ranks.at("embedding-grads-all-reduce"), (std::set<int>{0, 1, 2, 3})) << last;
}

// D = 2: the data-parallel reductions, ZeRO-1's all-gather, both ranks in each line; minmax.
TEST_F(TimersCli, TwoDataRanksWithZeroOne) {
  auto r = Ranks(2, Train(1, "--timing-log-level 1 --use-distributed-optimizer"));
  ASSERT_NE(r.output.find(AllZero(2)), std::string::npos) << r.output << Logs(2);
  EXPECT_TRUE(Blocks(ReadFile(RankLog(0))).empty()) << ReadFile(RankLog(0));
  const std::string last = ReadFile(RankLog(1));
  const auto blocks = Blocks(last);
  ASSERT_EQ(blocks.size(), 3u) << last;
  EXPECT_EQ(blocks[0].names,
            (std::vector<std::string>{"forward-backward", "all-grads-sync", "params-all-gather",
                                      "optimizer-clip-main-grad", "optimizer-inner-step", "optimizer"}))
      << last;
  auto all = Ranks(2, Train(1, "--timing-log-level 1 --timing-log-option all"));
  ASSERT_NE(all.output.find(AllZero(2)), std::string::npos) << all.output << Logs(2);
  const auto all_blocks = Blocks(ReadFile(RankLog(1)));
  ASSERT_EQ(all_blocks.size(), 3u);
  EXPECT_EQ(all_blocks[0].names, kOneRankLevel1);
  for (const auto& [name, ranks] : all_blocks[0].ranks) EXPECT_EQ(ranks, (std::set<int>{0, 1})) << name;
}

// T = 2 with --sequence-parallel: the partial gradients' sum over the tensor group is timed as
// megatron-core 0.16's finalize_model_grads times it (non-tensor-parallel-grads-all-reduce, level 1,
// its start at the level-1 barrier on every rank), a name Megatron's training log does not print
// (its list names layernorm-grads-all-reduce, which nothing times any more): the block holds
// Megatron's names only (level 2), each line both ranks'; the metrics are an untimed run's byte for
// byte.
TEST_F(TimersCli, SequenceParallelSumIsTimedUnderMegatronsName) {
  const std::string tp = "--tensor-model-parallel-size 2 --sequence-parallel ";
  const std::string plain_metrics = dir_ / "plain.jsonl", timed_metrics = dir_ / "timed.jsonl";
  auto plain = Ranks(2, Train(1, tp + "--metrics-file " + ShellQuote(plain_metrics)));
  ASSERT_NE(plain.output.find(AllZero(2)), std::string::npos) << plain.output << Logs(2);
  auto timed = Ranks(
      2, Train(1, tp + "--timing-log-level 2 --timing-log-option all --metrics-file " + ShellQuote(timed_metrics)));
  ASSERT_NE(timed.output.find(AllZero(2)), std::string::npos) << timed.output << Logs(2);
  EXPECT_EQ(ReadFile(timed_metrics), ReadFile(plain_metrics));
  EXPECT_EQ(Lines(timed.output), Lines(plain.output));
  const std::string last = ReadFile(RankLog(1));
  // The log lines too are the last rank's (tensor rank 1), not rank 0's.
  EXPECT_TRUE(Lines(ReadFile(RankLog(0))).empty()) << ReadFile(RankLog(0));
  EXPECT_EQ(Lines(last).size(), 3u) << last;
  const auto blocks = Blocks(last);
  ASSERT_EQ(blocks.size(), 3u) << last;
  for (const Block& b : blocks) {
    EXPECT_EQ(b.names, (std::vector<std::string>{"forward-backward", "all-grads-sync", "optimizer-clip-main-grad",
                                                 "optimizer-inner-step", "optimizer", "batch-generator"}))
        << last;
    for (const auto& [name, ranks] : b.ranks) EXPECT_EQ(ranks, (std::set<int>{0, 1})) << name;
  }
  EXPECT_EQ(last.find("grads-all-reduce"), std::string::npos) << last;
}

}  // namespace
}  // namespace ptk
