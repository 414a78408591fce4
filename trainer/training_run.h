// RunTraining's run (training.cpp): the Trainer class, declared once and defined by concern: the loop and its ends
// (training.cpp), the start-up, model, checkpoint load and datasets (training_setup.cpp), and what the run reports,
// the log line, TensorBoard's scalars, evaluations and samples (training_report.cpp). Not part of the library's
// interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/data_loader.h"
#include "trainer/checkpoint.h"
#include "trainer/comm.h"
#include "trainer/evaluation.h"
#include "trainer/gpt_model.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/run_settings.h"
#include "trainer/timers.h"
#include "trainer/train_options.h"
#include "trainer/train_step.h"
#include "trainer/training.h"
#include "trainer/training_data.h"
#include "trainer/training_log.h"

namespace ptk::training_detail {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// One run of RunTraining, step by step (Megatron's pretrain and train): set up, resume, then
// iterations of train, log, evaluate, sample, save and decide to exit; then finish.
class Trainer {
 public:
  Trainer(const TrainOptions& options, const TrainPlan& plan, Communicator* comm);

  absl::StatusOr<TrainSummary> Run();

 private:
  // Megatron's lines: print_rank_0's from world rank 0 (start-up, datetimes, saves), print_rank_last's from the last
  // world rank (the log line, the evaluations' lines, as the timers' blocks): a launcher that keeps each rank's output
  // apart (torchrun --log-dir --tee, srun --output %t) shows each in the same rank's file as Megatron's.
  void Print(const std::string& line) const;
  void PrintLast(const std::string& line) const;
  void PrintAnyRank(const std::string& line) const;

  // The ranks agree on the settings, the model and its training step are made, and rank 0 takes
  // --save for this run and puts back what a killed save left aside.
  absl::Status SetUp();

  // Before the model is made: what this rank will hold (Megatron's line, from rank 0), and a run
  // that cannot fit in what the machine, its cgroup or ulimit -v leave (with this node's ranks) stopped.
  absl::Status ShardExpertParallelOptimizer();
  absl::Status CheckCpuMemory(const BackendOptions& backend);

  // --load: the weights, and unless --finetune the iteration, data position, moments and the training step's
  // state (Megatron's load_checkpoint); a directory without a checkpoint starts a new run.
  absl::Status Resume();

  // --load at or past the last iteration: Megatron's train() runs no iteration and pretrain goes on to its end (a
  // save unless --save-interval divides the iteration, as after a loop that saved it; the final evaluations).
  absl::StatusOr<TrainSummary> NothingToTrain();

  // The splits and their loaders (from the data position reached), --metrics-file, --tensorboard-dir.
  absl::Status OpenDataAndOutputs();

  // Whether iteration `it` writes the log line or TensorBoard's scalars (the params norm and the
  // count of zeros are computed for those only: every rank decides alike).
  bool LogsThisIteration(int64_t it) const;

  // --rampup-batch-size: Megatron's update_num_microbatches before each iteration, from the samples
  // consumed (a resume takes the batch size of where it stopped); when the number of micro-batches
  // grows, Megatron saves a checkpoint first (with --save).
  absl::Status UpdateBatchSize();

  // --iterations-to-skip: whether the next iteration is one to skip, and its skip (Megatron's dummy_train_step):
  // this rank's micro-batches of it read and dropped, the counter and the consumed and skipped samples advanced.
  bool SkipsNextIteration() const;
  absl::Status SkipIteration();

  // One iteration: this rank's micro-batches through the training step (Megatron's train_step).
  absl::StatusOr<StepResult> TrainIteration();

  // Megatron's pairs: the value at the iteration, and "<tag> vs samples" at the samples consumed.
  void TensorBoardScalar(const std::string& tag, double value);

  // Megatron's training_log: --metrics-file's line every iteration, TensorBoard's scalars every
  // --tensorboard-log-interval, the log line (averaged over the interval) every --log-interval.
  absl::Status Log(const StepResult& r);

  // Megatron's evaluate over `extent` of `loader`, its 'evaluate' timer block, its lines and
  // scalars (none with --skip-train, as Megatron's write_to_tensorboard); `set` names it in the line ("validation",
  // "validation-1"), tb_tag in TensorBoard ("lm loss validation", "lm loss test"); `verbose` (pretrain's evaluations
  // after training) prints its 'Evaluating' lines. As Megatron's, it checks --exit-duration-in-mins after each of its
  // iterations and stops when the time is up, with one line and no loss (nullopt): the loop then saves and exits as it
  // does between iterations.
  struct EvaluationRun {
    std::string prefix, set, tb_tag;
    bool verbose = false;
  };
  absl::StatusOr<std::optional<double>> Evaluate(DataLoader* loader, const EvaluationExtent& extent, int64_t* consumed,
                                                 const EvaluationRun& run);

