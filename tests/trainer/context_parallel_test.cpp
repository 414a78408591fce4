// The CPU model's context parallelism against one rank, ranks as gloo threads: each context rank
// runs its positions of every sample (KeepContextRows, Megatron's 2C chunks), and the loss sums
// and the gradients summed over the context group are one rank's over the whole samples (loss
// within 1e-6 relative, every gradient within 2e-6 of the largest), with dropout on, for GPT's
// model and for a Llama-line one (RoPE by true position, grouped-query attention, query and key
// norms, recomputed attention); a context rank allocates what the memory estimate plans for it. With
// a loss mask uneven over the context ranks, the training step weighs each rank's tokens as
// megatron-core does (tests/support/gen_cp_loss_scale_golden.py: each rank's micro-batch mean weighing
// 1 / C, or with --calculate-per-token-loss 1 / the global batch's tokens). A sliding window and the learnable
// softmax offsets give one rank's loss and gradients too.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/parallel_layout.h"
#include "trainer/train_step.h"
#include "trainer/training_data.h"

namespace ptk {
namespace {

GPTConfig Config(bool llama) {
  GPTConfig c = testing::SmallGpt(2, 64, 4, 32, 97, 128);
  c.hidden_dropout = c.attention_dropout = 0.1;
  if (llama) {
    testing::SwitchToLlama(c, 2);
    c.recompute_activations = true;
  }
  return c;
}

struct Pass {
  double loss = 0, tokens = 0;
  std::vector<float> grads;
  int64_t activation_floats = 0;
};

// One forward and backward with dropout (seed 7) at `context` ranks (1: one plain model), the loss
// sums and gradients summed over the ranks.
Pass Run(const GPTConfig& c, int context) {
  const testing::Batches data(1, c.seq_length);
  Pass out;
  std::mutex mu;
  auto body = [&](Communicator* comm, int rank) {
    auto model = CpuGPTModel::Create(c);
    ASSERT_TRUE(model.ok()) << model.status();
    if (context > 1) {
      ASSERT_TRUE((*model)->SetContextParallel(comm).ok());
    }
    ASSERT_TRUE((*model)->InitWeights(11).ok());
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    MicroBatch mb = data.Loaded(0);
    if (context > 1) KeepContextRows(&mb, ContextParallelPositions(c.seq_length, context, rank));
    std::vector<int64_t> keys;
    auto loss = (*model)->ForwardBackward(View(mb, &keys), 1.0, /*train=*/true, 7);
    ASSERT_TRUE(loss.ok()) << loss.status();
    std::vector<float> grads(static_cast<size_t>((*model)->num_params()));
    ASSERT_TRUE((*model)->ReadGrads(grads).ok());
    double sums[2] = {loss->loss_sum, loss->tokens};
    ASSERT_TRUE(comm->AllReduceSum(sums, 2).ok());
    ASSERT_TRUE(comm->AllReduceSum(grads.data(), static_cast<int64_t>(grads.size())).ok());
    if (rank != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    out = Pass{sums[0], sums[1], grads, (*model)->ActivationFloats()};
    EXPECT_EQ(out.activation_floats, CpuGPTModel::PlanActivationFloats((*model)->layout(), false, 2, context));
  };
  if (context == 1) {
    auto local = MakeLocalCommunicator();
    body(local.get(), 0);
  } else {
    testing::RunRanks(context, body);
  }
  return out;
}

void ExpectContextRanksMatchOne(const GPTConfig& c, const std::string& what) {
  const Pass one = Run(c, 1);
  ASSERT_FALSE(one.grads.empty());
  for (int C : {2, 4}) {
    SCOPED_TRACE(what + " C=" + std::to_string(C));
    const Pass cp = Run(c, C);
    ASSERT_EQ(cp.grads.size(), one.grads.size());
    EXPECT_EQ(cp.tokens, one.tokens);
    EXPECT_LT(std::abs(cp.loss - one.loss) / one.loss, 1e-6) << cp.loss << " vs " << one.loss;
    double gmax = 0, dmax = 0;
    for (size_t i = 0; i < one.grads.size(); ++i) {
      gmax = std::max(gmax, static_cast<double>(std::abs(one.grads[i])));
      dmax = std::max(dmax, static_cast<double>(std::abs(one.grads[i] - cp.grads[i])));
    }
    EXPECT_LT(dmax, 2e-6 * gmax) << "largest gradient difference " << dmax << " of " << gmax;
    std::printf("%s, C=%d: loss %.3g relative, gradients %.3g of the largest from one rank's\n", what.c_str(), C,
                std::abs(cp.loss - one.loss) / one.loss, dmax / gmax);
    // The layers' activations are a context rank's rows; the attention's probabilities stay whole.
    EXPECT_LT(cp.activation_floats, one.activation_floats);
  }
}

TEST(ContextParallel, GptModelMatchesOneRank) { ExpectContextRanksMatchOne(Config(false), "GPT"); }

TEST(ContextParallel, LlamaLineModelMatchesOneRank) { ExpectContextRanksMatchOne(Config(true), "Llama line"); }

// Multi-latent attention: the gathered rows' query and key heads qk + pe wide, the values' v (12 and 6 here), and the
// rotary key and query parts by true position (each rank's rows of the whole sample's tables), plain RoPE without a
// query LoRA and YaRN with one.
TEST(ContextParallel, MultiLatentAttentionMatchesOneRank) {
  for (bool yarn : {false, true}) {
    GPTConfig c = Config(false);
    c.position_embedding = PositionEmbedding::kRope;
    c.normalization = Normalization::kRMSNorm;
    c.multi_latent_attention = true, c.qk_layernorm = true, c.mla_yarn = yarn;
    c.q_lora_rank = yarn ? 16 : 0, c.kv_lora_rank = 12, c.qk_head_dim = 8, c.qk_pos_emb_head_dim = 4, c.v_head_dim = 6;
    if (yarn) c.rotary_scaling_factor = 4, c.mscale = c.mscale_all_dim = 0.7;
    ExpectContextRanksMatchOne(c, yarn ? "MLA with YaRN" : "MLA");
  }
}

// A sliding window across the ranks' chunks (each rank's rows masked by their true positions) on the first layer
// only, and the learnable softmax offsets (each row's sink once, on the rank holding the row; their gradients
// summed over the context group), with and without recomputed attention. ptk-train refuses the softmax types under
// context parallelism as Megatron (Transformer Engine's a2a only): the library checks the arithmetic.
TEST(ContextParallel, SlidingWindowAndSoftmaxOffsetsMatchOneRank) {
  for (bool llama : {false, true}) {
    GPTConfig c = Config(llama);
    c.window_left = 5;
    c.window_pattern = {1, 0};
    c.softmax_type = "learnable";
    ExpectContextRanksMatchOne(c, llama ? "window + offsets, Llama line" : "window + offsets");
  }
}

// tests/data/trainer/cp_loss_scale_golden.txt: the whole samples' loss masks of 2 micro-batches, and
// megatron-core's weight of one masked token of each micro-batch and context rank in the reduced
// gradient, by mode ("mean", "per-token").
struct LossScaleGolden {
  std::vector<std::vector<float>> masks;                           // [micro-batch] 2 samples x 32
  std::map<std::string, std::vector<std::vector<double>>> weight;  // [mode][micro-batch][context rank]
};
LossScaleGolden ReadLossScaleGolden() {
  LossScaleGolden g;
  std::istringstream in(testing::ReadFile(testing::SourceDir() + "/tests/data/trainer/cp_loss_scale_golden.txt"));
  std::string line, tag;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    f >> tag;
    if (tag == "mask") {
      size_t m = 0, sample = 0;
      std::string bits;
      f >> m >> sample >> bits;
      g.masks.resize(std::max(g.masks.size(), m + 1));
      for (char b : bits) g.masks[m].push_back(b == '1' ? 1.0f : 0.0f);
    } else if (tag == "weight") {
      std::string mode;
      size_t m = 0, rank = 0;
      double tokens = 0, w = 0;
      f >> mode >> m >> rank >> tokens >> w;
      auto& v = g.weight[mode];
      v.resize(std::max(v.size(), m + 1));
      v[m].resize(std::max(v[m].size(), rank + 1));
      v[m][rank] = w;
    }
  }
  return g;
}

// Megatron with --eod-mask-loss-like holes that leave context rank 0 fewer tokens than rank 1: each
// rank's micro-batch loss is the mean over its own tokens, weighing 1 / C (not the micro-batch's mean
// over the context group, which weighs every token alike); with --calculate-per-token-loss every token
// weighs 1 / the global batch's tokens. The reference: one rank over the whole samples, each token's
// loss weighted by the golden's weight of its context rank, the gradients compared within 2e-6 of the
// largest (the loss sums' order differs).
TEST(ContextParallel, UnevenLossMaskWeighsEachRankAsMegatron) {
  const LossScaleGolden golden = ReadLossScaleGolden();
  ASSERT_EQ(golden.masks.size(), 2u);
  const GPTConfig c = Config(false);
  testing::Batches data(2, c.seq_length);
  for (size_t m = 0; m < 2; ++m) {
    ASSERT_EQ(golden.masks[m].size(), data.mask[m].size());
    data.mask[m] = golden.masks[m];
  }
  std::vector<int> rank_of(static_cast<size_t>(c.seq_length));
  for (int q = 0; q < 2; ++q)
    for (int64_t p : ContextParallelPositions(c.seq_length, 2, q)) rank_of[static_cast<size_t>(p)] = q;
  for (const char* mode : {"mean", "per-token"}) {
    SCOPED_TRACE(mode);
    ASSERT_EQ(golden.weight.count(mode), 1u);
    const auto& weight = golden.weight.at(mode);
    // One rank: each token's loss times its context rank's weight.
    auto one = CpuGPTModel::Create(c);
    ASSERT_TRUE(one.ok());
    ASSERT_TRUE((*one)->InitWeights(11).ok());
    ASSERT_TRUE((*one)->ZeroGrads().ok());
    for (size_t m = 0; m < 2; ++m) {
      MicroBatch mb = data.Loaded(m);
      for (size_t i = 0; i < mb.loss_mask.size(); ++i)
        mb.loss_mask[i] *= static_cast<float>(weight[m][static_cast<size_t>(rank_of[i % rank_of.size()])]);
      std::vector<int64_t> keys;
      ASSERT_TRUE((*one)->ForwardBackward(View(mb, &keys), 1.0, /*train=*/true, 7).ok());
    }
    std::vector<float> want(static_cast<size_t>((*one)->num_params()));
    ASSERT_TRUE((*one)->ReadGrads(want).ok());
    std::vector<float> got;
    double tokens = 0;
    std::mutex mu;
    testing::RunRanks(2, [&](Communicator* comm, int rank) {
      auto model = CpuGPTModel::Create(c);
      ASSERT_TRUE(model.ok());
      ASSERT_TRUE((*model)->SetContextParallel(comm).ok());
      ASSERT_TRUE((*model)->InitWeights(11).ok());
      OptimizerConfig oc;
      oc.calculate_per_token_loss = std::string(mode) == "per-token";
      TrainStep step(model->get(), oc, SchedulerConfig{}, comm);
      step.set_context(comm);
      std::vector<MicroBatch> mbs;
      for (size_t m = 0; m < 2; ++m) {
        mbs.push_back(data.Loaded(m));
        KeepContextRows(&mbs.back(), ContextParallelPositions(c.seq_length, 2, rank));
      }
      std::vector<std::vector<int64_t>> keys(2);
      auto r = step.ComputeGradients({View(mbs[0], &keys[0]), View(mbs[1], &keys[1])}, 7);
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<float> grads(static_cast<size_t>((*model)->num_params()));
      ASSERT_TRUE((*model)->ReadGrads(grads).ok());
      if (rank != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      got = grads;
      tokens = r->tokens;
    });
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(tokens, 96);  // the logged lm loss: the global sum over the global tokens, as Megatron's
    double gmax = 0, dmax = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      gmax = std::max(gmax, static_cast<double>(std::abs(want[i])));
      dmax = std::max(dmax, static_cast<double>(std::abs(want[i] - got[i])));
    }
    EXPECT_LT(dmax, 2e-6 * gmax) << "largest gradient difference " << dmax << " of " << gmax;
  }
}

TEST(ContextParallel, KeepContextRowsKeepsMegatronsChunksOfEverySample) {
  const testing::Batches data(1, 8);
  MicroBatch mb = data.Loaded(0);
  KeepContextRows(&mb, ContextParallelPositions(8, 2, 1));  // chunks 1 and 2 of 4: positions 2, 3, 4, 5
  EXPECT_EQ(mb.seq_length, 4);
  ASSERT_EQ(mb.tokens.size(), 8u);
  for (int64_t s = 0; s < 2; ++s)
    for (int64_t i = 0; i < 4; ++i) {
      const size_t from = static_cast<size_t>(s * 8 + 2 + i), to = static_cast<size_t>(s * 4 + i);
      EXPECT_EQ(mb.tokens[to], data.tokens[0][from]);
      EXPECT_EQ(mb.labels[to], data.labels[0][from]);
      EXPECT_EQ(mb.position_ids[to], data.positions[0][from]);
      EXPECT_EQ(mb.loss_mask[to], data.mask[0][from]);
    }
  EXPECT_EQ(mb.indices, data.keys[0]);
}

TEST(ContextParallel, RefusesWhatItDoesNotCover) {
  GPTConfig c = Config(false);
  testing::RunRanks(2, [&](Communicator* comm, int) {
    c.seq_length = 30;
    auto odd = CpuGPTModel::Create(c);
    ASSERT_TRUE(odd.ok());
    const absl::Status st = (*odd)->SetContextParallel(comm);
    EXPECT_EQ(StatusMessage(st), "--context-parallel-size 2: --seq-length 30 must be a multiple of 2 x 2");
  });
}

}  // namespace
}  // namespace ptk
