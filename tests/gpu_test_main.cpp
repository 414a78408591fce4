// main() of every gpu-labelled test. It exits 77 (CTest: skipped) only on a machine without a GPU:
// no NVIDIA driver installed (the runtime finds no libcuda, or only the toolkit's stub of it) or a
// driver that reports no device. On a machine whose driver is there, any other CUDA error is a failure
// (exit 1) naming the call and the error: a driver older than the runtime, a broken installation, a
// device the driver cannot initialise. A skip there would read as a pass.
#include <cuda_runtime.h>

#include <cstdio>

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err == cudaSuccess && devices > 0) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
  }
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);  // 0: no driver installed
  (void)cudaRuntimeGetVersion(&runtime);
  if (err == cudaSuccess || err == cudaErrorNoDevice) {
    std::printf("SKIP: the NVIDIA driver (CUDA %d.%d) reports no device (%s)\n", driver / 1000, driver % 1000 / 10,
                err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
    return 77;
  }
  if ((err == cudaErrorInsufficientDriver && driver == 0) || err == cudaErrorStubLibrary) {
    std::printf("SKIP: no NVIDIA driver installed (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(err),
                cudaGetErrorString(err));
    return 77;
  }
  std::fprintf(stderr,
               "FAIL: cudaGetDeviceCount: %s: %s (driver supports CUDA %d.%d, this runtime is CUDA %d.%d); an "
               "NVIDIA driver is installed, so this is not a machine without a GPU\n",
               cudaGetErrorName(err), cudaGetErrorString(err), driver / 1000, driver % 1000 / 10, runtime / 1000,
               runtime % 1000 / 10);
  return 1;
}
