// Causal attention of some query positions over whole samples, forward and backward: context
// parallelism's (a context rank's queries, the context group's keys and values all-gathered), and with
// every position a query, the whole samples' (attention_cpu.cpp). Row i of a sample is position
// qpos[i], attends to positions 0..qpos[i] (under Megatron's sliding window, AttentionShape::window, the
// window's keys before it only; with a softmax offset, AttentionShape::sink, the head's extra logit in its
// softmax, as megatron-core's SoftmaxOne), and its attention-dropout mask is that of row qpos[i] of
// one rank's (t x t) probabilities. Both products of each (batch, head) go through BLAS; the (batch,
// head) pairs (backward: the (batch, query group) pairs, whose heads add to one key and value
// gradient) run on oneTBB's threads, each computed whole by one thread in the same order: the same
// bits for any thread count. The scores' products leave out Gemm's tiles of keys after every row of
// the tile (MaskedKeys::kSkip): the other tiles are the same BLAS calls, so the same bits.
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

// Columns of head h's query and of its group's key in a token's QKV row (per group: its
// per_group query heads, the key, the value; the value vd wide).
int64_t QueryColumn(int64_t h, int64_t per_group, int64_t hd, int64_t vd) {
  return h / per_group * ((per_group + 1) * hd + vd) + h % per_group * hd;
}
int64_t KeyColumn(int64_t h, int64_t per_group, int64_t hd, int64_t vd) {
  return h / per_group * ((per_group + 1) * hd + vd) + per_group * hd;
}
// The scores' scale: 1 / sqrt(hd), or the shape's own (multi-latent attention's).
template <typename T>
T ScoreScale(const AttentionShape& s) {
  return static_cast<T>(s.scale > 0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.hd)));
}

// Dropout of the causal part of a (tq, t) block in place, row i being position qpos[i]: its mask is
// that of row qpos[i] of a sample's (t, t) probabilities (the same mask in forward and backward).
template <typename T>
void DropoutQueryRows(T* m, const int64_t* qpos, int64_t tq, int64_t t, double p, uint64_t seed, uint64_t stream) {
  if (p <= 0.0) return;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  for (int64_t i = 0; i < tq; ++i) {
    const int64_t last = qpos[i];
    for (int64_t j = 0; j <= last; ++j) {
      const uint64_t idx = static_cast<uint64_t>(last * t + j);
      m[i * t + j] = DropoutKeep(seed, stream, idx, threshold) ? m[i * t + j] * scale : T(0);
    }
  }
}

// The first key of the row at position `last`: 0, or under a sliding window (Megatron's
// get_sliding_window_causal_mask with (window, 0)) last - window when that is later.
int64_t FirstKey(int64_t last, int64_t window) { return window < 0 ? 0 : std::max<int64_t>(0, last - window); }

