// ptk-train's multi-latent attention end to end (--multi-latent-attention, CPU): checkpoints under Megatron's
// MLA names that resume bit for bit, the MLA flags taken by --use-checkpoint-args and other MLA flags refused
// on --load as another model, ptk-convert's refusal, data and pipeline ranks (processes over loopback gloo)
// training as one rank does, --dry-run's parameter count against megatron-core's (the golden's tensors), and
// every combination not implemented refused in one line naming it.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/golden_util.h"
#include "tests/trainer/mla_cli_model.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

constexpr const char* kMla = testing::kMlaLora;

class MlaTrainCli : public testing::RanksTest {
 protected:
  MlaTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  std::string Train(const std::string& extra, int64_t iters = 6, int layers = 2) {
    return testing::Tool("ptk-train") + " --num-layers " + std::to_string(layers) +
           " --hidden-size 32 --num-attention-heads 4 --seq-length 32" + SmallRun(iters) + kMla + " " + extra;
  }
  static GPTConfig Model(int layers = 2) { return testing::MlaLoraModel(layers); }
};

TEST_F(MlaTrainCli, TrainsAndSavesMegatronsNames) {
  auto r = RunCmd(Train("--save " + ShellQuote(dir_ / "ck"), 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::LossesOf(r.output).size(), 4u) << r.output;
  GPTConfig c = Model();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const char* name :
       {"linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
        "kv_layernorm.weight", "linear_kv_up_proj.weight", "linear_proj.weight"})
    EXPECT_NE(layout->Find(std::string("decoder.layers.1.self_attention.") + name), nullptr) << name;
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status loaded = LoadCheckpoint(dir_ / "ck", 4, *layout, &p, &m, &v, &st);
  EXPECT_TRUE(loaded.ok()) << loaded;
  c.q_lora_rank = 0;  // another query path is another model
  auto other = ParamLayout::Create(c);
  EXPECT_FALSE(LoadCheckpoint(dir_ / "ck", 4, *other, &p, &m, &v, &st).ok());
  for (const char* saver : {"hf", "megatron"}) {
    const std::string out = dir_ / (std::string("export-") + saver);
    auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver " + saver + " --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(out));
    if (std::string(saver) == "megatron") {  // megatron-core's MLA names (tests/interop/megatron_mla_test)
      EXPECT_EQ(e.exit_code, 0) << e.output;
      EXPECT_TRUE(std::filesystem::exists(out + "/latest_checkpointed_iteration.txt")) << e.output;
      continue;
    }
    EXPECT_NE(e.exit_code, 0) << e.output;
    // --saver hf: DeepseekV3ForCausalLM has no GELU MLP nor learned positions (hf_deepseek_v3_convert_test has the
    // rest).
    EXPECT_NE(e.output.find("this multi-latent attention model is not one Hugging Face's DeepseekV3ForCausalLM "
                            "computes: --position-embedding-type learned_absolute"),
              std::string::npos)
        << e.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << saver;
  }
}

TEST_F(MlaTrainCli, AStoppedRunResumesBitForBitAndOtherMlaFlagsAreAnotherModel) {
  std::vector<std::string> b;
  ASSERT_NO_FATAL_FAILURE(ExpectResumeBitForBit([&](const std::string& x) { return Train(x); }, &b));
  // --use-checkpoint-args takes the MLA flags the command line leaves out.
  const std::string bare =
      testing::Tool("ptk-train") + SmallRun(6) + " --use-checkpoint-args --load " + ShellQuote(dir_ / "ck");
  auto taken = RunCmd(bare);
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), b);
  EXPECT_NE(taken.output.find("--multi-latent-attention on, --q-lora-rank 16, --kv-lora-rank 12, --qk-head-dim 8, "
                              "--qk-pos-emb-head-dim 4, --v-head-dim 6, --rope-type rope"),
            std::string::npos)
      << taken.output;
  auto differs = RunCmd(bare + " --kv-lora-rank 8");
  EXPECT_EQ(differs.exit_code, 2) << differs.output;
  EXPECT_NE(differs.output.find("--use-checkpoint-args: --kv-lora-rank 8 differs from the checkpoint's --kv-lora-rank "
                                "12"),
            std::string::npos)
      << differs.output;
  for (const char* other : {" --q-lora-rank 8", " --rope-type yarn", " --v-head-dim 4", " --mscale-all-dim 1"}) {
    auto r = RunCmd(Train(std::string(other) + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(r.exit_code, 0) << other;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << other << "\n" << r.output;
  }
}

// Two data ranks, and two pipeline stages (one layer each), give one rank's losses.
TEST_F(MlaTrainCli, DataAndPipelineRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = testing::LossesOf(one.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(""), ref, 6, 1e-5, "D=2", &out));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--pipeline-model-parallel-size 2"), ref, 6, 1e-5, "P=2", &out));
}

