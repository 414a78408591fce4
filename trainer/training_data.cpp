// ptk-train's datasets and the check of --load (training_data.h).
#include "trainer/training_data.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

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

// A middle pipeline stage's stand-in for a split it does not read: the split's size (so that its
// sampler gives the first stage's sample indices, which key dropout) and samples of token 0 (a
// middle stage uses neither tokens, labels, positions nor the loss mask).
class StageStandInDataset : public TopLevelDataset {
 public:
  StageStandInDataset(int64_t size, const GPTDatasetConfig& config) : size_(size) {
    config_ = config;
    description_ = "a middle pipeline stage's stand-in";
  }
  int64_t size() const override { return size_; }
  absl::Status Text(int64_t, int64_t* out, int64_t* dataset_id) const override {
    *dataset_id = 0;
    std::fill(out, out + config_.sequence_length + 1, int64_t{0});
    return absl::OkStatus();
  }
  py::Json unique_identifiers() const override { return py::Json(py::Json::Object{}); }

 private:
  int64_t size_;
};

absl::StatusOr<TrainingSplits> BuildSplits(const TrainOptions& o, const TrainPlan& plan, const GPTDatasetConfig& cfg);

// The training split, built for Megatron's num_samples, holds fewer samples than the iterations
// take (a ramp whose last iteration goes past --train-samples): Megatron's loader runs out there.
absl::Status TrainSplitRunsOut(const TrainOptions& o, const TrainPlan& plan, int64_t size) {
  int64_t consumed = 0, iteration = 0;
  while (consumed <= size) {
    consumed += plan.GlobalBatchSizeAt(consumed);
    ++iteration;
  }
  if (o.train_samples <= 0)
    return absl::InvalidArgumentError(
        fmt::format("the train split has {} samples, {} are needed", size, plan.train_samples));
  return UsageError(fmt::format(
      "--train-samples {}: the training split is built for {} samples (Megatron's num_samples) and holds {}, but "
      "the {} iterations take {}{}: the data would run out at iteration {}, where Megatron's loader runs out too. "
      "Give a larger --train-samples",
      o.train_samples, plan.train_split_samples, size, plan.train_iters, plan.train_samples,
      plan.rampup_start > 0 ? " (the ramp's last iteration goes past --train-samples)" : "", iteration));
}

}  // namespace

absl::StatusOr<TrainingSplits> BuildTrainingDatasets(const TrainOptions& o, const TrainPlan& plan,
                                                     Communicator* pipeline) {
  GPTDatasetConfig cfg;
  cfg.random_seed = o.seed;
  cfg.sequence_length = o.model.seq_length;
  cfg.tokenizer = Gpt2TokenizerIdentifiers(o.vocab_file.empty() ? "gpt2-vocab.json" : o.vocab_file,
                                           o.merge_file.empty() ? "gpt2-merges.txt" : o.merge_file);
  cfg.path_to_cache = o.data_cache_path;
  cfg.mid_level_dataset_surplus = o.mid_level_dataset_surplus;
  cfg.eod_mask_loss = o.eod_mask_loss;
  cfg.reset_position_ids = o.reset_position_ids;
  cfg.eod = o.eod;
  if (o.fim.enabled && !o.mock_data) {  // Megatron's GPTFIMDataset (the flags' errors were found at parse time)
    PTK_ASSIGN_OR_RETURN(cfg.fim, MakeFimConfig(o.fim, o.vocab_file, o.merge_file));
  }
  const bool middle = pipeline && pipeline->rank() > 0 && pipeline->rank() < pipeline->size() - 1;
  TrainingSplits s;
  if (!middle) {
    PTK_ASSIGN_OR_RETURN(s, BuildSplits(o, plan, cfg));
  }
  if (!pipeline || pipeline->size() < 3) return s;
  // Only the first stage (tokens) and the last (labels, loss mask) read the data, as Megatron's
  // is_built_on_rank; the first stage's split sizes (and its validation sets' count and sizes) to every stage.
  int64_t sizes[4] = {-1, -1, -1, 0};
  for (int i = 0; i < 3 && !middle; ++i) {
    const auto& split = i == 0 ? s.train : i == 1 ? s.valid : s.test;
    sizes[i] = split ? split->size() : -1;
  }
  if (!middle) sizes[3] = static_cast<int64_t>(s.valid_sets.size());
  PTK_RETURN_IF_ERROR(pipeline->Broadcast(sizes, sizeof sizes, 0));
  std::vector<int64_t> set_sizes(static_cast<size_t>(sizes[3]));
  for (size_t k = 0; k < set_sizes.size() && !middle; ++k) set_sizes[k] = s.valid_sets[k]->size();
  if (!set_sizes.empty())
    PTK_RETURN_IF_ERROR(
        pipeline->Broadcast(set_sizes.data(), static_cast<int64_t>(set_sizes.size() * sizeof(int64_t)), 0));
  if (!middle) return s;
  auto stand_in = [&](int64_t n) { return n < 0 ? nullptr : std::make_shared<StageStandInDataset>(n, cfg); };
  TrainingSplits stand_ins{stand_in(sizes[0]), stand_in(sizes[1]), stand_in(sizes[2]), {}, {}};
  for (int64_t n : set_sizes) stand_ins.valid_sets.push_back(stand_in(n));
  if (!stand_ins.valid_sets.empty()) stand_ins.valid = stand_ins.valid_sets[0];
  return stand_ins;
}

