// What the ptk-convert tests share (hf_convert_test.cpp, hf_llama_convert_test.cpp, hf_shards_test.cpp,
// convert_progress_test.cpp): a ptk checkpoint of a small model with distinct weights, as ptk-train
// saves it; ConvertOptions for a direction; a tensor of an exported directory.
#pragma once

#include <cstdint>
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

  TempDir dir_;
  ParamLayout layout_;
  std::vector<float> params_;
};

}  // namespace ptk::testing
