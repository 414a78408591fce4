// GPT-2's tensors in Hugging Face's names and layout: Megatron's fused QKV rows, Conv1D's transposes.
#include "interop/hf_gpt2_tensors.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/progress.h"
#include "common/status.h"
#include "interop/hf_config.h"

namespace ptk::hf_detail {
namespace {

// Megatron's fused QKV rows ((head, {q, k, v}, head_dim), each a row of `c` inputs) -> HF's c_attn
// columns ({q, k, v}, head, head_dim) in Conv1D's (in, out) layout; `to_hf` false goes back.
void MapQkvWeight(const float* meg, float* hf, int64_t c, int64_t heads, int64_t hd, bool to_hf) {
  for (int64_t n = 0; n < heads; ++n)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t d = 0; d < hd; ++d) {
        const int64_t row = (n * 3 + w) * hd + d, col = w * c + n * hd + d;
        for (int64_t i = 0; i < c; ++i) {
          if (to_hf) {
            hf[i * 3 * c + col] = meg[row * c + i];
          } else {
            hf[row * c + i] = meg[i * 3 * c + col];  // here `meg` is HF's, `hf` Megatron's
          }
        }
      }
}
void MapQkvBias(const float* meg, float* hf, int64_t c, int64_t heads, int64_t hd, bool to_hf) {
  for (int64_t n = 0; n < heads; ++n)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t d = 0; d < hd; ++d) {
        const int64_t row = (n * 3 + w) * hd + d, col = w * c + n * hd + d;
        if (to_hf) {
          hf[col] = meg[row];
        } else {
          hf[row] = meg[col];
        }
      }
}
// (rows, cols) -> (cols, rows).
void Transpose(const float* in, float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) out[k * rows + r] = in[r * cols + k];
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

std::vector<HfTensor> HfTensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size;
  std::vector<HfTensor> t;
  t.push_back({"wte.weight", {c.vocab_size, h}, {}});
  t.push_back({"wpe.weight", {c.max_position_embeddings, h}, {}});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("h.{}.", l);
    t.push_back({p + "ln_1.weight", {h}, {}});
    t.push_back({p + "ln_1.bias", {h}, {}});
    t.push_back({p + "attn.c_attn.weight", {h, 3 * h}, {}});
    t.push_back({p + "attn.c_attn.bias", {3 * h}, {}});
    t.push_back({p + "attn.c_proj.weight", {h, h}, {}});
    t.push_back({p + "attn.c_proj.bias", {h}, {}});
    t.push_back({p + "ln_2.weight", {h}, {}});
    t.push_back({p + "ln_2.bias", {h}, {}});
    t.push_back({p + "mlp.c_fc.weight", {h, f}, {}});
    t.push_back({p + "mlp.c_fc.bias", {f}, {}});
    t.push_back({p + "mlp.c_proj.weight", {f, h}, {}});
    t.push_back({p + "mlp.c_proj.bias", {h}, {}});
  }
  t.push_back({"ln_f.weight", {h}, {}});
  t.push_back({"ln_f.bias", {h}, {}});
  if (c.untie_embeddings_and_output_weights) t.push_back({kLmHead, {c.vocab_size, h}, {}});
  return t;
}

void MapParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size, heads = c.num_attention_heads, hd = c.head_dim();
  float* P = params->data();
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) {
    if (to_hf) t.data.assign(static_cast<size_t>(Elements(t.shape)), 0.0f);
    by_name[t.name] = &t;
  }
  auto copy = [&](const std::string& name, int64_t offset) {
    HfTensor* t = by_name.at(name);
    if (to_hf) {
      std::copy(P + offset, P + offset + static_cast<int64_t>(t->data.size()), t->data.begin());
    } else {
      std::copy(t->data.begin(), t->data.end(), P + offset);
    }
  };
  auto transposed = [&](const std::string& name, int64_t offset, int64_t meg_rows, int64_t meg_cols) {
    HfTensor* t = by_name.at(name);
    if (to_hf) {
      Transpose(P + offset, t->data.data(), meg_rows, meg_cols);
    } else {
      Transpose(t->data.data(), P + offset, meg_cols, meg_rows);
    }
  };
  auto vocab = [&](const std::string& name, int64_t offset) {
    copy(name, offset);  // the first vocab_size rows
    if (!to_hf)
      for (int64_t r = c.vocab_size; r < c.padded_vocab_size; ++r)
        std::copy(P + offset + (c.vocab_size - 1) * h, P + offset + c.vocab_size * h, P + offset + r * h);
  };
  vocab("wte.weight", layout.wte);
  copy("wpe.weight", layout.wpe);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("h.{}.", l);
    copy(p + "ln_1.weight", lp.ln1_w);
    copy(p + "ln_1.bias", lp.ln1_b);
    HfTensor* qkv_w = by_name.at(p + "attn.c_attn.weight");
    HfTensor* qkv_b = by_name.at(p + "attn.c_attn.bias");
    if (to_hf) {
      MapQkvWeight(P + lp.qkv_w, qkv_w->data.data(), h, heads, hd, true);
      MapQkvBias(P + lp.qkv_b, qkv_b->data.data(), h, heads, hd, true);
    } else {
      MapQkvWeight(qkv_w->data.data(), P + lp.qkv_w, h, heads, hd, false);
      MapQkvBias(qkv_b->data.data(), P + lp.qkv_b, h, heads, hd, false);
    }
    transposed(p + "attn.c_proj.weight", lp.proj_w, h, h);
    copy(p + "attn.c_proj.bias", lp.proj_b);
    copy(p + "ln_2.weight", lp.ln2_w);
    copy(p + "ln_2.bias", lp.ln2_b);
    transposed(p + "mlp.c_fc.weight", lp.fc1_w, f, h);
    copy(p + "mlp.c_fc.bias", lp.fc1_b);
    transposed(p + "mlp.c_proj.weight", lp.fc2_w, h, f);
    copy(p + "mlp.c_proj.bias", lp.fc2_b);
  }
  copy("ln_f.weight", layout.lnf_w);
  copy("ln_f.bias", layout.lnf_b);
  if (c.untie_embeddings_and_output_weights) vocab(kLmHead, layout.out_w);
}

