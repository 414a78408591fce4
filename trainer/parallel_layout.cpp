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
    case ParallelGroup::kContext: return "context";
    case ParallelGroup::kDataContext: return "data-context";
    case ParallelGroup::kExpert: return "expert";
    case ParallelGroup::kExpertData: return "expert-data";
  }
  return "?";
}

absl::StatusOr<ParallelLayout> ParallelLayout::Create(int world_size, int tensor, int pipeline, int context,
                                                      int expert) {
  if (world_size < 1) return UsageError(fmt::format("the world size must be at least 1, not {}", world_size));
  if (tensor < 1) return UsageError(fmt::format("--tensor-model-parallel-size must be at least 1, not {}", tensor));
  if (pipeline < 1)
    return UsageError(fmt::format("--pipeline-model-parallel-size must be at least 1, not {}", pipeline));
  if (context < 1) return UsageError(fmt::format("--context-parallel-size must be at least 1, not {}", context));
  if (expert < 1) return UsageError(fmt::format("--expert-model-parallel-size must be at least 1, not {}", expert));
  const int64_t model = static_cast<int64_t>(tensor) * pipeline;
  if (world_size % model != 0)
    return UsageError(
        fmt::format("the world size {} is not divisible by tensor × pipeline model parallel size {} × {} = {}",
                    world_size, tensor, pipeline, model));
  if (world_size % (model * context) != 0)
    return UsageError(fmt::format(
        "the world size {} is not divisible by tensor × pipeline model parallel × context parallel size {} × {} × {} "
        "= {}",
        world_size, tensor, pipeline, context, model * context));
  const int data = static_cast<int>(world_size / (model * context));
  // Megatron's expert mesh (tp-ep-dp-pp, cp 1) takes its expert ranks from the data × context ranks of a stage.
  if (data * context % expert != 0)
    return UsageError(
        context > 1
            ? fmt::format("--expert-model-parallel-size {}: the data × context parallel size {} × {} (world size {} / "
                          "tensor × pipeline size {}) is not divisible by it",
                          expert, data, context, world_size, model)
            : fmt::format("--expert-model-parallel-size {}: the data-parallel size {} (world size {} / pipeline size "
                          "{}) is not "
                          "divisible by it",
                          expert, data, world_size, pipeline));
  return ParallelLayout(world_size, tensor, data, pipeline, context, expert);
}

RankCoords ParallelLayout::Coords(int rank) const {
  PTK_CHECK(rank >= 0 && rank < world_);
  RankCoords c;
  c.tensor = rank % tensor_;
  c.context = rank / tensor_ % context_;
  c.data = rank / (tensor_ * context_) % data_;
  c.pipeline = rank / (tensor_ * context_ * data_);
  return c;
}

int ParallelLayout::Rank(const RankCoords& c) const {
  PTK_CHECK(c.tensor >= 0 && c.tensor < tensor_ && c.data >= 0 && c.data < data_ && c.pipeline >= 0 &&
            c.pipeline < pipeline_ && c.context >= 0 && c.context < context_);
  return c.tensor + tensor_ * (c.context + context_ * (c.data + data_ * c.pipeline));
}

int64_t ParallelLayout::NumGroups(ParallelGroup kind) const {
  switch (kind) {
    case ParallelGroup::kTensor: return world_ / tensor_;
    case ParallelGroup::kData: return world_ / data_;
    case ParallelGroup::kPipeline:
    case ParallelGroup::kEmbedding: return world_ / pipeline_;
    case ParallelGroup::kModel: return static_cast<int64_t>(data_) * context_;
    case ParallelGroup::kContext: return world_ / context_;
    case ParallelGroup::kDataContext: return world_ / (data_ * context_);
    case ParallelGroup::kExpert: return world_ / expert_;
    case ParallelGroup::kExpertData: return static_cast<int64_t>(expert_) * tensor_ * pipeline_;
  }
  return 0;
}

