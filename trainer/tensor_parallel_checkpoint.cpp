// The weights and moments a checkpoint holds, gathered over the data and tensor groups.
#include "trainer/tensor_parallel_checkpoint.h"

#include <span>

#include "common/status.h"
#include "trainer/expert_shard.h"

namespace ptk {

namespace {
// The pipeline stage `layout` holds (its layers, its chunks).
PipelineStage StageOfLayout(const ParamLayout& layout) {
  PipelineStage stage;
  stage.size = layout.pipeline_size;
  stage.rank = layout.pipeline_rank;
  stage.first_layer = layout.first_layer;
  stage.num_layers = static_cast<int64_t>(layout.layers.size());
  stage.virtual_size = layout.virtual_size;
  return stage;
}

// Expert parallelism (each pipeline stage its own expert groups): each expert rank's weights and moments (its
// experts' and the replicated rest) gathered over its expert group, data rank 0 then holding every expert rank's
// file of its stage and tensor rank; under tensor ranks data rank 0's of each tensor rank gathered over the tensor
// group, tensor rank 0 holding every file of its stage (mp_rank_TT[_PPP]_EEE), as Megatron's expert-data rank 0 of
// each expert and tensor rank saves it. Under ZeRO-1 (the moments sharded by ranges, expert_shard.h) each rank's
// whole moments are first put together from its groups' parts: the file holds every moment, as without ZeRO-1, so
// that any data or expert size loads it.
absl::StatusOr<std::vector<CheckpointArrays>> GatherExperts(GPTModel* model, Communicator* data, Communicator* expert,
                                                            Communicator* tensor) {
  if (model->shard()) return absl::UnimplementedError("expert parallelism's checkpoint with ZeRO-1's one shard");
  const size_t n = static_cast<size_t>(model->num_params());
  const int E = expert->size(), me = expert->rank();
  const int T = tensor ? tensor->size() : 1, t = tensor ? tensor->rank() : 0;
  // Tensor rank u's expert rank e at (u·E + e)·n, in each of the weights and the two moments.
  std::vector<std::vector<float>> all(3, std::vector<float>(n * static_cast<size_t>(E) * static_cast<size_t>(T)));
  const auto at = [&](size_t k, int u, int e) {
    return all[k].begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(u) * E + e) * n);
  };
  PTK_RETURN_IF_ERROR(model->ReadParams(std::span<float>(&*at(0, t, me), n)));
  if (model->ranges_sharded())
    PTK_RETURN_IF_ERROR(GatherExpertShardedMoments(model, data, std::span<float>(&*at(1, t, me), n),
                                                   std::span<float>(&*at(2, t, me), n)));
  else
    PTK_RETURN_IF_ERROR(model->ReadMoments(std::span<float>(&*at(1, t, me), n), std::span<float>(&*at(2, t, me), n)));
  const std::vector<int64_t> bytes(static_cast<size_t>(E), static_cast<int64_t>(n * sizeof(float)));
  for (size_t k = 0; k < 3; ++k) PTK_RETURN_IF_ERROR(expert->AllGather(&*at(k, t, 0), bytes));
  std::vector<CheckpointArrays> out;
  if (data->rank() != 0) return out;
  if (T > 1) {
    const std::vector<int64_t> tensor_bytes(static_cast<size_t>(T), static_cast<int64_t>(E * n * sizeof(float)));
    for (std::vector<float>& v : all) PTK_RETURN_IF_ERROR(tensor->AllGather(v.data(), tensor_bytes));
    if (t != 0) return out;
  }
  for (int e = 0; e < E; ++e)  // tensor ranks fastest, as SaveCheckpoint takes the shards
    for (int u = 0; u < T; ++u) {
      PTK_ASSIGN_OR_RETURN(ParamLayout layout,
                           ParamLayout::Create(model->config(), T, u, StageOfLayout(model->layout()), E, e));
      auto slice = [&](size_t k) { return std::vector<float>(at(k, u, e), at(k, u, e + 1)); };
      out.push_back({std::move(layout), slice(0), slice(1), slice(2)});
    }
  return out;
}

