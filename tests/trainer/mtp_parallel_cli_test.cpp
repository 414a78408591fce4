// ptk-train's multi-token prediction (--mtp-num-layers, CPU) with model parallelism, as megatron-core 0.16 runs it:
// two tensor ranks (eh_proj column-parallel, its output gathered; the depth's layer a tensor-parallel layer; the
// embedding vocabulary-parallel) and two pipeline stages (the depths on the last stage beside a copy of the word
// embeddings, tied or not, its gradient summed with the first stage's) train as one rank does: the lm loss and each
// depth's mtp_K loss within 1e-5 relative over 6 iterations (the only difference is fp32 sums over the ranks in
// another order: one rank's products split into partial sums, the vocabulary's softmax over two slices). A run
// stopped and resumed at the same size continues bit for bit (dropout on), the depths' tensors in the last stage's
// mp_rank_00_001 (none in mp_rank_00_000) and eh_proj's rows split over mp_rank_00 and mp_rank_01. With
// --sequence-parallel (dense and DeepSeek-like MoE, one or two depths) likewise, and its checkpoint loads at T = 1.
// With --overlap-grad-reduce every run gives the bits of the run without it; two expert ranks give two data ranks'
// losses; the interleaved schedule (two chunks a stage) trains as one rank does.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

// Each log line's losses: the lm loss, then mtp_1, mtp_2, ... (in the line's order).
std::vector<std::vector<double>> LineLosses(const std::string& out) {
  std::vector<std::vector<double>> all;
  for (const std::string& line : testing::LogLinesWithoutTimes(out)) {
    std::vector<double> v;
    const std::regex loss(R"((lm|mtp_\d+) loss: (\S+) \|)");
    for (auto it = std::sregex_iterator(line.begin(), line.end(), loss); it != std::sregex_iterator(); ++it)
      v.push_back(std::stod((*it)[2].str()));
    all.push_back(v);
  }
  return all;
}

double WorstRelative(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    for (size_t k = 0; k < a[i].size() && k < b[i].size(); ++k)
      worst = std::max(worst, std::abs(a[i][k] - b[i][k]) / std::abs(b[i][k]));
  return worst;
}

class MtpParallelCli : public testing::RanksTest {
 protected:
  MtpParallelCli() : RanksTest(testing::kSmallVocabEod) {}
  // Rotary positions: over pipeline stages Megatron's depths would have position embeddings of their own (refused).
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return testing::Tool("ptk-train") + " --num-layers " + std::to_string(layers_) +
           " --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1 --threads 1"
           " --position-embedding-type rope --mtp-num-layers " +
           std::to_string(depths_) + " --data-path " + ShellQuote(prefix_) + " --data-cache-path " +
           ShellQuote(dir_ / "cache") + " --train-iters " + std::to_string(iters) + " " + extra;
  }
  // `world` ranks of `parallel` against one rank: every log line's lm and mtp_K losses.
  void TrainsAsOneRank(int world, const std::string& parallel, const std::string& extra = "") {
    auto one = RunCmd(Train(extra));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    auto r = Ranks(world, Train(parallel + " " + extra));
    ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    const auto want = LineLosses(one.output), got = LineLosses(r.output);
    ASSERT_EQ(want.size(), 6u) << one.output;
    ASSERT_EQ(got.size(), 6u) << r.output;
    for (const auto& v : got) ASSERT_EQ(v.size(), static_cast<size_t>(depths_ + 1)) << r.output;  // lm, mtp_1, ...
    const double worst = WorstRelative(got, want);
    EXPECT_LT(worst, 1e-5) << parallel << " " << extra;
    std::printf("%s %s: largest relative difference of the lm and mtp losses from one rank's: %.3g\n", parallel.c_str(),
                extra.c_str(), worst);
  }
  // Stopped at iteration 3 and resumed by as many ranks: the uninterrupted run's last 3 lines, character for
  // character. Returns the checkpoint's iteration-3 directory.
  std::string ResumesBitForBit(int world, const std::string& parallel) {
    auto whole = Ranks(world, Train(parallel + " --save " + ShellQuote(dir_ / "full")));
    EXPECT_NE(whole.output.find(AllZero(world)), std::string::npos) << whole.output << Logs(world);
    auto first = Ranks(world, Train(parallel + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(first.output.find(AllZero(world)), std::string::npos) << first.output << Logs(world);
    auto resumed = Ranks(world, Train(parallel + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(resumed.output.find(AllZero(world)), std::string::npos) << resumed.output << Logs(world);
    const auto a = testing::LogLinesWithoutTimes(whole.output), b = testing::LogLinesWithoutTimes(resumed.output);
    EXPECT_EQ(a.size(), 6u) << whole.output;
    EXPECT_EQ(b.size(), 3u) << resumed.output;
    if (a.size() == 6u) {
      EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
    }
    if (!b.empty()) {
      EXPECT_NE(b[0].find(" mtp_" + std::to_string(depths_) + " loss: "), std::string::npos) << b[0];
    }
    return CheckpointDir(dir_ / "ck", 3);
  }
  static std::string Header(const std::string& dir, const std::string& rank) {
    auto h = ReadCheckpointHeaderText(dir + "/" + rank + "/model_optim_rng.ptk");
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : std::string();
  }
  int depths_ = 2;  // --mtp-num-layers
  int layers_ = 2;  // --num-layers
};

TEST_F(MtpParallelCli, TwoTensorRanksTrainAsOneRankDoes) {
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, "--tensor-model-parallel-size 2"));
}

// Sequence parallelism (megatron-core's MultiTokenPredictionLayer under config.sequence_parallel): each tensor rank
// holds its t / 2 positions of the depth's embedding, norms and layer; eh_proj gathers [embedding, hidden] over the
// positions, its output columns are gathered and the positions scattered again. One rank's losses within 1e-5 (as
// tensor parallelism without it: fp32 sums over the ranks in another order).
TEST_F(MtpParallelCli, TwoTensorRanksWithSequenceParallelTrainAsOneRankDoesOneOrTwoDepths) {
  for (int depths : {1, 2}) {
    depths_ = depths;
    ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, "--tensor-model-parallel-size 2 --sequence-parallel"));
  }
}

