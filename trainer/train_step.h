// TrainStep: one training step as Megatron's train_step does it: forward/backward over the micro-batches of
// this rank, gradient all-reduce across data-parallel ranks, NaN/Inf check, global-norm clipping,
// AdamW (no weight decay on biases and LayerNorm parameters), then the scheduler. With a model
// whose optimizer state is sharded (GPTModel::ShardOptimizerState, --use-distributed-optimizer):
// reduce-scatter, the norm from every rank's partials, AdamW on the shard, all-gather.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/gpt_model.h"
#include "trainer/lr_schedule.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/timers.h"

namespace ptk {

struct OptimizerConfig {
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  double clip_grad = 1.0;  // 0 disables clipping
  // --overlap-grad-reduce: the last micro-batch's backward reduces buckets of --ddp-bucket-size
  // elements (0: Megatron's default, DefaultDdpBucketSize) as it completes them.
  bool overlap_grad_reduce = false;
  int64_t ddp_bucket_size = 0;
  // --calculate-per-token-loss: every token's loss weighs 1 / the global batch's tokens (over the data
  // and context ranks and the micro-batches), not 1 / its micro-batch's tokens on its rank
  // (TrainStep::LossScales).
  bool calculate_per_token_loss = false;
  // --apply-wd-to-qk-layernorm: the query and key norms' parameters decay as weights do (megatron-core's
  // Qwen3-Next rule); every other 1-D tensor and bias still without weight decay (AdamWGroups).
  bool apply_wd_to_qk_layernorm = false;
};

// Megatron's loss scaling for --fp16: ConstantGradScaler (--loss-scale) or DynamicGradScaler
// (--initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis; growth x2, backoff x0.5).
// fp32 and bf16 train with the constant scale 1.
struct LossScaleConfig {
  bool dynamic = false;
  double scale = 1.0;  // the constant scale, or the dynamic scaler's initial one
  double min_scale = 1.0;
  int64_t window = 1000;   // good steps between two growths
  int64_t hysteresis = 2;  // overflows tolerated before a backoff
  absl::Status Validate() const;
};

// The dynamic scaler's state (saved in checkpoints so a resume continues bit for bit).
struct LossScaleState {
  double scale = 1.0;
  int64_t growth_tracker = 0;
  int64_t hysteresis_tracker = 0;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config);
  double scale() const { return state_.scale; }
  bool dynamic() const { return config_.dynamic; }
  // After each step: an overflow (Inf/NaN in the scaled gradients) backs off once the hysteresis
  // is spent; `window` good steps in a row double the scale.
  void Update(bool found_inf);
  const LossScaleState& state() const { return state_; }
  void set_state(const LossScaleState& s) { state_ = s; }

 private:
  LossScaleConfig config_;
  LossScaleState state_;
};

struct StepResult {
  double loss_sum = 0, tokens = 0;  // over all micro-batches and ranks
  double grad_norm = 0;             // before clipping, of the unscaled gradients
  bool skipped = false;             // NaN/Inf in the loss or the gradients: no update
  bool overflow = false;            // skipped by fp16 dynamic loss scaling (not a NaN to stop on)
  double loss_scale = 1.0;          // the scale this step's gradients were computed with
  double next_loss_scale = 1.0;     // the scale after the step's update of it (what Megatron logs)
  double lr = 0;  // --lr's group's rate in this step: the one Megatron logs (get_canonical_lr_for_logging)
  // --log-num-zeros-in-grad (Megatron's count_zeros_fp32): zeros among the reduced gradients, when
  // the step was asked to count them and was not skipped.
  std::optional<double> num_zeros_in_grad;
  // Mixture of experts with a load-balancing loss: Megatron's logged load_balancing_loss (the layers'
  // mean of each one's loss without its coefficient, over the micro-batches and data ranks); 0 otherwise.
  double load_balancing_loss = 0;
  // With a router z-loss: Megatron's logged z_loss (the layers' mean of each one's z-loss without its coefficient,
  // over the micro-batches, summed over the stages and, as Megatron's tracker reduces it over no other group,
  // the last data rank's, which prints Megatron's log); 0 otherwise.
  double z_loss = 0;
  // seq_aux_loss's and global_aux_loss's (Megatron's seq_load_balancing_loss, global_load_balancing_loss), as
  // load_balancing_loss is; 0 without them.
  double seq_load_balancing_loss = 0, global_load_balancing_loss = 0;
  // Multi-token prediction: Megatron's logged mtp_K loss per depth (each micro-batch's masked mean over the depth's
  // rolled tokens, averaged over the micro-batches and data ranks); empty without.
  std::vector<double> mtp_losses;
  double lm_loss() const { return tokens > 0 ? loss_sum / tokens : 0.0; }
};

