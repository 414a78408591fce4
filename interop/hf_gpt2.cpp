// ptk checkpoint <-> Hugging Face GPT-2 directory: the export's files, the import's checks of config.json and weights.
#include "interop/hf_gpt2.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <utility>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/py_format.h"
#include "common/status.h"
#include "interop/hf_config.h"
#include "interop/hf_deepseek_v3.h"
#include "interop/hf_export_dir.h"
#include "interop/hf_gpt2_tensors.h"
#include "interop/hf_llama.h"
#include "interop/hf_mixtral.h"
#include "interop/hf_qwen2_moe.h"
#include "interop/hf_qwen3_moe.h"
#include "interop/hf_shards.h"
#include "interop/megatron.h"
#include "interop/safetensors.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "trainer/checkpoint.h"
#include "trainer/model_limits.h"
#include "trainer/training_log.h"

namespace ptk {
namespace {

using hf_detail::Bool;
using hf_detail::CheckExportTarget;
using hf_detail::CheckNotInside;
using hf_detail::ExportNewCopy;
using hf_detail::ExportOldCopy;
using hf_detail::ExportStep;
using hf_detail::ExportTarget;
using hf_detail::HfConfigReader;
using hf_detail::HfTensor;
using hf_detail::HfTensorsOf;
using hf_detail::Int;
using hf_detail::kLmHead;
using hf_detail::kMaxInitMethodStd;
using hf_detail::kMaxLayerNormEpsilon;
using hf_detail::kPrefix;
using hf_detail::MapParams;
using hf_detail::Num;
using hf_detail::PrettyConfig;
using hf_detail::PublishExport;
using hf_detail::RecoverExport;
using hf_detail::Shape;
using hf_detail::Str;

absl::StatusOr<std::string> ReadOrDefault(const std::string& path, std::string_view fallback) {
  if (path.empty()) return std::string(fallback);
  return ReadFileToString(path);
}

// --apply-layernorm-1p's norms in the weights that compute them without it: each norm weight + 1
// (in fp32, as megatron-core's forward adds it).
void FoldZeroCentredNorms(const ParamLayout& layout, std::vector<float>* params) {
  for (const ParamInfo& p : layout.infos) {
    const std::string_view name = p.name, suffix = "layernorm.weight";
    if (name.size() < suffix.size() || name.substr(name.size() - suffix.size()) != suffix) continue;
    for (int64_t i = 0; i < p.size; ++i) (*params)[static_cast<size_t>(p.offset + i)] += 1.0f;
  }
}

// The export's text files: config.json, generation_config.json, tokenizer_config.json, vocab.json,
// merges.txt.
struct HfTextFiles {
  std::string config, generation, tokenizer_config, vocab_json, merges_txt;
};

HfTextFiles HfTextFilesOf(const GPTConfig& c, int64_t eod, std::string vocab_json, std::string merges_txt) {
  HfTextFiles f;
  f.config = PrettyConfig({
      // --squared-relu: transformers' "relu2" (ReLUSquaredActivation, relu(x)^2), which GPT2MLP takes; the exact
      // GELU (Megatron's unfused GELU MLP): "gelu" (GELUActivation, F.gelu); the tanh GELU: "gelu_new".
      {"activation_function", Str(c.squared_relu ? "relu2"
                                  : c.gelu_exact ? "gelu"
                                                 : "gelu_new")},
      {"architectures", "[\n    \"GPT2LMHeadModel\"\n  ]"},
      {"attn_pdrop", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"embd_pdrop", Num(c.hidden_dropout)},
      {"eos_token_id", Int(eod)},
      {"initializer_range", Num(c.init_method_std)},
      {"layer_norm_epsilon", Num(c.layernorm_epsilon)},
      {"model_type", Str("gpt2")},
      {"n_embd", Int(c.hidden_size)},
      {"n_head", Int(c.num_attention_heads)},
      {"n_inner", Int(c.ffn_hidden_size)},
      {"n_layer", Int(c.num_layers)},
      {"n_positions", Int(c.max_position_embeddings)},
      {"reorder_and_upcast_attn", Bool(false)},
      {"resid_pdrop", Num(c.hidden_dropout)},
      {"scale_attn_by_inverse_layer_idx", Bool(false)},
      {"scale_attn_weights", Bool(true)},
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"vocab_size", Int(c.vocab_size)},
  });
  f.generation = PrettyConfig({{"bos_token_id", Int(eod)}, {"eos_token_id", Int(eod)}});
  const std::string eot(Gpt2Tokenizer::kEndOfText);
  f.tokenizer_config = PrettyConfig({
      {"add_prefix_space", Bool(false)},
      {"bos_token", Str(eot)},
      {"clean_up_tokenization_spaces", Bool(false)},  // decode gives the text's bytes, as ptk's Decode
      {"eos_token", Str(eot)},
      {"model_max_length", Int(c.max_position_embeddings)},
      {"tokenizer_class", Str("GPT2Tokenizer")},
      {"unk_token", Str(eot)},
  });
  f.vocab_json = std::move(vocab_json);
  f.merges_txt = std::move(merges_txt);
  return f;
}

// The weights into `dir` as save_pretrained writes them: model.safetensors when they fit in one shard of
// `max_shard_size`, else model-0000K-of-0000N.safetensors (the tensors assigned as
// split_torch_state_dict_into_shards assigns them, each whole) and model.safetensors.index.json.
absl::Status WriteWeights(const std::string& dir, const std::vector<SafetensorsEntry>& entries, uint64_t max_shard_size,
                          ProgressReporter* progress, bool say_files) {
  const std::map<std::string, std::string> kMetadata = {{"format", "pt"}};
  std::vector<uint64_t> sizes;
  for (const SafetensorsEntry& e : entries) sizes.push_back(e.data.size_bytes());
  const std::vector<int> shard = hf_detail::AssignShards(sizes, max_shard_size);
  const int shards = shard.empty() ? 1 : 1 + *std::max_element(shard.begin(), shard.end());
  if (shards == 1) {
    PTK_RETURN_IF_ERROR(ExportStep("write model.safetensors"));
    if (say_files) log::Info("convert: writing {} ({} tensors) ...", hf_detail::kWeightsName, entries.size());
    return WriteSafetensors(JoinPath(dir, hf_detail::kWeightsName), entries, kMetadata, progress);
  }
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (int k = 0; k < shards; ++k) {
    const std::string name = hf_detail::ShardFileName(k, shards);
    std::vector<SafetensorsEntry> part;
    for (size_t i = 0; i < entries.size(); ++i)
      if (shard[i] == k) {
        part.push_back(entries[i]);
        weight_map[entries[i].name] = name;
        total += sizes[i];
      }
    PTK_RETURN_IF_ERROR(ExportStep("write " + name));
    if (say_files) log::Info("convert: writing {} ({} tensors) ...", name, part.size());
    PTK_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, name), part, kMetadata, progress));
  }
  PTK_RETURN_IF_ERROR(ExportStep(std::string("write ") + hf_detail::kWeightsIndexName));
  return WriteFileAtomic(JoinPath(dir, hf_detail::kWeightsIndexName), hf_detail::ShardIndexJson(weight_map, total));
}

