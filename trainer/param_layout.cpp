// The parameter layout with its init (GPTConfig's checks: gpt_config.cpp).
#include "trainer/param_layout.h"

#include <algorithm>
#include <cmath>
#include <regex>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/model_limits.h"
#include "trainer/mtp_layout.h"

namespace ptk {

int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by) {
  if (divisible_by <= 1) return vocab_size;
  return (vocab_size + divisible_by - 1) / divisible_by * divisible_by;
}

PipelineStage StageOf(const std::vector<int64_t>& stage_layers, int rank, int virtual_size) {
  PipelineStage s;
  s.size = static_cast<int>(stage_layers.size());
  s.rank = rank;
  s.virtual_size = virtual_size;
  s.num_layers = stage_layers[static_cast<size_t>(rank)];
  if (virtual_size > 1) {  // chunk 0 holds virtual stage `rank`
    s.first_layer = rank * (s.num_layers / virtual_size);
    return s;
  }
  for (int p = 0; p < rank; ++p) s.first_layer += stage_layers[static_cast<size_t>(p)];
  return s;
}

int64_t MoeLayersOnStage(const GPTConfig& config, const PipelineStage& stage) {
  if (!config.moe()) return 0;
  const int64_t n = stage.num_layers < 0 ? config.num_layers : stage.num_layers;
  const int V = std::max(stage.virtual_size, 1);
  const int64_t per_chunk = n / V;
  int64_t moe = 0;
  for (int v = 0; v < V; ++v)  // chunk v: virtual stage v * size + rank (CutStage's)
    for (int64_t i = 0; i < per_chunk; ++i)
      moe += config.moe_layer(stage.first_layer + int64_t{v} * stage.size * per_chunk + i) ? 1 : 0;
  return moe;
}

