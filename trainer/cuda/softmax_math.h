// The online softmax sum of softmax_xent_cuda.cu's first pass, one pack of logits at a time: host
// and device code (PTK_HD), so the CPU checks the very function the kernel runs
// (tests/trainer/cuda_softmax_math_test.cpp). C++17: the .cu files include this header.
#pragma once

#include <math.h>

#include "trainer/host_device.h"

namespace ptk::cuda {

// Adds the pack v[0..N) to a thread's running (m, s): m the largest logit seen (fp32), s the sum of
// exp(logit - m) (double), rescaled when m grows. A logit of -inf adds nothing: exp(-inf - m) is 0,
// and so it must stay while m itself is still -inf, where expf(-inf - -inf) would be NaN and the
// NaN would outlive the rescaling once a finite logit arrives (a row whose first logits are -inf,
// e.g. fp16 logits past -65504, would get a NaN loss where the CPU op's is finite). A NaN logit
// still makes s NaN.
template <int N>
PTK_HD void SoftmaxOnlineAdd(float& m, double& s, const float (&v)[N]) {
  float pm = v[0];
  for (int k = 1; k < N; ++k) pm = fmaxf(pm, v[k]);
  if (pm > m) {
    if (m != -INFINITY) s *= exp(static_cast<double>(m) - static_cast<double>(pm));
    m = pm;
  }
  for (int k = 0; k < N; ++k) s += v[k] == -INFINITY ? 0.0 : static_cast<double>(expf(v[k] - m));
}

}  // namespace ptk::cuda
