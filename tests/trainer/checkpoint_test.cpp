// Checkpoint saves under fault injection: a kill (in a child process) or an I/O failure at every
// step of a save, over a fresh iteration and over a rerun that replaces an existing one, leaves a
// loadable `latest` and, after the next run's recovery, no temporaries; strict tracker parsing;
// Megatron's own torch checkpoints recognised; settings kept for the resume checks.
#include "trainer/checkpoint.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/hash.h"
#include "common/status.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"

namespace ptk {
namespace {

using testing::TempDir;

ParamLayout SmallLayout() {
  auto layout = ParamLayout::Create(testing::SmallGpt(1, 8, 2, 8, 64, 64));
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

// Arrays whose every value is `tag` (params), tag + 0.5 (exp_avg), tag + 0.25 (exp_avg_sq): a
// loaded checkpoint tells which save wrote it.
struct Arrays {
  std::vector<float> p, m, v;
};
Arrays Filled(const ParamLayout& layout, float tag) {
  const size_t n = static_cast<size_t>(layout.num_params);
  return {std::vector<float>(n, tag), std::vector<float>(n, tag + 0.5f), std::vector<float>(n, tag + 0.25f)};
}

absl::Status Save(const std::string& dir, const ParamLayout& layout, int64_t iteration, float tag) {
  Arrays a = Filled(layout, tag);
  TrainState s;
  s.iteration = iteration;
  s.consumed_train_samples = iteration * 4;
  s.settings = {{"--seed", "1234"}, {"--data-path", "a b"}};
  return SaveCheckpoint(dir, layout, a.p, a.m, a.v, s, "[\"--lr\", \"1e-3\"]");
}

// The tag of the checkpoint `latest` names, after checking that it loads; -1 when it does not.
float LatestTag(const std::string& dir, const ParamLayout& layout, int64_t* iteration) {
  auto it = LatestCheckpointIteration(dir);
  EXPECT_TRUE(it.ok()) << it.status();
  if (!it.ok()) return -1;
  *iteration = *it;
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir, *it, layout, &p, &m, &v, &s);
  EXPECT_TRUE(st.ok()) << st;
  if (!st.ok()) return -1;
  EXPECT_EQ(s.iteration, *it);
  EXPECT_EQ(m[0], p[0] + 0.5f);
  EXPECT_EQ(v.back(), p[0] + 0.25f);
  return p[0];
}

// Everything in `dir` that is not an iteration directory, the tracker or another file a run
// leaves on purpose.
std::string Litter(const std::string& dir) {
  std::string out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "latest_checkpointed_iteration.txt") continue;
    if (name.rfind("iter_", 0) == 0 && name.find('.') == std::string::npos) continue;
    out += name + " ";
  }
  return out + testing::Leftovers(dir);
}

// Runs Save in a child whose hook kills it (SIGKILL) at the `kill_at`-th step. Returns the step's
// name, or "" when the save finished before reaching it.
std::string SaveKilledAt(const std::string& dir, const ParamLayout& layout, int64_t iteration, float tag, int kill_at) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    int steps = 0;
    SetSaveStepHookForTesting([&](std::string_view step) {
      if (steps++ == kill_at) {
        (void)!::write(fds[1], step.data(), step.size());
        ::raise(SIGKILL);
      }
      return absl::OkStatus();
    });
    absl::Status st = Save(dir, layout, iteration, tag);
    ::_exit(st.ok() ? 0 : 1);
  }
  ::close(fds[1]);
  std::string step;
  char buf[256];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) step.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  if (step.empty()) {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the save failed without a fault";
  } else {
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  }
  return step;
}

