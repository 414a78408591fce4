// The training run's start-up (Trainer, training_run.h): the ranks' settings agreed, the model and its training
// step made, --load's checkpoint, the datasets and the run's outputs opened.
#include "trainer/training_run.h"

#include <algorithm>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/data_loader.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_retention.h"
#include "trainer/expert_shard.h"
#include "trainer/memory_estimate.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_shard.h"
#include "trainer/run_settings.h"
#include "trainer/timers.h"
#include "trainer/training_data.h"
#include "trainer/training_log.h"

namespace ptk {
namespace training_detail {

absl::Status Trainer::SetUp() {
  // Before any collective whose size depends on the flags.
  settings_ = RunSettings(o_, plan_.global_batch_size);
  PTK_RETURN_IF_ERROR(CheckRanksAgree(world_, settings_));
  BackendOptions backend = o_.backend;
  backend.micro_batch_size = plan_.micro_batch_size;
  if (pipe_)  // RunTraining checked
    backend.pipeline_stage = StageOf(o_.pipeline_stage_layers, pipe_->rank(), o_.pipeline_virtual_size);
  if (backend.device == Device::kCpu) PTK_RETURN_IF_ERROR(CheckCpuMemory(backend));
  PTK_ASSIGN_OR_RETURN(model_, CreateModel(o_.model, backend));
  if (o_.use_distributed_optimizer && model_->expert_comm() != nullptr) {
    PTK_RETURN_IF_ERROR(ShardExpertParallelOptimizer());
  } else if (o_.use_distributed_optimizer) {
    PTK_ASSIGN_OR_RETURN(const ParamShard shard, ParamShard::Create(model_->num_params(), dp_, rank_));
    PTK_RETURN_IF_ERROR(model_->ShardOptimizerState(shard));
    if (dp_ == 1 && lead_)
      log::Info(
          "note: --use-distributed-optimizer: accepted, one rank keeps the whole optimizer state (it is sharded "
          "over data-parallel ranks)");
    else if (lead_)
      log::Info("distributed optimizer: each of {} ranks keeps {} of the {} parameters' AdamW state", dp_,
                shard.shard_size, model_->num_params());
  }
  // --no-initialization: the checkpoint Resume loads writes every weight (it refuses the run where there is none).
  if (!o_.no_initialization) PTK_RETURN_IF_ERROR(model_->InitWeights(o_.seed));
  // Megatron's line from each tensor rank and stage of the first data-parallel rank.
  if ((tensor_ || pipe_) && rank_ == 0)
    PrintAnyRank(fmt::format(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}",
                             tensor_ ? tensor_->rank() : 0, pipe_ ? pipe_->rank() : 0, model_->num_params()));
  step_ = std::make_unique<TrainStep>(model_.get(), o_.optimizer, plan_.schedule, comm_, o_.loss_scale);
  if (context_) {
    step_->set_context(context_);
    context_positions_ = ContextParallelPositions(o_.model.seq_length, cp_, context_->rank());
  }
  if (pipe_) step_->set_pipeline(pipe_, o_.embedding_comm, o_.pipeline_microbatch_group_size);
  std::function<absl::Status()> barrier;  // Megatron's barrier_with_L1_time, over the world
  if (o_.barrier_with_l1_time) barrier = [world = world_] { return world->Barrier(); };
  timers_ = std::make_unique<Timers>(
      o_.timing_log_level, o_.timing_log_option, [model = model_.get()] { return model->Synchronize(); },
      std::move(barrier));
  step_->set_timers(timers_.get());
  if (lead_ && !step_->buckets().empty()) {
    int64_t largest = 0;
    for (const GradRange& b : step_->buckets()) largest = std::max(largest, b.size());
    log::Info("--overlap-grad-reduce: {} gradient bucket(s) of up to {} elements, reduced as backward completes them",
              step_->buckets().size(), largest);
  }
  state_.seed = o_.seed;
  // One training run per --save directory: a second (a requeue while the first still runs) stops
  // here naming the first, instead of interleaving checkpoints with it.
  if (lead_ && !o_.save.empty()) {
    PTK_RETURN_IF_ERROR(save_dir_.Take(o_.save, "ptk-train", o_.lock_wait));
    PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o_.save));
    // The non-persistent directory has a lock of its own, SAVE/non_persistent too: --save's does not keep out a
    // run whose --non-persistent-global-ckpt-dir or --save it is, and each one's cleanup removes the other's.
    const std::string& np = o_.non_persistent_dir;
    if (!np.empty()) PTK_RETURN_IF_ERROR(non_persistent_dir_.Take(np, "ptk-train", o_.lock_wait));
    if (!np.empty()) PTK_RETURN_IF_ERROR(RecoverCheckpointDir(np));
  }
  return absl::OkStatus();
}

