// main() of every gpu-labelled test: exit 77 (CTest: skipped) on a machine without a CUDA device.
#include <cuda_runtime.h>

#include <cstdio>

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
