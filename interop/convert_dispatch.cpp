// RunConvert: ptk-convert's four directions, and what --load-dir holds when its --loader does not read it.
#include <algorithm>
#include <filesystem>
#include <string>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "interop/megatron.h"

namespace ptk {
namespace {

// What `dir` holds, told by its files: "ptk" (iter_N/.../model_optim_rng.ptk), "megatron"
// (iter_N/.../model_optim_rng.pt, or torch_dist's .metadata and *.distcp), "hf" (config.json beside
// the weights), or "" (none of them, or more than one).
std::string CheckpointKind(const std::string& dir) {
  bool ptk = false, megatron = false;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::error_code ec2;
    if (e.path().filename().string().rfind("iter_", 0) != 0 || !e.is_directory(ec2)) continue;
    int seen = 0;  // a look, not a walk: enough entries to tell
    for (auto it = std::filesystem::recursive_directory_iterator(e.path(), ec2);
         !ec2 && it != std::filesystem::recursive_directory_iterator() && ++seen < 256; it.increment(ec2)) {
      const std::string name = it->path().filename().string();
      const auto ends = [&](std::string_view s) {
        return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
      };
      ptk |= ends(".ptk");
      megatron |= ends(".pt") || ends(".distcp") || name == ".metadata";
    }
  }
  const bool hf =
      PathExists(JoinPath(dir, "config.json")) &&
      (PathExists(JoinPath(dir, "model.safetensors")) || PathExists(JoinPath(dir, "model.safetensors.index.json")) ||
       PathExists(JoinPath(dir, "pytorch_model.bin")));
  if (ptk + megatron + hf != 1) return "";
  return ptk ? "ptk" : megatron ? "megatron" : "hf";
}

absl::StatusOr<ConvertSummary> Dispatch(const ConvertOptions& o) {
  if (o.loader == "ptk" && o.saver == "hf") return ExportToHf(o);
  if (o.loader == "hf" && o.saver == "ptk") return ImportFromHf(o);
  if (o.loader == "megatron" && o.saver == "ptk") return ImportFromMegatron(o);
  if (o.loader == "ptk" && o.saver == "megatron") {
    PTK_RETURN_IF_ERROR(CheckMegatronExportTarget(o.save_dir));
    return ExportToMegatron(o);
  }
  return UsageError(
      fmt::format("--loader {} --saver {}: ptk-convert converts ptk to hf or megatron, and hf or megatron to ptk",
                  o.loader, o.saver));
}

// A --load-dir that is no directory (a typo, a file) or one iteration of a --save directory: said so, where
// each loader said only that a file in it was missing.
absl::Status CheckLoadDir(const ConvertOptions& o) {
  const char* holds = o.loader == "hf" ? "the Hugging Face model's directory (config.json and its weights)"
                                       : "the --save directory (with latest_checkpointed_iteration.txt in it)";
  if (!PathExists(o.load_dir))
    return absl::NotFoundError(fmt::format("--load-dir {}: no such directory; give {}", o.load_dir, holds));
  if (!IsDirectory(o.load_dir))
    return absl::InvalidArgumentError(
        fmt::format("--load-dir {}: a file, not a directory; give {}", o.load_dir, holds));
  std::string dir = std::filesystem::path(o.load_dir).lexically_normal().string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string name = Basename(dir), parent = Dirname(dir);
  if (o.loader != "hf" && !PathExists(JoinPath(o.load_dir, "latest_checkpointed_iteration.txt")) &&
      (name.rfind("iter_", 0) == 0 || name == "release") &&
      PathExists(JoinPath(parent, "latest_checkpointed_iteration.txt")))
    return absl::InvalidArgumentError(fmt::format(
        "--load-dir {}: one iteration of a checkpoint; give its --save directory, {} (its latest iteration, named "
        "by latest_checkpointed_iteration.txt, is read)",
        o.load_dir, parent));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConvertSummary> RunConvert(const ConvertOptions& o) {
  if ((o.loader == "ptk") != (o.saver == "ptk")) PTK_RETURN_IF_ERROR(CheckLoadDir(o));  // a direction ptk converts
  absl::StatusOr<ConvertSummary> r = Dispatch(o);
  if (r.ok() || IsUsageError(r.status())) return r;
  // --loader megatron over a ptk checkpoint said only "model_optim_rng.pt: missing ... this one is
  // absent", --loader ptk over Megatron's "cannot open ...model_optim_rng.ptk": say what is there.
  const std::string kind = CheckpointKind(o.load_dir);
  if (kind.empty() || kind == o.loader) return r;
  const char* what = kind == "ptk"  ? "a ptk checkpoint"
                     : kind == "hf" ? "a Hugging Face directory"
                                    : "a Megatron checkpoint";
  return absl::Status(r.status().code(), fmt::format("{} (--load-dir {} holds {}: --loader {} reads it)",
                                                     StatusMessage(r.status()), o.load_dir, what, kind));
}

}  // namespace ptk