absl::StatusOr<std::vector<CheckpointArrays>> GatherStage(GPTModel* model, Communicator* data, Communicator* tensor) {
  const size_t n = static_cast<size_t>(model->num_params());
  CheckpointArrays mine{model->layout(), {}, {}, {}};
  std::vector<float>&params = mine.params, &m = mine.exp_avg, &v = mine.exp_avg_sq;
  if (model->shard()) {
    // Each data rank's range of the weights and moments (a sharded master holds no more), gathered.
    params.assign(n, 0.0f);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    const size_t begin = static_cast<size_t>(model->moments_begin()), size = static_cast<size_t>(model->moments_size());
    PTK_RETURN_IF_ERROR(model->ReadOwnedParams(std::span<float>(params).subspan(begin, size)));
    PTK_RETURN_IF_ERROR(
        model->ReadMoments(std::span<float>(m).subspan(begin, size), std::span<float>(v).subspan(begin, size)));
    std::vector<int64_t> bytes = model->shard()->Counts();
    for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
    PTK_RETURN_IF_ERROR(data->AllGather(params.data(), bytes));
    PTK_RETURN_IF_ERROR(data->AllGather(m.data(), bytes));
    PTK_RETURN_IF_ERROR(data->AllGather(v.data(), bytes));
  }
  if (model->expert_comm() != nullptr) return GatherExperts(model, data, model->expert_comm(), tensor);
  std::vector<CheckpointArrays> out;
  if (data->rank() != 0) return out;
  if (!model->shard()) {
    params.resize(n);
    PTK_RETURN_IF_ERROR(model->ReadParams(params));
    m.resize(n);
    v.resize(n);
    PTK_RETURN_IF_ERROR(model->ReadMoments(m, v));
  }
  if (!tensor || tensor->size() == 1) {
    out.push_back(std::move(mine));
    return out;
  }
  // Every tensor rank holds as many parameters (the split dimensions divide evenly).
  const int T = tensor->size(), me = tensor->rank();
  std::vector<int64_t> bytes(static_cast<size_t>(T), static_cast<int64_t>(n * sizeof(float)));
  std::vector<std::vector<float>> all(3, std::vector<float>(n * static_cast<size_t>(T)));
  const std::vector<float>* own[3] = {&params, &m, &v};
  for (size_t k = 0; k < 3; ++k) {
    std::copy(own[k]->begin(), own[k]->end(), all[k].begin() + static_cast<std::ptrdiff_t>(me * n));
    PTK_RETURN_IF_ERROR(tensor->AllGather(all[k].data(), bytes));
  }
  if (me != 0) return out;
  const PipelineStage stage = StageOfLayout(model->layout());
  for (int t = 0; t < T; ++t) {
    PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(model->config(), T, t, stage));
    auto slice = [&](size_t k) {
      return std::vector<float>(all[k].begin() + static_cast<std::ptrdiff_t>(t * n),
                                all[k].begin() + static_cast<std::ptrdiff_t>((t + 1) * n));
    };
    out.push_back({std::move(layout), slice(0), slice(1), slice(2)});
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<CheckpointArrays>> GatherCheckpointArrays(GPTModel* model, Communicator* data,
                                                                     Communicator* tensor, Communicator* pipeline,
                                                                     const std::vector<int64_t>& stage_layers,
                                                                     int virtual_size) {
  PTK_ASSIGN_OR_RETURN(std::vector<CheckpointArrays> out, GatherStage(model, data, tensor));
  if (!pipeline || pipeline->size() == 1 || out.empty()) return out;
  // Each later stage's entries (tensor rank by tensor rank of each expert rank) to the first stage, over the
  // pipeline group of data and tensor rank 0.
  const int P = pipeline->size(), me = pipeline->rank(), T = tensor ? tensor->size() : 1;
  const int E = model->layout().expert_size;
  if (static_cast<int>(stage_layers.size()) != P)
    return absl::InternalError("GatherCheckpointArrays: one layer count per pipeline stage");
  auto bytes = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size() * sizeof(float)); };
  if (me != 0) {
    for (const CheckpointArrays& a : out)
      for (const std::vector<float>* v : {&a.params, &a.exp_avg, &a.exp_avg_sq})
        PTK_RETURN_IF_ERROR(pipeline->SendRecv(v->data(), bytes(*v), 0, nullptr, 0, -1));
    return std::vector<CheckpointArrays>{};
  }
  for (int p = 1; p < P; ++p) {
    for (int k = 0; k < E * T; ++k) {
      PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(model->config(), T, k % T,
                                                                   StageOf(stage_layers, p, virtual_size), E, k / T));
      const size_t n = static_cast<size_t>(layout.num_params);
      CheckpointArrays a{std::move(layout), std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
      for (std::vector<float>* v : {&a.params, &a.exp_avg, &a.exp_avg_sq})
        PTK_RETURN_IF_ERROR(pipeline->SendRecv(nullptr, 0, -1, v->data(), bytes(*v), p));
      out.push_back(std::move(a));
    }
  }
  return out;
}

}  // namespace ptk
