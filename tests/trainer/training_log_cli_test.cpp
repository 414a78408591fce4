// ptk-train's standard output against Megatron-LM core_v0.16.1's for the same flags
// (tests/data/trainer/training_log_golden.txt, written by tests/support/gen_training_log_golden.py
// from Megatron's training_log, evaluate_and_print_results, print_datetime and pretrain): which
// lines come (a log line after the first iteration and every --log-interval, the evaluations every
// --eval-interval and at the end on the validation and test sets with their 'Evaluating' lines and
// 'evaluate' timer), and in them the iterations, consumed samples, learning rates, batch sizes, loss
// scale and counts, character for character; what depends on the model or the clock is masked alike.
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

// A case of the golden: ptk-train's flags and Megatron's masked lines.
struct GoldenCase {
  std::string flags;
  std::vector<std::string> lines;
};

std::map<std::string, GoldenCase> ReadGolden() {
  std::ifstream in(testing::SourceDir() + "/tests/data/trainer/training_log_golden.txt");
  std::map<std::string, GoldenCase> cases;
  std::string line, name;
  while (std::getline(in, line)) {
    if (line.rfind("case ", 0) == 0) {
      name = line.substr(5);
    } else if (line.rfind("flags ", 0) == 0) {
      cases[name].flags = line.substr(6);
    } else if (line == "end") {
      name.clear();
    } else if (!name.empty()) {
      cases[name].lines.push_back(line);
    }
  }
  return cases;
}

// The lines of `out` the golden compares, masked as gen_training_log_golden.py's KEEP and MASKS.
std::vector<std::string> Masked(const std::string& out) {
  static const std::regex keep(
      R"(^( \[.*\] iteration |\[.*\] datetime: |training \.\.\.$| validation|-+$|Evaluating |INFO:megatron\.core\.timers:|    \S.*: \())");
  static const std::vector<std::pair<std::regex, std::string>> masks = {
      {std::regex(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})"), "<datetime>"},
      {std::regex(R"((elapsed time per iteration \(ms\): )[0-9.]+)"), "$1<ms>"},
      {std::regex(R"((throughput per GPU \(TFLOP/s/GPU\): )[0-9.]+)"), "$1<tflops>"},
      {std::regex(R"((lm loss: |grad norm: |lm loss value: |lm loss PPL: )[-+0-9.eEnaif]+)"), "$1<value>"},
      {std::regex(R"(: \([0-9.]+, [0-9.]+\)$)"), ": (<ms>, <ms>)"},
      {std::regex(R"(^-+$)"), "<dashes>"},
  };
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (!std::regex_search(line, keep)) continue;
    for (const auto& [re, repl] : masks) line = std::regex_replace(line, re, repl);
    lines.push_back(line);
  }
  return lines;
}

class TrainingLogGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 300, testing::kSmallVocabEod));
  }
  // ptk-train with the case's flags on the tests' tiny model; `data` its data flags.
  void ExpectMegatronsLines(const std::string& name, const std::string& data) {
    const std::map<std::string, GoldenCase> golden = ReadGolden();
    ASSERT_EQ(golden.count(name), 1u) << name;
    const GoldenCase& c = golden.at(name);
    const auto r = RunCmd(testing::Tool("ptk-train") +
                          " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                          " --max-position-embeddings 32 --threads 2 " +
                          testing::SmallVocabFlags() + " --data-cache-path " + ShellQuote(dir_ / "cache") + " " +
                          c.flags + " " + data + " 2>/dev/null");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<std::string> got = Masked(r.output);
    ASSERT_FALSE(c.lines.empty());
    for (size_t i = 0; i < std::max(got.size(), c.lines.size()); ++i)
      EXPECT_EQ(i < got.size() ? got[i] : "(no line)", i < c.lines.size() ? c.lines[i] : "(no line)")
          << "line " << i + 1 << " of the compared lines\n"
          << r.output;
  }
  testing::TempDir dir_;
  std::string prefix_;
};

// The Azure GPT-3 tutorial's flags (04-gpt175B.sh) scaled down: --train-iters, cosine with
// --lr-warmup-fraction and --lr-decay-iters, separate train/valid/test data paths. Before: no line
// after iteration 1, seconds without microseconds, a throughput field without --log-throughput, no
// 'evaluate' timer, and 'the end of training for val data' for Megatron's 'iteration 12 on
// validation set' without its 'Evaluating' lines.
TEST_F(TrainingLogGolden, AzureTutorialRunPrintsMegatronsLines) {
  const std::string p = "1.0 " + ShellQuote(prefix_);
  ExpectMegatronsLines("azure_gpt3", "--train-data-path " + p + " --valid-data-path " + p + " --test-data-path " + p);
}

// --train-samples with a batch-size ramp, WSD in samples, --log-throughput; no test split.
TEST_F(TrainingLogGolden, SampleBasedWsdRampupRunPrintsMegatronsLines) {
  ExpectMegatronsLines("samples_wsd_rampup", "--data-path " + ShellQuote(prefix_) + " --split 9,1,0");
}

}  // namespace
}  // namespace ptk
