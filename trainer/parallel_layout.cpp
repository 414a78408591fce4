// Megatron's rank order and process groups (megatron-core's RankGenerator, order tp-cp-ep-dp-pp).
#include "trainer/parallel_layout.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "common/status.h"

namespace ptk {

std::string_view ParallelGroupName(ParallelGroup kind) {
  switch (kind) {
    case ParallelGroup::kTensor: return "tensor";
    case ParallelGroup::kData: return "data";
    case ParallelGroup::kPipeline: return "pipeline";
    case ParallelGroup::kEmbedding: return "embedding";
    case ParallelGroup::kModel: return "model";
  }
  return "?";
}

absl::StatusOr<ParallelLayout> ParallelLayout::Create(int world_size, int tensor, int pipeline, int context,
                                                      int expert) {
  if (world_size < 1) return UsageError(fmt::format("the world size must be at least 1, not {}", world_size));
  if (tensor < 1) return UsageError(fmt::format("--tensor-model-parallel-size must be at least 1, not {}", tensor));
  if (pipeline < 1)
    return UsageError(fmt::format("--pipeline-model-parallel-size must be at least 1, not {}", pipeline));
  if (context != 1)
    return UsageError(fmt::format("--context-parallel-size {}: ptk supports context parallel size 1 only", context));
  if (expert != 1)
    return UsageError(fmt::format("--expert-model-parallel-size {}: ptk supports expert parallel size 1 only", expert));
  const int64_t model = static_cast<int64_t>(tensor) * pipeline;
  if (world_size % model != 0)
    return UsageError(
        fmt::format("the world size {} is not divisible by tensor × pipeline model parallel size {} × {} = {}",
                    world_size, tensor, pipeline, model));
  return ParallelLayout(world_size, tensor, static_cast<int>(world_size / model), pipeline);
}

RankCoords ParallelLayout::Coords(int rank) const {
  PTK_CHECK(rank >= 0 && rank < world_);
  return RankCoords{rank % tensor_, rank / tensor_ % data_, rank / (tensor_ * data_)};
}

int ParallelLayout::Rank(const RankCoords& c) const {
  PTK_CHECK(c.tensor >= 0 && c.tensor < tensor_ && c.data >= 0 && c.data < data_ && c.pipeline >= 0 &&
            c.pipeline < pipeline_);
  return c.tensor + tensor_ * (c.data + data_ * c.pipeline);
}

int64_t ParallelLayout::NumGroups(ParallelGroup kind) const {
  switch (kind) {
    case ParallelGroup::kTensor: return world_ / tensor_;
    case ParallelGroup::kData: return world_ / data_;
    case ParallelGroup::kPipeline:
    case ParallelGroup::kEmbedding: return world_ / pipeline_;
    case ParallelGroup::kModel: return data_;
  }
  return 0;
}

// Megatron numbers the groups of a kind by the coordinates the group does not span, the first
// of them (in tp-dp-pp order) fastest.
std::vector<int> ParallelLayout::GroupAt(ParallelGroup kind, int64_t index) const {
  PTK_CHECK(index >= 0 && index < NumGroups(kind));
  const int i = static_cast<int>(index);
  std::vector<int> g;
  switch (kind) {
    case ParallelGroup::kTensor:  // index = d + D·p
      for (int t = 0; t < tensor_; ++t) g.push_back(Rank({t, i % data_, i / data_}));
      break;
    case ParallelGroup::kData:  // index = t + T·p
      for (int d = 0; d < data_; ++d) g.push_back(Rank({i % tensor_, d, i / tensor_}));
      break;
    case ParallelGroup::kPipeline:  // index = t + T·d
      for (int p = 0; p < pipeline_; ++p) g.push_back(Rank({i % tensor_, i / tensor_, p}));
      break;
    case ParallelGroup::kEmbedding:
      g.push_back(Rank({i % tensor_, i / tensor_, 0}));
      if (pipeline_ > 1) g.push_back(Rank({i % tensor_, i / tensor_, pipeline_ - 1}));
      break;
    case ParallelGroup::kModel:  // index = d
      for (int p = 0; p < pipeline_; ++p)
        for (int t = 0; t < tensor_; ++t) g.push_back(Rank({t, i, p}));
      break;
  }
  return g;
}

std::vector<int> ParallelLayout::Group(ParallelGroup kind, int rank) const {
  const RankCoords c = Coords(rank);
  switch (kind) {
    case ParallelGroup::kTensor: return GroupAt(kind, c.data + static_cast<int64_t>(data_) * c.pipeline);
    case ParallelGroup::kData: return GroupAt(kind, c.tensor + static_cast<int64_t>(tensor_) * c.pipeline);
    case ParallelGroup::kPipeline: return GroupAt(kind, c.tensor + static_cast<int64_t>(tensor_) * c.data);
    case ParallelGroup::kEmbedding:
      if (c.pipeline != 0 && c.pipeline != pipeline_ - 1) return {};
      return GroupAt(kind, c.tensor + static_cast<int64_t>(tensor_) * c.data);
    case ParallelGroup::kModel: return GroupAt(kind, c.data);
  }
  return {};
}

std::vector<std::vector<int>> ParallelLayout::Groups(ParallelGroup kind) const {
  std::vector<std::vector<int>> all;
  const int64_t n = NumGroups(kind);
  all.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all.push_back(GroupAt(kind, i));
  return all;
}

absl::StatusOr<int64_t> TensorParallelVocabSize(int64_t vocab_size, int64_t make_vocab_size_divisible_by, int tensor) {
  if (vocab_size < 1) return UsageError(fmt::format("the vocabulary size must be at least 1, not {}", vocab_size));
  if (make_vocab_size_divisible_by < 1)
    return UsageError(
        fmt::format("--make-vocab-size-divisible-by must be at least 1, not {}", make_vocab_size_divisible_by));
  if (tensor < 1) return UsageError(fmt::format("--tensor-model-parallel-size must be at least 1, not {}", tensor));
  const int64_t multiple = make_vocab_size_divisible_by * tensor;
  if (multiple > std::numeric_limits<int32_t>::max())
    return UsageError(fmt::format("--make-vocab-size-divisible-by {} × tensor model parallel size {} is too large",
                                  make_vocab_size_divisible_by, tensor));
  return (vocab_size + multiple - 1) / multiple * multiple;
}

std::string PaddedVocabLine(int64_t vocab_size, int64_t padded_vocab_size) {
  return fmt::format(" > padded vocab (size: {}) with {} dummy tokens (new size: {})", vocab_size,
                     padded_vocab_size - vocab_size, padded_vocab_size);
}

}  // namespace ptk
