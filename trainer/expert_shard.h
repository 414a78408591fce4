// ZeRO-1 under expert parallelism (--use-distributed-optimizer with --expert-model-parallel-size, CPU), as
// Megatron's distributed optimizer shards it: the dense parameters' AdamW state over the data-parallel group,
// the expert weights' over the expert-data-parallel group (the ranks holding the same experts). Each group's
// runs of the flat buffer (ExpertGradRanges), laid end to end, are cut into one contiguous part per rank of
// the group, from rank 0 up; a rank keeps the moments of its two parts, packed in buffer order
// (GPTModel::ShardOptimizerStateRanges). The gradients are summed whole as without ZeRO-1 (ReduceExpertParallelGrads),
// so the norm, the count of zeros and each update have the same bits; after its update each rank's parts of the
// weights go to its groups (AllGatherExpertShardedParams).
#pragma once

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/grad_buckets.h"
#include "trainer/param_layout.h"

namespace ptk {

struct ExpertShard {
  std::vector<std::vector<GradRange>> dense;    // data rank r's part of the dense runs
  std::vector<std::vector<GradRange>> experts;  // expert-data rank r's part of the expert runs
  int data_rank = 0, expert_data_rank = 0;
  // This rank's ranges: its dense and expert parts, in buffer order.
  std::vector<GradRange> Owned() const;
};

// The cut for a data group of `data_size` and an expert-data group of `expert_data_size` ranks.
ExpertShard MakeExpertShard(const ParamLayout& layout, int data_size, int data_rank, int expert_data_size,
                            int expert_data_rank);
// The cut of `model`'s layout over `data` and the model's expert-data group (one rank where it has none).
ExpertShard ExpertShardOf(const GPTModel& model, const Communicator& data);

// Every rank of `comm` holds `full`'s values in its ranges of_rank[comm->rank()]: each rank's to every rank
// (one AllGather), so that `full` holds every rank's ranges.
absl::Status AllGatherRanges(Communicator* comm, const std::vector<std::vector<GradRange>>& of_rank,
                             std::span<float> full);

// After the update of a model sharded with ShardOptimizerStateRanges: the dense parts over `data`, the expert
// parts over the expert-data group, so that every rank holds the whole updated model.
absl::Status AllGatherExpertShardedParams(GPTModel* model, Communicator* data);

// The whole buffer's moments (num_params each) from the model's packed ones: its own ranges' from the model,
// every other rank's from its groups (as AllGatherExpertShardedParams).
absl::Status GatherExpertShardedMoments(GPTModel* model, Communicator* data, std::span<float> exp_avg,
                                        std::span<float> exp_avg_sq);

// `packed` (the owned ranges' values, in their order) from `full` (num_params values).
std::vector<float> PackRanges(const std::vector<GradRange>& ranges, std::span<const float> full);

}  // namespace ptk
