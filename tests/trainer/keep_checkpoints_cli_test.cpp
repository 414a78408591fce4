// ptk-train's non-persistent checkpoints and --save-retain-interval end to end: a run stopped right after
// a non-persistent save (newer than --save's latest) resumes from it with the uninterrupted run's bits, on
// one rank, on two data-parallel ranks sharding the optimizer and on two pipeline stages; older
// non-persistent checkpoints and unretained persistent ones are removed, never another's directory; a
// tracker naming a deleted checkpoint is refused naming the way out; a second run on a non-persistent
// directory (SAVE/non_persistent too) is refused, and so is one that is --save by a link or Megatron's.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/output_lock.h"
#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_retention.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using Saved = testing::SavedCheckpoint;

class KeepCheckpointsCli : public testing::RanksTest {
 protected:
  KeepCheckpointsCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 4 of micro-batches of 1: one rank or two. Dropout on (Megatron's defaults).
  std::string Train(const std::string& extra, int64_t iters = 8) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 100 --eval-iters 1 --log-interval 1 --threads 1"
           " --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  static std::string Tracker(const std::string& dir) {
    return testing::ReadFile(dir + "/latest_checkpointed_iteration.txt");
  }
  static std::vector<int64_t> Iterations(const std::string& dir) {
    auto it = PtkIterations(dir);
    EXPECT_TRUE(it.ok()) << it.status();
    return it.ok() ? *it : std::vector<int64_t>{};
  }
  static void ExpectSameState(const std::string& a, const std::string& b, int64_t iteration) {
    const Saved x = testing::LoadTinyCheckpoint(a, iteration, 1000, 1024),
                y = testing::LoadTinyCheckpoint(b, iteration, 1000, 1024);
    EXPECT_EQ(x.state.consumed_train_samples, y.state.consumed_train_samples);
    EXPECT_TRUE(x.params == y.params) << "weights differ after the resume";
    EXPECT_TRUE(x.m == y.m && x.v == y.v) << "AdamW moments differ after the resume";
  }
  // `world` ranks: an uninterrupted run of 8 iterations, and one saving every 4 into --save and every 3
  // into SAVE/non_persistent, stopped at iteration 6 right after its non-persistent save (no persistent one
  // then, as Megatron's: the disk as a kill would leave it), then resumed from there: the last two log
  // lines and the checkpoint of iteration 8 are the uninterrupted run's.
  // `ranks`: the save line's "[ t 1/1, p 1/1 ]".
  void StopAfterANonPersistentSaveAndResume(int world, const std::string& extra,
                                            const std::string& ranks = "[ t 1/1, p 1/1 ]") {
    const std::string full = dir_ / "full", ck = dir_ / "ck";
    const std::string keep = " --save-interval 4 --non-persistent-ckpt-type global --non-persistent-save-interval 3 ";
    auto run = [&](const std::string& flags) {
      if (world == 1) {
        auto r = RunCmd(Train(flags + " " + extra));
        EXPECT_EQ(r.exit_code, 0) << r.output;
        return r.output;
      }
      auto r = Ranks(world, Train(flags + " " + extra));
      EXPECT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
      return r.output;
    };
    const std::string whole = run("--save " + ShellQuote(full));
    const std::string first = run("--save " + ShellQuote(ck) + keep + "--exit-interval 6");
    EXPECT_NE(first.find("exiting program at iteration 6"), std::string::npos) << first;
    EXPECT_NE(first.find("successfully saved non-persistent checkpoint from iteration       6 to " + ck +
                         "/non_persistent " + ranks),
              std::string::npos)
        << first;
    EXPECT_NE(first.find("Non-persistent checkpoints to be kept: ['" + CheckpointDir(ck + "/non_persistent", 3) + "']"),
              std::string::npos)
        << first;
    EXPECT_EQ(Tracker(ck), "4");
    EXPECT_EQ(Tracker(ck + "/non_persistent"), "6");
    EXPECT_EQ(Iterations(ck), std::vector<int64_t>{4});
    EXPECT_EQ(Iterations(ck + "/non_persistent"), (std::vector<int64_t>{3, 6}));  // Megatron's: 3 goes at the next
    const std::string resumed = run("--save " + ShellQuote(ck) + " --load " + ShellQuote(ck) + keep);
    EXPECT_NE(resumed.find("Loading from a non-persistent checkpoint (non-persistent iter 6)"), std::string::npos)
        << resumed;
    const auto lines = Lines(resumed), uninterrupted = Lines(whole);
    ASSERT_EQ(lines.size(), 2u) << resumed;
    ASSERT_EQ(uninterrupted.size(), 8u) << whole;
    EXPECT_EQ(lines, std::vector<std::string>(uninterrupted.begin() + 6, uninterrupted.end()));
    ExpectSameState(full, ck, 8);
    EXPECT_EQ(testing::Leftovers(ck), "");
  }
};

