// Publishing a Hugging Face export directory whole: the target's checks, the swap, what a kill left.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "interop/hf_gpt2.h"

namespace ptk::hf_detail {

// The new export is written into TARGET.ptk-tmp-PID beside the
// target and swapped in: rename(2) when there is no target, else renameat2(RENAME_EXCHANGE) (one
// atomic step: readers see the old directory or the new one), or where the filesystem cannot
// exchange (EINVAL: NFS, some FUSE), two renames: the target aside as TARGET.ptk-old-PID, the new
// one in. The copy left beside is removed last. RecoverExport, run by the next export under the
// lock, renames an old copy back when a kill fell between the two renames and removes the rest.

// SetExportStepHookForTesting's hook at a step, by name (OK without a hook).
absl::Status ExportStep(std::string_view name);

// --save-dir as one absolute directory name ("hf/", "./hf" and "hf" are one target).
absl::StatusOr<std::string> ExportTarget(const std::string& save_dir);
// Where this process writes the new export beside `target`, and where the two-rename path puts the
// old one aside.
std::string ExportNewCopy(const std::string& target);
std::string ExportOldCopy(const std::string& target);

// What a killed or failed export left beside `target`: an old copy renamed back when the target is
// missing (a kill between the two renames), every other copy removed. Call under the target's lock.
absl::Status RecoverExport(const std::string& target);

// The target may be missing, empty or an earlier export (exactly the files an export writes);
// anything else (another model's files beside ours) is replaced only with --force.
absl::Status CheckExportTarget(const std::string& target, bool force);

// The export replaces `target` whole (with --force, whatever it holds): never a directory that
// holds what the export reads, or the current directory.
absl::Status CheckNotInside(const std::string& target, const char* what, const std::string& path);

// Swaps the complete, synced export `tmp` in as `target` (see above); `old` names the aside copy of
// the two-rename path.
absl::Status PublishExport(const std::string& tmp, const std::string& target, const std::string& old);

// A checkpoint of ptk-train's multi-token prediction depths (--mtp-num-layers) refused: no Hugging Face class here
// holds them (DeepseekV3ForCausalLM has no MTP layers); --saver megatron writes them.
absl::Status RefuseMtp(const PtkCheckpoint& ck);

}  // namespace ptk::hf_detail
