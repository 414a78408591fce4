// Multi-latent attention's CPU op (trainer/cpu/mla_cpu.h) and the core attention's MLA shape: the backward
// of the projections, latent norms and rotary embedding against central finite differences in double
// precision (with and without a q_lora_rank, with and without the norms, LayerNorm and RMSNorm, the 1p
// offset), the rotation against megatron-core's definition, YaRN's tables against its formulas, and the
// core attention with value heads of another width and MLA's softmax scale against its definition and
// finite differences.
#include <cmath>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/mla_cpu.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk {
namespace {

using cpu::MlaSettings;
using testing::CheckGradient;
using testing::Dot;
using testing::Random;

MlaSettings Small(int64_t q_lora, bool norms, bool rms) {
  MlaSettings s;
  s.b = 2, s.t = 3, s.hidden = 5, s.heads = 2, s.q_lora = q_lora, s.kv_lora = 3, s.qk = 2, s.pe = 4, s.v = 3;
  s.norms = norms, s.rms = rms, s.eps = 1e-5, s.scale = 0.4;
  return s;
}

std::vector<float> Tables(const MlaSettings& s, bool sin_table, const cpu::MlaRope& r = {}) {
  std::vector<float> cos(static_cast<size_t>(s.t * s.pe / 2)), sin(cos.size());
  cpu::MlaRopeTables(cos.data(), sin.data(), s.t, s.pe, r);
  return sin_table ? sin : cos;
}

// Every weight of the settings, each a seeded normal tensor (norm weights near 1).
struct Weights {
  std::vector<double> q_proj, q_down, q_norm_w, q_norm_b, q_up, kv_down, kv_norm_w, kv_norm_b, kv_up;
  explicit Weights(const MlaSettings& s) {
    const bool lora = s.q_lora > 0;
    q_proj = lora ? std::vector<double>() : Random(s.q_rows() * s.hidden, 11, 0.5);
    q_down = lora ? Random(s.q_lora * s.hidden, 12, 0.5) : std::vector<double>();
    q_up = lora ? Random(s.q_rows() * s.q_lora, 13, 0.5) : std::vector<double>();
    q_norm_w = lora && s.norms ? Random(s.q_lora, 14, 0.1) : std::vector<double>();
    q_norm_b = lora && s.norms && !s.rms ? Random(s.q_lora, 15, 0.1) : std::vector<double>();
    for (double& w : q_norm_w) w += 1 - s.weight_offset;
    kv_down = Random(s.kv_down_rows() * s.hidden, 16, 0.5);
    kv_up = Random(s.kv_up_rows() * s.kv_lora, 17, 0.5);
    kv_norm_w = s.norms ? Random(s.kv_lora, 18, 0.1) : std::vector<double>();
    kv_norm_b = s.norms && !s.rms ? Random(s.kv_lora, 19, 0.1) : std::vector<double>();
    for (double& w : kv_norm_w) w += 1 - s.weight_offset;
  }
  static double* At(std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }
  cpu::MlaWeights<double> View() {
    return {At(q_proj),  At(q_down),    At(q_norm_w),  At(q_norm_b), At(q_up),
            At(kv_down), At(kv_norm_w), At(kv_norm_b), At(kv_up)};
  }
  std::vector<std::vector<double>*> All() {
    return {&q_proj, &q_down, &q_norm_w, &q_norm_b, &q_up, &kv_down, &kv_norm_w, &kv_norm_b, &kv_up};
  }
};

void CheckMlaGradients(const MlaSettings& s) {
  Weights w(s), g(s);
  for (auto* v : g.All()) std::fill(v->begin(), v->end(), 0.0);
  std::vector<double> x = Random(s.n() * s.hidden, 20);
  const int64_t width = s.shape().qkv_width();
  const std::vector<double> r = Random(s.n() * width, 21);
  const std::vector<float> cos = Tables(s, false), sin = Tables(s, true);
  std::vector<double> qkv(static_cast<size_t>(s.n() * width));
  auto objective = [&] {
    cpu::MlaActivations<double> a;
    cpu::MlaQkvForward(qkv.data(), &a, x.data(), w.View(), s, cos.data(), sin.data());
    return Dot(qkv, r);
  };
  cpu::MlaActivations<double> a;
  cpu::MlaQkvForward(qkv.data(), &a, x.data(), w.View(), s, cos.data(), sin.data());
  std::vector<double> dx(x.size(), 7.0);  // assigned, whatever it held
  cpu::MlaGrads<double> grads{Weights::At(g.q_proj),    Weights::At(g.q_down),    Weights::At(g.q_norm_w),
                              Weights::At(g.q_norm_b),  Weights::At(g.q_up),      Weights::At(g.kv_down),
                              Weights::At(g.kv_norm_w), Weights::At(g.kv_norm_b), Weights::At(g.kv_up)};
  cpu::MlaQkvBackward(dx.data(), grads, r.data(), a, x.data(), w.View(), s, cos.data(), sin.data());
  CheckGradient(x, dx, objective, "dx");
  const char* names[] = {"q_proj",  "q_down",    "q_norm_w",  "q_norm_b", "q_up",
                         "kv_down", "kv_norm_w", "kv_norm_b", "kv_up"};
  auto ws = w.All(), gs = g.All();
  for (size_t k = 0; k < ws.size(); ++k)
    if (!ws[k]->empty()) CheckGradient(*ws[k], *gs[k], objective, names[k]);
}

TEST(MlaOps, TheBackwardMatchesFiniteDifferences) {
  for (int64_t q_lora : {0, 4})
    for (bool norms : {false, true})
      for (bool rms : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "q_lora " << q_lora << " norms " << norms << " rms " << rms);
        CheckMlaGradients(Small(q_lora, norms, rms));
      }
  MlaSettings one_p = Small(4, true, false);
  one_p.weight_offset = 1;  // --apply-layernorm-1p
  CheckMlaGradients(one_p);
}