TEST_F(KeepCheckpointsCli, AStopAfterANonPersistentSaveResumesFromItBitForBit) {
  ASSERT_NO_FATAL_FAILURE(StopAfterANonPersistentSaveAndResume(1, ""));
  // Its tracker naming a deleted checkpoint: refused naming the file and the way out, never another one loaded.
  const std::string ck = dir_ / "ck", np = dir_ / "ck/non_persistent";
  ASSERT_EQ(Tracker(ck), "8");
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "9");
  const std::string resume = Train("--save " + ShellQuote(ck) + " --load " + ShellQuote(ck) +
                                       " --non-persistent-ckpt-type global --non-persistent-save-interval 3 "
                                       "--use-checkpoint-opt_param-scheduler",
                                   10);
  auto gone = RunCmd(resume);
  EXPECT_EQ(gone.exit_code, 1) << gone.output;
  EXPECT_NE(gone.output.find(CheckpointDir(np, 9)), std::string::npos) << gone.output;
  EXPECT_NE(gone.output.find("remove " + np + "/latest_checkpointed_iteration.txt to resume from --load's latest"),
            std::string::npos)
      << gone.output;
  // The way out taken: --load's latest, said so.
  std::filesystem::remove(np + "/latest_checkpointed_iteration.txt");
  auto persistent = RunCmd(resume);
  EXPECT_EQ(persistent.exit_code, 0) << persistent.output;
  EXPECT_NE(persistent.output.find("WARNING: could not find the metadata file " + np), std::string::npos);
  EXPECT_NE(persistent.output.find("iteration        9/"), std::string::npos) << persistent.output;
  EXPECT_EQ(persistent.output.find("iteration        8/"), std::string::npos) << persistent.output;
  // Iteration 9's non-persistent save removed all but the newest before it (no tracker: Megatron's rule).
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{6, 9}));
  EXPECT_EQ(Tracker(np), "9");
}

TEST_F(KeepCheckpointsCli, TwoShardedRanksResumeFromANonPersistentSaveBitForBit) {
  ASSERT_NO_FATAL_FAILURE(StopAfterANonPersistentSaveAndResume(2, "--use-distributed-optimizer"));
}

TEST_F(KeepCheckpointsCli, TwoPipelineStagesResumeFromANonPersistentSaveBitForBit) {
  ASSERT_NO_FATAL_FAILURE(
      StopAfterANonPersistentSaveAndResume(2, "--pipeline-model-parallel-size 2", "[ t 1/1, p 1/2 ]"));
}

// --use-checkpoint-args reads the checkpoint the run loads: the non-persistent one where it is newer (it read
// --load's, whose directory a user may have removed since: refused, though the run needs none of it).
TEST_F(KeepCheckpointsCli, UseCheckpointArgsReadsTheNonPersistentCheckpointWhereNewer) {
  const std::string ck = dir_ / "ck";
  const std::string keep = " --save-interval 4 --non-persistent-ckpt-type global --non-persistent-save-interval 3";
  auto first = RunCmd(Train("--save " + ShellQuote(ck) + keep + " --exit-interval 6"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::remove_all(CheckpointDir(ck, 4));
  auto resumed =
      RunCmd(Train("--save " + ShellQuote(ck) + " --load " + ShellQuote(ck) + keep + " --use-checkpoint-args"));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("Loading from a non-persistent checkpoint (non-persistent iter 6)"), std::string::npos)
      << resumed.output;
}

// --save-interval 2 --save-retain-interval 4: after each save the previous checkpoint goes unless a multiple of 4;
// a damaged old checkpoint and a directory ptk did not write are left alone, the resume unaffected by them.
TEST_F(KeepCheckpointsCli, RetentionKeepsMultiplesAndTheLatestOnly) {
  const std::string s = dir_ / "s";
  auto first = RunCmd(Train("--save " + ShellQuote(s) + " --save-interval 2 --exit-interval 6", 12));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(Iterations(s), (std::vector<int64_t>{2, 4, 6}));
  std::filesystem::resize_file(CheckpointFile(s, 2), 64);  // damaged, not the latest: no load reads it
  std::filesystem::create_directories(dir_ / "s/iter_0000007");
  testing::WriteFile(dir_ / "s/iter_0000007/notes.txt", "a user's");
  auto second = RunCmd(Train(
      "--save " + ShellQuote(s) + " --load " + ShellQuote(s) + " --save-interval 2 --save-retain-interval 4", 12));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("  successfully deleted checkpoint from iteration       6 at " + s), std::string::npos)
      << second.output;
  EXPECT_NE(second.output.find("  successfully deleted checkpoint from iteration      10 at " + s), std::string::npos)
      << second.output;
  // 2 (damaged) was no save's previous checkpoint here; 4 and 8 are multiples of 4; 12 is the latest.
  EXPECT_EQ(Iterations(s), (std::vector<int64_t>{2, 4, 8, 12}));
  EXPECT_TRUE(testing::Exists(dir_ / "s/iter_0000007/notes.txt"));
  EXPECT_EQ(Tracker(s), "12");
  EXPECT_EQ(testing::Leftovers(s), "");
}

