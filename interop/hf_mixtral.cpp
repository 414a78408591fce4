// ptk's mixture-of-experts Llama line <-> Hugging Face MixtralForCausalLM: config.json, the router and the
// experts' [gate; up] split into w1 and w3 (and joined back).
#include "interop/hf_mixtral.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/hf_config.h"
#include "interop/hf_llama.h"

namespace ptk::hf_detail {

absl::Status CheckMixtralExportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (c.moe_router_sigmoid)
    why.push_back("--moe-router-score-function sigmoid (Mixtral routes by a softmax over the experts' logits)");
  else if (c.moe_router_pre_softmax)
    why.push_back(
        "--moe-router-pre-softmax (Mixtral renormalises the top k's probabilities to sum to 1: Megatron's softmax "
        "after the top k)");
  if (c.moe_router_topk_scaling_factor > 0)
    why.push_back(fmt::format("--moe-router-topk-scaling-factor {} (Mixtral's probabilities are not scaled)",
                              Num(c.moe_router_topk_scaling_factor)));
  if (c.moe_router_group_topk > 0)
    why.push_back(fmt::format("--moe-router-group-topk {} (Mixtral routes among all experts, not limited groups)",
                              c.moe_router_group_topk));
  if (c.moe_shared_expert_intermediate_size > 0)
    why.push_back(fmt::format("--moe-shared-expert-intermediate-size {} (Mixtral has no shared experts)",
                              c.moe_shared_expert_intermediate_size));
  if (c.moe_layers() != c.num_layers) {
    std::string layers;
    for (int64_t l = 0; l < c.num_layers; ++l) layers += fmt::format("{}{}", l ? "," : "", c.moe_layer(l) ? 1 : 0);
    why.push_back(fmt::format(
        "--moe-layer-freq [{}] with dense layers (every layer of Mixtral is a mixture of experts)", layers));
  }
  if (!c.swiglu)
    why.push_back(fmt::format("{} experts without --swiglu (Mixtral's experts are SwiGLU's)",
                              c.squared_relu ? "squared-ReLU" : "GELU"));
  if (c.normalization != Normalization::kRMSNorm)
    why.push_back("--normalization LayerNorm (Mixtral normalizes with RMSNorm)");
  if (c.position_embedding != PositionEmbedding::kRope)
    why.push_back(fmt::format("--position-embedding-type {} (Mixtral has rotary positions only)",
                              c.position_embedding == PositionEmbedding::kNone ? "none" : "learned_absolute"));
  else if (c.rotary_percent != 1.0)
    why.push_back(fmt::format("--rotary-percent {} (Mixtral rotates every channel of a head)", Num(c.rotary_percent)));
  if (c.rope() && c.use_rope_scaling)
    why.push_back("--use-rope-scaling (transformers 4.44's Mixtral has no rope_scaling)");
  if (c.rope() && c.rotary_seq_len_interpolation_factor > 0)
    why.push_back("--rotary-seq-len-interpolation-factor (transformers 4.44's Mixtral has no rope_scaling)");
  if (c.add_bias_linear || c.add_qkv_bias) why.push_back("linear biases (Mixtral's linear layers have none)");
  if (c.qk_layernorm) why.push_back("--qk-layernorm (Mixtral has no query and key norms)");
  if (c.head_dim() * c.num_attention_heads != c.hidden_size)
    why.push_back(fmt::format(
        "--kv-channels {} with {} heads of hidden size {} (transformers 4.44's Mixtral takes head_dim = hidden_size / "
        "num_attention_heads)",
        c.head_dim(), c.num_attention_heads, c.hidden_size));
  if (why.empty()) return absl::OkStatus();
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return absl::FailedPreconditionError(fmt::format(
      "{}: this mixture-of-experts model (--num-experts {}) is not one Hugging Face's MixtralForCausalLM computes: {}",
      file, c.num_experts, list));
}