// The depths on the last of two pipeline stages, their positions split over its two tensor ranks: the decoder
// output's gradient each micro-batch's depths leave (this rank's positions) waits for the slot's backward.
TEST_F(MtpParallelCli, TwoTensorRanksWithSequenceParallelTimesTwoStagesTrainAsOneRankDoes) {
  ASSERT_NO_FATAL_FAILURE(
      TrainsAsOneRank(4, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel"));
}

// DeepSeek-V3's shape: MoE layers (Megatron needs sequence parallelism for them under tensor parallelism), the
// depths' layers MoE too, with shared experts, sigmoid routing with an expert bias and an auxiliary loss.
const char kDeepSeekLikeMoe[] =
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear "
    "--moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 0.01 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01";

TEST_F(MtpParallelCli, DeepSeekLikeMoeWithTwoTensorRanksAndSequenceParallelTrainsAsOneRankDoes) {
  for (int depths : {1, 2}) {
    depths_ = depths;
    ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, "--tensor-model-parallel-size 2 --sequence-parallel", kDeepSeekLikeMoe));
  }
}

// DeepSeek-V3's attention too: multi-latent attention (its down projections whole on every rank) in the decoder's
// and the depths' MoE layers, with and without sequence parallelism (--qk-layernorm: the latent norms, as DeepSeek's
// recipes).
TEST_F(MtpParallelCli, DeepSeekLikeMlaAndMoeWithTwoTensorRanksTrainAsOneRankDoes) {
  const std::string mla =
      std::string(kDeepSeekLikeMoe) +
      " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8"
      " --qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --normalization RMSNorm --rope-type rope";
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, "--tensor-model-parallel-size 2 --sequence-parallel", mla));
  // Dense layers without sequence parallelism (Megatron's MoE under tensor parallelism needs it).
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(
      2, "--tensor-model-parallel-size 2",
      " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4"
      " --v-head-dim 6 --qk-layernorm --normalization RMSNorm --rope-type rope"));
}

