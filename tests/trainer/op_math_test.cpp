// The per-element math both backends run (trainer/op_math.h, trainer/counter_rng.h), checked on the
// CPU against independent references: GELU against its formula in long double and a finite
// difference, the AdamW element against torch.optim.AdamW's update written out in long double, the
// dropout hash's keep rate and the independence of its streams, cpu::Dropout against DropoutKeep
// applied element by element, and the per-token indexing of the masks that the fused LayerNorm
// kernels use (TokenDropoutAt) against cpu::Dropout over each sample. The CUDA kernels call these
// very functions, so what is checked here holds for them too (bf16/fp16 rounding is checked on the
// GPU, ops_cuda_test).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/counter_rng.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk {
namespace {

// gelu(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), Megatron's / torch's tanh approximation.
long double GeluReference(long double x) {
  const long double pi = 3.141592653589793238462643383279502884L;
  return 0.5L * x * (1.0L + std::tanh(std::sqrt(2.0L / pi) * (x + 0.044715L * x * x * x)));
}

std::vector<double> Grid() {
  std::vector<double> xs;
  for (int i = -1000; i <= 1000; ++i) xs.push_back(i * 0.008);  // [-8, 8]
  for (double x : {-30.0, -12.5, -1e-3, -1e-7, 0.0, 1e-7, 1e-3, 12.5, 30.0}) xs.push_back(x);
  return xs;
}

TEST(OpMath, GeluValueMatchesTheFormula) {
  double worst_double = 0, worst_float = 0;
  for (double x : Grid()) {
    const long double ref = GeluReference(x);
    const long double scale = std::max(1.0L, std::fabs(static_cast<long double>(x)));
    worst_double = std::max(worst_double, static_cast<double>(std::fabs(GeluValue(x) - ref) / scale));
    const float xf = static_cast<float>(x);
    const long double ref_f = GeluReference(xf);
    worst_float = std::max(worst_float, static_cast<double>(std::fabs(GeluValue(xf) - ref_f) / scale));
  }
  EXPECT_LE(worst_double, 1e-15);
  EXPECT_LE(worst_float, 1e-6);
  EXPECT_NEAR(GeluValue(1.0), 0.8411919906082768, 1e-15);  // torch.nn.functional.gelu(1.0, approximate="tanh")
}

TEST(OpMath, GeluDerivativeMatchesAFiniteDifference) {
  const long double h = 1e-6L;
  double worst_double = 0, worst_float = 0;
  for (double x : Grid()) {
    // Central difference of the long double formula: truncation ~h^2, rounding ~1e-19 / h.
    const long double fd = (GeluReference(x + h) - GeluReference(x - h)) / (2 * h);
    worst_double = std::max(worst_double, static_cast<double>(std::fabs(GeluDerivative(x) - fd)));
    const float xf = static_cast<float>(x);
    const long double fd_f = (GeluReference(xf + h) - GeluReference(xf - h)) / (2 * h);
    worst_float = std::max(worst_float, static_cast<double>(std::fabs(GeluDerivative(xf) - fd_f)));
  }
  EXPECT_LE(worst_double, 1e-9);
  EXPECT_LE(worst_float, 2e-6);
  // The derivative is not the value: gelu'(0) = 1/2, gelu'(large) -> 1, gelu'(-large) -> 0.
  EXPECT_DOUBLE_EQ(GeluDerivative(0.0), 0.5);
  EXPECT_NEAR(GeluDerivative(10.0), 1.0, 1e-12);
  EXPECT_NEAR(GeluDerivative(-10.0), 0.0, 1e-12);
}

// torch.optim.AdamW's single-tensor update, in long double:
//   param.mul_(1 - lr * wd); exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
//   step_size = lr / (1 - beta1^step); denom = exp_avg_sq.sqrt() / sqrt(1 - beta2^step) + eps
//   param.addcdiv_(exp_avg, denom, value=-step_size)
struct TorchAdamW {
  long double p, m = 0, v = 0;
  void Step(long double g, const AdamWParams& a) {
    p *= 1.0L - a.lr * a.weight_decay;
    m += (g - m) * (1.0L - a.beta1);
    v = v * a.beta2 + (1.0L - a.beta2) * g * g;
    const long double bc1 = 1.0L - std::pow(static_cast<long double>(a.beta1), static_cast<long double>(a.step));
    const long double bc2 = 1.0L - std::pow(static_cast<long double>(a.beta2), static_cast<long double>(a.step));
    const long double denom = std::sqrt(v) / std::sqrt(bc2) + a.eps;
    p -= (a.lr / bc1) * m / denom;
  }
};

// Runs `steps` AdamW steps of AdamWElement<T> from p0 with the gradients gs and returns the largest
// error of p, m, v against TorchAdamW, relative to the size of the total update of p (for p) and to
// the moment's own size (m, v).
template <typename T>
double AdamWError(double p0, const std::vector<double>& gs, double lr, double eps, double wd) {
  TorchAdamW ref{p0};
  T p = static_cast<T>(p0), m = 0, v = 0;
  double worst = 0;
  for (size_t s = 0; s < gs.size(); ++s) {
    AdamWParams a{lr * (1.0 - 0.1 * static_cast<double>(s)), 0.9, 0.95, eps, wd, static_cast<int64_t>(s + 1)};
    const T g = static_cast<T>(gs[s]);
    ref.Step(static_cast<long double>(g), a);
    AdamWElement(p, g, m, v, MakeAdamWCoefficients<T>(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step));
    const long double moved = std::fabs(ref.p - static_cast<long double>(p0)) + 1e-30L;
    worst = std::max(worst, static_cast<double>(std::fabs(p - ref.p) / moved));
    worst = std::max(worst, static_cast<double>(std::fabs(m - ref.m) / (std::fabs(ref.m) + 1e-30L)));
    worst = std::max(worst, static_cast<double>(std::fabs(v - ref.v) / (std::fabs(ref.v) + 1e-30L)));
  }
  return worst;
}

TEST(OpMath, AdamWElementIsTorchAdamW) {
  struct Case {
    double p0;
    std::vector<double> gs;
    double lr, eps, wd;
  };
  const std::vector<Case> cases = {
      {0.75, {0.3, -0.2, 0.05, 1.5, -0.7}, 1e-2, 1e-8, 0.1},
      {-1.25, {2e-3, 1e-3, -4e-3, 3e-3, 2e-3}, 3e-3, 1e-3, 0.0},  // eps of the gradients' size
      {0.02, {-5.0, 4.0, -3.0, 2.0, -1.0}, 6e-4, 1e-8, 0.01},
      {3.0, {0.0, 0.0, 1e-4, 0.0, -1e-4}, 1e-3, 1e-6, 0.5},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    // double: the same formula up to rounding; float: the trainer's arithmetic (coefficients rounded
    // to float), still well inside one part in 10^4 of the update.
    EXPECT_LE(AdamWError<double>(c.p0, c.gs, c.lr, c.eps, c.wd), 1e-9) << "case " << k;
    EXPECT_LE(AdamWError<float>(c.p0, c.gs, c.lr, c.eps, c.wd), 2e-3) << "case " << k;
  }
}

TEST(OpMath, AdamWFirstStepMovesByLrTimesTheGradientSign) {
  // Step 1 of Adam without decay: m/bc1 = g, sqrt(v/bc2) = |g|, so p moves by lr * g / (|g| + eps).
  double p = 1.0, m = 0, v = 0;
  AdamWElement(p, 0.5, m, v, MakeAdamWCoefficients<double>(0.01, 0.9, 0.999, 1e-8, 0.0, 1));
  EXPECT_NEAR(p, 1.0 - 0.01 * 0.5 / (0.5 + 1e-8), 1e-15);
  p = 1.0, m = 0, v = 0;
  AdamWElement(p, -0.5, m, v, MakeAdamWCoefficients<double>(0.01, 0.9, 0.999, 1e-8, 0.1, 1));
  EXPECT_NEAR(p, 1.0 * (1.0 - 0.01 * 0.1) + 0.01 * 0.5 / (0.5 + 1e-8), 1e-15);
}

TEST(OpMath, DropoutThresholdAndKeepRate) {
  EXPECT_EQ(DropoutKeepThreshold(0.0), 0xffffffffu);
  EXPECT_EQ(DropoutKeepThreshold(0.5), 0x80000000u);
  EXPECT_EQ(DropoutKeepThreshold(0.1), static_cast<uint32_t>(std::ldexp(0.9, 32)));
  EXPECT_EQ(DropoutKeepThreshold(1.0), 0u);
  const int64_t n = 1 << 20;
  for (double p : {0.1, 0.5}) {
    const uint32_t threshold = DropoutKeepThreshold(p);
    for (uint64_t stream : {uint64_t{0}, uint64_t{1}, DropoutStream(12345, 3, kMlpOutDropout)}) {
      int64_t kept = 0;
      for (int64_t i = 0; i < n; ++i) kept += DropoutKeep(42, stream, static_cast<uint64_t>(i), threshold);
      const double rate = static_cast<double>(kept) / static_cast<double>(n);
      const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(n));
      EXPECT_NEAR(rate, 1.0 - p, 5 * sigma) << "p " << p << " stream " << stream;
    }
  }
}

