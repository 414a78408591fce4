// ptk-train end to end: Megatron's log line, metrics, evaluation; a run stopped and resumed ends
// with the same bits as an uninterrupted one; SIGTERM saves and exits; kill -9 during saves never
// leaves a damaged `latest`; damaged or mismatched checkpoints are refused; the seeds' flags are
// honoured or refused with one line.
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/output_lock.h"
#include "indexed_dataset/indexed_dataset.h"
#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"
#include "trainer/training.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    // The documents' ids are below 1000, their EOD the small vocabulary's.
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 400, testing::kSmallVocabEod));
  }
  // GPT-2's tokenizer cut to a vocabulary of 1000 (SmallVocabFlags, padded to 1024): GPT-2's output
  // layer of 50257 was nearly all of each iteration and of each checkpoint, and no check here needs it.
  std::string Train(const std::string& extra, int64_t iters = 8) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-interval 4 --eval-iters 1 --log-interval 2"
           " --threads 2 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  // The same run over GPT-2's own vocabulary (built in), with `vocab` in its place.
  std::string TrainGpt2(const std::string& extra, int64_t iters = 8, const std::string& vocab = "") {
    std::string cmd = Train(extra, iters);
    const std::string small = testing::SmallVocabFlags();
    return cmd.replace(cmd.find(small), small.size(), vocab);
  }
  TempDir dir_;
  std::string prefix_;
};

// The iterations' records of a --metrics-file (an evaluation's has "lm_loss_validation" and the like instead).
int IterationRecords(const std::string& metrics) {
  int n = 0;
  for (size_t at = metrics.find("\"lm_loss\": "); at != std::string::npos; at = metrics.find("\"lm_loss\": ", at + 1))
    ++n;
  return n;
}

// Over GPT-2's vocabulary, where the loss falls by 2 in 40 iterations (not over a vocabulary of 1000).
TEST_F(TrainCli, LogsLikeMegatronAndLearns) {
  auto r = RunCmd(TrainGpt2("--tensorboard-dir " + ShellQuote(dir_ / "tb"), 40));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::regex line(
      R"( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +40 \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [0-9.]+ \| learning rate: [0-9.]+E[-+]\d\d \| global batch size: +4 \| lm loss: ([0-9.]+E[-+]\d\d) \| loss scale: 1\.0 \| grad norm: [0-9.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \|)");
  std::vector<double> losses;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
    EXPECT_EQ(std::stoi((*it)[2]), std::stoi((*it)[1]) * 4);
    losses.push_back(std::stod((*it)[3]));
  }
  ASSERT_EQ(losses.size(), 21u) << r.output;  // after iteration 1 (as megatron-core 0.16), then every 2
  EXPECT_LT(losses.back(), losses.front() - 2.0) << r.output;  // the loss falls
  EXPECT_NE(r.output.find(" validation loss at iteration 4 | lm loss value: "), std::string::npos);
  EXPECT_NE(r.output.find(" validation loss at iteration 40 on validation set | "), std::string::npos);
  std::string metrics = testing::ReadFile(dir_ / "tb/metrics.jsonl");
  // 40 iterations' records and 11 evaluations' (every 4 iterations, then the end's: MetricsFileHoldsTheEvaluations).
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 40 + 11);
  EXPECT_EQ(IterationRecords(metrics), 40);
  EXPECT_NE(metrics.find("{\"iteration\": 40, \"consumed_samples\": 160, \"lm_loss\": "), std::string::npos);
}

// --metrics-file holds each evaluation's loss and PPL (Megatron's validation line and TensorBoard scalars) beside
// the iterations' records, keyed by the scalar's tag: the evaluations every --eval-interval, and after the last
// iteration the validation and test splits', at the iteration and samples consumed, the line's numbers.
TEST_F(TrainCli, MetricsFileHoldsTheEvaluations) {
  const std::string path = dir_ / "m.jsonl";
  auto r = RunCmd(Train("--split 96,2,2 --metrics-file " + ShellQuote(path)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string metrics = testing::ReadFile(path);
  const std::regex record(
      R"re(\{"iteration": (\d+), "consumed_samples": (\d+), "lm_loss_(validation|test)": ([-0-9.e+]+), )re"
      R"re("lm_loss_\3_ppl": ([-0-9.e+]+)\}\n)re");
  const std::regex line(R"( validation loss at iteration (\d+)(?: on (validation|test) set)? \| )"
                        R"(lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+) \|)");
  std::vector<std::smatch> records, lines;
  for (auto it = std::sregex_iterator(metrics.begin(), metrics.end(), record); it != std::sregex_iterator(); ++it)
    records.push_back(*it);
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it)
    lines.push_back(*it);
  ASSERT_EQ(lines.size(), 4u) << r.output;  // at 4, at 8, then at 8 on the validation and the test set
  ASSERT_EQ(records.size(), 4u) << metrics;
  const std::vector<std::string> sets = {"validation", "validation", "validation", "test"};
  for (size_t k = 0; k < 4; ++k) {
    const std::smatch &m = records[k], &l = lines[k];
    EXPECT_EQ(m[1].str(), l[1].str()) << m.str();
    EXPECT_EQ(std::stoi(m[2]), 4 * std::stoi(m[1])) << m.str();
    EXPECT_EQ(m[3].str(), sets[k]) << m.str();
    // The line prints 7 digits ({:.6E}: within 5e-7 relative), the record 9.
    EXPECT_NEAR(std::stod(m[4]), std::stod(l[3]), 6e-7 * std::stod(l[3])) << m.str() << "\n" << l.str();
    EXPECT_NEAR(std::stod(m[5]), std::stod(l[4]), 6e-7 * std::stod(l[4])) << m.str() << "\n" << l.str();
  }
  // Between the iterations' records, at their places: after iteration 4's, and after the last one's.
  EXPECT_NE(metrics.find("\"consumed_samples\": 16, \"lm_loss\": "), std::string::npos);
  EXPECT_LT(metrics.find("\"consumed_samples\": 16, \"lm_loss\": "), metrics.find(records[0].str()));
  EXPECT_LT(metrics.find(records[0].str()), metrics.find("\"consumed_samples\": 20, \"lm_loss\": "));
  EXPECT_LT(metrics.find("\"consumed_samples\": 32, \"lm_loss\": "), metrics.find(records[1].str()));
}

// The event files in `dir` (not below it): TensorBoard's run of that directory.
int EventFiles(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    n += e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  return n;
}

// A fresh run into a --tensorboard-dir that holds another run's event files writes its own in a
// subdirectory (TensorBoard's run of its own), saying where in one line, with the metrics.jsonl that
// defaults to the directory's; each run resumed from its checkpoint goes on writing where it wrote.
// Before, the second run's events went beside the first's with a warning: one run in TensorBoard,
// two curves from iteration 0 drawn as one.
TEST_F(TrainCli, AFreshRunGetsItsOwnTensorBoardRunAndAResumeKeepsIt) {
  const std::string tb = dir_ / "tb";
  auto run = [&](const std::string& ckpt, bool resume, int64_t exit_at) {
    std::string flags = "--tensorboard-dir " + ShellQuote(tb) + " --save " + ShellQuote(dir_ / ckpt);
    if (resume) flags += " --load " + ShellQuote(dir_ / ckpt);
    if (exit_at > 0) flags += " --exit-interval " + std::to_string(exit_at);
    auto r = RunCmd(Train(flags, 4));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  const std::string a1 = run("a", false, 2);
  EXPECT_EQ(a1.find("holds"), std::string::npos) << a1;
  EXPECT_EQ(EventFiles(tb), 1);
  const std::string b1 = run("b", false, 2);  // a fresh run beside a's
  EXPECT_NE(b1.find("--tensorboard-dir " + tb +
                    " holds 1 event file(s) of another run; this run starts at iteration "
                    "0 and writes its own in " +
                    tb + "/run-2"),
            std::string::npos)
      << b1;
  EXPECT_EQ(EventFiles(tb), 1);
  EXPECT_EQ(EventFiles(tb + "/run-2"), 1);
  EXPECT_TRUE(testing::Exists(tb + "/run-2/metrics.jsonl"));
  const std::string b2 = run("b", true, 0);  // b resumed: its own directory
  EXPECT_EQ(b2.find("holds"), std::string::npos) << b2;
  EXPECT_NE(b2.find("TensorBoard events: " + tb + "/run-2/events.out.tfevents."), std::string::npos) << b2;
  EXPECT_EQ(EventFiles(tb + "/run-2"), 2);
  const std::string a2 = run("a", true, 0);  // a resumed: the directory itself
  EXPECT_EQ(EventFiles(tb), 2);
  EXPECT_EQ(EventFiles(tb + "/run-2"), 2);
  std::string metrics_a = testing::ReadFile(tb + "/metrics.jsonl"),
              metrics_b = testing::ReadFile(tb + "/run-2/metrics.jsonl");
  EXPECT_EQ(IterationRecords(metrics_a), 4) << metrics_a;
  EXPECT_EQ(IterationRecords(metrics_b), 4) << metrics_b;
  const std::string c = run("c", false, 0);  // a third fresh run: the next subdirectory
  EXPECT_NE(c.find("writes its own in " + tb + "/run-3"), std::string::npos) << c;
  EXPECT_EQ(EventFiles(tb + "/run-3"), 1);
}

// The names in `dir`, sorted ("" if it does not exist).
std::string Entries(const std::string& dir) {
  std::vector<std::string> v;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  std::string out;
  for (const std::string& n : v) out += n + " ";
  return out;
}

// A start refused over its outputs (its --metrics-file held by a run that still writes there, or
// a path that is a directory) leaves nothing it made: no --tensorboard-dir, no run-N beside
// another run's event files, no lock file, no --save (made and locked at start-up, before the
// outputs are opened; its missing parents neither). A --save that existed stays, with its files
// and without a lock file. Before, the directories (and run-N with its record of --save) stayed
// behind, empty.
TEST_F(TrainCli, ARefusedStartLeavesNothingBehind) {
  const std::string held = dir_ / "held.jsonl", tb = dir_ / "tb", other = tb + "/events.out.tfevents.1.other.1.0";
  auto lock = OutputLock::Acquire(held);  // another run writing there
  ASSERT_TRUE(lock.ok()) << lock.status();
  std::string save = dir_ / "ck";
  auto refused = [&](const std::string& flags, const std::string& named) {
    auto r = RunCmd(Train(flags + " --save " + ShellQuote(save), 2));
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(named), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("writes its own in"), std::string::npos) << r.output;
  };
  refused("--tensorboard-dir " + ShellQuote(dir_ / "new/tb") + " --metrics-file " + ShellQuote(held),
          "--metrics-file " + held);
  EXPECT_FALSE(testing::Exists(dir_ / "new"));
  // --lock-wait: the held file tried again that long, then refused alike, saying how long it waited.
  refused("--lock-wait 0.5 --tensorboard-dir " + ShellQuote(dir_ / "new/tb") + " --metrics-file " + ShellQuote(held),
          "still held after waiting 0.5 s (--lock-wait)");
  EXPECT_FALSE(testing::Exists(dir_ / "new"));
  std::filesystem::create_directories(tb);
  testing::WriteFile(other, "");  // another run's events: a fresh run would write in run-2
  refused("--tensorboard-dir " + ShellQuote(tb) + " --metrics-file " + ShellQuote(held), "--metrics-file " + held);
  EXPECT_EQ(Entries(tb), "events.out.tfevents.1.other.1.0 ");
  std::filesystem::create_directories(dir_ / "a_directory");
  refused("--tensorboard-dir " + ShellQuote(tb) + " --metrics-file " + ShellQuote(dir_ / "a_directory"),
          dir_ / "a_directory");
  EXPECT_EQ(Entries(tb), "events.out.tfevents.1.other.1.0 ");
  EXPECT_EQ(Entries(dir_ / "a_directory"), "");
  EXPECT_FALSE(testing::Exists(dir_ / "ck"));
  save = dir_ / "parent/ck";
  refused("--metrics-file " + ShellQuote(held), "--metrics-file " + held);
  EXPECT_FALSE(testing::Exists(dir_ / "parent"));
  save = dir_ / "existing";  // a --save of its own files
  std::filesystem::create_directories(save);
  testing::WriteFile(save + "/notes.txt", "kept");
  refused("--metrics-file " + ShellQuote(held), "--metrics-file " + held);
  EXPECT_EQ(Entries(save), "notes.txt ");
  EXPECT_EQ(testing::ReadFile(save + "/notes.txt"), "kept");
  // The run is then let in, and writes where it was refused before.
  lock->reset();
  auto r = RunCmd(Train("--tensorboard-dir " + ShellQuote(tb) + " --metrics-file " + ShellQuote(held), 2));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(EventFiles(tb + "/run-2"), 1);
}

// --metrics-file tells a fresh run from a resumed one by the iteration it starts at: a fresh run
// where lines are says so (it appends its own from iteration 1 after them); a run resumed with its
// own file continues it without a word; a run resumed into a file that ends before its checkpoint
// (not its lines: its own were on disk before the save) says so.
TEST_F(TrainCli, MetricsFileTellsAFreshRunFromAResumedOne) {
  const std::string own = dir_ / "own.jsonl", ck = ShellQuote(dir_ / "ck");
  auto a = RunCmd(Train("--save " + ck + " --exit-interval 4 --metrics-file " + ShellQuote(own), 8));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.find("--metrics-file"), std::string::npos) << a.output;
  auto resumed =
      RunCmd(Train("--load " + ck + " --save " + ck + " --exit-interval 6 --metrics-file " + ShellQuote(own), 8));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(resumed.output.find("--metrics-file"), std::string::npos) << resumed.output;
  std::string lines = testing::ReadFile(own);
  EXPECT_EQ(IterationRecords(lines), 6) << lines;
  auto fresh = RunCmd(Train("--metrics-file " + ShellQuote(own), 2));
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_NE(fresh.output.find("--metrics-file " + own + " holds " + std::to_string(lines.size()) +
                              " bytes of an earlier run; this run starts at iteration 0"),
            std::string::npos)
      << fresh.output;
  // Another run's file, of 2 iterations, and a run resumed at iteration 6 into it.
  const std::string others = dir_ / "others.jsonl";
  testing::WriteFile(others, lines.substr(0, lines.find("{\"iteration\": 3,")));
  auto mixed = RunCmd(Train("--load " + ck + " --metrics-file " + ShellQuote(others), 8));
  ASSERT_EQ(mixed.exit_code, 0) << mixed.output;
  EXPECT_NE(mixed.output.find("--metrics-file " + others +
                              " ends at iteration 2, before this run's checkpoint of iteration 6: not this run's "
                              "lines? this run appends its lines from iteration 7 after them"),
            std::string::npos)
      << mixed.output;
}

