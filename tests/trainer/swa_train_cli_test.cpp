// ptk-train's sliding window attention and softmax types end to end (--window-size, --window-attn-skip-freq,
// --softmax-type, CPU): a run saves megatron-core's core_attention.softmax_offset tensors and its settings,
// a stopped run resumes bit for bit (dropout on), with --use-checkpoint-args taking the three flags from the
// checkpoint, another window or softmax is another model, two tensor ranks (the offsets split by heads) train
// as one (and two pipeline stages, and two context ranks with the window), ptk-convert refuses the checkpoint,
// --dry-run counts the offsets as megatron-core's golden model has them, and the values Megatron rejects and the
// combinations ptk has not are refused in one line each.
#include <filesystem>
#include <regex>
#include <string>
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

const char kVariant[] = " --window-size 4,0 --window-attn-skip-freq 2 --softmax-type learnable";

class SwaTrainCli : public testing::RanksTest {
 protected:
  SwaTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  std::string Train(const std::string& extra, int64_t iters = 6, const std::string& variant = kVariant) {
    return testing::Tool("ptk-train") + " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32" +
           SmallRun(iters) + " --init-method-std 0.2" + variant + " " + extra;
  }
};

TEST_F(SwaTrainCli, TrainsAndSavesTheOffsetsUnderMegatronsNames) {
  auto r = RunCmd(Train("--save " + ShellQuote(dir_ / "ck"), 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto losses = testing::LossesOf(r.output);
  EXPECT_EQ(losses.size(), 4u) << r.output;
  // The window (4 keys of 32) and the offsets change the losses: each flag reaches the model.
  for (const std::string& other :
       {std::string(" --window-size 4,0 --window-attn-skip-freq 2"), std::string(" --softmax-type learnable"),
        std::string(" --softmax-type off-by-one"), std::string(" --window-size 4,0 --softmax-type learnable")}) {
    auto o = RunCmd(Train("", 4, other));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_GT(testing::WorstRelativeDifference(testing::LossesOf(o.output), losses), 1e-6) << other;
  }
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.num_layers = 2;
  c.window_left = 4;
  c.window_pattern = {1, 0};
  c.softmax_type = "learnable";
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const char* name : {"decoder.layers.0.self_attention.core_attention.softmax_offset",
                           "decoder.layers.1.self_attention.core_attention.softmax_offset"}) {
    ASSERT_NE(layout->Find(name), nullptr) << name;
    EXPECT_EQ(layout->Find(name)->shape, std::vector<int64_t>{4}) << name;
  }
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status loaded = LoadCheckpoint(dir_ / "ck", 4, *layout, &p, &m, &v, &st);
  EXPECT_TRUE(loaded.ok()) << loaded;
  c.window_pattern.clear();  // the window on every layer is another model
  auto other = ParamLayout::Create(c);
  const absl::Status refused = LoadCheckpoint(dir_ / "ck", 4, *other, &p, &m, &v, &st);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.message()).find("--window-attn-skip-freq \"[1,0]\" (this run: \"[1,1]\")"),
            std::string::npos)
      << refused;
  for (const char* saver : {"hf", "megatron"}) {
    const std::string out = dir_ / (std::string("export-") + saver);
    auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver " + saver + " --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(out));
    EXPECT_NE(e.exit_code, 0) << e.output;
    EXPECT_NE(e.output.find("a model with --window-size or --softmax-type (window_size '4,0', softmax_type "
                            "'learnable'): ptk-convert does not export them"),
              std::string::npos)
        << e.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << saver;
  }
}

TEST_F(SwaTrainCli, AStoppedRunResumesBitForBit) {
  std::vector<std::string> b;
  ASSERT_NO_FATAL_FAILURE(ExpectResumeBitForBit([&](const std::string& x) { return Train(x); }, &b));
  // Without the flags, or with another softmax, the checkpoint is another model.
  for (const std::string& variant : {std::string(""), std::string(" --window-size 4,0 --window-attn-skip-freq 2"),
                                     std::string(" --window-size 4,0 --softmax-type learnable")}) {
    auto r = RunCmd(Train("--load " + ShellQuote(dir_ / "ck"), 6, variant));
    EXPECT_EQ(r.exit_code, 1) << variant << "\n" << r.output;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << variant << "\n" << r.output;
  }
  // --use-checkpoint-args takes the three flags (and the other architecture flags) from the checkpoint: the
  // same resume; the same values written otherwise agree; another value is refused naming it.
  const std::string load = "--use-checkpoint-args --load " + ShellQuote(dir_ / "ck");
  auto t = RunCmd(Train(load, 6, ""));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(t.output), b);
  EXPECT_NE(t.output.find("--window-size 4,0, --window-attn-skip-freq [1,0], --softmax-type learnable"),
            std::string::npos)
      << t.output;
  auto same = RunCmd(Train(load, 6, " --window-size '(4, 0)' --window-attn-skip-freq '[1,0]'"));
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(same.output), b);
  auto differs = RunCmd(Train(load, 6, " --window-size 5,0"));
  EXPECT_EQ(differs.exit_code, 2) << differs.output;
  EXPECT_NE(differs.output.find("--use-checkpoint-args: --window-size 5,0 differs from the checkpoint's --window-size "
                                "4,0"),
            std::string::npos)
      << differs.output;
}

