// The CUDA model of Megatron's Llama line against the CPU model (gpu-labelled: exits 77 without a
// device). A small Llama-shaped model (RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU,
// 4 query heads in 2 groups, untied output layer, no biases): one step's loss and every gradient in
// fp32 (no TF32) against the CPU model, and variants that reach the other paths (hidden and attention
// dropout with RMSNorm's unfused dropout, the QKV bias alone, half the channels rotated, one query
// group, no position embeddings with LayerNorm, recomputed attention); bf16 (cuDNN's grouped-query
// attention over the heads-first copy) one step loosely and a few dozen steps learning along the
// CPU's curve. The same for Qwen3's shape (--qk-layernorm), under RMSNorm and LayerNorm (one step in
// fp16 too), and for Megatron's --squared-relu and --apply-layernorm-1p.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

// fp32: the loss within 1e-5 relative, every gradient within 1e-4 relative L2 (rounding only).
TEST(CudaLlamaModel, Fp32StepMatchesTheCpu) {
  ExpectOneStepMatches(LlamaConfig(), Precision::kFp32, 1e-5, 1e-4, "the Llama model");
}

TEST(CudaLlamaModel, Fp32VariantsMatchTheCpu) {
  {
    // Dropout (the CPU's masks: RMSNorm's dropout as its own pass), the QKV bias without the others,
    // half of each head's channels rotated, the head dimension hidden / heads.
    GPTConfig c = LlamaConfig();
    c.hidden_dropout = c.attention_dropout = 0.1;
    c.add_qkv_bias = true;
    c.rotary_percent = 0.5;
    c.kv_channels = 0;
    c.use_rope_scaling = false;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "dropout, QKV bias, rotary percent 0.5");
  }
  {
    // One query group (multi-query attention), LayerNorm with biases, no position embeddings,
    // the attention probabilities recomputed in backward, a tied output layer.
    GPTConfig c = LlamaConfig();
    c.num_query_groups = 1;
    c.normalization = Normalization::kLayerNorm;
    c.position_embedding = PositionEmbedding::kNone;
    c.add_bias_linear = true;
    c.recompute_activations = true;
    c.untie_embeddings_and_output_weights = false;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "one group, LayerNorm, no positions, recompute");
  }
  {
    // Grouped-query attention and SwiGLU in Megatron's GPT otherwise (learned positions, GELU off).
    GPTConfig c = SmallConfig(/*dropout=*/true);
    c.num_query_groups = 2;
    c.swiglu = true;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "GQA and SwiGLU with learned positions and dropout");
  }
}

// Megatron's rotary variants (the CUDA model's tables and kernel as the CPU model's): --rotary-interleaved
// with Llama 3.2's --rope-scaling-factor 32, and --rotary-seq-len-interpolation-factor 4 interleaved over
// half the channels; fp32 within the bounds above, bf16 loosely.
TEST(CudaLlamaModel, RotaryVariantsMatchTheCpu) {
  GPTConfig c = LlamaConfig();
  c.rotary_interleaved = true;
  c.rope_scaling_factor = 32;
  ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "interleaved, rope scaling factor 32");
  ExpectOneStepMatches(c, Precision::kBf16, 1e-2, 6e-2, "interleaved, rope scaling factor 32");
  c.use_rope_scaling = false;
  c.rotary_seq_len_interpolation_factor = 4;
  c.rotary_percent = 0.5;
  c.kv_channels = 0;
  ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "interleaved, interpolation 4, rotary percent 0.5");
}

// bf16: 8-bit mantissas in the products and activations; cuDNN's fused grouped-query attention.
TEST(CudaLlamaModel, Bf16StepMatchesTheCpu) {
  ExpectOneStepMatches(LlamaConfig(), Precision::kBf16, 1e-2, 6e-2, "the Llama model");
  GPTConfig one = LlamaConfig();
  one.num_query_groups = 1;
  ExpectOneStepMatches(one, Precision::kBf16, 1e-2, 6e-2, "one query group");
}

// 40 steps: fp32 within 1e-3 relative of the CPU's curve at every step, bf16 within 5e-2; both learn.
TEST(CudaLlamaModel, StepsFollowTheCpuCurveAndLearn) {
  const GPTConfig c = LlamaConfig();
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 40, 1e-3, 5e-2, "");
}

// --qk-layernorm (Qwen3's query and key norms) under RMSNorm and LayerNorm (weights and biases),
// moved off their initial values: fp32 within the bounds above, with dropout, recomputed attention
// and one query group too; bf16 loosely (its norms in fp32 from the master weights).
TEST(CudaLlamaModel, QKLayerNormStepMatchesTheCpu) {
  for (bool layernorm : {false, true}) {
    const std::string what = layernorm ? "--qk-layernorm, LayerNorm" : "--qk-layernorm, RMSNorm";
    ExpectOneStepMatches(Qwen3Config(layernorm), Precision::kFp32, 1e-5, 1e-4, what);
    GPTConfig c = Qwen3Config(layernorm);
    c.hidden_dropout = c.attention_dropout = 0.1;
    c.recompute_activations = true;
    c.num_query_groups = 1;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, what + ", dropout, recompute, one group");
    ExpectOneStepMatches(Qwen3Config(layernorm), Precision::kBf16, 1e-2, 6e-2, what);
  }
}

