// The training step: micro-batches, all-reduce, NaN check, clipping, AdamW, scheduler.
#include "trainer/train_step.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/expert_grads.h"
#include "trainer/expert_shard.h"

namespace ptk {

absl::Status LossScaleConfig::Validate() const {
  auto bad = [](const std::string& m) { return UsageError(m); };
  if (!(scale > 0) || !std::isfinite(scale)) return bad("the loss scale must be a positive finite number");
  if (!(min_scale > 0) || !std::isfinite(min_scale)) return bad("--min-loss-scale must be a positive finite number");
  if (dynamic && min_scale > scale) return bad("--min-loss-scale must not exceed --initial-loss-scale");
  if (window < 1) return bad("--loss-scale-window must be at least 1");
  if (hysteresis < 1) return bad("--hysteresis must be at least 1");
  return absl::OkStatus();
}

LossScaler::LossScaler(const LossScaleConfig& config) : config_(config) {
  state_.scale = config.scale;
  state_.hysteresis_tracker = config.hysteresis;
}

void LossScaler::Update(bool found_inf) {
  if (!config_.dynamic) return;
  if (found_inf) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker -= 1;
    if (state_.hysteresis_tracker <= 0) state_.scale = std::max(state_.scale * 0.5, config_.min_scale);
    return;
  }
  state_.growth_tracker += 1;
  if (state_.growth_tracker == config_.window) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker = config_.hysteresis;
    state_.scale *= 2.0;
  }
}

TrainStep::TrainStep(GPTModel* model, const OptimizerConfig& config, const SchedulerConfig& schedule,
                     Communicator* comm, const LossScaleConfig& loss_scale)
    : model_(model), config_(config), scheduler_(schedule), scaler_(loss_scale), comm_(comm) {
  model->SetMoeDataComm(comm);  // global_aux_loss's and the expert bias's counts: over the data (x context) group
  if (config.overlap_grad_reduce)
    buckets_ = MakeGradBuckets(
        model->layout(), config.ddp_bucket_size > 0 ? config.ddp_bucket_size : DefaultDdpBucketSize(comm->size()));
}

TrainStepState TrainStep::State() const {
  TrainStepState s;
  s.adam_step = adam_step_;
  s.scheduler_num_steps = scheduler_.num_steps();
  s.schedule = scheduler_.config();
  if (scaler_.dynamic()) s.loss_scale = scaler_.state();
  return s;
}

void TrainStep::Restore(const TrainStepState& s) {
  adam_step_ = s.adam_step;
  scheduler_.set_num_steps(s.scheduler_num_steps);
  scheduler_.set_config(s.schedule);
  if (scaler_.dynamic() && s.loss_scale) scaler_.set_state(*s.loss_scale);
}

absl::StatusOr<StepResult> TrainStep::Step(const std::vector<ModelBatch>& micro_batches, int64_t global_batch_size,
                                           uint64_t seed) {
  PTK_ASSIGN_OR_RETURN(StepResult r, ComputeGradients(micro_batches, seed));
  PTK_RETURN_IF_ERROR(ApplyUpdate(r, global_batch_size));
  r.next_loss_scale = scaler_.scale();
  return r;
}

