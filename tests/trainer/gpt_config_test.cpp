// GPTConfig::Validate refuses a model it cannot build, naming each setting as GPTConfig (and
// Megatron's arguments) name it: a library knows no flags (ptk-train maps the names to its flags).
#include <gtest/gtest.h>

#include <string>

#include "trainer/param_layout.h"

namespace ptk {
namespace {

GPTConfig Small() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 256;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 97;
  c.padded_vocab_size = 128;
  return c;
}

std::string Refusal(const GPTConfig& c) {
  const absl::Status st = c.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  return std::string(st.message());
}

TEST(GPTConfig, RefusalsNameTheSettingNotAFlag) {
  ASSERT_TRUE(Small().Validate().ok());
  GPTConfig c = Small();
  c.num_attention_heads = 5;
  EXPECT_EQ(Refusal(c), "num_attention_heads 5 does not divide hidden_size 64");
  c = Small();
  c.num_attention_heads = 0;
  EXPECT_EQ(Refusal(c), "num_attention_heads 0: must be at least 1");
  c = Small();
  c.num_layers = 0;
  EXPECT_EQ(Refusal(c), "num_layers 0: must be at least 1");
  c = Small();
  c.max_position_embeddings = 16;
  EXPECT_EQ(Refusal(c), "max_position_embeddings 16 is less than seq_length 32");
  c = Small();
  c.padded_vocab_size = 96;
  EXPECT_EQ(Refusal(c), "padded_vocab_size 96 is less than vocab_size 97");
  c = Small();
  c.hidden_dropout = 1;
  EXPECT_EQ(Refusal(c), "hidden_dropout 1: must be in [0, 1)");
  c = Small();
  c.layernorm_epsilon = 0;
  EXPECT_EQ(Refusal(c), "layernorm_epsilon 0: must be in (0, 1]");
  c = Small();
  c.init_method_std = 2;
  EXPECT_EQ(Refusal(c), "init_method_std 2: must be in (0, 1]");
  // No refusal words a flag.
  for (auto set : {+[](GPTConfig& g) { g.hidden_size = 0; }, +[](GPTConfig& g) { g.ffn_hidden_size = 0; },
                   +[](GPTConfig& g) { g.seq_length = 0; }, +[](GPTConfig& g) { g.vocab_size = 0; },
                   +[](GPTConfig& g) { g.attention_dropout = -0.5; }}) {
    c = Small();
    set(c);
    EXPECT_EQ(Refusal(c).find("--"), std::string::npos) << c.Validate();
  }
}

}  // namespace
}  // namespace ptk