// What the step keeps between iterations besides AdamW's moments (which live in the model's
// backend): what a checkpoint saves of it (State) and a resume puts back (Restore).
struct TrainStepState {
  int64_t adam_step = 0;                     // AdamW's step count
  int64_t scheduler_num_steps = 0;           // the scheduler's position, in samples
  SchedulerConfig schedule;                  // the scheduler's settings
  std::optional<LossScaleState> loss_scale;  // the dynamic scaler's (--fp16); none with a constant scale
};

class TrainStep {
 public:
  TrainStep(GPTModel* model, const OptimizerConfig& config, const SchedulerConfig& schedule, Communicator* comm,
            const LossScaleConfig& loss_scale = {});

  // micro_batches: this rank's micro-batches of one global batch; global_batch_size advances the
  // scheduler after a successful update.
  absl::StatusOr<StepResult> Step(const std::vector<ModelBatch>& micro_batches, int64_t global_batch_size,
                                  uint64_t seed);
  // The two halves of Step. ComputeGradients leaves the all-reduced, unclipped gradients in the
  // model and fills loss, tokens, grad_norm and skipped; ApplyUpdate clips, updates and steps the
  // scheduler unless the result is marked skipped.
  absl::StatusOr<StepResult> ComputeGradients(const std::vector<ModelBatch>& micro_batches, uint64_t seed);
  absl::Status ApplyUpdate(const StepResult& r, int64_t global_batch_size);

  TrainStepState State() const;
  // Puts a saved state back; a loss scale is taken by a dynamic scaler only (none keeps its own).
  void Restore(const TrainStepState& state);

  // --overlap-grad-reduce's buckets, in the order backward completes them (empty without it).
  const std::vector<GradRange>& buckets() const { return buckets_; }
  const OptimizerParamScheduler& scheduler() const { return scheduler_; }
  // AdamW's step count (the moments live in the model's backend).
  int64_t adam_step() const { return adam_step_; }
  // Pipeline parallelism (the model one stage of several): the micro-batches run Megatron's 1F1B
  // schedule over `pipeline` (the stage's pipeline group); with tied embeddings `embedding` (the
  // first and last stage's group; null on a middle stage) sums the two copies' gradients after
  // the data-parallel reduction, as Megatron's finalize_model_grads; the loss, the grad norm and
  // the count of zeros span the stages. --overlap-grad-reduce's buckets are reduced during the
  // schedule's last backward, as it completes them. With model chunks `microbatch_group_size` is the
  // interleaved schedule's micro-batch groups (0: the pipeline size; ForwardBackwardInterleaved).
  void set_pipeline(Communicator* pipeline, Communicator* embedding, int microbatch_group_size = 0) {
    pipeline_ = pipeline;
    embedding_ = embedding;
    microbatch_group_size_ = microbatch_group_size;
  }
  const PipelineStats& pipeline_stats() const { return pipeline_stats_; }
  // Context parallelism: each micro-batch holds this rank's positions of its samples, `context`
  // the context group (comm is then data × context ranks, over which the gradients and losses are
  // summed). As Megatron, each rank's micro-batch loss is normalised by its own tokens and weighs 1 / C:
  // the step of one rank holding whole samples when the loss mask is even over the context ranks.
  void set_context(Communicator* context) { context_ = context; }
  // Whether the next steps count the zeros among the reduced gradients (a host copy of them; with
  // ZeRO-1 each rank's shard, summed over the ranks): every rank must ask alike.
  void set_count_zeros_in_grad(bool on) { count_zeros_ = on; }
  // Megatron's calc_params_l2_norm (--log-params-norm): the L2 norm of the fp32 weights over the
  // whole model (each rank's shard, slices and stage; a last stage's embedding copy left out).
  absl::StatusOr<double> ParamsNorm();
  // --timing-log-level: Megatron's timers of a step (forward-backward, all-grads-sync,
  // non-tensor-parallel-grads-all-reduce, embedding-grads-all-reduce, optimizer and its parts, the
  // schedule's); null: none. The optimizer
  // timer runs from ComputeGradients' norm to the end of ApplyUpdate.
  void set_timers(Timers* timers) { timers_ = timers; }