// A kill at every step of a save: iteration 2 saved over `latest` = 1 (fresh), or iteration 2
// saved again over `latest` = 2 (a rerun of a finished run, the case that lost both copies).
void KillAtEveryStep(bool rerun) {
  const ParamLayout layout = SmallLayout();
  int steps = 0;
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string save = dir / "ckpt";
    ASSERT_TRUE(Save(save, layout, 1, 1.0f).ok());
    if (rerun) {
      ASSERT_TRUE(Save(save, layout, 2, 2.0f).ok());
    }
    const std::string step = SaveKilledAt(save, layout, 2, 3.0f, k);
    SCOPED_TRACE("killed at step " + std::to_string(k) + " (" + step + ")" + (rerun ? ", rerun" : ", fresh"));
    // Before any recovery, `latest` names a checkpoint that loads (from a copy aside if need be).
    int64_t it = 0;
    float tag = LatestTag(save, layout, &it);
    // The next run's start-up recovery: the same checkpoint, in place, and nothing else left.
    ASSERT_TRUE(RecoverCheckpointDir(save).ok());
    int64_t it2 = 0;
    EXPECT_EQ(LatestTag(save, layout, &it2), tag);
    EXPECT_EQ(it2, it);
    EXPECT_EQ(Litter(save), "");
    if (rerun) {
      EXPECT_EQ(it, 2);
      EXPECT_TRUE(tag == 2.0f || tag == 3.0f) << tag;
    } else {
      EXPECT_TRUE((it == 1 && tag == 1.0f) || (it == 2 && tag == 3.0f)) << it << " " << tag;
    }
    if (testing::Exists(CheckpointDir(save, 2))) {
      EXPECT_TRUE(VerifyCheckpointFile(CheckpointFile(save, 2)).ok());
    }
    if (step.empty()) {
      EXPECT_EQ(it, 2);
      EXPECT_EQ(tag, 3.0f);
      break;
    }
    ++steps;
  }
  // create, write, fsync file, fsync dir, [rename aside], rename in, fsync save dir, [remove old],
  // write tracker, commit tracker.
  EXPECT_EQ(steps, rerun ? 10 : 8);
}

// A run's very first save killed at every step: recovery leaves either nothing (the next run starts
// anew) or the complete directory of the iteration (renamed in by the save, or by recovery from its
// temporary name) with the tracker naming it. It was left without a tracker, and the next run started from scratch
// beside a complete checkpoint (which its own save of that iteration then replaced).
TEST(Checkpoint, KillAtEveryStepOfAFirstSaveLosesNoCompleteCheckpoint) {
  const ParamLayout layout = SmallLayout();
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string save = dir / "ckpt";
    const std::string step = SaveKilledAt(save, layout, 3, 3.0f, k);
    SCOPED_TRACE("killed at step " + std::to_string(k) + " (" + step + ")");
    const bool renamed_in = testing::Exists(CheckpointDir(save, 3));
    ASSERT_TRUE(RecoverCheckpointDir(save).ok());
    EXPECT_EQ(Litter(save), "");
    // Recovery also renames in a complete new directory that the kill left under its temporary name.
    if (testing::Exists(CheckpointDir(save, 3))) {
      int64_t it = 0;
      EXPECT_EQ(LatestTag(save, layout, &it), 3.0f);
      EXPECT_EQ(it, 3);
    } else {
      EXPECT_FALSE(renamed_in);
      EXPECT_TRUE(absl::IsNotFound(LatestCheckpointIteration(save).status()));
    }
    if (step.empty()) break;
  }
}

// Iteration directories without a tracker that no killed save can leave (several of them, or one
// whose file is damaged) are left as they are: recovery does not choose among them.
TEST(Checkpoint, RecoveryWritesNoTrackerForDirectoriesNoKilledSaveLeaves) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  const std::string save = dir / "ckpt";
  ASSERT_TRUE(Save(save, layout, 1, 1.0f).ok());
  ASSERT_TRUE(Save(save, layout, 2, 2.0f).ok());
  std::filesystem::remove(save + "/latest_checkpointed_iteration.txt");
  ASSERT_TRUE(RecoverCheckpointDir(save).ok());
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpointIteration(save).status()));
  std::filesystem::remove_all(CheckpointDir(save, 1));
  const std::string file = CheckpointFile(save, 2);
  std::string bytes = testing::ReadFile(file);
  bytes[bytes.size() / 2] ^= 1;
  testing::WriteFile(file, bytes);
  ASSERT_TRUE(RecoverCheckpointDir(save).ok());
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpointIteration(save).status()));
}

