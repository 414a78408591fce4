// The CUDA model of Megatron's Llama line against the CPU model (gpu-labelled: exits 77 without a
// device). A small Llama-shaped model (RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU,
// 4 query heads in 2 groups, untied output layer, no biases): one step's loss and every gradient in
// fp32 (no TF32) against the CPU model, and variants that reach the other paths (hidden and attention
// dropout with RMSNorm's unfused dropout, the QKV bias alone, half the channels rotated, one query
// group, no position embeddings with LayerNorm, recomputed attention); bf16 (cuDNN's grouped-query
// attention over the heads-first copy) one step loosely and a few dozen steps learning along the
// CPU's curve.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

// One step on both backends from the same weights: the loss within loss_tol relative, every
// tensor's gradient within grad_tol (relative L2); the same layout (names, offsets) on both.
void ExpectOneStepMatches(const GPTConfig& c, Precision p, double loss_tol, double grad_tol, const std::string& what) {
  Batches data(1, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, p);
  ASSERT_TRUE(gpu) << what;
  ASSERT_EQ(gpu->num_params(), cpu->num_params()) << what;
  for (size_t i = 0; i < cpu->params_info().size(); ++i) {
    EXPECT_EQ(gpu->params_info()[i].name, cpu->params_info()[i].name) << what;
    EXPECT_EQ(gpu->params_info()[i].offset, cpu->params_info()[i].offset) << what;
  }
  ASSERT_TRUE(cpu->ZeroGrads().ok());
  ASSERT_TRUE(gpu->ZeroGrads().ok());
  const double scale = 1.0 / 200.0;
  auto a = cpu->ForwardBackward(data.Get(0), scale, /*train=*/true, 99);
  auto b = gpu->ForwardBackward(data.Get(0), scale, /*train=*/true, 99);
  ASSERT_TRUE(a.ok()) << what << ": " << a.status();
  ASSERT_TRUE(b.ok()) << what << ": " << b.status();
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NEAR(b->loss_sum / b->tokens, a->loss_sum / a->tokens, loss_tol * a->loss_sum / a->tokens)
      << what << " " << PrecisionName(p);
  std::vector<float> ga(static_cast<size_t>(cpu->num_params())), gb(ga.size());
  ASSERT_TRUE(cpu->ReadGrads(ga).ok());
  ASSERT_TRUE(gpu->ReadGrads(gb).ok());
  for (const ParamInfo& info : cpu->params_info())
    EXPECT_LE(RelL2(gb.data() + info.offset, ga.data() + info.offset, info.size), grad_tol)
        << info.name << ", " << what << " " << PrecisionName(p);
  // Evaluation (Forward) gives the training pass's loss.
  auto e = gpu->Forward(data.Get(0), nullptr);
  ASSERT_TRUE(e.ok()) << what << ": " << e.status();
  if (p == Precision::kFp32 && c.hidden_dropout == 0 && c.attention_dropout == 0) {
    EXPECT_NEAR(e->loss_sum / e->tokens, b->loss_sum / b->tokens, 1e-5 * b->loss_sum / b->tokens) << what;
  }
}

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

// bf16: 8-bit mantissas in the products and activations; cuDNN's fused grouped-query attention.
TEST(CudaLlamaModel, Bf16StepMatchesTheCpu) {
  ExpectOneStepMatches(LlamaConfig(), Precision::kBf16, 1e-2, 6e-2, "the Llama model");
  GPTConfig one = LlamaConfig();
  one.num_query_groups = 1;
  ExpectOneStepMatches(one, Precision::kBf16, 1e-2, 6e-2, "one query group");
}

std::vector<double> Curve(GPTModel* model, const Batches& data, int steps) {
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model, OptimizerConfig{0.9, 0.95, 1e-8, 1.0}, Schedule(), comm.get());
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    auto r = opt.Step({data.Get(i % 10)}, data.b, 7);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    losses.push_back(r->lm_loss());
  }
  return losses;
}

// 40 steps: fp32 within 1e-3 relative of the CPU's curve at every step, bf16 within 5e-2; both learn.
TEST(CudaLlamaModel, StepsFollowTheCpuCurveAndLearn) {
  const GPTConfig c = LlamaConfig();
  Batches data(10, c.vocab_size);
  auto cpu = Cpu(c);
  const std::vector<double> ref = Curve(cpu.get(), data, 40);
  ASSERT_EQ(ref.size(), 40u);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    auto gpu = Cuda(c, p);
    ASSERT_TRUE(gpu);
    const std::vector<double> got = Curve(gpu.get(), data, 40);
    ASSERT_EQ(got.size(), ref.size());
    const double tol = p == Precision::kFp32 ? 1e-3 : 5e-2;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], tol * ref[i]) << "step " << i + 1 << " " << PrecisionName(p);
    EXPECT_LT(got.back(), 0.7 * got.front()) << PrecisionName(p);
  }
}

}  // namespace
}  // namespace ptk
