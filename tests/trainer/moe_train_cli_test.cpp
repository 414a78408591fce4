// ptk-train's mixture-of-experts layers end to end (--num-experts, CPU): the log line's
// load_balancing_loss, checkpoints under Megatron's expert names that resume bit for bit (the MoE flags
// taken by --use-checkpoint-args) and refuse other MoE flags as another model, ptk-convert's refusal,
// data parallelism (plain, --use-distributed-optimizer and --overlap-grad-reduce, ranks as processes
// over loopback gloo), --dry-run's parameter count against megatron-core's (the golden's tensors), and
// every feature and combination not implemented refused in one line naming it.
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

constexpr char kMoe[] =
    " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01"
    " --disable-bias-linear";

class MoeTrainCli : public testing::RanksTest {
 protected:
  MoeTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  // 2 layers (the second MoE with --moe-layer-freq 2 where given); global batch 4 of micro-batches of 1.
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1 --threads 1"
           " --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + kMoe + " " + extra;
  }
  // The load_balancing_loss of each log line.
  static std::vector<double> Balancing(const std::string& out) {
    std::vector<double> v;
    const std::regex re(R"(\| lm loss: \S+ \| load_balancing_loss: (\S+) \|)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
    return v;
  }
};

TEST_F(MoeTrainCli, TrainsLogsTheLoadBalancingLossAndSavesMegatronsNames) {
  auto r = RunCmd(Train("--save " + ShellQuote(dir_ / "ck"), 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lb = Balancing(r.output);
  ASSERT_EQ(lb.size(), 4u) << r.output;
  for (double v : lb) EXPECT_TRUE(v >= 1.0 && v < 2.0) << v;  // 1 for an even split, up to E for one expert
  // The checkpoint holds the MoE layout's tensors (LoadCheckpoint checks every name and shape).
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.add_bias_linear = false;
  c.gelu_exact = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_NE(layout->Find("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"), nullptr);
  std::vector<float> p, m, v;
  TrainState st;
  EXPECT_TRUE(LoadCheckpoint(dir_ / "ck", 4, *layout, &p, &m, &v, &st).ok());
  // Another expert count is another model: its layout does not load.
  c.num_experts = 3;
  auto other = ParamLayout::Create(c);
  EXPECT_FALSE(LoadCheckpoint(dir_ / "ck", 4, *other, &p, &m, &v, &st).ok());
  // This GPT-2-style MoE model is no Mixtral (hf_mixtral_test.py exports the Llama line's), and no Megatron
  // exporter maps the experts yet: refused in one line each, nothing written.
  for (const char* saver : {"hf", "megatron"}) {
    const std::string out = dir_ / (std::string("export-") + saver);
    auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver " + saver + " --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(out));
    EXPECT_EQ(e.exit_code, 1) << e.output;
    EXPECT_NE(e.output.find(saver == std::string("hf")
                                ? "this mixture-of-experts model (--num-experts 4) is not one Hugging Face's "
                                  "MixtralForCausalLM computes: GELU experts without --swiglu"
                                : "a mixture-of-experts model (--num-experts 4): ptk-convert does not export MoE "
                                  "checkpoints to Megatron yet"),
              std::string::npos)
        << e.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << saver;
  }
}

TEST_F(MoeTrainCli, AStoppedRunResumesBitForBitAndOtherMoeFlagsAreAnotherModel) {
  auto whole = RunCmd(Train("--moe-layer-freq 2 --save " + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = RunCmd(Train("--moe-layer-freq 2 --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto resumed = RunCmd(Train("--moe-layer-freq 2 --load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output), b = testing::LogLinesWithoutTimes(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  ASSERT_EQ(b.size(), 3u) << resumed.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  EXPECT_NE(a[0].find("load_balancing_loss"), std::string::npos) << a[0];
  // --use-checkpoint-args takes the MoE flags from the checkpoint over the command line's (Megatron's force=True).
  auto taken =
      RunCmd(Train("--moe-layer-freq 1 --moe-router-topk 1 --moe-router-pre-softmax --use-checkpoint-args --load " +
                   ShellQuote(dir_ / "ck")));
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), b);
  for (const char* note : {"--use-checkpoint-args: --moe-router-topk 2 from the checkpoint",
                           "--use-checkpoint-args: --moe-router-pre-softmax off from the checkpoint",
                           "--use-checkpoint-args: --moe-layer-freq [1,0] from the checkpoint"})
    EXPECT_NE(taken.output.find(note), std::string::npos) << note << "\n" << taken.output;
  for (const char* other : {"--moe-layer-freq 1", "--moe-layer-freq 2 --moe-router-topk 1",
                            "--moe-layer-freq 2 --moe-router-pre-softmax"}) {
    auto r = RunCmd(Train(std::string(other) + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(r.exit_code, 0) << other;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << other << "\n" << r.output;
  }
}

TEST_F(MoeTrainCli, DataParallelRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = testing::LossesOf(one.output);
  const auto ref_lb = Balancing(one.output);
  ASSERT_EQ(ref_lb.size(), 6u);
  std::string plain, zero;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(""), ref, 6, 1e-5, "2 ranks", &plain));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train("--use-distributed-optimizer"), ref, 6, 1e-5, "2 ranks, distributed optimizer", &zero));
  // The load-balancing loss: each rank's micro-batches' mean, averaged over the ranks (Megatron's).
  for (const std::string* out : {&plain, &zero}) {
    const auto lb = Balancing(*out);
    ASSERT_EQ(lb.size(), 6u) << *out;
    for (size_t i = 0; i < lb.size(); ++i) EXPECT_NEAR(lb[i], ref_lb[i], 1e-5 * ref_lb[i]) << i;
  }
  EXPECT_EQ(testing::LogLinesWithoutTimes(plain), testing::LogLinesWithoutTimes(zero));
  // --overlap-grad-reduce's buckets (small ones: several per MoE layer) reduce the same sums.
  std::string overlap;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--overlap-grad-reduce --ddp-bucket-size 5000"), ref, 6, 1e-5,
                                          "2 ranks, overlapped reduction", &overlap));
  EXPECT_EQ(testing::LogLinesWithoutTimes(plain), testing::LogLinesWithoutTimes(overlap));
}