// Fraction of indices where two masks agree; independent masks of keep rate q agree with
// probability q^2 + (1-q)^2.
double Agreement(uint64_t seed_a, uint64_t stream_a, uint64_t seed_b, uint64_t stream_b, uint64_t shift,
                 uint32_t threshold, int64_t n) {
  int64_t same = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto u = static_cast<uint64_t>(i);
    same += DropoutKeep(seed_a, stream_a, u, threshold) == DropoutKeep(seed_b, stream_b, u + shift, threshold);
  }
  return static_cast<double>(same) / static_cast<double>(n);
}

TEST(OpMath, DropoutStreamsAreIndependent) {
  const int64_t n = 1 << 18;
  const double p = 0.5, q = 1 - p;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const double expected = q * q + (1 - q) * (1 - q);
  const double tol = 5 * std::sqrt(expected * (1 - expected) / static_cast<double>(n));
  const uint64_t s = DropoutStream(7, 2, kAttentionOutDropout);
  // Neighbouring streams, samples, layers, sites and seeds; the next index of the same stream.
  EXPECT_NEAR(Agreement(1, 0, 1, 1, 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 1, s + 1, 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 1, DropoutStream(8, 2, kAttentionOutDropout), 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 1, DropoutStream(7, 3, kAttentionOutDropout), 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 1, DropoutStream(7, 2, kMlpOutDropout), 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 2, s, 0, threshold, n), expected, tol);
  EXPECT_NEAR(Agreement(1, s, 1, s, 1, threshold, n), expected, tol);
  // Attention probabilities key stream + head: neighbouring heads are independent too.
  const uint64_t a = DropoutStream(7, 2, kAttentionProbs);
  EXPECT_NEAR(Agreement(1, a, 1, a + 1, 0, threshold, n), expected, tol);
  // The same key is the same mask.
  EXPECT_EQ(Agreement(1, s, 1, s, 0, threshold, n), 1.0);
  // The site, layer and sample all reach the stream.
  EXPECT_NE(DropoutStream(7, 2, 1), DropoutStream(7, 2, 2));
  EXPECT_NE(DropoutStream(7, 2, 1), DropoutStream(7, 3, 1));
  EXPECT_NE(DropoutStream(7, 2, 1), DropoutStream(8, 2, 1));
}

