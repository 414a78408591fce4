// A stand-in for the NVIDIA driver library (libcuda.so.1) for gpu_skip_test.sh: it reports the CUDA
// version FAKE_CUDA_DRIVER_VERSION (default 13000) and answers every other driver call with
// FAKE_CUDA_RESULT (default 100, CUDA_ERROR_NO_DEVICE): a driver with no device, a driver older than
// the runtime, a broken one. The CUDA runtime asks it for every entry point through cuGetProcAddress.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

static int Env(const char* name, int fallback) {
  const char* v = getenv(name);
  return v ? atoi(v) : fallback;
}
static int Result(void) { return Env("FAKE_CUDA_RESULT", 100); }

int cuDriverGetVersion(int* version) {
  *version = Env("FAKE_CUDA_DRIVER_VERSION", 13000);
  return 0;
}
int cuInit(unsigned flags) {
  (void)flags;
  return Result();
}
int cuDeviceGetCount(int* count) {
  *count = 0;
  return Result();
}
int cuGetProcAddress_v2(const char* symbol, void** fn, int version, unsigned long long flags, int* status) {
  (void)version;
  (void)flags;
  *fn = dlsym(RTLD_DEFAULT, symbol);
  if (!*fn) *fn = (void*)Result;  // every other entry point fails with FAKE_CUDA_RESULT
  if (status) *status = 0;
  return 0;
}
int cuGetProcAddress(const char* symbol, void** fn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, fn, version, flags, 0);
}
