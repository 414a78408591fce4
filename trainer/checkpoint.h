// Checkpoints in Megatron's directory layout: <save>/iter_0000100/mp_rank_00/model_optim_rng.ptk
// and <save>/latest_checkpointed_iteration.txt. One file holds model, AdamW moments, scheduler (its
// step and its settings),
// RNG seed, data position and the run's settings, with a SHA-256 over all of it. A save writes a
// temporary directory, fsyncs it and renames it into place (an older copy of the same iteration is
// renamed aside first and removed only once the new one is in place) before the tracker file is
// atomically replaced; RecoverCheckpointDir puts back an iteration whose directory a kill left
// aside. So at every instant `latest` names a whole checkpoint, or one that the next run's
// recovery restores from a verified copy. A damaged or mismatched checkpoint is refused, never
// loaded.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/param_layout.h"
#include "trainer/train_step.h"

namespace ptk {

class ProgressReporter;  // common/progress.h

struct TrainState {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  int64_t consumed_valid_samples = 0;
  int64_t scheduler_num_steps = 0;  // samples
  int64_t adam_step = 0;
  int64_t skipped_iterations = 0;
  // --iterations-to-skip's and --decrease-batch-size-if-needed's (Megatron's args.skipped_train_samples).
  int64_t skipped_train_samples = 0;
  std::optional<LossScaleState> loss_scale;  // --fp16's dynamic scaler; none otherwise
  // The scheduler's settings (Megatron's OptimizerParamScheduler.state_dict), compared with the
  // command line's on resume. None in checkpoints written before they were recorded.
  std::optional<SchedulerConfig> scheduler;
  uint64_t seed = 0;
  double wall_seconds = 0;  // training time so far, for progress reporting
  // The settings a resumed run compares with its own (flag name, value), e.g. {"--seed", "1234"}.
  // Empty in checkpoints written before they were recorded.
  std::vector<std::pair<std::string, std::string>> settings;
  // The model's buffers (GPTModel::ReadBuffers: a router's expert_bias under Megatron's name), every rank's alike;
  // empty where the model has none (and in checkpoints written before them).
  ModelBuffers buffers;
};

// The setting (TrainState::settings; value "none") of a checkpoint imported from one that held no
// optimizer state, its AdamW moments zero: ptk-train --load refuses it unless --no-load-optim or
// --finetune, as Megatron's load_checkpoint refuses the checkpoint itself.
inline constexpr char kOptimizerStateSetting[] = "optimizer state";

// A usage error naming --no-load-optim and --finetune where `loaded` (the checkpoint of `iteration` in
// `load`) records kOptimizerStateSetting "none" and neither is given (`optimizer_not_loaded` false).
absl::Status CheckOptimizerStateLoads(const TrainState& loaded, const std::string& load, int64_t iteration,
                                      bool optimizer_not_loaded);

std::string CheckpointDir(const std::string& save, int64_t iteration);  // <save>/iter_0000100
// .../mp_rank_TT/model_optim_rng.ptk: tensor rank TT's file (Megatron's layout for one pipeline
// stage); for tensor rank 0, mp_rank_00_000's where a pipelined checkpoint is there instead.
std::string CheckpointFile(const std::string& save, int64_t iteration, int tensor_rank = 0);
// mp_rank_TT/model_optim_rng.ptk, or with several pipeline stages mp_rank_TT_PPP/... (Megatron's).
// With expert parallelism (expert_size above 1) Megatron's _EEE after them: mp_rank_TT[_PPP]_EEE.
std::string MpRankFile(int tensor_rank, int pipeline_rank = 0, int pipeline_size = 1, int expert_rank = 0,
                       int expert_size = 1);
// The first rank's file in an iteration directory: mp_rank_00's, else mp_rank_00_000's, else mp_rank_00_000_000's.
std::string FirstRankFile(const std::string& dir);

// Writes the checkpoint of `iteration` and then points the tracker at it. A save that fails (a
// full disk) removes what it wrote and leaves the previous checkpoint and the tracker as they were.
// `params`, `exp_avg` and `exp_avg_sq` are host copies in `layout`'s order. `progress`, when given, gets
// the files and the arrays' bytes to write as its totals and counts them as they are written (ptk-convert's).
absl::Status SaveCheckpoint(const std::string& save, const ParamLayout& layout, std::span<const float> params,
                            std::span<const float> exp_avg, std::span<const float> exp_avg_sq, const TrainState& state,
                            const std::string& args_json, ProgressReporter* progress = nullptr);

// Every model-parallel rank's part at once (shards[(p * E + e) * T + t]: tensor rank t of expert rank e of
// pipeline stage p,
// its layout and arrays; one shard at T = P = 1): each in its mp_rank_TT (mp_rank_TT_PPP with
// several stages), all in the one directory the save renames into place.
struct CheckpointShard {
  const ParamLayout* layout = nullptr;
  std::span<const float> params, exp_avg, exp_avg_sq;
};
absl::Status SaveCheckpoint(const std::string& save, std::span<const CheckpointShard> shards, const TrainState& state,
                            const std::string& args_json, ProgressReporter* progress = nullptr);

// Makes `save` whole again after a killed save: an iteration directory that is missing while a
// complete copy of it (its checksum verified) lies aside as iter_*.ptk-tmp-* or iter_*.ptk-old-*
// is renamed back; every other temporary a save leaves (those directories, the tracker's
// temporaries) is removed; a run's first save killed before its tracker was written (the only
// iteration directory, complete, and no tracker) gets the tracker naming it. Call only while holding the directory's
// run lock (one run writes to one
// --save directory at a time).
absl::Status RecoverCheckpointDir(const std::string& save);

// A usage error where `save` (--save, or the flag `flag` that names it) holds Megatron's own checkpoints (a
// ptk-convert export, a Megatron run): a save there would move the latest_checkpointed_iteration.txt Megatron reads
// to a ptk checkpoint. OK else.
absl::Status CheckSaveHoldsNoMegatronCheckpoint(const std::string& save, std::string_view flag = "--save");

// Checks that a checkpoint file is complete: magic, length and its own SHA-256.
absl::Status VerifyCheckpointFile(const std::string& file);

// Why a file whose first bytes are `head` is not a ptk checkpoint: "not a ptk checkpoint (bad magic)",
// and what it is when that is known (a zip: PyTorch's torch.save format, Megatron's checkpoint file).
std::string NotAPtkCheckpoint(std::string_view head);

// The iteration named by <load>/latest_checkpointed_iteration.txt; NotFound when there is none.
// Anything but decimal digits (surrounding whitespace aside) is refused as DataLoss.
absl::StatusOr<int64_t> LatestCheckpointIteration(const std::string& load);
// The iteration a run resumes from: LatestCheckpointIteration's, or with --ckpt-step that one (Megatron's:
// it replaces the tracker's number, and a --load without a tracker holds no checkpoint); a --ckpt-step
// whose checkpoint is not there, or a --load without one, is a usage error naming the flag.
absl::StatusOr<int64_t> CheckpointToLoad(const std::string& load, std::optional<int64_t> ckpt_step);

// Loads the parameters (whose layout must match the saved one: same model flags), the moments and
// the state: `layout`'s tensor rank's file, or, when another tensor size saved it, this rank's
// slices of the whole model put together from every saved rank's (LoadResharded). A directory holding Megatron's own
// PyTorch checkpoint (model_optim_rng.pt, torch_dist shards) is refused saying so.
// `progress`, when given, gets the files to read and their bytes as its totals and counts them as they are read
// and checksummed (ptk-convert's).
absl::Status LoadCheckpoint(const std::string& load, int64_t iteration, const ParamLayout& layout,
                            std::vector<float>* params, std::vector<float>* exp_avg, std::vector<float>* exp_avg_sq,
                            TrainState* state, ProgressReporter* progress = nullptr);

// LoadCheckpoint's pieces. The directory holding the checkpoint of `iteration` (iter_N, or a
// complete copy a killed save left aside); the tensor size that saved it (1 for a ptk before
// tensor parallelism); one tensor rank's file, whose layout must be `layout`'s (rank and size too).
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& load, int64_t iteration);
// The tensor size and pipeline stages a checkpoint was saved with, from its first file's header
// (one stage of all layers for a ptk before pipeline parallelism).
struct SavedParallelism {
  int tensor_size = 1;
  int expert_size = 1;   // --expert-model-parallel-size (1 for a ptk before expert parallelism)
  int virtual_size = 1;  // model chunks of each stage (Megatron's virtual pipeline size)
  std::vector<int64_t> stage_layers;
  int pipeline_size() const { return static_cast<int>(stage_layers.size()); }
};
absl::StatusOr<SavedParallelism> ReadSavedParallelism(const std::string& file);
// Every saved rank's file in iteration directory `dir`, stage by stage, expert rank by expert rank, tensor rank
// by tensor rank.
std::vector<std::string> SavedRankFiles(const std::string& dir, const SavedParallelism& saved);
// Every rank's file of the checkpoint in iteration directory `dir` (the tensor ranks and stages its
// first file's header names) there and complete (VerifyCheckpointFile). (checkpoint_reshard.cpp)
absl::Status VerifyCheckpointDir(const std::string& dir);
// A tensor's chunk and name in a checkpoint's header: with model chunks, Megatron's (model v, its
// layers numbered from 0 within the chunk); otherwise chunk 0 and the layout's name.
std::pair<int, std::string> ChunkName(const ParamLayout& layout, const std::string& name);
absl::StatusOr<std::string> ReadCheckpointHeaderText(const std::string& file);
absl::Status LoadCheckpointFile(const std::string& file, int64_t iteration, const ParamLayout& layout,
                                std::vector<float>* params, std::vector<float>* exp_avg, std::vector<float>* exp_avg_sq,
                                TrainState* state, ProgressReporter* progress = nullptr);
