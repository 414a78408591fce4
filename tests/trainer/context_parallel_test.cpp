// The CPU model's context parallelism against one rank, ranks as gloo threads: each context rank
// runs its positions of every sample (KeepContextRows, Megatron's 2C chunks), and the loss sums
// and the gradients summed over the context group are one rank's over the whole samples (loss
// within 1e-6 relative, every gradient within 2e-6 of the largest), with dropout on, for GPT's
// model and for a Llama-line one (RoPE by true position, grouped-query attention, query and key
// norms, recomputed attention); a context rank allocates what the memory estimate plans for it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/parallel_layout.h"
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

// Micro-batch 0 of testing::Batches (2 samples of 32 tokens, a loss mask with holes) as a loader's.
MicroBatch Whole(const testing::Batches& data) {
  MicroBatch mb;
  mb.micro_batch_size = 2;
  mb.seq_length = data.t;
  mb.indices = data.keys[0];
  mb.tokens = data.tokens[0];
  mb.labels = data.labels[0];
  mb.position_ids = data.positions[0];
  mb.loss_mask = data.mask[0];
  return mb;
}

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
    MicroBatch mb = Whole(data);
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

TEST(ContextParallel, KeepContextRowsKeepsMegatronsChunksOfEverySample) {
  const testing::Batches data(1, 8);
  MicroBatch mb = Whole(data);
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
