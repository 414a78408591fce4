// What the ptk-convert tests share (hf_convert_test.cpp, hf_llama_convert_test.cpp, hf_shards_test.cpp,
// convert_progress_test.cpp): a ptk checkpoint of a small model with distinct weights, as ptk-train
// saves it; ConvertOptions for a direction; a tensor of an exported directory.
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

  TempDir dir_;
  ParamLayout layout_;
  std::vector<float> params_;
};

}  // namespace ptk::testing
