// ptk-train's context parallelism end to end, ranks as processes over loopback gloo: C = 2 context
// ranks (and C = 2 x D = 2 with ZeRO-1 and --overlap-grad-reduce, C = 2 x T = 2 with and without
// --sequence-parallel, C = 2 x P = 2 with and without the interleaved schedule, and Megatron's Llama
// line with RoPE at C = 2) give the loss lines of one rank within 1e-5 relative, with dropout on, and
// after 10 iterations the same parameters within 2e-5 of the largest (after 6 at C = 2 x P = 2 and at
// T = 2 x C = 2 x P = 2 with --sequence-parallel, 8 ranks); a checkpoint saved at C = 2
// resumes at C = 1 and the reverse, continuing the uninterrupted run's losses; with --eod-mask-loss
// (the context ranks' shares of the tokens uneven) --calculate-per-token-loss gives one rank's losses
// and parameters at C = 2, and Megatron's default per-rank mean other parameters; what ptk does not
// cover, and ranks started with another context or tensor size, are refused in one line, exit 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

class ContextParallelCli : public testing::RanksTest {
 protected:
  ContextParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  // LoadTinyCheckpoint's model on the vocabulary of 1000 (padded to 1024 at T = 1 and 2), micro-batches
  // of 2 samples, global batch 4, dropout on (Megatron's defaults), an evaluation every 5 iterations.
  std::string Train(int C, const std::string& extra, int64_t iters = 10) {
    return ptk::testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 5 --eval-iters 1 --log-interval 1 --threads 1"
           " --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " --context-parallel-size " + std::to_string(C) + " " + extra;
  }
  // The largest difference between two checkpoints' parameters, relative to the largest parameter.
  static double ParamsDifference(const std::string& a, const std::string& b, int64_t iteration) {
    const testing::SavedCheckpoint x = testing::LoadTinyCheckpoint(a, iteration, 1000, 1024);
    const testing::SavedCheckpoint y = testing::LoadTinyCheckpoint(b, iteration, 1000, 1024);
    EXPECT_EQ(x.params.size(), y.params.size());
    double worst = 0, largest = 0;
    for (size_t i = 0; i < std::min(x.params.size(), y.params.size()); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(x.params[i] - y.params[i])));
      largest = std::max(largest, static_cast<double>(std::abs(y.params[i])));
    }
    return largest > 0 ? worst / largest : worst;
  }
  static constexpr double kLossTolerance = 1e-5, kParamsTolerance = 2e-5;
};

