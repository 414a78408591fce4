// ptk-train's mixture-of-experts layers with tensor parallelism (CPU, --sequence-parallel as Megatron requires),
// ranks as processes over loopback gloo: T = 2 gives one rank's lm losses and load_balancing_loss within 1e-5
// relative over 6 iterations with dropout on (GELU experts with the aux loss; SwiGLU experts with gated shared
// experts; sigmoid routing with a top-k scaling factor, group-limited routing and a dense layer), and beside 2 data
// ranks (ZeRO-1), 2 pipeline stages or 2 context ranks; a T = 2 checkpoint
// (iter_N/mp_rank_00 and mp_rank_01, each rank's expert slices under Megatron's SequentialMLP names) resumes at
// T = 2 with the uninterrupted run's lines character for character and at T = 1 within 1e-5; the z-loss, the
// seq_aux_loss/global_aux_loss types, the expert bias and the capacity factor as megatron-core 0.16.1 has them at
// T = 2 (one rank's where Megatron's are, each rank's own tokens' where Megatron's are), resumed bit for bit; the
// combinations left refused are refused in one line, exit 2.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/moe_ranks_cli_support.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class MoeTensorParallelCli : public testing::MoeRanksCliTest {
 protected:
  // 2 layers, global batch 4 of micro-batches of 1, dropout on (Megatron's defaults), `T` tensor ranks.
  std::string Train(int T, const std::string& extra, int64_t iters = 6) override {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) +
           " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear"
           " --tensor-model-parallel-size " +
           std::to_string(T) + (T > 1 ? " --sequence-parallel" : "") + " " + extra;
  }
  // The load_balancing_loss of each log line.
  static std::vector<double> Balancing(const std::string& out) { return Entry(out, "load_balancing_loss"); }
};

TEST_F(MoeTensorParallelCli, TwoTensorRanksGiveOneRanksLossesAndBalancingLoss) {
  const std::vector<std::pair<std::string, std::string>> models = {
      {"GELU experts, aux loss", "--moe-aux-loss-coeff 0.01"},
      {"SwiGLU experts, gated shared experts, aux loss",
       "--swiglu --moe-aux-loss-coeff 0.01 --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate"},
      {"sigmoid routing, scaling, groups, a dense layer",
       "--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2 --moe-router-num-groups 2 "
       "--moe-router-group-topk 2 --moe-layer-freq '[1,0]' --moe-aux-loss-coeff 0.01"},
      {"softmax after top-k, no aux loss", "--moe-router-pre-softmax --normalization RMSNorm"},
  };
  for (const auto& [what, flags] : models) {
    SCOPED_TRACE(what);
    auto one = RunCmd(Train(1, flags));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const auto ref = Losses(one.output);
    ASSERT_EQ(ref.size(), 6u) << one.output;
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, flags), ref, 6, 1e-5, what + " T=2", &out));
    EXPECT_NE(out.find("> initialized tensor model parallel with size 2"), std::string::npos) << out;
    const auto b1 = Balancing(one.output), b2 = Balancing(out);
    ASSERT_EQ(b1.size(), b2.size()) << out;
    for (size_t i = 0; i < b1.size(); ++i) EXPECT_NEAR(b2[i], b1[i], 1e-5 * b1[i]) << "line " << i;
  }
}

// T = 2 beside 2 data ranks with ZeRO-1, 2 pipeline stages and 2 context ranks (4 ranks each): one rank's losses.
TEST_F(MoeTensorParallelCli, TensorRanksBesideDataPipelineAndContextRanksGiveOneRanksLosses) {
  const std::string flags = "--moe-aux-loss-coeff 0.01 --swiglu";
  auto one = RunCmd(Train(1, flags));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 6u) << one.output;
  for (const char* other :
       {"--use-distributed-optimizer", "--pipeline-model-parallel-size 2", "--context-parallel-size 2"}) {
    const std::string what = std::string("T=2 with ") + other;
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, flags + " " + other), ref, 6, 1e-5, what, &out));
  }
}

