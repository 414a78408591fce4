// The CUDA model with multi-latent attention (trainer/cuda/cuda_mla_layer.cpp) against the CPU model
// (trainer/cpu/cpu_mla_layer.cpp; gpu-labelled: exits 77 without a device). DeepSeek's shape on a small model:
// 4 heads whose queries and keys are qk_head_dim 12 + qk_pos_emb_head_dim 4 channels and values v_head_dim 8 (the
// core attention's qk head width is not its v width; both multiples of 8, as cuDNN's fused attention asks), the query
// through a q_lora_rank 16 latent or linear_q_proj, the keys and values through a kv_lora_rank 12 latent, the latent
// norms (--qk-layernorm, their weights moved off 1 so a norm read for the wrong latent shows) or none, MLA's rope or
// yarn tables.
//
// Tolerances, as cuda_llama_model_test's: fp32 (no TF32) the loss within 1e-5 relative and every gradient within
// 1e-4 relative L2 (rounding only: the rotations are the CPU's bits, the products and reductions cuBLAS's order);
// bf16 the loss within 1e-2 and every gradient within 6e-2 (bf16 activations, cuDNN's fused attention with a
// value head narrower than the query's), 1e-1 with MoE layers beside (cuda_moe_model_test's, the router reading
// bf16); the curves within 1e-3 (fp32) and 5e-2 (bf16) of the CPU's at every step, and learning.
#include <gtest/gtest.h>

#include <string>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

// DeepSeek-V2-Lite's line (RMSNorm, SwiGLU, untied, no biases) with MLA, the latents normed, rope tables.
GPTConfig MlaConfig(int64_t q_lora = 16, bool norms = true, bool yarn = false) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.ffn_hidden_size = 128;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.multi_latent_attention = true;
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 12;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 8;
  c.qk_layernorm = norms;
  c.mla_yarn = yarn;
  if (yarn) {  // DeepSeek-V3's YaRN settings (a concentration factor and a softmax scale off 1)
    c.rotary_scaling_factor = 40;
    c.mscale = c.mscale_all_dim = 0.707;
  }
  return c;
}

TEST(CudaMlaModel, Fp32StepMatchesTheCpu) {
  ExpectOneStepMatches(MlaConfig(), Precision::kFp32, 1e-5, 1e-4, "MLA q_lora 16, latent norms, rope");
}

TEST(CudaMlaModel, Fp32VariantsMatchTheCpu) {
  ExpectOneStepMatches(MlaConfig(0, false, true), Precision::kFp32, 1e-5, 1e-4, "MLA linear_q_proj, no norms, yarn");
  ExpectOneStepMatches(MlaConfig(16, false, false), Precision::kFp32, 1e-5, 1e-4, "MLA q_lora 16, no norms");
  ExpectOneStepMatches(MlaConfig(0, true, true), Precision::kFp32, 1e-5, 1e-4, "MLA linear_q_proj, kv norm, yarn");
  {  // GPT-3's line: LayerNorm latents with biases, learned positions beside MLA's rope, GELU, biases, dropout
    GPTConfig c = MlaConfig(16, true, true);
    c.normalization = Normalization::kLayerNorm;
    c.position_embedding = PositionEmbedding::kLearnedAbsolute;
    c.swiglu = false;
    c.ffn_hidden_size = 256;
    c.add_bias_linear = true;
    c.hidden_dropout = c.attention_dropout = 0.1;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MLA LayerNorm latents, learned positions, dropout");
    c.recompute_activations = true;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MLA LayerNorm latents, recomputed attention");
  }
  {  // --apply-layernorm-1p: the latent norms read 1 + gamma too
    GPTConfig c = MlaConfig();
    c.apply_layernorm_1p = true;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MLA with --apply-layernorm-1p");
  }
}

TEST(CudaMlaModel, Bf16AndFp16StepsMatchTheCpu) {
  ExpectOneStepMatches(MlaConfig(), Precision::kBf16, 1e-2, 6e-2, "MLA q_lora 16, latent norms, rope");
  ExpectOneStepMatches(MlaConfig(0, false, true), Precision::kBf16, 1e-2, 6e-2, "MLA linear_q_proj, no norms, yarn");
  const GPTConfig yarn = MlaConfig(16, true, true);
  ExpectCurvesFollowTheCpu(yarn, Batches(10, yarn.vocab_size), 30, 1e-3, 5e-2, " MLA yarn");
  ExpectOneStepMatches(MlaConfig(), Precision::kFp16, 1e-2, 6e-2, "MLA q_lora 16, latent norms, rope");
}

TEST(CudaMlaModel, FollowsTheCpuCurve) {
  const GPTConfig c = MlaConfig();
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 40, 1e-3, 5e-2, " MLA");
}

// MLA beside mixture-of-experts layers (DeepSeek's model: the CUDA MoE, data-parallel, cuda_moe_model.cpp).
TEST(CudaMlaModel, WithMoeLayersMatchesTheCpu) {
  GPTConfig c = MlaConfig();
  c.num_layers = 3;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 48;
  c.moe_layer_pattern = {0, 1, 1};
  c.moe_aux_loss_coeff = 1e-2;
  c.moe_shared_expert_intermediate_size = 32;
  ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MLA with MoE layers");
  ExpectOneStepMatches(c, Precision::kBf16, 1e-2, 1e-1, "MLA with MoE layers");
}

// What the CUDA layers do not cover is refused naming it: a pipeline stage (and tensor and context ranks, which
// ptk-train and CreateModel refuse first).
TEST(CudaMlaModel, ModelParallelismIsRefused) {
  cuda::CudaModelOptions options;
  options.pipeline.size = 2;
  options.pipeline.num_layers = 1;
  auto m = cuda::CreateCudaGPTModel(MlaConfig(), Precision::kFp32, 0, true, 4, false, options);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("multi_latent_attention on CUDA: one tensor, context and pipeline rank only"),
            std::string::npos)
      << m.status();
}

}  // namespace
}  // namespace ptk