using Saved = testing::SavedCheckpoint;
Saved Load(const std::string& dir, int64_t iteration) {
  return testing::LoadTinyCheckpoint(dir, iteration, 1000, 1024);
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

// --qk-layernorm in a Qwen3-shaped model (RMSNorm, RoPE, SwiGLU, query groups, no biases, untied):
// stopped at iteration 3 and resumed, the weights and AdamW moments of iteration 8 are the
// uninterrupted run's, bit for bit; the checkpoint holds the query and key norms, and a resume
// without the flag is refused as another model.
TEST_F(TrainCli, QKLayerNormStoppedAndResumedEqualsUninterrupted) {
  const std::string qwen3 =
      "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention --num-query-groups 2 "
      "--disable-bias-linear --untie-embeddings-and-output-weights --kv-channels 16 --qk-layernorm ";
  auto a = RunCmd(Train(qwen3 + "--save " + ShellQuote(dir_ / "a")));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b1 = RunCmd(Train(qwen3 + "--save " + ShellQuote(dir_ / "b") + " --exit-interval 3"));
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  auto b2 = RunCmd(Train(qwen3 + "--save " + ShellQuote(dir_ / "b") + " --load " + ShellQuote(dir_ / "b")));
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_EQ(b2.output.find("iteration        2/"), std::string::npos) << "the resumed run started over";
  // The tests' model with those flags (SwiGLU's default ffn: 64).
  auto load = [](const std::string& dir, int64_t iteration, bool qk) {
    GPTConfig c;
    c.num_layers = 2, c.hidden_size = 32, c.num_attention_heads = 4, c.ffn_hidden_size = 64;
    c.seq_length = c.max_position_embeddings = 32;
    c.vocab_size = 1000, c.padded_vocab_size = 1024;
    c.normalization = Normalization::kRMSNorm, c.position_embedding = PositionEmbedding::kRope, c.swiglu = true;
    c.num_query_groups = 2, c.kv_channels = 16, c.add_bias_linear = false;
    c.untie_embeddings_and_output_weights = true, c.qk_layernorm = qk;
    auto layout = ParamLayout::Create(c);
    EXPECT_TRUE(layout.ok()) << layout.status();
    Saved saved;
    const absl::Status st = LoadCheckpoint(dir, iteration, *layout, &saved.params, &saved.m, &saved.v, &saved.state);
    EXPECT_TRUE(st.ok()) << st;
    return saved;
  };
  Saved x = load(dir_ / "a", 8, true), y = load(dir_ / "b", 8, true);
  ASSERT_FALSE(x.params.empty());
  EXPECT_TRUE(x.params == y.params) << "weights differ after the resume";
  EXPECT_TRUE(x.m == y.m && x.v == y.v) << "AdamW moments differ after the resume";
  // 2 layers x (query, key) x 16 channels beside the model without the norms.
  auto without = RunCmd(
      Train(qwen3.substr(0, qwen3.find("--qk-layernorm")) + "--exit-interval 1 --save " + ShellQuote(dir_ / "c")));
  ASSERT_EQ(without.exit_code, 0) << without.output;
  EXPECT_EQ(x.params.size(), load(dir_ / "c", 1, false).params.size() + 2 * 2 * 16);
  auto refused = RunCmd(Train(qwen3.substr(0, qwen3.find("--qk-layernorm")) + "--load " + ShellQuote(dir_ / "a")));
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find("the checkpoint is of another model: --qk-layernorm true (this run: the default)"),
            std::string::npos)
      << refused.output;
}

// Megatron's --squared-relu, --apply-layernorm-1p and --init-method-xavier-uniform train (the first and
// last another model: the first logged loss differs from the default run's; 1 + gamma at gamma = 0
// starts as the default's norms), are recorded in the checkpoint
// (its settings; a --load without the first two is refused as another model), and a bad combination
// is refused naming both flags.
TEST_F(TrainCli, MegatronMlpAndNormFlagsTrainAndAreRecorded) {
  auto first_loss = [](const std::string& out) {
    const size_t at = out.find("lm loss: ");
    return at == std::string::npos ? std::string() : out.substr(at, 22);
  };
  auto plain = RunCmd(Train("", 2));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  for (const std::string flag : {"--squared-relu", "--apply-layernorm-1p", "--init-method-xavier-uniform"}) {
    auto r = RunCmd(Train(flag, 2));
    ASSERT_EQ(r.exit_code, 0) << flag << ": " << r.output;
    EXPECT_NE(r.output.find("iteration        2/       2"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("unknown flag"), std::string::npos) << r.output;
    if (flag == "--apply-layernorm-1p")
      EXPECT_EQ(first_loss(r.output), first_loss(plain.output)) << flag;
    else
      EXPECT_NE(first_loss(r.output), first_loss(plain.output)) << flag << " trained the default model";
  }
  const std::string all =
      "--squared-relu --apply-layernorm-1p --init-method-xavier-uniform --normalization RMSNorm --lr-decay-iters 6 ";
  auto saved = RunCmd(Train(all + "--save " + ShellQuote(dir_ / "a"), 4));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  // A longer --train-iters changes Megatron's weight-decay increment length: its resume needs one of the flags.
  auto resumed = RunCmd(Train(all + "--override-opt_param-scheduler --load " + ShellQuote(dir_ / "a"), 6));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  auto refused = RunCmd(Train("--normalization RMSNorm --init-method-xavier-uniform --load " + ShellQuote(dir_ / "a")));
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find("the checkpoint is of another model: --squared-relu true (this run: the default), "
                                "--apply-layernorm-1p true (this run: the default)"),
            std::string::npos)
      << refused.output;
  auto both = RunCmd(Train("--squared-relu --swiglu", 1));
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("usage error: --squared-relu with --swiglu: one MLP activation"), std::string::npos)
      << both.output;
}

