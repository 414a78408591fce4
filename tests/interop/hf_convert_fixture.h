// What the ptk-convert tests share (hf_convert_test.cpp, hf_llama_convert_test.cpp, hf_shards_test.cpp,
// convert_progress_test.cpp, the MoE lines' hf_*_convert_test.cpp): a ptk checkpoint of a small model with distinct
// weights, as ptk-train saves it; ConvertOptions for a direction; a tensor of an exported directory; a round trip's
// weights and files compared; an exported directory's weights rewritten damaged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "interop/hf_gpt2.h"
#include "interop/safetensors.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"

namespace ptk::testing {

// The MoE lines' small model (hf_mixtral, hf_qwen2_moe and hf_qwen3_moe_convert_test): `layers` layers of hidden 8,
// 2 heads in 1 query group, dense MLPs of width 12, 16 positions, a vocabulary of 20 padded to 24; the Llama line's
// RMSNorm, RoPE and SwiGLU without linear biases, untied output weights; four experts of width 6, top 2, aux loss 0.01.
inline GPTConfig SmallMoeLlama(int64_t layers) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.num_query_groups = 1;
  c.ffn_hidden_size = 12;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = 20;
  c.padded_vocab_size = 24;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 6;
  c.moe_aux_loss_coeff = 0.01;
  return c;
}

