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

// Collective over `data` (every rank, under ZeRO-1), `tensor` (null without tensor parallelism;
// the ranks of data rank 0) and `pipeline` (null with one stage; the stages of data and tensor
// rank 0, whose layers are `stage_layers`). Returns the entries (p * T + t: tensor rank t of stage
// p) on data rank 0's tensor rank 0 of the first stage, and nothing elsewhere. `virtual_size`: the
// model chunks of each stage.
absl::StatusOr<std::vector<CheckpointArrays>> GatherCheckpointArrays(GPTModel* model, Communicator* data,
                                                                     Communicator* tensor,
                                                                     Communicator* pipeline = nullptr,
                                                                     const std::vector<int64_t>& stage_layers = {},
                                                                     int virtual_size = 1);

}  // namespace ptk
