// Megatron's Llama line <-> Hugging Face LlamaForCausalLM: config.json, q/k/v and gate/up split out of the fused
// layers.
#include "interop/hf_llama.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>

#include <fmt/core.h>

#include "common/status.h"
#include "interop/safetensors.h"

namespace ptk::hf_detail {
namespace {

// Llama 3.x's frequency scaling as ptk computes it (trainer/op_math.h, Megatron's --use-rope-scaling): its
// factor is --rope-scaling-factor, the rest Megatron-core's fixed defaults.
constexpr double kRopeLowFreqFactor = 1.0, kRopeHighFreqFactor = 4.0;
constexpr int64_t kRopeOriginalContext = 8192;

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string SettingNum(double v) { return fmt::format("{}", v); }  // as ptk-train records its settings

}  // namespace

absl::Status CheckLlamaExportable(const GPTConfig& c, const std::string& file) {
  std::vector<std::string> why;
  if (c.normalization != Normalization::kRMSNorm)
    why.push_back("--normalization LayerNorm (LlamaForCausalLM normalizes with RMSNorm)");
  if (c.position_embedding != PositionEmbedding::kRope)
    why.push_back(fmt::format("--position-embedding-type {} (LlamaForCausalLM has rotary positions only)",
                              c.position_embedding == PositionEmbedding::kNone ? "none" : "learned_absolute"));
  else if (c.rotary_percent != 1.0)
    why.push_back(fmt::format(
        "--rotary-percent {} (LlamaForCausalLM rotates every channel of a head; partial rotary is another model's)",
        SettingNum(c.rotary_percent)));
  if (c.rope() && c.use_rope_scaling && c.rotary_seq_len_interpolation_factor > 0)
    why.push_back(
        "--use-rope-scaling with --rotary-seq-len-interpolation-factor (transformers' rope_scaling is one of "
        "llama3 and linear)");
  if (!c.swiglu) why.push_back("no --swiglu (LlamaForCausalLM's MLP is SwiGLU's gated one)");
  if (c.qk_layernorm) {  // Qwen3ForCausalLM: its attention_bias biases q, k, v and o, its MLP has none
    if (c.add_bias_linear)
      why.push_back("--qk-layernorm with biased linear layers (Qwen3ForCausalLM's MLP has no biases)");
    else if (c.add_qkv_bias)
      why.push_back(
          "--qk-layernorm with --add-qkv-bias (Qwen3ForCausalLM's attention_bias biases q, k, v and o together)");
  } else if (!c.add_bias_linear && c.add_qkv_bias) {
    why.push_back(
        "--add-qkv-bias without the other linear biases (LlamaForCausalLM's attention_bias biases q, k, v and o "
        "together)");
  }
  if (!c.qk_layernorm && c.head_dim() * c.num_attention_heads != c.hidden_size)
    why.push_back(fmt::format(
        "--kv-channels {} with {} heads of hidden size {} (transformers 4.44's Llama takes head_dim = hidden_size / "
        "num_attention_heads)",
        c.head_dim(), c.num_attention_heads, c.hidden_size));
  if (why.empty()) return absl::OkStatus();
  std::string list;
  for (const std::string& w : why) list += (list.empty() ? "" : "; ") + w;
  return absl::FailedPreconditionError(
      fmt::format("{}: this model is neither GPT-2's (GPT2LMHeadModel) nor one Hugging Face's {} computes: {}", file,
                  c.qk_layernorm ? "Qwen3ForCausalLM (--qk-layernorm)" : "LlamaForCausalLM", list));
}

std::string RopeScalingJson(const GPTConfig& c) {
  // Llama 3.x's scaling, or linear position interpolation (transformers divides the frequencies by the
  // factor where Megatron divides the positions: the same angles up to fp32 rounding).
  std::string rope_scaling = "null";
  if (c.use_rope_scaling)
    rope_scaling = PrettyConfig(
        {
            {"factor", Num(c.rope_scaling_factor)},
            {"high_freq_factor", Num(kRopeHighFreqFactor)},
            {"low_freq_factor", Num(kRopeLowFreqFactor)},
            {"original_max_position_embeddings", Int(kRopeOriginalContext)},
            {"rope_type", Str("llama3")},
        },
        1);
  else if (c.rotary_seq_len_interpolation_factor > 0)
    rope_scaling =
        PrettyConfig({{"factor", Num(c.rotary_seq_len_interpolation_factor)}, {"rope_type", Str("linear")}}, 1);
  return rope_scaling;
}

std::string LlamaConfigJson(const GPTConfig& c, int64_t eod) {
  const std::string rope_scaling = RopeScalingJson(c);
  const bool qwen3 = c.qk_layernorm;
  std::vector<std::pair<std::string, std::string>> fields = {
      {"architectures", qwen3 ? "[\n    \"Qwen3ForCausalLM\"\n  ]" : "[\n    \"LlamaForCausalLM\"\n  ]"},
      {"attention_bias", Bool(!qwen3 && c.add_bias_linear)},
      {"attention_dropout", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"eos_token_id", Int(eod)},
      {"head_dim", Int(c.head_dim())},
      {"hidden_act", Str("silu")},
      {"hidden_size", Int(c.hidden_size)},
      {"initializer_range", Num(c.init_method_std)},
      {"intermediate_size", Int(c.ffn_hidden_size)},
      {"max_position_embeddings", Int(c.max_position_embeddings)},
      {"model_type", Str(qwen3 ? "qwen3" : "llama")},
      {"num_attention_heads", Int(c.num_attention_heads)},
      {"num_hidden_layers", Int(c.num_layers)},
      {"num_key_value_heads", Int(c.query_groups())},
      {"rms_norm_eps", Num(c.layernorm_epsilon)},
      {"rope_scaling", rope_scaling},
      {"rope_theta", Num(c.rotary_base)},
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"vocab_size", Int(c.vocab_size)},
  };
  if (qwen3) {  // Qwen3Config's keys: no mlp_bias (its MLP is bias-free), no pretraining_tp
    fields.insert(
        fields.end(),
        {{"max_window_layers", Int(c.num_layers)}, {"sliding_window", "null"}, {"use_sliding_window", Bool(false)}});
  } else {
    fields.insert(fields.end(), {{"mlp_bias", Bool(c.add_bias_linear)}, {"pretraining_tp", Int(1)}});
  }
  return PrettyConfig(std::move(fields));  // sorted by key
}

