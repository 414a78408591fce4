// ptk-train's interleaved pipeline schedule end to end, ranks as processes over loopback gloo: a
// 4-layer model at P = 2 in two chunks of one layer (--num-layers-per-virtual-pipeline-stage 1, or
// --num-virtual-stages-per-pipeline-rank 2), 8 micro-batches a step, dropout on, gives one rank's
// loss lines within 1e-6 relative over 20 iterations and the 1F1B run's printed losses; T = 2 x
// P = 2 x data 2 with ZeRO-1, and T = 2 x P = 2 with --sequence-parallel, within 1e-5; P = 2 x data 2
// with --overlap-grad-reduce gives the run without it's printed losses; checkpoints
// resume at the same layout with the uninterrupted run's lines character for character, load at
// P = 2 without chunks and at P = 4, a 1F1B checkpoint loads into the interleaved run, ptk-convert
// exports one, and through Megatron's interleaved format (model0, model1) the run continues;
// Megatron's refusals and ptk's exit 2 in one line; text samples are one rank's through the chunks,
// TensorBoard and the level-2 timers run; --dry-run plans the layout.
// --microbatch-group-size-per-virtual-pipeline-stage 3 and 8 (groups other than P = 2) print the
// default group's log lines character for character, a checkpoint records the group, and a resume
// in other groups continues the same lines; without chunks the flag changes nothing (a note);
// Megatron's refusals of a group size are one line.
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

class InterleavedCli : public testing::PipelineCliTest {};

constexpr const char* kTwoChunks = "--num-layers-per-virtual-pipeline-stage 1";  // 4 layers, P = 2: V = 2

TEST_F(InterleavedCli, TwoChunksGiveOneRanksAndTheOneChunkRunsLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u) << OneRank();
  std::string plain, out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, ""), one, 20, 1e-6, "P=2", &plain));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, kTwoChunks), one, 20, 1e-6, "P=2 x V=2", &out));
  // Each chunk's backwards in micro-batch order: the 1F1B run's printed losses.
  EXPECT_EQ(Losses(out), Losses(plain));
  EXPECT_NE(out.find("validation loss at iteration 20 | lm loss value: "), std::string::npos) << out;
  EXPECT_NE(out.find("data parallel: 1 ranks x pipeline parallel: 2 stages of 2 model chunks (the interleaved "
                     "schedule) ("),
            std::string::npos)
      << out;
  // --num-virtual-stages-per-pipeline-rank says the same.
  std::string same;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, "--num-virtual-stages-per-pipeline-rank 2"), one, 20, 1e-6,
                                          "P=2, 2 virtual stages", &same));
  EXPECT_EQ(Lines(same), Lines(out));
}

// Megatron's --microbatch-group-size-per-virtual-pipeline-stage orders the same passes otherwise: each
// chunk's backwards stay in micro-batch order, so the same bits and the same printed lines.
TEST_F(InterleavedCli, MicroBatchGroupsChangeTheOrderNotTheLosses) {
  const auto one = Losses(OneRank());
  const std::string group = std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage ";
  std::string by_default, threes, whole;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, kTwoChunks), one, 20, 1e-6, "P=2 x V=2", &by_default));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, group + "3"), one, 20, 1e-6, "groups of 3", &threes));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, group + "8"), one, 20, 1e-6, "one group of 8", &whole));
  const auto want = Lines(by_default);
  ASSERT_EQ(want.size(), 20u) << by_default;
  EXPECT_EQ(Lines(threes), want);
  EXPECT_EQ(Lines(whole), want);
  // The checkpoint records the group as run; a resume in groups of 8 continues the same lines.
  const std::string ck = dir_ / "ck";
  auto first = Ranks(2, Train(1, 2, group + "3 --exit-interval 10 --save " + ShellQuote(ck)));
  ASSERT_NE(first.output.find(AllZero(2)), std::string::npos) << first.output << Logs(2);
  const std::string header = ptk::testing::ReadFile(dir_ / "ck/iter_0000010/mp_rank_00_000/model_optim_rng.ptk");
  EXPECT_NE(header.find(R"(["--microbatch-group-size-per-virtual-pipeline-stage", "3"])"), std::string::npos)
      << header.substr(0, 4000);
  auto resumed = Ranks(2, Train(1, 2, group + "8 --load " + ShellQuote(ck)));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  EXPECT_EQ(Lines(resumed.output), std::vector<std::string>(want.begin() + 10, want.end())) << resumed.output;
  // Without chunks Megatron's 1F1B has no groups: a note, one rank's lines.
  auto plain = RunCmd(Train(1, 1, "--microbatch-group-size-per-virtual-pipeline-stage 3"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("note: --microbatch-group-size-per-virtual-pipeline-stage 3: without model chunks"),
            std::string::npos)
      << plain.output;
  EXPECT_EQ(Lines(plain.output), Lines(OneRank()));
}

