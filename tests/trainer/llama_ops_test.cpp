// The Llama line's CPU ops: RMSNorm, rotary embedding, SwiGLU and grouped-query attention,
// backward against central finite differences in double precision, and their values against
// independent definitions (transformers' Llama 3.1 frequencies, multi-head attention with the key
// and value heads repeated).
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk {
namespace {

using testing::CheckGradient;
using testing::Dot;
using testing::Random;

TEST(LlamaOps, RMSNormGradientsAndValues) {
  const int64_t n = 70, c = 9;  // more rows than one fixed block
  auto x = Random(n * c, 5), w = Random(c, 6), r = Random(n * c, 8);
  std::vector<double> out(n * c), rstd(n);
  auto objective = [&] {
    cpu::RMSNormForward(out.data(), rstd.data(), x.data(), w.data(), n, c, 1e-5);
    return Dot(out, r);
  };
  objective();
  double ss = 0;  // row 3 by the definition
  for (int64_t j = 0; j < c; ++j) ss += x[3 * c + j] * x[3 * c + j];
  for (int64_t j = 0; j < c; ++j) EXPECT_NEAR(out[3 * c + j], x[3 * c + j] / std::sqrt(ss / c + 1e-5) * w[j], 1e-12);
  std::vector<double> dx(n * c, 0), dw(c, 0);
  cpu::RMSNormBackward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), n, c);
  CheckGradient(x, dx, objective, "dinp");
  CheckGradient(w, dw, objective, "dw");
}

// --qk-layernorm: each query and key head normalised by the norm's definition (its own
// statistics, the query or the key weight), value heads copied; the backward (in place) against
// finite differences for both norms, with grouped-query attention and more tokens than one block.
TEST(LlamaOps, QKNormGradientsAndValues) {
  const AttentionShape s{2, 37, 4, 5, 2};  // 74 tokens, 4 query heads in 2 groups, head dimension 5
  const int64_t n = s.b * s.t, width = s.qkv_width(), rows = n * (s.nh + s.groups());
  for (bool layernorm : {true, false}) {
    SCOPED_TRACE(layernorm ? "LayerNorm" : "RMSNorm");
    auto x = Random(n * width, 30), wq = Random(s.hd, 31), bq = Random(s.hd, 32), wk = Random(s.hd, 33),
         bk = Random(s.hd, 34), r = Random(n * width, 35);
    std::vector<double> y(n * width), mean(rows), rstd(rows);
    double* m = layernorm ? mean.data() : nullptr;
    const double* b_q = layernorm ? bq.data() : nullptr;
    const double* b_k = layernorm ? bk.data() : nullptr;
    auto objective = [&] {
      cpu::QKNormForward(y.data(), m, rstd.data(), x.data(), wq.data(), b_q, wk.data(), b_k, s, 1e-5);
      return Dot(y, r);
    };
    objective();
    // Token 41's heads by the definition: group 1 holds query heads 2 and 3, then its key and value.
    const int64_t tok = 41;
    for (int64_t h = 0; h < 8; ++h) {
      const int kind = h % 4 < 2 ? 0 : h % 4 == 2 ? 1 : 2;
      const double* xh = x.data() + tok * width + h * s.hd;
      const double* yh = y.data() + tok * width + h * s.hd;
      double mu = 0, var = 0;
      if (layernorm) {
        for (int64_t j = 0; j < s.hd; ++j) mu += xh[j] / s.hd;
      }
      for (int64_t j = 0; j < s.hd; ++j) var += (xh[j] - mu) * (xh[j] - mu) / s.hd;
      for (int64_t j = 0; j < s.hd; ++j) {
        double want = xh[j];
        if (kind < 2) {
          const double w = (kind == 0 ? wq : wk)[j], b = layernorm ? (kind == 0 ? bq : bk)[j] : 0.0;
          want = (xh[j] - mu) / std::sqrt(var + 1e-5) * w + b;
        }
        EXPECT_NEAR(yh[j], want, 1e-12) << "head " << h << " channel " << j;
      }
    }
    std::vector<double> d = r, dwq(s.hd, 0), dbq(s.hd, 0), dwk(s.hd, 0), dbk(s.hd, 0);
    cpu::QKNormBackward(d.data(), dwq.data(), layernorm ? dbq.data() : nullptr, dwk.data(),
                        layernorm ? dbk.data() : nullptr, x.data(), wq.data(), wk.data(), m, rstd.data(), s);
    CheckGradient(x, d, objective, "draw");
    CheckGradient(wq, dwq, objective, "dwq");
    CheckGradient(wk, dwk, objective, "dwk");
    if (layernorm) {
      CheckGradient(bq, dbq, objective, "dbq");
      CheckGradient(bk, dbk, objective, "dbk");
    }
  }
}