std::vector<HfTensor> LlamaTensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size, hd = c.head_dim(), q = c.num_attention_heads * hd,
                kv = c.query_groups() * hd;
  const bool bias = c.add_bias_linear;  // every linear layer's; q, k and v alone with --add-qkv-bias (Qwen2-MoE)
  std::vector<HfTensor> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, {}});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    for (const auto& [name, rows] : {std::pair<const char*, int64_t>{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}}) {
      t.push_back({p + "self_attn." + name + ".weight", {rows, h}, {}});
      if (c.qkv_bias()) t.push_back({p + "self_attn." + name + ".bias", {rows}, {}});
    }
    t.push_back({p + "self_attn.o_proj.weight", {h, q}, {}});
    if (bias) t.push_back({p + "self_attn.o_proj.bias", {h}, {}});
    if (c.qk_layernorm) {  // Qwen3's q_norm and k_norm (RMSNorm over a head)
      t.push_back({p + "self_attn.q_norm.weight", {hd}, {}});
      t.push_back({p + "self_attn.k_norm.weight", {hd}, {}});
    }
    if (!c.moe_layer(l)) {  // a mixture of experts' layer: MixtralTensorsOf adds its router and experts
      for (const char* name : {"gate_proj", "up_proj"}) {
        t.push_back({p + "mlp." + name + ".weight", {f, h}, {}});
        if (bias) t.push_back({p + "mlp." + name + ".bias", {f}, {}});
      }
      t.push_back({p + "mlp.down_proj.weight", {h, f}, {}});
      if (bias) t.push_back({p + "mlp.down_proj.bias", {h}, {}});
    }
    t.push_back({p + "input_layernorm.weight", {h}, {}});
    t.push_back({p + "post_attention_layernorm.weight", {h}, {}});
  }
  t.push_back({"model.norm.weight", {h}, {}});
  if (c.untie_embeddings_and_output_weights) t.push_back({"lm_head.weight", {c.vocab_size, h}, {}});
  return t;
}

void MapLlamaParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size, hd = c.head_dim(), groups = c.query_groups(),
                per_group = c.num_attention_heads / groups;
  float* P = params->data();
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) {
    if (to_hf) t.data.assign(static_cast<size_t>(Elements(t.shape)), 0.0f);
    by_name[t.name] = &t;
  }
  // `n` values of HF tensor `name` from element `at` <-> ptk's at `offset`.
  auto move = [&](const std::string& name, int64_t at, int64_t offset, int64_t n) {
    float* t = by_name.at(name)->data.data() + at;
    if (to_hf) {
      std::copy(P + offset, P + offset + n, t);
    } else {
      std::copy(t, t + n, P + offset);
    }
  };
  auto copy = [&](const std::string& name, int64_t offset) {
    move(name, 0, offset, static_cast<int64_t>(by_name.at(name)->data.size()));
  };
  auto vocab = [&](const std::string& name, int64_t offset) {
    copy(name, offset);  // the first vocab_size rows
    if (!to_hf)
      for (int64_t r = c.vocab_size; r < c.padded_vocab_size; ++r)
        std::copy(P + offset + (c.vocab_size - 1) * h, P + offset + c.vocab_size * h, P + offset + r * h);
  };
  // A head's hd rows of `width` (or elements: width 1) from HF's row `at` <-> ptk's from element `offset`.
  // With --rotary-interleaved ptk rotates channels (2i, 2i + 1) together, HF's rotate-half (i, i + hd/2):
  // HF's channel i is ptk's 2i, its channel hd/2 + i ptk's 2i + 1, in the query and key heads (and their
  // norms) alike. The same permutation of a query's and its key's channels leaves their product, hence
  // the attention, unchanged, so the HF model computes ptk's.
  const bool permute = c.rope() && c.rotary_interleaved;
  auto head = [&](const std::string& name, int64_t at, int64_t offset, int64_t width, bool rotated) {
    if (!permute || !rotated) return move(name, at * width, offset, hd * width);
    for (int64_t j = 0; j < hd; ++j)
      move(name, (at + j) * width, offset + (j < hd / 2 ? 2 * j : 2 * (j - hd / 2) + 1) * width, width);
  };
  vocab("model.embed_tokens.weight", layout.wte);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.", l);
    // linear_qkv's rows: per query group its query heads, then its key head and value head.
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t s = 0; s < per_group + 2; ++s) {
        const int64_t row = (g * (per_group + 2) + s) * hd;
        const char* proj = s < per_group ? "q_proj" : s == per_group ? "k_proj" : "v_proj";
        const int64_t at = (s < per_group ? g * per_group + s : g) * hd;
        head(p + "self_attn." + proj + ".weight", at, lp.qkv_w + row * h, h, s <= per_group);
        if (c.qkv_bias()) head(p + "self_attn." + proj + ".bias", at, lp.qkv_b + row, 1, s <= per_group);
      }
    copy(p + "self_attn.o_proj.weight", lp.proj_w);
    if (c.qk_layernorm) {
      head(p + "self_attn.q_norm.weight", 0, lp.q_norm_w, 1, true);
      head(p + "self_attn.k_norm.weight", 0, lp.k_norm_w, 1, true);
    }
    // linear_fc1's rows: [gate; up] (a mixture of experts' layer has none: MapMixtralParams maps its experts).
    if (lp.fc1_w >= 0) {
      copy(p + "mlp.gate_proj.weight", lp.fc1_w);
      copy(p + "mlp.up_proj.weight", lp.fc1_w + f * h);
      copy(p + "mlp.down_proj.weight", lp.fc2_w);
    }
    if (c.add_bias_linear) {
      copy(p + "self_attn.o_proj.bias", lp.proj_b);
      copy(p + "mlp.gate_proj.bias", lp.fc1_b);
      copy(p + "mlp.up_proj.bias", lp.fc1_b + f);
      copy(p + "mlp.down_proj.bias", lp.fc2_b);
    }
    copy(p + "input_layernorm.weight", lp.ln1_w);
    copy(p + "post_attention_layernorm.weight", lp.ln2_w);
  }
  copy("model.norm.weight", layout.lnf_w);
  if (c.untie_embeddings_and_output_weights) vocab("lm_head.weight", layout.out_w);
}

