// What the Megatron checkpoint readers share: names, splits, args, the ptk checkpoint written.
#include "interop/megatron_common.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <regex>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
#include "common/logging.h"
#include "common/progress.h"
#include "common/status.h"
#include "trainer/training_log.h"

namespace ptk::megatron {

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string RankDir(int64_t tp, int64_t pp, int64_t num_pp) {
  return num_pp > 1 ? fmt::format("mp_rank_{:02d}_{:03d}", tp, pp) : fmt::format("mp_rank_{:02d}", tp);
}

namespace {

// A transformer layer's parameter `rest` (of a MoE layer when `moe`) under `prefix` (the stage's decoder.layers.N., or
// mtp.layers.K.transformer_layer.): its names under both specs and its tensor-parallel split.
void LayerParam(const GPTConfig& c, bool moe, const std::string& prefix, const std::string& rest, MegParam* m) {
  m->local_name = prefix + rest;
  static const std::map<std::string, std::string> kTe = {
      {"input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"},
      {"input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"},
      {"pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"},
      {"pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"},
  };
  // A mixture of experts' layer keeps its pre-MLP norm apart (TENorm: no linear_fc1 to fuse it into).
  auto te = moe && rest.rfind("pre_mlp_layernorm.", 0) == 0 ? kTe.end() : kTe.find(rest);
  // MLA's TE spec: the input norm a TENorm of its own (no linear_qkv), the latents' norms fused into the up
  // projections (TELayerNormColumnParallelLinear, with --qk-layernorm).
  static const std::map<std::string, std::string> kMlaTe = {
      {"self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"},
      {"self_attention.q_layernorm.bias", "self_attention.linear_q_up_proj.layer_norm_bias"},
      {"self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"},
      {"self_attention.kv_layernorm.bias", "self_attention.linear_kv_up_proj.layer_norm_bias"},
  };
  std::string te_rest = te == kTe.end() ? rest : te->second;
  if (c.mla() && rest.rfind("input_layernorm.", 0) == 0) te_rest = rest;
  if (auto mla = kMlaTe.find(rest); c.mla() && mla != kMlaTe.end()) te_rest = mla->second;
  m->te_name = prefix + te_rest;
  // SequentialMLP's experts (one expert rank): each an MLP split over the tensor ranks as the dense one;
  // the router (mlp.router.weight) whole on every rank.
  static const std::regex kExpert(R"(mlp\.experts\.local_experts\.\d+\.(linear_fc1|linear_fc2)\.weight)");
  std::smatch em;
  if (std::regex_match(rest, em, kExpert)) {
    m->expert = true;
    m->split = em[1] == "linear_fc1" ? 0 : 1;
    if (c.swiglu && m->split == 0) m->chunks = 2;
  }
  // SharedExpertMLP: an MLP of the tensor group, split as the dense one; its gate_weight whole on every rank.
  if (rest == "mlp.shared_experts.linear_fc1.weight") {
    m->split = 0;
    if (c.swiglu) m->chunks = 2;
  }
  if (rest == "mlp.shared_experts.linear_fc2.weight") m->split = 1;
  if (rest == "self_attention.linear_qkv.weight" || rest == "self_attention.linear_qkv.bias" ||
      rest == "mlp.linear_fc1.weight" || rest == "mlp.linear_fc1.bias")
    m->split = 0;
  // SwiGLU's fc1 is [gate; up]: a tensor rank holds its rows of each, as Megatron's ColumnParallelLinear
  // of 2 x ffn outputs that MLP chunks in two.
  if (c.swiglu && (rest == "mlp.linear_fc1.weight" || rest == "mlp.linear_fc1.bias")) m->chunks = 2;
  if (rest == "self_attention.linear_proj.weight" || rest == "mlp.linear_fc2.weight") m->split = 1;
  // MLA's up projections (and linear_q_proj) column-parallel by heads; its down projections: SplitMlaDown.
  if (rest == "self_attention.linear_q_proj.weight" || rest == "self_attention.linear_q_up_proj.weight" ||
      rest == "self_attention.linear_kv_up_proj.weight")
    m->split = 0;
}

}  // namespace

// The parameters of a model in ptk's layout order (= Megatron's named_parameters order per stage).
absl::StatusOr<std::vector<MegParam>> MegParams(const ParamLayout& layout, int64_t pp) {
  const GPTConfig& c = layout.config;
  if (c.num_layers % pp != 0)
    return UsageError(
        fmt::format("--target-pipeline-parallel-size {} does not divide the model's {} layers", pp, c.num_layers));
  const int64_t per_stage = c.num_layers / pp;
  static const std::regex kLayer(R"(decoder\.layers\.(\d+)\.(.*))");
  // Multi-token prediction's depths (MultiTokenPredictionBlock, on the last stage): a depth's layer is of the decoder's
  // last layer's kind; its enorm, hnorm, eh_proj (column-parallel) and final_layernorm around it.
  static const std::regex kMtpLayer(R"((mtp\.layers\.\d+\.transformer_layer\.)(.*))");
  std::vector<MegParam> out;
  for (const ParamInfo& p : layout.infos) {
    MegParam m;
    m.info = &p;
    m.decay = p.shape.size() > 1;
    std::smatch match;
    if (std::regex_match(p.name, match, kLayer)) {
      const int64_t l = std::atoll(match[1].str().c_str());
      m.stage = l / per_stage;
      LayerParam(c, c.moe_layer(l), fmt::format("decoder.layers.{}.", l % per_stage), match[2].str(), &m);
    } else if (std::regex_match(p.name, match, kMtpLayer)) {
      m.stage = pp - 1;
      LayerParam(c, c.moe_layer(c.num_layers - 1), match[1].str(), match[2].str(), &m);
    } else {
      m.local_name = m.te_name = p.name;
      if (p.name.rfind("embedding.", 0) == 0) {
        m.stage = 0;
      } else {
        m.stage = pp - 1;  // final_layernorm, output_layer, the MTP depths' norms and eh_proj
      }
      if (p.name == "embedding.word_embeddings.weight" || p.name == "output_layer.weight") {
        m.split = 0;
        m.vocab = true;
      }
      if (p.name.ends_with(".eh_proj.weight")) m.split = 0;
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<MegBuffer> MegBuffers(const GPTConfig& c, const std::vector<MegParam>& params) {
  std::vector<MegBuffer> out;
  if (!c.moe() || !c.moe_router_enable_expert_bias) return out;
  constexpr std::string_view kRouter = "mlp.router.weight";
  auto bias = [&](const std::string& weight) {
    return weight.substr(0, weight.size() - std::string_view("weight").size()) + "expert_bias";
  };
  for (const MegParam& m : params)
    if (m.info->name.ends_with(kRouter))  // the router's weight names the buffer beside it (ExpertBiasName)
      out.push_back(MegBuffer{bias(m.info->name), bias(m.local_name), m.stage, c.num_experts});
  return out;
}

std::vector<DistribParam> StageDistribParams(const std::vector<MegParam>& params, int64_t stage, int64_t pp, bool te,
                                             bool tied_copy, int64_t vocab_rows, int64_t tp, int64_t hidden) {
  std::vector<DistribParam> out;
  for (const MegParam* m : StageOrder(params, stage, te))
    out.push_back(DistribParam{te ? m->te_name : m->local_name, Elements(ShardShape(*m, vocab_rows, tp)),
                               tied_copy && m->info->name == "embedding.word_embeddings.weight"});
  if (tied_copy && stage == pp - 1) out.push_back(DistribParam{"output_layer.weight", vocab_rows / tp * hidden, true});
  return out;
}

std::vector<DistribBuffer> RankDistribBuffers(const std::vector<MegParam>& params, int64_t p, int64_t pp, int64_t vp,
                                              bool te, bool tied_copy, int64_t vocab_rows, int64_t tp, int64_t hidden,
                                              const PyValue* args) {
  std::vector<DistribBuffer> out;
  for (int64_t v = 0; v < vp; ++v) {
    DistribBuffer b;
    b.params = StageDistribParams(params, v * pp + p, pp * vp, te, tied_copy, vocab_rows, tp, hidden);
    if (vp > 1)
      for (DistribParam& d : b.params) d.name = fmt::format("model{}.{}", v, d.name);
    if (v == 0) b.bucket_size = DistribBucketSize(args, p);
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<const MegParam*> StageOrder(const std::vector<MegParam>& params, int64_t stage, bool te) {
  // A decoder layer, or an MTP depth's transformer_layer (its norms and eh_proj a group of their own).
  static const std::regex kLayer(R"(((?:decoder|mtp)\.layers\.\d+(?:\.transformer_layer)?)\.(.*))");
  std::vector<const MegParam*> out;
  // A layer's parameters, contiguous in ptk's order: linear_proj's moved before linear_qkv's (and,
  // with Transformer Engine's names, before the input LayerNorm).
  std::vector<const MegParam*> layer, proj;
  std::string current;
  auto flush = [&] {
    // Multi-latent attention (MLASelfAttention): linear_proj before its projections, after the input norm (a module
    // of its own under either spec); under TE's names each latent norm is its up projection's (layer_norm_weight
    // and layer_norm_bias registered before its weight).
    auto has = [](const MegParam* q, const char* part) { return q->info->name.find(part) != std::string::npos; };
    const bool mla =
        std::any_of(layer.begin(), layer.end(), [&](const MegParam* q) { return has(q, ".linear_kv_down_proj."); });
    if (mla && te) {
      std::vector<const MegParam*> ordered;
      constexpr const char* kNorms[2][2] = {{".self_attention.q_layernorm.", ".linear_q_up_proj.weight"},
                                            {".self_attention.kv_layernorm.", ".linear_kv_up_proj.weight"}};
      for (const MegParam* q : layer) {
        for (const auto& [norm, up] : kNorms)
          if (has(q, up))
            for (const MegParam* n : layer)
              if (has(n, norm)) ordered.push_back(n);
        if (!has(q, kNorms[0][0]) && !has(q, kNorms[1][0])) ordered.push_back(q);
      }
      layer = std::move(ordered);
    }
    size_t at = 0;
    while (at < layer.size()) {
      std::smatch m;
      const std::string& name = layer[at]->info->name;
      std::regex_match(name, m, kLayer);
      const std::string rest = m[2].str();
      if (rest.rfind("self_attention.linear_qkv.", 0) == 0 || (te && !mla && rest.rfind("input_layernorm.", 0) == 0) ||
          (mla && rest.rfind("self_attention.linear_q", 0) == 0))
        break;
      ++at;
    }
    for (size_t i = 0; i < layer.size(); ++i) {
      if (i == at) out.insert(out.end(), proj.begin(), proj.end());
      out.push_back(layer[i]);
    }
    if (at >= layer.size()) out.insert(out.end(), proj.begin(), proj.end());
    layer.clear();
    proj.clear();
  };
  for (const MegParam& p : params) {
    if (p.stage != stage) continue;
    std::smatch m;
    if (!std::regex_match(p.info->name, m, kLayer)) {
      flush();
      out.push_back(&p);
      continue;
    }
    if (m[1].str() != current) {
      flush();
      current = m[1].str();
    }
    (m[2].str().rfind("self_attention.linear_proj.", 0) == 0 ? proj : layer).push_back(&p);
  }
  flush();
  return out;
}

// The shape of rank `t`'s shard of `m` when the vocabulary has `vocab_rows` rows.
std::vector<int64_t> ShardShape(const MegParam& m, int64_t vocab_rows, int64_t tp) {
  std::vector<int64_t> s = m.info->shape;
  if (m.vocab) s[0] = vocab_rows;
  if (m.split >= 0) s[static_cast<size_t>(m.split)] /= tp;
  return s;
}

// Copies shard `t` of the (rows, cols) matrix `full` (split along `split`) into `out`, or back when
// `gather`.
void CopyShard(float* full, float* shard, int64_t rows, int64_t cols, int split, int64_t t, int64_t tp, bool gather,
               int chunks) {
  if (split == 0 && chunks > 1) {
    const int64_t block = rows / chunks, r = block / tp;
    for (int64_t k = 0; k < chunks; ++k)
      CopyShard(full + k * block * cols, shard + k * r * cols, block, cols, 0, t, tp, gather);
    return;
  }
  if (split <= 0) {  // rows (or the whole tensor when replicated: t == 0, tp == 1)
    const int64_t r = split == 0 ? rows / tp : rows;
    float* f = full + t * r * cols;
    if (gather) {
      std::copy(shard, shard + r * cols, f);
    } else {
      std::copy(f, f + r * cols, shard);
    }
    return;
  }
  const int64_t c = cols / tp;
  for (int64_t i = 0; i < rows; ++i) {
    float* f = full + i * cols + t * c;
    if (gather) {
      std::copy(shard + i * c, shard + (i + 1) * c, f);
    } else {
      std::copy(f, f + c, shard + i * c);
    }
  }
}

int64_t Elements(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::optional<double> NumAttr(const PyValue* ns, const char* key) {
  const PyValue* v = ns ? ns->Get(key) : nullptr;
  if (!v || !v->IsNumber()) return std::nullopt;
  return v->Number();
}
std::optional<std::string> StrAttr(const PyValue* ns, const char* key) {
  const PyValue* v = ns ? ns->Get(key) : nullptr;
  if (!v || v->kind != PyValue::Kind::kStr) return std::nullopt;
  return v->s;
}
bool BoolAttr(const PyValue* ns, const char* key, bool fallback) {
  const PyValue* v = ns ? ns->Get(key) : nullptr;
  if (!v || v->kind == PyValue::Kind::kNone) return fallback;
  return v->Number() != 0;
}
const PyValue* IntKey(const PyValue* dict, int64_t key) {
  if (!dict || dict->kind != PyValue::Kind::kDict) return nullptr;
  for (const auto& [k, v] : dict->dict)
    if (k->IsInt() && k->i == key) return v.get();
  return nullptr;
}

absl::StatusOr<MegatronModel> ModelFromArgs(const PyValue* args, const std::string& source, const ConvertOptions& o,
                                            int64_t tp) {
  auto bad = [&](const std::string& file, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: {}", file, why));
  };
  MegatronModel out;
  GPTConfig& c = out.config;
  auto need_int = [&](const char* key, int64_t* out) -> absl::Status {
    auto v = NumAttr(args, key);
    if (!v) return bad(source, fmt::format("args.{} is missing", key));
    *out = static_cast<int64_t>(*v);
    return absl::OkStatus();
  };
  PTK_RETURN_IF_ERROR(need_int("num_layers", &c.num_layers));
  PTK_RETURN_IF_ERROR(need_int("hidden_size", &c.hidden_size));
  PTK_RETURN_IF_ERROR(need_int("num_attention_heads", &c.num_attention_heads));
  PTK_RETURN_IF_ERROR(need_int("max_position_embeddings", &c.max_position_embeddings));
  PTK_RETURN_IF_ERROR(need_int("padded_vocab_size", &out.ckpt_padded));
  c.ffn_hidden_size = static_cast<int64_t>(NumAttr(args, "ffn_hidden_size").value_or(4.0 * c.hidden_size));
  c.seq_length = static_cast<int64_t>(NumAttr(args, "seq_length").value_or(c.max_position_embeddings));
  c.untie_embeddings_and_output_weights = BoolAttr(args, "untie_embeddings_and_output_weights", false);
  // --norm-epsilon (args.layernorm_epsilon before Megatron-LM renamed it).
  c.layernorm_epsilon = NumAttr(args, "norm_epsilon").value_or(NumAttr(args, "layernorm_epsilon").value_or(1e-5));
  c.hidden_dropout = NumAttr(args, "hidden_dropout").value_or(0.1);
  c.attention_dropout = NumAttr(args, "attention_dropout").value_or(0.1);
  c.init_method_std = NumAttr(args, "init_method_std").value_or(0.02);
  std::vector<std::string> unsupported;
  // The Llama line, as Megatron-LM's arguments name it.
  if (auto v = StrAttr(args, "normalization"); v && *v == "RMSNorm") {
    c.normalization = Normalization::kRMSNorm;
  } else if (v && *v != "LayerNorm") {
    unsupported.push_back("--normalization " + *v);
  }
  if (auto v = StrAttr(args, "position_embedding_type"); v && *v == "rope") {
    c.position_embedding = PositionEmbedding::kRope;
  } else if (v && *v == "none") {
    c.position_embedding = PositionEmbedding::kNone;
  } else if (v && *v != "learned_absolute") {
    unsupported.push_back("--position-embedding-type " + *v);
  }
  if (c.rope()) {
    c.rotary_base = NumAttr(args, "rotary_base").value_or(10000.0);
    c.rotary_percent = NumAttr(args, "rotary_percent").value_or(1.0);
    c.use_rope_scaling = BoolAttr(args, "use_rope_scaling", false);
    c.rotary_interleaved = BoolAttr(args, "rotary_interleaved", false);
    // None (Megatron's default) reads as no number: no interpolation. A factor no run could use is refused.
    if (auto f = NumAttr(args, "rotary_seq_len_interpolation_factor"); f && !(*f > 0 && std::isfinite(*f)))
      unsupported.push_back(fmt::format("--rotary-seq-len-interpolation-factor {}", *f));
    else if (f)
      c.rotary_seq_len_interpolation_factor = *f;
    if (c.use_rope_scaling) c.rope_scaling_factor = NumAttr(args, "rope_scaling_factor").value_or(8.0);
  }
  c.swiglu = BoolAttr(args, "swiglu", false);
  // Without --group-query-attention Megatron gives every query head its key and value head, whatever
  // args.num_query_groups says.
  if (BoolAttr(args, "group_query_attention", false)) {
    auto g = NumAttr(args, "num_query_groups");
    if (!g) return bad(source, "args.group_query_attention without args.num_query_groups");
    c.num_query_groups = static_cast<int64_t>(*g);
  }
  if (auto v = NumAttr(args, "kv_channels"); v && static_cast<int64_t>(*v) * c.num_attention_heads != c.hidden_size)
    c.kv_channels = static_cast<int64_t>(*v);
  c.add_bias_linear = BoolAttr(args, "add_bias_linear", true);
  c.add_qkv_bias = !c.add_bias_linear && BoolAttr(args, "add_qkv_bias", false);
  c.apply_layernorm_1p = BoolAttr(args, "apply_layernorm_1p", false);
  if (BoolAttr(args, "apply_residual_connection_post_layernorm", false))
    unsupported.push_back("--apply-residual-connection-post-layernorm");
  c.qk_layernorm = BoolAttr(args, "qk_layernorm", false);
  if (BoolAttr(args, "qk_l2_norm", false)) unsupported.push_back("--qk-l2-norm");
  if (BoolAttr(args, "attention_output_gate", false)) unsupported.push_back("--attention-output-gate");
  c.squared_relu = BoolAttr(args, "squared_relu", false);
  if (c.squared_relu && c.swiglu) return bad(source, "args.squared_relu with args.swiglu (Megatron asserts not both)");
  c.init_method_xavier_uniform = BoolAttr(args, "init_method_xavier_uniform", false);
  // Megatron's GELU MLP is the tanh GELU only through its fused bias-GELU kernel; unfused (--no-bias-gelu-fusion,
  // or no biases, which its arguments.py lets not fuse) it is torch's exact erf GELU.
  c.gelu_exact = !c.swiglu && !c.squared_relu && (!BoolAttr(args, "bias_gelu_fusion", true) || !c.add_bias_linear);
  if (!unsupported.empty())
    return absl::FailedPreconditionError(fmt::format(
        "{}: the model was trained with {}: ptk's model is Megatron's GPT with the Llama line's settings "
        "(--normalization, --position-embedding-type rope, --swiglu, --group-query-attention, --kv-channels, "
        "--disable-bias-linear, --qk-layernorm, --squared-relu, --apply-layernorm-1p)",
        source, fmt::join(unsupported, ", ")));
  PTK_RETURN_IF_ERROR(ReadMoeArgs(args, source, tp, &c));  // --num-experts: ptk's MoE layers
  PTK_RETURN_IF_ERROR(ReadMlaArgs(args, source, &c));      // --multi-latent-attention
  PTK_RETURN_IF_ERROR(ReadMtpArgs(args, &c));              // --mtp-num-layers: its mtp.layers.* tensors
  // The tokenizer's vocabulary: --true-vocab-size, args.vocab_size, or GPT-2's for its tokenizer.
  if (o.true_vocab_size > 0) {
    c.vocab_size = o.true_vocab_size;
  } else if (auto v = NumAttr(args, "vocab_size"); v && *v > 0) {
    c.vocab_size = static_cast<int64_t>(*v);
  } else if (StrAttr(args, "tokenizer_type").value_or("") == "GPT2BPETokenizer") {
    c.vocab_size = 50257;
  } else {
    return UsageError(fmt::format("{}: args record no vocabulary size (tokenizer {}): give --true-vocab-size", source,
                                  StrAttr(args, "tokenizer_type").value_or("unknown")));
  }
  out.divisible = static_cast<int64_t>(NumAttr(args, "make_vocab_size_divisible_by").value_or(128));
  c.padded_vocab_size = PaddedVocabSize(c.vocab_size, out.divisible);
  if (c.padded_vocab_size > out.ckpt_padded || out.ckpt_padded % tp != 0)
    return bad(source, fmt::format("args.padded_vocab_size {} does not hold a vocabulary of {} padded to {} over {} "
                                   "tensor-parallel ranks",
                                   out.ckpt_padded, c.vocab_size, c.padded_vocab_size, tp));
  if (absl::Status st = c.Validate(); !st.ok()) return bad(source, std::string(StatusMessage(st)));
  if (c.num_attention_heads % tp != 0 || c.ffn_hidden_size % tp != 0 || c.query_groups() % tp != 0 ||
      (c.moe() && c.moe_ffn() % tp != 0))
    return bad(source,
               fmt::format("{} heads / {} query groups / ffn {} do not split over {} tensor-parallel ranks",
                           c.num_attention_heads, c.query_groups(), c.moe() ? c.moe_ffn() : c.ffn_hidden_size, tp));
  return out;
}

namespace {
const char* PositionEmbeddingName(const GPTConfig& c) {
  return c.rope() ? "rope" : c.position_embedding == PositionEmbedding::kNone ? "none" : "learned_absolute";
}

// ptk-train's flags for the Llama line's settings that leave GPT-3's model (none for a GPT-3 model).
std::string LlamaLineFlags(const GPTConfig& c) {
  if (c.gpt3() && !c.add_qkv_bias) return "";
  std::string f = fmt::format(" --normalization {} --norm-epsilon {} --position-embedding-type {}",
                              c.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm", c.layernorm_epsilon,
                              PositionEmbeddingName(c));
  if (c.rope()) {
    f += fmt::format(" --rotary-base {}", c.rotary_base);
    if (c.rotary_percent != 1.0) f += fmt::format(" --rotary-percent {}", c.rotary_percent);
    if (c.use_rope_scaling) f += " --use-rope-scaling";
    if (c.use_rope_scaling && c.rope_scaling_factor != 8.0)
      f += fmt::format(" --rope-scaling-factor {}", c.rope_scaling_factor);
    if (c.rotary_seq_len_interpolation_factor > 0)
      f += fmt::format(" --rotary-seq-len-interpolation-factor {}", c.rotary_seq_len_interpolation_factor);
    if (c.rotary_interleaved) f += " --rotary-interleaved";
  }
  if (c.swiglu) f += " --swiglu";
  if (c.query_groups() != c.num_attention_heads)
    f += fmt::format(" --group-query-attention --num-query-groups {}", c.query_groups());
  if (c.kv_channels > 0) f += fmt::format(" --kv-channels {}", c.kv_channels);
  if (!c.add_bias_linear) f += " --disable-bias-linear";
  if (c.add_qkv_bias) f += " --add-qkv-bias";
  if (c.qk_layernorm) f += " --qk-layernorm";
  return f;
}
}  // namespace

absl::Status SaveImported(const ConvertOptions& o, const PyValue* args, const PyValue& root,
                          torchfmt::TorchArchiveReader* reader, const ParamLayout& layout, int64_t divisible,
                          bool optimizer_state, int64_t adam_step, const std::vector<float>& weights,
                          const std::vector<float>& m1, const std::vector<float>& m2, ConvertSummary* s,
                          ModelBuffers buffers) {
  const GPTConfig& c = s->config;
  // The training state.
  TrainState state;
  state.buffers = std::move(buffers);  // the routers' expert biases, as ptk-train's checkpoint holds them
  if (s->release) {
    s->iteration = adam_step = 0;
    s->notes.push_back(
        "the tracker says release: imported at iteration 0 without the optimizer state and the scheduler, as "
        "Megatron loads a release checkpoint (the consumed samples its args record kept, as its load keeps them)");
  }
  state.iteration = s->iteration;
  state.consumed_train_samples = static_cast<int64_t>(NumAttr(args, "consumed_train_samples").value_or(0));
  state.consumed_valid_samples = static_cast<int64_t>(NumAttr(args, "consumed_valid_samples").value_or(0));
  state.skipped_train_samples = static_cast<int64_t>(NumAttr(args, "skipped_train_samples").value_or(0));
  state.adam_step = adam_step;
  state.seed = static_cast<uint64_t>(NumAttr(args, "seed").value_or(1234));
  const PyValue* sched = s->release ? nullptr : root.Get("opt_param_scheduler");
  if (s->release) {
    state.scheduler_num_steps = 0;  // a new scheduler: Megatron's load leaves it as built
  } else if (sched && sched->kind == PyValue::Kind::kDict) {
    state.scheduler_num_steps = static_cast<int64_t>(NumAttr(sched, "num_steps").value_or(0));
    SchedulerConfig sc;
    sc.max_lr = NumAttr(sched, "max_lr").value_or(0);
    sc.min_lr = NumAttr(sched, "min_lr").value_or(0);
    sc.warmup_steps = NumAttr(sched, "lr_warmup_steps").value_or(0);  // a float for a --lr-warmup-fraction
    sc.decay_steps = static_cast<int64_t>(NumAttr(sched, "lr_decay_steps").value_or(0));
    sc.decay_style = StrAttr(sched, "lr_decay_style").value_or("linear");
    sc.start_wd = NumAttr(sched, "start_wd").value_or(0.01);
    sc.end_wd = NumAttr(sched, "end_wd").value_or(0.01);
    sc.wd_incr_steps = static_cast<int64_t>(NumAttr(sched, "wd_incr_steps").value_or(0));
    sc.wd_incr_style = StrAttr(sched, "wd_incr_style").value_or("constant");
    sc.init_lr = NumAttr(args, "lr_warmup_init").value_or(0);
    sc.wsd_decay_steps = static_cast<int64_t>(NumAttr(args, "lr_wsd_decay_samples").value_or(0));
    sc.wsd_decay_style = StrAttr(args, "lr_wsd_decay_style").value_or("exponential");
    // --decoupled-lr's group keeps its max_lr and min_lr in the optimizer's param_groups, which Megatron's
    // resume loads back (megatron-core 0.16.1, whatever the scheduler flags): the run's flags, as its args
    // record them (its groups cannot tell that group from --lr's: is_decoupled_lr stays False).
    sc.decoupled_lr = NumAttr(args, "decoupled_lr");
    if (sc.decoupled_lr) sc.decoupled_min_lr = NumAttr(args, "decoupled_min_lr");
    state.scheduler = sc;
  } else {
    state.scheduler_num_steps = state.consumed_train_samples;
  }
  if (const PyValue* opt = s->release ? nullptr : root.Get("optimizer")) {
    const PyValue* gs = opt->Get("grad_scaler");
    if (gs && gs->kind == PyValue::Kind::kDict && BoolAttr(args, "fp16", false)) {
      LossScaleState ls;
      if (const PyValue* sc = gs->Get("scale"); sc && sc->kind == PyValue::Kind::kTensor) {
        PTK_ASSIGN_OR_RETURN(std::vector<float> v, reader->ReadFloat(sc->tensor, "grad_scaler.scale"));
        if (!v.empty()) ls.scale = v[0];
      } else if (sc && sc->IsNumber()) {
        ls.scale = sc->Number();
      }
      ls.growth_tracker = static_cast<int64_t>(NumAttr(gs, "growth_tracker").value_or(0));
      ls.hysteresis_tracker = static_cast<int64_t>(NumAttr(gs, "hysteresis_tracker").value_or(0));
      if (ls.scale > 0 && std::isfinite(ls.scale)) state.loss_scale = ls;
    }
  }
  auto num = [](double v) { return fmt::format("{}", v); };
  state.settings = {
      {"--num-layers", std::to_string(c.num_layers)},
      {"--hidden-size", std::to_string(c.hidden_size)},
      {"--num-attention-heads", std::to_string(c.num_attention_heads)},
      {"--ffn-hidden-size", std::to_string(c.ffn_hidden_size)},
      {"--seq-length", std::to_string(c.seq_length)},
      {"--max-position-embeddings", std::to_string(c.max_position_embeddings)},
      {"--vocab-size", std::to_string(c.vocab_size)},
      {"--make-vocab-size-divisible-by (padded vocabulary)", std::to_string(c.padded_vocab_size)},
      {"--untie-embeddings-and-output-weights", c.untie_embeddings_and_output_weights ? "on" : "off"},
      {"--layernorm-epsilon", num(c.layernorm_epsilon)},
      {"--hidden-dropout", num(c.hidden_dropout)},
      {"--attention-dropout", num(c.attention_dropout)},
      {"--init-method-std", num(c.init_method_std)},
      {"--normalization", c.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm"},
      {"--position-embedding-type", PositionEmbeddingName(c)},
      {"--rotary-base", num(c.rotary_base)},
      {"--rotary-percent", num(c.rotary_percent)},
      {"--use-rope-scaling", c.use_rope_scaling ? "on" : "off"},
      {"--rope-scaling-factor", c.use_rope_scaling ? num(c.rope_scaling_factor) : ""},
      {"--rotary-seq-len-interpolation-factor",
       c.rotary_seq_len_interpolation_factor > 0 ? num(c.rotary_seq_len_interpolation_factor) : ""},
      {"--rotary-interleaved", c.rotary_interleaved ? "on" : "off"},
      {"--swiglu", c.swiglu ? "on" : "off"},
      {"--num-query-groups", std::to_string(c.query_groups())},
      {"--kv-channels", std::to_string(c.head_dim())},
      {"--disable-bias-linear", c.add_bias_linear ? "off" : "on"},
      {"--add-qkv-bias", c.add_qkv_bias ? "on" : "off"},
      {"--qk-layernorm", c.qk_layernorm ? "on" : "off"},
      {"--squared-relu", c.squared_relu ? "on" : "off"},
      {"--no-bias-gelu-fusion", c.gelu_exact ? "on (the exact erf GELU)" : "off"},
      {"--apply-layernorm-1p", c.apply_layernorm_1p ? "on" : "off"},
      {"--init-method-xavier-uniform", c.init_method_xavier_uniform ? "on" : "off"},
      {"--seed", std::to_string(state.seed)},
      {"--bf16/--fp16", BoolAttr(args, "bf16", false)   ? "bf16"
                        : BoolAttr(args, "fp16", false) ? "fp16"
                                                        : "fp32"},
  };
  // Megatron's args record the divisor beside the padded vocabulary (--use-checkpoint-args compares it).
  if (auto divisor = NumAttr(args, "make_vocab_size_divisible_by"))
    state.settings.emplace_back("--make-vocab-size-divisible-by", std::to_string(static_cast<int64_t>(*divisor)));
  if (auto gbs = NumAttr(args, "global_batch_size"))
    state.settings.emplace_back("--global-batch-size", std::to_string(static_cast<int64_t>(*gbs)));
  // How the run weighed its losses (a Megatron before the flag records none: nothing said).
  const bool per_token = BoolAttr(args, "calculate_per_token_loss", false);
  if (args != nullptr && args->Get("calculate_per_token_loss") != nullptr)
    state.settings.emplace_back("--calculate-per-token-loss", per_token ? "on" : "off");
  if (!optimizer_state && !s->release) state.settings.emplace_back(kOptimizerStateSetting, "none");
  AddMoeSettings(c, &state.settings);
  AddMlaSettings(c, &state.settings);
  AddMtpSettings(c, &state.settings);
  SaveDirectory save_dir;  // locked; a failed import (a full disk) leaves no --save-dir it made
  PTK_RETURN_IF_ERROR(save_dir.Take(o.save_dir, "ptk-train", o.lock_wait));
  PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o.save_dir));
  PTK_RETURN_IF_ERROR(CheckImportTarget(o.save_dir, s->iteration, /*with_moments=*/true));
  const std::vector<float> zero(s->release ? weights.size() : 0, 0.0f);  // a release's moments: none loaded
  // The weights and two moments, written, checksummed and synced: minutes for a large model, counted.
  if (const uint64_t bytes = 3 * weights.size() * sizeof(float); o.progress && bytes >= kConvertLongStepBytes)
    log::Info("convert: writing {} ({}) ...", CheckpointFile(o.save_dir, s->iteration),
              HumanBytes(static_cast<double>(bytes)));
  {
    ProgressReporter writing({.label = "convert", .item_unit = "files", .enabled = o.progress});
    PTK_RETURN_IF_ERROR(SaveCheckpoint(o.save_dir, layout, weights, s->release ? zero : m1, s->release ? zero : m2,
                                       state, o.args_json, &writing));
  }
  save_dir.Keep();
  s->destination = CheckpointFile(o.save_dir, s->iteration);
  s->num_params = layout.num_params;
  s->train_flags = fmt::format(
      "--num-layers {} --hidden-size {} --num-attention-heads {} --ffn-hidden-size {} --max-position-embeddings {} "
      "--seq-length {}{}{}{}",
      c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size, c.max_position_embeddings, c.seq_length,
      c.untie_embeddings_and_output_weights ? " --untie-embeddings-and-output-weights" : "",
      c.vocab_size != 50257 ? fmt::format(" --vocab-size {}", c.vocab_size) : "", LlamaLineFlags(c));
  if (divisible != 128) s->train_flags += fmt::format(" --make-vocab-size-divisible-by {}", divisible);
  if (c.squared_relu) s->train_flags += " --squared-relu";
  s->train_flags += MoeTrainFlags(c);
  s->train_flags += MlaTrainFlags(c);
  s->train_flags += MtpTrainFlags(c);
  // The exact GELU: --disable-bias-linear (in the Llama line's flags) selects it already.
  if (c.gelu_exact && c.add_bias_linear) s->train_flags += " --no-bias-gelu-fusion";
  if (c.apply_layernorm_1p) s->train_flags += " --apply-layernorm-1p";
  if (per_token) s->train_flags += " --calculate-per-token-loss";             // the loss the run was trained on
  if (!optimizer_state && !s->release) s->train_flags += " --no-load-optim";  // its --load refuses it otherwise
  return absl::OkStatus();
}

}  // namespace ptk::megatron