TEST(Checkpoint, KillAtEveryStepOfAFreshSaveLeavesALoadableLatest) { KillAtEveryStep(false); }
TEST(Checkpoint, KillAtEveryStepOfARerunSaveLeavesALoadableLatest) { KillAtEveryStep(true); }

// A save that fails at any step (a full disk) returns the error and leaves the previous state:
// `latest` loadable and nothing of its own behind, without waiting for the next run.
void FailAtEveryStep(bool rerun) {
  const ParamLayout layout = SmallLayout();
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string save = dir / "ckpt";
    ASSERT_TRUE(Save(save, layout, 1, 1.0f).ok());
    if (rerun) {
      ASSERT_TRUE(Save(save, layout, 2, 2.0f).ok());
    }
    int steps = 0;
    std::string failed_at;
    bool renamed_in = false;  // the failure came after the new directory was renamed into place
    SetSaveStepHookForTesting([&](std::string_view step) {
      if (steps++ != k) {
        renamed_in |= step == "rename new directory in";
        return absl::OkStatus();
      }
      failed_at = std::string(step);
      return absl::ResourceExhaustedError("injected: no space left on device");
    });
    absl::Status st = Save(save, layout, 2, 3.0f);
    SetSaveStepHookForTesting(nullptr);
    SCOPED_TRACE("failed at step " + std::to_string(k) + " (" + failed_at + ")" + (rerun ? ", rerun" : ", fresh"));
    EXPECT_EQ(Litter(save), "");
    int64_t it = 0;
    const float tag = LatestTag(save, layout, &it);
    if (failed_at.empty()) {
      EXPECT_TRUE(st.ok()) << st;
      EXPECT_EQ(tag, 3.0f);
      break;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_EQ(it, rerun ? 2 : 1);
    // Until the new directory is in place, what was there before (a failed save does not put its
    // own copy in); after, the new directory of iteration 2, with or without the tracker moved.
    EXPECT_EQ(tag, rerun && renamed_in ? 3.0f : rerun ? 2.0f : 1.0f);
    // A new iteration 2 that the tracker does not name is not left behind (it was, after a
    // failure past its rename: the tracker's write on a full disk).
    EXPECT_EQ(testing::Exists(CheckpointDir(save, 2)), rerun);
  }
}