// With multi-token prediction the settings keep the skip frequency's count (megatron-core numbers the depth's layer 3
// after the 2 decoder layers: a list has no entry for it): a stopped run resumes bit for bit, and
// --use-checkpoint-args takes the count back.
TEST_F(SwaTrainCli, AnMtpRunKeepsTheSkipFrequencysCount) {
  const std::string mtp = std::string(kVariant) + " --mtp-num-layers 1";
  auto whole = RunCmd(Train("", 4, mtp));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = RunCmd(Train("--exit-interval 2 --save " + ShellQuote(dir_ / "mtp"), 4, mtp));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(a.size(), 4u) << whole.output;
  for (const std::string& how : {std::string(mtp), std::string(" --mtp-num-layers 1 --use-checkpoint-args")}) {
    auto resumed = RunCmd(Train("--load " + ShellQuote(dir_ / "mtp"), 4, how));
    ASSERT_EQ(resumed.exit_code, 0) << how << "\n" << resumed.output;
    EXPECT_EQ(testing::LogLinesWithoutTimes(resumed.output), std::vector<std::string>(a.begin() + 2, a.end())) << how;
  }
}

TEST_F(SwaTrainCli, TwoTensorRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train("--tensor-model-parallel-size 2"), testing::LossesOf(one.output), 6, 1e-5, "T=2", &out));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--tensor-model-parallel-size 2 --sequence-parallel"),
                                          testing::LossesOf(one.output), 6, 1e-5, "T=2, sequence-parallel", &out));
}

// Two pipeline stages (each layer's window by its number in the whole model) give one rank's losses, and so do two
// context ranks with the window (--cp-comm-type allgather: Transformer Engine's sliding window exchange; the window
// masks keys by their true positions across the ranks' chunks).
TEST_F(SwaTrainCli, PipelineStagesAndContextRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--pipeline-model-parallel-size 2"), testing::LossesOf(one.output),
                                          6, 1e-5, "P=2", &out));
  const std::string window = " --window-size 4,0 --window-attn-skip-freq 2";
  auto full = RunCmd(Train("", 6, window));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--context-parallel-size 2 --cp-comm-type allgather", 6, window),
                                          testing::LossesOf(full.output), 6, 1e-5, "C=2", &out));
}

// megatron-core's parameter count of tests/data/trainer/swa_learnable_full's model (its golden's tensors).
TEST_F(SwaTrainCli, DryRunCountsTheOffsetsAsMegatron) {
  const int64_t megatron = testing::MegatronParamCount("swa_learnable_full");
  const std::string dry = testing::DryRunOf(3);
  ASSERT_NO_FATAL_FAILURE(testing::ExpectDryRunCount(dry + " --softmax-type learnable", megatron));
  auto plain = RunCmd(dry + " --softmax-type off-by-one");  // no parameter
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("model: " + std::to_string(megatron - 3 * 4) + " parameters"), std::string::npos)
      << plain.output;
}