// A non-persistent directory of its own is locked as --save is: a second run on it is refused naming the
// first (its checkpoints untouched), and one that is --save itself is refused before anything starts.
TEST_F(KeepCheckpointsCli, ASecondRunOnANonPersistentDirectoryIsRefused) {
  const std::string np = dir_ / "np";
  const std::string flags =
      " --non-persistent-ckpt-type global --non-persistent-save-interval 1 "
      "--non-persistent-global-ckpt-dir " +
      ShellQuote(np);
  auto one = RunCmd(Train("--save " + ShellQuote(dir_ / "a") + flags, 2));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(Tracker(np), "2");  // and --save's final save of iteration 2 (persistent, as Megatron's)
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{1, 2}));
  {
    auto held = OutputLock::Acquire(np + "/ptk-train");  // the first run, still writing
    ASSERT_TRUE(held.ok()) << held.status();
    auto two = RunCmd(Train("--save " + ShellQuote(dir_ / "b") + flags, 2));
    EXPECT_NE(two.exit_code, 0) << two.output;
    EXPECT_NE(two.output.find(np), std::string::npos) << two.output;
    EXPECT_EQ(Iterations(np), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(Tracker(np), "2");
    EXPECT_FALSE(testing::Exists(dir_ / "b"));  // a refused start leaves no --save it made
  }
  auto same = RunCmd(Train("--save " + ShellQuote(np) + flags, 2));
  EXPECT_EQ(same.exit_code, 2) << same.output;
  EXPECT_NE(same.output.find("--non-persistent-global-ckpt-dir " + np + " is --save"), std::string::npos)
      << same.output;
}

// SAVE/non_persistent is locked too, not only through --save's lock: a run writing there as its
// --non-persistent-global-ckpt-dir (or its --save) keeps out a run whose default non-persistent directory it
// is, whose cleanup would remove its checkpoints. (Before: only SAVE was locked; the second run started.)
TEST_F(KeepCheckpointsCli, TheDefaultNonPersistentDirectoryIsLockedToo) {
  const std::string a = dir_ / "a", np = dir_ / "a/non_persistent";
  const std::string keep = " --non-persistent-ckpt-type global --non-persistent-save-interval 1 ";
  auto one = RunCmd(Train("--save " + ShellQuote(dir_ / "x") + keep + "--non-persistent-global-ckpt-dir " +
                              ShellQuote(np) + " --save-interval 100",
                          3));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{2, 3}));
  auto held = OutputLock::Acquire(np + "/ptk-train");  // that run, still writing there
  ASSERT_TRUE(held.ok()) << held.status();
  auto two = RunCmd(Train("--save " + ShellQuote(a) + keep, 3));
  EXPECT_NE(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find(np), std::string::npos) << two.output;
  EXPECT_EQ(two.output.find("scheduled for removal"), std::string::npos) << two.output;
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(Tracker(np), "3");
  EXPECT_FALSE(testing::Exists(CheckpointDir(a, 3)));
}