// The very first save of a run failing at any step (a full disk at the checkpoint file, or at the
// tracker after the directory is in place): nothing is left, no iteration directory without a
// tracker for the next --load to start from scratch beside.
TEST(Checkpoint, FailureAtEveryStepOfAFirstSaveLeavesNothing) {
  const ParamLayout layout = SmallLayout();
  for (int k = 0;; ++k) {
    TempDir dir;
    const std::string save = dir / "ckpt";
    int steps = 0;
    std::string failed_at;
    SetSaveStepHookForTesting([&](std::string_view step) {
      if (steps++ != k) return absl::OkStatus();
      failed_at = std::string(step);
      return absl::ResourceExhaustedError("injected: no space left on device");
    });
    absl::Status st = Save(save, layout, 1, 1.0f);
    SetSaveStepHookForTesting(nullptr);
    SCOPED_TRACE("failed at step " + std::to_string(k) + " (" + failed_at + ")");
    if (failed_at.empty()) {
      EXPECT_TRUE(st.ok()) << st;
      break;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    size_t entries = 0;
    for (const auto& e : std::filesystem::directory_iterator(save)) entries += !e.path().empty();
    EXPECT_EQ(entries, 0u) << Litter(save);
  }
}

TEST(Checkpoint, FailureAtEveryStepOfAFreshSaveLeavesNoTemporaries) { FailAtEveryStep(false); }
TEST(Checkpoint, FailureAtEveryStepOfARerunSaveLeavesNoTemporaries) { FailAtEveryStep(true); }

// The sequence: a rerun killed between moving the old copy aside and renaming the new one
// in; the next run must restore a copy, never delete the only complete ones.
TEST(Checkpoint, RecoveryRestoresAnIterationLeftAside) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  const std::string save = dir / "ckpt";
  ASSERT_TRUE(Save(save, layout, 2, 2.0f).ok());
  std::filesystem::rename(CheckpointDir(save, 2), CheckpointDir(save, 2) + ".ptk-old-4242");
  // A damaged copy beside it is not trusted.
  std::filesystem::copy(CheckpointDir(save, 2) + ".ptk-old-4242", CheckpointDir(save, 2) + ".ptk-tmp-4243",
                        std::filesystem::copy_options::recursive);
  const std::string bad = CheckpointDir(save, 2) + ".ptk-tmp-4243/mp_rank_00/model_optim_rng.ptk";
  std::string bytes = testing::ReadFile(bad);
  bytes[bytes.size() / 2] ^= 1;
  testing::WriteFile(bad, bytes);
  EXPECT_FALSE(VerifyCheckpointFile(bad).ok());
  testing::WriteFile(save + "/latest_checkpointed_iteration.txt.ptk-tmp-4242-abc", "3");
  ASSERT_TRUE(RecoverCheckpointDir(save).ok());
  EXPECT_EQ(Litter(save), "");
  int64_t it = 0;
  EXPECT_EQ(LatestTag(save, layout, &it), 2.0f);
  // A truncated file is not complete either.
  testing::WriteFile(bad, bytes.substr(0, bytes.size() - 10));
  EXPECT_FALSE(VerifyCheckpointFile(bad).ok());
}

TEST(Checkpoint, TrackerIsParsedStrictly) {
  TempDir dir;
  const std::string tracker = dir / "latest_checkpointed_iteration.txt";
  auto parse = [&](const std::string& text) {
    testing::WriteFile(tracker, text);
    return LatestCheckpointIteration(dir.path());
  };
  EXPECT_EQ(*parse("7"), 7);
  EXPECT_EQ(*parse(" 12\n"), 12);  // Megatron reads int(f.read().strip())
  for (const std::string& bad : {std::string("4\0garbage", 9), std::string("4\0", 2), std::string(""),
                                 std::string("-3"), std::string("+3"), std::string("3 4"), std::string("0x10")}) {
    auto r = parse(bad);
    ASSERT_FALSE(r.ok()) << "accepted " << bad.size() << " bytes";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find("not an iteration number"), absl::string_view::npos) << r.status();
  }
  auto nines = parse(std::string(24, '9'));
  ASSERT_FALSE(nines.ok());
  EXPECT_NE(nines.status().message().find("overflows"), absl::string_view::npos) << nines.status();
  EXPECT_EQ(*parse("9223372036854775807"), 9223372036854775807);
  EXPECT_FALSE(parse("9223372036854775808").ok());
}

