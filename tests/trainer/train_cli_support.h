// What ptk-train's end-to-end tests (train_cli_test, dp_train_cli_test, tp_train_cli_test,
// pp_train_cli_test, and the features' gated_attention_cli_test, mla_*, moe_* and swa_train_cli_test) share:
// the dataset they train on, a reader for the checkpoints their tiny model saves, a fixture that
// starts ranks as processes over loopback gloo, a stopped run resumed, and flags refused.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "indexed_dataset/indexed_dataset.h"
#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "trainer/checkpoint.h"

namespace ptk::testing {

// `documents` learnable documents at PREFIX: runs of consecutive ids (50 apart at most) from a
// document-specific start below 900, 20 to 169 tokens, each ending in `eod` (GPT-2's 50256 unless a
// test trains with a smaller --vocab-size). The same bytes every call.
inline void WriteLearnableDataset(const std::string& prefix, int documents, int32_t eod = 50256) {
  auto b = IndexedDatasetBuilder::Create(prefix, OptimalDType(50257));
  ASSERT_TRUE(b.ok()) << b.status();
  uint64_t h = 12345;
  for (int d = 0; d < documents; ++d) {
    h = h * 6364136223846793005ULL + 1442695040888963407ULL;
    int len = 20 + static_cast<int>((h >> 33) % 150), start = static_cast<int>((h >> 13) % 900);
    std::vector<int32_t> doc;
    for (int i = 0; i < len; ++i) doc.push_back(start + i % 50);
    doc.push_back(eod);
    std::vector<int32_t> lengths = {static_cast<int32_t>(doc.size())};
    ASSERT_TRUE((*b)->AddDocument(doc, lengths).ok());
  }
  ASSERT_TRUE((*b)->Finalize().ok());
}

// GPT-2's tokenizer cut to a vocabulary of 1000 (tests/support/gen_small_gpt2_tokenizer.py: its first
// 999 tokens, and <|endoftext|> as kSmallVocabEod), for tests whose tiny models would otherwise spend
// nearly all their time in GPT-2's output layer of 50257 rows: ptk-train's and ptk-convert's flags.
inline constexpr int32_t kSmallVocabEod = 999;
inline std::string SmallVocabFlags() {
  const std::string data = SourceDir() + "/tests/data/trainer/gpt2-1000-";
  return "--vocab-file " + ShellQuote(data + "vocab.json") + " --merge-file " + ShellQuote(data + "merges.txt");
}

// Model, moments, scheduler and data position of a saved checkpoint.
struct SavedCheckpoint {
  std::vector<float> params, m, v;
  TrainState state;
};

// Iteration `iteration` of DIR, saved by the tests' model (--num-layers 2 --hidden-size 32
// --num-attention-heads 4 --seq-length 32; GPT-2's vocabulary, or SmallVocabFlags' of 1000 padded to 1024).
// The tests' model: --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32.
inline GPTConfig TinyModel(int64_t vocab_size = 50257, int64_t padded_vocab_size = 50304) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = vocab_size;
  c.padded_vocab_size = padded_vocab_size;
  return c;
}

inline SavedCheckpoint LoadTinyCheckpoint(const std::string& dir, int64_t iteration, int64_t vocab_size = 50257,
                                          int64_t padded_vocab_size = 50304) {
  auto layout = ParamLayout::Create(TinyModel(vocab_size, padded_vocab_size));
  EXPECT_TRUE(layout.ok());
  SavedCheckpoint s;
  absl::Status st = LoadCheckpoint(dir, iteration, *layout, &s.params, &s.m, &s.v, &s.state);
  EXPECT_TRUE(st.ok()) << st;
  return s;
}

