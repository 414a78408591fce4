// Non-persistent checkpoints and --save-retain-interval: the removal of old checkpoints (renamed away
// first, never half under their name) and the choice between --load's and the non-persistent latest.
#include "trainer/checkpoint_retention.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include <fmt/core.h>

#include "absl/strings/numbers.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_header.h"

namespace ptk {
namespace {

namespace fs = std::filesystem;

// What a ptk save puts in an iteration directory: mp_rank_TT[_PPP]/model_optim_rng.ptk and nothing else (an
// empty directory is no save's: a save renames its directory in whole, a removal renames it away first).
bool HoldsOnlyPtkRankFiles(const fs::path& dir) {
  std::error_code ec;
  bool any = false;
  for (const auto& rank : fs::directory_iterator(dir, ec)) {
    any = true;
    if (rank.path().filename().string().rfind("mp_rank_", 0) != 0 || rank.is_symlink(ec) || !rank.is_directory(ec))
      return false;
    for (const auto& f : fs::directory_iterator(rank.path(), ec))
      if (f.path().filename() != "model_optim_rng.ptk" || f.is_symlink(ec)) return false;
    if (ec) return false;
  }
  return any && !ec;
}

// Every rank's file of the checkpoint in iteration directory `dir` (those its first file's header names) there at
// its recorded length, and with `checksums` its SHA-256 right (VerifyCheckpointDir).
absl::Status CheckpointDirWhole(const std::string& dir, bool checksums) {
  if (checksums) return VerifyCheckpointDir(dir);
  const std::string first = FirstRankFile(dir);
  PTK_RETURN_IF_ERROR(CheckCheckpointFileLength(first));
  PTK_ASSIGN_OR_RETURN(const SavedParallelism saved, ReadSavedParallelism(first));
  for (const std::string& file : SavedRankFiles(dir, saved)) PTK_RETURN_IF_ERROR(CheckCheckpointFileLength(file));
  return absl::OkStatus();
}

}  // namespace

std::string NonPersistentDir(const std::string& dir, const std::string& given) {
  return given.empty() ? JoinPath(dir, kNonPersistentSubdir) : given;
}

bool IsPtkIterationDir(const std::string& path, int64_t* iteration) {
  const std::string name = Basename(path);
  int64_t it = -1;
  if (name.rfind("iter_", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &it) || it < 0 ||
      Basename(CheckpointDir("", it)) != name)
    return false;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (ec || !fs::is_directory(st) || !HoldsOnlyPtkRankFiles(path)) return false;
  if (iteration != nullptr) *iteration = it;
  return true;
}

absl::StatusOr<std::vector<int64_t>> PtkIterations(const std::string& dir) {
  std::vector<int64_t> out;
  if (!IsDirectory(dir)) return out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    int64_t it = 0;
    if (IsPtkIterationDir(e.path().string(), &it)) out.push_back(it);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", dir, ec.message()));
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status RemoveCheckpointIteration(const std::string& dir, int64_t iteration) {
  const std::string path = CheckpointDir(dir, iteration);
  if (!IsPtkIterationDir(path))
    return absl::FailedPreconditionError(
        fmt::format("{}: not removed: not an iteration directory of ptk's checkpoints", path));
  if (absl::StatusOr<int64_t> latest = LatestCheckpointIteration(dir); latest.ok() && *latest == iteration)
    return absl::FailedPreconditionError(
        fmt::format("{}: not removed: latest_checkpointed_iteration.txt names it", path));
  const std::string away = fmt::format("{}{}{}", path, kRemovingTag, ::getpid());
  PTK_RETURN_IF_ERROR(CheckpointStep("rename checkpoint away"));
  PTK_RETURN_IF_ERROR(RenameFile(path, away));
  PTK_RETURN_IF_ERROR(CheckpointStep("fsync directory"));
  PTK_RETURN_IF_ERROR(FsyncDir(dir));
  PTK_RETURN_IF_ERROR(CheckpointStep("remove checkpoint"));
  std::error_code ec;
  fs::remove_all(away, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", away, ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<NonPersistentCleanup> CleanUpOldNonPersistent(const std::string& dir) {
  NonPersistentCleanup out;
  PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> found, PtkIterations(dir));
  if (found.empty()) return out;
  std::optional<int64_t> tracked;
  if (absl::StatusOr<int64_t> latest = LatestCheckpointIteration(dir); latest.ok()) {
    tracked = *latest;
  } else if (!absl::IsNotFound(latest.status())) {
    return latest.status();  // a damaged tracker: nothing is removed
  }
  const bool tracked_there = tracked && std::find(found.begin(), found.end(), *tracked) != found.end();
  std::vector<int64_t> keep;
  if (tracked_there) keep.push_back(*tracked);  // never removed, whole or not
  if (!tracked_there || !CheckpointDirWhole(CheckpointDir(dir, *tracked), /*checksums=*/false).ok()) {
    // The tracker's checkpoint is missing or damaged: the newest that verifies is kept too, and with none that
    // does, nothing is removed (a damaged checkpoint may still be all a user has).
    auto whole = std::find_if(found.rbegin(), found.rend(), [&](int64_t it) {
      return it != tracked && CheckpointDirWhole(CheckpointDir(dir, it), /*checksums=*/true).ok();
    });
    if (whole == found.rend()) keep = found;
    if (whole != found.rend()) keep.push_back(*whole);
  }
  for (int64_t it : found) {
    const bool kept = std::find(keep.begin(), keep.end(), it) != keep.end();
    (kept ? out.kept : out.removed).push_back(CheckpointDir(dir, it));
  }
  for (int64_t it : found)
    if (std::find(keep.begin(), keep.end(), it) == keep.end()) PTK_RETURN_IF_ERROR(RemoveCheckpointIteration(dir, it));
  return out;
}

std::string RetainAfterSave(const std::string& save, std::optional<int64_t> previous, int64_t iteration,
                            int64_t retain_interval) {
  if (retain_interval <= 0 || !previous || *previous <= 0 || *previous >= iteration || *previous % retain_interval == 0)
    return "";
  const std::string path = CheckpointDir(save, *previous);
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(path, ec)))
    return fmt::format("  skipping deleting checkpoint from iteration {:7d} at {} since it is a symbolic link",
                       *previous, save);
  if (!PathExists(path)) return "";  // removed already (a run killed after the removal, before its tracker)
  const absl::Status st = RemoveCheckpointIteration(save, *previous);
  if (!st.ok())
    return fmt::format("  encountered exception \"{}\" when trying to delete checkpoint from iteration {:7d} at {}",
                       StatusMessage(st), *previous, save);
  return fmt::format("  successfully deleted checkpoint from iteration {:7d} at {}", *previous, save);
}

