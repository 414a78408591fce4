// Rotary position embedding of the fused QKV's query and key heads, forward and backward.
#include <tbb/parallel_for.h>

#include <cmath>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk::cpu {

void RopeTables(float* cos, float* sin, int64_t t, int64_t rd, const RopeSettings& r) {
  RopeAngleTables(cos, sin, t, rd, r);
}

namespace {
// sign +1: the rotation (forward); -1: its transpose (backward). Pair i is channels (i, i + rd/2), or
// (2i, 2i + 1) interleaved.
template <typename T>
void Rotate(T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd, bool interleaved, T sign) {
  const int64_t half = rd / 2, step = interleaved ? 1 : half, stride = interleaved ? 2 : 1, hd = s.hd,
                groups = s.groups(), per_group = s.nh / groups, width = s.qkv_width();
  tbb::parallel_for(int64_t{0}, s.b * s.t, [&](int64_t row) {
    const int64_t pos = row % s.t;
    const float* cs = cos + pos * half;
    const float* sn = sin + pos * half;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t h = 0; h <= per_group; ++h) {  // the group's query heads, then its key head
        T* x = qkv + row * width + (g * (per_group + 2) + h) * hd;
        for (int64_t i = 0; i < half; ++i) {
          T* a = x + i * stride;
          const T x1 = a[0], x2 = a[step], c = static_cast<T>(cs[i]), sv = sign * static_cast<T>(sn[i]);
          a[0] = x1 * c - x2 * sv;
          a[step] = x2 * c + x1 * sv;
        }
      }
  });
}
}  // namespace

template <typename T>
void RopeForward(T* qkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd, bool interleaved) {
  Rotate(qkv, cos, sin, s, rd, interleaved, T(1));
}
template <typename T>
void RopeBackward(T* dqkv, const float* cos, const float* sin, const AttentionShape& s, int64_t rd, bool interleaved) {
  Rotate(dqkv, cos, sin, s, rd, interleaved, T(-1));
}

#define PTK_INSTANTIATE(T)                                                                            \
  template void RopeForward<T>(T*, const float*, const float*, const AttentionShape&, int64_t, bool); \
  template void RopeBackward<T>(T*, const float*, const float*, const AttentionShape&, int64_t, bool);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
