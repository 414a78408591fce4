// The CUDA kernels' launch arithmetic that is host code (trainer/cuda/launch_math.h), checked on the
// CPU wherever the CUDA backend is built: a wrong answer would show only as a failed launch on a GPU.
#include "trainer/cuda/launch_math.h"

#include <gtest/gtest.h>

namespace ptk::cuda {
namespace {

// LayerNorm's backward keeps 2c float partials in dynamic shared memory; its rows-in-series kernel
// also declares 66 doubles (528 bytes) of its own. At c = 6144 the partials are exactly 48 KiB: with
// the kernel's own bytes that is past the limit, and the launch needs the opt-in (without it: "too
// many resources requested", e.g. GPT-NeoX-20B's hidden size on an A100, where the warp kernel's
// four sets of partials do not fit and the rows-in-series kernel runs).
TEST(CudaLaunchMath, StaticSharedMemoryCountsAgainstTheLimitWithoutOptIn) {
  const int64_t kBlockSums = 66 * 8;
  EXPECT_TRUE(NeedsSharedMemoryOptIn(2 * 6144 * 4, kBlockSums));
  EXPECT_TRUE(NeedsSharedMemoryOptIn(2 * 6080 * 4, kBlockSums));   // 48640 + 528 > 49152
  EXPECT_FALSE(NeedsSharedMemoryOptIn(2 * 6078 * 4, kBlockSums));  // 48624 + 528 = 49152
  EXPECT_FALSE(NeedsSharedMemoryOptIn(2 * 6144 * 4, 0));           // exactly 48 KiB, nothing static
  EXPECT_TRUE(NeedsSharedMemoryOptIn(2 * 6144 * 4 + 4, 0));
  EXPECT_FALSE(NeedsSharedMemoryOptIn(0, kBlockSums));
}

// cuDNN's graphs declare 16-byte aligned tensors; with attention dropout the CUDA model calls the
// fused attention once per sample, at sample * FlashStatsStride floats into its layer's statistics
// (a layer's at layer * b * FlashStatsStride). One head of 37 positions (t odd, a tensor rank's one
// head) put sample 1's statistics 148 bytes in: misaligned.
TEST(CudaLaunchMath, FlashStatisticsOfEverySampleAndLayerStartAligned) {
  EXPECT_EQ(FlashStatsStride(1, 37), 40);
  EXPECT_EQ(FlashStatsStride(3, 37), 112);
  EXPECT_EQ(FlashStatsStride(12, 1024), 12 * 1024);  // a multiple of 4 already: unchanged
  EXPECT_EQ(FlashStatsStride(1, 1), 4);
  for (int64_t nh : {1, 2, 3, 5, 12})
    for (int64_t t : {1, 9, 37, 64, 130, 1023}) {
      const int64_t s = FlashStatsStride(nh, t);
      EXPECT_GE(s, nh * t);
      EXPECT_LT(s, nh * t + 4);
      for (int64_t b : {1, 3})
        for (int64_t layer : {0, 1, 5})
          for (int64_t r = 0; r < b; ++r)
            EXPECT_EQ((layer * b * s + r * s) * 4 % 16, 0) << "nh=" << nh << " t=" << t << " b=" << b;
    }
}

}  // namespace
}  // namespace ptk::cuda
