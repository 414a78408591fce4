// The run's settings recorded in a checkpoint's header (for --use-checkpoint-args and the convert tool),
// the model description a header records (ModelJson), how a saved model differs from a run's, and the
// refusal of an imported checkpoint without optimizer state (CheckOptimizerStateLoads).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/json_writer.h"
#include "common/status.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_header.h"

namespace ptk {

absl::StatusOr<int64_t> CheckpointToLoad(const std::string& load, std::optional<int64_t> ckpt_step) {
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(load);
  if (!ckpt_step) return latest;
  // No tracker (or, beside none, a Megatron checkpoint ptk-train does not read); a damaged one is not read.
  if (absl::IsNotFound(latest.status()) || absl::IsFailedPrecondition(latest.status()))
    return UsageError(fmt::format("--ckpt-step {}: no checkpoint in --load {} ({})", *ckpt_step, load,
                                  StatusMessage(latest.status())));
  absl::StatusOr<std::string> dir = ResolveCheckpointDir(load, *ckpt_step);
  if (absl::IsNotFound(dir.status()))
    return UsageError(fmt::format("--ckpt-step {}: {} holds no checkpoint of that iteration ({} is not there){}",
                                  *ckpt_step, load, FirstRankFile(CheckpointDir(load, *ckpt_step)),
                                  latest.ok() ? fmt::format("; its tracker names iteration {}", *latest) : ""));
  PTK_RETURN_IF_ERROR(dir.status());
  return *ckpt_step;
}

absl::StatusOr<std::string> ReadCheckpointHeaderText(const std::string& file) {
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint: {}", file, why));
  };
  {
    PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(file));  // a FIFO refused, not waited on
    ::close(fd);
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(fmt::format("{}: cannot open", file));
  char magic[sizeof kMagic];
  uint64_t len = 0;
  const bool whole_magic = static_cast<bool>(in.read(magic, sizeof magic));
  const std::string start(magic, static_cast<size_t>(in.gcount()));
  if (std::memcmp(magic, kMagic, start.size()) != 0) return corrupt(NotAPtkCheckpoint(start));
  // A file cut short (a copy stopped by a kill or a full disk) says so, with its size and the one it needs.
  PTK_ASSIGN_OR_RETURN(const uint64_t size, FileSize(file));
  if (!whole_magic || !in.read(reinterpret_cast<char*>(&len), sizeof len))
    return corrupt(CheckpointLengthProblem(start, size));
  if (len > (uint64_t{1} << 30)) return corrupt("bad header length");
  std::string header(len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(len))) {
    std::string head = start + std::string(reinterpret_cast<const char*>(&len), sizeof len);
    std::string why = CheckpointLengthProblem(head, size);
    return corrupt(why.empty() ? "header past the end" : why);
  }
  return header;
}

bool ReadHeaderSettings(simdjson::dom::element header, std::vector<std::pair<std::string, std::string>>* out) {
  out->clear();
  simdjson::dom::array settings;
  if (header["settings"].get(settings)) return true;
  for (simdjson::dom::element pair : settings) {
    simdjson::dom::array kv;
    std::string_view name, value;
    if (pair.get(kv) || kv.size() != 2 || kv.at(0).get(name) || kv.at(1).get(value)) return false;
    out->emplace_back(std::string(name), std::string(value));
  }
  return true;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadCheckpointSettings(const std::string& load,
                                                                                        int64_t iteration) {
  const std::string file = CheckpointFile(load, iteration);
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: corrupt checkpoint: {}", file, why));
  };
  absl::StatusOr<std::string> header = ReadCheckpointHeaderText(file);
  if (absl::IsNotFound(header.status()))
    return absl::NotFoundError(fmt::format("{}: cannot open (the tracker names iteration {})", file, iteration));
  PTK_RETURN_IF_ERROR(header.status());
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  if (parser.parse(*header).get(h)) return corrupt("header is not JSON");
  std::vector<std::pair<std::string, std::string>> out;
  if (!ReadHeaderSettings(h, &out)) return corrupt("malformed settings in the header");
  if (!out.empty()) return out;
  simdjson::dom::object model;
  if (h["model"].get(model)) return corrupt("header misses the model");
  const std::pair<const char*, const char*> names[] = {{"num_layers", "--num-layers"},
                                                       {"hidden_size", "--hidden-size"},
                                                       {"num_attention_heads", "--num-attention-heads"},
                                                       {"ffn_hidden_size", "--ffn-hidden-size"},
                                                       {"max_position_embeddings", "--max-position-embeddings"}};
  for (const auto& [key, flag] : names) {
    int64_t v = 0;
    if (!model[key].get(v)) out.emplace_back(flag, std::to_string(v));
  }
  bool untie = false;
  if (!model["untie_embeddings_and_output_weights"].get(untie))
    out.emplace_back("--untie-embeddings-and-output-weights", untie ? "on" : "off");
  return out;
}