// A row of t scores to probabilities in place: softmax over columns first..last, zeros elsewhere
// (Megatron's -10000 fill gives them exp() == 0 in fp32). With a sink (Megatron's SoftmaxOne), the
// logit `sink` joins the row's softmax and is dropped after it: its exp() adds to the denominator.
template <typename T>
void SoftmaxRow(T* row, int64_t first, int64_t last, int64_t t, const float* sink) {
  T mx = sink ? static_cast<T>(*sink) : -std::numeric_limits<T>::infinity();
  for (int64_t j = first; j <= last; ++j) mx = std::max(mx, row[j]);
  double sum = sink ? std::exp(static_cast<T>(*sink) - mx) : 0.0;
  for (int64_t j = first; j <= last; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  const T inv = static_cast<T>(1.0 / sum);
  for (int64_t j = 0; j < first; ++j) row[j] = T(0);
  for (int64_t j = first; j <= last; ++j) row[j] *= inv;
  for (int64_t j = last + 1; j < t; ++j) row[j] = T(0);
}

// The gradient of a row's probabilities (drow, in place) to that of its scaled scores, given the
// probabilities prow: drow = prow * (drow - prow . drow) * scale over columns first..last, zeros
// elsewhere. Returns prow . drow (a sink's gradient is -p_sink * that, p_sink = 1 - sum(prow)).
template <typename T>
double SoftmaxBackwardRow(const T* prow, T* drow, int64_t first, int64_t last, int64_t t, T scale) {
  double dot = 0;
  for (int64_t j = first; j <= last; ++j) dot += static_cast<double>(prow[j]) * drow[j];
  const T tdot = static_cast<T>(dot);
  for (int64_t j = 0; j < first; ++j) drow[j] = T(0);
  for (int64_t j = first; j <= last; ++j) drow[j] = prow[j] * (drow[j] - tdot) * scale;
  for (int64_t j = last + 1; j < t; ++j) drow[j] = T(0);
  return dot;
}
// The sink's probability in a row: what its keys' probabilities leave of 1.
template <typename T>
double SinkProbability(const T* prow, int64_t first, int64_t last) {
  double sum = 0;
  for (int64_t j = first; j <= last; ++j) sum += prow[j];
  return 1.0 - sum;
}

// kSkip: the Gemm tiles of a (tq, t) block of rows' scores that some row of the tile attends to (a
// key at or before its position); the tiles left out are zeros after the rows' last keys, which
// SoftmaxRow and SoftmaxBackwardRow write themselves. kCompute: every tile.
GemmTileFilter AttendedTiles(const int64_t* qpos, MaskedKeys keys) {
  if (keys == MaskedKeys::kCompute) return nullptr;
  return [qpos](int64_t row0, int64_t rows, int64_t col0, int64_t) {
    return *std::max_element(qpos + row0, qpos + row0 + rows) >= col0;
  };
}

}  // namespace

template <typename T>
void AttentionRowsForward(T* out, T* probs, const T* q_rows, const T* kv, const int64_t* qpos, int64_t tq,
                          const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams, MaskedKeys keys) {
  const int64_t t = s.t, hd = s.hd, vd = s.v_dim(), c = s.nh * vd, w = s.qkv_width(), per_group = s.nh / s.groups();
  const T scale = ScoreScale<T>(s);
  const GemmTileFilter attended = AttendedTiles(qpos, keys);
  tbb::enumerable_thread_specific<std::vector<T>> dropped_of(p > 0.0 ? static_cast<size_t>(tq * t) : 0);
  tbb::parallel_for(int64_t{0}, s.b * s.nh, [&](int64_t bh) {
    const int64_t b = bh / s.nh, h = bh % s.nh;
    tbb::this_task_arena::isolate([&] {  // no other head on this thread while Gemm's tiles run
      const T* q = q_rows + b * tq * w + QueryColumn(h, per_group, hd, vd);
      const T* k = kv + b * t * w + KeyColumn(h, per_group, hd, vd);
      const T* v = k + hd;
      T* pr = probs + (b * s.nh + h) * tq * t;
      GemmTiles<T>(false, true, tq, t, hd, scale, q, w, k, w, T(0), pr, t, attended);
      const float* sink = s.sink ? s.sink + h : nullptr;
      for (int64_t i = 0; i < tq; ++i) SoftmaxRow(pr + i * t, FirstKey(qpos[i], s.window), qpos[i], t, sink);
      const T* pv = pr;
      if (p > 0.0) {
        std::vector<T>& dropped = dropped_of.local();
        std::copy(pr, pr + tq * t, dropped.begin());
        DropoutQueryRows(dropped.data(), qpos, tq, t, p, seed, streams[b] + static_cast<uint64_t>(h));
        pv = dropped.data();
      }
      Gemm<T>(false, false, tq, vd, t, T(1), pv, t, v, w, T(0), out + b * tq * c + h * vd, c);
    });
  });
}

