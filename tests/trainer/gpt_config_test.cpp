// GPTConfig::Validate refuses a model it cannot build, naming each setting as GPTConfig (and
// Megatron's arguments) name it: a library knows no flags (ptk-train maps the names to its flags).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/trainer/small_gpt.h"
#include "trainer/param_layout.h"
#include "trainer/training.h"

namespace ptk {
namespace {

GPTConfig Small() { return testing::SmallGpt(2, 64, 4, 32, 97, 128); }

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

TEST(GPTConfig, LlamaLineRefusalsNameTheSetting) {
  GPTConfig c = Small();
  c.num_query_groups = 3;
  EXPECT_EQ(Refusal(c), "num_query_groups 3 does not divide num_attention_heads 4");
  c = Small();
  c.position_embedding = PositionEmbedding::kRope;
  c.kv_channels = 3;
  EXPECT_EQ(Refusal(c), "rotary_percent 1 of head dimension 3 rotates 3 channels: must be an even number, at least 2");
  c.kv_channels = 8;
  c.rotary_percent = 1.5;
  EXPECT_EQ(Refusal(c), "rotary_percent 1.5: must be in (0, 1]");
  c.rotary_percent = 1;
  c.rotary_base = 0;
  EXPECT_EQ(Refusal(c), "rotary_base 0: must be positive");
  c.rotary_base = 10000;
  c.rope_scaling_factor = 0;
  EXPECT_EQ(Refusal(c), "rope_scaling_factor 0: must be positive");
  c.rope_scaling_factor = -8;
  EXPECT_EQ(Refusal(c), "rope_scaling_factor -8: must be positive");
  c.rope_scaling_factor = 32;
  c.rotary_seq_len_interpolation_factor = -2;
  EXPECT_EQ(Refusal(c), "rotary_seq_len_interpolation_factor -2: must be positive (0: none)");
  c.rotary_seq_len_interpolation_factor = std::nan("");
  EXPECT_EQ(Refusal(c), "rotary_seq_len_interpolation_factor nan: must be positive (0: none)");
  c.rotary_seq_len_interpolation_factor = 4;
  c.rotary_interleaved = true;
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  c = Small();
  c.num_attention_heads = 5;  // a head dimension of its own: hidden_size need not divide
  c.kv_channels = 16;
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
}

// Tensor rank t of T holds whole query groups (their rows of linear_qkv are one block in
// Megatron's order) and, of SwiGLU's fc1, its gate rows and the matching up rows.
TEST(ParamLayout, TensorRanksHoldWholeQueryGroupsAndMatchingGateUpRows) {
  GPTConfig c = Small();
  c.num_query_groups = 2;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->Find("decoder.layers.0.self_attention.linear_qkv.weight")->shape,
            (std::vector<int64_t>{(4 + 2 * 2) * 16, 64}));
  EXPECT_EQ(whole->Find("decoder.layers.0.mlp.linear_fc1.weight")->shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(whole->Find("embedding.position_embeddings.weight"), nullptr);
  EXPECT_EQ(whole->Find("decoder.layers.0.input_layernorm.bias"), nullptr);
  auto rank1 = ParamLayout::Create(c, 2, 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  const ParamInfo* qkv = rank1->Find("decoder.layers.0.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{4 * 16, 64}));  // group 1: 2 query heads, its key and value
  EXPECT_EQ(rank1->WholeIndex(*qkv, 0), 4 * 16 * 64);
  const ParamInfo* fc1 = rank1->Find("decoder.layers.0.mlp.linear_fc1.weight");
  EXPECT_EQ(fc1->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(rank1->WholeIndex(*fc1, 0), 128 * 64);         // gate rows 128..255
  EXPECT_EQ(rank1->WholeIndex(*fc1, 128 * 64), 384 * 64);  // up rows 384..511
  EXPECT_EQ(rank1->WholeIndex(*fc1, 256 * 64 - 1), 512 * 64 - 1);
  // Copies through the slices come back whole.
  std::vector<float> w(whole->num_params), back(whole->num_params, 0.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  for (int t = 0; t < 2; ++t) {
    auto r = ParamLayout::Create(c, 2, t);
    std::vector<float> mine(r->num_params);
    CopyToShard(*r, w, mine);
    CopyFromShard(*r, mine, back);
  }
  EXPECT_EQ(w, back);
  c.num_query_groups = 1;
  auto refused = ParamLayout::Create(c, 2, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status()));
  EXPECT_NE(refused.status().message().find("num_query_groups 1 is not divisible by tensor size 2"), std::string::npos);
}

// Megatron's num_floating_point_operations, by hand: GPT-3's terms, and Llama 3 8B's (grouped-query
// attention, SwiGLU's 3/2).
TEST(Flops, MegatronsFormula) {
  GPTConfig c = Small();  // h 64, 4 heads, ffn 256, s 32, V 128, 2 layers
  const double base = 12.0 * 8 * 32 * 2 * 64 * 64;
  EXPECT_DOUBLE_EQ(FlopsPerIteration(c, 8), base * ((2.0 + 32.0 / 128) + 4.0 + 128.0 / 256));
  GPTConfig l;
  l.num_layers = 32;
  l.hidden_size = 4096;
  l.num_attention_heads = 32;
  l.num_query_groups = 8;
  l.kv_channels = 128;
  l.ffn_hidden_size = 14336;
  l.swiglu = true;
  l.seq_length = 8192;
  l.padded_vocab_size = 128256;
  const double h = 4096, s = 8192;
  EXPECT_DOUBLE_EQ(
      FlopsPerIteration(l, 1),
      12.0 * s * 32 * h * h * ((1.0 + 8.0 / 32 + s / (2 * h)) * 1.0 + 14336 / h * 1.5 + 128256 / (2 * 32 * h)));
}

}  // namespace
}  // namespace ptk
