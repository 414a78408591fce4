// The CPU model's --attention-output-gate (Qwen3-Next's gated attention) and --qk-l2-norm (Llama 4's query and key
// L2 norm) against megatron-core 0.16.1 itself (tests/support/gen_gated_attention_golden.py: its GPTModel of the
// local spec, its DDP, optimizer and scheduler on the CPU): the gate with multi-head attention (LayerNorm, GELU,
// biases), the gate and the L2 norm with grouped-query attention (RMSNorm, SwiGLU, RoPE), the L2 norm alone with one
// query group. The layout (linear_qkv's shape, Megatron's names and order), the first step's lm loss, grad norm and
// every gradient within 1e-5 relative (fp32 on both sides, only the order of the sums differs: 4.6e-7 seen), three
// optimizer steps' losses (1e-5) and the weights after them (2e-4, the MLA golden's 1e-4 doubled: Adam's m / sqrt(v)
// amplifies the sums' rounding where a gradient is near zero; gated_gqa_l2's layer 0 fc2 differs by 1.8e-4, all of it
// in one SwiGLU unit's column, its elements by 1e-5 to 7e-5 of weights near 1e-2, the attention's within 1e-4); at
// tensor size 2 (the gate rows split with their query groups), with and without sequence parallelism, one
// micro-batch's loss and gradients as the one-rank model's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/golden_util.h"
#include "trainer/backend.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"
#include "trainer/train_step.h"
#include "trainer/training.h"

namespace ptk {
namespace {

using testing::Golden;
using testing::GoldenBatches;
using testing::RelError;

class GatedGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto cfg = g_.meta["config"];
    GPTConfig c = g_.AttentionShape();
    c.num_query_groups = g_.Int("num_query_groups");
    c.layernorm_epsilon = g_.Num("layernorm_epsilon");
    c.rotary_base = g_.Num("rotary_base");
    c.attention_output_gate = cfg["attention_output_gate"].get_bool();
    c.qk_l2_norm = cfg["qk_l2_norm"].get_bool();
    config_ = c;
  }
  // The golden's weights, whole or tensor rank `tensor`'s slices of them.
  std::unique_ptr<CpuGPTModel> MakeModel(Communicator* tensor = nullptr, bool sequence_parallel = false) {
    auto m = CpuGPTModel::Create(config_, tensor, sequence_parallel);
    EXPECT_TRUE(m.ok()) << m.status();
    auto whole_layout = ParamLayout::Create(config_);
    const std::vector<float> whole = g_.InitWeights(*whole_layout);
    std::vector<float> mine((*m)->num_params());
    CopyToShard((*m)->layout(), whole, mine);
    EXPECT_TRUE((*m)->WriteParams(mine).ok());
    return std::move(*m);
  }
  double Want(int64_t step, const char* key) { return g_.meta["steps"].at(step)[key].get_double(); }
  double WorstGradient(const CpuGPTModel& model) {
    double worst = 0;
    for (const ParamInfo& p : model.params_info())
      worst = std::max(
          worst, RelError(const_cast<CpuGPTModel&>(model).grads() + p.offset, g_.Tensor<float>("grad:" + p.name)));
    return worst;
  }

  Golden g_{GetParam()};
  GoldenBatches batches_{g_};
  GPTConfig config_;
};

