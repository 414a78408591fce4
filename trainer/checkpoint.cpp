// Megatron-layout checkpoints, written atomically and verified on load.
#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>

#include <fmt/core.h>
#include <simdjson.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/json_keys.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/status.h"
#include "trainer/checkpoint_header.h"
#include "trainer/checkpoint_retention.h"

namespace ptk {
namespace {

constexpr char kTracker[] = "latest_checkpointed_iteration.txt";
constexpr char kTmpTag[] = ".ptk-tmp-";  // a save's new directory, before it is renamed in
constexpr char kOldTag[] = ".ptk-old-";  // an older copy of the same iteration, renamed aside

SaveStepHook& Hook() {
  static SaveStepHook hook;
  return hook;
}

absl::Status Step(std::string_view name) {
  if (Hook()) return Hook()(name);
  return absl::OkStatus();
}

// Megatron's own formats, recognised so that --load on one says what it is: the legacy torch
// format (mp_rank_00/model_optim_rng.pt) and torch_dist (*.distcp shards, metadata.json, common.pt).
std::string MegatronTorchCheckpointIn(const std::string& dir) {
  const std::string legacy = JoinPath(dir, "mp_rank_00/model_optim_rng.pt");
  if (PathExists(legacy)) return legacy;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 7 && name.compare(name.size() - 7, 7, ".distcp") == 0) return e.path().string();
    if (name == "common.pt") return e.path().string();
    if (name.rfind("mp_rank_", 0) == 0 && PathExists(JoinPath(e.path().string(), "model_optim_rng.pt")))
      return JoinPath(e.path().string(), "model_optim_rng.pt");
  }
  return "";
}

// What to do with Megatron's checkpoint (a file MegatronTorchCheckpointIn found) under `load`: either
// format converts with ptk-convert.
std::string ConvertHint(const std::string& load) {
  return fmt::format("convert it with ptk-convert --loader megatron --saver ptk --load-dir {} --save-dir DIR", load);
}

}  // namespace

void SetSaveStepHookForTesting(SaveStepHook hook) { Hook() = std::move(hook); }
absl::Status CheckpointStep(std::string_view name) { return Step(name); }

std::string CheckpointDir(const std::string& save, int64_t iteration) {
  return JoinPath(save, fmt::format("iter_{:07d}", iteration));
}
std::string MpRankDir(int tensor_rank, int pipeline_rank, int pipeline_size, int expert_rank, int expert_size) {
  std::string dir = pipeline_size > 1 ? fmt::format("mp_rank_{:02d}_{:03d}", tensor_rank, pipeline_rank)
                                      : fmt::format("mp_rank_{:02d}", tensor_rank);
  if (expert_size > 1) dir += fmt::format("_{:03d}", expert_rank);  // Megatron's get_checkpoint_name
  return dir;
}
std::string MpRankFile(int tensor_rank, int pipeline_rank, int pipeline_size, int expert_rank, int expert_size) {
  return JoinPath(MpRankDir(tensor_rank, pipeline_rank, pipeline_size, expert_rank, expert_size),
                  "model_optim_rng.ptk");
}
std::string FirstRankFile(const std::string& dir) {
  const std::string one_stage = JoinPath(dir, MpRankFile(0));
  const std::string staged = JoinPath(dir, MpRankFile(0, 0, 2));      // stages or expert ranks: mp_rank_00_000
  const std::string both = JoinPath(dir, MpRankFile(0, 0, 2, 0, 2));  // stages and expert ranks: mp_rank_00_000_000
  for (const std::string& file : {one_stage, staged, both})
    if (PathExists(file)) return file;
  return one_stage;  // none: the one named in the error
}
std::string CheckpointFile(const std::string& save, int64_t iteration, int tensor_rank) {
  const std::string dir = CheckpointDir(save, iteration);
  if (tensor_rank == 0) return FirstRankFile(dir);
  return JoinPath(dir, MpRankFile(tensor_rank));
}

