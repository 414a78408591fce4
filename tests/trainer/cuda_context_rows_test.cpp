// The CUDA backend's context-parallel element mapping and sum (trainer/cuda/context_rows.h, what
// context_parallel_cuda.cu's kernels run), on the CPU: the all-gathered pieces land where the CPU model's
// GatherContextRows puts them (each rank's rows at its ContextParallelPositions), every element once, and the
// shares of a rank's rows add in rank order, the CPU gloo reduce-scatter's bits; the hidden dropout's runs of
// consecutive true positions over a context rank's rows and a sequence-parallel tensor rank's share of them.
#include "trainer/cuda/context_rows.h"

#include <fmt/core.h>
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

// Every row of a slice in exactly one run, at its true position, and runs as long as the positions are
// consecutive: C = 2 x T = 3 over 36 positions gives tensor rank 1 the rows 6..11 of a context rank, positions
// 6..8 and 27..29 of context rank 0 (chunks 0 and 3 of 9 positions), two runs.
TEST(CudaContextRows, DropoutRunsFollowTheTruePositions) {
  const std::vector<int64_t> pos0 = ContextParallelPositions(36, 2, 0);
  EXPECT_EQ(PositionRuns(pos0.data(), 6, 6), (std::vector<PositionRun>{{0, 3, 6}, {3, 3, 27}}));
  EXPECT_EQ(PositionRuns(pos0.data(), 0, 18), (std::vector<PositionRun>{{0, 9, 0}, {9, 9, 27}}));
  for (const int C : {1, 2, 4})
    for (const int T : {1, 2, 3}) {
      const int64_t S = 2 * C * T * 3, t = S / C, tl = t / T;
      for (int q = 0; q < C; ++q) {
        const std::vector<int64_t> pos = ContextParallelPositions(S, C, q);
        for (int r = 0; r < T; ++r) {
          SCOPED_TRACE(fmt::format("C={} T={} context rank {} tensor rank {}", C, T, q, r));
          const std::vector<PositionRun> runs = PositionRuns(pos.data(), r * tl, tl);
          int64_t next = 0;
          for (size_t k = 0; k < runs.size(); ++k) {
            EXPECT_EQ(runs[k].row, next);
            ASSERT_GE(runs[k].count, 1);
            for (int64_t i = 0; i < runs[k].count; ++i)
              EXPECT_EQ(pos[static_cast<size_t>(r * tl + runs[k].row + i)], runs[k].position + i);
            if (k > 0) {  // a run ends on a jump
              EXPECT_NE(runs[k].position, runs[k - 1].position + runs[k - 1].count);
            }
            next += runs[k].count;
          }
          EXPECT_EQ(next, tl);
        }
      }
    }
}

}  // namespace
}  // namespace ptk::cuda::context_detail