// Megatron numbers the groups of a kind by the coordinates the group does not span, the first
// of them (in tp-cp-dp-pp order) fastest.
std::vector<int> ParallelLayout::GroupAt(ParallelGroup kind, int64_t index) const {
  PTK_CHECK(index >= 0 && index < NumGroups(kind));
  const int i = static_cast<int>(index), T = tensor_, C = context_, D = data_;
  auto rank = [&](int t, int c, int d, int p) {
    RankCoords rc;
    rc.tensor = t;
    rc.context = c;
    rc.data = d;
    rc.pipeline = p;
    return Rank(rc);
  };
  std::vector<int> g;
  switch (kind) {
    case ParallelGroup::kTensor:  // index = c + C·d + C·D·p
      for (int t = 0; t < T; ++t) g.push_back(rank(t, i % C, i / C % D, i / (C * D)));
      break;
    case ParallelGroup::kContext:  // index = t + T·d + T·D·p
      for (int c = 0; c < C; ++c) g.push_back(rank(i % T, c, i / T % D, i / (T * D)));
      break;
    case ParallelGroup::kData:  // index = t + T·c + T·C·p
      for (int d = 0; d < D; ++d) g.push_back(rank(i % T, i / T % C, d, i / (T * C)));
      break;
    case ParallelGroup::kDataContext:  // index = t + T·p
      for (int d = 0; d < D; ++d)
        for (int c = 0; c < C; ++c) g.push_back(rank(i % T, c, d, i / T));
      break;
    case ParallelGroup::kPipeline:  // index = t + T·c + T·C·d
      for (int p = 0; p < pipeline_; ++p) g.push_back(rank(i % T, i / T % C, i / (T * C), p));
      break;
    case ParallelGroup::kEmbedding:
      g.push_back(rank(i % T, i / T % C, i / (T * C), 0));
      if (pipeline_ > 1) g.push_back(rank(i % T, i / T % C, i / (T * C), pipeline_ - 1));
      break;
    case ParallelGroup::kModel:  // index = c + C·d
      for (int p = 0; p < pipeline_; ++p)
        for (int t = 0; t < T; ++t) g.push_back(rank(t, i % C, i / C, p));
      break;
    // The expert generator's (tp-ep-dp-pp with cp 1, its tensor size the tensor size): the data × context ranks of a
    // stage and tensor rank, in rank order j = c + C·d, are expert rank j % E of expert-data rank j / E.
    case ParallelGroup::kExpert: {  // index = t + T·(j / E) + T·(C·D / E)·p
      const int q = i / T, groups = C * D / expert_;
      for (int e = 0; e < expert_; ++e) {
        const int j = q % groups * expert_ + e;
        g.push_back(rank(i % T, j % C, j / C, q / groups));
      }
      break;
    }
    case ParallelGroup::kExpertData: {  // index = t + T·(j % E) + T·E·p
      const int q = i / T;
      for (int k = 0; k < C * D / expert_; ++k) {
        const int j = k * expert_ + q % expert_;
        g.push_back(rank(i % T, j % C, j / C, q / expert_));
      }
      break;
    }
  }
  return g;
}

std::vector<int> ParallelLayout::Group(ParallelGroup kind, int rank) const {
  const RankCoords c = Coords(rank);
  const int64_t T = tensor_, C = context_, D = data_;
  switch (kind) {
    case ParallelGroup::kTensor: return GroupAt(kind, c.context + C * (c.data + D * c.pipeline));
    case ParallelGroup::kContext: return GroupAt(kind, c.tensor + T * (c.data + D * c.pipeline));
    case ParallelGroup::kData: return GroupAt(kind, c.tensor + T * (c.context + C * c.pipeline));
    case ParallelGroup::kDataContext: return GroupAt(kind, c.tensor + T * c.pipeline);
    case ParallelGroup::kPipeline: return GroupAt(kind, c.tensor + T * (c.context + C * c.data));
    case ParallelGroup::kEmbedding:
      if (c.pipeline != 0 && c.pipeline != pipeline_ - 1) return {};
      return GroupAt(kind, c.tensor + T * (c.context + C * c.data));
    case ParallelGroup::kModel: return GroupAt(kind, c.context + C * c.data);
    case ParallelGroup::kExpert:
      return GroupAt(kind, c.tensor + T * ((c.context + C * c.data) / expert_ + C * D / expert_ * c.pipeline));
    case ParallelGroup::kExpertData:
      return GroupAt(kind, c.tensor + T * ((c.context + C * c.data) % expert_ + expert_ * c.pipeline));
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

std::vector<int64_t> ContextParallelPositions(int64_t seq_length, int context, int rank) {
  PTK_CHECK(context >= 1 && rank >= 0 && rank < context && seq_length % (2 * context) == 0);
  const int64_t chunk = seq_length / (2 * context);
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(2 * chunk));
  for (const int64_t k : {static_cast<int64_t>(rank), static_cast<int64_t>(2 * context - 1 - rank)})
    for (int64_t i = 0; i < chunk; ++i) positions.push_back(k * chunk + i);
  return positions;
}

std::vector<int64_t> ContextParallelPositionTable(int64_t seq_length, int context) {
  std::vector<int64_t> table;
  table.reserve(static_cast<size_t>(seq_length));
  for (int r = 0; r < context; ++r) {
    const std::vector<int64_t> mine = ContextParallelPositions(seq_length, context, r);
    table.insert(table.end(), mine.begin(), mine.end());
  }
  return table;
}

std::string PaddedVocabLine(int64_t vocab_size, int64_t padded_vocab_size) {
  return fmt::format(" > padded vocab (size: {}) with {} dummy tokens (new size: {})", vocab_size,
                     padded_vocab_size - vocab_size, padded_vocab_size);
}

std::string WorldSizeLine(const ParallelLayout& layout) {
  return fmt::format(
      "using world size: {}, data-parallel size: {}, context-parallel size: {}, hierarchical context-parallel sizes: "
      "None, tensor-model-parallel size: {}, pipeline-model-parallel size: {}",
      layout.world_size(), layout.data_size(), layout.context_size(), layout.tensor_size(), layout.pipeline_size());
}

}  // namespace ptk