TEST_F(InterleavedCli, TensorPipelineAndDataRanksWithZeroOne) {
  const auto one = Losses(OneRank());
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(8, Train(2, 2, std::string(kTwoChunks) + " --use-distributed-optimizer"), one,
                                          20, 1e-5, "T=2 x P=2 x D=2 x V=2, ZeRO-1", &out));
  // --overlap-grad-reduce: each chunk's buckets reduced from its last backward, the same printed losses.
  std::string plain, overlapped;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(1, 2, kTwoChunks), one, 20, 1e-5, "P=2 x D=2 x V=2", &plain));
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4,
                                          Train(1, 2,
                                                std::string(kTwoChunks) + " --overlap-grad-reduce "
                                                                          "--ddp-bucket-size 3000"),
                                          one, 20, 1e-5, "P=2 x D=2 x V=2, --overlap-grad-reduce", &overlapped));
  EXPECT_EQ(Losses(overlapped), Losses(plain));
  // --sequence-parallel: each chunk sends its tensor rank's shard of the sequence.
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(4, Train(2, 2, std::string(kTwoChunks) + " --sequence-parallel"), one, 20,
                                          1e-5, "T=2 x P=2 x V=2, --sequence-parallel", &out));
}

TEST_F(InterleavedCli, CheckpointsResumeAndLoadAcrossChunkLayouts) {
  const auto train = [&](const std::string& extra) { return Train(1, 2, std::string(kTwoChunks) + " " + extra); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/1, p 1/2 ]", {"mp_rank_00_000", "mp_rank_00_001"}, "mp_rank_00"));
  // The header names each tensor by its chunk, its layers numbered from 0 within it (Megatron's).
  const std::string header = ptk::testing::ReadFile(dir_ / "ck/iter_0000010/mp_rank_00_001/model_optim_rng.ptk");
  EXPECT_NE(header.find(R"("virtual_pipeline_model_parallel_size": 2)"), std::string::npos) << header.substr(0, 3000);
  EXPECT_NE(header.find(R"({"model": "model1", "name": "decoder.layers.0.input_layernorm.weight")"), std::string::npos);
  // ptk-convert reads the chunks put together (iteration 10's, copied).
  auto hf =
      RunCmd(ptk::testing::Tool("ptk-convert") + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck1") +
             " --save-dir " + ShellQuote(dir_ / "hf") + " " + testing::SmallVocabFlags());
  EXPECT_EQ(hf.exit_code, 0) << hf.output;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "hf/model.safetensors")) << hf.output;
  // The chunked checkpoint at P = 2 without chunks and at P = 4; a 1F1B checkpoint with chunks.
  const auto one = Losses(OneRank());
  for (int P : {2, 4}) {
    const std::string dst = dir_ / (P == 2 ? "ck1" : "ck4"), what = "V=2 checkpoint at P=" + std::to_string(P);
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(P, Train(1, P, "--load " + ShellQuote(dst) + " --save " + ShellQuote(dst)),
                                            one, 10, 1e-6, what, &out));
    EXPECT_EQ(Losses(out).front().first, 11);
  }
  const std::string plain = dir_ / "plain";
  auto first = Ranks(2, Train(1, 2, "--exit-interval 10 --save " + ShellQuote(plain)));
  ASSERT_NE(first.output.find(AllZero(2)), std::string::npos) << first.output << Logs(2);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(
      2, Train(1, 2, std::string(kTwoChunks) + " --load " + ShellQuote(plain) + " --save " + ShellQuote(plain)), one,
      10, 1e-6, "1F1B checkpoint with V=2", &out));
  EXPECT_NE(out.find("resuming with --num-virtual-stages-per-pipeline-rank 2 (the checkpoint of iteration 10"),
            std::string::npos)
      << out;
}

