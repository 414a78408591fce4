// The model interface that the training step, the loop and checkpoints use, whatever the backend:
// Megatron's GPT (pretrain_gpt.py with learned absolute positions, pre-LayerNorm blocks, GELU MLP,
// tied or untied output layer). The parameter layout (names, shapes, offsets, init: param_layout.h)
// is shared by every backend; a backend owns the parameters, gradients and AdamW moments in its own memory and
// hands the step and checkpoints host copies only. trainer/cpu/ holds the fp32 CPU backend,
// trainer/cuda/ the CUDA one.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/comm.h"
#include "trainer/grad_buckets.h"
#include "trainer/op_types.h"
#include "trainer/param_layout.h"
#include "trainer/param_shard.h"

namespace ptk {

// One micro-batch as the model sees it (host memory): (b, t) tokens, labels, positions and loss
// mask, and the global position of each sample in the training stream (keys the dropout masks).
struct ModelBatch {
  int64_t b = 0, t = 0;
  const int32_t* tokens = nullptr;
  const int32_t* labels = nullptr;
  const int32_t* position_ids = nullptr;
  const float* loss_mask = nullptr;
  const int64_t* sample_keys = nullptr;  // b entries; may be null when dropout is off
};

struct LossSum {
  double loss_sum = 0;  // sum over tokens of loss * loss_mask
  double tokens = 0;    // sum of loss_mask
  // Training passes with a load-balancing loss (GPTConfig::moe_aux_loss_coeff > 0): the sum over the
  // mixture-of-experts layers of each one's loss without its coefficient (what Megatron's tracker adds).
  double load_balancing_loss = 0;
  // Training passes with a router z-loss (GPTConfig::moe_z_loss_coeff > 0): the sum over the MoE layers of
  // each one's z-loss without its coefficient (what Megatron's tracker adds as z_loss).
  double z_loss = 0;
  // Training passes with multi-token prediction (GPTConfig::mtp_num_layers): depth k's masked mean loss over its
  // rolled tokens (what Megatron's MTPLossLoggingHelper tracks per micro-batch); empty otherwise.
  std::vector<double> mtp_losses;
  void AddMtp(const LossSum& o) {
    if (mtp_losses.size() < o.mtp_losses.size()) mtp_losses.resize(o.mtp_losses.size(), 0.0);
    for (size_t k = 0; k < o.mtp_losses.size(); ++k) mtp_losses[k] += o.mtp_losses[k];
  }
};

// Mixture of experts: the training passes' seq_aux_loss and global_aux_loss values without their coefficients,
// summed over the MoE layers and the passes (what Megatron's tracker adds as seq_load_balancing_loss and
// global_load_balancing_loss).
struct MoeBalanceLosses {
  double seq = 0, global = 0;
};
// A model's buffers that are no parameters (Megatron's persistent ones, e.g. a router's expert_bias): name, values.
using ModelBuffers = std::vector<std::pair<std::string, std::vector<float>>>;

enum class Device { kCpu, kCuda };
// Megatron's precision flags: none (fp32), --bf16, --fp16. Master weights, gradients, AdamW
// moments, LayerNorm statistics, softmax and the loss stay fp32 in every mode.
enum class Precision { kFp32, kBf16, kFp16 };
std::string_view DeviceName(Device d);
std::string_view PrecisionName(Precision p);

// Where one micro-batch's activations and their gradients cross to the adjacent pipeline stages
// (GPTModel::StageBuffers): the buffers the schedule receives into and sends from, each `elements`
// of the wire type. A buffer the stage has no neighbour for is null (input and input_grad on the
// first stage, output and output_grad on the last).
struct StageExchange {
  void* input = nullptr;        // receives the previous stage's output
  void* output = nullptr;       // this stage's output, to send
  void* output_grad = nullptr;  // receives the next stage's gradient of the output
  void* input_grad = nullptr;   // the gradient of the input, to send
  int64_t elements = 0;         // StageExchangeFloats
  Precision wire = Precision::kFp32;
  // Device memory (the current CUDA device's): the stream the stage's passes run on, where the
  // sends and receives are enqueued (Communicator::SendRecvDevice). Null: host memory (SendRecv).
  void* stream = nullptr;
  int64_t bytes() const { return elements * (wire == Precision::kFp32 ? 4 : 2); }
};

class GPTModel {
 public:
  virtual ~GPTModel() = default;
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;

