// The CUDA backend's context-parallel element mapping and sum (trainer/cuda/context_rows.h, what
// context_parallel_cuda.cu's kernels run), on the CPU: the all-gathered pieces land where the CPU model's
// GatherContextRows puts them (each rank's rows at its ContextParallelPositions), every element once, and the
// shares of a rank's rows add in rank order, the CPU gloo reduce-scatter's bits.
#include "trainer/cuda/context_rows.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "trainer/parallel_layout.h"

namespace ptk::cuda::context_detail {
namespace {

TEST(CudaContextRows, PiecesLandAtEachRanksPositionsOnce) {
  for (const int C : {1, 2, 3, 4}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t b = 2, t = 6, w = 3, S = C * t;
    const std::vector<int64_t> table = ContextParallelPositionTable(S, C);
    // The CPU model's order (GatherContextRows): rank q's row i of sample s is position ContextParallelPositions(q)[i].
    std::vector<int64_t> want(static_cast<size_t>(C * b * t * w));
    for (int q = 0; q < C; ++q) {
      const std::vector<int64_t> pos = ContextParallelPositions(S, C, q);
      for (int64_t s = 0; s < b; ++s)
        for (int64_t i = 0; i < t; ++i)
          for (int64_t k = 0; k < w; ++k)
            want[static_cast<size_t>(((q * b + s) * t + i) * w + k)] = (s * S + pos[static_cast<size_t>(i)]) * w + k;
    }
    std::vector<int> hits(want.size(), 0);
    for (int64_t e = 0; e < static_cast<int64_t>(want.size()); ++e) {
      const int64_t at = WholeIndex(e, b, t, w, C, table.data());
      ASSERT_EQ(at, want[static_cast<size_t>(e)]) << "element " << e;
      ++hits[static_cast<size_t>(at)];
    }
    EXPECT_EQ(hits, std::vector<int>(want.size(), 1));
  }
}

TEST(CudaContextRows, SharesAddInRankOrder) {
  // Values whose sum depends on the order in fp32: ((1e8 + 1) + -1e8) + 1 is 1, other orders give 2 or 0.
  const std::vector<float> shares = {1e8f, 1.0f, -1e8f, 1.0f};
  const int C = 4;
  const float in_order = ((shares[0] + shares[1]) + shares[2]) + shares[3];
  ASSERT_NE(in_order, ((shares[0] + shares[2]) + shares[1]) + shares[3]);  // the check below can fail
  for (int rank = 0; rank < C; ++rank) {
    std::vector<float> received(C, -7.0f);  // piece `rank` is not read: this rank's own share comes from `own`
    for (int q = 0; q < C; ++q)
      if (q != rank) received[static_cast<size_t>(q)] = shares[static_cast<size_t>(q)];
    const float own = shares[static_cast<size_t>(rank)];
    EXPECT_EQ(RankOrderSum(received.data(), &own, rank, C, 1, 0), in_order) << "rank " << rank;
  }
  const float alone = 3.5f;
  EXPECT_EQ(RankOrderSum(nullptr, &alone, 0, 1, 1, 0), 3.5f);
}

}  // namespace
}  // namespace ptk::cuda::context_detail