TEST_F(ContextParallelCli, TwoContextRanksGiveOneRanksLossesAndParameters) {
  const std::string one_dir = dir_ / "one", cp_dir = dir_ / "cp";
  auto one = RunCmd(Train(1, "--save " + ShellQuote(one_dir)));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 10u) << one.output;
  EXPECT_LT(ref.back().second, ref.front().second);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, "--cp-comm-type allgather --save " + ShellQuote(cp_dir)), ref, 10,
                                          kLossTolerance, "C=2", &out));
  EXPECT_NE(out.find("context parallel: 2 ranks x data parallel: 1 ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("1 rank(s) x 2 context ranks (each 16 positions of a sample)"), std::string::npos) << out;
  // The validation losses too (the forward-only pass over the context ranks' positions).
  const std::string val = "validation loss at iteration 5 | lm loss value: ";
  ASSERT_NE(one.output.find(val), std::string::npos) << one.output;
  ASSERT_NE(out.find(val), std::string::npos) << out;
  const double v1 = std::stod(one.output.substr(one.output.find(val) + val.size(), 12));
  const double v2 = std::stod(out.substr(out.find(val) + val.size(), 12));
  EXPECT_LT(std::abs(v1 - v2) / v1, kLossTolerance) << v1 << " " << v2;
  // The checkpoint is the model's, whatever the context size: the same parameters.
  const double params = ParamsDifference(cp_dir, one_dir, 10);
  EXPECT_LT(params, kParamsTolerance);
  std::printf("C=2: parameters after 10 iterations within %.3g of the largest of one rank's\n", params);
}

// --eod-mask-loss (the vocabulary's <|endoftext|> masked: was GPT-2's 50256 whatever --vocab-file said,
// so here no token) leaves the context ranks uneven shares of a micro-batch's tokens: Megatron's default
// weighs each rank's mean alike (its weights: context_parallel_test), so after 10 iterations its C = 2
// parameters are not one rank's, while --calculate-per-token-loss weighs every token alike at any C:
// one rank's lm losses and parameters (within 2e-5 of the largest).
TEST_F(ContextParallelCli, PerTokenLossWithTheEodMaskGivesOneRanksParameters) {
  const std::string eod = "--eod-mask-loss ", per_token = "--calculate-per-token-loss ";
  auto one = RunCmd(Train(1, eod + per_token + "--save " + ShellQuote(dir_ / "one")));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, eod + per_token + "--save " + ShellQuote(dir_ / "cp")),
                                          Losses(one.output), 10, kLossTolerance, "C=2, per-token loss, EOD mask",
                                          &out));
  // The mask holds: the vocabulary's <|endoftext|> (999 here) is masked, not GPT-2's 50256.
  auto unmasked = RunCmd(Train(1, per_token, 3));
  ASSERT_EQ(unmasked.exit_code, 0) << unmasked.output;
  ASSERT_EQ(Losses(unmasked.output).size(), 3u);
  EXPECT_NE(Losses(unmasked.output)[0].second, Losses(one.output)[0].second);
  const double same = ParamsDifference(dir_ / "cp", dir_ / "one", 10);
  EXPECT_LT(same, kParamsTolerance);
  auto mean_one = RunCmd(Train(1, eod + "--save " + ShellQuote(dir_ / "mean_one")));
  ASSERT_EQ(mean_one.exit_code, 0) << mean_one.output;
  auto mean_cp = Ranks(2, Train(2, eod + "--save " + ShellQuote(dir_ / "mean_cp")));
  ASSERT_NE(mean_cp.output.find(AllZero(2)), std::string::npos) << mean_cp.output << Logs(2);
  const double apart = ParamsDifference(dir_ / "mean_cp", dir_ / "mean_one", 10);
  EXPECT_GT(apart, 10 * kParamsTolerance);
  std::printf(
      "EOD mask, parameters after 10 iterations at C=2 vs one rank: per-token loss %.3g, Megatron's "
      "default %.3g of the largest\n",
      same, apart);
}

TEST_F(ContextParallelCli, ContextTimesDataTensorOrPipelineRanksAndTheLlamaLineGiveOneRanksLosses) {
  auto one = RunCmd(Train(1, "", 6));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 6u) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 5000", 6), ref,
                      6, kLossTolerance, "C=2 x D=2, ZeRO-1, overlap", &out));
  EXPECT_NE(out.find("context parallel: 2 ranks x data parallel: 2 ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("distributed optimizer: each of 4 ranks keeps"), std::string::npos) << out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, "--tensor-model-parallel-size 2", 6), ref, 6, kLossTolerance, "C=2 x T=2", &out));
  EXPECT_NE(out.find("tensor parallel: 2 ranks x context parallel: 2 ranks x data parallel: 1 ranks"),
            std::string::npos)
      << out;
  // --sequence-parallel: the tensor ranks split a context rank's positions (dropout keyed by true position).
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, "--tensor-model-parallel-size 2 --sequence-parallel", 6), ref, 6,
                                          kLossTolerance, "C=2 x T=2 --sequence-parallel", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, "--pipeline-model-parallel-size 2", 6), ref, 6, kLossTolerance, "C=2 x P=2", &out));
  EXPECT_NE(out.find("context parallel: 2 ranks x data parallel: 1 ranks x pipeline parallel: 2 stages"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("using world size: 4, data-parallel size: 1, context-parallel size: 2, hierarchical "
                     "context-parallel sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel size: 2\n"),
            std::string::npos)
      << out;
  // Megatron's interleaved schedule: 4 layers in 2 chunks on each of 2 stages.
  const std::string four = "--num-layers 4 --pipeline-model-parallel-size 2";
  auto one_four = RunCmd(Train(1, "--num-layers 4", 6));
  ASSERT_EQ(one_four.exit_code, 0) << one_four.output;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, four + " --num-layers-per-virtual-pipeline-stage 1", 6),
                                          Losses(one_four.output), 6, kLossTolerance, "C=2 x P=2 x 2 chunks", &out));
  // RoPE's rotations and the causal mask by each row's true position.
  const std::string llama =
      "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention --num-query-groups 2 "
      "--disable-bias-linear --untie-embeddings-and-output-weights";
  auto one_llama = RunCmd(Train(1, llama, 6));
  ASSERT_EQ(one_llama.exit_code, 0) << one_llama.output;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train(2, llama, 6), Losses(one_llama.output), 6, kLossTolerance, "Llama line, C=2", &out));
}

