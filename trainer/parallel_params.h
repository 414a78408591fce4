// How Megatron splits ptk's GPT over tensor and pipeline ranks, counted: the layers of each
// pipeline stage (even, or --decoder-first/last-pipeline-num-layers), the refusals of sizes that do
// not divide, and the number of parameters each (tensor, pipeline) rank holds, with Megatron's line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/param_layout.h"

namespace ptk {

// The transformer layers of each of `pipeline` stages: num_layers / P each, or with the first
// and/or last stage's count given, the rest split evenly over the middle stages (megatron-core's
// TransformerConfig checks). Usage errors in Megatron's terms when they do not divide.
absl::StatusOr<std::vector<int64_t>> PipelineStageLayers(int64_t num_layers, int pipeline,
                                                         std::optional<int64_t> first_stage_layers = std::nullopt,
                                                         std::optional<int64_t> last_stage_layers = std::nullopt);

// What Megatron refuses of a model at tensor size T: attention heads (and so the QKV columns) and
// the MLP's hidden size must divide by T. A usage error naming the flags.
absl::Status CheckTensorSplit(const GPTConfig& config, int tensor);

// The parameters one (tensor, pipeline) rank holds, as Megatron-core's GPTModel builds its stage
// (config.padded_vocab_size already padded for T): column-parallel QKV and fc1 weights and biases
// and row-parallel projection and fc2 weights split by T, their biases and the LayerNorms whole
// (the Llama line's shapes: grouped K/V heads, --kv-channels, SwiGLU's [gate; up] fc1, RMSNorm's
// weight alone, no biases under --disable-bias-linear, no position embeddings under RoPE);
// the first stage the word (its vocabulary slice) and position embeddings, the last the final
// LayerNorm and the output layer: its own copy of the word embeddings' slice when tied and P > 1,
// the untied output layer's slice when untied, nothing more when tied on one stage. With experts (one
// tensor rank) `moe_layers_on_stage` of the stage's layers hold a router and experts instead of the
// dense MLP (MoeLayersOnStage; -1: the model's MoE layers, for a stage holding every layer).
int64_t ParamsOnModelParallelRank(const GPTConfig& config, int tensor, int pipeline, int stage, int64_t layers_on_stage,
                                  int64_t moe_layers_on_stage = -1);

// A multi-latent attention layer's projections and latent norms (ParamLayout's mla_* tensors; linear_proj aside) on
// one of `tensor` ranks: the up projections (linear_q_proj without a q LoRA) split by heads, the rest whole.
int64_t MlaProjectionParams(const GPTConfig& config, int tensor = 1);

// " > number of parameters on (tensor, pipeline) model parallel rank (4, 0): 941594624"
std::string ParamCountLine(int tensor_rank, int pipeline_rank, int64_t num_params);

}  // namespace ptk
