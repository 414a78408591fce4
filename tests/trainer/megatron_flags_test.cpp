// ptk-train with Megatron's logging, batch-ramp, checkpoint-args and data-file flags: the log
// fields and TensorBoard scalars of --log-params-norm / --log-num-zeros-in-grad, Megatron's batch
// ramp (consumed samples, resume), --use-checkpoint-args, --data-args-path, --save-interval without
// --save, --profile, --help's required flags, a resume naming its data by another path, the
// start-up progress lines; and a Megatron GPT script's flags, one by one: taken, noted or refused.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

class MegatronFlags : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 400));
  }
  // The tests' tiny model (train_cli_test's), --train-iters or --train-samples given by the caller.
  std::string Base() const {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2"
           " --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0"
           " --eval-iters 0 --threads 2 --data-cache-path " +
           ShellQuote(dir_ / "cache") + " ";
  }
  std::string Train(const std::string& extra) const {
    return Base() + "--global-batch-size 4 --log-interval 2 --train-iters 8 --data-path " + ShellQuote(prefix_) + " " +
           extra;
  }
  TempDir dir_;
  std::string prefix_;
};

std::vector<std::string> Matches(const std::string& text, const std::string& pattern, int group = 1) {
  std::vector<std::string> out;
  std::regex re(pattern);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[group]);
  return out;
}

std::string EventFiles(const std::string& dir) {
  std::string all;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) all += testing::ReadFile(e.path());
  return all;
}

