// The mixture-of-experts MLP's CPU op (trainer/cpu/moe_cpu.h): the routing against its definition
// (top-k, the probabilities of both softmax orders, each expert's rows in token order), the
// load-balancing loss against Megatron's formula, and the backward of the router, dispatch,
// experts and combine (with the load-balancing loss's gradient) against central finite
// differences in double precision.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/moe_cpu.h"

namespace ptk {
namespace {

using cpu::MlpActivation;
using cpu::MoeActivations;
using cpu::MoeSettings;
using testing::CheckGradient;
using testing::Dot;
using testing::Random;

TEST(MoeOps, RoutingFollowsItsDefinition) {
  const int64_t n = 5, c = 3;
  MoeSettings s;
  s.experts = 4;
  s.topk = 2;
  s.ffn = 2;
  auto x = Random(n * c, 1), w = Random(s.experts * c, 2);
  for (bool pre : {false, true}) {
    s.pre_softmax = pre;
    MoeActivations<double> a;
    cpu::MoeRouterForward(&a, x.data(), w.data(), n, c, s);
    for (int64_t i = 0; i < n; ++i) {
      std::vector<double> z(s.experts);
      for (int64_t e = 0; e < s.experts; ++e)
        for (int64_t j = 0; j < c; ++j) z[e] += x[i * c + j] * w[e * c + j];
      const int e0 = a.expert[i * 2], e1 = a.expert[i * 2 + 1];
      for (int64_t e = 0; e < s.experts; ++e)  // the two largest logits, largest first
        if (e != e0 && e != e1) {
          EXPECT_LT(z[e], z[e1]);
        }
      EXPECT_GT(z[e0], z[e1]);
      double all = 0;
      for (double v : z) all += std::exp(v);
      const double p0 = pre ? std::exp(z[e0]) / all : 1.0 / (1.0 + std::exp(z[e1] - z[e0]));
      const double p1 = pre ? std::exp(z[e1]) / all : 1.0 - p0;
      EXPECT_NEAR(a.prob[i * 2], p0, 1e-12);
      EXPECT_NEAR(a.prob[i * 2 + 1], p1, 1e-12);
    }
    // Each expert's rows: its tokens in ascending order, every slot once.
    std::vector<int> seen(n * s.topk, 0);
    for (int64_t e = 0; e < s.experts; ++e)
      for (int64_t r = a.begin[e]; r < a.begin[e + 1]; ++r) {
        EXPECT_EQ(a.expert[a.order[r]], e);
        if (r > a.begin[e]) {
          EXPECT_LT(a.order[r - 1], a.order[r]);
        }
        ++seen[a.order[r]];
      }
    for (int v : seen) EXPECT_EQ(v, 1);
    // Megatron's switch_load_balancing_loss_func without its coefficient.
    double expect = 0;
    for (int64_t e = 0; e < s.experts; ++e) {
      double col = 0;
      for (int64_t i = 0; i < n; ++i) col += a.scores[i * s.experts + e];
      expect += col * static_cast<double>(a.begin[e + 1] - a.begin[e]);
    }
    expect *= static_cast<double>(s.experts) / (s.topk * n * n);
    EXPECT_NEAR(cpu::MoeAuxLoss(a, s), expect, 1e-14);
  }
}

// sum(out * r) + aux_weight * load-balancing loss: the layer's gradients against finite differences.
void CheckLayerGradients(MoeSettings s, double aux_weight) {
  const int64_t n = 7, c = 5;
  auto x = Random(n * c, 11), wr = Random(s.experts * c, 12, 0.5), we = Random(s.experts * s.expert_floats(c), 13, 0.5),
       r = Random(n * c, 14);
  std::vector<double> out(n * c);
  MoeActivations<double> a;
  auto objective = [&] {
    cpu::MoeRouterForward(&a, x.data(), wr.data(), n, c, s);
    cpu::MoeExpertsForward(out.data(), &a, we.data(), c, s);
    return Dot(out, r) + aux_weight * cpu::MoeAuxLoss(a, s);
  };
  objective();
  std::vector<double> dx(n * c, 0), dwr(wr.size(), 0), dwe(we.size(), 0);
  cpu::MoeBackward(dx.data(), dwr.data(), dwe.data(), r.data(), &a, x.data(), wr.data(), we.data(), c, s, aux_weight);
  CheckGradient(x, dx, objective, "dx", 1e-5);
  CheckGradient(wr, dwr, objective, "dw_router", 1e-5);
  CheckGradient(we, dwe, objective, "dw_experts", 1e-5);
}

TEST(MoeOps, GradientsMatchFiniteDifferences) {
  MoeSettings s;
  s.experts = 4;
  s.ffn = 3;
  for (MlpActivation act :
       {MlpActivation::kGelu, MlpActivation::kGeluExact, MlpActivation::kSwiglu, MlpActivation::kSquaredRelu})
    for (int score : {0, 1, 2})  // softmax after top-k, before it, sigmoid
      for (int64_t k : {1, 2, 3}) {
        s.activation = act;
        s.pre_softmax = score == 1;
        s.sigmoid = score == 2;
        s.topk = k;
        SCOPED_TRACE(::testing::Message()
                     << "activation " << static_cast<int>(act) << " score " << score << " topk " << k);
        CheckLayerGradients(s, 0.0);
        CheckLayerGradients(s, 0.37);
      }
}

// An expert no token chose (its rows empty) gets no gradient, and the others still add up.
TEST(MoeOps, AnUnchosenExpertGetsNoGradient) {
  MoeSettings s;
  s.experts = 3;
  s.topk = 1;
  s.ffn = 2;
  const int64_t n = 4, c = 2;
  std::vector<double> x = {1, 0, 2, 0, 3, 0, 4, 0}, wr = {1, 0, 0, 0, -1, 0};  // expert 0 always wins
  auto we = Random(s.experts * s.expert_floats(c), 3);
  MoeActivations<double> a;
  std::vector<double> out(n * c), dx(n * c, 0), dwr(wr.size(), 0), dwe(we.size(), 0), r = Random(n * c, 4);
  cpu::MoeRouterForward(&a, x.data(), wr.data(), n, c, s);
  EXPECT_EQ(a.begin[1] - a.begin[0], n);
  cpu::MoeExpertsForward(out.data(), &a, we.data(), c, s);
  cpu::MoeBackward(dx.data(), dwr.data(), dwe.data(), r.data(), &a, x.data(), wr.data(), we.data(), c, s, 0.0);
  for (int64_t i = s.expert_floats(c); i < static_cast<int64_t>(dwe.size()); ++i) EXPECT_EQ(dwe[i], 0.0);
  double sum0 = 0;
  for (int64_t i = 0; i < s.expert_floats(c); ++i) sum0 += std::abs(dwe[i]);
  EXPECT_GT(sum0, 0.0);
}

}  // namespace
}  // namespace ptk
