// ptk-train's flags for Megatron's non-persistent checkpoints and --save-retain-interval: declared, then
// checked against --save, --load and --save-interval (one line naming the flag for what makes no sense).
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"
#include "tools/train_flags.h"
#include "trainer/checkpoint_retention.h"

namespace ptk::train_flags {
namespace {

// Two spellings of one directory (a trailing slash, a relative path, a link to it) compared as one.
bool SameDirectory(const std::string& a, const std::string& b) {
  auto resolved = [](const std::string& p) {
    std::error_code ec;
    std::filesystem::path r = std::filesystem::weakly_canonical(p, ec);
    if (ec) r = std::filesystem::path(p).lexically_normal();
    return r.has_filename() ? r : r.parent_path();  // "s/" is "s"
  };
  return resolved(a) == resolved(b);
}

// --non-persistent-ckpt-type's value: global taken, the others refused saying why.
absl::Status CheckNonPersistentType(const std::string& type) {
  if (type.empty() || type == "global") return absl::OkStatus();
  if (type == "local")
    return UsageError(
        "--non-persistent-ckpt-type local: local checkpoints (each rank's part on its own node's storage) need "
        "NVIDIA's resiliency extension (nvidia_resiliency_ext), which ptk does not have; use global (written as "
        "--save's are, into --non-persistent-global-ckpt-dir or SAVE/non_persistent)");
  if (type == "in_memory")
    return UsageError(
        "--non-persistent-ckpt-type in_memory: not implemented by Megatron 0.16 either (its arguments accept global "
        "and local only); use global");
  return UsageError(
      fmt::format("--non-persistent-ckpt-type {}: not a type (global; Megatron's local is refused)", type));
}

// --save-retain-interval against --save and --save-interval (Megatron's validate_args).
absl::Status CheckRetainInterval(const TrainOptions& o) {
  const int64_t n = o.save_retain_interval;
  if (n == 0) return absl::OkStatus();
  if (o.save.empty())
    return UsageError(fmt::format("--save-retain-interval {} without --save: there are no checkpoints to thin out", n));
  if (o.save_interval <= 0)
    return UsageError(
        fmt::format("--save-retain-interval {} needs --save-interval (Megatron's): the checkpoints kept are those of "
                    "iterations that are multiples of it",
                    n));
  if (n % o.save_interval != 0)
    return UsageError(fmt::format(
        "--save-retain-interval {} must be a multiple of --save-interval {} (Megatron's check): the checkpoints it "
        "keeps are --save-interval's",
        n, o.save_interval));
  return absl::OkStatus();
}

}  // namespace

void AddCheckpointKeepingFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_option("--non-persistent-save-interval", o.non_persistent_save_interval,
                  "Save a non-persistent checkpoint every N iterations (with --non-persistent-ckpt-type global; "
                  "each such save removes the older ones)")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--non-persistent-ckpt-type", f->non_persistent_ckpt_type,
                  "global: non-persistent checkpoints written as --save's are, into --non-persistent-global-ckpt-dir "
                  "(default SAVE/non_persistent); --load then resumes from the newer of the two latest (local and "
                  "in_memory refused)");
  app->add_option("--non-persistent-global-ckpt-dir", f->non_persistent_global_ckpt_dir,
                  "Directory of the global non-persistent checkpoints (default SAVE/non_persistent, and "
                  "LOAD/non_persistent to resume)");
  app->add_option("--non-persistent-local-ckpt-dir", f->non_persistent_local_ckpt_dir,
                  "Local non-persistent checkpoints' directory: no effect (local checkpoints are refused)");
  app->add_option("--non-persistent-local-ckpt-algo", f->non_persistent_local_ckpt_algo,
                  "fully_parallel or atomic: local non-persistent checkpoints' algorithm: no effect (local "
                  "checkpoints are refused)")
      ->check(CLI::IsMember({"fully_parallel", "atomic"}));
  app->add_option("--save-retain-interval", o.save_retain_interval,
                  "After each save, remove the previous checkpoint unless its iteration is a multiple of N (a "
                  "multiple of --save-interval; the latest is always kept)")
      ->check(IntIn(1, kMaxCount));
}

absl::Status ResolveCheckpointKeeping(const TrainFlags& f, TrainOptions* out, std::vector<std::string>* notes) {
  TrainOptions& o = *out;
  const std::string& type = f.non_persistent_ckpt_type;
  PTK_RETURN_IF_ERROR(CheckNonPersistentType(type));
  const int64_t every = o.non_persistent_save_interval;
  if (every > 0 && type.empty())
    return UsageError(fmt::format(
        "--non-persistent-save-interval {} needs --non-persistent-ckpt-type global (Megatron stops at the first "
        "non-persistent save without it)",
        every));
  if (every > 0 && o.save.empty())
    return UsageError(
        fmt::format("--non-persistent-save-interval {} without --save: Megatron saves no checkpoint without --save, "
                    "non-persistent ones neither",
                    every));
  const std::string& given = f.non_persistent_global_ckpt_dir;
  if (!given.empty() && type.empty())
    return UsageError(
        fmt::format("--non-persistent-global-ckpt-dir {} needs --non-persistent-ckpt-type global", given));
  for (const auto& [flag, dir] : {std::pair{"--save", o.save}, std::pair{"--load", o.load}})
    if (!given.empty() && !dir.empty() && SameDirectory(given, dir))
      return UsageError(fmt::format(
          "--non-persistent-global-ckpt-dir {} is {}: each non-persistent save removes the older checkpoints of its "
          "directory; give one of its own (or none: SAVE/non_persistent)",
          given, flag));
  for (const auto& [flag, value] : {std::pair{"--non-persistent-local-ckpt-dir", f.non_persistent_local_ckpt_dir},
                                    std::pair{"--non-persistent-local-ckpt-algo", f.non_persistent_local_ckpt_algo}})
    if (!value.empty())
      notes->push_back(
          fmt::format("{} {}: accepted, no effect: it is local checkpoints', and ptk writes global ones", flag, value));
  if (type == "global") {
    if (!o.save.empty()) o.non_persistent_dir = NonPersistentDir(o.save, given);
    if (!o.load.empty()) o.non_persistent_load_dir = NonPersistentDir(o.load, given);
    // SAVE/non_persistent made a symbolic link to --save or --load: its cleanup would remove their checkpoints.
    for (const auto& [flag, dir] : {std::pair{"--save", o.save}, std::pair{"--load", o.load}})
      if (given.empty() && !o.non_persistent_dir.empty() && !dir.empty() && SameDirectory(o.non_persistent_dir, dir))
        return UsageError(fmt::format(
            "{} is {} {} itself (a symbolic link): each non-persistent save removes the older checkpoints of its "
            "directory; give --non-persistent-global-ckpt-dir a directory of its own",
            o.non_persistent_dir, flag, dir));
    if (every == 0 && o.load.empty())
      notes->push_back(
          "--non-persistent-ckpt-type global without --non-persistent-save-interval or --load: no non-persistent "
          "checkpoint is saved or loaded");
  }
  return CheckRetainInterval(o);
}

}  // namespace ptk::train_flags
