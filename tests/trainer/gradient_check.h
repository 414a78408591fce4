// Test helper for the CPU ops' tests: seeded normal vectors, a dot product, and a backward pass
// checked against central finite differences in double precision.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace ptk::testing {

inline std::vector<double> Random(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = d(g);
  return v;
}

inline double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks d(objective)/dx[i] (objective: typically sum(f(x) * r)) against central differences for
// every element of x; `analytic` is the backward pass's gradient.
inline void CheckGradient(std::vector<double>& x, const std::vector<double>& analytic,
                          const std::function<double()>& objective, const std::string& what, double tol = 1e-6) {
  const double h = 1e-5;
  double max_err = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = objective();
    x[i] = keep - h;
    const double down = objective();
    x[i] = keep;
    const double numeric = (up - down) / (2 * h);
    max_err = std::max(max_err, std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(numeric)));
  }
  EXPECT_LE(max_err, tol) << what;
}

// An elementwise op's backward (backward(dx, x, dout, n)) against central differences of
// sum(forward(x) * r) at `x`, r seeded normal.
template <typename Forward, typename Backward>
void CheckElementwiseGradient(std::vector<double> x, uint32_t r_seed, Forward forward, Backward backward) {
  const int64_t n = static_cast<int64_t>(x.size());
  const std::vector<double> r = Random(x.size(), r_seed);
  std::vector<double> out(x.size()), dx(x.size());
  auto objective = [&] {
    forward(out.data(), x.data(), n);
    return Dot(out, r);
  };
  backward(dx.data(), x.data(), r.data(), n);
  CheckGradient(x, dx, objective, "dinp");
}

}  // namespace ptk::testing