absl::StatusOr<StepResult> TrainStep::ComputeGradients(const std::vector<ModelBatch>& micro_batches, uint64_t seed) {
  StepResult r;
  r.lr = scheduler_.lr();
  r.loss_scale = scaler_.scale();
  PTK_RETURN_IF_ERROR(model_->ZeroGrads());
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "forward-backward", 1));
  double local[6] = {0, 0, 0, 0, 0, 0};
  const bool overlap = !buckets_.empty();
  PTK_ASSIGN_OR_RETURN(const std::vector<double> scale_of, LossScales(micro_batches));
  // Tied embeddings over several stages: the first stage's word embeddings and the last stage's
  // copy, whose data-parallel sums the embedding group adds up once the reduction is done.
  GradRange tied;
  if (embedding_) {
    const ParamLayout& lay = model_->layout();
    const int64_t at = lay.wte >= 0 ? lay.wte : lay.out_w;  // multi-token prediction's: the last stage's wte
    tied = {at, at + lay.config.padded_vocab_size / lay.tensor_size * lay.config.hidden_size};
  }
  bool armed = false;  // --overlap-grad-reduce over stages: armed by the schedule's last backward
  PTK_ASSIGN_OR_RETURN(const LossSum losses,
                       pipeline_ ? ForwardBackwardPipelined(micro_batches, scale_of, r.loss_scale, seed, &armed)
                                 : ForwardBackwardMicroBatches(micro_batches, scale_of, r.loss_scale, seed));
  local[0] = losses.loss_sum;
  local[1] = losses.tokens;
  local[2] = losses.load_balancing_loss;
  local[3] = comm_->rank() == comm_->size() - 1 ? losses.z_loss : 0.0;  // the last data rank's (Megatron's)
  const MoeBalanceLosses balance = model_->TakeMoeBalanceLosses();
  local[4] = balance.seq;
  local[5] = balance.global;
  PTK_RETURN_IF_ERROR(FinalizeGrads(tied, armed, overlap));
  PTK_RETURN_IF_ERROR(model_->FinishMoeStep());  // the expert bias's update (Megatron's finalize_model_grads)
  PTK_RETURN_IF_ERROR(comm_->AllReduceSum(local, 6));
  // Pipeline parallelism: the last stage's loss to every stage (the others add zeros), and the stages'
  // load-balancing losses added up (Megatron's reduce_aux_losses_tracker_across_ranks: over the pipeline group).
  if (pipeline_) PTK_RETURN_IF_ERROR(pipeline_->AllReduceSum(local, 6));
  r.loss_sum = local[0];
  r.tokens = local[1];
  // Megatron's track_moe_metrics: each layer's sum over the micro-batches over their number,
  // averaged over the data ranks, the layers' sum over the MoE layers (of --moe-layer-freq's pattern, plus the
  // multi-token prediction depths, MoE or not: Megatron-LM's training_log passes mtp_num_layers).
  if (const GPTConfig& cf = model_->config(); cf.moe() && cf.moe_aux_loss_coeff > 0) {
    const int context = context_ ? context_->size() : 1;
    r.load_balancing_loss = local[2] / (static_cast<double>(micro_batches.size()) * (comm_->size() / context) *
                                        static_cast<double>(cf.moe_layers() + cf.mtp_num_layers));
  }
  // seq_load_balancing_loss as load_balancing_loss (summed over the context ranks, averaged over the data ranks);
  // global_load_balancing_loss's group holds the data ranks: summed over them, not averaged.
  if (const GPTConfig& cf = model_->config(); cf.moe()) {
    const double per =
        static_cast<double>(micro_batches.size()) * static_cast<double>(cf.moe_layers() + cf.mtp_num_layers);
    const int context = context_ ? context_->size() : 1;
    if (cf.moe_seq_aux_loss_coeff > 0) r.seq_load_balancing_loss = local[4] / (per * (comm_->size() / context));
    if (cf.moe_global_aux_loss_coeff > 0) r.global_load_balancing_loss = local[5] / per;
  }
  if (const GPTConfig& cf = model_->config(); cf.moe() && cf.moe_z_loss_coeff > 0)
    r.z_loss = local[3] /
               (static_cast<double>(micro_batches.size()) * static_cast<double>(cf.moe_layers() + cf.mtp_num_layers));
  if (const int64_t N = model_->config().mtp_num_layers; N > 0) {
    // MTPLossLoggingHelper: averaged over the data ranks, then the micro-batches; over pipeline stages the last
    // stage's (the others add zeros).
    r.mtp_losses = losses.mtp_losses;
    r.mtp_losses.resize(static_cast<size_t>(N), 0.0);
    PTK_RETURN_IF_ERROR(comm_->AllReduceSum(r.mtp_losses.data(), N));
    if (pipeline_) PTK_RETURN_IF_ERROR(pipeline_->AllReduceSum(r.mtp_losses.data(), N));
    for (double& v : r.mtp_losses) v /= static_cast<double>(micro_batches.size()) * comm_->size();
  }
  PTK_RETURN_IF_ERROR(StopTimer(timers_, "forward-backward"));
  PTK_RETURN_IF_ERROR(MeasureGrads(&r));
  return r;
}

