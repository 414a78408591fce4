// The online softmax sum that softmax_xent_cuda.cu's kernel runs (trainer/cuda/softmax_math.h),
// on the CPU: host code, so it is checked wherever ptk builds, with or without CUDA.
#include "trainer/cuda/softmax_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace ptk::cuda {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The sum of exp(v - max) over all the values, in double: what the online sum must give.
double TwoPassSum(const std::vector<float>& v, float* max) {
  float m = -kInf;
  for (float x : v) m = std::fmax(m, x);
  double s = 0;
  for (float x : v) s += x == -kInf ? 0.0 : std::exp(static_cast<double>(x) - m);
  *max = m;
  return s;
}

// Feeds v in packs of N (v.size() a multiple of N) from the kernel's start: m = -inf, s = 0.
template <int N>
void Online(const std::vector<float>& v, float* m, double* s) {
  *m = -kInf;
  *s = 0.0;
  for (size_t i = 0; i < v.size(); i += N) {
    float pack[N];
    for (int k = 0; k < N; ++k) pack[k] = v[i + static_cast<size_t>(k)];
    SoftmaxOnlineAdd<N>(*m, *s, pack);
  }
}

// Online<N> over v against the two-pass sum: the same max, a finite sum within 1e-6 of it.
template <int N>
void ExpectTheTwoPassSum(const std::vector<float>& v) {
  float want_m = 0;
  const double want = TwoPassSum(v, &want_m);
  float m = 0;
  double s = 0;
  Online<N>(v, &m, &s);
  EXPECT_EQ(m, want_m);
  EXPECT_TRUE(std::isfinite(s)) << s;
  EXPECT_NEAR(s, want, 1e-6 * want);
}

// The regression: a thread whose first pack is all -inf (its max still -inf there) and whose later
// packs are finite. expf(-inf - -inf) is NaN; added to the sum, it outlived the rescaling when the
// finite pack came, and the row's loss was NaN where the CPU op's is finite.
TEST(CudaSoftmaxMath, MinusInfLogitsBeforeAnyFiniteOneAddNothing) {
  for (const std::vector<float>& v :
       {std::vector<float>{-kInf, -kInf, -kInf, -kInf, 0.5f, 1.0f, -2.0f, 3.0f},
        std::vector<float>{-kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, 1.0f, -kInf, 2.0f, 0.0f}}) {
    ExpectTheTwoPassSum<4>(v);
    ExpectTheTwoPassSum<1>(v);  // the scalar kernel: one logit per pack
  }
}

// Only -inf: no mass (the block's combine then treats the thread as empty).
TEST(CudaSoftmaxMath, AllMinusInfIsAnEmptySum) {
  const std::vector<float> v(8, -kInf);
  float m = 0;
  double s = 1;
  Online<4>(v, &m, &s);
  EXPECT_EQ(m, -kInf);
  EXPECT_EQ(s, 0.0);
}

// A NaN logit still poisons the sum, before or after the max is finite, and a +inf one too (as the
// CPU op: exp(inf - inf)).
TEST(CudaSoftmaxMath, NanAndPlusInfStillGiveNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<float>& v : {std::vector<float>{-kInf, nan, -kInf, -kInf, 1.0f, 2.0f, 3.0f, 4.0f},
                                      std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f, nan, 0.0f, 0.0f, 0.0f},
                                      std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f, kInf, 0.0f, 0.0f, 0.0f}}) {
    float m = 0;
    double s = 0;
    Online<4>(v, &m, &s);
    EXPECT_TRUE(std::isnan(s)) << s;
  }
}

// Random rows whose max grows along the packs (rescalings) and falls: the online sum within 1e-6 of
// the two-pass sum.
TEST(CudaSoftmaxMath, OnlineSumIsTheTwoPassSum) {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int row = 0; row < 20; ++row) {
    std::vector<float> v(64);
    for (size_t i = 0; i < v.size(); ++i) v[i] = normal(gen) + (row % 2 == 0 ? 0.5f * static_cast<float>(i) : 0.0f);
    SCOPED_TRACE(row);
    ExpectTheTwoPassSum<8>(v);
  }
}

}  // namespace
}  // namespace ptk::cuda
