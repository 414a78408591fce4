// Megatron's GPT (pretrain_gpt.py with learned absolute positions, pre-LayerNorm blocks, GELU MLP,
// tied or untied output layer) as an fp32 CPU model: parameters and gradients in one flat buffer
// each (the all-reduce, the optimizer and checkpoints see one array), activations kept per layer
// for the backward pass.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk::trainer {

struct GPTConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t ffn_hidden_size = 0;  // Megatron's default: 4 * hidden_size
  int64_t seq_length = 0;
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;         // the tokenizer's
  int64_t padded_vocab_size = 0;  // rounded up to --make-vocab-size-divisible-by
  bool untie_embeddings_and_output_weights = false;
  double layernorm_epsilon = 1e-5;
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  double init_method_std = 0.02;
  bool recompute_activations = false;  // attention probabilities recomputed in backward (selective)

  absl::Status Validate() const;
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

// Megatron's _vocab_size_with_padding.
int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by);

struct ParamInfo {
  std::string name;  // Megatron-core's parameter name
  std::vector<int64_t> shape;
  int64_t offset = 0, size = 0;
  bool no_weight_decay = false;  // biases and LayerNorm parameters (1-D), as Megatron's param groups
  double init_std = 0.0;         // 0: constant init (see init_value)
  float init_value = 0.0f;
};

// One micro-batch as the model sees it: (b, t) tokens, labels, positions and loss mask, and the
// global position of each sample in the training stream (keys the dropout masks).
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
};

class GPTModel {
 public:
  static absl::StatusOr<std::unique_ptr<GPTModel>> Create(const GPTConfig& config);

  const GPTConfig& config() const { return config_; }
  const std::vector<ParamInfo>& params_info() const { return infos_; }
  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const ParamInfo* FindParam(const std::string& name) const;

  // Megatron's init: N(0, std) for weights, the two output projections of every layer with
  // std / sqrt(2 * layers), biases 0, LayerNorm weights 1. Deterministic in `seed`.
  void InitWeights(uint64_t seed);
  void ZeroGrads();

  // Forward and backward of one micro-batch: returns the masked loss sum and token count, and adds
  // d(loss_scale * sum(loss * mask)) to the gradients. `train` applies dropout (keyed by seed).
  absl::StatusOr<LossSum> ForwardBackward(const ModelBatch& batch, double loss_scale, bool train, uint64_t seed);
  // Forward only (evaluation, no dropout). With `logits`, the (b, t, padded vocab) logits are
  // copied out.
  absl::StatusOr<LossSum> Forward(const ModelBatch& batch, std::vector<float>* logits = nullptr);

  ~GPTModel();

 private:
  struct Activations;
  explicit GPTModel(const GPTConfig& config);
  absl::Status Prepare(const ModelBatch& batch);
  // Up to the logits.
  void RunForward(const ModelBatch& batch, bool train, uint64_t seed);
  // From the logits, which the loss step has turned into their gradient.
  void RunBackward(const ModelBatch& batch, bool train, uint64_t seed);

  GPTConfig config_;
  std::vector<ParamInfo> infos_;
  std::vector<float> params_, grads_;
  std::unique_ptr<Activations> act_;
};

}  // namespace ptk::trainer