// Pipeline parallelism: the micro-batches through the stages' schedule, each scaled by `scale_of` x `loss_scale`;
// with --overlap-grad-reduce `armed` says whether the schedule's last backward started the buckets' reduction.
absl::StatusOr<LossSum> TrainStep::ForwardBackwardPipelined(const std::vector<ModelBatch>& micro_batches,
                                                            const std::vector<double>& scale_of, double loss_scale,
                                                            uint64_t seed, bool* armed) {
  std::vector<double> scales;
  for (const double scale : scale_of) scales.push_back(scale * loss_scale);
  // The MoE layers' load-balancing loss scale, read by each backward: the same for every micro-batch of a step
  // (the loss scale over the micro-batches and ranks, or with --calculate-per-token-loss the micro-batch's
  // b x t tokens, all alike, over the global batch's loss tokens), so set once for the schedule.
  if (!micro_batches.empty()) {
    const double aux = MoeAuxLossScale(micro_batches[0], scale_of[0], loss_scale, micro_batches.size());
    model_->SetMoeAuxLossScale(aux);
    // The multi-token prediction depths' scale (MTPLossAutoScaler's): as ForwardBackwardMicroBatches sets it.
    model_->SetMtpLossScale(config_.calculate_per_token_loss ? scale_of[0] * loss_scale : aux,
                            config_.calculate_per_token_loss);
  }
  std::function<absl::Status()> arm;
  if (!buckets_.empty())
    arm = [&]() -> absl::Status {
      PTK_RETURN_IF_ERROR(model_->StartGradReduction(comm_, buckets_));
      *armed = true;
      return absl::OkStatus();
    };
  absl::StatusOr<LossSum> l = ForwardBackwardPipelining(model_, pipeline_, micro_batches, scales, seed,
                                                        &pipeline_stats_, arm, timers_, microbatch_group_size_);
  if (!l.ok()) {
    if (*armed) (void)model_->FinishGradReduction();  // waits for what was launched
    return l.status();
  }
  return *l;
}

// One stage: each micro-batch's forward and backward, scaled by `scale_of` x `loss_scale`; with
// --overlap-grad-reduce the last one's backward reduces the buckets. The losses, read once after the last.
absl::StatusOr<LossSum> TrainStep::ForwardBackwardMicroBatches(const std::vector<ModelBatch>& micro_batches,
                                                               const std::vector<double>& scale_of, double loss_scale,
                                                               uint64_t seed) {
  for (size_t k = 0; k < micro_batches.size(); ++k) {
    const ModelBatch& mb = micro_batches[k];
    const double scale = scale_of[k];
    // --overlap-grad-reduce: the last micro-batch's backward starts each bucket's reduction.
    const bool arm = !buckets_.empty() && k + 1 == micro_batches.size();
    if (arm) PTK_RETURN_IF_ERROR(model_->StartGradReduction(comm_, buckets_));
    model_->SetMoeAuxLossScale(MoeAuxLossScale(mb, scale, loss_scale, micro_batches.size()));
    // Megatron's MTPLossAutoScaler scale: the main loss's (schedules.py), its tokens the depth's own.
    model_->SetMtpLossScale(config_.calculate_per_token_loss
                                ? scale * loss_scale
                                : MoeAuxLossScale(mb, scale, loss_scale, micro_batches.size()),
                            config_.calculate_per_token_loss);
    // The losses are read once, after the last micro-batch (TakeLosses).
    absl::Status s = model_->ForwardBackwardDeferred(mb, scale * loss_scale, /*train=*/true, seed);
    if (arm) {
      const absl::Status timed = StartTimer(timers_, "all-grads-sync", 1);
      absl::Status reduced = model_->FinishGradReduction();
      if (reduced.ok()) reduced = timed.ok() ? StopTimer(timers_, "all-grads-sync") : timed;
      if (s.ok() && !reduced.ok()) s = reduced;
    }
    if (!s.ok()) {
      (void)model_->TakeLosses();  // drop what the failed step left pending
      return s;
    }
  }
  return model_->TakeLosses();
}

