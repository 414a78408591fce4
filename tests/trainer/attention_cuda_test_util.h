// What the CUDA attention and product tests share: a device array that uploads a host vector and downloads it back
// (failures are test failures, not exceptions), the uniform random inputs and their conversions, a context as the CUDA
// model makes one (Gpu), and STATUS_OK (an absl::Status expression asserted ok, the expression and the status in the
// message).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "trainer/cuda/ops_cuda.h"

#define STATUS_OK(x)                            \
  do {                                          \
    absl::Status st_ = (x);                     \
    ASSERT_TRUE(st_.ok()) << #x << ": " << st_; \
  } while (0)

namespace ptk::cuda::cuda_test {

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { Upload(h); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Upload(const std::vector<T>& h) {
    EXPECT_EQ(h.size(), n_);
    EXPECT_EQ(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// n floats uniform in [lo, hi) from mt19937_64(seed).
inline std::vector<float> Random(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Host values rounded to T; T's values (or doubles') widened; absolute values.
template <typename T>
std::vector<T> ToT(const std::vector<float>& v) {
  std::vector<T> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = FromFloat<T>(v[i]);
  return o;
}
template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = static_cast<double>(ToFloat(v[i]));
  return o;
}
template <typename V>
std::vector<V> Abs(const std::vector<V>& v) {
  std::vector<V> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = std::fabs(v[i]);
  return o;
}
// A context as the CUDA model makes one: stream, cuBLAS (pedantic math), cuBLASLt, 64 MiB workspace.
class Gpu {
 public:
  explicit Gpu(bool deterministic = false) {
    ctx.deterministic = deterministic;
    EXPECT_EQ(cudaGetDevice(&ctx.device), cudaSuccess);
    cudaDeviceProp prop{};
    EXPECT_EQ(cudaGetDeviceProperties(&prop, ctx.device), cudaSuccess);
    ctx.sm_major = prop.major;
    ctx.sm_minor = prop.minor;
    ctx.num_sms = prop.multiProcessorCount;
    EXPECT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
    EXPECT_EQ(cublasCreate(&ctx.cublas), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(ctx.cublas, ctx.stream), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetMathMode(ctx.cublas, CUBLAS_PEDANTIC_MATH), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtCreate(&ctx.cublaslt), CUBLAS_STATUS_SUCCESS);
    ctx.workspace_bytes = size_t{64} << 20;
    EXPECT_EQ(cudaMalloc(&ctx.workspace, ctx.workspace_bytes), cudaSuccess);
  }
  ~Gpu() {
    cudaStreamSynchronize(ctx.stream);
    DestroyCudnnHandle(&ctx);
    cudaFree(ctx.workspace);
    cublasLtDestroy(ctx.cublaslt);
    cublasDestroy(ctx.cublas);
    cudaStreamDestroy(ctx.stream);
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  CudaContext ctx;
};

}  // namespace ptk::cuda::cuda_test
