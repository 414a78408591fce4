// The fp32 CPU backend of GPTModel: the oracle every other backend is checked against. Parameters,
// gradients and AdamW moments in host vectors (one flat buffer each, the layout's order);
// activations kept per layer for the backward pass.
#pragma once

#include <memory>
#include <vector>

#include "trainer/gpt_model.h"

namespace ptk {
namespace cpu {  // trainer/cpu/moe_cpu.h
struct MoeSettings;
template <typename T>
struct MoeActivations;
}  // namespace cpu

class CpuGPTModel final : public GPTModel {
 public:
  // With `tensor` (a group of several ranks): this rank's partition of the model (Megatron's tensor
  // parallelism: ParamLayout::Create's slices), its layers communicating over `tensor`, which must
  // outlive the model.
  // With `sequence_parallel` as well (Megatron's --sequence-parallel): LayerNorm, dropout and the
  // residual stream on this rank's part of each sample's positions (seq_length / T of them),
  // all-gathered before the column-parallel products and reduce-scattered after the row-parallel
  // ones; the norms' and the row-parallel biases' gradients are this rank's positions' (GPTModel::sequence_parallel).
  // With `stage` (several stages): that pipeline stage's part of the model (ParamLayout::Create),
  // trained through StageForward / StageBackward.
  // With `expert` (a group of several ranks, Megatron's expert-parallel group): this expert rank's experts of
  // each MoE layer (ParamLayout::Create's), the tokens dispatched over `expert` (expert_parallel_cpu.h); their
  // gradients are reduced over `expert_data` (GPTModel::expert_data_comm). Both must outlive the model.
  static absl::StatusOr<std::unique_ptr<CpuGPTModel>> Create(const GPTConfig& config, Communicator* tensor = nullptr,
                                                             bool sequence_parallel = false,
                                                             const PipelineStage& stage = {},
                                                             Communicator* expert = nullptr,
                                                             Communicator* expert_data = nullptr);
  ~CpuGPTModel() override;
  // Context parallelism (Megatron's --context-parallel-size, its allgather exchange): each batch
  // holds this rank's positions of its samples (ContextParallelPositions over `context`'s ranks:
  // batch.t = seq_length / C rows of a sample); the attention all-gathers the queries', keys' and
  // values' rows of the whole sequence over `context`, which must outlive the model, and runs over
  // all of it (the causal mask, RoPE and dropout by true position), backward reduce-scattering
  // their gradients. Under --sequence-parallel the tensor ranks split the context rank's positions.
  absl::Status SetContextParallel(Communicator* context);

  // The host buffers themselves (tests and the gradient checks read and poke them).
  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  // The floats of the activation buffers, as the last pass sized them for its micro-batch: what is
  // kept for backward and the transient buffers (tests compare the sequence-parallel footprint).
  int64_t ActivationFloats() const;
  // The floats ActivationFloats counts after a pass over a micro-batch of `micro_batch_size`
  // sequences of the configuration's length, for the largest of the layout's model chunks, without
  // building the model: what one activation slot of a run will hold (the memory check before the
  // model is made, trainer/memory_estimate.h).
  // With `context` ranks: one context rank's, its batches' seq_length / context rows of a sample.
  static int64_t PlanActivationFloats(const ParamLayout& layout, bool sequence_parallel, int64_t micro_batch_size,
                                      int context = 1);
  // The multi-token prediction depths' buffers (mtp_cpu.cpp) on a layout that holds them (the last stage's): each
  // depth's one-layer pass and its own vectors, kept once beside the slots (a depth's forward and backward run
  // together), and the decoder output's kept gradient (this rank's positions' with `sequence_parallel`). 0 without
  // depths.
  static int64_t PlanMtpActivationFloats(const ParamLayout& layout, int64_t micro_batch_size,
                                         bool sequence_parallel = false);

  Device device() const override { return Device::kCpu; }
  Precision precision() const override { return Precision::kFp32; }
  std::string Describe() const override { return "cpu fp32"; }

  absl::Status ReadParams(std::span<float> out) const override;
  absl::Status WriteParams(std::span<const float> in) override;
  absl::Status ReadGrads(std::span<float> out) const override;
  absl::Status ReadMoments(std::span<float> exp_avg, std::span<float> exp_avg_sq) const override;
  absl::Status WriteMoments(std::span<const float> exp_avg, std::span<const float> exp_avg_sq) override;

