// ptk-train refusing what cannot work before it starts, in one line, and what it must still get
// right: the memory a run needs printed before anything is allocated (Megatron's "Theoretical memory
// footprints" line) and a run that cannot fit refused with both figures, the ranks on one node
// counted together; an index cache that
// cannot be written (the run is the same); half a dataset; --eval-iters with no validation split;
// --save below a file; --load of another model's checkpoint; a resume whose training or validation
// split cannot hold what it reads; SIGTERM during a checkpoint write.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/system_memory.h"
#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

class TrainRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 200, testing::kSmallVocabEod));
  }
  std::string Train(const std::string& extra, int64_t iters = 4) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --split 98,2,0 --eval-interval 2 --eval-iters 1 --log-interval 1"
           " --threads 2 --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  // Train(extra) without its --eval-iters 1: Megatron's default --eval-iters (100), the flag not given.
  std::string TrainWithDefaultEvalIters(const std::string& extra) {
    const std::string given = " --eval-iters 1";
    std::string cmd = Train(extra);
    cmd.erase(cmd.find(given), given.size());
    return cmd;
  }
  std::string Data() const { return " --data-path " + ShellQuote(prefix_); }
  // The dataset's `ext` file (".idx", ".bin") with 4 bytes appended trains through its validation, warning
  // once: "ptk-train: warning: FILE: 4 trailing bytes at offset SIZE" (its size before) followed by `rest`.
  void TrainsWithOneTrailingBytesWarning(const std::string& ext, const std::string& rest) {
    const std::string path = prefix_ + ext, before = testing::ReadFile(path);
    testing::WriteFile(path, before + "junk");
    auto r = RunCmd(Train(Data() + " --data-cache-path " + ShellQuote(dir_ / "cache")));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const std::string warning =
        "ptk-train: warning: " + path + ": 4 trailing bytes at offset " + std::to_string(before.size()) + rest;
    const size_t at = r.output.find(warning);
    EXPECT_NE(at, std::string::npos) << r.output;
    EXPECT_EQ(r.output.find(warning, at + 1), std::string::npos) << "warned more than once: " << r.output;
    EXPECT_NE(r.output.find("validation loss at iteration 2"), std::string::npos) << r.output;
  }
  // The lines of `out` that start with "ptk-train: error:" or "ptk-train: usage error:".
  static std::vector<std::string> Errors(const std::string& out) {
    std::vector<std::string> v;
    for (size_t at = 0; at < out.size();) {
      const size_t end = std::min(out.find('\n', at), out.size());
      const std::string line = out.substr(at, end - at);
      if (line.rfind("ptk-train: error:", 0) == 0 || line.rfind("ptk-train: usage error:", 0) == 0) v.push_back(line);
      at = end + 1;
    }
    return v;
  }
  TempDir dir_;
  std::string prefix_;
};

