// Megatron-layout checkpoints, written atomically and verified on load.
#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <fmt/core.h>
#include <simdjson.h>

#include "absl/strings/ascii.h"
#include "common/file_util.h"
#include "common/hash.h"
#include "common/json_writer.h"
#include "common/status.h"

namespace ptk::trainer {
namespace {

constexpr char kMagic[8] = {'P', 'T', 'K', 'C', 'K', 'P', 'T', '1'};
constexpr int kFormatVersion = 1;
constexpr char kTracker[] = "latest_checkpointed_iteration.txt";

// The fields of the model configuration that must match for a checkpoint to load.
std::string ModelJson(const GPTConfig& c) {
  return JsonWriter()
      .BeginObject()
      .Field("num_layers", c.num_layers)
      .Field("hidden_size", c.hidden_size)
      .Field("num_attention_heads", c.num_attention_heads)
      .Field("ffn_hidden_size", c.ffn_hidden_size)
      .Field("max_position_embeddings", c.max_position_embeddings)
      .Field("padded_vocab_size", c.padded_vocab_size)
      .Field("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights)
      .EndObject()
      .str();
}

}  // namespace

std::string CheckpointDir(const std::string& save, int64_t iteration) {
  return JoinPath(save, fmt::format("iter_{:07d}", iteration));
}
std::string CheckpointFile(const std::string& save, int64_t iteration) {
  return JoinPath(CheckpointDir(save, iteration), "mp_rank_00/model_optim_rng.ptk");
}

absl::Status SaveCheckpoint(const std::string& save, const GPTModel& model, const std::vector<float>& exp_avg,
                            const std::vector<float>& exp_avg_sq, const TrainState& state,
                            const std::string& args_json) {
  PTK_RETURN_IF_ERROR(MakeDirs(save));
  const std::string final_dir = CheckpointDir(save, state.iteration);
  const std::string tmp_dir = fmt::format("{}.ptk-tmp-{}", final_dir, ::getpid());
  std::error_code ec;
  std::filesystem::remove_all(tmp_dir, ec);
  PTK_RETURN_IF_ERROR(MakeDirs(JoinPath(tmp_dir, "mp_rank_00")));
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
      .Field("seed", state.seed)
      .Field("wall_seconds", state.wall_seconds)
      .Field("num_params", model.num_params())
      .Key("model")
      .Raw(ModelJson(model.config()))
      .Key("tensors")
      .BeginArray();
  for (const ParamInfo& p : model.params_info()) {
    w.BeginObject().Field("name", p.name).Key("shape").BeginArray();
    for (int64_t d : p.shape) w.Value(d);
    w.EndArray().Field("offset", p.offset).EndObject();
  }
  w.EndArray().Key("args").Raw(args_json.empty() ? "{}" : args_json).EndObject();
  const std::string& header = w.str();
  const std::string file = JoinPath(tmp_dir, "mp_rank_00/model_optim_rng.ptk");
  {
    PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(file));
    Sha256 sha;
    auto put = [&](const void* data, size_t size) -> absl::Status {
      sha.Update(data, size);
      return w->Write(data, size);
    };
    uint64_t len = header.size();
    PTK_RETURN_IF_ERROR(put(kMagic, sizeof kMagic));
    PTK_RETURN_IF_ERROR(put(&len, sizeof len));
    PTK_RETURN_IF_ERROR(put(header.data(), header.size()));
    const size_t bytes = static_cast<size_t>(model.num_params()) * sizeof(float);
    PTK_RETURN_IF_ERROR(put(model.params(), bytes));
    PTK_RETURN_IF_ERROR(put(exp_avg.data(), bytes));
    PTK_RETURN_IF_ERROR(put(exp_avg_sq.data(), bytes));
    PTK_RETURN_IF_ERROR(w->Write(sha.HexDigest()));
    PTK_RETURN_IF_ERROR(w->Commit());
  }
  PTK_RETURN_IF_ERROR(FsyncDir(JoinPath(tmp_dir, "mp_rank_00")));
  PTK_RETURN_IF_ERROR(FsyncDir(tmp_dir));
  // An older directory of the same iteration (a rerun) is moved aside first: rename(2) cannot
  // replace a non-empty directory.
  if (PathExists(final_dir)) {
    const std::string old = fmt::format("{}.ptk-old-{}", final_dir, ::getpid());
    PTK_RETURN_IF_ERROR(RenameFile(final_dir, old));
    std::filesystem::remove_all(old, ec);
  }
  PTK_RETURN_IF_ERROR(RenameFile(tmp_dir, final_dir));
  PTK_RETURN_IF_ERROR(FsyncDir(save));
  return WriteFileAtomic(JoinPath(save, kTracker), std::to_string(state.iteration));
}

absl::Status RemoveStaleCheckpointTemporaries(const std::string& save) {
  std::error_code ec;
  if (!IsDirectory(save)) return absl::OkStatus();
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) != 0) continue;
    if (name.find(".ptk-tmp-") == std::string::npos && name.find(".ptk-old-") == std::string::npos) continue;
    std::filesystem::remove_all(e.path(), ec);
    if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", e.path().string(), ec.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LatestCheckpointIteration(const std::string& load) {
  const std::string tracker = JoinPath(load, kTracker);
  if (!PathExists(tracker)) return absl::NotFoundError(fmt::format("{}: no checkpoint (no {})", load, kTracker));
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(tracker));
  text = std::string(absl::StripAsciiWhitespace(text));
  if (text == "release")
    return absl::InvalidArgumentError(tracker +
                                      ": 'release' checkpoints (converted Megatron weights) are not supported");
  char* end = nullptr;
  long long it = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || it < 0)
    return absl::DataLossError(fmt::format("{}: not an iteration number: '{}'", tracker, text));
  return static_cast<int64_t>(it);
}

