// The CPU ops' vector lanes (trainer/cpu/cpu_lanes.h): the tanh against the C library's in double,
// fp32 GELU (lanes, then a scalar tail) against the double formula, and AdamW and Scale against the
// scalar formula bit for bit, at sizes with tails, with
// each element's bits independent of whether a lane or the tail computed it.
#include "trainer/cpu/cpu_lanes.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk {
namespace {

using cpu::lanes::IntLanes;
using cpu::lanes::kLanes;
using cpu::lanes::Lanes;

// Units in the last place of float at `want` between got and want.
double Ulps(float got, double want) {
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), 1.1754943508222875e-38)) - 23);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

std::vector<float> SweepInputs() {
  std::vector<float> xs = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-7f, 0.625f,  -0.625f, 0.62499994f, 0.62500006f,
                           9.0f, -9.0f, 20.0f,  -20.0f,  50.0f, -100.0f, 1e30f,   -1e30f};
  for (double x = -12.0; x <= 12.0; x += 1.0 / 1024) xs.push_back(static_cast<float>(x));
  return xs;
}

TEST(CpuLanes, TanhWithinThreeUlpsOfTheExactValue) {
  double worst = 0;
  for (float x : SweepInputs()) {
    const double want = std::tanh(static_cast<double>(x));
    const float got = cpu::lanes::Tanh<float, int32_t>(x);
    worst = std::max(worst, Ulps(got, want));
    EXPECT_LE(Ulps(got, want), 3.0) << "x=" << x << " got " << got << " want " << want;
  }
  EXPECT_GT(worst, 0.0);  // the sweep does reach values that are not exact
  EXPECT_EQ((cpu::lanes::Tanh<float, int32_t>(100.0f)), 1.0f);
  EXPECT_EQ((cpu::lanes::Tanh<float, int32_t>(-100.0f)), -1.0f);
}

TEST(CpuLanes, TanhLanesGiveTheScalarsBits) {
  const std::vector<float> xs = SweepInputs();
  for (size_t i = 0; i + kLanes <= xs.size(); i += kLanes) {
    Lanes v;
    std::memcpy(&v, xs.data() + i, sizeof v);
    const Lanes t = cpu::lanes::Tanh<Lanes, IntLanes>(v);
    for (int k = 0; k < kLanes; ++k) {
      const float s = cpu::lanes::Tanh<float, int32_t>(xs[i + k]);
      EXPECT_EQ(std::memcmp(&s, &t[k], sizeof s), 0) << "x=" << xs[i + k];
    }
  }
}

// n = 1 (tail only), a lane's width and one off either side, and past one 4096-element block with a tail.
TEST(CpuLanes, Fp32GeluMatchesTheDoubleFormulaAtEverySize) {
  for (int64_t n : {1, 15, 16, 17, 33, 4095, 4096, 4113, 9000}) {
    const std::vector<double> xd = testing::Random(n, 40 + static_cast<uint64_t>(n), 6.0),
                              rd = testing::Random(n, 41, 1.0);
    std::vector<float> x(xd.begin(), xd.end()), r(rd.begin(), rd.end()), y(n), dx(n);
    cpu::GeluForward(y.data(), x.data(), n);
    cpu::GeluBackward(dx.data(), x.data(), r.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double xi = x[i];
      const double want_y = GeluValue(xi), want_dx = static_cast<double>(r[i]) * GeluDerivative(xi);
      EXPECT_NEAR(y[i], want_y, 4e-7 * std::fabs(xi) + 1e-30) << "n=" << n << " i=" << i << " x=" << xi;
      // Near |x| = 5 one ulp of tanh (about 1) moves 1 - tanh^2, and so the derivative, by ~1e-6: float's
      // own bound, which the C library's tanhf in the same formula meets too.
      const double dx_tol = std::fabs(r[i]) * (1e-6 + 2e-7 * xi * xi) + 1e-30;
      EXPECT_NEAR(dx[i], want_dx, dx_tol) << "n=" << n << " i=" << i << " x=" << xi;
      EXPECT_NEAR(r[i] * GeluDerivative(x[i]), want_dx, dx_tol) << "n=" << n << " i=" << i << " x=" << xi;
    }
  }
}

TEST(CpuLanes, Fp32GeluBitsDoNotDependOnTheElementsPosition) {
  const int64_t n = 4113;  // the second block: one lane's width, then a tail of one
  const std::vector<double> xd = testing::Random(n + 1, 42, 6.0);
  std::vector<float> x(xd.begin(), xd.end()), y(n), shifted(n), dx(n), dshifted(n), ones(n + 1, 1.0f);
  cpu::GeluForward(y.data(), x.data(), n);
  cpu::GeluForward(shifted.data(), x.data() + 1, n);
  cpu::GeluBackward(dx.data(), x.data(), ones.data(), n);
  cpu::GeluBackward(dshifted.data(), x.data() + 1, ones.data(), n);
  for (int64_t i = 1; i < n; ++i) {
    EXPECT_EQ(std::memcmp(&y[i], &shifted[i - 1], sizeof(float)), 0) << i;
    EXPECT_EQ(std::memcmp(&dx[i], &dshifted[i - 1], sizeof(float)), 0) << i;
  }
}

// AdamW and Scale in fp32 run whole lanes of 16, then a tail, in blocks of 16384: every element has the
// bits of the scalar formula (op_math.h's AdamWElement), at sizes with tails and across blocks.
TEST(CpuLanes, Fp32AdamWAndScaleGiveTheScalarFormulasBits) {
  AdamWParams a;
  a.lr = 3e-4;
  a.beta1 = 0.9;
  a.beta2 = 0.95;
  a.eps = 1e-8;
  a.weight_decay = 0.1;
  a.step = 7;
  const AdamWCoefficients<float> c =
      MakeAdamWCoefficients<float>(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step);
  for (int64_t n : {1, 15, 16, 17, 16384 + 33}) {
    auto make = [&](uint32_t seed, double scale, bool positive) {
      const std::vector<double> d = testing::Random(n, seed, scale);
      std::vector<float> f(d.begin(), d.end());
      if (positive)
        for (float& x : f) x = std::fabs(x);
      return f;
    };
    std::vector<float> p = make(50, 1.0, false), g = make(51, 1e-2, false), m = make(52, 1e-3, false),
                       v = make(53, 1e-5, true);
    std::vector<float> wp = p, wm = m, wv = v;
    for (int64_t i = 0; i < n; ++i) AdamWElement(wp[i], g[i], wm[i], wv[i], c);
    cpu::AdamW(p.data(), g.data(), m.data(), v.data(), n, a);
    EXPECT_EQ(std::memcmp(p.data(), wp.data(), n * sizeof(float)), 0) << "n=" << n;
    EXPECT_EQ(std::memcmp(m.data(), wm.data(), n * sizeof(float)), 0) << "n=" << n;
    EXPECT_EQ(std::memcmp(v.data(), wv.data(), n * sizeof(float)), 0) << "n=" << n;
    std::vector<float> ws = g;
    for (float& x : ws) x *= 0.37f;
    cpu::Scale(g.data(), n, 0.37f);
    EXPECT_EQ(std::memcmp(g.data(), ws.data(), n * sizeof(float)), 0) << "n=" << n;
  }
}

}  // namespace
}  // namespace ptk
