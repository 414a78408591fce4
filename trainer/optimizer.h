// One training step as Megatron's train_step does it: forward/backward over the micro-batches of
// this rank, gradient all-reduce across data-parallel ranks, NaN/Inf check, global-norm clipping,
// AdamW (no weight decay on biases and LayerNorm parameters), then the scheduler.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/lr_schedule.h"

namespace ptk::trainer {

struct OptimizerConfig {
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  double clip_grad = 1.0;  // 0 disables clipping
};

struct StepResult {
  double loss_sum = 0, tokens = 0;  // over all micro-batches and ranks
  double grad_norm = 0;             // before clipping
  bool skipped = false;             // NaN/Inf in the loss or the gradients: no update
  double lr = 0;                    // the learning rate used by this step
  double lm_loss() const { return tokens > 0 ? loss_sum / tokens : 0.0; }
};

class Optimizer {
 public:
  Optimizer(GPTModel* model, const OptimizerConfig& config, const SchedulerConfig& schedule, Communicator* comm);

  // micro_batches: this rank's micro-batches of one global batch; global_batch_size advances the
  // scheduler after a successful update.
  absl::StatusOr<StepResult> Step(const std::vector<ModelBatch>& micro_batches, int64_t global_batch_size,
                                  uint64_t seed);
  // The two halves of Step. ComputeGradients leaves the all-reduced, unclipped gradients in the
  // model and fills loss, tokens, grad_norm and skipped; ApplyUpdate clips, updates and steps the
  // scheduler unless the result is marked skipped.
  absl::StatusOr<StepResult> ComputeGradients(const std::vector<ModelBatch>& micro_batches, uint64_t seed);
  absl::Status ApplyUpdate(const StepResult& r, int64_t global_batch_size);

  OptimizerParamScheduler& scheduler() { return scheduler_; }
  const OptimizerParamScheduler& scheduler() const { return scheduler_; }
  // AdamW's step count (the moments live in the model's backend).
  int64_t adam_step() const { return adam_step_; }
  void set_adam_step(int64_t s) { adam_step_ = s; }

 private:
  GPTModel* model_;
  OptimizerConfig config_;
  OptimizerParamScheduler scheduler_;
  Communicator* comm_;
  int64_t adam_step_ = 0;
};

}  // namespace ptk::trainer
