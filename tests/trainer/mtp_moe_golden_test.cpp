// The CPU model's multi-token prediction with mixture-of-experts layers and multi-latent attention against
// megatron-core 0.16.1 itself (tests/support/gen_mtp_moe_golden.py: its GPTModel from get_gpt_decoder_block_spec
// with the MultiTokenPredictionBlock of get_gpt_mtp_block_spec, DDP, optimizer and scheduler on the CPU): two MoE
// depths with a shared expert after a dense and an MoE layer (mtp_moe), a dense depth after an MoE and a dense
// layer (mtp_moe_dense_last: the depth's layer is the decoder's last layer's kind), an MLA depth (mtp_mla), and an
// MoE + MLA depth with a sigmoid router, expert bias and a shared expert (mtp_moe_mla), and the attention variants in
// the depths' layers as in the decoder's: two depths with a sliding window (depth 1's layer, number 3, full under skip
// frequency 3, depth 2's windowed) and the learnable softmax offset (mtp_swa_learnable), the output gate with the
// query and key L2 norm (mtp_gated_l2), and MLA with the window and the learnable offset (mtp_mla_swa_learnable).
// The layout (Megatron's
// names, shapes and order), the first step's lm loss, grad norm, mtp_K losses, load-balancing loss (logged over the
// MoE layers plus the depths, as Megatron-LM) and every gradient within 1e-5 relative (fp32 sums in another order:
// the MoE and MLA goldens' bound), and three optimizer steps' losses, expert biases (bit for bit: sign steps of
// fp32 counts) and weights within 1e-4 (as the other megatron-core goldens: Adam's first steps amplify the last
// bits). The first step also at two tensor ranks with sequence parallelism, against the same numbers.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/golden_util.h"
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

class MtpMoeGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto cfg = g_.meta["config"];
    auto str = [&](const char* k) { return std::string(cfg[k].get_string().value()); };
    GPTConfig c = g_.Shape();
    c.init_method_std = g_.Num("init_method_std");
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
    c.swiglu = cfg["swiglu"].get_bool();
    c.gelu_exact = !c.swiglu;  // torch's exact GELU without the bias-GELU fusion
    c.hidden_dropout = c.attention_dropout = 0.0;
    c.normalization = str("normalization") == "RMSNorm" ? Normalization::kRMSNorm : Normalization::kLayerNorm;
    c.position_embedding =
        str("position_embedding_type") == "rope" ? PositionEmbedding::kRope : PositionEmbedding::kLearnedAbsolute;
    c.mtp_num_layers = g_.Int("mtp_num_layers");
    c.mtp_loss_scaling_factor = g_.Num("mtp_loss_scaling_factor");
    if (g_.Int("num_experts") > 0) {
      c.num_experts = g_.Int("num_experts");
      c.moe_router_topk = g_.Int("moe_router_topk");
      c.moe_ffn_hidden_size = g_.Int("moe_ffn_hidden_size");
      c.moe_router_pre_softmax = false;
      c.moe_aux_loss_coeff = g_.Num("moe_aux_loss_coeff");
      c.moe_router_sigmoid = str("moe_router_score_function") == "sigmoid";
      for (auto v : cfg["moe_layer_pattern"].get_array()) c.moe_layer_pattern.push_back(int(int64_t(v)));
      c.moe_shared_expert_intermediate_size = g_.Int("moe_shared_expert_intermediate_size");
      c.moe_router_enable_expert_bias = cfg["moe_router_enable_expert_bias"].get_bool();
      c.moe_router_bias_update_rate = g_.Num("moe_router_bias_update_rate");
    }
    if (cfg["mla"].get_bool()) {
      c.multi_latent_attention = true;
      c.qk_layernorm = cfg["qk_layernorm"].get_bool();
      c.q_lora_rank = g_.Int("q_lora_rank");
      c.kv_lora_rank = g_.Int("kv_lora_rank");
      c.qk_head_dim = g_.Int("qk_head_dim");
      c.qk_pos_emb_head_dim = g_.Int("qk_pos_emb_head_dim");
      c.v_head_dim = g_.Int("v_head_dim");
    }
    ReadAttentionVariants(&c);
    config_ = c;
  }
  // The attention variants of the depths' layers (the goldens before them have none of these keys).
  void ReadAttentionVariants(GPTConfig* c) {
    auto cfg = g_.meta["config"];
    auto has = [&](const char* k) { return !cfg[k].error() && !cfg[k].is_null(); };
    if (has("num_query_groups")) c->num_query_groups = g_.Int("num_query_groups");
    if (has("softmax_type")) c->softmax_type = std::string(cfg["softmax_type"].get_string().value());
    if (has("attention_output_gate")) c->attention_output_gate = cfg["attention_output_gate"].get_bool();
    if (has("qk_l2_norm")) c->qk_l2_norm = cfg["qk_l2_norm"].get_bool();
    if (!has("window_size")) return;
    c->window_left = int64_t(cfg["window_size"].at(0));
    ASSERT_TRUE(has("window_attn_skip_freq"));  // the goldens give a count: a list has no entries for the depths
    c->window_skip_freq = g_.Int("window_attn_skip_freq");
    for (int64_t l = 0; l < c->num_layers; ++l) c->window_pattern.push_back((l + 1) % c->window_skip_freq != 0);
  }
  std::unique_ptr<CpuGPTModel> MakeModel() {
    auto m = CpuGPTModel::Create(config_);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE((*m)->WriteParams(g_.InitWeights((*m)->layout())).ok());
    return std::move(*m);
  }
  double Want(int64_t step, const char* key) { return g_.meta["steps"].at(step)[key].get_double(); }
  double WantMtp(int64_t step, int64_t k) { return g_.meta["steps"].at(step)["mtp_losses"].at(k).get_double(); }

  // The first step at two tensor ranks (`sp`: with sequence parallelism) against megatron-core's numbers.
  void FirstStepAtTwoTensorRanks(bool sp);

  Golden g_{GetParam()};
  GoldenBatches batches_{g_};
  GPTConfig config_;
};

