// Causal self-attention, multi-head or grouped-query (Megatron's core attention: scores scaled by 1/sqrt(head dim),
// causal softmax, attention dropout), forward and backward. Both products of each (batch, head) go through BLAS; the T
// x T probabilities are kept for backward unless the caller recomputes them. The (batch, head) pairs (backward: the
// (batch, query group) pairs, whose heads add to one key and value gradient) run on oneTBB's threads, each computed
// whole by one thread in the same order: the same bits for any thread count.
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <vector>

#include "trainer/cpu/causal_attention_rows.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

using causal::KeyColumn;
using causal::QueryColumn;

constexpr auto Diagonal = [](int64_t i) { return i; };  // row i of a whole sample is position i

}  // namespace

template <typename T>
void AttentionForward(T* out, T* probs, const T* qkv, const AttentionShape& s, double p, uint64_t seed,
                      const uint64_t* streams) {
  const int64_t t = s.t, hd = s.hd, c = s.nh * s.hd, c3 = s.qkv_width(), per_group = s.nh / s.groups();
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  // Each thread's copy of a head's probabilities for dropout.
  tbb::enumerable_thread_specific<std::vector<T>> dropped_of(p > 0.0 ? static_cast<size_t>(t * t) : 0);
  tbb::parallel_for(int64_t{0}, s.b * s.nh, [&](int64_t bh) {
    const int64_t b = bh / s.nh, h = bh % s.nh;
    // Isolated: while Gemm's own tiles run, this thread takes no other head, which would reuse its buffer.
    tbb::this_task_arena::isolate([&] {
      const T* q = qkv + b * t * c3 + QueryColumn(h, per_group, hd);
      const T* k = qkv + b * t * c3 + KeyColumn(h, per_group, hd);
      const T* v = k + hd;
      T* pr = probs + (b * s.nh + h) * t * t;
      Gemm<T>(false, true, t, t, hd, scale, q, c3, k, c3, T(0), pr, t);
      for (int64_t i = 0; i < t; ++i) causal::SoftmaxRow(pr + i * t, i, t);
      const T* pv = pr;
      if (p > 0.0) {
        std::vector<T>& dropped = dropped_of.local();
        std::copy(pr, pr + t * t, dropped.begin());
        causal::Dropout(dropped.data(), t, t, Diagonal, p, seed, streams[b] + static_cast<uint64_t>(h));
        pv = dropped.data();
      }
      Gemm<T>(false, false, t, hd, t, T(1), pv, t, v, c3, T(0), out + b * t * c + h * hd, c);
    });
  });
}

template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* probs, const AttentionShape& s, double p,
                       uint64_t seed, const uint64_t* streams) {
  const int64_t t = s.t, hd = s.hd, c = s.nh * s.hd, c3 = s.qkv_width(), per_group = s.nh / s.groups();
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  // Each thread's work buffers: the dropped probabilities (t, t), then their gradient (t, t).
  tbb::enumerable_thread_specific<std::vector<T>> scratch_of(static_cast<size_t>(2 * t * t));
  // A group's heads in order on one thread: the first assigns its key and value gradients, the others add.
  tbb::parallel_for(int64_t{0}, s.b * s.groups(), [&](int64_t bg) {
    const int64_t b = bg / s.groups();
    T* pd = scratch_of.local().data();  // dropped probabilities (t, t)
    T* dp = pd + t * t;                 // gradient of the probabilities (t, t)
    // Isolated: while Gemm's own tiles run, this thread takes no other group, which would reuse its buffers.
    tbb::this_task_arena::isolate([&] {
      for (int64_t h = bg % s.groups() * per_group; h < (bg % s.groups() + 1) * per_group; ++h) {
        const uint64_t stream = p > 0.0 ? streams[b] + static_cast<uint64_t>(h) : 0;
        const T* q = qkv + b * t * c3 + QueryColumn(h, per_group, hd);
        const T* k = qkv + b * t * c3 + KeyColumn(h, per_group, hd);
        const T* v = k + hd;
        T* dq = dqkv + b * t * c3 + QueryColumn(h, per_group, hd);
        T* dk = dqkv + b * t * c3 + KeyColumn(h, per_group, hd);
        T* dv = dk + hd;
        // The group's first query head assigns its key and value gradients, the others add to them.
        const T acc = h % per_group == 0 ? T(0) : T(1);
        const T* dy = dout + b * t * c + h * hd;
        const T* pr = probs + (b * s.nh + h) * t * t;
        const T* pv = pr;
        if (p > 0.0) {
          std::copy(pr, pr + t * t, pd);
          causal::Dropout(pd, t, t, Diagonal, p, seed, stream);
          pv = pd;
        }
        Gemm<T>(true, false, t, hd, t, T(1), pv, t, dy, c, acc, dv, c3);  // dV = P'^T dY
        Gemm<T>(false, true, t, t, hd, T(1), dy, c, v, c3, T(0), dp, t);  // dP' = dY V^T
        causal::Dropout(dp, t, t, Diagonal, p, seed, stream);             // dP = dropout(dP')
        for (int64_t i = 0; i < t; ++i) causal::SoftmaxBackwardRow(pr + i * t, dp + i * t, i, t, scale);
        Gemm<T>(false, false, t, hd, t, T(1), dp, t, k, c3, T(0), dq, c3);  // dQ = dS K
        Gemm<T>(true, false, t, hd, t, T(1), dp, t, q, c3, acc, dk, c3);    // dK = dS^T Q
      }
    });
  });
}

#define PTK_INSTANTIATE(T)                                                                                       \
  template void AttentionForward<T>(T*, T*, const T*, const AttentionShape&, double, uint64_t, const uint64_t*); \
  template void AttentionBackward<T>(T*, const T*, const T*, const T*, const AttentionShape&, double, uint64_t,  \
                                     const uint64_t*);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
