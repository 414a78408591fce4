// Softmax cross-entropy over the padded vocabulary, forward and backward (dlogits in place).
#include <tbb/parallel_for.h>

#include <cmath>
#include <limits>

#include "trainer/ops_cpu.h"

namespace ptk::trainer {

template <typename T>
void SoftmaxCrossEntropyForwardCpu(T* losses, const T* logits, const int32_t* targets, int64_t n, int64_t vp) {
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
void SoftmaxCrossEntropyBackwardCpu(T* logits, const int32_t* targets, const T* dlosses, int64_t n, int64_t vp) {
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
void SoftmaxCrossEntropyFusedCpu(T* logits, T* losses, const int32_t* targets, const T* dlosses, int64_t n,
                                 int64_t vp) {
  tbb::parallel_for(int64_t{0}, n, [&](int64_t i) {
    T* row = logits + i * vp;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vp; ++j) mx = std::max(mx, row[j]);
    const T target_logit = row[targets[i]];
    double sum = 0;
    for (int64_t j = 0; j < vp; ++j) {
      T e = std::exp(row[j] - mx);
      row[j] = e;
      sum += e;
    }
    losses[i] = static_cast<T>(std::log(sum) + static_cast<double>(mx) - static_cast<double>(target_logit));
    const T d = dlosses[i];
    const T scale = static_cast<T>(static_cast<double>(d) / sum);
    for (int64_t j = 0; j < vp; ++j) row[j] *= scale;
    row[targets[i]] -= d;
  });
}

template void SoftmaxCrossEntropyFusedCpu<float>(float*, float*, const int32_t*, const float*, int64_t, int64_t);
template void SoftmaxCrossEntropyFusedCpu<double>(double*, double*, const int32_t*, const double*, int64_t, int64_t);
template void SoftmaxCrossEntropyForwardCpu<float>(float*, const float*, const int32_t*, int64_t, int64_t);
template void SoftmaxCrossEntropyForwardCpu<double>(double*, const double*, const int32_t*, int64_t, int64_t);
template void SoftmaxCrossEntropyBackwardCpu<float>(float*, const int32_t*, const float*, int64_t, int64_t);
template void SoftmaxCrossEntropyBackwardCpu<double>(double*, const int32_t*, const double*, int64_t, int64_t);

}  // namespace ptk::trainer