namespace {
// A MoE layer's shared experts' tensors (where it has them), taken in Create's order.
template <typename Take>
void TakeSharedExperts(const LayerParams& w, LayerParams* lp, Take& take) {
  lp->shared_gate = take(w.shared_gate);
  lp->shared_fc1 = take(w.shared_fc1);
  lp->shared_fc2 = take(w.shared_fc2);
}

// One transformer layer's tensors, in Create's order.
template <typename Take>
LayerParams TakeLayer(const LayerParams& w, const GPTConfig& cf, int64_t tensor_size, Take& take) {
  LayerParams lp;
  for (auto [to, from] : {std::pair{&lp.ln1_w, w.ln1_w},
                          {&lp.ln1_b, w.ln1_b},
                          {&lp.qkv_w, w.qkv_w},
                          {&lp.qkv_b, w.qkv_b},
                          {&lp.mla_q_proj, w.mla_q_proj},  // MLA's, in Create's order
                          {&lp.mla_q_down, w.mla_q_down},
                          {&lp.mla_q_up, w.mla_q_up},
                          {&lp.mla_kv_down, w.mla_kv_down},
                          {&lp.mla_kv_up, w.mla_kv_up},
                          {&lp.mla_q_norm_w, w.mla_q_norm_w},
                          {&lp.mla_q_norm_b, w.mla_q_norm_b},
                          {&lp.mla_kv_norm_w, w.mla_kv_norm_w},
                          {&lp.mla_kv_norm_b, w.mla_kv_norm_b},
                          {&lp.q_norm_w, w.q_norm_w},
                          {&lp.q_norm_b, w.q_norm_b},
                          {&lp.k_norm_w, w.k_norm_w},
                          {&lp.k_norm_b, w.k_norm_b},
                          {&lp.softmax_offset, w.softmax_offset},  // core_attention's, before linear_proj
                          {&lp.proj_w, w.proj_w},
                          {&lp.proj_b, w.proj_b},
                          {&lp.ln2_w, w.ln2_w},
                          {&lp.ln2_b, w.ln2_b},
                          {&lp.fc1_w, w.fc1_w},
                          {&lp.fc1_b, w.fc1_b},
                          {&lp.fc2_w, w.fc2_w},
                          {&lp.fc2_b, w.fc2_b}})
    *to = take(from);
  lp.router_w = take(w.router_w);
  if (w.experts >= 0) {  // each expert's fc1 and fc2, in order
    const int64_t ef = cf.expert_floats() / tensor_size, f1 = ef - cf.hidden_size * cf.moe_ffn() / tensor_size;
    for (int64_t j = 0; j < cf.num_experts; ++j) {
      const int64_t at = take(w.experts + j * ef);
      if (j == 0) lp.experts = at;
      take(w.experts + j * ef + f1);
    }
  }
  TakeSharedExperts(w, &lp, take);
  return lp;
}

// The multi-token prediction depths' tensors (Create's order), on the last pipeline stage (megatron-core's
// mtp_on_this_rank without a custom layout).
template <typename Take, typename Layer>
void TakeMtpDepths(const ParamLayout& whole, Take& take, Layer& take_layer, ParamLayout* s) {
  for (const MtpLayerParams& w : whole.mtp) {
    MtpLayerParams mp;
    mp.enorm_w = take(w.enorm_w);
    mp.enorm_b = take(w.enorm_b);
    mp.hnorm_w = take(w.hnorm_w);
    mp.hnorm_b = take(w.hnorm_b);
    mp.eh_proj = take(w.eh_proj);
    mp.layer = take_layer(w.layer);
    mp.norm_w = take(w.norm_w);
    mp.norm_b = take(w.norm_b);
    s->mtp.push_back(mp);
  }
}

// A pipeline stage's tensors taken from the whole model's, in its order, at new offsets.
absl::StatusOr<ParamLayout> CutStage(const ParamLayout& whole, const PipelineStage& stage) {
  const int64_t L = whole.config.num_layers, n = stage.num_layers < 0 ? L : stage.num_layers;
  const int V = stage.virtual_size;
  if (stage.size < 1 || stage.rank < 0 || stage.rank >= stage.size || stage.first_layer < 0 || n < 1 ||
      stage.first_layer + n > L)
    return absl::InvalidArgumentError(fmt::format("pipeline stage {} of {} with layers [{}, {}) of a {}-layer model",
                                                  stage.rank, stage.size, stage.first_layer, stage.first_layer + n, L));
  // Interleaved: V chunks of n / V layers, chunk v at virtual stage v * size + rank.
  const int64_t per_chunk = V > 1 ? n / V : n;
  if (V < 1 || (V > 1 && (n % V != 0 || L != per_chunk * V * stage.size || stage.size < 2 ||
                          stage.first_layer != stage.rank * per_chunk)))
    return absl::InvalidArgumentError(
        fmt::format("pipeline stage {} of {} in {} model chunks of {} layers each: a {}-layer model splits into {} "
                    "virtual stages only with as many layers each",
                    stage.rank, stage.size, V, n / std::max(V, 1), L, int64_t{V} * stage.size));
  ParamLayout s;
  s.config = whole.config;
  s.tensor_size = whole.tensor_size;
  s.tensor_rank = whole.tensor_rank;
  s.pipeline_size = stage.size;
  s.pipeline_rank = stage.rank;
  s.first_layer = stage.first_layer;
  s.pre_process = stage.rank == 0;
  s.post_process = stage.rank == stage.size - 1;
  s.virtual_size = V;
  for (int v = 0; v < V; ++v) s.chunk_first_layer.push_back(stage.first_layer + int64_t{v} * stage.size * per_chunk);
  std::vector<size_t> index_at(static_cast<size_t>(whole.num_params + 1), 0);
  for (size_t k = 0; k < whole.infos.size(); ++k) index_at[static_cast<size_t>(whole.infos[k].offset)] = k;
  int64_t offset = 0;
  auto take = [&](int64_t at, bool copy = false) -> int64_t {
    if (at < 0) return -1;
    const size_t k = index_at[static_cast<size_t>(at)];
    ParamInfo p = whole.infos[k];
    p.offset = offset;
    p.embedding_copy = copy;
    offset += p.size;
    s.infos.push_back(std::move(p));
    s.whole_index.push_back(k);
    return s.infos.back().offset;
  };
  s.wte = s.wpe = s.lnf_w = s.lnf_b = s.out_w = -1;
  if (s.pre_process) {
    s.wte = take(whole.wte);
    s.wpe = take(whole.wpe);
  }
  auto take_layer = [&](const LayerParams& w) { return TakeLayer(w, whole.config, whole.tensor_size, take); };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = s.chunk_first_layer[static_cast<size_t>(i / per_chunk)] + i % per_chunk;
    s.layers.push_back(take_layer(whole.layers[static_cast<size_t>(l)]));
  }
  if (s.post_process) {
    s.lnf_w = take(whole.lnf_w);
    s.lnf_b = take(whole.lnf_b);
    TakeMtpDepths(whole, take, take_layer, &s);
    if (whole.config.untie_embeddings_and_output_weights)
      s.out_w = take(whole.out_w);
    else
      s.out_w = s.pre_process ? s.wte : take(whole.wte, /*copy=*/true);  // last: the copy ends the buffer
    // Multi-token prediction embeds on the last stage: with tied weights the output layer's copy, else a copy of
    // its own (Megatron's shared embedding on the MTP stage, its gradient summed over the embedding group).
    if (!whole.mtp.empty() && !s.pre_process)
      s.wte = whole.config.untie_embeddings_and_output_weights ? take(whole.wte, /*copy=*/true) : s.out_w;
  }
  s.num_params = offset;
  return s;
}

