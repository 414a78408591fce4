// Expert parallelism's pieces: an expert rank's parameter layout (its experts renumbered from 0, the whole model's
// init), and the CPU MoE layer's allgather dispatch and reduce-scatter combine over two gloo ranks (threads)
// against each rank's layer with every expert (what one expert rank computes), forward and backward.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/trainer/gloo_ranks.h"
#include "trainer/cpu/expert_parallel_cpu.h"
#include "trainer/cpu/moe_cpu.h"
#include "trainer/expert_grads.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

GPTConfig MoeModel() {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 32;
  c.seq_length = c.max_position_embeddings = 8;
  c.vocab_size = c.padded_vocab_size = 64;
  c.add_bias_linear = false;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 12;
  c.moe_layer_pattern = {1, 0, 1};
  return c;
}

TEST(ExpertParallelLayout, EachExpertRankHoldsItsExpertsRenumberedWithTheWholeModelsInit) {
  const GPTConfig c = MoeModel();
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<float> all(static_cast<size_t>(whole->num_params));
  whole->InitWeights(1234, all);
  int64_t total = 0;
  for (int e = 0; e < 2; ++e) {
    auto mine = ParamLayout::Create(c, 1, 0, {}, 2, e);
    ASSERT_TRUE(mine.ok()) << mine.status();
    EXPECT_EQ(mine->expert_size, 2);
    EXPECT_EQ(mine->expert_rank, e);
    EXPECT_EQ(mine->local_experts(), 2);
    // Megatron's SequentialMLP names: local_experts.0 and .1 on either rank, never .2.
    for (const char* name : {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                             "decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight",
                             "decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.linear_fc1.weight"})
      EXPECT_NE(mine->Find(name), nullptr) << name;
    EXPECT_EQ(mine->Find("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"), nullptr);
    const int64_t ef = c.expert_floats();
    EXPECT_EQ(mine->num_params, whole->num_params - 2 * 2 * ef);  // two layers' two other experts
    // Each local expert is the whole model's expert 2e + j, its weights the same bits.
    std::vector<float> init(static_cast<size_t>(mine->num_params)), cut(init.size());
    mine->InitWeights(1234, init);
    CopyToShard(*mine, all, cut);
    EXPECT_EQ(init, cut);
    const LayerParams &lp = mine->layers[2], &wp = whole->layers[2];
    EXPECT_TRUE(std::equal(init.begin() + lp.experts, init.begin() + lp.experts + 2 * ef,
                           all.begin() + wp.experts + 2 * e * ef));
    EXPECT_EQ(init[static_cast<size_t>(lp.router_w)], all[static_cast<size_t>(wp.router_w)]);
    std::vector<GradRange> experts, rest;
    ExpertGradRanges(*mine, &experts, &rest);
    for (const GradRange& g : experts) total += g.size();
  }
  EXPECT_EQ(total, 2 * 4 * c.expert_floats());  // every expert of both MoE layers once over the ranks
  auto three = ParamLayout::Create(c, 1, 0, {}, 3, 0);
  ASSERT_FALSE(three.ok());
  EXPECT_TRUE(IsUsageError(three.status()));
  EXPECT_NE(StatusMessage(three.status()).find("--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
            std::string::npos)
      << three.status();
}

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 2e-6 * std::max(1.0f, std::abs(want[i]))) << what << " [" << i << "]";
}

// Two expert ranks of 4 experts (top 2, SwiGLU, the load-balancing loss's gradient on): each rank's output,
// input gradient and router gradient are those of its layer with all four experts, and its experts' weight
// gradients the sum of both ranks' (what the data-parallel sum of one expert rank's would hold).
TEST(ExpertParallelCpu, DispatchAndCombineComputeEachRanksLayerWithEveryExpert) {
  const int64_t n = 7, c = 8, E = 4;
  cpu::MoeSettings s;
  s.experts = E;
  s.topk = 2;
  s.ffn = 6;
  s.activation = cpu::MlpActivation::kSwiglu;
  const int64_t ef = s.expert_floats(c);
  const std::vector<float> w_router = Random(static_cast<size_t>(E * c), 1, 0.5f);
  const std::vector<float> w_experts = Random(static_cast<size_t>(E * ef), 2, 0.3f);
  struct Rank {
    std::vector<float> x, dout, out, dx, dw_router, dw_experts;
  };
  Rank want[2], got[2];
  for (int r = 0; r < 2; ++r) {  // each rank alone, every expert
    Rank& w = want[r];
    w.x = Random(static_cast<size_t>(n * c), 10 + r, 1.0f);
    w.dout = Random(static_cast<size_t>(n * c), 20 + r, 1.0f);
    cpu::MoeActivations<float> a;
    cpu::MoeRouterForward(&a, w.x.data(), w_router.data(), n, c, s);
    w.out.resize(w.x.size());
    cpu::MoeExpertsForward(w.out.data(), &a, w_experts.data(), c, s);
    w.dx.assign(w.x.size(), 0.0f);
    w.dw_router.assign(w_router.size(), 0.0f);
    w.dw_experts.assign(w_experts.size(), 0.0f);
    cpu::MoeBackward(w.dx.data(), w.dw_router.data(), w.dw_experts.data(), w.dout.data(), &a, w.x.data(),
                     w_router.data(), w_experts.data(), c, s, 0.7);
  }
  std::mutex mu;
  testing::RunRanks(2, [&](Communicator* comm, int r) {
    Rank g;
    const float* w_local = w_experts.data() + r * 2 * ef;
    cpu::MoeActivations<float> mine, rows;
    std::vector<float> buf;
    cpu::MoeRouterForward(&mine, want[r].x.data(), w_router.data(), n, c, s);
    g.out.resize(static_cast<size_t>(n * c));
    absl::Status st =
        cpu::ExpertParallelForward(g.out.data(), &mine, &rows, want[r].x.data(), w_local, c, s, comm, &buf);
    ASSERT_TRUE(st.ok()) << st;
    g.dx.assign(g.out.size(), 0.0f);
    g.dw_router.assign(w_router.size(), 0.0f);
    g.dw_experts.assign(static_cast<size_t>(2 * ef), 0.0f);
    st = cpu::ExpertParallelBackward(g.dx.data(), g.dw_router.data(), g.dw_experts.data(), want[r].dout.data(), &mine,
                                     &rows, want[r].x.data(), w_router.data(), w_local, c, s, 0.7, 0.0, comm, &buf);
    ASSERT_TRUE(st.ok()) << st;
    std::lock_guard<std::mutex> lock(mu);
    got[r] = std::move(g);
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    ExpectClose(got[r].out, want[r].out, "out");
    ExpectClose(got[r].dx, want[r].dx, "dx");
    ExpectClose(got[r].dw_router, want[r].dw_router, "dw_router");
    std::vector<float> sum(static_cast<size_t>(2 * ef));
    for (size_t i = 0; i < sum.size(); ++i) {
      const size_t at = static_cast<size_t>(r * 2 * ef) + i;
      sum[i] = want[0].dw_experts[at] + want[1].dw_experts[at];
    }
    ExpectClose(got[r].dw_experts, sum, "dw_experts");
  }
}

}  // namespace
}  // namespace ptk
