// ptk-train's evaluation modes end to end (Megatron's --skip-train, --full-validation,
// --multiple-validation-sets), ranks as processes over loopback gloo: --skip-train evaluates the loaded
// weights on the samples the saved run's final evaluation read (the same line, bit for bit), saves and
// trains nothing, alike on one rank and on 2 data-parallel, pipeline, tensor or context ranks; each
// validation set alike on 3 stages (the middle one reads no data); --full-validation reads
// the whole epoch of the validation split (Megatron's sampler's count); --multiple-validation-sets gives
// each --valid-data-path prefix its line and TensorBoard tag; the bad combinations exit 2 with one line.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class EvalModesCli : public testing::RanksTest {
 protected:
  EvalModesCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 4 (micro-batch 1: 4 per rank on one rank, 2 on two); no evaluation before the end
  // (--eval-interval 100), whose --eval-iters 2 read the validation split's first 8 samples.
  std::string Train(const std::string& extra, int64_t iters = 4) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --eval-interval 100 --eval-iters 2 --log-interval 1 --threads 1 --data-cache-path " +
           ShellQuote(dir_ / "cache") + " --train-iters " + std::to_string(iters) + " " + extra;
  }
  std::string Data() const { return "--split 90,10,0 --data-path " + ShellQuote(prefix_); }
  // The lines of `set` ("validation", "validation-1") at `at` ("iteration 4 on validation set").
  static std::vector<std::string> LossLines(const std::string& out, const std::string& set, const std::string& at) {
    std::vector<std::string> found;
    const std::string head = " " + set + " loss at " + at + " | lm loss value: ";
    for (size_t p = out.find(head); p != std::string::npos; p = out.find(head, p + 1))
      found.push_back(out.substr(p, out.find('\n', p) - p));
    return found;
  }
  static double LossOf(const std::string& line) {
    const std::string key = "lm loss value: ";
    return std::strtod(line.c_str() + line.find(key) + key.size(), nullptr);
  }
  // A checkpoint of 4 iterations in DIR/ckpt, and its final evaluation's line.
  std::string Saved() {
    auto r = RunCmd(Train(Data() + " --save " + ShellQuote(dir_ / "ckpt")));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto lines = LossLines(r.output, "validation", "iteration 4 on validation set");
    EXPECT_EQ(lines.size(), 1u) << r.output;
    return lines.empty() ? "" : lines[0];
  }
};

TEST_F(EvalModesCli, SkipTrainEvaluatesTheLoadedWeightsOnEveryLayout) {
  const std::string final_line = Saved();
  ASSERT_FALSE(final_line.empty());
  const std::string skip = Train(Data() + " --skip-train --load " + ShellQuote(dir_ / "ckpt") + " --save " +
                                 ShellQuote(dir_ / "other") + " --tensorboard-dir " + ShellQuote(dir_ / "tb"));
  auto r = RunCmd(skip);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipping training (--skip-train is on) ..."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("enabling --no-load-optim when skipping training."), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("training ...\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(" iteration        5/"), std::string::npos) << r.output;
  // The samples the saved run's final evaluation read (the split sized alike), with the same weights: its line.
  EXPECT_EQ(LossLines(r.output, "validation", "iteration 4 on validation set"), std::vector<std::string>{final_line})
      << r.output;
  EXPECT_NE(r.output.find("Evaluating on 8 samples"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: --skip-train: evaluated the weights of iteration 4, validation loss "),
            std::string::npos)
      << r.output;
  // Nothing saved: no iteration past 4 in --load, no --save directory.
  EXPECT_EQ(testing::ReadFile(dir_ / "ckpt/latest_checkpointed_iteration.txt"), "4");
  EXPECT_FALSE(std::filesystem::exists(dir_ / "other")) << r.output;
  // Nor any TensorBoard scalar (Megatron's write_to_tensorboard=False with --skip-train).
  EXPECT_FALSE(std::filesystem::exists(dir_ / "tb")) << r.output;
  EXPECT_NE(r.output.find("--tensorboard-dir / --metrics-file with --skip-train: nothing is written there"),
            std::string::npos)
      << r.output;

  const double one = LossOf(final_line);
  for (const std::string layout :
       {"", "--pipeline-model-parallel-size 2", "--tensor-model-parallel-size 2", "--context-parallel-size 2"}) {
    auto two = Ranks(2, Train(Data() + " --skip-train --load " + ShellQuote(dir_ / "ckpt") + " " + layout));
    ASSERT_NE(two.output.find(AllZero(2)), std::string::npos) << layout << two.output;
    const auto lines = LossLines(two.output, "validation", "iteration 4 on validation set");
    ASSERT_EQ(lines.size(), 1u) << layout << two.output;
    EXPECT_NEAR(LossOf(lines[0]), one, 1e-5 * one) << layout << two.output;
  }
}

