// Megatron's non-persistent (global) checkpoints and --save-retain-interval: where the non-persistent ones go,
// which old checkpoints a save removes (and how, so that a kill never leaves half of one under its name), and
// which of --load's and the non-persistent directory's latest checkpoints a resume loads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

// Megatron's _NON_PERSISTENT_CKPT_SUBDIR: non-persistent checkpoints go to <save>/non_persistent unless
// --non-persistent-global-ckpt-dir names a directory.
inline constexpr char kNonPersistentSubdir[] = "non_persistent";
// `given` (--non-persistent-global-ckpt-dir) when not empty, else <dir>/non_persistent (dir: --save or --load).
std::string NonPersistentDir(const std::string& dir, const std::string& given);

// Whether `path` is an iteration directory a ptk save writes: named exactly as CheckpointDir names one
// (iter_ and seven or more digits), a directory and not a symbolic link, holding nothing but mp_rank_*
// directories that hold nothing but model_optim_rng.ptk (a damaged or half-written one still counts; an empty
// directory, a Megatron checkpoint, another tool's files or anything a user put there does not). Its iteration in
// *iteration.
bool IsPtkIterationDir(const std::string& path, int64_t* iteration = nullptr);

// The iterations of `dir`'s directories IsPtkIterationDir recognises, ascending (none when `dir` is missing).
absl::StatusOr<std::vector<int64_t>> PtkIterations(const std::string& dir);

// Removes the checkpoint of `iteration` in `dir`: its directory is first renamed to a name no load reads
// (iter_N.ptk-removing-PID, fsynced) and only then deleted, so a kill leaves the whole checkpoint or none
// under its name; RecoverCheckpointDir finishes a removal a kill interrupted. Refused (FailedPrecondition)
// for a directory IsPtkIterationDir does not recognise and for the iteration `dir`'s tracker names.
absl::Status RemoveCheckpointIteration(const std::string& dir, int64_t iteration);

// Megatron's cleanup_old_non_persistent_checkpoint before a non-persistent save into `dir`: every
// checkpoint there but one is removed. The one kept is the one the tracker names (Megatron keeps the
// newest, which is the same unless a kill came between a save's rename and its tracker). Where the tracker
// names none, a missing one or one not whole (a rank's file gone or cut short), the newest that verifies
// (VerifyCheckpointDir) is kept too, and with none that does nothing is removed: a bad tracker never costs the
// last usable checkpoint. A damaged tracker: an error, nothing removed. `removed` and `kept` list the iteration
// directories, for Megatron's two lines.
struct NonPersistentCleanup {
  std::vector<std::string> removed, kept;
};
absl::StatusOr<NonPersistentCleanup> CleanUpOldNonPersistent(const std::string& dir);

// Megatron's --save-retain-interval after a save of `iteration` into `save` is complete: the checkpoint
// the tracker named before it (`previous`) is removed when it is older, not a multiple of
// `retain_interval`, and a ptk iteration directory (a symbolic link, Megatron's skip, or anything else is
// kept). Returns the line to print (Megatron's "successfully deleted checkpoint ...", its "skipping ..."
// for a link, or why a removal failed: never fatal, as Megatron's), "" when nothing was to remove.
std::string RetainAfterSave(const std::string& save, std::optional<int64_t> previous, int64_t iteration,
                            int64_t retain_interval);

// What --load resumes from (Megatron's _load_base_checkpoint): --load's latest checkpoint (CheckpointToLoad),
// or where `non_persistent_dir` is given (--non-persistent-ckpt-type global) and its tracker names an
// iteration at least as new, that one. --ckpt-step names one of --load's and skips the non-persistent
// directory. NotFound where neither holds a checkpoint (--load's status). `lines`: Megatron's lines about
// the non-persistent checkpoint, for rank 0 to print.
struct CheckpointChoice {
  std::string dir;  // --load, or the non-persistent directory
  int64_t iteration = 0;
  bool non_persistent = false;
  std::vector<std::string> lines;
};
absl::StatusOr<CheckpointChoice> ChooseCheckpointToLoad(const std::string& load, const std::string& non_persistent_dir,
                                                        std::optional<int64_t> ckpt_step);

}  // namespace ptk
