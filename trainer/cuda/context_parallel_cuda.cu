// Context parallelism's attention on one context rank, on the GPU (the CPU model's context_parallel_cpu.cpp
// without its collectives): the all-gathered QKV rows put in the whole samples' position order, this rank's
// queries over them (attention_rows_cuda.cu), and backward this rank's share of every position's key and value
// gradients put back in rank order for the exchange, then the shares of this rank's rows added in rank order.
// The positions come from the host's ContextParallelPositions table (one definition of the chunk math).
#include <fmt/core.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "trainer/cuda/context_rows.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kThreads = 256;

// Row (q, s, i) of the rank-ordered pieces (rank q's row i of sample s) is row (s, positions[q * t + i]) of
// the whole samples: copied from the pieces to the whole (to_whole) or back. One thread per element.
__global__ void ContextRowsKernel(float* __restrict__ dst, const float* __restrict__ src,
                                  const int64_t* __restrict__ positions, int64_t b, int64_t t, int64_t w, int context,
                                  bool to_whole) {
  const int64_t n = static_cast<int64_t>(context) * b * t * w;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = context_detail::WholeIndex(e, b, t, w, context, positions);
    if (to_whole)
      dst[at] = src[e];
    else
      dst[e] = src[at];
  }
}

__global__ void AddSharesKernel(float* __restrict__ dqkv, const float* __restrict__ received,
                                const float* __restrict__ own, int rank, int context, int64_t piece) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < piece;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dqkv[e] += context_detail::RankOrderSum(received, own, rank, context, piece, e);
}

unsigned BlocksFor(int64_t n) {
  const int64_t blocks = CeilDiv(n, kThreads);
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

absl::Status CheckContext(const ContextAttentionArgs& cp, const std::string& where) {
  if (cp.context < 1 || cp.rank < 0 || cp.rank >= cp.context || !cp.positions)
    return absl::InvalidArgumentError(fmt::format("{}: rank {} of {} context ranks, positions {}", where, cp.rank,
                                                  cp.context, cp.positions ? "set" : "missing"));
  return absl::OkStatus();
}

absl::Status ContextRows(float* dst, const float* src, const ContextAttentionArgs& cp, const AttentionShape& local,
                         bool to_whole, const CudaContext& ctx, const std::string& where) {
  const int64_t n = cp.context * local.b * local.t * local.qkv_width();
  ContextRowsKernel<<<BlocksFor(n), kThreads, 0, ctx.stream>>>(dst, src, cp.positions, local.b, local.t,
                                                               local.qkv_width(), cp.context, to_whole);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

AttentionShape Whole(const ContextAttentionArgs& cp, const AttentionShape& local) {
  AttentionShape whole = local;
  whole.t = local.t * cp.context;
  return whole;
}

}  // namespace

absl::Status ContextAttentionForward(float* out, float* probs, const float* qkv, const float* gathered, float* whole,
                                     const ContextAttentionArgs& cp, const AttentionShape& local, double p,
                                     uint64_t seed, const uint64_t* streams, const CudaContext& ctx) {
  const std::string where =
      fmt::format("ContextAttentionForward(rank {} of {}, b={}, t={})", cp.rank, cp.context, local.b, local.t);
  if (absl::Status st = CheckContext(cp, where); !st.ok()) return st;
  if (!gathered || !whole) return absl::InvalidArgumentError(fmt::format("{}: gathered, whole must be set", where));
  if (absl::Status st = ContextRows(whole, gathered, cp, local, true, ctx, where); !st.ok()) return st;
  return AttentionRowsForward(out, probs, qkv, whole, cp.positions + cp.rank * local.t, local.t, Whole(cp, local), p,
                              seed, streams, ctx);
}

absl::Status ContextAttentionBackward(float* dqkv, float* shares, const float* dout, const float* qkv,
                                      const float* gathered, float* whole, float* dwhole, const float* probs,
                                      const ContextAttentionArgs& cp, const AttentionShape& local, double p,
                                      uint64_t seed, const uint64_t* streams, float* scratch, const CudaContext& ctx) {
  const std::string where =
      fmt::format("ContextAttentionBackward(rank {} of {}, b={}, t={})", cp.rank, cp.context, local.b, local.t);
  if (absl::Status st = CheckContext(cp, where); !st.ok()) return st;
  if (!dqkv || !shares || !gathered || !whole || !dwhole)
    return absl::InvalidArgumentError(fmt::format("{}: dqkv, shares, gathered, whole, dwhole must be set", where));
  if (absl::Status st = ContextRows(whole, gathered, cp, local, true, ctx, where); !st.ok()) return st;
  // The op assigns the query columns of this rank's rows and the key and value columns of every position; the
  // rest stays zero, so the exchange's sum adds nothing to the query columns.
  const int64_t piece = local.b * local.t * local.qkv_width();
  PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dqkv, 0, static_cast<size_t>(piece) * sizeof(float), ctx.stream), where);
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dwhole, 0, static_cast<size_t>(piece * cp.context) * sizeof(float), ctx.stream), where);
  if (absl::Status st = AttentionRowsBackward(dqkv, dwhole, dout, qkv, whole, probs, cp.positions + cp.rank * local.t,
                                              local.t, Whole(cp, local), p, seed, streams, scratch, ctx);
      !st.ok())
    return st;
  return ContextRows(shares, dwhole, cp, local, false, ctx, where);
}

absl::Status AddContextShares(float* dqkv, const float* received, const float* own, const ContextAttentionArgs& cp,
                              int64_t piece, const CudaContext& ctx) {
  const std::string where = fmt::format("AddContextShares(rank {} of {}, {} floats)", cp.rank, cp.context, piece);
  if (cp.context < 1 || cp.rank < 0 || cp.rank >= cp.context || piece < 0 || !dqkv || !own ||
      (cp.context > 1 && !received))
    return absl::InvalidArgumentError(fmt::format("{}: bad arguments", where));
  if (piece == 0) return absl::OkStatus();
  AddSharesKernel<<<BlocksFor(piece), kThreads, 0, ctx.stream>>>(dqkv, received, own, cp.rank, cp.context, piece);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

}  // namespace ptk::cuda