// A change to a model, and a part of the reason an export's check gives for refusing it.
struct ExportRefusal {
  void (*change)(GPTConfig*);
  const char* reason;
};
// Each of `cases` applied to `base` and given to `check` (an HF line's Check*Exportable) for the file
// dir/model_optim_rng.ptk: refused (kFailedPrecondition) in a message that starts with `prefix` and holds the
// case's reason; with `one_line`, in one line.
inline void ExpectExportRefusals(const GPTConfig& base, absl::Status (*check)(const GPTConfig&, const std::string&),
                                 const std::string& prefix, const std::vector<ExportRefusal>& cases, bool one_line) {
  for (const ExportRefusal& k : cases) {
    GPTConfig c = base;
    k.change(&c);
    const absl::Status st = check(c, "dir/model_optim_rng.ptk");
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << k.reason;
    const std::string msg(st.message());
    EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
    EXPECT_NE(msg.find(k.reason), std::string::npos) << msg;
    if (one_line) {
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

class HfConvertFixture : public ::testing::Test {
 protected:
  // A checkpoint of `c` at `iteration` recording `settings`, its weights Megatron's init plus a
  // ramp (no runs of 0 or 1 a wrong mapping could hide in), the moments zero; layout_ and params_ set.
  void SaveModel(const GPTConfig& c, const std::string& dir, int64_t iteration,
                 std::vector<std::pair<std::string, std::string>> settings) {
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    params_.resize(static_cast<size_t>(layout_.num_params));
    layout_.InitWeights(5, params_);
    for (size_t i = 0; i < params_.size(); ++i) params_[i] += 1e-3f * static_cast<float>(i % 97);
    std::vector<float> zeros(params_.size(), 0.0f);
    TrainState st;
    st.iteration = iteration;
    st.settings = std::move(settings);
    ASSERT_TRUE(SaveCheckpoint(dir, layout_, params_, zeros, zeros, st, "[]").ok());
  }
  // A 2-layer, hidden-8 model with GPT-2's vocabulary (50257 padded to 50304) and untied output weights, saved at
  // iteration 3 in `dir` (hf_shards_test, convert_progress_test).
  void SaveSmallUntiedGpt2(const std::string& dir) {
    GPTConfig c;
    c.num_layers = 2;
    c.hidden_size = 8;
    c.num_attention_heads = 2;
    c.ffn_hidden_size = 24;
    c.seq_length = 16;
    c.max_position_embeddings = 16;
    c.vocab_size = 50257;
    c.padded_vocab_size = 50304;
    c.untie_embeddings_and_output_weights = true;
    SaveModel(c, dir, 3, {{"--vocab-size", "50257"}});
  }
  ConvertOptions Opts(const std::string& loader, const std::string& saver, const std::string& from,
                      const std::string& to) {
    return testing::ConvertOpts(loader, saver, from, to);
  }
  // Tensor `name` of an exported directory.
  std::vector<float> Tensor(const std::string& dir, const std::string& name, std::vector<int64_t>* shape = nullptr) {
    auto f = SafetensorsFile::Open(dir + "/model.safetensors");
    EXPECT_TRUE(f.ok()) << f.status();
    const SafetensorsTensor* t = (*f)->Find(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    if (shape) *shape = t->shape;
    return *(*f)->ReadFloat(*t);
  }
  float P(int64_t offset) const { return params_[static_cast<size_t>(offset)]; }
  // config.json's text with `from` replaced by `to` (the first one), `from` required to be there.
  static std::string Edited(const std::string& config, const std::string& from, const std::string& to) {
    EXPECT_NE(config.find(from), std::string::npos) << from;
    std::string out = config;
    if (size_t at = out.find(from); at != std::string::npos) out.replace(at, from.size(), to);
    return out;
  }
  struct ConfigEdit {
    std::string from, to, why;
  };
  // Each edit of the HF directory `hf`'s config.json (whose text is `config`) imported into a fresh directory
  // (dir_/outN): refused in one line that starts with config.json's path and holds the edit's `why`, nothing written.
  // config.json is left holding the last edit.
  void ExpectConfigEditsRefused(const std::string& hf, const std::string& config, const std::vector<ConfigEdit>& bad) {
    int n = 0;
    for (const ConfigEdit& k : bad) {
      WriteFile(hf + "/config.json", Edited(config, k.from, k.to));
      const std::string out = dir_ / ("out" + std::to_string(n++));
      auto r = ImportFromHf(Opts("hf", "ptk", hf, out));
      ASSERT_FALSE(r.ok()) << k.to;
      const std::string msg(r.status().message());
      EXPECT_NE(msg.find(k.why), std::string::npos) << msg;
      EXPECT_EQ(msg.rfind(hf + "/config.json", 0), 0u) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      EXPECT_FALSE(std::filesystem::exists(out + "/iter_0000000")) << k.to;
    }
  }

  // The round trip of the checkpoint saved last (params_, GPT-2's vocabulary of 50257 padded to 50304) named by
  // `tag`: exported to dir_/hf<tag>, imported back into dir_/back<tag> whose weights are `back`. Every weight bit for
  // bit but the padded vocabulary rows (dropped by the export, copies of the last row): the embedding's, and the
  // output layer's when `untie`; and dir_/back<tag> exported again (dir_/hf2<tag>) gives the same files, byte for byte.
  void ExpectRoundTripBitForBit(const std::vector<float>& back, int64_t hidden, bool untie, const std::string& tag) {
    ASSERT_EQ(back.size(), params_.size());
    const int64_t h = hidden;
    int64_t differ = 0;
    for (int64_t i = 0; i < layout_.num_params; ++i) {
      const bool padded = (i >= layout_.wte + 50257 * h && i < layout_.wte + 50304 * h) ||
                          (untie && i >= layout_.out_w + 50257 * h && i < layout_.out_w + 50304 * h);
      if (!padded && back[static_cast<size_t>(i)] != P(i)) ++differ;
    }
    EXPECT_EQ(differ, 0) << tag;
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("back" + tag), dir_ / ("hf2" + tag))).ok());
    for (const char* f : {"model.safetensors", "config.json"})
      EXPECT_EQ(ReadFile(dir_ / ("hf" + tag + "/" + f)), ReadFile(dir_ / ("hf2" + tag + "/" + f))) << tag << " " << f;
  }
  // The tensors of a model.safetensors, read whole, to be written back damaged: `entries` point into `values`.
  struct HfTensors {
    std::vector<std::vector<float>> values;
    std::vector<SafetensorsEntry> entries;
  };
  static void ReadTensors(const std::string& file, HfTensors* out) {
    auto f = SafetensorsFile::Open(file);
    ASSERT_TRUE(f.ok());
    out->values.reserve((*f)->tensors().size());
    for (const SafetensorsTensor& t : (*f)->tensors()) {
      out->values.push_back(*(*f)->ReadFloat(t));
      out->entries.push_back({t.name, t.shape, out->values.back()});
    }
  }
  // `entries` but the one named `name`.
  static std::vector<SafetensorsEntry> Without(const std::vector<SafetensorsEntry>& entries, const std::string& name) {
    std::vector<SafetensorsEntry> out;
    for (const SafetensorsEntry& e : entries)
      if (e.name != name) out.push_back(e);
    return out;
  }
  // The HF directory `hf` (its model.safetensors now `entries`) imported into dir_/`out`: refused, the message holding
  // `want`.
  void ExpectImportRefused(const std::string& hf, const std::vector<SafetensorsEntry>& entries, const std::string& out,
                           const std::string& want) {
    ASSERT_TRUE(WriteSafetensors(hf + "/model.safetensors", entries, {{"format", "pt"}}).ok());
    auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / out));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status();
  }

  TempDir dir_;
  ParamLayout layout_;
  std::vector<float> params_;
};

}  // namespace ptk::testing
