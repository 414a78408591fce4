// ptk-train's multi-token prediction end to end (--mtp-num-layers, CPU): the log line's mtp_K loss entries after
// the lm loss, --metrics-file's mtp_K_loss, checkpoints under megatron-core's mtp.layers.K names that resume bit
// for bit (dropout on: the depths' masks keyed too), two data ranks training as one, ptk-convert's refusal,
// --dry-run's parameter count against megatron-core's (tests/data/trainer/mtp_tied's tensors), and every
// combination not implemented refused in one line naming it. With MoE and MLA (DeepSeek-V3's shape: a depth's layer an
// MoE layer of multi-latent attention): the log line's load-balancing and mtp_K losses, the depths' router, experts,
// shared experts, MLA projections and expert biases under Megatron's names, and a bit-for-bit resume.
#include <filesystem>
#include <fstream>
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

class MtpTrainCli : public testing::RanksTest {
 protected:
  MtpTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1 --threads 1"
           " --mtp-num-layers 2 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
};

TEST_F(MtpTrainCli, TrainsLogsTheDepthsLossesAndSavesMegatronsNames) {
  const std::string metrics = dir_ / "metrics.jsonl";
  auto r = RunCmd(Train("--save " + ShellQuote(dir_ / "ck") + " --metrics-file " + ShellQuote(metrics), 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::LossesOf(r.output).size(), 4u) << r.output;
  // Megatron's order: lm loss, the MoE entries (none here), then mtp_1 loss, mtp_2 loss, before the loss scale.
  const std::regex line(R"(\| lm loss: \S+ \| mtp_1 loss: \S+ \| mtp_2 loss: \S+ \| loss scale: )");
  int lines = 0;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it)
    ++lines;
  EXPECT_EQ(lines, 4) << r.output;
  std::ifstream f(metrics);
  std::string first;
  std::getline(f, first);
  EXPECT_NE(first.find("\"mtp_1_loss\": "), std::string::npos) << first;
  EXPECT_NE(first.find("\"mtp_2_loss\": "), std::string::npos) << first;
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.num_layers = 2;
  c.mtp_num_layers = 2;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const char* name :
       {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.bias", "mtp.layers.1.eh_proj.weight",
        "mtp.layers.1.transformer_layer.mlp.linear_fc2.weight", "mtp.layers.1.final_layernorm.weight"})
    EXPECT_NE(layout->Find(name), nullptr) << name;
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status loaded = LoadCheckpoint(dir_ / "ck", 4, *layout, &p, &m, &v, &st);
  EXPECT_TRUE(loaded.ok()) << loaded;
  c.mtp_num_layers = 1;  // another depth count is another model
  auto other = ParamLayout::Create(c);
  EXPECT_FALSE(LoadCheckpoint(dir_ / "ck", 4, *other, &p, &m, &v, &st).ok());
  for (const char* saver : {"hf"}) {  // --saver megatron writes MTP depths (megatron_mtp_test)
    const std::string out = dir_ / (std::string("export-") + saver);
    auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver " + saver + " --load-dir " +
                    ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(out));
    EXPECT_NE(e.exit_code, 0) << e.output;
    EXPECT_NE(e.output.find("a multi-token prediction model (--mtp-num-layers 2): ptk-convert does not export MTP"),
              std::string::npos)
        << e.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << saver;
  }
}

