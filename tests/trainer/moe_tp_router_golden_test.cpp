// The CPU MoE router over tensor ranks (MoeSettings::shards, MoeZLossOfShard: what ptk-train runs on the gathered
// rows under --sequence-parallel) against megatron-core 0.16.1's TopKRouter at tensor size 2 with sequence
// parallelism, each rank routing its own positions (tests/support/gen_moe_tp_router_golden.py, two gloo
// processes; and at tensor size 1): softmax top-2 with the aux loss, the z-loss and a capacity of 1 (probs policy);
// sigmoid scores with an expert bias, the z-loss and a capacity of 1 (probs policy). Each rank's routing map after
// the drop exactly, its probabilities within 1e-6; its z_loss (its own tokens' mean) and the ranks' load-balancing
// losses' sum within 1e-6 relative; the expert bias's token counts summed over the ranks exactly; the router weight's
// gradient summed over the ranks and each rank's input gradient within 1e-6 (fp32 against ptk's double: the largest
// measured 2.7e-7). At tensor size 2 the drop differs from size 1's (each rank's capacity of its own tokens).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/router_golden.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk {
namespace {

constexpr int64_t S = 8, B = 2, H = 6, E = 4, K = 2;

using GoldenCase = testing::RouterGoldenCase;

// The largest absolute difference seen by Near (printed after the cases).
double worst_difference = 0;
::testing::AssertionResult Near(double got, double want, double tolerance) {
  return testing::NearMegatron(got, want, tolerance, &worst_difference);
}

void CheckCase(const std::string& name, const GoldenCase& g, int64_t T) {
  SCOPED_TRACE(name + " at tensor size " + std::to_string(T));
  const bool sigmoid = name == "sigmoid_bias";
  const double aux = sigmoid ? 0.0 : 0.01, z = sigmoid ? 0.02 : 0.03;
  cpu::MoeSettings s;
  s.experts = E;
  s.topk = K;
  s.ffn = 1;
  s.sigmoid = sigmoid;
  s.capacity_factor = 1.0;
  s.sample_rows = S;
  s.shards = T;
  const std::vector<double>& bias = g.shared.at("bias");
  std::vector<float> bias_f(bias.begin(), bias.end());
  if (sigmoid) s.expert_bias = bias_f.data();
  // ptk's rows: [sample, position]; Megatron's x, g: [position, sample, .].
  const std::vector<double>& xm = g.ranks.at("1 0").at("x");
  const std::vector<double>& gm = g.shared.at("g");
  const int64_t n = B * S, tl = S / T;
  std::vector<double> x(static_cast<size_t>(n * H));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < S; ++p)
      for (int64_t h = 0; h < H; ++h) x[(b * S + p) * H + h] = xm[(p * B + b) * H + h];
  cpu::MoeActivations<double> a;
  cpu::MoeRouterForward(&a, x.data(), g.shared.at("weight").data(), n, H, s);
  a.dprob.assign(static_cast<size_t>(n * K), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < S; ++p)
      for (int64_t k = 0; k < K; ++k) {
        const size_t slot = static_cast<size_t>((b * S + p) * K + k);
        if (a.dropped.empty() || a.dropped[slot] == 0) a.dprob[slot] = gm[(p * B + b) * E + a.expert[slot]];
      }
  std::vector<double> dx(static_cast<size_t>(n * H), 0.0), dw(static_cast<size_t>(E * H), 0.0);
  cpu::MoeRouterBackward(dx.data(), dw.data(), &a, x.data(), g.shared.at("weight").data(), H, s, aux, z);
  double lbl = 0;
  std::vector<double> counts(E, 0.0), dw_sum(E * H, 0.0);
  for (int64_t r = 0; r < T; ++r) {
    const auto& m = g.ranks.at(std::to_string(T) + " " + std::to_string(r));
    for (int64_t p = 0; p < tl; ++p)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = b * S + r * tl + p, j = p * B + b;  // ptk's row, the rank's Megatron token
        for (int64_t e = 0; e < E; ++e) {
          double prob = 0;
          bool sent = false;
          for (int64_t k = 0; k < K; ++k) {
            const size_t slot = static_cast<size_t>(row * K + k);
            if (a.expert[slot] == e && (a.dropped.empty() || a.dropped[slot] == 0)) sent = true, prob = a.prob[slot];
          }
          EXPECT_EQ(sent, m.at("map")[j * E + e] != 0) << "rank " << r << " token " << j << " expert " << e;
          EXPECT_TRUE(Near(prob, m.at("probs")[j * E + e], 1e-6)) << "rank " << r << " token " << j << " expert " << e;
        }
        for (int64_t h = 0; h < H; ++h)
          EXPECT_TRUE(Near(dx[row * H + h], m.at("dx")[j * H + h], 1e-6)) << "rank " << r << " token " << j;
      }
    const double zr = T == 1 ? cpu::MoeZLoss(a, s) : cpu::MoeZLossOfShard(a, s, r);
    EXPECT_TRUE(Near(zr, m.at("z")[0], 1e-6 * m.at("z")[0])) << "rank " << r;
    lbl += m.at("lbl")[0];
    for (int64_t e = 0; e < E; ++e) counts[e] += m.at("counts")[e];
    for (int64_t i = 0; i < E * H; ++i) dw_sum[i] += m.at("dw")[i];
  }
  if (!sigmoid) {
    EXPECT_TRUE(Near(cpu::MoeAuxLoss(a, s), lbl, 1e-6 * lbl));
  } else {
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(static_cast<double>(a.begin[e + 1] - a.begin[e]), counts[e]) << e;
  }
  for (int64_t i = 0; i < E * H; ++i) EXPECT_TRUE(Near(dw[i], dw_sum[i], 1e-6)) << "router weight " << i;
}

TEST(MoeTensorParallelRouterGolden, EachRanksRoutingLossesAndGradientsAreMegatronCores) {
  const auto cases = testing::ReadRouterGolden("moe_tp_router_golden.txt", "tensor");
  ASSERT_EQ(cases.size(), 2u);
  for (const auto& [name, g] : cases) {
    for (int64_t T : {1, 2}) CheckCase(name, g, T);
    // Megatron's drop at size 2 is not size 1's.
    double kept1 = 0, kept2 = 0;
    for (double v : g.ranks.at("1 0").at("map")) kept1 += v;
    for (const char* r : {"2 0", "2 1"})
      for (double v : g.ranks.at(r).at("map")) kept2 += v;
    EXPECT_NE(kept1, kept2) << name;
  }
  std::printf("largest difference from megatron-core's: %.3g\n", worst_difference);
}

}  // namespace
}  // namespace ptk