TEST(Checkpoint, MegatronTorchCheckpointIsNamedAsSuch) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  std::filesystem::create_directories(dir / "iter_0000005/mp_rank_00");
  testing::WriteFile(dir / "iter_0000005/mp_rank_00/model_optim_rng.pt", "PK\x03\x04 torch zip");
  // Without a tracker (copied without it) and with one.
  auto it = LatestCheckpointIteration(dir.path());
  ASSERT_FALSE(it.ok());
  EXPECT_EQ(it.status().code(), absl::StatusCode::kFailedPrecondition) << it.status();
  EXPECT_NE(it.status().message().find("PyTorch's format"), absl::string_view::npos) << it.status();
  testing::WriteFile(dir / "latest_checkpointed_iteration.txt", "5");
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir.path(), 5, layout, &p, &m, &v, &s);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("model_optim_rng.pt is a Megatron checkpoint in PyTorch's format"),
            absl::string_view::npos)
      << st;
  EXPECT_NE(st.message().find("ptk-convert --loader megatron --saver ptk"), absl::string_view::npos) << st;
  // torch_dist: shards and metadata in the iteration directory.
  std::filesystem::remove_all(dir / "iter_0000005");
  std::filesystem::create_directories(dir / "iter_0000005");
  testing::WriteFile(dir / "iter_0000005/__0_0.distcp", "x");
  st = LoadCheckpoint(dir.path(), 5, layout, &p, &m, &v, &s);
  EXPECT_NE(st.message().find("PyTorch's format"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("ptk-convert --loader megatron --saver ptk"), absl::string_view::npos) << st;
}

// Megatron's file renamed to ptk's name (model_optim_rng.ptk): what it is, and the tool that reads it,
// from every reader (was "not a ptk checkpoint (bad magic)").
TEST(Checkpoint, ATorchFileUnderPtksNameIsNamedAsSuch) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  std::filesystem::create_directories(dir / "iter_0000005/mp_rank_00");
  const std::string file = dir / "iter_0000005/mp_rank_00/model_optim_rng.ptk";
  testing::WriteFile(file, std::string("PK\x03\x04", 4) + std::string(200, 'z'));
  testing::WriteFile(dir / "latest_checkpointed_iteration.txt", "5");
  const std::string what = "it is a zip archive, PyTorch's torch.save format";
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir.path(), 5, layout, &p, &m, &v, &s);
  EXPECT_NE(st.message().find(file), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find(what), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("ptk-convert --loader megatron --saver ptk"), absl::string_view::npos) << st;
  st = VerifyCheckpointFile(file);
  EXPECT_NE(st.message().find(what), absl::string_view::npos) << st;
  EXPECT_EQ(NotAPtkCheckpoint("garbage!"), "not a ptk checkpoint (bad magic)");
}

TEST(Checkpoint, SettingsComeBack) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), layout, 3, 1.0f).ok());
  std::vector<float> p, m, v;
  TrainState s;
  ASSERT_TRUE(LoadCheckpoint(dir.path(), 3, layout, &p, &m, &v, &s).ok());
  ASSERT_EQ(s.settings.size(), 2u);
  EXPECT_EQ(s.settings[0], std::make_pair(std::string("--seed"), std::string("1234")));
  EXPECT_EQ(s.settings[1], std::make_pair(std::string("--data-path"), std::string("a b")));
  auto read = ReadCheckpointSettings(dir.path(), 3);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, s.settings);
}

// A header whose settings are not [[flag, value], ...] of strings is refused by the load and by
// ReadCheckpointSettings alike (the file's SHA-256 made right again, so that only the header speaks).
TEST(Checkpoint, MalformedSettingsAreRefusedByBothReaders) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), layout, 3, 1.0f).ok());
  const std::string file = CheckpointFile(dir.path(), 3);
  std::string data = testing::ReadFile(file);
  const std::string good = "[\"--seed\", \"1234\"]", bad = "[\"--seed\",  1234 ]";
  ASSERT_EQ(good.size(), bad.size());
  const size_t at = data.find(good);
  ASSERT_NE(at, std::string::npos);
  data.replace(at, good.size(), bad);
  data.replace(data.size() - 64, 64, Sha256Hex(std::string_view(data.data(), data.size() - 64)));
  testing::WriteFile(file, data);
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir.path(), 3, layout, &p, &m, &v, &s);
  EXPECT_NE(st.message().find("malformed settings in the header"), absl::string_view::npos) << st;
  auto read = ReadCheckpointSettings(dir.path(), 3);
  EXPECT_NE(read.status().message().find("malformed settings in the header"), absl::string_view::npos) << read.status();
}

