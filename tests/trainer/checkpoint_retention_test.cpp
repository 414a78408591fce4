// Non-persistent checkpoints and --save-retain-interval at the library's level: removals never touch
// the tracker's checkpoint or a directory ptk did not write (nor does a save replace one), a bad tracker never
// costs the newest whole checkpoint, a kill at every step of a removal or of a non-persistent save leaves a
// loadable checkpoint, and --load picks the newer of the two latest.
#include "trainer/checkpoint_retention.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::TempDir;

ParamLayout SmallLayout() {
  auto layout = ParamLayout::Create(testing::SmallGpt(1, 8, 2, 8, 64, 64));
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

// A checkpoint of `iteration` whose every parameter is `tag`: a load tells which save wrote it.
absl::Status Save(const std::string& dir, int64_t iteration, float tag) {
  const ParamLayout layout = SmallLayout();
  const std::vector<float> p(static_cast<size_t>(layout.num_params), tag), m(p.size(), 0.5f), v(p.size(), 0.25f);
  TrainState s;
  s.iteration = iteration;
  return SaveCheckpoint(dir, layout, p, m, v, s, "");
}

// The tag of the checkpoint of `iteration` in `dir`, or -1 when it does not load.
float Tag(const std::string& dir, int64_t iteration) {
  std::vector<float> p, m, v;
  TrainState s;
  if (!LoadCheckpoint(dir, iteration, SmallLayout(), &p, &m, &v, &s).ok()) return -1;
  return p[0];
}

// A file at `path`, its directories made.
void Put(const std::string& path, const std::string& data) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  testing::WriteFile(path, data);
}

std::vector<int64_t> Iterations(const std::string& dir) {
  auto it = PtkIterations(dir);
  EXPECT_TRUE(it.ok()) << it.status();
  return it.ok() ? *it : std::vector<int64_t>{};
}

// Runs `work` in a child killed (SIGKILL) at the `kill_at`-th checkpoint step. Returns false when
// `work` finished before that step (the child exits 0).
bool KilledAt(int kill_at, const std::function<absl::Status()>& work) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int steps = 0;
    SetSaveStepHookForTesting([&](std::string_view) {
      if (steps++ == kill_at) ::raise(SIGKILL);
      return absl::OkStatus();
    });
    ::_exit(work().ok() ? 0 : 1);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  if (WIFSIGNALED(status)) return true;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "failed without a fault";
  return false;
}

TEST(CheckpointRetention, OnlyPtksOwnIterationDirectoriesAreRecognised) {
  TempDir dir;
  ASSERT_TRUE(Save(dir / "s", 10, 1).ok());
  EXPECT_TRUE(IsPtkIterationDir(CheckpointDir(dir / "s", 10)));
  // Megatron's checkpoint, a user's directory, a near name, a link to a real one: none is ptk's.
  Put(dir / "s/iter_0000020/mp_rank_00/model_optim_rng.pt", "torch");
  Put(dir / "s/iter_0000030/notes.txt", "mine");
  std::filesystem::create_directories(dir / "s/iter_40");
  std::filesystem::create_directories(dir / "s/iter_0000060");  // empty: no save leaves one
  std::filesystem::create_directory_symlink(CheckpointDir(dir / "s", 10), dir / "s/iter_0000050");
  EXPECT_EQ(Iterations(dir / "s"), std::vector<int64_t>{10});
  for (int64_t it : {20, 30, 50, 60}) {
    const absl::Status st = RemoveCheckpointIteration(dir / "s", it);
    EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  }
  EXPECT_TRUE(testing::Exists(dir / "s/iter_0000020/mp_rank_00/model_optim_rng.pt"));
  EXPECT_TRUE(testing::Exists(dir / "s/iter_0000030/notes.txt"));
  EXPECT_TRUE(testing::Exists(dir / "s/iter_0000060"));
  // The tracker's checkpoint is never removed.
  const absl::Status st = RemoveCheckpointIteration(dir / "s", 10);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_EQ(Tag(dir / "s", 10), 1);
}