TEST(LlamaOps, Llama31FrequenciesAreTransformers) {
  // transformers 4.44.2 _compute_llama3_parameters (fp32), head dimension 128, rope_theta 500000.
  const std::pair<int, double> want[] = {{0, 1.0},
                                         {20, 0.016560440883040428},
                                         {30, 0.0013718936825171113},
                                         {40, 3.428102354519069e-05},
                                         {63, 3.068925877869333e-07}};
  for (auto [i, f] : want) EXPECT_NEAR(RopeInverseFrequency(i, 128, 500000.0, 8.0), f, 2e-6 * f) << i;
  EXPECT_NEAR(RopeInverseFrequency(1, 4, 10000.0, 0.0), 0.01, 1e-9);  // 10000^(-2/4)
}

AttentionShape Gqa() { return AttentionShape{2, 5, 4, 6, 2}; }  // 4 query heads in 2 groups

// Both layouts: pair i is channels (i, i + rd/2), or (2i, 2i + 1) with --rotary-interleaved.
TEST(LlamaOps, RopeRotatesQueriesAndKeysOnly) {
  const AttentionShape s = Gqa();
  const int64_t rd = 4, half = rd / 2;  // rotary_percent 2/3 of head dim 6
  std::vector<float> cos(s.t * half), sin(s.t * half);
  cpu::RopeTables(cos.data(), sin.data(), s.t, rd, RopeSettings{});
  for (bool interleaved : {false, true}) {
    auto x = Random(s.b * s.t * s.qkv_width(), 20), r = Random(x.size(), 21);
    const std::vector<double> x0 = x;
    std::vector<double> y;
    auto objective = [&] {
      y = x;
      cpu::RopeForward(y.data(), cos.data(), sin.data(), s, rd, interleaved);
      return Dot(y, r);
    };
    objective();
    const int64_t per = s.nh / s.groups();
    for (int64_t row = 0; row < s.b * s.t; ++row) {
      const int64_t pos = row % s.t;
      for (int64_t g = 0; g < s.groups(); ++g)
        for (int64_t h = 0; h < per + 2; ++h)
          for (int64_t j = 0; j < s.hd; ++j) {
            const int64_t at = row * s.qkv_width() + (g * (per + 2) + h) * s.hd;
            double want = x0[at + j];
            if (h <= per && j < rd) {  // queries and the key, rotated channels
              const int64_t i = interleaved ? j / 2 : j % half, mate = interleaved ? (j ^ 1) : (j + half) % rd;
              const bool first = interleaved ? j % 2 == 0 : j < half;
              const double a = pos * std::pow(10000.0, -2.0 * i / rd);
              want = first ? x0[at + j] * std::cos(a) - x0[at + mate] * std::sin(a)
                           : x0[at + j] * std::cos(a) + x0[at + mate] * std::sin(a);
            }
            EXPECT_NEAR(y[at + j], want, 1e-6)
                << "interleaved " << interleaved << " row " << row << " group " << g << " head " << h << " ch " << j;
          }
    }
    std::vector<double> dx = r;
    cpu::RopeBackward(dx.data(), cos.data(), sin.data(), s, rd, interleaved);
    CheckGradient(x, dx, objective, "dqkv");
  }
}