namespace {
absl::StatusOr<TrainingSplits> BuildSplits(const TrainOptions& o, const TrainPlan& plan, const GPTDatasetConfig& cfg) {
  // Megatron's get_train_valid_test_num_samples: the training split is built for --train-samples as
  // given (or train_iters x global batch), not for the samples the iterations consume.
  const int64_t gbs = plan.global_batch_size, train_samples = plan.train_split_samples;
  const int64_t eval_iters = o.eval_iters > 0 && o.eval_interval > 0 ? o.eval_iters : 0;
  const int64_t valid_samples = o.skip_train
                                    ? eval_iters * gbs
                                    : (plan.train_iters / std::max<int64_t>(1, o.eval_interval) + 1) * eval_iters * gbs;
  const int64_t test_samples = eval_iters * gbs;
  TrainingSplits s;
  if (o.mock_data) {
    // The mock documents' ids run over [0, vocab - 1); they end with GPT-2's end-of-document token
    // where the vocabulary has it, else with its last id (a --vocab-size below GPT-2's).
    if (o.model.vocab_size < 2)
      return absl::InvalidArgumentError(
          fmt::format("--mock-data: the mock documents need a vocabulary of at least 2 tokens (--vocab-size {})",
                      o.model.vocab_size));
    GPTDatasetConfig mock = cfg;
    if (mock.eod >= o.model.vocab_size) mock.eod = o.model.vocab_size - 1;
    s.train = std::make_shared<MockDataset>(std::max(train_samples, plan.train_samples), o.model.vocab_size, mock);
    if (valid_samples > 0) s.valid = std::make_shared<MockDataset>(valid_samples, o.model.vocab_size, mock);
    if (test_samples > 0) s.test = std::make_shared<MockDataset>(test_samples, o.model.vocab_size, mock);
    if (s.valid) s.valid_sets = {s.valid};
    return s;
  }
  DataArgs args = o.data;
  args.sizes = {train_samples, valid_samples, test_samples};
  if (o.full_validation) args.sizes[1] = std::nullopt;  // one epoch of each validation set
  args.multiple_validation_sets = o.multiple_validation_sets;
  std::vector<std::shared_ptr<TopLevelDataset>> valid_sets;
  PTK_ASSIGN_OR_RETURN(auto sets, BuildGPTDatasets(args, cfg, &s.warnings, &valid_sets));
  s.train = sets[0];
  if (eval_iters > 0 || o.full_validation) {
    s.valid = sets[1];
    s.valid_sets = std::move(valid_sets);
  }
  s.test = eval_iters > 0 ? sets[2] : nullptr;
  if (!s.train) return absl::InvalidArgumentError("the train split is empty: check --split and the data paths");
  if (s.train->size() < plan.train_samples) return TrainSplitRunsOut(o, plan, s.train->size());
  return s;
}

// The iteration this run stops at: --train-iters, or the first --exit-interval after `iteration` when
// that comes first (no evaluation at the end then).
int64_t LastIteration(const TrainOptions& o, const TrainPlan& plan, int64_t iteration, bool* final_evaluation) {
  *final_evaluation = true;
  const int64_t exit_at = o.exit_interval > 0 ? (iteration / o.exit_interval + 1) * o.exit_interval : 0;
  if (exit_at == 0 || exit_at > plan.train_iters) return plan.train_iters;
  *final_evaluation = false;
  return exit_at;
}

}  // namespace

