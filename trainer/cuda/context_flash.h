// The fused (cuDNN flash) context-parallel attention in bf16/fp16, host and device: the pairs of chunks one context
// rank attends and where their rows lie, and the exact merge of the partial outputs. The model runs it for
// bf16/fp16 without attention dropout or query groups (cuda_context_parallel.cpp's ContextFlash); the pairs' cuDNN
// graphs over ContextFlashViews, and the kernels that merge and add their results, are
// context_flash_cuda.h's (gpu test context_flash_cuda_test). The
// CPU test (tests/trainer/cuda_context_flash_test.cpp) checks the plan and the views against context_rows.h's
// mapping and the merge, and the backward identity it relies on, against a direct softmax.
//
// The plan: rank r of C holds query chunks r and 2C - 1 - r of the 2C chunks of every sample (its halves 0 and
// 1, ContextParallelPositions). Query chunk i attends key/value chunks j = 0, 1, ..., i of the all-gathered
// rank-ordered pieces: j < i unmasked, j == i causal. Each pair gives a partial output o_j and its rows'
// log-sum-exp l_j (natural log, of the scaled scores; that cuDNN's stats are this is for the GPU path's tests to
// check); merged in the order j = 0, 1, ... in fp32,
//   l = log(exp(l_acc) + exp(l_j)),   o = o_acc exp(l_acc - l) + o_j exp(l_j - l),
// they give the output and log-sum-exp of the softmax over all keys j <= i. Backward, each pair's gradient with
// the final output O and log-sum-exp L (P = exp(S - L), D = rowsum(dO O)) is that pair's part of the whole
// softmax's gradient: dQ sums over j, and dK/dV of chunk j are this rank's share for chunk j's owner.
// C++17 (nvcc's): the .cu files may include this header.
#pragma once

#include <math.h>

#include <cstdint>
#include <vector>

#include "trainer/host_device.h"

