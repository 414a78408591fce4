// PlanTraining: how ptk-train's settings go together, checked and resolved once.
#include "trainer/train_options.h"

#include <algorithm>
#include <limits>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/status.h"
#include "trainer/evaluation.h"

namespace ptk {
namespace {

// Megatron's get_optimizer_param_scheduler: the schedule's lengths in samples (a warm-up fraction's
// product unrounded, a float as Megatron's lr_warmup_steps).
SchedulerConfig ResolveSchedule(const TrainOptions& o, const TrainPlan& p) {
  const ScheduleOptions& s = o.schedule_options;
  SchedulerConfig sc = o.schedule;
  const int64_t gbs = p.global_batch_size;
  if (o.train_iters > 0) {
    const int64_t decay_iters = s.lr_decay_iters > 0 ? s.lr_decay_iters : p.train_iters;
    sc.decay_steps = decay_iters * gbs;
    sc.wsd_decay_steps = s.lr_wsd_decay_iters * gbs;
    sc.warmup_steps = s.lr_warmup_fraction ? *s.lr_warmup_fraction * static_cast<double>(sc.decay_steps)
                                           : static_cast<double>(s.lr_warmup_iters * gbs);
  } else {
    sc.decay_steps = s.lr_decay_samples > 0 ? s.lr_decay_samples : o.train_samples;
    sc.wsd_decay_steps = s.lr_wsd_decay_samples;
    sc.warmup_steps = s.lr_warmup_fraction ? *s.lr_warmup_fraction * static_cast<double>(sc.decay_steps)
                                           : static_cast<double>(s.lr_warmup_samples);
  }
  sc.start_wd = s.start_weight_decay.value_or(s.weight_decay);
  sc.end_wd = s.end_weight_decay.value_or(s.weight_decay);
  // Megatron: train_iters x global batch, or --train-samples as given (with or without a ramp).
  sc.wd_incr_steps = p.train_split_samples;
  return sc;
}

// --rampup-batch-size START INCR SAMPLES: Megatron's checks (arguments.py and
// RampupBatchsizeNumMicroBatchesCalculator) and its update_train_iters: the iterations of the
// ramp, then the whole global batches of what --train-samples leaves.
absl::Status PlanRampup(const TrainOptions& o, TrainPlan* p) {
  const std::vector<int64_t>& r = o.rampup_batch_size;
  if (r.size() != 3)  // Megatron: "expected the following format: --rampup-batch-size <start> <incr> <samples>"
    return UsageError(
        fmt::format("--rampup-batch-size {}: give three numbers, START INCR SAMPLES (the start batch "
                    "size, its increment and the ramp's samples), as Megatron takes them",
                    fmt::join(r, " ")));
  const std::string given = fmt::format("--rampup-batch-size {} {} {}", r[0], r[1], r[2]);
  // Megatron asserts each positive, and divides by the samples per increment (0 samples: a division by zero).
  if (*std::min_element(r.begin(), r.end()) < 1)
    return UsageError(given + ": the start batch size, the increment and the ramp's samples must be at least 1");
  if (o.train_iters > 0)
    return UsageError(given +
                      ": a batch-size ramp needs sample-based training (--train-samples instead of "
                      "--train-iters), as in Megatron");
  const int64_t gbs = p->global_batch_size, unit = p->micro_batch_size * p->data_parallel_size;
  if (r[0] > gbs)
    return UsageError(fmt::format("{}: the start batch size is larger than --global-batch-size {}", given, gbs));
  if (r[0] == gbs) return UsageError(fmt::format("{}: the start batch size is --global-batch-size already", given));
  if ((gbs - r[0]) % r[1] != 0)
    return UsageError(
        fmt::format("{}: --global-batch-size {} minus the start batch size ({}) is not a multiple of "
                    "the increment",
                    given, gbs, gbs - r[0]));
  for (int64_t b = r[0]; b <= gbs; b += r[1])
    if (b % unit != 0)
      return UsageError(
          fmt::format("{}: the ramp's batch size {} is not a multiple of --micro-batch-size ({}) x "
                      "data-parallel size ({})",
                      given, b, p->micro_batch_size, p->data_parallel_size));
  p->rampup_start = r[0];
  p->rampup_increment = r[1];
  p->rampup_samples = r[2];
  int64_t iterations = 0, consumed = 0;
  while (consumed <= p->rampup_samples && consumed <= o.train_samples) {
    consumed += p->GlobalBatchSizeAt(consumed);
    ++iterations;
  }
  int64_t constant = 0;
  if (o.train_samples > consumed) constant = (o.train_samples - consumed) / gbs;
  p->train_iters = iterations + constant;
  p->train_samples = consumed + constant * gbs;
  return absl::OkStatus();
}

// Megatron's validate_args: the schedule's lengths in the unit of the run, one warm-up, and the weight
// decay's ends only with an increment.
absl::Status CheckScheduleUnits(const TrainOptions& o) {
  const ScheduleOptions& so = o.schedule_options;
  struct Lengths {  // the decay, the warm-up and WSD's anneal in one unit
    int64_t decay, warmup, wsd;
  };
  const Lengths in_iters{so.lr_decay_iters, so.lr_warmup_iters, so.lr_wsd_decay_iters},
      in_samples{so.lr_decay_samples, so.lr_warmup_samples, so.lr_wsd_decay_samples};
  const bool iters = o.train_iters > 0;
  const Lengths& own = iters ? in_iters : in_samples;
  const Lengths& other = iters ? in_samples : in_iters;
  const char* own_unit = iters ? "iters" : "samples";
  const char* other_unit = iters ? "samples" : "iters";
  const char* run = iters ? "--train-iters" : "--train-samples";
  const char* words = iters ? "iterations" : "samples";
  if (other.decay > 0)
    return UsageError(fmt::format("--lr-decay-{} {}: with {} the decay is in {} (--lr-decay-{}), as Megatron requires",
                                  other_unit, other.decay, run, words, own_unit));
  if (other.warmup > 0)
    return UsageError(
        fmt::format("--lr-warmup-{} {}: with {} the warm-up is in {} (--lr-warmup-{}), as Megatron requires",
                    other_unit, other.warmup, run, words, own_unit));
  if (so.lr_warmup_fraction && own.warmup > 0)
    return UsageError(
        fmt::format("--lr-warmup-fraction {} and --lr-warmup-{} {}: give one of them, as Megatron requires",
                    *so.lr_warmup_fraction, own_unit, own.warmup));
  // Megatron's: the two ends only with an increment, and then both (a constant weight decay is --weight-decay).
  const std::optional<double>& start = so.start_weight_decay;
  const std::optional<double>& end = so.end_weight_decay;
  if (o.schedule.wd_incr_style == "constant" && (start || end))
    return UsageError(
        fmt::format("{} {} with --weight-decay-incr-style constant: a constant weight decay is "
                    "--weight-decay; the ends are for linear or cosine, as Megatron requires",
                    start ? "--start-weight-decay" : "--end-weight-decay", start ? *start : *end));
  if (o.schedule.wd_incr_style != "constant" && (!start || !end))
    return UsageError(
        fmt::format("--weight-decay-incr-style {} needs both --start-weight-decay and "
                    "--end-weight-decay, as Megatron requires",
                    o.schedule.wd_incr_style));
  if (o.schedule.decay_style == "WSD" && own.wsd == 0 && other.wsd > 0)
    return UsageError(fmt::format("--lr-wsd-decay-{} {}: with {} the WSD anneal is in {} (--lr-wsd-decay-{})",
                                  other_unit, other.wsd, run, words, own_unit));
  return absl::OkStatus();
}

}  // namespace

int64_t TrainPlan::GlobalBatchSizeAt(int64_t consumed) const {
  if (rampup_start == 0 || consumed > rampup_samples) return global_batch_size;
  const double per_increment =
      static_cast<double>(rampup_samples) / static_cast<double>((global_batch_size - rampup_start) / rampup_increment);
  const int64_t steps = static_cast<int64_t>(static_cast<double>(consumed) / per_increment);
  return std::min(global_batch_size, rampup_start + steps * rampup_increment);
}

absl::StatusOr<TrainPlan> PlanTraining(const TrainOptions& o, int dp) {
  auto usage = [](const std::string& m) { return UsageError(m); };
  if (absl::Status st = o.model.Validate(); !st.ok()) return usage(std::string(StatusMessage(st)));
  if (o.data.data_path.empty() && o.data.per_split_data_path[0].empty() && !o.mock_data)
    return usage("give --data-path (or --train-data-path), or --mock-data");
  PTK_RETURN_IF_ERROR(o.loss_scale.Validate());
  PTK_RETURN_IF_ERROR(CheckEvaluationModes(o));
  if (o.distributed_backend == "nccl" && o.backend.device != Device::kCuda)
    return usage("--distributed-backend nccl needs --device cuda (NCCL moves GPU memory); CPU ranks use gloo");

  // The batch, as Megatron's argument validation.
  TrainPlan p;
  p.data_parallel_size = dp;
  p.micro_batch_size = o.micro_batch_size;
  const int64_t mbs = o.micro_batch_size;
  p.global_batch_size = o.global_batch_size > 0 ? o.global_batch_size : mbs * dp;
  const int64_t gbs = p.global_batch_size;
  p.decrease_batch_size = o.decrease_batch_size_if_needed;
  if (gbs % (mbs * dp) != 0 && !p.decrease_batch_size)
    return usage(
        fmt::format("--global-batch-size ({}) must be a multiple of --micro-batch-size ({}) x data-parallel "
                    "size ({}) (or give --decrease-batch-size-if-needed)",
                    gbs, mbs, dp));
  p.micro_batches = gbs / (mbs * dp);
  if (p.micro_batches < 1)
    return usage(fmt::format(
        "--decrease-batch-size-if-needed: --global-batch-size ({}) is smaller than --micro-batch-size ({}) x "
        "data-parallel size ({}): no micro-batch is left",
        gbs, mbs, dp));
  if (p.decrease_batch_size && !o.rampup_batch_size.empty())
    return usage("--decrease-batch-size-if-needed with --rampup-batch-size is not implemented");
  if (!o.phase_transition_iterations.empty() && (o.train_samples <= 0 || !o.rampup_batch_size.empty()))
    return usage(
        "--phase-transition-iterations: multi-phase training needs --train-samples (Megatron's phases end at it; with "
        "--train-iters its code fails) and no --rampup-batch-size (Megatron asserts so)");
  if ((o.train_iters > 0) == (o.train_samples > 0))
    return usage("give exactly one of --train-iters and --train-samples");
  PTK_RETURN_IF_ERROR(CheckScheduleUnits(o));
  if (!o.rampup_batch_size.empty()) {
    PTK_RETURN_IF_ERROR(PlanRampup(o, &p));
  } else {
    p.train_iters = o.train_iters > 0 ? o.train_iters : o.train_samples / gbs;
    if (p.train_iters < 1) return usage("--train-samples is smaller than one global batch");
    if (p.train_iters > std::numeric_limits<int64_t>::max() / 2 / gbs)
      return usage(
          fmt::format("--train-iters {} x global batch {} samples is more than ptk can count", p.train_iters, gbs));
    p.train_samples = p.train_iters * gbs;
  }
  p.train_split_samples = o.train_iters > 0 ? p.train_samples : o.train_samples;
  if (o.sample.interval > 0) {
    if (o.sample.prompt.empty() || !o.sample.decode)
      return usage("--sample-interval needs a prompt encoded by the GPT-2 tokenizer");
    if (static_cast<int64_t>(o.sample.prompt.size()) >= o.model.seq_length)
      return usage(fmt::format("--sample-prompt is {} tokens: it must be shorter than --seq-length {}",
                               o.sample.prompt.size(), o.model.seq_length));
    // A sample runs the model's Forward over the whole context for every new token (no KV cache),
    // on rank 0 alone: count the positions it forwards (sampling.cpp's lengths) against the
    // forward and backward (about 3 forwards) rank 0 trains between two samples.
    const int64_t seq = o.model.seq_length;
    double sample_positions = 0;
    for (int64_t k = 0, len = static_cast<int64_t>(o.sample.prompt.size()); k < o.sample.length; ++k, ++len) {
      const int64_t ctx = std::min(len, seq);
      sample_positions += static_cast<double>(std::min(seq, (ctx + 63) / 64 * 64));
    }
    const double train_positions = 3.0 * static_cast<double>(o.sample.interval) *
                                   static_cast<double>(p.micro_batches * p.micro_batch_size) * static_cast<double>(seq);
    if (sample_positions > train_positions)
      p.warnings.push_back(fmt::format(
          "--sample-length {}: each sample runs the model {} times over up to {} positions (no KV cache), {:.1f}x the "
          "work of the {} iteration(s) between samples (--sample-interval): sampling will take most of the run's "
          "time; a shorter --sample-length or a longer --sample-interval costs less",
          o.sample.length, o.sample.length, seq, sample_positions / train_positions, o.sample.interval));
  }

  p.schedule = ResolveSchedule(o, p);
  if (absl::Status st = p.schedule.Validate(); !st.ok()) return usage(std::string(StatusMessage(st)));
  return p;
}

}  // namespace ptk
