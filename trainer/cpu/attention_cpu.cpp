// Causal self-attention, multi-head or grouped-query (Megatron's core attention: scores scaled by 1/sqrt(head dim),
// causal softmax, attention dropout), forward and backward. Both products of each (batch, head) go through BLAS; the T
// x T probabilities are kept for backward unless the caller recomputes them. The (batch, head) pairs (backward: the
// (batch, query group) pairs, whose heads add to one key and value gradient) run on oneTBB's threads, each computed
// whole by one thread in the same order: the same bits for any thread count.
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <limits>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

// Applies dropout to the causal part of a T x T matrix in place (same mask in forward/backward).
template <typename T>
void DropoutRows(T* m, int64_t t, double p, uint64_t seed, uint64_t stream) {
  if (p <= 0.0) return;
  uint32_t threshold = DropoutKeepThreshold(p);
  T scale = static_cast<T>(1.0 / (1.0 - p));
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      uint64_t idx = static_cast<uint64_t>(i * t + j);
      m[i * t + j] = DropoutKeep(seed, stream, idx, threshold) ? m[i * t + j] * scale : T(0);
    }
}

// Columns of head h's query and of its group's key in a token's QKV row (per group: its
// per_group query heads, the key, the value).
int64_t QueryColumn(int64_t h, int64_t per_group, int64_t hd) {
  return (h / per_group * (per_group + 2) + h % per_group) * hd;
}
int64_t KeyColumn(int64_t h, int64_t per_group, int64_t hd) {
  return (h / per_group * (per_group + 2) + per_group) * hd;
}

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
      for (int64_t i = 0; i < t; ++i) {
        T* row = pr + i * t;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j]);
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        T inv = static_cast<T>(1.0 / sum);
        for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
        for (int64_t j = i + 1; j < t; ++j) row[j] = T(0);
      }
      const T* pv = pr;
      if (p > 0.0) {
        std::vector<T>& dropped = dropped_of.local();
        std::copy(pr, pr + t * t, dropped.begin());
        DropoutRows(dropped.data(), t, p, seed, streams[b] + static_cast<uint64_t>(h));
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
          DropoutRows(pd, t, p, seed, stream);
          pv = pd;
        }
        Gemm<T>(true, false, t, hd, t, T(1), pv, t, dy, c, acc, dv, c3);  // dV = P'^T dY
        Gemm<T>(false, true, t, t, hd, T(1), dy, c, v, c3, T(0), dp, t);  // dP' = dY V^T
        DropoutRows(dp, t, p, seed, stream);                              // dP = dropout(dP')
        for (int64_t i = 0; i < t; ++i) {
          const T* prow = pr + i * t;
          T* drow = dp + i * t;
          double dot = 0;
          for (int64_t j = 0; j <= i; ++j) dot += static_cast<double>(prow[j]) * drow[j];
          T tdot = static_cast<T>(dot);
          for (int64_t j = 0; j <= i; ++j) drow[j] = prow[j] * (drow[j] - tdot) * scale;
          for (int64_t j = i + 1; j < t; ++j) drow[j] = T(0);
        }
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