// A T = 2 checkpoint: each rank's expert slices under Megatron's names and shapes (LoadCheckpoint checks every
// name and shape against a rank's layout), a stopped run resumed bit for bit, and at T = 1 one rank's losses.
TEST_F(MoeTensorParallelCli, CheckpointsHoldEachRanksSlicesAndResume) {
  const std::string flags = "--swiglu --moe-aux-loss-coeff 0.01";
  const auto train = [&](const std::string& extra) { return Train(2, flags + " " + extra, 20); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/2, p 1/1 ]", {"mp_rank_00", "mp_rank_01"}, "mp_rank_02"));
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.add_bias_linear = false;
  c.swiglu = true;
  c.ffn_hidden_size = 64;  // Megatron's SwiGLU default for hidden 32: 4h x 2/3 down to a multiple of 64
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  c.moe_aux_loss_coeff = 0.01;
  for (int rank : {0, 1}) {
    auto layout = ParamLayout::Create(c, 2, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    bool sliced = false;
    for (const ParamInfo& p : layout->infos)
      if (p.name == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
        sliced = p.shape == std::vector<int64_t>{48, 32};  // [gate; up] of 24 rows each
    EXPECT_TRUE(sliced);
    std::vector<float> p, m, v;
    TrainState st;
    const absl::Status s = LoadCheckpoint(dir_ / "ck1", 10, *layout, &p, &m, &v, &st);
    EXPECT_TRUE(s.ok()) << s;
  }
  auto one = RunCmd(Train(1, flags, 20));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto t1 = RunCmd(Train(1, flags + " --load " + ShellQuote(dir_ / "ck1"), 20));
  ASSERT_EQ(t1.exit_code, 0) << t1.output;
  EXPECT_NE(t1.output.find("saved with --tensor-model-parallel-size 2): the saved ranks' slices"), std::string::npos)
      << t1.output;
  ASSERT_EQ(Losses(t1.output).size(), 10u) << t1.output;
  EXPECT_LT(Worst(Losses(t1.output), Losses(one.output)), 1e-5);
  std::printf("T=2 MoE checkpoint resumed at T=1: %.3g largest relative difference from one rank's losses\n",
              Worst(Losses(t1.output), Losses(one.output)));
  // ptk-convert reads it (the slices put together) and writes Megatron's layout at T = 2, which reads back.
  const std::string mg = dir_ / "megatron", back = dir_ / "back";
  auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver megatron --target-tensor-parallel-size 2" +
                  " --load-dir " + ShellQuote(dir_ / "ck4") + " --save-dir " + ShellQuote(mg));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(mg) / "iter_0000010/mp_rank_01")) << e.output;
  e = RunCmd(testing::Tool("ptk-convert") + " --loader megatron --saver ptk --load-dir " + ShellQuote(mg) +
             " --save-dir " + ShellQuote(back));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<float> a, b, m, v;
  TrainState st;
  ASSERT_TRUE(LoadCheckpoint(dir_ / "ck4", 10, *whole, &a, &m, &v, &st).ok());
  const absl::Status s = LoadCheckpoint(back, 10, *whole, &b, &m, &v, &st);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(a, b);
}

// The z-loss, the seq_aux_loss and global_aux_loss types, the expert bias and a capacity no rank's tokens exceed:
// megatron-core 0.16.1's values at T = 2 are T = 1's (the tokens per expert summed over the tensor group, the losses'
// totals the whole sequence's, the z-loss's coefficient over T each rank on its own tokens), so T = 2 gives one
// rank's losses and balancing losses within 1e-5; the z_loss logged is the last tensor rank's own tokens' mean
// (Megatron tracks it without a reduce group), so not one rank's. With --calculate-per-token-loss Megatron scales
// the MoE losses' gradients by each rank's own tokens (b x t / T): T = 2 trains as T = 1 with half the coefficients.
TEST_F(MoeTensorParallelCli, ZLossBalanceTypesExpertBiasAndCapacityTrainAsOneRankDoes) {
  ASSERT_NO_FATAL_FAILURE(ExpectRouterFeaturesTrainAsOneRank("T", "tensor"));
}

