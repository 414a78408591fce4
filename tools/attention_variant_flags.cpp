// ptk-train's sliding window attention and softmax type flags (Megatron's --window-size,
// --window-attn-skip-freq, --softmax-type; megatron-core's DotProductAttention, which the CPU backend's
// attention mirrors, MLA's and the MTP depths' too): declared, read as Megatron-LM's arguments.py reads them
// (tuple_type, moe_freq_type), resolved into GPTConfig, and what Megatron or ptk does not run them with (Transformer
// Engine's context parallelism's limits, the CUDA backend) refused in one line each.
#include <cctype>
#include <charconv>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk {
namespace {

std::string Trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

// Megatron's tuple_type: the parentheses at both ends stripped, the rest split at commas, each an int.
bool ParseIntTuple(const std::string& text, std::vector<int64_t>* out) {
  size_t a = 0, b = text.size();
  while (a < b && (text[a] == '(' || text[a] == ')')) ++a;
  while (b > a && (text[b - 1] == '(' || text[b - 1] == ')')) --b;
  const std::string body = text.substr(a, b - a);
  size_t at = 0;
  while (true) {
    const size_t comma = body.find(',', at);
    std::string item = Trim(body.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (!item.empty() && item[0] == '+') item.erase(0, 1);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) return false;
    out->push_back(v);
    if (comma == std::string::npos) return true;
    at = comma + 1;
  }
}

// --window-size's left bound (its right one must be 0).
absl::Status ResolveWindowSize(const std::string& text, int64_t* left) {
  const std::string flag = "--window-size " + text;
  std::vector<int64_t> v;
  if (!ParseIntTuple(text, &v))
    return UsageError(flag + ": integers separated by a comma, \"LEFT,RIGHT\" (Megatron's tuple_type)");
  if (v.size() != 2)
    return UsageError(fmt::format(
        "{}: {} integer(s); the window is two, its left and right bounds (\"LEFT,0\"; Megatron's attention reads "
        "window_size[0] and window_size[1])",
        flag, v.size()));
  if (v[0] < 0)
    return UsageError(
        flag +
        ": the left bound must be at least 0 (Megatron's local attention masks every key of a row for -1; it "
        "is Transformer Engine's unbounded window, which ptk has not)");
  if (v[1] != 0)
    return UsageError(flag +
                      ": the right bound must be 0; ptk trains causal language models (a window over later "
                      "keys is not implemented)");
  *left = v[0];
  return absl::OkStatus();
}

// --window-attn-skip-freq (Megatron's moe_freq_type): N, layer_number % N != 0 has the window (layer_number
// 1-based); or a list pattern, 1 for a windowed layer, 0 for full attention.
// `count`, if given, gets N (0 for a list pattern).
absl::Status ResolveSkipFreq(const std::string& text, int64_t layers, std::vector<int>* pattern,
                             int64_t* count = nullptr) {
  const std::string flag = "--window-attn-skip-freq " + text;
  if (count) *count = 0;
  if (text.find('[') == std::string::npos) {
    int64_t n = 0;
    const std::string t = Trim(text);
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), n);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size() || n < 1)
      return UsageError(flag +
                        ": a positive count N (every N-th layer has full attention) or a list pattern "
                        "(\"[1,1,0]\", \"([1]*3+[0])*2\")");
    for (int64_t l = 0; l < layers; ++l) pattern->push_back((l + 1) % n != 0 ? 1 : 0);
    if (count) *count = n;
    return absl::OkStatus();
  }
  if (!train_flags::ParseLayerPattern(text, pattern))
    return UsageError(flag +
                      ": ptk reads list patterns of 0 and 1 with +, * and parentheses (\"[1,1,0]\", "
                      "\"([1]*3+[0])*2\"), not other Python");
  if (static_cast<int64_t>(pattern->size()) != layers)
    return UsageError(fmt::format("{}: {} entries for --num-layers {} (one per layer)", flag, pattern->size(), layers));
  for (int v : *pattern)
    if (v != 0 && v != 1)
      return UsageError(fmt::format("{}: entry {}: 1 (sliding window) or 0 (full attention)", flag, v));
  return absl::OkStatus();
}

bool AttentionVariantOn(const TrainFlags& f) {
  return !f.attn.window_size.empty() || (!f.attn.softmax_type.empty() && f.attn.softmax_type != "vanilla");
}

}  // namespace

void AddAttentionVariantFlags(CLI::App* app, TrainFlags* f) {
  TrainFlags::AttentionVariant& a = f->attn;
  app->add_option("--window-size", a.window_size,
                  "Sliding window attention (megatron-core's DotProductAttention window): \"LEFT,0\", each query "
                  "attends itself and the LEFT keys before it (default none; on CUDA not with context parallelism)");
  app->add_option("--window-attn-skip-freq", a.window_attn_skip_freq,
                  "Sliding window attention's full layers: N (every N-th layer has full attention) or a list pattern "
                  "of 1 (window) and 0 (full), one per layer (default: every layer windowed)");
  app->add_option("--softmax-type", a.softmax_type,
                  "The attention's softmax: vanilla (default), off-by-one (a 1 more in each denominator) or "
                  "learnable (a learned logit per head beside the scores, core_attention.softmax_offset; CUDA: fp32)")
      ->check(CLI::IsMember({"vanilla", "off-by-one", "learnable"}));
}

