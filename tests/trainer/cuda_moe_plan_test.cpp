// The CUDA MoE layer's host side (trainer/cuda/moe_plan.h), on the CPU: the dispatch plan is the CPU MoE's
// permutation (trainer/cpu/moe_cpu.cpp's order and begin) with each token's rows ascending for the un-permute,
// bad router output refused, the load-balancing and z-losses from the kernels' partial results equal the CPU
// ones, the layer's buffers aligned and disjoint, and the memory plan holding them for every MoE layer
// and the dense MLP's fc1 and activation only for the dense layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "trainer/cpu/moe_cpu.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/moe_plan.h"

namespace ptk::cuda {
namespace {

struct Routed {
  cpu::MoeActivations<float> a;
  cpu::MoeSettings s;
};

Routed Route(int64_t n, int64_t c, int64_t E, int64_t K, bool sigmoid, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * c)), w(static_cast<size_t>(E * c));
  for (float& v : x) v = d(rng);
  for (float& v : w) v = d(rng);
  Routed r;
  r.s.experts = E;
  r.s.topk = K;
  r.s.ffn = 4;
  r.s.sigmoid = sigmoid;
  cpu::MoeRouterForward(&r.a, x.data(), w.data(), n, c, r.s);
  return r;
}

TEST(CudaMoePlan, DispatchIsTheCpuPermutationAndTheCombineItsInverse) {
  for (const auto& [n, E, K, sigmoid] : std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
           {1, 1, 1, false}, {7, 4, 2, false}, {64, 8, 2, true}, {33, 16, 4, false}, {50, 5, 5, true}}) {
    const Routed r = Route(n, 6, E, K, sigmoid, static_cast<uint32_t>(n * 131 + E));
    MoeDispatchPlan p;
    ASSERT_TRUE(BuildMoeDispatch(&p, r.a.expert.data(), n, K, E).ok());
    ASSERT_EQ(p.begin, r.a.begin) << n << " tokens, " << E << " experts";
    ASSERT_EQ(p.order.size(), r.a.order.size());
    for (size_t i = 0; i < p.order.size(); ++i) EXPECT_EQ(p.order[i], r.a.order[i]) << "row " << i;
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(p.counts[static_cast<size_t>(e)], r.a.begin[e + 1] - r.a.begin[e]);
    std::vector<int> seen(static_cast<size_t>(n * K), 0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t row = p.combine[static_cast<size_t>(i * K + k)];
        ASSERT_GE(row, 0);
        ASSERT_LT(row, n * K);
        EXPECT_EQ(p.order[static_cast<size_t>(row)] / K, i) << "token " << i << " gets row " << row;
        if (k > 0) {
          EXPECT_LT(p.combine[static_cast<size_t>(i * K + k - 1)], row) << "token " << i << " rows ascend";
        }
        ++seen[static_cast<size_t>(row)];
      }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; }));
  }
}

TEST(CudaMoePlan, RefusesAnExpertOutOfRange) {
  const std::vector<int32_t> expert = {0, 1, 3, 1};
  MoeDispatchPlan p;
  const absl::Status st = BuildMoeDispatch(&p, expert.data(), 2, 2, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("token 1 slot 0 names expert 3 of 3"), std::string_view::npos) << st;
  const std::vector<int32_t> negative = {-1};
  EXPECT_FALSE(BuildMoeDispatch(&p, negative.data(), 1, 1, 3).ok());
  EXPECT_FALSE(BuildMoeDispatch(&p, negative.data(), int64_t{1} << 31, 1, 3).ok());  // n K beyond int32
}