  const GPTConfig& config() const { return layout_.config; }
  const ParamLayout& layout() const { return layout_; }
  const std::vector<ParamInfo>& params_info() const { return layout_.infos; }
  int64_t num_params() const { return layout_.num_params; }
  const ParamInfo* FindParam(const std::string& name) const { return layout_.Find(name); }

  // Tensor parallelism: the tensor group this model's layers communicate over (null: none), and
  // this rank's place in it (the layout's partition).
  Communicator* tensor_comm() const { return tensor_comm_; }
  int tensor_size() const { return layout_.tensor_size; }
  int tensor_rank() const { return layout_.tensor_rank; }
  // --sequence-parallel over the tensor group: the gradients of SequenceParallelGradRanges are each
  // tensor rank's partial sums (its positions'), left for TrainStep to sum over the group after
  // the data-parallel reduction, as Megatron's finalize_model_grads does.
  bool sequence_parallel() const { return sequence_parallel_; }
  // Expert parallelism (--expert-model-parallel-size): the expert group the MoE layers dispatch over and
  // the expert-data group their experts' gradients are reduced over (null: none; the layout holds this
  // expert rank's experts).
  Communicator* expert_comm() const { return expert_comm_; }
  Communicator* expert_data_comm() const { return expert_data_comm_; }

  virtual Device device() const = 0;
  virtual Precision precision() const = 0;
  // One line for the log: "cpu fp32", "cuda:0 (NVIDIA H100 80GB HBM3) bf16".
  virtual std::string Describe() const = 0;

  // Host copies of the backend's fp32 state, each num_params floats in the layout's order; the
  // moments are moments_size() floats (the shard's range under ZeRO-1).
  virtual absl::Status ReadParams(std::span<float> out) const = 0;
  // The fp32 parameters of the range this rank updates: moments_size() floats from
  // moments_begin() (all of them without ZeRO-1). What a rank contributes when a checkpoint gathers
  // the parameters: under ZeRO-1 in bf16/fp16 the CUDA backend keeps the fp32 master of its shard
  // only, and ReadParams is refused there. This default reads them all and keeps the range.
  virtual absl::Status ReadOwnedParams(std::span<float> out) const;
  virtual absl::Status WriteParams(std::span<const float> in) = 0;
  virtual absl::Status ReadGrads(std::span<float> out) const = 0;
  virtual absl::Status ReadMoments(std::span<float> exp_avg, std::span<float> exp_avg_sq) const = 0;
  virtual absl::Status WriteMoments(std::span<const float> exp_avg, std::span<const float> exp_avg_sq) = 0;
  // ParamLayout::InitWeights on the host, then WriteParams: the same bits on every backend.
  absl::Status InitWeights(uint64_t seed);

