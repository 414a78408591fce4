// The CPU model as one pipeline stage: a micro-batch's pass over this stage's layers, from the
// previous stage's output to the next stage's input, activations kept per slot until its backward.
#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cpu/tensor_parallel_cpu.h"

namespace ptk {

absl::Status CpuGPTModel::SelectSlot(int slot) {
  // The interleaved schedule hands a chunk's slots out as its activations arrive, which may be
  // before an earlier slot's first forward: the slots up to this one are made.
  if (slot < 0 || slot >= (1 << 16))
    return absl::InvalidArgumentError(fmt::format("activation slot {}: {} made so far", slot, slots_.size()));
  while (slot >= static_cast<int>(slots_.size())) slots_.push_back(std::make_unique<Activations>());
  act_ = slots_[static_cast<size_t>(slot)].get();
  return absl::OkStatus();
}

int64_t CpuGPTModel::StageExchangeFloats(const ModelBatch& batch) const {
  // Sequence parallelism: this tensor rank's positions of each sample (Megatron's shards).
  return batch.b * batch.t * config().hidden_size / (sequence_parallel_ ? tensor_size() : 1);
}

namespace {
absl::Status CheckActivation(const char* what, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("{}: {} floats where this stage exchanges {}", what, got, want));
}
}  // namespace

absl::StatusOr<LossSum> CpuGPTModel::StageForward(const ModelBatch& batch, int slot, std::span<const float> input,
                                                  std::span<float> output, std::optional<double> loss_scale, bool train,
                                                  uint64_t seed, std::vector<float>* logits) {
  PTK_RETURN_IF_ERROR(SelectSlot(slot));
  PTK_RETURN_IF_ERROR(Prepare(batch));
  const bool dropout = train && (config().hidden_dropout > 0 || config().attention_dropout > 0);
  if (dropout && !batch.sample_keys) return absl::InvalidArgumentError("dropout needs the samples' keys");
  Activations& a = *act_;
  const int64_t n = batch.b * batch.t, nc = StageExchangeFloats(batch);
  PTK_RETURN_IF_ERROR(CheckActivation("StageForward input", input.size(), chunk_pre_process() ? 0 : nc));
  PTK_RETURN_IF_ERROR(CheckActivation("StageForward output", output.size(), chunk_post_process() ? 0 : nc));
  if (!chunk_pre_process()) std::copy(input.begin(), input.end(), a.resid[chunk_layer_begin()].begin());
  moe_aux_sum_ = moe_z_sum_ = 0;  // this chunk's MoE layers' load-balancing and z-losses (every stage its own)
  PTK_RETURN_IF_ERROR(RunForward(batch, train, seed));
  LossSum aux;
  aux.load_balancing_loss = moe_aux_sum_;
  aux.z_loss = moe_z_sum_;
  if (!chunk_post_process()) {
    const std::vector<float>& out = a.resid[chunk_layer_end()];
    std::copy(out.begin(), out.end(), output.begin());
    return aux;
  }
  if (logits && tp())  // the whole rows, gathered from the ranks' slices (text samples)
    PTK_RETURN_IF_ERROR(cpu::GatherVocabParallelLogits(a.logits.data(), n, config().padded_vocab_size / tensor_size(),
                                                       tensor_comm_, logits));
  else if (logits)
    *logits = a.logits;
  if (!loss_scale) {
    PTK_RETURN_IF_ERROR(Loss(batch, nullptr));
    return SumLosses(a.losses, batch.loss_mask, n);
  }
  // The fused loss leaves the logits' gradient in place for StageBackward (as ForwardBackward).
  for (int64_t i = 0; i < n; ++i) a.dloss[i] = static_cast<float>(batch.loss_mask[i] * *loss_scale);
  PTK_RETURN_IF_ERROR(Loss(batch, a.dloss.data()));
  LossSum s = SumLosses(a.losses, batch.loss_mask, n);
  // Multi-token prediction on the last stage (megatron-core's default placement): the depths' forward and
  // backward now, the decoder output's gradient kept for the slot's StageBackward.
  if (config().mtp_num_layers > 0) PTK_RETURN_IF_ERROR(MtpStageForwardBackward(batch, slot, train, seed, &s));
  s.load_balancing_loss = moe_aux_sum_;  // the depths' MoE layers' too
  s.z_loss = moe_z_sum_;
  return s;
}

