// ptk-train's options: what RunTraining is asked to do (the model, its backend, the batch, the
// schedule, data, evaluation, logging, checkpoints, the ranks), each under its Megatron flag; and
// the plan they make, resolved once: every check between two settings, the batch arithmetic and
// the schedule in samples.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "trainer/backend.h"
#include "trainer/comm.h"
#include "trainer/fim_codec.h"
#include "trainer/gpt_model.h"
#include "trainer/lr_schedule.h"
#include "trainer/train_step.h"

namespace ptk {

// --tensorboard-dir: Megatron's scalars in TensorBoard event files (rank 0), selected by its flags.
struct TensorBoardOptions {
  std::string dir;                  // empty: no event files
  int64_t log_interval = 1;         // --tensorboard-log-interval
  bool log_loss_scale = true;       // off: --no-log-loss-scale-to-tensorboard
  bool log_validation_ppl = false;  // --log-validation-ppl-to-tensorboard
  bool log_world_size = false;      // --log-world-size-to-tensorboard
  bool log_timers = false;          // --log-timers-to-tensorboard: iteration-time and the timers' <name>-time (s)
  bool log_throughput = false;      // --log-throughput: the log line's TFLOP/s/GPU (TensorBoard's with log_timers)
};

// --sample-interval: rank 0 prints a continuation of a prompt every `interval` iterations. The
// trainer does not tokenize: the caller passes the prompt's ids and a decoder.
struct SampleOptions {
  int64_t interval = 0;  // 0: no samples
  std::vector<int32_t> prompt;
  std::string prompt_text;  // as given, for the printed line
  int64_t length = 32;
  double temperature = 0;  // 0: greedy; else drawn, keyed by --seed and the iteration
  std::function<std::string(std::span<const int32_t>)> decode;
};

// The schedule's flags that PlanTraining resolves into SchedulerConfig once the global batch size
// is known: lengths in iterations (a --train-iters run) or in samples (a --train-samples run), and
// the weight decay, which --start-weight-decay / --end-weight-decay replace at either end.
struct ScheduleOptions {
  int64_t lr_decay_iters = 0, lr_decay_samples = 0;  // 0: the whole run
  int64_t lr_warmup_iters = 0, lr_warmup_samples = 0;
  std::optional<double> lr_warmup_fraction;  // of the decay length, instead of the two above
  int64_t lr_wsd_decay_iters = 0, lr_wsd_decay_samples = 0;
  double weight_decay = 0.01;
  std::optional<double> start_weight_decay, end_weight_decay;
};

// A setting's own range is checked where ptk-train's option table declares its flag; how settings
// go together is PlanTraining's.
struct TrainOptions {
  GPTConfig model;             // vocab_size / padded_vocab_size filled by the caller
  BackendOptions backend;      // --device, precision, --deterministic-mode
  LossScaleConfig loss_scale;  // --fp16's scaler (scale 1 otherwise)
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: micro_batch_size * data-parallel size
  int64_t train_iters = 0;        // one of train_iters / train_samples
  int64_t train_samples = 0;
  // --rampup-batch-size START INCR SAMPLES (Megatron's RampupBatchsizeNumMicroBatchesCalculator):
  // the global batch grows from START by INCR up to --global-batch-size over SAMPLES samples.
  // Empty: the batch is --global-batch-size throughout.
  std::vector<int64_t> rampup_batch_size;
  // Megatron's --iterations-to-skip: where the iteration counter (the iterations done so far, one less than the
  // number the step's log line would show) is one of these, the step's global batch is read and dropped: the counter
  // and the consumed (and skipped) samples advance, nothing else runs (no step, no scheduler step, no log line,
  // evaluation, sample, save or exit check). Any order, repeats and numbers never reached are harmless.
  std::vector<int64_t> iterations_to_skip;
  // Megatron's --decrease-batch-size-if-needed: a --global-batch-size that --micro-batch-size x data-parallel size
  // does not divide is cut, each iteration, to its largest multiple; the rest of it counts as skipped samples.
  bool decrease_batch_size_if_needed = false;
  // Megatron's --phase-transition-iterations (sorted): multi-phase training. The run saves and exits at each of these
  // iterations; each phase builds its training split for its own samples (from one transition to the next, in global
  // batches; the last phase up to --train-samples) and reads it from its first sample, so a relaunch at a transition
  // may name the next phase's data. --train-samples runs only, no --rampup-batch-size; a resume keeps the global batch.
  std::vector<int64_t> phase_transition_iterations;

  OptimizerConfig optimizer;
  // The rates (--lr, --min-lr, --lr-warmup-init) and styles (--lr-decay-style,
  // --lr-wsd-decay-style, --weight-decay-incr-style); PlanTraining fills in the rest from
  // schedule_options.
  SchedulerConfig schedule;
  ScheduleOptions schedule_options;