// ComputeGradients' end, on the reduced gradients: the grad norm, skipped and overflow, the count of zeros.
absl::Status TrainStep::MeasureGrads(StepResult* r) {
  // Megatron's optimizer.step from here to ApplyUpdate's end: the norm (clip-main-grad: the clip
  // itself is folded into the inner step's one pass), the count of zeros, AdamW, ZeRO-1's gather.
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "optimizer", 1));
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "optimizer-clip-main-grad", 1));
  PTK_ASSIGN_OR_RETURN(double sum_squares, model_->shard()         ? ShardedGradSumSquares()
                                           : model_->expert_comm() ? ExpertParallelGradSum(/*squares=*/true)
                                                                   : model_->GradSumSquares());
  // Tensor parallelism: each tensor rank's part of the whole model's (its slices; the tensors every
  // rank holds whole counted by tensor rank 0), so the norm and the NaN check span the whole model;
  // then the stages' parts (a last stage's embedding copy left out).
  if (model_->tensor_comm()) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum_squares, 1, model_->tensor_comm()));
  if (pipeline_) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum_squares, 1, pipeline_));
  r->grad_norm = std::sqrt(sum_squares) / r->loss_scale;  // of the unscaled gradients
  PTK_RETURN_IF_ERROR(StopTimer(timers_, "optimizer-clip-main-grad"));
  r->skipped = !std::isfinite(r->grad_norm) || !std::isfinite(r->loss_sum);
  // fp16's dynamic scaling skips an overflowing step and backs off: Megatron's found_inf, not a
  // NaN to stop the run for (a NaN loss still is one).
  r->overflow = scaler_.dynamic() && !std::isfinite(r->grad_norm) && std::isfinite(r->loss_sum);
  if (count_zeros_ && !r->skipped) {
    PTK_RETURN_IF_ERROR(StartTimer(timers_, "optimizer-count-zeros", 1));
    PTK_ASSIGN_OR_RETURN(r->num_zeros_in_grad, CountZerosInGrad());
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "optimizer-count-zeros"));
  }
  return absl::OkStatus();
}

// Megatron's MoEAuxLossAutoScaler scale (schedules.py sets it per micro-batch): the loss scale over the
// micro-batches, the gradients then averaged over the data ranks (here summed: over them too); with
// --calculate-per-token-loss the loss scale and the micro-batch's tokens (the router's, padding too) over
// the global batch's loss tokens (`scale`, finalize_model_grads' division).
double TrainStep::MoeAuxLossScale(const ModelBatch& mb, double scale, double loss_scale, size_t num_micro) const {
  // Per token: times the router's tokens, Megatron's valid_token_count: under tensor ranks (--sequence-parallel)
  // each rank's own b x t / T (router.py's attach_and_log_load_balancing_loss and apply_z_loss).
  if (config_.calculate_per_token_loss)
    return loss_scale * static_cast<double>(mb.b * mb.t) / model_->tensor_size() * scale;
  const int context = context_ ? context_->size() : 1;
  return loss_scale / (static_cast<double>(num_micro) * (comm_->size() / context));
}

// Megatron (megatron-core's forward_step_calc_loss, then the data x context reduction scaled by
// 1 / (data x context ranks)): each rank's micro-batch loss is the mean over its own tokens, divided by
// the number of micro-batches, so a micro-batch's context ranks each weigh 1 / C whatever their share
// of its tokens (the same as one rank holding whole samples when the loss mask is even over them,
// not with --eod-mask-loss's holes). comm_ spans data x context ranks: the gradients summed over it are
// the data-parallel sum of whole samples'. --calculate-per-token-loss: every token weighs 1 / the
// global batch's tokens (the micro-batches' over comm_), finalize_model_grads' num_tokens.
absl::StatusOr<std::vector<double>> TrainStep::LossScales(const std::vector<ModelBatch>& micro_batches) {
  const double num_micro = static_cast<double>(micro_batches.size());
  const int context = context_ ? context_->size() : 1;
  const double dp = static_cast<double>(comm_->size() / context);
  std::vector<double> tokens;
  for (const ModelBatch& mb : micro_batches) {
    double t = 0;
    for (int64_t i = 0; i < mb.b * mb.t; ++i) t += mb.loss_mask[i];
    tokens.push_back(t);
  }
  std::vector<double> scales;
  if (config_.calculate_per_token_loss) {
    double total = 0;
    for (const double t : tokens) total += t;
    PTK_RETURN_IF_ERROR(comm_->AllReduceSum(&total, 1));
    for (size_t k = 0; k < tokens.size(); ++k) scales.push_back(total > 0 ? 1.0 / total : 0.0);
    return scales;
  }
  for (const double t : tokens) scales.push_back(t > 0 ? 1.0 / (t * num_micro * dp * context) : 0.0);
  return scales;
}

