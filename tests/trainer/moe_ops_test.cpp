// The mixture-of-experts MLP's CPU op (trainer/cpu/moe_cpu.h): the routing against its definition
// (top-k, the probabilities of both softmax orders, each expert's rows in token order), the
// load-balancing loss against Megatron's formula, and the backward of the router, dispatch,
// experts and combine (with the load-balancing loss's gradient) against central finite
// differences in double precision; the router z-loss, the top-k scaling factor and group-limited routing
// likewise; token dropping over the experts' capacity (moe_capacity_cpu.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/moe_capacity_cpu.h"
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

// sum(out * r) + aux_weight * load-balancing loss + z_weight * z-loss: the layer's gradients against finite
// differences.
void CheckLayerGradients(MoeSettings s, double aux_weight, double z_weight = 0) {
  const int64_t n = 7, c = 5;
  auto x = Random(n * c, 11), wr = Random(s.experts * c, 12, 0.5), we = Random(s.experts * s.expert_floats(c), 13, 0.5),
       r = Random(n * c, 14);
  std::vector<double> out(n * c);
  MoeActivations<double> a;
  auto objective = [&] {
    cpu::MoeRouterForward(&a, x.data(), wr.data(), n, c, s);
    cpu::MoeExpertsForward(out.data(), &a, we.data(), c, s);
    return Dot(out, r) + aux_weight * cpu::MoeAuxLoss(a, s) + z_weight * cpu::MoeZLoss(a, s);
  };
  objective();
  std::vector<double> dx(n * c, 0), dwr(wr.size(), 0), dwe(we.size(), 0);
  cpu::MoeBackward(dx.data(), dwr.data(), dwe.data(), r.data(), &a, x.data(), wr.data(), we.data(), c, s, aux_weight,
                   z_weight);
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

// The z-loss: its value against the definition, and its gradient (alone and with the others, in every
// score function) against finite differences.
TEST(MoeOps, TheZLossAndItsGradientFollowTheirDefinition) {
  const int64_t n = 6, c = 3;
  MoeSettings s;
  s.experts = 5;
  s.topk = 2;
  s.ffn = 2;
  auto x = Random(n * c, 21), w = Random(s.experts * c, 22);
  MoeActivations<double> a;
  cpu::MoeRouterForward(&a, x.data(), w.data(), n, c, s);
  double expect = 0;
  for (int64_t i = 0; i < n; ++i) {
    double all = 0;
    for (int64_t e = 0; e < s.experts; ++e) all += std::exp(a.logits[i * s.experts + e]);
    expect += std::log(all) * std::log(all) / n;
  }
  EXPECT_NEAR(cpu::MoeZLoss(a, s), expect, 1e-13);
  for (int score : {0, 1, 2}) {
    s.pre_softmax = score == 1;
    s.sigmoid = score == 2;
    SCOPED_TRACE(::testing::Message() << "score " << score);
    CheckLayerGradients(s, 0.0, 0.83);
    CheckLayerGradients(s, 0.37, 0.83);
  }
}

// The top-k scaling factor multiplies the probabilities (and the experts' outputs), and its backward holds.
TEST(MoeOps, TheScalingFactorScalesTheProbabilities) {
  const int64_t n = 5, c = 3;
  MoeSettings s;
  s.experts = 4;
  s.ffn = 2;
  auto x = Random(n * c, 31), w = Random(s.experts * c, 32);
  for (int score : {0, 1, 2})
    for (int64_t k : {1, 2, 3}) {
      s.pre_softmax = score == 1;
      s.sigmoid = score == 2;
      s.topk = k;
      SCOPED_TRACE(::testing::Message() << "score " << score << " topk " << k);
      MoeActivations<double> plain, scaled;
      s.scaling = 0;
      cpu::MoeRouterForward(&plain, x.data(), w.data(), n, c, s);
      s.scaling = 2.5;
      cpu::MoeRouterForward(&scaled, x.data(), w.data(), n, c, s);
      EXPECT_EQ(scaled.expert, plain.expert);
      for (size_t i = 0; i < plain.prob.size(); ++i) EXPECT_NEAR(scaled.prob[i], 2.5 * plain.prob[i], 1e-14);
      CheckLayerGradients(s, 0.37, 0.5);
    }
}

// Group-limited routing against a brute force of Megatron's group_limited_topk: the groups of the largest
// sums of their topk / group_topk best scores, the top k within them; the load-balancing loss counts the
// plain top k; gradients by finite differences.
TEST(MoeOps, GroupLimitedRoutingChoosesWithinTheBestGroups) {
  const int64_t n = 9, c = 4;
  MoeSettings s;
  s.experts = 8;
  s.ffn = 2;
  s.groups = 4;
  auto x = Random(n * c, 41), w = Random(s.experts * c, 42, 2.0);
  for (int score : {0, 1, 2})
    for (auto [k, g] : {std::pair<int64_t, int64_t>{2, 2}, {2, 1}, {4, 2}, {3, 3}}) {
      s.pre_softmax = score == 1;
      s.sigmoid = score == 2;
      s.topk = k;
      s.group_topk = g;
      SCOPED_TRACE(::testing::Message() << "score " << score << " topk " << k << " group topk " << g);
      MoeActivations<double> a;
      cpu::MoeRouterForward(&a, x.data(), w.data(), n, c, s);
      std::vector<double> plain(s.experts, 0.0);
      for (int64_t i = 0; i < n; ++i) {
        // The routing scores: the logits (softmax after top-k), the softmax (before), the sigmoids.
        std::vector<double> v(a.logits.begin() + i * s.experts, a.logits.begin() + (i + 1) * s.experts);
        if (score == 1) v.assign(a.scores.begin() + i * s.experts, a.scores.begin() + (i + 1) * s.experts);
        if (score == 2) v.assign(a.gates.begin() + i * s.experts, a.gates.begin() + (i + 1) * s.experts);
        const int64_t per = s.experts / s.groups;
        std::vector<std::pair<double, int64_t>> groups;
        for (int64_t q = 0; q < s.groups; ++q) {
          std::vector<double> in(v.begin() + q * per, v.begin() + (q + 1) * per);
          std::sort(in.rbegin(), in.rend());
          double sum = 0;
          for (int64_t t = 0; t < k / g; ++t) sum += in[t];
          groups.push_back({sum, q});
        }
        std::sort(groups.rbegin(), groups.rend());
        std::vector<std::pair<double, int64_t>> allowed;
        for (int64_t j = 0; j < g; ++j)
          for (int64_t e = groups[j].second * per; e < (groups[j].second + 1) * per; ++e) allowed.push_back({v[e], e});
        std::sort(allowed.rbegin(), allowed.rend());
        for (int64_t j = 0; j < k; ++j) EXPECT_EQ(a.expert[i * k + j], allowed[j].second) << "token " << i;
        std::vector<std::pair<double, int64_t>> all;
        for (int64_t e = 0; e < s.experts; ++e) all.push_back({a.scores[i * s.experts + e], e});
        std::sort(all.rbegin(), all.rend());
        for (int64_t j = 0; j < k; ++j) plain[all[j].second] += 1;
      }
      for (int64_t e = 0; e < s.experts; ++e) EXPECT_EQ(a.AuxCount(e), plain[e]) << "expert " << e;
      EXPECT_EQ(a.AuxTokens(), static_cast<double>(n));
      CheckLayerGradients(s, 0.37, 0.5);
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

// Megatron's get_capacity: ceil((tokens x topk / experts) x factor) in Python's double arithmetic, where
// (100 / 10) x 1.1 is 11 (100 x 1.1 / 10 would be 11.000000000000002, 12), (90 / 3) x 1.1 33 (not 34) and
// (150 / 3) x 1.1 55.00000000000001 (56; 150 x 1.1 / 3 would be 55).
TEST(MoeCapacity, TheCapacityIsMegatronsRounding) {
  EXPECT_EQ(cpu::MoeExpertCapacity(16, 2, 4, 0.75), 6);
  EXPECT_EQ(cpu::MoeExpertCapacity(16, 3, 4, 0.5), 6);
  EXPECT_EQ(cpu::MoeExpertCapacity(16, 2, 4, 1.0), 8);
  EXPECT_EQ(cpu::MoeExpertCapacity(5, 2, 4, 1.0), 3);  // 2.5 up
  EXPECT_EQ(cpu::MoeExpertCapacity(50, 2, 10, 1.1), 11);
  EXPECT_EQ(cpu::MoeExpertCapacity(45, 2, 3, 1.1), 33);
  EXPECT_EQ(cpu::MoeExpertCapacity(75, 2, 3, 1.1), 56);
  EXPECT_EQ(cpu::MoeExpertCapacity(16, 2, 4, 0.0), 0);
}

// Four rows, two samples of two positions: Megatron's tokens are [sequence, micro-batch], so rows 0, 1, 2, 3
// are its tokens 0, 2, 1, 3.
TEST(MoeCapacity, PolicyOrderAndTies) {
  EXPECT_EQ(cpu::MegatronTokenIndex(1, 4, 2), 2);
  EXPECT_EQ(cpu::MegatronTokenIndex(2, 4, 2), 1);
  const std::vector<int32_t> expert = {0, 0, 0, 0};  // top-1, every token to expert 0
  std::vector<uint8_t> dropped;
  auto drop = [&](std::vector<double> prob, int64_t capacity, bool position, int64_t rows) {
    EXPECT_EQ(cpu::MoeDropOverCapacity(&dropped, prob.data(), expert.data(), 4, 1, 2, capacity, position, rows),
              std::max<int64_t>(0, 4 - capacity));
    return dropped;
  };
  using D = std::vector<uint8_t>;
  // position: the earliest Megatron tokens (rows 0 and 2), whatever the probabilities.
  EXPECT_EQ(drop({0.1, 0.9, 0.2, 0.9}, 2, true, 2), (D{0, 1, 0, 1}));
  EXPECT_EQ(drop({0.1, 0.9, 0.2, 0.9}, 2, true, 4), (D{0, 0, 1, 1}));  // one sample: row order
  // probs: the largest; among equal ones the earlier Megatron token (row 2, token 1, before row 1, token 2).
  EXPECT_EQ(drop({0.1, 0.9, 0.2, 0.9}, 2, false, 2), (D{1, 0, 1, 0}));
  EXPECT_EQ(drop({0.9, 0.5, 0.5, 0.5}, 2, false, 2), (D{0, 1, 0, 1}));
  EXPECT_EQ(drop({0.9, 0.5, 0.5, 0.5}, 3, false, 2), (D{0, 0, 0, 1}));
  // A capacity of all the tokens keeps them all (Megatron's expert_capacity > num_tokens, and at equality its
  // top-k takes every token); 0 drops every slot.
  EXPECT_EQ(drop({0.1, 0.9, 0.2, 0.9}, 4, false, 2), (D{0, 0, 0, 0}));
  EXPECT_EQ(drop({0.1, 0.9, 0.2, 0.9}, 0, true, 2), (D{1, 1, 1, 1}));
}

// With a capacity factor the router sends each expert at most its capacity, the dropped slots to none (the
// token's output the kept slots' alone); the load-balancing loss counts the routing before the drop; the
// layer's gradients (the dropped probabilities' zero, the kept ones' still through every chosen logit) hold
// against finite differences.
TEST(MoeCapacity, TheRouterDropsOverCapacityAndTheGradientsHold) {
  const int64_t n = 7, c = 5;
  MoeSettings s;
  s.experts = 4;
  s.ffn = 3;
  auto x = Random(n * c, 51), w = Random(s.experts * c, 52, 2.0), we = Random(s.experts * s.expert_floats(c), 53);
  for (int score : {0, 1, 2})
    for (int64_t k : {1, 2, 3})
      for (bool position : {false, true}) {
        s.pre_softmax = score == 1;
        s.sigmoid = score == 2;
        s.topk = k;
        s.drop_by_position = position;
        SCOPED_TRACE(::testing::Message() << "score " << score << " topk " << k << " position " << position);
        MoeActivations<double> plain, a;
        s.capacity_factor = -1;
        cpu::MoeRouterForward(&plain, x.data(), w.data(), n, c, s);
        s.capacity_factor = 0.5;
        cpu::MoeRouterForward(&a, x.data(), w.data(), n, c, s);
        const int64_t capacity = cpu::MoeExpertCapacity(n, k, s.experts, 0.5);
        std::vector<uint8_t> want;
        const int64_t drops =
            cpu::MoeDropOverCapacity(&want, a.prob.data(), a.expert.data(), n, k, s.experts, capacity, position, n);
        EXPECT_GT(drops, 0);
        EXPECT_EQ(a.dropped, want);
        EXPECT_EQ(a.expert, plain.expert);
        EXPECT_EQ(a.prob, plain.prob);  // the kept probabilities are the router's
        EXPECT_EQ(a.begin[s.experts], n * k - drops);
        for (int64_t e = 0; e < s.experts; ++e) {
          EXPECT_LE(a.begin[e + 1] - a.begin[e], capacity);
          EXPECT_EQ(a.AuxCount(e), static_cast<double>(plain.begin[e + 1] - plain.begin[e]));
          for (int64_t r = a.begin[e]; r < a.begin[e + 1]; ++r) EXPECT_EQ(a.dropped[a.order[r]], 0);
        }
        EXPECT_EQ(cpu::MoeAuxLoss(a, s), cpu::MoeAuxLoss(plain, s));
        // A token's output: its kept slots' alone (one whose every slot is dropped gets 0).
        std::vector<double> out(n * c), all(n * c);
        cpu::MoeExpertsForward(out.data(), &a, we.data(), c, s);
        cpu::MoeExpertsForward(all.data(), &plain, we.data(), c, s);
        for (int64_t i = 0; i < n; ++i) {
          bool any = false, every = true;
          for (int64_t j = 0; j < k; ++j) any |= a.dropped[i * k + j] != 0, every &= a.dropped[i * k + j] != 0;
          for (int64_t j = 0; j < c; ++j) {
            if (every) {
              EXPECT_EQ(out[i * c + j], 0.0) << "token " << i;
            }
            if (!any) {
              EXPECT_NEAR(out[i * c + j], all[i * c + j], 1e-14) << "token " << i;
            }
          }
        }
        CheckLayerGradients(s, 0.37, 0.5);
      }
}

}  // namespace
// Tensor ranks (MoeSettings::shards): Megatron's router runs on each rank's own positions [r·t/T, (r+1)·t/T) of every
// sample, so the drop of all the gathered rows is each rank's rows dropped alone (the capacity of its own tokens, its
// own [position, sample] order), and MoeZLossOfShard is the z-loss of one rank's rows alone; the drop differs from
// one rank's over all the rows.
TEST(MoeCapacity, TensorRanksDropEachRanksOwnTokens) {
  const int64_t b = 3, t = 6, T = 2, tl = t / T, n = b * t, c = 4;
  MoeSettings s;
  s.experts = 4;
  s.ffn = 2;
  s.sample_rows = t;
  auto x = Random(n * c, 61), w = Random(s.experts * c, 62, 2.0);
  bool differs = false;
  for (int score : {0, 2})
    for (int64_t k : {1, 2})
      for (bool position : {false, true})
        for (double factor : {0.5, 1.0}) {
          s.sigmoid = score == 2;
          s.topk = k;
          s.drop_by_position = position;
          s.capacity_factor = factor;
          SCOPED_TRACE(::testing::Message()
                       << "score " << score << " topk " << k << " position " << position << " factor " << factor);
          MoeActivations<double> whole, one;
          s.shards = 1;
          cpu::MoeRouterForward(&one, x.data(), w.data(), n, c, s);
          s.shards = T;
          cpu::MoeRouterForward(&whole, x.data(), w.data(), n, c, s);
          ASSERT_EQ(whole.dropped.size(), static_cast<size_t>(n * k));
          differs |= whole.dropped != one.dropped;
          for (int64_t r = 0; r < T; ++r) {
            std::vector<double> xr;  // rank r's rows: each sample's positions [r·tl, (r+1)·tl)
            for (int64_t i = 0; i < b; ++i)
              xr.insert(xr.end(), x.begin() + (i * t + r * tl) * c, x.begin() + (i * t + (r + 1) * tl) * c);
            MoeSettings sr = s;
            sr.shards = 1;
            sr.sample_rows = tl;
            MoeActivations<double> mine;
            cpu::MoeRouterForward(&mine, xr.data(), w.data(), b * tl, c, sr);
            for (int64_t i = 0; i < b; ++i)
              for (int64_t j = 0; j < tl; ++j)
                for (int64_t q = 0; q < k; ++q) {
                  const size_t at = static_cast<size_t>(((i * t + r * tl + j) * k + q)),
                               got = static_cast<size_t>((i * tl + j) * k + q);
                  EXPECT_EQ(whole.expert[at], mine.expert[got]);
                  EXPECT_EQ(whole.dropped[at], mine.dropped.empty() ? 0 : mine.dropped[got]) << "rank " << r;
                }
            EXPECT_NEAR(cpu::MoeZLossOfShard(whole, s, r), cpu::MoeZLoss(mine, sr), 1e-12);
          }
        }
  EXPECT_TRUE(differs);
}

}  // namespace ptk