absl::Status CheckSamplesLast(const TrainOptions& o, const TrainPlan& plan, const TrainState& state,
                              const TrainingSplits& splits) {
  if (o.skip_train) return absl::OkStatus();  // no iteration; each evaluation reads from the first sample
  bool final_evaluation = true;
  const int64_t it = state.iteration, last = LastIteration(o, plan, it, &final_evaluation);
  int64_t consumed = state.consumed_train_samples, runs_out = 0;
  for (int64_t k = it + 1; k <= last && splits.train; ++k) {
    consumed += plan.GlobalBatchSizeAt(consumed);
    if (runs_out == 0 && consumed > splits.train->size()) runs_out = k;
  }
  if (runs_out > 0)
    return UsageError(fmt::format(
        "--load {}: the checkpoint of iteration {} has consumed {} training samples, and this run's iterations to {} "
        "take {} more, but the training split holds {} (it is sized from this command line's --train-iters or "
        "--train-samples and --global-batch-size): it would run out at iteration {}, where Megatron's sampler "
        "stops too. Resume with the batch size the checkpoint was saved with",
        o.load, it, state.consumed_train_samples, last, consumed - state.consumed_train_samples, splits.train->size(),
        runs_out));
  // --full-validation reads each validation set from its first sample at every evaluation.
  if (!splits.valid || o.eval_iters <= 0 || o.eval_interval <= 0 || o.full_validation) return absl::OkStatus();
  // The evaluations every --eval-interval from here to `last` (none at or past it), and the final one.
  const int64_t evaluations =
      std::max<int64_t>(0, last / o.eval_interval - it / o.eval_interval) + (final_evaluation ? 1 : 0);
  const int64_t need = evaluations * o.eval_iters * plan.global_batch_size;
  if (state.consumed_valid_samples + need <= splits.valid->size()) return absl::OkStatus();
  const bool past = it >= last;  // resumed at or past its last iteration: only the evaluation at the end
  const std::string span = past ? "the one at the end: no iteration is left to train"
                                : fmt::format("--eval-interval {} up to iteration {}{}", o.eval_interval, last,
                                              final_evaluation ? " and the one at the end" : "");
  return UsageError(fmt::format(
      "--load {}: the checkpoint of iteration {} has consumed {} validation samples, and this run's {} evaluation(s) "
      "({}, --eval-iters {} of {} samples) need {} more, but the validation split holds {} (it is sized from this "
      "command line's --train-iters, --eval-interval and --eval-iters): Megatron's sampler stops there too. {}",
      o.load, it, state.consumed_valid_samples, evaluations, span, o.eval_iters, plan.global_batch_size, need,
      splits.valid->size(),
      past ? "Give the saved run's --train-iters or --train-samples, or --eval-iters 0"
           : "Give the saved run's --eval-interval (or a larger --eval-iters), or --eval-iters 0"));
}

TrainPhase PhaseAt(const TrainOptions& o, const TrainPlan& plan, int64_t iteration) {
  const int64_t gbs = plan.global_batch_size, current = iteration * gbs;
  int64_t last_sample = 0, next_sample = o.train_samples, last_iteration = 0, end = plan.train_iters;
  for (int64_t t : o.phase_transition_iterations) {
    if (t * gbs <= current) last_sample = std::max(last_sample, t * gbs);
    if (t * gbs > current) next_sample = std::min(next_sample, t * gbs);
    if (t <= iteration) last_iteration = std::max(last_iteration, t);
    if (t > iteration) end = std::min(end, t);
  }
  TrainPhase p;
  p.split_samples = std::max<int64_t>(0, next_sample - last_sample);
  p.consumed = (iteration - last_iteration) * gbs;
  p.end_iteration = end;
  return p;
}

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

