// Megatron's Llama line as Hugging Face's LlamaForCausalLM: config.json, the tensors in HF's names
// and layout, and what LlamaForCausalLM cannot hold, refused with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_config.h"
#include "interop/hf_gpt2_tensors.h"
#include "interop/hf_shards.h"
#include "trainer/param_layout.h"

namespace ptk::hf_detail {

// OK when LlamaForCausalLM (transformers 4.44's) computes the model `c` describes: RMSNorm, RoPE
// over every channel of a head (Megatron's rotate-half layout, which is HF's), SwiGLU, every
// linear layer biased or none (attention_bias and mlp_bias together), head_dim = hidden / heads.
// Otherwise FailedPrecondition naming `file` and each setting HF's Llama has no place for.
absl::Status CheckLlamaExportable(const GPTConfig& c, const std::string& file);

// config.json of LlamaForCausalLM for `c` (vocab_size: the tokenizer's), `eod` the BOS/EOS id.
std::string LlamaConfigJson(const GPTConfig& c, int64_t eod);

// HF's tensors of `c` in LlamaForCausalLM's state_dict order, full names (model.layers.0...,
// lm_head.weight when untied), shapes set, data empty.
std::vector<HfTensor> LlamaTensorsOf(const GPTConfig& c);

// Between ptk's flat parameters and HF's tensors: linear_qkv's groups ([q heads, k, v] per query
// group) split into q_proj, k_proj, v_proj; linear_fc1's [gate; up] into gate_proj and up_proj; the
// vocabulary rows as the GPT-2 mapping (the padded rows dropped; on import copies of the last row).
// With --rotary-interleaved each query and key head's rows permuted (HF's channel i is ptk's 2i, hd/2 + i
// ptk's 2i + 1) so that HF's rotate-half computes the interleaved rotation.
void MapLlamaParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf);

// config.json (model_type "llama") as the model ptk trains; refused where ptk would compute another
// model (an activation but SiLU, a rope_scaling but llama3 or linear ptk computes, biases on one side only).
absl::StatusOr<GPTConfig> ReadLlamaConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                          std::vector<std::string>* notes, bool qwen3 = false);

// What the Llama line's readers share (Llama, Qwen3, Qwen3-MoE): hidden_act (silu only), rms_norm_eps,
// attention_dropout, initializer_range, partial_rotary_factor (1 only), rope_theta and rope_scaling (or
// rope_parameters) as ptk computes them; hidden_dropout 0. Refused naming the key.
absl::Status ReadLlamaCommon(const HfConfigReader& r, GPTConfig* c);

// Qwen3's attention keys: use_sliding_window true and a layer_types entry but "full_attention" refused; a
// sliding_window below max_position_embeddings noted (transformers 4.51's Qwen3 masks past it).
absl::Status ReadQwen3Attention(const HfConfigReader& r, const GPTConfig& c, std::vector<std::string>* notes);

// config.json's rope_scaling for `c`: null, Llama 3.x's (--use-rope-scaling) or linear
// (--rotary-seq-len-interpolation-factor), indented as a value of the top-level object.
std::string RopeScalingJson(const GPTConfig& c);

// The directory's weights (model.safetensors or its shards): every tensor `tensors` names with its
// shape and finite values, nothing else (rotary inv_freq buffers aside; a tied model's lm_head.weight
// only as a copy of the embedding). `model` names the model in a refusal of a tensor it has no place for.
absl::Status ReadLlamaTensors(const HfWeights& weights, const GPTConfig& c, std::vector<HfTensor>* tensors,
                              const std::string& model = "Llama");

// The model settings an imported checkpoint records, and ptk-train's flags for that model.
std::vector<std::pair<std::string, std::string>> LlamaSettings(const GPTConfig& c);
std::string LlamaTrainFlags(const GPTConfig& c);

}  // namespace ptk::hf_detail
