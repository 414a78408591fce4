// Checkpoints in Megatron's directory layout: <save>/iter_0000100/mp_rank_00/model_optim_rng.ptk
// and <save>/latest_checkpointed_iteration.txt. One file holds model, AdamW moments, scheduler,
// RNG seed and data position, with a SHA-256 over all of it. A save goes to a temporary
// directory that is fsynced and renamed into place before the tracker file is atomically
// replaced, so a kill at any point leaves the previous checkpoint whole and `latest` pointing at
// it. A damaged or mismatched checkpoint is refused, never loaded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk::trainer {

struct TrainState {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  int64_t consumed_valid_samples = 0;
  int64_t scheduler_num_steps = 0;  // samples
  int64_t adam_step = 0;
  int64_t skipped_iterations = 0;
  uint64_t seed = 0;
  double wall_seconds = 0;  // training time so far, for progress reporting
};

std::string CheckpointDir(const std::string& save, int64_t iteration);   // <save>/iter_0000100
std::string CheckpointFile(const std::string& save, int64_t iteration);  // .../mp_rank_00/model_optim_rng.ptk

// Writes the checkpoint of `iteration` and then points the tracker at it.
absl::Status SaveCheckpoint(const std::string& save, const GPTModel& model, const std::vector<float>& exp_avg,
                            const std::vector<float>& exp_avg_sq, const TrainState& state,
                            const std::string& args_json);

// Removes what killed saves left in `save` (iter_*.ptk-tmp-PID, iter_*.ptk-old-PID). One run
// writes to one --save directory at a time.
absl::Status RemoveStaleCheckpointTemporaries(const std::string& save);

// The iteration named by <load>/latest_checkpointed_iteration.txt; NotFound when there is none.
absl::StatusOr<int64_t> LatestCheckpointIteration(const std::string& load);

// Loads into `model` (whose configuration must match the saved one), the moments and the state.
absl::Status LoadCheckpoint(const std::string& load, int64_t iteration, GPTModel* model, std::vector<float>* exp_avg,
                            std::vector<float>* exp_avg_sq, TrainState* state);

}  // namespace ptk::trainer
