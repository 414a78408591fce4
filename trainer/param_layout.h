// The parameter layout every backend, checkpoints, interop/, ZeRO-1 (param_shard) and the gradient
// buckets share: the model's configuration and Megatron-core's parameter names, shapes, offsets in
// the one flat buffer, and init. It knows nothing of a backend or a model object, so the trainer's
// lower rooms (the shard, the buckets) need not reach up to the model for it. A tensor- or
// pipeline-parallel partition is meant to be a view of this table (which rank holds which slice of
// which tensor), not another table.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

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
  // Tensor parallelism (Megatron's partition): -1 every tensor rank holds the whole tensor
  // (LayerNorms, position embeddings, the row-parallel layers' biases); 0 each holds a slice of the
  // rows (vocabulary-parallel embedding and output layer, column-parallel QKV and fc1: weights and
  // biases); 1 a slice of the columns (row-parallel proj and fc2 weights). `shape` is the slice's.
  int tensor_split_dim = -1;
};

// Offsets of one transformer layer's tensors in the flat parameter (and gradient) buffer.
struct LayerParams {
  int64_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

// Where every parameter lives in the one flat buffer: Megatron-core's names and order, shared by
// every backend and by checkpoints.
struct ParamLayout {
  GPTConfig config;
  std::vector<ParamInfo> infos;
  std::vector<LayerParams> layers;
  int64_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;
  int64_t out_w = 0;  // == wte when the output layer is tied to the embedding
  int64_t num_params = 0;
  // This layout's tensor rank of tensor_size: the slices (ParamInfo::tensor_split_dim) it holds.
  int tensor_size = 1, tensor_rank = 0;

  // The whole model at tensor_size 1; tensor rank `tensor_rank`'s partition otherwise (heads, ffn
  // and the padded vocabulary must divide by tensor_size: InvalidArgument naming the flag).
  static absl::StatusOr<ParamLayout> Create(const GPTConfig& config, int tensor_size = 1, int tensor_rank = 0);
  const ParamInfo* Find(const std::string& name) const;
  // Megatron's init: N(0, std) for weights, the two output projections of every layer with
  // std / sqrt(2 * layers), biases 0, LayerNorm weights 1. Deterministic in `seed`; `out` holds
  // num_params floats.
  // A tensor rank's slice holds the elements of the whole model's init (the same bits), so any
  // tensor size starts from the same weights.
  void InitWeights(uint64_t seed, std::span<float> out) const;
  // Element `i` of parameter `info` (of this layout) as an element index of the whole tensor.
  int64_t WholeIndex(const ParamInfo& info, int64_t i) const;
};

// Copies between the whole model (`whole`, a tensor_size-1 layout's buffer) and one tensor rank's
// slices (`shard`, `shard_layout`'s buffer; the two layouts of one configuration).
void CopyToShard(const ParamLayout& shard_layout, std::span<const float> whole, std::span<float> shard);
void CopyFromShard(const ParamLayout& shard_layout, std::span<const float> shard, std::span<float> whole);

}  // namespace ptk