// --use-distributed-optimizer with expert parallelism: the dense moments over the data ranks, the experts' over
// the expert-data ranks (expert_shard.h).
absl::Status Trainer::ShardExpertParallelOptimizer() {
  const ExpertShard shard = ExpertShardOf(*model_, *comm_);
  const std::vector<GradRange> owned = shard.Owned();
  PTK_RETURN_IF_ERROR(model_->ShardOptimizerStateRanges(owned));
  if (lead_) {
    const Communicator* ed = model_->expert_data_comm();
    log::Info(
        "distributed optimizer: the dense parameters' AdamW state sharded over {} data-parallel ranks, the experts' "
        "over {} expert-data-parallel rank(s); rank 0 keeps {} of its {} parameters'",
        comm_->size(), ed ? ed->size() : 1, model_->moments_size(), model_->num_params());
  }
  return absl::OkStatus();
}

absl::Status Trainer::CheckCpuMemory(const BackendOptions& backend) {
  const int T = tensor_ ? tensor_->size() : 1, t = tensor_ ? tensor_->rank() : 0;
  PTK_ASSIGN_OR_RETURN(
      const CpuTrainingMemory need,
      EstimateCpuTrainingMemory(o_.model, T, t, backend.sequence_parallel && T > 1, backend.pipeline_stage,
                                plan_.micro_batch_size, plan_.micro_batches,
                                !o_.save.empty() || !o_.load.empty() || !o_.pretrained_checkpoint.empty(),
                                o_.pipeline_microbatch_group_size, /*threads=*/0, cp_, o_.expert_model_parallel_size));
  Print(TheoreticalMemoryLine(need));
  return CheckFitsInMemory(need, ReadAvailableMemory(), o_.ranks_on_node, o_.ranks_on_node_source);
}

absl::Status Trainer::Resume() {
  if (o_.load.empty() && o_.pretrained_checkpoint.empty()) return absl::OkStatus();
  // Every rank reads --load once rank 0 has put back what a killed save left aside.
  if (!o_.save.empty()) PTK_RETURN_IF_ERROR(world_->Barrier());
  std::string load = o_.load;
  bool finetune = o_.finetune;
  // --load's latest, or the non-persistent directory's where that is newer (Megatron's _load_base_checkpoint).
  absl::StatusOr<CheckpointChoice> choice =
      load.empty() ? absl::NotFoundError("not given")
                   : ChooseCheckpointToLoad(load, o_.non_persistent_load_dir, o_.ckpt_step);
  if (choice.ok() && lead_)
    for (const std::string& line : choice->lines) Print(line);
  absl::StatusOr<int64_t> latest = choice.ok() ? absl::StatusOr<int64_t>(choice->iteration) : choice.status();
  if (choice.ok()) load = choice->dir;
  if (absl::IsNotFound(latest.status()) && !o_.pretrained_checkpoint.empty()) {
    latest = PretrainedCheckpointToLoad(o_, latest.status(), lead_);
    load = o_.pretrained_checkpoint;
    finetune = true;
  } else if (absl::IsNotFound(latest.status())) {
    return NoCheckpointToLoad(o_, latest.status(), lead_);
  }
  PTK_RETURN_IF_ERROR(latest.status());
  TrainState loaded;
  std::vector<float> params, m, v;
  if (absl::Status st = LoadCheckpoint(load, *latest, model_->layout(), &params, &m, &v, &loaded); !st.ok()) {
    if (!choice.ok() || !choice->non_persistent) return st;
    // Not loaded from --load's latest unasked: the damaged non-persistent checkpoint is named, with the way out.
    return absl::Status(st.code(), fmt::format("{} (the non-persistent checkpoint, newer than --load's: remove {} to "
                                               "resume from --load's latest instead)",
                                               StatusMessage(st), JoinPath(load, "latest_checkpointed_iteration.txt")));
  }
  PTK_RETURN_IF_ERROR(CheckOptimizerStateLoads(loaded, load, *latest, finetune || o_.no_load_optim));
  if (!o_.phase_transition_iterations.empty())  // Megatron's check_checkpoint_args compares it then
    for (const auto& [flag, value] : loaded.settings)
      if (flag == "--global-batch-size" && value != std::to_string(plan_.global_batch_size))
        return UsageError(fmt::format(
            "--phase-transition-iterations: the checkpoint of iteration {} was saved with --global-batch-size {}, "
            "this run has {}: the phases are counted in global batches, give the checkpoint's",
            *latest, value, plan_.global_batch_size));
  PTK_RETURN_IF_ERROR(model_->WriteParams(params));
  PTK_RETURN_IF_ERROR(model_->WriteBuffers(loaded.buffers));  // a router's expert_bias, as Megatron's state dict
  if (finetune) {
    log::Info("--finetune: loaded the weights of iteration {}; iteration, optimizer and data position start anew",
              *latest);
    return absl::OkStatus();
  }
  state_ = loaded;
  TrainStepState step_state = step_->State();
  if (!o_.no_load_optim) {
    // This rank's range of the moments (all of them without ZeRO-1): any rank count loads them.
    const size_t begin = static_cast<size_t>(model_->moments_begin()),
                 size = static_cast<size_t>(model_->moments_size());
    if (model_->ranges_sharded())  // expert parallelism's ZeRO-1: its owned ranges, packed
      PTK_RETURN_IF_ERROR(
          model_->WriteMoments(PackRanges(model_->owned_ranges(), m), PackRanges(model_->owned_ranges(), v)));
    else
      PTK_RETURN_IF_ERROR(model_->WriteMoments(std::span<const float>(m).subspan(begin, size),
                                               std::span<const float>(v).subspan(begin, size)));
    step_state.adam_step = loaded.adam_step;
    step_state.loss_scale = loaded.loss_scale;
  }
  // Megatron's OptimizerParamScheduler.load_state_dict, its checks even where no iteration is left to train.
  // Megatron loads it with the optimizer: under --no-load-optim it starts anew (num_steps 0, the warm-up again).
  step_state.scheduler_num_steps = o_.no_load_optim ? 0 : loaded.scheduler_num_steps;
  if (!o_.no_load_optim) {
    PTK_ASSIGN_OR_RETURN(step_state.schedule, ResumedSchedule(loaded, plan_.schedule, o_.scheduler_on_load,
                                                              o_.train_iters > 0 ? plan_.global_batch_size : 0, lead_));
  }
  step_->Restore(step_state);
  if (o_.no_load_rng) state_.seed = o_.seed;
  summary_.resumed = true;
  if (lead_)
    log::Info("loaded checkpoint {} at iteration {} ({} samples consumed)", CheckpointFile(load, *latest),
              loaded.iteration, loaded.consumed_train_samples);
  if (lead_) ReportResumeChanges(loaded.settings, settings_, loaded, o_.no_load_rng);
  return absl::OkStatus();
}