// megatron-core's MLA rotation: t = cat(x[0::2], x[1::2]), then t * cos + rotate_half(t) * sin; the query's
// first qk channels, the key's no-position channels and the value copied; the key's rotary part shared.
TEST(MlaOps, TheRotationIsMegatronsDeinterleavedRope) {
  MlaSettings s = Small(0, false, false);
  Weights w(s);
  const std::vector<float> cos = Tables(s, false), sin = Tables(s, true);
  std::vector<double> x = Random(s.n() * s.hidden, 3);
  std::vector<double> qkv(static_cast<size_t>(s.n() * s.shape().qkv_width()));
  cpu::MlaActivations<double> a;
  cpu::MlaQkvForward(qkv.data(), &a, x.data(), w.View(), s, cos.data(), sin.data());
  const int64_t half = s.pe / 2, dq = s.dq(), head = 2 * dq + s.v, width = s.shape().qkv_width();
  for (int64_t i = 0; i < s.n(); ++i) {
    std::vector<double> q(static_cast<size_t>(s.q_rows()));
    for (int64_t o = 0; o < s.q_rows(); ++o)
      for (int64_t j = 0; j < s.hidden; ++j) q[o] += x[i * s.hidden + j] * w.q_proj[o * s.hidden + j];
    const int64_t p = i % s.t;
    for (int64_t h = 0; h < s.heads; ++h) {
      const double* qh = q.data() + h * dq;
      const double* got = qkv.data() + i * width + h * head;
      for (int64_t j = 0; j < s.qk; ++j) EXPECT_NEAR(got[j], qh[j], 1e-12);
      for (int64_t j = 0; j < half; ++j) {
        const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * j / s.pe);
        const double x1 = qh[s.qk + 2 * j], x2 = qh[s.qk + 2 * j + 1];
        EXPECT_NEAR(got[s.qk + j], x1 * std::cos(angle) - x2 * std::sin(angle), 1e-6);
        EXPECT_NEAR(got[s.qk + half + j], x2 * std::cos(angle) + x1 * std::sin(angle), 1e-6);
      }
      for (int64_t j = 0; j < s.pe; ++j)  // the rotary key: one per token, the same in every head
        EXPECT_EQ(got[dq + s.qk + j], qkv[i * width + dq + s.qk + j]);
    }
  }
}

