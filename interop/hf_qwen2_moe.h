// ptk-train's mixture-of-experts models of the Llama line with gated shared experts (--moe-shared-expert-gate) <->
// Hugging Face's Qwen2MoeForCausalLM (transformers 4.51): config.json, the router, experts and the shared expert with
// its sigmoid gate in Qwen2-MoE's names, and what either side cannot compute, refused with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_config.h"
#include "interop/hf_gpt2_tensors.h"
#include "trainer/param_layout.h"

namespace ptk::hf_detail {

// OK when Qwen2MoeForCausalLM computes the MoE model `c` describes: RMSNorm, RoPE over every channel (plain,
// Llama 3.x's or linear scaling), SwiGLU, no linear biases but q, k and v's (--add-qkv-bias: qkv_bias), head_dim =
// hidden / heads, any query groups, routed by the softmax over all experts (the top k renormalised or, with
// --moe-router-pre-softmax, not), and in every MoE layer a shared expert scaled by sigmoid(x . gate)
// (--moe-shared-expert-intermediate-size with --moe-shared-expert-gate: Megatron's SharedExpertMLP gate is
// Qwen2-MoE's shared_expert_gate). Otherwise FailedPrecondition naming `file` and each setting it has no place for.
absl::Status CheckQwen2MoeExportable(const GPTConfig& c, const std::string& file);

// config.json of Qwen2MoeForCausalLM for `c` (vocab_size: the tokenizer's), `eod` the BOS/EOS id.
std::string Qwen2MoeConfigJson(const GPTConfig& c, int64_t eod);

// HF's tensors of `c` in Qwen2MoeForCausalLM's state_dict order: the Llama line's (q, k, v biases with qkv_bias),
// in each MoE layer mlp.gate, mlp.experts.J.gate_proj/up_proj/down_proj, mlp.shared_expert.gate_proj/up_proj/
// down_proj and mlp.shared_expert_gate (1 x hidden); shapes set, data empty.
std::vector<HfTensor> Qwen2MoeTensorsOf(const GPTConfig& c);

// Between ptk's flat parameters and Qwen2MoeTensorsOf's tensors, either way: the Llama line's and the experts' as
// MapMoeExperts, the shared experts' linear_fc1 rows [gate; up] as shared_expert.gate_proj and up_proj, linear_fc2
// as down_proj, gate_weight as shared_expert_gate.
void MapQwen2MoeParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf);

// config.json (model_type "qwen2_moe", absent keys Qwen2MoeConfig's defaults) as ptk's model. Refused naming the
// key where ptk would compute another model.
absl::StatusOr<GPTConfig> ReadQwen2MoeConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                             std::vector<std::string>* notes);

}  // namespace ptk::hf_detail
