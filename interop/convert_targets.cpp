// ptk-convert's checks of a --save-dir before a conversion writes into it: an import must not move a
// training run's latest checkpoint, a Megatron export must not replace ptk checkpoints.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

// The first regular file below `dir` (recursively, sorted) for which `match` holds, as a path relative
// to `save`; empty when there is none or no `dir`.
std::string FirstFileBelow(const std::string& save, const std::string& dir,
                           const std::function<bool(const std::string& name)>& match) {
  std::vector<std::string> found;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code ec2;
    if (it->is_regular_file(ec2) && match(it->path().filename().string()))
      found.push_back(std::filesystem::path(it->path()).lexically_relative(save).string());
  }
  return found.empty() ? std::string() : *std::min_element(found.begin(), found.end());
}

bool IsPtkCheckpointFile(const std::string& name) {
  return name.size() > 4 && (name.compare(name.size() - 4, 4, ".ptk") == 0 || name.find(".ptk-") != std::string::npos);
}

}  // namespace

absl::Status CheckMegatronExportTarget(const std::string& save) {
  std::error_code ec;
  std::vector<std::string> ptk_files;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) != 0) continue;
    std::string f = FirstFileBelow(save, e.path().string(), [](const std::string& n) {
      return n.size() > 4 && n.compare(n.size() - 4, 4, ".ptk") == 0;
    });
    if (!f.empty()) ptk_files.push_back(std::move(f));
  }
  if (ptk_files.empty()) return absl::OkStatus();
  std::sort(ptk_files.begin(), ptk_files.end());
  return UsageError(fmt::format(
      "--save-dir {}: holds ptk checkpoints ({}{}): a Megatron export writes iter_N/ and "
      "latest_checkpointed_iteration.txt there, replacing a ptk checkpoint or moving its latest; give a directory of "
      "its own",
      save, ptk_files.front(), ptk_files.size() > 1 ? fmt::format(" and {} more", ptk_files.size() - 1) : ""));
}

// An import writes iteration `iteration` (0 unless --iteration) and points the tracker at it: into
// the --save of a training run it would move `latest` (back, or past the run's own checkpoints) and
// make the next ptk-train --load restart from the imported weights. So the directory must hold no
// checkpoint but that iteration's (a new directory, or an earlier import, which a rerun replaces).
// An earlier import is told from a run's checkpoint by its AdamW step (0: a Hugging Face import), or
// where the import carries moments (a Megatron checkpoint's) by the command line in its header
// (ptk-convert's --saver; ptk-train takes no such flag).
absl::Status CheckImportTarget(const std::string& save, int64_t iteration, bool with_moments) {
  std::vector<std::string> iterations;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) == 0 && name != Basename(CheckpointDir(save, iteration))) iterations.push_back(name);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save, ec.message()));
  std::sort(iterations.begin(), iterations.end());
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(save);
  std::string held;
  if (latest.ok() && *latest != iteration) {
    held = fmt::format("its latest checkpoint is iteration {}", *latest);
  } else if (!latest.ok() && !absl::IsNotFound(latest.status())) {
    held = std::string(StatusMessage(latest.status()));
  } else if (!iterations.empty()) {
    held = fmt::format("it holds {}{}", iterations.back(),
                       iterations.size() > 1 ? fmt::format(" and {} more", iterations.size() - 1) : "");
  } else if (const std::string other = FirstFileBelow(save, CheckpointDir(save, iteration),
                                                      [](const std::string& n) { return !IsPtkCheckpointFile(n); });
             !other.empty()) {
    // Another tool's checkpoint of that iteration (Megatron's model_optim_rng.pt or *.distcp: --load-dir
    // itself, given as --save-dir): the import would replace it.
    return UsageError(fmt::format(
        "--save-dir {}: its iteration {} holds {}, which is not a ptk checkpoint's file (a Megatron checkpoint, or "
        "--load-dir itself): the import would replace it; import into a directory of its own",
        save, iteration, other));
  } else if (const std::string file = CheckpointFile(save, iteration); PathExists(file)) {
    // That iteration is there: an earlier import is replaced, a run's own is kept.
    PTK_ASSIGN_OR_RETURN(const std::string header, ReadCheckpointHeaderText(file));
    simdjson::dom::parser parser;
    simdjson::dom::element h;
    int64_t adam_step = 0;
    if (with_moments) {
      bool imported = false;
      simdjson::dom::array args;
      if (!parser.parse(header).get(h) && !h["args"].get(args))
        for (simdjson::dom::element a : args) {
          std::string_view v;
          if (!a.get(v) && (v == "--saver" || v.rfind("--saver=", 0) == 0)) imported = true;
        }
      if (!imported) held = fmt::format("its iteration {} was saved by a training run, not by an import", iteration);
    } else if (parser.parse(header).get(h) || h["adam_step"].get(adam_step) || adam_step != 0) {
      held = fmt::format("its iteration {} has taken {} AdamW steps: a run's, not an import", iteration, adam_step);
    }
  }
  if (held.empty()) return absl::OkStatus();
  return UsageError(
      fmt::format("--save-dir {}: holds a training run's checkpoints ({}); an import (iteration {}) would move "
                  "latest_checkpointed_iteration.txt or replace the run's checkpoint. Import into a new directory, "
                  "then ptk-train --load NEW{} --save {} to "
                  "continue from the imported weights",
                  save, held, iteration, iteration == 0 ? " --finetune" : "", save));
}

}  // namespace ptk
