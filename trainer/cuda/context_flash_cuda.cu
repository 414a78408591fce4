// Context parallelism's fused attention on the device, between the pairs' cuDNN graphs (context_flash_graphs.cpp):
// a pair's partial output and log-sum-exp merged into the rank's fp32 output and stats (context_flash.h's
// MergedOutput / MergedLse, in pair order), and a pair's dQ, dK, dV added to the rank's fp32 query gradient and
// to its fp32 shares of the key/value chunks' gradients (ContextFlashViews' element maps). No atomics: every
// element is written by one thread, the pairs in stream order, so the sums are in pair order, run after run.
#include <fmt/core.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "trainer/cuda/context_flash_cuda.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using context_detail::FlashPair;
using context_detail::FlashPairShape;
using context_detail::FlashPairViews;

constexpr int kThreads = 256;

unsigned BlocksFor(int64_t n, int64_t per_block) {
  const int64_t blocks = CeilDiv(n, per_block);
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

// One warp per row (s, h, k) of the pair: its elements merged with the row's old log-sum-exp, which lane 0 then
// updates (after the whole warp has read it). The first pair of a query chunk is copied.
template <typename T>
__global__ void MergeKernel(float* __restrict__ out, float* __restrict__ lse, const T* __restrict__ part,
                            const float* __restrict__ part_lse, FlashPairViews v, bool first) {
  const int64_t rows = v.q.dim[0] * v.q.dim[1] * v.q.dim[2], hd = v.q.dim[3];
  const int lane = threadIdx.x % 32;
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t k = row % v.q.dim[2], h = row / v.q.dim[2] % v.q.dim[1], s = row / v.q.dim[2] / v.q.dim[1];
    float& l = lse[v.stats.At(s, h, k, 0)];
    const float lp = part_lse[v.part_stats.At(s, h, k, 0)];
    const float la = first ? -INFINITY : l;
    for (int64_t d = lane; d < hd; d += 32) {
      float& o = out[v.out.At(s, h, k, d)];
      const float p = ToFloat(part[v.part_out.At(s, h, k, d)]);
      o = first ? p : context_detail::MergedOutput(o, la, p, lp);
    }
    __syncwarp();
    if (lane == 0) l = first ? lp : context_detail::MergedLse(la, lp);
  }
}

// One thread per element of the pair's dQ (nh heads) and dK, dV (ng heads each) of a (s, k) row.
template <typename T>
__global__ void AddGradsKernel(float* __restrict__ dq, float* __restrict__ shares, const T* __restrict__ part_dq,
                               const T* __restrict__ part_dk, const T* __restrict__ part_dv, FlashPairViews v) {
  const int64_t nh = v.q.dim[1], ng = v.k.dim[1], chunk = v.q.dim[2], hd = v.q.dim[3];
  const int64_t width = (nh + 2 * ng) * hd, n = v.q.dim[0] * chunk * width;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = e % hd, head = e / hd % (nh + 2 * ng), k = e / width % chunk, s = e / width / chunk;
    if (head < nh) {
      dq[v.own_q.At(s, head, k, d)] += ToFloat(part_dq[v.part_out.At(s, head, k, d)]);
    } else if (head < nh + ng) {
      shares[v.k.At(s, head - nh, k, d)] += ToFloat(part_dk[v.part_kv.At(s, head - nh, k, d)]);
    } else {
      shares[v.v.At(s, head - nh - ng, k, d)] += ToFloat(part_dv[v.part_kv.At(s, head - nh - ng, k, d)]);
    }
  }
}

absl::Status CheckPairArgs(const FlashPairShape& s, const FlashPair& p, const std::string& where) {
  if (s.b <= 0 || s.t <= 0 || s.t % 2 != 0 || s.nh <= 0 || s.ng <= 0 || s.nh % s.ng != 0 || s.hd <= 0 || s.context < 1)
    return absl::InvalidArgumentError(fmt::format("{}: not a context rank's attention shape", where));
  if (p.q_chunk < 0 || p.q_chunk >= 2 * s.context || p.kv_chunk < 0 || p.kv_chunk > p.q_chunk ||
      p.half != context_detail::ChunkHalf(p.q_chunk, s.context) || p.first != (p.kv_chunk == 0))
    return absl::InvalidArgumentError(fmt::format("{}: not a pair of ContextFlashPairs", where));
  return absl::OkStatus();
}

std::string Name(const char* op, const FlashPairShape& s, const FlashPair& p) {
  return fmt::format("{}(b={}, t={}, nh={}, ng={}, hd={}, context={}, chunks {} x {})", op, s.b, s.t, s.nh, s.ng, s.hd,
                     s.context, p.q_chunk, p.kv_chunk);
}

}  // namespace

template <typename T>
absl::Status MergeContextFlashPair(float* out, float* stats, const T* part_out, const float* part_stats,
                                   const FlashPairShape& s, const FlashPair& pair, const CudaContext& ctx) {
  const std::string where = Name("MergeContextFlashPair", s, pair);
  if (absl::Status st = CheckPairArgs(s, pair, where); !st.ok()) return st;
  if (!out || !stats || !part_out || !part_stats)
    return absl::InvalidArgumentError(fmt::format("{}: out, stats, part_out, part_stats must be set", where));
  const FlashPairViews v = context_detail::ContextFlashViews(s, pair);
  const int64_t rows = s.b * s.nh * (s.t / 2);
  MergeKernel<T>
      <<<BlocksFor(rows, kThreads / 32), kThreads, 0, ctx.stream>>>(out, stats, part_out, part_stats, v, pair.first);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

template <typename T>
absl::Status AddContextFlashPairGrads(float* dq, float* shares, const T* part_dq, const T* part_dk, const T* part_dv,
                                      const FlashPairShape& s, const FlashPair& pair, const CudaContext& ctx) {
  const std::string where = Name("AddContextFlashPairGrads", s, pair);
  if (absl::Status st = CheckPairArgs(s, pair, where); !st.ok()) return st;
  if (!dq || !shares || !part_dq || !part_dk || !part_dv)
    return absl::InvalidArgumentError(fmt::format("{}: dq, shares, part_dq, part_dk, part_dv must be set", where));
  const FlashPairViews v = context_detail::ContextFlashViews(s, pair);
  const int64_t n = s.b * (s.t / 2) * (s.nh + 2 * s.ng) * s.hd;
  AddGradsKernel<T><<<BlocksFor(n, kThreads), kThreads, 0, ctx.stream>>>(dq, shares, part_dq, part_dk, part_dv, v);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                      \
  template absl::Status MergeContextFlashPair<T>(float*, float*, const T*, const float*, const FlashPairShape&, \
                                                 const FlashPair&, const CudaContext&);                         \
  template absl::Status AddContextFlashPairGrads<T>(float*, float*, const T*, const T*, const T*,               \
                                                    const FlashPairShape&, const FlashPair&, const CudaContext&);
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
