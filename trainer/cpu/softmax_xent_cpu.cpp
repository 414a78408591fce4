// Softmax cross-entropy over the padded vocabulary, forward and backward (dlogits in place).
#include <tbb/parallel_for.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "trainer/cpu/cpu_lanes.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

using lanes::ExpNonPositive;
using lanes::IntLanes;
using lanes::kLanes;
using lanes::Lanes;
using lanes::Load;
using lanes::Store;

// One row: returns the max; row[j] = exp(row[j] - max); *sum = sum of those. The lanes fix the
// summation order, so every instruction set gives the same bits.
__attribute__((target_clones("avx512f", "avx2", "default"))) float ExpRow(float* row, int64_t vp, double* sum) {
  Lanes mx = Lanes{} - std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= vp; j += kLanes) {
    const Lanes x = Load(row + j);
    mx = x > mx ? x : mx;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int k = 0; k < kLanes; ++k) m = std::max(m, mx[k]);
  for (int64_t t = j; t < vp; ++t) m = std::max(m, row[t]);
  Lanes acc = {};
  j = 0;
  for (; j + kLanes <= vp; j += kLanes) {
    const Lanes e = ExpNonPositive<Lanes, IntLanes>(Load(row + j) - m);
    Store(row + j, e);
    acc += e;
  }
  double s = 0;
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  for (int64_t t = j; t < vp; ++t) {
    row[t] = ExpNonPositive<float, int32_t>(row[t] - m);
    s += row[t];
  }
  *sum = s;
  return m;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void ScaleRow(float* row, int64_t vp, float scale) {
  int64_t j = 0;
  for (; j + kLanes <= vp; j += kLanes) Store(row + j, Load(row + j) * scale);
  for (; j < vp; ++j) row[j] *= scale;
}

// The double instantiation (finite-difference tests) keeps libm's exp.
double ExpRow(double* row, int64_t vp, double* sum) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < vp; ++j) m = std::max(m, row[j]);
  double s = 0;
  for (int64_t j = 0; j < vp; ++j) {
    row[j] = std::exp(row[j] - m);
    s += row[j];
  }
  *sum = s;
  return m;
}
void ScaleRow(double* row, int64_t vp, double scale) {
  for (int64_t j = 0; j < vp; ++j) row[j] *= scale;
}

}  // namespace

template <typename T>
void SoftmaxCrossEntropyForward(T* losses, const T* logits, const int32_t* targets, int64_t n, int64_t vp) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    const T* row = logits + i * vp;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vp; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < vp; ++j) sum += std::exp(row[j] - mx);
    losses[i] = static_cast<T>(std::log(sum) + static_cast<double>(mx) - static_cast<double>(row[targets[i]]));
  });
}

template <typename T>
void SoftmaxCrossEntropyBackward(T* logits, const int32_t* targets, const T* dlosses, int64_t n, int64_t vp) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    T* row = logits + i * vp;
    T d = dlosses[i];
    if (d == T(0)) {
      for (int64_t j = 0; j < vp; ++j) row[j] = T(0);
      return;
    }
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vp; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < vp; ++j) {
      T e = std::exp(row[j] - mx);
      row[j] = e;
      sum += e;
    }
    T inv = static_cast<T>(1.0 / sum);
    for (int64_t j = 0; j < vp; ++j) row[j] = row[j] * inv * d;
    row[targets[i]] -= d;
  });
}

template <typename T>
void SoftmaxCrossEntropyFused(T* logits, T* losses, const int32_t* targets, const T* dlosses, int64_t n, int64_t vp) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    T* row = logits + i * vp;
    const T target_logit = row[targets[i]];
    double sum = 0;
    const T mx = ExpRow(row, vp, &sum);
    losses[i] = static_cast<T>(std::log(sum) + static_cast<double>(mx) - static_cast<double>(target_logit));
    const T d = dlosses[i];
    ScaleRow(row, vp, static_cast<T>(static_cast<double>(d) / sum));
    row[targets[i]] -= d;
  });
}

template void SoftmaxCrossEntropyFused<float>(float*, float*, const int32_t*, const float*, int64_t, int64_t);
template void SoftmaxCrossEntropyFused<double>(double*, double*, const int32_t*, const double*, int64_t, int64_t);
template void SoftmaxCrossEntropyForward<float>(float*, const float*, const int32_t*, int64_t, int64_t);
template void SoftmaxCrossEntropyForward<double>(double*, const double*, const int32_t*, int64_t, int64_t);
template void SoftmaxCrossEntropyBackward<float>(float*, const int32_t*, const float*, int64_t, int64_t);
template void SoftmaxCrossEntropyBackward<double>(double*, const int32_t*, const double*, int64_t, int64_t);

}  // namespace ptk::cpu