// SAVE/non_persistent made a symbolic link to --save (or --load) is refused before anything starts: each
// non-persistent save's cleanup would remove --save's checkpoints but the one its tracker names. (Before: only a
// --non-persistent-global-ckpt-dir was compared with them; the run removed SAVE's older checkpoints.)
TEST_F(KeepCheckpointsCli, ANonPersistentDirectoryLinkedToSaveIsRefused) {
  const std::string s = dir_ / "s", l = dir_ / "l";
  auto first = RunCmd(Train("--save " + ShellQuote(s) + " --save-interval 1", 2));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::create_directory_symlink(s, s + "/non_persistent");
  std::filesystem::create_directories(l);
  std::filesystem::create_directory_symlink(s, l + "/non_persistent");
  const std::string keep = " --non-persistent-ckpt-type global --non-persistent-save-interval 1 ";
  for (const auto& [flags, says] :
       {std::pair{"--save " + ShellQuote(s), s + "/non_persistent is --save " + s + " itself"},
        std::pair{"--save " + ShellQuote(l) + " --load " + ShellQuote(s), l + "/non_persistent is --load " + s}}) {
    auto r = RunCmd(Train(flags + keep, 2));
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("usage error: " + says), std::string::npos) << flags << "\n" << r.output;
  }
  EXPECT_EQ(Iterations(s), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Tracker(s), "2");
}

// A non-persistent directory holding Megatron's own checkpoints (a Megatron job's, its command line reused) is
// refused as such a --save is: a save there moved the tracker Megatron reads to ptk's checkpoint. (Before: it
// was taken.)
TEST_F(KeepCheckpointsCli, ANonPersistentDirectoryOfMegatronsIsRefused) {
  const std::string keep = " --non-persistent-ckpt-type global --non-persistent-save-interval 1 ";
  for (const auto& [np, flags] :
       {std::pair{dir_ / "m", "--save " + ShellQuote(dir_ / "a") + keep + "--non-persistent-global-ckpt-dir " +
                                  ShellQuote(dir_ / "m")},
        std::pair{dir_ / "b/non_persistent", "--save " + ShellQuote(dir_ / "b") + keep}}) {
    std::filesystem::create_directories(np + "/iter_0000010/mp_rank_00");
    testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "10");
    testing::WriteFile(np + "/iter_0000010/mp_rank_00/model_optim_rng.pt", "torch");
    auto r = RunCmd(Train(flags, 2));
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(
        r.output.find(np + ": holds a Megatron checkpoint (" + np + "/iter_0000010/mp_rank_00/model_optim_rng.pt)"),
        std::string::npos)
        << r.output;
    EXPECT_EQ(Tracker(np), "10");
  }
}

// What makes no sense is refused in one line naming the flag, before anything starts (exit 2).
TEST_F(KeepCheckpointsCli, NonsenseIsRefusedInOneLine) {
  const std::string s = ShellQuote(dir_ / "s");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--non-persistent-save-interval 0 --non-persistent-ckpt-type global --save " + s,
       "--non-persistent-save-interval: must be an integer in [1, "},
      {"--non-persistent-save-interval 3 --save " + s,
       "--non-persistent-save-interval 3 needs --non-persistent-ckpt-type global"},
      {"--non-persistent-save-interval 3 --non-persistent-ckpt-type global",
       "--non-persistent-save-interval 3 without --save"},
      {"--non-persistent-global-ckpt-dir " + ShellQuote(dir_ / "np") + " --save " + s,
       "--non-persistent-global-ckpt-dir " + (dir_ / "np") + " needs --non-persistent-ckpt-type global"},
      {"--non-persistent-ckpt-type global --non-persistent-global-ckpt-dir " + ShellQuote(dir_ / "s/") + " --load " + s,
       "--non-persistent-global-ckpt-dir " + (dir_ / "s/") + " is --load"},
      {"--non-persistent-ckpt-type local --save " + s, "--non-persistent-ckpt-type local: local checkpoints"},
      {"--non-persistent-ckpt-type in_memory --save " + s, "--non-persistent-ckpt-type in_memory: not implemented"},
      {"--non-persistent-ckpt-type disk --save " + s, "--non-persistent-ckpt-type disk: not a type"},
      {"--non-persistent-local-ckpt-algo fast", "--non-persistent-local-ckpt-algo"},
      {"--save-retain-interval -4 --save " + s + " --save-interval 2", "--save-retain-interval: must be an integer"},
      {"--save-retain-interval 4 --save-interval 2", "--save-retain-interval 4 without --save"},
      {"--save-retain-interval 4 --save " + s, "--save-retain-interval 4 needs --save-interval"},
      {"--save-retain-interval 5 --save-interval 2 --save " + s,
       "--save-retain-interval 5 must be a multiple of --save-interval 2"},
  };
  for (const auto& [flags, says] : cases) {
    auto r = RunCmd(Train(flags));
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("usage error: " + says), std::string::npos) << flags << "\n" << r.output;
  }
  EXPECT_FALSE(testing::Exists(dir_ / "s"));
}

}  // namespace
}  // namespace ptk
