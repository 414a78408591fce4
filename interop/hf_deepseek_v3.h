// ptk-train's multi-latent attention models (--multi-latent-attention, with or without sigmoid-routed experts) <->
// Hugging Face's DeepseekV3ForCausalLM (transformers 4.51): config.json, MLA's projections and latent norms, the
// router with its expert bias (e_score_correction_bias), the routed and shared experts and the first dense layers in
// DeepSeek-V3's names, and what either side cannot compute, refused with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_config.h"
#include "interop/hf_gpt2_tensors.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"

namespace ptk::hf_detail {

// YaRN's original context in ptk's MLA rotary tables (megatron-core's YarnRotaryEmbedding default).
inline constexpr int64_t kMlaYarnOriginalContext = 4096;

// OK when DeepseekV3ForCausalLM computes the model `c` describes: MLA with its latent norms (--qk-layernorm; RMSNorm
// at epsilon 1e-6, DeepseekV3Attention's fixed one), RoPE or YaRN on the rotary channels (rope_interleave: megatron-
// core's MLA gathers each pair (2i, 2i + 1) as transformers' apply_rotary_pos_emb_interleave does), SwiGLU, no
// biases; experts (if any) routed by sigmoid scores with Megatron's renormalisation and scaling, shared experts of a
// multiple of the experts' width without a gate, dense layers first (first_k_dense_replace). Otherwise
// FailedPrecondition naming `file` and each setting DeepSeek-V3 has no place for.
absl::Status CheckDeepseekV3Exportable(const GPTConfig& c, const std::string& file);

// config.json of DeepseekV3ForCausalLM for `c` (vocab_size: the tokenizer's), `eod` the BOS/EOS id.
std::string DeepseekV3ConfigJson(const GPTConfig& c, int64_t eod);

// HF's tensors of `c` in DeepseekV3ForCausalLM's state_dict order (each layer's self_attn, then mlp: experts.J,
// gate.weight, gate.e_score_correction_bias, shared_experts; then its norms), full names, shapes set, data empty.
std::vector<HfTensor> DeepseekV3TensorsOf(const GPTConfig& c);

// Between ptk's flat parameters and DeepseekV3TensorsOf's tensors: every weight as it is (MLA's fused projections
// are HF's: linear_q_up_proj rows per head [nope; rope] as q_b_proj, linear_kv_down_proj [latent; rope] as
// kv_a_proj_with_mqa, linear_kv_up_proj per head [k nope; v] as kv_b_proj), linear_fc1's [gate; up] split, the
// vocabulary rows as the Llama mapping. `to_hf` sizes `hf`'s tensors and fills them. The expert biases are
// MapExpertBiases'.
void MapDeepseekV3Params(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf);

// The router's expert bias of MoE layer `l` under ptk-train's name (decoder.layers.L.mlp.router.expert_bias).
std::string ExpertBiasName(const ParamLayout& layout, int64_t l);
// Each MoE layer's e_score_correction_bias <-> `buffers` (ptk's expert biases; to HF: zeros for a model trained
// without --moe-router-enable-expert-bias, a buffer of another name or size refused naming it).
absl::Status MapExpertBiases(const ParamLayout& layout, ModelBuffers* buffers, std::vector<HfTensor>* hf, bool to_hf);

// config.json (model_type "deepseek_v3", absent keys DeepseekV3Config's defaults) as ptk's model. Refused naming
// config.json and the key where ptk would compute another model.
absl::StatusOr<GPTConfig> ReadDeepseekV3Config(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                               std::vector<std::string>* notes);

// The model settings an imported DeepSeek-V3 checkpoint records, and ptk-train's flags for that model.
std::vector<std::pair<std::string, std::string>> DeepseekV3Settings(const GPTConfig& c);
std::string DeepseekV3TrainFlags(const GPTConfig& c);

}  // namespace ptk::hf_detail