// With pipeline stages the step runs through Megatron's schedule, the gradients summed over data x context ranks
// and then over the embedding group: C = 2 x P = 2 and T = 2 x C = 2 x P = 2 (8 ranks, --sequence-parallel) print
// one rank's losses and save one rank's parameters after 6 iterations (the checkpoint put together from the
// stages and tensor slices), within the bounds of C = 2 alone.
TEST_F(ContextParallelCli, ContextRanksTimesStagesGiveOneRanksParameters) {
  const std::string one_dir = dir_ / "one";
  auto one = RunCmd(Train(1, "--save " + ShellQuote(one_dir), 6));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = Losses(one.output);
  ASSERT_EQ(ref.size(), 6u) << one.output;
  struct Case {
    int world;
    std::string flags, what;
  };
  for (const Case& k : {Case{4, "--pipeline-model-parallel-size 2", "C=2 x P=2"},
                        Case{8, "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
                             "T=2 x C=2 x P=2, sequence parallel"}}) {
    const std::string dir = dir_ / ("w" + std::to_string(k.world));
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(k.world, Train(2, k.flags + " --save " + ShellQuote(dir), 6), ref, 6,
                                            kLossTolerance, k.what, &out));
    const double params = ParamsDifference(dir, one_dir, 6);
    EXPECT_LT(params, kParamsTolerance) << k.what;
    std::printf("%s: parameters after 6 iterations within %.3g of the largest of one rank's\n", k.what.c_str(), params);
  }
}

// A checkpoint holds the model, not its context split: saved at C = 2 it resumes at C = 1, and the
// reverse, each continuing the other's uninterrupted run (its tracker set back to iteration 5).
TEST_F(ContextParallelCli, CheckpointsResumeAtAnotherContextSize) {
  const std::string one_dir = dir_ / "one", cp_dir = dir_ / "cp";
  auto one = RunCmd(Train(1, "--save-interval 5 --save " + ShellQuote(one_dir)));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto cp = Ranks(2, Train(2, "--save-interval 5 --save " + ShellQuote(cp_dir)));
  ASSERT_NE(cp.output.find(AllZero(2)), std::string::npos) << cp.output << Logs(2);
  const auto ref_one = Losses(one.output), ref_cp = Losses(cp.output);
  ASSERT_EQ(ref_one.size(), 10u);
  ASSERT_EQ(ref_cp.size(), 10u);
  auto at_five = [&](const std::string& from, const std::string& to) {
    ASSERT_EQ(RunCmd("cp -r " + ShellQuote(from) + " " + ShellQuote(to)).exit_code, 0);
    ASSERT_EQ(RunCmd("echo 5 > " + ShellQuote(to + "/latest_checkpointed_iteration.txt")).exit_code, 0);
  };
  ASSERT_NO_FATAL_FAILURE(at_five(cp_dir, dir_ / "cp_to_one"));
  auto to_one = RunCmd(Train(1, "--load " + ShellQuote(dir_ / "cp_to_one")));
  ASSERT_EQ(to_one.exit_code, 0) << to_one.output;
  EXPECT_NE(to_one.output.find("at iteration 5"), std::string::npos) << to_one.output;
  EXPECT_NE(to_one.output.find("resuming with --context-parallel-size 1 (the checkpoint of iteration 5 was saved with "
                               "--context-parallel-size 2): the checkpoint holds the model"),
            std::string::npos)
      << to_one.output;
  ASSERT_EQ(Losses(to_one.output).size(), 5u) << to_one.output;
  EXPECT_LT(Worst(Losses(to_one.output), ref_one), kLossTolerance);
  ASSERT_NO_FATAL_FAILURE(at_five(one_dir, dir_ / "one_to_cp"));
  auto to_cp = Ranks(2, Train(2, "--load " + ShellQuote(dir_ / "one_to_cp")));
  ASSERT_NE(to_cp.output.find(AllZero(2)), std::string::npos) << to_cp.output << Logs(2);
  ASSERT_EQ(Losses(to_cp.output).size(), 5u) << to_cp.output;
  EXPECT_LT(Worst(Losses(to_cp.output), ref_cp), kLossTolerance);
  std::printf("resumed at C=1 from C=2: %.3g, at C=2 from C=1: %.3g largest relative loss difference\n",
              Worst(Losses(to_one.output), ref_one), Worst(Losses(to_cp.output), ref_cp));
}