// Megatron's training_log: "... grad norm: G | num zeros: Z | params norm: P | number of skipped ...",
// and the TensorBoard scalars num-zeros and params-norm (with their "vs samples" twins). The params
// norm is the L2 norm of the weights the checkpoint of that iteration holds.
TEST_F(MegatronFlags, ParamsNormAndNumZerosAsMegatronLogsThem) {
  auto r = RunCmd(Train("--log-params-norm --log-num-zeros-in-grad --save " + ShellQuote(dir_ / "s") +
                        " --tensorboard-dir " + ShellQuote(dir_ / "tb")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string pattern =
      R"(iteration +(\d+)/ +8 \|.* loss scale: 1\.0 \| grad norm: [0-9.]+ \| num zeros: ([0-9]+)\.0 \| params norm: ([0-9.]+) \| number of skipped iterations: +0 \|)";
  const std::vector<std::string> its = Matches(r.output, pattern, 1), norms = Matches(r.output, pattern, 3);
  ASSERT_EQ(its, (std::vector<std::string>{"1", "2", "4", "6", "8"})) << r.output;  // the first, then every 2
  testing::SavedCheckpoint saved = testing::LoadTinyCheckpoint(dir_ / "s", 8);
  double sum = 0;
  for (float x : saved.params) sum += static_cast<double>(x) * x;
  EXPECT_NEAR(std::stod(norms.back()), std::sqrt(sum), 1e-3) << r.output;
  EXPECT_NE(norms.front(), norms.back());  // the weights move
  const std::string events = EventFiles(dir_ / "tb");
  for (const char* tag : {"params-norm", "params-norm vs samples", "num-zeros", "num-zeros vs samples"})
    EXPECT_NE(events.find(tag), std::string::npos) << tag;
  // Without the flags, neither field (Megatron prints them only when asked).
  auto plain = RunCmd(Train(""));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("params norm:"), std::string::npos);
  EXPECT_EQ(plain.output.find("num zeros:"), std::string::npos);
}

// --rampup-batch-size 2 2 16 to --global-batch-size 8 over --train-samples 40, as megatron-core's
// RampupBatchsizeNumMicroBatchesCalculator and update_train_iters give it: 16/3 samples per
// increment, so the batch is 2 until 16/3 samples, 4 until 32/3, 6 until 16, then 8; the ramp's
// iterations last while at most 16 samples are consumed (2, 4, 6, 10, 14, 20), then (40 - 20) // 8
// iterations of 8.
TEST_F(MegatronFlags, RampupBatchSizeFollowsMegatronAndResumes) {
  const std::string ramp = Base() +
                           "--global-batch-size 8 --rampup-batch-size 2 2 16 --train-samples 40 "
                           "--lr-warmup-samples 4 --log-interval 1 --data-path " +
                           ShellQuote(prefix_) + " ";
  auto a = RunCmd(ramp + "--save " + ShellQuote(dir_ / "a"));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string line = R"(iteration +\d+/ +8 \| consumed samples: +(\d+) \|.*\| global batch size: +(\d+) \|)";
  const std::vector<std::string> consumed = Matches(a.output, line, 1), batch = Matches(a.output, line, 2);
  EXPECT_EQ(consumed, (std::vector<std::string>{"2", "4", "6", "10", "14", "20", "28", "36"})) << a.output;
  EXPECT_EQ(batch, (std::vector<std::string>{"2", "2", "2", "4", "4", "6", "8", "8"})) << a.output;
  EXPECT_NE(a.output.find("setting initial batch size to 2"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("ramping up batch size from 4 to 6"), std::string::npos) << a.output;
  // Megatron saves when the number of micro-batches grows (iterations 3, 5 and 6 end a batch size).
  for (int it : {3, 5, 6}) EXPECT_TRUE(testing::Exists(CheckpointDir(dir_ / "a", it))) << it;
  // Stopped inside the ramp and resumed: the batch size follows the samples consumed, and the run
  // ends with the same bits as the uninterrupted one (the scheduler counted in samples).
  auto b1 = RunCmd(ramp + "--save " + ShellQuote(dir_ / "b") + " --exit-interval 4");
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  auto b2 = RunCmd(ramp + "--save " + ShellQuote(dir_ / "b") + " --load " + ShellQuote(dir_ / "b"));
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_EQ(Matches(b2.output, line, 2), (std::vector<std::string>{"4", "6", "8", "8"})) << b2.output;
  testing::SavedCheckpoint x = testing::LoadTinyCheckpoint(dir_ / "a", 8),
                           y = testing::LoadTinyCheckpoint(dir_ / "b", 8);
  EXPECT_EQ(x.state.consumed_train_samples, 36);
  EXPECT_EQ(y.state.consumed_train_samples, 36);
  EXPECT_EQ(x.state.scheduler_num_steps, y.state.scheduler_num_steps);
  EXPECT_TRUE(x.params == y.params) << "weights differ after the resume";
  EXPECT_TRUE(x.m == y.m && x.v == y.v) << "moments differ after the resume";
  // As Megatron: a ramp needs sample-based training, and its sizes must divide into micro-batches.
  auto iters = RunCmd(Train("--global-batch-size 8 --rampup-batch-size 2 2 16"));
  EXPECT_EQ(iters.exit_code, 2) << iters.output;
  EXPECT_NE(iters.output.find("--rampup-batch-size 2 2 16: a batch-size ramp needs sample-based training"),
            std::string::npos)
      << iters.output;
  auto odd = RunCmd(Base() + "--global-batch-size 8 --rampup-batch-size 3 1 16 --train-samples 40 --data-path " +
                    ShellQuote(prefix_));
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  EXPECT_NE(odd.output.find("the ramp's batch size 3 is not a multiple of --micro-batch-size (2)"), std::string::npos)
      << odd.output;
}

// A ramp's training split is built for --train-samples as given (Megatron's
// get_train_valid_test_num_samples), not for the 44 samples its 9 iterations consume: ptk-train's
// index cache has the names megatron-core's builder gives that split (they hash num_samples; ptk
// built another dataset, another sample order) and its iterations consume Megatron's samples,
// through a stop mid-ramp and a resume (tests/data/trainer/rampup_order.json, case
// tiny_ramp_resume). A --train-samples whose split the ramp's last iteration runs past is refused,
// naming the iteration where Megatron's loader runs out (case tiny_ramp_short).
TEST_F(MegatronFlags, RampTrainSplitIsBuiltForTrainSamplesAsMegatron) {
  simdjson::dom::parser parser;
  simdjson::dom::element golden = parser.load(testing::SourceDir() + "/tests/data/trainer/rampup_order.json");
  std::filesystem::copy(testing::SourceDir() + "/tests/data/gpt_dataset/gpt_data", dir_ / "gpt_data");
  const std::string cmd = "cd " + ShellQuote(dir_.path()) + " && " + testing::Tool("ptk-train") +
                          " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 4"
                          " --max-position-embeddings 4 --micro-batch-size 2 --global-batch-size 8"
                          " --rampup-batch-size 2 2 16 --lr 1e-3 --data-path gpt_data/tiny --split 1,0,0"
                          " --eval-iters 0 --log-interval 1 --threads 2 --data-cache-path ramp_cache ";
  auto a = RunCmd(cmd + "--train-samples 46 --save ck --exit-interval 4");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = RunCmd(cmd + "--train-samples 46 --save ck --load ck");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  simdjson::dom::element g = golden["tiny_ramp_resume"];
  std::vector<std::string> want_consumed, want_files, files;
  for (auto it : g["iterations"].get_array())
    want_consumed.push_back(std::to_string(int64_t(it["consumed_before"]) + int64_t(it["global_batch_size"])));
  const std::string line = R"(iteration +\d+/ +9 \| consumed samples: +(\d+) \|)";
  std::vector<std::string> consumed = Matches(a.output, line), after = Matches(b.output, line);
  consumed.insert(consumed.end(), after.begin(), after.end());
  EXPECT_EQ(consumed, want_consumed) << a.output << b.output;
  for (auto f : g["cache_files"].get_array()) want_files.emplace_back(std::string_view(f));
  for (const auto& e : std::filesystem::directory_iterator(dir_ / "ramp_cache"))
    files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, want_files);

  auto past = RunCmd(cmd + "--train-samples 14");
  EXPECT_EQ(past.exit_code, 2) << past.output;
  EXPECT_NE(past.output.find(fmt::format("the data would run out at iteration {}",
                                         int64_t(golden["tiny_ramp_short"]["runs_out_at_iteration"]))),
            std::string::npos)
      << past.output;
}

// --use-checkpoint-args: the model's flags from --load's checkpoint; one given otherwise is named.
TEST_F(MegatronFlags, UseCheckpointArgsTakesTheModelFromTheCheckpoint) {
  auto first = RunCmd(Train("--save " + ShellQuote(dir_ / "s") + " --exit-interval 4"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string rest = testing::Tool("ptk-train") +
                           " --micro-batch-size 2 --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style "
                           "cosine --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-iters 0 --threads 2 "
                           "--log-interval 2 --train-iters 8 --data-path " +
                           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") +
                           " --use-checkpoint-args --load " + ShellQuote(dir_ / "s") + " ";
  auto r = RunCmd(rest + "--save " + ShellQuote(dir_ / "s"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --use-checkpoint-args: from the checkpoint of iteration 4: --num-layers 2, "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(testing::LoadTinyCheckpoint(dir_ / "s", 8).state.iteration, 8);
  auto same = RunCmd(rest + "--hidden-size 32");  // given as the checkpoint has it: fine
  EXPECT_EQ(same.exit_code, 0) << same.output;
  auto conflict = RunCmd(rest + "--hidden-size 64");
  EXPECT_EQ(conflict.exit_code, 2) << conflict.output;
  EXPECT_NE(conflict.output.find("--use-checkpoint-args: --hidden-size 64 differs from the checkpoint's --hidden-size "
                                 "32"),
            std::string::npos)
      << conflict.output;
  auto no_load = RunCmd(testing::Tool("ptk-train") + " --use-checkpoint-args --lr 1e-3 --train-iters 2 --mock-data");
  EXPECT_EQ(no_load.exit_code, 2) << no_load.output;
  EXPECT_NE(no_load.output.find("--use-checkpoint-args needs --load"), std::string::npos) << no_load.output;
  // Without the flag the model's flags stay required.
  auto missing =
      RunCmd(testing::Tool("ptk-train") + " --lr 1e-3 --train-iters 2 --mock-data --load " + ShellQuote(dir_ / "s"));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("--num-layers"), std::string::npos) << missing.output;
}

// --data-args-path: the --data-path words from a file (Megatron splits its text on whitespace).
TEST_F(MegatronFlags, DataArgsPathReadsTheDataPathsFromAFile) {
  testing::WriteFile(dir_ / "data-args.txt", "  0.5 " + prefix_ + "\n0.5\t" + prefix_ + "\n");
  const std::string common = Base() + "--global-batch-size 4 --log-interval 2 --train-iters 4 ";
  auto file = RunCmd(common + "--data-args-path " + ShellQuote(dir_ / "data-args.txt"));
  ASSERT_EQ(file.exit_code, 0) << file.output;
  auto given = RunCmd(common + "--data-path 0.5 " + ShellQuote(prefix_) + " 0.5 " + ShellQuote(prefix_));
  ASSERT_EQ(given.exit_code, 0) << given.output;
  const std::string loss = R"(lm loss: ([0-9.]+E[-+]\d\d))";
  EXPECT_EQ(Matches(file.output, loss), Matches(given.output, loss));
  EXPECT_EQ(Matches(file.output, loss).size(), 3u) << file.output;  // iterations 1, 2 and 4
  auto both =
      RunCmd(common + "--data-args-path " + ShellQuote(dir_ / "data-args.txt") + " --data-path " + ShellQuote(prefix_));
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("--data-args-path and --data-path: give one"), std::string::npos) << both.output;
  // --per-split-data-args-path: Megatron's JSON of the splits' lists (or strings, split on whitespace).
  testing::WriteFile(dir_ / "splits.json",
                     "{\"train\": [\"1.0\", \"" + prefix_ + "\"], \"valid\": \"1.0 " + prefix_ + "\", \"test\": []}");
  auto splits = RunCmd(common + "--eval-iters 1 --eval-interval 2 --per-split-data-args-path " +
                       ShellQuote(dir_ / "splits.json"));
  ASSERT_EQ(splits.exit_code, 0) << splits.output;
  EXPECT_NE(splits.output.find(" validation loss at iteration 2 | "), std::string::npos) << splits.output;
  // A key missing (Megatron's KeyError): refused naming it, and the key given instead (was: trained with
  // no validation, without a word); null is no dataset, as in Megatron.
  testing::WriteFile(dir_ / "splits2.json",
                     "{\"train\": [\"" + prefix_ + "\"], \"validation\": [\"" + prefix_ + "\"], \"test\": null}");
  auto typo = RunCmd(common + "--per-split-data-args-path " + ShellQuote(dir_ / "splits2.json"));
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_NE(typo.output.find("splits2.json: no \"valid\" key: Megatron's file has \"train\", \"valid\" and \"test\" "
                             "(null for none); this one has \"validation\""),
            std::string::npos)
      << typo.output;
  testing::WriteFile(dir_ / "splits3.json",
                     "{\"train\": [\"" + prefix_ + "\"], \"valid\": null, \"test\": null, \"note\": \"x\"}");
  auto nulls = RunCmd(common + "--eval-iters 0 --per-split-data-args-path " + ShellQuote(dir_ / "splits3.json"));
  EXPECT_EQ(nulls.exit_code, 0) << nulls.output;
  auto missing = RunCmd(common + "--data-args-path " + ShellQuote(dir_ / "nope.txt"));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("nope.txt"), std::string::npos) << missing.output;
  // A FIFO given as a file to read is refused at once: ptk-train hung on --per-split-data-args-path
  // and --vocab-file ones, waiting for a writer.
  const std::string fifo = dir_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  for (const std::string& flags :
       {"--per-split-data-args-path " + ShellQuote(fifo), "--data-args-path " + ShellQuote(fifo),
        "--vocab-file " + ShellQuote(fifo) + " --merge-file " + ShellQuote(dir_ / "splits.json") + " --data-path " +
            ShellQuote(prefix_)}) {
    auto r = RunCmd("timeout 60 " + common + flags);
    EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << flags << ": " << r.output;
    EXPECT_NE(r.output.find(fifo + " is a FIFO, not a regular file"), std::string::npos) << flags << ": " << r.output;
  }
}

// --save-interval without --save, as Megatron: allowed, nothing saved, a note; --profile on the CPU
// is a note.
TEST_F(MegatronFlags, SaveIntervalWithoutSaveAndProfileAreNotes) {
  auto r = RunCmd(Train("--save-interval 2 --profile --device cpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --save-interval 2 without --save: nothing is saved (as in Megatron)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("note: --profile: accepted, the CPU backend has no profiler"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("successfully saved checkpoint"), std::string::npos) << r.output;
}

// --help: a required flag says REQUIRED, without the value its variable held before parsing.
TEST_F(MegatronFlags, HelpShowsRequiredFlagsWithoutAFakeDefault) {
  auto r = RunCmd(testing::Tool("ptk-train") + " --help");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* flag : {"--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--lr"}) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex(std::string(flag) + " [^\n]*REQUIRED"))) << flag;
    EXPECT_EQ(m.str().find("=0"), std::string::npos) << m.str();
  }
  // Nor a default its own range refuses ("--ffn-hidden-size INT:an integer in [1, 2147483647]=0"): a
  // sentinel for "not given", whose meaning the help text states.
  for (const char* flag : {"--ffn-hidden-size", "--train-iters", "--global-batch-size", "--ddp-bucket-size"}) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex(std::string("\\n  ") + flag + " [^\n]*"))) << flag;
    EXPECT_EQ(m.str().find("]=0"), std::string::npos) << m.str();
  }
  EXPECT_NE(r.output.find("--micro-batch-size INT:an integer in [1, 2147483647]=1"), std::string::npos) << r.output;
  // Regression: "selective (as --recompute-activations) or full", while full runs as selective (its note says so).
  EXPECT_NE(r.output.find("full is taken as selective, with a note"), std::string::npos) << r.output;
}