 private:
  // After the passes: the armed bucket reduction finished, or (no --overlap-grad-reduce) the
  // gradients reduced; then --sequence-parallel's partial gradients summed over the tensor group;
  // then the tied embeddings' copies summed over `embedding_` (`tied`: this
  // stage's).
  absl::Status FinalizeGrads(const GradRange& tied, bool armed, bool overlap);
  // ComputeGradients' passes: this stage's part of the pipeline schedule (`armed`: the buckets' reduction started by
  // its last backward), or without pipeline parallelism each micro-batch's forward and backward (the last one's
  // reducing the buckets); each micro-batch's loss scaled by scale_of[k] x loss_scale. The losses of this rank.
  absl::StatusOr<LossSum> ForwardBackwardPipelined(const std::vector<ModelBatch>& micro_batches,
                                                   const std::vector<double>& scale_of, double loss_scale,
                                                   uint64_t seed, bool* armed);
  absl::StatusOr<LossSum> ForwardBackwardMicroBatches(const std::vector<ModelBatch>& micro_batches,
                                                      const std::vector<double>& scale_of, double loss_scale,
                                                      uint64_t seed);
  // ComputeGradients' end, Megatron's optimizer.step before the update (the "optimizer" timer started, ApplyUpdate
  // stops it): the grad norm over the whole model, skipped and overflow, --log-num-zeros-in-grad's count.
  absl::Status MeasureGrads(StepResult* r);
  // ZeRO-1's gradient norm: the ranks' partials of their shards, added in rank order.
  absl::StatusOr<double> ShardedGradSumSquares();
  // This update's settings of each optimizer group: `lr` (--lr's group, as the step computed it) and the
  // scheduler's decoupled rate, its weight decay or none, the step's count.
  AdamWGroups Groups(double lr) const;
  // --log-num-zeros-in-grad's count over the whole model (each rank's shard, slices and stage).
  absl::StatusOr<double> CountZerosInGrad();
  absl::StatusOr<double> ExpertParallelGradSum(bool squares);

  GPTModel* model_;
  OptimizerConfig config_;
  std::vector<GradRange> buckets_;  // --overlap-grad-reduce's
  OptimizerParamScheduler scheduler_;
  LossScaler scaler_;
  Communicator* comm_;
  Communicator* pipeline_ = nullptr;
  Communicator* embedding_ = nullptr;
  Communicator* context_ = nullptr;  // set_context's
  // Each micro-batch's loss scale (before the loss scaler's): 1 / (its tokens on this rank × micro-batches
  // × data ranks × context ranks), or with --calculate-per-token-loss 1 / the global batch's tokens.
  absl::StatusOr<std::vector<double>> LossScales(const std::vector<ModelBatch>& micro_batches);
  double MoeAuxLossScale(const ModelBatch& mb, double scale, double loss_scale, size_t num_micro) const;
  int microbatch_group_size_ = 0;
  PipelineStats pipeline_stats_;
  int64_t adam_step_ = 0;
  bool count_zeros_ = false;
  Timers* timers_ = nullptr;
};

}  // namespace ptk
