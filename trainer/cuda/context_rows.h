// Context parallelism's element mapping and sum on the CUDA backend (context_parallel_cuda.cu's kernels), host and
// device, so that the CPU tests cover the exact functions the kernels run: where an element of the all-gathered
// pieces lies in the whole samples, and the shares of a rank's rows summed in rank order.
#pragma once

#include <cstdint>

#include "trainer/host_device.h"

namespace ptk::cuda::context_detail {

// Element e of `context` rank-ordered pieces of (b, t, w) rows (rank q's row i of sample s, q's piece first) is
// element WholeIndex of the whole samples (b, context * t, w): row (s, positions[q * t + i]), positions being
// every rank's ContextParallelPositions, rank by rank (ContextParallelPositionTable).
PTK_HD int64_t WholeIndex(int64_t e, int64_t b, int64_t t, int64_t w, int context, const int64_t* positions) {
  const int64_t col = e % w, row = e / w;  // row = (q * b + s) * t + i
  const int64_t i = row % t, s = row / t % b, q = row / t / b;
  return (s * context * t + positions[q * t + i]) * w + col;
}

// Element e of this rank's rows summed over the ranks' shares in rank order, ((s_0 + s_1) + s_2) + ... (the
// CPU's gloo reduce-scatter): rank q's share in piece q of `received`, this rank's own in `own`.
PTK_HD float RankOrderSum(const float* received, const float* own, int rank, int context, int64_t piece, int64_t e) {
  float acc = rank == 0 ? own[e] : received[e];
  for (int q = 1; q < context; ++q) acc += q == rank ? own[e] : received[q * piece + e];
  return acc;
}

}  // namespace ptk::cuda::context_detail
