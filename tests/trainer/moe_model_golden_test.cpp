// The CPU model's mixture-of-experts layers against megatron-core 0.16.1 itself
// (tests/support/gen_moe_golden.py: its GPTModel with TopKRouter and SequentialMLP experts, its DDP,
// optimizer and scheduler on the CPU): a GELU model with MoE, dense and MoE layers (top-2 of 4,
// softmax after top-k), a SwiGLU one with every layer MoE (top-3, softmax before top-k) and a GELU one
// routed by sigmoid scores (dense, MoE, MoE layers), and the first with --calculate-per-token-loss and a
// quarter of the tokens masked, all with the load-balancing loss; the router's options: the z-loss (per
// micro-batch and per token), group-limited routing (8 experts in 4 groups, softmax before and after the top
// k, sigmoid) and the top-k scaling factor; shared experts (tests/support/gen_moe_shared_golden.py: GELU ones on
// MoE, dense, MoE layers, gated SwiGLU ones on every layer); load balancing: the expert bias (its updates bit for
// bit), seq_aux_loss and global_aux_loss; token dropping by capacity (probs and position policies). The layout
// (Megatron's names, shapes and order of the MoE parameters), the first step's lm loss, grad norm, load_balancing_loss
// and every gradient within 1e-5 relative, and three optimizer steps' losses and the weights after them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/golden_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/backend.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"
#include "trainer/parallel_params.h"
#include "trainer/param_layout.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::Golden;
using testing::GoldenBatches;
using testing::RelError;

class MoeGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    GPTConfig c = g_.Shape();
    c.init_method_std = g_.Num("init_method_std");
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
    c.swiglu = g_.meta["config"]["swiglu"].get_bool();
    c.gelu_exact = !c.swiglu;  // Megatron's GELU MLP without biases: torch's exact GELU
    c.hidden_dropout = c.attention_dropout = 0.0;
    c.num_experts = g_.Int("num_experts");
    c.moe_router_topk = g_.Int("moe_router_topk");
    c.moe_ffn_hidden_size = g_.Int("moe_ffn_hidden_size");
    c.moe_router_pre_softmax = g_.meta["config"]["moe_router_pre_softmax"].get_bool();
    c.moe_aux_loss_coeff = g_.Num("moe_aux_loss_coeff");
    c.moe_router_sigmoid = g_.meta["config"]["moe_router_score_function"].get_string().value() == "sigmoid";
    for (auto v : g_.meta["config"]["moe_layer_pattern"].get_array()) c.moe_layer_pattern.push_back(int(int64_t(v)));
    c.moe_z_loss_coeff = Config("moe_z_loss_coeff");
    c.moe_router_topk_scaling_factor = Config("moe_router_topk_scaling_factor");
    c.moe_router_num_groups = static_cast<int64_t>(Config("moe_router_num_groups"));
    c.moe_router_group_topk = static_cast<int64_t>(Config("moe_router_group_topk"));
    // Shared experts (gen_moe_shared_golden.py's goldens; the others lack the keys: none).
    c.moe_shared_expert_intermediate_size = static_cast<int64_t>(Config("moe_shared_expert_intermediate_size"));
    c.moe_shared_expert_gate = Config("moe_shared_expert_gate") != 0;
    // Load balancing (the goldens written before it lack the keys: aux_loss, no expert bias).
    std::string_view type;
    if (g_.meta["config"]["moe_router_load_balancing_type"].get(type)) type = "aux_loss";
    if (type == "seq_aux_loss") std::swap(c.moe_seq_aux_loss_coeff, c.moe_aux_loss_coeff);
    if (type == "global_aux_loss") std::swap(c.moe_global_aux_loss_coeff, c.moe_aux_loss_coeff);
    bool bias = false;
    c.moe_router_enable_expert_bias = !g_.meta["config"]["moe_router_enable_expert_bias"].get(bias) && bias;
    if (c.moe_router_enable_expert_bias) c.moe_router_bias_update_rate = Config("moe_router_bias_update_rate");
    // Token dropping (the moe_capacity_* goldens; the others lack the keys: dropless).
    double factor = -1;
    if (!g_.meta["config"]["moe_expert_capacity_factor"].get(factor)) c.moe_expert_capacity_factor = factor;
    std::string_view policy;
    if (!g_.meta["config"]["moe_token_drop_policy"].get(policy)) c.moe_token_drop_position = policy == "position";
    config_ = c;
  }
  std::unique_ptr<CpuGPTModel> MakeModel() {
    auto m = CpuGPTModel::Create(config_);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE((*m)->WriteParams(g_.InitWeights((*m)->layout())).ok());
    return std::move(*m);
  }
  SchedulerConfig Schedule() { return g_.ConstantSchedule(); }
  OptimizerConfig Optimizer() {
    OptimizerConfig o = g_.Optimizer();
    o.calculate_per_token_loss = g_.meta["config"]["calculate_per_token_loss"].get_bool();
    return o;
  }
  int64_t GlobalBatch() { return g_.GlobalBatch(); }
  double Want(int64_t step, const char* key) {
    double v = 0;  // 0 for a z_loss the goldens written before the router's options lack (they have none)
    return g_.meta["steps"].at(step)[key].get(v) ? 0.0 : v;
  }
  // The router's options, which the goldens written before them lack (Megatron's defaults: none, 0 here).
  double Config(const char* key) {
    double v = 0;
    return g_.meta["config"][key].get(v) ? 0.0 : v;
  }

  Golden g_{GetParam()};
  GoldenBatches batches_{g_};
  GPTConfig config_;
};

