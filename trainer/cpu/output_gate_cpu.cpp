// Megatron's --attention-output-gate (Qwen3-Next's gated attention): the QKV projection's rows of each query group
// are its query heads, their gate heads, the key and the value head (SelfAttention.get_query_key_value_tensors with
// output_gate); the core attention's output times sigmoid(gate) goes to linear_proj (Attention._apply_output_gate).
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {
// Per query group: q its per x hd query channels (as the gate's), f the fused row's group width, w the QKV row's.
struct GroupWidths {
  int64_t q, f, w;
};
GroupWidths WidthsOf(const AttentionShape& s) {
  const int64_t q = s.nh / s.groups() * s.hd;
  return {q, 2 * q + 2 * s.hd, q + 2 * s.hd};
}
template <typename T>
T Sigmoid(T x) {
  return static_cast<T>(1) / (static_cast<T>(1) + std::exp(-x));
}
}  // namespace

template <typename T>
void SplitGatedQkv(T* qkv, T* gate, const T* fused, const AttentionShape& s) {
  const GroupWidths g = WidthsOf(s);
  const int64_t groups = s.groups();
  tbb::parallel_for(int64_t{0}, s.b * s.t, [&](int64_t i) {
    for (int64_t k = 0; k < groups; ++k) {
      const T* f = fused + (i * groups + k) * g.f;
      T* q = qkv + (i * groups + k) * g.w;
      std::copy(f, f + g.q, q);                                        // the query heads
      std::copy(f + g.q, f + 2 * g.q, gate + (i * groups + k) * g.q);  // their gate heads
      std::copy(f + 2 * g.q, f + g.f, q + g.q);                        // the key and the value head
    }
  });
}

template <typename T>
void MergeGatedQkv(T* fused, const T* qkv, const T* gate, const AttentionShape& s) {
  const GroupWidths g = WidthsOf(s);
  const int64_t groups = s.groups();
  tbb::parallel_for(int64_t{0}, s.b * s.t, [&](int64_t i) {
    for (int64_t k = 0; k < groups; ++k) {
      T* f = fused + (i * groups + k) * g.f;
      const T* q = qkv + (i * groups + k) * g.w;
      const T* gt = gate + (i * groups + k) * g.q;
      std::copy(q, q + g.q, f);
      std::copy(gt, gt + g.q, f + g.q);
      std::copy(q + g.q, q + g.w, f + 2 * g.q);
    }
  });
}

template <typename T>
void OutputGateForward(T* out, const T* attn, const T* gate, int64_t n) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) { out[i] = attn[i] * Sigmoid(gate[i]); });
}

template <typename T>
void OutputGateBackward(T* dattn, T* dgate, const T* attn, const T* gate, int64_t n) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T sg = Sigmoid(gate[i]), dy = dattn[i];
    dgate[i] = dy * attn[i] * sg * (static_cast<T>(1) - sg);
    dattn[i] = dy * sg;
  });
}

#define PTK_INSTANTIATE(T)                                                       \
  template void SplitGatedQkv<T>(T*, T*, const T*, const AttentionShape&);       \
  template void MergeGatedQkv<T>(T*, const T*, const T*, const AttentionShape&); \
  template void OutputGateForward<T>(T*, const T*, const T*, int64_t);           \
  template void OutputGateBackward<T>(T*, T*, const T*, const T*, int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
