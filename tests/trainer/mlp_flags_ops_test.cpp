// The CPU ops behind Megatron's --squared-relu, its exact GELU (--no-bias-gelu-fusion) and --apply-layernorm-1p against
// megatron-core's own formulas (tests/support/gen_mlp_flags_goldens.py, float64) and central finite differences, and
// --init-method-xavier-uniform's init against torch.nn.init.xavier_uniform_'s bound.
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/golden_util.h"
#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using testing::CheckElementwiseGradient;
using testing::CheckGradient;
using testing::Dot;
using testing::Golden;
using testing::Random;

std::vector<double> AsDouble(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Largest |got - want| / max(1, |want|).
double WorstRel(const std::vector<double>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(1.0, std::fabs(double{want[i]})));
  return worst;
}

TEST(MlpFlagsOps, SquaredReluMatchesMegatronCore) {
  Golden g("mlp_flags_ops");
  const auto x = AsDouble(g.Tensor<float>("sr_x")), dy = AsDouble(g.Tensor<float>("sr_dy"));
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<double> y(x.size()), dx(x.size());
  cpu::SquaredReluForward(y.data(), x.data(), n);
  cpu::SquaredReluBackward(dx.data(), x.data(), dy.data(), n);
  EXPECT_LE(WorstRel(y, g.Tensor<float>("sr_y")), 1e-7);  // the golden is float32-rounded
  EXPECT_LE(WorstRel(dx, g.Tensor<float>("sr_dx")), 1e-7);
  // float, and the backward in place (dinp = dout), as the CUDA model calls it.
  std::vector<float> xf(x.begin(), x.end()), yf(x.size()), df(dy.begin(), dy.end());
  cpu::SquaredReluForward(yf.data(), xf.data(), n);
  cpu::SquaredReluBackward(df.data(), xf.data(), df.data(), n);
  EXPECT_LE(WorstRel(AsDouble(yf), g.Tensor<float>("sr_y")), 1e-6);
  EXPECT_LE(WorstRel(AsDouble(df), g.Tensor<float>("sr_dx")), 1e-6);
  // Not GELU: relu(-1)^2 = 0, (2)^2 = 4, and the derivative at 0 is 0 (autograd's).
  EXPECT_EQ(SquaredReluValue(-1.0), 0.0);
  EXPECT_EQ(SquaredReluValue(2.0), 4.0);
  EXPECT_EQ(SquaredReluDerivative(0.0), 0.0);
  EXPECT_EQ(SquaredReluDerivative(3.0), 6.0);
}

TEST(MlpFlagsOps, SquaredReluGradientIsAFiniteDifference) {
  auto x = Random(50, 21, 2.0);
  for (double& v : x)
    if (std::fabs(v) < 1e-3) v = 0.5;  // away from the kink
  CheckElementwiseGradient(x, 22, cpu::SquaredReluForward<double>, cpu::SquaredReluBackward<double>);
}