// megatron-core's parameter count of tests/data/trainer/moe_gelu's model (its golden's tensors).
TEST_F(MoeTrainCli, DryRunCountsParametersAsMegatron) {
  simdjson::dom::parser parser;
  simdjson::dom::element meta = parser.load(testing::SourceDir() + "/tests/data/trainer/moe_gelu.json");
  int64_t megatron = 0;
  for (auto name : meta["param_order"].get_array()) {
    int64_t n = 1;
    for (auto d : meta["tensors"]["init:" + std::string(name.get_string().value())]["shape"].get_array())
      n *= int64_t(d);
    megatron += n;
  }
  auto r = RunCmd("WORLD_SIZE=2 " + testing::Tool("ptk-train") +
                  " --dry-run --num-layers 3 --hidden-size 16 --num-attention-heads 4 --ffn-hidden-size 24"
                  " --seq-length 8 --max-position-embeddings 8 --vocab-size 40 --make-vocab-size-divisible-by 8"
                  " --untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 4 --train-iters 1"
                  " --lr 1e-3 --disable-bias-linear --num-experts 4 --moe-ffn-hidden-size 12"
                  " --moe-layer-freq '[1,0,1]'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: " + std::to_string(megatron) + " parameters"), std::string::npos) << megatron << "\n"
                                                                                                    << r.output;
}