std::string NotAPtkCheckpoint(std::string_view head) {
  if (head.substr(0, 4) == std::string_view("PK\x03\x04", 4))
    return "not a ptk checkpoint (bad magic): it is a zip archive, PyTorch's torch.save format (Megatron's "
           "model_optim_rng.pt?); ptk-convert --loader megatron --saver ptk converts a Megatron checkpoint";
  return "not a ptk checkpoint (bad magic)";
}

namespace {

absl::Status RemoveAllOrError(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", path, ec.message()));
  return absl::OkStatus();
}

// The checkpoint file: magic, header length, header, then each array's bytes, then the hex
// SHA-256 of everything before it. Committed (fsynced, renamed) inside the temporary directory.
// `progress` (may be null) counts the arrays' bytes as they are written, and the file once committed.
absl::Status WriteCheckpointFile(const std::string& file, const std::string& header,
                                 std::initializer_list<std::span<const float>> arrays, ProgressReporter* progress) {
  PTK_RETURN_IF_ERROR(Step("write checkpoint file"));
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(file));
  Sha256 sha;
  auto put = [&](const void* data, size_t size) -> absl::Status {
    sha.Update(data, size);
    return w->Write(data, size);
  };
  const uint64_t len = header.size();
  PTK_RETURN_IF_ERROR(put(kMagic, sizeof kMagic));
  PTK_RETURN_IF_ERROR(put(&len, sizeof len));
  PTK_RETURN_IF_ERROR(put(header.data(), header.size()));
  constexpr size_t kPiece = 64 << 20;  // a large model's arrays are GBs: counted as they go
  for (std::span<const float> a : arrays) {
    const auto* bytes = reinterpret_cast<const char*>(a.data());
    for (size_t at = 0; at < a.size_bytes(); at += kPiece) {
      const size_t n = std::min(kPiece, a.size_bytes() - at);
      PTK_RETURN_IF_ERROR(put(bytes + at, n));
      if (progress != nullptr) {
        progress->AddBytes(n);
        progress->Refresh();
      }
    }
  }
  PTK_RETURN_IF_ERROR(w->Write(sha.HexDigest()));
  PTK_RETURN_IF_ERROR(Step("fsync checkpoint file"));
  PTK_RETURN_IF_ERROR(w->Commit());
  if (progress != nullptr) {
    progress->AddItems(1);
    progress->Refresh();
  }
  return absl::OkStatus();
}

// Moves the complete temporary directory of an iteration into place. An existing directory of
// the same iteration (a rerun over a finished run) is renamed aside and removed only once the new
// one is in place: at every instant one complete copy is iter_N or lies aside for
// RecoverCheckpointDir to rename back.
absl::Status PublishDirectory(const std::string& save, const std::string& tmp_dir, const std::string& final_dir,
                              const std::string& old_dir, const std::vector<std::string>& rank_dirs) {
  PTK_RETURN_IF_ERROR(Step("fsync temporary directory"));
  for (const std::string& d : rank_dirs) PTK_RETURN_IF_ERROR(FsyncDir(JoinPath(tmp_dir, d)));
  PTK_RETURN_IF_ERROR(FsyncDir(tmp_dir));
  const bool replacing = PathExists(final_dir);  // rename(2) cannot replace a non-empty directory
  if (replacing) {
    PTK_RETURN_IF_ERROR(RemoveAllOrError(old_dir));
    PTK_RETURN_IF_ERROR(Step("rename old directory aside"));
    PTK_RETURN_IF_ERROR(RenameFile(final_dir, old_dir));
  }
  PTK_RETURN_IF_ERROR(Step("rename new directory in"));
  PTK_RETURN_IF_ERROR(RenameFile(tmp_dir, final_dir));
  PTK_RETURN_IF_ERROR(Step("fsync save directory"));
  PTK_RETURN_IF_ERROR(FsyncDir(save));
  if (replacing) {
    PTK_RETURN_IF_ERROR(Step("remove old directory"));
    PTK_RETURN_IF_ERROR(RemoveAllOrError(old_dir));
  }
  return absl::OkStatus();
}