// Megatron's rotary variants train (--rotary-interleaved, --rope-scaling-factor 32 under
// --use-rope-scaling, --rotary-seq-len-interpolation-factor), each a model of its own: its weights after
// 4 iterations are not the default RoPE's, its checkpoint records it and resumes with its flags, and a
// resume without them (or with another factor) is refused as another model. Values no model has are
// refused naming the flag; a flag without effect where Megatron ignores it is noted.
TEST_F(TrainCli, RotaryVariantsTrainAndResumeOnlyAsThemselves) {
  const std::string llama =
      "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention --num-query-groups 2 "
      "--disable-bias-linear --rotary-base 500000 --lr-decay-iters 8 ";
  auto weights = [](const std::string& dir, const std::function<void(GPTConfig&)>& variant) {
    GPTConfig c;
    c.num_layers = 2, c.hidden_size = 32, c.num_attention_heads = 4, c.ffn_hidden_size = 64;
    c.seq_length = c.max_position_embeddings = 32;
    c.vocab_size = 1000, c.padded_vocab_size = 1024;
    c.normalization = Normalization::kRMSNorm, c.position_embedding = PositionEmbedding::kRope, c.swiglu = true;
    c.num_query_groups = 2, c.add_bias_linear = false, c.rotary_base = 500000, c.use_rope_scaling = true;
    variant(c);
    auto layout = ParamLayout::Create(c);
    EXPECT_TRUE(layout.ok()) << layout.status();
    Saved saved;
    const absl::Status st = LoadCheckpoint(dir, 4, *layout, &saved.params, &saved.m, &saved.v, &saved.state);
    EXPECT_TRUE(st.ok()) << st;
    return saved.params;
  };
  auto plain = RunCmd(Train(llama + "--use-rope-scaling --save " + ShellQuote(dir_ / "plain"), 4));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::vector<float> plain_weights = weights(dir_ / "plain", [](GPTConfig&) {});
  ASSERT_FALSE(plain_weights.empty());
  struct Variant {
    std::string flags, differs;
    std::function<void(GPTConfig&)> set;
  };
  const Variant variants[] = {
      {"--rotary-interleaved --use-rope-scaling", "--rotary-interleaved true (this run: the default)",
       [](GPTConfig& c) { c.rotary_interleaved = true; }},
      {"--use-rope-scaling --rope-scaling-factor 32", "--rope-scaling-factor 32.0 (this run: the default)",
       [](GPTConfig& c) { c.rope_scaling_factor = 32; }},
      {"--use-rope-scaling --rotary-seq-len-interpolation-factor 4",
       "--rotary-seq-len-interpolation-factor 4.0 (this run: the default)",
       [](GPTConfig& c) { c.rotary_seq_len_interpolation_factor = 4; }}};
  int i = 0;
  for (const Variant& v : variants) {
    const std::string save = dir_ / ("v" + std::to_string(i++));
    auto r = RunCmd(Train(llama + v.flags + " --save " + ShellQuote(save), 4));
    ASSERT_EQ(r.exit_code, 0) << v.flags << ": " << r.output;
    const std::vector<float> w = weights(save, v.set);
    ASSERT_EQ(w.size(), plain_weights.size()) << v.flags;
    EXPECT_NE(w, plain_weights) << v.flags << " trained the default RoPE's model";
    auto resumed = RunCmd(Train(llama + v.flags + " --override-opt_param-scheduler --load " + ShellQuote(save), 6));
    EXPECT_EQ(resumed.exit_code, 0) << v.flags << ": " << resumed.output;
    EXPECT_NE(resumed.output.find("iteration        6/"), std::string::npos) << resumed.output;
    auto refused = RunCmd(Train(llama + "--use-rope-scaling --load " + ShellQuote(save), 6));
    EXPECT_NE(refused.exit_code, 0) << refused.output;
    EXPECT_NE(refused.output.find("the checkpoint is of another model: " + v.differs), std::string::npos)
        << v.flags << ": " << refused.output;
  }
  auto other_factor =
      RunCmd(Train(llama + "--use-rope-scaling --rope-scaling-factor 16 --load " + ShellQuote(dir_ / "v1"), 6));
  EXPECT_NE(other_factor.output.find("--rope-scaling-factor 32.0 (this run: 16.0)"), std::string::npos)
      << other_factor.output;
  for (const std::string bad : {"--rope-scaling-factor 0", "--rope-scaling-factor -32", "--rope-scaling-factor nan",
                                "--rotary-seq-len-interpolation-factor 0", "--rotary-seq-len-interpolation-factor -4",
                                "--rotary-seq-len-interpolation-factor inf"}) {
    auto r = RunCmd(Train(llama + "--use-rope-scaling " + bad, 2));
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("usage error: " + bad.substr(0, bad.find(' ')) + ": must be"), std::string::npos)
        << bad << ": " << r.output;
  }
  auto noted = RunCmd(Train(llama + "--rope-scaling-factor 32", 2));
  EXPECT_EQ(noted.exit_code, 0) << noted.output;
  EXPECT_NE(noted.output.find("--rope-scaling-factor: accepted, no effect without --use-rope-scaling"),
            std::string::npos)
      << noted.output;
  auto gpt = RunCmd(Train("--rotary-interleaved", 2));
  EXPECT_EQ(gpt.exit_code, 0) << gpt.output;
  EXPECT_NE(gpt.output.find("--rotary-interleaved: accepted, no effect without --position-embedding-type rope"),
            std::string::npos)
      << gpt.output;
}

// The shell's loop that waits (up to 120 s) until `log` holds an iteration's line: training runs.
std::string UntilTraining(const std::string& log) {
  return "end=$((SECONDS + 120)); until grep -q ' iteration ' " + ShellQuote(log) +
         " 2>/dev/null || [ $SECONDS -ge $end ]; do sleep 0.05; done; ";
}

// Sent once training runs (its first log line), whatever the machine's speed: 100000 iterations
// never end by themselves.
TEST_F(TrainCli, SigtermSavesAndExitsCleanly) {
  const std::string log = dir_ / "s.log";
  std::string cmd = "bash -c " + ShellQuote(Train("--exit-signal-handler --save " + ShellQuote(dir_ / "s"), 100000) +
                                            " > " + ShellQuote(log) + " 2>&1 & pid=$!; " + UntilTraining(log) +
                                            "kill -TERM $pid; wait $pid; echo rc=$?; cat " + ShellQuote(log));
  auto r = RunCmd(cmd);
  EXPECT_NE(r.output.find("exiting program after receiving SIGTERM."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rc=0"), std::string::npos) << r.output;
  auto it = LatestCheckpointIteration(dir_ / "s");
  ASSERT_TRUE(it.ok()) << it.status();
  EXPECT_GT(*it, 0);
  EXPECT_EQ(Load(dir_ / "s", *it).state.iteration, *it);
}

// A SIGTERM as soon as the process exists, before main has run: with --exit-signal-handler it is
// handled, never the death of the process. The launcher here blocks SIGTERM (so that the signal
// cannot land before the handler exists, whatever the machine's load): ptk-train installs its
// handler first thing, unblocks the signal, and saves and exits at the first iteration.
TEST_F(TrainCli, SigtermAtTheStartIsHandled) {
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &term, &old), 0);
  const std::string log = dir_ / "early.log";
  // 30 iterations: a ptk-train that never took the signal would train them all and save at the end.
  pid_t pid = testing::SpawnShell(Train("--exit-signal-handler --save " + ShellQuote(dir_ / "e"), 30), log);
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const int rc = testing::WaitExit(pid);
  const std::string out = testing::ReadFile(log);
  EXPECT_EQ(rc, 0) << "128 + the signal that ended it, or the exit code:\n" << out;
  EXPECT_NE(out.find("exiting program after receiving SIGTERM."), std::string::npos) << out;
  auto it = LatestCheckpointIteration(dir_ / "e");
  ASSERT_TRUE(it.ok()) << it.status() << out;
  EXPECT_EQ(*it, 1);
  EXPECT_EQ(Load(dir_ / "e", 1).state.iteration, 1);
}

// A second ptk-train on the same --save (a requeue while the first still runs) stops at once, naming
// the first, and leaves its checkpoints alone; the first goes on and ends normally. The first cannot
// end before the second is refused, however fast the machine: 100000 iterations, ended by a SIGTERM
// (--exit-signal-handler: it saves and exits 0) only once the second run has returned.
TEST_F(TrainCli, SecondRunOnOneSaveDirIsRefused) {
  const std::string save = ShellQuote(dir_ / "s"), first = dir_ / "first.log";
  std::string cmd =
      "bash -c " + ShellQuote(Train("--exit-signal-handler --save " + save, 100000) + " > " + ShellQuote(first) +
                              " 2>&1 & pid=$!; " + UntilTraining(first) + Train("--save " + save, 4) +
                              "; echo second_rc=$?; kill -TERM $pid; wait $pid; echo first_rc=$?");
  auto r = RunCmd(cmd);
  const std::string log = testing::ReadFile(first);
  EXPECT_NE(r.output.find("second_rc=1"), std::string::npos) << r.output << log;
  EXPECT_NE(r.output.find("is being written by another run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("first_rc=0"), std::string::npos) << r.output << log;
  EXPECT_NE(log.find("exiting program after receiving SIGTERM."), std::string::npos) << log;
  // The first run's checkpoint is the one it saved on the signal, whole; its lock is gone.
  auto it = LatestCheckpointIteration(dir_ / "s");
  ASSERT_TRUE(it.ok()) << it.status() << log;
  EXPECT_GT(*it, 0);
  EXPECT_LT(*it, 100000);
  EXPECT_NE(log.find("successfully saved checkpoint from iteration " +
                     std::string(7 - std::to_string(*it).size(), ' ') + std::to_string(*it)),
            std::string::npos)
      << log;
  EXPECT_EQ(Load(dir_ / "s", *it).state.iteration, *it);
  EXPECT_FALSE(testing::Exists(dir_ / "s/ptk-train.ptk-lock"));
}

TEST_F(TrainCli, KillDuringSavesKeepsLatestWhole) {
  const std::string save = dir_ / "k";
  const std::string tracker = ShellQuote(save + "/latest_checkpointed_iteration.txt");
  for (int attempt = 0; attempt < 5; ++attempt) {
    // Once this attempt has saved a checkpoint (the tracker moved: every iteration saves), a little
    // later each time: the kill lands during a later save or between two, on any machine.
    std::string delay = std::to_string(0.11 * attempt);
    auto r = RunCmd(
        "bash -c " +
        ShellQuote("before=$(cat " + tracker + " 2>/dev/null); " +
                   Train("--save-interval 1 --save " + ShellQuote(save) + " --load " + ShellQuote(save), 100000) +
                   " >/dev/null 2>&1 & pid=$!; end=$((SECONDS + 120)); until [ \"$(cat " + tracker +
                   " 2>/dev/null)\" != \"$before\" ] || [ $SECONDS -ge $end ]; do sleep 0.02; done; sleep " + delay +
                   "; kill -9 $pid; wait $pid; echo rc=$?"));
    EXPECT_NE(r.output.find("rc=137"), std::string::npos) << r.output;
    auto it = LatestCheckpointIteration(save);
    ASSERT_TRUE(it.ok()) << it.status();
    Saved s = Load(save, *it);
    EXPECT_EQ(s.state.iteration, *it);
  }
  // (Killed before iteration 3, the longer schedule of the killed run is the checkpoint's.)
  auto done = RunCmd(Train(
      "--save " + ShellQuote(save) + " --load " + ShellQuote(save) + " --eval-iters 0 --override-opt_param-scheduler",
      3));
  // train_iters 3 is behind the checkpoint: nothing to do, still a clean exit.
  EXPECT_EQ(done.exit_code, 0) << done.output;
  auto ls = RunCmd("ls -a " + ShellQuote(save));
  EXPECT_EQ(ls.output.find("ptk-tmp"), std::string::npos) << "temporary checkpoint directories left: " << ls.output;
  EXPECT_EQ(ls.output.find("ptk-old"), std::string::npos) << "old checkpoint directories left: " << ls.output;
}

// A rerun over a finished run (same --save, no --load) saves the same iterations again, replacing
// each directory: kills during those saves must leave `latest` loadable and the next run no litter
// (a kill between moving the old directory aside and renaming the new one in lost both).
TEST_F(TrainCli, KillDuringARerunsSavesKeepsLatestWhole) {
  const std::string save = dir_ / "r";
  const std::string run = Train("--save-interval 1 --eval-iters 0 --save " + ShellQuote(save), 6);
  ASSERT_EQ(RunCmd(run).exit_code, 0);
  for (int attempt = 0; attempt < 6; ++attempt) {
    // Half the kills at a random moment, half the moment an old directory is moved aside (the
    // issue's window: polled with shell builtins, so the kill lands within microseconds). The poll
    // ends with the run: spinning on after it took a core from the other tests for 20 s.
    const std::string wait_then_kill = attempt % 2 == 0 ? "sleep " + std::to_string(0.4 + 0.23 * attempt)
                                                        : "end=$((SECONDS + 20)); until compgen -G " +
                                                              ShellQuote(save + "/*.ptk-old-*") +
                                                              " >/dev/null || ! kill -0 $pid 2>/dev/null || "
                                                              "[ $SECONDS -ge $end ]; do :; done";
    RunCmd("bash -c " + ShellQuote(run + " >/dev/null 2>&1 & pid=$!; " + wait_then_kill + "; kill -9 $pid; wait $pid"));
    auto it = LatestCheckpointIteration(save);
    ASSERT_TRUE(it.ok()) << it.status();
    // Loadable now (from a copy aside if the kill hit mid-replacement) and after the next start-up.
    EXPECT_EQ(Load(save, *it).state.iteration, *it);
    auto next = RunCmd(Train("--save " + ShellQuote(save) + " --load " + ShellQuote(save) + " --eval-iters 0", 6));
    EXPECT_EQ(next.exit_code, 0) << next.output;
    EXPECT_EQ(testing::Leftovers(save), "");
    auto ls = RunCmd("ls -a " + ShellQuote(save));
    EXPECT_EQ(ls.output.find("ptk-old"), std::string::npos) << ls.output;
  }
}

TEST_F(TrainCli, DamagedOrMismatchedCheckpointIsRefused) {
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "c"), 2)).exit_code, 0);
  std::string file = CheckpointFile(dir_ / "c", 2);
  auto wrong = RunCmd(Train("--load " + ShellQuote(dir_ / "c") + " --ffn-hidden-size 64", 4));
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_NE(wrong.output.find("the checkpoint is of another model: --ffn-hidden-size 128 (this run: 64)"),
            std::string::npos)
      << wrong.output;
  std::string bytes = testing::ReadFile(file);
  bytes[bytes.size() / 2] ^= 0x40;
  testing::WriteFile(file, bytes);
  auto r = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("corrupt checkpoint, refusing to load it: SHA-256 mismatch"), std::string::npos) << r.output;
  // Cut short (a copy stopped by a full disk): said so, with both sizes, in one line (it read as a SHA-256 mismatch).
  testing::WriteFile(file, bytes.substr(0, bytes.size() - 1000));
  r = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(fmt::format("{}: corrupt checkpoint, refusing to load it: cut short: {} bytes of the {} its "
                                      "header records (1000 missing",
                                      file, bytes.size() - 1000, bytes.size())),
            std::string::npos)
      << r.output;
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
  EXPECT_NE(azure.output.find("--num-layers 2 is not divisible by --pipeline-model-parallel-size 16"),
            std::string::npos)
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
  // The model's shape is checked by GPTConfig, which names settings (num_attention_heads); ptk-train
  // names the flags.
  auto heads = RunCmd(Train("--num-attention-heads 5", 2));
  EXPECT_EQ(heads.exit_code, 2) << heads.output;
  EXPECT_NE(heads.output.find("--num-attention-heads 5 does not divide --hidden-size 32"), std::string::npos)
      << heads.output;
  auto positions = RunCmd(Train("--max-position-embeddings 16", 2));
  EXPECT_EQ(positions.exit_code, 2) << positions.output;
  EXPECT_NE(positions.output.find("--max-position-embeddings 16 is less than --seq-length 32"), std::string::npos)
      << positions.output;
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

