// Publishing a Hugging Face export directory whole (hf_export_dir.h).
#include "interop/hf_export_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <iterator>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/status.h"
#include "interop/hf_shards.h"

namespace ptk {
namespace hf_detail {
namespace {

constexpr char kExportNewTag[] = ".ptk-tmp-";
constexpr char kExportOldTag[] = ".ptk-old-";
// What an export writes: a directory holding these (and shards, IsShardFileName) and nothing else is a
// ptk export.
constexpr const char* kExportFiles[] = {
    "config.json", "generation_config.json", "tokenizer_config.json",       "vocab.json",
    "merges.txt",  "model.safetensors",      "model.safetensors.index.json"};

// An export's file, or the temporary of one that an older ptk-convert, which replaced the files one by
// one, left when killed.
bool IsExportFile(const std::string& name) {
  const bool shard_tmp =
      name.size() > 32 && IsShardFileName(std::string_view(name).substr(0, 32)) && name.compare(32, 8, ".ptk-tmp") == 0;
  return IsShardFileName(name) || shard_tmp ||
         std::find_if(std::begin(kExportFiles), std::end(kExportFiles), [&](const char* f) {
           return name == f || name.rfind(std::string(f) + ".ptk-tmp", 0) == 0;
         }) != std::end(kExportFiles);
}

ExportStepHook& ExportHook() {
  static ExportStepHook hook;
  return hook;
}

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", path, ec.message()));
  return absl::OkStatus();
}

// The copies of `target` that earlier exports left beside it: (old copies, new copies), sorted.
absl::StatusOr<std::pair<std::vector<std::string>, std::vector<std::string>>> ExportCopies(const std::string& target) {
  std::pair<std::vector<std::string>, std::vector<std::string>> out;
  const std::string base = Basename(target);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(Dirname(target), ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    if (!e.is_directory(ec2)) continue;
    if (name.rfind(base + kExportOldTag, 0) == 0) out.first.push_back(e.path().string());
    if (name.rfind(base + kExportNewTag, 0) == 0) out.second.push_back(e.path().string());
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", Dirname(target), ec.message()));
  std::sort(out.first.begin(), out.first.end());
  std::sort(out.second.begin(), out.second.end());
  return out;
}

}  // namespace

absl::Status ExportStep(std::string_view name) { return ExportHook() ? ExportHook()(name) : absl::OkStatus(); }

absl::StatusOr<std::string> ExportTarget(const std::string& save_dir) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(save_dir, ec);
  if (ec || save_dir.empty()) return UsageError(fmt::format("--save-dir {:?}: not a usable directory name", save_dir));
  std::string dir = p.lexically_normal().string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir == "/") return UsageError("--save-dir /: an export needs a directory of its own");
  return dir;
}

std::string ExportNewCopy(const std::string& target) {
  return fmt::format("{}{}{}", target, kExportNewTag, ::getpid());
}
std::string ExportOldCopy(const std::string& target) {
  return fmt::format("{}{}{}", target, kExportOldTag, ::getpid());
}

absl::Status RecoverExport(const std::string& target) {
  PTK_ASSIGN_OR_RETURN(auto copies, ExportCopies(target));
  auto& [olds, news] = copies;
  if (!PathExists(target) && !olds.empty()) {
    PTK_RETURN_IF_ERROR(RenameFile(olds.front(), target));
    PTK_RETURN_IF_ERROR(FsyncDir(Dirname(target)));
    log::Info("{}: the export an interrupted ptk-convert had renamed aside ({}) is put back", target, olds.front());
    olds.erase(olds.begin());
  }
  for (const std::string& p : olds) PTK_RETURN_IF_ERROR(RemoveTree(p));
  for (const std::string& p : news) PTK_RETURN_IF_ERROR(RemoveTree(p));
  RemoveStaleTemporaries(target);
  return absl::OkStatus();
}