TEST_F(SwaTrainCli, WhatMegatronRejectsAndWhatIsNotImplementedIsRefusedInOneLine) {
  const std::string base = testing::MockRunOf(2);
  const std::string w = " --window-size 4,0", ws = "usage error: --window-size ";
  const std::string with = "usage error: --window-size 4,0 and --softmax-type learnable with ";
  const std::string sm = w + " --softmax-type learnable";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --window-size 4", ws + "4: 1 integer(s); the window is two"},
      {" --window-size 4,0,0", ws + "4,0,0: 3 integer(s)"},
      {" --window-size=-1,0", ws + "-1,0: the left bound must be at least 0"},
      {" --window-size 4,2", ws + "4,2: the right bound must be 0"},
      {" --window-size a,0", ws + "a,0: integers separated by a comma"},
      {" --window-size ,", ws + ",: integers"},
      {w + " --window-attn-skip-freq 0", "usage error: --window-attn-skip-freq 0: a positive count"},
      {w + " --window-attn-skip-freq x", "usage error: --window-attn-skip-freq x: a positive count"},
      {w + " --window-attn-skip-freq [1,0,1]",
       "usage error: --window-attn-skip-freq [1,0,1]: 3 entries for "
       "--num-layers 2"},
      {w + " --window-attn-skip-freq [2,1]", "usage error: --window-attn-skip-freq [2,1]: entry 2"},
      {w + " --window-attn-skip-freq '__import__(1)'", "usage error: --window-attn-skip-freq"},
      {" --softmax-type softer", "--softmax-type"},
      // Transformer Engine's context parallelism (Megatron's): the softmax types with a2a only, the window not with
      // p2p.
      {sm + " --context-parallel-size 2",
       "usage error: --softmax-type learnable with --context-parallel-size 2 --cp-comm-type p2p: Transformer "
       "Engine's context parallelism (Megatron's) runs the softmax types only with --cp-comm-type a2a"},
      {" --softmax-type off-by-one --context-parallel-size 2 --cp-comm-type allgather",
       "usage error: --softmax-type off-by-one with --context-parallel-size 2 --cp-comm-type allgather"},
      {w + " --context-parallel-size 2",
       "usage error: --window-size 4,0 with --context-parallel-size 2 --cp-comm-type p2p: Transformer Engine's "
       "context parallelism (Megatron's) runs a sliding window only with --cp-comm-type a2a or allgather"},
      // megatron-core numbers the depths' layers after the decoder's: a list pattern has no entry for them.
      {w + " --window-attn-skip-freq [1,0] --mtp-num-layers 1",
       "usage error: --window-attn-skip-freq [1,0] with --mtp-num-layers 1: megatron-core's "
       "is_layer_window_attention indexes a list pattern"},
      // The CUDA backend: the window in every precision, the softmax types in fp32 only, neither under context
      // parallelism.
      {sm + " --dry-run --bf16",
       "usage error: --softmax-type learnable with --bf16: the CUDA backend's bf16/fp16 attention (cuDNN's) runs "
       "without the softmax offset"},
      {" --softmax-type off-by-one --device cuda --fp16", "usage error: --softmax-type off-by-one with --fp16"},
      {w + " --device cuda --context-parallel-size 2 --cp-comm-type allgather",
       "usage error: --window-size 4,0 with --device cuda and --context-parallel-size 2 --cp-comm-type allgather: "
       "the CUDA backend's context-parallel attention has neither"},
      {sm + " --dry-run --context-parallel-size 2", "usage error: --softmax-type learnable with --context-parallel"},
      {" --softmax-type learnable --init-method-xavier-uniform",
       "usage error: --softmax-type learnable with --init-method-xavier-uniform"},
  };
  testing::ExpectUsageErrors(base, cases);
  // Megatron's depths and MLA take the window and the offsets (mtp_moe_golden_test checks their numbers).
  for (const std::string with_model : {" --mtp-num-layers 1 --window-attn-skip-freq 2",
                                       " --multi-latent-attention --kv-lora-rank 8 --qk-head-dim 4"
                                       " --qk-pos-emb-head-dim 4 --v-head-dim 4"}) {
    auto r = RunCmd(base + sm + with_model + " --train-iters 1");
    EXPECT_EQ(r.exit_code, 0) << with_model << "\n" << r.output;
  }
  // --device cuda takes the window and the softmax types (fp32): refused here only for the missing device, if at
  // all; a bf16 dry run takes the window.
  for (const std::string& cuda : {sm + " --device cuda", w + " --device cuda --bf16"}) {
    auto r = RunCmd(base + cuda + " --train-iters 1");
    EXPECT_EQ(r.output.find("usage error: --window-size"), std::string::npos) << cuda << "\n" << r.output;
    EXPECT_EQ(r.output.find("--softmax-type learnable with"), std::string::npos) << cuda << "\n" << r.output;
  }
  auto dry = RunCmd(base + w + " --window-attn-skip-freq 2 --dry-run --bf16");
  EXPECT_EQ(dry.exit_code, 0) << dry.output;
  auto plain = RunCmd(base + " --window-attn-skip-freq 2 --softmax-type vanilla --train-iters 1");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("--window-attn-skip-freq: accepted, no effect without --window-size (as Megatron)"),
            std::string::npos)
      << plain.output;
}

}  // namespace
}  // namespace ptk