// The export's files written into a new directory beside --save-dir, which then takes its place;
// returns the directory.
absl::StatusOr<std::string> WriteExport(const ConvertOptions& o, const std::string& source,
                                        const std::vector<SafetensorsEntry>& entries, uint64_t max_shard_size,
                                        const HfTextFiles& text) {
  // One export into a directory at a time (a lock file beside it), published whole: every file written
  // into a new directory beside the target, which then takes the target's place (PublishExport).
  PTK_ASSIGN_OR_RETURN(const std::string dir, ExportTarget(o.save_dir));
  PTK_RETURN_IF_ERROR(MakeDirs(Dirname(dir)));
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(dir, o.lock_wait));
  PTK_RETURN_IF_ERROR(RecoverExport(dir));
  PTK_RETURN_IF_ERROR(CheckExportTarget(dir, o.force));
  for (const auto& [what, path] : {std::pair<const char*, std::string>{"--load-dir", o.load_dir},
                                   {"--vocab-file", o.vocab_file},
                                   {"--merge-file", o.merge_file},
                                   {"the current directory", "."}})
    PTK_RETURN_IF_ERROR(CheckNotInside(dir, what, path));
  // --load-dir's checkpoint itself: a --save-dir inside --load-dir (ckpt/iter_0000007) holds it too.
  PTK_RETURN_IF_ERROR(CheckNotInside(dir, "the checkpoint read", source));
  const std::string tmp = ExportNewCopy(dir), old = ExportOldCopy(dir);
  const std::vector<std::pair<std::string, const std::string*>> small = {
      {"config.json", &text.config},
      {"generation_config.json", &text.generation},
      {"tokenizer_config.json", &text.tokenizer_config},
      {"vocab.json", &text.vocab_json},
      {"merges.txt", &text.merges_txt}};
  absl::Status written = [&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(MakeDirs(tmp));
    // An 8B model's weights are tens of GB: the export says how far it is (it was silent until done).
    uint64_t bytes_total = 0;
    for (const SafetensorsEntry& e : entries) bytes_total += e.data.size_bytes();
    ProgressReporter progress({.label = "convert",
                               .item_unit = "tensors",
                               .items_total = entries.size(),
                               .bytes_total = bytes_total,
                               .enabled = o.progress});
    PTK_RETURN_IF_ERROR(
        WriteWeights(tmp, entries, max_shard_size, &progress, o.progress && bytes_total >= kConvertLongStepBytes));
    progress.Finish();
    for (const auto& [name, contents] : small) {
      PTK_RETURN_IF_ERROR(ExportStep("write " + name));
      PTK_RETURN_IF_ERROR(WriteFileAtomic(JoinPath(tmp, name), *contents));
    }
    PTK_RETURN_IF_ERROR(ExportStep("fsync new export"));
    PTK_RETURN_IF_ERROR(FsyncDir(tmp));
    return PublishExport(tmp, dir, old);
  }();
  if (!written.ok()) {
    // Whatever failed (a full disk): the target as it was, nothing of this export left beside it.
    absl::Status undo = RecoverExport(dir);
    if (!undo.ok()) log::Warning("after a failed export: {}", StatusMessage(undo));
    return written;
  }
  return dir;
}

}  // namespace