TEST_P(MtpMoeGolden, TheLayoutIsMegatronCores) {
  auto layout = ParamLayout::Create(config_);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->infos.size(), g_.meta["param_order"].get_array().size());
  std::vector<std::string> theirs, mine;  // the order, the attention's tensors aside (registered either way)
  int64_t count = 0;
  for (auto e : g_.meta["param_order"].get_array()) {
    const std::string name(e.get_string().value());
    const ParamInfo* p = layout->Find(name);
    ASSERT_NE(p, nullptr) << name;
    std::vector<int64_t> shape;
    for (auto d : g_.meta["tensors"]["init:" + name]["shape"].get_array()) shape.push_back(int64_t(d));
    EXPECT_EQ(p->shape, shape) << name;
    count += p->size;
    if (name.find("self_attention") == std::string::npos) theirs.push_back(name);
  }
  for (const ParamInfo& p : layout->infos)
    if (p.name.find("self_attention") == std::string::npos) mine.push_back(p.name);
  EXPECT_EQ(mine, theirs);
  EXPECT_EQ(layout->num_params, count);
  EXPECT_EQ(ParamsOnModelParallelRank(config_, 1, 1, 0, config_.num_layers), count);  // --dry-run's count
  for (const MtpLayerParams& mp : layout->mtp)                                        // the decoder's last layer's kind
    EXPECT_EQ(mp.layer.router_w >= 0, config_.moe_layer(config_.num_layers - 1));
  if (!g_.meta["config"]["window_layers"].error()) {  // is_layer_window_attention of the decoder's and depths' layers
    int64_t n = 0;
    for (auto w : g_.meta["config"]["window_layers"].get_array()) {
      EXPECT_EQ(config_.window_layer(n), w.get_bool().value()) << "layer number " << n + 1;
      ++n;
    }
    EXPECT_EQ(n, config_.num_layers + config_.mtp_num_layers);
  }
  std::vector<std::string> biases;
  for (const auto& [name, bias] : MakeModel()->ReadBuffers()) biases.push_back(name);
  std::vector<std::string> want;
  for (auto k : g_.meta["config"]["expert_bias_keys"].get_array()) want.emplace_back(k.get_string().value());
  EXPECT_EQ(biases, want);  // mtp.layers.K.transformer_layer.mlp.router.expert_bias after the decoder's
}

