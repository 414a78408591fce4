// ptk-train's mixture-of-experts models of the Llama line as Hugging Face's MixtralForCausalLM: config.json,
// the router and experts in Mixtral's names, and what Mixtral cannot compute, refused with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "interop/hf_gpt2_tensors.h"
#include "trainer/param_layout.h"

namespace ptk::hf_detail {

// OK when MixtralForCausalLM (transformers 4.44's) computes the MoE model `c` describes: the Llama line's
// dense parts (RMSNorm, RoPE over every channel without scaling, no biases, head_dim = hidden / heads, any
// query groups) and in every layer SwiGLU experts routed by a softmax over all experts, the top k
// renormalised (Megatron's softmax over the top k's logits, its default). Otherwise FailedPrecondition
// naming `file` and each setting Mixtral has no place for.
absl::Status CheckMixtralExportable(const GPTConfig& c, const std::string& file);

// config.json of MixtralForCausalLM for `c` (vocab_size: the tokenizer's), `eod` the BOS/EOS id.
std::string MixtralConfigJson(const GPTConfig& c, int64_t eod);

// HF's tensors of `c` in MixtralForCausalLM's state_dict order (each layer's block_sparse_moe.gate and
// experts.J.w1, w2, w3 after its attention), full names, shapes set, data empty.
std::vector<HfTensor> MixtralTensorsOf(const GPTConfig& c);

// ptk's flat parameters into `hf` (MixtralTensorsOf's): the Llama line's as MapLlamaParams; the router
// as gate; each expert's linear_fc1 rows [gate; up] as w1 and w3, linear_fc2 as w2.
void MapMixtralParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf);

}  // namespace ptk::hf_detail