// Qwen3's attention is causal over the whole sequence when use_sliding_window is false, as ptk's. Newer
// transformers name each layer's kind in layer_types; any but "full_attention" is refused. transformers
// 4.51 masks beyond sliding_window (default 4096) even so: noted where the positions reach past it.
absl::Status ReadQwen3Attention(const HfConfigReader& r, const GPTConfig& c, std::vector<std::string>* notes) {
  bool sliding = false;
  PTK_RETURN_IF_ERROR(r.Get("use_sliding_window", false, &sliding, "true or false"));
  if (sliding) return r.Bad("use_sliding_window true: ptk's attention is causal over the whole sequence");
  simdjson::dom::element types;
  if (r.Find("layer_types", &types)) {
    simdjson::dom::array list;
    if (types.get(list)) return r.Bad("layer_types is not a list");
    int64_t i = 0;
    for (simdjson::dom::element t : list) {
      std::string_view kind;
      if (t.get(kind) || kind != "full_attention")
        return r.Bad(
            fmt::format("layer_types[{}] {}: ptk's attention is causal over the whole sequence "
                        "(\"full_attention\" only)",
                        i, simdjson::minify(t)));
      ++i;
    }
  }
  simdjson::dom::element value;
  if (r.Present("sliding_window") && !r.Find("sliding_window", &value)) return absl::OkStatus();  // null: none
  int64_t window = 4096;
  PTK_RETURN_IF_ERROR(r.GetInt("sliding_window", &window, 4096));
  if (window < c.max_position_embeddings)
    notes->push_back(fmt::format(
        "sliding_window {} with use_sliding_window false: ptk attends over the whole sequence, as Qwen3 means; "
        "transformers 4.51 masks the keys more than {} positions back all the same",
        window, window));
  return absl::OkStatus();
}

namespace {

// Qwen3Config's dimensions (absent keys: its defaults); head_dim any width (Megatron's --kv-channels).
absl::Status ReadQwen3Dims(const HfConfigReader& r, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 32));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 4096));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 32));
  // Qwen3Config's default is 32 key/value heads; null (its "backward compatibility") one per query head.
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &c->num_query_groups,
                               r.Present("num_key_value_heads") ? c->num_attention_heads : 32));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->ffn_hidden_size, 22016));
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 32768));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 151936));
  PTK_RETURN_IF_ERROR(r.GetInt("head_dim", &c->kv_channels, 128));
  if (c->num_attention_heads < 1 || c->num_query_groups < 1 || c->num_attention_heads % c->num_query_groups != 0)
    return r.Bad(fmt::format("num_key_value_heads {} does not divide num_attention_heads {}", c->num_query_groups,
                             c->num_attention_heads));
  bool attention_bias = false;
  PTK_RETURN_IF_ERROR(r.Get("attention_bias", false, &attention_bias, "true or false"));
  if (attention_bias)
    return r.Bad(
        "attention_bias true: Qwen3's q, k, v and o biases without MLP biases are no ptk model (Megatron's "
        "--add-qkv-bias biases q, k and v only, --disable-bias-linear off biases every linear layer)");
  return absl::OkStatus();
}

// LlamaConfig's dimensions and biases (absent keys: its defaults); head_dim hidden_size / heads only.
absl::Status ReadLlamaDims(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c,
                           int64_t* head_dim_out, bool* tie) {
  int64_t& head_dim = *head_dim_out;
  // Absent keys take LlamaConfig's defaults.
  PTK_RETURN_IF_ERROR(r.GetInt("num_hidden_layers", &c->num_layers, 32));
  PTK_RETURN_IF_ERROR(r.GetInt("hidden_size", &c->hidden_size, 4096));
  PTK_RETURN_IF_ERROR(r.GetInt("num_attention_heads", &c->num_attention_heads, 32));
  PTK_RETURN_IF_ERROR(r.GetInt("num_key_value_heads", &c->num_query_groups, c->num_attention_heads));
  PTK_RETURN_IF_ERROR(r.GetInt("intermediate_size", &c->ffn_hidden_size, 11008));
  PTK_RETURN_IF_ERROR(r.GetInt("max_position_embeddings", &c->max_position_embeddings, 2048));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, 32000));
  if (c->hidden_size % c->num_attention_heads != 0)
    return r.Bad(
        fmt::format("num_attention_heads {} does not divide hidden_size {}", c->num_attention_heads, c->hidden_size));
  if (c->num_attention_heads % c->num_query_groups != 0)
    return r.Bad(fmt::format("num_key_value_heads {} does not divide num_attention_heads {}", c->num_query_groups,
                             c->num_attention_heads));
  PTK_RETURN_IF_ERROR(r.GetInt("head_dim", &head_dim, c->hidden_size / c->num_attention_heads));
  if (head_dim != c->hidden_size / c->num_attention_heads)
    return r.Bad(
        fmt::format("head_dim {} is not hidden_size / num_attention_heads ({}): ptk-convert reads the Llama "
                    "of transformers 4.44, whose heads are hidden_size / num_attention_heads wide",
                    head_dim, c->hidden_size / c->num_attention_heads));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool attention_bias = false, mlp_bias = false;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, tie, "true or false"));
  c->untie_embeddings_and_output_weights = !*tie;
  PTK_RETURN_IF_ERROR(r.Get("attention_bias", false, &attention_bias, "true or false"));
  PTK_RETURN_IF_ERROR(r.Get("mlp_bias", false, &mlp_bias, "true or false"));
  if (attention_bias != mlp_bias)
    return r.Bad(
        fmt::format("attention_bias {} with mlp_bias {}: ptk's linear layers are biased all together (Megatron's "
                    "--disable-bias-linear off) or none of them",
                    Bool(attention_bias), Bool(mlp_bias)));
  c->add_bias_linear = attention_bias;
  return absl::OkStatus();
}

}  // namespace