TEST_P(MtpMoeGolden, TheFirstStepsGradientsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  auto r = step.ComputeGradients(batches_.Step(0), 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(std::abs(r->lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
  EXPECT_LE(std::abs(r->grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
  EXPECT_LE(std::abs(r->load_balancing_loss - Want(0, "load_balancing_loss")), 1e-5);
  ASSERT_EQ(static_cast<int64_t>(r->mtp_losses.size()), config_.mtp_num_layers);
  for (int64_t k = 0; k < config_.mtp_num_layers; ++k)
    EXPECT_LE(std::abs(r->mtp_losses[k] - WantMtp(0, k)) / WantMtp(0, k), 1e-5) << "mtp_" << k + 1;
  double worst = 0;
  for (const ParamInfo& p : model->params_info()) {
    const double e = RelError(model->grads() + p.offset, g_.Tensor<float>("grad:" + p.name));
    EXPECT_LE(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  std::printf(
      "%s: loss %.9g (megatron %.9g), mtp_1 %.9g (%.9g), load balancing %.9g (%.9g), largest gradient "
      "difference %.3g\n",
      GetParam().c_str(), r->lm_loss(), Want(0, "lm_loss"), r->mtp_losses[0], WantMtp(0, 0), r->load_balancing_loss,
      Want(0, "load_balancing_loss"), worst);
}

// Two tensor ranks, with sequence parallelism and without (gloo ranks as threads, each its slices of megatron-core's
// initial weights; Megatron runs MoE under tensor parallelism with sequence parallelism only): megatron-core's first
// step within the same bounds, every gradient gathered from the ranks' slices after the training step's sum of the
// sequence-parallel partial gradients over the tensor group.
void MtpMoeGolden::FirstStepAtTwoTensorRanks(bool sp) {
  auto whole = ParamLayout::Create(config_);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<float> init = g_.InitWeights(*whole);
  std::vector<float> grads(static_cast<size_t>(whole->num_params), 0.0f);
  std::vector<StepResult> results(2);
  std::mutex mu;
  testing::RunRanks(2, [&](Communicator* tensor, int rank) {
    auto model = CpuGPTModel::Create(config_, tensor, sp);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<float> mine(static_cast<size_t>((*model)->num_params()));
    CopyToShard((*model)->layout(), init, mine);
    ASSERT_TRUE((*model)->WriteParams(mine).ok());
    auto data = MakeLocalCommunicator();  // one data-parallel rank
    TrainStep step(model->get(), g_.Optimizer(), g_.ConstantSchedule(), data.get());
    auto r = step.ComputeGradients(batches_.Step(0), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    const float* g = (*model)->grads();
    std::lock_guard<std::mutex> lock(mu);
    results[static_cast<size_t>(rank)] = *r;
    CopyFromShard((*model)->layout(), std::vector<float>(g, g + (*model)->num_params()), grads);
  });
  for (const StepResult& r : results) {
    EXPECT_LE(std::abs(r.lm_loss() - Want(0, "lm_loss")) / Want(0, "lm_loss"), 1e-5);
    EXPECT_LE(std::abs(r.grad_norm - Want(0, "grad_norm")) / Want(0, "grad_norm"), 1e-5);
    EXPECT_LE(std::abs(r.load_balancing_loss - Want(0, "load_balancing_loss")), 1e-5);
    ASSERT_EQ(static_cast<int64_t>(r.mtp_losses.size()), config_.mtp_num_layers);
    for (int64_t k = 0; k < config_.mtp_num_layers; ++k)
      EXPECT_LE(std::abs(r.mtp_losses[k] - WantMtp(0, k)) / WantMtp(0, k), 1e-5) << "mtp_" << k + 1;
  }
  double worst = 0;
  for (const ParamInfo& p : whole->infos) {
    const double e = RelError(grads.data() + p.offset, g_.Tensor<float>("grad:" + p.name));
    EXPECT_LE(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("%s at T=2%s: loss %.9g (megatron %.9g), mtp_1 %.9g (%.9g), largest gradient difference %.3g\n",
              GetParam().c_str(), sp ? " SP" : "", results[0].lm_loss(), Want(0, "lm_loss"), results[0].mtp_losses[0],
              WantMtp(0, 0), worst);
}

TEST_P(MtpMoeGolden, TwoSequenceParallelTensorRanksMatchMegatronsFirstStep) { FirstStepAtTwoTensorRanks(true); }

// Without sequence parallelism the layers every rank holds whole get the same gradient on every rank, but for the
// tensors whose gradient is each rank's heads' share (multi-latent attention's down projections and latent norms, the
// query and key norms), summed over the tensor group: the depths' too. (MoE under tensor parallelism needs sequence
// parallelism, as Megatron.)
TEST_P(MtpMoeGolden, TwoTensorRanksMatchMegatronsFirstStep) {
  if (config_.num_experts > 0) GTEST_SKIP() << "MoE with tensor ranks runs with sequence parallelism only";
  FirstStepAtTwoTensorRanks(false);
}

TEST_P(MtpMoeGolden, ThreeOptimizerStepsMatchMegatron) {
  auto model = MakeModel();
  auto comm = MakeLocalCommunicator();
  TrainStep step(model.get(), g_.Optimizer(), g_.ConstantSchedule(), comm.get());
  const int64_t steps = static_cast<int64_t>(g_.meta["steps"].get_array().size());
  for (int64_t s = 0; s < steps; ++s) {
    auto r = step.Step(batches_.Step(s), g_.GlobalBatch(), 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_LE(std::abs(r->lm_loss() - Want(s, "lm_loss")), 1e-5) << "step " << s;
    EXPECT_LE(std::abs(r->load_balancing_loss - Want(s, "load_balancing_loss")), 1e-5) << "step " << s;
    for (int64_t k = 0; k < config_.mtp_num_layers; ++k)
      EXPECT_LE(std::abs(r->mtp_losses[k] - WantMtp(s, k)), 1e-5) << "step " << s << " mtp_" << k + 1;
    for (const auto& [name, bias] : model->ReadBuffers())
      EXPECT_EQ(bias, g_.Tensor<float>(fmt::format("expert_bias:{}:{}", s, name))) << name << " step " << s;
  }
  for (const ParamInfo& p : model->params_info())
    EXPECT_LE(RelError(model->params() + p.offset, g_.Tensor<float>("final:" + p.name)), 1e-4) << p.name;
}

INSTANTIATE_TEST_SUITE_P(Goldens, MtpMoeGolden,
                         ::testing::Values("mtp_moe", "mtp_moe_dense_last", "mtp_mla", "mtp_moe_mla",
                                           "mtp_swa_learnable", "mtp_gated_l2", "mtp_mla_swa_learnable"));

// Expert parallelism: expert rank 1 of 2 holds the second half of every MoE layer's experts, the depths' too, under
// their local numbers (megatron's per-rank files), each tensor's whole_index its place in the whole model.
TEST(MtpMoeModel, ExpertRanksCutTheDepthsExpertsToo) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 16;
  c.seq_length = c.max_position_embeddings = 8;
  c.vocab_size = c.padded_vocab_size = 32;
  c.add_bias_linear = false;
  c.num_experts = 2;
  c.mtp_num_layers = 1;
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto cut = ParamLayout::Create(c, 1, 0, PipelineStage{}, /*expert_size=*/2, 1);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->num_params, whole->num_params - 3 * c.expert_floats());  // one expert of each of 3 MoE layers
  ASSERT_EQ(cut->mtp.size(), 1u);
  const MtpLayerParams& m = cut->mtp[0];
  const ParamInfo* fc1 = cut->Find("mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(m.layer.experts, fc1->offset);
  EXPECT_EQ(cut->Find("mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight"), nullptr);
  const size_t k = static_cast<size_t>(fc1 - cut->infos.data());
  EXPECT_EQ(whole->infos[cut->whole_index[k]].name,
            "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight");
  for (const int64_t at : {m.enorm_w, m.hnorm_w, m.eh_proj, m.norm_w, m.layer.ln1_w, m.layer.router_w}) {
    ASSERT_GE(at, 0);
    const ParamInfo* p = nullptr;
    for (const ParamInfo& i : cut->infos)
      if (i.offset == at) p = &i;
    ASSERT_NE(p, nullptr) << at;
    EXPECT_EQ(p->name.rfind("mtp.layers.0.", 0), 0u) << p->name;
  }
}

}  // namespace
}  // namespace ptk