TEST_P(GatedGolden, TheLayoutIsMegatronCores) {
  auto layout = ParamLayout::Create(config_);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<std::string> theirs, mine;
  for (const std::string& name : g_.ParamOrder()) {
    theirs.push_back(name);
    const ParamInfo* p = layout->Find(name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_EQ(p->shape, g_.InitShape(name)) << name;
  }
  for (const ParamInfo& p : layout->infos) mine.push_back(p.name);
  std::sort(theirs.begin(), theirs.end());
  std::sort(mine.begin(), mine.end());
  EXPECT_EQ(mine, theirs);  // no query or key norm weights with the L2 norm
  const ParamInfo* qkv = layout->Find("decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  const int64_t gate = config_.attention_output_gate ? config_.num_attention_heads : 0;
  EXPECT_EQ(qkv->shape[0], (config_.num_attention_heads + gate + 2 * config_.query_groups()) * config_.head_dim());
}

TEST_P(GatedGolden, TheFirstStepsGradientsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(std::abs(r->lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
  EXPECT_LE(std::abs(r->grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
  for (const ParamInfo& p : model->params_info())
    EXPECT_LE(RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name)), 1e-5) << p.name;
  // The activations a pass keeps are those the memory plan counts (--dry-run's estimate).
  EXPECT_EQ(CpuGPTModel::PlanActivationFloats(model->layout(), false, g_.Int("micro_batch_size")),
            model->ActivationFloats());
  std::printf("loss %.9g (megatron %.9g), grad norm %.9g (megatron %.9g), largest gradient difference %.3g\n",
              r->lm_loss(), Want(0, "lm_loss"), r->grad_norm, Want(0, "grad_norm"), WorstGradient(*model));
}

TEST_P(GatedGolden, ThreeOptimizerStepsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  const int64_t steps = static_cast<int64_t>(g_.meta["steps"].get_array().size());
  for (int64_t s = 0; s < steps; ++s) {
    auto r = step.Step(batches_.Step(s), g_.GlobalBatch(), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(std::abs(r->lm_loss() - Want(s, "lm_loss")), 1e-5) << "step " << s;
  }
  g_.ExpectFinalWeights(*model, 2e-4);
}

// Without the L2 norm (the gate's rows being the layout's, it cannot be left out of the same weights) the gradients
// are not Megatron's: the comparison above sees the norm.
TEST_P(GatedGolden, WithoutTheL2NormTheGradientsDiffer) {
  if (!config_.qk_l2_norm) GTEST_SKIP() << "no L2 norm in this golden";
  config_.qk_l2_norm = false;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  ASSERT_TRUE(step.ComputeGradients(batches_.Step(0), 0).ok());
  EXPECT_GT(WorstGradient(*model), 1e-3);
}

TEST_P(GatedGolden, TensorParallelRanksMatchOneRank) {
  const int T = 2;
  if (config_.query_groups() % T != 0) GTEST_SKIP() << "one query group: no tensor size 2";
  auto one = MakeModel();
  ASSERT_TRUE(one->ZeroGrads().ok());
  auto want = one->ForwardBackward(batches_.Step(0)[0], 1.0, false, 0);
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<float> whole(one->num_params());
  ASSERT_TRUE(one->ReadGrads(whole).ok());
  for (bool sp : {false, true})
    testing::RunRanks(T, [&](Communicator* comm, int rank) {
      SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
      auto model = MakeModel(comm, sp);
      ASSERT_TRUE(model->ZeroGrads().ok());
      auto loss = model->ForwardBackward(batches_.Step(0)[0], 1.0, false, 0);
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(model->SumNonTensorParallelGrads().ok());
      EXPECT_LE(std::abs(loss->loss_sum - want->loss_sum) / want->loss_sum, 1e-5) << "rank " << rank;
      std::vector<float> mine(model->num_params()), expect(model->num_params());
      CopyToShard(model->layout(), whole, expect);
      ASSERT_TRUE(model->ReadGrads(mine).ok());
      for (const ParamInfo& p : model->params_info())
        EXPECT_LE(RelError(mine.data() + p.offset,
                           std::vector<float>(expect.begin() + p.offset, expect.begin() + p.offset + p.size)),
                  1e-5)
            << p.name << " rank " << rank;
    });
}

INSTANTIATE_TEST_SUITE_P(Megatron, GatedGolden, ::testing::Values("gated_mha", "gated_gqa_l2", "l2_gqa"));

// The TFLOP/s line's formula counts the gate rows' product as Megatron-LM's num_floating_point_operations does
// (gate_projection_size = the query's, 6 x hidden x gate FLOPs per token and layer: forward and backward, FMA), the
// L2 norm as it counts the other norms (not at all).
TEST(GatedAttentionModel, TheFlopsCountTheGateProjection) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 64;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = c.padded_vocab_size = 64;
  const int64_t gbs = 4;
  const double plain = FlopsPerIteration(c, gbs);
  c.qk_l2_norm = true;
  EXPECT_EQ(FlopsPerIteration(c, gbs), plain);
  c.attention_output_gate = true;
  const double gate = 6.0 * gbs * c.seq_length * c.num_layers * c.hidden_size * c.num_attention_heads * c.head_dim();
  EXPECT_NEAR(FlopsPerIteration(c, gbs) - plain, gate, 1e-9 * plain);
}

// What the gate and the L2 norm do not run with is refused by the library too, not only by ptk-train's flags.
TEST(GatedAttentionModel, OtherBackendsAndCombinationsAreRefused) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 16;
  c.seq_length = c.max_position_embeddings = 4;
  c.vocab_size = c.padded_vocab_size = 16;
  for (bool gate : {true, false}) {
    GPTConfig x = c;
    x.attention_output_gate = gate;
    x.qk_l2_norm = !gate;
    EXPECT_TRUE(CreateModel(x, BackendOptions{}).ok());
    // The CUDA backend runs both (cuda_attention_variant_model_test): refused here for a missing device only,
    // if at all, never for the variant.
    BackendOptions cuda;
    cuda.device = Device::kCuda;
    auto on_cuda = CreateModel(x, cuda);
    EXPECT_EQ(std::string(on_cuda.status().message()).find(gate ? "attention_output_gate" : "qk_l2_norm"),
              std::string::npos)
        << on_cuda.status();
    GPTConfig mla = x;  // megatron-core has neither for multi-latent attention
    mla.multi_latent_attention = true;
    mla.kv_lora_rank = 4;
    mla.qk_head_dim = mla.qk_pos_emb_head_dim = mla.v_head_dim = 2;
    mla.mla_yarn = false;
    EXPECT_EQ(ParamLayout::Create(mla).status().code(), absl::StatusCode::kInvalidArgument);
  }
  GPTConfig both = c;  // megatron-core's spec would drop --qk-layernorm's norms for the L2 norm
  both.qk_l2_norm = both.qk_layernorm = true;
  EXPECT_EQ(ParamLayout::Create(both).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ptk
