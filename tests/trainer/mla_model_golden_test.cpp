// The CPU model's multi-latent attention layers against megatron-core 0.16.1 itself
// (tests/support/gen_mla_golden.py: its GPTModel with MLASelfAttention of the local spec, its DDP, optimizer
// and scheduler on the CPU): queries through a latent with the latents' norms (RMSNorm, SwiGLU, RoPE
// positions), queries by linear_q_proj without norms (LayerNorm, GELU, biases, learned positions beside MLA's
// rope), and the first model with YaRN, mscale and mscale_all_dim. The layout (Megatron's names, shapes and
// order of the attention's parameters), the first step's lm loss, grad norm and every gradient within 1e-5
// relative, and three optimizer steps' losses and the weights after them (1e-4: Adam's first steps amplify),
// the MoE golden's tolerances: fp32 on both sides, only the order of the sums differs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/golden_util.h"
#include "trainer/backend.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::Golden;
using testing::GoldenBatches;
using testing::RelError;

class MlaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto cfg = g_.meta["config"];
    auto str = [&](const char* k) { return std::string(cfg[k].get_string().value()); };
    GPTConfig c = g_.AttentionShape();
    c.qk_layernorm = cfg["qk_layernorm"].get_bool();
    c.multi_latent_attention = true;
    c.q_lora_rank = g_.Int("q_lora_rank");
    c.kv_lora_rank = g_.Int("kv_lora_rank");
    c.qk_head_dim = g_.Int("qk_head_dim");
    c.qk_pos_emb_head_dim = g_.Int("qk_pos_emb_head_dim");
    c.v_head_dim = g_.Int("v_head_dim");
    c.mla_yarn = str("rope_type") == "yarn";
    c.rotary_base = g_.Num("rotary_base");
    c.rotary_scaling_factor = g_.Num("rotary_scaling_factor");
    c.mscale = g_.Num("mscale");
    c.mscale_all_dim = g_.Num("mscale_all_dim");
    config_ = c;
  }
  std::unique_ptr<CpuGPTModel> MakeModel() {
    auto m = CpuGPTModel::Create(config_);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE((*m)->WriteParams(g_.InitWeights((*m)->layout())).ok());
    return std::move(*m);
  }
  SchedulerConfig Schedule() { return g_.ConstantSchedule(); }
  int64_t GlobalBatch() { return g_.GlobalBatch(); }
  double Want(int64_t step, const char* key) { return g_.meta["steps"].at(step)[key].get_double(); }

  Golden g_{GetParam()};
  GoldenBatches batches_{g_};
  GPTConfig config_;
};

TEST_P(MlaGolden, TheLayoutIsMegatronCores) {
  auto layout = ParamLayout::Create(config_);
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Every tensor megatron-core has, of its shape, and no other.
  EXPECT_EQ(layout->infos.size(), g_.meta["param_order"].get_array().size());
  std::vector<std::string> attention;  // megatron-core's order of MLA's parameters (linear_proj aside)
  for (const std::string& name : g_.ParamOrder()) {
    const ParamInfo* p = layout->Find(name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_EQ(p->shape, g_.InitShape(name)) << name;
    if (name.find(".self_attention.") != std::string::npos && name.find("linear_proj") == std::string::npos)
      attention.push_back(name);
  }
  std::vector<std::string> mine;
  for (const ParamInfo& p : layout->infos)
    if (p.name.find(".self_attention.") != std::string::npos && p.name.find("linear_proj") == std::string::npos)
      mine.push_back(p.name);
  EXPECT_EQ(mine, attention);
  EXPECT_DOUBLE_EQ(config_.MlaSoftmaxScale(), g_.meta["softmax_scale"].get_double());
}

TEST_P(MlaGolden, TheFirstStepsGradientsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), Schedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(std::abs(r->lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
  EXPECT_LE(std::abs(r->grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
  double worst = 0;
  for (const ParamInfo& p : model->params_info()) {
    const double e = RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name));
    EXPECT_LE(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  // The activations a pass keeps are those the memory plan counts (--dry-run's estimate).
  EXPECT_EQ(CpuGPTModel::PlanActivationFloats(model->layout(), false, g_.Int("micro_batch_size")),
            model->ActivationFloats());
  std::printf("loss %.9g (megatron %.9g), grad norm %.9g (megatron %.9g), largest gradient difference %.3g\n",
              r->lm_loss(), Want(0, "lm_loss"), r->grad_norm, Want(0, "grad_norm"), worst);
}

TEST_P(MlaGolden, ThreeOptimizerStepsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), Schedule(), comm.get());
  const int64_t steps = static_cast<int64_t>(g_.meta["steps"].get_array().size());
  for (int64_t s = 0; s < steps; ++s) {
    auto r = step.Step(batches_.Step(s), GlobalBatch(), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(std::abs(r->lm_loss() - Want(s, "lm_loss")), 1e-5) << "step " << s;
  }
  g_.ExpectFinalWeights(*model, 1e-4);
}

// With the other rope type (plain rope for yarn; yarn of factor 4 for rope) the gradients differ from
// Megatron's: the comparison above sees MLA's rotary embedding.
TEST_P(MlaGolden, TheOtherRopeTypeDiffers) {
  config_.mla_yarn = !config_.mla_yarn;
  if (config_.mla_yarn) config_.rotary_scaling_factor = 4;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), Schedule(), comm.get());
  ASSERT_TRUE(step.ComputeGradients(batches_.Step(0), 0).ok());
  double worst = 0;
  for (const ParamInfo& p : model->params_info())
    worst = std::max(worst, RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name)));
  EXPECT_GT(worst, 1e-3);
}