namespace {

// The tensors ReadPresentTensors reads and their bytes: `progress`'s totals.
void SetReadTotals(const std::map<std::string, PresentTensor>& present, bool untied,
                   const std::vector<HfTensor>& tensors, ProgressReporter* progress) {
  uint64_t items = 0, bytes = 0;
  auto add = [&](const std::string& name) {
    if (auto it = present.find(name); it != present.end()) {
      ++items;
      bytes += it->second.tensor->end - it->second.tensor->begin;
    }
  };
  for (const HfTensor& t : tensors) add(t.name);
  if (!untied) add(kLmHead);
  progress->SetTotals(items, bytes);
}

void Count(const SafetensorsTensor& t, ProgressReporter* progress) {
  progress->AddItems(1);
  progress->AddBytes(t.end - t.begin);
  progress->Refresh();  // on a terminal the line says each tensor as it is read
}

}  // namespace

absl::Status ReadPresentTensors(const std::string& weights_path, std::map<std::string, PresentTensor> present,
                                bool untied, const std::string& prefix, const std::string& model,
                                std::vector<HfTensor>* tensors, ProgressReporter* progress) {
  auto shown = [&](const std::string& name) { return name == kLmHead ? name : prefix + name; };
  auto refuse = [&](const std::string& file, const std::string& tensor, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: tensor {}: {}", file, tensor, why));
  };
  ProgressReporter quiet({.label = "convert", .enabled = false});
  if (progress == nullptr) progress = &quiet;
  SetReadTotals(present, untied, *tensors, progress);
  for (HfTensor& t : *tensors) {
    auto it = present.find(t.name);
    if (it == present.end())
      return refuse(weights_path, shown(t.name),
                    fmt::format("missing (config.json asks for shape {})", Shape(t.shape)));
    const auto& [file, found] = it->second;
    if (found->shape != t.shape)
      return refuse(file->path(), shown(t.name),
                    fmt::format("shape {}, config.json asks for {}", Shape(found->shape), Shape(t.shape)));
    PTK_ASSIGN_OR_RETURN(t.data, file->ReadFloat(*found));
    for (float x : t.data)
      if (!std::isfinite(x)) return refuse(file->path(), shown(t.name), "holds a NaN or an infinity");
    Count(*found, progress);
    present.erase(it);
  }
  if (!untied && present.count(kLmHead)) {
    // A tied model's file may carry the output layer too: it must be the embedding.
    const auto [file, head] = present.at(kLmHead);
    PTK_ASSIGN_OR_RETURN(std::vector<float> lm, file->ReadFloat(*head));
    Count(*head, progress);
    if (head->shape != (*tensors)[0].shape || lm != (*tensors)[0].data)
      return refuse(
          file->path(), kLmHead,
          fmt::format("differs from {}, but config.json ties them (tie_word_embeddings)", shown((*tensors)[0].name)));
    present.erase(kLmHead);
  }
  if (!present.empty()) {
    const auto [file, extra] = present.begin()->second;
    return refuse(file->path(), extra->name,
                  fmt::format("not a weight of the {} model config.json describes ({} such tensor{})", model,
                              present.size(), present.size() > 1 ? "s" : ""));
  }
  return absl::OkStatus();
}

}  // namespace ptk::hf_detail