// --exit-duration-in-mins was checked only between iterations: an evaluation ran all its --eval-iters
// past the limit (a job's last minutes, then its kill without a save). Megatron's evaluate checks the
// limit after each of its iterations, says "Exiting during evaluation, timelimit reached", prints no
// validation line, and the loop saves and exits. A limit of 1e-9 minutes is up by the first check
// on any machine: the evaluation stops after its first of 20 iterations, one global batch consumed.
TEST_F(TrainCli, ExitDurationStopsAnEvaluationAsMegatron) {
  auto r = RunCmd(
      Train("--exit-duration-in-mins 1e-9 --eval-interval 1 --eval-iters 20 --save " + ShellQuote(dir_ / "d"), 8));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\nExiting during evaluation, timelimit reached\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("validation loss at"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exiting program after"), std::string::npos) << r.output;
  EXPECT_LT(r.output.find("timelimit reached"), r.output.find("successfully saved checkpoint from iteration       1"))
      << r.output;
  EXPECT_EQ(testing::ReadFile(dir_ / "d/latest_checkpointed_iteration.txt"), "1");
  Saved s = Load(dir_ / "d", 1);
  EXPECT_EQ(s.state.consumed_valid_samples, 4) << "the evaluation did not stop after its first iteration";
  EXPECT_EQ(s.state.consumed_train_samples, 4);
}

std::string Port() { return std::to_string(testing::FreeTestPort()); }

// TensorBoard's events and metrics.jsonl come from the last rank, as Megatron's writer (rank world_size - 1):
// the one event file is named with rank 1's pid, which says where it writes, and metrics.jsonl holds the loss
// of rank 1's first log line (iteration 1's alone; later lines average their interval's). Before, rank 0 wrote them
// (the last stage's first data rank), its pid in the name.
void ExpectTensorBoardFromTheLastRank(const std::string& tb, const std::string& r0, const std::string& r1) {
  std::smatch pid;
  ASSERT_TRUE(std::regex_search(r0, pid, std::regex("pid1=(\\d+)"))) << r0;
  EXPECT_EQ(EventFiles(tb), 1);
  const std::string events = "TensorBoard events: " + tb + "/events.out.tfevents.";
  EXPECT_EQ(r0.find(events), std::string::npos) << r0;
  std::smatch named;  // the path, then the pid in the file's name
  ASSERT_TRUE(std::regex_search(r1, named,
                                std::regex(R"(TensorBoard events: (\S+/events\.out\.tfevents\.\d+\.\S+\.(\d+)\.0)\n)")))
      << r1;
  EXPECT_EQ(named[2], pid[1]) << "the event file is not rank 1's:\n" << r1;
  EXPECT_TRUE(testing::Exists(named[1])) << named[1];
  const std::string metrics = testing::ReadFile(tb + "/metrics.jsonl");
  EXPECT_EQ(IterationRecords(metrics), 8) << metrics;
  std::smatch logged, written;
  ASSERT_TRUE(std::regex_search(r1, logged, std::regex(R"(iteration +1/ +8 \|.*\| lm loss: ([0-9.]+E[-+]\d\d) \|)")))
      << r1;
  ASSERT_TRUE(std::regex_search(metrics, written, std::regex(R"(\{"iteration": 1, [^\n]*"lm_loss": ([0-9.e+-]+),)")))
      << metrics;
  EXPECT_NEAR(std::stod(written[1]), std::stod(logged[1]), 1e-5 * std::stod(logged[1])) << metrics << r1;
}

TEST_F(TrainCli, TwoRanksEqualOneRank) {
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "one") + " --threads 1")).exit_code, 0);
  const std::string tb = dir_ / "tb";
  const std::string two =
      Train("--save " + ShellQuote(dir_ / "two") + " --threads 1 --tensorboard-dir " + ShellQuote(tb));
  auto r =
      RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + Port() + "; RANK=1 " +
                                     two + " > " + ShellQuote(dir_ / "r1.log") + " 2>&1 & echo pid1=$!; RANK=0 " + two +
                                     "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
  EXPECT_NE(r.output.find("rc0=0 rc1=0"), std::string::npos) << r.output << testing::ReadFile(dir_ / "r1.log");
  EXPECT_NE(r.output.find("data parallel: 2 ranks (torchrun variables)"), std::string::npos) << r.output;
  // Megatron's line of the sizes (validate_args' print_rank_0), from rank 0 only.
  const std::string sizes =
      "using world size: 2, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel sizes: "
      "None, tensor-model-parallel size: 1, pipeline-model-parallel size: 1\n";
  EXPECT_NE(r.output.find(sizes), std::string::npos) << r.output;
  const std::string r1 = testing::ReadFile(dir_ / "r1.log");
  EXPECT_EQ(r1.find("using world size"), std::string::npos);
  // Megatron's print_rank_last lines come from the last rank only, as with torchrun --log-dir --tee: the
  // log lines (iterations 1, 2, 4, 6, 8) and the evaluations' (rank 0 printed them, and rank 1 nothing).
  EXPECT_EQ(testing::LogLinesWithoutTimes(r1).size(), 5u) << r1;
  EXPECT_TRUE(testing::LogLinesWithoutTimes(r.output).empty()) << r.output;
  for (const char* evaluation : {" validation loss at iteration 4 | lm loss value: ",
                                 " validation loss at iteration 8 on validation set | lm loss value: "}) {
    EXPECT_NE(r1.find(evaluation), std::string::npos) << r1;
    EXPECT_EQ(r.output.find(evaluation), std::string::npos) << r.output;
  }
  EXPECT_EQ(r.output.find(" validation loss at iteration"), std::string::npos) << r.output;
  // Rank 0's start-up line said "its log line comes after it", in an output that never holds it.
  EXPECT_NE(r.output.find("start-up: iteration 1 running (its log line comes after it, from the last rank, 1) ..."),
            std::string::npos)
      << r.output;
  // print_rank_0's lines stay rank 0's.
  EXPECT_NE(r.output.find("[after training is done] datetime: "), std::string::npos) << r.output;
  EXPECT_EQ(r1.find("[after training is done] datetime: "), std::string::npos) << r1;
  ExpectTensorBoardFromTheLastRank(tb, r.output, r1);
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
  auto r =
      RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + Port() + "; RANK=1 " +
                                     cmd + " >/dev/null 2>&1 & p1=$!; RANK=0 " + cmd + " > " +
                                     ShellQuote(dir_ / "r0.log") + " 2>&1 & p0=$!; " + UntilTraining(dir_ / "r0.log") +
                                     "kill -9 $p1; start=$SECONDS; wait $p0; echo rc0=$? after=$((SECONDS-start))"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("rc0=(\\d+) after=(\\d+)"))) << r.output;
  EXPECT_EQ(m[1], "1") << testing::ReadFile(dir_ / "r0.log");
  EXPECT_LE(std::stoi(m[2]), 45) << "rank 0 took too long to notice";
  EXPECT_NE(testing::ReadFile(dir_ / "r0.log").find("failed (a rank died or the network failed)"), std::string::npos)
      << testing::ReadFile(dir_ / "r0.log");
}