// A resume that names the same dataset by a relative path from another working directory (a Slurm
// requeue elsewhere) says nothing about the data; another copy of the data is still named.
TEST_F(MegatronFlags, ResumeComparesDatasetsByTheirResolvedFiles) {
  auto first = RunCmd(Train("--save " + ShellQuote(dir_ / "s") + " --exit-interval 2"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::create_directories(dir_ / "elsewhere");
  const std::string relative = Base() +
                               "--global-batch-size 4 --log-interval 2 --train-iters 8 --exit-interval 4 "
                               "--data-path ../data_text_document --save ../s --load ../s";
  auto r = RunCmd("cd " + ShellQuote(dir_ / "elsewhere") + " && " + relative);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("not the ones the saved run would have read next"), std::string::npos) << r.output;
  // The checkpoint records the path as given and as resolved.
  const testing::SavedCheckpoint saved = testing::LoadTinyCheckpoint(dir_ / "s", 4);
  std::map<std::string, std::string> settings(saved.state.settings.begin(), saved.state.settings.end());
  EXPECT_EQ(settings["--data-path"], "../data_text_document");
  EXPECT_EQ(settings["--data-path (resolved)"],
            std::filesystem::canonical(dir_.path()).string() + "/data_text_document");
  // Other files (a copy) are other data: the warning stays.
  for (const char* ext : {".bin", ".idx"})
    std::filesystem::copy_file(prefix_ + ext, dir_ / ("elsewhere/copy_text_document" + std::string(ext)));
  auto copy =
      RunCmd("cd " + ShellQuote(dir_ / "elsewhere") + " && " + Base() +
             "--global-batch-size 4 --log-interval 2 --train-iters 8 --exit-interval 6 --data-path copy_text_document "
             "--save ../s --load ../s");
  ASSERT_EQ(copy.exit_code, 0) << copy.output;
  EXPECT_NE(copy.output.find("not the ones the saved run would have read next"), std::string::npos) << copy.output;
}

// A run says what it is doing before its first log line: a line per start-up stage with its time.
// As megatron-core 0.16's training_log, the first iteration prints its log line whatever
// --log-interval is (before, a run with --train-iters below --log-interval printed none, and its
// start-up line said so); the lines after it come at multiples of --log-interval.
TEST_F(MegatronFlags, StartUpStagesArePrintedWithTheirTimes) {
  auto r = RunCmd(Train("--log-interval 100"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* stage :
       {"start-up: model built and initialised (", "start-up: building the datasets", "start-up: datasets ready (",
        "start-up: iteration 1 running (its log line comes after it) ...", "start-up: iteration 1 done ("})
    EXPECT_NE(r.output.find(stage), std::string::npos) << stage << "\n" << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(start-up: datasets ready \([0-9]+\.[0-9] s\))"))) << r.output;
  EXPECT_EQ(Matches(r.output, R"(iteration +(\d+)/ +8 \| consumed samples)"), std::vector<std::string>{"1"})
      << r.output;
  auto logged = RunCmd(Train("--log-interval 4"));
  ASSERT_EQ(logged.exit_code, 0) << logged.output;
  EXPECT_EQ(Matches(logged.output, R"(iteration +(\d+)/ +8 \| consumed samples)"),
            (std::vector<std::string>{"1", "4", "8"}))
      << logged.output;
}

// The flags of Megatron's own examples/gpt3/train_gpt3_175b_distributed.sh and of the tutorials'
// pretrain_gpt.py lines (/work/shared/reference/seed-pipelines.md: Azure's, AWS's, Neuron's), each added to
// a tiny run of its own: taken, taken with a note, or refused with the reason (never "unknown
// flag"). The model's sizes are the tests' tiny ones; every other value is the script's.
// --mid-level-dataset-surplus reaches the blend's builder: each dataset of a 0.5/0.5 blend of 8 training
// samples is built for Megatron's ceil(ceil(8 x 0.5) x (1 + surplus)) samples, 5 by default and 8 at 1 (its
// GPTDataset's cached description records them).
TEST_F(MegatronFlags, MidLevelDatasetSurplusSizesTheBlendsDatasets) {
  for (const auto& [surplus, built] : std::vector<std::pair<std::string, int>>{{"", 5}, {"1", 8}}) {
    const auto cache = dir_ / ("surplus" + surplus);
    auto r = RunCmd(testing::Tool("ptk-train") +
                    " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --lr 1e-3"
                    " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --eval-iters 0 --split 98,2,0"
                    " --threads 2 --device cpu --data-path 0.5 " +
                    ShellQuote(prefix_) + " 0.5 " + ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(cache) +
                    (surplus.empty() ? "" : " --mid-level-dataset-surplus " + surplus));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::vector<std::string> counts;
    for (const auto& e : std::filesystem::directory_iterator(cache))
      if (e.path().filename().string().find("-GPTDataset-train-description.txt") != std::string::npos)
        for (const std::string& n : Matches(testing::ReadFile(e.path()), "\"num_samples\": ([0-9]+)"))
          counts.push_back(n);
    EXPECT_EQ(counts, std::vector<std::string>{std::to_string(built)}) << "surplus " << surplus;
  }
}

// --encoder-seq-length N is Megatron's other name for --seq-length N (validate_args): the same run, the same
// losses; with --seq-length too it is refused, and without either --seq-length is still required.
TEST_F(MegatronFlags, EncoderSeqLengthIsSeqLength) {
  const std::string run = testing::Tool("ptk-train") +
                          " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --lr 1e-3 --micro-batch-size 1"
                          " --global-batch-size 2 --train-iters 3 --log-interval 1 --eval-iters 0 --split 98,2,0"
                          " --threads 2 --device cpu --data-cache-path " +
                          ShellQuote(dir_ / "cache") + " --data-path " + ShellQuote(prefix_);
  auto seq = RunCmd(run + " --seq-length 16");
  auto enc = RunCmd(run + " --encoder-seq-length 16");
  ASSERT_EQ(seq.exit_code, 0) << seq.output;
  ASSERT_EQ(enc.exit_code, 0) << enc.output;
  const auto losses = Matches(seq.output, "lm loss: ([0-9.E+-]+)");
  EXPECT_EQ(losses.size(), 3u) << seq.output;
  EXPECT_EQ(Matches(enc.output, "lm loss: ([0-9.E+-]+)"), losses) << enc.output;
  const auto footprint = Matches(seq.output, "(Theoretical memory footprints: [^\\n]*)");
  EXPECT_EQ(footprint.size(), 1u) << seq.output;
  EXPECT_EQ(Matches(enc.output, "(Theoretical memory footprints: [^\\n]*)"), footprint) << enc.output;
  auto both = RunCmd(run + " --seq-length 16 --encoder-seq-length 16");
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("--seq-length and --encoder-seq-length: give one"), std::string::npos) << both.output;
  auto neither = RunCmd(run);
  EXPECT_EQ(neither.exit_code, 2) << neither.output;
  EXPECT_NE(neither.output.find("--seq-length is required"), std::string::npos) << neither.output;
}

TEST_F(MegatronFlags, MegatronScriptFlagsAreTakenNotedOrRefused) {
  enum Outcome { kTaken, kNoted, kRefused };
  struct Case {
    std::string flags;
    Outcome outcome;
    std::string says;           // in the note or the refusal
    bool own_data = false;      // the case gives the data paths itself
    bool sample_based = false;  // the case gives --train-samples itself
  };
  const std::string P = ShellQuote(prefix_), ckpt = ShellQuote(dir_ / "ckpt"), tb = ShellQuote(dir_ / "tb");
  const std::string vocab = ShellQuote(testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json"),
                    merges = ShellQuote(testing::SourceDir() + "/tokenizer/data/gpt2-merges.txt");
  testing::WriteFile(dir_ / "data-args.txt", "1.0 " + prefix_ + "\n");
  // Megatron's --per-dataset-sequences-path file: {prefix: [sequences, document indices]}, right and wrong.
  const std::string seqs = dir_ / "seqs.json", bad_seqs = dir_ / "bad-seqs.json";
  testing::WriteFile(seqs, "{\"" + prefix_ + "\": [400, 401]}");
  testing::WriteFile(bad_seqs, "{\"" + prefix_ + "\": [400, 400]}");
  const std::vector<Case> cases = {
      // examples/gpt3/train_gpt3_175b_distributed.sh: GPT_MODEL_ARGS (sizes tiny)
      {"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32", kTaken,
       ""},
      {"--attention-backend auto", kNoted, "--attention-backend auto: accepted, attention runs through ptk's BLAS"},
      // TRAINING_ARGS (--global-batch-size 1536 made 4)
      {"--micro-batch-size 1 --global-batch-size 4", kTaken, ""},
      // The script ramps with --train-iters, which Megatron's validate_args refuses too.
      {"--rampup-batch-size 16 16 5859375", kRefused, "a batch-size ramp needs sample-based training"},
      {"--train-iters 2", kTaken, ""},
      {"--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0", kTaken, ""},
      {"--fp16", kRefused, "--fp16: the CPU backend trains in fp32"},
      // Megatron's dynamic loss scaling flags without --fp16 were taken without a word (only --loss-scale was noted).
      {"--loss-scale 1024 --initial-loss-scale 65536 --hysteresis 3", kNoted,
       "--loss-scale, --initial-loss-scale, --hysteresis: accepted, loss scaling applies to --fp16 only"},
      {"--min-loss-scale 2 --loss-scale-window 500", kNoted,
       "--min-loss-scale, --loss-scale-window: accepted, loss scaling applies to --fp16 only"},
      {"--lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000", kTaken,
       ""},
      // MODEL_PARALLEL_ARGS
      {"--tensor-model-parallel-size 8", kRefused,
       "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"},
      {"--pipeline-model-parallel-size 16", kRefused, "is not divisible by --pipeline-model-parallel-size 16"},
      // DATA_ARGS
      {"--data-path " + P + " --vocab-file " + vocab + " --merge-file " + merges + " --split 949,50,1", kTaken, "",
       true},
      // EVAL_AND_LOGGING_ARGS
      {"--log-interval 100 --eval-interval 1000 --save " + ckpt + " --load " + ckpt + " --tensorboard-dir " + tb,
       kTaken, ""},
      {"--save-interval 10000", kNoted, "--save-interval 10000 without --save: nothing is saved"},
      // Likewise for TensorBoard's and --load's flags (were taken without a word).
      {"--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard", kNoted,
       "--log-validation-ppl-to-tensorboard, --log-timers-to-tensorboard without --tensorboard-dir: nothing is "
       "written to TensorBoard"},
      {"--no-load-optim --no-load-rng --exit-on-missing-checkpoint", kNoted,
       "--no-load-optim, --no-load-rng, --exit-on-missing-checkpoint without --load: nothing is loaded"},
      {"--eval-iters 10", kTaken, ""},  // (with 949,50,1 the tiny data's test split is empty: refused)
      // The Azure tutorial's (seed-pipelines.md)
      {"--sequence-parallel", kNoted, "--sequence-parallel: accepted"},
      {"--use-distributed-optimizer", kNoted, "--use-distributed-optimizer: accepted"},
      {"--data-cache-path " + ShellQuote(dir_ / "cache2"), kTaken, ""},
      {"--train-data-path 1.0 " + P + " --valid-data-path 1.0 " + P + " --test-data-path 1.0 " + P, kTaken, "", true},
      {"--ckpt-format torch_dist", kNoted, "--ckpt-format torch_dist: accepted"},
      {"--ckpt-fully-parallel-load", kNoted, "--ckpt-fully-parallel-load: accepted"},
      {"--use-persistent-ckpt-worker", kNoted, "--use-persistent-ckpt-worker: accepted"},
      {"--ckpt-assume-constant-structure", kNoted, "--ckpt-assume-constant-structure: accepted"},
      {"--use-sharp", kNoted, "--use-sharp: accepted"},
      // The AWS tutorial's (sample-based; --fp16 as above)
      {"--train-samples 8 --lr-decay-samples 8 --lr-warmup-samples 2", kTaken, "", false, true},
      {"--recompute-activations --log-interval 1 --eval-iters 40 --eval-interval 1000 --split 98,2,0", kTaken, ""},
      // The Neuron tutorial's (seed-pipelines.md section 4, its examples/pretrain_gpt3_6.7B_32layers_bf16.sh;
      // --tensor-model-parallel-size 8 as above): --distributed-backend xla was refused suggesting gloo, and
      // --no-contiguous-buffers-in-local-ddp and --save-xser were unknown flags.
      {"--lr-decay-iters 320000 --vocab-file " + vocab + " --merge-file " + merges +
           " --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1"
           " --lr-warmup-fraction .01 --log-interval 1 --tensorboard-log-interval 1 --attention-dropout 0"
           " --hidden-dropout 0",
       kTaken, ""},
      {"--data-impl mmap", kNoted, "--data-impl mmap: accepted"},
      {"--split 100,0,0 --eval-interval 2 --eval-iters 1000", kRefused,
       "--eval-iters 1000: the run has no validation data (--split 100,0,0 gives it no part)"},
      {"--distributed-backend xla", kRefused, "xla (AWS Neuron's torch-xla, Trainium) is not implemented"},
      {"--no-masked-softmax-fusion --no-bias-dropout-fusion --no-async-tensor-model-parallel-allreduce", kNoted,
       "--no-masked-softmax-fusion: accepted"},
      {"--no-contiguous-buffers-in-local-ddp", kNoted,
       "--no-contiguous-buffers-in-local-ddp: accepted, the gradients are reduced from ptk's own buffers"},
      {"--save-xser " + ckpt + " --save-interval 2000", kRefused,
       "--save-xser " + (dir_ / "ckpt") +
           ": Neuron's torch-xla serialized checkpoints are not written; give --save DIR"},
      {"--load-xser " + ckpt, kRefused, "Neuron's torch-xla serialized checkpoints are not read"},
      {"--use-cpu-initialization", kNoted, "--use-cpu-initialization: accepted"},
      // Megatron's checkpoint-content flags were unknown, suggesting the opposite end ("did you mean
      // --no-load-optim?").
      {"--no-save-optim", kRefused, "--no-save-optim: the optimizer state is always saved"},
      {"--no-save-rng", kRefused, "--no-save-rng: the random state is always saved"},
      // Megatron's examples/llama scripts' speed, memory and logging flags (were unknown flags).
      {"--no-create-attention-mask-in-dataloader --no-mmap-bin-files --no-bias-swiglu-fusion --manual-gc "
       "--manual-gc-interval 100 --num-dataset-builder-threads 2 --log-progress",
       kNoted, "--no-create-attention-mask-in-dataloader: accepted"},
      // Megatron's full recomputation, as its scripts write it: --recompute-method was an unknown flag.
      {"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", kNoted,
       "--recompute-method uniform: accepted, ptk recomputes the attention probabilities (selective)"},
      // Megatron's flags a full pretrain_gpt.py line carries beside them
      {"--log-params-norm --log-num-zeros-in-grad", kTaken, ""},
      {"--profile", kNoted, "--profile: accepted, the CPU backend has no profiler"},
      {"--data-args-path " + ShellQuote(dir_ / "data-args.txt"), kTaken, "", true},
      {"--train-samples 48 --rampup-batch-size 4 4 16 --global-batch-size 8 --micro-batch-size 2", kTaken, "", false,
       true},
      // Megatron's GELU MLP is the tanh GELU only through its fused bias-GELU kernel: without it (the flag, or no
      // biases, which turn the fusion off) it computes torch's exact erf GELU, as ptk does then (were refused).
      {"--no-bias-gelu-fusion", kNoted, "--no-bias-gelu-fusion: accepted, the GELU MLP computes the exact erf GELU"},
      {"--disable-bias-linear", kTaken, ""},
      {"--swiglu --disable-bias-linear --no-bias-gelu-fusion", kNoted, "--no-bias-gelu-fusion: accepted"},
      {"--squared-relu --disable-bias-linear", kTaken, ""},
      {"--squared-relu --no-bias-gelu-fusion", kNoted, "--no-bias-gelu-fusion: accepted"},
      // Megatron flags that were bare unknown flags (megatron_flag_list_test now covers all of pretrain_gpt.py's),
      // some suggesting an unrelated flag: refused naming what is missing, or noted where nothing changes.
      {"--fp32-residual-connection", kRefused,
       "--fp32-residual-connection: a choice of precision for the residual connections is not implemented"},
      {"--log-straggler", kNoted, "--log-straggler: accepted, this log or monitor is not kept here"},
      {"--use-torch-fsdp2", kRefused, "--use-torch-fsdp2: FSDP is not implemented"},
      {"--non-persistent-save-interval 100", kRefused,
       "--non-persistent-save-interval 100 needs --non-persistent-ckpt-type global"},
      {"--non-persistent-ckpt-type local", kRefused, "need NVIDIA's resiliency extension (nvidia_resiliency_ext)"},
      {"--non-persistent-ckpt-type global --non-persistent-local-ckpt-algo atomic", kNoted,
       "--non-persistent-local-ckpt-algo atomic: accepted, no effect"},
      {"--save-retain-interval 100", kRefused, "--save-retain-interval 100 without --save"},
      {"--use-precision-aware-optimizer", kRefused,
       "--use-precision-aware-optimizer: TransformerEngine's precision-aware optimizer is not implemented"},
      {"--hierarchical-context-parallel-sizes 2 2", kRefused,
       "--hierarchical-context-parallel-sizes 2 2: this parallelism is not implemented"},
      {"--profile-ranks 0 1 --disable-jit-fuser", kNoted, "--profile-ranks 0 1: accepted"},
      // Classified from Megatron 0.16.1's code: noted where ptk's result cannot change, refused by value otherwise.
      {"--test-mode", kNoted, "--test-mode: accepted, this check is not run here"},
      {"--te-rng-tracker", kNoted, "--te-rng-tracker: accepted, dropout masks are ptk's own function of --seed"},
      {"--per-dataset-sequences-path " + seqs, kNoted,
       "--per-dataset-sequences-path " + seqs + ": accepted, its counts are each .idx header's, which ptk reads"},
      {"--per-dataset-sequences-path " + bad_seqs, kRefused,
       " is [400, 400] there (uint16 tokens by the vocabulary), its .idx has 400 sequences, 401 document indices"},
      {"--mock-data --per-dataset-sequences-path " + bad_seqs, kNoted,
       "--per-dataset-sequences-path " + bad_seqs + ": accepted, not read with --mock-data (as Megatron)", true},
      {"--exit-signal SIGHUP", kNoted, "--exit-signal SIGHUP: accepted, no effect without --exit-signal-handler"},
      {"--exit-signal-handler --exit-signal SIGUSR1", kNoted,
       "--exit-signal SIGUSR1: accepted, --exit-signal-handler saves on SIGTERM, SIGUSR1 and SIGINT"},
      {"--exit-signal-handler --exit-signal SIGHUP", kRefused,
       "--exit-signal SIGHUP: ptk's --exit-signal-handler saves on SIGTERM, SIGUSR1 and SIGINT only"},
      {"--exit-signal TERM", kRefused, "--exit-signal TERM: not a signal name"},
      {"--disable-bf16-reduced-precision-matmul", kNoted,
       "--disable-bf16-reduced-precision-matmul: accepted, no effect without --bf16 (as Megatron)"},
      // With --bf16 the CUDA products' split-K sums stay in fp32 (cuda_gemm_plan_test, matmul_reduction_cuda_test):
      // taken by a --dry-run of a bf16 run (no "no effect" note), as by a run on a GPU.
      {"--dry-run --bf16 --disable-bf16-reduced-precision-matmul", kTaken, ""},
      // Megatron's other spellings of flags ptk has
      {"--persistent-save-interval 10000", kNoted, "--save-interval 10000 without --save: nothing is saved"},
  };
  const std::string tiny = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --lr 1e-3"
                           " --micro-batch-size 1 --global-batch-size 4 --eval-iters 0 --split 98,2,0 --threads 2"
                           " --device cpu --data-cache-path " +
                           ShellQuote(dir_ / "cache") + " ";
  std::string table;
  for (const Case& c : cases) {
    std::string cmd =
        tiny + (c.sample_based ? "" : "--train-iters 2 ") + (c.own_data ? "" : "--data-path " + P + " ") + c.flags;
    auto r = RunCmd(cmd);
    const bool noted = r.output.find("note: ") != std::string::npos;
    EXPECT_EQ(r.output.find("unknown flag"), std::string::npos) << c.flags << "\n" << r.output;
    switch (c.outcome) {
      case kTaken:
        EXPECT_EQ(r.exit_code, 0) << c.flags << "\n" << r.output;
        EXPECT_FALSE(noted) << c.flags << "\n" << r.output;
        break;
      case kNoted:
        EXPECT_EQ(r.exit_code, 0) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find("note: " + c.says), std::string::npos) << c.flags << "\n" << r.output;
        break;
      case kRefused:
        EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
        EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
        break;
    }
    table += fmt::format("{:<8} {}{}\n",
                         c.outcome == kTaken   ? "taken"
                         : c.outcome == kNoted ? "noted"
                                               : "refused",
                         c.flags.substr(0, 90), c.says.empty() ? "" : "  -> " + c.says);
  }
  std::cout << table;
}

}  // namespace
}  // namespace ptk