// An interleaved run's checkpoint through Megatron's format with its chunks (ptk-convert --saver
// megatron --target-num-layers-per-virtual-pipeline-stage 1: model0, model1 in each mp_rank file) and
// back (--loader megatron) resumes as the run itself: the uninterrupted run's log lines, character
// for character.
TEST_F(InterleavedCli, ThroughMegatronsInterleavedCheckpointTheRunContinues) {
  const auto train = [&](const std::string& extra) { return Train(1, 2, std::string(kTwoChunks) + " " + extra); };
  const std::string full = dir_ / "full", ck = dir_ / "ck", meg = dir_ / "meg", back = dir_ / "back";
  auto whole = Ranks(2, train("--save " + ShellQuote(full)));
  ASSERT_NE(whole.output.find(AllZero(2)), std::string::npos) << whole.output << Logs(2);
  auto first = Ranks(2, train("--exit-interval 10 --save " + ShellQuote(ck)));
  ASSERT_NE(first.output.find(AllZero(2)), std::string::npos) << first.output << Logs(2);
  const std::string convert = ptk::testing::Tool("ptk-convert");
  auto out = RunCmd(convert + " --loader ptk --saver megatron --load-dir " + ShellQuote(ck) + " --save-dir " +
                    ShellQuote(meg) +
                    " --target-pipeline-parallel-size 2 --target-num-layers-per-virtual-pipeline-stage 1"
                    " --make-vocab-size-divisible-by 512");
  ASSERT_EQ(out.exit_code, 0) << out.output;
  const std::string rank1 = ptk::testing::ReadFile(dir_ / "meg/iter_0000010/mp_rank_00_001/model_optim_rng.pt");
  EXPECT_NE(rank1.find("model1"), std::string::npos);
  auto in = RunCmd(convert + " --loader megatron --saver ptk --load-dir " + ShellQuote(meg) + " --save-dir " +
                   ShellQuote(back));
  ASSERT_EQ(in.exit_code, 0) << in.output;
  EXPECT_NE(in.output.find("of 2 model chunks each (interleaved)"), std::string::npos) << in.output;
  auto resumed = Ranks(2, train("--load " + ShellQuote(back) + " --save " + ShellQuote(back)));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  const auto want = Lines(whole.output), got = Lines(resumed.output);
  ASSERT_EQ(want.size(), 20u) << whole.output;
  EXPECT_EQ(got, std::vector<std::string>(want.begin() + 10, want.end())) << resumed.output;
}

