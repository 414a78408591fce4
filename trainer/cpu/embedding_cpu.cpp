// Token + learned absolute position embeddings (or token embeddings alone), forward and backward.
#include <tbb/parallel_for.h>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
constexpr int64_t kChannelBlock = 64;
}

template <typename T>
void EmbeddingForward(T* out, const int32_t* tokens, const int32_t* positions, const T* wte, const T* wpe, int64_t n,
                      int64_t c) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* a = wte + static_cast<int64_t>(tokens[i]) * c;
    T* y = out + i * c;
    if (!wpe) {
      for (int64_t j = 0; j < c; ++j) y[j] = a[j];
      return;
    }
    const T* p = wpe + static_cast<int64_t>(positions[i]) * c;
    for (int64_t j = 0; j < c; ++j) y[j] = a[j] + p[j];
  });
}

template <typename T>
void EmbeddingBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, const int32_t* positions, int64_t n,
                       int64_t c) {
  // Each task owns a block of channels and walks the rows in order: scatter-adds without atomics,
  // in the same order for any thread count.
  int64_t blocks = (c + kChannelBlock - 1) / kChannelBlock;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    int64_t j0 = blk * kChannelBlock, j1 = std::min(c, j0 + kChannelBlock);
    for (int64_t i = 0; i < n; ++i) {
      const T* dy = dout + i * c;
      T* a = dwte + static_cast<int64_t>(tokens[i]) * c;
      for (int64_t j = j0; j < j1; ++j) a[j] += dy[j];
      if (!dwpe) continue;
      T* p = dwpe + static_cast<int64_t>(positions[i]) * c;
      for (int64_t j = j0; j < j1; ++j) p[j] += dy[j];
    }
  });
}

#define PTK_INSTANTIATE(T)                                                                                     \
  template void EmbeddingForward<T>(T*, const int32_t*, const int32_t*, const T*, const T*, int64_t, int64_t); \
  template void EmbeddingBackward<T>(T*, T*, const T*, const int32_t*, const int32_t*, int64_t, int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
