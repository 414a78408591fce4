// context_flash_graphs.cpp's context-parallel pairs: the cuDNN graphs of context_flash.h's plan (a header of its
// own, beside ops_cuda.h, so that the kernels' files do not depend on it).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/cuda/context_flash.h"
#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {

// Context parallelism's fused attention, one pair of chunks at a time (context_flash.h: ContextFlashPairs, the
// views ContextFlashViews, the merge MergedOutput / MergedLse): cuDNN's SDPA over strided views of `gathered`,
// the all-gathered rank-ordered pieces of qkv rows (b, t, w) (without query groups Megatron's (nh, 3, hd) rows,
// with them heads first, as FlashAttentionForward's in ops_cuda.h), no dropout. Forward: the pair's partial output
// part_out (b, t/2, nh hd) and its log-sum-exp part_stats (b, nh, t/2). Backward, with this rank's final output `out`
// and its gradient `dout` (b, t, nh hd) and the merged log-sum-exp `stats` (2, b, nh, t/2), half by half: the pair's
// part of dQ, part_dq (b, t/2, nh hd), and of the key/value chunk's dK, dV, part_dk / part_dv (b, t/2, ng hd) each. One
// graph per shape, mask and direction, cached with the single-GPU ones (ContextFlashWorkspaceBytes builds all four and
// returns the largest workspace).
template <typename T>
absl::StatusOr<int64_t> ContextFlashWorkspaceBytes(const context_detail::FlashPairShape& s, const CudaContext& ctx);
template <typename T>
absl::Status ContextFlashPairForward(T* part_out, float* part_stats, const T* gathered,
                                     const context_detail::FlashPairShape& s, const context_detail::FlashPair& pair,
                                     const CudaContext& ctx);
template <typename T>
absl::Status ContextFlashPairBackward(T* part_dq, T* part_dk, T* part_dv, const T* dout, const T* out,
                                      const float* stats, const T* gathered, const context_detail::FlashPairShape& s,
                                      const context_detail::FlashPair& pair, const CudaContext& ctx);

// context_flash_cuda.cu, on ctx.stream, the pairs in ContextFlashPairs' order. MergeContextFlashPair: the pair's
// part_out / part_stats (ContextFlashPairForward's) merged into this rank's fp32 output out (b, t, nh hd) and
// log-sum-exp stats (2, b, nh, t/2) at its query chunk's rows (the first pair of a chunk, kv_chunk 0, copied: no
// zeroing needed). AddContextFlashPairGrads: the pair's part_dq added to this rank's fp32 QKV gradient rows dq
// (b, t, w) (query columns), its part_dk / part_dv to shares, fp32 in the gathered pieces' layout (C (b, t, w)
// pieces in rank order: each rank's share of every chunk's key/value gradient); the caller zeroes both first.
// One thread per element, no atomics: the same bits run after run.
template <typename T>
absl::Status MergeContextFlashPair(float* out, float* stats, const T* part_out, const float* part_stats,
                                   const context_detail::FlashPairShape& s, const context_detail::FlashPair& pair,
                                   const CudaContext& ctx);
template <typename T>
absl::Status AddContextFlashPairGrads(float* dq, float* shares, const T* part_dq, const T* part_dk, const T* part_dv,
                                      const context_detail::FlashPairShape& s, const context_detail::FlashPair& pair,
                                      const CudaContext& ctx);

}  // namespace ptk::cuda