template <typename T>
void AttentionRowsBackward(T* dq_rows, T* dkv, const T* dout, const T* q_rows, const T* kv, const T* probs,
                           const int64_t* qpos, int64_t tq, const AttentionShape& s, double p, uint64_t seed,
                           const uint64_t* streams, MaskedKeys keys) {
  const int64_t t = s.t, hd = s.hd, vd = s.v_dim(), c = s.nh * vd, w = s.qkv_width(), per_group = s.nh / s.groups();
  const T scale = ScoreScale<T>(s);
  const GemmTileFilter attended = AttendedTiles(qpos, keys);
  // Each thread's work buffers: the dropped probabilities (tq, t), then their gradient (tq, t).
  tbb::enumerable_thread_specific<std::vector<T>> scratch_of(static_cast<size_t>(2 * tq * t));
  // Each (batch, head)'s share of the sink's gradient, summed over the batch in order after (the same bits for
  // any thread count).
  std::vector<double> dsink_of(s.dsink ? static_cast<size_t>(s.b * s.nh) : 0);
  tbb::parallel_for(int64_t{0}, s.b * s.groups(), [&](int64_t bg) {
    const int64_t b = bg / s.groups();
    T* pd = scratch_of.local().data();
    T* dp = pd + tq * t;
    tbb::this_task_arena::isolate([&] {
      for (int64_t h = bg % s.groups() * per_group; h < (bg % s.groups() + 1) * per_group; ++h) {
        const uint64_t stream = p > 0.0 ? streams[b] + static_cast<uint64_t>(h) : 0;
        const T* q = q_rows + b * tq * w + QueryColumn(h, per_group, hd, vd);
        const T* k = kv + b * t * w + KeyColumn(h, per_group, hd, vd);
        const T* v = k + hd;
        T* dq = dq_rows + b * tq * w + QueryColumn(h, per_group, hd, vd);
        T* dk = dkv + b * t * w + KeyColumn(h, per_group, hd, vd);
        T* dv = dk + hd;
        const T acc = h % per_group == 0 ? T(0) : T(1);  // the group's first head assigns, the others add
        const T* dy = dout + b * tq * c + h * vd;
        const T* pr = probs + (b * s.nh + h) * tq * t;
        const T* pv = pr;
        if (p > 0.0) {
          std::copy(pr, pr + tq * t, pd);
          DropoutQueryRows(pd, qpos, tq, t, p, seed, stream);
          pv = pd;
        }
        Gemm<T>(true, false, t, vd, tq, T(1), pv, t, dy, c, acc, dv, w);                 // dV = P'^T dY
        GemmTiles<T>(false, true, tq, t, vd, T(1), dy, c, v, w, T(0), dp, t, attended);  // dP' = dY V^T
        DropoutQueryRows(dp, qpos, tq, t, p, seed, stream);                              // dP = dropout(dP')
        double dsink = 0;  // the sink's gradient over these rows: -sum of p_sink x (p . dp)
        for (int64_t i = 0; i < tq; ++i) {
          const int64_t first = FirstKey(qpos[i], s.window);
          const double dot = SoftmaxBackwardRow(pr + i * t, dp + i * t, first, qpos[i], t, scale);
          if (s.dsink) dsink -= SinkProbability(pr + i * t, first, qpos[i]) * dot;
        }
        if (s.dsink) dsink_of[static_cast<size_t>(b * s.nh + h)] = dsink;
        Gemm<T>(false, false, tq, hd, t, T(1), dp, t, k, w, T(0), dq, w);  // dQ = dS K
        Gemm<T>(true, false, t, hd, tq, T(1), dp, t, q, w, acc, dk, w);    // dK = dS^T Q
      }
    });
  });
  if (!s.dsink) return;
  for (int64_t h = 0; h < s.nh; ++h) {
    double sum = 0;
    for (int64_t b = 0; b < s.b; ++b) sum += dsink_of[static_cast<size_t>(b * s.nh + h)];
    s.dsink[h] += static_cast<float>(sum);
  }
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template void AttentionRowsForward<T>(T*, T*, const T*, const T*, const int64_t*, int64_t, const AttentionShape&, \
                                        double, uint64_t, const uint64_t*, MaskedKeys);                             \
  template void AttentionRowsBackward<T>(T*, T*, const T*, const T*, const T*, const T*, const int64_t*, int64_t,   \
                                         const AttentionShape&, double, uint64_t, const uint64_t*, MaskedKeys);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
