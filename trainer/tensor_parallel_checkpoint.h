// What a checkpoint writes, gathered on world rank 0: every tensor rank's slices of the weights and
// AdamW moments (ZeRO-1's shards gathered over each data group first), one entry per tensor rank,
// each with its layout; SaveCheckpoint writes entry t to mp_rank_TT.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"

namespace ptk {

struct CheckpointArrays {
  ParamLayout layout;
  std::vector<float> params, exp_avg, exp_avg_sq;
};

// Collective over `data` (every rank, under ZeRO-1) and `tensor` (null without tensor
// parallelism; the ranks of data rank 0). Returns the entries on data rank 0's tensor rank 0, and
// nothing elsewhere.
absl::StatusOr<std::vector<CheckpointArrays>> GatherCheckpointArrays(GPTModel* model, Communicator* data,
                                                                     Communicator* tensor);

}  // namespace ptk