// A save of an iteration whose directory holds a user's file besides ptk's (a rerun resuming from an older
// checkpoint, a non-persistent save meeting the cleanup's survivor) is refused: replacing the directory deleted
// the file with it. (Before: the save replaced it.) A ptk directory, an empty one or a link is replaced.
TEST(CheckpointRetention, ASaveNeverReplacesADirectoryHoldingAUsersFiles) {
  TempDir dir;
  const std::string s = dir / "s";
  ASSERT_TRUE(Save(s, 10, 1).ok());
  Put(dir / "s/iter_0000010/notes.txt", "mine");
  const absl::Status st = Save(s, 10, 2);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(StatusMessage(st).find("holds files a ptk save does not write"), std::string::npos) << st;
  EXPECT_TRUE(testing::Exists(dir / "s/iter_0000010/notes.txt"));
  EXPECT_EQ(Tag(s, 10), 1);
  EXPECT_EQ(testing::Leftovers(s), "");
  std::filesystem::remove(dir / "s/iter_0000010/notes.txt");
  ASSERT_TRUE(Save(s, 10, 3).ok());
  EXPECT_EQ(Tag(s, 10), 3);
  std::filesystem::create_directories(dir / "s/iter_0000012");
  ASSERT_TRUE(Save(s, 12, 4).ok());
  EXPECT_EQ(Tag(s, 12), 4);
  std::filesystem::create_directory_symlink(CheckpointDir(s, 10), dir / "s/iter_0000014");
  ASSERT_TRUE(Save(s, 14, 5).ok());
  EXPECT_EQ(Tag(s, 14), 5);
  EXPECT_EQ(Tag(s, 10), 3);  // what the link pointed to is untouched
}

// A kill at every step of a removal: the checkpoint is whole under its name or gone, and the next
// run's recovery finishes what was begun; the tracker's checkpoint loads throughout.
TEST(CheckpointRetention, KillAtEveryStepOfARemovalLeavesWholeOrNothing) {
  int steps = 0;
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string s = dir / "s";
    ASSERT_TRUE(Save(s, 10, 1).ok());
    ASSERT_TRUE(Save(s, 20, 2).ok());
    const bool killed = KilledAt(k, [&] { return RemoveCheckpointIteration(s, 10); });
    SCOPED_TRACE("killed at step " + std::to_string(k));
    if (testing::Exists(CheckpointDir(s, 10))) {
      EXPECT_EQ(Tag(s, 10), 1);
    }
    ASSERT_TRUE(RecoverCheckpointDir(s).ok());
    EXPECT_EQ(Tag(s, 20), 2);
    const std::vector<int64_t> left = Iterations(s);
    EXPECT_TRUE(left == std::vector<int64_t>({10, 20}) || left == std::vector<int64_t>({20}));
    EXPECT_EQ(testing::Leftovers(s), "");
    for (const auto& e : std::filesystem::directory_iterator(s))
      EXPECT_EQ(e.path().filename().string().find(".ptk-"), std::string::npos) << e.path();
    if (!killed) {
      EXPECT_EQ(left, std::vector<int64_t>{20});
      break;
    }
    ++steps;
  }
  EXPECT_EQ(steps, 3);  // rename away, fsync the directory, remove
}

// Megatron's cleanup before a non-persistent save keeps one checkpoint: the tracker's, even where a
// newer directory lies beside it (a save killed between its rename and its tracker).
TEST(CheckpointRetention, NonPersistentCleanupKeepsTheTrackersCheckpoint) {
  TempDir dir;
  const std::string np = dir / "np";
  for (int64_t it : {2, 4, 6}) ASSERT_TRUE(Save(np, it, static_cast<float>(it)).ok());
  auto c = CleanUpOldNonPersistent(np);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kept, std::vector<std::string>{CheckpointDir(np, 6)});
  EXPECT_EQ(c->removed, (std::vector<std::string>{CheckpointDir(np, 2), CheckpointDir(np, 4)}));
  EXPECT_EQ(Iterations(np), std::vector<int64_t>{6});
  // iter 8 renamed in, tracker still 6: 6 is kept, 8 goes (the save about to come rewrites whatever it needs).
  std::filesystem::copy(CheckpointDir(np, 6), dir / "np/iter_0000008", std::filesystem::copy_options::recursive);
  ASSERT_TRUE(CleanUpOldNonPersistent(np).ok());
  EXPECT_EQ(Iterations(np), std::vector<int64_t>{6});
  EXPECT_EQ(Tag(np, 6), 6);
  // A damaged tracker: nothing is removed.
  ASSERT_TRUE(Save(np, 10, 10).ok());
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "x");
  EXPECT_FALSE(CleanUpOldNonPersistent(np).ok());
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{6, 10}));
}