// A file of another tensor rank or pipeline stage than the layout loading it is named with both, not
// read as this rank's part.
TEST(Checkpoint, AFileOfAnotherModelParallelRankNamesBoth) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), layout, 3, 1.0f).ok());
  const std::string file = CheckpointFile(dir.path(), 3);
  std::vector<float> p, m, v;
  TrainState s;
  ParamLayout tensor = layout;
  tensor.tensor_size = 2;
  tensor.tensor_rank = 1;
  absl::Status st = LoadCheckpointFile(file, 3, tensor, &p, &m, &v, &s);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_EQ(StatusMessage(st), file + ": tensor rank 0 of 1 saved it; this is tensor rank 1 of 2");
  ParamLayout stage = layout;
  stage.pipeline_size = 3;
  stage.pipeline_rank = 2;
  st = LoadCheckpointFile(file, 3, stage, &p, &m, &v, &s);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_EQ(StatusMessage(st), file + ": pipeline stage 0 of 1 saved it; this is stage 2 of 3");
}

// A checkpoint of a later format version (a later ptk's) is named as such, with both versions, not as
// corrupt ("unsupported format version" gave neither).
TEST(Checkpoint, ALaterFormatVersionIsNamedWithBothVersions) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), layout, 3, 1.0f).ok());
  const std::string file = CheckpointFile(dir.path(), 3);
  std::string data = testing::ReadFile(file);
  const size_t at = data.find("\"version\": 1,");
  ASSERT_NE(at, std::string::npos);
  data[at + 11] = '2';
  data.replace(data.size() - 64, 64, Sha256Hex(std::string_view(data.data(), data.size() - 64)));
  testing::WriteFile(file, data);
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir.path(), 3, layout, &p, &m, &v, &s);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_EQ(StatusMessage(st), file +
                                   ": checkpoint format version 2, and this ptk reads version 1 only: load it with "
                                   "the ptk that saved it, or convert it with that ptk's ptk-convert");
}

// A Llama-line model's checkpoint records its settings: it loads into the same model, and one that
// differs only where the parameter count does not show it (the rope scaling, the rotary base) is
// refused naming the description, not loaded into the wrong model.
TEST(Checkpoint, LlamaLineSettingsMustMatch) {
  GPTConfig c = SmallLayout().config;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.num_query_groups = 1;
  c.add_bias_linear = false;
  c.rotary_base = 500000;
  c.use_rope_scaling = true;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), *layout, 3, 1.0f).ok());
  std::vector<float> p, m, v;
  TrainState s;
  ASSERT_TRUE(LoadCheckpoint(dir.path(), 3, *layout, &p, &m, &v, &s).ok());
  // The message names the setting that differs, as its flag.
  const std::pair<void (*)(GPTConfig&), const char*> changes[] = {
      {+[](GPTConfig& g) { g.use_rope_scaling = false; }, "--use-rope-scaling true (this run: false)"},
      {+[](GPTConfig& g) { g.rotary_base = 1e4; }, "--rotary-base 500000.0 (this run: 10000.0)"},
      {+[](GPTConfig& g) { g.rope_scaling_factor = 32; }, "--rope-scaling-factor the default (this run: 32.0)"},
      {+[](GPTConfig& g) { g.rotary_interleaved = true; }, "--rotary-interleaved the default (this run: true)"},
      {+[](GPTConfig& g) { g.rotary_seq_len_interpolation_factor = 4; },
       "--rotary-seq-len-interpolation-factor the default (this run: 4.0)"}};
  for (const auto& [change, says] : changes) {
    GPTConfig other = c;
    change(other);
    auto other_layout = ParamLayout::Create(other);
    ASSERT_EQ(other_layout->num_params, layout->num_params);
    absl::Status st = LoadCheckpoint(dir.path(), 3, *other_layout, &p, &m, &v, &s);
    EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
    EXPECT_NE(st.message().find(std::string("the checkpoint is of another model: ") + says + ";"), std::string::npos)
        << st;
  }
  // Saved with the rotary variants: they come back in the description, and the default run is refused.
  GPTConfig variant = c;
  variant.rope_scaling_factor = 32;
  variant.rotary_interleaved = true;
  variant.rotary_seq_len_interpolation_factor = 2.5;
  auto variant_layout = ParamLayout::Create(variant);
  ASSERT_TRUE(variant_layout.ok()) << variant_layout.status();
  TempDir vdir;
  ASSERT_TRUE(Save(vdir.path(), *variant_layout, 3, 1.0f).ok());
  ASSERT_TRUE(LoadCheckpoint(vdir.path(), 3, *variant_layout, &p, &m, &v, &s).ok());
  absl::Status st = LoadCheckpoint(vdir.path(), 3, *layout, &p, &m, &v, &s);
  EXPECT_NE(st.message().find("--rope-scaling-factor 32.0 (this run: the default), --rotary-seq-len-interpolation-"
                              "factor 2.5 (this run: the default), --rotary-interleaved true (this run: the default)"),
            std::string::npos)
      << st;
}

