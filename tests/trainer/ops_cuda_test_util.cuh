// What ops_cuda_test's files share: device arrays, conversions to and from T, random inputs, the
// comparisons (within a tolerance, bitwise), status assertions and the fixture holding a context.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/counter_rng.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/ops_cuda.h"
namespace ptk::cuda::ops_test {

// ---- device memory and conversions --------------------------------------------------------------

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T) + 64) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc failed");
    }
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return p_; }
  void Upload(const std::vector<T>& host, size_t offset = 0) {
    if (cudaMemcpy(p_ + offset, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy to the device failed");
    }
  }
  std::vector<T> Download(size_t count, size_t offset = 0) const {
    std::vector<T> host(count);
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(host.data(), p_ + offset, count * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error(std::string("a kernel or the copy back failed: ") +
                               cudaGetErrorString(cudaGetLastError()));
    }
    return host;
  }
  std::vector<T> Download() const { return Download(n_); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
std::vector<T> ToT(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FromFloat<T>(x[i]);
  return out;
}
template <typename T>
std::vector<float> ToF(const std::vector<T>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = ToFloat(x[i]);
  return out;
}
// x rounded to T and back: the values a T-typed kernel reads.
template <typename T>
std::vector<float> RoundTrip(const std::vector<float>& x) {
  return ToF(ToT<T>(x));
}

inline std::vector<float> Normal(size_t n, uint32_t seed, float mean = 0.0f, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// ---- comparisons ---------------------------------------------------------------------------------

template <typename T>
struct Prec;
template <>
struct Prec<float> {
  static constexpr double ulp = 0.0;  // no rounding of the output
  static constexpr double floor = 0.0;
};
template <>
struct Prec<__nv_bfloat16> {
  static constexpr double ulp = 1.0 / 128;  // 2^-7: one unit in the last place, relative
  static constexpr double floor = 0.0;      // bf16 has fp32's exponent range
};
template <>
struct Prec<__half> {
  static constexpr double ulp = 1.0 / 1024;  // 2^-10
  static constexpr double floor = 6e-8;      // fp16's subnormal spacing
};

// Every got[i] within rel * |want| + abs (+ one ulp of T when `rounded` to T) of want[i].
template <typename T = float>
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                 const std::string& what, bool rounded = false) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double ulp = rounded ? Prec<T>::ulp : 0.0, floor = rounded ? Prec<T>::floor : 0.0;
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const double err = std::fabs(g - w), tol = (rel + ulp) * std::fabs(w) + abs + floor;
    const bool ok = err <= tol || (std::isnan(g) && std::isnan(w));
    if (!ok) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
    if (std::isfinite(err)) worst = std::max(worst, err / (tol > 0 ? tol : 1e-300));
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside the tolerance; first at " << first
                    << " (got " << (first >= 0 ? got[first] : 0.0f) << ", want " << (first >= 0 ? want[first] : 0.0f)
                    << "); worst error / tolerance " << worst;
}

template <typename V>
void ExpectBitwise(const std::vector<V>& got, const std::vector<V>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(V)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " differ in their bits; first at " << first;
}

#define EXPECT_OK(expr)                                     \
  do {                                                      \
    const ::absl::Status ptk_test_status_ = (expr);         \
    EXPECT_TRUE(ptk_test_status_.ok()) << ptk_test_status_; \
  } while (0)
#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::absl::Status ptk_test_status_ = (expr);         \
    ASSERT_TRUE(ptk_test_status_.ok()) << ptk_test_status_; \
  } while (0)

// ---- fixtures ------------------------------------------------------------------------------------

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaGetDevice(&ctx_.device), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&ctx_.stream), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&ctx_.num_sms, cudaDevAttrMultiProcessorCount, ctx_.device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&ctx_.sm_major, cudaDevAttrComputeCapabilityMajor, ctx_.device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&ctx_.sm_minor, cudaDevAttrComputeCapabilityMinor, ctx_.device), cudaSuccess);
  }
  void TearDown() override {
    EXPECT_EQ(cudaStreamSynchronize(ctx_.stream), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(ctx_.stream), cudaSuccess);
  }
  CudaContext ctx_;
};

struct TypeNames {
  template <typename T>
  static std::string GetName(int) {
    if (std::is_same_v<T, float>) return "fp32";
    if (std::is_same_v<T, __nv_bfloat16>) return "bf16";
    return "fp16";
  }
};
using ActivationTypes = ::testing::Types<float, __nv_bfloat16, __half>;

}  // namespace ptk::cuda::ops_test
