// ptk's mixture-of-experts Llama line with gated shared experts <-> Hugging Face Qwen2MoeForCausalLM: config.json
// (mlp_only_layers from --moe-layer-freq, norm_topk_prob from --moe-router-pre-softmax, qkv_bias from
// --add-qkv-bias), the experts' and the shared expert's [gate; up] split into gate_proj and up_proj (and joined back).
#include "interop/hf_qwen2_moe.h"

#include <cinttypes>
#include <cstdio>
#include <map>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/hf_llama.h"
#include "interop/hf_mixtral.h"
#include "interop/hf_qwen3_moe.h"

namespace ptk::hf_detail {
namespace {

// Qwen2-MoE's names: mlp.gate, mlp.experts.J.gate_proj, up_proj, down_proj (Qwen2MoeMLP's order).
const ExpertNames kQwen2Moe{"mlp.", "gate_proj", "up_proj", "down_proj", "gate_proj", "up_proj", "down_proj"};

}  // namespace

absl::Status CheckQwen2MoeExportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (c.moe_shared_expert_intermediate_size <= 0)
    why.push_back("no --moe-shared-expert-intermediate-size (Qwen2-MoE's every MoE layer has a shared expert)");
  else if (!c.moe_shared_expert_gate)
    why.push_back(
        "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate (Qwen2-MoE scales its shared "
        "expert by sigmoid(shared_expert_gate), always)");
  AppendQwenMoeRefusals(c, "Qwen2-MoE", &why);
  if (c.add_bias_linear)
    why.push_back(
        "linear biases (Qwen2-MoE biases q, k and v only: --disable-bias-linear, with or without --add-qkv-bias)");
  if (c.head_dim() * c.num_attention_heads != c.hidden_size)
    why.push_back(
        fmt::format("--kv-channels {} with {} heads of hidden size {} (Qwen2-MoE takes head_dim = hidden_size / "
                    "num_attention_heads)",
                    c.head_dim(), c.num_attention_heads, c.hidden_size));
  if (why.empty()) return absl::OkStatus();
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return absl::FailedPreconditionError(
      fmt::format("{}: this mixture-of-experts model (--num-experts {} with shared experts) is not one Hugging Face's "
                  "Qwen2MoeForCausalLM computes: {}",
                  file, c.num_experts, list));
}

std::string Qwen2MoeConfigJson(const GPTConfig& c, int64_t eod) {
  std::string dense;  // mlp_only_layers, as json.dumps(indent=2) writes the list
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (!c.moe_layer(l)) dense += fmt::format("{}\n    {}", dense.empty() ? "[" : ",", l);
  dense = dense.empty() ? "[]" : dense + "\n  ]";
  return PrettyConfig({
      {"architectures", "[\n    \"Qwen2MoeForCausalLM\"\n  ]"},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"decoder_sparse_step", Int(1)},
      {"eos_token_id", Int(eod)},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.ffn_hidden_size)},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"max_window_layers", Int(c.num_layers)},
      {"mlp_only_layers", dense},
      {"model_type", Str("qwen2_moe")},
      {"moe_intermediate_size", Int(c.moe_ffn())},
      {"norm_topk_prob", Bool(!c.moe_router_pre_softmax)},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_experts", Int(c.num_experts)},
      {"num_experts_per_tok", Int(c.moe_router_topk)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.query_groups())},
      {"output_router_logits", Bool(false)},
      {"qkv_bias", Bool(c.add_qkv_bias)},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_scaling", RopeScalingJson(c)},
      {"rope_theta", Num(c.rotary_base)},
      {"router_aux_loss_coef", Num(c.moe_aux_loss_coeff)},
      {"shared_expert_intermediate_size", Int(c.moe_shared_expert_intermediate_size)},
      {"sliding_window", "null"},  // ptk's attention is causal over the whole sequence
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"use_sliding_window", Bool(false)},
      {"vocab_size", Int(c.vocab_size)},
  });
}

std::vector<HfTensor> Qwen2MoeTensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, s = c.moe_shared_expert_intermediate_size;
  std::vector<HfTensor> t;
  for (HfTensor& x : MoeTensorsOf(c, kQwen2Moe)) {
    int64_t l = -1;
    int end = 0;  // set only where the whole pattern matched
    if (std::sscanf(x.name.c_str(), "model.layers.%" SCNd64 ".input_layernorm.weight%n", &l, &end) == 1 &&
        end == static_cast<int>(x.name.size()) && c.moe_layer(l)) {
      // Qwen2MoeSparseMoeBlock registers shared_expert and shared_expert_gate after the experts.
      const std::string p = fmt::format("model.layers.{}.mlp.", l);
      t.push_back({p + "shared_expert.gate_proj.weight", {s, h}, {}});
      t.push_back({p + "shared_expert.up_proj.weight", {s, h}, {}});
      t.push_back({p + "shared_expert.down_proj.weight", {h, s}, {}});
      t.push_back({p + "shared_expert_gate.weight", {1, h}, {}});
    }
    t.push_back(std::move(x));
  }
  return t;
}