// --qk-layernorm in fp16 (the products and activations in half precision, the query and key norms in
// fp32 from the master weights, as in bf16), under RMSNorm and LayerNorm, with the norms moved off
// their initial values: one step within bf16's bounds (fp16 keeps 3 more mantissa bits).
TEST(CudaLlamaModel, QKLayerNormFp16StepMatchesTheCpu) {
  for (bool layernorm : {false, true})
    ExpectOneStepMatches(Qwen3Config(layernorm), Precision::kFp16, 1e-2, 6e-2,
                         layernorm ? "--qk-layernorm, LayerNorm" : "--qk-layernorm, RMSNorm");
}

// 30 steps with --qk-layernorm: fp32 within 1e-3 of the CPU's curve, bf16 within 5e-2; both learn.
TEST(CudaLlamaModel, QKLayerNormStepsFollowTheCpuCurve) {
  for (bool layernorm : {false, true}) {
    const GPTConfig c = Qwen3Config(layernorm);
    ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, layernorm ? " LayerNorm" : "");
  }
}

// --squared-relu (fc1's product, then the squared-ReLU kernel; its backward in place) and
// --apply-layernorm-1p (every norm reads 1 + gamma from the effective-weight buffer; the norms moved
// off their initial 0 by PerturbQKNorms), in Megatron's GPT and in the Llama line with --qk-layernorm:
// fp32 within the bounds above, bf16 loosely (without attention dropout: cuDNN's mask there), and a
// 30-step curve.
TEST(CudaLlamaModel, SquaredReluAndLayerNorm1pStepMatchTheCpu) {
  GPTConfig relu = SmallConfig(/*dropout=*/true);
  relu.squared_relu = true;
  GPTConfig one_p = SmallConfig(/*dropout=*/false);
  one_p.apply_layernorm_1p = true;
  GPTConfig both = Qwen3Config(/*layernorm=*/false);
  both.apply_layernorm_1p = true;
  GPTConfig gpt_both = SmallConfig(/*dropout=*/false);
  gpt_both.squared_relu = gpt_both.apply_layernorm_1p = gpt_both.qk_layernorm = true;
  for (const auto& [c, what] : std::vector<std::pair<GPTConfig, std::string>>{
           {relu, "--squared-relu with dropout"},
           {one_p, "--apply-layernorm-1p, LayerNorm"},
           {both, "--apply-layernorm-1p, RMSNorm, --qk-layernorm"},
           {gpt_both, "--squared-relu --apply-layernorm-1p --qk-layernorm, LayerNorm"}}) {
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, what);
    // bf16's attention dropout is cuDNN's own mask, not the CPU's (the hidden dropout's is the same):
    // attention dropout off there, as in every bf16 step against the CPU.
    GPTConfig half = c;
    half.attention_dropout = 0.0;
    ExpectOneStepMatches(half, Precision::kBf16, 1e-2, 6e-2, what);
  }
}

TEST(CudaLlamaModel, SquaredReluAndLayerNorm1pStepsFollowTheCpuCurve) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.squared_relu = c.apply_layernorm_1p = true;
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, " squared ReLU, LayerNorm 1p");
}

// The exact erf GELU of Megatron's unfused GELU MLP (--no-bias-gelu-fusion; fc1's product, then the exact
// GELU's kernel, never cuBLASLt's tanh GELU epilogue; its backward in place), with biases (with hidden
// and attention dropout) and without (--disable-bias-linear): one step within the bounds above in fp32,
// bf16 loosely without attention dropout, and a 30-step curve.
TEST(CudaLlamaModel, ExactGeluStepMatchesTheCpu) {
  GPTConfig biased = SmallConfig(/*dropout=*/true);
  biased.gelu_exact = true;
  GPTConfig bare = SmallConfig(/*dropout=*/false);
  bare.gelu_exact = true;
  bare.add_bias_linear = false;
  for (const auto& [c, what] : std::vector<std::pair<GPTConfig, std::string>>{{biased, "exact GELU with dropout"},
                                                                              {bare, "exact GELU without biases"}}) {
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, what);
    GPTConfig half = c;
    half.attention_dropout = 0.0;
    ExpectOneStepMatches(half, Precision::kBf16, 1e-2, 6e-2, what);
  }
}

TEST(CudaLlamaModel, ExactGeluStepsFollowTheCpuCurve) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.gelu_exact = true;
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, " exact GELU");
}

}  // namespace
}  // namespace ptk
