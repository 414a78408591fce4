// Counter-based dropout: the mask is a pure function of (seed, stream, index).
#include <tbb/parallel_for.h>

#include <cmath>

#include "trainer/ops_cpu.h"

namespace ptk::trainer {
namespace {
constexpr int64_t kBlock = 4096;

inline uint64_t Mix64(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

uint32_t DropoutKeepThreshold(double p) {
  double keep = 1.0 - p;
  if (keep >= 1.0) return 0xffffffffu;
  return static_cast<uint32_t>(std::ldexp(keep, 32));
}

bool DropoutKeep(uint64_t seed, uint64_t stream, uint64_t i, uint32_t threshold) {
  uint64_t key = Mix64(seed * 0x9e3779b97f4a7c15ULL + Mix64(stream + 0x632be59bd9b4e019ULL));
  return static_cast<uint32_t>(Mix64(key + i * 0x9e3779b97f4a7c15ULL) >> 32) < threshold;
}

uint64_t DropoutStream(uint64_t sample, uint64_t layer, uint64_t site) {
  return Mix64(Mix64(sample + 0x2545f4914f6cdd1dULL) ^ (layer << 32) ^ (site << 16));
}

template <typename T>
void DropoutCpu(T* inout, int64_t n, double p, uint64_t seed, uint64_t stream) {
  if (p <= 0.0) return;
  uint32_t threshold = DropoutKeepThreshold(p);
  T scale = static_cast<T>(1.0 / (1.0 - p));
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i)
      inout[i] = DropoutKeep(seed, stream, static_cast<uint64_t>(i), threshold) ? inout[i] * scale : T(0);
  });
}

template void DropoutCpu<float>(float*, int64_t, double, uint64_t, uint64_t);
template void DropoutCpu<double>(double*, int64_t, double, uint64_t, uint64_t);

}  // namespace ptk::trainer