absl::StatusOr<ConvertSummary> ExportToHf(const ConvertOptions& o) {
  ConvertSummary s;
  PTK_ASSIGN_OR_RETURN(const uint64_t max_shard_size, hf_detail::ParseMaxShardSize(o.max_shard_size));
  PTK_ASSIGN_OR_RETURN(PtkCheckpoint ck, LoadPtkCheckpoint(o.load_dir, o.true_vocab_size, o.progress));
  PTK_RETURN_IF_ERROR(hf_detail::RefuseMtp(ck));  // MTP depths: --saver megatron only
  // A router's expert_bias: DeepseekV3ForCausalLM (MLA) routes by it; no other HF class does, none drops it unsaid.
  if (!ck.state.buffers.empty() && !ck.config.mla())
    return absl::UnimplementedError(fmt::format(
        "{}: the checkpoint holds {} (--moe-router-enable-expert-bias): Mixtral, Qwen2-MoE and "
        "Qwen3-MoE route without an expert bias; ptk-convert carries it to Megatron (--saver megatron) and, with "
        "--multi-latent-attention, to DeepseekV3ForCausalLM",
        ck.file, ck.state.buffers.front().first));
  s.iteration = ck.iteration;
  s.source = ck.file;
  s.notes = ck.notes;
  const GPTConfig& c = ck.config;
  if (c.moe() && c.moe_expert_capacity_factor >= 0)  // a training setting to HF: its MoE classes never drop
    s.notes.push_back(fmt::format("trained with --moe-expert-capacity-factor {}: the Hugging Face model is dropless",
                                  c.moe_expert_capacity_factor));
  // A GPT-3-style model stays GPT-2's; the Llama line goes to LlamaForCausalLM where it can (with
  // --qk-layernorm to Qwen3ForCausalLM).
  // A mixture of experts goes to MixtralForCausalLM (with --qk-layernorm Qwen3MoeForCausalLM) where it can, a
  // multi-latent attention model (dense too) to DeepseekV3ForCausalLM.
  const bool llama = !c.gpt3() || hf_detail::MoeLine(c);
  if (hf_detail::MoeLine(c)) {
    PTK_RETURN_IF_ERROR(hf_detail::CheckMoeExportable(c, ck.file));
  } else if (llama) {
    PTK_RETURN_IF_ERROR(hf_detail::CheckLlamaExportable(c, ck.file));
  }
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  std::vector<float>& params = ck.params;
  if (c.apply_layernorm_1p) {
    // Hugging Face's norms scale by their weight itself: 1 + gamma is the weight that computes the same.
    FoldZeroCentredNorms(layout, &params);
    s.notes.push_back("--apply-layernorm-1p: each norm's weight is exported as 1 + its zero-centred weight");
  }

  PTK_ASSIGN_OR_RETURN(auto tokenizer, Gpt2Tokenizer::LoadOrDefault(o.vocab_file, o.merge_file));
  if (tokenizer->vocab_size() != c.vocab_size)
    return UsageError(fmt::format(
        "the model's vocabulary has {} entries, the tokenizer's {} ({}): give --vocab-file and --merge-file "
        "of the tokenizer the model was trained with",
        c.vocab_size, tokenizer->vocab_size(), o.vocab_file.empty() ? "ptk's built-in GPT-2 files" : o.vocab_file));
  PTK_ASSIGN_OR_RETURN(std::string vocab_json, ReadOrDefault(o.vocab_file, Gpt2Tokenizer::DefaultVocabJson()));
  PTK_ASSIGN_OR_RETURN(std::string merges_txt, ReadOrDefault(o.merge_file, Gpt2Tokenizer::DefaultMergesTxt()));
  const int64_t eod = tokenizer->eod();

  std::vector<HfTensor> tensors = hf_detail::MoeLine(c) ? hf_detail::MoeTensorsOf(c)
                                  : llama               ? hf_detail::LlamaTensorsOf(c)
                                                        : HfTensorsOf(c);
  if (hf_detail::MoeLine(c)) {
    hf_detail::MapMoeParams(layout, &params, &tensors, /*to_hf=*/true);
    if (c.mla()) PTK_RETURN_IF_ERROR(hf_detail::MapExpertBiases(layout, &ck.state.buffers, &tensors, true));
  } else if (llama) {
    hf_detail::MapLlamaParams(layout, &params, &tensors, /*to_hf=*/true);
  } else {
    MapParams(layout, &params, &tensors, /*to_hf=*/true);
    for (HfTensor& t : tensors)
      if (t.name != kLmHead) t.name = kPrefix + t.name;
  }
  // Weights that no reader can use are refused here, as the import refuses them.
  for (const HfTensor& t : tensors)
    for (size_t i = 0; i < t.data.size(); ++i)
      if (!std::isfinite(t.data[i]))
        return absl::DataLossError(
            fmt::format("{}: tensor {} (element {}) holds {}: a model with non-finite weights is not exported", ck.file,
                        t.name, i, std::isnan(t.data[i]) ? "a NaN" : "an infinity"));
  std::vector<SafetensorsEntry> entries;
  for (const HfTensor& t : tensors) entries.push_back({t.name, t.shape, t.data});

  HfTextFiles text = HfTextFilesOf(c, eod, std::move(vocab_json), std::move(merges_txt));
  if (llama) {
    text.config = hf_detail::MoeLine(c) ? hf_detail::MoeConfigJson(c, eod) : hf_detail::LlamaConfigJson(c, eod);
    if (c.use_rope_scaling && c.max_position_embeddings <= 8192)
      s.notes.push_back(fmt::format(
          "--max-position-embeddings {} is not above Llama 3.1's original context (8192): transformers warns about "
          "rope_scaling when it loads the model (RoPE has no weights: a larger value changes nothing else)",
          c.max_position_embeddings));
    if (c.hidden_dropout != 0)
      s.notes.push_back(fmt::format("--hidden-dropout {}: {} has no hidden dropout (it is left out)",
                                    Num(c.hidden_dropout),
                                    hf_detail::MoeLine(c) ? hf_detail::MoeArchitecture(c)
                                    : c.qk_layernorm      ? "Qwen3ForCausalLM"
                                                          : "LlamaForCausalLM"));
  }
  PTK_ASSIGN_OR_RETURN(const std::string dir, WriteExport(o, ck.file, entries, max_shard_size, text));
  s.destination = dir;
  s.config = c;
  for (const HfTensor& t : tensors) s.num_params += static_cast<int64_t>(t.data.size());
  if (c.padded_vocab_size > c.vocab_size)
    s.notes.push_back(fmt::format(
        "the {} padded vocabulary rows (ids {} to {}, no token of the tokenizer) are dropped: HF's logits are the "
        "first {} of ptk's",
        c.padded_vocab_size - c.vocab_size, c.vocab_size, c.padded_vocab_size - 1, c.vocab_size));
  return s;
}