TEST(CudaMoePlan, LossesFromColumnSumsAndLogSumExpsAreTheCpuOnes) {
  for (bool sigmoid : {false, true}) {
    const int64_t n = 40, E = 8, K = 2;
    const Routed r = Route(n, 5, E, K, sigmoid, 7);
    MoeDispatchPlan p;
    ASSERT_TRUE(BuildMoeDispatch(&p, r.a.expert.data(), n, K, E).ok());
    std::vector<float> colsum(static_cast<size_t>(E), 0.0f), lse(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < E; ++e) colsum[static_cast<size_t>(e)] += r.a.scores[static_cast<size_t>(i * E + e)];
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += std::exp(r.a.logits[static_cast<size_t>(i * E + e)]);
      lse[static_cast<size_t>(i)] = static_cast<float>(std::log(s));
    }
    EXPECT_NEAR(MoeAuxLossOf(colsum.data(), p.counts, n, K, E), cpu::MoeAuxLoss(r.a, r.s), 1e-6);
    EXPECT_NEAR(MoeZLossOf(lse.data(), n), cpu::MoeZLoss(r.a, r.s), 1e-5);
    EXPECT_DOUBLE_EQ(MoeAuxUnit(2.0, n, K, E), 2.0 * E / (K * double(n) * n));
  }
}

TEST(CudaMoePlan, LayerBuffersAreAlignedDisjointAndSized) {
  MoeShape s;
  s.n = 100, s.c = 33, s.experts = 6, s.topk = 3, s.ffn = 17, s.fc1_rows = 34, s.act_bytes = 2, s.sigmoid = true;
  const MoeBuffers b = PlanMoeBuffers(s);
  const std::vector<std::pair<int64_t, int64_t>> saved = {
      {b.logits, 100 * 6 * 4}, {b.scores, 100 * 6 * 4}, {b.gates, 100 * 6 * 4}, {b.prob, 300 * 4},
      {b.expert, 300 * 4},     {b.lse, 100 * 4},        {b.order, 300 * 4},     {b.combine, 300 * 4},
      {b.x, 300 * 33 * 2},     {b.fc1, 300 * 34 * 2},   {b.act, 300 * 17 * 2},  {b.scaled, 300 * 17 * 2}};
  const std::vector<std::pair<int64_t, int64_t>> scratch = {
      {b.xf, 100 * 33 * 4},      {b.wf, 6 * 33 * 4},          {b.colsum, 6 * 4},         {b.rows, 300 * 33 * 2},
      {b.dscaled, 300 * 17 * 2}, {b.dfc1, 300 * 34 * 2},      {b.dx_rows, 300 * 33 * 2}, {b.dprob, 300 * 4},
      {b.dlogits, 100 * 6 * 4},  {b.dx_router, 100 * 33 * 4}, {b.dscore, 6 * 4}};
  for (const auto* region : {&saved, &scratch}) {
    int64_t end = 0;
    for (const auto& [offset, bytes] : *region) {
      EXPECT_EQ(offset % 256, 0);
      EXPECT_GE(offset, end);
      end = offset + bytes;
    }
    EXPECT_LE(end, region == &saved ? b.saved_bytes : b.scratch_bytes);
    EXPECT_GT(end + 256, region == &saved ? b.saved_bytes : b.scratch_bytes);
  }
  s.sigmoid = false;
  EXPECT_EQ(PlanMoeBuffers(s).gates, -1);
  for (int64_t f : {b.shared_fc1, b.shared_act, b.shared_y, b.shared_gate, b.shared_add, b.shared_dy, b.shared_dact,
                    b.shared_dfc1, b.shared_dx, b.shared_dlogit, b.plain, b.seq_colsum, b.bias})
    EXPECT_EQ(f, -1) << "no shared experts, groups or seq_aux_loss: none of their buffers";
}

