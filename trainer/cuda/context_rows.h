// Context parallelism's element mapping and sum on the CUDA backend (context_parallel_cuda.cu's kernels), host and
// device, so that the CPU tests cover the exact functions the kernels run: where an element of the all-gathered
// pieces lies in the whole samples, and the shares of a rank's rows summed in rank order; and (host only) the runs
// of consecutive true positions the hidden dropout keys (cuda_context_parallel.cpp's ContextDropout).
#pragma once

#include <cstdint>
#include <vector>

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

// A run of rows of a sample at consecutive true positions: rows [row, row + count) of the slice at positions
// [position, position + count) of the whole sample.
struct PositionRun {
  int64_t row, count, position;
  bool operator==(const PositionRun& o) const {  // C++17 (nvcc's): no defaulted comparison
    return row == o.row && count == o.count && position == o.position;
  }
};

// The runs of rows [row0, row0 + rows) of a context rank's positions (ContextParallelPositions; all of them, or a
// tensor rank's --sequence-parallel share), rows counted from row0: one DropoutRows call each, keyed from
// position * hidden (a run's elements are consecutive in the whole sample's row too).
inline std::vector<PositionRun> PositionRuns(const int64_t* positions, int64_t row0, int64_t rows) {
  std::vector<PositionRun> runs;
  const int64_t* pos = positions + row0;
  for (int64_t i0 = 0, i1 = 0; i0 < rows; i0 = i1) {
    for (i1 = i0 + 1; i1 < rows && pos[i1] == pos[i1 - 1] + 1; ++i1) {
    }
    runs.push_back({i0, i1 - i0, pos[i0]});
  }
  return runs;
}

}  // namespace ptk::cuda::context_detail