std::string MixtralConfigJson(const GPTConfig& c, int64_t eod) {
  return PrettyConfig({
      {"architectures", "[\n    \"MixtralForCausalLM\"\n  ]"},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"eos_token_id", Int(eod)},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.moe_ffn())},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"model_type", Str("mixtral")},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_experts_per_tok", Int(c.moe_router_topk)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.query_groups())},
      {"num_local_experts", Int(c.num_experts)},
      {"output_router_logits", Bool(false)},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_theta", Num(c.rotary_base)},
      {"router_aux_loss_coef", Num(c.moe_aux_loss_coeff)},
      {"router_jitter_noise", Num(0.0)},
      {"sliding_window", "null"},  // ptk's attention is causal over the whole sequence
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"vocab_size", Int(c.vocab_size)},
  });
}

std::vector<HfTensor> MoeTensorsOf(const GPTConfig& c, const ExpertNames& n) {
  const int64_t h = c.hidden_size, f = c.moe_ffn();
  std::vector<HfTensor> t;
  for (HfTensor& x : LlamaTensorsOf(c)) {  // the layers without their MoE blocks
    int64_t l = -1;
    int end = 0;  // set only where the whole pattern matched
    if (std::sscanf(x.name.c_str(), "model.layers.%" SCNd64 ".input_layernorm.weight%n", &l, &end) == 1 &&
        end == static_cast<int>(x.name.size()) && c.moe_layer(l)) {
      // The MoE block, registered after the attention (and its norms): the router, then each expert.
      const std::string p = fmt::format("model.layers.{}.{}", l, n.block);
      t.push_back({p + "gate.weight", {c.num_experts, h}, {}});
      for (int64_t j = 0; j < c.num_experts; ++j)
        for (const std::string* w : {&n.first, &n.second, &n.third}) {
          const bool down = *w == n.down;
          t.push_back({fmt::format("{}experts.{}.{}.weight", p, j, *w), {down ? h : f, down ? f : h}, {}});
        }
    }
    t.push_back(std::move(x));
  }
  return t;
}

void MapMoeExperts(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf,
                   const ExpertNames& n) {
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, f = c.moe_ffn();
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
    const std::string p = fmt::format("model.layers.{}.{}", l, n.block);
    copy(p + "gate.weight", lp.router_w);
    for (int64_t j = 0; j < c.num_experts; ++j) {
      const int64_t fc1 = lp.experts + j * c.expert_floats(), fc2 = fc1 + 2 * f * h;
      const std::string e = fmt::format("{}experts.{}.", p, j);
      copy(e + n.gate + ".weight", fc1);  // linear_fc1's rows: [gate; up]
      copy(e + n.up + ".weight", fc1 + f * h);
      copy(e + n.down + ".weight", fc2);
    }
  }
}

namespace {
// Mixtral's names: block_sparse_moe.experts.J.w1 (gate), w2 (down), w3 (up), registered in that order.
const ExpertNames kMixtral{"block_sparse_moe.", "w1", "w3", "w2", "w1", "w2", "w3"};
}  // namespace

std::vector<HfTensor> MixtralTensorsOf(const GPTConfig& c) { return MoeTensorsOf(c, kMixtral); }

void MapMixtralParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  MapLlamaParams(layout, params, hf, to_hf);  // sizes every tensor (to HF); the dense parts either way
  MapMoeExperts(layout, params, hf, to_hf, kMixtral);
}

