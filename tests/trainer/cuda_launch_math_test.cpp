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

}  // namespace
}  // namespace ptk::cuda
