// The CUDA model's class, declared for the four files that define it: setup, pass, state, ops.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "absl/status/statusor.h"
#include "common/status.h"
#include "trainer/cuda/adamw_table.h"
#include "trainer/cuda/cuda_common.h"
#include "trainer/cuda/cuda_gpt_model.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/mla_plan.h"
#include "trainer/cuda/moe_layer_cuda.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/cuda/pinned_buffer.h"
#include "trainer/gpt_model.h"

// Implementation details of the CUDA model, named only by its files.
namespace ptk::cuda::model_detail {

inline int64_t AlignUp(int64_t x) {
  return (x + MemoryPlan::kAlignment - 1) / MemoryPlan::kAlignment * MemoryPlan::kAlignment;
}

template <typename T>
constexpr Precision PrecisionOf() {
  if constexpr (std::is_same_v<T, float>)
    return Precision::kFp32;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return Precision::kBf16;
  else
    return Precision::kFp16;
}

// The member functions are defined in the four files by concern and instantiated there for float,
// __nv_bfloat16 and __half (each file's PTK_INSTANTIATE).
template <typename T>
class CudaGPTModelImpl final : public GPTModel {
 public:
  static constexpr bool kFlash = !std::is_same_v<T, float>;
  CudaGPTModelImpl(ParamLayout layout) : GPTModel(std::move(layout)) {}
  // Tensor parallelism: the group this rank's partition communicates over (NCCL: device
  // collectives on the compute stream); it must outlive the model.
  void SetTensorComm(Communicator* tensor) { tensor_comm_ = tensor; }
  // cuda_gpt_model.cpp, beside Init: what Init and the passes created, destroyed once the streams drain.
  ~CudaGPTModelImpl() override;

  // cuda_gpt_model.cpp: the device, its handles and the first plan.
  absl::Status Init(int device, bool deterministic, int64_t micro_batch_size, bool profile,
                    const CudaModelOptions& options);
  Device device() const override { return Device::kCuda; }
  Precision precision() const override { return PrecisionOf<T>(); }
  std::string Describe() const override;

  // cuda_gpt_model_state.cpp: what the step and checkpoints read and write, through the host.
  absl::Status ReadParams(std::span<float> out) const override;
  absl::Status ReadOwnedParams(std::span<float> out) const override;
  absl::Status WriteParams(std::span<const float> in) override;
  absl::Status ReadGrads(std::span<float> out) const override { return Download(plan_.grads, out, num_params()); }
  absl::Status ReadMoments(std::span<float> m, std::span<float> v) const override;
  absl::Status WriteMoments(std::span<const float> m, std::span<const float> v) override;
  absl::Status ZeroGrads() override;

  // cuda_gpt_model_pass.cpp.
  absl::StatusOr<LossSum> ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                          uint64_t seed) override;
  // The pass stays enqueued: its per-token losses go to a pinned slot of their own (an
  // asynchronous copy), and TakeLosses synchronises once for all the step's micro-batches.
  absl::Status ForwardBackwardDeferred(const ModelBatch& batch, double loss_scale, bool train, uint64_t seed) override;
  absl::StatusOr<LossSum> TakeLosses() override;
  absl::StatusOr<LossSum> Forward(const ModelBatch& batch, std::vector<float>* logits) override;