// torch's exact GELU (Megatron's GELU MLP without the fused bias-GELU kernel): values of x Phi(x) and
// Phi(x) + x phi(x) computed in long double from erfc, the float op within float rounding of the double
// one, the backward in place, and not the tanh approximation.
TEST(MlpFlagsOps, GeluExactMatchesTheErfFormula) {
  const int64_t n = 400;
  std::vector<double> x(n), dy = Random(n, 31);
  for (int64_t i = 0; i < n; ++i) x[i] = -8.0 + 16.0 * static_cast<double>(i) / static_cast<double>(n - 1);
  std::vector<double> y(n), dx(n);
  cpu::GeluExactForward(y.data(), x.data(), n);
  cpu::GeluExactBackward(dx.data(), x.data(), dy.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const long double v = x[i], cdf = 0.5L * std::erfc(-v / std::sqrt(2.0L));
    const long double pdf = std::exp(-0.5L * v * v) / std::sqrt(2.0L * 3.14159265358979323846264L);
    EXPECT_NEAR(y[i], static_cast<double>(v * cdf), 1e-14) << x[i];
    EXPECT_NEAR(dx[i], static_cast<double>(dy[i] * (cdf + v * pdf)), 1e-14) << x[i];
  }
  std::vector<float> xf(x.begin(), x.end()), yf(n), df(dy.begin(), dy.end());
  cpu::GeluExactForward(yf.data(), xf.data(), n);
  cpu::GeluExactBackward(df.data(), xf.data(), df.data(), n);  // in place, as the CUDA model calls it
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(yf[i], GeluExactValue<double>(xf[i]), 1e-6 * std::max(1.0, std::fabs(y[i]))) << x[i];
    EXPECT_NEAR(df[i], dy[i] * GeluExactDerivative<double>(xf[i]), 2e-6) << x[i];
  }
  EXPECT_NEAR(GeluExactValue(1.0), 0.8413447460685429, 1e-15);  // Phi(1)
  EXPECT_NEAR(GeluExactDerivative(0.0), 0.5, 1e-15);
  EXPECT_GT(std::fabs(GeluExactValue(1.0) - GeluValue(1.0)), 1e-5);  // the tanh one differs
}

TEST(MlpFlagsOps, GeluExactGradientIsAFiniteDifference) {
  CheckElementwiseGradient(Random(50, 23, 3.0), 24, cpu::GeluExactForward<double>, cpu::GeluExactBackward<double>);
}

TEST(MlpFlagsOps, LayerNorm1pMatchesMegatronCore) {
  Golden g("mlp_flags_ops");
  const int64_t n = g.Int("n"), c = g.Int("c");
  const double eps = g.Num("eps");
  const auto x = AsDouble(g.Tensor<float>("ln_x")), gamma = AsDouble(g.Tensor<float>("ln_gamma")),
             beta = AsDouble(g.Tensor<float>("ln_beta")), dy = AsDouble(g.Tensor<float>("ln_dy"));
  std::vector<double> y(n * c), mean(n), rstd(n), dx(n * c, 0.0), dg(c, 0.0), db(c, 0.0);
  cpu::LayerNormForward(y.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(), n, c, eps, 1.0);
  cpu::LayerNormBackward(dx.data(), dg.data(), db.data(), dy.data(), x.data(), gamma.data(), mean.data(), rstd.data(),
                         n, c, 1.0);
  EXPECT_LE(WorstRel(y, g.Tensor<float>("ln_y")), 1e-6);
  EXPECT_LE(WorstRel(dx, g.Tensor<float>("ln_dx")), 1e-6);
  EXPECT_LE(WorstRel(dg, g.Tensor<float>("ln_dgamma")), 1e-6);
  EXPECT_LE(WorstRel(db, g.Tensor<float>("ln_dbeta")), 1e-6);
  // Without the offset the op is another one (gamma near 0 scales the output to near beta).
  std::vector<double> plain(n * c);
  cpu::LayerNormForward(plain.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(), n, c, eps);
  EXPECT_GT(WorstRel(plain, g.Tensor<float>("ln_y")), 0.1);
}

TEST(MlpFlagsOps, RMSNorm1pMatchesTheZeroCentredFormula) {
  Golden g("mlp_flags_ops");
  const int64_t n = g.Int("n"), c = g.Int("c");
  const double eps = g.Num("eps");
  const auto x = AsDouble(g.Tensor<float>("rms_x")), gamma = AsDouble(g.Tensor<float>("rms_gamma")),
             dy = AsDouble(g.Tensor<float>("rms_dy"));
  std::vector<double> y(n * c), rstd(n), dx(n * c, 0.0), dg(c, 0.0);
  cpu::RMSNormForward(y.data(), rstd.data(), x.data(), gamma.data(), n, c, eps, 1.0);
  cpu::RMSNormBackward(dx.data(), dg.data(), dy.data(), x.data(), gamma.data(), rstd.data(), n, c, 1.0);
  EXPECT_LE(WorstRel(y, g.Tensor<float>("rms_y")), 1e-6);
  EXPECT_LE(WorstRel(dx, g.Tensor<float>("rms_dx")), 1e-6);
  EXPECT_LE(WorstRel(dg, g.Tensor<float>("rms_dgamma")), 1e-6);
}