absl::Status LoadCheckpoint(const std::string& load, int64_t iteration, GPTModel* model, std::vector<float>* exp_avg,
                            std::vector<float>* exp_avg_sq, TrainState* state) {
  const std::string file = CheckpointFile(load, iteration);
  if (!PathExists(file))
    return absl::NotFoundError(fmt::format("{}: missing (the tracker names iteration {})", file, iteration));
  PTK_ASSIGN_OR_RETURN(std::string data, ReadFileToString(file));
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint, refusing to load it: {}", file, why));
  };
  if (data.size() < sizeof kMagic + 8 + 64 || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
    return corrupt("not a ptk checkpoint (bad magic or too short)");
  const std::string_view body(data.data(), data.size() - 64);
  if (Sha256Hex(body) != std::string_view(data.data() + data.size() - 64, 64))
    return corrupt(fmt::format("SHA-256 mismatch over {} bytes", body.size()));
  uint64_t len = 0;
  std::memcpy(&len, data.data() + sizeof kMagic, sizeof len);
  if (len > body.size() - sizeof kMagic - 8) return corrupt("header length past the end");
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(data.data() + sizeof kMagic + 8, len).get(h)) return corrupt("header is not JSON");
  int64_t version = 0, num_params = 0;
  if (h["version"].get(version) || version != kFormatVersion) return corrupt("unsupported format version");
  simdjson::dom::element saved_model;
  if (h["num_params"].get(num_params) || h["model"].get(saved_model)) return corrupt("header misses the model");
  simdjson::dom::parser mine_parser;
  simdjson::dom::element mine;
  if (mine_parser.parse(ModelJson(model->config())).get(mine)) return absl::InternalError("model description");
  const std::string saved_json = simdjson::minify(saved_model), mine_json = simdjson::minify(mine);
  if (num_params != model->num_params() || saved_json != mine_json)
    return absl::FailedPreconditionError(fmt::format(
        "{}: the checkpoint's model {} ({} parameters) differs from this run's {} ({} parameters): model flags differ "
        "from the saved run's",
        file, saved_json, num_params, mine_json, model->num_params()));
  const size_t bytes = static_cast<size_t>(num_params) * sizeof(float);
  const size_t payload = sizeof kMagic + 8 + len;
  if (payload + 3 * bytes != body.size()) return corrupt("payload size does not match the header");
  std::memcpy(model->params(), data.data() + payload, bytes);
  exp_avg->resize(num_params);
  exp_avg_sq->resize(num_params);
  std::memcpy(exp_avg->data(), data.data() + payload + bytes, bytes);
  std::memcpy(exp_avg_sq->data(), data.data() + payload + 2 * bytes, bytes);
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
  uint64_t seed = 0;
  if (h["seed"].get(seed)) return corrupt("header misses seed");
  state->seed = seed;
  double wall = 0;
  if (!h["wall_seconds"].get(wall)) state->wall_seconds = wall;
  if (state->iteration != iteration)
    return corrupt(fmt::format("holds iteration {}, the directory says {}", state->iteration, iteration));
  return absl::OkStatus();
}

}  // namespace ptk::trainer
