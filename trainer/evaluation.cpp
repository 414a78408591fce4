// ptk-train's evaluation (Megatron's evaluate) and the --exit-duration-in-mins check it shares.
#include "trainer/evaluation.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"
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

absl::StatusOr<std::optional<double>> Evaluate(const EvaluationPass& pass, const TrainOptions& o, const TrainPlan& plan,
                                               DataLoader* loader, const std::string& prefix, int64_t* consumed) {
  double sums[2] = {0, 0};
  if (pass.verbose) pass.verbose(fmt::format("Evaluating on {} samples", o.eval_iters * plan.global_batch_size));
  for (int64_t it = 0; it < o.eval_iters; ++it) {
    if (pass.verbose) pass.verbose(fmt::format("Evaluating iter {}/{}", it + 1, o.eval_iters));
    for (int64_t m = 0; m < plan.micro_batches; ++m) {
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
    if (consumed) *consumed += plan.global_batch_size;
    PTK_ASSIGN_OR_RETURN(const TimeLimit limit, CheckExitDuration(pass.world, pass.started, o.exit_duration_in_mins));
    if (limit.reached) return std::nullopt;
  }
  PTK_RETURN_IF_ERROR(pass.data->AllReduceSum(sums, 2));
  if (pass.pipeline) PTK_RETURN_IF_ERROR(pass.pipeline->AllReduceSum(sums, 2));  // the last stage's to every stage
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
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

std::string ValidationLine(const std::string& prefix, double loss) {
  return fmt::format(" validation loss at {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", prefix, loss,
                     std::exp(std::min(20.0, loss)));
}

}  // namespace ptk
