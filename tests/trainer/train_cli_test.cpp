// ptk-train end to end: Megatron's log line, metrics, evaluation; a run stopped and resumed ends
// with the same bits as an uninterrupted one; SIGTERM saves and exits; kill -9 during saves never
// leaves a damaged `latest`; damaged or mismatched checkpoints are refused; the seeds' flags are
// honoured or refused with one line.
#include <unistd.h>

#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "indexed_dataset/indexed_dataset.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"

namespace ptk::trainer {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    auto b = IndexedDatasetBuilder::Create(prefix_, OptimalDType(50257));
    ASSERT_TRUE(b.ok());
    // Learnable documents: runs of consecutive ids from a document-specific start, ending in EOD.
    uint64_t h = 12345;
    for (int d = 0; d < 400; ++d) {
      h = h * 6364136223846793005ULL + 1442695040888963407ULL;
      int len = 20 + static_cast<int>((h >> 33) % 150), start = static_cast<int>((h >> 13) % 900);
      std::vector<int32_t> doc;
      for (int i = 0; i < len; ++i) doc.push_back(start + i % 50);
      doc.push_back(50256);
      std::vector<int32_t> lengths = {static_cast<int32_t>(doc.size())};
      ASSERT_TRUE((*b)->AddDocument(doc, lengths).ok());
    }
    ASSERT_TRUE((*b)->Finalize().ok());
  }
  std::string Train(const std::string& extra, int64_t iters = 8) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2"
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-interval 4 --eval-iters 1 --log-interval 2"
           " --threads 2 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  TempDir dir_;
  std::string prefix_;
};

TEST_F(TrainCli, LogsLikeMegatronAndLearns) {
  auto r = RunCmd(Train("--tensorboard-dir " + ShellQuote(dir_ / "tb"), 40));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::regex line(
      R"( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +40 \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [0-9.]+ \| throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \| learning rate: [0-9.]+E[-+]\d\d \| global batch size: +4 \| lm loss: ([0-9.]+E[-+]\d\d) \| loss scale: 1\.0 \| grad norm: [0-9.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \|)");
  std::vector<double> losses;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
    EXPECT_EQ(std::stoi((*it)[2]), std::stoi((*it)[1]) * 4);
    losses.push_back(std::stod((*it)[3]));
  }
  ASSERT_EQ(losses.size(), 20u) << r.output;
  EXPECT_LT(losses.back(), losses.front() - 2.0) << r.output;  // the loss falls
  EXPECT_NE(r.output.find(" validation loss at iteration 4 | lm loss value: "), std::string::npos);
  EXPECT_NE(r.output.find(" validation loss at the end of training for val data | "), std::string::npos);
  std::string metrics = testing::ReadFile(dir_ / "tb/metrics.jsonl");
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 40);
  EXPECT_NE(metrics.find("{\"iteration\": 40, \"consumed_samples\": 160, \"lm_loss\": "), std::string::npos);
}

// Model, moments, scheduler and data position of a saved checkpoint.
struct Saved {
  std::vector<float> params, m, v;
  TrainState state;
};
Saved Load(const std::string& dir, int64_t iteration) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  auto layout = ParamLayout::Create(c);
  EXPECT_TRUE(layout.ok());
  Saved s;
  absl::Status st = LoadCheckpoint(dir, iteration, *layout, &s.params, &s.m, &s.v, &s.state);
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

TEST_F(TrainCli, StoppedAndResumedEqualsUninterrupted) {
  // Dropout on (Megatron's defaults): the masks must come back the same after the resume.
  auto a = RunCmd(Train("--save " + ShellQuote(dir_ / "a")));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b1 = RunCmd(Train("--save " + ShellQuote(dir_ / "b") + " --exit-interval 3"));
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  EXPECT_NE(b1.output.find("exiting program at iteration 3"), std::string::npos) << b1.output;
  EXPECT_EQ(testing::ReadFile(dir_ / "b/latest_checkpointed_iteration.txt"), "3");
  auto b2 = RunCmd(Train("--save " + ShellQuote(dir_ / "b") + " --load " + ShellQuote(dir_ / "b")));
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_EQ(b2.output.find("iteration        2/"), std::string::npos) << "the resumed run started over";
  Saved x = Load(dir_ / "a", 8), y = Load(dir_ / "b", 8);
  EXPECT_EQ(x.state.consumed_train_samples, 32);
  EXPECT_EQ(y.state.consumed_train_samples, 32);
  EXPECT_EQ(x.state.scheduler_num_steps, y.state.scheduler_num_steps);
  EXPECT_TRUE(x.params == y.params) << "weights differ after the resume";
  EXPECT_TRUE(x.m == y.m && x.v == y.v) << "AdamW moments differ after the resume";
}