// Group-limited routing keeps each token's plain top-k (n, K) in the scratch; seq_aux_loss that and the scores'
// sums per sequence, and a score gradient row per sequence.
TEST(CudaMoePlan, GroupAndSeqAuxLossBuffersAreSized) {
  MoeShape s;
  s.n = 60, s.c = 8, s.experts = 6, s.topk = 2, s.ffn = 4, s.fc1_rows = 4;
  const MoeBuffers none = PlanMoeBuffers(s);
  s.grouped = true;
  const MoeBuffers grouped = PlanMoeBuffers(s);
  EXPECT_EQ(grouped.plain, none.scratch_bytes);  // after the rest, 120 int32
  EXPECT_EQ(grouped.seq_colsum, -1);
  EXPECT_EQ(grouped.scratch_bytes, none.scratch_bytes + 512);
  EXPECT_EQ(grouped.saved_bytes, none.saved_bytes);
  s.grouped = false;
  s.biased = true;  // the expert bias: the plain top-k and the bias (6 floats) after it
  const MoeBuffers biased = PlanMoeBuffers(s);
  EXPECT_EQ(biased.plain, none.scratch_bytes);
  EXPECT_EQ(biased.bias, biased.plain + 512);
  EXPECT_EQ(biased.scratch_bytes, biased.bias + 256);
  EXPECT_EQ(grouped.bias, -1);
  s.biased = false;
  s.seq_tokens = 20;  // 3 sequences
  EXPECT_EQ(s.seqs(), 3);
  const MoeBuffers seq = PlanMoeBuffers(s);
  EXPECT_EQ(seq.dscore, none.dscore);
  EXPECT_EQ(seq.plain, none.scratch_bytes);  // dscore's 3 rows of 6 still in one aligned block
  EXPECT_EQ(seq.seq_colsum, seq.plain + 512);
  EXPECT_EQ(seq.scratch_bytes, seq.seq_colsum + 256);
  s.experts = 40;  // 3 rows of 40 floats: 480 bytes, two blocks
  MoeShape one = s;
  one.seq_tokens = 0;
  EXPECT_EQ(PlanMoeBuffers(s).plain - PlanMoeBuffers(s).dscore, 512);
  EXPECT_EQ(PlanMoeBuffers(one).scratch_bytes - PlanMoeBuffers(one).dscore, 256);
}

// The routing counts per group of tokens, seq_aux_loss's value and the score gradients the router's backward reads,
// against the definitions the CPU model follows (trainer/cpu/moe_balance.cpp, moe_cpu.cpp's RouterBackward).
TEST(CudaMoePlan, SeqAuxLossAndScoreGradientsFollowTheCpuDefinitions) {
  const int64_t n = 30, E = 5, K = 2, S = 10, B = 3;
  const Routed r = Route(n, 4, E, K, false, 11);
  std::vector<int32_t> plain(n * K);  // the plain top-k of the scores: the router's choices without groups
  for (int64_t i = 0; i < n * K; ++i) plain[i] = r.a.expert[i];
  std::vector<float> counts;
  ASSERT_TRUE(MoeRoutingCounts(&counts, plain.data(), n, K, E, S).ok());
  ASSERT_EQ(counts.size(), static_cast<size_t>(B * E));
  std::vector<double> want_counts(B * E, 0.0);
  std::vector<float> colsum(B * E, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < K; ++k) want_counts[i / S * E + plain[i * K + k]] += 1;
    for (int64_t e = 0; e < E; ++e) colsum[i / S * E + e] += r.a.scores[i * E + e];
  }
  double want_loss = 0;
  for (int64_t j = 0; j < B * E; ++j) {
    EXPECT_EQ(counts[j], want_counts[j]) << j;
    want_loss += double(colsum[j]) * want_counts[j];
  }
  want_loss *= double(E) / (double(K) * S * S * B);
  EXPECT_NEAR(MoeSeqAuxLossOf(colsum.data(), counts, n, K, E, S), want_loss, 1e-12);
  std::vector<float> all;
  ASSERT_TRUE(MoeRoutingCounts(&all, plain.data(), n, K, E).ok());  // one group: the whole pass
  ASSERT_EQ(all.size(), static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(all[e], want_counts[e] + want_counts[E + e] + want_counts[2 * E + e]);
  // The gradient rows: aux_unit x count + the sequence's seq_grad x unit x its count, rounded once.
  const double aux_unit = MoeAuxUnit(0.3, n, K, E), seq_grad = 0.7;
  const std::vector<float> d = MoeScoreGradients(aux_unit, all, seq_grad, counts, n, K, E, S);
  ASSERT_EQ(d.size(), static_cast<size_t>(B * E));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < E; ++e)
      EXPECT_EQ(d[b * E + e], static_cast<float>(aux_unit * all[e] + seq_grad * double(E) / (double(K) * S * S * B) *
                                                                         want_counts[b * E + e]))
          << b << " " << e;
  const std::vector<float> aux_only = MoeScoreGradients(aux_unit, all, 0.0, {}, n, K, E, S);
  ASSERT_EQ(aux_only.size(), static_cast<size_t>(E));
  EXPECT_EQ(aux_only[2], static_cast<float>(aux_unit * all[2]));
  // Bad input: groups that do not divide the tokens, an expert out of range.
  EXPECT_EQ(MoeRoutingCounts(&counts, plain.data(), n, K, E, 7).code(), absl::StatusCode::kInvalidArgument);
  plain[5] = E;
  EXPECT_EQ(MoeRoutingCounts(&counts, plain.data(), n, K, E, S).code(), absl::StatusCode::kInvalidArgument);
}

