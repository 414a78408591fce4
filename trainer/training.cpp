// ptk-train's loop (Megatron's pretrain / train / training_log / evaluate / checkpoint_and_decide_exit).
#include "trainer/training.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/py_format.h"
#include "common/status.h"
#include "indexed_dataset/data_loader.h"
#include "tensorboard/summary_writer.h"
#include "trainer/checkpoint.h"
#include "trainer/counter_rng.h"
#include "trainer/evaluation.h"
#include "trainer/memory_estimate.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_shard.h"
#include "trainer/phase_watch.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/run_settings.h"
#include "trainer/sampling.h"
#include "trainer/tensor_parallel_checkpoint.h"
#include "trainer/timers.h"
#include "trainer/training_data.h"
#include "trainer/training_log.h"

namespace ptk {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// One run of RunTraining, step by step (Megatron's pretrain and train): set up, resume, then
// iterations of train, log, evaluate, sample, save and decide to exit; then finish.
class Trainer {
 public:
  Trainer(const TrainOptions& options, const TrainPlan& plan, Communicator* comm)
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
        tb_writer_(rank_ == 0 && (!tensor_ || tensor_->rank() == 0) && (!pipe_ || pipe_->rank() == pipe_->size() - 1)) {
  }

  absl::StatusOr<TrainSummary> Run() {
    started_ = o_.started != Clock::time_point{} ? o_.started : Clock::now();
    auto t0 = Clock::now();
    // Another rank's reported failure ends this rank's start-up within a second or two, not at its end.
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
    if (lead_) log::Info("start-up: datasets ready ({:.1f} s)", Seconds(t0));
    start_ = Clock::now();
    interval_.Start();
    wall_before_ = state_.wall_seconds;
    Print(fmt::format("[after dataloaders are built] datetime: {} ", Timestamp()));
    Print("training ...");
    if (state_.iteration >= plan_.train_iters) return NothingToTrain();
    const int64_t first = state_.iteration + 1;
    if (lead_) log::Info("start-up: iteration {} running (its log line comes after it) ...", first);
    while (state_.iteration < plan_.train_iters) {
      PTK_RETURN_IF_ERROR(UpdateBatchSize());
      t0 = Clock::now();
      PTK_ASSIGN_OR_RETURN(const StepResult r, TrainIteration());
      if (lead_ && state_.iteration == first) log::Info("start-up: iteration {} done ({:.1f} s)", first, Seconds(t0));
      PTK_RETURN_IF_ERROR(Log(r));
      bool timelimit = false;  // --exit-duration-in-mins reached during the evaluation: it stopped early
      if (valid_loader_ && o_.eval_interval > 0 && state_.iteration % o_.eval_interval == 0) {
        PTK_ASSIGN_OR_RETURN(const std::optional<double> loss,
                             Evaluate(valid_loader_.get(), fmt::format("iteration {}", state_.iteration),
                                      &state_.consumed_valid_samples, "lm loss validation"));
        if (loss) summary_.last_validation_loss = loss;
        timelimit = !loss;
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

 private:
  // Rank 0's Megatron-shaped lines.
  void Print(const std::string& line) const {
    if (lead_) PrintAnyRank(line);
  }
  void PrintAnyRank(const std::string& line) const {
    if (o_.print) {
      o_.print(line);
    } else {
      std::fputs((line + "\n").c_str(), stdout);
      std::fflush(stdout);
    }
  }

  // The ranks agree on the settings, the model and its training step are made, and rank 0 takes
  // --save for this run and puts back what a killed save left aside.
  absl::Status SetUp() {
    // Before any collective whose size depends on the flags.
    settings_ = RunSettings(o_, plan_.global_batch_size);
    PTK_RETURN_IF_ERROR(CheckRanksAgree(world_, settings_));
    BackendOptions backend = o_.backend;
    backend.micro_batch_size = plan_.micro_batch_size;
    if (pipe_)  // RunTraining checked
      backend.pipeline_stage = StageOf(o_.pipeline_stage_layers, pipe_->rank(), o_.pipeline_virtual_size);
    if (backend.device == Device::kCpu) PTK_RETURN_IF_ERROR(CheckCpuMemory(backend));
    PTK_ASSIGN_OR_RETURN(model_, CreateModel(o_.model, backend));
    if (o_.use_distributed_optimizer) {
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
    PTK_RETURN_IF_ERROR(model_->InitWeights(o_.seed));
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
      PTK_RETURN_IF_ERROR(save_dir_.Take(o_.save));
      PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o_.save));
    }
    return absl::OkStatus();
  }

  // Before the model is made: what this rank will hold (Megatron's line, from rank 0), and a run
  // that cannot fit in what the machine, its cgroup or ulimit -v leave (with this node's ranks) stopped.
  absl::Status CheckCpuMemory(const BackendOptions& backend) {
    const int T = tensor_ ? tensor_->size() : 1, t = tensor_ ? tensor_->rank() : 0;
    PTK_ASSIGN_OR_RETURN(
        const CpuTrainingMemory need,
        EstimateCpuTrainingMemory(o_.model, T, t, backend.sequence_parallel && T > 1, backend.pipeline_stage,
                                  plan_.micro_batch_size, plan_.micro_batches,
                                  !o_.save.empty() || !o_.load.empty() || !o_.pretrained_checkpoint.empty(),
                                  o_.pipeline_microbatch_group_size, /*threads=*/0, cp_));
    Print(TheoreticalMemoryLine(need));
    return CheckFitsInMemory(need, ReadAvailableMemory(), o_.ranks_on_node, o_.ranks_on_node_source);
  }

  // --load: the weights, and unless --finetune the iteration, data position, moments and the training step's
  // state (Megatron's load_checkpoint); a directory without a checkpoint starts a new run.
  absl::Status Resume() {
    if (o_.load.empty() && o_.pretrained_checkpoint.empty()) return absl::OkStatus();
    // Every rank reads --load once rank 0 has put back what a killed save left aside.
    if (!o_.save.empty()) PTK_RETURN_IF_ERROR(world_->Barrier());
    std::string load = o_.load;
    bool finetune = o_.finetune;
    absl::StatusOr<int64_t> latest =
        load.empty() ? absl::NotFoundError("not given") : CheckpointToLoad(load, o_.ckpt_step);
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
    PTK_RETURN_IF_ERROR(LoadCheckpoint(load, *latest, model_->layout(), &params, &m, &v, &loaded));
    PTK_RETURN_IF_ERROR(CheckOptimizerStateLoads(loaded, load, *latest, finetune || o_.no_load_optim));
    PTK_RETURN_IF_ERROR(model_->WriteParams(params));
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
      PTK_RETURN_IF_ERROR(model_->WriteMoments(std::span<const float>(m).subspan(begin, size),
                                               std::span<const float>(v).subspan(begin, size)));
      step_state.adam_step = loaded.adam_step;
      step_state.loss_scale = loaded.loss_scale;
    }
    // Megatron's OptimizerParamScheduler.load_state_dict, its checks even where no iteration is left to train.
    // Megatron loads it with the optimizer: under --no-load-optim it starts anew (num_steps 0, the warm-up again).
    step_state.scheduler_num_steps = o_.no_load_optim ? 0 : loaded.scheduler_num_steps;
    if (!o_.no_load_optim) {
      PTK_ASSIGN_OR_RETURN(step_state.schedule,
                           ResumedSchedule(loaded, plan_.schedule, o_.scheduler_on_load,
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

  // --load at or past the last iteration: Megatron's train() runs no iteration and pretrain goes on to its end (a
  // save unless --save-interval divides the iteration, as after a loop that saved it; the final evaluations).
  absl::StatusOr<TrainSummary> NothingToTrain() {
    if (lead_)
      log::Info("{}", NothingToTrainLine(o_, state_.iteration, state_.consumed_train_samples, plan_.train_iters));
    summary_.nothing_to_train = true;
    if (o_.save_interval > 0 && state_.iteration % o_.save_interval == 0) last_saved_ = state_.iteration;
    return Finish();
  }

  // The splits and their loaders (from the data position reached), --metrics-file, --tensorboard-dir.
  absl::Status OpenDataAndOutputs() {
    PTK_ASSIGN_OR_RETURN(data_, BuildTrainingDatasets(o_, plan_, pipe_));
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
    PTK_RETURN_IF_ERROR(
        OpenRunOutputs(o_.tensorboard.dir, o_.metrics_path, o_.save, o_.load, state_.iteration, tb_writer_, &outputs_));
    train_loader_ = std::make_unique<DataLoader>(
        data_.train,
        PretrainingSampler(data_.train->size(), state_.consumed_train_samples, mbs, data_rank_, data_size_), mbs);
    PTK_RETURN_IF_ERROR(CheckSamplesLast(o_, plan_, state_, data_));
    if (data_.valid)
      valid_loader_ = std::make_unique<DataLoader>(
          data_.valid,
          PretrainingSampler(data_.valid->size(), state_.consumed_valid_samples, mbs, data_rank_, data_size_), mbs);
    return absl::OkStatus();
  }

  // Whether iteration `it` writes the log line or TensorBoard's scalars (the params norm and the
  // count of zeros are computed for those only: every rank decides alike).
  bool LogsThisIteration(int64_t it) const {
    return interval_.Due(it) || (!o_.tensorboard.dir.empty() && it % o_.tensorboard.log_interval == 0);
  }

  // --rampup-batch-size: Megatron's update_num_microbatches before each iteration, from the samples
  // consumed (a resume takes the batch size of where it stopped); when the number of micro-batches
  // grows, Megatron saves a checkpoint first (with --save).
  absl::Status UpdateBatchSize() {
    const int64_t gbs = plan_.GlobalBatchSizeAt(state_.consumed_train_samples);
    if (gbs == current_gbs_) return absl::OkStatus();
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

  // One iteration: this rank's micro-batches through the training step (Megatron's train_step).
  absl::StatusOr<StepResult> TrainIteration() {
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
    state_.consumed_train_samples += current_gbs_;
    interval_.Add(r);
    if (r.skipped) ++state_.skipped_iterations;
    summary_.last_lm_loss = r.lm_loss();
    return r;
  }

  // Megatron's pairs: the value at the iteration, and "<tag> vs samples" at the samples consumed.
  void TensorBoardScalar(const std::string& tag, double value) {
    outputs_.tb->AddScalar(tag, value, state_.iteration);
    outputs_.tb->AddScalar(tag + " vs samples", value, state_.consumed_train_samples);
  }

  // Megatron's training_log: --metrics-file's line every iteration, TensorBoard's scalars every
  // --tensorboard-log-interval, the log line (averaged over the interval) every --log-interval.
  absl::Status Log(const StepResult& r) {
    const double lr_now = step_->scheduler().lr();  // Megatron logs the rate after the scheduler step
    std::optional<double> params_norm;
    if (o_.log_params_norm && LogsThisIteration(state_.iteration)) {
      PTK_ASSIGN_OR_RETURN(params_norm, step_->ParamsNorm());
    }
    if (outputs_.metrics.is_open())
      PTK_RETURN_IF_ERROR(outputs_.metrics.Append(fmt::format(
          "{{\"iteration\": {}, \"consumed_samples\": {}, \"lm_loss\": {}, \"grad_norm\": {}, \"learning_rate\": "
          "{}, \"skipped\": {}, \"tokens\": {:.0f}}}\n",
          state_.iteration, state_.consumed_train_samples, JsonNumber(r.lm_loss()), JsonNumber(r.grad_norm),
          JsonNumber(lr_now), r.skipped ? "true" : "false", r.tokens)));
    if (outputs_.tb && state_.iteration % o_.tensorboard.log_interval == 0) {
      TensorBoardScalar("learning-rate", lr_now);
      TensorBoardScalar("batch-size", static_cast<double>(current_gbs_));
      TensorBoardScalar("lm loss", r.lm_loss());
      if (o_.tensorboard.log_loss_scale) TensorBoardScalar("loss-scale", r.next_loss_scale);
      if (o_.tensorboard.log_world_size) TensorBoardScalar("world-size", world_->size());  // args.world_size
      if (!r.skipped) TensorBoardScalar("grad-norm", r.grad_norm);  // Megatron has none for a skipped step
      if (r.num_zeros_in_grad) TensorBoardScalar("num-zeros", *r.num_zeros_in_grad);
      if (params_norm) TensorBoardScalar("params-norm", *params_norm);
    }
    if (!interval_.Due(state_.iteration)) return absl::OkStatus();
    LogLineFields f;
    f.iteration = state_.iteration;
    f.train_iters = plan_.train_iters;
    f.consumed_samples = state_.consumed_train_samples;
    f.global_batch_size = current_gbs_;
    interval_.Fill(r, FlopsPerIteration(o_.model, current_gbs_), world_->size(), o_.tensorboard.log_throughput, &f);
    f.params_norm = params_norm;
    f.learning_rate = lr_now;
    Print(FormatLogLine(f, Timestamp()));
    PTK_RETURN_IF_ERROR(LogTimers(
        timers_.get(), world_, state_.iteration, static_cast<double>(o_.log_interval),
        o_.tensorboard.log_timers ? outputs_.tb.get() : nullptr,
        [this](const std::string& text) { PrintAnyRank(text); }, interval_.Resets(state_.iteration)));
    if (outputs_.tb) {
      if (o_.tensorboard.log_timers && interval_.Resets(state_.iteration))
        outputs_.tb->AddScalar("iteration-time", f.elapsed_ms / 1000.0, state_.iteration);
      if (o_.tensorboard.log_timers && f.tflops_per_gpu)
        outputs_.tb->AddScalar("throughput", *f.tflops_per_gpu, state_.iteration);
      PTK_RETURN_IF_ERROR(outputs_.tb->Flush());
    }
    interval_.Logged(state_.iteration);
    return absl::OkStatus();
  }

  // Megatron's evaluate over eval_iters global batches, its 'evaluate' timer block, its lines and
  // scalars; tb_tag is Megatron's "lm loss validation", or "lm loss test"; `verbose` (pretrain's
  // evaluations after training) prints its 'Evaluating' lines. As Megatron's, it checks --exit-duration-in-mins after
  // each of its iterations and stops when the time is up, with one line and no loss (nullopt): the
  // loop then saves and exits as it does between iterations.
  absl::StatusOr<std::optional<double>> Evaluate(DataLoader* loader, const std::string& prefix, int64_t* consumed,
                                                 const std::string& tb_tag, bool verbose = false) {
    const IntervalPause paused(&interval_);  // no iteration's time, as in Megatron's train()
    const std::vector<int64_t>* positions = context_ ? &context_positions_ : nullptr;
    EvaluationPass pass{model_.get(), comm_, world_, pipe_, &agreed_, positions, started_, nullptr};
    if (verbose) pass.verbose = [this](const std::string& text) { Print(text); };
    const auto t0 = Clock::now();
    PTK_ASSIGN_OR_RETURN(const std::optional<double> loss, ptk::Evaluate(pass, o_, plan_, loader, prefix, consumed));
    if (!loss) {
      Print("Exiting during evaluation, timelimit reached");
      return loss;
    }
    PTK_RETURN_IF_ERROR(LogEvaluateTime(world_, Seconds(t0), timers_->option(),
                                        [this](const std::string& text) { PrintAnyRank(text); }));
    const std::string line = ValidationLine(prefix, *loss), bar(line.size() + 1, '-');
    Print(bar);
    Print(line);
    Print(bar);
    if (outputs_.tb) {
      TensorBoardScalar(tb_tag, *loss);
      if (o_.tensorboard.log_validation_ppl) TensorBoardScalar(tb_tag + " ppl", std::exp(std::min(20.0, *loss)));
      PTK_RETURN_IF_ERROR(outputs_.tb->Flush());
    }
    return loss;
  }

  // --sample-interval: rank 0 continues the prompt with the weights of this iteration.
  absl::Status Sample() {
    if (rank_ != 0) return absl::OkStatus();  // every tensor rank and stage of data rank 0 runs it; lead_ prints
    const IntervalPause paused(&interval_);
    GenerateOptions g;
    g.new_tokens = o_.sample.length;
    g.temperature = o_.sample.temperature;
    g.seed = Mix64(state_.seed ^ (static_cast<uint64_t>(state_.iteration) << 20));
    PTK_ASSIGN_OR_RETURN(std::vector<int32_t> ids, Generate(model_.get(), o_.sample.prompt, g, pipe_, &agreed_));
    Print(fmt::format(" sample at iteration {:8d} ({}): {:?} -> {:?}", state_.iteration,
                      o_.sample.temperature > 0 ? fmt::format("temperature {}", o_.sample.temperature) : "greedy",
                      o_.sample.prompt_text, o_.sample.decode(ids)));
    return absl::OkStatus();
  }

  // A checkpoint of this iteration in --save (none without it): the weights, the moments (ZeRO-1's
  // shards gathered, so that any number of ranks loads the file), the training step's state.
  absl::Status Save() {
    if (o_.save.empty()) return absl::OkStatus();
    const IntervalPause paused(&interval_);  // no iteration's time, as Megatron's save_checkpoint_and_time
    // What this checkpoint covers is on disk in the event and metrics files before the tracker
    // names it (the writer is the last stage's): a kill right after the save loses no iteration.
    PTK_RETURN_IF_ERROR(outputs_.Sync());
    PTK_RETURN_IF_ERROR(world_->Barrier());
    auto t0 = Clock::now();
    // Every tensor rank's and stage's weights and moments (ZeRO-1's shards gathered) on world rank 0.
    PTK_ASSIGN_OR_RETURN(std::vector<CheckpointArrays> parts,
                         GatherCheckpointArrays(model_.get(), comm_, tensor_, pipe_, o_.pipeline_stage_layers,
                                                o_.pipeline_virtual_size));
    if (lead_) {
      const TrainStepState step_state = step_->State();
      state_.adam_step = step_state.adam_step;
      state_.scheduler_num_steps = step_state.scheduler_num_steps;
      state_.scheduler = step_state.schedule;
      if (step_state.loss_scale) state_.loss_scale = step_state.loss_scale;
      state_.settings = settings_;
      std::vector<CheckpointShard> shards;
      for (const CheckpointArrays& a : parts) shards.push_back({&a.layout, a.params, a.exp_avg, a.exp_avg_sq});
      PTK_RETURN_IF_ERROR(SaveCheckpoint(o_.save, shards, state_, o_.args_json));
      const int pp = pipe_ ? pipe_->size() : 1;
      Print(fmt::format("  successfully saved checkpoint from iteration {:7d} to {} [ t 1/{}, p 1/{} ] ({:.1f} ms)",
                        state_.iteration, o_.save, parts.size() / static_cast<size_t>(pp), pp,
                        std::chrono::duration<double, std::milli>(Clock::now() - t0).count()));
    }
    last_saved_ = state_.iteration;
    return world_->Barrier();
  }

  // Megatron's checkpoint_and_decide_exit: the ranks agree on every reason through all-reduces;
  // a save every --save-interval; the reason to exit (a signal, --exit-duration-in-mins,
  // --exit-interval) in Megatron's words (the minutes as Python prints a float), or "" to go on.
  absl::StatusOr<std::string> SaveAndDecideExit() {
    double signal = o_.exit_signal && o_.exit_signal->load() != 0 ? 1.0 : 0.0;
    PTK_RETURN_IF_ERROR(world_->AllReduceSum(&signal, 1));
    if (signal > 0) return std::string("exiting program after receiving SIGTERM.");  // Megatron's, for any signal
    if (o_.save_interval > 0 && state_.iteration % o_.save_interval == 0) PTK_RETURN_IF_ERROR(Save());
    PTK_ASSIGN_OR_RETURN(const TimeLimit limit, CheckExitDuration(world_, started_, o_.exit_duration_in_mins));
    if (limit.reached) return fmt::format("exiting program after {} minutes", py::FloatRepr(limit.minutes));
    if (o_.exit_interval > 0 && state_.iteration % o_.exit_interval == 0)
      return fmt::format("exiting program at iteration {}", state_.iteration);
    return std::string();
  }

  // An exit before the last iteration: this iteration saved, the reason in Megatron's print_datetime line.
  absl::StatusOr<TrainSummary> Exit(const std::string& reason) {
    if (last_saved_ != state_.iteration) PTK_RETURN_IF_ERROR(Save());
    Print(fmt::format("[{}] datetime: {} ", reason, Timestamp()));
    summary_.exit_reason = reason;
    return Close();
  }

  // After the last iteration (Megatron's pretrain after train): the profile, a save, the final
  // evaluation on the validation and test splits.
  absl::StatusOr<TrainSummary> Finish() {
    Print(fmt::format("[after training is done] datetime: {} ", Timestamp()));
    if (std::string report = model_->ProfileReport(); lead_ && !report.empty()) {
      if (report.back() == '\n') report.pop_back();
      Print(report);
    }
    if (last_saved_ != state_.iteration) PTK_RETURN_IF_ERROR(Save());
    // Each stops, without its line, where --exit-duration-in-mins is up, as Megatron's.
    if (valid_loader_) {
      PTK_ASSIGN_OR_RETURN(
          const std::optional<double> loss,
          Evaluate(valid_loader_.get(), fmt::format("iteration {} on validation set", state_.iteration), nullptr,
                   "lm loss validation", /*verbose=*/true));
      if (loss) summary_.last_validation_loss = loss;
    }
    if (data_.test) {
      const int64_t mbs = plan_.micro_batch_size;
      DataLoader test_loader(data_.test, PretrainingSampler(data_.test->size(), 0, mbs, data_rank_, data_size_), mbs);
      PTK_ASSIGN_OR_RETURN(summary_.test_loss,
                           Evaluate(&test_loader, fmt::format("iteration {} on test set", state_.iteration), nullptr,
                                    "lm loss test", /*verbose=*/true));
    }
    return Close();
  }

  // The summary; the metrics and event files closed with their errors checked.
  absl::StatusOr<TrainSummary> Close() {
    summary_.iteration = state_.iteration;
    summary_.consumed_train_samples = state_.consumed_train_samples;
    summary_.skipped_iterations = state_.skipped_iterations;
    PTK_RETURN_IF_ERROR(outputs_.metrics.Close());
    if (outputs_.tb) PTK_RETURN_IF_ERROR(outputs_.tb->Close());
    return summary_;
  }

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
  const bool lead_;                         // world rank 0: the logs, the checkpoint's writer
  const bool tb_writer_;  // events and metrics: the last stage's data and tensor rank 0 (Megatron's last rank)
  Settings settings_;
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<Timers> timers_;  // --timing-log-level's
  StageExchangeAgreement agreed_;   // the forward-only passes' exchange formats, agreed once each
  SaveDirectory save_dir_;          // rank 0's --save: a start refused on any rank leaves none it made
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
  int64_t last_saved_ = -1;
};

}  // namespace

absl::StatusOr<TrainSummary> RunTraining(const TrainOptions& o, const TrainPlan& plan) {
  std::unique_ptr<Communicator> local = o.comm ? nullptr : MakeLocalCommunicator();
  Communicator* comm = o.comm ? o.comm : local.get();
  PTK_RETURN_IF_ERROR(CheckRunCommunicators(o, plan, *comm));
  return Trainer(o, plan, comm).Run();
}

}  // namespace ptk