  virtual absl::Status ZeroGrads() = 0;
  // Mixture of experts: the weight of each layer's load-balancing loss in the gradients of the next
  // training passes, beside its coefficient (Megatron's MoEAuxLossAutoScaler scale: the loss scale over
  // the micro-batches, here also over the data ranks, whose gradients TrainStep sums). Default 1.
  void SetMoeAuxLossScale(double scale) { moe_aux_loss_scale_ = scale; }
  // Load balancing beyond aux_loss (trainer/cpu/moe_balance.cpp; the CPU backend's): `data` is the group whose
  // token counts global_aux_loss and the expert bias sum (Megatron's tensor x data x context group; null: one
  // rank). TakeMoeBalanceLosses: the passes' sums since the last call. FinishMoeStep, once the step's gradients are
  // reduced (Megatron's finalize_model_grads): the expert biases updated from the step's counts summed over
  // `data`, and global_aux_loss's counts reset.
  void SetMoeDataComm(Communicator* data) { moe_data_comm_ = data; }
  virtual MoeBalanceLosses TakeMoeBalanceLosses() { return {}; }
  virtual absl::Status FinishMoeStep() { return absl::OkStatus(); }
  // The model's buffers (saved in checkpoints beside the parameters), and their load: every buffer the model
  // has must be there (named as ReadBuffers names it, of its size).
  virtual ModelBuffers ReadBuffers() const { return {}; }
  virtual absl::Status WriteBuffers(const ModelBuffers& in);
  // Multi-token prediction: Megatron's MTPLossAutoScaler scale of the next training passes: each depth's token
  // losses weigh mtp_loss_scaling_factor / mtp_num_layers x `scale`, over the depth's tokens unless `per_token`.
  void SetMtpLossScale(double scale, bool per_token) {
    mtp_loss_scale_ = scale;
    mtp_per_token_ = per_token;
  }
  // Forward and backward of one micro-batch: returns the masked loss sum and token count, and adds
  // d(loss_scale * sum(loss * mask)) to the fp32 gradients. `train` applies dropout (keyed by seed).
  virtual absl::StatusOr<LossSum> ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                                  uint64_t seed) = 0;
  // ForwardBackward whose loss is kept for TakeLosses instead of returned: a backend may leave the
  // pass enqueued (CUDA: no host synchronisation per micro-batch; the losses are read once a step).
  // This default runs ForwardBackward and keeps its LossSum.
  virtual absl::Status ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train, uint64_t seed);
  // The losses of the ForwardBackwardDeferred calls since the last TakeLosses, each micro-batch's
  // LossSum (ForwardBackward's bits) added in call order from zero; waits for their passes. An
  // error of any of them is returned here, and the pending losses are dropped either way.
  virtual absl::StatusOr<LossSum> TakeLosses();
  // Forward only (evaluation, no dropout). With `logits`, the (b, t, padded vocab) logits are
  // copied out as fp32.
  virtual absl::StatusOr<LossSum> Forward(const ModelBatch& batch, std::vector<float>* logits = nullptr) = 0;

  // ---- Pipeline parallelism (the layout is a stage's: layout().pipeline_size > 1). One stage's part
  // of a micro-batch's pass, its activations kept in `slot` (0 <= slot < the micro-batches a
  // schedule keeps in flight) until its backward. `input`: the previous stage's output,
  // StageExchangeFloats floats (empty on the first stage, which embeds the tokens); `output`: this stage's
  // (empty on the last stage, which computes the loss). With `loss_scale` the last stage also
  // makes the loss's gradient (d(loss_scale * sum(loss * mask))) for StageBackward; without, the
  // pass is forward only (evaluation). The last stage returns the masked loss sum, the others zero;
  // with `logits` the last stage also copies out the (b, t, padded vocab) logits, as Forward.
  virtual absl::StatusOr<LossSum> StageForward(const ModelBatch& batch, int slot, std::span<const float> input,
                                               std::span<float> output, std::optional<double> loss_scale, bool train,
                                               uint64_t seed, std::vector<float>* logits = nullptr);
  // The backward of slot's pass: `output_grad` the next stage's gradient of this stage's output
  // (empty on the last stage), `input_grad` receives the gradient of its input (empty on the first).
  // Adds to the gradients, as ForwardBackward.
  virtual absl::Status StageBackward(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                                     std::span<float> input_grad, bool train, uint64_t seed);
  // The floats of `input` and `output` (and their gradients) for `batch`: (b, t, hidden), or under
  // sequence parallelism this tensor rank's positions of each sample, (b, t / T, hidden), the
  // shards Megatron sends between stages.
  virtual int64_t StageExchangeFloats(const ModelBatch& batch) const {
    return batch.b * batch.t * config().hidden_size;
  }
  // The exchange the pipeline schedules run: slot's buffers for `batch`, which the schedule
  // receives into and sends from and StageForwardExchanged / StageBackwardExchanged read and write.
  // `device_memory`: the pipeline communicator sends device memory (device_collectives()); a
  // backend hands host memory otherwise. Lifetimes: slot k's input from its receive to its forward
  // (the schedule receives into a slot only after the backward of its previous micro-batch: a
  // backend may keep the input there for the backward); its output from its forward to its send
  // (until the slot's next forward); output_grad from its
  // receive to the slot's backward, input_grad from that backward to its send. A backend may hand
  // every slot the same output_grad / input_grad (one buffer, both of them): the schedule receives
  // an output gradient only after the previous input gradient went out. Sends and receives on
  // device memory are ordered with the passes by the stream alone (no host synchronisation).
  // This default stages through the host: fp32 host buffers (an input per slot, one each of the
  // others) and StageForward / StageBackward over them, what the CPU backend runs and the CUDA
  // backend's oracle (CudaModelOptions::unfused.pipeline_host_exchange).
  virtual absl::StatusOr<StageExchange> StageBuffers(const ModelBatch& batch, int slot, bool device_memory);
  // Megatron's interleaved schedule (layout().virtual_size model chunks): the chunk the stage calls
  // above and below work on from here on: its layers, its input (none for the first virtual
  // stage: chunk 0 of stage 0) and output (none for the last: chunk V - 1 of the last stage). A
  // slot holds one chunk's pass: the schedule gives each chunk slots of its own. 0 without chunks.
  absl::Status SelectChunk(int chunk);
  int chunk() const { return chunk_; }
  // The slots 0..slots-1 a schedule is about to use (InterleavedSlots), told before it takes any:
  // a backend that plans its activation slots up front (CUDA) makes room for them; slots live
  // then are refused. This default (slots made on first use) has nothing to do.
  virtual absl::Status ReserveStageSlots(int slots) {
    (void)slots;
    return absl::OkStatus();
  }
  // StageForward / StageBackward with slot's StageBuffers as input and output (and gradients).
  // With defer_loss the last stage keeps the loss for TakeLosses (as ForwardBackwardDeferred: a
  // backend may leave the pass enqueued) and returns zero.
  virtual absl::StatusOr<LossSum> StageForwardExchanged(const ModelBatch& batch, int slot,
                                                        std::optional<double> loss_scale, bool train, uint64_t seed,
                                                        std::vector<float>* logits = nullptr, bool defer_loss = false);
  virtual absl::Status StageBackwardExchanged(const ModelBatch& batch, int slot, bool train, uint64_t seed);
  // Sums the gradients [begin, begin + n) over `comm` (the embedding group's copies of the tied
  // word embeddings; sequence parallelism's partial gradients over the tensor group).
  virtual absl::Status AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n);
  // Sums the gradients of `ranges` (each within the parameters) over `comm` in one
  // collective: gathered into one contiguous buffer of the backend's (allocated once, kept for the
  // next call), all-reduced, scattered back. Each element gets the bits AllReduceGradRange gives
  // it wherever it lies in the buffer when the communicator adds in a fixed order per element
  // (gloo's: rank order; any communicator at two ranks, a + b being b + a); NCCL's ring at more than
  // two ranks may add an element in another order than a range of its own would.
  virtual absl::Status AllReduceGradRanges(Communicator* comm, std::span<const GradRange> ranges);
  // Sums the gradients of NonTensorParallelGradRanges (under --sequence-parallel each tensor rank's
  // positions' share, with --qk-layernorm the query and key norms' share of this rank's heads, with
  // multi-latent attention its down projections' and latent norms' share: what backward leaves) over the tensor group
  // in one all-reduce (AllReduceGradRanges), as Megatron's _allreduce_non_tensor_model_parallel_grads flattens them
  // into one buffer: TrainStep calls it once per step, after the data-parallel reduction. Under ZeRO-1 the whole ranges
  // are summed, as Megatron does, though only this rank's shard of them holds data-parallel sums (its tensor peers cut
  // the same shard). Nothing to do without any of them (sums_non_tensor_parallel_grads()).
  absl::Status SumNonTensorParallelGrads();
  bool sums_non_tensor_parallel_grads() const {
    return tensor_comm_ != nullptr && tensor_size() > 1 &&
           (sequence_parallel_ || config().qk_layernorm || config().mla());
  }
  // ZeRO-1: each rank's reduced piece of the gradients [begin, begin + n) (its shard's part, as
  // ReduceScatterGrads left it) to every rank of `comm`, so that the range holds the data-parallel
  // sums whole (a tied embedding copy, before the embedding group sums the stages' copies).
  virtual absl::Status AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n);

  // The optimizer step's pieces, on the backend's own buffers.
  // Sums the gradients over the communicator's ranks (every rank ends with the same bits).
  virtual absl::Status AllReduceGrads(Communicator* comm) = 0;
  // Sum of squares of all gradients, in double; the same bits for any thread count. Under tensor
  // parallelism this rank's part of the whole model's: its slices, and the tensors every tensor
  // rank holds whole counted on tensor rank 0 only (the caller sums it over the tensor group).
  virtual absl::StatusOr<double> GradSumSquares() = 0;
  // Scales the gradients of the range the model updates (all, or the shard's under ZeRO-1).
  virtual absl::Status ScaleGrads(double s) = 0;
  // AdamW over the range the model updates (every tensor, or their parts in the shard's range):
  // each tensor with its group's settings (AdamWGroups::Of: weight decay or none, --decoupled-lr's rate).
  virtual absl::Status AdamWUpdate(const AdamWGroups& groups) = 0;
  // The gradients scaled by grad_scale (unscaling and clipping), then AdamW: ScaleGrads (skipped
  // at 1) and AdamWUpdate by default; a backend may fold the scale into the update's one pass (the
  // same bits; the gradient buffer may then keep the unscaled gradients).
  virtual absl::Status ScaledAdamWUpdate(double grad_scale, const AdamWGroups& groups);

  // ---- ZeRO-1 (--use-distributed-optimizer). From this call on the model keeps AdamW's moments
  // for shard.begin()..shard.end() only (zero), and ScaleGrads / AdamWUpdate / Read/WriteMoments
  // work on that range. Once, before training and before moments are written.
  absl::Status ShardOptimizerState(const ParamShard& shard);
  const std::optional<ParamShard>& shard() const { return shard_; }
  int64_t moments_begin() const { return shard_ ? shard_->begin() : 0; }
  int64_t moments_size() const { return shard_ ? shard_->size() : ranges_sharded_ ? owned_size_ : num_params(); }
  // ZeRO-1 under expert parallelism (trainer/expert_shard.h, the CPU backend): from this call on the model keeps
  // AdamW's moments for `owned` only (ascending ranges of the buffer), packed in their order (zero), and
  // ScaleGrads / AdamWUpdate / Read/WriteMoments work on them; shard() stays empty (the gradients are summed
  // whole). Once, before training and before moments are written.
  absl::Status ShardOptimizerStateRanges(std::vector<GradRange> owned);
  bool ranges_sharded() const { return ranges_sharded_; }
  const std::vector<GradRange>& owned_ranges() const { return owned_; }
  // The shard's gradients summed over the ranks (Communicator::ReduceScatterSum: the bits
  // AllReduceGrads gives them); the other ranges keep this rank's own sums.
  virtual absl::Status ReduceScatterGrads(Communicator* comm) = 0;
  // Partial sums of squares (double) of the gradients in [begin, end), appended to `out` in order:
  // adding every rank's partials of its shard, rank after rank, from 0.0 gives GradSumSquares()'s
  // bits where the backend sums the same pieces (the CPU: fixed blocks of ParamShard::kAlignment,
  // so any rank count; CUDA: one partial per range, so one rank).
  virtual absl::Status GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) = 0;
  // Each rank's range of the (updated) parameters to every rank.
  virtual absl::Status AllGatherParams(Communicator* comm) = 0;

  // ---- --overlap-grad-reduce. Arms the next ForwardBackward (a step's last micro-batch): as its
  // backward finishes each bucket's gradients (buckets: contiguous ranges, e.g. MakeGradBuckets),
  // the bucket's reduction over `comm` starts, on a thread (host memory) or a stream (device
  // memory) of the backend's own: the sum AllReduceGrads makes, or under ZeRO-1 the shard pieces
  // ReduceScatterGrads makes, element for element the same. FinishGradReduction waits for every
  // bucket and returns the first error; call it after that ForwardBackward, failed or not.
  // buckets_launched_in_backward() counts the buckets launched while backward ran (all of them,
  // once backward has run to its end).
  absl::Status StartGradReduction(Communicator* comm, const std::vector<GradRange>& buckets);
  absl::Status FinishGradReduction();
  int buckets_launched_in_backward() const { return launched_in_backward_; }
  // With model chunks, whether the selected chunk's next backward is its last of the step (the
  // interleaved schedule says so before each): while a reduction is armed only that backward
  // reports its ranges ready, and only the chunk's own (its layers; the head's are the last
  // chunk's, the embeddings' the first's), so no bucket is launched before its last gradient.
  void SetLastBackwardOfChunk(bool last) { last_backward_of_chunk_ = last; }

  // With BackendOptions::profile on a backend that times its ops: GPU time per iteration by op
  // category, as lines of text; empty otherwise.
  virtual std::string ProfileReport() const { return ""; }

  // Waits until the work this model queued on its device is done (--timing-log-level's timers read
  // their clock after it, as Megatron's synchronise the device). The CPU backend's work is done when
  // its calls return: nothing to wait for.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

 protected:
  explicit GPTModel(ParamLayout layout) : layout_(std::move(layout)) {}
  // ShardOptimizerState's work in the backend: moments for the shard's range only, zeroed.
  virtual absl::Status ResizeMoments(const ParamShard& shard) = 0;
  // ShardOptimizerStateRanges' work: n moments, zeroed (backends without it refuse).
  virtual absl::Status ResizeMomentsPacked(int64_t n);

  // Backends call GradsReady(i) as their backward finishes range i of BackwardReadyOrder; while a
  // reduction is armed it launches every bucket that completes (LaunchBucket, which must not
  // block on the collective).
  void GradsReady(size_t index);
  virtual absl::Status BeginBucketReduction(const std::vector<GradRange>& buckets) = 0;
  virtual void LaunchBucket(int bucket, const GradRange& range) = 0;
  virtual absl::Status EndBucketReduction() = 0;  // every launched bucket done; the first error
  // One bucket of host-memory gradients (`grads` the whole buffer) over reduce_comm_: its sum, or
  // under ZeRO-1 each rank's piece of it.
  absl::Status ReduceHostBucket(float* grads, const GradRange& range);
  absl::Status ReduceExpertParallelBucket(float* grads, const GradRange& range);
  Communicator* reduce_comm_ = nullptr;  // while a reduction is armed

  // The selected chunk's part of the stage: whether it embeds the tokens / ends in the loss, its
  // layers [chunk_layer_begin(), chunk_layer_end()) of layout_.layers, and layer l's index in the
  // whole model (the dropout keys).
  bool chunk_pre_process() const { return layout_.ChunkPreProcess(chunk_); }
  bool chunk_post_process() const { return layout_.ChunkPostProcess(chunk_); }
  int64_t chunk_layer_begin() const { return chunk_ * layout_.chunk_layers(); }
  int64_t chunk_layer_end() const { return (chunk_ + 1) * layout_.chunk_layers(); }
  // The stage's transformer layers (every chunk's): GradsReady's indices are L - l for layer l,
  // L + 1 for the embeddings.
  int64_t stage_layers() const { return static_cast<int64_t>(layout_.layers.size()); }
  int64_t GlobalLayer(int64_t l) const {
    const int64_t n = layout_.chunk_layers();
    return layout_.chunk_first_layer.empty() ? layout_.first_layer + l
                                             : layout_.chunk_first_layer[static_cast<size_t>(l / n)] + l % n;
  }
  int chunk_ = 0;
  double moe_aux_loss_scale_ = 1.0;  // SetMoeAuxLossScale
  // SetMoeDataComm's group.
  Communicator* moe_data_comm_ = nullptr;
  double mtp_loss_scale_ = 1.0;  // SetMtpLossScale
  bool mtp_per_token_ = false;

  ParamLayout layout_;
  std::optional<ParamShard> shard_;
  std::vector<GradRange> owned_;  // ShardOptimizerStateRanges
  int64_t owned_size_ = 0;
  bool ranges_sharded_ = false;
  Communicator* tensor_comm_ = nullptr;
  Communicator* expert_comm_ = nullptr;
  Communicator* expert_data_comm_ = nullptr;
  bool sequence_parallel_ = false;  // with a tensor group of more than one rank

 private:
  std::vector<GradRange> non_tensor_parallel_ranges_;  // NonTensorParallelGradRanges, made at the first sum
  std::vector<GradRange> ready_order_;
  BucketTracker tracker_;
  int launched_in_backward_ = 0;
  bool last_backward_of_chunk_ = true;  // SetLastBackwardOfChunk
  LossSum deferred_;                    // ForwardBackwardDeferred's default
  // StageBuffers' default host buffers: each slot's input and output gradient; the output and the
  // input gradient.
  std::vector<std::vector<float>> stage_inputs_, stage_output_grads_;
  std::vector<float> stage_output_, stage_input_grad_;
};

// Checks a batch against the configuration (shape, token and position ids in range): a token id
// outside the vocabulary is a data error, found before any backend indexes memory with it.
absl::Status ValidateBatch(const GPTConfig& config, const ModelBatch& batch);

// AllReduceGradRanges' check: every range within [0, num_params) (InvalidArgument naming the one
// that is not); returns the elements they hold together.
absl::StatusOr<int64_t> CheckGradRanges(std::span<const GradRange> ranges, int64_t num_params);

}  // namespace ptk