// Shared experts: their fc1 and activation kept per layer (with the gate fc2's output and the gate too), their
// scratch after the routed experts', disjoint; the fp32 sum the un-permute adds in dx_router's place (forward only).
TEST(CudaMoePlan, SharedExpertBuffersAreAlignedDisjointAndSized) {
  for (bool gate : {false, true}) {
    MoeShape s;
    s.n = 50, s.c = 24, s.experts = 4, s.topk = 2, s.ffn = 10, s.fc1_rows = 20, s.act_bytes = 2;
    s.shared_ffn = 36, s.shared_fc1_rows = 72, s.shared_gate = gate;
    const MoeBuffers b = PlanMoeBuffers(s);
    MoeShape routed = s;
    routed.shared_ffn = routed.shared_fc1_rows = 0;
    routed.shared_gate = false;
    const MoeBuffers r = PlanMoeBuffers(routed);
    std::vector<std::pair<int64_t, int64_t>> saved = {
        {b.scaled, 100 * 10 * 2}, {b.shared_fc1, 50 * 72 * 2}, {b.shared_act, 50 * 36 * 2}};
    std::vector<std::pair<int64_t, int64_t>> scratch = {{b.dx_router, 50 * 24 * 4},
                                                        {b.shared_dy, 50 * 24 * 2},
                                                        {b.shared_dact, 50 * 36 * 2},
                                                        {b.shared_dfc1, 50 * 72 * 2},
                                                        {b.shared_dx, 50 * 24 * 2}};
    if (gate) {
      saved.push_back({b.shared_y, 50 * 24 * 2});
      saved.push_back({b.shared_gate, 50 * 4});
      scratch.push_back({b.shared_dlogit, 50 * 4});
    } else {
      EXPECT_EQ(b.shared_y, -1);
      EXPECT_EQ(b.shared_gate, -1);
      EXPECT_EQ(b.shared_dlogit, -1);
    }
    for (const auto* region : {&saved, &scratch}) {
      int64_t end = 0;
      for (const auto& [offset, bytes] : *region) {
        EXPECT_EQ(offset % 256, 0) << "gate " << gate;
        EXPECT_GE(offset, end) << "gate " << gate;
        end = offset + bytes;
      }
      EXPECT_LE(end, region == &saved ? b.saved_bytes : b.scratch_bytes);
    }
    EXPECT_EQ(b.shared_add, b.dx_router);
    EXPECT_EQ(b.scaled, r.scaled);  // the routed experts' buffers where they were
    const auto align = [](int64_t v) { return (v + 255) / 256 * 256; };
    EXPECT_EQ(b.saved_bytes - r.saved_bytes,
              align(50 * 72 * 2) + align(50 * 36 * 2) + (gate ? align(50 * 24 * 2) + align(50 * 4) : 0));
  }
  GPTConfig c;
  c.hidden_size = 64;
  c.ffn_hidden_size = 128;
  c.num_experts = 8;
  c.moe_router_topk = 2;
  c.swiglu = true;
  c.moe_shared_expert_intermediate_size = 80;
  c.moe_shared_expert_gate = true;
  const MoeShape s = MoeShapeOf(c, 16, 4);
  EXPECT_EQ(s.shared_ffn, 80);
  EXPECT_EQ(s.shared_fc1_rows, 160);
  EXPECT_TRUE(s.shared_gate);
  EXPECT_FALSE(s.biased);
  c.moe_router_enable_expert_bias = true;
  EXPECT_FALSE(MoeShapeOf(c, 16, 4).biased);  // the bias is the sigmoid router's
  c.moe_router_sigmoid = true;
  EXPECT_TRUE(MoeShapeOf(c, 16, 4).biased);
  c.moe_shared_expert_intermediate_size = 0;  // the gate flag alone: no shared experts
  EXPECT_FALSE(MoeShapeOf(c, 16, 4).shared_gate);
  EXPECT_EQ(MoeShapeOf(c, 16, 4).shared_ffn, 0);
}