// The log lines' iteration, loss and norm fields without their timings: what a run that resumes
// bit for bit reproduces, character for character.
inline std::vector<std::string> LogLinesWithoutTimes(const std::string& out) {
  std::vector<std::string> v;
  const std::regex line(R"(iteration +\d+/ +\d+ .*\| lm loss: \S+ \|.*\| grad norm: \S+ \|)");
  const std::regex times(R"(elapsed time per iteration \(ms\): \S+ \|( throughput per GPU \(TFLOP/s/GPU\): \S+ \|)?)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it)
    v.push_back(std::regex_replace(it->str(), times, ""));
  return v;
}

// Each log line's iteration and lm loss, in order.
inline std::vector<std::pair<int, double>> LossesOf(const std::string& out) {
  std::vector<std::pair<int, double>> v;
  const std::regex re(R"(iteration +(\d+)/ +\d+ .*\| lm loss: (\S+) \|)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    v.emplace_back(std::stoi((*it)[1]), std::strtod((*it)[2].str().c_str(), nullptr));
  return v;
}

// The largest relative difference between the losses of the same iterations of `a` and `ref`.
inline double WorstRelativeDifference(const std::vector<std::pair<int, double>>& a,
                                      const std::vector<std::pair<int, double>>& ref) {
  double worst = 0;
  for (const auto& [it, loss] : a)
    for (const auto& [rit, rloss] : ref)
      if (it == rit) worst = std::max(worst, std::abs(loss - rloss) / std::abs(rloss));
  return worst;
}

// Each case's flags appended to `base`: ptk-train exits 2 with the case's message (a usage error) in its output;
// with `one_line`, in its first line, CLI11's "Run with --help" hint the only other.
inline void ExpectUsageErrors(const std::string& base, const std::vector<std::pair<std::string, std::string>>& cases,
                              bool one_line = false) {
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
    if (!one_line) continue;
    const std::string line = r.output.substr(0, r.output.find('\n') + 1);
    EXPECT_EQ(r.output.substr(line.size()), "Run with --help for more information.\n") << flags << "\n" << r.output;
  }
}

// The refusal tests' ptk-train: `layers` layers of the tests' model (TinyModel's shape) on mock data in
// SmallVocabFlags' vocabulary, 2 iterations; the flags under test after.
inline std::string MockRunOf(int layers) {
  return Tool("ptk-train") + " --num-layers " + std::to_string(layers) +
         " --hidden-size 32 --num-attention-heads 4 --seq-length 32"
         " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
         SmallVocabFlags();
}

// ptk-train --dry-run of the goldens' small models (their parameter counts: MegatronParamCount): `layers` layers of
// hidden 16, 4 heads, MLP 24, 8 positions, a vocabulary of 40 padded to 48, untied; the model's own flags after.
inline std::string DryRunOf(int layers) {
  return Tool("ptk-train") + " --dry-run --num-layers " + std::to_string(layers) +
         " --hidden-size 16 --num-attention-heads 4 --ffn-hidden-size 24"
         " --seq-length 8 --max-position-embeddings 8 --vocab-size 40 --make-vocab-size-divisible-by 8"
         " --untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 4"
         " --train-iters 1 --lr 1e-3";
}

// `cmd` (a --dry-run) exits 0 and prints the model's `count` parameters. Call under ASSERT_NO_FATAL_FAILURE.
inline void ExpectDryRunCount(const std::string& cmd, int64_t count) {
  auto r = RunCmd(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: " + std::to_string(count) + " parameters"), std::string::npos) << count << "\n"
                                                                                                 << r.output;
}

// A test directory holding PREFIX data_text_document (WriteLearnableDataset's 300 documents), and
// ranks of ptk-train started in it as processes over loopback gloo (torchrun's variables).
class RanksTest : public ::testing::Test {
 protected:
  // `eod`: the documents' last token (WriteLearnableDataset).
  explicit RanksTest(int32_t eod = 50256) : eod_(eod) {}
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(WriteLearnableDataset(prefix_, 300, eod_));
  }
  // `world` ranks of `cmd`, rank r's output in DIR/r<r>.log, each under `timeout 300` (a hang fails the
  // test instead of blocking it). The output is rank 0's (Megatron's print_rank_0 lines), then the last
  // rank's (its print_rank_last lines: the log lines, the evaluations' and the timers'), then one line
  // with every rank's exit code ("rc=0 0 0").
  CommandResult Ranks(int world, const std::string& cmd) {
    const std::string port = std::to_string(FreeTestPort());
    std::string script =
        "export WORLD_SIZE=" + std::to_string(world) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; pids=; ";
    for (int r = 1; r < world; ++r)
      script += "RANK=" + std::to_string(r) + " timeout 300 " + cmd + " > " + ShellQuote(RankLog(r)) +
                " 2>&1 & pids=\"$pids $!\"; ";
    script += "RANK=0 timeout 300 " + cmd + " > " + ShellQuote(RankLog(0)) +
              " 2>&1; rcs=$?; for p in $pids; do wait $p; rcs=\"$rcs $?\"; done; cat " + ShellQuote(RankLog(0)) +
              (world > 1 ? "; cat " + ShellQuote(RankLog(world - 1)) : std::string()) + "; echo rc=$rcs";
    return RunCmd("bash -c " + ShellQuote(script));
  }
  // Ranks' line of `world` exit codes 0.
  static std::string AllZero(int world) {
    std::string s = "rc=0";
    for (int r = 1; r < world; ++r) s += " 0";
    return s;
  }
  std::string RankLog(int rank) const {
    const std::string r = std::to_string(rank);
    return dir_ / ("r" + r + ".log");
  }
  // The runs' log lines: each one's iteration and lm loss; the lines without their timings; the
  // largest relative difference between the losses of the same iterations.
  static std::vector<std::pair<int, double>> Losses(const std::string& out) { return LossesOf(out); }
  static std::vector<std::string> Lines(const std::string& out) { return LogLinesWithoutTimes(out); }
  static double Worst(const std::vector<std::pair<int, double>>& a, const std::vector<std::pair<int, double>>& ref) {
    return WorstRelativeDifference(a, ref);
  }
  // `world` ranks of `cmd` (one plain process when `world` is 1), every one exiting 0, whose log lines
  // (the last rank's output, in *out after rank 0's) hold `lines` losses, each within `tolerance` relative of the same
  // iteration's in `ref`; the largest difference is printed after `what`. Its failures are fatal:
  // call it under ASSERT_NO_FATAL_FAILURE.
  void RunGivingLosses(int world, const std::string& cmd, const std::vector<std::pair<int, double>>& ref, size_t lines,
                       double tolerance, const std::string& what, std::string* out) {
    const CommandResult r = world == 1 ? RunCmd(cmd) : Ranks(world, cmd);
    *out = r.output;
    if (world == 1) {
      ASSERT_EQ(r.exit_code, 0) << r.output;
    } else {
      ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    }
    const auto got = Losses(r.output);
    ASSERT_EQ(got.size(), lines) << r.output;
    const double worst = Worst(got, ref);
    EXPECT_LT(worst, tolerance) << what;
    std::printf("%s: largest relative difference of the %zu lm losses from one rank's: %.3g\n", what.c_str(), lines,
                worst);
  }
  // The checkpoint tests' start: `world` ranks of `train`'s run (20 iterations) saved in DIR/full,
  // and again stopped at iteration 10 in DIR/ck (its save line saying `saved_as`, "[ t 1/2, p 1/1 ]",
  // iteration 10 holding each of the mp_rank directories `shards` and not `absent`), copied to
  // DIR/ck1 and DIR/ck4 (for resumes at other sizes); then DIR/ck resumed by as many ranks: the
  // uninterrupted run's last 10 lines, character for character. Call under ASSERT_NO_FATAL_FAILURE.
  void StopAndResumeAtTheSameSize(int world, const std::function<std::string(const std::string&)>& train,
                                  const std::string& saved_as, const std::vector<std::string>& shards,
                                  const std::string& absent) {
    const std::string full = dir_ / "full", ck = dir_ / "ck";
    auto whole = Ranks(world, train("--save " + ShellQuote(full)));
    ASSERT_NE(whole.output.find(AllZero(world)), std::string::npos) << whole.output << Logs(world);
    auto first = Ranks(world, train("--exit-interval 10 --save " + ShellQuote(ck)));
    ASSERT_NE(first.output.find(AllZero(world)), std::string::npos) << first.output << Logs(world);
    EXPECT_NE(first.output.find(saved_as), std::string::npos) << first.output;
    for (const std::string& mp : shards)
      EXPECT_TRUE(std::filesystem::exists(dir_ / ("ck/iter_0000010/" + mp + "/model_optim_rng.ptk"))) << mp;
    EXPECT_FALSE(std::filesystem::exists(dir_ / ("ck/iter_0000010/" + absent)));
    for (const char* copy : {"ck1", "ck4"})
      ASSERT_EQ(RunCmd("cp -r " + ShellQuote(ck) + " " + ShellQuote(dir_ / copy)).exit_code, 0);
    auto same = Ranks(world, train("--load " + ShellQuote(ck) + " --save " + ShellQuote(ck)));
    ASSERT_NE(same.output.find(AllZero(world)), std::string::npos) << same.output << Logs(world);
    const auto resumed = Lines(same.output), uninterrupted = Lines(whole.output);
    ASSERT_EQ(resumed.size(), 10u) << same.output;
    ASSERT_EQ(uninterrupted.size(), 20u);
    EXPECT_EQ(resumed, std::vector<std::string>(uninterrupted.begin() + 10, uninterrupted.end()));
  }
  // The features' runs after their model's flags: micro-batches of 1 in SmallVocabFlags' vocabulary, global batch
  // 4, lr 5e-3 to 5e-4 (cosine, 1 warmup iteration), weight decay 0.1, an evaluation every 3 iterations, a log line
  // each, one thread, `iters` iterations of prefix_'s documents.
  std::string SmallRun(int64_t iters) const {
    return " --micro-batch-size 1 " + SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1 --threads 1"
           " --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters);
  }
  // One process of `train(extra)` (6 iterations) stopped after 3 (saved in DIR/ck) and resumed from DIR/ck: its
  // log lines (*resumed, when given) are `whole`'s last 3 (the run not stopped), character for character. Call under
  // ASSERT_NO_FATAL_FAILURE.
  void ExpectStoppedRunResumes(const std::function<std::string(const std::string&)>& train,
                               const std::vector<std::string>& whole, std::vector<std::string>* resumed = nullptr) {
    auto first = RunCmd(train("--exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
    ASSERT_EQ(first.exit_code, 0) << first.output;
    auto again = RunCmd(train("--load " + ShellQuote(dir_ / "ck")));
    ASSERT_EQ(again.exit_code, 0) << again.output;
    const auto lines = LogLinesWithoutTimes(again.output);
    EXPECT_EQ(lines, std::vector<std::string>(whole.begin() + 3, whole.end()));
    if (resumed) *resumed = lines;
  }
  // One process of `train(extra)`: 6 iterations saved in DIR/full, and the same run stopped after 3 (saved in
  // DIR/ck) and resumed from DIR/ck giving the last 3 log lines, character for character; *resumed gets them. Call
  // under ASSERT_NO_FATAL_FAILURE.
  void ExpectResumeBitForBit(const std::function<std::string(const std::string&)>& train,
                             std::vector<std::string>* resumed, std::vector<std::string>* whole_lines = nullptr) {
    auto whole = RunCmd(train("--save " + ShellQuote(dir_ / "full")));
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    auto first = RunCmd(train("--exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
    ASSERT_EQ(first.exit_code, 0) << first.output;
    auto again = RunCmd(train("--load " + ShellQuote(dir_ / "ck")));
    ASSERT_EQ(again.exit_code, 0) << again.output;
    const auto a = LogLinesWithoutTimes(whole.output), b = LogLinesWithoutTimes(again.output);
    ASSERT_EQ(a.size(), 6u) << whole.output;
    ASSERT_EQ(b.size(), 3u) << again.output;
    EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
    *resumed = b;
    if (whole_lines) *whole_lines = a;
  }
  // The logs of ranks 1 to world - 1 of the last Ranks, each under a header (for failure messages).
  std::string Logs(int world) const {
    std::string out;
    for (int r = 1; r < world; ++r) out += "--- rank " + std::to_string(r) + "\n" + ReadFile(RankLog(r));
    return out;
  }

  const int32_t eod_;
  TempDir dir_;
  std::string prefix_;
};

// The pipeline CLI tests' runs (pp_train_cli_test, vpp_train_cli_test): a tiny model at any T and P.
class PipelineCliTest : public RanksTest {
 protected:
  // The documents' ids are below 1000 (WriteLearnableDataset), their EOD the small vocabulary's.
  PipelineCliTest() : RanksTest(kSmallVocabEod) {}
  // 4 layers; global batch 8 of micro-batches of 1 (8 micro-batches a step on one data rank);
  // dropout on (Megatron's defaults). GPT-2's tokenizer cut to a vocabulary of 1000 (SmallVocabFlags): the
  // output layer of 50257 made the runs many times slower and checks nothing more about the stages.
  // It is padded to 1024 at every T.
  std::string Train(int T, int P, const std::string& extra, int64_t iters = 20) {
    return Tool("ptk-train") +
           " --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 " +
           SmallVocabFlags() +
           " --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 10 --eval-iters 1 --log-interval 1 --threads 1"
           " --tensor-model-parallel-size " +
           std::to_string(T) + " --pipeline-model-parallel-size " + std::to_string(P) +
           " --make-vocab-size-divisible-by " + std::to_string(512 / T) + " --data-path " + ShellQuote(prefix_) +
           " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " + std::to_string(iters) + " " + extra;
  }
  // The one-rank run every test compares with.
  const std::string& OneRank() {
    static std::string out;
    if (out.empty()) {
      auto r = RunCmd(Train(1, 1, ""));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      out = r.output;
    }
    return out;
  }
};

}  // namespace ptk::testing
