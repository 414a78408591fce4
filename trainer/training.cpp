// ptk-train's loop (Megatron's pretrain / train / training_log / evaluate / checkpoint_and_decide_exit).
#include "trainer/training.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>

#include <fmt/core.h>

#include "common/file_util.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/status.h"
#include "indexed_dataset/data_loader.h"
#include "tensorboard/summary_writer.h"
#include "trainer/checkpoint.h"
#include "trainer/counter_rng.h"
#include "trainer/param_shard.h"
#include "trainer/run_settings.h"
#include "trainer/sampling.h"

namespace ptk::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// --mock-data: synthetic documents (an arithmetic run of token ids per sample, EOD-separated), the
// same for every run with the same seed. Not Megatron's MockGPTDataset token for token.
class MockDataset : public TopLevelDataset {
 public:
  MockDataset(int64_t size, int64_t vocab, const GPTDatasetConfig& config) : size_(size), vocab_(vocab) {
    config_ = config;
    description_ = "MockGPTDataset";
  }
  int64_t size() const override { return size_; }
  absl::Status Text(int64_t idx, int64_t* out, int64_t* dataset_id) const override {
    *dataset_id = 0;
    uint64_t h = static_cast<uint64_t>(idx) * 0x9e3779b97f4a7c15ULL + config_.random_seed;
    h ^= h >> 29;
    const int64_t start = static_cast<int64_t>(h % static_cast<uint64_t>(vocab_ - 1));
    const int64_t step = 1 + static_cast<int64_t>((h >> 20) % 7);
    const int64_t eod_every = 16 + static_cast<int64_t>((h >> 40) % 48);
    for (int64_t i = 0; i <= config_.sequence_length; ++i)
      out[i] = (i + 1) % eod_every == 0 ? config_.eod : (start + i * step) % (vocab_ - 1);
    return absl::OkStatus();
  }
  py::Json unique_identifiers() const override { return py::Json(py::Json::Object{}); }

 private:
  int64_t size_, vocab_;
};

std::string Timestamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

struct Splits {
  std::shared_ptr<TopLevelDataset> train, valid, test;
};

absl::StatusOr<Splits> BuildDatasets(const TrainOptions& o, const TrainPlan& plan) {
  GPTDatasetConfig cfg;
  cfg.random_seed = o.seed;
  cfg.sequence_length = o.model.seq_length;
  cfg.tokenizer = Gpt2TokenizerIdentifiers(o.vocab_file.empty() ? "gpt2-vocab.json" : o.vocab_file,
                                           o.merge_file.empty() ? "gpt2-merges.txt" : o.merge_file);
  cfg.path_to_cache = o.data_cache_path;
  cfg.eod_mask_loss = o.eod_mask_loss;
  cfg.reset_position_ids = o.reset_position_ids;
  // Megatron's train_valid_test_num_samples.
  const int64_t gbs = plan.global_batch_size, train_samples = plan.train_samples;
  const int64_t eval_iters = o.eval_iters > 0 && o.eval_interval > 0 ? o.eval_iters : 0;
  const int64_t valid_samples = (plan.train_iters / std::max<int64_t>(1, o.eval_interval) + 1) * eval_iters * gbs;
  const int64_t test_samples = eval_iters * gbs;
  Splits s;
  if (o.mock_data) {
    s.train = std::make_shared<MockDataset>(train_samples, o.model.vocab_size, cfg);
    if (valid_samples > 0) s.valid = std::make_shared<MockDataset>(valid_samples, o.model.vocab_size, cfg);
    if (test_samples > 0) s.test = std::make_shared<MockDataset>(test_samples, o.model.vocab_size, cfg);
    return s;
  }
  DataArgs args = o.data;
  args.sizes = {train_samples, valid_samples, test_samples};
  PTK_ASSIGN_OR_RETURN(auto sets, BuildGPTDatasets(args, cfg));
  s.train = sets[0];
  s.valid = eval_iters > 0 ? sets[1] : nullptr;
  s.test = eval_iters > 0 ? sets[2] : nullptr;
  if (!s.train) return absl::InvalidArgumentError("the train split is empty: check --split and the data paths");
  if (s.train->size() < train_samples)
    return absl::InvalidArgumentError(
        fmt::format("the train split has {} samples, {} are needed", s.train->size(), train_samples));
  return s;
}