absl::Status CpuGPTModel::StageBackward(const ModelBatch& batch, int slot, std::span<const float> output_grad,
                                        std::span<float> input_grad, bool train, uint64_t seed) {
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    return absl::InvalidArgumentError(fmt::format("StageBackward: slot {} holds no forward pass", slot));
  PTK_RETURN_IF_ERROR(SelectSlot(slot));
  Activations& a = *act_;
  if (a.b != batch.b || a.t != batch.t || a.chunk != chunk_)
    return absl::InvalidArgumentError(
        "StageBackward: the batch is not the shape (or the model chunk) of the slot's forward pass");
  const int64_t nc = StageExchangeFloats(batch);
  PTK_RETURN_IF_ERROR(
      CheckActivation("StageBackward output gradient", output_grad.size(), chunk_post_process() ? 0 : nc));
  PTK_RETURN_IF_ERROR(CheckActivation("StageBackward input gradient", input_grad.size(), chunk_pre_process() ? 0 : nc));
  if (!chunk_post_process()) std::copy(output_grad.begin(), output_grad.end(), a.dresid.begin());
  dlnf_extra_ = MtpSlotGrad(slot);
  const absl::Status backward = RunBackward(batch, train, seed);
  dlnf_extra_ = nullptr;
  PTK_RETURN_IF_ERROR(backward);
  if (!chunk_pre_process()) std::copy(a.dresid.begin(), a.dresid.end(), input_grad.begin());
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AllReduceGradRange(Communicator* comm, int64_t begin, int64_t n) {
  if (begin < 0 || n < 0 || begin + n > num_params())
    return absl::InvalidArgumentError(
        fmt::format("AllReduceGradRange: [{}, {}) of {} parameters", begin, begin + n, num_params()));
  return comm->AllReduceSum(grads_.data() + begin, n);
}

absl::Status CpuGPTModel::AllReduceGradRanges(Communicator* comm, std::span<const GradRange> ranges) {
  PTK_ASSIGN_OR_RETURN(const int64_t total, CheckGradRanges(ranges, num_params()));
  if (total == 0) return absl::OkStatus();
  if (static_cast<int64_t>(coalesced_grads_.size()) < total) coalesced_grads_.resize(static_cast<size_t>(total));
  float* buf = coalesced_grads_.data();
  for (const GradRange& g : ranges) buf = std::copy_n(grads_.data() + g.begin, g.size(), buf);
  PTK_RETURN_IF_ERROR(comm->AllReduceSum(coalesced_grads_.data(), total));
  const float* in = coalesced_grads_.data();
  for (const GradRange& g : ranges) {
    std::copy_n(in, g.size(), grads_.data() + g.begin);
    in += g.size();
  }
  return absl::OkStatus();
}

absl::Status CpuGPTModel::AllGatherGradRange(Communicator* comm, int64_t begin, int64_t n) {
  if (!shard()) return absl::FailedPreconditionError("AllGatherGradRange needs a sharded optimizer state");
  if (begin < 0 || n < 0 || begin + n > num_params())
    return absl::InvalidArgumentError(
        fmt::format("AllGatherGradRange: [{}, {}) of {} parameters", begin, begin + n, num_params()));
  // The ranks' ranges ascend: their pieces of [begin, begin + n) lie in rank order.
  std::vector<int64_t> bytes = shard()->CountsIn(begin, begin + n);
  for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
  return comm->AllGather(grads_.data() + begin, bytes);
}

}  // namespace ptk