// Expert rank `rank` of `size`'s part of `in`: its experts, renumbered from 0, every other tensor kept, offsets
// packed again; whole_index keeps each tensor's place in the whole model (its init, the checkpoints' reshard).
absl::StatusOr<ParamLayout> CutExperts(const ParamLayout& in, int size, int rank) {
  const int64_t E = in.config.num_experts;
  if (size < 1 || rank < 0 || rank >= size)
    return absl::InvalidArgumentError(fmt::format("expert rank {} of {}: not a valid rank", rank, size));
  if (E < 1 || E % size != 0)
    return UsageError(fmt::format("--num-experts {} is not divisible by --expert-model-parallel-size {}", E, size));
  const int64_t L = E / size, first = L * rank;
  ParamLayout s = in;
  s.expert_size = size;
  s.expert_rank = rank;
  s.infos.clear();
  s.whole_index.clear();
  std::vector<int64_t> moved(static_cast<size_t>(in.num_params + 1), -1);  // old offset -> new
  int64_t offset = 0;
  const std::regex local(R"(^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$)");
  for (size_t k = 0; k < in.infos.size(); ++k) {
    ParamInfo p = in.infos[k];
    if (p.expert) {
      std::smatch m;
      if (!std::regex_match(p.name, m, local)) return absl::InternalError("CutExperts: " + p.name);
      const int64_t j = std::stoll(m[2].str());
      if (j < first || j >= first + L) continue;
      p.name = fmt::format("{}{}{}", m[1].str(), j - first, m[3].str());
    }
    moved[static_cast<size_t>(p.offset)] = offset;
    p.offset = offset;
    offset += p.size;
    s.infos.push_back(std::move(p));
    s.whole_index.push_back(in.WholeInfoIndex(k));
  }
  auto move = [&](int64_t at) { return at < 0 ? -1 : moved[static_cast<size_t>(at)]; };
  std::vector<LayerParams*> layers;  // the decoder's, then the multi-token prediction depths' (MoE or not)
  for (LayerParams& lp : s.layers) layers.push_back(&lp);
  for (MtpLayerParams& mp : s.mtp) {
    layers.push_back(&mp.layer);
    for (int64_t* f : {&mp.enorm_w, &mp.enorm_b, &mp.hnorm_w, &mp.hnorm_b, &mp.eh_proj, &mp.norm_w, &mp.norm_b})
      *f = move(*f);
  }
  for (LayerParams* l : layers) {
    LayerParams& lp = *l;
    for (int64_t* f :
         {&lp.ln1_w,        &lp.ln1_b,       &lp.qkv_w,          &lp.qkv_b,         &lp.proj_w,        &lp.proj_b,
          &lp.ln2_w,        &lp.ln2_b,       &lp.fc1_w,          &lp.fc1_b,         &lp.fc2_w,         &lp.fc2_b,
          &lp.q_norm_w,     &lp.q_norm_b,    &lp.k_norm_w,       &lp.k_norm_b,      &lp.router_w,      &lp.shared_fc1,
          &lp.shared_fc2,   &lp.shared_gate, &lp.softmax_offset, &lp.mla_q_proj,    &lp.mla_q_down,    &lp.mla_q_norm_w,
          &lp.mla_q_norm_b, &lp.mla_q_up,    &lp.mla_kv_down,    &lp.mla_kv_norm_w, &lp.mla_kv_norm_b, &lp.mla_kv_up})
      *f = move(*f);
    if (lp.experts >= 0) lp.experts = move(lp.experts + first * in.config.expert_floats() / in.tensor_size);
  }
  for (int64_t* f : {&s.wte, &s.wpe, &s.lnf_w, &s.lnf_b, &s.out_w}) *f = move(*f);
  s.num_params = offset;
  return s;
}
}  // namespace

