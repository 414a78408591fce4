// The per-row pieces of causal attention shared by attention_cpu.cpp (every position of a sample)
// and attention_rows_cpu.cpp (context parallelism: some query positions of it): row i of a (rows, t)
// block of scores or probabilities is the query at position pos(i), which attends to positions
// 0..pos(i). One copy of the math, so both ops give the same bits for the same rows (not part of the
// library's interface; compiled with the trainer_cpu flags of trainer/cpu/CMakeLists.txt).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu::causal {

// Columns of head h's query and of its group's key in a token's QKV row (per group: its
// per_group query heads, the key, the value).
inline int64_t QueryColumn(int64_t h, int64_t per_group, int64_t hd) {
  return (h / per_group * (per_group + 2) + h % per_group) * hd;
}
inline int64_t KeyColumn(int64_t h, int64_t per_group, int64_t hd) {
  return (h / per_group * (per_group + 2) + per_group) * hd;
}

// Dropout of the causal part of a (rows, t) block in place, row i being position pos(i): its mask is
// that of row pos(i) of a sample's (t, t) probabilities (the same mask in forward and backward).
template <typename T, typename Pos>
void Dropout(T* m, int64_t rows, int64_t t, Pos pos, double p, uint64_t seed, uint64_t stream) {
  if (p <= 0.0) return;
  const uint32_t threshold = DropoutKeepThreshold(p);
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t last = pos(i);
    for (int64_t j = 0; j <= last; ++j) {
      const uint64_t idx = static_cast<uint64_t>(last * t + j);
      m[i * t + j] = DropoutKeep(seed, stream, idx, threshold) ? m[i * t + j] * scale : T(0);
    }
  }
}

// A row of t scores to probabilities in place: softmax over columns 0..last, zeros after.
template <typename T>
void SoftmaxRow(T* row, int64_t last, int64_t t) {
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j <= last; ++j) mx = std::max(mx, row[j]);
  double sum = 0;
  for (int64_t j = 0; j <= last; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  const T inv = static_cast<T>(1.0 / sum);
  for (int64_t j = 0; j <= last; ++j) row[j] *= inv;
  for (int64_t j = last + 1; j < t; ++j) row[j] = T(0);
}

// The gradient of a row's probabilities (drow, in place) to that of its scaled scores, given the
// probabilities prow: drow = prow * (drow - prow . drow) * scale over columns 0..last, zeros after.
template <typename T>
void SoftmaxBackwardRow(const T* prow, T* drow, int64_t last, int64_t t, T scale) {
  double dot = 0;
  for (int64_t j = 0; j <= last; ++j) dot += static_cast<double>(prow[j]) * drow[j];
  const T tdot = static_cast<T>(dot);
  for (int64_t j = 0; j <= last; ++j) drow[j] = prow[j] * (drow[j] - tdot) * scale;
  for (int64_t j = last + 1; j < t; ++j) drow[j] = T(0);
}

}  // namespace ptk::cpu::causal