// A stopped T = 2 sequence-parallel run resumes bit for bit; its checkpoint (the depths' tensors resharded as the
// decoder's: eh_proj's rows put together) loads at T = 1 and continues as one rank's uninterrupted run within 1e-5.
TEST_F(MtpParallelCli, TwoTensorRanksWithSequenceParallelResumeBitForBitAndLoadAtOneRank) {
  const std::string dir =
      ResumesBitForBit(2, "--tensor-model-parallel-size 2 --sequence-parallel " + std::string(kDeepSeekLikeMoe));
  EXPECT_NE(Header(dir, "mp_rank_01").find("mtp.layers.1.transformer_layer.mlp.router.expert_bias"), std::string::npos);
  auto whole = RunCmd(Train(kDeepSeekLikeMoe));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto one = RunCmd(Train(std::string(kDeepSeekLikeMoe) + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = LineLosses(whole.output), got = LineLosses(one.output);
  ASSERT_EQ(want.size(), 6u) << whole.output;
  ASSERT_EQ(got.size(), 3u) << one.output;
  for (const auto& v : got) ASSERT_EQ(v.size(), 3u) << one.output;
  const double worst = WorstRelative(got, std::vector<std::vector<double>>(want.begin() + 3, want.end()));
  EXPECT_LT(worst, 1e-5);
  std::printf("T=2 sequence-parallel MTP checkpoint resumed at T=1: largest relative difference %.3g\n", worst);
}

TEST_F(MtpParallelCli, TwoPipelineStagesTrainAsOneRankDoesTiedOrNot) {
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, "--pipeline-model-parallel-size 2"));
  ASSERT_NO_FATAL_FAILURE(
      TrainsAsOneRank(2, "--pipeline-model-parallel-size 2", "--untie-embeddings-and-output-weights"));
}

TEST_F(MtpParallelCli, TwoTensorRanksResumeBitForBitWithEhProjSplit) {
  const std::string dir = ResumesBitForBit(2, "--tensor-model-parallel-size 2");
  for (const char* rank : {"mp_rank_00", "mp_rank_01"}) {
    const std::string h = Header(dir, rank);
    // eh_proj: its 32 output rows split, 16 a rank, of 2 x 32 inputs.
    EXPECT_TRUE(
        std::regex_search(h, std::regex(R"("name": ?"mtp\.layers\.1\.eh_proj\.weight", ?"shape": ?\[16, ?64\])")))
        << rank << ": " << h.substr(0, 4000);
    EXPECT_NE(h.find("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"), std::string::npos) << rank;
  }
}

TEST_F(MtpParallelCli, TwoPipelineStagesResumeBitForBitTheDepthsOnTheLast) {
  const std::string dir = ResumesBitForBit(2, "--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights");
  const std::string first = Header(dir, "mp_rank_00_000"), last = Header(dir, "mp_rank_00_001");
  EXPECT_EQ(first.find("mtp.layers."), std::string::npos) << first.substr(0, 4000);
  for (const char* name :
       {"mtp.layers.0.enorm.weight", "mtp.layers.1.eh_proj.weight", "mtp.layers.1.final_layernorm.weight",
        "embedding.word_embeddings.weight", "output_layer.weight"})
    EXPECT_NE(last.find(std::string("\"") + name + "\""), std::string::npos) << name << ": " << last.substr(0, 4000);
}

// --overlap-grad-reduce (megatron's overlapped bucketed reduction): the depths' tensors lie between the decoder's
// final norm and the output layer, in the bucket the decoder's backward completes first (the depths' backward, its
// share of the word embeddings' included, is done by then). Over two data ranks, two data ranks of two pipeline
// stages (ZeRO-1, tied embeddings) and two data ranks of two tensor ranks with sequence parallelism (DeepSeek-like
// MoE), the log lines and every rank's saved weights and optimizer state are those of the run without it, bit for
// bit (gloo sums each element in rank order, bucket by bucket or in one call alike); a stopped run resumes bit for
// bit.
std::string CheckpointArrays(const std::string& file) {  // magic, header length, header, arrays, SHA-256 in hex
  const std::string bytes = testing::ReadFile(file);
  uint64_t len = 0;
  EXPECT_GE(bytes.size(), 16u + 64u) << file;
  if (bytes.size() < 16 + 64) return "";
  std::memcpy(&len, bytes.data() + 8, sizeof len);
  EXPECT_LE(16 + len + 64, bytes.size()) << file;
  return bytes.substr(16 + len, bytes.size() - 64 - 16 - len);
}

