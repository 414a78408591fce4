// What the training run reports (Trainer, training_run.h): rank 0's and the last rank's lines, Megatron's
// training_log (--metrics-file, TensorBoard's scalars, the log line and timers), the evaluations and
// --sample-interval's samples.
#include "trainer/training_run.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tensorboard/summary_writer.h"
#include "trainer/counter_rng.h"
#include "trainer/evaluation.h"
#include "trainer/sampling.h"
#include "trainer/timers.h"
#include "trainer/training_log.h"

namespace ptk {
namespace training_detail {

void Trainer::Print(const std::string& line) const {
  if (lead_) PrintAnyRank(line);
}

void Trainer::PrintLast(const std::string& line) const {
  if (last_) PrintAnyRank(line);
}

void Trainer::PrintAnyRank(const std::string& line) const {
  if (o_.print) {
    o_.print(line);
  } else {
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  }
}

bool Trainer::LogsThisIteration(int64_t it) const {
  return interval_.Due(it) || (!o_.tensorboard.dir.empty() && it % o_.tensorboard.log_interval == 0);
}

void Trainer::TensorBoardScalar(const std::string& tag, double value) {
  outputs_.tb->AddScalar(tag, value, state_.iteration);
  outputs_.tb->AddScalar(tag + " vs samples", value, state_.consumed_train_samples);
}

namespace {
// Multi-token prediction's entries of a --metrics-file line: , "mtp_K_loss": X per depth.
std::string MtpMetricsFields(const StepResult& r) {
  std::string s;
  for (size_t k = 0; k < r.mtp_losses.size(); ++k)
    s += fmt::format(", \"mtp_{}_loss\": {}", k + 1, JsonNumber(r.mtp_losses[k]));
  return s;
}
}  // namespace

absl::Status Trainer::Log(const StepResult& r) {
  const double lr_now = step_->scheduler().lr();  // Megatron logs the rate after the scheduler step
  std::optional<double> params_norm;
  if (o_.log_params_norm && LogsThisIteration(state_.iteration)) {
    PTK_ASSIGN_OR_RETURN(params_norm, step_->ParamsNorm());
  }
  if (outputs_.metrics.is_open())
    PTK_RETURN_IF_ERROR(outputs_.metrics.Append(fmt::format(
        "{{\"iteration\": {}, \"consumed_samples\": {}, \"lm_loss\": {}, \"grad_norm\": {}, \"learning_rate\": "
        "{}, \"skipped\": {}, \"tokens\": {:.0f}{}}}\n",
        state_.iteration, state_.consumed_train_samples, JsonNumber(r.lm_loss()), JsonNumber(r.grad_norm),
        JsonNumber(lr_now), r.skipped ? "true" : "false", r.tokens, MtpMetricsFields(r))));
  if (outputs_.tb && state_.iteration % o_.tensorboard.log_interval == 0) {
    TensorBoardScalar("learning-rate", lr_now);
    // Megatron's, by iteration only, once --iterations-to-skip has skipped one.
    if (state_.skipped_train_samples > 0)
      outputs_.tb->AddScalar("skipped-train-samples", static_cast<double>(state_.skipped_train_samples),
                             state_.iteration);
    TensorBoardScalar("batch-size", static_cast<double>(current_gbs_));
    TensorBoardScalar("lm loss", r.lm_loss());
    if (o_.tensorboard.log_loss_scale) TensorBoardScalar("loss-scale", r.next_loss_scale);
    if (o_.tensorboard.log_world_size) TensorBoardScalar("world-size", world_->size());  // args.world_size
    if (!r.skipped) TensorBoardScalar("grad-norm", r.grad_norm);  // Megatron has none for a skipped step
    if (r.num_zeros_in_grad) TensorBoardScalar("num-zeros", *r.num_zeros_in_grad);
    if (params_norm) TensorBoardScalar("params-norm", *params_norm);
  }
  // Megatron's track_moe_metrics writes them at every iteration (not every --tensorboard-log-interval), in its
  // tracker's order (the router saves its z-loss first).
  if (outputs_.tb && o_.model.moe() && o_.model.moe_z_loss_coeff > 0) TensorBoardScalar("z_loss", r.z_loss);
  if (outputs_.tb && o_.model.moe() && o_.model.moe_aux_loss_coeff > 0)
    TensorBoardScalar("load_balancing_loss", r.load_balancing_loss);
  if (outputs_.tb && o_.model.moe() && o_.model.moe_seq_aux_loss_coeff > 0)
    TensorBoardScalar("seq_load_balancing_loss", r.seq_load_balancing_loss);
  if (outputs_.tb && o_.model.moe() && o_.model.moe_global_aux_loss_coeff > 0)
    TensorBoardScalar("global_load_balancing_loss", r.global_load_balancing_loss);
  for (size_t k = 0; outputs_.tb && k < r.mtp_losses.size(); ++k)  // track_mtp_metrics: every iteration too
    TensorBoardScalar(fmt::format("mtp_{} loss", k + 1), r.mtp_losses[k]);
  if (!interval_.Due(state_.iteration)) return absl::OkStatus();
  LogLineFields f;
  f.iteration = state_.iteration;
  f.train_iters = plan_.train_iters;
  f.consumed_samples = state_.consumed_train_samples;
  f.skipped_samples = state_.skipped_train_samples;
  f.global_batch_size = current_gbs_;
  interval_.Fill(r, FlopsPerIteration(o_.model, current_gbs_), world_->size(), o_.tensorboard.log_throughput, &f);
  f.params_norm = params_norm;
  f.learning_rate = lr_now;
  PrintLast(FormatLogLine(f, Timestamp()));
  PTK_RETURN_IF_ERROR(LogTimers(
      timers_.get(), world_, state_.iteration, static_cast<double>(o_.log_interval),
      o_.tensorboard.log_timers ? outputs_.tb.get() : nullptr, [this](const std::string& text) { PrintAnyRank(text); },
      interval_.Resets(state_.iteration)));
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

absl::StatusOr<std::optional<double>> Trainer::Evaluate(DataLoader* loader, const EvaluationExtent& extent,
                                                        int64_t* consumed, const EvaluationRun& run) {
  const IntervalPause paused(&interval_);  // no iteration's time, as in Megatron's train()
  const std::vector<int64_t>* positions = context_ ? &context_positions_ : nullptr;
  EvaluationPass pass{model_.get(), comm_, world_, pipe_, &agreed_, positions, started_, nullptr};
  if (run.verbose) pass.verbose = [this](const std::string& text) { Print(text); };
  const auto t0 = Clock::now();
  PTK_ASSIGN_OR_RETURN(const std::optional<double> loss, ptk::Evaluate(pass, o_, extent, loader, run.prefix, consumed));
  if (!loss) {
    Print("Exiting during evaluation, timelimit reached");
    return loss;
  }
  PTK_RETURN_IF_ERROR(
      LogEvaluateTime(world_, Seconds(t0), timers_->option(), [this](const std::string& text) { PrintAnyRank(text); }));
  const std::string line = ValidationLine(run.prefix, *loss, run.set), bar(line.size() + 1, '-');
  PrintLast(bar);
  PrintLast(line);
  PrintLast(bar);
  if (outputs_.tb) {
    TensorBoardScalar(run.tb_tag, *loss);
    if (o_.tensorboard.log_validation_ppl) TensorBoardScalar(run.tb_tag + " ppl", std::exp(std::min(20.0, *loss)));
    PTK_RETURN_IF_ERROR(outputs_.tb->Flush());
  }
  // The line's loss and PPL, keyed by TensorBoard's tag as the iterations' "lm_loss" is ("lm loss validation":
  // "lm_loss_validation", "lm_loss_validation_ppl"), at the iteration and samples of its scalars.
  if (outputs_.metrics.is_open()) {
    std::string key = run.tb_tag;
    std::replace(key.begin(), key.end(), ' ', '_');
    PTK_RETURN_IF_ERROR(outputs_.metrics.Append(fmt::format(
        "{{\"iteration\": {}, \"consumed_samples\": {}, \"{}\": {}, \"{}_ppl\": {}}}\n", state_.iteration,
        state_.consumed_train_samples, key, JsonNumber(*loss), key, JsonNumber(std::exp(std::min(20.0, *loss))))));
  }
  return loss;
}

absl::StatusOr<bool> Trainer::EvaluateValidation(const std::string& prefix, int64_t* consumed, bool verbose) {
  const int64_t mbs = plan_.micro_batch_size;
  for (size_t k = 0; k < data_.valid_sets.size(); ++k) {
    const std::string set = ValidationSetName(o_.multiple_validation_sets, k);
    const EvaluationRun run{prefix, set, "lm loss " + set, verbose};
    std::optional<double> loss;
    if (valid_loader_) {
      PTK_ASSIGN_OR_RETURN(loss, Evaluate(valid_loader_.get(), EvalItersExtent(o_.eval_iters, plan_), consumed, run));
    } else {
      const std::shared_ptr<TopLevelDataset>& ds = data_.valid_sets[k];
      const EvaluationExtent extent = o_.full_validation ? FullValidationExtent(ds->size(), data_size_, plan_)
                                                         : EvalItersExtent(o_.eval_iters, plan_);
      if (extent.micro_batches == 0)
        return absl::FailedPreconditionError(fmt::format(
            "--full-validation: {} set holds {} sample(s), fewer than one micro-batch of {} on each of the {} "
            "data-parallel rank(s): nothing to evaluate",
            set, ds->size(), mbs, data_size_));
      DataLoader loader(ds, PretrainingSampler(ds->size(), 0, mbs, data_rank_, data_size_), mbs);
      PTK_ASSIGN_OR_RETURN(loss, Evaluate(&loader, extent, consumed, run));
    }
    if (!loss) return false;
    if (k == 0) summary_.last_validation_loss = loss;
  }
  return true;
}

absl::Status Trainer::Sample() {
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

}  // namespace training_detail

}  // namespace ptk
