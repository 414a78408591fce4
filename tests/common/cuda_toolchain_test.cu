// The CUDA toolchain end to end: a kernel compiled for the configured architectures runs and its
// result is checked on the host. Skipped (exit 77) without a device; built wherever nvcc is.
#include <cuda_runtime.h>

#include <vector>

#include <gtest/gtest.h>

namespace {

__global__ void axpy_kernel(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

TEST(CudaToolchain, KernelRunsAndComputes) {
  const int n = 1 << 20;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 97);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  axpy_kernel<<<(n + 255) / 256, 256>>>(n, 2.0f, dx, dy);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < n; i += 4099) EXPECT_EQ(y[i], 2.0f * static_cast<float>(i % 97) + 1.0f) << i;
  cudaFree(dx);
  cudaFree(dy);
}

}  // namespace