namespace {
// A multi-latent attention layer's tensors (LayerParams' mla_*), in MLASelfAttention's registration order:
// linear_q_proj or linear_q_down_proj and linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, then the
// latents' norms (--qk-layernorm). Every projection on init_method's normal, without bias. Tensor ranks
// (megatron-core's MLA split, as its DeepSeek spec): linear_q_proj, linear_q_up_proj and linear_kv_up_proj
// column-parallel (each rank its heads' rows), the down projections and the latents' norms whole on every rank
// (duplicated; their gradients summed over the tensor group: NonTensorParallelGradRanges), linear_proj row-parallel
// (Create's).
template <typename AddIf>
void AddMlaParams(const GPTConfig& cf, const std::string& p, float one, int64_t T, AddIf& add_if, LayerParams* lp) {
  const std::string a = p + "self_attention.";
  const int64_t c = cf.hidden_size, qr = cf.q_lora_rank, kvr = cf.kv_lora_rank;
  const int64_t q_rows = cf.num_attention_heads * cf.mla_q_head_dim() / T;
  const bool lora = qr > 0, ln = cf.normalization == Normalization::kLayerNorm, norms = cf.qk_layernorm;
  const double std = cf.init_method_std;
  using Shape = std::vector<int64_t>;
  lp->qkv_w = lp->qkv_b = -1;
  lp->mla_q_proj = add_if(!lora, a + "linear_q_proj.weight", Shape{q_rows, c}, std, 0.0f, 0);
  lp->mla_q_down = add_if(lora, a + "linear_q_down_proj.weight", Shape{qr, c}, std);
  lp->mla_q_up = add_if(lora, a + "linear_q_up_proj.weight", Shape{q_rows, qr}, std, 0.0f, 0);
  lp->mla_kv_down = add_if(true, a + "linear_kv_down_proj.weight", Shape{kvr + cf.qk_pos_emb_head_dim, c}, std);
  lp->mla_kv_up = add_if(true, a + "linear_kv_up_proj.weight",
                         Shape{cf.num_attention_heads / T * (cf.qk_head_dim + cf.v_head_dim), kvr}, std, 0.0f, 0);
  lp->mla_q_norm_w = add_if(lora && norms, a + "q_layernorm.weight", Shape{qr}, 0.0, one);
  lp->mla_q_norm_b = add_if(lora && norms && ln, a + "q_layernorm.bias", Shape{qr}, 0.0);
  lp->mla_kv_norm_w = add_if(norms, a + "kv_layernorm.weight", Shape{kvr}, 0.0, one);
  lp->mla_kv_norm_b = add_if(norms && ln, a + "kv_layernorm.bias", Shape{kvr}, 0.0);
}
}  // namespace

