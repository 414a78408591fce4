// The tensor size a checkpoint was saved at, and a checkpoint saved at one tensor-parallel size
// loaded at another: the whole model (weights and AdamW moments) put together from every saved
// tensor rank's slices, then this rank's cut.
#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "trainer/checkpoint.h"

namespace ptk {

absl::StatusOr<int> SavedTensorSize(const std::string& file) {
  PTK_ASSIGN_OR_RETURN(const std::string header, ReadCheckpointHeader(file));
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(header).get(h)) return absl::DataLossError(fmt::format("{}: header is not JSON", file));
  int64_t t = 1;
  if (h["tensor_model_parallel_size"].get(t)) t = 1;  // ptk before tensor parallelism
  if (t < 1 || t > (1 << 20)) return absl::DataLossError(fmt::format("{}: tensor size {} in the header", file, t));
  return static_cast<int>(t);
}

absl::Status LoadResharded(const std::string& dir, int saved, int64_t iteration, const ParamLayout& layout,
                           std::vector<float>* params, std::vector<float>* exp_avg, std::vector<float>* exp_avg_sq,
                           TrainState* state) {
  auto whole = ParamLayout::Create(layout.config, 1, 0);
  if (!whole.ok()) return whole.status();
  const size_t n = static_cast<size_t>(whole->num_params);
  std::vector<float> p(n), m(n), v(n), sp, sm, sv;
  for (int t = 0; t < saved; ++t) {
    auto saved_layout = ParamLayout::Create(layout.config, saved, t);
    if (!saved_layout.ok())
      return absl::FailedPreconditionError(
          fmt::format("{}: saved at tensor size {}, which this model cannot have been split into: {}", dir, saved,
                      StatusMessage(saved_layout.status())));
    PTK_RETURN_IF_ERROR(
        LoadCheckpointFile(JoinPath(dir, MpRankFile(t)), iteration, *saved_layout, &sp, &sm, &sv, state));
    CopyFromShard(*saved_layout, sp, p);
    CopyFromShard(*saved_layout, sm, m);
    CopyFromShard(*saved_layout, sv, v);
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
