// Reading a ptk checkpoint file: its verification (length, magic, SHA-256) and its load.
#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/json_keys.h"
#include "common/progress.h"
#include "common/status.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_header.h"

namespace ptk {

std::string CheckpointLengthProblem(std::string_view head, uint64_t size) {
  constexpr uint64_t kStart = sizeof kMagic + 8;
  if (std::memcmp(head.data(), kMagic, std::min(head.size(), sizeof kMagic)) != 0) return "";
  if (size < kStart)
    return fmt::format(
        "cut short: {} bytes, fewer than the {} that open every checkpoint (a copy or download "
        "stopped by a kill or a full disk?)",
        size, kStart);
  if (head.size() < kStart) return "";
  uint64_t len = 0;
  std::memcpy(&len, head.data() + sizeof kMagic, sizeof len);
  if (len > (uint64_t{1} << 30)) return "";  // no header of ptk's: the SHA-256 decides
  if (size < kStart + len + kDigestChars)
    return fmt::format(
        "cut short: {} bytes, fewer than its {}-byte header and checksum alone (a copy or download "
        "stopped by a kill or a full disk?)",
        size, kStart + len + kDigestChars);
  if (head.size() < kStart + len) return "";
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  int64_t num_params = 0;
  if (parser.parse(head.data() + kStart, len).get(h) || h["num_params"].get(num_params) || num_params < 0 ||
      num_params > (int64_t{1} << 50))
    return "";
  const uint64_t want = kStart + len + 3 * sizeof(float) * static_cast<uint64_t>(num_params) + kDigestChars;
  if (size < want)
    return fmt::format(
        "cut short: {} bytes of the {} its header records ({} missing: a copy or download stopped "
        "by a kill or a full disk?)",
        size, want, want - size);
  if (size > want)
    return fmt::format("{} bytes, {} more than the {} its header records (something appended to it?)", size,
                       size - want, want);
  return "";
}

namespace {

// The first bytes of a checkpoint file of `size` bytes: its fixed start and its header, or what there is.
absl::StatusOr<std::string> ReadHead(const std::string& file, uint64_t size) {
  PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(file));  // a FIFO refused, not waited on
  std::string head(static_cast<size_t>(std::min<uint64_t>(size, sizeof kMagic + 8)), '\0');
  auto read_at = [&](size_t at) -> absl::Status {
    while (at < head.size()) {
      const ssize_t n = ::pread(fd, head.data() + at, head.size() - at, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return absl::DataLossError(fmt::format("{}: read failed at byte {}", file, at));
      at += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  };
  absl::Status st = read_at(0);
  uint64_t len = 0;
  if (st.ok() && head.size() == sizeof kMagic + 8) {
    std::memcpy(&len, head.data() + sizeof kMagic, sizeof len);
    const size_t fixed = head.size();
    head.resize(static_cast<size_t>(std::min<uint64_t>(size, fixed + std::min<uint64_t>(len, uint64_t{1} << 30))));
    st = read_at(fixed);
  }
  ::close(fd);
  PTK_RETURN_IF_ERROR(st);
  return head;
}

// The header's opt_param_scheduler (absent from an earlier ptk's checkpoint: *scheduler left empty).
absl::Status ReadSchedulerSettings(simdjson::dom::element h,
                                   const std::function<absl::Status(const std::string&)>& corrupt,
                                   std::optional<SchedulerConfig>* scheduler) {
  scheduler->reset();
  simdjson::dom::object sched;
  if (!h["opt_param_scheduler"].get(sched)) {
    SchedulerConfig c;
    std::string_view decay_style, wd_incr_style, wsd_style;
    if (sched["max_lr"].get(c.max_lr) || sched["min_lr"].get(c.min_lr) ||
        sched["lr_warmup_steps"].get(c.warmup_steps) || sched["lr_decay_steps"].get(c.decay_steps) ||
        sched["lr_decay_style"].get(decay_style) || sched["start_wd"].get(c.start_wd) ||
        sched["end_wd"].get(c.end_wd) || sched["wd_incr_steps"].get(c.wd_incr_steps) ||
        sched["wd_incr_style"].get(wd_incr_style) || sched["init_lr"].get(c.init_lr) ||
        sched["wsd_decay_steps"].get(c.wsd_decay_steps) || sched["lr_wsd_decay_style"].get(wsd_style))
      return corrupt("malformed opt_param_scheduler in the header");
    c.decay_style = decay_style;
    c.wd_incr_style = wd_incr_style;
    c.wsd_decay_style = wsd_style;
    // Absent: a run on --lr's schedule alone (or an earlier ptk's).
    for (auto [key, to] : {std::pair{"decoupled_lr", &c.decoupled_lr}, {"decoupled_min_lr", &c.decoupled_min_lr}}) {
      double rate = 0;
      const simdjson::error_code e = sched[key].get(rate);
      if (e == simdjson::NO_SUCH_FIELD) continue;
      if (e) return corrupt(fmt::format("malformed opt_param_scheduler.{} in the header", key));
      *to = rate;
    }
    *scheduler = c;
  }
  return absl::OkStatus();
}

// The training state a checkpoint's header records (everything but the arrays), into *state.
absl::Status ReadHeaderState(simdjson::dom::element h, const std::function<absl::Status(const std::string&)>& corrupt,
                             TrainState* state) {
  auto get = [&](const char* key, int64_t* out) -> absl::Status {
    if (h[key].get(*out)) return corrupt(std::string("header misses ") + key);
    return absl::OkStatus();
  };
  PTK_RETURN_IF_ERROR(get("iteration", &state->iteration));
  PTK_RETURN_IF_ERROR(get("consumed_train_samples", &state->consumed_train_samples));
  PTK_RETURN_IF_ERROR(get("consumed_valid_samples", &state->consumed_valid_samples));
  PTK_RETURN_IF_ERROR(get("opt_param_scheduler_num_steps", &state->scheduler_num_steps));
  PTK_RETURN_IF_ERROR(get("adam_step", &state->adam_step));
  PTK_RETURN_IF_ERROR(get("skipped_iterations", &state->skipped_iterations));
  // --iterations-to-skip's samples: none in a checkpoint of an earlier ptk.
  if (h["skipped_train_samples"].get(state->skipped_train_samples)) state->skipped_train_samples = 0;
  if (state->skipped_train_samples < 0) return corrupt("skipped_train_samples is negative");
  // fp16's dynamic loss scaler, when the saving run had one.
  state->loss_scale.reset();
  double scale = 0;
  if (!h["loss_scale"].get(scale)) {
    if (!(scale > 0) || !std::isfinite(scale)) return corrupt("loss_scale is not a positive number");
    LossScaleState ls;
    ls.scale = scale;
    if (h["loss_scale_growth_tracker"].get(ls.growth_tracker) ||
        h["loss_scale_hysteresis_tracker"].get(ls.hysteresis_tracker))
      return corrupt("header misses the loss scaler's trackers");
    state->loss_scale = ls;
  }
  // The scheduler's settings, when the saving ptk recorded them.
  PTK_RETURN_IF_ERROR(ReadSchedulerSettings(h, corrupt, &state->scheduler));
  uint64_t seed = 0;
  if (h["seed"].get(seed)) return corrupt("header misses seed");
  state->seed = seed;
  double wall = 0;
  if (!h["wall_seconds"].get(wall)) state->wall_seconds = wall;
  if (!ReadHeaderSettings(h, &state->settings)) return corrupt("malformed settings in the header");
  state->buffers.clear();  // the model's buffers, where it has any
  simdjson::dom::array buffers;
  if (!h["buffers"].get(buffers))
    for (simdjson::dom::element b : buffers) {
      std::string_view name;
      simdjson::dom::array values;
      if (b["name"].get(name) || b["values"].get(values)) return corrupt("malformed buffers in the header");
      std::vector<float> v;
      for (simdjson::dom::element x : values) {
        double d = 0;
        if (x.get(d)) return corrupt(fmt::format("malformed buffer {} in the header", name));
        v.push_back(static_cast<float>(d));
      }
      state->buffers.emplace_back(std::string(name), std::move(v));
    }
  return absl::OkStatus();
}

// A checkpoint file whole, and the SHA-256 of all but its last kDigestChars bytes (the digest it ends with), taken
// as the pieces come (one pass over a file of GBs); `progress` (may be null) counts each piece, and the file.
struct HashedFile {
  std::string data, digest;
};
absl::StatusOr<HashedFile> ReadHashed(const std::string& file, ProgressReporter* progress) {
  HashedFile f;
  f.data.reserve(FileSize(file).value_or(0));  // an error is the read's to say
  Sha256 sha;
  size_t hashed = 0;
  PTK_RETURN_IF_ERROR(ReadFileChunks(file, 4 << 20, [&](const char* p, size_t n) {
    f.data.append(p, n);
    if (f.data.size() > kDigestChars) {
      sha.Update(f.data.data() + hashed, f.data.size() - kDigestChars - hashed);
      hashed = f.data.size() - kDigestChars;
    }
    if (progress != nullptr) {
      progress->AddBytes(n);
      if ((f.data.size() - n) >> 26 != f.data.size() >> 26) progress->Refresh();  // on a terminal, every 64 MiB
    }
  }));
  f.digest = sha.HexDigest();
  if (progress != nullptr) {
    progress->AddItems(1);
    progress->Refresh();
  }
  return f;
}

}  // namespace

absl::Status CheckCheckpointFileLength(const std::string& file) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: incomplete or corrupt checkpoint: {}", file, why));
  };
  if (!PathExists(file)) return absl::NotFoundError(fmt::format("{}: missing", file));
  PTK_ASSIGN_OR_RETURN(uint64_t size, FileSize(file));
  // The fixed start and the header (all of a shorter file): a file cut short says so, not "SHA-256 mismatch".
  PTK_ASSIGN_OR_RETURN(const std::string head, ReadHead(file, size));
  if (std::string why = CheckpointLengthProblem(head, size); !why.empty()) return bad(why);
  if (size < sizeof kMagic + 8 + kDigestChars) return bad(fmt::format("{} bytes, too short", size));
  if (std::memcmp(head.data(), kMagic, sizeof kMagic) != 0) return bad(NotAPtkCheckpoint(head));
  return absl::OkStatus();
}