TEST_F(ContextParallelCli, WhatPtkDoesNotCoverIsRefusedInOneLine) {
  struct Case {
    std::string flags, says;
  };
  const Case cases[] = {
      {"",
       "--tensor-model-parallel-size 1 x --context-parallel-size 2: the world size 1 is not divisible by tensor × "
       "pipeline model parallel × context parallel size 1 × 1 × 2 = 2; start a multiple of 2 ranks"},
      {"--seq-length 30 --max-position-embeddings 32",
       "--context-parallel-size 2: --seq-length 30 must be a multiple of 2 x 2 = 4"},
      {"--tensor-model-parallel-size 4 --sequence-parallel --seq-length 36 --max-position-embeddings 36",
       "--context-parallel-size 2 with --sequence-parallel: a context rank's --seq-length 36 / 2 = 18 positions must "
       "be a multiple of --tensor-model-parallel-size 4"},
      {"--cp-comm-type a2a", "--context-parallel-size 2 --cp-comm-type a2a: ptk has allgather"},
      // The CUDA backend's context parallelism needs NCCL: refused before the backend is looked for, with or
      // without CUDA in the build.
      {"--device cuda --distributed-backend gloo",
       "--context-parallel-size 2 on the CUDA backend needs NCCL for the context group"},
      {"--sample-interval 5", "--context-parallel-size 2 with --sample-interval: text samples are not implemented"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    auto r = RunCmd(Train(2, c.flags, 2));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
  }
}

// --context-parallel-size with --device cuda is taken (it was refused, "implemented on the CPU backend only", while
// the CUDA model had no context parallelism; then in bf16 and fp16, "runs in fp32 only", and with
// --sequence-parallel, "not on the CUDA backend yet"): in fp32, bf16 and fp16, and with --sequence-parallel, the
// flags pass, and this one-rank run stops at the world size (or, in a build without CUDA, at the build), never at
// the combination.
TEST_F(ContextParallelCli, CudaInEveryPrecisionIsTaken) {
  for (const char* extra : {"", " --bf16", " --fp16", " --bf16 --tensor-model-parallel-size 2 --sequence-parallel"}) {
    SCOPED_TRACE(extra);
    auto r = RunCmd(Train(2, std::string("--device cuda") + extra, 2));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output.find("CPU backend only"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("runs in fp32 only"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("not on the CUDA backend yet"), std::string::npos) << r.output;
    EXPECT_TRUE(r.output.find("the world size 1 is not divisible") != std::string::npos ||
                r.output.find("built without CUDA") != std::string::npos)
        << r.output;
  }
}

// Ranks started with another --context-parallel-size (or --tensor-model-parallel-size) made other
// groups and failed when the timeout ran out, "context did not join", instead of naming the flag.
// Now the ranks agree on their settings over the world before making any group.
TEST_F(ContextParallelCli, RanksWithAnotherParallelSizeAreRefusedNamingTheFlag) {
  struct Case {
    std::string flag, says;
  };
  const Case cases[] = {
      {"--context-parallel-size $((RANK == 0 ? 2 : 1))",
       "rank 1 was started with --context-parallel-size 1, rank 0 with --context-parallel-size 2: every rank "
       "needs the same flags"},
      {"--context-parallel-size 1 --tensor-model-parallel-size $((RANK == 0 ? 2 : 1))",
       "rank 1 was started with --tensor-model-parallel-size 1, rank 0 with --tensor-model-parallel-size 2: every "
       "rank needs the same flags"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flag);
    std::string cmd = Train(2, "--distributed-timeout-minutes 0.2", 4);
    const std::string cp = "--context-parallel-size 2 ";
    cmd.replace(cmd.find(cp), cp.size(), c.flag + " ");
    const auto r = Ranks(2, "env PTK_RUN_ID=one bash -c " + ShellQuote(cmd));  // one launch
    EXPECT_NE(r.output.find("rc=2 2"), std::string::npos) << r.output << Logs(2);
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("did not join"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace ptk