void MapQwen2MoeParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  MapLlamaParams(layout, params, hf, to_hf);  // sizes every tensor (to HF); the attention and dense layers
  MapMoeExperts(layout, params, hf, to_hf, kQwen2Moe);
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, s = c.moe_shared_expert_intermediate_size;
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) by_name[t.name] = &t;
  auto copy = [&](const std::string& name, int64_t offset) {
    std::vector<float>& d = by_name.at(name)->data;
    float* p = params->data() + offset;
    if (to_hf) {
      std::copy(p, p + static_cast<int64_t>(d.size()), d.begin());
    } else {
      std::copy(d.begin(), d.end(), p);
    }
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.moe_layer(l)) continue;
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.mlp.", l);
    copy(p + "shared_expert.gate_proj.weight", lp.shared_fc1);  // linear_fc1's rows: [gate; up]
    copy(p + "shared_expert.up_proj.weight", lp.shared_fc1 + s * h);
    copy(p + "shared_expert.down_proj.weight", lp.shared_fc2);
    copy(p + "shared_expert_gate.weight", lp.shared_gate);
  }
}

namespace {

// Qwen2MoeConfig's dimensions (absent keys: its defaults); head_dim hidden_size / num_attention_heads only.
absl::Status ReadQwen2MoeDims(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 24));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 2048));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 16));
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &c->num_query_groups, 16));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->ffn_hidden_size, 5632));
  PTK_RETURN_IF_ERROR(r.GetInt("moe_intermediate_size", &c->moe_ffn_hidden_size, 1408));
  PTK_RETURN_IF_ERROR(
      r.GetInt("shared_expert_intermediate_size", &c->moe_shared_expert_intermediate_size, int64_t{5632}));
  c->moe_shared_expert_gate = true;  // shared_expert_gate: always there
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 32768));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 151936));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts", &c->num_experts, 60));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts_per_tok", &c->moe_router_topk, 4));
  if (c->moe_router_topk > c->num_experts)
    return r.Bad(fmt::format("num_experts_per_tok {} is more than num_experts {}", c->moe_router_topk, c->num_experts));
  if (c->hidden_size % c->num_attention_heads != 0)
    return r.Bad(
        fmt::format("num_attention_heads {} does not divide hidden_size {}", c->num_attention_heads, c->hidden_size));
  if (c->num_attention_heads % c->num_query_groups != 0)
    return r.Bad(fmt::format("num_key_value_heads {} does not divide num_attention_heads {}", c->num_query_groups,
                             c->num_attention_heads));
  int64_t head_dim = 0;
  PTK_RETURN_IF_ERROR(r.GetInt("head_dim", &head_dim, c->hidden_size / c->num_attention_heads));
  if (head_dim != c->hidden_size / c->num_attention_heads)
    return r.Bad(
        fmt::format("head_dim {} is not hidden_size / num_attention_heads ({}): Qwen2-MoE's heads are that wide",
                    head_dim, c->hidden_size / c->num_attention_heads));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool tie = false, qkv_bias = true;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, &tie, "true or false"));
  c->untie_embeddings_and_output_weights = !tie;
  PTK_RETURN_IF_ERROR(r.Get("qkv_bias", true, &qkv_bias, "true or false"));
  c->add_qkv_bias = qkv_bias;  // Megatron's --add-qkv-bias: q, k and v biased, o_proj and the MLPs not
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GPTConfig> ReadQwen2MoeConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                             std::vector<std::string>* notes) {
  GPTConfig c;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.moe_router_sigmoid = false;
  PTK_RETURN_IF_ERROR(ReadQwen2MoeDims(r, make_vocab_size_divisible_by, &c));
  PTK_RETURN_IF_ERROR(ReadQwenMoeRouting(r, &c, notes));
  PTK_RETURN_IF_ERROR(ReadLlamaCommon(r, &c));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size), hd = h / static_cast<double>(c.num_attention_heads),
               implied = static_cast<double>(c.num_layers) *
                             (h * hd * static_cast<double>(2 * c.num_attention_heads + 2 * c.num_query_groups) +
                              3 * h * static_cast<double>(c.ffn_hidden_size + c.moe_shared_expert_intermediate_size) +
                              static_cast<double>(c.num_experts) * (3 * h * static_cast<double>(c.moe_ffn()) + h)) +
                         2 * h * static_cast<double>(c.vocab_size);
  if (implied > 0x1p40)
    return r.Bad(fmt::format(
        "num_hidden_layers {}, hidden_size {}, num_experts {} of moe_intermediate_size {} and vocab_size {} make "
        "{:.3g} parameters: more than ptk can hold",
        c.num_layers, c.hidden_size, c.num_experts, c.moe_ffn(), c.vocab_size, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  return c;
}

}  // namespace ptk::hf_detail
