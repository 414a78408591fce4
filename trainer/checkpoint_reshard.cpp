// The tensor and pipeline sizes a checkpoint was saved with (every rank's file of it verified; its
// tensors' names in model chunks), and a checkpoint saved at one layout loaded at another: the whole
// model (weights and AdamW moments) put together from every saved rank's slices of its stage, then
// this rank's cut.
#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "trainer/checkpoint.h"

namespace ptk {

absl::StatusOr<SavedParallelism> ReadSavedParallelism(const std::string& file) {
  PTK_ASSIGN_OR_RETURN(const std::string header, ReadCheckpointHeaderText(file));
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(header).get(h)) return absl::DataLossError(fmt::format("{}: header is not JSON", file));
  SavedParallelism saved;
  int64_t t = 1;
  if (h["tensor_model_parallel_size"].get(t)) t = 1;  // ptk before tensor parallelism
  if (t < 1 || t > (1 << 20)) return absl::DataLossError(fmt::format("{}: tensor size {} in the header", file, t));
  saved.tensor_size = static_cast<int>(t);
  int64_t e = 1;
  if (h["expert_model_parallel_size"].get(e)) e = 1;  // ptk before expert parallelism
  if (e < 1 || e > (1 << 20)) return absl::DataLossError(fmt::format("{}: expert size {} in the header", file, e));
  saved.expert_size = static_cast<int>(e);
  int64_t v = 1;
  if (h["virtual_pipeline_model_parallel_size"].get(v)) v = 1;  // ptk before the interleaved schedule
  if (v < 1 || v > (1 << 20))
    return absl::DataLossError(fmt::format("{}: virtual pipeline size {} in the header", file, v));
  saved.virtual_size = static_cast<int>(v);
  simdjson::dom::array stages;
  if (!h["pipeline_stage_layers"].get(stages)) {
    for (simdjson::dom::element e : stages) {
      int64_t l = 0;
      if (e.get(l) || l < 1) return absl::DataLossError(fmt::format("{}: malformed pipeline_stage_layers", file));
      saved.stage_layers.push_back(l);
    }
  }
  if (saved.stage_layers.empty()) {  // ptk before pipeline parallelism: one stage of every layer
    int64_t layers = 0;
    if (h["model"]["num_layers"].get(layers) || layers < 1)
      return absl::DataLossError(fmt::format("{}: header misses the model's num_layers", file));
    saved.stage_layers.push_back(layers);
  }
  return saved;
}

std::vector<std::string> SavedRankFiles(const std::string& dir, const SavedParallelism& saved) {
  std::vector<std::string> files;
  const int P = saved.pipeline_size(), E = saved.expert_size;
  for (int p = 0; p < P; ++p)
    for (int e = 0; e < E; ++e)
      for (int t = 0; t < saved.tensor_size; ++t) files.push_back(JoinPath(dir, MpRankFile(t, p, P, e, E)));
  return files;
}

absl::Status VerifyCheckpointDir(const std::string& dir) {
  const std::string first = FirstRankFile(dir);
  PTK_RETURN_IF_ERROR(VerifyCheckpointFile(first));
  PTK_ASSIGN_OR_RETURN(const SavedParallelism saved, ReadSavedParallelism(first));
  for (const std::string& file : SavedRankFiles(dir, saved)) PTK_RETURN_IF_ERROR(VerifyCheckpointFile(file));
  return absl::OkStatus();
}

std::pair<int, std::string> ChunkName(const ParamLayout& layout, const std::string& name) {
  if (layout.virtual_size <= 1) return {0, name};
  constexpr std::string_view kLayers = "decoder.layers.";
  // The embeddings are the first stage's chunk 0's; the final norm, the output layer and the last
  // stage's copy of tied embeddings its last chunk's.
  if (name.rfind(kLayers, 0) != 0)
    return {name.rfind("embedding.", 0) == 0 && layout.pre_process ? 0 : layout.virtual_size - 1, name};
  const size_t dot = name.find('.', kLayers.size());
  const int64_t global = std::stoll(name.substr(kLayers.size(), dot - kLayers.size()));
  const int64_t n = layout.chunk_layers();
  for (int v = 0; v < layout.virtual_size; ++v) {
    const int64_t first = layout.chunk_first_layer[static_cast<size_t>(v)];
    if (global >= first && global < first + n)
      return {v, fmt::format("{}{}{}", kLayers, global - first, name.substr(dot))};
  }
  return {0, name};
}

absl::Status LoadResharded(const std::string& dir, const SavedParallelism& saved, int64_t iteration,
                           const ParamLayout& layout, std::vector<float>* params, std::vector<float>* exp_avg,
                           std::vector<float>* exp_avg_sq, TrainState* state, ProgressReporter* progress) {
  auto whole = ParamLayout::Create(layout.config, 1, 0);
  if (!whole.ok()) return whole.status();
  const size_t n = static_cast<size_t>(whole->num_params);
  std::vector<float> p(n), m(n), v(n), sp, sm, sv;
  const int P = saved.pipeline_size(), E = saved.expert_size;
  for (int stage = 0; stage < P; ++stage) {
    for (int e = 0; e < E; ++e) {
      for (int t = 0; t < saved.tensor_size; ++t) {
        auto saved_layout = ParamLayout::Create(layout.config, saved.tensor_size, t,
                                                StageOf(saved.stage_layers, stage, saved.virtual_size), E, e);
        if (!saved_layout.ok())
          return absl::FailedPreconditionError(fmt::format(
              "{}: saved at tensor size {}, expert size {} and {} pipeline stage(s), which this model cannot have "
              "been split into: {}",
              dir, saved.tensor_size, E, P, StatusMessage(saved_layout.status())));
        PTK_RETURN_IF_ERROR(LoadCheckpointFile(JoinPath(dir, MpRankFile(t, stage, P, e, E)), iteration, *saved_layout,
                                               &sp, &sm, &sv, state, progress));
        CopyFromShard(*saved_layout, sp, p);
        CopyFromShard(*saved_layout, sm, m);
        CopyFromShard(*saved_layout, sv, v);
      }
    }
  }
  const size_t mine = static_cast<size_t>(layout.num_params);
  params->assign(mine, 0.0f);
  exp_avg->assign(mine, 0.0f);
  exp_avg_sq->assign(mine, 0.0f);
  CopyToShard(layout, p, *params);
  CopyToShard(layout, m, *exp_avg);
  CopyToShard(layout, v, *exp_avg_sq);
  return absl::OkStatus();
}

}  // namespace ptk