  // Megatron's evaluate_and_print_results on the validation sets, one after the other: the split's loader read on
  // from the samples consumed (adding to *consumed), or with --full-validation or --multiple-validation-sets each set
  // from its first sample (--full-validation: all of it). False when --exit-duration-in-mins stopped it.
  absl::StatusOr<bool> EvaluateValidation(const std::string& prefix, int64_t* consumed, bool verbose);

  // --skip-train: Megatron's pretrain without train(): the evaluations of the loaded weights, no save.
  absl::StatusOr<TrainSummary> SkipTraining();

  // --sample-interval: rank 0 continues the prompt with the weights of this iteration.
  absl::Status Sample();

  // A checkpoint of this iteration in --save (none without it): the weights, the moments (ZeRO-1's
  // shards gathered, so that any number of ranks loads the file), the training step's state. Then
  // --save-retain-interval's removal of the checkpoint the tracker named before. `non_persistent`:
  // into the non-persistent directory instead, after the older checkpoints there are removed.
  absl::Status Save(bool non_persistent = false);

  // Megatron's cleanup_old_non_persistent_checkpoint and its two lines (rank 0).
  absl::Status CleanUpNonPersistent();

  // Megatron's checkpoint_and_decide_exit: the ranks agree on every reason through all-reduces;
  // a save every --save-interval; the reason to exit (a signal, --exit-duration-in-mins,
  // --exit-interval) in Megatron's words (the minutes as Python prints a float), or "" to go on.
  absl::StatusOr<std::string> SaveAndDecideExit();

  // An exit before the last iteration: this iteration saved, the reason in Megatron's print_datetime line.
  absl::StatusOr<TrainSummary> Exit(const std::string& reason);

  // After the last iteration (Megatron's pretrain after train): the profile, a save, the final
  // evaluation on the validation and test splits.
  absl::StatusOr<TrainSummary> Finish();

  // Megatron's evaluations after training: the validation sets', then the test split's; then Close.
  absl::StatusOr<TrainSummary> FinalEvaluations();

  // The summary; the metrics and event files closed with their errors checked.
  absl::StatusOr<TrainSummary> Close();

  const TrainOptions& o_;
  const TrainPlan& plan_;
  Communicator* const comm_;     // the data-parallel group
  Communicator* const world_;    // every rank (comm_ without tensor parallelism)
  Communicator* const tensor_;   // the tensor-parallel group; null without
  Communicator* const pipe_;     // the pipeline group; null with one stage
  Communicator* const context_;  // the context-parallel group; null with one context rank
  // comm_'s rank and size (data × context ranks: ZeRO-1's shards), the context size, the samplers' data rank and size.
  const int rank_, dp_, cp_, data_rank_, data_size_;
  std::vector<int64_t> context_positions_;  // this context rank's positions of each sample
  const bool lead_;                         // world rank 0: print_rank_0's lines, the checkpoint's writer
  // The last world rank: print_rank_last's lines, and the TensorBoard events and --metrics-file (Megatron's
  // _set_tensorboard_writer: rank world_size - 1), which hold the same reduced values as its log line.
  const bool last_;
  Settings settings_;
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<Timers> timers_;    // --timing-log-level's
  StageExchangeAgreement agreed_;     // the forward-only passes' exchange formats, agreed once each
  SaveDirectory save_dir_;            // rank 0's --save: a start refused on any rank leaves none it made
  SaveDirectory non_persistent_dir_;  // rank 0's non-persistent directory (SAVE/non_persistent too), the same
  TrainState state_;
  TrainSummary summary_;
  TrainingSplits data_;
  std::unique_ptr<DataLoader> train_loader_, valid_loader_;
  std::vector<std::unique_ptr<MicroBatch>> held_;  // this iteration's micro-batches
  std::vector<std::vector<int64_t>> keys_;
  std::vector<ModelBatch> batches_;
  RunOutputs outputs_;
  int64_t current_gbs_ = 0;            // this iteration's global batch (--rampup-batch-size changes it)
  Clock::time_point started_, start_;  // the process's start (--exit-duration-in-mins), training's
  double wall_before_ = 0;             // training time of the runs before this one
  LogInterval interval_{o_.log_interval};
  int64_t last_saved_ = -1;                 // the last iteration saved to --save
  int64_t last_non_persistent_saved_ = -1;  // the last saved to the non-persistent directory
};

}  // namespace ptk::training_detail