TEST(MlpFlagsOps, NormsWithTheOffsetHaveFiniteDifferenceGradients) {
  const int64_t n = 70, c = 9;
  auto x = Random(n * c, 23), w = Random(c, 24, 0.1), b = Random(c, 25), r = Random(n * c, 26);
  std::vector<double> out(n * c), mean(n), rstd(n);
  auto ln = [&] {
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c, 1e-5, 1.0);
    return Dot(out, r);
  };
  ln();
  std::vector<double> dx(n * c, 0), dw(c, 0), db(c, 0);
  cpu::LayerNormBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(), rstd.data(), n, c,
                         1.0);
  CheckGradient(x, dx, ln, "layernorm-1p dinp");
  CheckGradient(w, dw, ln, "layernorm-1p dw");
  auto rms = [&] {
    cpu::RMSNormForward(out.data(), rstd.data(), x.data(), w.data(), n, c, 1e-5, 1.0);
    return Dot(out, r);
  };
  rms();
  std::vector<double> rdx(n * c, 0), rdw(c, 0);
  cpu::RMSNormBackward(rdx.data(), rdw.data(), r.data(), x.data(), w.data(), rstd.data(), n, c, 1.0);
  CheckGradient(x, rdx, rms, "rmsnorm-1p dinp");
  CheckGradient(w, rdw, rms, "rmsnorm-1p dw");
}

// --qk-layernorm under --apply-layernorm-1p: the query and key norms with weight w and offset 1 are
// the norms with weight 1 + w (forward, the input gradient, the weights' and biases' gradients).
TEST(MlpFlagsOps, QKNormWithTheOffsetIsTheNormOfOnePlusTheWeight) {
  const AttentionShape s{2, 3, 4, 6, 2};
  const int64_t rows = s.b * s.t, width = s.qkv_width(), hd = s.hd, normed = rows * (s.nh + s.groups());
  const auto raw = Random(rows * width, 27), wq = Random(hd, 28, 0.1), wk = Random(hd, 29, 0.1), bq = Random(hd, 30),
             bk = Random(hd, 31), dy = Random(rows * width, 32);
  std::vector<double> wq1(wq), wk1(wk);
  for (double& v : wq1) v += 1.0;
  for (double& v : wk1) v += 1.0;
  std::vector<double> a(rows * width), b(rows * width), mean(normed), rstd(normed);
  cpu::QKNormForward(a.data(), mean.data(), rstd.data(), raw.data(), wq.data(), bq.data(), wk.data(), bk.data(), s,
                     1e-6, 1.0);
  cpu::QKNormForward(b.data(), mean.data(), rstd.data(), raw.data(), wq1.data(), bq.data(), wk1.data(), bk.data(), s,
                     1e-6);
  EXPECT_EQ(a, b);
  std::vector<double> da(dy), db(dy), ga(4 * hd, 0.0), gb(4 * hd, 0.0);
  cpu::QKNormBackward(da.data(), ga.data(), ga.data() + hd, ga.data() + 2 * hd, ga.data() + 3 * hd, raw.data(),
                      wq.data(), wk.data(), mean.data(), rstd.data(), s, 1.0);
  cpu::QKNormBackward(db.data(), gb.data(), gb.data() + hd, gb.data() + 2 * hd, gb.data() + 3 * hd, raw.data(),
                      wq1.data(), wk1.data(), mean.data(), rstd.data(), s);
  EXPECT_EQ(da, db);
  EXPECT_EQ(ga, gb);
}