// The scheduler's settings come back from a checkpoint; one written without
// them (by an earlier ptk) still loads, with none.
// A run with more layers than the checkpoint loads it through LoadResharded (another stage shape), which reads
// the file with this run's config cut to the saved layers: the refusal named the flag, then "(N parameters saved,
// N in this run)", the same N, the slice's count as this run's. The message names the flags, no slice's count.
TEST(Checkpoint, AnotherLayerCountIsNamedWithoutASlicesParameterCount) {
  const ParamLayout two = SmallLayout();
  GPTConfig c = two.config;
  c.num_layers = 2;
  auto three = ParamLayout::Create(c);
  ASSERT_TRUE(three.ok()) << three.status();
  TempDir dir;
  ASSERT_TRUE(Save(dir.path(), two, 3, 1.0f).ok());
  std::vector<float> p, m, v;
  TrainState s;
  absl::Status st = LoadCheckpoint(dir.path(), 3, *three, &p, &m, &v, &s);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find("the checkpoint is of another model: --num-layers 1 (this run: 2); give"),
            std::string::npos)
      << st;
  EXPECT_EQ(st.message().find("parameters"), std::string::npos) << st;
}

TEST(Checkpoint, SchedulerSettingsComeBackAndOldCheckpointsLoad) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  Arrays a = Filled(layout, 1.0f);
  TrainState s;
  s.iteration = 5;
  s.scheduler_num_steps = 40;
  SchedulerConfig c;
  c.init_lr = 1e-7;
  c.max_lr = 3e-3;
  c.min_lr = 0.1 / 3;
  c.warmup_steps = 8;
  c.decay_steps = 400;
  c.decay_style = "WSD";
  c.wsd_decay_steps = 80;
  c.wsd_decay_style = "minus_sqrt";
  c.start_wd = 0.01;
  c.end_wd = 0.1;
  c.wd_incr_steps = 400;
  c.wd_incr_style = "cosine";
  c.decoupled_lr = 0.01 / 3;  // --decoupled-lr / --decoupled-min-lr: Megatron's group max_lr / min_lr
  c.decoupled_min_lr = 1e-5;
  s.scheduler = c;
  ASSERT_TRUE(SaveCheckpoint(dir.path(), layout, a.p, a.m, a.v, s, "").ok());
  s.iteration = 6;
  s.scheduler.reset();
  ASSERT_TRUE(SaveCheckpoint(dir.path(), layout, a.p, a.m, a.v, s, "").ok());
  std::vector<float> p, m, v;
  TrainState got;
  ASSERT_TRUE(LoadCheckpoint(dir.path(), 5, layout, &p, &m, &v, &got).ok());
  ASSERT_TRUE(got.scheduler.has_value());
  EXPECT_TRUE(CompareSchedulers(*got.scheduler, c, 0).empty());
  EXPECT_EQ(got.scheduler->init_lr, c.init_lr);
  EXPECT_EQ(got.scheduler->min_lr, c.min_lr);  // bit for bit through the JSON
  EXPECT_EQ(got.scheduler->wsd_decay_steps, 80);
  EXPECT_EQ(got.scheduler->wsd_decay_style, "minus_sqrt");
  EXPECT_EQ(got.scheduler_num_steps, 40);
  EXPECT_EQ(got.scheduler->decoupled_lr, c.decoupled_lr);
  EXPECT_EQ(got.scheduler->decoupled_min_lr, c.decoupled_min_lr);
  absl::Status st = LoadCheckpoint(dir.path(), 6, layout, &p, &m, &v, &got);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_FALSE(got.scheduler.has_value());
  const std::string header = testing::ReadFile(CheckpointFile(dir.path(), 6));
  EXPECT_EQ(header.find("opt_param_scheduler\""), std::string::npos);
}