// Text samples run each token's forward through the chunks: one rank's samples; TensorBoard's
// events come from the last stage; the level-2 timers time the chunks' passes and exchanges.
TEST_F(InterleavedCli, SamplesTensorBoardAndTimersThroughTheChunks) {
  const std::string common = "--sample-interval 10 --sample-length 6 ";
  auto samples = [](const std::string& out) {
    std::vector<std::string> v;
    const std::regex re(R"( sample at iteration +\d+ \(.*)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(it->str());
    return v;
  };
  auto one = RunCmd(Train(1, 1, common));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string tb = dir_ / "tb";
  auto two = Ranks(2, Train(1, 2, common + kTwoChunks + " --timing-log-level 2 --tensorboard-dir " + ShellQuote(tb)));
  ASSERT_NE(two.output.find(AllZero(2)), std::string::npos) << two.output << Logs(2);
  const auto want = samples(one.output);
  ASSERT_EQ(want.size(), 2u) << one.output;
  EXPECT_EQ(samples(two.output), want) << two.output;
  EXPECT_NE(Logs(2).find("TensorBoard events: " + tb), std::string::npos) << Logs(2);
  for (const char* timer : {"forward-compute", "backward-compute", "forward-backward-send-forward-backward-recv"})
    EXPECT_NE(Logs(2).find(timer), std::string::npos) << timer << "\n" << Logs(2);  // the last rank prints them
}

TEST_F(InterleavedCli, WhatMegatronAndPtkRefuseIsOneLine) {
  struct Case {
    int world, P;
    std::string extra, says;
  };
  for (const Case& c : {
           Case{1, 1, kTwoChunks, "the interleaved schedule needs --pipeline-model-parallel-size above 1"},
           Case{2, 2, "--num-layers-per-virtual-pipeline-stage 3",
                "must be divisible by the layers of a virtual stage"},
           Case{2, 2, std::string(kTwoChunks) + " --num-virtual-stages-per-pipeline-rank 2", "give one of them"},
           Case{2, 2, std::string(kTwoChunks) + " --global-batch-size 5", "must be a multiple of it"},
           Case{2, 2, std::string(kTwoChunks) + " --decoder-first-pipeline-num-layers 1", "splits the layers evenly"},
           // Megatron-core's checks of the micro-batch groups (8 micro-batches a step; 4 with a batch of 4).
           Case{2, 2, std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage 1", "[PP=2, M=8]"},
           Case{2, 2, std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage 9", "[PP=2, M=8]"},
           Case{2, 2,
                std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage 3 --global-batch-size 4",
                "holds 1 (M mod N), fewer than the pipeline size 2"},
           Case{1, 2, std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage 0",
                "--microbatch-group-size-per-virtual-pipeline-stage: must be an integer in [1, "},
       }) {
    SCOPED_TRACE(c.extra);
    auto r = c.world == 1 ? RunCmd(Train(1, c.P, c.extra)) : Ranks(c.world, Train(1, c.P, c.extra));
    EXPECT_NE(r.output.find(c.world == 1 ? "usage error" : "rc=2 2"), std::string::npos) << r.output;
    if (c.world == 1) {
      EXPECT_EQ(r.exit_code, 2) << r.output;
    }
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
  }
  // The CUDA backend runs the schedule too (over NCCL or gloo): --device cuda with chunks gets past
  // the options, to the device (none here: the module's or the driver's line) or, on a GPU, to the
  // world of one rank that two stages need two of.
  for (const char* backend : {"", " --distributed-backend nccl", " --distributed-backend gloo"}) {
    SCOPED_TRACE(backend);
    auto cuda = RunCmd(Train(1, 2, std::string(kTwoChunks) + " --device cuda" + backend));
    EXPECT_NE(cuda.exit_code, 0) << cuda.output;
    EXPECT_EQ(cuda.output.find("interleaved"), std::string::npos) << cuda.output;
    EXPECT_EQ(cuda.output.find("virtual"), std::string::npos) << cuda.output;
  }
  // --dry-run plans the interleaved layout (the parameters of each rank as without chunks; Megatron's
  // virtual micro-batches in flight) for any world, even one that would run on GPUs.
  auto plan = RunCmd("WORLD_SIZE=2 " + Train(1, 2, std::string(kTwoChunks) + " --dry-run --device cuda"));
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find(" > number of parameters on (tensor, pipeline) model parallel rank (0, 1): "),
            std::string::npos)
      << plan.output;
  EXPECT_NE(plan.output.find("virtual micro-batches of its 2 chunks' layers each"), std::string::npos) << plan.output;
  auto grouped =
      RunCmd("WORLD_SIZE=2 " +
             Train(1, 2, std::string(kTwoChunks) + " --microbatch-group-size-per-virtual-pipeline-stage 4 --dry-run"));
  EXPECT_EQ(grouped.exit_code, 0) << grouped.output;
  EXPECT_NE(grouped.output.find("micro-batch groups of N = 4"), std::string::npos) << grouped.output;
}

}  // namespace
}  // namespace ptk