// A directory of the iteration about to be saved is replaced (a rerun over a finished run) only when it is ptk's
// own, or empty, or a symbolic link (the link replaced, never what it points to): one holding anything else (a
// user's notes, another tool's files) would be deleted with it.
absl::Status CheckReplaceable(const std::string& final_dir) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::symlink_status(final_dir, ec);
  if (ec || !std::filesystem::is_directory(st) || IsPtkIterationDir(final_dir) ||
      std::filesystem::is_empty(final_dir, ec))
    return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{}: not replaced by this save: it holds files a ptk save does not write (they would be deleted "
                  "with it); move them, or the directory, away",
                  final_dir));
}

absl::Status WriteTracker(const std::string& save, int64_t iteration) {
  PTK_RETURN_IF_ERROR(Step("write tracker"));
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(JoinPath(save, kTracker)));
  PTK_RETURN_IF_ERROR(w->Write(std::to_string(iteration)));
  PTK_RETURN_IF_ERROR(Step("commit tracker"));
  return w->Commit();
}

// The copies of one iteration directory (iter_0000100) that saves left aside: the older copies
// a rerun moved aside first (the tracker may name them), then new ones never renamed in.
struct AsideCopies {
  std::vector<std::string> paths;
  size_t num_old = 0;
};
absl::StatusOr<AsideCopies> FindAsideCopies(const std::string& save, const std::string& base) {
  std::vector<std::string> tmp, old;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(base + kTmpTag, 0) == 0) tmp.push_back(e.path().string());
    if (name.rfind(base + kOldTag, 0) == 0) old.push_back(e.path().string());
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save, ec.message()));
  std::sort(old.begin(), old.end());
  std::sort(tmp.begin(), tmp.end());
  AsideCopies a;
  a.paths = old;
  a.paths.insert(a.paths.end(), tmp.begin(), tmp.end());
  a.num_old = old.size();
  return a;
}

// For one iteration directory name: when the directory is missing, renames back the first
// complete copy lying aside (an old one, or a new one too when `restore_new`); then removes the
// copies left aside.
absl::Status RecoverIteration(const std::string& save, const std::string& base, bool restore_new) {
  PTK_ASSIGN_OR_RETURN(AsideCopies copies, FindAsideCopies(save, base));
  std::vector<std::string>& aside = copies.paths;
  const std::string final_dir = JoinPath(save, base);
  if (!PathExists(final_dir)) {
    for (auto it = aside.begin(); it != aside.end(); ++it) {
      if (!restore_new && it - aside.begin() >= static_cast<std::ptrdiff_t>(copies.num_old)) break;
      absl::Status whole = VerifyCheckpointFile(FirstRankFile(*it));
      if (!whole.ok()) continue;
      PTK_RETURN_IF_ERROR(RenameFile(*it, final_dir));
      PTK_RETURN_IF_ERROR(FsyncDir(save));
      log::Info("{}: restored from {}, a complete copy an interrupted save left aside", final_dir, *it);
      aside.erase(it);
      break;
    }
  }
  for (const std::string& path : aside) PTK_RETURN_IF_ERROR(RemoveAllOrError(path));
  return absl::OkStatus();
}

// A run's first save killed once its directory was in place (renamed in by the save, or by
// RecoverIteration from its temporary name) and before the tracker named it leaves the only
// iteration directory of `save`, complete, and no tracker: the tracker is written to name it, so
// that the next --load resumes there instead of starting anew beside it. Anything else without a
// tracker (several iteration directories, a damaged one) is no killed save's and is left alone.
absl::Status NameKilledFirstSave(const std::string& save) {
  if (PathExists(JoinPath(save, kTracker))) return absl::OkStatus();
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    int64_t it = -1;  // iter_ and the digits CheckpointDir writes, nothing else
    if (name.rfind("iter_", 0) != 0 || !e.is_directory(ec) || !absl::SimpleAtoi(name.substr(5), &it)) continue;
    if (it >= 0 && Basename(CheckpointDir(save, it)) == name) found.emplace_back(it, e.path().string());
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save, ec.message()));
  if (found.size() != 1 || !VerifyCheckpointDir(found[0].second).ok()) return absl::OkStatus();
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(JoinPath(save, kTracker)));
  PTK_RETURN_IF_ERROR(w->Write(std::to_string(found[0].first)));
  PTK_RETURN_IF_ERROR(w->Commit());
  log::Info(
      "{}: wrote {} naming iteration {}: its complete checkpoint is the first save of a run killed before the "
      "tracker named it",
      save, kTracker, found[0].first);
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveCheckpoint(const std::string& save, const ParamLayout& layout, std::span<const float> params,
                            std::span<const float> exp_avg, std::span<const float> exp_avg_sq, const TrainState& state,
                            const std::string& args_json, ProgressReporter* progress) {
  const CheckpointShard shard{&layout, params, exp_avg, exp_avg_sq};
  return SaveCheckpoint(save, std::span<const CheckpointShard>(&shard, 1), state, args_json, progress);
}

