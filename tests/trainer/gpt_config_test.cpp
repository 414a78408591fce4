// GPTConfig::Validate refuses a model it cannot build, naming each setting as GPTConfig (and
// Megatron's arguments) name it: a library knows no flags (ptk-train maps the names to its flags).
#include <gtest/gtest.h>

#include <algorithm>
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

// Megatron's --embedding-init-method-std (megatron-core's embedding_init_method): the word and position embeddings
// drawn as --init-method-std of that value would draw them (the same counter keys), every other tensor, the untied
// output layer too, as without it; under --init-method-xavier-uniform a value equal to --init-method-std keeps them
// uniform, another draws them from its normal; a tensor rank's slice holds the whole model's init.
std::vector<float> Init(const GPTConfig& c, int tensor_size = 1, int tensor_rank = 0) {
  auto layout = ParamLayout::Create(c, tensor_size, tensor_rank);
  EXPECT_TRUE(layout.ok()) << layout.status();
  std::vector<float> w(static_cast<size_t>(layout->num_params));
  layout->InitWeights(1234, w);
  return w;
}

// `a`'s and `b`'s elements of tensor `name` (of `c`'s whole layout) are the same bits.
bool SameTensor(const GPTConfig& c, const std::string& name, const std::vector<float>& a, const std::vector<float>& b) {
  const absl::StatusOr<ParamLayout> layout = ParamLayout::Create(c);
  const ParamInfo* p = layout->Find(name);
  EXPECT_NE(p, nullptr) << name;
  if (p == nullptr) return false;
  return std::equal(a.begin() + p->offset, a.begin() + p->offset + p->size, b.begin() + p->offset);
}

TEST(ParamLayout, EmbeddingInitMethodStdDrawsTheEmbeddingsOnly) {
  GPTConfig c = Small();
  c.untie_embeddings_and_output_weights = true;
  GPTConfig emb = c, all = c;
  emb.embedding_init_method_std = 0.5;
  all.init_method_std = 0.5;
  const std::vector<float> plain = Init(c), with = Init(emb), wide = Init(all);
  const std::vector<std::string> embeddings = {"embedding.word_embeddings.weight",
                                               "embedding.position_embeddings.weight"};
  for (const std::string& name : embeddings) {
    EXPECT_TRUE(SameTensor(c, name, with, wide)) << name;
    EXPECT_FALSE(SameTensor(c, name, with, plain)) << name;
  }
  const absl::StatusOr<ParamLayout> layout = ParamLayout::Create(c);
  for (const ParamInfo& p : layout->infos) {
    if (std::find(embeddings.begin(), embeddings.end(), p.name) == embeddings.end()) {
      EXPECT_TRUE(SameTensor(c, p.name, with, plain)) << p.name;
    }
  }
  GPTConfig same = c;  // Megatron's default (None) is --init-method-std's value: given, the same bits
  same.embedding_init_method_std = c.init_method_std;
  EXPECT_EQ(Init(same), plain);
  // Every tensor rank's slice is the whole model's init.
  std::vector<float> back(with.size(), 0.0f);
  for (int t = 0; t < 2; ++t) CopyFromShard(*ParamLayout::Create(emb, 2, t), Init(emb, 2, t), back);
  EXPECT_EQ(back, with);
}

TEST(ParamLayout, EmbeddingInitMethodStdUnderXavierUniform) {
  GPTConfig x = Small();
  x.init_method_xavier_uniform = true;
  const std::vector<float> uniform = Init(x);
  GPTConfig same = x;  // the init std's value: megatron-core keeps init_method (xavier) for the embeddings
  same.embedding_init_method_std = x.init_method_std;
  EXPECT_EQ(Init(same), uniform);
  GPTConfig other = x, normal = Small();  // another value: the embeddings from N(0, 0.5), the rest uniform
  other.embedding_init_method_std = 0.5;
  normal.embedding_init_method_std = 0.5;
  const std::vector<float> mixed = Init(other), drawn = Init(normal);
  EXPECT_TRUE(SameTensor(x, "embedding.word_embeddings.weight", mixed, drawn));
  EXPECT_TRUE(SameTensor(x, "embedding.position_embeddings.weight", mixed, drawn));
  EXPECT_TRUE(SameTensor(x, "decoder.layers.0.self_attention.linear_qkv.weight", mixed, uniform));
  EXPECT_FALSE(SameTensor(x, "embedding.word_embeddings.weight", mixed, uniform));
}

TEST(GPTConfig, EmbeddingInitMethodStdRange) {
  GPTConfig c = Small();
  c.embedding_init_method_std = 2;
  EXPECT_EQ(Refusal(c), "embedding_init_method_std 2: must be in (0, 1] (0: init_method_std's)");
  c.embedding_init_method_std = -0.1;
  EXPECT_EQ(Refusal(c), "embedding_init_method_std -0.1: must be in (0, 1] (0: init_method_std's)");
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