// A tracker naming a checkpoint that is gone (deleted by hand) or not whole (a damaged copy): the cleanup keeps
// the newest checkpoint that verifies beside it, never only the tracker's; with none that verifies, it removes
// nothing. (Before: every checkpoint but the tracker's went, the only usable one with them.)
TEST(CheckpointRetention, ABadTrackerNeverCostsTheNewestWholeCheckpoint) {
  TempDir dir;
  const std::string np = dir / "np";
  for (int64_t it : {2, 4}) ASSERT_TRUE(Save(np, it, static_cast<float>(it)).ok());
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "6");  // iter 6 deleted by hand
  auto gone = CleanUpOldNonPersistent(np);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->kept, std::vector<std::string>{CheckpointDir(np, 4)});
  EXPECT_EQ(Iterations(np), std::vector<int64_t>{4});
  EXPECT_EQ(Tag(np, 4), 4);
  // The tracker's copy cut short: it stays, and so does the newest whole one; an older whole one goes.
  for (int64_t it : {6, 8}) ASSERT_TRUE(Save(np, it, static_cast<float>(it)).ok());
  std::filesystem::resize_file(CheckpointFile(np, 8), 100);
  auto cut = CleanUpOldNonPersistent(np);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->kept, (std::vector<std::string>{CheckpointDir(np, 6), CheckpointDir(np, 8)}));
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(Tag(np, 6), 6);
  // A flipped byte (its length right, its checksum wrong) in the newest beside a missing tracker's: the older
  // whole one is kept.
  ASSERT_TRUE(Save(np, 10, 10).ok());
  std::filesystem::remove_all(CheckpointDir(np, 8));
  {
    std::fstream f(CheckpointFile(np, 10), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-100, std::ios::end);
    f.put('\x7f');
  }
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "12");
  ASSERT_TRUE(CleanUpOldNonPersistent(np).ok());
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{6}));
  EXPECT_EQ(Tag(np, 6), 6);
  // None verifies: nothing is removed.
  ASSERT_TRUE(Save(np, 14, 14).ok());
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "16");
  std::filesystem::resize_file(CheckpointFile(np, 6), 100);
  std::filesystem::resize_file(CheckpointFile(np, 14), 100);
  auto none = CleanUpOldNonPersistent(np);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->removed.empty());
  EXPECT_EQ(Iterations(np), (std::vector<int64_t>{6, 14}));
}

// A kill at every step of a non-persistent save (its cleanup, then the save): the tracker names a
// checkpoint that loads, the previous one or the new one.
TEST(CheckpointRetention, KillAtEveryStepOfANonPersistentSaveLeavesTheLastUsable) {
  int steps = 0;
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string np = dir / "np";
    ASSERT_TRUE(Save(np, 2, 2).ok());
    ASSERT_TRUE(Save(np, 4, 4).ok());
    const bool killed = KilledAt(k, [&]() -> absl::Status {
      PTK_RETURN_IF_ERROR(CleanUpOldNonPersistent(np).status());
      return Save(np, 6, 6);
    });
    SCOPED_TRACE("killed at step " + std::to_string(k));
    ASSERT_TRUE(RecoverCheckpointDir(np).ok());
    auto choice = ChooseCheckpointToLoad(dir / "none", np, std::nullopt);
    ASSERT_TRUE(choice.ok()) << choice.status();
    EXPECT_TRUE(choice->non_persistent);
    EXPECT_TRUE(choice->iteration == 4 || choice->iteration == 6) << choice->iteration;
    EXPECT_EQ(Tag(np, choice->iteration), static_cast<float>(choice->iteration));
    if (!killed) {
      EXPECT_EQ(choice->iteration, 6);
      EXPECT_EQ(Iterations(np), (std::vector<int64_t>{4, 6}));  // Megatron's: the previous stays until the next
      break;
    }
    ++steps;
  }
  EXPECT_EQ(steps, 11);  // the removal's 3, the save's 8
}

