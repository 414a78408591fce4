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
  for (int64_t it = 0; it < o.eval_iters; ++it) {
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

std::string ValidationLine(const std::string& prefix, double loss) {
  return fmt::format(" validation loss at {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", prefix, loss,
                     std::exp(std::min(20.0, loss)));
}

}  // namespace ptk