// megatron-core's parameter count of tests/data/trainer/mla_lora's model (its golden's tensors).
TEST_F(MlaTrainCli, DryRunCountsParametersAsMegatron) {
  const int64_t megatron = testing::MegatronParamCount("mla_lora");
  ASSERT_NO_FATAL_FAILURE(testing::ExpectDryRunCount(
      testing::DryRunOf(2) + " --disable-bias-linear --swiglu --normalization RMSNorm"
                             " --position-embedding-type rope --multi-latent-attention --q-lora-rank 8"
                             " --kv-lora-rank 6 --qk-head-dim 4 --qk-pos-emb-head-dim 4 --v-head-dim 6"
                             " --qk-layernorm --rope-type rope",
      megatron));
}

TEST_F(MlaTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingIt) {
  const std::string base = testing::MockRunOf(2);
  const std::string mla =
      " --multi-latent-attention --kv-lora-rank 8 --qk-head-dim 4 --qk-pos-emb-head-dim 4"
      " --v-head-dim 4";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {mla + " --device cuda --pipeline-model-parallel-size 2",
       "usage error: --multi-latent-attention on --device cuda with --pipeline-model-parallel-size 2: the CUDA "
       "backend's multi-latent attention is data-parallel only"},
      {mla + " --dry-run --bf16 --context-parallel-size 2",
       "usage error: --multi-latent-attention on --device cuda with --context-parallel-size 2"},
      {mla + " --rope-type ntk", "usage error: --rope-type ntk: rope or yarn"},
      {" --rope-type yarn", "usage error: --rope-type yarn without --multi-latent-attention: Megatron's common"},
      {mla + " --qk-pos-emb-head-dim 3", "usage error: --qk-pos-emb-head-dim 3: the rotary channels come in pairs"},
      {mla + " --kv-lora-rank 0", "usage error: --kv-lora-rank"},
      {mla + " --group-query-attention --num-query-groups 2",
       "usage error: --multi-latent-attention with --group-query-attention"},
      {mla + " --position-embedding-type rope --rotary-percent 0.5",
       "usage error: --multi-latent-attention with --rotary-percent 0.5"},
      {mla + " --position-embedding-type rope --rotary-interleaved",
       "usage error: --multi-latent-attention with --rotary-interleaved"},
      {mla + " --position-embedding-type rope --use-rope-scaling",
       "usage error: --multi-latent-attention with --use-rope-scaling"},
      {mla + " --cache-mla-latents", "usage error: --multi-latent-attention with --cache-mla-latents: an inference"},
  };
  testing::ExpectUsageErrors(base, cases);
  // Accepted with their notes: yarn by default, the latents without norms (the local spec's), and MLA's flags
  // without --multi-latent-attention (as Megatron).
  auto r = RunCmd(base + mla + " --train-iters 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --multi-latent-attention without --rope-type: yarn"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --multi-latent-attention without --qk-layernorm"), std::string::npos) << r.output;
  auto plain = RunCmd(base + " --kv-lora-rank 8 --mscale 0.5 --train-iters 1");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("accepted, no effect without --multi-latent-attention"), std::string::npos)
      << plain.output;
}

}  // namespace
}  // namespace ptk
