// ptk-train's multi-latent attention with tensor parallelism (CPU; ranks as processes over loopback gloo),
// megatron-core's MLA split: linear_q_proj / linear_q_up_proj and linear_kv_up_proj column-parallel by heads, the down
// projections and the latents' norms whole on every tensor rank, linear_proj row-parallel. T = 2 (with and without
// --sequence-parallel; with a q LoRA and --qk-layernorm under RMSNorm and RoPE, and without a q LoRA under LayerNorm
// and YaRN) gives one rank's lm losses within 1e-5 relative over 6 iterations with dropout on, and its weights after
// them within 5e-5; beside 2 data ranks (ZeRO-1) or 2 pipeline stages too; a T = 2 checkpoint holds each rank's slices
// under Megatron's names, resumes at T = 2 character for character and at T = 1 within 1e-5; what is not implemented
// is refused in one line, exit 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/mla_cli_model.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

constexpr const char* kLora = testing::kMlaLora;
// kLora without --qk-layernorm: the down projections' gradients are summed over the tensor ranks all the same (they
// were not without --sequence-parallel: T = 2 drifted from one rank's losses by 9e-6 relative in 6 iterations).
constexpr char kLoraNoNorms[] =
    " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4"
    " --v-head-dim 6 --normalization RMSNorm --rope-type rope";
constexpr char kNoLora[] =
    " --multi-latent-attention --kv-lora-rank 10 --qk-head-dim 6 --qk-pos-emb-head-dim 4 --v-head-dim 8"
    " --qk-layernorm --rope-type yarn --rotary-scaling-factor 2 --mscale-all-dim 1";

class MlaTensorParallelCli : public testing::RanksTest {
 protected:
  MlaTensorParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  // 2 layers, 4 heads, global batch 4 of micro-batches of 1, dropout on (Megatron's defaults), `T` tensor ranks.
  std::string Train(int T, const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) + " --tensor-model-parallel-size " + std::to_string(T) + " " + extra;
  }
  // The model of kLora.
  static GPTConfig LoraModel() { return testing::MlaLoraModel(); }
  // The whole model's weights of the checkpoint saved in `dir` at iteration `it` (put together from its tensor ranks).
  static std::vector<float> Weights(const std::string& dir, int64_t it) {
    auto whole = ParamLayout::Create(LoraModel());
    EXPECT_TRUE(whole.ok()) << whole.status();
    std::vector<float> p, m, v;
    TrainState st;
    const absl::Status s = LoadCheckpoint(dir, it, *whole, &p, &m, &v, &st);
    EXPECT_TRUE(s.ok()) << s;
    return p;
  }
};

TEST_F(MlaTensorParallelCli, TwoTensorRanksGiveOneRanksLossesAndWeights) {
  for (const auto& [what, model] : {std::pair{"q LoRA, RMSNorm, RoPE", kLora},
                                    {"no q LoRA, LayerNorm, YaRN", kNoLora},
                                    {"q LoRA without latent norms", kLoraNoNorms}}) {
    SCOPED_TRACE(what);
    const std::string one_dir = dir_ / "one";
    auto one = RunCmd(Train(1, std::string(model) + " --save " + ShellQuote(one_dir)));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const auto ref = Losses(one.output);
    ASSERT_EQ(ref.size(), 6u) << one.output;
    for (const char* sp : {"", " --sequence-parallel"}) {
      const std::string label = std::string(what) + ", T=2" + sp, tp_dir = dir_ / "tp";
      std::string out;
      ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, model + std::string(sp) + " --save " + ShellQuote(tp_dir)),
                                              ref, 6, model == kLoraNoNorms ? 2e-6 : 1e-5, label, &out));
      EXPECT_NE(out.find("> initialized tensor model parallel with size 2"), std::string::npos) << out;
      if (model != kLora) continue;
      const std::vector<float> a = Weights(one_dir, 6), b = Weights(tp_dir, 6);
      ASSERT_EQ(a.size(), b.size());
      float worst = 0;
      for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
      EXPECT_LT(worst, 5e-5f) << label;
      std::printf("%s: largest weight difference from one rank's after 6 iterations: %.3g\n", label.c_str(), worst);
      RunCmd("rm -rf " + ShellQuote(tp_dir));
    }
    RunCmd("rm -rf " + ShellQuote(one_dir));
  }
}

