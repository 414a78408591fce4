// The host arithmetic of the CUDA attention variants (trainer/cuda/launch_math.h), checked on the CPU wherever the
// CUDA backend is built: Megatron's sliding window (window, 0) as cuDNN's diagonal band keeps exactly the keys the
// CPU op attends (cpu::AttentionForward's nonzero probabilities), and the fp32 backward's scratch puts the softmax
// offset's doubles aligned after the dP rows. A wrong bound would show only as a wrong loss on a GPU.
#include <cmath>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/launch_math.h"

namespace ptk::cuda {
namespace {

TEST(CudaAttentionWindow, CudnnBandKeepsTheKeysTheCpuOpAttends) {
  for (int64_t window : {0, 1, 3, 8, 11, 40}) {
    AttentionShape s{1, 12, 2, 4};
    s.window = window;
    std::vector<float> qkv(static_cast<size_t>(s.t * s.qkv_width()));
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = std::sin(0.37f * static_cast<float>(i));
    std::vector<float> out(static_cast<size_t>(s.t * s.nh * s.hd)), probs(static_cast<size_t>(s.nh * s.t * s.t));
    cpu::AttentionForward<float>(out.data(), probs.data(), qkv.data(), s, 0.0, 0, nullptr);
    const int64_t bound = CudnnWindowLeftBound(window);
    for (int64_t h = 0; h < s.nh; ++h)
      for (int64_t i = 0; i < s.t; ++i)
        for (int64_t j = 0; j < s.t; ++j)
          EXPECT_EQ(probs[static_cast<size_t>((h * s.t + i) * s.t + j)] != 0.0f, CudnnBandKeeps(i, j, bound))
              << "window " << window << ", head " << h << ", query " << i << ", key " << j;
  }
  // Megatron's (window, 0): the query itself and the window's keys before it, window + 1 keys in all.
  EXPECT_EQ(CudnnWindowLeftBound(0), 1);
  EXPECT_TRUE(CudnnBandKeeps(5, 5, CudnnWindowLeftBound(0)));
  EXPECT_FALSE(CudnnBandKeeps(5, 4, CudnnWindowLeftBound(0)));
  EXPECT_TRUE(CudnnBandKeeps(5, 1, CudnnWindowLeftBound(4)));
  EXPECT_FALSE(CudnnBandKeeps(5, 0, CudnnWindowLeftBound(4)));
  EXPECT_FALSE(CudnnBandKeeps(5, 6, CudnnWindowLeftBound(4)));  // never a later key
}

TEST(CudaAttentionWindow, SoftmaxOffsetScratchIsAlignedAfterTheRows) {
  for (int64_t nh : {1, 2, 3, 12})
    for (int64_t t : {1, 9, 37, 64}) {
      const int64_t at = SinkScratchOffset(nh, t);
      EXPECT_EQ(at % 2, 0) << nh << " x " << t;  // whole doubles: 8-byte aligned
      EXPECT_GE(at, nh * t * t);
      EXPECT_LE(at, nh * t * t + 1);
      EXPECT_EQ(AttentionScratchFloats(nh, t), at + 2 * nh * t + 2 * nh);  // rows' shares and per-head sums
    }
  EXPECT_EQ(SinkScratchOffset(1, 3), 10);  // 9 floats of dP: one float of padding
}

}  // namespace
}  // namespace ptk::cuda