absl::Status SaveCheckpoint(const std::string& save, std::span<const CheckpointShard> shards, const TrainState& state,
                            const std::string& args_json, ProgressReporter* progress) {
  PTK_RETURN_IF_ERROR(MakeDirs(save));
  const std::string final_dir = CheckpointDir(save, state.iteration);
  const std::string tmp_dir = fmt::format("{}{}{}", final_dir, kTmpTag, ::getpid());
  const std::string old_dir = fmt::format("{}{}{}", final_dir, kOldTag, ::getpid());
  if (shards.empty()) return absl::InternalError("SaveCheckpoint: no arrays");
  PTK_RETURN_IF_ERROR(CheckReplaceable(final_dir));
  const int tensor_size = shards[0].layout->tensor_size, pipeline_size = shards[0].layout->pipeline_size;
  const int expert_size = shards[0].layout->expert_size;
  if (static_cast<int64_t>(shards.size()) != int64_t{tensor_size} * pipeline_size * expert_size)
    return absl::InternalError("SaveCheckpoint: not one shard per tensor, expert and pipeline rank");
  std::vector<std::string> rank_dirs;
  std::vector<int64_t> stage_layers;
  for (size_t i = 0; i < shards.size(); ++i) {
    const CheckpointShard& sh = shards[i];
    const size_t n = static_cast<size_t>(sh.layout->num_params);
    const int t = static_cast<int>(i) % tensor_size, e = static_cast<int>(i) / tensor_size % expert_size,
              p = static_cast<int>(i) / (tensor_size * expert_size);
    if (sh.layout->tensor_size != tensor_size || sh.layout->tensor_rank != t || sh.layout->expert_size != expert_size ||
        sh.layout->expert_rank != e || sh.layout->pipeline_size != pipeline_size || sh.layout->pipeline_rank != p ||
        sh.params.size() != n || sh.exp_avg.size() != n || sh.exp_avg_sq.size() != n)
      return absl::InternalError("SaveCheckpoint: the arrays do not match the parameter layouts");
    rank_dirs.push_back(MpRankDir(t, p, pipeline_size, e, expert_size));
    if (t == 0 && e == 0) stage_layers.push_back(static_cast<int64_t>(sh.layout->layers.size()));
  }
  if (progress != nullptr) {
    uint64_t bytes = 0;
    for (const CheckpointShard& sh : shards)
      bytes += sh.params.size_bytes() + sh.exp_avg.size_bytes() + sh.exp_avg_sq.size_bytes();
    progress->SetTotals(shards.size(), bytes);
  }
  auto header = [&](const ParamLayout& layout) {
    JsonWriter w;
    w.BeginObject()
        .Field("format", "ptk-checkpoint")
        .Field("version", kFormatVersion)
        .Field("checkpoint_version", 3.0)
        .Field("iteration", state.iteration)
        .Field("consumed_train_samples", state.consumed_train_samples)
        .Field("consumed_valid_samples", state.consumed_valid_samples)
        .Field("opt_param_scheduler_num_steps", state.scheduler_num_steps)
        .Field("adam_step", state.adam_step)
        .Field("skipped_iterations", state.skipped_iterations)
        .Field("skipped_train_samples", state.skipped_train_samples);
    if (state.loss_scale)
      w.Field("loss_scale", state.loss_scale->scale)
          .Field("loss_scale_growth_tracker", state.loss_scale->growth_tracker)
          .Field("loss_scale_hysteresis_tracker", state.loss_scale->hysteresis_tracker);
    if (state.scheduler) {
      // Megatron's OptimizerParamScheduler.state_dict names, and ptk's settings it does not save.
      const SchedulerConfig& c = *state.scheduler;
      w.Key("opt_param_scheduler")
          .BeginObject()
          .Field("max_lr", c.max_lr)
          .Field("min_lr", c.min_lr)
          .Key("lr_warmup_steps")
          .WholeOrFloat(c.warmup_steps)
          .Field("lr_decay_steps", c.decay_steps)
          .Field("lr_decay_style", c.decay_style)
          .Field("start_wd", c.start_wd)
          .Field("end_wd", c.end_wd)
          .Field("wd_incr_steps", c.wd_incr_steps)
          .Field("wd_incr_style", c.wd_incr_style)
          .Field("init_lr", c.init_lr)
          .Field("wsd_decay_steps", c.wsd_decay_steps)
          .Field("lr_wsd_decay_style", c.wsd_decay_style);
      // The embedding and output layer's group, as megatron-core's optimizer param_groups hold it.
      if (c.decoupled_lr) w.Field("decoupled_lr", *c.decoupled_lr);
      if (c.decoupled_lr && c.decoupled_min_lr) w.Field("decoupled_min_lr", *c.decoupled_min_lr);
      w.EndObject();
    }
    w.Field("seed", state.seed)
        .Field("wall_seconds", state.wall_seconds)
        .Field("num_params", layout.num_params)
        .Field("tensor_model_parallel_size", static_cast<int64_t>(layout.tensor_size))
        .Field("tensor_rank", static_cast<int64_t>(layout.tensor_rank))
        .Field("pipeline_model_parallel_size", static_cast<int64_t>(layout.pipeline_size))
        .Field("pipeline_rank", static_cast<int64_t>(layout.pipeline_rank))
        .Field("expert_model_parallel_size", static_cast<int64_t>(layout.expert_size))
        .Field("expert_rank", static_cast<int64_t>(layout.expert_rank))
        .Field("virtual_pipeline_model_parallel_size", static_cast<int64_t>(layout.virtual_size))
        .Key("pipeline_stage_layers")
        .BeginArray();
    for (int64_t l : stage_layers) w.Value(l);
    w.EndArray().Key("model").Raw(ModelJson(layout.config)).Key("settings").BeginArray();
    for (const auto& [name, value] : state.settings) w.BeginArray().Value(name).Value(value).EndArray();
    w.EndArray();
    if (!state.buffers.empty()) {  // each float exactly (its shortest repr as a double reads back to it)
      w.Key("buffers").BeginArray();
      for (const auto& [name, values] : state.buffers) {
        w.BeginObject().Field("name", name).Key("values").BeginArray();
        for (float v : values) w.Value(static_cast<double>(v));
        w.EndArray().EndObject();
      }
      w.EndArray();
    }
    w.Key("tensors").BeginArray();
    for (const ParamInfo& p : layout.infos) {
      // Model chunks: Megatron's state of each (model0, model1, ...), its layers numbered from 0.
      const auto [chunk, name] = ChunkName(layout, p.name);
      w.BeginObject();
      if (layout.virtual_size > 1) w.Field("model", fmt::format("model{}", chunk));
      w.Field("name", name).Key("shape").BeginArray();
      for (int64_t d : p.shape) w.Value(d);
      w.EndArray().Field("offset", p.offset).EndObject();
    }
    w.EndArray().Key("args").Raw(args_json.empty() ? "{}" : args_json).EndObject();
    return w.str();
  };

  const bool fresh = !PathExists(final_dir);  // no directory of this iteration before this save
  absl::Status st = [&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(Step("create temporary directory"));
    PTK_RETURN_IF_ERROR(RemoveAllOrError(tmp_dir));
    for (const CheckpointShard& sh : shards) {
      const std::string file = JoinPath(tmp_dir, MpRankFile(sh.layout->tensor_rank, sh.layout->pipeline_rank,
                                                            pipeline_size, sh.layout->expert_rank, expert_size));
      PTK_RETURN_IF_ERROR(MakeDirs(Dirname(file)));
      PTK_RETURN_IF_ERROR(
          WriteCheckpointFile(file, header(*sh.layout), {sh.params, sh.exp_avg, sh.exp_avg_sq}, progress));
    }
    PTK_RETURN_IF_ERROR(PublishDirectory(save, tmp_dir, final_dir, old_dir, rank_dirs));
    return WriteTracker(save, state.iteration);
  }();
  if (!st.ok()) {
    // Whatever step failed: the iteration's directory back in place if a copy of it lies aside,
    // and nothing of this save left behind (a full disk must not leave empty directories).
    absl::Status undo = RecoverIteration(save, Basename(final_dir), /*restore_new=*/false);
    if (!undo.ok()) log::Warning("after a failed save: {}", StatusMessage(undo));
    // A new iteration directory whose tracker could not be written (a full disk at the last small
    // file) is named by nothing, and the next --load would start from scratch beside it: removed.
    if (fresh && PathExists(final_dir)) {
      auto latest = LatestCheckpointIteration(save);
      if (!latest.ok() || *latest != state.iteration) {
        absl::Status gone = RemoveAllOrError(final_dir);
        if (!gone.ok()) log::Warning("after a failed save: {}", StatusMessage(gone));
      }
    }
  }
  return st;
}