// Megatron's finalize_model_grads: the data-parallel reduction of every gradient first (its
// finish_grad_sync: the armed buckets waited for, or without --overlap-grad-reduce the reduction
// now), then with --sequence-parallel the sum over the tensor group of the gradients each tensor
// rank computed from its positions (_allreduce_non_tensor_model_parallel_grads: the norms', the
// row-parallel biases'), so such a gradient is (a0 + a1 + ...) + (b0 + b1 + ...) over data ranks
// 0, 1, ... of tensor ranks a, b, each the sum of its micro-batches; then the embedding group's sum
// of the tied copies (_allreduce_word_embedding_grads), alike over the copies of the stages.
absl::Status TrainStep::FinalizeGrads(const GradRange& tied, bool armed, bool overlap) {
  if (armed) {
    pipeline_stats_.buckets_launched_in_backward = model_->buckets_launched_in_backward();
    const absl::Status timed = StartTimer(timers_, "all-grads-sync", 1);
    const absl::Status reduced = model_->FinishGradReduction();  // waited for even when the timer failed
    PTK_RETURN_IF_ERROR(timed);
    PTK_RETURN_IF_ERROR(reduced);
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "all-grads-sync"));
  }
  // Without --overlap-grad-reduce, after backward; ZeRO-1: each rank's shard of the gradients
  // summed over the ranks, the rest left alone.
  if (!overlap) {
    PTK_RETURN_IF_ERROR(StartTimer(timers_, "all-grads-sync", 1));
    PTK_RETURN_IF_ERROR(model_->shard()         ? model_->ReduceScatterGrads(comm_)
                        : model_->expert_comm() ? ReduceExpertParallelGrads(model_, comm_)
                                                : model_->AllReduceGrads(comm_));
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "all-grads-sync"));
  }
  // Megatron times the sum as non-tensor-parallel-grads-all-reduce (level 1, megatron-core 0.16's
  // finalize_model_grads), a name its training log's timer list leaves out (it lists the former
  // layernorm-grads-all-reduce, which nothing times): timed, barrier and all, never printed. Timed
  // where there is a sum, as embedding-grads-all-reduce is; sequence parallelism (and
  // --qk-layernorm's tensor-parallel sum) is every rank's.
  if (model_->sums_non_tensor_parallel_grads()) {
    PTK_RETURN_IF_ERROR(StartTimer(timers_, "non-tensor-parallel-grads-all-reduce", 1));
    PTK_RETURN_IF_ERROR(model_->SumNonTensorParallelGrads());
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "non-tensor-parallel-grads-all-reduce"));
  }
  // Timed on every stage of tied embeddings, as Megatron does (a middle stage has no copy to sum):
  // a level-1 timer's start waits at a barrier over all ranks, which every rank must reach.
  // Multi-token prediction keeps a copy of the word embeddings on the last stage, tied or not.
  if (!pipeline_ || (model_->config().untie_embeddings_and_output_weights && model_->config().mtp_num_layers == 0))
    return absl::OkStatus();
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "embedding-grads-all-reduce", 1));
  if (embedding_) {
    // ZeRO-1: the shards of the first and the last stage cut their copies at different places
    // (Megatron gives the shared embedding a bucket of its own, sharded alike on both stages), so
    // each rank's reduced piece of its copy goes to the other data ranks first: every element of
    // both copies then holds its data-parallel sum, the bits the reduce-scatter gave its owner.
    if (model_->shard()) PTK_RETURN_IF_ERROR(model_->AllGatherGradRange(comm_, tied.begin, tied.size()));
    PTK_RETURN_IF_ERROR(model_->AllReduceGradRange(embedding_, tied.begin, tied.size()));
  }
  return StopTimer(timers_, "embedding-grads-all-reduce");
}

