// LoadPtkCheckpoint (hf_gpt2.h): the latest checkpoint of a ptk-train --save directory, for the exports.

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
#include "common/json_keys.h"
#include "common/logging.h"
#include "common/progress.h"
#include "common/py_format.h"
#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

// The ptk checkpoint's header: magic "PTKCKPT1", u64 length, JSON (trainer/README.md). Only the
// model description and the run's settings are read here; LoadCheckpoint then checks the file whole.
struct CheckpointHeader {
  GPTConfig config;
  std::map<std::string, std::string> settings;
};

// The experts' architecture a MoE checkpoint records (trainer/checkpoint_settings.cpp's ModelJson):
// false when a field is missing or moe_layer_freq is not a list of 0 and 1.
bool ReadMoeHeader(simdjson::dom::element m, GPTConfig* c) {
  std::string_view score, freq;
  bool pre = false;
  if (m["moe_router_topk"].get(c->moe_router_topk) || m["moe_ffn_hidden_size"].get(c->moe_ffn_hidden_size) ||
      m["moe_router_pre_softmax"].get(pre) || m["moe_router_score_function"].get(score) ||
      m["moe_layer_freq"].get(freq) || (score != "softmax" && score != "sigmoid") || freq.size() < 2 ||
      freq.front() != '[' || freq.back() != ']')
    return false;
  c->moe_router_pre_softmax = pre;
  c->moe_router_sigmoid = score == "sigmoid";
  // Written only where set (trainer/checkpoint_settings.cpp).
  if (double f = 0; !m["moe_router_topk_scaling_factor"].get(f)) c->moe_router_topk_scaling_factor = f;
  if (int64_t g = 0, k = 0; !m["moe_router_num_groups"].get(g) && !m["moe_router_group_topk"].get(k))
    c->moe_router_num_groups = g, c->moe_router_group_topk = k;
  if (int64_t s = 0; !m["moe_shared_expert_intermediate_size"].get(s)) {  // shared experts
    bool gate = false;
    if (m["moe_shared_expert_gate"].get(gate)) return false;
    c->moe_shared_expert_intermediate_size = s, c->moe_shared_expert_gate = gate;
  }
  c->moe_layer_pattern.clear();
  for (size_t i = 1; i + 1 < freq.size(); i += 2) {
    if ((freq[i] != '0' && freq[i] != '1') || (i + 2 < freq.size() && freq[i + 1] != ',')) return false;
    c->moe_layer_pattern.push_back(freq[i] - '0');
  }
  return static_cast<int64_t>(c->moe_layer_pattern.size()) == c->num_layers;
}

// Multi-latent attention's architecture and rotary embedding (trainer/checkpoint_settings.cpp's ModelJson):
// false when a field is missing or rope_type is neither rope nor yarn.
bool ReadMlaHeader(simdjson::dom::element m, GPTConfig* c) {
  std::string_view rope;
  if (m["q_lora_rank"].get(c->q_lora_rank) || m["kv_lora_rank"].get(c->kv_lora_rank) ||
      m["qk_head_dim"].get(c->qk_head_dim) || m["qk_pos_emb_head_dim"].get(c->qk_pos_emb_head_dim) ||
      m["v_head_dim"].get(c->v_head_dim) || m["rope_type"].get(rope) || m["mla_rotary_base"].get(c->rotary_base) ||
      m["rotary_scaling_factor"].get(c->rotary_scaling_factor) || m["mscale"].get(c->mscale) ||
      m["mscale_all_dim"].get(c->mscale_all_dim) || (rope != "rope" && rope != "yarn"))
    return false;
  c->multi_latent_attention = true;
  c->mla_yarn = rope == "yarn";
  return true;
}