// What MLA does not run with is refused by the library too, not only by ptk-train's flags.
TEST(MlaModel, OtherBackendsAndLayoutsAreRefused) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 16;
  c.seq_length = c.max_position_embeddings = 4;
  c.vocab_size = c.padded_vocab_size = 16;
  c.multi_latent_attention = true;
  c.kv_lora_rank = 4;
  c.qk_head_dim = c.qk_pos_emb_head_dim = c.v_head_dim = 2;
  c.mla_yarn = false;
  EXPECT_TRUE(CreateModel(c, BackendOptions{}).ok());
  BackendOptions cuda;  // the CUDA backend's MLA runs on one tensor, context and pipeline rank (cuda_mla_layer.cpp)
  cuda.device = Device::kCuda;
  cuda.pipeline_stage = PipelineStage{2, 1, 1, 1};
  const absl::Status staged_cuda = CreateModel(c, cuda).status();
  EXPECT_EQ(staged_cuda.code(), absl::StatusCode::kUnimplemented) << staged_cuda;
  EXPECT_NE(staged_cuda.message().find("multi_latent_attention: the CUDA backend's multi-latent attention runs on one"),
            std::string::npos)
      << staged_cuda;
  cuda.pipeline_stage = PipelineStage{};  // one rank: past the check (then a GPU, or its absence, decides)
  const absl::Status one_cuda = CreateModel(c, cuda).status();
  EXPECT_EQ(one_cuda.message().find("multi_latent_attention"), std::string::npos) << one_cuda;
  auto split = ParamLayout::Create(c, /*tensor_size=*/2, 1);  // one head per rank: its up projections' rows
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->Find("decoder.layers.0.self_attention.linear_kv_up_proj.weight")->shape,
            (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(split->Find("decoder.layers.0.self_attention.linear_kv_down_proj.weight")->tensor_split_dim, -1);
  EXPECT_FALSE(ParamLayout::Create(c, /*tensor_size=*/4, 0).ok());  // 2 heads over 4 ranks
  BackendOptions stage;                                             // pipeline stages hold their layers' projections
  stage.pipeline_stage = PipelineStage{2, 1, 1, 1};
  auto staged = CreateModel(c, stage);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_NE((*staged)->FindParam("decoder.layers.1.self_attention.linear_kv_down_proj.weight"), nullptr);
  for (auto bad : {+[](GPTConfig& x) { x.qk_pos_emb_head_dim = 3; },  // odd rotary channels
                   +[](GPTConfig& x) { x.kv_lora_rank = 0; }, +[](GPTConfig& x) { x.q_lora_rank = -1; },
                   +[](GPTConfig& x) { x.rotary_percent = 0.5; }, +[](GPTConfig& x) { x.rotary_interleaved = true; },
                   +[](GPTConfig& x) { x.num_query_groups = 1; }, +[](GPTConfig& x) { x.rotary_scaling_factor = 0; }}) {
    GPTConfig x = c;
    bad(x);
    EXPECT_EQ(ParamLayout::Create(x).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

INSTANTIATE_TEST_SUITE_P(Megatron, MlaGolden, ::testing::Values("mla_lora", "mla_plain", "mla_yarn"));

}  // namespace
}  // namespace ptk