// Expert parallelism: the gradients' sum of squares or zeros, each expert rank's experts added once (Megatron's
// get_grad_norm_fp32 over the expert model-parallel group), the rest every rank's alike.
absl::StatusOr<double> TrainStep::ExpertParallelGradSum(bool squares) {
  std::vector<float> grads(static_cast<size_t>(model_->num_params()));
  PTK_RETURN_IF_ERROR(model_->ReadGrads(grads));
  return ExpertParallelSum(model_->layout(), grads, squares, model_->expert_comm());
}

absl::StatusOr<double> TrainStep::CountZerosInGrad() {
  if (model_->expert_comm()) {  // the stage's count (its tensor ranks' parts), then the stages' in rank order
    PTK_ASSIGN_OR_RETURN(double zeros, ExpertParallelGradSum(/*squares=*/false));
    if (model_->tensor_comm()) PTK_RETURN_IF_ERROR(SumInRankOrder(&zeros, 1, model_->tensor_comm()));
    if (pipeline_) PTK_RETURN_IF_ERROR(SumInRankOrder(&zeros, 1, pipeline_));
    return zeros;
  }
  std::vector<float> grads(static_cast<size_t>(model_->num_params()));
  PTK_RETURN_IF_ERROR(model_->ReadGrads(grads));
  double zeros = 0;
  const int64_t begin = model_->moments_begin();
  const int64_t counted = model_->layout().norm_end();  // a last stage's embedding copy left out
  for (const ParamPiece& p : PiecesIn(model_->layout(), begin, std::min(counted, begin + model_->moments_size())))
    if (model_->tensor_rank() == 0 || p.tensor_split_dim >= 0)  // whole tensors counted once
      zeros += static_cast<double>(std::count(grads.begin() + p.offset, grads.begin() + p.offset + p.size, 0.0f));
  if (model_->shard()) PTK_RETURN_IF_ERROR(comm_->AllReduceSum(&zeros, 1));
  if (model_->tensor_comm()) PTK_RETURN_IF_ERROR(SumInRankOrder(&zeros, 1, model_->tensor_comm()));
  if (pipeline_) PTK_RETURN_IF_ERROR(SumInRankOrder(&zeros, 1, pipeline_));
  return zeros;
}

absl::StatusOr<double> TrainStep::ParamsNorm() {
  if (model_->expert_comm()) {  // every rank holds its whole model (under ZeRO-1 too: gathered after the update)
    std::vector<float> all(static_cast<size_t>(model_->num_params()));
    PTK_RETURN_IF_ERROR(model_->ReadParams(all));
    PTK_ASSIGN_OR_RETURN(double sum, ExpertParallelSum(model_->layout(), all, true, model_->expert_comm()));
    if (model_->tensor_comm()) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum, 1, model_->tensor_comm()));
    if (pipeline_) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum, 1, pipeline_));  // the stages' parts
    return std::sqrt(sum);
  }
  std::vector<float> own(static_cast<size_t>(model_->moments_size()));
  PTK_RETURN_IF_ERROR(model_->ReadOwnedParams(own));
  double sum = 0;
  const int64_t begin = model_->moments_begin();
  // Tensor parallelism: the tensors every tensor rank holds whole counted by tensor rank 0 only;
  // pipeline parallelism: a last stage's copy of the tied embeddings left out.
  const int64_t counted = std::min(model_->layout().norm_end(), begin + model_->moments_size());
  for (const ParamPiece& p : PiecesIn(model_->layout(), begin, std::max(begin, counted)))
    if (model_->tensor_rank() == 0 || p.tensor_split_dim >= 0)
      for (int64_t i = p.offset - begin; i < p.offset - begin + p.size; ++i)
        sum += static_cast<double>(own[static_cast<size_t>(i)]) * own[static_cast<size_t>(i)];
  if (model_->shard()) PTK_RETURN_IF_ERROR(comm_->AllReduceSum(&sum, 1));
  if (model_->tensor_comm()) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum, 1, model_->tensor_comm()));
  if (pipeline_) PTK_RETURN_IF_ERROR(SumInRankOrder(&sum, 1, pipeline_));
  return std::sqrt(sum);
}