TEST_P(MoeGolden, TheLayoutIsMegatronCores) {
  auto layout = ParamLayout::Create(config_);
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Every tensor megatron-core has, of its shape, and no other.
  EXPECT_EQ(layout->infos.size(), g_.meta["param_order"].get_array().size());
  std::vector<std::string> mlp;  // megatron-core's order of the MLP parameters
  for (auto e : g_.meta["param_order"].get_array()) {
    const std::string name(e.get_string().value());
    const ParamInfo* p = layout->Find(name);
    ASSERT_NE(p, nullptr) << name;
    std::vector<int64_t> shape;
    for (auto d : g_.meta["tensors"]["init:" + name]["shape"].get_array()) shape.push_back(int64_t(d));
    EXPECT_EQ(p->shape, shape) << name;
    if (name.find(".mlp.") != std::string::npos) mlp.push_back(name);
  }
  std::vector<std::string> mine;
  for (const ParamInfo& p : layout->infos)
    if (p.name.find(".mlp.") != std::string::npos) mine.push_back(p.name);
  EXPECT_EQ(mine, mlp);
  for (int64_t l = 0; l < config_.num_layers; ++l)
    EXPECT_EQ(layout->layers[l].router_w >= 0, config_.moe_layer(l)) << "layer " << l;
}

