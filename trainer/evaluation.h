// ptk-train's evaluation (Megatron's evaluate and its line in evaluate_and_print_results) and the
// check of --exit-duration-in-mins that it shares with checkpoint_and_decide_exit.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/data_loader.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/timers.h"
#include "trainer/train_options.h"

namespace ptk {

// --exit-duration-in-mins (`limit_minutes`; 0: none) against the time since `started` (the
// process's start, Megatron's _TRAIN_START_TIME): reached when it is up on any rank of `world`
// (Megatron's MAX all-reduce: every rank decides alike); `minutes` is this rank's own (Megatron's
// train_time, which its rank 0 prints in the exit line). A collective
// of `world` when there is a limit, nothing without one.
struct TimeLimit {
  bool reached = false;
  double minutes = 0;
};
absl::StatusOr<TimeLimit> CheckExitDuration(Communicator* world, std::chrono::steady_clock::time_point started,
                                            double limit_minutes);

// What an evaluation runs on: the model, this rank's groups (`data`: the data-parallel ranks the
// losses are summed over; `world`: every rank, which agree on the time limit; `pipeline`: null with
// one stage), the exchange formats of the forward-only passes, the context rank's positions of each
// sample (null without context parallelism), and the process's start (--exit-duration-in-mins's).
struct EvaluationPass {
  GPTModel* model = nullptr;
  Communicator *data = nullptr, *world = nullptr, *pipeline = nullptr;
  StageExchangeAgreement* agreed = nullptr;
  const std::vector<int64_t>* context_positions = nullptr;
  std::chrono::steady_clock::time_point started;
  // Megatron's verbose evaluation (pretrain's after training): "Evaluating on N samples" and
  // "Evaluating iter i/n" given to it (rank 0's); none when empty.
  std::function<void(const std::string&)> verbose;
};

// How much one evaluation reads: `micro_batches` of this rank's micro-batches in `iterations` global
// batches (the last one may hold fewer: --full-validation's epoch need not fill it), `samples` in all (its
// verbose line's count).
struct EvaluationExtent {
  int64_t iterations = 0, micro_batches = 0, samples = 0;
};
// --eval-iters global batches of the plan (Megatron's evaluate's).
EvaluationExtent EvalItersExtent(int64_t eval_iters, const TrainPlan& plan);
// --full-validation: every sample Megatron's pretraining sampler gives from the first of a validation set
// of `set_size` samples (its last incomplete batch of `data_size` ranks' micro-batches dropped), each once.
EvaluationExtent FullValidationExtent(int64_t set_size, int64_t data_size, const TrainPlan& plan);

// Megatron's evaluate: forward-only passes over `extent` of `loader`, each global batch adding its samples
// to *consumed (when given); after each one, as Megatron's, --exit-duration-in-mins (CheckExitDuration) may
// stop it: nullopt then, as Megatron's returns no loss. Else the mean loss per token over every rank's
// batches (data-parallel ranks, then stages). `prefix` names the evaluation in an error (data that runs out).
absl::StatusOr<std::optional<double>> Evaluate(const EvaluationPass& pass, const TrainOptions& o,
                                               const EvaluationExtent& extent, DataLoader* loader,
                                               const std::string& prefix, int64_t* consumed);

// Megatron's name of validation set `index` in its lines and TensorBoard tags: "validation", and with
// --multiple-validation-sets "validation-<index>".
std::string ValidationSetName(bool multiple_validation_sets, size_t index);

// Megatron's timers.log(['evaluate']) after an evaluation (its 'evaluate' timer is of level 0: every
// run prints it): every rank's `seconds` gathered over `world`, the block (kTimersLogPrefix, the
// slowest and fastest rank as --timing-log-option shows them) given to `print` on the last rank.
absl::Status LogEvaluateTime(Communicator* world, double seconds, TimingLogOption option,
                             const std::function<void(const std::string&)>& print);

// The checks of --skip-train, --full-validation and --multiple-validation-sets against the other flags
// (Megatron's, and where Megatron would evaluate nothing or fail later, one usage error naming the flags).
absl::Status CheckEvaluationModes(const TrainOptions& o);

// Megatron's line of an evaluation's loss (printed between two rules of dashes one longer); `set` is
// ValidationSetName's.
std::string ValidationLine(const std::string& prefix, double loss, const std::string& set = "validation");

}  // namespace ptk