  // cuda_gpt_model_state.cpp: the collectives, the gradient norm, AdamW.
  absl::Status AllReduceGrads(Communicator* comm) override;
  absl::Status ReduceScatterGrads(Communicator* comm) override;
  absl::Status GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) override;
  absl::Status AllGatherParams(Communicator* comm) override;
  absl::StatusOr<double> GradSumSquares() override;
  // Sum of squares of the gradients [offset, offset + count), synchronised.
  absl::StatusOr<double> SumSquaresOf(int64_t offset, int64_t count);
  absl::Status ScaleGrads(double s) override;
  // One launch over the table of the pieces this rank updates, the gradient scale folded in.
  absl::Status ScaledAdamWUpdate(double grad_scale, const AdamWGroups& groups) override;
  absl::Status AdamWUpdate(const AdamWGroups& groups) override;

  // cuda_gpt_model_ops.cpp.
  std::string ProfileReport() const override;
  // The compute stream and the gradient buckets' stream drained (Megatron's torch.cuda.synchronize).
  absl::Status Synchronize() override;

  // cuda_pipeline_stage.cpp: the model as one pipeline stage (layout().pipeline_size > 1).
  absl::StatusOr<LossSum> StageForward(const ModelBatch& batch, int slot, std::span<const float> input,
                                       std::span<float> output, std::optional<double> loss_scale, bool train,
                                       uint64_t seed, std::vector<float>* logits) override;
  absl::Status StageBackward(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                             std::span<float> input_grad, bool train, uint64_t seed) override;
  // The direct exchange: the slot's residual stream (its first layer's input, its last layer's
  // output) and the residual gradient, in T on the device, sent and received on the compute stream;
  // the host exchange (GPTModel's fp32 host buffers and StageForward / StageBackward) under
  // CudaModelOptions::unfused.pipeline_host_exchange or a host communicator.
  absl::StatusOr<StageExchange> StageBuffers(const ModelBatch& batch, int slot, bool device_memory) override;
  absl::StatusOr<LossSum> StageForwardExchanged(const ModelBatch& batch, int slot, std::optional<double> loss_scale,
                                                bool train, uint64_t seed, std::vector<float>* logits,
                                                bool defer_loss) override;
  absl::Status StageBackwardExchanged(const ModelBatch& batch, int slot, bool train, uint64_t seed) override;
  // Under --sequence-parallel this tensor rank's positions of each sample, (b, t / T, hidden):
  // the residual stream's rows it keeps, which cross the stage boundary as Megatron sends them.
  int64_t StageExchangeFloats(const ModelBatch& batch) const override {
    return batch.b * (sequence_parallel_ ? batch.t / tensor_size() : batch.t) * config().hidden_size;
  }
  absl::Status AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n) override;
  absl::Status AllReduceGradRanges(Communicator* comm, std::span<const GradRange> ranges) override;
  absl::Status AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n) override;

 protected:
  // cuda_gpt_model_state.cpp.
  // Re-planned with the padded parameter buffers and the shard's moments (zero); the parameters
  // come back through the host.
  absl::Status ResizeMoments(const ParamShard& shard) override;
  // --overlap-grad-reduce. Each bucket, once the compute stream has enqueued its last gradient
  // op, is marked by an event; with NCCL the communication stream waits for the event and runs the
  // collective on the device buffer, with a host communicator (gloo) a thread waits for it, copies
  // the bucket out, reduces it and copies it back. Finishing makes the compute stream wait for all.
  absl::Status BeginBucketReduction(const std::vector<GradRange>& buckets) override;
  void LaunchBucket(int bucket, const GradRange& range) override;
  absl::Status EndBucketReduction() override;
  // On the worker thread: one bucket through the host.
  absl::Status HostBucket(int bucket);

 private:
  // Views of the planned device memory.
  // A pipeline stage's activations (resid through lnf_stats) are those of the selected slot.
  template <typename U>
  U* Buf(int index) const {
    if (slot_ > 0 && index >= plan_.resid && index <= plan_.lnf_stats)
      return reinterpret_cast<U*>(arena_ + plan_[plan_.pipeline_slots].offset + (slot_ - 1) * plan_.slot_bytes +
                                  (plan_[index].offset - plan_[plan_.resid].offset));
    return reinterpret_cast<U*>(arena_ + plan_[index].offset);
  }
  float* Master(int64_t offset) const { return Buf<float>(plan_.master) + offset; }
  // The fp32 master of the parameter at `offset` of the flat layout, which AdamW updates: under a
  // sharded master (bf16/fp16 with ZeRO-1) inside this rank's shard only.
  float* MasterOf(int64_t offset) const {
    return plan_.master_sharded ? Buf<float>(plan_.master) + (offset - master_begin_) : Master(offset);
  }
  // A norm's fp32 weight or bias (`offset` is the tensor's start in the flat layout; -1, RMSNorm's
  // absent bias: null).
  const float* Ln(int64_t offset) const {
    if (offset < 0) return nullptr;
    if (!plan_.master_sharded) return Master(offset);
    return Buf<float>(plan_.ln_master) + LnCompactOffset(offset);
  }
  // A norm's weight as its kernel multiplies by it: Ln(offset), or under --apply-layernorm-1p
  // 1 + that weight (norm_eff, which RefreshNormWeights fills at each forward pass's start).
  const float* LnW(int64_t offset) const {
    if (plan_.norm_eff < 0) return Ln(offset);
    return Buf<float>(plan_.norm_eff) + LnCompactOffset(offset);
  }
  absl::Status RefreshNormWeights() {
    if (plan_.norm_eff < 0) return absl::OkStatus();
    for (const LayerNormRun& r : ln_runs_)  // a run's biases get 1 too there: only LnW reads norm_eff
      PTK_RETURN_IF_ERROR(Op("layernorm", "norm weights 1 + gamma",
                             AddWeightOffset(Buf<float>(plan_.norm_eff) + r.compact, Ln(r.begin), r.end - r.begin,
                                             config().norm_weight_offset(), ctx_)));
    return absl::OkStatus();
  }
  int64_t LnCompactOffset(int64_t offset) const {
    for (const LayerNormRun& r : ln_runs_)
      if (offset >= r.begin && offset < r.end) return r.compact + (offset - r.begin);
    PTK_CHECK_MSG(false, fmt::format("parameter offset {} is no LayerNorm's", offset));
    return 0;
  }
  // A tensor's gradient; null for one the configuration leaves out (offset -1: biases under
  // --disable-bias-linear, the position table under rotary or no position embeddings).
  float* Grad(int64_t offset) const { return offset < 0 ? nullptr : Buf<float>(plan_.grads) + offset; }
  // The weights the products read: the master itself in fp32 mode, its rounded copy otherwise (null
  // for an absent tensor, as Grad).
  T* Compute(int64_t offset) const {
    if (offset < 0) return nullptr;
    if constexpr (kFlash)
      return Buf<T>(plan_.compute) + offset;
    else
      return Master(offset);
  }
  // Layer `layer` of the stage (the selected model chunk's: a slot holds the layers
  // [chunk_layer_begin(), chunk_layer_end()] of one chunk, the residual stream's one more).
  T* Act(int index, int64_t layer, int64_t per_layer) const {
    return Buf<T>(index) + (layer - chunk_layer_begin()) * per_layer;
  }
  float* Stats(int index, int64_t layer) const {
    return Buf<float>(index) + (layer - chunk_layer_begin()) * 2 * plan_.n;
  }
  // Layer l's place among the slot's layers (the per-layer buffers the memory plan keeps).
  int64_t SlotLayer(int64_t l) const { return l - chunk_layer_begin(); }
  // Dense layer `layer`'s MLP fc1 or activation (plan_.fc1, plan_.gelu): the plan keeps them for the slot's dense
  // layers only, in order (a MoE layer keeps its own in moe_saved).
  T* MlpAct(int index, int64_t layer, int64_t per_layer) const {
    return Buf<T>(index) + (SlotLayer(layer) - MoeLayersIn(config(), chunk_layer_begin(), layer)) * per_layer;
  }

  // cuda_gpt_model_ops.cpp: each op through Op, each synchronisation through Sync.
  // An error here may come from any op enqueued since the last synchronisation (kernels fault
  // asynchronously): without PTK_CUDA_SYNC_OPS the message says how to find the op.
  absl::Status Sync(std::string_view what) const;
  // --ptk-profile-ops: an event after each op; at each synchronisation the time between
  // consecutive events is added to the op's category. Begin() starts a sequence (the time before it,
  // the host's, is nobody's). With PTK_CUDA_SYNC_OPS=1 (CudaModelOptions::sync_ops) every op is
  // followed by a synchronisation, and the first error names the op (`name`), its shapes and layer.
  void Begin();
  absl::Status Op(const char* category, const char* name, absl::Status status);
  // "op fc1+gelu (n=4096 x c=768 -> 3072) of layer 3 of 12, a 4x1024 micro-batch, bf16, cuda:0".
  std::string OpWhere(const char* name) const;
  void RecordMark(const char* category);
  void CollectProfile() const;

  // cuda_gpt_model_state.cpp: copies between the host and the planned buffers.
  absl::Status CheckSize(std::string_view what, size_t got, int64_t want) const;
  absl::Status Download(int index, std::span<float> out, int64_t want) const;
  absl::Status Upload(int index, std::span<const float> in, int64_t want);
  // `count` floats of buffer `index` from element `at`.
  absl::Status DownloadRange(int index, float* out, int64_t at, int64_t count) const;
  // Under a sharded master: the gradient buffer holds every fp32 parameter (gathered, or written);
  // this rank's shard of the master, the LayerNorms' fp32 copy and the compute copy are taken from
  // it. The buffer keeps the weights until the next step's ZeroGrads (TrainStep zeroes it before
  // every accumulation): no second pass over it per step. On the stream; the caller synchronises.
  absl::Status TakeParamsFromGrads(std::string_view what);
  // AllGatherParams under a sharded master: every rank's updated shard of the fp32 master is
  // gathered into the gradient buffer (the step no longer needs the gradients), from which the
  // compute copy is cast and the LayerNorms' fp32 copy taken, as with a whole master.
  absl::Status GatherShardedMaster(Communicator* comm);
  absl::Status UploadRange(int index, const float* in, int64_t at, int64_t count);

  // cuda_pipeline_stage.cpp.
  // The stage's transformer layers (all of them without pipeline parallelism).
  int64_t StageLayers() const { return static_cast<int64_t>(layout().layers.size()); }
  static constexpr int kMaxSlots = 64;  // slots_live_ has a bit per slot
  absl::Status SelectSlot(int slot, std::string_view what);
  // The device memory planned for `batch`: re-planned when it is larger than planned, refused while
  // another slot's activations are in flight (a re-plan keeps the parameters only); the inputs
  // received into slots ahead of their forward passes (slots_received_) are carried across it
  // (PlanStageReplan decides).
  absl::Status PlanStage(const ModelBatch& batch, int slot, std::string_view what);
  // The received inputs of `slots` (slot_inputs_ elements each, the slot's first residual layer)
  // copied to the host, in the current plan; then, after a re-plan, back into the new one.
  absl::Status CarryInputs(const std::vector<int>& slots, std::vector<std::vector<char>>* kept, bool back);
  // From now on the host exchange (bf16/fp16: pipeline_exchange planned, a re-plan, refused while
  // any slot's activations are in flight).
  absl::Status UseHostExchange(std::string_view what);
  // A stage's passes; `direct`: the input and the output gradient are already in the slot's
  // buffers and the output and input gradient stay there (StageBuffers), the spans unused;
  // otherwise they come and go as host spans.
  // defer_loss: the last stage's losses kept for TakeLosses (KeepLosses), zero returned.
  absl::StatusOr<LossSum> StageForwardPass(const ModelBatch& batch, int slot, std::span<const float> input,
                                           std::span<float> output, bool direct, std::optional<double> loss_scale,
                                           bool train, uint64_t seed, std::vector<float>* logits, bool defer_loss);
  absl::Status StageBackwardPass(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                                 std::span<float> input_grad, bool direct, bool train, uint64_t seed);
  // The fp32 host activation (n_, hidden) to a T device buffer and back, through pipeline_exchange.
  absl::Status ExchangeIn(T* dst, std::span<const float> host, std::string_view what);
  absl::Status ExchangeOut(std::span<float> host, const T* src, std::string_view what);
  // The interleaved schedule's slots (ReserveStageSlots): room made for them, refused while any
  // slot's activations are in flight.
  absl::Status ReserveStageSlots(int slots) override;
  // With model chunks, the slot's output gradient (the next stage's, received before the slot's
  // backward; several may wait): copied into dresid when the backward starts.
  T* OutputGrad(int slot) const {
    return Buf<T>(plan_.pipeline_output_grads) +
           static_cast<int64_t>(slot) *
               AlignUp(ExchangeRows() * config().hidden_size * static_cast<int64_t>(sizeof(T))) /
               static_cast<int64_t>(sizeof(T));
  }
  // The residual stream's rows on this rank (its positions under sequence parallelism).
  int64_t ExchangeRows() const { return sequence_parallel_ ? plan_.n / tensor_size() : plan_.n; }
  // The slot's final-norm gradient (the last stage's LM head leaves it in dln).
  T* HeadGrad(int slot) const {
    return Buf<T>(plan_.pipeline_head_grads) +
           static_cast<int64_t>(slot) * AlignUp(plan_.n * config().hidden_size * static_cast<int64_t>(sizeof(T))) /
               static_cast<int64_t>(sizeof(T));
  }

  // cuda_gpt_model.cpp.
  // (Re)plans the device memory for (b, t) and allocates it in one piece; the parameters, gradients
  // and moments (the plan's first buffers, whose offsets do not depend on the shape) move along.
  absl::Status Plan(int64_t b, int64_t t);
  // What Plan asks of the memory plan for (b, t): the shape, the stage's slots and chunks, the
  // parallel layouts, the scratch the ops ask for (cuDNN's workspace queried).
  absl::StatusOr<PlanOptions> PlanOptionsFor(int64_t b, int64_t t);
  // Checks the batch, re-plans when it is larger than planned, and copies its inputs (tokens,
  // labels, positions, the per-token loss weights, the dropout streams) through pinned memory.
  absl::Status Prepare(const ModelBatch& batch, double loss_scale, bool dropout);

  // The micro-batch's inputs on the device (Prepare).
  const int32_t* Tokens() const { return Buf<int32_t>(plan_.inputs); }
  const int32_t* Labels() const { return Buf<int32_t>(plan_.inputs) + AlignUp(n_ * 4) / 4; }
  const int32_t* Positions() const { return Buf<int32_t>(plan_.inputs) + 2 * AlignUp(n_ * 4) / 4; }
  const float* LossWeights() const {
    return reinterpret_cast<const float*>(Buf<int32_t>(plan_.inputs) + 3 * AlignUp(n_ * 4) / 4);
  }
  const uint64_t* Streams(int64_t layer, int64_t site) const {
    return Buf<uint64_t>(plan_.streams) + StreamIndex(layer, site, b_);
  }

  // This rank's attention shape for the micro-batch: its query heads and query groups (MLA: its head widths, scale).
  AttentionShape Shape() const { return ShapeFor(b_, t_); }
  AttentionShape ShapeFor(int64_t b, int64_t t) const {
    const GPTConfig& cf = config();
    const int64_t nh = cf.num_attention_heads / tensor_size();
    if (cf.mla()) return AttentionShape{b, t, nh, cf.mla_q_head_dim(), nh, cf.v_head_dim, cf.MlaSoftmaxScale()};
    return AttentionShape{b, t, nh, cf.head_dim(), cf.query_groups() / tensor_size()};
  }
  // The attention output's width (proj's input): heads x the value heads' width.
  static int64_t OutWidth(const AttentionShape& s) { return s.nh * s.v_dim(); }
  // Layer l's core attention: Shape() with Megatron's sliding window where the layer has it, and (fp32: the model
  // refuses it in bf16/fp16, CreateModel) the softmax offset, learnable's parameter (its gradient when `backward`) or
  // off-by-one's zeros (plan_.sink_zeros).
  AttentionShape LayerShape(int64_t l, bool backward) const {
    const GPTConfig& cf = config();
    AttentionShape s = Shape();
    if (cf.window_layer(GlobalLayer(l))) s.window = cf.window_left;
    const int64_t offset = layout().layers[static_cast<size_t>(l)].softmax_offset;
    if (!kFlash && offset >= 0) {
      s.sink = Master(offset);
      if (backward) s.dsink = Grad(offset);
    } else if (!kFlash && cf.softmax_sink()) {
      s.sink = Buf<float>(plan_.sink_zeros);
    }
    return s;
  }
  bool Rms() const { return config().normalization == Normalization::kRMSNorm; }
  // RoPE's fp32 tables (cos, then sin: plan_.t x rotary dim / 2 each), uploaded by Plan.
  const float* RopeCos() const { return Buf<float>(plan_.rope_tables); }
  const float* RopeSin() const { return RopeCos() + plan_.t * (config().rotary_dim() / 2); }
  // --qk-layernorm: layer l's query and key norm statistics (per token and normalised head, the
  // planned n apart, as Stats): LayerNorm's mean (null under RMSNorm) and rstd. Per layer of the slot
  // (SlotLayer: a model chunk's slot holds its own layers only, as Act and Stats index them).
  // --qk-l2-norm keeps rstd alone, as RMSNorm (QKCentred false).
  bool QKCentred() const { return !Rms() && !config().qk_l2_norm; }
  float* QKMean(int64_t l) const {
    return !QKCentred() ? nullptr : Buf<float>(plan_.qk_stats) + SlotLayer(l) * plan_.qk_stats_per_layer;
  }
  float* QKRstd(int64_t l) const {
    return Buf<float>(plan_.qk_stats) + SlotLayer(l) * plan_.qk_stats_per_layer +
           (QKCentred() ? plan_.n * plan_.qk_rows : 0);
  }

  // cuda_gpt_model_pass.cpp.
  absl::Status Dropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed);
  // The configuration's norm (rows n_, hidden c; the statistics: mean at stats, rstd at stats + n_)
  // of resid_out = a + b, written to resid_out; of a itself when b is null (resid_out unused).
  // LayerNorm takes the fused dropout `drop` of b; RMSNorm never has one (FusedDropout).
  absl::Status NormForward(const char* name, T* resid_out, T* out, float* stats, const T* a, const T* b, int64_t w,
                           int64_t bias, const LnDropout& drop);
  // A transformer layer's fc1 and its activation: GELU in the product's epilogue, or SwiGLU after it.
  absl::Status Fc1Forward(int64_t l);
  // Up to the final LayerNorm's output.
  absl::Status RunForward(bool train, uint64_t seed);
  absl::Status AttentionFwd(T* atty, const T* qkv, int64_t l, const AttentionShape& shape, double ap, uint64_t seed);
  // A transformer layer's fused QKV product over ln1's output (gathered whole under sequence
  // parallelism), the query and key norms (--qk-layernorm: the product kept in qkv_raw[l], its
  // normalised copy in qkv[l]), RoPE where the model has it, and attention into atty[l] (proj's input).
  absl::Status SelfAttentionForward(int64_t l, double ap, uint64_t seed);
  // The LM head and the loss, chunk by chunk of rows. With backward, each chunk's logits become
  // their gradient at once and flow back into the final LayerNorm's gradient (dln) and the output
  // weight's gradient; without, the losses (and, when asked, the logits) are all that is kept.
  absl::Status RunHead(bool backward, std::vector<float>* logits_out);
  // Tensor parallelism: x(rows, c) summed over the tensor group (NCCL on the compute stream, in
  // fp32 through plan_.tp_sum; with summed_in_fp32 the fp32 partial is already there), then
  // rounded to T with a bias (a row-parallel product's, added once) or the position embeddings
  // added (bias, positions/wpe may be null).
  absl::Status TensorSum(T* x, int64_t rows, int64_t c, const T* bias, const int32_t* positions, const T* wpe,
                         bool summed_in_fp32 = false);
  // The vocabulary-parallel cross-entropy of a chunk of rows of this rank's logits slice (with
  // dlosses the slice becomes its gradient): maxima all-gathered, sums and target logits
  // all-reduced over the tensor group.
  absl::Status VocabParallelLoss(T* logits, float* losses, const int32_t* labels, const float* dlosses, int64_t rows);
  // cuda_sequence_parallel.cpp: --sequence-parallel (sequence_parallel_), the two passes above with
  // the norms, hidden dropout and residual stream on this rank's rows (SeqRows), the gathers and
  // reduce-scatters around the products.
  absl::Status RunForwardSequenceParallel(bool train, uint64_t seed);
  absl::Status RunBackwardSequenceParallel(bool train, uint64_t seed);
  // This rank's rows: positions [r·t/T, (r+1)·t/T) of each of the b samples, (b, t/T, c) in order.
  int64_t SeqRows() const { return n_ / tensor_size(); }
  // The staging buffer (sp_stage) as T, and this rank's slot in it (where a gather starts).
  T* SeqSlot() const { return Buf<T>(plan_.sp_stage) + tensor_rank() * SeqRows() * config().hidden_size; }
  // whole (n, c) = this rank's rows `local` (b, t/T, c) gathered from every rank in sample order.
  absl::Status SeqGather(T* whole, const T* local);
  // local = this rank's rows of whole (n, c) (or of the fp32 whole_f32 when given) summed over the
  // group in fp32, rounded to T with the bias and the position embeddings (may be null) added.
  absl::Status SeqReduceScatter(T* local, const T* whole, const float* whole_f32, const T* bias, const T* wpe);
  // Hidden dropout of (layer, site) on this rank's rows, each element keyed by its place in the sample.
  absl::Status SeqDropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed);
  // A norm's forward on this rank's rows (resid_out = a + b first when b is given; stats: mean at
  // stats, rstd at stats + n_, as the unsharded pass keeps them), its output gathered whole into out.
  absl::Status SeqNormForward(const char* name, T* resid_out, T* out, float* stats, const T* a, const T* b, int64_t w,
                              int64_t bias);
  // The gradient of whole (n, c) partial sums dpartial reduce-scattered to this rank's rows (into dln's
  // first rows), then the norm's backward on them: dresid += the input gradient, the weight (and
  // bias) gradients of this rank's rows added to the gradients (summed over the group later).
  absl::Status SeqNormBackward(const char* name, T* dpartial, const T* inp, float* stats, int64_t w, int64_t bias);
  // cuda_context_parallel.cpp: --context-parallel-size (context_comm_): each sample's t_ rows are this rank's
  // positions (ContextParallelPositions); the attention all-gathers the group's QKV rows and runs this rank's
  // queries over the whole samples (ContextAttentionForward, fp32 rows: fp32, and bf16/fp16 with attention dropout
  // or query groups, their rows widened and the output narrowed; ContextFlash: bf16/fp16's cuDNN pairs merged in
  // fp32, context_flash.h), backward exchanges the key and value gradients' shares (fp32) and adds them in rank
  // order (ContextAttentionBackward or the pairs' AddContextFlashPairGrads, then AddContextShares); hidden dropout
  // keyed by true position (ContextDropout).
  bool cp() const { return context_comm_ != nullptr; }
  // bf16/fp16 context parallelism without attention dropout or query groups: cuDNN's pairs of chunks (unless the
  // rows attention is asked for as their oracle).
  bool ContextFlash() const {
    return kFlash && cp() && !unfused_.context_rows_attention && config().attention_dropout == 0 &&
           config().query_groups() == config().num_attention_heads;
  }
  int64_t ContextSize() const { return cp() ? context_comm_->size() : 1; }
  // The keys a query row attends over: the whole sample's positions.
  int64_t KeyPositions() const { return t_ * ContextSize(); }
  // Where layer l's saved attention lies in attn_saved (floats): ContextFlash's log-sum-exps (2, b, heads, t/2) of
  // every layer, else the rows path's probabilities (b, heads, t, KeyPositions) of the layer (one with recompute).
  int64_t ContextSavedOffset(int64_t l, const AttentionShape& shape) const {
    if (ContextFlash()) return SlotLayer(l) * b_ * shape.nh * t_;
    return (config().recompute_activations ? 0 : SlotLayer(l)) * b_ * shape.nh * t_ * KeyPositions();
  }
  absl::Status SetContext(Communicator* context);
  // atty may be null on the rows path in bf16/fp16 (backward's recomputation: the probabilities alone). probs: the
  // rows path's probabilities, or ContextFlash's merged log-sum-exps (2, b, heads, t/2). Backward's `out` is the
  // layer's output (ContextFlash's pairs read it; the rows path does not).
  absl::Status ContextAttnFwd(T* atty, float* probs, const T* qkv, const AttentionShape& shape, double ap,
                              uint64_t seed, const uint64_t* streams);
  absl::Status ContextAttnBwd(T* dqkv, const T* datt, const T* out, const T* qkv, const float* probs,
                              const AttentionShape& shape, double ap, uint64_t seed, const uint64_t* streams);
  absl::Status ContextFlashFwd(T* atty, float* stats, const AttentionShape& shape);
  absl::Status ContextFlashBwd(float* dq, float* shares, const T* datt, const T* out, const float* stats,
                               const AttentionShape& shape);
  absl::Status ContextRowsBwd(float* dq, float* shares, float* received, const T* datt, const T* qkv,
                              const float* probs, const AttentionShape& shape, double ap, uint64_t seed,
                              const uint64_t* streams);
  // Hidden dropout of rows [row0, row0 + rows) of this rank's positions of each sample, x (b_, rows, hidden).
  absl::Status ContextDropout(T* x, int64_t row0, int64_t rows, int64_t layer, int64_t site, double p, uint64_t seed);
  // The group's QKV rows into plan_.cp_gathered as fp32 (its rank-ordered pieces), on the compute stream:
  // bf16/fp16 rows gathered as they are (half the bytes) through cp_whole's room, then widened (ContextFlash: kept
  // in the activation type in cp_gathered).
  absl::Status GatherContextRows(const T* qkv, int64_t piece);
  // This rank's positions (context_positions_), every rank's (cp_positions) and RoPE's tables for this rank's
  // positions (Plan).
  absl::Status UploadContextTables();
  // dtmp (n, c) = the gradient of a branch's output: this rank's residual gradient with the branch's
  // dropout mask, gathered whole; the branch's row-parallel bias (at `bias`, -1 none) gets the
  // column sums of this rank's rows of it.
  absl::Status SeqBranchGrad(int64_t l, int64_t site, double p, uint64_t seed, int64_t bias);

  // cuda_moe_model.cpp: a mixture-of-experts layer's MLP (GPTConfig::moe_layer, moe_layer_cuda.h) from ln2[l]
  // into tmp, its training pass's load-balancing and z-loss values added to moe_aux_sum_ and moe_z_sum_; its
  // backward from dmlp into dln (assigned, as MlpBackward's), the router's and experts' gradients added to.
  absl::Status MoeMlpForward(int64_t l, bool train);
  MoeWeights<T> MoeWeightsOf(const LayerParams& lp) const;  // the layer's router, experts and shared experts
  MoeLayerSpec MoeSpec() const;                             // the pass's MoE layer shape (seq_aux_loss: t_ each)
  MoeBalanceLosses TakeMoeBalanceLosses() override;         // seq_aux_loss's values since the last call
  MoeBalanceLosses moe_balance_sums_;
  // cuda_moe_bias.cpp: --moe-router-enable-expert-bias, per layer of the stage on the host: the bias (E) and the
  // tokens each expert got since the last step (moe_balance.cpp's state); the update and the checkpoint buffers.
  std::vector<std::pair<std::vector<float>, std::vector<double>>> moe_bias_;
  std::pair<std::vector<float>, std::vector<double>>& MoeBiasOf(int64_t l);
  std::string ExpertBiasName(int64_t l) const;
  absl::Status FinishMoeStep() override;
  ModelBuffers ReadBuffers() const override;
  absl::Status WriteBuffers(const ModelBuffers& in) override;
  absl::Status MoeMlpBackward(int64_t l, const T* dmlp);
  std::vector<MoeLayerHost> moe_host_;  // per layer of the stage: what the forward left for backward
  double moe_aux_sum_ = 0, moe_z_sum_ = 0;

  // cuda_mla_layer.cpp: multi-latent attention (cpu_mla_layer.cpp's) from ln1[l] into qkv[l]; backward from dqkv
  // into dln (assigned), gradients added to; a latent norm (backward assigns dinp); the rotary tables (Plan).
  absl::Status MlaQkvForward(int64_t l);
  absl::Status MlaQkvBackward(int64_t l, const T* dqkv);
  absl::Status UploadMlaRope();
  MlaShape MlaShapeNow() const;
  absl::Status MlaNormForward(T* out, float* stats, const T* inp, int64_t w, int64_t bias, int64_t c, const char* name);
  absl::Status MlaNormBackward(T* dinp, const T* dout, const T* inp, const float* stats, int64_t w, int64_t bias,
                               int64_t c, const char* name);

  // cuda_gpt_model_backward.cpp.
  // From the final LayerNorm's output gradient (dln, left by RunHead) down to the embeddings.
  absl::Status RunBackward(bool train, uint64_t seed);
  // A layer's MLP backward, from the gradient of its output (dmlp) to fc1's input gradient in dln;
  // fc2's bias gradient from dmlp unless `fc2_bias` is false (sequence parallelism: SeqBranchGrad's).
  absl::Status MlpBackward(int64_t l, const T* dmlp, bool fc2_bias = true);
  // A layer's attention backward, from the gradient of its output (dproj) through the output
  // projection, attention, RoPE and the query and key norms to the QKV product's input gradient in
  // dln; the projection's bias gradient from dproj unless `proj_bias` is false (as MlpBackward's).
  absl::Status AttentionBranchBackward(int64_t l, const T* dproj, double ap, uint64_t seed, bool proj_bias = true);
  // The gradient a residual branch's backward starts from: the residual gradient itself where no
  // dropout runs on the branch's output (its product reads it before the LayerNorm's backward adds
  // to it), else a copy with the dropout mask applied. CudaModelOptions::unfused.residual_grad_copy
  // copies in every case (the oracle).
  absl::StatusOr<const T*> BranchGrad(const T* dresid, T* dtmp, size_t bytes, int64_t l, int64_t site, double p,
                                      uint64_t seed);
  // LayerNormBackward, or its rows-in-series oracle (CudaModelOptions::unfused); with `drop`'s p > 0
  // also the dropped branch's gradient into dbranch. Under RMSNorm, RMSNormBackward (db and mean
  // unused; scratch taken as doubles; never a dbranch).
  absl::Status LnBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w, const float* mean,
                          const float* rstd, int64_t n, int64_t c, float* scratch, const CudaContext& ctx,
                          T* dbranch = nullptr, const LnDropout& drop = {});
  // Hidden dropout of (layer, site) fused into a LayerNorm kernel: none where p is 0 or the unfused
  // pass runs (CudaModelOptions::unfused.dropout_pass).
  // RMSNorm's kernels take no dropout: its hidden dropout runs as its own pass.
  // Context parallelism keys each row by its true position: the pass of its own (ContextDropout).
  bool FuseDropout(double p) const { return p > 0.0 && !unfused_.dropout_pass && !Rms() && !cp(); }
  LnDropout FusedDropout(int64_t layer, int64_t site, double p, uint64_t seed) const {
    if (!FuseDropout(p)) return {};
    return LnDropout{Streams(layer, site), t_, p, seed};
  }
  absl::Status AttentionBwd(T* dqkv, const T* datt, int64_t l, const AttentionShape& shape, double ap, uint64_t seed);
  // From attention's input gradient dqkv (in place) to the QKV product's output gradient: RoPE's
  // inverse rotation, then --qk-layernorm's backward (its weights' and biases' gradients added:
  // this rank's heads' share, summed over the tensor group by SumNonTensorParallelGrads).
  absl::Status QkvInputBackward(T* dqkv, int64_t l, const AttentionShape& shape);
  // The masked loss sum and token count, summed on the host exactly as the CPU model does.
  absl::StatusOr<LossSum> Losses(const ModelBatch& batch);
  // The per-token losses copied to a pinned slot of their own (asynchronously), with the batch's
  // mask, for TakeLosses.
  absl::Status KeepLosses(const ModelBatch& batch);
  static LossSum SumLosses(const float* host, std::span<const float> mask);

  CudaContext ctx_;
  mutable GemmFallbacks fallbacks_;  // ctx_.fallbacks
  std::string device_name_;
  MemoryPlan plan_;
  char* arena_ = nullptr;
  // The micro-batch inputs in two pinned slots, used in turn: a slot is refilled once the copy
  // out of it (recorded by its event) has run, so the host need not wait for the previous pass.
  Pinned pinned_[2], losses_;
  cudaEvent_t inputs_copied_[2] = {nullptr, nullptr};
  int input_slot_ = 0;
  // ForwardBackwardDeferred's per-token losses (a pinned slot per pending micro-batch) and masks.
  std::vector<std::unique_ptr<Pinned>> loss_slots_;
  std::vector<std::vector<float>> pending_masks_;
  size_t pending_losses_ = 0;
  int64_t b_ = 0, t_ = 0, n_ = 0;
  // A pipeline stage: the slot whose activations the pass uses (Buf), the slots holding a forward
  // pass whose backward has not run (bit k: slot k).
  int slot_ = 0;
  uint64_t slots_live_ = 0;
  bool host_exchange_ = false;  // the host exchange (UseHostExchange)
  int reserved_slots_ = 0;      // ReserveStageSlots' (0: 1F1B's P - s)
  // The slots handed out to receive their input (StageBuffers) whose forward pass has not run yet
  // (bit k: slot k), and the elements each receives.
  uint64_t slots_received_ = 0;
  std::vector<int64_t> slot_inputs_ = std::vector<int64_t>(kMaxSlots, 0);
  std::vector<std::pair<int64_t, int64_t>> slot_shapes_;  // each live slot's (b, t)
  const int32_t* tokens_host_ = nullptr;
  const int32_t* positions_host_ = nullptr;
  std::vector<uint64_t> flash_keys_;
  std::vector<float> host_grads_;           // host staging for a host-memory communicator (gloo)
  int64_t padded_params_ = 0;               // ZeRO-1's plan (PlanOptions)
  Communicator* context_comm_ = nullptr;    // CudaModelOptions::context with several ranks (null: none)
  std::vector<int64_t> context_positions_;  // this context rank's positions of a sample (UploadContextTables)
  // --overlap-grad-reduce: the communication stream, an event per bucket, the host thread (gloo).
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t comm_done_ = nullptr;
  std::vector<cudaEvent_t> bucket_events_;
  std::vector<GradRange> buckets_;
  std::unique_ptr<BucketWorker> worker_;
  absl::Status launch_error_;
  int64_t moment_params_ = -1;
  // The shard whose fp32 master this rank keeps when plan_.master_sharded.
  int64_t master_begin_ = 0, master_size_ = 0;
  // The LayerNorms' parameters as runs of the flat layout, each at `compact` in ln_master.
  std::vector<LayerNormRun> ln_runs_ = LayerNormRuns(layout());
  EmbeddingBackwardPlan embedding_plan_;
  bool profile_ = false;
  bool sync_ops_ = false;            // PTK_CUDA_SYNC_OPS=1: CudaModelOptions::sync_ops
  int64_t logits_budget_bytes_ = 0;  // CudaModelOptions::logits_budget_bytes (0: the plan's default)
  CudaModelOptions::Unfused unfused_;
  // The multi-tensor AdamW table (adamw_table.h) on the device; built at the first update.
  AdamWChunk* adamw_table_ = nullptr;
  int64_t adamw_table_size_ = -1;
  bool adamw_table_qk_wd_ = false;  // the --apply-wd-to-qk-layernorm the table's groups were chosen with
  // What OpWhere names: the layer being run (-1: none), the LM head's chunk of rows.
  int64_t layer_ = -1, head_row0_ = 0, head_rows_ = 0;
  int64_t profiled_steps_ = 0;
  mutable std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  mutable std::vector<cudaEvent_t> free_events_;
  mutable std::map<std::string, double> op_ms_;
};

}  // namespace ptk::cuda::model_detail