TEST_P(MoeGolden, TheFirstStepsGradientsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(std::abs(r->lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
  EXPECT_LE(std::abs(r->grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
  EXPECT_LE(std::abs(r->load_balancing_loss - Want(0, "load_balancing_loss")), 1e-6);
  EXPECT_LE(std::abs(r->z_loss - Want(0, "z_loss")), 1e-6 * std::max(1.0, Want(0, "z_loss")));
  EXPECT_LE(std::abs(r->seq_load_balancing_loss - Want(0, "seq_load_balancing_loss")), 1e-6);
  EXPECT_LE(std::abs(r->global_load_balancing_loss - Want(0, "global_load_balancing_loss")), 1e-6);
  double worst = 0;
  for (const ParamInfo& p : model->params_info()) {
    const double e = RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name));
    EXPECT_LE(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  std::printf(
      "loss %.9g (megatron %.9g), load_balancing_loss %.9g (megatron %.9g), z_loss %.9g (megatron %.9g), largest "
      "gradient difference %.3g\n",
      r->lm_loss(), Want(0, "lm_loss"), r->load_balancing_loss, Want(0, "load_balancing_loss"), r->z_loss,
      Want(0, "z_loss"), worst);
}

// Without the z-loss's gradient the routers' gradients differ from Megatron's (the comparison above sees it);
// the log line puts z_loss where Megatron's tracker has it, before load_balancing_loss.
TEST_P(MoeGolden, TheRoutersGradientHoldsTheZLoss) {
  if (config_.moe_z_loss_coeff == 0) GTEST_SKIP() << "no z-loss in " << GetParam();
  std::vector<std::string> order;
  for (auto k : g_.meta["steps"].at(0)["tracker_order"].get_array()) order.emplace_back(k.get_string().value());
  EXPECT_EQ(order, (std::vector<std::string>{"z_loss", "load_balancing_loss"}));
  config_.moe_z_loss_coeff = 0;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->z_loss, 0.0);
  int64_t first = 0;
  while (!config_.moe_layer(first)) ++first;
  const ParamInfo* router = model->FindParam(fmt::format("decoder.layers.{}.mlp.router.weight", first));
  ASSERT_NE(router, nullptr);
  EXPECT_GT(RelError(model->grads() + router->offset, g_.Tensor<float>("grad:" + router->name)), 1e-4);
}

// Without the load-balancing loss's gradient the router's gradients differ from Megatron's: the
// comparison above sees it.
TEST_P(MoeGolden, TheRoutersGradientHoldsTheLoadBalancingLoss) {
  GPTConfig no_aux = config_;
  no_aux.moe_aux_loss_coeff = no_aux.moe_seq_aux_loss_coeff = no_aux.moe_global_aux_loss_coeff = 0;
  config_ = no_aux;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->load_balancing_loss, 0.0);  // Megatron logs none without a coefficient
  int64_t first = 0;                       // the first MoE layer
  while (!config_.moe_layer(first)) ++first;
  const ParamInfo* router = model->FindParam(fmt::format("decoder.layers.{}.mlp.router.weight", first));
  ASSERT_NE(router, nullptr);
  EXPECT_GT(RelError(model->grads() + router->offset, g_.Tensor<float>("grad:" + router->name)), 1e-3);
}

// Without the capacity the gradients differ from Megatron's (its tokens really dropped: the script asserts it).
TEST_P(MoeGolden, TheDroppedTokensShowInTheGradients) {
  if (config_.moe_expert_capacity_factor < 0) GTEST_SKIP() << "no capacity in " << GetParam();
  config_.moe_expert_capacity_factor = -1;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  const ParamInfo* fc2 = model->FindParam("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight");
  ASSERT_NE(fc2, nullptr);
  EXPECT_GT(RelError(model->grads() + fc2->offset, g_.Tensor<float>("grad:" + fc2->name)), 1e-3);
}

// The activation plan (--dry-run's, the memory check's) counts at most each expert's capacity of rows: it bounds
// what a pass holds and is below the dropless plan.
TEST_P(MoeGolden, TheActivationPlanCountsTheCapacity) {
  if (config_.moe_expert_capacity_factor < 0) GTEST_SKIP() << "no capacity in " << GetParam();
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  ASSERT_TRUE(step.ComputeGradients(batches_.Step(0), 0).ok());
  const int64_t mbs = g_.Int("micro_batch_size"), plan = CpuGPTModel::PlanActivationFloats(model->layout(), false, mbs);
  EXPECT_LE(model->ActivationFloats(), plan);
  GPTConfig dropless = config_;
  dropless.moe_expert_capacity_factor = -1;
  auto layout = ParamLayout::Create(dropless);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_LT(plan, CpuGPTModel::PlanActivationFloats(*layout, false, mbs));
}

TEST_P(MoeGolden, ThreeOptimizerStepsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  const int64_t steps = static_cast<int64_t>(g_.meta["steps"].get_array().size());
  for (int64_t s = 0; s < steps; ++s) {
    auto r = step.Step(batches_.Step(s), GlobalBatch(), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(std::abs(r->lm_loss() - Want(s, "lm_loss")), 1e-5) << "step " << s;
    EXPECT_LE(std::abs(r->load_balancing_loss - Want(s, "load_balancing_loss")), 1e-5) << "step " << s;
    EXPECT_LE(std::abs(r->z_loss - Want(s, "z_loss")), 1e-5 * std::max(1.0, Want(s, "z_loss"))) << "step " << s;
    // seq_aux_loss's and global_aux_loss's logged values (0 where the golden has none), and the expert biases
    // after the step's update: bit for bit (each a sum of +-rate in fp32, as Megatron's).
    EXPECT_LE(std::abs(r->seq_load_balancing_loss - Want(s, "seq_load_balancing_loss")), 1e-5) << "step " << s;
    EXPECT_LE(std::abs(r->global_load_balancing_loss - Want(s, "global_load_balancing_loss")), 1e-5) << "step " << s;
    for (const auto& [name, bias] : model->ReadBuffers())
      EXPECT_EQ(bias, g_.Tensor<float>(fmt::format("expert_bias:{}:{}", s, name))) << name << " step " << s;
  }
  for (const ParamInfo& p : model->params_info())
    EXPECT_LE(RelError(model->params() + p.offset, g_.Tensor<float>("final:" + p.name)), 1e-4)
        << p.name;  // as the Llama golden: Adam's first steps amplify
}

// The expert biases are Megatron's state-dict buffers (decoder.layers.L.mlp.router.expert_bias, one per MoE layer;
// local_tokens_per_expert is not persistent), and without them the routing, so the weights, differ from
// Megatron's after three steps.
TEST_P(MoeGolden, TheExpertBiasIsMegatronsBufferAndChangesTheRouting) {
  if (!config_.moe_router_enable_expert_bias) GTEST_SKIP() << "no expert bias in " << GetParam();
  std::vector<std::string> want, mine;
  for (auto k : g_.meta["config"]["state_dict_keys"].get_array())
    if (std::string name(k.get_string().value()); name.ends_with("expert_bias")) want.push_back(name);
  for (const auto& [name, bias] : MakeModel()->ReadBuffers()) mine.push_back(name);
  EXPECT_EQ(mine, want);
  config_.moe_router_enable_expert_bias = false;
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), Optimizer(), Schedule(), comm.get());
  for (int64_t s = 0; s < 3; ++s) ASSERT_TRUE(step.Step(batches_.Step(s), GlobalBatch(), 0).ok());
  EXPECT_TRUE(model->ReadBuffers().empty());
  double worst = 0;
  for (const ParamInfo& p : model->params_info())
    worst = std::max(worst, RelError(model->params() + p.offset, g_.Tensor<float>("final:" + p.name)));
  EXPECT_GT(worst, 1e-3);
}

// What the MoE layers do not run with is refused by the library too, not only by ptk-train's flags.
TEST(MoeModel, OtherBackendsAndLayoutsAreRefused) {
  GPTConfig c = testing::SmallGpt(2, 8, 2, 4, 16, 16);
  c.ffn_hidden_size = 16;
  c.add_bias_linear = false;
  c.num_experts = 4;
  BackendOptions cuda;
  cuda.device = Device::kCuda;
  // The CUDA backend's MoE is dropless and data-parallel: what it lacks is refused before the device is looked for.
  c.moe_global_aux_loss_coeff = 0.01;
  EXPECT_EQ(CreateModel(c, cuda).status().code(), absl::StatusCode::kUnimplemented);
  c.moe_global_aux_loss_coeff = 0;
  // Shared experts, group-limited routing and seq_aux_loss run on CUDA: not refused as missing there.
  c.moe_shared_expert_intermediate_size = 8;
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_seq_aux_loss_coeff = 0.01;
  const absl::Status runs = CreateModel(c, cuda).status();
  EXPECT_EQ(runs.message().find("mixture-of-experts layers have no"), std::string_view::npos) << runs;
  c.moe_router_num_groups = 128;  // more groups than the CUDA router's mask
  c.num_experts = 128;
  EXPECT_EQ(CreateModel(c, cuda).status().code(), absl::StatusCode::kUnimplemented);
  c.num_experts = 4;
  c.moe_router_num_groups = c.moe_router_group_topk = 0;
  c.moe_seq_aux_loss_coeff = 0;
  c.moe_shared_expert_intermediate_size = 0;
  c.moe_expert_capacity_factor = 1.0;
  EXPECT_EQ(CreateModel(c, cuda).status().code(), absl::StatusCode::kUnimplemented);
  c.moe_expert_capacity_factor = -1.0;
  BackendOptions stage;  // pipeline stages hold their layers' experts
  stage.pipeline_stage = PipelineStage{2, 0, 0, 1};
  EXPECT_TRUE(CreateModel(c, stage).ok());
  EXPECT_TRUE(ParamLayout::Create(c, /*tensor_size=*/2, 0).ok());  // tensor ranks hold a slice of every expert
  c.moe_ffn_hidden_size = 9;                                       // one no tensor size 2 divides
  EXPECT_FALSE(ParamLayout::Create(c, /*tensor_size=*/2, 0).ok());
  c.moe_ffn_hidden_size = 0;
  EXPECT_TRUE(CreateModel(c, BackendOptions{}).ok());
  c.add_bias_linear = true;  // the experts have no biases
  EXPECT_FALSE(ParamLayout::Create(c).ok());
  c.add_bias_linear = false;
  c.moe_router_topk = 5;  // more than the experts
  EXPECT_FALSE(ParamLayout::Create(c).ok());
}

// --dry-run's count per pipeline stage (ParamsOnModelParallelRank with the stage's MoE layers) is what each
// stage's layout holds: P = 2 with two layers each, P = 2 interleaved (layers 0 and 2 on stage 0), P = 4.
TEST(MoeModel, EachStageHoldsItsLayersExpertsAsTheDryRunCounts) {
  GPTConfig c = testing::SmallGpt(4, 8, 2, 4, 16, 16);
  c.ffn_hidden_size = 16;
  c.add_bias_linear = false;
  c.num_experts = 3;
  c.moe_ffn_hidden_size = 6;
  c.moe_layer_pattern = {1, 0, 1, 1};
  for (const auto& [P, V, moe] :
       {std::tuple{2, 1, std::vector<int64_t>{1, 2}}, std::tuple{2, 2, std::vector<int64_t>{2, 1}},
        std::tuple{4, 1, std::vector<int64_t>{1, 0, 1, 1}}}) {
    const std::vector<int64_t> layers(static_cast<size_t>(P), c.num_layers / P);
    for (int p = 0; p < P; ++p) {
      const PipelineStage st = StageOf(layers, p, V);
      EXPECT_EQ(MoeLayersOnStage(c, st), moe[static_cast<size_t>(p)]) << P << " " << V << " " << p;
      auto layout = ParamLayout::Create(c, 1, 0, st);
      ASSERT_TRUE(layout.ok()) << layout.status();
      EXPECT_EQ(layout->num_params, ParamsOnModelParallelRank(c, 1, P, p, layers[0], MoeLayersOnStage(c, st)))
          << P << " " << V << " " << p;
    }
  }
}

// Shared experts: each MoE layer's on the stage that holds it, counted as the dry run counts them, and whole on
// every expert rank (not expert-parallel), after the rank's experts.
TEST(MoeModel, SharedExpertsAreOnEachStageAndEveryExpertRank) {
  GPTConfig c = testing::SmallGpt(4, 8, 2, 4, 16, 16);
  c.ffn_hidden_size = 16;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 6;
  c.moe_layer_pattern = {1, 0, 1, 1};
  c.moe_shared_expert_intermediate_size = 5;
  c.moe_shared_expert_gate = true;
  EXPECT_EQ(c.shared_expert_floats(), 3 * 5 * 8 + 8);
  const std::vector<int64_t> layers{2, 2};
  for (int p = 0; p < 2; ++p) {
    const PipelineStage st = StageOf(layers, p);
    auto layout = ParamLayout::Create(c, 1, 0, st);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->num_params, ParamsOnModelParallelRank(c, 1, 2, p, 2, MoeLayersOnStage(c, st))) << p;
    const LayerParams& lp = layout->layers[1];
    EXPECT_EQ(lp.shared_fc1 >= 0, p == 1) << p;  // layer 1 is dense, layer 3 MoE
  }
  c.moe_shared_expert_gate = false;
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->Find("decoder.layers.0.mlp.shared_experts.gate_weight"), nullptr);
  for (int r = 0; r < 2; ++r) {
    auto ep = ParamLayout::Create(c, 1, 0, {}, /*expert_size=*/2, r);
    ASSERT_TRUE(ep.ok()) << ep.status();
    const ParamInfo* fc1 = ep->Find("decoder.layers.2.mlp.shared_experts.linear_fc1.weight");
    ASSERT_NE(fc1, nullptr);
    EXPECT_FALSE(fc1->expert);
    EXPECT_EQ(ep->layers[2].shared_fc1, fc1->offset);
    EXPECT_EQ(ep->layers[2].shared_fc2, fc1->offset + fc1->size);
    EXPECT_EQ(ep->num_params, whole->num_params - 3 * 2 * c.expert_floats());  // 2 of 4 experts on 3 MoE layers
  }
  c.moe_shared_expert_intermediate_size = -1;
  EXPECT_FALSE(ParamLayout::Create(c).ok());
}

INSTANTIATE_TEST_SUITE_P(Megatron, MoeGolden,
                         ::testing::Values("moe_gelu", "moe_swiglu", "moe_sigmoid", "moe_per_token", "moe_zloss",
                                           "moe_zloss_per_token", "moe_groups", "moe_groups_softmax",
                                           "moe_groups_sigmoid", "moe_shared", "moe_shared_gate", "moe_expert_bias",
                                           "moe_seq_aux", "moe_global_aux", "moe_capacity_probs",
                                           "moe_capacity_position"));

}  // namespace
}  // namespace ptk