TEST(CudaMoePlan, MemoryPlanHoldsEveryMoeLayer) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = c.padded_vocab_size = 128;
  PlanOptions o;
  o.micro_batch_size = 2;
  auto dense = PlanMemory(c, 1000, o);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(dense->moe_saved, -1);
  EXPECT_EQ(dense->moe_scratch, -1);
  c.num_experts = 8;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 48;
  c.moe_layer_pattern = {1, 0, 1, 1};
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    o.precision = p;
    auto moe = PlanMemory(c, 1000, o);
    ASSERT_TRUE(moe.ok()) << moe.status();
    GPTConfig plain = c;
    plain.num_experts = 0;
    auto dense_p = PlanMemory(plain, 1000, o);
    ASSERT_TRUE(dense_p.ok()) << dense_p.status();
    const MoeBuffers b = PlanMoeBuffers(MoeShapeOf(c, 64, p == Precision::kFp32 ? 4 : 2));
    EXPECT_EQ(moe->moe_layers, 3);
    EXPECT_EQ(moe->moe_saved_bytes, b.saved_bytes);
    EXPECT_EQ((*moe)[moe->moe_saved].bytes, 3 * b.saved_bytes);
    EXPECT_EQ((*moe)[moe->moe_scratch].bytes, b.scratch_bytes);
    EXPECT_GT(b.saved_bytes, 64 * 2 * 64 * (p == Precision::kFp32 ? 4 : 2));  // at least the gathered rows
    // The dense MLP's fc1 and activation for the one dense layer only (layer 1): the MoE layers keep their own.
    const int64_t a = p == Precision::kFp32 ? 4 : 2;
    EXPECT_EQ((*moe)[moe->fc1].bytes, 1 * 64 * 128 * a);
    EXPECT_EQ((*moe)[moe->gelu].bytes, 1 * 64 * 128 * a);
    EXPECT_EQ((*dense_p)[dense_p->fc1].bytes, 4 * 64 * 128 * a);
    EXPECT_GE(moe->total_bytes, dense_p->total_bytes - 3 * 2 * 64 * 128 * a + 3 * b.saved_bytes + b.scratch_bytes);
  }
  c.moe_layer_pattern.clear();  // every layer MoE: no dense MLP activations at all
  c.swiglu = true;
  auto all = PlanMemory(c, 1000, o);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->moe_layers, 4);
  EXPECT_EQ((*all)[all->fc1].bytes, 0);
  EXPECT_EQ((*all)[all->gelu].bytes, 0);
}

}  // namespace
}  // namespace ptk::cuda