// The fields of the model configuration that must match for a checkpoint to load.
// The Llama line's settings are written only where they leave GPT-3's model, so a GPT-3 model's
// description (and the checkpoints saved before them) stays as it was.
std::string ModelJson(const GPTConfig& c) {
  JsonWriter w;
  w.BeginObject()
      .Field("num_layers", c.num_layers)
      .Field("hidden_size", c.hidden_size)
      .Field("num_attention_heads", c.num_attention_heads)
      .Field("ffn_hidden_size", c.ffn_hidden_size)
      .Field("max_position_embeddings", c.max_position_embeddings)
      .Field("padded_vocab_size", c.padded_vocab_size)
      .Field("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  if (!c.gpt3() || c.add_qkv_bias) {
    w.Field("normalization", std::string(c.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm"))
        .Field("position_embedding_type",
               std::string(c.rope()                                           ? "rope"
                           : c.position_embedding == PositionEmbedding::kNone ? "none"
                                                                              : "learned_absolute"))
        .Field("swiglu", c.swiglu)
        .Field("num_query_groups", c.query_groups())
        .Field("kv_channels", c.head_dim())
        .Field("add_bias_linear", c.add_bias_linear)
        .Field("add_qkv_bias", c.add_qkv_bias);
    if (c.qk_layernorm) w.Field("qk_layernorm", true);
    if (c.qk_l2_norm) w.Field("qk_l2_norm", true);  // Megatron's args' names, written only when on
    if (c.attention_output_gate) w.Field("attention_output_gate", true);
    if (c.rope()) {  // the rotary variants only where they leave Megatron's defaults, as qk_layernorm
      w.Field("rotary_base", c.rotary_base)
          .Field("rotary_percent", c.rotary_percent)
          .Field("use_rope_scaling", c.use_rope_scaling);
      if (c.use_rope_scaling && c.rope_scaling_factor != 8.0) w.Field("rope_scaling_factor", c.rope_scaling_factor);
      if (c.rotary_seq_len_interpolation_factor > 0)
        w.Field("rotary_seq_len_interpolation_factor", c.rotary_seq_len_interpolation_factor);
      if (c.rotary_interleaved) w.Field("rotary_interleaved", true);
    }
  }
  // Megatron's other model flags, written only when on (a model without them reads as before).
  if (c.squared_relu) w.Field("squared_relu", true);
  if (c.gelu_exact) w.Field("bias_gelu_fusion", false);  // Megatron's unfused GELU MLP: the exact erf GELU
  if (c.apply_layernorm_1p) w.Field("apply_layernorm_1p", true);
  if (c.moe()) {  // the experts' architecture (the load-balancing loss's coefficient is a training setting)
    std::string layers;
    for (int64_t l = 0; l < c.num_layers; ++l) layers += fmt::format("{}{}", l ? "," : "", c.moe_layer(l) ? 1 : 0);
    w.Field("num_experts", c.num_experts)
        .Field("moe_router_topk", c.moe_router_topk)
        .Field("moe_ffn_hidden_size", c.moe_ffn())
        .Field("moe_router_pre_softmax", c.moe_router_pre_softmax)
        .Field("moe_router_score_function", std::string(c.moe_router_sigmoid ? "sigmoid" : "softmax"))
        .Field("moe_layer_freq", "[" + layers + "]");
    // The routing's variants only where set (a checkpoint without them reads as before).
    if (c.moe_router_topk_scaling_factor > 0)
      w.Field("moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor);
    if (c.moe_router_group_topk > 0)
      w.Field("moe_router_num_groups", c.moe_router_num_groups).Field("moe_router_group_topk", c.moe_router_group_topk);
    if (c.moe_shared_expert_intermediate_size > 0)  // shared experts
      w.Field("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size)
          .Field("moe_shared_expert_gate", c.moe_shared_expert_gate);
  }
  if (c.mla()) {  // multi-latent attention's architecture and its rotary embedding
    w.Field("multi_latent_attention", true)
        .Field("q_lora_rank", c.q_lora_rank)
        .Field("kv_lora_rank", c.kv_lora_rank)
        .Field("qk_head_dim", c.qk_head_dim)
        .Field("qk_pos_emb_head_dim", c.qk_pos_emb_head_dim)
        .Field("v_head_dim", c.v_head_dim)
        .Field("rope_type", std::string(c.mla_yarn ? "yarn" : "rope"))
        .Field("mla_rotary_base", c.rotary_base)
        .Field("rotary_scaling_factor", c.rotary_scaling_factor)
        .Field("mscale", c.mscale)
        .Field("mscale_all_dim", c.mscale_all_dim);
  }
  if (c.mtp_num_layers > 0) w.Field("mtp_num_layers", c.mtp_num_layers);  // multi-token prediction's depths
  if (c.window_left >= 0) {  // sliding window attention: the window and the layers it is on
    w.Field("window_size", fmt::format("{},0", c.window_left))
        .Field("window_attn_skip_freq", c.WindowSkipFreqSetting());
  }
  if (c.softmax_sink()) w.Field("softmax_type", c.softmax_type);
  return w.EndObject().str();
}

std::string ModelDifferences(simdjson::dom::element saved, simdjson::dom::element mine) {
  simdjson::dom::object a, b;
  if (saved.get(a) || mine.get(b)) return "another description";
  std::string out;
  auto add = [&](std::string_view key, const std::string& was, const std::string& now) {
    std::string flag = "--" + std::string(key);
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (key == "padded_vocab_size") flag = "a padded vocabulary of";
    if (key == "bias_gelu_fusion") flag = "bias_gelu_fusion (false: the exact erf GELU, --no-bias-gelu-fusion)";
    out += fmt::format("{}{} {} (this run: {})", out.empty() ? "" : ", ", flag, was, now);
  };
  for (auto field : a) {
    simdjson::dom::element other;
    const std::string was = simdjson::minify(field.value);
    if (b[field.key].get(other)) {
      add(field.key, was, "the default");
    } else if (const std::string now = simdjson::minify(other); now != was) {
      add(field.key, was, now);
    }
  }
  for (auto field : b) {
    simdjson::dom::element other;
    if (a[field.key].get(other)) add(field.key, "the default", simdjson::minify(field.value));
  }
  return out.empty() ? "the same settings, another parameter count" : out;
}

// Megatron's load_checkpoint refuses a checkpoint without optimizer state unless told not to load it
// (ptk resumed on the import's zero moments, with only the import's note to say so).
absl::Status CheckOptimizerStateLoads(const TrainState& loaded, const std::string& load, int64_t iteration,
                                      bool optimizer_not_loaded) {
  if (optimizer_not_loaded) return absl::OkStatus();
  for (const auto& [flag, value] : loaded.settings)
    if (flag == kOptimizerStateSetting && value == "none")
      return UsageError(
          fmt::format("--load {}: the checkpoint of iteration {} holds no optimizer state (imported from a checkpoint "
                      "saved without it): give --no-load-optim or --finetune (Megatron refuses this load too)",
                      load, iteration));
  return absl::OkStatus();
}

}  // namespace ptk
