// ptk-train's evaluation (Megatron's evaluate) and the --exit-duration-in-mins check it shares.
#include "trainer/evaluation.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "trainer/training_data.h"

namespace ptk {

absl::StatusOr<TimeLimit> CheckExitDuration(Communicator* world, std::chrono::steady_clock::time_point started,
                                            double limit_minutes) {
  if (!(limit_minutes > 0)) return TimeLimit{};
  const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() / 60.0;
  double up = minutes > limit_minutes ? 1.0 : 0.0;
  PTK_RETURN_IF_ERROR(world->AllReduceSum(&up, 1));
  return TimeLimit{up > 0, minutes};
}

EvaluationExtent EvalItersExtent(int64_t eval_iters, const TrainPlan& plan) {
  return {eval_iters, eval_iters * plan.micro_batches, eval_iters * plan.global_batch_size};
}

EvaluationExtent FullValidationExtent(int64_t set_size, int64_t data_size, const TrainPlan& plan) {
  const int64_t micro_batches = set_size / (plan.micro_batch_size * data_size);
  return {(micro_batches + plan.micro_batches - 1) / plan.micro_batches, micro_batches,
          micro_batches * plan.micro_batch_size * data_size};
}

absl::StatusOr<std::optional<double>> Evaluate(const EvaluationPass& pass, const TrainOptions& o,
                                               const EvaluationExtent& extent, DataLoader* loader,
                                               const std::string& prefix, int64_t* consumed) {
  double sums[2] = {0, 0};
  if (pass.verbose) pass.verbose(fmt::format("Evaluating on {} samples", extent.samples));
  int64_t left = extent.micro_batches;
  const int64_t per_iteration = extent.iterations > 0 ? (left + extent.iterations - 1) / extent.iterations : 0;
  for (int64_t it = 0; it < extent.iterations; ++it) {
    if (pass.verbose) pass.verbose(fmt::format("Evaluating iter {}/{}", it + 1, extent.iterations));
    const int64_t now = std::min(left, per_iteration);
    for (int64_t m = 0; m < now; ++m) {
      PTK_ASSIGN_OR_RETURN(auto mb, loader->Next());
      if (!mb) return absl::OutOfRangeError(prefix + ": the evaluation data ran out");
      if (pass.context_positions) KeepContextRows(mb.get(), *pass.context_positions);
      std::vector<int64_t> k;
      PTK_ASSIGN_OR_RETURN(
          LossSum s, pass.pipeline ? ForwardPipelining(pass.model, pass.pipeline, View(*mb, &k), nullptr, pass.agreed)
                                   : pass.model->Forward(View(*mb, &k)));
      sums[0] += s.loss_sum;
      sums[1] += s.tokens;
    }
    left -= now;
    if (consumed) *consumed += extent.samples / extent.micro_batches * now;
    PTK_ASSIGN_OR_RETURN(const TimeLimit limit, CheckExitDuration(pass.world, pass.started, o.exit_duration_in_mins));
    if (limit.reached) return std::nullopt;
  }
  PTK_RETURN_IF_ERROR(pass.data->AllReduceSum(sums, 2));
  if (pass.pipeline) PTK_RETURN_IF_ERROR(pass.pipeline->AllReduceSum(sums, 2));  // the last stage's to every stage
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

namespace {
// Whether `list` (a --data-path or --valid-data-path) gives weights.
absl::StatusOr<bool> Weighted(const std::vector<std::string>& list) {
  if (list.empty()) return false;
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;
  PTK_RETURN_IF_ERROR(ParseBlend(list, &prefixes, &weights));
  return weights.has_value();
}
}  // namespace

absl::Status CheckEvaluationModes(const TrainOptions& o) {
  if (o.multiple_validation_sets && !o.full_validation && !o.skip_train)
    return UsageError(
        "--multiple-validation-sets currently requires --full-validation (as Megatron's; with --skip-train each set is "
        "evaluated for --eval-iters global batches)");
  if (o.full_validation && o.mock_data)
    return UsageError(
        "--full-validation reads one epoch of the validation split, and --mock-data's has none (its size comes from "
        "--eval-iters): give --data-path, or drop --full-validation");
  if (o.skip_train && !o.full_validation && o.eval_iters == 0)
    return UsageError(
        "--skip-train --eval-iters 0: nothing would be evaluated; give --eval-iters N or --full-validation");
  if (o.mock_data) return absl::OkStatus();
  PTK_ASSIGN_OR_RETURN(const bool weighted_valid, Weighted(o.data.per_split_data_path[1]));
  if (o.multiple_validation_sets && weighted_valid)
    return UsageError(
        "--multiple-validation-sets: give --valid-data-path its prefixes without weights (each prefix is a set of its "
        "own, evaluated apart)");
  PTK_ASSIGN_OR_RETURN(const bool weighted_data, Weighted(o.data.data_path));
  if (o.full_validation && (weighted_valid || weighted_data))
    return UsageError(fmt::format(
        "--full-validation reads one epoch of the validation split, which a weighted blend cannot size (Megatron's "
        "builder needs a sample count there): give {} its prefixes without weights",
        weighted_data ? "--data-path" : "--valid-data-path"));
  if (!o.skip_train) return absl::OkStatus();
  PTK_ASSIGN_OR_RETURN(const std::string no_valid, NoValidationSplit(o.data));
  if (!no_valid.empty())
    return UsageError(fmt::format(
        "--skip-train: the run has no validation data ({}), so nothing would be evaluated; {}", no_valid,
        o.data.data_path.empty() ? "give --valid-data-path" : "give --split a validation part (e.g. 98,2,0)"));
  return absl::OkStatus();
}

std::string ValidationSetName(bool multiple_validation_sets, size_t index) {
  return multiple_validation_sets ? fmt::format("validation-{}", index) : "validation";
}

absl::Status LogEvaluateTime(Communicator* world, double seconds, TimingLogOption option,
                             const std::function<void(const std::string&)>& print) {
  std::vector<double> all(static_cast<size_t>(world->size()), 0.0);
  all[static_cast<size_t>(world->rank())] = seconds;
  PTK_RETURN_IF_ERROR(world->AllReduceSum(all.data(), static_cast<int64_t>(all.size())));
  if (world->rank() != world->size() - 1) return absl::OkStatus();
  std::vector<std::vector<double>> times;
  for (double t : all) times.push_back({t});
  if (const std::optional<std::string> text = FormatTimers({"evaluate"}, times, option, 1.0))
    print(kTimersLogPrefix + *text);
  return absl::OkStatus();
}

std::string ValidationLine(const std::string& prefix, double loss, const std::string& set) {
  return fmt::format(" {} loss at {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", set, prefix, loss,
                     std::exp(std::min(20.0, loss)));
}

}  // namespace ptk