absl::StatusOr<CheckpointHeader> ReadCheckpointHeader(const std::string& file) {
  // The trainer's reader: a file cut short says so, with its size and the one it needs, as ptk-train's load
  // does (10 bytes of a checkpoint were "not a ptk checkpoint (bad magic)", 100 bytes "the header length runs
  // past the end of the file").
  PTK_ASSIGN_OR_RETURN(const std::string json, ReadCheckpointHeaderText(file));
  auto bad = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", file, why)); };
  simdjson::dom::parser parser;
  simdjson::dom::element h, m;
  if (parser.parse(json).get(h) || h["model"].get(m)) return bad("the header has no model description");
  if (auto dup = FirstDuplicateJsonKey(h)) return bad(fmt::format("the header gives the key {} twice", *dup));
  CheckpointHeader out;
  GPTConfig& c = out.config;
  bool untie = false;
  if (m["num_layers"].get(c.num_layers) || m["hidden_size"].get(c.hidden_size) ||
      m["num_attention_heads"].get(c.num_attention_heads) || m["ffn_hidden_size"].get(c.ffn_hidden_size) ||
      m["max_position_embeddings"].get(c.max_position_embeddings) || m["padded_vocab_size"].get(c.padded_vocab_size) ||
      m["untie_embeddings_and_output_weights"].get(untie))
    return bad("the header's model description misses a field");
  c.untie_embeddings_and_output_weights = untie;
  if (bool mla = false; !m["multi_latent_attention"].get(mla) && mla && !ReadMlaHeader(m, &c))
    return bad("the header's description of multi-latent attention misses a field or has a bad one");
  if (int64_t mtp = 0; !m["mtp_num_layers"].get(mtp) && mtp > 0)  // ptk-train's multi-token prediction depths
    c.mtp_num_layers = mtp;          // (their loss weight is the run's --mtp-loss-scaling-factor setting)
  std::string_view window, softmax;  // ptk-train's CPU sliding window attention and softmax types
  const bool windowed = !m["window_size"].get(window), sink = !m["softmax_type"].get(softmax);
  if (windowed || sink)
    return absl::UnimplementedError(fmt::format(
        "{}: a model with --window-size or --softmax-type (window_size '{}', softmax_type '{}'): ptk-convert does not "
        "export them (neither --saver hf nor --saver megatron)",
        file, window, softmax));
  if (!m["num_experts"].get(c.num_experts) && !ReadMoeHeader(m, &c))  // ptk-train's MoE layers
    return bad("the header's description of the mixture of experts misses a field or has a bad one");
  if (std::string_view norm; !m["normalization"].get(norm)) {  // written for the Llama line only
    std::string_view pos;
    bool swiglu = false, bias = true, qkv_bias = false;
    if (m["position_embedding_type"].get(pos) || m["swiglu"].get(swiglu) ||
        m["num_query_groups"].get(c.num_query_groups) || m["kv_channels"].get(c.kv_channels) ||
        m["add_bias_linear"].get(bias) || m["add_qkv_bias"].get(qkv_bias) ||
        (pos == "rope" && (m["rotary_base"].get(c.rotary_base) || m["rotary_percent"].get(c.rotary_percent) ||
                           m["use_rope_scaling"].get(c.use_rope_scaling))))
      return bad("the header's description of a Llama-line model misses a field");
    if ((norm != "RMSNorm" && norm != "LayerNorm") || (pos != "rope" && pos != "none" && pos != "learned_absolute"))
      return bad(fmt::format("the header's normalization {:?} or position_embedding_type {:?} is unknown", norm, pos));
    c.normalization = norm == "RMSNorm" ? Normalization::kRMSNorm : Normalization::kLayerNorm;
    c.position_embedding = pos == "rope"   ? PositionEmbedding::kRope
                           : pos == "none" ? PositionEmbedding::kNone
                                           : PositionEmbedding::kLearnedAbsolute;
    c.swiglu = swiglu;
    c.add_bias_linear = bias;
    c.add_qkv_bias = qkv_bias;
    bool qk_layernorm = false;  // written only when on
    if (!m["qk_layernorm"].get(qk_layernorm)) c.qk_layernorm = qk_layernorm;
    // ptk-train's query and key L2 norm and gated attention: no converter carries them yet.
    for (auto [key, flag] :
         {std::pair{"qk_l2_norm", "--qk-l2-norm"}, {"attention_output_gate", "--attention-output-gate"}})
      if (bool on = false; !m[key].get(on) && on)
        return absl::UnimplementedError(
            fmt::format("{}: the model was trained with {}, which ptk-convert does not convert yet", file, flag));
    // The rotary variants, written only where they leave Megatron's defaults.
    if (pos == "rope") {
      bool interleaved = false;
      if (!m["rotary_interleaved"].get(interleaved)) c.rotary_interleaved = interleaved;
      if (double f = 0; !m["rope_scaling_factor"].get(f)) c.rope_scaling_factor = f;
      if (double f = 0; !m["rotary_seq_len_interpolation_factor"].get(f)) c.rotary_seq_len_interpolation_factor = f;
    }
  }
  bool on = false;  // Megatron's other model flags: written only when on
  if (!m["squared_relu"].get(on)) c.squared_relu = on;
  if (!m["apply_layernorm_1p"].get(on)) c.apply_layernorm_1p = on;
  if (!m["bias_gelu_fusion"].get(on)) c.gelu_exact = !on;  // written only when false: the exact erf GELU
  simdjson::dom::array settings;
  if (!h["settings"].get(settings))
    for (simdjson::dom::element pair : settings) {
      simdjson::dom::array kv;
      std::string_view k, v;
      if (!pair.get(kv) && kv.size() == 2 && !kv.at(0).get(k) && !kv.at(1).get(v))
        out.settings[std::string(k)] = std::string(v);
    }
  return out;
}

// A setting of the saved run as a number; `fallback` (and a note) when it was not recorded.
double SettingOr(const CheckpointHeader& h, const std::string& flag, double fallback, std::vector<std::string>* notes) {
  auto it = h.settings.find(flag);
  if (it != h.settings.end()) {
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (end != it->second.c_str() && *end == '\0') return v;
  }
  notes->push_back(
      fmt::format("the checkpoint does not record {}: {} (Megatron's default) assumed", flag, py::FloatRepr(fallback)));
  return fallback;
}

