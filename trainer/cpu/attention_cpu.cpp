// Causal self-attention, multi-head or grouped-query (Megatron's core attention: scores scaled by 1/sqrt(head dim),
// causal softmax, attention dropout), forward and backward: attention_rows_cpu.cpp's ops with every position of the
// samples a query row (the queries, keys and values all from qkv; the gradients all into dqkv), which are the same
// operations in the same order. The T x T probabilities are kept for backward unless the caller recomputes them.
#include <numeric>
#include <vector>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

// The positions 0..t-1 of a sample: every row a query.
std::vector<int64_t> EveryPosition(int64_t t) {
  std::vector<int64_t> positions(static_cast<size_t>(t));
  std::iota(positions.begin(), positions.end(), int64_t{0});
  return positions;
}

}  // namespace

template <typename T>
void AttentionForward(T* out, T* probs, const T* qkv, const AttentionShape& s, double p, uint64_t seed,
                      const uint64_t* streams) {
  const std::vector<int64_t> qpos = EveryPosition(s.t);
  AttentionRowsForward<T>(out, probs, qkv, qkv, qpos.data(), s.t, s, p, seed, streams);
}

template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* probs, const AttentionShape& s, double p,
                       uint64_t seed, const uint64_t* streams) {
  // The query columns of dqkv from the rows' dQ, the key and value columns from their dK and dV: all assigned.
  const std::vector<int64_t> qpos = EveryPosition(s.t);
  AttentionRowsBackward<T>(dqkv, dqkv, dout, qkv, qkv, probs, qpos.data(), s.t, s, p, seed, streams);
}

#define PTK_INSTANTIATE(T)                                                                                       \
  template void AttentionForward<T>(T*, T*, const T*, const AttentionShape&, double, uint64_t, const uint64_t*); \
  template void AttentionBackward<T>(T*, const T*, const T*, const T*, const AttentionShape&, double, uint64_t,  \
                                     const uint64_t*);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE

}  // namespace ptk::cpu
