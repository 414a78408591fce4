// Softmax cross-entropy over the padded vocabulary, forward and backward (dlogits in place).
#include <tbb/parallel_for.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

constexpr int kLanes = 16;
// kLanes floats as one GCC vector: the lanes' arithmetic is written out, so that it is vector code
// at any optimisation level (-O2's vectoriser leaves the exponential's loop scalar), with each lane
// the same operations, and so the same bits, as one float.
// Functions taking and returning Lanes are this file's own and always inlined (PTK_LANES_INLINE),
// at -O0 too: GCC's note that a 64-byte vector's calling convention differs with AVX-512 does not
// concern them. Left as calls (a Debug build), an avx512f clone of ExpRow would take Load's result in
// a register where the default-target Load returns it in memory (the ASan build read a null pointer).
#define PTK_LANES_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(float))));

PTK_LANES_INLINE Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
PTK_LANES_INLINE void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }
// static_cast for one value, lane by lane for lanes.
template <typename To, typename From>
PTK_LANES_INLINE To ConvertTo(From x) {
  if constexpr (std::is_arithmetic_v<From>)
    return static_cast<To>(x);
  else
    return __builtin_convertvector(x, To);
}

// exp(x) for x <= 0 (arguments are logit - row max): Cephes' expf, 2^n * p(r) with |r| <= ln2/2,
// within 2 ulp; branch-free. A template, so that the scalar tail and the lanes run one formula.
template <typename V, typename I>
PTK_LANES_INLINE V ExpNonPositive(V x) {
  x = x < -87.3f ? V{} - 87.3f : x;
  const V n = ConvertTo<V>(ConvertTo<I>(x * 1.44269504088896341f - 0.5f));
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (ConvertTo<I>(n) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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