// Every run says what it needs, as Megatron's line, before the model is made.
TEST_F(TrainRefusals, TheMemoryARunNeedsIsPrintedBeforeItStarts) {
  auto r = RunCmd(Train(Data()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t line = r.output.find("Theoretical memory footprints: weight and optimizer=");
  ASSERT_NE(line, std::string::npos) << r.output;
  EXPECT_LT(line, r.output.find("start-up: model built")) << r.output;
  EXPECT_NE(r.output.find(" MB, activation=", line), std::string::npos);
}

// A model of 750 TiB: refused before anything is allocated (it died in std::bad_alloc, after
// minutes of allocating on a machine with overcommit, or at the OOM killer), and under ulimit -v a
// run that needs 2.2 GiB, with the limit named (one BLAS thread: OpenBLAS reserves address space per
// core when it loads).
TEST_F(TrainRefusals, ARunThatCannotFitIsRefusedWithWhatItNeedsAndWhatIsAvailable) {
  auto huge = RunCmd(testing::Tool("ptk-train") +
                     " --num-layers 1000 --hidden-size 65536 --num-attention-heads 64 --seq-length 1024 --lr 1e-3"
                     " --train-iters 1 --micro-batch-size 1 --mock-data --threads 2");
  EXPECT_EQ(huge.exit_code, 1) << huge.output;
  ASSERT_EQ(Errors(huge.output).size(), 1u) << huge.output;
  EXPECT_EQ(Errors(huge.output)[0].rfind("ptk-train: error: not enough memory: this rank needs 754.2 TiB (", 0), 0u)
      << huge.output;
  // Attention's work buffers, 2 x 1024^2 floats on each of --threads 2 (they went uncounted).
  EXPECT_NE(Errors(huge.output)[0].find("; 16.0 MiB for attention's work buffers while it runs (2 threads))"),
            std::string::npos)
      << huge.output;
  EXPECT_NE(huge.output.find(" is available ("), std::string::npos) << huge.output;
  EXPECT_EQ(huge.output.find("start-up: model built"), std::string::npos) << huge.output;
  auto limited =
      RunCmd("bash -c " + ShellQuote("ulimit -v 1500000; OPENBLAS_NUM_THREADS=1 " + testing::Tool("ptk-train") +
                                     " --num-layers 4 --hidden-size 1024 --num-attention-heads 16"
                                     " --seq-length 512 --lr 1e-3 --train-iters 1 --micro-batch-size 2"
                                     " --mock-data --threads 1"));
  EXPECT_EQ(limited.exit_code, 1) << limited.output;
  ASSERT_EQ(Errors(limited.output).size(), 1u) << limited.output;
  EXPECT_NE(Errors(limited.output)[0].find("this rank needs 2.1 GiB ("), std::string::npos) << limited.output;
  EXPECT_NE(Errors(limited.output)[0].find(" is available (ulimit -v 1500000 KiB less this process's "),
            std::string::npos)
      << limited.output;
}

// Ranks on one machine share its memory (they were each checked alone, and together could end at
// the OOM killer): two torchrun ranks (LOCAL_WORLD_SIZE=2) of a model about 0.7 of what this machine
// leaves, which one rank would hold, are both refused naming the node's total.
TEST_F(TrainRefusals, RanksSharingANodeThatTogetherCannotFitAreRefused) {
  const AvailableMemory available = ReadAvailableMemory();
  if (available.shared_bytes < 0) GTEST_SKIP() << "no /proc/meminfo to check against";
  // Hidden size 1024, 16 bytes a parameter: 12 h^2 a layer, GPT-2's padded vocabulary's embedding.
  const double layer = 16.0 * 12 * 1024 * 1024, embedding = 16.0 * 50304 * 1024;
  const double target = 0.7 * static_cast<double>(available.shared_bytes) - embedding;
  if (target < 2 * layer) GTEST_SKIP() << "too little memory here for a model one rank holds and two do not";
  const int layers = static_cast<int>(target / layer);
  const std::string rank = testing::Tool("ptk-train") + " --num-layers " + std::to_string(layers) +
                           " --hidden-size 1024 --num-attention-heads 16 --seq-length 128 --lr 1e-3 --train-iters 1"
                           " --micro-batch-size 1 --mock-data --threads 1";
  auto r = RunCmd("bash -c " + ShellQuote("export WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                          std::to_string(testing::FreeTestPort()) + "; RANK=1 " + rank + " > " +
                                          ShellQuote(dir_ / "r1.log") + " 2>&1 & RANK=0 " + rank +
                                          "; rc=$?; wait $!; echo rc0=$rc rc1=$?"));
  const std::string r1 = testing::ReadFile(dir_ / "r1.log");
  EXPECT_NE(r.output.find("rc0=1 rc1=1"), std::string::npos) << r.output << r1;
  // One rank's need, from Megatron's line, is less than what is available: alone it would run.
  const size_t total = r.output.find(", total=");
  ASSERT_NE(total, std::string::npos) << r.output;
  EXPECT_LT(std::strtod(r.output.c_str() + total + 8, nullptr) * 1024 * 1024,
            static_cast<double>(available.shared_bytes))
      << r.output;
  for (const std::string& out : {r.output, r1}) {
    ASSERT_EQ(Errors(out).size(), 1u) << out;
    EXPECT_EQ(Errors(out)[0].rfind(
                  "ptk-train: error: not enough memory on this node: its 2 ranks (LOCAL_WORLD_SIZE) need ", 0),
              0u)
        << out;
    EXPECT_NE(Errors(out)[0].find("start fewer ranks on each node"), std::string::npos) << out;
    EXPECT_EQ(out.find("start-up: model built"), std::string::npos) << out;
  }
}

// --data-cache-path where no directory can be made: the run is the same as with a cache (its indices
// built in memory), and one warning names the path and what follows (it said "continuing without
// it" once per split, naming neither).
TEST_F(TrainRefusals, AnUnwritableIndexCacheWarnsOnceAndTheRunIsTheSame) {
  testing::WriteFile(dir_ / "afile", "x");
  auto cached = RunCmd(Train(Data() + " --data-cache-path " + ShellQuote(dir_ / "cache")));
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  auto r = RunCmd(Train(Data() + " --data-cache-path " + ShellQuote(dir_ / "afile/cache")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(r.output), testing::LogLinesWithoutTimes(cached.output));
  EXPECT_EQ(testing::LogLinesWithoutTimes(r.output).size(), 4u);
  const std::string warning = "ptk-train: warning: --data-cache-path " + dir_ / "afile/cache" +
                              ": cannot save the GPTDataset index cache there (";
  const size_t at = r.output.find(warning);
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(warning, at + 1), std::string::npos) << "warned more than once: " << r.output;
  EXPECT_NE(r.output.find("the run is unaffected (its indices are built in memory, the same), but every run will "
                          "build them again: give --data-cache-path a directory this process can write",
                          at),
            std::string::npos)
      << r.output;
}

// Megatron's --exit-on-missing-checkpoint (ptk-train refused it as an unknown flag): a --load with no checkpoint,
// missing or empty, stops in one line naming it, exit 1 (Megatron's sys.exit() exits 0: it would read as a
// finished run); without the flag such a run starts anew, and with a checkpoint there the flag changes nothing.
TEST_F(TrainRefusals, ExitOnMissingCheckpointStopsInsteadOfStartingAnew) {
  std::filesystem::create_directories(dir_ / "empty");
  for (const std::string& load : {dir_ / "nothing", dir_ / "empty"}) {
    auto r = RunCmd(Train(Data() + " --exit-on-missing-checkpoint --load " + ShellQuote(load)));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
    EXPECT_EQ(Errors(r.output)[0],
              "ptk-train: error: --load " + load +
                  ": no checkpoint (no latest_checkpointed_iteration.txt); --exit-on-missing-checkpoint: stopping "
                  "instead of starting from random initialization")
        << r.output;
    EXPECT_EQ(r.output.find("iteration        1/"), std::string::npos) << r.output;
    auto anew = RunCmd(Train(Data() + " --load " + ShellQuote(load)));
    EXPECT_EQ(anew.exit_code, 0) << anew.output;
    EXPECT_NE(anew.output.find("starting from random initialization"), std::string::npos) << anew.output;
  }
  // A tracker naming an iteration that is not there (a directory copied without it) is no new run: one line, exit 1.
  testing::WriteFile(dir_ / "empty/latest_checkpointed_iteration.txt", "7");
  for (const std::string flag : {"", " --exit-on-missing-checkpoint"}) {
    auto r = RunCmd(Train(Data() + flag + " --load " + ShellQuote(dir_ / "empty")));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
    EXPECT_EQ(Errors(r.output)[0],
              "ptk-train: error: " + CheckpointFile(dir_ / "empty", 7) + ": missing (the tracker names iteration 7)");
  }
  const std::string ck = ShellQuote(dir_ / "ck");
  ASSERT_EQ(RunCmd(Train(Data() + " --save " + ck, 2)).exit_code, 0);
  auto r = RunCmd(Train(Data() + " --exit-on-missing-checkpoint --override-opt_param-scheduler --load " + ck));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("at iteration 2"), std::string::npos) << r.output;
}

// Megatron's --pretrained-checkpoint (ptk-train refused it as an unknown flag): a fine-tuning run's first start,
// whose --load holds nothing yet, loads the pretrained checkpoint as --finetune (iteration 0, no optimizer state);
// its restart resumes from its own --load (a --finetune kept in a requeued command started anew at iteration 0
// from its own checkpoint). Neither holding one stops naming both (exit 1); a file is refused before the model.
TEST_F(TrainRefusals, PretrainedCheckpointStartsAFineTuneThatResumesFromItsOwn) {
  const std::string base = ShellQuote(dir_ / "base"), ft = ShellQuote(dir_ / "ft");
  ASSERT_EQ(RunCmd(Train(Data() + " --save " + base, 2)).exit_code, 0);
  const std::string cmd = Data() + " --pretrained-checkpoint " + base + " --load " + ft + " --save " + ft;
  auto first = RunCmd(Train(cmd, 3));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(
      first.output.find("--load " + dir_ / "ft" + " holds no checkpoint: fine-tuning from --pretrained-checkpoint " +
                        dir_ / "base" + " (its iteration 2)"),
      std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("iteration        1/       3"), std::string::npos) << first.output;
  auto again = RunCmd(Train(cmd + " --override-opt_param-scheduler", 5));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("at iteration 3 (12 samples consumed)"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("fine-tuning from"), std::string::npos) << again.output;
  EXPECT_EQ(*LatestCheckpointIteration(dir_ / "ft"), 5);
  std::filesystem::create_directories(dir_ / "empty");
  auto none = RunCmd(Train(Data() + " --pretrained-checkpoint " + ShellQuote(dir_ / "empty") + " --load " +
                           ShellQuote(dir_ / "nothing")));
  EXPECT_EQ(none.exit_code, 1) << none.output;
  ASSERT_EQ(Errors(none.output).size(), 1u) << none.output;
  EXPECT_EQ(Errors(none.output)[0],
            "ptk-train: error: no checkpoint in --load " + dir_ / "nothing" + " (" + dir_ / "nothing" +
                ": no checkpoint (no latest_checkpointed_iteration.txt)) nor in --pretrained-checkpoint " +
                dir_ / "empty" + ": no checkpoint (no latest_checkpointed_iteration.txt)");
  testing::WriteFile(dir_ / "afile", "x");
  auto file = RunCmd(Train(Data() + " --pretrained-checkpoint " + ShellQuote(dir_ / "afile")));
  EXPECT_EQ(file.exit_code, 1) << file.output;
  EXPECT_NE(file.output.find("ptk-train: error: --pretrained-checkpoint " + dir_ / "afile" + ": a file"),
            std::string::npos)
      << file.output;
  EXPECT_EQ(file.output.find("start-up: model built"), std::string::npos) << file.output;
}

// Each refused in one line before the model is made (a .bin without its .idx said "cannot open
// PREFIX.idx: No such file or directory" after it; --eval-iters with --split 100,0,0 evaluated
// nothing and exited 0; --save below a file said "afile is not a directory" after building it;
// --load of a file trained from scratch and exited 0; an empty --data-path said ": no dataset here"; --save of a
// Megatron checkpoint's directory saved ptk's beside it and moved its tracker).
TEST_F(TrainRefusals, WhatCannotWorkIsRefusedBeforeTheModelIsBuilt) {
  std::filesystem::copy_file(prefix_ + ".bin", dir_ / "half.bin");
  testing::WriteFile(dir_ / "afile", "x");
  // Megatron's checkpoint (a ptk-convert export): a save there moved the tracker Megatron reads to ptk's.
  const std::string meg = dir_ / "meg", meg_file = meg + "/iter_0000002/mp_rank_00/model_optim_rng.pt";
  std::filesystem::create_directories(meg + "/iter_0000002/mp_rank_00");
  testing::WriteFile(meg_file, "PK");
  testing::WriteFile(meg + "/latest_checkpointed_iteration.txt", "2");
  const std::pair<std::string, std::string> cases[] = {
      {" --data-path " + ShellQuote(dir_ / "half"),
       "ptk-train: error: " + dir_ / "half" + ": " + dir_ / "half.bin" + " is there but not " + dir_ / "half.idx" +
           ": a dataset is the pair of files (one copied or deleted without the other?)"},
      {" --data-path 0.5 " + ShellQuote(prefix_) + " 0.5 " + ShellQuote(dir_ / "half"),
       "ptk-train: error: " + dir_ / "half" + ": " + dir_ / "half.bin" + " is there but not"},
      {Data() + " --split 100,0,0 --eval-iters 3",
       "ptk-train: usage error: --eval-iters 3: the run has no validation data (--split 100,0,0 gives it no part), "
       "so nothing would be evaluated; give --split a validation part (e.g. 98,2,0), or --eval-iters 0"},
      {" --train-data-path " + ShellQuote(prefix_) + " --eval-iters 3",
       "ptk-train: usage error: --eval-iters 3: the run has no validation data (no --valid-data-path)"},
      {Data() + " --load " + ShellQuote(dir_ / "afile"),
       "ptk-train: error: --load " + dir_ / "afile" + ": a file, not a checkpoint directory"},
      {" --data-path ''", "ptk-train: usage error: --data-path: an empty dataset prefix (an unset shell variable?)"},
      {Data() + " --save " + ShellQuote(meg),
       "ptk-train: usage error: --save " + meg + ": holds a Megatron checkpoint (" + meg_file +
           "): a ptk-train save writes iter_N/ there and moves the latest_checkpointed_iteration.txt Megatron reads "
           "to it; give a directory of its own (convert it with ptk-convert --loader megatron --saver ptk"},
      {Data() + " --save " + ShellQuote(dir_ / "afile/ck"),
       "ptk-train: error: --save " + dir_ / "afile/ck" + ": " + dir_ / "afile" +
           " is a file, not a directory: checkpoints are directories"},
      // --tensorboard-dir a file and --metrics-file a directory said "afile is not a directory" and "open DIR: Is a
      // directory", without the flag, after the model and the datasets were built.
      {Data() + " --tensorboard-dir " + ShellQuote(dir_ / "afile"),
       "ptk-train: error: --tensorboard-dir " + dir_ / "afile" + ": " + dir_ / "afile" +
           " is a file, not a directory: TensorBoard's event files go in a directory"},
      {Data() + " --tensorboard-dir " + ShellQuote(dir_ / "afile/tb"),
       "ptk-train: error: --tensorboard-dir " + dir_ / "afile/tb" + ": " + dir_ / "afile" + " is a file"},
      {Data() + " --metrics-file " + ShellQuote(dir_.path()),
       "ptk-train: error: --metrics-file " + dir_.path() + ": a directory, not a file"},
      {Data() + " --metrics-file " + ShellQuote(dir_ / "afile/m.jsonl"),
       "ptk-train: error: --metrics-file " + dir_ / "afile/m.jsonl" + ": " + dir_ / "afile" + " is a file"},
  };
  for (const auto& [flags, says] : cases) {
    auto r = RunCmd(Train(flags));
    EXPECT_NE(r.exit_code, 0) << flags;
    ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
    EXPECT_EQ(Errors(r.output)[0].rfind(says, 0), 0u) << r.output;
    EXPECT_EQ(r.output.find("start-up: model built"), std::string::npos) << r.output;
  }
  // Megatron's default --eval-iters (100) with a split without validation: no refusal (the flag was
  // not given), and a note that nothing is evaluated (Megatron's first evaluation fails there).
  auto quiet = RunCmd(TrainWithDefaultEvalIters(Data() + " --split 100,0,0"));
  EXPECT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_NE(quiet.output.find("note: nothing is evaluated: the run has no validation data (--split 100,0,0 gives it "
                              "no part), where Megatron's first evaluation fails with its default --eval-iters 100"),
            std::string::npos)
      << quiet.output;
}

// --split 999999999999999999999,1,1 normalizes to [1.0, 1e-21, 1e-21]: the validation part is above 0,
// so the check for a split without one let it through, but the split matrix's sums lose it (1.0 +
// 1e-21 is 1.0), as Megatron's do, and the run evaluated nothing without a word. Now named as a
// split of 100,0,0 is: refused with --eval-iters given, a note with Megatron's default.
TEST_F(TrainRefusals, AValidationPartTooSmallForTheSplitMatrixIsNamed) {
  const std::string split = " --split 999999999999999999999,1,1";
  auto given = RunCmd(Train(Data() + split + " --eval-iters 3"));
  EXPECT_EQ(given.exit_code, 2) << given.output;
  ASSERT_EQ(Errors(given.output).size(), 1u) << given.output;
  EXPECT_EQ(Errors(given.output)[0],
            "ptk-train: usage error: --eval-iters 3: the run has no validation data (--split "
            "999999999999999999999,1,1 gives it 1e-21 of the data, too small beside the other parts for a double's "
            "sums: its range in the split matrix, [1.0, 1.0), is empty (Megatron's too)), so nothing would be "
            "evaluated; give --split a validation part (e.g. 98,2,0), or --eval-iters 0");
  auto noted = RunCmd(TrainWithDefaultEvalIters(Data() + split));
  EXPECT_EQ(noted.exit_code, 0) << noted.output;
  EXPECT_NE(noted.output.find("note: nothing is evaluated: the run has no validation data (--split "
                              "999999999999999999999,1,1 gives it 1e-21 of the data"),
            std::string::npos)
      << noted.output;
  EXPECT_EQ(noted.output.find("validation loss at"), std::string::npos) << noted.output;
}

// An .idx with bytes after its document index trains as Megatron's reader reads it (ptk-train
// refused it: "file is N bytes but ... need M (truncated or corrupt)"), with one warning naming it.
TEST_F(TrainRefusals, TrailingIndexBytesAreIgnoredWithAWarning) {
  TrainsWithOneTrailingBytesWarning(".idx", ", after the document index, ignored as Megatron's reader ignores them\n");
}

// A .bin with bytes after the sequences its .idx describes trains as Megatron's reader reads it
// (ptk-train refused it: "the two files are not one dataset's"), with one warning naming both files.
TEST_F(TrainRefusals, TrailingBinBytesAreIgnoredWithAWarning) {
  TrainsWithOneTrailingBytesWarning(".bin", ", after the ");
}

// --load of another model's checkpoint names the flags that differ (it printed both models' JSON).
TEST_F(TrainRefusals, ACheckpointOfAnotherModelNamesTheFlagsThatDiffer) {
  const std::string ck = ShellQuote(dir_ / "ck");
  ASSERT_EQ(RunCmd(Train(Data() + " --save " + ck, 2)).exit_code, 0);
  std::string other = Train(Data() + " --load " + ck);
  other.replace(other.find("--num-layers 2 --hidden-size 32"), 31, "--num-layers 3 --hidden-size 64");
  auto r = RunCmd(other);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
  EXPECT_NE(Errors(r.output)[0].find(": the checkpoint is of another model: --num-layers 2 (this run: 3), "
                                     "--hidden-size 32 (this run: 64), --ffn-hidden-size 128 (this run: 256); give"),
            std::string::npos)
      << r.output;
  EXPECT_NE(Errors(r.output)[0].find("; give the saved run's model flags, or --use-checkpoint-args"),
            std::string::npos);
}

// A resume that evaluates less often than the saved run did: this command line sizes the validation
// split for its own evaluations (Megatron's (train_iters // eval_interval + 1) x eval_iters x gbs),
// smaller than the samples the checkpoint has consumed and the evaluations still to come. It trained
// to the end and died at the last evaluation ("the evaluation data ran out", exit 1; Megatron's
// sampler refuses at its start); it is refused before any iteration, naming both runs' needs.
TEST_F(TrainRefusals, AResumeWhoseValidationSplitCannotHoldItsEvaluationsIsRefused) {
  const std::string ck = ShellQuote(dir_ / "ck");
  auto saved = RunCmd(Train(Data() + " --eval-interval 1 --exit-interval 6 --save " + ck, 8));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  auto r = RunCmd(Train(Data() + " --eval-interval 100 --load " + ck + " --save " + ck, 8));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
  EXPECT_NE(Errors(r.output)[0].find("the checkpoint of iteration 6 has consumed 24 validation samples, and this "
                                     "run's 1 evaluation(s) (--eval-interval 100 up to iteration 8 and the one at "
                                     "the end, --eval-iters 1 of 4 samples) need 4 more, but the validation split "
                                     "holds "),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(testing::LossesOf(r.output).empty()) << r.output;
  // The saved run's evaluations fit: it resumes.
  auto same = RunCmd(Train(Data() + " --eval-interval 1 --load " + ck + " --save " + ck, 8));
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(testing::LossesOf(same.output).size(), 2u) << same.output;
}

// A resume with a smaller --global-batch-size on a blend: the blend holds exactly this command line's
// --train-iters x --global-batch-size samples, fewer than the checkpoint consumed plus the iterations
// to come. It failed at the iteration that ran out ("the training data ran out before --train-iters",
// exit 1, with no numbers), after training up to there; it is refused before any iteration.
TEST_F(TrainRefusals, AResumeWhoseTrainingSplitRunsOutIsRefused) {
  const std::string ck = ShellQuote(dir_ / "ck"),
                    blend = " --eval-iters 0 --data-path 0.5 " + ShellQuote(prefix_) + " 0.5 " + ShellQuote(prefix_);
  auto saved = RunCmd(Train(blend + " --global-batch-size 8 --exit-interval 2 --save " + ck, 4));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  auto r = RunCmd(Train(blend + " --use-checkpoint-opt_param-scheduler --load " + ck + " --save " + ck, 4));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
  EXPECT_NE(Errors(r.output)[0].find("the checkpoint of iteration 2 has consumed 16 training samples, and this run's "
                                     "iterations to 4 take 8 more, but the training split holds 16 ("),
            std::string::npos)
      << r.output;
  EXPECT_NE(Errors(r.output)[0].find("it would run out at iteration 3"), std::string::npos) << r.output;
  EXPECT_TRUE(testing::LossesOf(r.output).empty()) << r.output;
  auto same = RunCmd(Train(blend + " --global-batch-size 8 --load " + ck + " --save " + ck, 4));
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(testing::LossesOf(same.output).size(), 2u) << same.output;
}

// SIGTERM the moment a checkpoint is being written (its temporary directory polled for by a shell
// builtin) after a first one was saved, with and without --exit-signal-handler: the previous
// checkpoint (with the handler, the one being written) loads, and nothing half-written is left.
TEST_F(TrainRefusals, SigtermDuringACheckpointWriteLeavesTheLastOneLoadable) {
  for (const std::string handler : {"", " --exit-signal-handler"}) {
    const std::string save = dir_ / ("s" + std::to_string(handler.size()));
    const std::string run =
        Train(Data() + " --eval-iters 0 --save-interval 1 --save " + ShellQuote(save) + handler, 100000);
    const std::string script =
        run + " >/dev/null 2>&1 & pid=$!; end=$((SECONDS + 60)); until [ -f " +
        ShellQuote(save + "/latest_checkpointed_iteration.txt") +
        " ] || [ $SECONDS -ge $end ]; do :; done; until compgen -G " + ShellQuote(save + "/*.ptk-tmp*") +
        " >/dev/null || [ $SECONDS -ge $end ]; do :; done; kill -TERM $pid; wait $pid; echo rc=$?";
    auto r = RunCmd("bash -c " + ShellQuote(script));
    EXPECT_NE(r.output.find(handler.empty() ? "rc=143" : "rc=0"), std::string::npos) << handler << r.output;
    auto it = LatestCheckpointIteration(save);
    ASSERT_TRUE(it.ok()) << it.status();
    auto next = RunCmd(Train(Data() + " --eval-iters 0 --use-checkpoint-opt_param-scheduler --save " +
                                 ShellQuote(save) + " --load " + ShellQuote(save),
                             *it + 1));
    EXPECT_EQ(next.exit_code, 0) << next.output;
    const auto losses = testing::LossesOf(next.output);
    ASSERT_EQ(losses.size(), 1u) << next.output;
    EXPECT_EQ(losses[0].first, *it + 1);
    EXPECT_EQ(testing::Leftovers(save), "");
  }
}

// A Megatron checkpoint without optimizer state (saved with --no-save-optim): Megatron's
// load_checkpoint refuses it unless --no-load-optim or --finetune. ptk-convert's import of it gave zero
// moments and ptk-train resumed on them (exit 0, the import's note the only sign); it is refused in one
// line naming the flags (exit 2), and either flag loads it. A release checkpoint (the tracker says
// "release") Megatron loads at iteration 0 without optimizer state or scheduler and without those flags;
// the import took the iteration its file stores (2), so --load went on from there.
TEST_F(TrainRefusals, AnImportWithoutOptimizerStateNeedsNoLoadOptimAndAReleaseStartsAtZero) {
  auto layout = ParamLayout::Create(testing::TinyModel(1000, 1024));
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> p(static_cast<size_t>(layout->num_params)), zero(p.size(), 0.0f);
  layout->InitWeights(3, p);
  TrainState st;  // no AdamW step: the export writes no optimizer state
  st.iteration = 2;
  st.consumed_train_samples = 8;
  st.settings = {{"--vocab-size", "1000"}};
  ASSERT_TRUE(SaveCheckpoint(dir_ / "ck", *layout, p, zero, zero, st, "").ok());
  const std::string convert = testing::Tool("ptk-convert") + " --model-type GPT ";
  auto to_megatron = [&](const std::string& from, const std::string& to) {
    return RunCmd(convert + "--loader ptk --saver megatron --load-dir " + ShellQuote(dir_ / from) + " --save-dir " +
                  ShellQuote(dir_ / to));
  };
  auto to_ptk = [&](const std::string& from, const std::string& to) {
    return RunCmd(convert + "--loader megatron --saver ptk --load-dir " + ShellQuote(dir_ / from) + " --save-dir " +
                  ShellQuote(dir_ / to));
  };
  auto ex = to_megatron("ck", "meg");
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  auto im = to_ptk("meg", "imp");
  ASSERT_EQ(im.exit_code, 0) << im.output;
  EXPECT_NE(im.output.find("takes it only with --no-load-optim or --finetune"), std::string::npos) << im.output;
  EXPECT_NE(im.output.find(" --no-load-optim --load "), std::string::npos) << im.output;  // the command it prints
  const std::string imp = ShellQuote(dir_ / "imp");
  auto r = RunCmd(Train(Data() + " --load " + imp));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_EQ(Errors(r.output).size(), 1u) << r.output;
  EXPECT_NE(Errors(r.output)[0].find("the checkpoint of iteration 2 holds no optimizer state (imported from a "
                                     "checkpoint saved without it): give --no-load-optim or --finetune"),
            std::string::npos)
      << r.output;
  for (const char* flag : {" --no-load-optim", " --finetune"}) {
    auto ok = RunCmd(Train(Data() + " --load " + imp + flag));
    EXPECT_EQ(ok.exit_code, 0) << flag << "\n" << ok.output;
  }

  // The same checkpoint as Megatron's release: iteration 0, nothing refused.
  std::filesystem::rename(dir_ / "meg/iter_0000002", dir_ / "meg/release");
  testing::WriteFile(dir_ / "meg/latest_checkpointed_iteration.txt", "release");
  auto rel = to_ptk("meg", "rel");
  ASSERT_EQ(rel.exit_code, 0) << rel.output;
  EXPECT_NE(rel.output.find("the tracker says release: imported at iteration 0"), std::string::npos) << rel.output;
  EXPECT_EQ(CheckpointToLoad(dir_ / "rel", std::nullopt).value_or(-1), 0);
  auto run = RunCmd(Train(Data() + " --load " + ShellQuote(dir_ / "rel")));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(" iteration        1/       4 |"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace ptk