namespace {

// The model config.json describes must be the one ptk computes: GPT-2, the tanh GELU (the exact GELU:
// "gelu", transformers' F.gelu; relu2: --squared-relu), attention scaled by 1/sqrt(head_dim) alone.
absl::Status CheckHfArchitecture(const HfConfigReader& r, GPTConfig* c) {
  std::string_view act;
  bool scale = true, by_layer = false, cross = false;
  PTK_RETURN_IF_ERROR(r.Get("activation_function", std::string_view("gelu_new"), &act, "a string"));
  c->squared_relu = act == "relu2";
  c->gelu_exact = act == "gelu";  // GELUActivation: torch's F.gelu, Megatron's unfused GELU MLP
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast" && !c->squared_relu && !c->gelu_exact)
    return r.Bad(fmt::format(
        "activation_function {:?}: ptk computes the tanh GELU (gelu_new, gelu_pytorch_tanh, gelu_fast), the exact "
        "GELU (gelu: --no-bias-gelu-fusion) or relu2 (--squared-relu)",
        act));
  PTK_RETURN_IF_ERROR(r.Get("scale_attn_weights", true, &scale, "true or false"));
  PTK_RETURN_IF_ERROR(r.Get("scale_attn_by_inverse_layer_idx", false, &by_layer, "true or false"));
  PTK_RETURN_IF_ERROR(r.Get("add_cross_attention", false, &cross, "true or false"));
  if (!scale || by_layer || cross)
    return r.Bad(
        "ptk's attention is scaled by 1/sqrt(head_dim) only, without cross-attention (scale_attn_weights true, "
        "scale_attn_by_inverse_layer_idx false, add_cross_attention false)");
  return absl::OkStatus();
}

// The dimensions, the vocabulary padded as ptk-train pads it, and the tying of the output layer.
absl::Status ReadHfDimensions(const HfConfigReader& r, int64_t make_vocab_size_divisible_by, GPTConfig* c) {
  PTK_RETURN_IF_ERROR(r.GetInt("n_layer", &c->num_layers, std::nullopt));
  PTK_RETURN_IF_ERROR(r.GetInt("n_embd", &c->hidden_size, std::nullopt));
  PTK_RETURN_IF_ERROR(r.GetInt("n_head", &c->num_attention_heads, std::nullopt));
  PTK_RETURN_IF_ERROR(r.GetInt("n_inner", &c->ffn_hidden_size, 4 * c->hidden_size));
  PTK_RETURN_IF_ERROR(r.GetInt("n_positions", &c->max_position_embeddings, std::nullopt));
  PTK_RETURN_IF_ERROR(r.GetInt("vocab_size", &c->vocab_size, std::nullopt));
  c->seq_length = c->max_position_embeddings;
  c->padded_vocab_size = PaddedVocabSize(c->vocab_size, make_vocab_size_divisible_by);
  bool tie = true;
  PTK_RETURN_IF_ERROR(r.Get("tie_word_embeddings", true, &tie, "true or false"));
  c->untie_embeddings_and_output_weights = !tie;
  return absl::OkStatus();
}

// Numbers: simdjson reads integers as doubles too (a dropout of 0). Each in the range the model
// can use (GPTConfig::Validate, as ptk-train's flags).
absl::Status ReadHfReals(const HfConfigReader& r, GPTConfig* c, double* embd_pdrop) {
  PTK_RETURN_IF_ERROR(
      r.GetReal("layer_norm_epsilon", 1e-5, &c->layernorm_epsilon, 0, true, kMaxLayerNormEpsilon, false));
  PTK_RETURN_IF_ERROR(r.GetReal("resid_pdrop", 0.1, &c->hidden_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(r.GetReal("attn_pdrop", 0.1, &c->attention_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(r.GetReal("initializer_range", 0.02, &c->init_method_std, 0, true, kMaxInitMethodStd, false));
  return r.GetReal("embd_pdrop", c->hidden_dropout, embd_pdrop, 0, false, 1, true);
}

// config.json as the model ptk trains, refused where ptk would compute another model or cannot
// hold it; what ptk cannot keep apart (embd_pdrop) becomes a note.
absl::StatusOr<GPTConfig> ReadGpt2Config(const HfConfigReader& r, int64_t make_vocab_size_divisible_by,
                                         std::vector<std::string>* notes) {
  GPTConfig c;
  PTK_RETURN_IF_ERROR(CheckHfArchitecture(r, &c));
  PTK_RETURN_IF_ERROR(ReadHfDimensions(r, make_vocab_size_divisible_by, &c));
  double embd_pdrop = 0;
  PTK_RETURN_IF_ERROR(ReadHfReals(r, &c, &embd_pdrop));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size),
               implied =
                   static_cast<double>(c.num_layers) * (4 * h * h + 2 * h * static_cast<double>(c.ffn_hidden_size)) +
                   h * static_cast<double>(c.vocab_size + c.max_position_embeddings);
  if (implied > 0x1p40)
    return r.Bad(
        fmt::format("n_layer {}, n_embd {}, n_inner {}, vocab_size {} and n_positions {} make {:.3g} "
                    "parameters: more than ptk can hold",
                    c.num_layers, c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.max_position_embeddings, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return r.Bad(std::string(StatusMessage(st)));
  if (embd_pdrop != c.hidden_dropout)
    notes->push_back(fmt::format("embd_pdrop {} differs from resid_pdrop {}: ptk's --hidden-dropout applies to both",
                                 Num(embd_pdrop), Num(c.hidden_dropout)));
  return c;
}

// The weights: every tensor config.json implies, with its shape and finite values, and nothing
// else (the causal-mask buffers of older files aside; a tied model's output layer only as a copy
// of the embedding). Fills each tensor's data.
absl::Status ReadHfTensors(const hf_detail::HfWeights& weights, const GPTConfig& c, std::vector<HfTensor>* tensors) {
  std::map<std::string, hf_detail::PresentTensor> present;
  for (const auto& [full_name, t] : weights.tensors) {
    std::string name = full_name;
    if (name.rfind(kPrefix, 0) == 0) name = name.substr(sizeof kPrefix - 1);
    // The causal-mask buffers older GPT-2 files carry: not weights.
    static const std::regex kMask(R"(h\.\d+\.attn\.(masked_)?bias)");
    if (std::regex_match(name, kMask)) continue;
    if (!present.emplace(name, t).second)
      return absl::DataLossError(
          fmt::format("{}: tensor {} is there with and without the {} prefix", t.file->path(), full_name, kPrefix));
  }
  return hf_detail::ReadPresentTensors(weights.source, std::move(present), c.untie_embeddings_and_output_weights,
                                       kPrefix, "GPT-2", tensors, weights.progress);
}

std::string SettingNum(double v) { return fmt::format("{}", v); }  // as ptk-train records its settings

// config.json's model: GPT-2's ("gpt2"), Llama's ("llama"), Qwen3's ("qwen3"), Mixtral's, Qwen3-MoE's ("qwen3_moe").
absl::StatusOr<GPTConfig> ReadHfConfig(const std::string& config_path, int64_t make_vocab_size_divisible_by,
                                       std::vector<std::string>* notes) {
  PTK_ASSIGN_OR_RETURN(std::string config_text, ReadFileToString(config_path));
  HfConfigReader r(config_path);
  PTK_RETURN_IF_ERROR(r.Parse(config_text));
  std::string_view model_type;
  PTK_RETURN_IF_ERROR(r.Get("model_type", std::string_view(), &model_type, "a string"));
  if (model_type == "gpt2") return ReadGpt2Config(r, make_vocab_size_divisible_by, notes);
  if (model_type == "llama") return hf_detail::ReadLlamaConfig(r, make_vocab_size_divisible_by, notes);
  if (model_type == "qwen3") return hf_detail::ReadLlamaConfig(r, make_vocab_size_divisible_by, notes, /*qwen3=*/true);
  if (model_type == "mixtral") return hf_detail::ReadMixtralConfig(r, make_vocab_size_divisible_by, notes);
  if (model_type == "qwen3_moe") return hf_detail::ReadQwen3MoeConfig(r, make_vocab_size_divisible_by, notes);
  if (model_type == "qwen2_moe") return hf_detail::ReadQwen2MoeConfig(r, make_vocab_size_divisible_by, notes);
  if (model_type == "deepseek_v3") return hf_detail::ReadDeepseekV3Config(r, make_vocab_size_divisible_by, notes);
  return r.Bad(fmt::format(
      "model_type {:?}: ptk reads GPT-2 models (model_type \"gpt2\"), Llama models (model_type \"llama\"), Qwen3 "
      "models (model_type \"qwen3\"), Mixtral models (model_type \"mixtral\"), Qwen3-MoE models (model_type "
      "\"qwen3_moe\"), Qwen2-MoE models (model_type \"qwen2_moe\") and DeepSeek-V3 models (model_type \"deepseek_v3\")",
      model_type));
}

// The settings the imported checkpoint records, as a training run records them.
std::vector<std::pair<std::string, std::string>> ImportedSettings(const GPTConfig& c) {
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
      {"--hidden-dropout", SettingNum(c.hidden_dropout)},
      {"--attention-dropout", SettingNum(c.attention_dropout)},
      {"--init-method-std", SettingNum(c.init_method_std)},
      {"--squared-relu", c.squared_relu ? "on" : "off"},
      {"--no-bias-gelu-fusion", c.gelu_exact ? "on (the exact erf GELU)" : "off"},
  };
}

// The model flags ptk-train needs to load the imported checkpoint.
std::string ImportedTrainFlags(const GPTConfig& c, int64_t make_vocab_size_divisible_by) {
  std::string flags = c.gpt3()
                          ? fmt::format(
                                "--num-layers {} --hidden-size {} --num-attention-heads {} --ffn-hidden-size {} "
                                "--max-position-embeddings {} --layernorm-epsilon {}{}",
                                c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size,
                                c.max_position_embeddings, SettingNum(c.layernorm_epsilon),
                                c.untie_embeddings_and_output_weights ? " --untie-embeddings-and-output-weights" : "")
                      : hf_detail::MoeLine(c) ? hf_detail::MoeTrainFlags(c)
                                              : hf_detail::LlamaTrainFlags(c);
  if (c.squared_relu) flags += " --squared-relu";  // relu2
  // gelu: the exact GELU, Megatron's GELU MLP without its fused kernel (--disable-bias-linear selects it too)
  if (c.gelu_exact && c.add_bias_linear) flags += " --no-bias-gelu-fusion";
  if (c.vocab_size != 50257) flags += fmt::format(" --vocab-size {}", c.vocab_size);
  if (make_vocab_size_divisible_by != 128)
    flags += fmt::format(" --make-vocab-size-divisible-by {}", make_vocab_size_divisible_by);
  return flags;
}

// --save-dir the Hugging Face directory read, or inside it: the import wrote iter_N/ and
// latest_checkpointed_iteration.txt into it, exit 0 (the exports refuse their overlaps already).
absl::Status CheckImportOutsideLoadDir(const ConvertOptions& o) {
  std::error_code ec;
  const std::filesystem::path load = std::filesystem::weakly_canonical(o.load_dir, ec);
  if (ec) return absl::OkStatus();
  const std::filesystem::path save = std::filesystem::weakly_canonical(o.save_dir, ec);
  if (ec) return absl::OkStatus();
  const std::string l = load.string(), v = save.string();
  if (v != l && v.rfind(l == "/" ? l : l + "/", 0) != 0) return absl::OkStatus();
  return UsageError(fmt::format(
      "--save-dir {} is {}--load-dir {}: the import would write iter_N/ and latest_checkpointed_iteration.txt into "
      "the Hugging Face directory it reads; import into a directory of its own",
      o.save_dir, v == l ? "" : "inside ", o.load_dir));
}

}  // namespace

absl::StatusOr<ConvertSummary> ImportFromHf(const ConvertOptions& o) {
  ConvertSummary s;
  PTK_RETURN_IF_ERROR(CheckImportOutsideLoadDir(o));
  if (o.iteration < 0) return UsageError(fmt::format("--iteration {}: must be at least 0", o.iteration));
  if (o.iteration > 0 && (o.global_batch_size > 0) == (o.consumed_train_samples >= 0))
    return UsageError(fmt::format(
        "--iteration {}: give the run's --global-batch-size (the samples consumed are iteration x batch) or, with "
        "batch ramp-up, its --consumed-train-samples: one of the two",
        o.iteration));
  if (o.iteration == 0 && (o.global_batch_size > 0 || o.consumed_train_samples >= 0))
    return UsageError("--global-batch-size and --consumed-train-samples place an import at --iteration N (N > 0)");
  // model.safetensors, or the shards of model.safetensors.index.json: mapped, read tensor by tensor.
  PTK_ASSIGN_OR_RETURN(hf_detail::HfWeights weights, hf_detail::OpenHfWeights(o.load_dir, &s.notes));
  // An 8B model's weights are tens of GB: the import says how far it is reading them.
  ProgressReporter progress({.label = "convert", .item_unit = "tensors", .enabled = o.progress});
  weights.progress = &progress;
  s.source = weights.source;
  PTK_ASSIGN_OR_RETURN(s.config,
                       ReadHfConfig(JoinPath(o.load_dir, "config.json"), o.make_vocab_size_divisible_by, &s.notes));
  const GPTConfig& c = s.config;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  const bool llama = !c.gpt3();
  std::vector<HfTensor> tensors = hf_detail::MoeLine(c) ? hf_detail::MoeTensorsOf(c)
                                  : llama               ? hf_detail::LlamaTensorsOf(c)
                                                        : HfTensorsOf(c);
  std::vector<float> params(static_cast<size_t>(layout.num_params), 0.0f);
  ModelBuffers buffers;         // DeepSeek-V3's e_score_correction_bias: the routers' expert biases
  if (hf_detail::MoeLine(c)) {  // MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, DeepseekV3ForCausalLM
    PTK_RETURN_IF_ERROR(hf_detail::ReadLlamaTensors(weights, c, &tensors, hf_detail::MoeArchitecture(c)));
    hf_detail::MapMoeParams(layout, &params, &tensors, /*to_hf=*/false);
    if (c.mla()) PTK_RETURN_IF_ERROR(hf_detail::MapExpertBiases(layout, &buffers, &tensors, false));
  } else if (llama) {
    PTK_RETURN_IF_ERROR(hf_detail::ReadLlamaTensors(weights, c, &tensors));
    hf_detail::MapLlamaParams(layout, &params, &tensors, /*to_hf=*/false);
  } else {
    PTK_RETURN_IF_ERROR(ReadHfTensors(weights, c, &tensors));
    MapParams(layout, &params, &tensors, /*to_hf=*/false);
  }
  progress.Finish();
  const std::vector<float> zeros(params.size(), 0.0f);
  TrainState state;
  state.seed = 1234;
  state.buffers = std::move(buffers);
  state.settings = hf_detail::MoeLine(c) ? hf_detail::MoeSettings(c)
                   : llama               ? hf_detail::LlamaSettings(c)
                                         : ImportedSettings(c);
  // The divisor beside the padded vocabulary, as a run records it (Megatron's args hold
  // make_vocab_size_divisible_by): --use-checkpoint-args pads the same from it.
  const auto padded_at = std::find_if(state.settings.begin(), state.settings.end(), [](const auto& kv) {
    return kv.first == "--make-vocab-size-divisible-by (padded vocabulary)";
  });
  state.settings.insert(padded_at + (padded_at != state.settings.end() ? 1 : 0),
                        {"--make-vocab-size-divisible-by", std::to_string(o.make_vocab_size_divisible_by)});
  // A run's position (--iteration): Megatron's consumed samples, which place the data and the
  // learning-rate schedule (counted in samples, as Megatron's OptimizerParamScheduler counts them).
  state.iteration = s.iteration = o.iteration;
  if (o.iteration > 0) {
    state.consumed_train_samples =
        o.consumed_train_samples >= 0 ? o.consumed_train_samples : o.iteration * o.global_batch_size;
    state.scheduler_num_steps = state.consumed_train_samples;
    if (o.global_batch_size > 0)
      state.settings.emplace_back("--global-batch-size", std::to_string(o.global_batch_size));
  }
  // As a training run: one writer per --save directory, and what a killed save left put right.
  SaveDirectory save_dir;  // locked; a failed import (a full disk) leaves no --save-dir it made
  PTK_RETURN_IF_ERROR(save_dir.Take(o.save_dir, "ptk-train", o.lock_wait));
  PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o.save_dir));
  PTK_RETURN_IF_ERROR(CheckImportTarget(o.save_dir, o.iteration, /*with_moments=*/false));
  // The weights and two moments, written, checksummed and synced: minutes for a large model.
  if (const uint64_t bytes = 3 * params.size() * sizeof(float); o.progress && bytes >= kConvertLongStepBytes)
    log::Info("convert: {} tensors read ({}) in {}; writing {} ({}) ...", progress.items(),
              HumanBytes(static_cast<double>(progress.bytes())), HumanDuration(progress.ElapsedSeconds()),
              CheckpointFile(o.save_dir, o.iteration), HumanBytes(static_cast<double>(bytes)));
  {
    ProgressReporter writing({.label = "convert", .item_unit = "files", .enabled = o.progress});
    PTK_RETURN_IF_ERROR(SaveCheckpoint(o.save_dir, layout, params, zeros, zeros, state, o.args_json, &writing));
  }
  save_dir.Keep();
  s.destination = CheckpointFile(o.save_dir, o.iteration);
  s.notes.push_back(fmt::format("a Hugging Face directory holds no optimizer state: AdamW's moments start at zero{}",
                                o.iteration > 0
                                    ? fmt::format(" (Adam's step from 1) at iteration {}, {} samples consumed",
                                                  o.iteration, state.consumed_train_samples)
                                    : ""));
  if (o.iteration > 0)
    s.notes.push_back(
        "the seed recorded is 1234 (Megatron's default; dropout masks follow it): resume with ptk-train --no-load-rng "
        "to take the run's own --seed");
  s.num_params = layout.num_params;
  s.train_flags = ImportedTrainFlags(c, o.make_vocab_size_divisible_by);
  if (c.padded_vocab_size > c.vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} rows with copies of the last row, as "
                    "Megatron's checkpoint converter pads",
                    c.vocab_size, c.padded_vocab_size));
  return s;
}

}  // namespace ptk