// Linear position interpolation: position p's angles are those of p / factor, the fp32 position
// rounded as Megatron's seq *= 1 / factor; with a factor of 1 the plain tables.
TEST(LlamaOps, RopeInterpolationDividesThePositions) {
  const int64_t t = 9, rd = 8, half = rd / 2;
  std::vector<float> cos(t * half), sin(t * half), plain_cos(t * half), plain_sin(t * half);
  cpu::RopeTables(plain_cos.data(), plain_sin.data(), t, rd, RopeSettings{});
  cpu::RopeTables(cos.data(), sin.data(), t, rd, RopeSettings{.interpolation = 1.0});
  EXPECT_EQ(cos, plain_cos);
  EXPECT_EQ(sin, plain_sin);
  cpu::RopeTables(cos.data(), sin.data(), t, rd, RopeSettings{.interpolation = 4.0});
  for (int64_t p = 0; p < t; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double a = p / 4.0 * std::pow(10000.0, -2.0 * i / rd);
      EXPECT_NEAR(cos[p * half + i], std::cos(a), 1e-6) << p << " " << i;
      EXPECT_NEAR(sin[p * half + i], std::sin(a), 1e-6) << p << " " << i;
    }
}

TEST(LlamaOps, SwigluGradientsAndValues) {
  const int64_t n = 7, f = 5;
  auto x = Random(n * 2 * f, 30, 2.0), r = Random(n * f, 31);
  std::vector<double> out(n * f);
  auto objective = [&] {
    cpu::SwigluForward(out.data(), x.data(), n, f);
    return Dot(out, r);
  };
  objective();
  const double g = x[2 * f + 1], u = x[2 * f + f + 1];  // row 1, column 1: gate then up
  EXPECT_NEAR(out[f + 1], g / (1 + std::exp(-g)) * u, 1e-12);
  std::vector<double> dx(n * 2 * f);
  cpu::SwigluBackward(dx.data(), x.data(), r.data(), n, f);
  CheckGradient(x, dx, objective, "dinp");
}

void CheckGqa(double p) {
  const AttentionShape s = Gqa();
  auto qkv = Random(s.b * s.t * s.qkv_width(), 40), r = Random(s.b * s.t * s.nh * s.hd, 41);
  std::vector<uint64_t> streams = {DropoutStream(11, 0, 3), DropoutStream(12, 0, 3)};
  std::vector<double> out(s.b * s.t * s.nh * s.hd), probs(s.b * s.nh * s.t * s.t);
  auto objective = [&] {
    cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, p, 42, streams.data());
    return Dot(out, r);
  };
  objective();
  // Multi-head attention over the same queries with each group's key and value repeated for its
  // query heads gives the same output.
  const AttentionShape mha{s.b, s.t, s.nh, s.hd};
  const int64_t per = s.nh / s.groups();
  std::vector<double> wide(s.b * s.t * mha.qkv_width());
  for (int64_t row = 0; row < s.b * s.t; ++row)
    for (int64_t h = 0; h < s.nh; ++h) {
      const int64_t g = h / per, src = row * s.qkv_width() + g * (per + 2) * s.hd;
      for (int64_t j = 0; j < s.hd; ++j) {
        double* dst = wide.data() + row * mha.qkv_width() + h * 3 * s.hd;
        dst[j] = qkv[src + (h % per) * s.hd + j];
        dst[s.hd + j] = qkv[src + per * s.hd + j];
        dst[2 * s.hd + j] = qkv[src + (per + 1) * s.hd + j];
      }
    }
  std::vector<double> out_mha(out.size()), probs_mha(probs.size());
  cpu::AttentionForward(out_mha.data(), probs_mha.data(), wide.data(), mha, p, 42, streams.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], out_mha[i], 1e-12) << i;
  std::vector<double> dqkv(qkv.size()), scratch(2 * s.t * s.t);
  cpu::AttentionBackward(dqkv.data(), r.data(), qkv.data(), probs.data(), s, p, 42, streams.data(), scratch.data());
  CheckGradient(qkv, dqkv, objective, "dqkv");
}

TEST(LlamaOps, GroupedQueryAttentionGradients) { CheckGqa(0.0); }
TEST(LlamaOps, GroupedQueryAttentionGradientsWithDropout) { CheckGqa(0.3); }

}  // namespace
}  // namespace ptk