namespace ptk::cuda::context_detail {

// Chunk c of a sample's 2C chunks lies with rank ChunkOwner (as its half ChunkHalf: 0 for c < C, else 1).
PTK_HD int ChunkOwner(int c, int context) { return c < context ? c : 2 * context - 1 - c; }
PTK_HD int ChunkHalf(int c, int context) { return c < context ? 0 : 1; }

// One (query chunk, key/value chunk) pair of a rank's attention.
struct FlashPair {
  int half;      // the query chunk's half of this rank's rows: rows [half * chunk, (half + 1) * chunk)
  int q_chunk;   // its index i among the sample's 2C chunks
  int kv_chunk;  // the key/value chunk j <= i
  bool causal;   // j == i: the causal mask within the chunk; j < i: no mask
  bool first;    // j == 0: the pair starts the query chunk's merge (the partial is copied, not merged)
  bool operator==(const FlashPair& o) const {  // C++17: no defaulted comparison
    return half == o.half && q_chunk == o.q_chunk && kv_chunk == o.kv_chunk && causal == o.causal && first == o.first;
  }
};

// Rank `rank`'s pairs in the order they run (and merge): half 0 (chunk rank) with j = 0..rank, then half 1
// (chunk 2C - 1 - rank) with j = 0..2C - 1 - rank. 2C + 1 pairs on every rank (the load balance of the chunks).
inline std::vector<FlashPair> ContextFlashPairs(int context, int rank) {
  std::vector<FlashPair> pairs;
  for (int half = 0; half < 2; ++half) {
    const int i = half == 0 ? rank : 2 * context - 1 - rank;
    for (int j = 0; j <= i; ++j) pairs.push_back({half, i, j, j == i, j == 0});
  }
  return pairs;
}

// The element offset, in the all-gathered rank-ordered pieces (context_rows.h's layout: rank q's rows (b, t, w)
// of its positions, q's piece first; t = 2 chunk), of sample 0's first row of key/value chunk j. Sample s's
// rows follow at s * t * w, row k of the chunk at k * w: a strided (b, heads, chunk, hd) view for cuDNN with
// batch stride t * w, row stride w (the head stride and the K, V column offsets are those of the fused QKV).
PTK_HD int64_t PairKvOffset(int kv_chunk, int64_t b, int64_t t, int64_t w, int context) {
  const int64_t chunk = t / 2;
  return (static_cast<int64_t>(ChunkOwner(kv_chunk, context)) * b * t + ChunkHalf(kv_chunk, context) * chunk) * w;
}

// The element offset of a pair's query rows in this rank's own (b, t, w) rows (or of its output rows in
// (b, t, width) with width = nh * hd; of its stats in (b, nh, t) with width 1): sample 0's row half * chunk.
PTK_HD int64_t PairRowOffset(int half, int64_t t, int64_t width) { return half * (t / 2) * width; }

// The log-sum-exp of two disjoint key sets' log-sum-exps (either may be -inf: no key, or all masked).
PTK_HD float MergedLse(float acc, float part) {
  if (acc == -INFINITY) return part;
  if (part == -INFINITY) return acc;
  const float hi = fmaxf(acc, part), lo = fminf(acc, part);
  return hi + log1pf(expf(lo - hi));
}

// The weight exp(l - merged) of a partial of log-sum-exp l in the merged output (0 for a partial of no key).
PTK_HD float MergeWeight(float lse, float merged) { return lse == -INFINITY ? 0.0f : expf(lse - merged); }

// One element of a row's running output merged with a partial's: o_acc exp(l_acc - l) + o_part exp(l_part - l),
// l = MergedLse(l_acc, l_part). Every element of the row reads the row's old l_acc; the log-sum-exp itself is
// updated after (MergedLse).
PTK_HD float MergedOutput(float acc, float lse_acc, float part, float lse_part) {
  const float merged = MergedLse(lse_acc, lse_part);
  const float wa = MergeWeight(lse_acc, merged), wp = MergeWeight(lse_part, merged);
  return (wa == 0.0f ? 0.0f : acc * wa) + (wp == 0.0f ? 0.0f : part * wp);  // a zero weight drops even a NaN
}

// A strided (b, heads, rows, hd) view of a buffer, as cuDNN's graphs take it: element (s, h, k, d) at
// offset + s stride[0] + h stride[1] + k stride[2] + d stride[3].
struct FlashView {
  int64_t offset;
  int64_t dim[4];
  int64_t stride[4];
  PTK_HD int64_t At(int64_t s, int64_t h, int64_t k, int64_t d) const {
    return offset + s * stride[0] + h * stride[1] + k * stride[2] + d * stride[3];
  }
};

// A context rank's attention: b samples of t = 2 chunk rows each, nh query heads of hd, ng key/value heads. Rows
// of qkv are w = (nh + 2 ng) hd wide: Megatron's (nh, 3, hd) when ng == nh, heads first (nh query heads, ng key
// heads, ng value heads: flash_attention_cuda.cpp's grouped layout) when ng < nh.
struct FlashPairShape {
  int64_t b, t, nh, ng, hd;
  int context;
};

// The views of one pair's cuDNN graphs, offsets in elements of the buffer each names:
//   q, k, v      the all-gathered rank-ordered pieces of qkv rows (the query chunk is in this rank's own piece:
//                both at PairKvOffset);
//   own_q        the query chunk's columns in this rank's own (b, t, w) rows (its QKV gradient's dQ);
//   out          this rank's final output rows (b, t, nh hd) (and its gradient dO), at the query chunk's rows;
//   part_out     a pair's partial output, and its dQ: (b, chunk, nh hd) rows;
//   part_kv      a pair's dK or dV: (b, chunk, ng hd) rows;
//   part_stats   a pair's log-sum-exp (b, nh, chunk);
//   stats        the merged log-sum-exp of both halves, (2, b, nh, chunk): half h's at h b nh chunk.
// Only the offsets depend on the pair; the dims and strides on the shape alone (one graph per shape and mask).
struct FlashPairViews {
  FlashView q, k, v, own_q, out, part_out, part_kv, part_stats, stats;
};

inline FlashPairViews ContextFlashViews(const FlashPairShape& s, const FlashPair& p) {
  const int64_t chunk = s.t / 2, c = s.nh * s.hd, ckv = s.ng * s.hd, w = (s.nh + 2 * s.ng) * s.hd;
  const bool grouped = s.ng != s.nh;
  const int64_t head = grouped ? s.hd : 3 * s.hd, k_col = grouped ? c : s.hd, v_col = grouped ? c + ckv : 2 * s.hd;
  const int64_t q_at = PairKvOffset(p.q_chunk, s.b, s.t, w, s.context);
  const int64_t kv_at = PairKvOffset(p.kv_chunk, s.b, s.t, w, s.context);
  FlashPairViews v{};
  v.q = {q_at, {s.b, s.nh, chunk, s.hd}, {s.t * w, head, w, 1}};
  v.k = {kv_at + k_col, {s.b, s.ng, chunk, s.hd}, {s.t * w, head, w, 1}};
  v.v = {kv_at + v_col, {s.b, s.ng, chunk, s.hd}, {s.t * w, head, w, 1}};
  v.own_q = {PairRowOffset(p.half, s.t, w), {s.b, s.nh, chunk, s.hd}, {s.t * w, head, w, 1}};
  v.out = {PairRowOffset(p.half, s.t, c), {s.b, s.nh, chunk, s.hd}, {s.t * c, s.hd, c, 1}};
  v.part_out = {0, {s.b, s.nh, chunk, s.hd}, {chunk * c, s.hd, c, 1}};
  v.part_kv = {0, {s.b, s.ng, chunk, s.hd}, {chunk * ckv, s.hd, ckv, 1}};
  v.part_stats = {0, {s.b, s.nh, chunk, 1}, {s.nh * chunk, chunk, 1, 1}};
  v.stats = {p.half * s.b * s.nh * chunk, {s.b, s.nh, chunk, 1}, {s.nh * chunk, chunk, 1, 1}};
  return v;
}

}  // namespace ptk::cuda::context_detail
