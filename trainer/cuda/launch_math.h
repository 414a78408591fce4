// Launch arithmetic of the CUDA kernels that is pure host code (no CUDA header): checked on the CPU
// (tests/trainer/cuda_launch_math_test.cpp) wherever the backend is built, since a wrong answer here
// shows only as a failed launch on a device.
#pragma once

#include <cstdint>

// C++17 here: the .cu files include this header.
namespace ptk::cuda {

// Shared memory a block may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize):
// 48 KiB, the kernel's static shared memory and the launch's dynamic shared memory together.
inline constexpr int64_t kSharedMemoryWithoutOptIn = 48 * 1024;

// Whether a launch with `dynamic_bytes` of dynamic shared memory of a kernel that declares
// `static_bytes` of its own must first raise the kernel's dynamic limit: the static part counts
// against the 48 KiB too (a dynamic size of exactly 48 KiB fails without the opt-in as soon as the
// kernel has any static shared memory).
inline bool NeedsSharedMemoryOptIn(int64_t dynamic_bytes, int64_t static_bytes) {
  return dynamic_bytes + static_bytes > kSharedMemoryWithoutOptIn;
}

// Floats of one sample's softmax statistics (nh heads x t positions) in the CUDA model's buffer of
// cuDNN's fused attention: nh * t rounded up to whole 16 bytes. cuDNN's graphs declare every tensor
// 16-byte aligned, and with attention dropout each sample is a call of its own whose statistics
// start at sample * this (a layer's at layer * b * this): with nh * t not a multiple of 4 (t odd,
// one head per tensor rank) the plain product would start a sample's statistics misaligned.
inline int64_t FlashStatsStride(int64_t nh, int64_t t) { return (nh * t + 3) / 4 * 4; }

// Megatron's sliding window (window, 0) as cuDNN's SDPA diagonal band: cuDNN keeps key j of query row i where
// j + left_bound > i (cudnn-frontend's sliding_window_mask, top-left aligned; the causal mask keeps j <= i), so the
// bound window + 1 keeps keys i - window..i, the CPU op's (attention_rows_cpu.cpp's FirstKey).
inline int64_t CudnnWindowLeftBound(int64_t window) { return window + 1; }
inline bool CudnnBandKeeps(int64_t i, int64_t j, int64_t left_bound) { return j <= i && j + left_bound > i; }

// The fp32 attention backward's scratch (AttentionBackwardScratch, floats): the dP rows of one sample (nh * t * t
// floats) rounded up to whole doubles, then the softmax offset's per-row shares (nh * t doubles) and per-head sums
// (nh doubles). The doubles start at SinkScratchOffset floats: 8-byte aligned in an 8-byte aligned buffer.
inline int64_t SinkScratchOffset(int64_t nh, int64_t t) { return (nh * t * t + 1) / 2 * 2; }
inline int64_t AttentionScratchFloats(int64_t nh, int64_t t) { return SinkScratchOffset(nh, t) + 2 * (nh * t + nh); }

}  // namespace ptk::cuda