// T = 2 beside 2 data ranks with ZeRO-1 and beside 2 pipeline stages (4 ranks each): one rank's losses.
TEST_F(MlaTensorParallelCli, TensorRanksBesideDataAndPipelineRanksGiveOneRanksLosses) {
  auto one = RunCmd(Train(1, kLora));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 6u) << one.output;
  for (const char* other : {" --use-distributed-optimizer", " --sequence-parallel --pipeline-model-parallel-size 2"}) {
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, kLora + std::string(other)), ref, 6, 1e-5,
                                            std::string("MLA T=2 with") + other, &out));
  }
}

// A T = 2 checkpoint: each rank's slices under Megatron's names and shapes, a stopped run resumed bit for bit, and
// at T = 1 one rank's losses.
TEST_F(MlaTensorParallelCli, CheckpointsHoldEachRanksSlicesResumeAndReshard) {
  const auto train = [&](const std::string& extra) { return Train(2, kLora + (" --sequence-parallel " + extra), 20); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/2, p 1/1 ]", {"mp_rank_00", "mp_rank_01"}, "mp_rank_02"));
  const std::string a = "decoder.layers.1.self_attention.";
  for (int rank : {0, 1}) {
    auto layout = ParamLayout::Create(LoraModel(), 2, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    // Heads 2 of 4 per rank: the up projections' rows split, the down projections and latent norms whole.
    for (const auto& [name, shape] :
         std::vector<std::pair<std::string, std::vector<int64_t>>>{{a + "linear_q_down_proj.weight", {16, 32}},
                                                                   {a + "linear_q_up_proj.weight", {24, 16}},
                                                                   {a + "linear_kv_down_proj.weight", {16, 32}},
                                                                   {a + "linear_kv_up_proj.weight", {28, 12}},
                                                                   {a + "q_layernorm.weight", {16}},
                                                                   {a + "kv_layernorm.weight", {12}},
                                                                   {a + "linear_proj.weight", {32, 12}}}) {
      const ParamInfo* p = layout->Find(name);
      ASSERT_NE(p, nullptr) << name;
      EXPECT_EQ(p->shape, shape) << name;
    }
    std::vector<float> p, m, v;
    TrainState st;
    const absl::Status s = LoadCheckpoint(dir_ / "ck1", 10, *layout, &p, &m, &v, &st);
    EXPECT_TRUE(s.ok()) << s;
  }
  auto one = RunCmd(Train(1, kLora, 20));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto t1 = RunCmd(Train(1, kLora + (" --load " + ShellQuote(dir_ / "ck1")), 20));
  ASSERT_EQ(t1.exit_code, 0) << t1.output;
  EXPECT_NE(t1.output.find("saved with --tensor-model-parallel-size 2): the saved ranks' slices"), std::string::npos)
      << t1.output;
  ASSERT_EQ(Losses(t1.output).size(), 10u) << t1.output;
  EXPECT_LT(Worst(Losses(t1.output), Losses(one.output)), 1e-5);
  std::printf("MLA T=2 checkpoint resumed at T=1: %.3g largest relative difference from one rank's losses\n",
              Worst(Losses(t1.output), Losses(one.output)));
}

TEST_F(MlaTensorParallelCli, WhatIsNotImplementedIsRefusedInOneLine) {
  const std::string base = testing::MockRunOf(2) + kLora;
  const std::vector<std::pair<std::string, std::string>> cases = {
      // --context-parallel-size (mla_cp_train_cli_test) and --mtp-num-layers with tensor ranks
      // (mtp_parallel_cli_test's DeepSeekLikeMlaAndMoe...) run.
      {" --tensor-model-parallel-size 3",
       "usage error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"},
      {" --tensor-model-parallel-size 2 --device cuda", "usage error: --multi-latent-attention on --device cuda"},
  };
  testing::ExpectUsageErrors(base, cases, /*one_line=*/true);
  // A tensor-parallel MLA plan is accepted (a dry run's).
  auto ok = RunCmd("WORLD_SIZE=2 " + base + " --tensor-model-parallel-size 2 --sequence-parallel --dry-run");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
}  // namespace ptk
