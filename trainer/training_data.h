// ptk-train's datasets: the train, validation and test splits of a run (Megatron's
// build_train_valid_test_datasets, or --mock-data's synthetic documents), and the check of --load.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/data_loader.h"
#include "indexed_dataset/gpt_dataset.h"
#include "trainer/checkpoint.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/train_options.h"

namespace ptk {

struct TrainingSplits {
  std::shared_ptr<TopLevelDataset> train, valid, test;
  // The validation sets evaluated apart (--multiple-validation-sets: one per --valid-data-path prefix; else the
  // validation split alone, or none); `valid` is the first.
  std::vector<std::shared_ptr<TopLevelDataset>> valid_sets;
  std::vector<std::string> warnings;  // for the run to print: BuildGPTDatasets'
};

// The splits with Megatron's train_valid_test_num_samples for the plan (valid and test null
// without evaluation; --skip-train: --eval-iters global batches of each; --full-validation: one epoch of
// the validation split, Megatron's num_samples None); --mock-data: synthetic documents (an arithmetic run of token ids
// per sample, EOD-separated), the same for every run with the same seed. With `pipeline` (a stage of three or more,
// every stage calling it) a middle stage opens no data: its splits stand in with the first stage's sizes and samples of
// token 0 (their sample indices, which key dropout, are the first stage's).
absl::StatusOr<TrainingSplits> BuildTrainingDatasets(const TrainOptions& o, const TrainPlan& plan,
                                                     Communicator* pipeline = nullptr);

// --phase-transition-iterations: the phase iteration `iteration` starts (Megatron's get_train_valid_test_num_samples
// and build_train_valid_test_data_loaders): its training split's samples (from its first transition's to the next's
// in global batches, the last up to --train-samples), the samples the phase has consumed (its iterations done), and
// the iteration it ends at (the next transition, or the run's end).
struct TrainPhase {
  int64_t split_samples = 0, consumed = 0, end_iteration = 0;
};
TrainPhase PhaseAt(const TrainOptions& o, const TrainPlan& plan, int64_t iteration);

// A run resumed from `state` (the checkpoint's iteration and samples consumed) reads on from there:
// its iterations' training samples up to where it stops (--train-iters, or an earlier
// --exit-interval), and the validation samples of every --eval-interval and of the evaluation at the
// end. Each split is sized from this command line, as Megatron's; one that cannot hold them (a
// resume with a smaller --global-batch-size on a blend, or evaluating less often than the saved run
// did) is refused here, before any iteration, naming what the checkpoint consumed and what the run
// needs, instead of dying where the split runs out (Megatron's sampler stops there too).
absl::Status CheckSamplesLast(const TrainOptions& o, const TrainPlan& plan, const TrainState& state,
                              const TrainingSplits& splits);

// --load given a path inside a checkpoint directory (iter_0000020, its mp_rank_00, the file): Megatron
// and ptk take the directory that holds latest_checkpointed_iteration.txt, and training from random
// weights instead would be a silent mistake. A usage error naming that directory; OK otherwise.
absl::Status CheckLoadIsACheckpointDirectory(const std::string& load);

// --load holds no checkpoint (`why`: NotFound, naming what is missing): a --load inside a checkpoint directory
// refused (CheckLoadIsACheckpointDirectory), with --no-initialization a usage error (no weights to start from), and
// with --exit-on-missing-checkpoint the run stopped naming --load;
// else OK, the run starting from random initialization with a line from `lead` (a warning where --load is not
// --save: --load = --save is how every first run starts, another --load was meant to hold a checkpoint).
absl::Status NoCheckpointToLoad(const TrainOptions& o, const absl::Status& why, bool lead);

// Megatron's --pretrained-checkpoint: where --load holds no checkpoint (`why`), the iteration of
// --pretrained-checkpoint's to fine-tune from, said by `lead`; none there either: NotFound naming both.
absl::StatusOr<int64_t> PretrainedCheckpointToLoad(const TrainOptions& o, const absl::Status& why, bool lead);

// A loader's micro-batch as the model reads it; `keys` holds the samples' indices (dropout's keys).
ModelBatch View(const MicroBatch& mb, std::vector<int64_t>* keys);
// Context parallelism: each sample's rows at `positions` only (this context rank's,
// ContextParallelPositions), in that order, in place; the samples' indices stay, so dropout keys
// every row by its sample and true position.
void KeepContextRows(MicroBatch* mb, const std::vector<int64_t>& positions);

// RunTraining's check of its communicators against the plan: the data-parallel group (times the
// context group's ranks), the pipeline stages, the interleaved schedule's micro-batches.
absl::Status CheckRunCommunicators(const TrainOptions& o, const TrainPlan& plan, const Communicator& comm);

}  // namespace ptk