  DataArgs data;
  bool mock_data = false;
  std::optional<std::string> data_cache_path;
  double mid_level_dataset_surplus = 0.005;  // Megatron's --mid-level-dataset-surplus (blends only)
  FimOptions fim;                            // --fim-data and its flags: Megatron's GPTFIMDataset
  uint32_t seed = 1234;
  std::string vocab_file, merge_file;
  // --make-vocab-size-divisible-by, recorded beside the padded vocabulary it gave (model.padded_vocab_size
  // is the caller's; with --use-checkpoint-args the checkpoint's, as Megatron takes it).
  int64_t make_vocab_size_divisible_by = 128;
  bool eod_mask_loss = false, reset_position_ids = false;
  // The end-of-document token --eod-mask-loss and --reset-position-ids look for: --vocab-file's
  // <|endoftext|> (Megatron's tokenizer.eod), GPT-2's 50256 by default.
  int32_t eod = 50256;

  // The job's ranks on this machine and the launcher's variable that says so (TrainingRanks's
  // ranks_on_node): the CPU backend's memory check counts them all against what they share.
  int ranks_on_node = 1;
  std::string ranks_on_node_source;

  int64_t eval_interval = 1000, eval_iters = 100;
  // Megatron's evaluation modes: --skip-train (no iteration: the final evaluations of the loaded weights, then exit),
  // --full-validation (each evaluation reads every sample of one epoch of the validation split, from its first),
  // --multiple-validation-sets (each --valid-data-path prefix its own validation set, loss and line).
  bool skip_train = false, full_validation = false, multiple_validation_sets = false;
  int64_t log_interval = 100;
  // --log-params-norm / --log-num-zeros-in-grad: Megatron's "params norm:" and "num zeros:" log
  // fields and TensorBoard scalars (params-norm, num-zeros).
  bool log_params_norm = false, log_num_zeros_in_grad = false;
  // --timing-log-level / --timing-log-option: Megatron's timers (trainer/timers.h) of the given
  // level, printed after each log line by the last rank (0: none, and no synchronisation).
  int timing_log_level = 0;
  TimingLogOption timing_log_option = TimingLogOption::kMinMax;
  // Megatron's barrier_with_L1_time (off with --no-barrier-with-level-1-timing): a barrier over the
  // world before each start of a level-1 timer (at --timing-log-level 1 or 2).
  bool barrier_with_l1_time = true;
  std::string save, load;
  int64_t save_interval = 0, exit_interval = 0;
  // Megatron's non-persistent (global) checkpoints: --non-persistent-ckpt-type global, saved every
  // --non-persistent-save-interval iterations (0: never) into non_persistent_dir (--non-persistent-global-ckpt-dir
  // given, else <save>/non_persistent), where each such save first removes the older ones but the latest; a
  // --load resumes from the newer of its latest and non_persistent_load_dir's (the given directory, else
  // <load>/non_persistent). All empty without --non-persistent-ckpt-type global.
  int64_t non_persistent_save_interval = 0;
  std::string non_persistent_dir, non_persistent_load_dir;
  // --save-retain-interval: after each save to --save, the checkpoint the tracker named before it is removed
  // unless its iteration is a multiple of this (0: every checkpoint kept).
  int64_t save_retain_interval = 0;
  double exit_duration_in_mins = 0;
  // When the process started (main's first statement): --exit-duration-in-mins counts from there, as
  // Megatron's from _TRAIN_START_TIME, so that start-up (the datasets' indices, a checkpoint's load)
  // counts against a job's time limit too. Unset (the epoch): from RunTraining's call.
  std::chrono::steady_clock::time_point started{};
  bool no_load_optim = false, no_load_rng = false, finetune = false;
  // Megatron's --no-initialization (perform_initialization off): the weights are not drawn, only loaded; ptk refuses
  // the run where no checkpoint is there to load (Megatron would train from uninitialised memory).
  bool no_initialization = false;
  // Megatron's --exit-on-missing-checkpoint: a --load without a checkpoint stops the run (exit 1) instead of
  // starting from random initialization (Megatron's sys.exit() exits 0 there).
  bool exit_on_missing_checkpoint = false;
  // Megatron's --pretrained-checkpoint: where --load holds no checkpoint (a fine-tuning run's first start), its
  // checkpoint loaded as --finetune loads one; once the run has saved to --load, a restart resumes from there.
  std::string pretrained_checkpoint;
  std::optional<int64_t> ckpt_step;  // --ckpt-step: the iteration --load resumes from, not the tracker's
  // A resume whose scheduler settings differ from the checkpoint's: stop (Megatron's default), or
  // --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
  SchedulerOnLoad scheduler_on_load = SchedulerOnLoad::kCheck;
  // Megatron's --check-for-nan-in-loss-and-grad: a NaN/Inf loss or gradient norm stops the run
  // (naming the iteration and which of the two); off, such an iteration is skipped and counted.
  bool check_for_nan_in_loss_and_grad = true;
  std::string metrics_path;  // per-iteration metrics as JSON lines (rank 0)
  // --lock-wait: how long to keep trying for --save's, --tensorboard-dir's and --metrics-file's locks while
  // another run holds them (OutputLock::Acquire); 0 fails at once.
  std::chrono::milliseconds lock_wait{0};
  TensorBoardOptions tensorboard;
  SampleOptions sample;
  std::string args_json;  // the command line, stored in checkpoints