namespace {

// A rope_scaling (or rope_parameters) object as ptk computes it: transformers' plain RoPE (rope_type
// "default", or the older key "type"), Llama 3.x's scaling with Megatron's fixed constants (low_freq_factor
// 1, high_freq_factor 4, original_max_position_embeddings 8192) and any positive factor
// (--use-rope-scaling --rope-scaling-factor), or linear interpolation (--rotary-seq-len-interpolation-factor);
// kOther for anything else.
struct RopeKind {
  enum { kPlain, kLlama3, kLinear, kOther } kind = kOther;
  double factor = 0;
};
RopeKind ClassifyRope(simdjson::dom::element e) {
  simdjson::dom::object o;
  std::string_view type;
  if (e.get(o) || (o["rope_type"].get(type) && o["type"].get(type))) return {};
  if (type == "default") return {RopeKind::kPlain, 0};
  double factor = 0, low = 0, high = 0;
  int64_t original = 0;
  if (o["factor"].get(factor) || !(factor > 0 && std::isfinite(factor))) return {};
  if (type == "linear") return {RopeKind::kLinear, factor};
  if (type == "llama3" && !o["low_freq_factor"].get(low) && !o["high_freq_factor"].get(high) &&
      !o["original_max_position_embeddings"].get(original) && low == kRopeLowFreqFactor &&
      high == kRopeHighFreqFactor && original == kRopeOriginalContext)
    return {RopeKind::kLlama3, factor};
  return {};
}

void ApplyRope(const RopeKind& k, GPTConfig* c) {
  if (k.kind == RopeKind::kLlama3) {
    c->use_rope_scaling = true;
    c->rope_scaling_factor = k.factor;
  } else if (k.kind == RopeKind::kLinear) {
    c->rotary_seq_len_interpolation_factor = k.factor;
  }
}

// RoPE's base and scaling: transformers 4's rope_theta and rope_scaling, or transformers 5's
// rope_parameters (the base, rope_type and the scaling's constants in one object; a config may carry
// both forms, which must then agree). What ClassifyRope takes; anything else is refused naming the key.
absl::Status ReadRope(const HfConfigReader& r, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetReal("rope_theta", 10000.0, &c->rotary_base, 0, true, 1e300, false));
  constexpr std::string_view kWhat =
      "ptk computes Llama 3.x's (rope_type \"llama3\", a positive factor, low_freq_factor 1.0, high_freq_factor "
      "4.0, original_max_position_embeddings 8192; Megatron's --use-rope-scaling --rope-scaling-factor), linear "
      "interpolation (rope_type \"linear\", a positive factor; --rotary-seq-len-interpolation-factor) or none";
  simdjson::dom::element scaling;
  const bool found_scaling = r.Find("rope_scaling", &scaling);
  const RopeKind from_scaling = found_scaling ? ClassifyRope(scaling) : RopeKind{RopeKind::kPlain, 0};
  if (from_scaling.kind == RopeKind::kOther)
    return r.Bad(fmt::format("rope_scaling {}: {}", simdjson::minify(scaling), kWhat));
  ApplyRope(from_scaling, c);
  simdjson::dom::element params;
  if (!r.Find("rope_parameters", &params)) return absl::OkStatus();
  simdjson::dom::object o;
  double theta = 0;
  if (params.get(o) || o["rope_theta"].get(theta) || !(theta > 0 && theta <= 1e300))
    return r.Bad(fmt::format("rope_parameters {}: not an object with a positive rope_theta", simdjson::minify(params)));
  simdjson::dom::element top;
  if (r.Find("rope_theta", &top) && theta != c->rotary_base)
    return r.Bad(
        fmt::format("rope_theta {} and rope_parameters' rope_theta {} differ", Num(c->rotary_base), Num(theta)));
  c->rotary_base = theta;
  const RopeKind from_params = ClassifyRope(params);
  if (from_params.kind == RopeKind::kOther)
    return r.Bad(fmt::format("rope_parameters {}: {}", simdjson::minify(params), kWhat));
  if (found_scaling && (from_scaling.kind != from_params.kind || from_scaling.factor != from_params.factor))
    return r.Bad(fmt::format("rope_scaling {} and rope_parameters {} differ", simdjson::minify(scaling),
                             simdjson::minify(params)));
  ApplyRope(from_params, c);
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadLlamaCommon(const HfConfigReader& r, GPTConfig* c) {
  std::string_view act;
  PTK_RETURN_IF_ERROR(r.Get("hidden_act", std::string_view("silu"), &act, "a string"));
  if (act != "silu")
    return r.Bad(fmt::format("hidden_act {:?}: ptk's gated MLP is SwiGLU's (hidden_act \"silu\")", act));
  PTK_RETURN_IF_ERROR(r.GetReal("rms_norm_eps", 1e-6, &c->layernorm_epsilon, 0, true, kMaxLayerNormEpsilon, false));
  PTK_RETURN_IF_ERROR(r.GetReal("attention_dropout", 0.0, &c->attention_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(r.GetReal("initializer_range", 0.02, &c->init_method_std, 0, true, kMaxInitMethodStd, false));
  c->hidden_dropout = 0.0;  // LlamaForCausalLM has none
  double partial = 1.0;
  PTK_RETURN_IF_ERROR(r.GetReal("partial_rotary_factor", 1.0, &partial, 0, true, 1, false));
  if (partial != 1.0)
    return r.Bad(
        fmt::format("partial_rotary_factor {}: transformers' Llama rotates every channel of a head", Num(partial)));
  PTK_RETURN_IF_ERROR(ReadRope(r, c));
  return absl::OkStatus();
}

absl::StatusOr<GPTConfig> ReadLlamaConfig(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                          std::vector<std::string>* notes, bool qwen3) {
  GPTConfig c;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.qk_layernorm = qwen3;  // Qwen3's q_norm and k_norm: Megatron's --qk-layernorm
  int64_t head_dim = 0;
  bool tie = false;
  if (qwen3) {
    PTK_RETURN_IF_ERROR(ReadQwen3Dims(r, &c));
    PTK_RETURN_IF_ERROR(ReadQwen3Attention(r, c, notes));
    head_dim = c.kv_channels;
    c.seq_length = c.max_position_embeddings;
    c.padded_vocab_size = PaddedVocabSize(c.vocab_size, make_vocab_size_divisible_by);
    PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", false, &tie, "true or false"));
    c.untie_embeddings_and_output_weights = !tie;
    c.add_bias_linear = false;
  } else {
    PTK_RETURN_IF_ERROR(ReadLlamaDims(r, make_vocab_size_divisible_by, &c, &head_dim, &tie));
  }
  PTK_RETURN_IF_ERROR(ReadLlamaCommon(r, &c));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size), hd = static_cast<double>(head_dim),
               implied = static_cast<double>(c.num_layers) *
                             (h * hd * static_cast<double>(2 * c.num_attention_heads + 2 * c.num_query_groups) +
                              3 * h * static_cast<double>(c.ffn_hidden_size)) +
                         2 * h * static_cast<double>(c.vocab_size);
  if (implied > 0x1p40)
    return r.Bad(fmt::format(
        "num_hidden_layers {}, hidden_size {}, intermediate_size {} and vocab_size {} make {:.3g} parameters: more "
        "than ptk can hold",
        c.num_layers, c.hidden_size, c.ffn_hidden_size, c.vocab_size, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  int64_t tp = 1;
  PTK_RETURN_IF_ERROR(r.GetInt("pretraining_tp", &tp, 1));
  if (tp != 1)
    notes->push_back(fmt::format(
        "pretraining_tp {}: transformers splits its products {} ways, ptk computes them whole (the same model)", tp,
        tp));
  return c;
}

absl::Status ReadLlamaTensors(const HfWeights& weights, const GPTConfig& c, std::vector<HfTensor>* tensors,
                              const std::string& model) {
  std::map<std::string, PresentTensor> present;
  for (const auto& [name, t] : weights.tensors) {
    // The rotary tables older files carry: not weights.
    static const std::regex kInvFreq(R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)");
    if (std::regex_match(name, kInvFreq)) continue;
    present.emplace(name, t);
  }
  return ReadPresentTensors(weights.source, std::move(present), c.untie_embeddings_and_output_weights, "", model,
                            tensors, weights.progress);
}

std::vector<std::pair<std::string, std::string>> LlamaSettings(const GPTConfig& c) {
  return {
      {"--num-layers", Int(c.num_layers)},
      {"--hidden-size", Int(c.hidden_size)},
      {"--num-attention-heads", Int(c.num_attention_heads)},
      {"--ffn-hidden-size", Int(c.ffn_hidden_size)},
      {"--max-position-embeddings", Int(c.max_position_embeddings)},
      {"--vocab-size", Int(c.vocab_size)},
      {"--make-vocab-size-divisible-by (padded vocabulary)", Int(c.padded_vocab_size)},
      {"--untie-embeddings-and-output-weights", c.untie_embeddings_and_output_weights ? "on" : "off"},
      {"--layernorm-epsilon", SettingNum(c.layernorm_epsilon)},
      {"--normalization", "RMSNorm"},
      {"--position-embedding-type", "rope"},
      {"--rotary-base", SettingNum(c.rotary_base)},
      {"--rotary-percent", SettingNum(c.rotary_percent)},
      {"--use-rope-scaling", c.use_rope_scaling ? "on" : "off"},
      {"--rope-scaling-factor", c.use_rope_scaling ? SettingNum(c.rope_scaling_factor) : ""},
      {"--rotary-seq-len-interpolation-factor",
       c.rotary_seq_len_interpolation_factor > 0 ? SettingNum(c.rotary_seq_len_interpolation_factor) : ""},
      {"--rotary-interleaved", "off"},
      {"--swiglu", "on"},
      {"--num-query-groups", Int(c.query_groups())},
      {"--kv-channels", Int(c.head_dim())},
      {"--disable-bias-linear", c.add_bias_linear ? "off" : "on"},
      {"--add-qkv-bias", c.add_qkv_bias ? "on" : "off"},
      {"--qk-layernorm", c.qk_layernorm ? "on" : "off"},
      {"--hidden-dropout", SettingNum(c.hidden_dropout)},
      {"--attention-dropout", SettingNum(c.attention_dropout)},
      {"--init-method-std", SettingNum(c.init_method_std)},
  };
}

std::string LlamaTrainFlags(const GPTConfig& c) {
  std::string flags = fmt::format(
      "--num-layers {} --hidden-size {} --num-attention-heads {} --ffn-hidden-size {} --max-position-embeddings {} "
      "--normalization RMSNorm --norm-epsilon {} --position-embedding-type rope --rotary-base {}{} --swiglu{}{}{}",
      c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size, c.max_position_embeddings,
      SettingNum(c.layernorm_epsilon), SettingNum(c.rotary_base), c.use_rope_scaling ? " --use-rope-scaling" : "",
      c.query_groups() != c.num_attention_heads
          ? fmt::format(" --group-query-attention --num-query-groups {}", c.query_groups())
          : "",
      c.add_bias_linear ? "" : " --disable-bias-linear",
      c.untie_embeddings_and_output_weights ? " --untie-embeddings-and-output-weights" : "");
  if (c.head_dim() * c.num_attention_heads != c.hidden_size) flags += fmt::format(" --kv-channels {}", c.head_dim());
  if (c.use_rope_scaling && c.rope_scaling_factor != 8.0)
    flags += " --rope-scaling-factor " + SettingNum(c.rope_scaling_factor);
  if (c.rotary_seq_len_interpolation_factor > 0)
    flags += " --rotary-seq-len-interpolation-factor " + SettingNum(c.rotary_seq_len_interpolation_factor);
  if (c.qk_layernorm) flags += " --qk-layernorm";
  if (c.add_qkv_bias && !c.add_bias_linear) flags += " --add-qkv-bias";  // Qwen2-MoE's qkv_bias
  return flags;
}

}  // namespace ptk::hf_detail