// The mixture of experts' training settings beside the aux loss's (trainer/run_settings.cpp records each, empty
// where off): the z-loss, seq_aux_loss's and global_aux_loss's coefficients, the expert bias and its rate, the
// capacity and its drop policy. A setting not recorded (an older checkpoint, or off) leaves it off.
void ReadMoeTrainingSettings(const CheckpointHeader& h, GPTConfig* c) {
  auto num = [&](const char* flag) -> std::optional<double> {
    auto it = h.settings.find(flag);
    if (it == h.settings.end() || it->second.empty()) return std::nullopt;
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (end == it->second.c_str() || *end != '\0') return std::nullopt;
    return v;
  };
  auto on = [&](const char* flag) {
    auto it = h.settings.find(flag);
    return it != h.settings.end() && it->second == "on";
  };
  c->moe_z_loss_coeff = num("--moe-z-loss-coeff").value_or(0.0);
  c->moe_seq_aux_loss_coeff = num("--moe-router-load-balancing-type seq_aux_loss").value_or(0.0);
  c->moe_global_aux_loss_coeff = num("--moe-router-load-balancing-type global_aux_loss").value_or(0.0);
  c->moe_router_enable_expert_bias = on("--moe-router-enable-expert-bias");
  c->moe_router_bias_update_rate = num("--moe-router-bias-update-rate").value_or(1e-3);
  c->moe_expert_capacity_factor = num("--moe-expert-capacity-factor").value_or(-1.0);
  auto policy = h.settings.find("--moe-token-drop-policy");
  c->moe_token_drop_position =
      c->moe_expert_capacity_factor >= 0 && policy != h.settings.end() && policy->second == "position";
}

}  // namespace

absl::StatusOr<PtkCheckpoint> LoadPtkCheckpoint(const std::string& load_dir, int64_t true_vocab_size, bool progress,
                                                bool with_optimizer) {
  PtkCheckpoint out;
  PTK_ASSIGN_OR_RETURN(out.iteration, LatestCheckpointIteration(load_dir));
  out.file = CheckpointFile(load_dir, out.iteration);
  // As ptk-train's --load says it (it read "cannot open ...: No such file or directory").
  if (const std::string dir = CheckpointDir(load_dir, out.iteration); !IsDirectory(dir))
    return absl::NotFoundError(fmt::format("{}: missing (the tracker names iteration {})", dir, out.iteration));
  PTK_ASSIGN_OR_RETURN(CheckpointHeader header, ReadCheckpointHeader(out.file));
  GPTConfig& c = header.config;
  // What the model description leaves to the run's settings.
  if (true_vocab_size > 0) {
    c.vocab_size = true_vocab_size;
  } else if (auto it = header.settings.find("--vocab-size"); it != header.settings.end()) {
    c.vocab_size = std::atoll(it->second.c_str());
  } else {
    return UsageError(fmt::format(
        "{} does not record the tokenizer's vocabulary size (its padded size is {}): give --true-vocab-size", out.file,
        c.padded_vocab_size));
  }
  if (c.vocab_size < 1 || c.vocab_size > c.padded_vocab_size)
    return UsageError(fmt::format("a vocabulary of {} does not fit the checkpoint's padded vocabulary of {}",
                                  c.vocab_size, c.padded_vocab_size));
  auto seq = header.settings.find("--seq-length");
  c.seq_length = seq != header.settings.end() ? std::atoll(seq->second.c_str()) : c.max_position_embeddings;
  c.seq_length = std::clamp<int64_t>(c.seq_length, 1, c.max_position_embeddings);
  c.layernorm_epsilon = SettingOr(header, "--layernorm-epsilon", 1e-5, &out.notes);
  c.hidden_dropout = SettingOr(header, "--hidden-dropout", 0.1, &out.notes);
  c.attention_dropout = SettingOr(header, "--attention-dropout", 0.1, &out.notes);
  c.init_method_std = SettingOr(header, "--init-method-std", 0.02, &out.notes);
  if (c.mtp_num_layers > 0) c.mtp_loss_scaling_factor = SettingOr(header, "--mtp-loss-scaling-factor", 0.1, &out.notes);
  if (c.moe()) {
    c.moe_aux_loss_coeff = SettingOr(header, "--moe-aux-loss-coeff", 0.0, &out.notes);
    ReadMoeTrainingSettings(header, &c);
  }
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  // The weights and AdamW's moments, checksummed whole: minutes for a large model, counted (files and bytes read).
  if (auto size = FileSize(out.file); progress && size.ok() && *size >= kConvertLongStepBytes)
    log::Info("convert: reading and verifying {} ({}) ...", out.file, HumanBytes(static_cast<double>(*size)));
  {
    ProgressReporter reading({.label = "convert", .item_unit = "files", .enabled = progress});
    PTK_RETURN_IF_ERROR(
        LoadCheckpoint(load_dir, out.iteration, layout, &out.params, &out.m1, &out.m2, &out.state, &reading));
  }
  if (!with_optimizer) {
    std::vector<float>().swap(out.m1);
    std::vector<float>().swap(out.m2);
  }
  out.config = c;
  return out;
}

}  // namespace ptk