absl::Status TrainStep::ApplyUpdate(const StepResult& r, int64_t global_batch_size) {
  scaler_.Update(r.skipped);
  if (r.skipped) return StopTimer(timers_, "optimizer");
  // One pass over the gradients: unscale and clip together (Megatron unscales, then clips the
  // unscaled norm).
  double factor = 1.0 / r.loss_scale;
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (r.grad_norm + 1e-6);
    if (coeff < 1.0) factor *= coeff;
  }
  ++adam_step_;
  PTK_RETURN_IF_ERROR(StartTimer(timers_, "optimizer-inner-step", 1));
  PTK_RETURN_IF_ERROR(model_->ScaledAdamWUpdate(factor, Groups(r.lr)));
  PTK_RETURN_IF_ERROR(StopTimer(timers_, "optimizer-inner-step"));
  // ZeRO-1: each rank updated its shard; every rank needs all of them for the next forward.
  if (model_->shard() || model_->ranges_sharded()) {
    PTK_RETURN_IF_ERROR(StartTimer(timers_, "params-all-gather", 1));
    PTK_RETURN_IF_ERROR(model_->shard() ? model_->AllGatherParams(comm_) : AllGatherExpertShardedParams(model_, comm_));
    PTK_RETURN_IF_ERROR(StopTimer(timers_, "params-all-gather"));
  }
  scheduler_.Step(global_batch_size);
  return StopTimer(timers_, "optimizer");
}

AdamWGroups TrainStep::Groups(double lr) const {
  // Megatron's scheduler sets each group's lr from its max_lr and min_lr, and its weight decay as the
  // schedule's times the group's wd_mult (1 or 0).
  const double wd = scheduler_.weight_decay(), decoupled = scheduler_.decoupled_lr();
  auto adamw = [&](double rate, double weight_decay) {
    return AdamWParams{rate, config_.adam_beta1, config_.adam_beta2, config_.adam_eps, weight_decay, adam_step_};
  };
  return AdamWGroups{{adamw(lr, wd), adamw(lr, 0.0), adamw(decoupled, wd), adamw(decoupled, 0.0)},
                     config_.apply_wd_to_qk_layernorm};
}

absl::StatusOr<double> TrainStep::ShardedGradSumSquares() {
  const ParamShard& shard = *model_->shard();
  std::vector<double> mine;
  PTK_RETURN_IF_ERROR(model_->GradSumSquaresPartials(shard.begin(), shard.end(), &mine));
  // Every rank's partials, in rank order, then added in that order from 0.0.
  const size_t world = static_cast<size_t>(comm_->size()), me = static_cast<size_t>(comm_->rank());
  std::vector<int64_t> counts(world, 0), eight(world, static_cast<int64_t>(sizeof(int64_t)));
  counts[me] = static_cast<int64_t>(mine.size());
  PTK_RETURN_IF_ERROR(comm_->AllGather(counts.data(), eight));
  std::vector<int64_t> bytes(world);
  int64_t before = 0, total = 0;
  for (size_t r = 0; r < world; ++r) {
    if (counts[r] < 0 || counts[r] > (int64_t{1} << 40))
      return absl::InternalError(fmt::format("rank {} sent {} gradient-norm partials", r, counts[r]));
    if (r < me) before += counts[r];
    total += counts[r];
    bytes[r] = counts[r] * static_cast<int64_t>(sizeof(double));
  }
  std::vector<double> all(static_cast<size_t>(total), 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + before);
  PTK_RETURN_IF_ERROR(comm_->AllGather(all.data(), bytes));
  double s = 0;
  for (double v : all) s += v;
  return s;
}

}  // namespace ptk