// gloo writes to the other ranks with writev: a rank that wrote to the socket of a rank that had
// died got SIGPIPE and died with it (exit 141, no message naming the dead rank; seen in
// pp_train_cli_test's killed stage, about one run in eight here). ptk-train ignores SIGPIPE, as
// PyTorch's ranks under Python do. Which write meets the closed socket first is the machine's
// timing, so the disposition itself is checked, in a training run.
TEST_F(TrainCli, IgnoresSigpipeLikeARankUnderPython) {
  const std::string log = dir_ / "p.log";
  auto r = RunCmd("bash -c " + ShellQuote(Train("--exit-signal-handler", 100000) + " > " + ShellQuote(log) +
                                          " 2>&1 & pid=$!; " + UntilTraining(log) +
                                          "sed -n 's/^SigIgn:[[:space:]]*/sigign=/p' /proc/$pid/status; "
                                          "kill -TERM $pid; wait $pid; echo rc=$?"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("sigign=([0-9a-f]+)"))) << r.output;
  EXPECT_TRUE((std::stoull(m[1], nullptr, 16) >> (SIGPIPE - 1)) & 1) << "SigIgn " << m[1];
  EXPECT_NE(r.output.find("rc=0"), std::string::npos) << r.output << testing::ReadFile(log);
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

// --mock-data with a vocabulary below GPT-2's: the mock documents end with the vocabulary's last id
// (was GPT-2's 50256: "token id ... outside the vocabulary" at the first sample that reached an end
// of document), with and without --eod-mask-loss.
TEST_F(TrainCli, MockDataWithASmallVocabularyTrains) {
  const std::string tiny =
      testing::Tool("ptk-train") +
      " --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 64 --max-position-embeddings 64"
      " --vocab-size 64 --make-vocab-size-divisible-by 1 --micro-batch-size 2 --global-batch-size 4"
      " --train-iters 2 --lr 1e-3 --mock-data --eval-iters 0 --log-interval 1 --threads 1 ";
  for (const char* extra : {"", "--eod-mask-loss"}) {
    auto r = RunCmd(tiny + extra);
    EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.output;
    EXPECT_EQ(testing::LossesOf(r.output).size(), 2u) << r.output;
  }
  // One token leaves no room for documents and their end: refused in one line (was SIGFPE).
  const std::string one = std::regex_replace(tiny, std::regex("--vocab-size 64"), "--vocab-size 1");
  auto r = RunCmd(one);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--mock-data: the mock documents need a vocabulary of at least 2 tokens (--vocab-size 1)"),
            std::string::npos)
      << r.output;
}

// The real binary killed at each rename and at each fsync of its saves (strace's fault injection:
// SIGKILL on the K-th call), on a fresh directory and on a rerun that saves the same iteration
// over a finished run: `latest` always loads and the next run leaves no litter. Skipped where
// strace is missing or ptrace is not allowed (the library-level checkpoint_test covers every step
// there).
TEST_F(TrainCli, KillAtEachRenameAndFsyncOfASave) {
  if (RunCmd("strace -qq -o /dev/null true").exit_code != 0) GTEST_SKIP() << "strace cannot trace here";
  const std::string tiny =
      testing::Tool("ptk-train") +
      " --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size 64"
      " --make-vocab-size-divisible-by 1 --micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-3"
      " --mock-data --eval-iters 0 --log-interval 1 --threads 1 ";
  for (const bool rerun : {false, true}) {
    for (const char* call : {"rename", "fsync"}) {
      for (int k = 1;; ++k) {
        SCOPED_TRACE(std::string(rerun ? "rerun" : "fresh") + ", killed at " + call + " #" + std::to_string(k));
        TempDir dir;
        const std::string save = ShellQuote(dir / "ck");
        if (rerun) {
          ASSERT_EQ(RunCmd(tiny + "--save " + save).exit_code, 0);
        }
        auto r = RunCmd("strace -f -qq -o /dev/null -e trace=" + std::string(call) + " -e inject=" + call +
                        ":signal=KILL:when=" + std::to_string(k) + " " + tiny + "--save " + save);
        const bool killed = r.exit_code != 0;
        auto it = LatestCheckpointIteration(dir / "ck");
        if (rerun || !killed) {
          EXPECT_TRUE(it.ok()) << it.status();
        }
        auto next = RunCmd(tiny + "--save " + save + " --load " + save);
        EXPECT_EQ(next.exit_code, 0) << next.output;
        if (it.ok()) {
          EXPECT_NE(next.output.find("loaded checkpoint"), std::string::npos) << next.output;
        }
        EXPECT_EQ(testing::Leftovers(dir / "ck"), "");
        EXPECT_EQ(RunCmd("ls -a " + save + " | grep ptk-old").output, "");
        if (!killed) break;
        ASSERT_LT(k, 40) << r.output;
      }
    }
  }
}

// Values no run can use are refused where the flag is declared, in one line
// naming the flag, before anything runs (exit 2).
TEST_F(TrainCli, ImpossibleNumbersAreRefusedNamingTheFlag) {
  for (const std::string& bad : std::vector<std::string>{"--lr nan",
                                                         "--lr inf",
                                                         "--adam-beta1 1.5",
                                                         "--adam-eps -1",
                                                         "--make-vocab-size-divisible-by 0",
                                                         "--vocab-size -5",
                                                         "--ffn-hidden-size -1",
                                                         "--threads -1",
                                                         "--save-interval -1",
                                                         "--eval-interval 0",
                                                         "--distributed-timeout-minutes nan",
                                                         "--exit-duration-in-mins nan",
                                                         "--seed -1",
                                                         "--seed 4294967296",
                                                         "--hidden-dropout 1",
                                                         "--lr-warmup-fraction 2",
                                                         "--micro-batch-size 0",
                                                         "--train-iters 1e3",
                                                         "--num-workers -1",
                                                         "--hysteresis 0"}) {
    auto r = RunCmd(Train(bad + " --save " + ShellQuote(dir_ / "never"), 2));
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    const std::string flag = bad.substr(0, bad.find(' '));
    EXPECT_NE(r.output.find("usage error: " + flag + ": must be"), std::string::npos) << bad << ": " << r.output;
    EXPECT_FALSE(testing::Exists(dir_ / "never")) << bad;
  }
  // Inside the ranges: accepted.
  auto ok = RunCmd(Train("--seed 0 --save-interval 0 --exit-interval 0 --threads 0 --hidden-dropout 0", 2));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// Point 5: a loss that goes NaN stops the run with the iteration, the rank and which went bad;
// Megatron's --no-check-for-nan-in-loss-and-grad skips such iterations instead. --lr 1e20 makes the loss NaN
// at iteration 2: with --lr 1e6 the two iterations of huge but finite weights before it took ~3 CPU seconds each.
TEST_F(TrainCli, NanLossStopsTheRun) {
  const std::string mock =
      testing::Tool("ptk-train") +
      " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2"
      " --global-batch-size 4 --train-iters 30 --lr 1e20 --mock-data --eval-iters 0 --log-interval 5 --threads 1 ";
  auto r = RunCmd(mock + "--save " + ShellQuote(dir_ / "nan"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("error: iteration \\d+ \\(rank 0\\): the loss is NaN")))
      << r.output;
  EXPECT_NE(r.output.find("--no-check-for-nan-in-loss-and-grad"), std::string::npos) << r.output;
  auto skip = RunCmd(mock + "--no-check-for-nan-in-loss-and-grad --metrics-file " + ShellQuote(dir_ / "m.jsonl"));
  EXPECT_EQ(skip.exit_code, 0) << skip.output;
  EXPECT_NE(testing::ReadFile(dir_ / "m.jsonl").find("\"lm_loss\": null"), std::string::npos);
  auto on = RunCmd(mock + "--no-check-for-nan-in-loss-and-grad --check-for-nan-in-loss-and-grad");
  EXPECT_EQ(on.exit_code, 1) << on.output;
}

TEST(NanCheck, NamesLossOrGradient) {
  StepResult r;
  r.loss_sum = 10;
  r.tokens = 4;
  r.grad_norm = 1;
  EXPECT_TRUE(CheckForNanInLossAndGrad(r, 7, 1).ok());
  r.grad_norm = std::numeric_limits<double>::infinity();
  absl::Status st = CheckForNanInLossAndGrad(r, 7, 1);
  EXPECT_NE(st.message().find("iteration 7 (rank 1): the gradient norm is infinite"), absl::string_view::npos) << st;
  r.loss_sum = std::nan("");
  st = CheckForNanInLossAndGrad(r, 8, 0);
  EXPECT_NE(st.message().find("iteration 8 (rank 0): the loss is NaN"), absl::string_view::npos) << st;
}

// Point 6: a full disk (here a file-size limit: EFBIG, the same path as ENOSPC) while the metrics
// or a checkpoint are written is exit 3 naming the file; a failed save leaves no temporaries.
TEST_F(TrainCli, FullDiskIsExit3) {
  const std::string mock =
      testing::Tool("ptk-train") +
      " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2"
      " --global-batch-size 4 --train-iters 40 --lr 1e-3 --mock-data --eval-iters 0 --log-interval 5 --threads 1 ";
  auto m = RunCmd("ulimit -f 1; " + mock + "--metrics-file " + ShellQuote(dir_ / "m.jsonl"));
  EXPECT_EQ(m.exit_code, 3) << m.output;
  EXPECT_NE(m.output.find("m.jsonl"), std::string::npos) << m.output;
  const std::string save = dir_ / "full";
  auto c = RunCmd("ulimit -f 1024; " + mock + "--save-interval 10 --save " + ShellQuote(save));
  EXPECT_EQ(c.exit_code, 3) << c.output;
  EXPECT_NE(c.output.find("model_optim_rng.ptk"), std::string::npos) << c.output;
  EXPECT_EQ(testing::Leftovers(save), "");
  auto ls = RunCmd("ls -a " + ShellQuote(save));
  EXPECT_EQ(ls.output.find("iter_"), std::string::npos) << "a failed save left a directory: " << ls.output;
}

// Point 7: ranks of one launch (one run id) started with different model flags fail at start-up in
// one line naming the flag (no gloo abort); without a run id (started by hand) the rank whose
// settings are not rank 0's is refused at its hello, naming the flag with both values (it may be
// another job's: rank 0 warns and waits for its own rank 1, here until its short timeout); a bad
// RANK is a usage error.
TEST_F(TrainCli, RanksWithDifferentFlagsFailInOneLine) {
  const std::string base = Train("--threads 1", 4);
  auto r =
      RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 PTK_RUN_ID=one MASTER_PORT=" + Port() +
                                     "; RANK=1 " + base + " --hidden-size 64 > " + ShellQuote(dir_ / "r1.log") +
                                     " 2>&1 & RANK=0 " + base + "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
  EXPECT_NE(r.output.find("rc0=2 rc1=2"), std::string::npos) << r.output << testing::ReadFile(dir_ / "r1.log");
  EXPECT_NE(r.output.find("rank 1 was started with --hidden-size 64, rank 0 with --hidden-size 32"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  // By hand: rank 0 first (listening), then rank 1, refused at once; rank 0 names it and waits out its timeout.
  const std::string port = Port();
  auto hand =
      RunCmd("bash -c " +
             ShellQuote("unset PTK_RUN_ID SLURM_JOB_ID TORCHELASTIC_RUN_ID TORCHELASTIC_ERROR_FILE; export "
                        "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                        port + "; RANK=0 " + base + " --distributed-timeout-minutes 0.1 > " +
                        ShellQuote(dir_ / "h0.log") + " 2>&1 & for i in $(seq 1200); do (: > /dev/tcp/127.0.0.1/" +
                        port + ") 2>/dev/null && break; sleep 0.05; done; RANK=1 " + base +
                        " --hidden-size 64; rc1=$?; wait $!; echo rc0=$? rc1=$rc1"));
  const std::string h0 = testing::ReadFile(dir_ / "h0.log");
  EXPECT_NE(hand.output.find("rc0=1 rc1=1"), std::string::npos) << hand.output << h0;
  EXPECT_NE(hand.output.find("runs other settings than this rank 1: --hidden-size differs: rank 0 has 32, rank 1 has "
                             "64 (and "),
            std::string::npos)
      << hand.output;
  EXPECT_NE(h0.find("rank 0's rendezvous refused a rank 1 (host "), std::string::npos) << h0;
  EXPECT_NE(h0.find("rank 1 did not join within"), std::string::npos) << h0;
  EXPECT_NE(h0.find("Refused meanwhile: a rank 1 (host "), std::string::npos) << h0;
  auto bad = RunCmd("RANK=2 WORLD_SIZE=2 " + base);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("RANK=2 is outside [0, 1] (WORLD_SIZE=2)"), std::string::npos) << bad.output;
  // Point 8: a rank that never comes is named.
  auto alone = RunCmd("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + Port() + " " + base +
                      " --distributed-timeout-minutes 0.03");
  EXPECT_EQ(alone.exit_code, 1) << alone.output;
  EXPECT_NE(alone.output.find("rank 1 did not join within"), std::string::npos) << alone.output;
}

// Point 8: messages that say what is wrong.
TEST_F(TrainCli, DataAndCheckpointMistakesAreNamed) {
  // The default split leaves the test split of this small dataset empty; with --eval-iters 0
  // nothing is asked of it.
  auto small = RunCmd(Train("--split 969,30,1 --eval-iters 0", 2));
  EXPECT_EQ(small.exit_code, 0) << small.output;
  auto split = RunCmd(Train("--split abc", 2));
  EXPECT_EQ(split.exit_code, 2) << split.output;
  EXPECT_NE(split.output.find("--split \"abc\" holds no number"), std::string::npos) << split.output;
  for (const char* w : {"-1", "0", "nan"}) {
    std::string cmd = Train("", 2);
    const std::string given = "--data-path " + ShellQuote(prefix_);
    cmd.replace(cmd.find(given), given.size(), "--data-path " + std::string(w) + " " + ShellQuote(prefix_));
    auto r = RunCmd(cmd);
    EXPECT_EQ(r.exit_code, 2) << w << ": " << r.output;
    EXPECT_EQ(r.output.find("samples were requested"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("weight"), std::string::npos) << r.output;
  }
  // Megatron's own checkpoint (torch format) under --load.
  std::filesystem::create_directories(dir_ / "mg/iter_0000010/mp_rank_00");
  testing::WriteFile(dir_ / "mg/iter_0000010/mp_rank_00/model_optim_rng.pt", "PK torch");
  testing::WriteFile(dir_ / "mg/latest_checkpointed_iteration.txt", "10");
  auto mg = RunCmd(Train("--load " + ShellQuote(dir_ / "mg"), 2));
  EXPECT_EQ(mg.exit_code, 1) << mg.output;
  EXPECT_NE(mg.output.find("is a Megatron checkpoint in PyTorch's format"), std::string::npos) << mg.output;
  // A tracker with a NUL after the number, and one that overflows.
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "c"), 2)).exit_code, 0);
  testing::WriteFile(dir_ / "c/latest_checkpointed_iteration.txt", std::string("2\0garbage", 9));
  auto nul = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(nul.exit_code, 1) << nul.output;
  EXPECT_NE(nul.output.find("not an iteration number"), std::string::npos) << nul.output;
  testing::WriteFile(dir_ / "c/latest_checkpointed_iteration.txt", std::string(24, '9'));
  auto big = RunCmd(Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_NE(big.output.find("overflows"), std::string::npos) << big.output;
  // A FIFO in the checkpoint file's place is refused at once (it was opened and waited on for a
  // writer that never comes: ptk-train hung).
  testing::WriteFile(dir_ / "c/latest_checkpointed_iteration.txt", "2");
  const std::string file = CheckpointFile(dir_ / "c", 2);
  std::filesystem::remove(file);
  ASSERT_EQ(::mkfifo(file.c_str(), 0644), 0);
  auto fifo = RunCmd("timeout 60 " + Train("--load " + ShellQuote(dir_ / "c"), 4));
  EXPECT_EQ(fifo.exit_code, 1) << fifo.output;
  EXPECT_NE(fifo.output.find(file + " is a FIFO, not a regular file"), std::string::npos) << fifo.output;
}