TEST(CheckpointRetention, RetentionRemovesOnlyThePreviousUnretainedCheckpoint) {
  TempDir dir;
  const std::string s = dir / "s";
  for (int64_t it : {2, 4, 6}) ASSERT_TRUE(Save(s, it, static_cast<float>(it)).ok());
  EXPECT_EQ(RetainAfterSave(s, 4, 6, 4), "");  // a multiple of 4: kept
  EXPECT_EQ(RetainAfterSave(s, std::nullopt, 6, 4), "");
  EXPECT_EQ(RetainAfterSave(s, 6, 6, 4), "");  // the same iteration saved again
  EXPECT_EQ(RetainAfterSave(s, 6, 5, 4), "");  // newer than this save (a --ckpt-step resume): kept
  EXPECT_EQ(RetainAfterSave(s, 2, 6, 0), "");  // no --save-retain-interval
  EXPECT_EQ(RetainAfterSave(s, 2, 6, 4), "  successfully deleted checkpoint from iteration       2 at " + s);
  EXPECT_EQ(Iterations(s), (std::vector<int64_t>{4, 6}));
  // A damaged old checkpoint (a file cut short, a rank's file gone) is still ptk's: removed.
  ASSERT_TRUE(Save(s, 8, 8).ok());
  std::filesystem::resize_file(CheckpointFile(s, 6), 100);
  EXPECT_EQ(RetainAfterSave(s, 6, 8, 4), "  successfully deleted checkpoint from iteration       6 at " + s);
  // A directory ptk did not write is kept, and said so (not fatal, as Megatron's).
  Put(dir / "s/iter_0000009/mp_rank_00/model_optim_rng.pt", "torch");
  EXPECT_NE(RetainAfterSave(s, 9, 10, 4).find("encountered exception"), std::string::npos);
  EXPECT_TRUE(testing::Exists(dir / "s/iter_0000009/mp_rank_00/model_optim_rng.pt"));
  std::filesystem::create_directory_symlink(CheckpointDir(s, 8), dir / "s/iter_0000011");
  EXPECT_EQ(RetainAfterSave(s, 11, 12, 4),
            "  skipping deleting checkpoint from iteration      11 at " + s + " since it is a symbolic link");
  EXPECT_EQ(Tag(s, 8), 8);
}

TEST(CheckpointRetention, LoadTakesTheNewerOfTheTwoLatest) {
  TempDir dir;
  const std::string load = dir / "s", np = dir / "s/non_persistent";
  ASSERT_TRUE(Save(load, 4, 4).ok());
  auto none = ChooseCheckpointToLoad(load, np, std::nullopt);  // no non-persistent tracker
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->iteration, 4);
  EXPECT_FALSE(none->non_persistent);
  ASSERT_EQ(none->lines.size(), 2u);
  EXPECT_EQ(none->lines[0], "WARNING: could not find the metadata file " + np + "/latest_checkpointed_iteration.txt");
  ASSERT_TRUE(Save(np, 6, 6).ok());
  auto newer = ChooseCheckpointToLoad(load, np, std::nullopt);
  ASSERT_TRUE(newer.ok());
  EXPECT_EQ(newer->dir, np);
  EXPECT_EQ(newer->iteration, 6);
  EXPECT_EQ(newer->lines, std::vector<std::string>{"Loading from a non-persistent checkpoint (non-persistent iter 6)"});
  // --ckpt-step names one of --load's; without the type, the directory is not looked at.
  EXPECT_EQ(ChooseCheckpointToLoad(load, np, 4)->dir, load);
  EXPECT_EQ(ChooseCheckpointToLoad(load, "", std::nullopt)->iteration, 4);
  ASSERT_TRUE(Save(load, 6, 7).ok());  // the same iteration: the non-persistent one, as Megatron's >=
  EXPECT_EQ(ChooseCheckpointToLoad(load, np, std::nullopt)->dir, np);
  ASSERT_TRUE(Save(load, 8, 8).ok());
  auto older = ChooseCheckpointToLoad(load, np, std::nullopt);
  EXPECT_EQ(older->dir, load);
  EXPECT_EQ(older->lines,
            std::vector<std::string>{"WARNING: non-persistent checkpoints are older than persistent checkpoint"});
  // Only a non-persistent checkpoint (--load's tracker gone): it is the one.
  std::filesystem::remove(load + "/latest_checkpointed_iteration.txt");
  EXPECT_EQ(ChooseCheckpointToLoad(load, np, std::nullopt)->iteration, 6);
  // A tracker naming a deleted directory is chosen and its load fails naming the file (never another one).
  std::filesystem::remove_all(CheckpointDir(np, 6));
  auto gone = ChooseCheckpointToLoad(load, np, std::nullopt);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(Tag(gone->dir, gone->iteration), -1);
  // A damaged tracker is an error, not a silent fallback.
  testing::WriteFile(np + "/latest_checkpointed_iteration.txt", "six");
  EXPECT_TRUE(absl::IsDataLoss(ChooseCheckpointToLoad(load, np, std::nullopt).status()));
}

}  // namespace
}  // namespace ptk