// A checkpoint file cut short (a copy stopped by a kill or a full disk) is named as such, with its size
// and the size its header records, by the verification (start-up recovery, --load of every rank's file)
// and by the load alike; one with bytes appended too. Only a file of the right length whose bytes
// changed is a SHA-256 mismatch (it was reported for a file cut short).
TEST(Checkpoint, AFileCutShortSaysSoWithBothSizes) {
  const ParamLayout layout = SmallLayout();
  TempDir dir;
  const std::string save = dir / "ckpt";
  ASSERT_TRUE(Save(save, layout, 2, 2.0f).ok());
  const std::string file = CheckpointFile(save, 2);
  const std::string whole = testing::ReadFile(file);
  auto errors = [&](const std::string& bytes) {
    testing::WriteFile(file, bytes);
    std::vector<float> p, m, v;
    TrainState s;
    absl::Status load = LoadCheckpoint(save, 2, layout, &p, &m, &v, &s);
    return std::pair<std::string, std::string>(StatusMessage(VerifyCheckpointFile(file)), StatusMessage(load));
  };
  for (size_t keep : {whole.size() - 1, whole.size() - 64, whole.size() / 2, whole.size() / 2 - 700}) {
    SCOPED_TRACE(keep);
    const auto [verify, load] = errors(whole.substr(0, keep));
    const std::string want = fmt::format("cut short: {} bytes of the {} its header records ({} missing", keep,
                                         whole.size(), whole.size() - keep);
    EXPECT_EQ(verify.rfind(file + ": incomplete or corrupt checkpoint: " + want, 0), 0u) << verify;
    EXPECT_EQ(load.rfind(file + ": corrupt checkpoint, refusing to load it: " + want, 0), 0u) << load;
  }
  // Within the header, and within the fixed start: still cut short, never a hash or JSON complaint.
  for (size_t keep : {size_t{200}, size_t{40}, size_t{12}, size_t{3}}) {
    const auto [verify, load] = errors(whole.substr(0, keep));
    EXPECT_NE(verify.find(fmt::format("cut short: {} bytes, fewer than", keep)), std::string::npos) << verify;
    EXPECT_NE(load.find(fmt::format("cut short: {} bytes, fewer than", keep)), std::string::npos) << load;
  }
  {
    const auto [verify, load] = errors(whole + "xyz");
    const std::string want = fmt::format("{} bytes, 3 more than the {} its header records (something appended",
                                         whole.size() + 3, whole.size());
    EXPECT_NE(verify.find(want), std::string::npos) << verify;
    EXPECT_NE(load.find(want), std::string::npos) << load;
  }
  std::string flipped = whole;
  flipped[whole.size() - 100] ^= 1;
  const auto [verify, load] = errors(flipped);
  EXPECT_NE(verify.find("SHA-256 mismatch"), std::string::npos) << verify;
  EXPECT_NE(load.find("SHA-256 mismatch"), std::string::npos) << load;
  EXPECT_TRUE(errors(whole).first.empty());
}

}  // namespace
}  // namespace ptk