absl::Status RecoverCheckpointDir(const std::string& save) {
  if (!IsDirectory(save)) return absl::OkStatus();
  std::vector<std::string> bases;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) != 0) continue;
    if (name.find(kRemovingTag) != std::string::npos) {  // a removal a kill interrupted: finished
      PTK_RETURN_IF_ERROR(RemoveAllOrError(e.path().string()));
      continue;
    }
    for (const char* tag : {kTmpTag, kOldTag})
      if (const size_t at = name.find(tag); at != std::string::npos) bases.push_back(name.substr(0, at));
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save, ec.message()));
  std::sort(bases.begin(), bases.end());
  bases.erase(std::unique(bases.begin(), bases.end()), bases.end());
  for (const std::string& base : bases) PTK_RETURN_IF_ERROR(RecoverIteration(save, base, /*restore_new=*/true));
  RemoveStaleTemporaries(JoinPath(save, kTracker));
  return NameKilledFirstSave(save);
}

absl::Status CheckSaveHoldsNoMegatronCheckpoint(const std::string& save, std::string_view flag) {
  if (save.empty() || !IsDirectory(save)) return absl::OkStatus();
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    if (e.path().filename().string().rfind("iter_", 0) != 0 || !e.is_directory(ec)) continue;
    if (std::string torch = MegatronTorchCheckpointIn(e.path().string()); !torch.empty())
      return UsageError(fmt::format(
          "{} {}: holds a Megatron checkpoint ({}): a ptk-train save writes iter_N/ there and moves the "
          "latest_checkpointed_iteration.txt Megatron reads to it; give a directory of its own ({} to train on)",
          flag, save, torch, ConvertHint(save)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LatestCheckpointIteration(const std::string& load) {
  const std::string tracker = JoinPath(load, kTracker);
  if (!PathExists(tracker)) {
    if (IsDirectory(load)) {
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(load, ec))
        if (e.path().filename().string().rfind("iter_", 0) == 0 && e.is_directory(ec)) {
          if (std::string torch = MegatronTorchCheckpointIn(e.path().string()); !torch.empty())
            return absl::FailedPreconditionError(fmt::format(
                "{}: no {}, and {} is a Megatron checkpoint in PyTorch's format, which ptk-train does not read; "
                "{}, or train without --load",
                load, kTracker, torch, ConvertHint(load)));
        }
    }
    return absl::NotFoundError(fmt::format("{}: no checkpoint (no {})", load, kTracker));
  }
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(tracker));
  const absl::string_view stripped = absl::StripAsciiWhitespace(text);
  const std::string_view digits(stripped.data(), stripped.size());
  if (digits == "release")
    return absl::InvalidArgumentError(tracker +
                                      ": 'release' checkpoints (converted Megatron weights) are not supported");
  auto bad = [&](const std::string& why) {
    const std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
    return absl::DataLossError(fmt::format("{}: not an iteration number: {:?} ({})", tracker, shown, why));
  };
  if (digits.empty()) return bad("empty");
  int64_t it = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return bad(fmt::format("holds {:?}", std::string(1, c)));
    if (it > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10)
      return bad("larger than any iteration: it overflows a 64-bit integer");
    it = it * 10 + (c - '0');
  }
  return it;
}

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& load, int64_t iteration) {
  const std::string dir = CheckpointDir(load, iteration);
  const std::string file = FirstRankFile(dir);
  if (PathExists(file)) return dir;
  if (std::string torch = IsDirectory(dir) ? MegatronTorchCheckpointIn(dir) : ""; !torch.empty())
    return absl::FailedPreconditionError(
        fmt::format("{} is a Megatron checkpoint in PyTorch's format (the tracker names iteration {}); ptk-train "
                    "reads only its own {}: {}, or train without --load",
                    torch, iteration, Basename(file), ConvertHint(load)));
  // A save killed while it replaced this iteration (a run that --load-s without --save on this
  // directory does not recover it): a complete copy aside is as good.
  PTK_ASSIGN_OR_RETURN(AsideCopies copies, FindAsideCopies(load, Basename(dir)));
  for (const std::string& copy : copies.paths) {
    const std::string aside = FirstRankFile(copy);
    if (VerifyCheckpointFile(aside).ok()) {
      log::Info("{}: missing; loading {}, the complete copy an interrupted save left aside", file, aside);
      return copy;
    }
  }
  return absl::NotFoundError(fmt::format("{}: missing (the tracker names iteration {})", file, iteration));
}

