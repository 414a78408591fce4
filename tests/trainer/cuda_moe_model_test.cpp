// The CUDA model with mixture-of-experts layers (trainer/cuda/cuda_moe_model.cpp) against the CPU model
// (gpu-labelled: exits 77 without a device). A small GPT with two MoE layers of 4 experts (top-2) beside a
// dense one, no biases (Megatron's MoE needs --disable-bias-linear), the load-balancing loss and the z-loss on:
// one step's loss, load-balancing and z-loss values and every gradient; softmax, pre-softmax and sigmoid routers
// with the top-k scaling factor, GELU and SwiGLU experts, shared experts with and without their gate, group-limited
// routing (softmax and sigmoid), seq_aux_loss, the expert bias; a few dozen steps along the CPU's curve.
//
// Tolerances, as cuda_model_test's: fp32 (no TF32) the loss within 1e-5 relative, every gradient within 1e-4
// relative L2 (rounding only: both routers choose the same experts from fp32 logits of the same weights); the
// load-balancing loss and z-loss within 1e-5 relative. bf16: the loss within 1e-2, every gradient within 1e-1
// relative L2 (looser than the dense model's 6e-2: the router reads the bf16 norm output, so a token whose two
// best experts are within bf16's rounding of each other may go elsewhere than on the CPU); the curves within
// 1e-3 (fp32) and 5e-2 (bf16) of the CPU's at every step, and learning.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

GPTConfig MoeConfig() {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.num_layers = 3;
  c.add_bias_linear = false;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 96;
  c.moe_layer_pattern = {1, 0, 1};
  c.moe_aux_loss_coeff = 1e-2;
  c.moe_z_loss_coeff = 1e-3;
  return c;
}

// The MoE losses' values: the same on both backends.
void ExpectMoeLossesMatch(const GPTConfig& c, Precision p, double tol, const std::string& what) {
  Batches data(1, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, p);
  ASSERT_TRUE(gpu) << what;
  auto a = cpu->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5);
  auto b = gpu->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT(a->load_balancing_loss, 0) << what;
  EXPECT_GT(a->z_loss, 0) << what;
  EXPECT_NEAR(b->load_balancing_loss, a->load_balancing_loss, tol * a->load_balancing_loss) << what;
  EXPECT_NEAR(b->z_loss, a->z_loss, tol * a->z_loss) << what;
  // Evaluation passes track neither.
  auto e = gpu->Forward(data.Get(0), nullptr);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->load_balancing_loss, 0) << what;
}

TEST(CudaMoeModel, Fp32StepMatchesTheCpu) {
  ExpectOneStepMatches(MoeConfig(), Precision::kFp32, 1e-5, 1e-4, "MoE softmax top-2, GELU");
  ExpectMoeLossesMatch(MoeConfig(), Precision::kFp32, 1e-5, "MoE softmax top-2, GELU");
}

TEST(CudaMoeModel, Fp32RouterVariantsMatchTheCpu) {
  {
    GPTConfig c = MoeConfig();
    c.moe_router_pre_softmax = true;
    c.swiglu = true;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MoE pre-softmax, SwiGLU");
    ExpectMoeLossesMatch(c, Precision::kFp32, 1e-5, "MoE pre-softmax, SwiGLU");
  }
  {
    GPTConfig c = MoeConfig();
    c.moe_router_sigmoid = true;
    c.moe_router_topk_scaling_factor = 2.5;
    c.moe_router_topk = 1;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MoE sigmoid top-1, scaling 2.5");
    ExpectMoeLossesMatch(c, Precision::kFp32, 1e-5, "MoE sigmoid top-1, scaling 2.5");
  }
}

// Shared experts (DeepSeek / Qwen-MoE): a dense MLP beside the routed experts on every token, with and without the
// sigmoid gate; their weights' gradients among every gradient compared.
GPTConfig SharedConfig(bool gate) {
  GPTConfig c = MoeConfig();
  c.moe_shared_expert_intermediate_size = 80;
  c.moe_shared_expert_gate = gate;
  return c;
}

TEST(CudaMoeModel, Fp32SharedExpertsMatchTheCpu) {
  ExpectOneStepMatches(SharedConfig(false), Precision::kFp32, 1e-5, 1e-4, "MoE with shared experts");
  ExpectMoeLossesMatch(SharedConfig(false), Precision::kFp32, 1e-5, "MoE with shared experts");
  GPTConfig c = SharedConfig(true);
  c.swiglu = true;
  ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MoE with gated shared experts, SwiGLU");
}

TEST(CudaMoeModel, SharedExpertsFollowTheCpuInBf16AndAlongTheCurve) {
  ExpectOneStepMatches(SharedConfig(true), Precision::kBf16, 1e-2, 1e-1, "MoE with gated shared experts");
  const GPTConfig c = SharedConfig(true);
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 20, 1e-3, 5e-2, " MoE shared experts");
}

// Group-limited routing (DeepSeek-V2's softmax, DeepSeek-V3's sigmoid with shared experts; no expert bias): the
// top 2 within the best of 2 groups of 2 experts, the load-balancing loss counting each token's plain top 2.
GPTConfig GroupedConfig(bool sigmoid) {
  GPTConfig c = sigmoid ? SharedConfig(true) : MoeConfig();
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_router_sigmoid = sigmoid;
  if (sigmoid) c.moe_router_topk_scaling_factor = 2.5;
  return c;
}