absl::Status VerifyCheckpointFile(const std::string& file) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: incomplete or corrupt checkpoint: {}", file, why));
  };
  PTK_RETURN_IF_ERROR(CheckCheckpointFileLength(file));
  PTK_ASSIGN_OR_RETURN(uint64_t size, FileSize(file));
  const uint64_t body = size - kDigestChars;
  Sha256 sha;
  std::string head, tail;
  uint64_t pos = 0;
  PTK_RETURN_IF_ERROR(ReadFileChunks(file, 4 << 20, [&](const char* p, size_t n) {
    if (head.size() < sizeof kMagic) head.append(p, std::min(n, sizeof kMagic - head.size()));
    const uint64_t hashed = pos < body ? std::min<uint64_t>(n, body - pos) : 0;
    sha.Update(p, hashed);
    tail.append(p + hashed, n - hashed);
    pos += n;
  }));
  if (pos != size) return bad(fmt::format("read {} of {} bytes (the file changed)", pos, size));
  if (std::memcmp(head.data(), kMagic, sizeof kMagic) != 0) return bad(NotAPtkCheckpoint(head));
  if (sha.HexDigest() != tail) return bad(fmt::format("SHA-256 mismatch over {} bytes", body));
  return absl::OkStatus();
}

absl::Status LoadCheckpointFile(const std::string& file, int64_t iteration, const ParamLayout& layout,
                                std::vector<float>* params, std::vector<float>* exp_avg, std::vector<float>* exp_avg_sq,
                                TrainState* state, ProgressReporter* progress) {
  PTK_ASSIGN_OR_RETURN(const HashedFile read, ReadHashed(file, progress));
  const std::string& data = read.data;
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint, refusing to load it: {}", file, why));
  };
  if (data.size() >= sizeof kMagic && std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
    return corrupt(NotAPtkCheckpoint(data));
  if (std::string why = CheckpointLengthProblem(data, data.size()); !why.empty()) return corrupt(why);
  if (data.size() < sizeof kMagic + 8 + 64) return corrupt("not a ptk checkpoint (bad magic or too short)");
  const std::string_view body(data.data(), data.size() - 64);
  if (read.digest != std::string_view(data.data() + data.size() - 64, 64))
    return corrupt(fmt::format("SHA-256 mismatch over {} bytes", body.size()));
  uint64_t len = 0;
  std::memcpy(&len, data.data() + sizeof kMagic, sizeof len);
  if (len > body.size() - sizeof kMagic - 8) return corrupt("header length past the end");
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(data.data() + sizeof kMagic + 8, len).get(h)) return corrupt("header is not JSON");
  // ptk writes each key once; a second one is not ptk's header (which value would be meant?).
  if (auto dup = FirstDuplicateJsonKey(h)) return corrupt(fmt::format("the header gives the key {} twice", *dup));
  int64_t version = 0, num_params = 0;
  if (h["version"].get(version)) return corrupt("the header records no format version");
  if (version != kFormatVersion)  // a later ptk's: not damage, so not kDataLoss
    return absl::FailedPreconditionError(
        fmt::format("{}: checkpoint format version {}, and this ptk reads version {} only: load it with the ptk "
                    "that saved it, or convert it with that ptk's ptk-convert",
                    file, version, kFormatVersion));
  simdjson::dom::element saved_model;
  if (h["num_params"].get(num_params) || h["model"].get(saved_model)) return corrupt("header misses the model");
  // The model-parallel rank that saved the file (`size_key`, `rank_key`; absent: ptk before that
  // parallelism, 1 and 0) must be this one, `rank` of `size`, said as "`saved` R of N ... `here` R of N".
  auto saved_by = [&](const char* size_key, const char* rank_key, int size, int rank, const char* saved,
                      const char* here) -> absl::Status {
    int64_t saved_size = 1, saved_rank = 0;
    if (h[size_key].get(saved_size)) saved_size = 1;
    if (h[rank_key].get(saved_rank)) saved_rank = 0;
    if (saved_size == size && saved_rank == rank) return absl::OkStatus();
    return absl::FailedPreconditionError(fmt::format("{}: {} {} of {} saved it; this is {} {} of {}", file, saved,
                                                     saved_rank, saved_size, here, rank, size));
  };
  PTK_RETURN_IF_ERROR(saved_by("tensor_model_parallel_size", "tensor_rank", layout.tensor_size, layout.tensor_rank,
                               "tensor rank", "tensor rank"));
  PTK_RETURN_IF_ERROR(saved_by("pipeline_model_parallel_size", "pipeline_rank", layout.pipeline_size,
                               layout.pipeline_rank, "pipeline stage", "stage"));
  PTK_RETURN_IF_ERROR(saved_by("expert_model_parallel_size", "expert_rank", layout.expert_size, layout.expert_rank,
                               "expert rank", "expert rank"));
  simdjson::dom::parser mine_parser;
  simdjson::dom::element mine;
  if (mine_parser.parse(ModelJson(layout.config)).get(mine)) return absl::InternalError("model description");
  const std::string saved_json = simdjson::minify(saved_model), mine_json = simdjson::minify(mine);
  // The counts are this file's and `layout`'s: a stage's or tensor rank's slice when a checkpoint is put together
  // (LoadResharded), where they would read as the whole models' (2 and 3 layers "both" of one size): only where
  // the descriptions agree do they say what differs.
  if (saved_json != mine_json)
    return absl::FailedPreconditionError(fmt::format(
        "{}: the checkpoint is of another model: {}; give the saved run's model flags, or --use-checkpoint-args to "
        "take them from the checkpoint",
        file, ModelDifferences(saved_model, mine)));
  if (num_params != layout.num_params)
    return absl::FailedPreconditionError(fmt::format(
        "{}: the checkpoint is of another model: the same settings, {} parameters saved and {} here; give the saved "
        "run's model flags, or --use-checkpoint-args to take them from the checkpoint",
        file, num_params, layout.num_params));
  const size_t bytes = static_cast<size_t>(num_params) * sizeof(float);
  const size_t payload = sizeof kMagic + 8 + len;
  if (payload + 3 * bytes != body.size()) return corrupt("payload size does not match the header");
  params->resize(num_params);
  std::memcpy(params->data(), data.data() + payload, bytes);
  exp_avg->resize(num_params);
  exp_avg_sq->resize(num_params);
  std::memcpy(exp_avg->data(), data.data() + payload + bytes, bytes);
  std::memcpy(exp_avg_sq->data(), data.data() + payload + 2 * bytes, bytes);
  PTK_RETURN_IF_ERROR(ReadHeaderState(h, corrupt, state));
  if (state->iteration != iteration)
    return corrupt(fmt::format("holds iteration {}, the directory says {}", state->iteration, iteration));
  return absl::OkStatus();
}

}  // namespace ptk