TEST(OpMath, DropoutCpuIsDropoutKeepElementByElement) {
  const int64_t n = 3 * 4096 + 77;  // several of the CPU op's blocks and a partial one
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(gen);
  for (double p : {0.1, 0.5}) {
    const uint64_t seed = 1234, stream = DropoutStream(99, 4, kEmbeddingDropout);
    std::vector<float> y = x;
    cpu::Dropout(y.data(), n, p, seed, stream);
    const uint32_t threshold = DropoutKeepThreshold(p);
    const uint64_t key = DropoutKey(seed, stream);
    const auto scale = static_cast<float>(1.0 / (1.0 - p));
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto u = static_cast<uint64_t>(i);
      EXPECT_EQ(DropoutKeepKeyed(key, u, threshold), DropoutKeep(seed, stream, u, threshold));
      const float want = DropoutKeep(seed, stream, u, threshold) ? x[i] * scale : 0.0f;
      mismatches += std::memcmp(&want, &y[i], sizeof(float)) != 0;
    }
    EXPECT_EQ(mismatches, 0) << "p " << p;
  }
  std::vector<float> y = x;
  cpu::Dropout(y.data(), n, 0.0, 1, 2);
  EXPECT_EQ(y, x);  // p = 0 keeps everything, unscaled
}

// The masks of the fused LayerNorm kernels, indexed per token row through TokenDropoutAt, are the
// masks of cpu::Dropout over each sample's row of seq_len * c (the CPU model's and DropoutRows'
// numbering): every element of a (samples * seq_len, c) activation, with seq_len > 1 and c not a
// power of two, so that a row taken as a sample, or a position not scaled by c, would differ.
TEST(OpMath, TokenDropoutAtIndexesTheSamplesMasks) {
  const int64_t samples = 3, seq_len = 5, c = 7, n = samples * seq_len;
  std::mt19937 gen(6);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * c));
  for (float& v : x) v = dist(gen);
  const double p = 0.5;
  const uint64_t seed = 4321;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const auto scale = static_cast<float>(1.0 / (1.0 - p));
  std::vector<uint64_t> streams(samples);  // a site's stream table: one stream per sample
  for (int64_t r = 0; r < samples; ++r) streams[r] = DropoutStream(static_cast<uint64_t>(50 + r), 1, kMlpOutDropout);
  std::vector<float> want = x;
  for (int64_t r = 0; r < samples; ++r) cpu::Dropout(want.data() + r * seq_len * c, seq_len * c, p, seed, streams[r]);
  int64_t mismatches = 0;
  for (int64_t row = 0; row < n; ++row) {
    const TokenDropoutIndex at = TokenDropoutAt(row, seq_len, c);
    EXPECT_EQ(at.sample, row / seq_len) << "row " << row;
    const uint64_t key = DropoutKey(seed, streams[static_cast<size_t>(at.sample)]);
    for (int64_t j = 0; j < c; ++j) {
      const size_t k = static_cast<size_t>(row * c + j);
      const float got = DropoutKeepKeyed(key, at.first + static_cast<uint64_t>(j), threshold) ? x[k] * scale : 0.0f;
      mismatches += std::memcmp(&got, &want[k], sizeof(float)) != 0;
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(TokenDropoutAt(0, 1, 9).first, 0u);  // one position per sample: every row a sample
  EXPECT_EQ(TokenDropoutAt(4, 1, 9).sample, 4);
  EXPECT_EQ(TokenDropoutAt(9, 5, 9).first, 4u * 9u);
}

}  // namespace
}  // namespace ptk