  // Set asynchronously by the caller's signal handler (--exit-signal-handler): save and exit.
  const std::atomic<int>* exit_signal = nullptr;
  // Called (on a watch's thread) when another rank reported its own failure while this one is still
  // busy with its start-up (the model, --load, the datasets' indices) a second after: the caller
  // ends the process there (LocalPhaseWatch, trainer/phase_watch.h). Empty: such a rank meets the
  // failure at its next collective.
  std::function<void(const absl::Status&)> on_peer_failure;
  Communicator* comm = nullptr;  // the data-parallel group; null: a single process
  // --tensor-model-parallel-size: backend.tensor_comm is the tensor group (its size), and
  // world_comm every rank of the run (null: comm alone).
  int tensor_model_parallel_size = 1;
  Communicator* world_comm = nullptr;
  // --context-parallel-size (CPU backend; CUDA in fp32): each sample's positions split over the context group
  // (ContextParallelPositions); comm is then Megatron's data-parallel group with context parallel
  // (data × context ranks: gradients, ZeRO-1's shards, the loss sums), context_comm the context
  // group (null: one context rank), which backend.context_comm also carries to the model.
  int context_parallel_size = 1;
  Communicator* context_comm = nullptr;
  // --expert-model-parallel-size (CPU backend, MoE): the expert-parallel ranks carved from the data x context ranks
  // (ParallelGroup::kExpert); backend.expert_comm and backend.expert_data_comm carry the groups to the model.
  int expert_model_parallel_size = 1;
  // --pipeline-model-parallel-size: the layers of each stage (PipelineStageLayers; empty: one
  // stage), backend.pipeline_stage this rank's, pipeline_comm its pipeline group and
  // embedding_comm the first and last stage's group (null on a middle stage or without tied
  // embeddings).
  std::vector<int64_t> pipeline_stage_layers;
  // Megatron's interleaved schedule: the model chunks of each stage (1: the 1F1B schedule).
  int pipeline_virtual_size = 1;
  // --microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule's micro-batches
  // run in a row on one chunk (0: Megatron's default, the pipeline size); only the order changes.
  int pipeline_microbatch_group_size = 0;
  Communicator* pipeline_comm = nullptr;
  Communicator* embedding_comm = nullptr;
  // --use-distributed-optimizer (Megatron's ZeRO-1): each rank keeps and updates its shard of the
  // optimizer state (ParamShard); gradients reduce-scattered, parameters all-gathered.
  bool use_distributed_optimizer = false;
  // --distributed-backend: the communicator's (the caller makes it; ranks must agree).
  std::string distributed_backend = "gloo";
  // Where rank 0's Megatron-shaped lines go (stdout by default).
  std::function<void(const std::string&)> print;
};

// What RunTraining runs, resolved once from the options and the number of data-parallel ranks.
struct TrainPlan {
  int data_parallel_size = 1;
  int64_t micro_batch_size = 1;
  int64_t micro_batches = 1;      // per rank and iteration (gradient accumulation)
  int64_t global_batch_size = 1;  // micro_batch_size x micro_batches x data_parallel_size (but see decrease_batch_size)
  int64_t train_iters = 0;        // --train-iters, or the iterations --train-samples makes (update_train_iters)
  int64_t train_samples = 0;      // what the iterations consume (each its global batch)
  // The training split's num_samples, as Megatron's get_train_valid_test_num_samples builds it:
  // --train-samples as given (a ramp's iterations may consume fewer, or more), else train_iters x
  // global_batch_size. The split's sample order depends on it.
  int64_t train_split_samples = 0;
  SchedulerConfig schedule;           // options.schedule completed, its lengths in samples
  std::vector<std::string> warnings;  // for rank 0 to print (a setting that costs more than it seems)
  // --rampup-batch-size (0: none): the global batch at `consumed` samples is GlobalBatchSizeAt.
  int64_t rampup_start = 0, rampup_increment = 0, rampup_samples = 0;

  // Megatron's running global batch size after `consumed` training samples: the start size plus
  // one increment per (rampup samples / increments) samples consumed, then global_batch_size.
  int64_t GlobalBatchSizeAt(int64_t consumed) const;
  // --decrease-batch-size-if-needed (Megatron's running global batch size): what an iteration trains on, the
  // largest multiple of micro_batch_size x data_parallel_size within GlobalBatchSizeAt; that size without it.
  bool decrease_batch_size = false;
  int64_t RunningGlobalBatchSizeAt(int64_t consumed) const {
    const int64_t unit = micro_batch_size * data_parallel_size;
    return decrease_batch_size ? GlobalBatchSizeAt(consumed) / unit * unit : GlobalBatchSizeAt(consumed);
  }
  int64_t MicroBatchesAt(int64_t consumed) const {
    return RunningGlobalBatchSizeAt(consumed) / (micro_batch_size * data_parallel_size);
  }
};

// Megatron's argument validation and get_optimizer_param_scheduler in one place: every check
// between two settings of `options` (a usage error naming the flags) and the plan they make with
// `data_parallel_size` ranks.
absl::StatusOr<TrainPlan> PlanTraining(const TrainOptions& options, int data_parallel_size);

}  // namespace ptk