GPTConfig TinyConfig() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 64;
  c.seq_length = 7;
  c.max_position_embeddings = 7;
  c.vocab_size = 100;
  c.padded_vocab_size = 100;
  return c;
}

// Every weight matrix U(-a, a) with torch's a for its whole shape, for any tensor size (the same bits);
// biases 0 and norm weights 1 as before.
TEST(MlpFlagsOps, XavierUniformInitHasTorchsBoundForEveryWeightMatrix) {
  Golden g("mlp_flags_ops");
  const std::vector<float> table = g.Tensor<float>("xavier");  // rows of (rows, cols, bound, max |draw|)
  GPTConfig c = TinyConfig();
  c.init_method_xavier_uniform = true;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> w(static_cast<size_t>(layout->num_params));
  layout->InitWeights(1234, w);
  int matrices = 0;
  for (const ParamInfo& p : layout->infos) {
    const float* v = w.data() + p.offset;
    if (p.shape.size() != 2) {
      const float want = p.name.find("layernorm.weight") != std::string::npos ? 1.0f : 0.0f;
      for (int64_t i = 0; i < p.size; ++i) ASSERT_EQ(v[i], want) << p.name;
      continue;
    }
    ++matrices;
    double bound = -1;
    for (size_t r = 0; r + 3 < table.size(); r += 4)
      if (table[r] == p.shape[0] && table[r + 1] == p.shape[1]) bound = table[r + 2];
    ASSERT_GT(bound, 0) << p.name << ": no golden shape";
    EXPECT_NEAR(p.init_uniform, bound, 1e-7) << p.name;
    double sum_sq = 0, worst = 0;
    for (int64_t i = 0; i < p.size; ++i) {
      worst = std::max(worst, std::fabs(double{v[i]}));
      sum_sq += double{v[i]} * v[i];
    }
    EXPECT_LE(worst, bound) << p.name;
    EXPECT_GT(worst, 0.8 * bound) << p.name;  // uniform, not a normal of std 0.02
    EXPECT_NEAR(sum_sq / static_cast<double>(p.size), bound * bound / 3, 0.25 * bound * bound / 3) << p.name;
  }
  EXPECT_EQ(matrices, 2 + 4 * 2);  // wte, wpe; QKV, proj, fc1, fc2 per layer (the output layer tied)
  // Tensor rank 1 of 2 holds the whole model's elements (its bounds are the whole tensors').
  auto half = ParamLayout::Create(c, 2, 1);
  ASSERT_TRUE(half.ok()) << half.status();
  std::vector<float> shard(static_cast<size_t>(half->num_params)), expect(shard.size());
  half->InitWeights(1234, shard);
  CopyToShard(*half, w, expect);
  EXPECT_EQ(shard, expect);
}

TEST(MlpFlagsOps, LayerNorm1pInitialisesEveryNormWeightToZero) {
  GPTConfig c = TinyConfig();
  c.apply_layernorm_1p = true;
  c.qk_layernorm = true;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> w(static_cast<size_t>(layout->num_params), -1.0f);
  layout->InitWeights(7, w);
  int norms = 0;
  for (const ParamInfo& p : layout->infos) {
    if (p.name.find("layernorm.weight") == std::string::npos) continue;
    ++norms;
    EXPECT_TRUE(p.no_weight_decay) << p.name;  // 1-D: no weight decay, as Megatron's param groups
    for (int64_t i = 0; i < p.size; ++i) ASSERT_EQ(w[p.offset + i], 0.0f) << p.name;
  }
  EXPECT_EQ(norms, 2 * 4 + 1);  // input, q, k, pre-MLP per layer; the final one
}

TEST(MlpFlagsOps, SquaredReluWithSwigluIsRefused) {
  GPTConfig c = TinyConfig();
  c.squared_relu = true;
  EXPECT_TRUE(c.Validate().ok());
  c.swiglu = true;
  const absl::Status st = c.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("squared_relu with swiglu"), std::string::npos) << st;
}

}  // namespace
}  // namespace ptk