// --data-path (and a per-split path) given twice, a script's default then an override: the last
// occurrence, as argparse takes it. Both lists were joined: training on both, or here, failing on
// the first one's missing dataset.
TEST_F(TrainCli, ADataPathGivenTwiceTakesTheLastAsArgparse) {
  const std::string given = "--data-path " + ShellQuote(prefix_);
  const std::string nope = ShellQuote(dir_ / "nope_text_document");
  std::string cmd = Train("--eval-iters 0", 2);
  cmd.replace(cmd.find(given), given.size(), "--data-path 1 " + nope + " " + given);
  auto r = RunCmd(cmd);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("nope_text_document"), std::string::npos) << r.output;
  cmd = Train("--eval-iters 0", 2);
  cmd.replace(cmd.find(given), given.size(),
              "--train-data-path " + nope + " --train-data-path " + ShellQuote(prefix_) + " --split 1");
  r = RunCmd(cmd);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("nope_text_document"), std::string::npos) << r.output;
}

// Point 9: a resume with another seed, global batch size, sequence length or data says so.
TEST_F(TrainCli, ResumeWithOtherDataSettingsSaysWhatChanged) {
  const std::string ck = ShellQuote(dir_ / "s");
  ASSERT_EQ(RunCmd(Train("--save " + ck + " --lr-decay-iters 10", 2)).exit_code, 0);
  auto same =
      RunCmd(Train("--save " + ck + " --load " + ck + " --lr-decay-iters 10 --override-opt_param-scheduler", 3));
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(same.output.find("resuming with"), std::string::npos) << same.output;
  // The learning-rate schedule is in samples: a global batch of 8 doubles its lengths.
  auto other = RunCmd(Train("--save " + ck + " --load " + ck +
                                " --seed 99 --global-batch-size 8 --seq-length 16 --max-position-embeddings 32 "
                                "--split 90,10,0 --lr-decay-iters 10 --override-opt_param-scheduler",
                            5));
  EXPECT_EQ(other.exit_code, 0) << other.output;
  for (const char* what :
       {"resuming with --seed 99 (the checkpoint of iteration 3 was saved with --seed 1234)",
        "resuming with --global-batch-size 8 (the checkpoint of iteration 3 was saved with --global-batch-size 4)",
        "resuming with --seq-length 16 (", "resuming with --split 90,10,0 ("})
    EXPECT_NE(other.output.find(what), std::string::npos) << what << "\n" << other.output;
}

// The learning rate of each iteration in a --metrics-file.
std::map<int, std::string> LearningRates(const std::string& metrics) {
  std::map<int, std::string> out;
  std::regex line(R"re(\{"iteration": (\d+), .*"learning_rate": ([^,]+),)re");
  for (auto it = std::sregex_iterator(metrics.begin(), metrics.end(), line); it != std::sregex_iterator(); ++it)
    out[std::stoi((*it)[1])] = (*it)[2];
  return out;
}

// --no-load-optim: Megatron's load_checkpoint loads neither the optimizer nor its scheduler, so the scheduler
// starts anew (num_steps 0: the warm-up again, the decay over this command line's length from here) while the
// iteration and the data position go on. ptk kept the checkpoint's scheduler position: the resumed rates went on
// near --min-lr where Megatron's warm up again. The rates of the iterations after the checkpoint are a fresh run's
// of the same flags, from its first iteration.
TEST_F(TrainCli, NoLoadOptimStartsTheScheduleAnewAsMegatron) {
  const std::string ck = ShellQuote(dir_ / "ck");
  ASSERT_EQ(RunCmd(Train("--save " + ck, 4)).exit_code, 0);
  auto resumed = RunCmd(Train("--load " + ck + " --no-load-optim --metrics-file " + ShellQuote(dir_ / "r.jsonl"), 8));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("loaded checkpoint"), std::string::npos) << resumed.output;
  ASSERT_EQ(RunCmd(Train("--metrics-file " + ShellQuote(dir_ / "fresh.jsonl"), 8)).exit_code, 0);
  const auto resumed_lr = LearningRates(testing::ReadFile(dir_ / "r.jsonl"));
  auto fresh_lr = LearningRates(testing::ReadFile(dir_ / "fresh.jsonl"));
  ASSERT_EQ(resumed_lr.size(), 4u);
  for (const auto& [it, lr] : resumed_lr) EXPECT_EQ(lr, fresh_lr[it - 4]) << "iteration " << it;
  // The checkpoint it saves records where its own schedule is: 4 iterations of 4 samples.
  ASSERT_EQ(RunCmd(Train("--load " + ck + " --no-load-optim --save " + ShellQuote(dir_ / "b"), 8)).exit_code, 0);
  EXPECT_EQ(Load(dir_ / "b", 8).state.scheduler_num_steps, 16);
}

