// The training loop (Megatron's pretrain and train): RunTraining, Trainer's run and its iterations, the saves, the
// exits (the start-up: training_setup.cpp; the reports: training_report.cpp).
#include "trainer/training.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/py_format.h"
#include "common/status.h"
#include "indexed_dataset/data_loader.h"
#include "tensorboard/summary_writer.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_retention.h"
#include "trainer/evaluation.h"
#include "trainer/phase_watch.h"
#include "trainer/tensor_parallel_checkpoint.h"
#include "trainer/training_data.h"
#include "trainer/training_log.h"
#include "trainer/training_run.h"

namespace ptk {
namespace training_detail {

Trainer::Trainer(const TrainOptions& options, const TrainPlan& plan, Communicator* comm)
    : o_(options),
      plan_(plan),
      comm_(comm),
      world_(options.world_comm ? options.world_comm : comm),
      tensor_(options.backend.tensor_comm && options.backend.tensor_comm->size() > 1 ? options.backend.tensor_comm
                                                                                     : nullptr),
      pipe_(options.pipeline_comm && options.pipeline_comm->size() > 1 ? options.pipeline_comm : nullptr),
      context_(options.context_comm && options.context_comm->size() > 1 ? options.context_comm : nullptr),
      rank_(comm->rank()),
      dp_(comm->size()),
      cp_(context_ ? context_->size() : 1),
      data_rank_(rank_ / cp_),
      data_size_(dp_ / cp_),
      lead_(world_->rank() == 0),
      last_(world_->rank() == world_->size() - 1) {}

absl::StatusOr<TrainSummary> Trainer::Run() {
  started_ = o_.started != Clock::time_point{} ? o_.started : Clock::now();
  auto t0 = Clock::now();
  // Another rank's reported failure ends this rank's start-up within seconds (phase_watch.h), not at its end.
  LocalPhaseWatch start_up(world_->failure_store(), AbandonedOnStop(o_.on_peer_failure, &save_dir_),
                           "building the model");
  PTK_RETURN_IF_ERROR(SetUp());
  if (lead_) log::Info("start-up: model built and initialised ({:.1f} s)", Seconds(t0));
  t0 = Clock::now();
  start_up.Enter("loading the checkpoint");
  PTK_RETURN_IF_ERROR(Resume());
  if (lead_ && summary_.resumed) log::Info("start-up: checkpoint loaded ({:.1f} s)", Seconds(t0));
  t0 = Clock::now();
  if (lead_)
    log::Info("start-up: building the datasets and their indices{} ...",
              o_.mock_data         ? " (mock data)"
              : o_.data_cache_path ? " (cached in " + *o_.data_cache_path + ")"
                                   : "");
  start_up.Enter("building the datasets");
  PTK_RETURN_IF_ERROR(OpenDataAndOutputs());
  PTK_RETURN_IF_ERROR(world_->Barrier());  // every rank started (one refused exits: this fails)
  start_up.End();
  save_dir_.Keep();
  non_persistent_dir_.Keep();
  if (lead_) log::Info("start-up: datasets ready ({:.1f} s)", Seconds(t0));
  start_ = Clock::now();
  interval_.Start();
  wall_before_ = state_.wall_seconds;
  Print(fmt::format("[after dataloaders are built] datetime: {} ", Timestamp()));
  if (o_.skip_train) return SkipTraining();
  Print("training ...");
  if (state_.iteration >= plan_.train_iters) return NothingToTrain();
  // The first iteration that trains (--iterations-to-skip's are read and dropped, without a line).
  int64_t first = state_.iteration + 1;
  const std::vector<int64_t>& skip = o_.iterations_to_skip;
  while (first < plan_.train_iters && std::find(skip.begin(), skip.end(), first - 1) != skip.end()) ++first;
  // On several ranks the log line is the last rank's (print_rank_last): rank 0's output never holds it.
  if (lead_)
    log::Info("start-up: iteration {} running (its log line comes after it{}) ...", first,
              world_->size() > 1 ? fmt::format(", from the last rank, {}", world_->size() - 1) : "");
  while (state_.iteration < plan_.train_iters) {
    PTK_RETURN_IF_ERROR(UpdateBatchSize());
    if (SkipsNextIteration()) {  // as Megatron's: no log line, evaluation, sample, save or exit check
      PTK_RETURN_IF_ERROR(SkipIteration());
      continue;
    }
    t0 = Clock::now();
    PTK_ASSIGN_OR_RETURN(const StepResult r, TrainIteration());
    if (lead_ && state_.iteration == first) log::Info("start-up: iteration {} done ({:.1f} s)", first, Seconds(t0));
    PTK_RETURN_IF_ERROR(Log(r));
    bool timelimit = false;  // --exit-duration-in-mins reached during the evaluation: it stopped early
    if (!data_.valid_sets.empty() && o_.eval_interval > 0 && state_.iteration % o_.eval_interval == 0) {
      PTK_ASSIGN_OR_RETURN(const bool done, EvaluateValidation(fmt::format("iteration {}", state_.iteration),
                                                               &state_.consumed_valid_samples, false));
      timelimit = !done;
    }
    // No sample when the time is up: the save and exit come next.
    if (!timelimit && o_.sample.interval > 0 && state_.iteration % o_.sample.interval == 0)
      PTK_RETURN_IF_ERROR(Sample());
    state_.wall_seconds = wall_before_ + std::chrono::duration<double>(Clock::now() - start_).count();
    PTK_ASSIGN_OR_RETURN(const std::string reason, SaveAndDecideExit());
    if (!reason.empty()) return Exit(reason);
  }
  return Finish();
}

absl::StatusOr<TrainSummary> Trainer::NothingToTrain() {
  if (lead_)
    log::Info("{}", NothingToTrainLine(o_, state_.iteration, state_.consumed_train_samples, plan_.train_iters));
  summary_.nothing_to_train = true;
  if (o_.save_interval > 0 && state_.iteration % o_.save_interval == 0) last_saved_ = state_.iteration;
  return Finish();
}

absl::Status Trainer::UpdateBatchSize() {
  const int64_t gbs = plan_.RunningGlobalBatchSizeAt(state_.consumed_train_samples);
  if (gbs == current_gbs_) return absl::OkStatus();
  if (lead_ && plan_.decrease_batch_size)  // Megatron's calculator's line (its missing space too)
    log::Info("decreasing batch size from {} to {}to keep divisiblity by micro_batch_size={} * data_parallel_size={}",
              plan_.global_batch_size, gbs, plan_.micro_batch_size, plan_.data_parallel_size);
  if (lead_ && plan_.rampup_start > 0)
    log::Info("{}", current_gbs_ == 0 ? fmt::format("setting initial batch size to {}", gbs)
                                      : fmt::format("ramping up batch size from {} to {}", current_gbs_, gbs));
  if (current_gbs_ != 0 && state_.iteration != 0 && last_saved_ != state_.iteration) PTK_RETURN_IF_ERROR(Save());
  current_gbs_ = gbs;
  const size_t num_micro = static_cast<size_t>(plan_.MicroBatchesAt(state_.consumed_train_samples));
  held_.resize(num_micro);
  keys_.resize(num_micro);
  batches_.resize(num_micro);
  return absl::OkStatus();
}

bool Trainer::SkipsNextIteration() const {
  const std::vector<int64_t>& skip = o_.iterations_to_skip;
  return std::find(skip.begin(), skip.end(), state_.iteration) != skip.end();
}

absl::Status Trainer::SkipIteration() {
  for (size_t m = 0; m < held_.size(); ++m) {
    PTK_ASSIGN_OR_RETURN(std::unique_ptr<MicroBatch> dropped, train_loader_->Next());
    if (!dropped) return absl::OutOfRangeError("the training data ran out before --train-iters");
  }
  ++state_.iteration;
  state_.consumed_train_samples += current_gbs_;
  state_.skipped_train_samples += current_gbs_;
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Trainer::TrainIteration() {
  step_->set_count_zeros_in_grad(o_.log_num_zeros_in_grad && LogsThisIteration(state_.iteration + 1));
  PTK_RETURN_IF_ERROR(timers_->Start("batch-generator", 2));
  for (size_t m = 0; m < held_.size(); ++m) {
    PTK_ASSIGN_OR_RETURN(held_[m], train_loader_->Next());
    if (!held_[m]) return absl::OutOfRangeError("the training data ran out before --train-iters");
    if (context_) KeepContextRows(held_[m].get(), context_positions_);
    batches_[m] = View(*held_[m], &keys_[m]);
  }
  PTK_RETURN_IF_ERROR(timers_->Stop("batch-generator"));
  PTK_ASSIGN_OR_RETURN(StepResult r, step_->Step(batches_, current_gbs_, state_.seed));
  // fp16's dynamic loss scaling skips an overflowing step by design; anything else non-finite stops.
  if (o_.check_for_nan_in_loss_and_grad && !r.overflow)
    PTK_RETURN_IF_ERROR(CheckForNanInLossAndGrad(r, state_.iteration + 1, rank_));
  ++state_.iteration;
  // --decrease-batch-size-if-needed: the part of the global batch the iteration did not train on (Megatron's
  // current minus running global batch size).
  state_.skipped_train_samples += plan_.GlobalBatchSizeAt(state_.consumed_train_samples) - current_gbs_;
  state_.consumed_train_samples += current_gbs_;
  interval_.Add(r);
  if (r.skipped) ++state_.skipped_iterations;
  summary_.last_lm_loss = r.lm_loss();
  return r;
}

absl::Status Trainer::Save(bool non_persistent) {
  if (o_.save.empty()) return absl::OkStatus();
  const std::string& dir = non_persistent ? o_.non_persistent_dir : o_.save;
  const IntervalPause paused(&interval_);  // no iteration's time, as Megatron's save_checkpoint_and_time
  // What this checkpoint covers is on disk in the event and metrics files before the tracker
  // names it (the writer is the last stage's): a kill right after the save loses no iteration.
  PTK_RETURN_IF_ERROR(outputs_.Sync());
  PTK_RETURN_IF_ERROR(world_->Barrier());
  auto t0 = Clock::now();
  // Every tensor rank's and stage's weights and moments (ZeRO-1's shards gathered) on world rank 0.
  PTK_ASSIGN_OR_RETURN(
      std::vector<CheckpointArrays> parts,
      GatherCheckpointArrays(model_.get(), comm_, tensor_, pipe_, o_.pipeline_stage_layers, o_.pipeline_virtual_size));
  if (lead_) {
    const TrainStepState step_state = step_->State();
    state_.adam_step = step_state.adam_step;
    state_.scheduler_num_steps = step_state.scheduler_num_steps;
    state_.scheduler = step_state.schedule;
    if (step_state.loss_scale) state_.loss_scale = step_state.loss_scale;
    state_.settings = settings_;
    state_.buffers = model_->ReadBuffers();  // the expert biases (every rank's alike: no pipeline stages with them)
    std::vector<CheckpointShard> shards;
    for (const CheckpointArrays& a : parts) shards.push_back({&a.layout, a.params, a.exp_avg, a.exp_avg_sq});
    if (non_persistent) PTK_RETURN_IF_ERROR(CleanUpNonPersistent());
    // --save-retain-interval's candidate: the checkpoint the tracker names until this save replaces it.
    std::optional<int64_t> previous;
    if (!non_persistent && o_.save_retain_interval > 0) {
      if (absl::StatusOr<int64_t> latest = LatestCheckpointIteration(o_.save); latest.ok()) previous = *latest;
    }
    PTK_RETURN_IF_ERROR(SaveCheckpoint(dir, shards, state_, o_.args_json));
    const int pp = pipe_ ? pipe_->size() : 1;
    Print(fmt::format("  successfully saved {}checkpoint from iteration {:7d} to {} [ t 1/{}, p 1/{} ] ({:.1f} ms)",
                      non_persistent ? "non-persistent " : "", state_.iteration, dir,
                      parts.size() / static_cast<size_t>(pp * model_->layout().expert_size), pp,
                      std::chrono::duration<double, std::milli>(Clock::now() - t0).count()));
    // Every rank's part is in the checkpoint now complete (rank 0 wrote them all): the older one may go.
    if (std::string line = RetainAfterSave(o_.save, previous, state_.iteration, o_.save_retain_interval); !line.empty())
      Print(line);
  }
  (non_persistent ? last_non_persistent_saved_ : last_saved_) = state_.iteration;
  return world_->Barrier();
}

absl::Status Trainer::CleanUpNonPersistent() {
  PTK_ASSIGN_OR_RETURN(const NonPersistentCleanup cleanup, CleanUpOldNonPersistent(o_.non_persistent_dir));
  if (cleanup.removed.empty() && cleanup.kept.empty()) return absl::OkStatus();
  auto list = [](const std::vector<std::string>& paths) {  // a Python list, as Megatron's lines print it
    std::string out;
    for (const std::string& p : paths) out += (out.empty() ? "'" : ", '") + p + "'";
    return "[" + out + "]";
  };
  Print("Non-persistent checkpoints scheduled for removal: " + list(cleanup.removed));
  Print("Non-persistent checkpoints to be kept: " + list(cleanup.kept));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Trainer::SaveAndDecideExit() {
  double signal = o_.exit_signal && o_.exit_signal->load() != 0 ? 1.0 : 0.0;
  PTK_RETURN_IF_ERROR(world_->AllReduceSum(&signal, 1));
  if (signal > 0) return std::string("exiting program after receiving SIGTERM.");  // Megatron's, for any signal
  if (o_.save_interval > 0 && state_.iteration % o_.save_interval == 0) {
    PTK_RETURN_IF_ERROR(Save());
  } else if (o_.non_persistent_save_interval > 0 && state_.iteration % o_.non_persistent_save_interval == 0) {
    PTK_RETURN_IF_ERROR(Save(/*non_persistent=*/true));
  }
  PTK_ASSIGN_OR_RETURN(const TimeLimit limit, CheckExitDuration(world_, started_, o_.exit_duration_in_mins));
  if (limit.reached) return fmt::format("exiting program after {} minutes", py::FloatRepr(limit.minutes));
  const std::vector<int64_t>& phases = o_.phase_transition_iterations;  // Megatron's end of a phase: save and exit
  if ((o_.exit_interval > 0 && state_.iteration % o_.exit_interval == 0) ||
      std::find(phases.begin(), phases.end(), state_.iteration) != phases.end())
    return fmt::format("exiting program at iteration {}", state_.iteration);
  return std::string();
}

absl::StatusOr<TrainSummary> Trainer::Exit(const std::string& reason) {
  // As Megatron's: an iteration saved already, persistent or not, is not saved again before the exit.
  if (last_saved_ != state_.iteration && last_non_persistent_saved_ != state_.iteration) PTK_RETURN_IF_ERROR(Save());
  Print(fmt::format("[{}] datetime: {} ", reason, Timestamp()));
  summary_.exit_reason = reason;
  return Close();
}

absl::StatusOr<TrainSummary> Trainer::Finish() {
  Print(fmt::format("[after training is done] datetime: {} ", Timestamp()));
  if (std::string report = model_->ProfileReport(); lead_ && !report.empty()) {
    if (report.back() == '\n') report.pop_back();
    Print(report);
  }
  // Megatron's pretrain saves after its loop where `iteration % save_interval != 0`: not where --save-interval
  // divides the last iteration though --iterations-to-skip skipped it (and its save). --save alone: ptk's end save.
  const bool interval_divides = o_.save_interval > 0 && state_.iteration % o_.save_interval == 0;
  if (last_saved_ != state_.iteration && !interval_divides) PTK_RETURN_IF_ERROR(Save());
  return FinalEvaluations();
}

absl::StatusOr<TrainSummary> Trainer::FinalEvaluations() {
  // Each stops, without its line, where --exit-duration-in-mins is up, as Megatron's.
  PTK_RETURN_IF_ERROR(EvaluateValidation(fmt::format("iteration {} on validation set", state_.iteration), nullptr,
                                         /*verbose=*/true)
                          .status());
  if (data_.test) {
    const int64_t mbs = plan_.micro_batch_size;
    DataLoader test_loader(data_.test, PretrainingSampler(data_.test->size(), 0, mbs, data_rank_, data_size_), mbs);
    PTK_ASSIGN_OR_RETURN(summary_.test_loss, Evaluate(&test_loader, EvalItersExtent(o_.eval_iters, plan_), nullptr,
                                                      {fmt::format("iteration {} on test set", state_.iteration),
                                                       "validation", "lm loss test", /*verbose=*/true}));
  }
  return Close();
}

absl::StatusOr<TrainSummary> Trainer::SkipTraining() {
  Print("skipping training (--skip-train is on) ...");
  summary_.skipped_training = true;
  return FinalEvaluations();
}

absl::StatusOr<TrainSummary> Trainer::Close() {
  summary_.iteration = state_.iteration;
  summary_.consumed_train_samples = state_.consumed_train_samples;
  summary_.skipped_iterations = state_.skipped_iterations;
  summary_.skipped_train_samples = state_.skipped_train_samples;
  PTK_RETURN_IF_ERROR(outputs_.metrics.Close());
  if (outputs_.tb) PTK_RETURN_IF_ERROR(outputs_.tb->Close());
  return summary_;
}

}  // namespace training_detail

absl::StatusOr<TrainSummary> RunTraining(const TrainOptions& o, const TrainPlan& plan) {
  std::unique_ptr<Communicator> local = o.comm ? nullptr : MakeLocalCommunicator();
  Communicator* comm = o.comm ? o.comm : local.get();
  PTK_RETURN_IF_ERROR(CheckRunCommunicators(o, plan, *comm));
  return training_detail::Trainer(o, plan, comm).Run();
}

}  // namespace ptk