absl::Status ResolveAttentionVariantFlags(const TrainFlags& f, GPTConfig* model, std::vector<std::string>* notes) {
  const TrainFlags::AttentionVariant& a = f.attn;
  if (!a.softmax_type.empty()) model->softmax_type = a.softmax_type;
  if (a.window_size.empty()) {
    if (!a.window_attn_skip_freq.empty())
      notes->push_back("--window-attn-skip-freq: accepted, no effect without --window-size (as Megatron)");
    return absl::OkStatus();
  }
  PTK_RETURN_IF_ERROR(ResolveWindowSize(a.window_size, &model->window_left));
  model->window_pattern.clear();
  if (!a.window_attn_skip_freq.empty())
    PTK_RETURN_IF_ERROR(
        ResolveSkipFreq(a.window_attn_skip_freq, model->num_layers, &model->window_pattern, &model->window_skip_freq));
  return absl::OkStatus();
}

absl::Status RefuseAttentionVariantCombinations(const TrainFlags& f, Device device) {
  if (!AttentionVariantOn(f)) return absl::OkStatus();
  const bool window = !f.attn.window_size.empty(),
             sink = !f.attn.softmax_type.empty() && f.attn.softmax_type != "vanilla";
  std::string flags = window ? "--window-size " + f.attn.window_size : "";
  if (sink) flags += (flags.empty() ? "" : " and ") + ("--softmax-type " + f.attn.softmax_type);
  // Megatron's context parallelism is Transformer Engine's attention's (the local DotProductAttention asserts
  // context_parallel_size 1), and TE's attn_forward_func_with_cp asserts what each exchange runs.
  const std::string cp =
      fmt::format("--context-parallel-size {} --cp-comm-type {}", f.context_parallel_size, f.cp_comm_type);
  if (f.context_parallel_size > 1 && sink)
    return UsageError(fmt::format(
        "--softmax-type {} with {}: Transformer Engine's context parallelism (Megatron's) runs the softmax types "
        "only with --cp-comm-type a2a (attn_forward_func_with_cp asserts), which ptk has not",
        f.attn.softmax_type, cp));
  if (f.context_parallel_size > 1 && window && f.cp_comm_type != "allgather")
    return UsageError(fmt::format(
        "--window-size {} with {}: Transformer Engine's context parallelism (Megatron's) runs a sliding window only "
        "with --cp-comm-type a2a or allgather (attn_forward_func_with_cp asserts); use --cp-comm-type allgather",
        f.attn.window_size, cp));
  if (window && !f.attn.window_attn_skip_freq.empty() && f.attn.window_attn_skip_freq.find('[') != std::string::npos &&
      f.mtp.num_layers.value_or(0) > 0)
    return UsageError(fmt::format(
        "--window-attn-skip-freq {} with --mtp-num-layers {}: megatron-core's is_layer_window_attention indexes a "
        "list pattern at the depths' layer numbers (--num-layers + 1 on), past its entries (IndexError); give a "
        "count N",
        f.attn.window_attn_skip_freq, *f.mtp.num_layers));
  const bool half = f.bf16 || f.fp16;
  if (device != Device::kCpu && f.context_parallel_size > 1)
    return UsageError(fmt::format(
        "{} with --device cuda and {}: the CUDA backend's context-parallel attention has neither the sliding window "
        "nor the softmax offset (--device cpu has them)",
        flags, cp));
  if (device != Device::kCpu && sink && half)
    return UsageError(fmt::format(
        "--softmax-type {} with {}: the CUDA backend's bf16/fp16 attention (cuDNN's) runs without the softmax offset "
        "in ptk; fp32 (--device cuda without --bf16 / --fp16) and --device cpu have it",
        f.attn.softmax_type, f.bf16 ? "--bf16" : "--fp16"));
  if (f.attn.softmax_type == "learnable" && f.options.model.init_method_xavier_uniform)
    return UsageError(
        "--softmax-type learnable with --init-method-xavier-uniform: Megatron's init_method (xavier_uniform_) "
        "cannot initialise the 1-D softmax_offset (it has no fan-in and fan-out)");
  return absl::OkStatus();
}

std::string CanonicalAttentionVariantValue(const std::string& flag, const std::string& given, int64_t layers,
                                           int64_t mtp_layers) {
  if (flag == "--window-size") {
    std::vector<int64_t> v;
    if (!ParseIntTuple(given, &v) || v.size() != 2) return given;
    return fmt::format("{},{}", v[0], v[1]);
  }
  if (flag == "--window-attn-skip-freq") {
    std::vector<int> pattern;
    int64_t count = 0;
    if (!ResolveSkipFreq(given, layers, &pattern, &count).ok()) return given;
    if (mtp_layers > 0 && count > 0) return std::to_string(count);  // GPTConfig::WindowSkipFreqSetting's
    std::string out = "[";
    for (size_t l = 0; l < pattern.size(); ++l) out += fmt::format("{}{}", l ? "," : "", pattern[l]);
    return out + "]";
  }
  return given;
}

}  // namespace ptk