namespace {

// MixtralConfig's dimensions (absent keys: its defaults); head_dim, where a newer config names it,
// hidden_size / num_attention_heads only.
absl::Status ReadMixtralDims(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 32));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 4096));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 32));
  // MixtralConfig's default is 8 key/value heads; null ("backward compatibility") one per query head.
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &c->num_query_groups,
                               r.Present("num_key_value_heads") ? c->num_attention_heads : 8));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->moe_ffn_hidden_size, 14336));
  c->ffn_hidden_size = c->moe_ffn_hidden_size;  // no dense MLP: the experts' width
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 4096 * 32));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 32000));
  PTK_RETURN_IF_ERROR(r.GetInt("num_local_experts", &c->num_experts, 8));
  PTK_RETURN_IF_ERROR(r.GetInt("num_experts_per_tok", &c->moe_router_topk, 2));
  if (c->moe_router_topk > c->num_experts)
    return r.Bad(
        fmt::format("num_experts_per_tok {} is more than num_local_experts {}", c->moe_router_topk, c->num_experts));
  if (c->hidden_size % c->num_attention_heads != 0)
    return r.Bad(
        fmt::format("num_attention_heads {} does not divide hidden_size {}", c->num_attention_heads, c->hidden_size));
  if (c->num_attention_heads % c->num_query_groups != 0)
    return r.Bad(fmt::format("num_key_value_heads {} does not divide num_attention_heads {}", c->num_query_groups,
                             c->num_attention_heads));
  int64_t head_dim = 0;
  PTK_RETURN_IF_ERROR(r.GetInt("head_dim", &head_dim, c->hidden_size / c->num_attention_heads));
  if (head_dim != c->hidden_size / c->num_attention_heads)
    return r.Bad(fmt::format(
        "head_dim {} is not hidden_size / num_attention_heads ({}): ptk-convert reads the Mixtral of transformers "
        "4.44, whose heads are hidden_size / num_attention_heads wide",
        head_dim, c->hidden_size / c->num_attention_heads));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool tie = false;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, &tie, "true or false"));
  c->untie_embeddings_and_output_weights = !tie;
  return absl::OkStatus();
}