// A resume whose schedule differs from the checkpoint's stops, as Megatron's
// does, unless --use-checkpoint-opt_param-scheduler (the checkpoint's schedule goes on: past its
// decay, the minimum rate) or --override-opt_param-scheduler (the command line's: the rates of an
// uninterrupted run with these flags). A finished run resumed: FinishedRunResumedGoesToMegatronsEnd.
TEST_F(TrainCli, ResumeKeepsOrReplacesTheScheduleAsMegatron) {
  const std::string ck = ShellQuote(dir_ / "ck");
  ASSERT_EQ(RunCmd(Train("--save " + ck, 4)).exit_code, 0);
  auto stop = RunCmd(Train("--load " + ck, 8));
  EXPECT_EQ(stop.exit_code, 2) << stop.output;
  for (const char* part : {"the learning-rate schedule differs from the one the checkpoint of iteration 4 was saved",
                           "decay length (--lr-decay-iters or --lr-decay-samples, by default --train-iters or "
                           "--train-samples): 8 iterations (32 samples) here, 4 iterations (16 samples) in the "
                           "checkpoint",
                           "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"})
    EXPECT_NE(stop.output.find(part), std::string::npos) << part << "\n" << stop.output;
  EXPECT_EQ(stop.output.find("iteration        5/"), std::string::npos) << stop.output;

  auto kept = RunCmd(Train("--load " + ck + " --use-checkpoint-opt_param-scheduler --save " +
                               ShellQuote(dir_ / "kept") + " --metrics-file " + ShellQuote(dir_ / "kept.jsonl"),
                           8));
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  EXPECT_NE(kept.output.find("going on with the checkpoint's schedule: decay length 4 iterations (16 samples)"),
            std::string::npos)
      << kept.output;
  const auto kept_lr = LearningRates(testing::ReadFile(dir_ / "kept.jsonl"));
  ASSERT_EQ(kept_lr.size(), 4u);
  for (const auto& [it, lr] : kept_lr) EXPECT_EQ(std::stod(lr), 5e-4) << "iteration " << it;  // --min-lr
  // The checkpoint it saved records the schedule it ran (the first run's).
  Saved k = Load(dir_ / "kept", 8);
  ASSERT_TRUE(k.state.scheduler.has_value());
  EXPECT_EQ(k.state.scheduler->decay_steps, 16);

  auto replaced = RunCmd(Train(
      "--load " + ck + " --override-opt_param-scheduler --metrics-file " + ShellQuote(dir_ / "replaced.jsonl"), 8));
  ASSERT_EQ(replaced.exit_code, 0) << replaced.output;
  EXPECT_NE(replaced.output.find("--override-opt_param-scheduler: this command line's schedule replaces"),
            std::string::npos)
      << replaced.output;
  ASSERT_EQ(RunCmd(Train("--metrics-file " + ShellQuote(dir_ / "whole.jsonl"), 8)).exit_code, 0);
  auto whole_lr = LearningRates(testing::ReadFile(dir_ / "whole.jsonl"));
  const auto replaced_lr = LearningRates(testing::ReadFile(dir_ / "replaced.jsonl"));
  ASSERT_EQ(replaced_lr.size(), 4u);
  for (const auto& [it, lr] : replaced_lr) EXPECT_EQ(lr, whole_lr[it]) << "iteration " << it;
  EXPECT_GT(std::stod(replaced_lr.at(5)), 1e-3);

  auto both = RunCmd(Train("--load " + ck + " --override-opt_param-scheduler --use-checkpoint-opt_param-scheduler", 8));
  EXPECT_EQ(both.exit_code, 2) << both.output;
}

// A run resumed at or past its last iteration does what Megatron-LM 0.16.1 does (pretrain / train): the checkpoint's
// schedule is checked on load (OptimizerParamScheduler.load_state_dict), train() runs no iteration, and pretrain
// goes on to its end: a save unless --save-interval divides the iteration, the evaluations on the validation (and
// test) split. ptk said "nothing to train" and exited 0 before the check, with no evaluation and no save.
TEST_F(TrainCli, FinishedRunResumedGoesToMegatronsEnd) {
  const std::string ck = ShellQuote(dir_ / "ck");
  ASSERT_EQ(RunCmd(Train("--save " + ck, 4)).exit_code, 0);
  const std::string saved = "successfully saved checkpoint from iteration       4";
  for (const char* save_interval : {"", " --save-interval 2", " --save-interval 3"}) {
    SCOPED_TRACE(save_interval);
    auto done = RunCmd(Train("--load " + ck + " --save " + ck + save_interval, 4));
    ASSERT_EQ(done.exit_code, 0) << done.output;
    EXPECT_NE(done.output.find("nothing to train: the checkpoint in " + dir_ / "ck" +
                               " is at iteration 4 (16 samples consumed) and --train-iters is 4; give a larger "
                               "--train-iters to train further"),
              std::string::npos)
        << done.output;
    EXPECT_EQ(done.output.find("iteration        5/"), std::string::npos) << done.output;
    EXPECT_NE(done.output.find("training ...\n"), std::string::npos) << done.output;
    EXPECT_NE(done.output.find("[after training is done] datetime: "), std::string::npos) << done.output;
    EXPECT_NE(done.output.find("validation loss at iteration 4 on validation set | lm loss value: "), std::string::npos)
        << done.output;
    EXPECT_NE(done.output.find("done: nothing to train; the run is complete at iteration 4 (16 samples consumed), "
                               "validation loss "),
              std::string::npos)
        << done.output;
    // Megatron's `iteration % args.save_interval != 0` (ptk's --save without --save-interval saves at the end).
    EXPECT_EQ(done.output.find(saved) != std::string::npos, std::string(save_interval) != " --save-interval 2")
        << done.output;
  }
  EXPECT_EQ(Load(dir_ / "ck", 4).state.iteration, 4);
  // A run by samples: the same end.
  auto by_samples = [&](const std::string& extra) {
    std::string cmd = Train(extra, 4);
    cmd.replace(cmd.find("--train-iters 4"), 15, "--train-samples 16");
    return cmd.replace(cmd.find("--lr-warmup-iters 1"), 19, "--lr-warmup-samples 4");
  };
  ASSERT_EQ(RunCmd(by_samples("--save " + ShellQuote(dir_ / "s"))).exit_code, 0);
  auto samples = RunCmd(by_samples("--load " + ShellQuote(dir_ / "s")));
  ASSERT_EQ(samples.exit_code, 0) << samples.output;
  EXPECT_NE(samples.output.find("is at iteration 4 (16 samples consumed) and --train-samples 16 make 4 iterations; "
                                "give a larger --train-samples to train further"),
            std::string::npos)
      << samples.output;
  EXPECT_NE(samples.output.find("validation loss at iteration 4 on validation set | lm loss value: "),
            std::string::npos)
      << samples.output;
  // Fewer iterations than the checkpoint's: Megatron's check on load stops the run (the decay length and the
  // weight-decay increment's length are --train-iters'), as any resume's.
  auto fewer = RunCmd(Train("--load " + ck, 3));
  EXPECT_EQ(fewer.exit_code, 2) << fewer.output;
  EXPECT_NE(fewer.output.find("the learning-rate schedule differs from the one the checkpoint of iteration 4 was saved "
                              "with: decay length (--lr-decay-iters or --lr-decay-samples, by default --train-iters or "
                              "--train-samples): 3 iterations (12 samples) here, 4 iterations (16 samples) in the "
                              "checkpoint"),
            std::string::npos)
      << fewer.output;
  EXPECT_EQ(fewer.output.find("validation loss"), std::string::npos) << fewer.output;
  // With the checkpoint's schedule it runs, but the validation split is this command line's: a blend sized for
  // --train-iters 4 holds 8 samples, which the checkpoint of iteration 8 consumed; the evaluation at the end needs 4
  // more, where Megatron's sampler stops (counted as -1 + 1 evaluations, it would have passed the check).
  const std::string blend = " --data-path 1 " + ShellQuote(prefix_) + " 1 " + ShellQuote(prefix_);
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(dir_ / "b8") + blend, 8)).exit_code, 0);
  auto past = RunCmd(Train("--load " + ShellQuote(dir_ / "b8") + " --use-checkpoint-opt_param-scheduler" + blend, 4));
  EXPECT_EQ(past.exit_code, 2) << past.output;
  EXPECT_NE(past.output.find("usage error: --load " + dir_ / "b8" +
                             ": the checkpoint of iteration 8 has consumed 8 validation samples, and this run's 1 "
                             "evaluation(s) (the one at the end: no iteration is left to train, --eval-iters 1 of 4 "
                             "samples) need 4 more, but the validation split holds 8"),
            std::string::npos)
      << past.output;
}

// --qk-layernorm --device cuda is taken (it was refused while the CUDA model had no query and key
// norms): on a GPU it trains; without one the only refusal is the device's (exit 1), in a build
// without CUDA the build's (exit 2), never the flag's.
TEST_F(TrainCli, QKLayerNormOnCudaIsTaken) {
  auto r = RunCmd(Train("--qk-layernorm --device cuda", 2));
  EXPECT_EQ(r.output.find("CPU backend only"), std::string::npos) << r.output;
  if (r.output.find("built without CUDA") != std::string::npos) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
  } else if (r.output.find("no CUDA device is visible") != std::string::npos) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
  } else {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("iteration        2/       2"), std::string::npos) << r.output;
  }
}

// Megatron's Llama-line flags train (Qwen's mix: RMSNorm, RoPE, SwiGLU, grouped-query attention,
// no biases but the QKV's); flags for models ptk has not get a reason, every one of them named, not a
// bare "unknown flag"; a value ptk has not, or query groups the tensor size does not divide, names the flag.
TEST_F(TrainCli, LlamaLineFlagsTrainAndOtherModelsAreRefusedSayingWhy) {
  auto qwen = RunCmd(Train(
      "--swiglu --group-query-attention --num-query-groups 2 --use-rotary-position-embeddings --disable-bias-linear "
      "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --use-rope-scaling "
      "--untie-embeddings-and-output-weights --kv-channels 16",
      4));
  EXPECT_EQ(qwen.exit_code, 0) << qwen.output;
  EXPECT_NE(qwen.output.find("iteration        4/       4"), std::string::npos) << qwen.output;
  auto twice =
      RunCmd(Train("--apply-residual-connection-post-layernorm --moe-input-jitter-eps 0.1 --fp8-format hybrid", 1));
  EXPECT_EQ(twice.exit_code, 2) << twice.output;
  EXPECT_NE(twice.output.find("usage error: --apply-residual-connection-post-layernorm: the residual is taken before"),
            std::string::npos)
      << twice.output;
  EXPECT_NE(twice.output.find("also not implemented here: --fp8-format hybrid, --moe-input-jitter-eps 0.1"),
            std::string::npos)
      << twice.output;
  for (const auto& [flag, why] : std::vector<std::pair<std::string, std::string>>{
           {"--squared-relu --swiglu", "--squared-relu with --swiglu: one MLP activation"},
           {"--fp8-format hybrid", "fp8 training is not implemented"},
           {"--position-embedding-type alibi", "ptk has learned_absolute, rope and none"},
           {"--normalization LayerNorm1p", "ptk has LayerNorm and RMSNorm"},
           {"--group-query-attention --num-query-groups 3",
            "--num-query-groups 3 does not divide --num-attention-heads 4"},
           {"--position-embedding-type rope --kv-channels 3", "--rotary-percent 1 of head dimension 3 rotates 3"},
           {"--num-experts 8", "--num-experts without --disable-bias-linear: ptk's MoE layers have no biases"},
           {"--tokenizer-model tok.model", "reads GPT-2 BPE data"}}) {
    auto r = RunCmd(Train(flag, 1));
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << flag << ": " << r.output;
    EXPECT_EQ(r.output.find("unknown flag"), std::string::npos) << r.output;
  }
  auto ok = RunCmd(Train("--openai-gelu --norm-epsilon 1e-5", 2));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("note: --openai-gelu: accepted"), std::string::npos) << ok.output;
}

