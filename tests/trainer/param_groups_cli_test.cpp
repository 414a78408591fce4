// ptk-train's parameter groups end to end (--decoupled-lr, --decoupled-min-lr, --apply-wd-to-qk-layernorm),
// ranks as processes over loopback gloo: data (with --use-distributed-optimizer), tensor, context and pipeline
// ranks, the interleaved schedule too (tied embeddings: the word embeddings on the first stage and their copy on the
// last, both decoupled; untied: the output layer on the last) give one rank's loss lines, which differ from a run
// without the groups; a resume is bit for bit; a resume with another decoupled rate stops as Megatron's scheduler check
// does unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler; ptk-convert refuses to
// write such a checkpoint as Megatron's (two groups only); bad values are refused.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

constexpr int64_t kIters = 10;
const std::string kGroups =
    "--decoupled-lr 1e-2 --decoupled-min-lr 1e-3 --qk-layernorm --apply-wd-to-qk-layernorm --eval-interval 5 ";

class ParamGroupsCli : public testing::PipelineCliTest {
 protected:
  std::string Groups(int T, int P, const std::string& extra) { return Train(T, P, kGroups + extra, kIters); }
};

TEST_F(ParamGroupsCli, DataTensorContextAndPipelineRanksGiveOneRanksLosses) {
  for (const std::string untie : {"", "--untie-embeddings-and-output-weights "}) {
    SCOPED_TRACE(untie.empty() ? "tied embeddings" : "untied");
    auto one = RunCmd(Groups(1, 1, untie));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const auto ref = Losses(one.output);
    ASSERT_EQ(ref.size(), static_cast<size_t>(kIters)) << one.output;
    // Not the run without groups: the embedding's and output layer's rate and the norms' decay change it.
    auto plain = RunCmd(Train(1, 1, "--qk-layernorm --eval-interval 5 " + untie, kIters));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    EXPECT_GT(Worst(Losses(plain.output), ref), 1e-4) << "the groups changed nothing";
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Groups(1, 1, untie + "--use-distributed-optimizer"), ref, kIters, 1e-6,
                                            "D=2, ZeRO-1", &out));
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Groups(1, 2, untie), ref, kIters, 1e-6, "P=2", &out));
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Groups(2, 1, untie), ref, kIters, 1e-5, "T=2", &out));
    // Interleaved: the embedding on stage 0's first chunk, the output layer (or the copy) on the last stage's last.
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Groups(1, 2, untie + "--num-layers-per-virtual-pipeline-stage 1"), ref,
                                            kIters, 1e-6, "P=2, two chunks", &out));
    ASSERT_NO_FATAL_FAILURE(
        RunGivingLosses(2, Groups(1, 1, untie + "--context-parallel-size 2"), ref, kIters, 1e-5, "C=2", &out));
  }
}

TEST_F(ParamGroupsCli, ResumeIsBitForBitAndAnotherRateStopsAsMegatron) {
  auto whole = RunCmd(Groups(1, 1, ""));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string ck = dir_ / "ck";
  auto first = RunCmd(Groups(1, 1, "--exit-interval 5 --save " + ShellQuote(ck)));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto copy = [&](const std::string& name) {
    const std::string dst = dir_ / name;
    EXPECT_EQ(RunCmd("cp -r " + ShellQuote(ck) + " " + ShellQuote(dst)).exit_code, 0);
    return ShellQuote(dst);
  };
  const std::string same = copy("same"), checkpoint = copy("checkpoint"), other = copy("other");
  // ptk-convert writes Megatron's two optimizer groups only: a run with a decoupled rate is refused, not
  // written into groups a Megatron resume would read on --lr's schedule.
  auto megatron = RunCmd(ptk::testing::Tool("ptk-convert") + " --loader ptk --saver megatron --load-dir " +
                         ShellQuote(ck) + " --save-dir " + ShellQuote(dir_ / "megatron"));
  EXPECT_EQ(megatron.exit_code, 1) << megatron.output;
  EXPECT_NE(megatron.output.find("was trained with --decoupled-lr 0.01: megatron-core keeps the word embeddings"),
            std::string::npos)
      << megatron.output;
  auto resumed = RunCmd(Groups(1, 1, "--load " + same));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto lines = Lines(whole.output);
  ASSERT_EQ(lines.size(), static_cast<size_t>(kIters));
  const std::vector<std::string> after(lines.begin() + 5, lines.end());
  EXPECT_EQ(Lines(resumed.output), after) << resumed.output;
  // Another decoupled rate: the checkpoint's param groups held the other max_lr.
  const std::string changed =
      "--decoupled-lr 2e-2 --decoupled-min-lr 1e-3 --qk-layernorm --apply-wd-to-qk-layernorm "
      "--eval-interval 5 ";
  auto refused = RunCmd(Train(1, 1, changed + "--load " + other, kIters));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("decoupled learning rate (embedding and output layer) (--decoupled-lr): 0.02 here, "
                                "0.01 in the checkpoint"),
            std::string::npos)
      << refused.output;
  auto taken = RunCmd(Train(1, 1, changed + "--use-checkpoint-opt_param-scheduler --load " + checkpoint, kIters));
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(Lines(taken.output), after) << "the checkpoint's rate was not the one used";
  auto overridden = RunCmd(Train(1, 1, changed + "--override-opt_param-scheduler --load " + other, kIters));
  ASSERT_EQ(overridden.exit_code, 0) << overridden.output;
  EXPECT_NE(Lines(overridden.output), after) << "the command line's rate was not the one used";
}

TEST_F(ParamGroupsCli, BadValuesAreRefusedAndFlagsWithoutTheirTargetNoted) {
  struct Case {
    std::string flags, says;
  };
  for (const Case& c :
       {Case{"--decoupled-lr -1e-3", "--decoupled-lr: must be a finite number >= 0"},
        Case{"--decoupled-lr 1e-3 --decoupled-min-lr -1", "--decoupled-min-lr: must be a finite"},
        Case{"--decoupled-lr 1e-4", "--decoupled-lr (0.0001) must be at least --min-lr (0.0003)"},
        Case{"--decoupled-lr 1e-3 --decoupled-min-lr 2e-3",
             "--decoupled-lr (0.001) must be at least --decoupled-min-lr (0.002)"},
        Case{"--no-weight-decay-cond-type apply_wd_to_all", "the one choice is apply_wd_to_qk_layernorm"},
        Case{"--head-lr-mult 2", "no parameter group reads it"}}) {
    auto r = RunCmd(Train(1, 1, c.flags, 4));
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
  }
  auto r = RunCmd(Train(1, 1, "--decoupled-min-lr 1e-4 --no-weight-decay-cond-type apply_wd_to_qk_layernorm", 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* note : {"--decoupled-min-lr: accepted, no effect without --decoupled-lr (as Megatron)",
                           "--no-weight-decay-cond-type apply_wd_to_qk_layernorm: deprecated in Megatron, taken as "
                           "--apply-wd-to-qk-layernorm",
                           "--apply-wd-to-qk-layernorm: accepted, no effect without --qk-layernorm (as Megatron)"})
    EXPECT_NE(r.output.find(note), std::string::npos) << note << "\n" << r.output;
}

}  // namespace
}  // namespace ptk
