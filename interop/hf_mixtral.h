// ptk-train's mixture-of-experts models of the Llama line <-> Hugging Face's MixtralForCausalLM: config.json,
// the router and experts in Mixtral's names, and what either side cannot compute, refused with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_config.h"
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

// A MoE block's names in an HF class: the block's prefix in a layer ("block_sparse_moe.", "mlp."), each expert's
// gate, up and down projections, and the three in the order the class registers them (its state_dict's).
struct ExpertNames {
  std::string block, gate, up, down, first, second, third;
};

// The Llama line's tensors of `c` (LlamaTensorsOf's) with, in each MoE layer after its attention, the router
// (`block`gate.weight, num_experts x hidden) and each expert's three projections, shapes set, data empty.
std::vector<HfTensor> MoeTensorsOf(const GPTConfig& c, const ExpertNames& names);

// Between ptk's MoE layers and MoeTensorsOf's tensors (already sized when `to_hf`): the router as
// `block`gate, each expert's linear_fc1 rows [gate; up] as its gate and up projections, linear_fc2 as down.
void MapMoeExperts(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf,
                   const ExpertNames& names);

// HF's tensors of `c` in MixtralForCausalLM's state_dict order (each layer's block_sparse_moe.gate and
// experts.J.w1, w2, w3 after its attention), full names, shapes set, data empty.
std::vector<HfTensor> MixtralTensorsOf(const GPTConfig& c);

// Between ptk's flat parameters and `hf` (MixtralTensorsOf's): the Llama line's as MapLlamaParams; the
// router as gate; each expert's linear_fc1 rows [gate; up] as w1 and w3, linear_fc2 as w2. `to_hf` sizes
// `hf`'s tensors and fills them; otherwise `params` is filled from them (the padded vocabulary rows as
// MapLlamaParams fills them).
void MapMixtralParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf,
                      bool to_hf = true);

// config.json (model_type "mixtral", absent keys MixtralConfig's defaults) as ptk's model: the Llama line
// (RMSNorm, RoPE over every channel, SwiGLU, no biases) with every layer's MLP num_local_experts SwiGLU
// experts of intermediate_size, routed to the top num_experts_per_tok of the softmax over all experts,
// renormalised (Megatron's softmax over the top k's logits, --moe-router-topk's default routing), the
// load-balancing loss weighted by router_aux_loss_coef (--moe-aux-loss-coeff). Refused naming the key where
// ptk would compute another model: a sliding_window shorter than max_position_embeddings, a
// router_jitter_noise, an activation but SiLU, biases, a rope_scaling (transformers 4.44's Mixtral reads
// none), head_dim other than hidden_size / num_attention_heads.
absl::StatusOr<GPTConfig> ReadMixtralConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                            std::vector<std::string>* notes);

// The model settings an imported Mixtral checkpoint records (the Llama line's and the experts'), and
// ptk-train's flags for that model.
std::vector<std::pair<std::string, std::string>> MixtralSettings(const GPTConfig& c);
std::string MixtralTrainFlags(const GPTConfig& c);

}  // namespace ptk::hf_detail