TEST_F(TrainCli, SigtermSavesAndExitsCleanly) {
  std::string cmd = "bash -c " + ShellQuote(Train("--exit-signal-handler --save " + ShellQuote(dir_ / "s"), 100000) +
                                            " & pid=$!; sleep 3; kill -TERM $pid; wait $pid; echo rc=$?");
  auto r = RunCmd(cmd);
  EXPECT_NE(r.output.find("exiting on signal"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rc=0"), std::string::npos) << r.output;
  auto it = LatestCheckpointIteration(dir_ / "s");
  ASSERT_TRUE(it.ok()) << it.status();
  EXPECT_GT(*it, 0);
  EXPECT_EQ(Load(dir_ / "s", *it).state.iteration, *it);
}

// A second ptk-train on the same --save (a requeue while the first still runs) stops at once, naming
// the first, and leaves its checkpoints alone; the first finishes normally.
TEST_F(TrainCli, SecondRunOnOneSaveDirIsRefused) {
  const std::string save = ShellQuote(dir_ / "s");
  std::string cmd =
      "bash -c " + ShellQuote(Train("--save " + save + " --save-interval 50", 100) + " > " +
                              ShellQuote(dir_ / "first.log") + " 2>&1 & pid=$!; sleep 1; " +
                              Train("--save " + save, 4) + "; echo second_rc=$?; wait $pid; echo first_rc=$?");
  auto r = RunCmd(cmd);
  EXPECT_NE(r.output.find("second_rc=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("is being written by another run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("first_rc=0"), std::string::npos) << r.output << testing::ReadFile(dir_ / "first.log");
  auto it = LatestCheckpointIteration(dir_ / "s");
  ASSERT_TRUE(it.ok()) << it.status();
  EXPECT_EQ(*it, 100);
  EXPECT_FALSE(testing::Exists(dir_ / "s/ptk-train.ptk-lock"));
}

TEST_F(TrainCli, KillDuringSavesKeepsLatestWhole) {
  const std::string save = dir_ / "k";
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::string delay = std::to_string(1.0 + 0.37 * attempt);
    auto r = RunCmd(
        "bash -c " +
        ShellQuote(Train("--save-interval 1 --save " + ShellQuote(save) + " --load " + ShellQuote(save), 100000) +
                   " >/dev/null 2>&1 & pid=$!; sleep " + delay + "; kill -9 $pid; wait $pid"));
    auto it = LatestCheckpointIteration(save);
    if (!it.ok()) continue;  // killed before the first save
    Saved s = Load(save, *it);
    EXPECT_EQ(s.state.iteration, *it);
  }
  auto done = RunCmd(Train("--save " + ShellQuote(save) + " --load " + ShellQuote(save) + " --eval-iters 0", 3));
  // train_iters 3 is behind the checkpoint: nothing to do, still a clean exit.
  EXPECT_EQ(done.exit_code, 0) << done.output;
  auto ls = RunCmd("ls " + ShellQuote(save));
  EXPECT_EQ(ls.output.find("ptk-tmp"), std::string::npos) << "temporary checkpoint directories left: " << ls.output;
}

TEST_F(TrainCli, DamagedOrMismatchedCheckpointIsRefused) {
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "c"), 2)).exit_code, 0);
  std::string file = CheckpointFile(dir_ / "c", 2);
  auto wrong = RunCmd(Train("--load " + ShellQuote(dir_ / "c") + " --ffn-hidden-size 64", 4));
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_NE(wrong.output.find("model flags differ"), std::string::npos) << wrong.output;
  std::string bytes = testing::ReadFile(file);
  bytes[bytes.size() / 2] ^= 0x40;
  testing::WriteFile(file, bytes);
  auto r = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("corrupt checkpoint, refusing to load it: SHA-256 mismatch"), std::string::npos) << r.output;
  testing::WriteFile(dir_ / "c/latest_checkpointed_iteration.txt", "banana");
  r = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not an iteration number"), std::string::npos) << r.output;
}

TEST_F(TrainCli, SeedsFlagsAreHonouredOrRefusedInOneLine) {
  // Azure's GPT-3 175B line (shape kept, sizes shrunk where they only change the model size).
  auto azure =
      RunCmd(Train("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel "
                   "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                   "--attention-backend auto --ckpt-format torch_dist --no-gradient-accumulation-fusion "
                   "--use-mcore-models --distributed-timeout-minutes 60 --fp16"));
  EXPECT_EQ(azure.exit_code, 2) << azure.output;
  EXPECT_NE(azure.output.find("--tensor-model-parallel-size 8: ptk-train is data parallel only"), std::string::npos)
      << azure.output;
  EXPECT_LE(std::count(azure.output.begin(), azure.output.end(), '\n'), 2);
  // AWS's line: --fp16 --recompute-activations --split 98,2,0 --train-samples ...
  auto aws = RunCmd(Train("--fp16 --recompute-activations"));
  EXPECT_EQ(aws.exit_code, 2);
  EXPECT_NE(aws.output.find("--fp16: the CPU backend trains in fp32"), std::string::npos) << aws.output;
  // Speed-only flags are accepted with a note, and the run trains.
  auto ok =
      RunCmd(Train("--use-distributed-optimizer --overlap-grad-reduce --recompute-activations --log-throughput", 2));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("note: --use-distributed-optimizer: accepted"), std::string::npos) << ok.output;
  auto unknown = RunCmd(Train("--apend-eod", 2));
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  auto gbs = RunCmd(Train("--global-batch-size 5", 2));
  EXPECT_EQ(gbs.exit_code, 2) << gbs.output;
  EXPECT_NE(gbs.output.find("--global-batch-size (5) must be a multiple of --micro-batch-size (2)"), std::string::npos);
  auto missing = RunCmd(Train("--data-path " + ShellQuote(dir_ / "nope_text_document"), 2));
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("nope_text_document"), std::string::npos) << missing.output;
}