absl::StatusOr<ParamLayout> ParamLayout::Create(const GPTConfig& config, int tensor_size, int tensor_rank,
                                                const PipelineStage& stage, int expert_size, int expert_rank) {
  if (expert_size != 1 || expert_rank != 0) {
    PTK_ASSIGN_OR_RETURN(const ParamLayout all, Create(config, tensor_size, tensor_rank, stage));
    return CutExperts(all, expert_size, expert_rank);
  }
  PTK_RETURN_IF_ERROR(ValidateMtpParallelism(config, tensor_size, stage.size, stage.virtual_size));
  if (stage.size != 1 || stage.virtual_size != 1 || (stage.num_layers >= 0 && stage.num_layers != config.num_layers)) {
    PTK_ASSIGN_OR_RETURN(const ParamLayout whole, Create(config, tensor_size, tensor_rank));
    return CutStage(whole, stage);
  }
  PTK_RETURN_IF_ERROR(config.Validate());
  if (tensor_size < 1 || tensor_rank < 0 || tensor_rank >= tensor_size)
    return absl::InvalidArgumentError(fmt::format("tensor rank {} of {}: not a valid rank", tensor_rank, tensor_size));
  if (config.num_attention_heads % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("--num-attention-heads ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.num_attention_heads, tensor_size));
  if (config.moe() && config.moe_ffn() % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("the experts' ffn (--moe-ffn-hidden-size, default --ffn-hidden-size: {}) must be a multiple of "
                    "--tensor-model-parallel-size ({})",
                    config.moe_ffn(), tensor_size));
  if (config.moe() && config.moe_shared_expert_intermediate_size % tensor_size != 0)
    return absl::InvalidArgumentError(fmt::format(
        "--moe-shared-expert-intermediate-size ({}) must be a multiple of --tensor-model-parallel-size ({})",
        config.moe_shared_expert_intermediate_size, tensor_size));
  if (config.ffn_hidden_size % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("--ffn-hidden-size ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.ffn_hidden_size, tensor_size));
  if (config.padded_vocab_size % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("the padded vocabulary ({}) must be a multiple of --tensor-model-parallel-size ({})",
                    config.padded_vocab_size, tensor_size));
  if (config.query_groups() % tensor_size != 0)
    return absl::InvalidArgumentError(
        fmt::format("num_query_groups {} is not divisible by tensor size {}", config.query_groups(), tensor_size));
  ParamLayout m;
  m.config = config;
  m.tensor_size = tensor_size;
  m.tensor_rank = tensor_rank;
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, vp = config.padded_vocab_size;
  // This rank's rows of QKV (whole query groups: their query heads, key and value, Megatron's order),
  // the attention's width it holds (proj's columns), fc1's rows ([gate; up] under SwiGLU) and fc2's columns.
  const int64_t T = tensor_size, qkv_t = config.qkv_rows() / T, att_t = config.attention_width() / T, ft = f / T,
                fc1_t = (config.swiglu ? 2 : 1) * ft, vt = vp / T;
  const int fc1_chunks = config.swiglu ? 2 : 1;
  const bool ln = config.normalization == Normalization::kLayerNorm, bias = config.add_bias_linear;
  const float one = config.apply_layernorm_1p ? 0.0f : 1.0f;  // a norm's weight at init: 1 + 0 under 1p
  const double std = config.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double init_std, float init_value = 0.0f,
                 int split = -1, int chunks = 1) {
    ParamInfo p;
    p.tensor_split_dim = T > 1 ? split : -1;
    p.tensor_split_chunks = T > 1 && split == 0 ? chunks : 1;
    p.name = name;
    p.shape = std::move(shape);
    p.size = 1;
    for (int64_t d : p.shape) p.size *= d;
    p.offset = offset;
    p.no_weight_decay = p.shape.size() == 1;
    p.qk_layernorm = name.find(".q_layernorm.") != std::string::npos || name.find(".k_layernorm.") != std::string::npos;
    p.decoupled_lr = name == "embedding.word_embeddings.weight" || name == "output_layer.weight";
    p.init_std = init_std;
    p.init_value = init_value;
    if (config.init_method_xavier_uniform && init_std > 0 && p.shape.size() == 2) {
      // torch.nn.init.xavier_uniform_ of the whole (rows, cols) tensor (Megatron initialises the whole
      // master weight, then splits it): fan_in cols, fan_out rows.
      const double rows = static_cast<double>(p.shape[0] * (split == 0 ? T : 1)),
                   cols = static_cast<double>(p.shape[1] * (split == 1 ? T : 1));
      p.init_uniform = std::sqrt(6.0 / (rows + cols));
    }
    offset += p.size;
    m.infos.push_back(std::move(p));
    return m.infos.back().offset;
  };
  // A tensor the configuration may leave out: -1 then.
  auto add_if = [&](bool present, auto&&... args) -> int64_t { return present ? add(args...) : -1; };
  // The embeddings' init (megatron-core's embedding_init_method): its own normal where the std is given (and, under
  // xavier_uniform, differs from init_method_std), else the other weights'.
  const double emb = config.embedding_init_method_std;
  const bool emb_normal = emb > 0 && (!config.init_method_xavier_uniform || emb != std);
  auto embedding = [&](int64_t at) {
    if (at >= 0 && emb_normal) m.infos.back().init_uniform = 0;
    return at;
  };
  const double emb_std = emb > 0 ? emb : std;
  m.wte = embedding(add("embedding.word_embeddings.weight", {vt, c}, emb_std, 0.0f, 0));
  m.wpe = embedding(add_if(config.position_embedding == PositionEmbedding::kLearnedAbsolute,
                           "embedding.position_embeddings.weight",
                           std::vector<int64_t>{config.max_position_embeddings, c}, emb_std));
  const int64_t L = config.num_layers;
  auto final_norm = [&] {
    m.lnf_w = add("decoder.final_layernorm.weight", {c}, 0.0, one);
    m.lnf_b = add_if(ln, "decoder.final_layernorm.bias", std::vector<int64_t>{c}, 0.0);
  };
  // MTP depth k's norms and eh_proj, after the decoder's final norm (k 0) or depth k - 1's final_layernorm.
  auto mtp_norm = [&](const std::string& p, int64_t* w, int64_t* b) {  // `p` weight, and bias under LayerNorm
    *w = add(p + "weight", {c}, 0.0, one);
    *b = add_if(ln, p + "bias", std::vector<int64_t>{c}, 0.0);
  };
  auto mtp_head = [&](int64_t k) {
    if (k == 0) final_norm();
    if (k > 0)
      mtp_norm(fmt::format("mtp.layers.{}.final_layernorm.", k - 1), &m.mtp.back().norm_w, &m.mtp.back().norm_b);
    if (k == config.mtp_num_layers) return std::string();
    const std::string q = fmt::format("mtp.layers.{}.", k);
    MtpLayerParams mp;
    mtp_norm(q + "enorm.", &mp.enorm_w, &mp.enorm_b);
    mtp_norm(q + "hnorm.", &mp.hnorm_w, &mp.hnorm_b);
    mp.eh_proj = add(q + "eh_proj.weight", {c / T, 2 * c}, std, 0.0f, 0);  // column-parallel: its output rows
    m.mtp.push_back(mp);
    return q + "transformer_layer.";
  };
  for (int64_t l = 0; l < L + config.mtp_num_layers; ++l) {
    std::string p = l < L ? fmt::format("decoder.layers.{}.", l) : mtp_head(l - L);
    LayerParams lp;
    lp.ln1_w = add(p + "input_layernorm.weight", {c}, 0.0, one);
    lp.ln1_b = add_if(ln, p + "input_layernorm.bias", std::vector<int64_t>{c}, 0.0);
    if (config.mla()) {
      AddMlaParams(config, p, one, T, add_if, &lp);
    } else {
      lp.qkv_w = add(p + "self_attention.linear_qkv.weight", {qkv_t, c}, std, 0.0f, 0);
      lp.qkv_b =
          add_if(config.qkv_bias(), p + "self_attention.linear_qkv.bias", std::vector<int64_t>{qkv_t}, 0.0, 0.0f, 0);
    }
    // --qk-layernorm: whole on every tensor rank (each rank's heads' share of their gradients is
    // summed over the tensor group: NonTensorParallelGradRanges), registered after linear_qkv as
    // Megatron's SelfAttention does.
    const std::vector<int64_t> hd{config.head_dim()};
    const bool qk_norm = config.qk_layernorm && !config.mla();  // MLA's norms are its latents'
    lp.q_norm_w = add_if(qk_norm, p + "self_attention.q_layernorm.weight", hd, 0.0, one);
    lp.q_norm_b = add_if(qk_norm && ln, p + "self_attention.q_layernorm.bias", hd, 0.0);
    lp.k_norm_w = add_if(qk_norm, p + "self_attention.k_layernorm.weight", hd, 0.0, one);
    lp.k_norm_b = add_if(qk_norm && ln, p + "self_attention.k_layernorm.bias", hd, 0.0);
    // --softmax-type learnable: DotProductAttention's softmax_offset, one per head (split by heads over the tensor
    // ranks), init_method's normal; its module (core_attention) comes before linear_proj.
    lp.softmax_offset = add_if(config.learnable_softmax(), p + "self_attention.core_attention.softmax_offset",
                               std::vector<int64_t>{config.num_attention_heads / T}, std, 0.0f, 0);
    lp.proj_w = add(p + "self_attention.linear_proj.weight", {c, att_t}, out_std, 0.0f, 1);
    lp.proj_b = add_if(bias, p + "self_attention.linear_proj.bias", std::vector<int64_t>{c}, 0.0);
    lp.ln2_w = add(p + "pre_mlp_layernorm.weight", {c}, 0.0, one);
    lp.ln2_b = add_if(ln, p + "pre_mlp_layernorm.bias", std::vector<int64_t>{c}, 0.0);
    // A depth's layer is of the decoder's last layer's spec (get_gpt_mtp_block_spec): MoE when that one is.
    if (config.moe_layer(std::min(l, L - 1))) {  // Megatron's MoELayer: its router, then SequentialMLP's experts
      // Tensor ranks (the expert tensor size is the tensor size): each expert's and the shared experts' fc1
      // column-parallel (SwiGLU's gate and up halves each split, [gate; up] per rank) and fc2 row-parallel, as the
      // dense MLP's; the router and the shared experts' gate whole on every rank.
      const int64_t fm = config.moe_ffn() / T, fm1 = (config.swiglu ? 2 : 1) * fm;
      lp.router_w = add(p + "mlp.router.weight", {config.num_experts, c}, std);
      for (int64_t j = 0; j < config.num_experts; ++j) {
        const std::string e = fmt::format("{}mlp.experts.local_experts.{}.", p, j);
        const int64_t at = add(e + "linear_fc1.weight", {fm1, c}, std, 0.0f, 0, fc1_chunks);
        m.infos.back().expert = true;
        if (j == 0) lp.experts = at;
        add(e + "linear_fc2.weight", {c, fm}, out_std, 0.0f, 1);
        m.infos.back().expert = true;
      }
      if (config.moe_shared_expert_intermediate_size > 0) {  // SharedExpertMLP: its own gate_weight, then its MLP's
        const int64_t fs = config.moe_shared_expert_intermediate_size / T, fs1 = (config.swiglu ? 2 : 1) * fs;
        const std::string e = p + "mlp.shared_experts.";
        lp.shared_gate = add_if(config.moe_shared_expert_gate, e + "gate_weight", std::vector<int64_t>{1, c}, std);
        lp.shared_fc1 = add(e + "linear_fc1.weight", {fs1, c}, std, 0.0f, 0, fc1_chunks);
        lp.shared_fc2 = add(e + "linear_fc2.weight", {c, fs}, out_std, 0.0f, 1);
      }
      lp.fc1_w = lp.fc1_b = lp.fc2_w = lp.fc2_b = -1;
      if (l >= L)
        m.mtp.back().layer = lp;
      else
        m.layers.push_back(lp);
      continue;
    }
    lp.fc1_w = add(p + "mlp.linear_fc1.weight", {fc1_t, c}, std, 0.0f, 0, fc1_chunks);
    lp.fc1_b = add_if(bias, p + "mlp.linear_fc1.bias", std::vector<int64_t>{fc1_t}, 0.0, 0.0f, 0, fc1_chunks);
    lp.fc2_w = add(p + "mlp.linear_fc2.weight", {c, ft}, out_std, 0.0f, 1);
    lp.fc2_b = add_if(bias, p + "mlp.linear_fc2.bias", std::vector<int64_t>{c}, 0.0);
    if (l >= L) {
      m.mtp.back().layer = lp;
      continue;
    }
    m.layers.push_back(lp);
  }
  if (config.mtp_num_layers == 0)
    final_norm();
  else
    mtp_head(config.mtp_num_layers);
  m.out_w = config.untie_embeddings_and_output_weights ? add("output_layer.weight", {vt, c}, std, 0.0f, 0) : m.wte;
  m.num_params = offset;
  m.chunk_first_layer = {0};
  for (size_t k = 0; k < m.infos.size(); ++k) m.whole_index.push_back(k);
  return m;
}

const ParamInfo* ParamLayout::Find(const std::string& name) const {
  for (const ParamInfo& p : infos)
    if (p.name == name) return &p;
  return nullptr;
}

void ParamLayout::InitWeights(uint64_t seed, std::span<float> out) const {
  for (size_t k = 0; k < infos.size(); ++k) {
    const ParamInfo& p = infos[k];
    float* w = out.data() + p.offset;
    if (p.init_std == 0.0) {
      std::fill(w, w + p.size, p.init_value);
      continue;
    }
    const uint64_t key = InitKey(seed, WholeInfoIndex(k));  // a stage's tensors keep the whole model's init
    if (p.init_uniform > 0) {
      for (int64_t i = 0; i < p.size; ++i)
        w[i] =
            static_cast<float>(p.init_uniform * CounterUniformSymmetric(key, static_cast<uint64_t>(WholeIndex(p, i))));
      continue;
    }
    for (int64_t i = 0; i < p.size; ++i)
      w[i] = static_cast<float>(p.init_std * CounterNormal(key, static_cast<uint64_t>(WholeIndex(p, i))));
  }
}

int64_t ParamLayout::WholeIndex(const ParamInfo& p, int64_t i) const {
  if (p.tensor_split_dim == 0) {  // rows: one contiguous block of each chunk
    const int64_t chunk = p.size / p.tensor_split_chunks;
    return (i / chunk * tensor_size + tensor_rank) * chunk + i % chunk;
  }
  if (p.tensor_split_dim == 1) {
    const int64_t cols = p.shape[1];
    return i / cols * cols * tensor_size + tensor_rank * cols + i % cols;
  }
  return i;
}

namespace {
// Runs of contiguous elements: (shard offset, whole offset, length) for each.
template <typename F>
void ForEachRun(const ParamLayout& shard, F&& f) {
  auto whole = ParamLayout::Create(shard.config);  // the configuration was validated by `shard`
  for (size_t k = 0; k < shard.infos.size(); ++k) {
    const ParamInfo &p = shard.infos[k], &w = whole->infos[shard.WholeInfoIndex(k)];
    if (p.tensor_split_dim == 1) {
      const int64_t cols = p.shape[1];
      for (int64_t r = 0; r < p.shape[0]; ++r) f(p.offset + r * cols, w.offset + shard.WholeIndex(p, r * cols), cols);
    } else {
      const int64_t chunk = p.size / p.tensor_split_chunks;
      for (int64_t i = 0; i < p.size; i += chunk) f(p.offset + i, w.offset + shard.WholeIndex(p, i), chunk);
    }
  }
}
}  // namespace

void CopyToShard(const ParamLayout& shard_layout, std::span<const float> whole, std::span<float> shard) {
  ForEachRun(shard_layout, [&](int64_t s, int64_t w, int64_t n) {
    std::copy(whole.begin() + w, whole.begin() + w + n, shard.begin() + s);
  });
}

void CopyFromShard(const ParamLayout& shard_layout, std::span<const float> shard, std::span<float> whole) {
  ForEachRun(shard_layout, [&](int64_t s, int64_t w, int64_t n) {
    std::copy(shard.begin() + s, shard.begin() + s + n, whole.begin() + w);
  });
}

}  // namespace ptk