TEST_F(MtpParallelCli, OverlapGradReduceGivesTheBitsOfTheRunWithout) {
  const std::string overlap = " --overlap-grad-reduce --ddp-bucket-size 3000";
  const std::vector<std::pair<int, std::string>> cases = {
      {2, ""},
      {4, "--pipeline-model-parallel-size 2 --use-distributed-optimizer"},
      {4, "--tensor-model-parallel-size 2 --sequence-parallel " + std::string(kDeepSeekLikeMoe)}};
  for (const auto& [world, parallel] : cases) {
    auto plain = Ranks(world, Train(parallel + " --save " + ShellQuote(dir_ / "plain")));
    ASSERT_NE(plain.output.find(AllZero(world)), std::string::npos) << plain.output << Logs(world);
    auto over = Ranks(world, Train(parallel + overlap + " --save " + ShellQuote(dir_ / "over")));
    ASSERT_NE(over.output.find(AllZero(world)), std::string::npos) << over.output << Logs(world);
    EXPECT_NE(over.output.find("--overlap-grad-reduce: "), std::string::npos) << over.output;
    const auto a = testing::LogLinesWithoutTimes(plain.output), b = testing::LogLinesWithoutTimes(over.output);
    ASSERT_EQ(a.size(), 6u) << plain.output;
    EXPECT_EQ(b, a) << parallel;
    EXPECT_NE(b[0].find(" mtp_2 loss: "), std::string::npos) << b[0];
    int files = 0;  // every rank's model_optim_rng.ptk (and ZeRO-1's distrib_optim.ptk)
    const std::filesystem::path from = CheckpointDir(dir_ / "plain", 6), to = CheckpointDir(dir_ / "over", 6);
    for (const auto& e : std::filesystem::recursive_directory_iterator(from)) {
      if (e.path().extension() != ".ptk") continue;
      const std::filesystem::path mine = to / std::filesystem::relative(e.path(), from);
      ASSERT_TRUE(std::filesystem::exists(mine)) << mine;
      const std::string want = CheckpointArrays(e.path());
      EXPECT_FALSE(want.empty()) << e.path();
      EXPECT_TRUE(CheckpointArrays(mine) == want) << parallel << ": " << mine;
      ++files;
    }
    EXPECT_GE(files, world / 2) << parallel;
    std::filesystem::remove_all(dir_ / "plain");
    std::filesystem::remove_all(dir_ / "over");
  }
  ResumesBitForBit(2, "--overlap-grad-reduce --ddp-bucket-size 3000 --use-distributed-optimizer");
}