TEST(CudaMoeModel, Fp32GroupLimitedRoutingMatchesTheCpu) {
  for (bool sigmoid : {false, true}) {
    const std::string what = sigmoid ? "MoE sigmoid, 2 groups, shared experts" : "MoE softmax, 2 groups";
    ExpectOneStepMatches(GroupedConfig(sigmoid), Precision::kFp32, 1e-5, 1e-4, what);
    ExpectMoeLossesMatch(GroupedConfig(sigmoid), Precision::kFp32, 1e-5, what);
  }
}

TEST(CudaMoeModel, GroupLimitedRoutingFollowsTheCpuInBf16AndAlongTheCurve) {
  ExpectOneStepMatches(GroupedConfig(true), Precision::kBf16, 1e-2, 1e-1, "MoE sigmoid, 2 groups, shared experts");
  const GPTConfig c = GroupedConfig(true);
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 20, 1e-3, 5e-2, " MoE group-limited routing");
}

// seq_aux_loss (with aux_loss beside it): each sequence's switch loss, its value (TakeMoeBalanceLosses) and gradient
// the CPU model's (trainer/cpu/moe_balance.cpp), micro-batches of 4 sequences.
GPTConfig SeqAuxConfig() {
  GPTConfig c = GroupedConfig(true);
  c.moe_seq_aux_loss_coeff = 5e-2;
  return c;
}

TEST(CudaMoeModel, Fp32SeqAuxLossMatchesTheCpu) {
  const GPTConfig c = SeqAuxConfig();
  ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, "MoE seq_aux_loss");
  Batches data(1, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, Precision::kFp32);
  ASSERT_TRUE(gpu);
  ASSERT_TRUE(cpu->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5).ok());
  ASSERT_TRUE(gpu->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5).ok());
  const MoeBalanceLosses a = cpu->TakeMoeBalanceLosses(), b = gpu->TakeMoeBalanceLosses();
  EXPECT_GT(a.seq, 0);
  EXPECT_NEAR(b.seq, a.seq, 1e-5 * a.seq);
  EXPECT_EQ(gpu->TakeMoeBalanceLosses().seq, 0);         // taken
  ASSERT_TRUE(gpu->Forward(data.Get(0), nullptr).ok());  // evaluation passes track none
  EXPECT_EQ(gpu->TakeMoeBalanceLosses().seq, 0);
}

TEST(CudaMoeModel, SeqAuxLossFollowsTheCpuInBf16AndAlongTheCurve) {
  ExpectOneStepMatches(SeqAuxConfig(), Precision::kBf16, 1e-2, 1e-1, "MoE seq_aux_loss");
  const GPTConfig c = SeqAuxConfig();
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 20, 1e-3, 5e-2, " MoE seq_aux_loss");
}

// Aux-loss-free routing (DeepSeek-V3's: sigmoid, the expert bias, groups, shared experts): the bias moved after each
// step by the step's counts as the CPU model moves it (FinishMoeStep), the same values after 12 steps (fp32: the
// same choices, so the same counts and signs; the rate 1e-2 makes them matter), read back as checkpoint buffers and
// written into another model; the curve the CPU's.
GPTConfig BiasConfig() {
  GPTConfig c = GroupedConfig(true);
  c.moe_router_enable_expert_bias = true;
  c.moe_router_bias_update_rate = 1e-2;
  c.moe_aux_loss_coeff = 0;
  return c;
}

TEST(CudaMoeModel, ExpertBiasMovesAsTheCpusAndIsACheckpointBuffer) {
  const GPTConfig c = BiasConfig();
  const Batches data(10, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, Precision::kFp32);
  ASSERT_TRUE(gpu);
  const std::vector<double> ref = Curve(cpu.get(), data, 12), run = Curve(gpu.get(), data, 12);
  ASSERT_EQ(run.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(run[i], ref[i], 1e-3 * ref[i]) << "step " << i + 1;
  const ModelBuffers want = cpu->ReadBuffers(), got = gpu->ReadBuffers();
  ASSERT_EQ(got.size(), 2u);  // the two MoE layers' routers
  ASSERT_EQ(want.size(), got.size());
  double moved = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    ASSERT_EQ(got[i].second.size(), want[i].second.size());
    for (size_t e = 0; e < got[i].second.size(); ++e) {
      EXPECT_NEAR(got[i].second[e], want[i].second[e], 1e-6) << got[i].first << " expert " << e;
      moved += std::fabs(got[i].second[e]);
    }
  }
  EXPECT_GT(moved, 0);
  auto other = Cuda(c, Precision::kBf16);
  ASSERT_TRUE(other);
  ASSERT_TRUE(other->WriteBuffers(got).ok());
  EXPECT_EQ(other->ReadBuffers(), got);
  EXPECT_FALSE(other->WriteBuffers({}).ok());  // a checkpoint without the biases
  ModelBuffers wrong = got;
  wrong[0].second.pop_back();
  EXPECT_FALSE(other->WriteBuffers(wrong).ok());
  ExpectCurvesFollowTheCpu(c, data, 20, 1e-3, 5e-2, " MoE expert bias");
}

TEST(CudaMoeModel, Bf16StepFollowsTheCpu) {
  ExpectOneStepMatches(MoeConfig(), Precision::kBf16, 1e-2, 1e-1, "MoE softmax top-2, GELU");
}

TEST(CudaMoeModel, StepsFollowTheCpuCurveAndLearn) {
  const GPTConfig c = MoeConfig();
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, " MoE");
}

}  // namespace
}  // namespace ptk