absl::Status Trainer::OpenDataAndOutputs() {
  // --phase-transition-iterations: this phase's training split, read from its first sample.
  TrainPlan data_plan = plan_;
  TrainState data_state = state_;
  if (!o_.phase_transition_iterations.empty()) {
    const TrainPhase phase = PhaseAt(o_, plan_, state_.iteration);
    data_plan.train_split_samples = data_plan.train_samples = phase.split_samples;
    data_state.consumed_train_samples = phase.consumed;
    if (lead_)
      log::Info(
          "--phase-transition-iterations: this phase trains to iteration {} on a training split of {} samples, "
          "{} of them consumed",
          phase.end_iteration, phase.split_samples, phase.consumed);
  }
  PTK_ASSIGN_OR_RETURN(data_, BuildTrainingDatasets(o_, data_plan, pipe_));
  for (const std::string& w : data_.warnings)
    if (lead_) log::Warning("{}", w);
  const int64_t mbs = plan_.micro_batch_size;
  if (lead_)
    log::Info(
        "model: {} parameters on {}; {} micro-batch(es) of {} per rank per iteration, {} rank(s){}, global batch {}",
        model_->num_params(), model_->Describe(), plan_.micro_batches, mbs, data_size_,
        cp_ > 1 ? fmt::format(" x {} context ranks (each {} positions of a sample)", cp_, o_.model.seq_length / cp_)
                : "",
        plan_.global_batch_size);
  if (o_.skip_train) return absl::OkStatus();  // no training loader, nothing written (no TensorBoard, as Megatron's)
  PTK_RETURN_IF_ERROR(OpenRunOutputs(o_.tensorboard.dir, o_.metrics_path, o_.save, o_.load, state_.iteration, last_,
                                     &outputs_, o_.lock_wait));
  train_loader_ = std::make_unique<DataLoader>(
      data_.train,
      PretrainingSampler(data_.train->size(), data_state.consumed_train_samples, mbs, data_rank_, data_size_), mbs);
  if (!o_.phase_transition_iterations.empty())
    data_plan.train_iters = PhaseAt(o_, plan_, state_.iteration).end_iteration;
  PTK_RETURN_IF_ERROR(CheckSamplesLast(o_, data_plan, data_state, data_));
  // One validation split read on across the evaluations; --full-validation's and --multiple-validation-sets' sets
  // each get a loader from their first sample at every evaluation (EvaluateValidation).
  if (data_.valid && !o_.full_validation && !o_.multiple_validation_sets)
    valid_loader_ = std::make_unique<DataLoader>(
        data_.valid,
        PretrainingSampler(data_.valid->size(), state_.consumed_valid_samples, mbs, data_rank_, data_size_), mbs);
  return absl::OkStatus();
}

}  // namespace training_detail

}  // namespace ptk