// A capacity that drops: each tensor rank's tokens dropped as its own router would (moe_ops_test's
// TensorRanksDropEachRanksOwnTokens), so not one rank's losses; with every feature above a stopped T = 2 run resumes
// bit for bit. Without the capacity the T = 2 checkpoint's expert biases (whole on every rank) resume at T = 1 within
// 1e-5 of one rank's losses.
TEST_F(MoeTensorParallelCli, TheFeaturesResumeBitForBitAndTheBiasReshards) {
  const std::string bias =
      "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
      "--moe-z-loss-coeff 0.01 --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
      "--moe-aux-loss-coeff 0.01 0.01 0.01";
  const std::string drops = " --moe-expert-capacity-factor 1 --moe-token-drop-policy position";
  auto one = RunCmd(Train(1, bias + drops));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = Ranks(2, Train(2, bias + drops));
  ASSERT_NE(two.output.find(AllZero(2)), std::string::npos) << two.output << Logs(2);
  ASSERT_EQ(Losses(two.output).size(), 6u) << two.output;
  EXPECT_GT(Worst(Losses(two.output), Losses(one.output)), 1e-5) << "each rank's capacity is not one rank's";
  const auto train = [&](const std::string& extra) { return Train(2, bias + drops + " " + extra, 20); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/2, p 1/1 ]", {"mp_rank_00", "mp_rank_01"}, "mp_rank_02"));
  for (const char* mp : {"mp_rank_00", "mp_rank_01"}) {
    auto text = ReadCheckpointHeaderText(dir_ / ("ck1/iter_0000010/" + std::string(mp) + "/model_optim_rng.ptk"));
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_NE(text->find("decoder.layers.1.mlp.router.expert_bias"), std::string::npos) << mp;
  }
  const std::string reshard = dir_ / "reshard";
  auto stopped = Ranks(2, Train(2, bias + " --exit-interval 10 --save " + ShellQuote(reshard), 20));
  ASSERT_NE(stopped.output.find(AllZero(2)), std::string::npos) << stopped.output << Logs(2);
  auto whole = RunCmd(Train(1, bias, 20));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto t1 = RunCmd(Train(1, bias + " --load " + ShellQuote(reshard), 20));
  ASSERT_EQ(t1.exit_code, 0) << t1.output;
  ASSERT_EQ(Losses(t1.output).size(), 10u) << t1.output;
  EXPECT_LT(Worst(Losses(t1.output), Losses(whole.output)), 1e-5);
  std::printf("T=2 expert-bias checkpoint resumed at T=1: %.3g largest relative difference from one rank's losses\n",
              Worst(Losses(t1.output), Losses(whole.output)));
}

TEST_F(MoeTensorParallelCli, WhatIsNotImplementedIsRefusedInOneLine) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data "
                           "--dry-run --num-experts 4 --disable-bias-linear " +
                           testing::SmallVocabFlags();
  const std::string tp = " --tensor-model-parallel-size 2";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {tp, "usage error: --num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel (as Megatron"},
      {tp + " --sequence-parallel --expert-tensor-parallel-size 1",
       "usage error: --expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2: ptk splits the experts"},
      {" --expert-tensor-parallel-size 2",
       "usage error: --expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1: ptk splits the experts"},
      {" --expert-tensor-parallel-size 0", "--expert-tensor-parallel-size"},
      {tp + " --sequence-parallel --moe-ffn-hidden-size 47",
       "usage error: --moe-ffn-hidden-size 47 is not divisible by --tensor-model-parallel-size 2"},
      {tp + " --sequence-parallel --moe-shared-expert-intermediate-size 33",
       "usage error: --moe-shared-expert-intermediate-size 33 is not divisible by --tensor-model-parallel-size 2"},
      // With expert ranks: ep_tensor_cli_test.
      {tp + " --sequence-parallel --device cuda",
       "usage error: --num-experts 4 with --tensor-model-parallel-size 2 on --device cuda"},
  };
  testing::ExpectUsageErrors(base, cases, /*one_line=*/true);
  // The default and the tensor size are accepted (a dry run's plan).
  auto ok = RunCmd("WORLD_SIZE=2 " + base + tp + " --sequence-parallel --expert-tensor-parallel-size 2 --device cpu");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
}  // namespace ptk