// What transformers' Mixtral may carry that ptk's model does not compute: refused naming the key.
absl::Status CheckMixtralComputable(const HfConfigReader& r, const GPTConfig& c, std::vector<std::string>* notes) {
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    bool bias = false;
    PTK_RETURN_IF_ERROR(r.Get(key, false, &bias, "true or false"));
    if (bias) return r.Bad(fmt::format("{} true: ptk's mixture-of-experts layers have no biases", key));
  }
  double jitter = 0;
  PTK_RETURN_IF_ERROR(r.GetReal("router_jitter_noise", 0.0, &jitter, 0, false, 1, false));
  if (jitter != 0)
    return r.Bad(fmt::format(
        "router_jitter_noise {}: ptk's router has no jitter (transformers scales the hidden states by noise in "
        "training)",
        Num(jitter)));
  simdjson::dom::element e;
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (r.Find(key, &e))
      return r.Bad(fmt::format(
          "{} {}: transformers 4.44's Mixtral has plain RoPE only (ptk-convert reads that model: give null)", key,
          simdjson::minify(e)));
  double partial = 1.0;
  PTK_RETURN_IF_ERROR(r.GetReal("partial_rotary_factor", 1.0, &partial, 0, true, 1, false));
  if (partial != 1.0)
    return r.Bad(
        fmt::format("partial_rotary_factor {}: transformers' Mixtral rotates every channel of a head", Num(partial)));
  if (r.Find("layer_types", &e)) return r.Bad("layer_types: ptk's attention is causal over the whole sequence");
  if (r.Find("sliding_window", &e)) {  // null: none (Mixtral 8x7B's)
    int64_t window = 0;
    PTK_RETURN_IF_ERROR(r.GetInt("sliding_window", &window, std::nullopt));
    if (window < c.max_position_embeddings)
      return r.Bad(
          fmt::format("sliding_window {}: ptk's attention is causal over the whole sequence (null, or at least "
                      "max_position_embeddings {}, computes ptk's model)",
                      window, c.max_position_embeddings));
    notes->push_back(fmt::format("sliding_window {} is not below max_position_embeddings {}: no window", window,
                                 c.max_position_embeddings));
  }
  std::string_view act;
  PTK_RETURN_IF_ERROR(r.Get("hidden_act", std::string_view("silu"), &act, "a string"));
  if (act != "silu")
    return r.Bad(fmt::format("hidden_act {:?}: ptk's experts are SwiGLU's (hidden_act \"silu\")", act));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GPTConfig> ReadMixtralConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                            std::vector<std::string>* notes) {
  GPTConfig c;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.hidden_dropout = 0.0;  // MixtralForCausalLM has none
  // Mixtral's routing: the softmax over every expert, the top k renormalised = Megatron's softmax over the
  // top k's logits (neither --moe-router-pre-softmax nor sigmoid), every layer a mixture of experts.
  c.moe_router_pre_softmax = false;
  c.moe_router_sigmoid = false;
  PTK_RETURN_IF_ERROR(ReadMixtralDims(r, make_vocab_size_divisible_by, &c));
  PTK_RETURN_IF_ERROR(CheckMixtralComputable(r, c, notes));
  PTK_RETURN_IF_ERROR(r.GetReal("rms_norm_eps", 1e-5, &c.layernorm_epsilon, 0, true, kMaxLayerNormEpsilon, false));
  PTK_RETURN_IF_ERROR(r.GetReal("attention_dropout", 0.0, &c.attention_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(r.GetReal("initializer_range", 0.02, &c.init_method_std, 0, true, kMaxInitMethodStd, false));
  PTK_RETURN_IF_ERROR(r.GetReal("rope_theta", 1e6, &c.rotary_base, 0, true, 1e300, false));
  PTK_RETURN_IF_ERROR(r.GetReal("router_aux_loss_coef", 0.001, &c.moe_aux_loss_coeff, 0, false, 1e300, false));
  bool router_logits = false;
  PTK_RETURN_IF_ERROR(r.Get("output_router_logits", false, &router_logits, "true or false"));
  if (!router_logits && c.moe_aux_loss_coeff > 0)
    notes->push_back(fmt::format(
        "router_aux_loss_coef {}: ptk-train adds the load-balancing loss at that weight (--moe-aux-loss-coeff; "
        "transformers only with output_router_logits); 0 turns it off",
        Num(c.moe_aux_loss_coeff)));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size), hd = h / static_cast<double>(c.num_attention_heads),
               implied = static_cast<double>(c.num_layers) *
                             (h * hd * static_cast<double>(2 * c.num_attention_heads + 2 * c.num_query_groups) +
                              static_cast<double>(c.num_experts) * (3 * h * static_cast<double>(c.moe_ffn()) + h)) +
                         2 * h * static_cast<double>(c.vocab_size);
  if (implied > 0x1p40)
    return r.Bad(fmt::format(
        "num_hidden_layers {}, hidden_size {}, num_local_experts {} of intermediate_size {} and vocab_size {} make "
        "{:.3g} parameters: more than ptk can hold",
        c.num_layers, c.hidden_size, c.num_experts, c.moe_ffn(), c.vocab_size, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  return c;
}

std::vector<std::pair<std::string, std::string>> MixtralSettings(const GPTConfig& c) {
  std::vector<std::pair<std::string, std::string>> s = LlamaSettings(c);
  s.insert(s.end(), {{"--num-experts", Int(c.num_experts)},
                     {"--moe-router-topk", Int(c.moe_router_topk)},
                     {"--moe-ffn-hidden-size", Int(c.moe_ffn())},
                     {"--moe-aux-loss-coeff", fmt::format("{}", c.moe_aux_loss_coeff)},
                     {"--moe-router-score-function", "softmax"},
                     {"--moe-router-pre-softmax", "off"},
                     {"--moe-layer-freq", "1"}});
  return s;
}

std::string MixtralTrainFlags(const GPTConfig& c) {
  std::string flags =
      LlamaTrainFlags(c) + fmt::format(" --num-experts {} --moe-router-topk {} --moe-ffn-hidden-size {}", c.num_experts,
                                       c.moe_router_topk, c.moe_ffn());
  if (c.moe_aux_loss_coeff > 0) flags += fmt::format(" --moe-aux-loss-coeff {}", c.moe_aux_loss_coeff);
  return flags;
}

}  // namespace ptk::hf_detail