// Megatron's --skip-train without --load: the randomly initialized model, at iteration 0, said in a note.
TEST_F(EvalModesCli, SkipTrainWithoutLoadEvaluatesTheInitialWeights) {
  auto r = RunCmd(Train(Data() + " --skip-train"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--skip-train without --load: the randomly initialized model is evaluated"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(LossLines(r.output, "validation", "iteration 0 on validation set").size(), 1u) << r.output;
}

TEST_F(EvalModesCli, FullValidationReadsTheWholeEpochOfTheValidationSplit) {
  // The validation split's epoch (Megatron's num_samples None), as the run builds it.
  DataArgs args;
  args.data_path = {prefix_};
  args.split = "90,10,0";
  args.sizes = {int64_t{16}, std::nullopt, int64_t{0}};
  GPTDatasetConfig cfg;
  cfg.sequence_length = 32;
  auto sets = BuildGPTDatasets(args, cfg);
  ASSERT_TRUE(sets.ok()) << sets.status();
  const int64_t size = (*sets)[1]->size();
  ASSERT_GT(size, 9);
  for (int world : {1, 2}) {
    const int64_t samples = size / world * world, iterations = (samples / world + 4 / world - 1) / (4 / world);
    auto r = Ranks(world, Train(Data() + " --full-validation --eval-interval 2", 2));
    ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output;
    EXPECT_EQ(LossLines(r.output, "validation", "iteration 2").size(), 1u) << r.output;
    EXPECT_EQ(LossLines(r.output, "validation", "iteration 2 on validation set").size(), 1u) << r.output;
    EXPECT_NE(r.output.find("Evaluating on " + std::to_string(samples) + " samples"), std::string::npos)
        << world << r.output;
    const std::string last = "Evaluating iter " + std::to_string(iterations) + "/" + std::to_string(iterations);
    EXPECT_NE(r.output.find(last + "\n"), std::string::npos) << world << r.output;
  }
}

TEST_F(EvalModesCli, MultipleValidationSetsGiveALineAndATagEach) {
  const std::string other = dir_ / "other_text_document";
  ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(other, 90, testing::kSmallVocabEod));
  const std::string paths = " --train-data-path " + ShellQuote(prefix_) + " --valid-data-path " + ShellQuote(other) +
                            " " + ShellQuote(prefix_);
  auto r = RunCmd(Train(paths + " --full-validation --multiple-validation-sets --eval-interval 2 --tensorboard-dir " +
                            ShellQuote(dir_ / "tb"),
                        2));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* at : {"iteration 2", "iteration 2 on validation set"}) {
    EXPECT_EQ(LossLines(r.output, "validation-0", at).size(), 1u) << r.output;
    EXPECT_EQ(LossLines(r.output, "validation-1", at).size(), 1u) << r.output;
  }
  EXPECT_EQ(LossLines(r.output, "validation", "iteration 2").size(), 0u) << r.output;
  std::string events;
  for (const auto& f : std::filesystem::directory_iterator(dir_ / "tb"))
    if (f.path().filename().string().rfind("events.", 0) == 0) events += testing::ReadFile(f.path());
  for (const char* tag : {"lm loss validation-0", "lm loss validation-1 vs samples"})
    EXPECT_NE(events.find(tag), std::string::npos) << tag;

  // Each set is the one --valid-data-path of that prefix alone gives: set 1's line is that run's.
  auto alone = RunCmd(Train(" --train-data-path " + ShellQuote(prefix_) + " --valid-data-path " + ShellQuote(prefix_) +
                                " --full-validation --eval-interval 2",
                            2));
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  const auto one = LossLines(alone.output, "validation", "iteration 2");
  const auto set1 = LossLines(r.output, "validation-1", "iteration 2");
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(set1.size(), 1u);
  EXPECT_EQ(one[0].substr(one[0].find(" | ")), set1[0].substr(set1[0].find(" | "))) << r.output << alone.output;
}

// 3 stages: the middle one opens no data and stands in for each validation set with the first stage's size.
TEST_F(EvalModesCli, MultipleValidationSetsOnThreeStagesAreOneRanks) {
  const std::string other = dir_ / "other_text_document";
  ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(other, 90, testing::kSmallVocabEod));
  const std::string run =
      Train(" --train-data-path " + ShellQuote(prefix_) + " --valid-data-path " + ShellQuote(other) + " " +
            ShellQuote(prefix_) + " --skip-train --full-validation --multiple-validation-sets --num-layers 3");
  auto one = RunCmd(run);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto three = Ranks(3, run + " --pipeline-model-parallel-size 3");
  ASSERT_NE(three.output.find(AllZero(3)), std::string::npos) << three.output;
  for (const char* set : {"validation-0", "validation-1"}) {
    const auto a = LossLines(one.output, set, "iteration 0 on validation set");
    const auto b = LossLines(three.output, set, "iteration 0 on validation set");
    ASSERT_EQ(a.size(), 1u) << one.output;
    ASSERT_EQ(b.size(), 1u) << three.output;
    EXPECT_NEAR(LossOf(b[0]), LossOf(a[0]), 1e-5 * LossOf(a[0])) << set << three.output;
  }
}

TEST_F(EvalModesCli, BadCombinationsExitTwoWithOneLine) {
  struct Case {
    std::string flags, words;
  };
  for (const Case& c : {
           Case{"--multiple-validation-sets", "--multiple-validation-sets currently requires --full-validation"},
           Case{"--skip-train --eval-iters 0", "--skip-train --eval-iters 0: nothing would be evaluated"},
           Case{"--skip-train --split 100,0,0", "--skip-train: the run has no validation data"},
           Case{"--full-validation --mock-data --vocab-size 1000", "--mock-data"},
       }) {
    const std::string data = c.flags.find("--split") != std::string::npos       ? " --data-path " + ShellQuote(prefix_)
                             : c.flags.find("--mock-data") != std::string::npos ? ""
                                                                                : " " + Data();
    auto r = RunCmd(Train(c.flags + data));
    EXPECT_EQ(r.exit_code, 2) << c.flags << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << c.flags << r.output;
  }
}

}  // namespace
}  // namespace ptk
