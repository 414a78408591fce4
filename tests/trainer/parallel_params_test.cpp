// The parameters of each (tensor, pipeline) rank against Megatron's own logs (the EKS tutorial at
// T=8, Hugging Face accelerate's gpt2-large at T=2 × P=2), against ptk's whole model at T=1, P=1,
// and hand-derived splits; the layers of each pipeline stage and Megatron's refusals.
#include "trainer/parallel_params.h"

#include <gtest/gtest.h>

#include "common/status.h"
#include "trainer/parallel_layout.h"

namespace ptk {
namespace {

GPTConfig Gpt(int64_t layers, int64_t hidden, int64_t heads, int64_t positions, int64_t vocab, int64_t divisible_by,
              int tensor) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.ffn_hidden_size = 4 * hidden;
  c.seq_length = positions;
  c.max_position_embeddings = positions;
  c.vocab_size = vocab;
  c.padded_vocab_size = *TensorParallelVocabSize(vocab, divisible_by, tensor);
  return c;
}

// awsome-distributed-training's EKS Megatron-LM tutorial (36 layers, hidden 4096, 32 heads,
// sequence 2048, TENSOR_PARALLEL=8) logs
// "> number of parameters on (tensor, pipeline) model parallel rank (4, 0): 941594624".
TEST(ParamsOnModelParallelRank, MatchesTheEksTutorialsMegatronLog) {
  const GPTConfig c = Gpt(36, 4096, 32, 2048, 50257, 128, 8);
  EXPECT_EQ(c.padded_vocab_size, 51200);
  for (int t = 0; t < 8; ++t) EXPECT_EQ(ParamsOnModelParallelRank(c, 8, 1, 0, 36), 941594624);
  EXPECT_EQ(ParamCountLine(4, 0, 941594624),
            " > number of parameters on (tensor, pipeline) model parallel rank (4, 0): 941594624");
}

// Hugging Face accelerate's Megatron-LM guide: gpt2-large (36 layers, hidden 1280, 20 heads, 1024
// positions) at tensor 2 × pipeline 2 logs 210753280 on stage 0 and 209445120 on stage 1 (the
// last stage's own copy of the tied word embeddings, the final LayerNorm, no position embeddings).
TEST(ParamsOnModelParallelRank, MatchesAcceleratesGpt2LargeLogAtTwoStages) {
  const GPTConfig c = Gpt(36, 1280, 20, 1024, 50257, 128, 2);
  EXPECT_EQ(c.padded_vocab_size, 50432);
  auto layers = PipelineStageLayers(36, 2);
  ASSERT_TRUE(layers.ok());
  EXPECT_EQ(ParamsOnModelParallelRank(c, 2, 2, 0, (*layers)[0]), 210753280);
  EXPECT_EQ(ParamsOnModelParallelRank(c, 2, 2, 1, (*layers)[1]), 209445120);
}

// Megatron's GPT-3 175B example (96 layers, hidden 12288, 96 heads, sequence 2048) at T=8, P=16:
// six layers a stage of 12h²/8 + 3h/8 + h + 4h/8 + h + 4h = 226576896 each; the vocabulary slice
// 51200/8 × h = 78643200, positions 2048 × h = 25165824, final LayerNorm 2h.
TEST(ParamsOnModelParallelRank, TheGpt3175BExampleByHand) {
  const GPTConfig c = Gpt(96, 12288, 96, 2048, 50257, 128, 8);
  auto layers = PipelineStageLayers(96, 16);
  ASSERT_TRUE(layers.ok());
  ASSERT_EQ(layers->size(), 16u);
  EXPECT_EQ((*layers)[7], 6);
  const int64_t layer = 226576896;
  EXPECT_EQ(ParamsOnModelParallelRank(c, 8, 16, 0, 6), 6 * layer + 78643200 + 25165824);
  EXPECT_EQ(ParamsOnModelParallelRank(c, 8, 16, 0, 6), 1463270400);
  for (int p = 1; p < 15; ++p) EXPECT_EQ(ParamsOnModelParallelRank(c, 8, 16, p, 6), 6 * layer);
  EXPECT_EQ(ParamsOnModelParallelRank(c, 8, 16, 15, 6), 6 * layer + 78643200 + 2 * 12288);
}

// At T=1, P=1 a rank holds the whole model: ptk's own parameter table (Megatron-core's tensors).
TEST(ParamsOnModelParallelRank, OneRankHoldsPtksWholeModel) {
  for (bool untied : {false, true}) {
    GPTConfig c = Gpt(3, 48, 4, 40, 1000, 128, 1);
    c.ffn_hidden_size = 200;
    c.untie_embeddings_and_output_weights = untied;
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(ParamsOnModelParallelRank(c, 1, 1, 0, 3), layout->num_params) << "untied " << untied;
  }
}

// Tensor ranks hold equal slices of every split tensor and a whole copy of the rest: T copies of a
// rank's count less the replicated parameters counted T-1 times too many is the whole model.
TEST(ParamsOnModelParallelRank, TensorSlicesAddUpToTheWholeModel) {
  for (int t : {2, 4, 8}) {
    GPTConfig c = Gpt(4, 64, 8, 32, 1000, 8, t);                         // the vocabulary padded to a multiple of 8·t
    const int64_t h = 64, replicated_per_layer = 2 * h + h + 2 * h + h;  // LayerNorms, proj and fc2 biases
    const int64_t replicated = 4 * replicated_per_layer + 32 * h + 2 * h;  // + positions, final LayerNorm
    GPTConfig whole = c;                                                   // the same padded vocabulary on one rank
    auto layout = ParamLayout::Create(whole);
    ASSERT_TRUE(layout.ok());
    EXPECT_EQ(t * ParamsOnModelParallelRank(c, t, 1, 0, 4) - (t - 1) * replicated, layout->num_params) << t;
  }
}

TEST(PipelineStageLayers, EvenOrMegatronsFirstAndLastStageCounts) {
  EXPECT_EQ(*PipelineStageLayers(12, 1), std::vector<int64_t>{12});
  EXPECT_EQ(*PipelineStageLayers(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(*PipelineStageLayers(10, 4, 1, 3), (std::vector<int64_t>{1, 3, 3, 3}));
  EXPECT_EQ(*PipelineStageLayers(10, 4, 4), (std::vector<int64_t>{4, 2, 2, 2}));
  EXPECT_EQ(*PipelineStageLayers(10, 4, std::nullopt, 1), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(*PipelineStageLayers(5, 2, 2, 3), (std::vector<int64_t>{2, 3}));
  auto s = PipelineStageLayers(10, 4).status();
  EXPECT_TRUE(IsUsageError(s));
  EXPECT_NE(StatusMessage(s).find("--num-layers 10 is not divisible by --pipeline-model-parallel-size 4"),
            std::string_view::npos)
      << s;
  s = PipelineStageLayers(10, 4, 2).status();  // 8 layers for 3 middle stages
  EXPECT_NE(StatusMessage(s).find("not divisible by the 3 middle pipeline stages"), std::string_view::npos) << s;
  s = PipelineStageLayers(4, 2, 4).status();  // no layer left for the last stage
  EXPECT_NE(StatusMessage(s).find("leaves 0 middle layers for 1 middle pipeline stages"), std::string_view::npos) << s;
  EXPECT_TRUE(IsUsageError(PipelineStageLayers(4, 2, 0).status()));
  EXPECT_TRUE(IsUsageError(PipelineStageLayers(4, 2, 5).status()));
  EXPECT_TRUE(IsUsageError(PipelineStageLayers(4, 1, 2).status()));
  EXPECT_TRUE(IsUsageError(PipelineStageLayers(4, 0).status()));
}

// Megatron's Llama 3 8B flags (32 layers, hidden 4096, 32 heads in 8 query groups of 128 channels,
// SwiGLU's ffn 14336, RMSNorm, RoPE, no biases, untied, vocabulary 128256: a multiple of 128, so
// Megatron pads nothing). By hand per layer: 2 RMSNorms 2h, QKV (32 + 2·8)·128·h, projection h·h,
// fc1 2·14336·h, fc2 14336·h = 218112000; embedding and output layer 128256·h each, final norm h:
// 8030261248, the count of Hugging Face's Meta-Llama-3-8B.
GPTConfig Llama3_8B(int tensor) {
  GPTConfig c = Gpt(32, 4096, 32, 8192, 128256, 128, tensor);
  c.ffn_hidden_size = 14336;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.rotary_base = 500000;
  c.swiglu = true;
  c.num_query_groups = 8;
  c.kv_channels = 128;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

TEST(ParamsOnModelParallelRank, Llama3_8BByHand) {
  const GPTConfig c = Llama3_8B(1);
  EXPECT_EQ(c.padded_vocab_size, 128256);
  const int64_t h = 4096, layer = 2 * h + 48 * 128 * h + h * h + 2 * 14336 * h + 14336 * h;
  EXPECT_EQ(layer, 218112000);
  EXPECT_EQ(ParamsOnModelParallelRank(c, 1, 1, 0, 32), 32 * layer + 2 * 128256 * h + h);
  EXPECT_EQ(ParamsOnModelParallelRank(c, 1, 1, 0, 32), 8030261248);
  // T=8, P=4: each rank a slice of every split tensor (its query group), the RMSNorms whole.
  // (The vocabulary padded to a multiple of 128·8: 129024.)
  const GPTConfig t8 = Llama3_8B(8);
  EXPECT_EQ(t8.padded_vocab_size, 129024);
  const int64_t layer8 = 2 * h + 6 * 128 * h + h * h / 8 + 2 * 1792 * h + 1792 * h;
  EXPECT_EQ(ParamsOnModelParallelRank(t8, 8, 4, 0, 8), 8 * layer8 + 129024 / 8 * h);
  EXPECT_EQ(ParamsOnModelParallelRank(t8, 8, 4, 1, 8), 8 * layer8);
  EXPECT_EQ(ParamsOnModelParallelRank(t8, 8, 4, 3, 8), 8 * layer8 + 129024 / 8 * h + h);
}

// The Llama line's shapes at T=1: ptk's own parameter table, for each flag alone and together.
TEST(ParamsOnModelParallelRank, OneRankHoldsPtksWholeLlamaLineModel) {
  for (int variant = 0; variant < 7; ++variant) {
    GPTConfig c = Gpt(3, 48, 4, 40, 1000, 128, 1);
    c.ffn_hidden_size = 200;
    if (variant == 0 || variant == 6) c.normalization = Normalization::kRMSNorm;
    if (variant == 1 || variant == 6) c.position_embedding = PositionEmbedding::kRope;
    if (variant == 2) c.position_embedding = PositionEmbedding::kNone;
    if (variant == 3 || variant == 6) c.swiglu = true;
    if (variant == 4 || variant == 6) c.num_query_groups = 2, c.kv_channels = 16;
    if (variant == 5 || variant == 6) c.add_bias_linear = false, c.add_qkv_bias = variant == 5;
    c.untie_embeddings_and_output_weights = variant % 2 == 0;
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(ParamsOnModelParallelRank(c, 1, 1, 0, 3), layout->num_params) << "variant " << variant;
  }
}

// --qk-layernorm: a query and a key norm of --kv-channels per layer (weight and bias under
// LayerNorm, weight under RMSNorm), whole on every tensor rank: ptk's own table on each rank.
TEST(ParamsOnModelParallelRank, QKLayerNormsAreCountedWholeOnEveryTensorRank) {
  for (bool rms : {false, true}) {
    GPTConfig c = Gpt(3, 48, 4, 40, 1000, 128, 4);
    c.ffn_hidden_size = 200;
    c.qk_layernorm = true;
    c.num_query_groups = 4, c.kv_channels = 16;
    if (rms) c.normalization = Normalization::kRMSNorm, c.position_embedding = PositionEmbedding::kRope;
    GPTConfig plain = c;
    plain.qk_layernorm = false;
    EXPECT_EQ(ParamsOnModelParallelRank(c, 1, 1, 0, 3) - ParamsOnModelParallelRank(plain, 1, 1, 0, 3),
              3 * 2 * 16 * (rms ? 1 : 2));
    for (int t : {1, 2, 4}) {
      auto layout = ParamLayout::Create(c, t, t - 1);
      ASSERT_TRUE(layout.ok()) << layout.status();
      EXPECT_EQ(ParamsOnModelParallelRank(c, t, 1, 0, 3), layout->num_params) << "T " << t << " rms " << rms;
    }
  }
}

// Multi-latent attention's tensor ranks: the up projections (linear_q_proj without a q LoRA) split by heads, the down
// projections and the latents' norms whole on every rank.
TEST(ParamsOnModelParallelRank, MlaUpProjectionsAreSplitAndDownProjectionsWhole) {
  for (int64_t q_lora : {0, 16}) {
    GPTConfig c = Gpt(3, 48, 4, 40, 1000, 128, 4);
    c.ffn_hidden_size = 200;
    c.multi_latent_attention = true, c.qk_layernorm = true, c.mla_yarn = false;
    c.q_lora_rank = q_lora, c.kv_lora_rank = 12, c.qk_head_dim = 8, c.qk_pos_emb_head_dim = 4, c.v_head_dim = 6;
    for (int t : {1, 2, 4}) {
      auto layout = ParamLayout::Create(c, t, t - 1);
      ASSERT_TRUE(layout.ok()) << layout.status();
      EXPECT_EQ(ParamsOnModelParallelRank(c, t, 1, 0, 3), layout->num_params) << "T " << t << " q_lora " << q_lora;
      const int64_t up = (q_lora ? 4 * 12 * 16 : 4 * 12 * 48) + 4 * 14 * 12;  // heads x widths x inputs
      EXPECT_EQ(MlaProjectionParams(c, 1) - MlaProjectionParams(c, t), up - up / t) << "T " << t;
    }
  }
}

TEST(CheckTensorSplit, RefusesHeadsOrMlpThatDoNotDivide) {
  GPTConfig c = Gpt(2, 96, 12, 16, 100, 1, 1);
  EXPECT_TRUE(CheckTensorSplit(c, 4).ok());
  auto s = CheckTensorSplit(c, 8);
  EXPECT_TRUE(IsUsageError(s));
  EXPECT_EQ(StatusMessage(s),
            "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8 (each tensor rank takes "
            "whole heads)");
  c.ffn_hidden_size = 386;
  EXPECT_NE(StatusMessage(CheckTensorSplit(c, 4)).find("--ffn-hidden-size 386"), std::string_view::npos);
  c.ffn_hidden_size = 384;
  c.num_query_groups = 2;
  EXPECT_EQ(StatusMessage(CheckTensorSplit(c, 4)),
            "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4 (each tensor rank takes whole "
            "query groups)");
}

}  // namespace
}  // namespace ptk