// YarnRotaryEmbedding's tables: at factor 1 the plain rope's; at factor 4 over 8 channels with the original
// context 4096 (correction range pairs 1 to 3), pair 0 the original frequency, pair 3 the interpolated
// (divided by 4), pair 2 halfway; cos and sin x the concentration factor mscale(4, m) / mscale(4, m_all).
TEST(MlaOps, YarnTablesFollowTheirFormulas) {
  MlaSettings s = Small(0, false, false);
  s.t = 5;
  s.pe = 8;
  cpu::MlaRope yarn;
  yarn.yarn = true;
  EXPECT_EQ(Tables(s, false, yarn), Tables(s, false));
  yarn.factor = 4;
  yarn.mscale = 0.7;
  yarn.mscale_all_dim = 0.9;
  const std::vector<float> cos = Tables(s, false, yarn), sin = Tables(s, true, yarn);
  const double m = (0.1 * 0.7 * std::log(4.0) + 1) / (0.1 * 0.9 * std::log(4.0) + 1);
  EXPECT_NEAR(cpu::YarnGetMscale(4, 0.7), 0.1 * 0.7 * std::log(4.0) + 1, 1e-15);
  EXPECT_EQ(cpu::YarnGetMscale(1, 0.7), 1.0);
  const double base = 10000;
  const int64_t p = 3;
  EXPECT_NEAR(cos[p * 4 + 0], std::cos(3.0) * m, 1e-6);
  EXPECT_NEAR(sin[p * 4 + 0], std::sin(3.0) * m, 1e-6);
  // Pair 2: ramp (2 - 1) / (3 - 1) = 1/2, so inv = inter / 2 + extra / 2.
  const double extra2 = std::pow(base, -0.5), pair2 = extra2 / 4 * 0.5 + extra2 * 0.5;
  EXPECT_NEAR(cos[p * 4 + 2], std::cos(3 * pair2) * m, 1e-6);
  // Pair 3: past the range, the interpolated frequency.
  const double pair3 = std::pow(base, -0.75) / 4;
  EXPECT_NEAR(sin[p * 4 + 3], std::sin(3 * pair3) * m, 1e-6);
}

// The core attention of value heads wider than the query and key heads, MLA's scale: its output against
// the definition and its backward against finite differences.
TEST(MlaOps, CoreAttentionWithOtherValueWidthAndScale) {
  const AttentionShape s{2, 4, 3, 2, 3, 5, 0.3};  // b, t, heads, q/k width, groups, value width, scale
  const int64_t w = s.qkv_width(), head = 2 * s.hd + s.vd, c = s.nh * s.vd;
  ASSERT_EQ(w, s.nh * head);
  std::vector<double> qkv = Random(s.b * s.t * w, 5), out(s.b * s.t * c), probs(s.b * s.nh * s.t * s.t);
  cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.0, 0, nullptr);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.nh; ++h)
      for (int64_t i = 0; i < s.t; ++i) {
        const double* q = qkv.data() + (b * s.t + i) * w + h * head;
        std::vector<double> e(static_cast<size_t>(i + 1));
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = qkv.data() + (b * s.t + j) * w + h * head + s.hd;
          double d = 0;
          for (int64_t x = 0; x < s.hd; ++x) d += q[x] * k[x];
          e[j] = std::exp(d * s.scale);
          sum += e[j];
        }
        for (int64_t x = 0; x < s.vd; ++x) {
          double want = 0;
          for (int64_t j = 0; j <= i; ++j) want += e[j] / sum * qkv[(b * s.t + j) * w + h * head + 2 * s.hd + x];
          EXPECT_NEAR(out[(b * s.t + i) * c + h * s.vd + x], want, 1e-12);
        }
      }
  const std::vector<double> r = Random(out.size(), 6);
  auto objective = [&] {
    cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.0, 0, nullptr);
    return Dot(out, r);
  };
  objective();
  std::vector<double> dqkv(qkv.size());
  cpu::AttentionBackward(dqkv.data(), r.data(), qkv.data(), probs.data(), s, 0.0, 0, nullptr);
  CheckGradient(qkv, dqkv, objective, "dqkv");
}

}  // namespace
}  // namespace ptk