absl::StatusOr<CheckpointChoice> ChooseCheckpointToLoad(const std::string& load, const std::string& non_persistent_dir,
                                                        std::optional<int64_t> ckpt_step) {
  CheckpointChoice choice;
  choice.dir = load;
  absl::StatusOr<int64_t> persistent = CheckpointToLoad(load, ckpt_step);
  if (!persistent.ok() && !absl::IsNotFound(persistent.status())) return persistent.status();
  if (non_persistent_dir.empty() || ckpt_step) {
    PTK_RETURN_IF_ERROR(persistent.status());
    choice.iteration = *persistent;
    return choice;
  }
  absl::StatusOr<int64_t> np = LatestCheckpointIteration(non_persistent_dir);
  if (absl::IsNotFound(np.status())) {
    choice.lines.push_back(fmt::format("WARNING: could not find the metadata file {}",
                                       JoinPath(non_persistent_dir, "latest_checkpointed_iteration.txt")));
    choice.lines.push_back("    will not load any non-persistent checkpoint");
  } else if (!np.ok()) {
    return np.status();
  } else if (!persistent.ok() || *np >= *persistent) {
    choice.dir = non_persistent_dir;
    choice.iteration = *np;
    choice.non_persistent = true;
    choice.lines.push_back(fmt::format("Loading from a non-persistent checkpoint (non-persistent iter {})", *np));
    return choice;
  } else {
    choice.lines.push_back("WARNING: non-persistent checkpoints are older than persistent checkpoint");
  }
  PTK_RETURN_IF_ERROR(persistent.status());
  choice.iteration = *persistent;
  return choice;
}

}  // namespace ptk