absl::Status LoadCheckpoint(const std::string& load, int64_t iteration, const ParamLayout& layout,
                            std::vector<float>* params, std::vector<float>* exp_avg, std::vector<float>* exp_avg_sq,
                            TrainState* state, ProgressReporter* progress) {
  PTK_ASSIGN_OR_RETURN(const std::string dir, ResolveCheckpointDir(load, iteration));
  PTK_ASSIGN_OR_RETURN(const SavedParallelism saved, ReadSavedParallelism(FirstRankFile(dir)));
  // This rank's own file when it was saved with this rank's slices and layers; else put together.
  const bool same_stage =
      saved.pipeline_size() == layout.pipeline_size && saved.virtual_size == layout.virtual_size &&
      StageOf(saved.stage_layers, layout.pipeline_rank).first_layer == layout.first_layer &&
      saved.stage_layers[static_cast<size_t>(layout.pipeline_rank)] == static_cast<int64_t>(layout.layers.size());
  const bool resharded =
      saved.tensor_size != layout.tensor_size || saved.expert_size != layout.expert_size || !same_stage;
  const std::string own = JoinPath(dir, MpRankFile(layout.tensor_rank, layout.pipeline_rank, layout.pipeline_size,
                                                   layout.expert_rank, layout.expert_size));
  if (progress != nullptr) {  // the files about to be read: this rank's, or every saved rank's
    std::vector<std::string> files = {own};
    if (resharded) files = SavedRankFiles(dir, saved);
    uint64_t bytes = 0;
    for (const std::string& f : files) bytes += FileSize(f).value_or(0);  // a missing file: its load says so
    progress->SetTotals(files.size(), bytes);
  }
  if (resharded) return LoadResharded(dir, saved, iteration, layout, params, exp_avg, exp_avg_sq, state, progress);
  return LoadCheckpointFile(own, iteration, layout, params, exp_avg, exp_avg_sq, state, progress);
}

}  // namespace ptk
