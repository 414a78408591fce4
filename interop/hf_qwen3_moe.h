// ptk-train's mixture-of-experts models of the Llama line with --qk-layernorm <-> Hugging Face's
// Qwen3MoeForCausalLM (transformers 4.51): config.json, the router and experts in Qwen3-MoE's names, dense
// layers of --moe-layer-freq as its mlp_only_layers, and what either side cannot compute, refused with the reason.
// Also the choice between it and MixtralForCausalLM for a MoE model (the Moe* functions).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/hf_config.h"
#include "interop/hf_gpt2_tensors.h"
#include "trainer/param_layout.h"

namespace ptk::hf_detail {

// The reasons a MoE model of the Llama line is not one Qwen3-MoE or Qwen2-MoE (`cls`) computes, as far as both
// share them (routing, MLP, norm, positions), appended to `why`: one place for both classes' messages.
void AppendQwenMoeRefusals(const GPTConfig& c, std::string_view cls, std::vector<std::string>* why);

// OK when Qwen3MoeForCausalLM computes the MoE model `c` describes: RMSNorm, RoPE over every channel (plain,
// Llama 3.x's or linear scaling), the query and key norms (--qk-layernorm), SwiGLU, no biases, any head_dim
// and query groups, routed by the softmax over all experts' logits, the top k renormalised (norm_topk_prob
// true: Megatron's default) or not (false: --moe-router-pre-softmax), no shared experts, any dense layers
// (mlp_only_layers). Otherwise FailedPrecondition naming `file` and each setting it has no place for.
absl::Status CheckQwen3MoeExportable(const GPTConfig& c, const std::string& file);

// config.json of Qwen3MoeForCausalLM for `c` (vocab_size: the tokenizer's), `eod` the BOS/EOS id.
std::string Qwen3MoeConfigJson(const GPTConfig& c, int64_t eod);

// config.json (model_type "qwen3_moe", absent keys Qwen3MoeConfig's defaults) as ptk's model. Refused naming
// the key where ptk would compute another model.
absl::StatusOr<GPTConfig> ReadQwen3MoeConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                             std::vector<std::string>* notes);

// What Qwen3-MoE's and Qwen2-MoE's configs share: the MoE layers (Qwen3MoeDecoderLayer's rule: (N + 1) %
// decoder_sparse_step == 0 and N not in mlp_only_layers; none refused), use_sliding_window (true refused),
// norm_topk_prob (false: --moe-router-pre-softmax), router_aux_loss_coef (noted), refused naming the key.
absl::Status ReadQwenMoeRouting(const HfConfigReader& r, GPTConfig* c, std::vector<std::string>* notes);

// A MoE model of the Llama line: DeepseekV3ForCausalLM with multi-latent attention (a dense one too: MoeLine),
// else Qwen3MoeForCausalLM with --qk-layernorm, else Qwen2MoeForCausalLM with shared experts, else MixtralForCausalLM.
inline bool MoeLine(const GPTConfig& c) { return c.moe() || c.mla(); }
const char* MoeArchitecture(const GPTConfig& c);
absl::Status CheckMoeExportable(const GPTConfig& c, const std::string& file);
std::string MoeConfigJson(const GPTConfig& c, int64_t eod);
std::vector<HfTensor> MoeTensorsOf(const GPTConfig& c);
// The Llama line's tensors and the experts, either way (MapLlamaParams, MapMoeExperts).
void MapMoeParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf);
// The model settings an imported MoE checkpoint records, and ptk-train's flags for that model.
std::vector<std::pair<std::string, std::string>> MoeSettings(const GPTConfig& c);
std::string MoeTrainFlags(const GPTConfig& c);

}  // namespace ptk::hf_detail