// Megatron's Llama line (RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU, grouped-query
// attention, untied, no biases; dropout on) killed with SIGKILL after a checkpoint: --load resumes it
// bit for bit: its log lines and its last checkpoint's weights are the uninterrupted run's.
// The killed run cannot end by itself (100000 iterations, its learning rate decayed over the first
// 40; it ran 40 before, and the kill had to land within the 30 iterations after the checkpoint of
// iteration 10, however slowly the polling shell was scheduled): the uninterrupted run is made after
// the kill, to 8 iterations past the checkpoint the kill left (--exit-interval), as the resumed one.
TEST_F(TrainCli, LlamaLineKilledAndResumedEqualsUninterrupted) {
  const std::string llama =
      "--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --swiglu "
      "--group-query-attention --num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights "
      "--save-interval 4 --lr-decay-iters 40 ";
  // Checkpoints at even iterations only: a log line (every 2 iterations) holds the mean loss of the
  // iterations since the last one, so a run resumed from an odd iteration logs at the next even one
  // the loss of that iteration alone where the uninterrupted run logs that of both, as Megatron does;
  // the lines then differ by design.
  const int64_t iters = 100000;
  // Killed as soon as a checkpoint of iteration 10 or later is complete (polled with shell builtins).
  const std::string latest = dir_ / "b/latest_checkpointed_iteration.txt";
  auto killed = RunCmd("bash -c " + ShellQuote(Train(llama + "--save " + ShellQuote(dir_ / "b"), iters) +
                                               " >/dev/null 2>&1 & pid=$!; end=$((SECONDS + 120)); until [ -f " +
                                               ShellQuote(latest) + " ] && { read -r i < " + ShellQuote(latest) +
                                               "; [ \"${i:-0}\" -ge 10 ]; } || [ $SECONDS -ge $end ]; do :; done; "
                                               "kill -9 $pid; wait $pid; echo rc=$?"));
  EXPECT_NE(killed.output.find("rc=137"), std::string::npos) << "the run was not killed: " << killed.output;
  auto at = LatestCheckpointIteration(dir_ / "b");
  ASSERT_TRUE(at.ok()) << at.status();
  ASSERT_GE(*at, 10);
  ASSERT_EQ(*at % 2, 0);
  const int64_t end = *at + 8;
  std::printf("killed after iteration %lld's checkpoint; resumed to %lld\n", static_cast<long long>(*at),
              static_cast<long long>(end));
  const std::string until = "--exit-interval " + std::to_string(end) + " ";
  auto whole = RunCmd(Train(llama + until + "--save " + ShellQuote(dir_ / "a"), iters));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto resumed =
      RunCmd(Train(llama + until + "--save " + ShellQuote(dir_ / "b") + " --load " + ShellQuote(dir_ / "b"), iters));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("at iteration " + std::to_string(*at)), std::string::npos) << resumed.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output), b = testing::LogLinesWithoutTimes(resumed.output);
  // Each run's first iteration logs too (megatron-core 0.16), the next line averaging from there:
  // the resumed run's line of iteration at + 1 is its own, the ones after it the uninterrupted run's.
  ASSERT_EQ(a.size(), static_cast<size_t>(end / 2 + 1)) << whole.output;
  ASSERT_EQ(b.size(), static_cast<size_t>((end - *at) / 2 + 1)) << resumed.output;
  EXPECT_NE(
      b[0].find("iteration " + std::string(8 - std::to_string(*at + 1).size(), ' ') + std::to_string(*at + 1) + "/"),
      std::string::npos)
      << b[0];
  for (size_t i = 1; i < b.size(); ++i) EXPECT_EQ(b[i], a[a.size() - b.size() + i]);
  // The weights of the last checkpoints, bit for bit (the checkpoint files themselves record each
  // run's own flags, --load among them), through the Hugging Face export.
  for (const char* run : {"a", "b"}) {
    auto hf = RunCmd(testing::Tool("ptk-convert") + " --model-type GPT --loader ptk --saver hf --load-dir " +
                     ShellQuote(dir_ / run) + " --save-dir " + ShellQuote(dir_ / (std::string(run) + "-hf")) + " " +
                     testing::SmallVocabFlags());
    ASSERT_EQ(hf.exit_code, 0) << hf.output;
  }
  auto same =
      RunCmd("cmp " + ShellQuote(dir_ / "a-hf/model.safetensors") + " " + ShellQuote(dir_ / "b-hf/model.safetensors"));
  EXPECT_EQ(same.exit_code, 0) << "the last checkpoints' weights differ: " << same.output;
}

// --data-path without _text_document, or with .bin, names the prefix
// meant (was "cannot open my.idx"); a missing --vocab-file says GPT-2's files are built in; -lr
// gets --lr.
TEST_F(TrainCli, NewcomerMistakesAreNamed) {
  const std::string given_prefix = dir_ / "data";
  for (const std::string& given : {given_prefix, prefix_ + ".bin"}) {
    std::string cmd = Train("", 2);
    const std::string flag = "--data-path " + ShellQuote(prefix_);
    cmd.replace(cmd.find(flag), flag.size(), "--data-path " + ShellQuote(given));
    auto r = RunCmd(cmd);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(given + ": no dataset here"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("did you mean " + prefix_ + "?"), std::string::npos) << r.output;
  }
  auto vocab = RunCmd(TrainGpt2("", 2, "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt"));
  EXPECT_EQ(vocab.exit_code, 1) << vocab.output;
  EXPECT_NE(vocab.output.find("--vocab-file gpt2-vocab.json: no such file; ptk has GPT-2's vocab.json and merges.txt "
                              "built in: leave out --vocab-file and --merge-file to use them"),
            std::string::npos)
      << vocab.output;
  // --load given one iteration's directory, or the file in it (was: training from random weights).
  const std::string ck = dir_ / "ck";
  ASSERT_EQ(RunCmd(Train("--save " + ShellQuote(ck), 2)).exit_code, 0);
  for (const std::string& inside :
       {ck + "/iter_0000002", ck + "/iter_0000002/mp_rank_00/", ck + "/iter_0000002/mp_rank_00/model_optim_rng.ptk"}) {
    auto r = RunCmd(Train("--load " + ShellQuote(inside), 4));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--load " + inside + " is inside a checkpoint directory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("did you mean --load " + ck + "?"), std::string::npos) << r.output;
  }
  auto none = RunCmd(Train("--load " + ShellQuote(dir_ / "nothing-here"), 2));
  EXPECT_EQ(none.exit_code, 0) << none.output;
  EXPECT_NE(none.output.find("warning: --load " + dir_ / "nothing-here" + ": no checkpoint"), std::string::npos)
      << none.output;
  auto lr = RunCmd(Train("-lr 1e-3", 2));
  EXPECT_EQ(lr.exit_code, 2) << lr.output;
  EXPECT_NE(lr.output.find("unknown flag -lr; did you mean --lr?"), std::string::npos) << lr.output;
  // Regression: --rank suggested --save, --world-size --vocab-size, --node-rank --local-rank. A
  // launcher's flag says where ptk-train takes it from.
  const std::vector<std::pair<std::string, std::string>> launcher = {
      {"--rank 1",
       "unknown flag --rank: ptk-train, as Megatron, reads its rank from the launcher's environment: "
       "RANK with WORLD_SIZE (torchrun sets both), or srun's SLURM_PROCID with SLURM_STEP_NUM_TASKS"},
      {"--world-size 2",
       "unknown flag --world-size: ptk-train, as Megatron, reads the number of ranks from the "
       "launcher's environment: WORLD_SIZE with RANK"},
      {"--master_addr node1",
       "unknown flag --master_addr: torchrun's flag, not the program's: give it to torchrun "
       "before the program; ptk-train, as Megatron, reads MASTER_ADDR and MASTER_PORT"},
      {"--nproc-per-node 8",
       "unknown flag --nproc-per-node: torchrun's flag, not the program's: give it to torchrun "
       "before the program (torchrun --no-python --nproc-per-node 8 ptk-train ...)"},
      {"--node-rank 0", "unknown flag --node-rank: torchrun's flag"},
      // torchrun's flags for its workers' logs and its --no-python, given after the program.
      {"--no-python", "unknown flag --no-python: torchrun's flag, not the program's"},
      {"--log-dir logs", "unknown flag --log-dir: torchrun's flag, not the program's"},
      {"--tee 3", "unknown flag --tee: torchrun's flag, not the program's"},
      {"--local_ranks_filter 0", "unknown flag --local_ranks_filter: torchrun's flag, not the program's"},
  };
  for (const auto& [flag, want] : launcher) {
    auto r = RunCmd(Train(flag, 2));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("did you mean"), std::string::npos) << r.output;
  }
}

// PTK_TRAIN_INCOMPLETE_EXIT (k8s/train.sh's): a run that stopped before its last iteration exits with
// it, whatever flag set the run's length; one that reached it (even when --exit-interval fires there) and
// one with nothing left to train exit 0, and so does a stop without it (Megatron's). Regression:
// k8s/train.sh judged completion from --train-iters alone, and a rank of a --train-samples run that
// stopped with the others exited 0: its pod counted as done and never ran again.
TEST_F(TrainCli, IncompleteExitCodeSaysWhetherTrainingIsComplete) {
  const std::string env = "PTK_TRAIN_INCOMPLETE_EXIT=75 ";
  auto by_samples = [&](const std::string& extra) {
    std::string cmd = Train(extra, 4);
    cmd.replace(cmd.find(" --lr-warmup-iters 1 "), 21, " --lr-warmup-samples 4 ");  // Megatron's rule
    return cmd.replace(cmd.find(" --train-iters 4 "), 17, " --train-samples 16 ");
  };
  const std::string ck = ShellQuote(dir_ / "ck"), resume = " --save " + ck + " --load " + ck;
  auto stopped = RunCmd(env + by_samples("--exit-interval 2" + resume));
  EXPECT_EQ(stopped.exit_code, 75) << stopped.output;
  EXPECT_NE(stopped.output.find("exiting program at iteration 2"), std::string::npos) << stopped.output;
  auto finished = RunCmd(env + by_samples("--exit-interval 2" + resume));
  EXPECT_EQ(finished.exit_code, 0) << finished.output;
  EXPECT_NE(finished.output.find("done: iteration 4"), std::string::npos) << finished.output;
  auto nothing = RunCmd(env + by_samples(resume));
  EXPECT_EQ(nothing.exit_code, 0) << nothing.output;
  const std::string ck2 = ShellQuote(dir_ / "ck2");
  auto plain = RunCmd(by_samples("--exit-interval 2 --save " + ck2));
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  std::string abbreviated_cmd = Train("--exit-interval 2 --save " + ShellQuote(dir_ / "ck3"), 4);
  auto abbreviated =
      RunCmd(env + abbreviated_cmd.replace(abbreviated_cmd.find(" --train-iters 4 "), 17, " --train-it 4 "));
  EXPECT_EQ(abbreviated.exit_code, 75) << abbreviated.output;
  auto bad = RunCmd("PTK_TRAIN_INCOMPLETE_EXIT=0 " + by_samples(""));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("PTK_TRAIN_INCOMPLETE_EXIT=0: an exit code from 1 to 255"), std::string::npos)
      << bad.output;
}

}  // namespace
}  // namespace ptk