absl::Status CheckExportTarget(const std::string& target, bool force) {
  std::error_code ec;
  const auto st = std::filesystem::symlink_status(target, ec);
  if (ec || st.type() == std::filesystem::file_type::not_found) return absl::OkStatus();
  if (st.type() == std::filesystem::file_type::symlink)
    return UsageError(fmt::format(
        "--save-dir {}: is a symbolic link (an export replaces its directory whole): give the directory it names",
        target));
  if (st.type() != std::filesystem::file_type::directory)
    return UsageError(fmt::format("--save-dir {}: exists and is not a directory", target));
  std::vector<std::string> foreign;
  for (const auto& e : std::filesystem::directory_iterator(target, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    if (!e.is_regular_file(ec2) || !IsExportFile(name)) foreign.push_back(name);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", target, ec.message()));
  if (foreign.empty() || force) return absl::OkStatus();
  std::sort(foreign.begin(), foreign.end());
  std::string shown;
  for (size_t i = 0; i < foreign.size() && i < 5; ++i) shown += (i ? ", " : "") + foreign[i];
  if (foreign.size() > 5) shown += fmt::format(" and {} more", foreign.size() - 5);
  return UsageError(fmt::format(
      "--save-dir {}: holds {} that a ptk export does not write ({}): give a new or empty directory, or --force "
      "to replace the directory whole (everything in it is removed)",
      target, foreign.size() == 1 ? "an entry" : fmt::format("{} entries", foreign.size()), shown));
}

absl::Status CheckNotInside(const std::string& target, const char* what, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::error_code ec;
  const std::string t = std::filesystem::weakly_canonical(target, ec).string();
  if (ec) return absl::OkStatus();
  const std::string p = std::filesystem::weakly_canonical(path, ec).string();
  if (ec || (p != t && p.rfind(t + "/", 0) != 0)) return absl::OkStatus();
  return UsageError(fmt::format(
      "--save-dir {}: holds {} ({}), and an export replaces its directory whole: give a directory of its own", target,
      what, path));
}

absl::Status PublishExport(const std::string& tmp, const std::string& target, const std::string& old) {
  const std::string parent = Dirname(target);
  std::string leftover;  // the old export, once out of the target's place
  if (!PathExists(target)) {
    PTK_RETURN_IF_ERROR(ExportStep("rename new export in"));
    PTK_RETURN_IF_ERROR(RenameFile(tmp, target));
  } else {
    absl::Status exchange = ExportStep("exchange directories");
    int err = 0;
    if (exchange.ok()) {
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
        leftover = tmp;
      } else {
        err = errno;
      }
    } else if (absl::IsUnimplemented(exchange)) {
      err = EINVAL;  // a test's hook: as on a filesystem that cannot exchange
    } else {
      return exchange;
    }
    if (leftover.empty()) {
      if (err != EINVAL && err != ENOSYS && err != ENOTSUP)
        return ErrnoToStatus(err, fmt::format("exchange {} and {}", tmp, target));
      PTK_RETURN_IF_ERROR(ExportStep("rename old export aside"));
      PTK_RETURN_IF_ERROR(RenameFile(target, old));
      PTK_RETURN_IF_ERROR(ExportStep("rename new export in"));
      PTK_RETURN_IF_ERROR(RenameFile(tmp, target));
      leftover = old;
    }
  }
  PTK_RETURN_IF_ERROR(ExportStep("fsync parent directory"));
  PTK_RETURN_IF_ERROR(FsyncDir(parent));
  if (leftover.empty()) return absl::OkStatus();
  PTK_RETURN_IF_ERROR(ExportStep("remove old export"));
  return RemoveTree(leftover);
}

absl::Status RefuseMtp(const PtkCheckpoint& ck) {
  if (ck.config.mtp_num_layers <= 0) return absl::OkStatus();
  return absl::UnimplementedError(
      fmt::format("{}: a multi-token prediction model (--mtp-num-layers {}): ptk-convert does not export MTP "
                  "checkpoints to Hugging Face (DeepseekV3ForCausalLM has no MTP layers; --saver megatron writes them)",
                  ck.file, ck.config.mtp_num_layers));
}

}  // namespace hf_detail

void SetExportStepHookForTesting(ExportStepHook hook) { hf_detail::ExportHook() = std::move(hook); }

}  // namespace ptk
