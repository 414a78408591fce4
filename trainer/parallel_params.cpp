// Megatron's split of ptk's GPT over tensor and pipeline ranks, counted.
#include "trainer/parallel_params.h"

#include <fmt/format.h>

#include "common/status.h"

namespace ptk {

absl::StatusOr<std::vector<int64_t>> PipelineStageLayers(int64_t num_layers, int pipeline,
                                                         std::optional<int64_t> first_stage_layers,
                                                         std::optional<int64_t> last_stage_layers) {
  if (pipeline < 1)
    return UsageError(fmt::format("--pipeline-model-parallel-size must be at least 1, not {}", pipeline));
  if (num_layers < 1) return UsageError(fmt::format("--num-layers must be at least 1, not {}", num_layers));
  if (!first_stage_layers && !last_stage_layers) {
    if (num_layers % pipeline != 0)
      return UsageError(fmt::format(
          "--num-layers {} is not divisible by --pipeline-model-parallel-size {} (Megatron: number of layers "
          "should be divisible by the pipeline parallel size; or give --decoder-first-pipeline-num-layers / "
          "--decoder-last-pipeline-num-layers)",
          num_layers, pipeline));
    return std::vector<int64_t>(static_cast<size_t>(pipeline), num_layers / pipeline);
  }
  if (pipeline == 1)
    return UsageError(
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
        "--pipeline-model-parallel-size above 1");
  int64_t middle_layers = num_layers;
  int middle_stages = pipeline;
  for (auto [given, flag] : {std::pair{first_stage_layers, "--decoder-first-pipeline-num-layers"},
                             std::pair{last_stage_layers, "--decoder-last-pipeline-num-layers"}}) {
    if (!given) continue;
    if (*given <= 0) return UsageError(fmt::format("{} must be larger than 0, not {}", flag, *given));
    middle_layers -= *given;
    --middle_stages;
  }
  if (middle_layers < 0)
    return UsageError(fmt::format(
        "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers take more than --num-layers {}",
        num_layers));
  if ((middle_layers != 0) != (middle_stages != 0))
    return UsageError(fmt::format("--num-layers {} leaves {} middle layers for {} middle pipeline stages", num_layers,
                                  middle_layers, middle_stages));
  if (middle_stages > 0 && middle_layers % middle_stages != 0)
    return UsageError(fmt::format(
        "--num-layers {} leaves {} layers for the middle stages, not divisible by the {} middle pipeline stages",
        num_layers, middle_layers, middle_stages));
  std::vector<int64_t> layers(static_cast<size_t>(pipeline), middle_stages ? middle_layers / middle_stages : 0);
  if (first_stage_layers) layers.front() = *first_stage_layers;
  if (last_stage_layers) layers.back() = *last_stage_layers;
  return layers;
}

absl::Status CheckTensorSplit(const GPTConfig& c, int tensor) {
  if (tensor < 1) return UsageError(fmt::format("--tensor-model-parallel-size must be at least 1, not {}", tensor));
  if (c.num_attention_heads % tensor != 0)
    return UsageError(fmt::format(
        "--num-attention-heads {} is not divisible by --tensor-model-parallel-size {} (each tensor rank takes "
        "whole heads)",
        c.num_attention_heads, tensor));
  const int64_t ffn = c.ffn_hidden_size > 0 ? c.ffn_hidden_size : 4 * c.hidden_size;
  if (ffn % tensor != 0)
    return UsageError(
        fmt::format("--ffn-hidden-size {} is not divisible by --tensor-model-parallel-size {}", ffn, tensor));
  if (c.query_groups() % tensor != 0)
    return UsageError(fmt::format(
        "--num-query-groups {} is not divisible by --tensor-model-parallel-size {} (each tensor rank takes whole "
        "query groups)",
        c.query_groups(), tensor));
  return absl::OkStatus();
}

int64_t MlaProjectionParams(const GPTConfig& c, int tensor) {
  const int64_t h = c.hidden_size, heads = c.num_attention_heads / tensor, qr = c.q_lora_rank, kvr = c.kv_lora_rank;
  const int64_t norm = c.normalization == Normalization::kRMSNorm ? 1 : 2;  // a norm's tensors per channel
  const int64_t q_rows = heads * c.mla_q_head_dim();
  const int64_t q = qr > 0 ? qr * h + q_rows * qr + (c.qk_layernorm ? norm * qr : 0) : q_rows * h;
  return q + (kvr + c.qk_pos_emb_head_dim) * h + heads * (c.qk_head_dim + c.v_head_dim) * kvr +
         (c.qk_layernorm ? norm * kvr : 0);
}

int64_t ParamsOnModelParallelRank(const GPTConfig& c, int tensor, int pipeline, int stage, int64_t layers_on_stage,
                                  int64_t moe_layers_on_stage) {
  PTK_CHECK(tensor >= 1 && pipeline >= 1 && stage >= 0 && stage < pipeline);
  PTK_CHECK(c.padded_vocab_size % tensor == 0);
  const int64_t h = c.hidden_size, t = tensor;
  const int64_t ffn = c.ffn_hidden_size > 0 ? c.ffn_hidden_size : 4 * h;
  const int64_t norm = c.normalization == Normalization::kRMSNorm ? h : 2 * h;  // RMSNorm has no bias
  const int64_t qkv = c.qkv_rows();               // query heads plus a key and a value head per group
  const int64_t attention = c.attention_width();  // the projection's input
  const int64_t fc1 = (c.swiglu ? 2 : 1) * ffn;   // SwiGLU's fc1: [gate; up]
  const int64_t bias = c.add_bias_linear ? 1 : 0;
  // --qk-layernorm: the query and the key norm over head_dim channels, whole on every tensor rank.
  const int64_t qk_norms = c.qk_layernorm ? 2 * (norm / h) * c.head_dim() : 0;
  // Multi-latent attention holds its projections and latent norms in place of QKV's (its heads' up projections).
  const int64_t qkv_part =
      c.mla() ? MlaProjectionParams(c, tensor) : qkv * h / t + (c.qkv_bias() ? qkv / t : 0) + qk_norms;
  const int64_t layer = norm                            // input norm
                        + qkv_part                      // column-parallel QKV, query and key norms
                        + h * attention / t + bias * h  // row-parallel projection, bias whole
                        + norm                          // pre-MLP norm
                        + fc1 * h / t + bias * fc1 / t  // column-parallel fc1
                        + h * ffn / t + bias * h;       // row-parallel fc2, bias whole
  const int64_t vocab_slice = c.padded_vocab_size / t * h;
  int64_t n = layers_on_stage * layer;
  if (c.learnable_softmax()) n += layers_on_stage * (c.num_attention_heads / t);  // softmax_offset, split by heads
  if (c.moe()) {  // each MoE layer's router (whole) and experts (each split over the tensor ranks, as the MLP)
    PTK_CHECK(moe_layers_on_stage >= 0 || layers_on_stage == c.num_layers);
    const int64_t moe = moe_layers_on_stage >= 0 ? moe_layers_on_stage : c.moe_layers();
    PTK_CHECK(moe <= layers_on_stage);
    n -= moe * (fc1 * h / t + h * ffn / t);  // the dense MLP they hold instead (no biases with experts)
    n += moe * (c.num_experts * h + c.num_experts * c.expert_floats() / t);
    const int64_t gate = c.moe_shared_expert_intermediate_size > 0 && c.moe_shared_expert_gate ? h : 0;
    n += moe * ((c.shared_expert_floats() - gate) / t + gate);  // and their shared experts (0 without)
  }
  const bool first = stage == 0, last = stage == pipeline - 1;
  if (first) n += vocab_slice;
  if (first && c.position_embedding == PositionEmbedding::kLearnedAbsolute) n += c.max_position_embeddings * h;
  if (last) {
    n += norm;  // final norm
    // Multi-token prediction (one tensor rank and stage): per depth enorm, hnorm, eh_proj, a layer, final_layernorm.
    n += c.mtp_num_layers * (3 * norm + 2 * h * h + layer);
    if (c.learnable_softmax()) n += c.mtp_num_layers * c.num_attention_heads;  // each depth's softmax_offset
    if (c.mtp_num_layers > 0 && c.moe_layer(c.num_layers - 1))  // MoE depths (the decoder's last layer's kind)
      n += c.mtp_num_layers *
           (c.num_experts * h + c.num_experts * c.expert_floats() + c.shared_expert_floats() - (fc1 * h + h * ffn));
    if (c.untie_embeddings_and_output_weights || !first) n += vocab_slice;
  }
  return n;
}

std::string ParamCountLine(int tensor_rank, int pipeline_rank, int64_t num_params) {
  return fmt::format(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}", tensor_rank,
                     pipeline_rank, num_params);
}

}  // namespace ptk
