// ptk-train's --attention-output-gate and --qk-l2-norm end to end (CPU): checkpoints whose linear_qkv holds the gate
// rows (Megatron's layout) and that resume bit for bit, the flags taken by --use-checkpoint-args and their absence
// refused on --load as another model, ptk-convert's refusal, tensor, context and pipeline ranks (processes over
// loopback gloo, the gate rows split with their query groups) training as one rank does, --dry-run's parameter count
// against megatron-core's (the golden's tensors), and the combinations not implemented refused in one line naming them.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/golden_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

constexpr char kGated[] =
    " --attention-output-gate --qk-l2-norm --group-query-attention --num-query-groups 2 --normalization RMSNorm"
    " --position-embedding-type rope --swiglu --disable-bias-linear";

class GatedTrainCli : public testing::RanksTest {
 protected:
  GatedTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) + kGated + " " + extra;
  }
};

TEST_F(GatedTrainCli, TrainsSavesAndResumesBitForBit) {
  std::vector<std::string> b;
  ASSERT_NO_FATAL_FAILURE(ExpectResumeBitForBit([&](const std::string& x) { return Train(x); }, &b));
  // linear_qkv holds the gate rows: per query group 2 query, 2 gate, 1 key and 1 value head of 8 channels.
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.num_layers = 2;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.num_query_groups = 2;
  c.ffn_hidden_size = (4 * c.hidden_size * 2 / 3) / 64 * 64;
  c.attention_output_gate = c.qk_l2_norm = true;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->Find("decoder.layers.0.self_attention.linear_qkv.weight")->shape, (std::vector<int64_t>{96, 32}));
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status loaded = LoadCheckpoint(dir_ / "ck", 3, *layout, &p, &m, &v, &st);
  EXPECT_TRUE(loaded.ok()) << loaded;
  // --use-checkpoint-args takes both flags; without it their absence (or one of them) is another model.
  const std::string bare =
      testing::Tool("ptk-train") + SmallRun(6) + " --use-checkpoint-args --load " + ShellQuote(dir_ / "ck");
  auto taken = RunCmd(bare);
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), b);
  EXPECT_NE(taken.output.find("--qk-l2-norm on, --attention-output-gate on"), std::string::npos) << taken.output;
  const std::string shape = testing::Tool("ptk-train") +
                            " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" + SmallRun(6) +
                            " --group-query-attention --num-query-groups 2 --normalization RMSNorm"
                            " --position-embedding-type rope --swiglu --disable-bias-linear --load " +
                            ShellQuote(dir_ / "ck");
  for (const char* flags : {"", " --attention-output-gate", " --qk-l2-norm"}) {
    auto r = RunCmd(shape + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << flags << "\n" << r.output;
  }
  for (const char* saver : {"hf", "megatron"}) {
    const std::string out = dir_ / (std::string("export-") + saver);
    auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver " + saver + " --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(out));
    EXPECT_NE(e.exit_code, 0) << e.output;
    EXPECT_NE(e.output.find("which ptk-convert does not convert yet"), std::string::npos) << e.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << saver;
  }
}

// Two tensor ranks (the gate rows sharded with their query groups), with and without sequence parallelism, two
// context ranks and two pipeline stages give one rank's losses.
TEST_F(GatedTrainCli, TensorRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = testing::LossesOf(one.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--tensor-model-parallel-size 2"), ref, 6, 1e-5, "T=2", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train("--tensor-model-parallel-size 2 --sequence-parallel"), ref, 6, 1e-5, "T=2 SP", &out));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--context-parallel-size 2"), ref, 6, 1e-5, "C=2", &out));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--pipeline-model-parallel-size 2"), ref, 6, 1e-5, "P=2", &out));
}

// megatron-core's parameter count of tests/data/trainer/gated_gqa_l2's model (its golden's tensors).
TEST_F(GatedTrainCli, DryRunCountsParametersAsMegatron) {
  const int64_t megatron = testing::MegatronParamCount("gated_gqa_l2");
  ASSERT_NO_FATAL_FAILURE(testing::ExpectDryRunCount(
      testing::DryRunOf(2) + " --disable-bias-linear --swiglu --normalization RMSNorm"
                             " --position-embedding-type rope --group-query-attention --num-query-groups 2"
                             " --attention-output-gate --qk-l2-norm",
      megatron));
}

TEST_F(GatedTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingIt) {
  const std::string base = testing::MockRunOf(2);
  const std::string mla =
      " --multi-latent-attention --kv-lora-rank 8 --qk-head-dim 4 --qk-pos-emb-head-dim 4"
      " --v-head-dim 4";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --qk-l2-norm --qk-layernorm", "usage error: --qk-l2-norm with --qk-layernorm: megatron-core replaces"},
      {mla + " --attention-output-gate",
       "usage error: --attention-output-gate with --multi-latent-attention: megatron-core has no output gate"},
      {mla + " --qk-l2-norm", "usage error: --qk-l2-norm with --multi-latent-attention"},
      {" --attention-output-gate=maybe", "--attention-output-gate"},
  };
  testing::ExpectUsageErrors(base, cases);
  // The CUDA backend runs both (cuda_attention_variant_model_test): a bf16 dry run takes them, and --device cuda
  // is refused here only for the missing device, if at all, never for the variant.
  auto dry = RunCmd(base + " --attention-output-gate --qk-l2-norm --dry-run --bf16");
  EXPECT_EQ(dry.exit_code, 0) << dry.output;
  auto cuda = RunCmd(base + " --attention-output-gate --qk-l2-norm --device cuda --train-iters 1");
  for (const char* flag : {"--attention-output-gate", "--qk-l2-norm"})
    EXPECT_EQ(cuda.output.find(std::string("usage error: ") + flag), std::string::npos) << cuda.output;
}

}  // namespace
}  // namespace ptk
