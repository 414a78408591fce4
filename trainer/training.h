// ptk-train's loop, as Megatron's pretrain_gpt.py runs it: datasets and Megatron's sample order,
// micro-batches and gradient accumulation, data-parallel all-reduce, the log line every
// --log-interval iterations, evaluation, checkpoints, exit on signal / interval / duration.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/train_options.h"
#include "trainer/train_step.h"

namespace ptk {

struct TrainSummary {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  double last_lm_loss = 0;
  std::optional<double> last_validation_loss, test_loss;  // the validation loss: the first set's
  int64_t skipped_iterations = 0;
  // --iterations-to-skip's and --decrease-batch-size-if-needed's, with the resumed runs'.
  int64_t skipped_train_samples = 0;
  std::string exit_reason;        // "" when train_iters was reached
  bool nothing_to_train = false;  // --load was at --train-iters already: no iteration ran (the evaluations did)
  bool resumed = false;
  bool skipped_training = false;  // --skip-train: only the evaluations ran
};

// Runs `plan` (PlanTraining's, for options.comm's number of ranks).
absl::StatusOr<TrainSummary> RunTraining(const TrainOptions& options, const TrainPlan& plan);

// Megatron's num_floating_point_operations for one iteration of this model (dense GPT, GELU MLP,
// causal attention counted as half of the full score matrix).
double FlopsPerIteration(const GPTConfig& c, int64_t global_batch_size);

// Megatron's --check-for-nan-in-loss-and-grad on one step's (all-reduced) result: an error naming
// the iteration, the rank and whether the loss or the gradient norm went NaN/Inf; OK otherwise.
absl::Status CheckForNanInLossAndGrad(const StepResult& r, int64_t iteration, int rank);

// The log line Megatron's training_log prints.
struct LogLineFields {
  int64_t iteration = 0, train_iters = 0, consumed_samples = 0, global_batch_size = 0;
  int64_t skipped_samples = 0;  // skipped so far (TrainState's): the field shows only above 0, as Megatron's
  double elapsed_ms = 0, learning_rate = 0, lm_loss = 0, loss_scale = 1.0;
  double load_balancing_loss = 0;  // mixture of experts: Megatron's entry after lm loss, shown when above 0
  double z_loss = 0;               // the router z-loss: Megatron's entry before load_balancing_loss, when above 0
  // seq_aux_loss's and global_aux_loss's: Megatron's entries after load_balancing_loss (its tracker's order), when
  // above 0
  double seq_load_balancing_loss = 0, global_load_balancing_loss = 0;
  std::vector<double> mtp_losses;  // multi-token prediction: Megatron's "mtp_K loss" entries after the MoE ones
  int64_t skipped = 0, nan = 0;
  std::optional<double> tflops_per_gpu;  // --log-throughput
  std::optional<double> grad_norm;       // none for an iteration the loss scaler skipped (Megatron's None)
  std::optional<double> num_zeros_in_grad, params_norm;  // --log-num-zeros-in-grad, --log-params-norm
};
std::string FormatLogLine(const LogLineFields& f, const std::string& timestamp);

}  // namespace ptk
