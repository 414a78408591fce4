// The CUDA MoE layer's host side (trainer/cuda/moe_plan.h), on the CPU: the dispatch plan is the CPU MoE's
// permutation (trainer/cpu/moe_cpu.cpp's order and begin) with each token's rows ascending for the un-permute,
// bad router output refused, the load-balancing and z-losses from the kernels' partial results equal the CPU
// ones, the layer's buffers aligned and disjoint, and the memory plan holding them for every MoE layer.
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
    EXPECT_NEAR(MoeAuxLossOf(colsum.data(), p, n, K, E), cpu::MoeAuxLoss(r.a, r.s), 1e-6);
    EXPECT_NEAR(MoeZLossOf(lse.data(), n), cpu::MoeZLoss(r.a, r.s), 1e-5);
    EXPECT_DOUBLE_EQ(MoeAuxUnit(2.0, n, K, E), 2.0 * E / (K * double(n) * n));
  }
}

TEST(CudaMoePlan, LayerBuffersAreAlignedDisjointAndSized) {
  MoeShape s;
  s.n = 100, s.c = 33, s.experts = 6, s.topk = 3, s.ffn = 17, s.fc1_rows = 34, s.act_bytes = 2, s.sigmoid = true;
  const MoeBuffers b = PlanMoeBuffers(s);
  const std::vector<std::pair<int64_t, int64_t>> saved = {
      {b.logits, 100 * 6 * 4}, {b.scores, 100 * 6 * 4}, {b.gates, 100 * 6 * 4},  {b.prob, 300 * 4}, {b.expert, 300 * 4},
      {b.lse, 100 * 4},        {b.order, 300 * 4},      {b.combine, 300 * 4},    {b.counts, 6 * 4}, {b.x, 300 * 33 * 2},
      {b.fc1, 300 * 34 * 2},   {b.act, 300 * 17 * 2},   {b.scaled, 300 * 17 * 2}};
  const std::vector<std::pair<int64_t, int64_t>> scratch = {
      {b.xf, 100 * 33 * 4},      {b.wf, 6 * 33 * 4},         {b.colsum, 6 * 4},         {b.rows, 300 * 33 * 2},
      {b.dscaled, 300 * 17 * 2}, {b.dfc1, 300 * 34 * 2},     {b.dx_rows, 300 * 33 * 2}, {b.dprob, 300 * 4},
      {b.dlogits, 100 * 6 * 4},  {b.dx_router, 100 * 33 * 4}};
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
    EXPECT_GE(moe->total_bytes, dense_p->total_bytes + 3 * b.saved_bytes + b.scratch_bytes);
  }
}

}  // namespace
}  // namespace ptk::cuda