absl::Status NoCheckpointToLoad(const TrainOptions& o, const absl::Status& why, bool lead) {
  PTK_RETURN_IF_ERROR(CheckLoadIsACheckpointDirectory(o.load));
  if (o.no_initialization)
    return UsageError(fmt::format(
        "--no-initialization: --load {}: no weights to start from (Megatron would train from uninitialised memory); "
        "drop --no-initialization, or give --load a checkpoint",
        StatusMessage(why)));
  if (o.exit_on_missing_checkpoint)
    return absl::NotFoundError(
        fmt::format("--load {}; --exit-on-missing-checkpoint: stopping instead of starting from random initialization",
                    StatusMessage(why)));
  if (lead && o.load != o.save)
    log::Warning("--load {}; starting from random initialization", StatusMessage(why));
  else if (lead)
    log::Info("{}; starting from random initialization", StatusMessage(why));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PretrainedCheckpointToLoad(const TrainOptions& o, const absl::Status& why, bool lead) {
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(o.pretrained_checkpoint);
  if (absl::IsNotFound(latest.status()))
    return absl::NotFoundError(fmt::format("no checkpoint in --load {} ({}) nor in --pretrained-checkpoint {}", o.load,
                                           StatusMessage(why), StatusMessage(latest.status())));
  PTK_RETURN_IF_ERROR(latest.status());
  if (lead)
    log::Info(
        "--load {} holds no checkpoint: fine-tuning from --pretrained-checkpoint {} (its iteration {}) as "
        "--finetune does; a restart resumes from --load once this run has saved there",
        o.load, o.pretrained_checkpoint, *latest);
  return latest;
}

ModelBatch View(const MicroBatch& mb, std::vector<int64_t>* keys) {
  *keys = mb.indices;
  return ModelBatch{mb.micro_batch_size,    mb.seq_length,       mb.tokens.data(), mb.labels.data(),
                    mb.position_ids.data(), mb.loss_mask.data(), keys->data()};
}

void KeepContextRows(MicroBatch* mb, const std::vector<int64_t>& positions) {
  const int64_t S = mb->seq_length, n = static_cast<int64_t>(positions.size());
  auto keep = [&](auto& v) {
    for (int64_t b = 0; b < mb->micro_batch_size; ++b)
      for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(b * n + i)] = v[static_cast<size_t>(b * S + positions[i])];
    v.resize(static_cast<size_t>(mb->micro_batch_size * n));
  };
  keep(mb->tokens);
  keep(mb->labels);
  keep(mb->position_ids);
  keep(mb->loss_mask);
  mb->seq_length = n;
}

absl::Status CheckRunCommunicators(const TrainOptions& o, const TrainPlan& plan, const Communicator& comm) {
  const int stages = o.pipeline_comm ? o.pipeline_comm->size() : 1;
  const int context = o.context_comm ? o.context_comm->size() : 1;
  if (plan.data_parallel_size * context != comm.size() ||
      (stages > 1 && static_cast<size_t>(stages) != o.pipeline_stage_layers.size()))
    return absl::InvalidArgumentError(
        fmt::format("a plan for {} data-parallel ranks and {} stage(s); communicators of {} (with {} context rank(s)) "
                    "and {}",
                    plan.data_parallel_size, o.pipeline_stage_layers.size(), comm.size(), context, stages));
  if (o.pipeline_virtual_size > 1 && stages < 2) return absl::InvalidArgumentError("model chunks without stages");
  const int m = static_cast<int>(plan.micro_batches), group = o.pipeline_microbatch_group_size;
  if (absl::Status st = CheckInterleavedMicroBatches(m, stages, group); o.pipeline_virtual_size > 1 && !st.ok())
    return UsageError(fmt::format("{} (--global-batch-size {}, --micro-batch-size {}, {} data-parallel rank(s))",
                                  StatusMessage(st), plan.global_batch_size, plan.micro_batch_size,
                                  plan.data_parallel_size));
  return absl::OkStatus();
}

}  // namespace ptk