// A checkpoint saved with other tensor or pipeline sizes (`saved`) in `dir`, loaded at `layout`'s:
// every saved rank's slices put together into the whole model (weights and moments), then
// `layout`'s slices of its stage cut. (checkpoint_reshard.cpp, as ReadSavedParallelism)
absl::Status LoadResharded(const std::string& dir, const SavedParallelism& saved, int64_t iteration,
                           const ParamLayout& layout, std::vector<float>* params, std::vector<float>* exp_avg,
                           std::vector<float>* exp_avg_sq, TrainState* state, ProgressReporter* progress = nullptr);

// The settings the checkpoint of `iteration` in `load` records of its run (flag name, value), read
// from its header alone (LoadCheckpoint verifies the file). A checkpoint that records none (an
// earlier ptk, a conversion) gives its model's shape under the flags' names instead.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadCheckpointSettings(const std::string& load,
                                                                                        int64_t iteration);

// Fault injection for tests: SaveCheckpoint calls the hook before each step of a save (its
// renames, fsyncs, writes and removals, by name, e.g. "rename new directory in"); a non-OK status
// fails the save at that step as an I/O error would, and a hook may end the process there (a kill).
// Not thread-safe; an empty function removes the hook.
using SaveStepHook = std::function<absl::Status(std::string_view step)>;
void SetSaveStepHookForTesting(SaveStepHook hook);

}  // namespace ptk