TEST_F(TrainCli, SameSeedSameBitsAnyThreadCount) {
  // Dropout on: the masks, the data order and the arithmetic are all deterministic.
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "x") + " --threads 2")).exit_code, 0);
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "y") + " --threads 1")).exit_code, 0);
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "z") + " --threads 2 --seed 99")).exit_code, 0);
  Saved x = Load(dir_ / "x", 8), y = Load(dir_ / "y", 8), z = Load(dir_ / "z", 8);
  EXPECT_TRUE(x.params == y.params) << "1 and 2 threads give different bits";
  EXPECT_TRUE(x.params != z.params) << "--seed has no effect";
}

TEST_F(TrainCli, ExitDurationSavesAndStops) {
  auto r = RunCmd(Train("--exit-duration-in-mins 0.02 --save " + ShellQuote(dir_ / "d"), 100000));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("exiting program after"), std::string::npos) << r.output;
  auto it = LatestCheckpointIteration(dir_ / "d");
  ASSERT_TRUE(it.ok());
  EXPECT_GT(*it, 0);
  EXPECT_LT(*it, 100000);
}

std::string Port() { return std::to_string(20000 + ::getpid() % 20000); }

TEST_F(TrainCli, TwoRanksEqualOneRank) {
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "one") + " --threads 1")).exit_code, 0);
  const std::string two = Train("--save " + ShellQuote(dir_ / "two") + " --threads 1");
  auto r = RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + Port() +
                                          "; RANK=1 " + two + " > " + ShellQuote(dir_ / "r1.log") + " 2>&1 & RANK=0 " +
                                          two + "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
  EXPECT_NE(r.output.find("rc0=0 rc1=0"), std::string::npos) << r.output << testing::ReadFile(dir_ / "r1.log");
  EXPECT_NE(r.output.find("data parallel: 2 ranks (torchrun variables)"), std::string::npos) << r.output;
  EXPECT_EQ(testing::ReadFile(dir_ / "r1.log").find("iteration "), std::string::npos) << "rank 1 printed log lines";
  Saved a = Load(dir_ / "one", 8), b = Load(dir_ / "two", 8);
  ASSERT_EQ(a.params.size(), b.params.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    num += (double(a.params[i]) - b.params[i]) * (double(a.params[i]) - b.params[i]);
    den += double(a.params[i]) * a.params[i];
  }
  EXPECT_LE(std::sqrt(num / den), 1e-5) << "2 ranks drifted from 1 rank beyond fp32 reduction-order differences";
  EXPECT_EQ(a.state.consumed_train_samples, b.state.consumed_train_samples);
}

TEST_F(TrainCli, ARankThatDiesStopsTheOthers) {
  const std::string cmd = Train("--distributed-timeout-minutes 0.5 --threads 1", 100000);
  auto r = RunCmd("bash -c " +
                  ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + Port() + "; RANK=1 " + cmd +
                             " >/dev/null 2>&1 & p1=$!; RANK=0 " + cmd + " > " + ShellQuote(dir_ / "r0.log") +
                             " 2>&1 & p0=$!; sleep 3; "
                             "kill -9 $p1; start=$SECONDS; wait $p0; echo rc0=$? after=$((SECONDS-start))"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("rc0=(\\d+) after=(\\d+)"))) << r.output;
  EXPECT_EQ(m[1], "1") << testing::ReadFile(dir_ / "r0.log");
  EXPECT_LE(std::stoi(m[2]), 45) << "rank 0 took too long to notice";
  EXPECT_NE(testing::ReadFile(dir_ / "r0.log").find("failed (a rank died or the network failed)"), std::string::npos)
      << testing::ReadFile(dir_ / "r0.log");
}

TEST_F(TrainCli, SamplesBasedScheduleAndMockData) {
  auto r = RunCmd(testing::Tool("ptk-train") +
                  " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2"
                  " --global-batch-size 4 --train-samples 40 --lr-decay-samples 40 --lr-warmup-samples 8 --lr 1e-3"
                  " --lr-decay-style WSD --lr-wsd-decay-samples 16 --lr-wsd-decay-style linear --mock-data"
                  " --eval-iters 0 --log-interval 10 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("iteration       10/      10 | consumed samples:           40"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("learning rate: 0.000000E+00"), std::string::npos) << r.output;  // WSD annealed to --min-lr
}

}  // namespace
}  // namespace ptk::trainer