TEST_F(MoeTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingIt) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags();
  const std::string moe = " --num-experts 4 --disable-bias-linear";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --num-experts 4", "usage error: --num-experts without --disable-bias-linear"},
      {moe + " --moe-router-score-function tanh", "usage error: --moe-router-score-function tanh: softmax or sigmoid"},
      {moe + " --moe-router-load-balancing-type seq_aux_loss",
       "usage error: --moe-router-load-balancing-type "
       "seq_aux_loss: not implemented"},
      {moe + " --moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type sinkhorn: not"},
      {moe + " --moe-expert-capacity-factor 1.0",
       "usage error: --moe-expert-capacity-factor 1.0: this "
       "mixture-of-experts feature is not implemented"},
      {moe + " --moe-shared-expert-intermediate-size 64", "--moe-shared-expert-intermediate-size 64: this mixture"},
      {moe + " --moe-z-loss-coeff 0.001", "--moe-z-loss-coeff 0.001: this mixture-of-experts"},
      {moe + " --moe-router-enable-expert-bias", "--moe-router-enable-expert-bias: this mixture-of-experts"},
      {moe + " --moe-router-group-topk 2", "--moe-router-group-topk 2: this mixture-of-experts"},
      {moe + " --moe-router-topk-scaling-factor 2", "--moe-router-topk-scaling-factor 2: this mixture"},
      {moe + " --moe-token-dispatcher-type flex", "usage error: --moe-token-dispatcher-type flex:"},
      {moe + " --moe-router-dtype fp64", "usage error: --moe-router-dtype fp64: ptk's router computes in fp32"},
      {moe + " --moe-router-topk 5", "usage error: --moe-router-topk 5 is more than --num-experts 4"},
      {moe + " --moe-layer-freq '[1,0]'", "usage error: --moe-layer-freq [1,0]: 2 entries for --num-layers 3"},
      {moe + " --moe-layer-freq '[1,2,1]'", "usage error: --moe-layer-freq [1,2,1]: entry 2"},
      {moe + " --moe-layer-freq '__import__(\"os\")'",
       "usage error: --moe-layer-freq __import__(\"os\"): a "
       "positive count"},
      {moe + " --moe-layer-freq '[0]*3'", "usage error: --moe-layer-freq [0]*3: no layer is MoE"},
      {moe + " --expert-model-parallel-size 2", "usage error: --num-experts 4 with --expert-model-parallel-size 2:"},
      {moe + " --tensor-model-parallel-size 2", "usage error: --num-experts 4 with --tensor-model-parallel-size 2:"},
      {moe + " --pipeline-model-parallel-size 3", "--num-experts 4 with --pipeline-model-parallel-size 3:"},
      {moe + " --context-parallel-size 2", "usage error: --num-experts 4 with --context-parallel-size 2:"},
      {moe + " --device cuda", "usage error: --num-experts 4 on --device cuda: the CUDA backend has no"},
      {moe + " --dry-run --bf16", "usage error: --num-experts 4 on --device cuda"},
      {moe + " --dry-run --tensor-model-parallel-size 2", "--num-experts 4 with --tensor-model-parallel-size 2"},
  };
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
  }
  // Speed-only flags are accepted with a note, and --moe-* without --num-experts changes nothing (as Megatron).
  auto r = RunCmd(base + moe + " --moe-grouped-gemm --moe-permute-fusion --moe-token-dispatcher-type alltoall" +
                  " --moe-router-dtype fp32" +
                  " --moe-router-load-balancing-type none --moe-aux-loss-coeff 0.1 --train-iters 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --moe-grouped-gemm: accepted, speed only"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --moe-router-dtype fp32: accepted"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --moe-aux-loss-coeff: accepted, no effect with --moe-router-load-balancing-type "
                          "none"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("load_balancing_loss"), std::string::npos) << r.output;  // none logged without the loss
  auto dense = RunCmd(base + " --moe-router-topk 1 --train-iters 1");
  EXPECT_EQ(dense.exit_code, 0) << dense.output;
  EXPECT_NE(dense.output.find("note: --moe-* flags: accepted, no effect without --num-experts"), std::string::npos)
      << dense.output;
}

}  // namespace
}  // namespace ptk