// Expert parallelism (megatron-core's MoE layer in the depth, its tokens exchanged over the expert group as the
// decoder's): two expert ranks of the DeepSeek-like MoE (4 experts, shared experts, expert bias; also with ZeRO-1
// and --overlap-grad-reduce), and two expert ranks of two pipeline stages, give the lm and mtp_K losses of two data
// ranks with every expert within 1e-5 relative (the experts' products over the group's gathered tokens: fp32 sums in
// another order). A stopped E = 2 run resumes bit for bit; its files mp_rank_00_000 and mp_rank_00_001 hold each
// depth's two local experts (megatron's per-rank numbering, as the decoder's), and the checkpoint loads at E = 1 (every
// expert) continuing as the uninterrupted E = 1 run within 1e-5.
TEST_F(MtpParallelCli, ExpertRanksTrainAsDataRanksWithEveryExpertDo) {
  // Over pipeline stages ptk refuses seq_aux_loss and the expert bias: softmax routing and the Switch aux loss there.
  const std::string staged =
      "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear "
      "--moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 0.01";
  std::vector<std::vector<double>> want;
  for (const auto& [world, parallel, moe] : std::vector<std::tuple<int, std::string, std::string>>{
           {2, "--expert-model-parallel-size 2", kDeepSeekLikeMoe},
           {2, "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce", kDeepSeekLikeMoe},
           {4, "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2", staged}}) {
    auto ref = Ranks(2, Train(moe));
    ASSERT_NE(ref.output.find(AllZero(2)), std::string::npos) << ref.output << Logs(2);
    want = LineLosses(ref.output);
    ASSERT_EQ(want.size(), 6u) << ref.output;
    auto r = Ranks(world, Train(parallel + " " + moe));
    ASSERT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    const auto got = LineLosses(r.output);
    ASSERT_EQ(got.size(), 6u) << r.output;
    for (const auto& v : got) ASSERT_EQ(v.size(), 3u) << r.output;  // lm, mtp_1, mtp_2
    const double worst = WorstRelative(got, want);
    EXPECT_LT(worst, 1e-5) << parallel;
    std::printf("%s: largest relative difference of the lm and mtp losses from D = 2's: %.3g\n", parallel.c_str(),
                worst);
    if (world != 4) continue;
    // --dry-run's per-rank parameter lines are the run's (each stage's first data rank prints its own; the last
    // stage's holds the depths' local experts).
    const std::regex count(R"( > number of parameters on \(tensor, pipeline\) model parallel rank \(0, \d\): \d+)");
    std::set<std::string> run, dry;
    for (int rank = 0; rank < world; ++rank) {
      const std::string log = testing::ReadFile(RankLog(rank));
      for (auto it = std::sregex_iterator(log.begin(), log.end(), count); it != std::sregex_iterator(); ++it)
        run.insert(it->str());
    }
    auto d = RunCmd("WORLD_SIZE=4 RANK=0 " + Train(parallel + " " + moe + " --dry-run"));
    ASSERT_EQ(d.exit_code, 0) << d.output;
    for (auto it = std::sregex_iterator(d.output.begin(), d.output.end(), count); it != std::sregex_iterator(); ++it)
      dry.insert(it->str());
    EXPECT_EQ(run.size(), 2u) << Logs(world);
    EXPECT_EQ(dry, run) << d.output;
  }
  auto ref = Ranks(2, Train(kDeepSeekLikeMoe));  // the reference of the resumed E = 1 run below
  want = LineLosses(ref.output);
  ASSERT_EQ(want.size(), 6u) << ref.output;
  const std::string dir = ResumesBitForBit(2, "--expert-model-parallel-size 2 " + std::string(kDeepSeekLikeMoe));
  for (const char* rank : {"mp_rank_00_000", "mp_rank_00_001"}) {
    const std::string h = Header(dir, rank);
    for (const char* name : {"mtp.layers.1.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight",
                             "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                             "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"})
      EXPECT_NE(h.find(std::string("\"") + name + "\""), std::string::npos) << rank << " " << name;
    EXPECT_EQ(h.find("local_experts.2."), std::string::npos) << rank << ": " << h.substr(0, 4000);
  }
  auto one = Ranks(2, Train(std::string(kDeepSeekLikeMoe) + " --load " + ShellQuote(dir_ / "ck")));
  ASSERT_NE(one.output.find(AllZero(2)), std::string::npos) << one.output << Logs(2);
  const auto got = LineLosses(one.output);
  ASSERT_EQ(got.size(), 3u) << one.output;
  const double worst = WorstRelative(got, std::vector<std::vector<double>>(want.begin() + 3, want.end()));
  EXPECT_LT(worst, 1e-5);
  std::printf("E=2 MTP checkpoint resumed at E=1: largest relative difference %.3g\n", worst);
}

// The interleaved schedule (two model chunks of one layer on each of two stages): the depths run after the last
// stage's last chunk, as megatron-core's (its last virtual stage), and train as one rank does (1e-5 relative, tied
// and untied embeddings, dense and MoE); a stopped run resumes bit for bit.
TEST_F(MtpParallelCli, InterleavedScheduleTrainsAsOneRankDoes) {
  layers_ = 4;
  const std::string vpp = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1";
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, vpp));
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(2, vpp, "--untie-embeddings-and-output-weights"));
  ASSERT_NO_FATAL_FAILURE(
      TrainsAsOneRank(2, vpp,
                      "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --disable-bias-linear "
                      "--moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 0.01"));
  ASSERT_NO_FATAL_FAILURE(TrainsAsOneRank(4, vpp + " --overlap-grad-reduce --ddp-bucket-size 3000"));
  const std::string dir = ResumesBitForBit(2, vpp);
  EXPECT_NE(Header(dir, "mp_rank_00_001").find("\"mtp.layers.1.eh_proj.weight\""), std::string::npos);
  EXPECT_EQ(Header(dir, "mp_rank_00_000").find("mtp.layers."), std::string::npos);
}

}  // namespace
}  // namespace ptk