  absl::Status ZeroGrads() override;
  MoeBalanceLosses TakeMoeBalanceLosses() override;  // moe_balance.cpp
  absl::Status FinishMoeStep() override;
  ModelBuffers ReadBuffers() const override;
  absl::Status WriteBuffers(const ModelBuffers& in) override;
  absl::StatusOr<LossSum> ForwardBackward(const ModelBatch& batch, double loss_scale, bool train,
                                          uint64_t seed) override;
  absl::StatusOr<LossSum> Forward(const ModelBatch& batch, std::vector<float>* logits = nullptr) override;
  absl::StatusOr<LossSum> StageForward(const ModelBatch& batch, int slot, std::span<const float> input,
                                       std::span<float> output, std::optional<double> loss_scale, bool train,
                                       uint64_t seed, std::vector<float>* logits = nullptr) override;
  absl::Status StageBackward(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                             std::span<float> input_grad, bool train, uint64_t seed) override;
  absl::Status AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n) override;
  absl::Status AllReduceGradRanges(Communicator* comm, std::span<const GradRange> ranges) override;
  absl::Status AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n) override;
  int64_t StageExchangeFloats(const ModelBatch& batch) const override;
  // The activation slots allocated so far (the most micro-batches a schedule kept in flight).
  int activation_slots() const { return static_cast<int>(slots_.size()); }

  absl::Status AllReduceGrads(Communicator* comm) override;
  absl::StatusOr<double> GradSumSquares() override;
  absl::Status ScaleGrads(double s) override;
  absl::Status AdamWUpdate(const AdamWGroups& groups) override;
  absl::Status ReduceScatterGrads(Communicator* comm) override;
  absl::Status GradSumSquaresPartials(int64_t begin, int64_t end, std::vector<double>* out) override;
  absl::Status AllGatherParams(Communicator* comm) override;

 protected:
  absl::Status ResizeMoments(const ParamShard& shard) override;
  absl::Status ResizeMomentsPacked(int64_t n) override;
  // --overlap-grad-reduce: a communication thread reduces each bucket as backward completes it.
  absl::Status BeginBucketReduction(const std::vector<GradRange>& buckets) override;
  void LaunchBucket(int bucket, const GradRange& range) override;
  absl::Status EndBucketReduction() override;

 private:
  struct Activations;
  explicit CpuGPTModel(ParamLayout layout);
  absl::Status Prepare(const ModelBatch& batch);
  // The activation buffers of model chunk `chunk`'s pass over a (b, t) micro-batch: sized in `a`
  // when it is given, and counted (floats), so that what a run is said to need is what Prepare makes.
  // `context`: the context ranks, each with t rows of a sample (the attention's buffers span t × context).
  static int64_t SizeActivations(const ParamLayout& layout, int chunk, bool sequence_parallel, int64_t b, int64_t t,
                                 int64_t context, Activations* a);
  // Up to the logits (this rank's vocabulary slice under tensor parallelism).
  absl::Status RunForward(const ModelBatch& batch, bool train, uint64_t seed);
  // From the logits, which the loss step has turned into their gradient.
  absl::Status RunBackward(const ModelBatch& batch, bool train, uint64_t seed);
  // The loss of the logits (and with `dloss` their gradient in place).
  absl::Status Loss(const ModelBatch& batch, const float* dloss);
  // Tensor parallelism: sums a (n, c) partial over the tensor group (a row-parallel product's
  // output, a column-parallel product's input gradient); nothing at one tensor rank.
  absl::Status TensorSum(float* x, int64_t count);
  bool tp() const { return tensor_size() > 1; }
  // Layer l's attention backward, shared by both passes: from act_->datt (the attention output's
  // gradient, this rank's heads) to act_->dqkv (the QKV product's), the probabilities recomputed
  // under --recompute-activations, context-parallel or not, through RoPE and the QK norms.
  absl::Status LayerAttentionBackward(int64_t l, const LayerParams& lp, const AttentionShape& shape, double ap,
                                      uint64_t seed);
  // Layer l's core attention: `shape` with the layer's sliding window (GPTConfig::window_layer) and softmax offset
  // (off-by-one's zeros, learnable's softmax_offset parameter, and with `backward` its gradient).
  AttentionShape CoreAttentionShape(const AttentionShape& shape, int64_t l, const LayerParams& lp, bool backward);
  std::vector<float> zero_sink_;  // --softmax-type off-by-one's offsets (this rank's heads)
  // Sequence parallelism's passes (sequence_parallel_cpu.cpp) and their collectives: this rank's
  // rows of a (b, t, c) buffer to and from the whole; a partial whole summed into this rank's rows.
  absl::Status RunForwardSequenceParallel(const ModelBatch& batch, bool train, uint64_t seed);
  absl::Status RunBackwardSequenceParallel(const ModelBatch& batch, bool train, uint64_t seed);
  absl::Status GatherRows(const float* local, float* whole, const ModelBatch& batch, int64_t c);
  absl::Status ReduceScatterRows(const float* whole, float* local, const ModelBatch& batch, int64_t c);
  // A norm's backward on this rank's rows: its weight and bias gradients of those rows added to
  // the gradients (TrainStep sums them over the group once the data-parallel reduction is done).
  // Context parallelism's attention (context_parallel_cpu.cpp): out (b, t, heads) of this rank's
  // rows from its qkv rows (b, t, qkv width) and the other context ranks'; backward the qkv rows'
  // gradients, this rank's and the others' shares summed over the context group.
  bool cp() const { return context_comm_ != nullptr; }
  absl::Status ContextAttentionForward(float* out, float* probs, const float* qkv, const AttentionShape& shape,
                                       double p, uint64_t seed);
  absl::Status ContextAttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                                        const AttentionShape& shape, double p, uint64_t seed);
  // This rank's qkv rows gathered with the others' into act_->cp_qkv, the whole samples' order.
  absl::Status GatherContextRows(const float* qkv, int64_t b, int64_t t, int64_t w);
  // A mixture-of-experts layer's MLP (cpu_moe_layer.cpp): from x (n rows: act_->ln2[l], or its rows gathered
  // over the tensor group) into act_->tmp, the
  // training pass's load-balancing loss added to moe_aux_sum_ (with context ranks its counts the
  // group's, summed over context_comm_) and its z-loss to moe_z_sum_; backward from act_->dtmp, ln2's output
  // gradient assigned to act_->dln. With tensor ranks (sequence parallelism) every rank routes all n rows, its
  // experts' ffn slice gives a partial output (summed by the caller's reduce-scatter); backward leaves the partial
  // input gradient in act_->dln, the router's (from x_router: x with the other ranks' rows zeroed, so its weight
  // gradient is this rank's rows' share, summed over the group as the norms') in act_->dtmp.
  absl::Status MoeMlpForward(int64_t l, const LayerParams& lp, const float* x, int64_t n, bool train);
  absl::Status MoeMlpBackward(int64_t l, const LayerParams& lp, const float* x, const float* x_router, bool train);
  // Sequence parallelism's MoE backward (sequence_parallel_cpu.cpp): from act_->dtmp to act_->dln (n rows).
  absl::Status MoeBackwardRows(int64_t l, const LayerParams& lp, const ModelBatch& batch, bool train);
  double moe_aux_sum_ = 0, moe_z_sum_ = 0;
  // Load balancing beyond aux_loss (moe_balance.cpp): per layer the expert bias and the tokens its experts got
  // since the last update (aux-loss-free routing), global_aux_loss's counts summed over the step's micro-batches
  // and their number; the step's seq_ and global_load_balancing_loss sums (TakeMoeBalanceLosses).
  struct MoeBalanceState {
    std::vector<float> expert_bias;
    std::vector<double> tokens, global_counts;
    double global_steps = 0;
  };
  std::vector<MoeBalanceState> balance_;
  MoeBalanceLosses balance_sums_;
  MoeBalanceState& BalanceOf(int64_t l);
  // A training pass's MoE layer l after its router (m routed): the counts kept, the seq_ and global_aux_loss's
  // values added and their gradients (without the step's scale) put in m->balance_grad.
  absl::Status MoeBalanceForward(int64_t l, cpu::MoeActivations<float>* m, const cpu::MoeSettings& s);
  // Megatron's names of the expert biases, by layer (empty where a layer has none).
  std::string ExpertBiasName(int64_t l) const;
  // The layers with balance state: the stage's, then the multi-token prediction depths' (index layers + k), and
  // layer l's router (-1: dense). moe_layer_offset_: a depth's pass's index of its layer 0 (MtpSwap's).
  int64_t BalanceLayers() const;
  int64_t RouterOf(int64_t l) const;
  int64_t moe_layer_offset_ = 0;
  // A multi-latent attention layer's projections (cpu_mla_layer.cpp): act_->qkv[l] (the core attention's
  // per-head query, key and value of this rank's heads) from x (act_->ln1[l], or its rows gathered under sequence
  // parallelism); backward from act_->dqkv, x's gradient (this rank's heads' share with tensor ranks) assigned to
  // act_->dln. PrepareMla makes the rotary tables of the batch's length.
  void MlaQkvForward(int64_t l, const LayerParams& lp, const float* x);
  void MlaQkvBackward(int64_t l, const LayerParams& lp, const float* x);
  void PrepareMla(int64_t t);
  // Multi-token prediction (mtp_cpu.cpp): after the main loss, each depth's forward, loss and backward; leaves
  // the decoder output's gradient from the first depth in dlnf_extra_, which RunBackward adds to the final
  // norm's output gradient (a depth's pass: the next depth's). mtp_pass_: a depth's pass (no embedding).
  struct MtpState;
  class MtpSwap;
  absl::Status MtpForwardBackward(const ModelBatch& batch, bool train, uint64_t seed, LossSum* s);
  absl::Status MtpForward(const ModelBatch& batch, bool train, uint64_t seed, LossSum* s);
  absl::Status MtpBackward(const ModelBatch& batch, bool train, uint64_t seed);
  // A last pipeline stage's depths after micro-batch `slot`'s loss: the decoder output's gradient kept for the
  // slot's StageBackward (MtpSlotGrad; null without depths or on another stage).
  absl::Status MtpStageForwardBackward(const ModelBatch& batch, int slot, bool train, uint64_t seed, LossSum* s);
  const float* MtpSlotGrad(int slot) const;
  // Tensor parallelism: the depth's vocabulary-parallel embedding and column-parallel eh_proj (its output gathered).
  absl::Status MtpEmbed(float* out, const int32_t* tokens, const int32_t* positions, int64_t n);
  // Under sequence parallelism eh_proj's input gathered over the positions and its output scattered to them.
  absl::Status MtpProjForward(int64_t k, const ModelBatch& batch);  // depth k's
  absl::Status MtpProjBackward(int64_t k, const ModelBatch& batch);
  absl::Status MtpDepthInput(int64_t k, const ModelBatch& bk, double p, uint64_t seed, const float* hin);
  std::shared_ptr<MtpState> mtp_;
  bool mtp_pass_ = false;
  // --overlap-grad-reduce: a depth's pass runs RunBackward on its own one-layer layout, whose ranges are not the
  // model's; the depths' gradients (and their share of the word embeddings') are complete before the decoder's
  // backward, whose GradsReady(0) (the final norm to the end: every depth's tensors) and embeddings mark them.
  void GradsReady(size_t index);  // mtp_cpu.cpp
  const float* dlnf_extra_ = nullptr;
  absl::Status LayerNormBackwardRows(float* dinp, int64_t w, int64_t b, const float* dout, const float* inp,
                                     const float* mean, const float* rstd, int64_t rows);

  std::vector<float> params_, grads_, exp_avg_, exp_avg_sq_;
  Communicator* context_comm_ = nullptr;    // SetContextParallel's group (null: none)
  std::vector<int64_t> context_positions_;  // this context rank's positions of a sample (Prepare's)
  std::vector<float> coalesced_grads_;      // AllReduceGradRanges' buffer, grown to the largest call's
  // One set of activations per micro-batch in flight (pipeline schedules); act_ is the pass's.
  std::vector<std::unique_ptr<Activations>> slots_;
  Activations* act_ = nullptr;
  absl::Status SelectSlot(int slot);
  std::unique_ptr<BucketWorker> worker_;
  std::vector<GradRange> buckets_;  // the armed reduction's
};

}  // namespace ptk
