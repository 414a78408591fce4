// Counter-based dropout: the mask is a pure function of (seed, stream, index).
#include <tbb/parallel_for.h>

#include <algorithm>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kBlock = 4096;
}  // namespace

template <typename T>
void Dropout(T* inout, int64_t n, double p, uint64_t seed, uint64_t stream) {
  if (p <= 0.0) return;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const uint64_t key = DropoutKey(seed, stream);
  T scale = static_cast<T>(1.0 / (1.0 - p));
  tbb::parallel_for(int64_t{0}, (n + kBlock - 1) / kBlock, [&](int64_t blk) {
    int64_t end = std::min(n, (blk + 1) * kBlock);
    for (int64_t i = blk * kBlock; i < end; ++i)
      inout[i] = DropoutKeepKeyed(key, static_cast<uint64_t>(i), threshold) ? inout[i] * scale : T(0);
  });
}

template void Dropout<float>(float*, int64_t, double, uint64_t, uint64_t);
template void Dropout<double>(double*, int64_t, double, uint64_t, uint64_t);

}  // namespace ptk::cpu