// --metrics-file: one JSON line per iteration, each written and flushed with its errors checked
// (a full disk stops the run with exit 3 instead of leaving an empty file behind a success).
class MetricsFile {
 public:
  ~MetricsFile() {
    if (f_) std::fclose(f_);
  }
  absl::Status Open(const std::string& path) {
    path_ = path;
    PTK_RETURN_IF_ERROR(MakeDirs(Dirname(path)));
    f_ = std::fopen(path.c_str(), "a");
    if (!f_) return ErrnoToStatus(errno, "open " + path);
    return absl::OkStatus();
  }
  bool is_open() const { return f_ != nullptr; }
  absl::Status Append(const std::string& line) {
    if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
      return ErrnoToStatus(errno, "write " + path_);
    return absl::OkStatus();
  }
  absl::Status Close() {
    if (!f_) return absl::OkStatus();
    const int rc = std::fclose(f_);
    f_ = nullptr;
    if (rc != 0) return ErrnoToStatus(errno, "close " + path_);
    return absl::OkStatus();
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

// A JSON number, or null for NaN/Inf (which JSON cannot spell).
std::string JsonNumber(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "null"; }

// --load given a path inside a checkpoint directory (iter_0000020, its mp_rank_00, the file): Megatron
// and ptk take the directory that holds latest_checkpointed_iteration.txt, and training from random
// weights instead would be a silent mistake. A usage error naming that directory; OK otherwise.
absl::Status CheckLoadIsACheckpointDirectory(const std::string& load) {
  if (!PathExists(load)) return absl::OkStatus();  // a new run's directory
  std::string dir = load;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  for (int up = 0; up < 3 && !dir.empty() && dir != "/" && dir != "."; ++up) {
    dir = Dirname(dir);
    if (PathExists(JoinPath(dir, "latest_checkpointed_iteration.txt")))
      return UsageError(
          fmt::format("--load {} is inside a checkpoint directory: --load takes the directory that holds "
                      "latest_checkpointed_iteration.txt (it resumes from the iteration that file names): did you "
                      "mean --load {}?",
                      load, dir));
  }
  return absl::OkStatus();
}

// Views of a loader's micro-batch for the model.
ModelBatch View(const MicroBatch& mb, std::vector<int64_t>* keys) {
  *keys = mb.indices;
  return ModelBatch{mb.micro_batch_size,    mb.seq_length,       mb.tokens.data(), mb.labels.data(),
                    mb.position_ids.data(), mb.loss_mask.data(), keys->data()};
}

}  // namespace

double FlopsPerIteration(const GPTConfig& c, int64_t gbs) {
  const double b = static_cast<double>(gbs), s = static_cast<double>(c.seq_length),
               l = static_cast<double>(c.num_layers), h = static_cast<double>(c.hidden_size),
               f = static_cast<double>(c.ffn_hidden_size), v = static_cast<double>(c.padded_vocab_size);
  // 12 * B * s * l * h^2 * ((1 + groups/heads + s/(2h)) + ffn/h + V/(2 l h)); groups == heads here.
  return 12.0 * b * s * l * h * h * ((2.0 + s / (2.0 * h)) + f / h + v / (2.0 * l * h));
}

absl::Status CheckForNanInLossAndGrad(const StepResult& r, int64_t iteration, int rank) {
  const bool loss_bad = !std::isfinite(r.loss_sum), grad_bad = !std::isfinite(r.grad_norm);
  if (!loss_bad && !grad_bad) return absl::OkStatus();
  const double bad = loss_bad ? r.loss_sum : r.grad_norm;
  return absl::AbortedError(
      fmt::format("iteration {} (rank {}): the {} is {} (lm loss {}, grad norm {}); stopping, as Megatron does with "
                  "--check-for-nan-in-loss-and-grad (lower --lr, or resume from the last checkpoint; "
                  "--no-check-for-nan-in-loss-and-grad skips such iterations instead)",
                  iteration, rank, loss_bad ? "loss" : "gradient norm", std::isnan(bad) ? "NaN" : "infinite",
                  std::fabs(r.lm_loss()), std::fabs(r.grad_norm)));
}

std::string FormatLogLine(const LogLineFields& f, const std::string& timestamp) {
  std::string s = fmt::format(" [{}] iteration {:8d}/{:8d} |", timestamp, f.iteration, f.train_iters);
  s += fmt::format(" consumed samples: {:12d} |", f.consumed_samples);
  s += fmt::format(" elapsed time per iteration (ms): {:.1f} |", f.elapsed_ms);
  s += fmt::format(" throughput per GPU (TFLOP/s/GPU): {:.1f} |", f.tflops_per_gpu);
  s += fmt::format(" learning rate: {:.6E} |", f.learning_rate);
  s += fmt::format(" global batch size: {:5d} |", f.global_batch_size);
  if (f.lm_loss > 0.0) s += fmt::format(" lm loss: {:.6E} |", f.lm_loss);
  s += fmt::format(" loss scale: {:.1f} |", f.loss_scale);
  s += fmt::format(" grad norm: {:.3f} |", f.grad_norm);
  s += fmt::format(" number of skipped iterations: {:3d} |", f.skipped);
  s += fmt::format(" number of nan iterations: {:3d} |", f.nan);
  return s;
}

absl::StatusOr<TrainSummary> RunTraining(const TrainOptions& o, const TrainPlan& plan) {
  std::unique_ptr<Communicator> local;
  Communicator* comm = o.comm;
  if (!comm) {
    local = MakeLocalCommunicator();
    comm = local.get();
  }
  const int rank = comm->rank(), dp = comm->size();
  auto print = [&](const std::string& line) {
    if (rank != 0) return;
    if (o.print) {
      o.print(line);
    } else {
      std::fputs((line + "\n").c_str(), stdout);
      std::fflush(stdout);
    }
  };
  if (plan.data_parallel_size != dp)
    return absl::InvalidArgumentError(
        fmt::format("a plan for {} data-parallel ranks, a communicator of {}", plan.data_parallel_size, dp));
  const int64_t mbs = plan.micro_batch_size, gbs = plan.global_batch_size, num_micro = plan.micro_batches,
                train_iters = plan.train_iters;
  const SchedulerConfig& sc = plan.schedule;
  // Before any collective whose size depends on the flags.
  const Settings settings = RunSettings(o, gbs);
  PTK_RETURN_IF_ERROR(CheckRanksAgree(comm, settings));

  // ---- model, optimizer, checkpoint
  BackendOptions backend = o.backend;
  backend.micro_batch_size = mbs;
  PTK_ASSIGN_OR_RETURN(std::unique_ptr<GPTModel> model, CreateModel(o.model, backend));
  if (o.use_distributed_optimizer) {
    PTK_ASSIGN_OR_RETURN(const ParamShard shard, ParamShard::Create(model->num_params(), dp, rank));
    PTK_RETURN_IF_ERROR(model->ShardOptimizerState(shard));
    if (dp == 1)
      log::Info(
          "note: --use-distributed-optimizer: accepted, one rank keeps the whole optimizer state (it is sharded over "
          "data-parallel ranks)");
    else if (rank == 0)
      log::Info("distributed optimizer: each of {} ranks keeps {} of the {} parameters' AdamW state", dp,
                shard.shard_size, model->num_params());
  }
  PTK_RETURN_IF_ERROR(model->InitWeights(o.seed));
  TrainStep opt(model.get(), o.optimizer, sc, comm, o.loss_scale);
  if (rank == 0 && !opt.buckets().empty()) {
    int64_t largest = 0;
    for (const GradRange& b : opt.buckets()) largest = std::max(largest, b.size());
    log::Info("--overlap-grad-reduce: {} gradient bucket(s) of up to {} elements, reduced as backward completes them",
              opt.buckets().size(), largest);
  }
  TrainState state;
  state.seed = o.seed;
  TrainSummary summary;
  // One training run per --save directory: a second (a requeue while the first still runs) stops
  // here naming the first, instead of interleaving checkpoints with it.
  std::unique_ptr<OutputLock> save_lock;
  if (rank == 0 && !o.save.empty()) {
    PTK_RETURN_IF_ERROR(MakeDirs(o.save));
    PTK_ASSIGN_OR_RETURN(save_lock, OutputLock::Acquire(JoinPath(o.save, "ptk-train")));
    PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o.save));
  }
  // Every rank reads --load once rank 0 has put back what a killed save left aside.
  if (!o.load.empty() && !o.save.empty()) PTK_RETURN_IF_ERROR(comm->Barrier());
  if (!o.load.empty()) {
    auto latest = LatestCheckpointIteration(o.load);
    if (latest.ok()) {
      TrainState loaded;
      std::vector<float> params, m, v;
      PTK_RETURN_IF_ERROR(LoadCheckpoint(o.load, *latest, model->layout(), &params, &m, &v, &loaded));
      PTK_RETURN_IF_ERROR(model->WriteParams(params));
      if (o.finetune) {
        log::Info("--finetune: loaded the weights of iteration {}; iteration, optimizer and data position start anew",
                  *latest);
      } else {
        state = loaded;
        TrainStepState step_state = opt.State();
        if (!o.no_load_optim) {
          // This rank's range of the moments (all of them without ZeRO-1): any rank count loads them.
          PTK_RETURN_IF_ERROR(
              model->WriteMoments(std::span<const float>(m).subspan(static_cast<size_t>(model->moments_begin()),
                                                                    static_cast<size_t>(model->moments_size())),
                                  std::span<const float>(v).subspan(static_cast<size_t>(model->moments_begin()),
                                                                    static_cast<size_t>(model->moments_size()))));
          step_state.adam_step = loaded.adam_step;
          step_state.loss_scale = loaded.loss_scale;
        }
        step_state.scheduler_num_steps = loaded.scheduler_num_steps;
        // Megatron's OptimizerParamScheduler.load_state_dict; a finished run needs no schedule, and
        // --no-load-optim takes this command line's optimizer settings, schedule included.
        if (loaded.scheduler && !o.no_load_optim && loaded.iteration < train_iters) {
          std::vector<std::string> notes;
          PTK_ASSIGN_OR_RETURN(SchedulerConfig chosen,
                               ResolveResumedScheduler(sc, *loaded.scheduler, o.scheduler_on_load, loaded.iteration,
                                                       o.train_iters > 0 ? gbs : 0, &notes));
          step_state.schedule = chosen;
          for (const std::string& n : notes)
            if (rank == 0) log::Info("{}", n);
        } else if (!loaded.scheduler && o.scheduler_on_load == SchedulerOnLoad::kUseCheckpoint && rank == 0) {
          log::Warning(
              "--use-checkpoint-opt_param-scheduler: the checkpoint of iteration {} does not record its schedule "
              "(an earlier ptk wrote it); going on with this command line's",
              loaded.iteration);
        }
        opt.Restore(step_state);
        if (o.no_load_rng) state.seed = o.seed;
        summary.resumed = true;
        if (rank == 0)
          log::Info("loaded checkpoint {} at iteration {} ({} samples consumed)", CheckpointFile(o.load, *latest),
                    loaded.iteration, loaded.consumed_train_samples);
        if (rank == 0) ReportResumeChanges(loaded.settings, settings, loaded, o.no_load_rng);
      }
    } else if (absl::IsNotFound(latest.status())) {
      PTK_RETURN_IF_ERROR(CheckLoadIsACheckpointDirectory(o.load));
      // --load and --save one directory is how every first run starts; another --load was meant to
      // hold a checkpoint.
      if (rank == 0 && o.load != o.save)
        log::Warning("--load {}; starting from random initialization", StatusMessage(latest.status()));
      else if (rank == 0)
        log::Info("{}; starting from random initialization", StatusMessage(latest.status()));
    } else {
      return latest.status();
    }
  }

  if (state.iteration >= train_iters) {
    if (rank == 0)
      log::Info(
          "nothing to train: the checkpoint in {} is at iteration {} ({} samples consumed) and {}; give a larger {} "
          "to train further",
          o.load, state.iteration, state.consumed_train_samples,
          o.train_iters > 0 ? fmt::format("--train-iters is {}", o.train_iters)
                            : fmt::format("--train-samples {} make {} iterations", o.train_samples, train_iters),
          o.train_iters > 0 ? "--train-iters" : "--train-samples");
    summary.iteration = state.iteration;
    summary.consumed_train_samples = state.consumed_train_samples;
    summary.exit_reason = "nothing to train";
    summary.nothing_to_train = true;
    return summary;
  }
  PTK_ASSIGN_OR_RETURN(Splits data, BuildDatasets(o, plan));
  const double flops = FlopsPerIteration(o.model, gbs);
  if (rank == 0)
    log::Info(
        "model: {} parameters on {}; {} micro-batch(es) of {} per rank per iteration, {} rank(s), global batch {}",
        model->num_params(), model->Describe(), num_micro, mbs, dp, gbs);

  MetricsFile metrics;
  if (rank == 0 && !o.metrics_path.empty()) PTK_RETURN_IF_ERROR(metrics.Open(o.metrics_path));
  // --tensorboard-dir: a new event file per run (a resume adds one), as Megatron's SummaryWriter.
  std::unique_ptr<SummaryWriter> tb;
  if (rank == 0 && !o.tensorboard.dir.empty()) {
    PTK_ASSIGN_OR_RETURN(tb, SummaryWriter::Create(o.tensorboard.dir));
    log::Info("TensorBoard events: {}", tb->path());
  }
  // Megatron's pairs: the value at the iteration, and "<tag> vs samples" at the samples consumed.
  auto tb_scalar = [&](const std::string& tag, double value) {
    tb->AddScalar(tag, value, state.iteration);
    tb->AddScalar(tag + " vs samples", value, state.consumed_train_samples);
  };

  DataLoader train_loader(data.train,
                          PretrainingSampler(data.train->size(), state.consumed_train_samples, mbs, rank, dp), mbs);
  std::unique_ptr<DataLoader> valid_loader;
  if (data.valid)
    valid_loader = std::make_unique<DataLoader>(
        data.valid, PretrainingSampler(data.valid->size(), state.consumed_valid_samples, mbs, rank, dp), mbs);

  std::vector<std::unique_ptr<MicroBatch>> held(static_cast<size_t>(num_micro));
  std::vector<std::vector<int64_t>> keys(static_cast<size_t>(num_micro));
  std::vector<ModelBatch> batches(static_cast<size_t>(num_micro));

  // Forward-only evaluation over eval_iters global batches (Megatron's evaluate).
  // tb_tag: "lm loss validation" (Megatron's tag), "lm loss test".
  auto evaluate = [&](DataLoader* loader, const std::string& prefix, int64_t* consumed,
                      const std::string& tb_tag) -> absl::StatusOr<double> {
    double sums[2] = {0, 0};
    for (int64_t it = 0; it < o.eval_iters; ++it) {
      for (int64_t m = 0; m < num_micro; ++m) {
        PTK_ASSIGN_OR_RETURN(auto mb, loader->Next());
        if (!mb) return absl::OutOfRangeError(prefix + ": the evaluation data ran out");
        std::vector<int64_t> k;
        PTK_ASSIGN_OR_RETURN(LossSum s, model->Forward(View(*mb, &k)));
        sums[0] += s.loss_sum;
        sums[1] += s.tokens;
      }
      if (consumed) *consumed += gbs;
    }
    PTK_RETURN_IF_ERROR(comm->AllReduceSum(sums, 2));
    const double loss = sums[1] > 0 ? sums[0] / sums[1] : 0.0;
    std::string line = fmt::format(" validation loss at {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", prefix,
                                   loss, std::exp(std::min(20.0, loss)));
    std::string bar(line.size() + 1, '-');
    print(bar);
    print(line);
    print(bar);
    if (tb) {
      tb_scalar(tb_tag, loss);
      if (o.tensorboard.log_validation_ppl) tb_scalar(tb_tag + " ppl", std::exp(std::min(20.0, loss)));
      PTK_RETURN_IF_ERROR(tb->Flush());
    }
    return loss;
  };

  // --sample-interval: rank 0 continues the prompt with the weights of this iteration.
  auto sample = [&]() -> absl::Status {
    if (rank != 0) return absl::OkStatus();
    GenerateOptions g;
    g.new_tokens = o.sample.length;
    g.temperature = o.sample.temperature;
    g.seed = Mix64(state.seed ^ (static_cast<uint64_t>(state.iteration) << 20));
    PTK_ASSIGN_OR_RETURN(std::vector<int32_t> ids, Generate(model.get(), o.sample.prompt, g));
    print(fmt::format(" sample at iteration {:8d} ({}): {:?} -> {:?}", state.iteration,
                      o.sample.temperature > 0 ? fmt::format("temperature {}", o.sample.temperature) : "greedy",
                      o.sample.prompt_text, o.sample.decode(ids)));
    return absl::OkStatus();
  };

  auto save = [&]() -> absl::Status {
    if (o.save.empty()) return absl::OkStatus();
    PTK_RETURN_IF_ERROR(comm->Barrier());
    auto t0 = Clock::now();
    const size_t n = static_cast<size_t>(model->num_params());
    std::vector<float> m, v;
    if (model->shard()) {
      // ZeRO-1: every rank's shard of the moments put together (the file holds the whole state, so
      // a run on another number of ranks loads it).
      m.assign(n, 0.0f);
      v.assign(n, 0.0f);
      const size_t begin = static_cast<size_t>(model->moments_begin()),
                   size = static_cast<size_t>(model->moments_size());
      PTK_RETURN_IF_ERROR(
          model->ReadMoments(std::span<float>(m).subspan(begin, size), std::span<float>(v).subspan(begin, size)));
      std::vector<int64_t> bytes = model->shard()->Counts();
      for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
      PTK_RETURN_IF_ERROR(comm->AllGather(m.data(), bytes));
      PTK_RETURN_IF_ERROR(comm->AllGather(v.data(), bytes));
    }
    if (rank == 0) {
      const TrainStepState step_state = opt.State();
      state.adam_step = step_state.adam_step;
      state.scheduler_num_steps = step_state.scheduler_num_steps;
      state.scheduler = step_state.schedule;
      if (step_state.loss_scale) state.loss_scale = step_state.loss_scale;
      state.settings = settings;
      std::vector<float> params(n);
      PTK_RETURN_IF_ERROR(model->ReadParams(params));
      if (!model->shard()) {
        m.resize(n);
        v.resize(n);
        PTK_RETURN_IF_ERROR(model->ReadMoments(m, v));
      }
      PTK_RETURN_IF_ERROR(SaveCheckpoint(o.save, model->layout(), params, m, v, state, o.args_json));
      print(fmt::format("  successfully saved checkpoint from iteration {:7d} to {} [ t 1/1, p 1/1 ] ({:.1f} ms)",
                        state.iteration, o.save, std::chrono::duration<double, std::milli>(Clock::now() - t0).count()));
    }
    return comm->Barrier();
  };

  const auto start = Clock::now();
  const double wall_before = state.wall_seconds;
  auto interval_start = Clock::now();
  int64_t interval_iters = 0, interval_advanced = 0, interval_skipped = 0, interval_nan = 0;
  double interval_loss = 0;
  int64_t last_saved = -1;
  print(fmt::format("[after dataloaders are built] datetime: {} ", Timestamp()));
  print("training ...");

  while (state.iteration < train_iters) {
    for (int64_t m = 0; m < num_micro; ++m) {
      PTK_ASSIGN_OR_RETURN(held[m], train_loader.Next());
      if (!held[m]) return absl::OutOfRangeError("the training data ran out before --train-iters");
      batches[m] = View(*held[m], &keys[m]);
    }
    PTK_ASSIGN_OR_RETURN(StepResult r, opt.Step(batches, gbs, state.seed));
    // fp16's dynamic loss scaling skips an overflowing step by design; anything else non-finite stops.
    if (o.check_for_nan_in_loss_and_grad && !r.overflow)
      PTK_RETURN_IF_ERROR(CheckForNanInLossAndGrad(r, state.iteration + 1, rank));
    ++state.iteration;
    state.consumed_train_samples += gbs;
    ++interval_iters;
    if (r.skipped) {
      ++interval_skipped;
      if (!r.overflow) ++interval_nan;
      ++state.skipped_iterations;
    } else {
      ++interval_advanced;
      interval_loss += r.lm_loss();
    }
    summary.last_lm_loss = r.lm_loss();
    const double lr_now = opt.scheduler().lr();  // Megatron logs the rate after the scheduler step
    if (metrics.is_open())
      PTK_RETURN_IF_ERROR(metrics.Append(fmt::format(
          "{{\"iteration\": {}, \"consumed_samples\": {}, \"lm_loss\": {}, \"grad_norm\": {}, \"learning_rate\": "
          "{}, \"skipped\": {}, \"tokens\": {:.0f}}}\n",
          state.iteration, state.consumed_train_samples, JsonNumber(r.lm_loss()), JsonNumber(r.grad_norm),
          JsonNumber(lr_now), r.skipped ? "true" : "false", r.tokens)));
    // Megatron's training_log: its scalars every --tensorboard-log-interval iterations.
    if (tb && state.iteration % o.tensorboard.log_interval == 0) {
      tb_scalar("learning-rate", lr_now);
      tb_scalar("batch-size", static_cast<double>(gbs));
      tb_scalar("lm loss", r.lm_loss());
      if (o.tensorboard.log_loss_scale) tb_scalar("loss-scale", r.loss_scale);
      if (o.tensorboard.log_world_size) tb_scalar("world-size", dp);
      if (!r.overflow) tb_scalar("grad-norm", r.grad_norm);  // Megatron has no norm for an overflow
    }
    if (state.iteration % o.log_interval == 0) {
      const double secs = std::chrono::duration<double>(Clock::now() - interval_start).count();
      LogLineFields f;
      f.iteration = state.iteration;
      f.train_iters = train_iters;
      f.consumed_samples = state.consumed_train_samples;
      f.global_batch_size = gbs;
      f.elapsed_ms = secs * 1000.0 / static_cast<double>(interval_iters);
      f.tflops_per_gpu = flops / (secs / static_cast<double>(interval_iters) * 1e12 * dp);
      f.learning_rate = lr_now;
      f.lm_loss = interval_advanced > 0 ? interval_loss / static_cast<double>(interval_advanced) : 0.0;
      f.grad_norm = r.grad_norm;
      f.loss_scale = r.loss_scale;
      f.skipped = interval_skipped;
      f.nan = interval_nan;
      print(FormatLogLine(f, Timestamp()));
      if (tb) {
        if (o.tensorboard.log_timers) {
          tb->AddScalar("iteration-time", f.elapsed_ms / 1000.0, state.iteration);
          if (o.tensorboard.log_throughput) tb->AddScalar("throughput", f.tflops_per_gpu, state.iteration);
        }
        PTK_RETURN_IF_ERROR(tb->Flush());
      }
      interval_start = Clock::now();
      interval_iters = interval_advanced = interval_skipped = interval_nan = 0;
      interval_loss = 0;
    }
    if (valid_loader && o.eval_interval > 0 && state.iteration % o.eval_interval == 0) {
      PTK_ASSIGN_OR_RETURN(double vl, evaluate(valid_loader.get(), fmt::format("iteration {}", state.iteration),
                                               &state.consumed_valid_samples, "lm loss validation"));
      summary.last_validation_loss = vl;
    }
    if (o.sample.interval > 0 && state.iteration % o.sample.interval == 0) PTK_RETURN_IF_ERROR(sample());
    state.wall_seconds = wall_before + std::chrono::duration<double>(Clock::now() - start).count();

    // Megatron's checkpoint_and_decide_exit: ranks agree on every reason through one all-reduce.
    double flags[2] = {o.exit_signal && o.exit_signal->load() != 0 ? 1.0 : 0.0,
                       std::chrono::duration<double>(Clock::now() - start).count() / 60.0};
    PTK_RETURN_IF_ERROR(comm->AllReduceSum(flags, 2));
    std::string reason;
    if (flags[0] > 0) reason = "exiting on signal";
    if (reason.empty() && o.save_interval > 0 && state.iteration % o.save_interval == 0) {
      PTK_RETURN_IF_ERROR(save());
      last_saved = state.iteration;
    }
    if (reason.empty() && o.exit_duration_in_mins > 0 && flags[1] / dp > o.exit_duration_in_mins)
      reason = fmt::format("exiting program after {:.1f} minutes", flags[1] / dp);
    if (reason.empty() && o.exit_interval > 0 && state.iteration % o.exit_interval == 0)
      reason = fmt::format("exiting program at iteration {}", state.iteration);
    if (!reason.empty()) {
      if (last_saved != state.iteration) PTK_RETURN_IF_ERROR(save());
      print(reason);
      summary.exit_reason = reason;
      summary.iteration = state.iteration;
      summary.consumed_train_samples = state.consumed_train_samples;
      summary.skipped_iterations = state.skipped_iterations;
      PTK_RETURN_IF_ERROR(metrics.Close());
      if (tb) PTK_RETURN_IF_ERROR(tb->Close());
      return summary;
    }
  }
  print(fmt::format("[after training is done] datetime: {} ", Timestamp()));
  if (std::string report = model->ProfileReport(); rank == 0 && !report.empty()) {
    if (report.back() == '\n') report.pop_back();
    print(report);
  }
  if (last_saved != state.iteration && !o.save.empty()) PTK_RETURN_IF_ERROR(save());
  if (valid_loader) {
    PTK_ASSIGN_OR_RETURN(
        double vl, evaluate(valid_loader.get(), "the end of training for val data", nullptr, "lm loss validation"));
    summary.last_validation_loss = vl;
  }
  if (data.test) {
    DataLoader test_loader(data.test, PretrainingSampler(data.test->size(), 0, mbs, rank, dp), mbs);
    PTK_ASSIGN_OR_RETURN(double tl,
                         evaluate(&test_loader, "the end of training for test data", nullptr, "lm loss test"));
    summary.test_loss = tl;
  }
  summary.iteration = state.iteration;
  summary.consumed_train_samples = state.consumed_train_samples;
  summary.skipped_iterations = state.skipped_iterations;
  PTK_RETURN_IF_ERROR(metrics.Close());
  if (tb) PTK_RETURN_IF_ERROR(tb->Close());
  return summary;
}

}  // namespace ptk::trainer