TEST_F(MtpTrainCli, AStoppedRunResumesBitForBit) {
  auto whole = RunCmd(Train("--save " + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = RunCmd(Train("--exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto resumed = RunCmd(Train("--load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output), b = testing::LogLinesWithoutTimes(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  ASSERT_EQ(b.size(), 3u) << resumed.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  EXPECT_NE(b[0].find(" mtp_1 loss: "), std::string::npos) << b[0];
  // Without the depths the checkpoint is another model.
  const std::string plain =
      std::regex_replace(Train("--load " + ShellQuote(dir_ / "ck")), std::regex(" --mtp-num-layers 2"), "");
  auto r = RunCmd(plain);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--mtp-num-layers"), std::string::npos) << r.output;
  // --use-checkpoint-args takes the depths from the checkpoint: the same resume.
  const std::string taken = std::regex_replace(Train("--use-checkpoint-args --load " + ShellQuote(dir_ / "ck")),
                                               std::regex(" --mtp-num-layers 2"), "");
  auto t = RunCmd(taken);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(t.output), b);
}

constexpr char kMoeMla[] =
    " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01 --disable-bias-linear"
    " --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-shared-expert-intermediate-size 32"
    " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4"
    " --v-head-dim 6 --qk-layernorm --normalization RMSNorm --position-embedding-type rope ";

TEST_F(MtpTrainCli, WithMoeAndMlaTrainsLogsSavesAndResumesBitForBit) {
  auto whole = RunCmd(Train(kMoeMla + std::string("--save ") + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  // Megatron's order: lm loss, load_balancing_loss (over the MoE layers and the depths), mtp_1 loss, mtp_2 loss.
  const std::regex line(R"(\| lm loss: \S+ \| load_balancing_loss: \S+ \| mtp_1 loss: \S+ \| mtp_2 loss: \S+ \| )");
  const auto a = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  for (const std::string& l : a) EXPECT_TRUE(std::regex_search(l, line)) << l;
  auto first = RunCmd(Train(kMoeMla + std::string("--exit-interval 3 --save ") + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto resumed = RunCmd(Train(kMoeMla + std::string("--load ") + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(resumed.output), std::vector<std::string>(a.begin() + 3, a.end()));
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.add_bias_linear = false;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  c.moe_shared_expert_intermediate_size = 32;
  c.moe_router_sigmoid = c.moe_router_enable_expert_bias = true;
  c.gelu_exact = true;  // --disable-bias-linear: no bias-GELU fusion
  c.multi_latent_attention = c.qk_layernorm = true;
  c.q_lora_rank = 16, c.kv_lora_rank = 12, c.qk_head_dim = 8, c.qk_pos_emb_head_dim = 4, c.v_head_dim = 6;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.mtp_num_layers = 2;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const char* name : {"mtp.layers.0.transformer_layer.mlp.router.weight",
                           "mtp.layers.1.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight",
                           "mtp.layers.1.transformer_layer.mlp.shared_experts.linear_fc1.weight",
                           "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight",
                           "mtp.layers.1.transformer_layer.self_attention.kv_layernorm.weight"})
    EXPECT_NE(layout->Find(name), nullptr) << name;
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status loaded = LoadCheckpoint(dir_ / "full", 6, *layout, &p, &m, &v, &st);
  ASSERT_TRUE(loaded.ok()) << loaded;
  std::vector<std::string> buffers;
  for (const auto& [name, values] : st.buffers) buffers.push_back(name);
  EXPECT_EQ(buffers, (std::vector<std::string>{"decoder.layers.0.mlp.router.expert_bias",
                                               "decoder.layers.1.mlp.router.expert_bias",
                                               "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                                               "mtp.layers.1.transformer_layer.mlp.router.expert_bias"}));
}

TEST_F(MtpTrainCli, TwoDataRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(""), testing::LossesOf(one.output), 6, 1e-5, "D=2", &out));
}

// megatron-core's parameter count of tests/data/trainer/mtp_tied's model (its golden's tensors).
TEST_F(MtpTrainCli, DryRunCountsParametersAsMegatron) {
  simdjson::dom::parser parser;
  simdjson::dom::element meta = parser.load(testing::SourceDir() + "/tests/data/trainer/mtp_tied.json");
  int64_t megatron = 0;
  for (auto name : meta["param_order"].get_array()) {
    int64_t n = 1;
    for (auto d : meta["tensors"]["init:" + std::string(name.get_string().value())]["shape"].get_array())
      n *= int64_t(d);
    megatron += n;
  }
  auto r = RunCmd(testing::Tool("ptk-train") +
                  " --dry-run --num-layers 2 --hidden-size 16 --num-attention-heads 4 --ffn-hidden-size 24"
                  " --seq-length 8 --max-position-embeddings 8 --vocab-size 40 --make-vocab-size-divisible-by 8"
                  " --micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mtp-num-layers 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: " + std::to_string(megatron) + " parameters"), std::string::npos) << megatron << "\n"
                                                                                                    << r.output;
}

TEST_F(MtpTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingIt) {
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data " +
                           testing::SmallVocabFlags();
  const std::string mtp = " --mtp-num-layers 1";
  const std::string with = "usage error: --mtp-num-layers with ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {mtp + " --mtp-standalone", "usage error: --mtp-standalone: multi-token prediction on a pipeline stage"},
      {" --mtp-standalone", "usage error: --mtp-standalone"},
      // Tensor (with sequence parallelism too) and pipeline parallelism run (mtp_parallel_cli_test); what they do not
      // run with is refused.
      {mtp + " --pipeline-model-parallel-size 2",
       with + "--pipeline-model-parallel-size 2 and learned absolute position embeddings: Megatron's last stage"},
      {mtp + " --context-parallel-size 2", with + "--context-parallel-size 2: ptk does not yet roll"},
      {mtp + " --device cuda", with + "--device cuda"},
      {mtp + " --dry-run --bf16", with + "--device cuda"},
      {mtp + " --dry-run --context-parallel-size 2", with + "--context-parallel-size 2"},
      {" --mtp-num-layers -1", "usage error: --mtp-num-layers"},
      {mtp + " --mtp-loss-scaling-factor -1", "usage error: --mtp-loss-scaling-factor"},
  };
  for (const auto& [flags, want] : cases) {
    auto r = RunCmd(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
  }
  auto plain = RunCmd(base + " --mtp-loss-scaling-factor 0.5 --train-iters 1");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("--mtp-loss-scaling-factor: accepted, no effect without --mtp-num-layers"),
            std::string::npos)
      << plain.output;
}

}  // namespace
}  // namespace ptk
