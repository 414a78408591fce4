// Megatron's parallel layout: the rank order tp-cp-ep-dp-pp (tensor ranks adjacent, then context,
// then data, then pipeline), each rank's coordinates, the process groups as megatron-core's RankGenerator makes them,
// and the vocabulary padded for tensor parallelism. Pure arithmetic: no communicator, no model.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

// The groups initialize_model_parallel makes. kEmbedding: the first and last stage of a pipeline
// group (Megatron's default_embedding_ranks; one stage when P = 1). kModel: tensor × pipeline.
// kContext: the context ranks of one (tensor, data, pipeline) place (Megatron's "cp");
// kDataContext: data × context (Megatron's "dp-cp", the group its gradients are reduced and its
// distributed optimizer sharded over when the context size is above 1).
// kExpert: the expert-parallel ranks (Megatron's "ep" of its expert rank generator, tp-ep-dp-pp with cp 1 and its
// expert tensor size the tensor size: E consecutive ranks of a stage's data × context ranks of one tensor rank,
// context fastest), kExpertData: the ranks holding the same experts (its expert "dp", data × context / E of them),
// over which the experts' gradients are reduced.
enum class ParallelGroup {
  kTensor,
  kData,
  kPipeline,
  kEmbedding,
  kModel,
  kContext,
  kDataContext,
  kExpert,
  kExpertData
};
std::string_view ParallelGroupName(ParallelGroup kind);  // "tensor", "data", "pipeline", ...

struct RankCoords {
  int tensor = 0, data = 0, pipeline = 0, context = 0;
  bool operator==(const RankCoords&) const = default;
};

class ParallelLayout {
 public:
  // world = tensor × context × data × pipeline; `expert` ranks are carved from the data × context ranks (it must
  // divide them; the experts split over the tensor ranks as the dense layers, Megatron's default
  // --expert-tensor-parallel-size). Errors are usage errors naming the sizes (Megatron's
  // refusals: world not divisible by T·C·P, ...).
  static absl::StatusOr<ParallelLayout> Create(int world_size, int tensor, int pipeline, int context = 1,
                                               int expert = 1);

  int world_size() const { return world_; }
  int tensor_size() const { return tensor_; }
  int data_size() const { return data_; }
  int pipeline_size() const { return pipeline_; }
  int context_size() const { return context_; }
  int expert_size() const { return expert_; }

  // global rank = t + T·c + T·C·d + T·C·D·p (Megatron's generate_masked_orthogonal_rank_groups, ep = 1).
  RankCoords Coords(int rank) const;
  int Rank(const RankCoords& c) const;
  bool IsFirstStage(int rank) const { return Coords(rank).pipeline == 0; }
  bool IsLastStage(int rank) const { return Coords(rank).pipeline == pipeline_ - 1; }

  // The sorted global ranks of `rank`'s group of this kind; empty for the embedding group of a
  // middle pipeline stage (Megatron gives such a rank no embedding group).
  std::vector<int> Group(ParallelGroup kind, int rank) const;
  // Every group of this kind, in the order initialize_model_parallel creates them.
  std::vector<std::vector<int>> Groups(ParallelGroup kind) const;
  int64_t NumGroups(ParallelGroup kind) const;
  // The index-th group of Groups(kind), 0 <= index < NumGroups(kind), without making the others.
  std::vector<int> GroupAt(ParallelGroup kind, int64_t index) const;

 private:
  ParallelLayout(int world, int tensor, int data, int pipeline, int context, int expert)
      : world_(world), tensor_(tensor), data_(data), pipeline_(pipeline), context_(context), expert_(expert) {}
  int world_, tensor_, data_, pipeline_, context_, expert_;
};

// Megatron's load-balanced split of a sequence over `context` ranks (get_batch_on_this_cp_rank):
// the sequence cut into 2·context chunks of seq_length / (2·context) positions, rank r keeping
// chunks r and 2·context − 1 − r, in that order. The positions of rank `rank`'s rows, in order;
// seq_length must be a multiple of 2·context (PTK_CHECK: callers refuse the flags first).
std::vector<int64_t> ContextParallelPositions(int64_t seq_length, int context, int rank);
// Every rank's ContextParallelPositions, rank by rank (context × seq_length / context entries): the
// table the CUDA backend's context-parallel attention reads (cuda::ContextAttentionArgs::positions).
std::vector<int64_t> ContextParallelPositionTable(int64_t seq_length, int context);

// The vocabulary Megatron trains on at tensor size T: rounded up to a multiple of
// make_vocab_size_divisible_by × T (Megatron's _vocab_size_with_padding), so every tensor rank holds
// an equal slice. A usage error for a size below 1.
absl::StatusOr<int64_t> TensorParallelVocabSize(int64_t vocab_size, int64_t make_vocab_size_divisible_by, int tensor);
// " > padded vocab (size: 50257) with 943 dummy tokens (new size: 51200)", as Megatron prints it.
std::string PaddedVocabLine(int64_t vocab_size, int64_t padded_vocab_size);
// Megatron-LM 0.16.1's start-up line of the sizes (validate_args, rank 0): "using world size: 8, data-parallel
// size: 2, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 2,
// pipeline-model-parallel size: 2" (ptk has no hierarchical context parallelism: None).
std::string WorldSizeLine(const ParallelLayout& layout);

}  // namespace ptk
