// The CPU MoE router over context ranks (trainer/cpu/moe_balance_cpu.h: what ptk-train's MoE layers run on each
// context rank's positions) against megatron-core 0.16.1's TopKRouter at context size 2, each rank routing its own
// positions, chunks r and 3 - r of 4 (tests/support/gen_moe_cp_router_golden.py, two gloo processes; and at context
// size 1), here two gloo threads: softmax top-2 with the aux loss and the z-loss, with and without
// --calculate-per-token-loss; seq_aux_loss with a capacity of 1 (probs policy); sigmoid scores with an expert bias,
// global_aux_loss and the z-loss. Each rank's routing map after the drop exactly and its expert-bias token counts
// exactly, its probabilities within 1e-6; its tracked losses (its own part: load_balancing_loss,
// seq_load_balancing_loss and global_load_balancing_loss over the group's counts, z_loss its own tokens' mean)
// within 1e-5 relative; its input gradient and the router weight's gradient as Megatron's data x context reduction
// leaves it (the ranks' mean, or their sum with --calculate-per-token-loss) within 1e-5 (ptk's fp32 router against
// Megatron's fp32 in another order: the largest measured is printed).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/router_golden.h"
#include "trainer/cpu/moe_balance_cpu.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk {
namespace {

constexpr int64_t S = 8, B = 2, H = 6, E = 4, K = 2;

using GoldenCase = testing::RouterGoldenCase;

std::mutex mu;  // the ranks' threads' expectations and the worst difference
double worst = 0;
::testing::AssertionResult Near(double got, double want, double tolerance) {
  return testing::NearMegatron(got, want, tolerance, &worst);
}
::testing::AssertionResult NearRelative(double got, double want) {
  return Near(got, want, 1e-5 * std::max(std::abs(want), 1e-3));
}

// The case's coefficients (gen_moe_cp_router_golden.py's CASES).
struct Coeffs {
  double aux = 0, seq = 0, global = 0, z = 0;
  bool sigmoid = false, per_token = false, capacity = false;
};
Coeffs CoeffsOf(const std::string& name) {
  Coeffs c;
  if (name == "aux_z" || name == "aux_z_per_token") c.aux = 0.01, c.z = 0.03, c.per_token = name != "aux_z";
  if (name == "seq_capacity") c.seq = 0.02, c.capacity = true;
  if (name == "sigmoid_bias_global") c.sigmoid = true, c.global = 0.01, c.z = 0.02;
  return c;
}

// One context rank of C: its routing, losses and gradients against the golden's; its router weight gradient
// (as Megatron's reduction weighs it) added to *dw.
void CheckRank(const GoldenCase& g, const Coeffs& c, int C, int r, Communicator* comm, std::vector<double>* dw) {
  const auto& m = g.ranks.at(std::to_string(C) + " " + std::to_string(r));
  const int64_t t = S / C, n = B * t;
  cpu::MoeSettings s;
  s.experts = E;
  s.topk = K;
  s.ffn = 1;
  s.sigmoid = c.sigmoid;
  s.capacity_factor = c.capacity ? 1.0 : -1.0;
  s.sample_rows = t;
  const std::vector<float> bias(g.shared.at("bias").begin(), g.shared.at("bias").end());
  if (c.sigmoid) s.expert_bias = bias.data();
  // ptk's rows: [sample, the rank's position]; Megatron's x, g: [position, sample, .].
  const std::vector<double>&xm = m.at("x"), &gm = g.shared.at("g"), &pos = m.at("pos");
  std::vector<float> x(static_cast<size_t>(n * H)), w(g.shared.at("weight").begin(), g.shared.at("weight").end());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t h = 0; h < H; ++h) x[(b * t + p) * H + h] = static_cast<float>(xm[(p * B + b) * H + h]);
  cpu::MoeActivations<float> a;
  cpu::MoeRouterForward(&a, x.data(), w.data(), n, H, s);
  double lbl = 0, seq = 0, global = 0, steps = 0;
  std::vector<double> global_counts;
  if (c.aux > 0) {
    ASSERT_TRUE(cpu::MoeContextAuxCounts(&a, s, comm).ok());
    lbl = cpu::MoeAuxLoss(a, s);
  }
  a.balance_tokens = c.seq > 0 ? t : n;
  a.balance_grad.assign(static_cast<size_t>(n / a.balance_tokens * E), 0.0);
  if (c.seq > 0) seq = *cpu::MoeSeqAuxLoss(&a, s, t, c.seq, comm);
  if (c.global > 0) global = *cpu::MoeGlobalAuxLoss(&a, s, c.global, comm, &global_counts, &steps);
  // MoEAuxLossAutoScaler's scale, as ptk-train's (TrainStep::MoeAuxLossScale at one micro-batch, one data rank,
  // the loss's weights left out): 1, or with --calculate-per-token-loss the rank's tokens.
  const double scale = c.per_token ? static_cast<double>(n) : 1.0;
  for (double& v : a.balance_grad) v *= scale;
  a.dprob.assign(static_cast<size_t>(n * K), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t k = 0; k < K; ++k) {
        const size_t slot = static_cast<size_t>((b * t + p) * K + k);
        const int64_t at = static_cast<int64_t>(pos[p]) * B + b;
        if (a.dropped.empty() || a.dropped[slot] == 0) a.dprob[slot] = static_cast<float>(gm[at * E + a.expert[slot]]);
      }
  std::vector<float> dx(static_cast<size_t>(n * H), 0.0f), dwr(static_cast<size_t>(E * H), 0.0f);
  cpu::MoeRouterBackward(dx.data(), dwr.data(), &a, x.data(), w.data(), H, s, c.aux * scale,
                         cpu::MoeZLossRankCoeff(c.z, C) * scale);
  const double mean = c.per_token ? 1.0 : static_cast<double>(C);  // Megatron's rank gradients over the reduction's
  std::lock_guard<std::mutex> lock(mu);
  SCOPED_TRACE("context rank " + std::to_string(r) + " of " + std::to_string(C));
  for (int64_t p = 0; p < t; ++p)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t row = b * t + p, j = p * B + b;  // ptk's row, the rank's Megatron token
      for (int64_t e = 0; e < E; ++e) {
        double prob = 0;
        bool sent = false;
        for (int64_t k = 0; k < K; ++k) {
          const size_t slot = static_cast<size_t>(row * K + k);
          if (a.expert[slot] == e && (a.dropped.empty() || a.dropped[slot] == 0)) sent = true, prob = a.prob[slot];
        }
        EXPECT_EQ(sent, m.at("map")[j * E + e] != 0) << "token " << j << " expert " << e;
        EXPECT_TRUE(Near(prob, m.at("probs")[j * E + e], 1e-6)) << "token " << j << " expert " << e;
      }
      for (int64_t h = 0; h < H; ++h) EXPECT_TRUE(Near(dx[row * H + h], m.at("dx")[j * H + h] / mean, 1e-5)) << j;
    }
  EXPECT_TRUE(NearRelative(lbl, m.at("lbl")[0])) << "load_balancing_loss";
  EXPECT_TRUE(NearRelative(seq, m.at("seq")[0])) << "seq_load_balancing_loss";
  EXPECT_TRUE(NearRelative(global, m.at("global")[0])) << "global_load_balancing_loss";
  if (c.z > 0) {
    EXPECT_TRUE(NearRelative(cpu::MoeZLoss(a, s), m.at("z")[0])) << "z_loss";
  }
  if (c.sigmoid) {
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(static_cast<double>(a.begin[e + 1] - a.begin[e]), m.at("counts")[e]);
  }
  for (int64_t i = 0; i < E * H; ++i) (*dw)[i] += dwr[i] - m.at("dw")[i] / mean;
}

TEST(MoeContextParallelRouterGolden, EachRanksRoutingLossesAndGradientsAreMegatronCores) {
  const auto cases = testing::ReadRouterGolden("moe_cp_router_golden.txt", "context");
  ASSERT_EQ(cases.size(), 4u);
  for (const auto& [name, g] : cases) {
    const Coeffs c = CoeffsOf(name);
    for (int C : {1, 2}) {
      SCOPED_TRACE(name + " at context size " + std::to_string(C));
      std::vector<double> dw(E * H, 0.0);  // ptk's summed gradient minus Megatron's reduced one
      testing::RunRanks(C, [&](Communicator* comm, int r) { CheckRank(g, c, C, r, comm, &dw); });
      for (int64_t i = 0; i < E * H; ++i) EXPECT_TRUE(Near(dw[i], 0.0, 1e-5)) << "router weight " << i;
    }
  }
  std::printf("largest difference from megatron-core's: %.3g\n", worst);
}

}  // namespace
}  // namespace ptk
