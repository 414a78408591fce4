// Causal attention of some query rows over whole samples on the GPU in fp32 (cpu::AttentionRowsForward /
// AttentionRowsBackward's twin), and context parallelism's device steps around it.
//
// AttentionRowsForward / AttentionRowsBackward: the tq query rows of each sample (row i at position qpos[i] of
// the whole sample) against the whole samples' keys and values, attention_cuda.cu's algorithm with a (tq, t)
// score matrix per head: row i's causal mask ends at column qpos[i], and its attention-dropout key is that of row
// qpos[i] of one rank's (t, t) probabilities (stream streams[batch] + head, element qpos[i] * t + j), as the CPU
// op. Column-major views as there: S^T = K Q^T is (t, tq), out^T = V^T P'^T, dV^T = dY^T P', dP'^T = V dY^T,
// dQ^T = K^T dS^T, dK^T = Q^T dS; a group's key and value gradients take its first head's term and add the
// others' in head order (beta 1).
//
// Context parallelism (--context-parallel-size C, Megatron's allgather exchange): each rank holds t positions of
// every sample (ContextParallelPositions); its QKV rows are all-gathered over the group (the caller's NCCL call)
// into C pieces in rank order, put in position order (ContextRowsToWhole, from the host's table of every rank's
// positions: no second copy of the chunk math), and this rank's rows attend to them. Backward puts the whole
// samples' key and value gradients (this rank's share) back in rank order (ContextWholeToRows) for the exchange,
// and each rank adds every rank's share of its rows in rank order (AddContextShares): the bits of the CPU op's
// gloo reduce-scatter, whatever the NCCL topology.
#include <fmt/core.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/attention_check.h"
#include "trainer/cuda/attention_util.cuh"
#include "trainer/cuda/ops_cuda.h"

// PTK_RETURN_IF_ERROR over an expression whose braced arguments hold commas (Batched's).
#define PTK_ROWS_RETURN_IF_ERROR(...)            \
  do {                                           \
    absl::Status ptk_rows_st_ = __VA_ARGS__;     \
    if (!ptk_rows_st_.ok()) return ptk_rows_st_; \
  } while (0)

namespace ptk::cuda {
namespace {

using attention_detail::BlockMax;
using attention_detail::BlockSum;
using attention_detail::CheckShape;
using attention_detail::DropoutArgs;
using attention_detail::Heads;
using attention_detail::MakeDropout;
using attention_detail::RowThreadsFor;
using attention_detail::RunBatched;
using attention_detail::ShapeString;
using attention_detail::UseStream;

// Row `row` of probs (b, nh, tq, t): its query row i, its last visible column qpos[i] and its dropout key.
struct QueryRow {
  int64_t i, last;
  uint64_t key;
};
__device__ __forceinline__ QueryRow RowOf(const DropoutArgs& d, const int64_t* qpos, int64_t row, int64_t tq,
                                          int64_t nh) {
  const int64_t bh = row / tq, i = row % tq;
  const uint64_t key = d.on ? DropoutKey(d.seed, d.streams[bh / nh] + static_cast<uint64_t>(bh % nh)) : 0;
  return {i, qpos[i], key};
}

// One block per row of probs, rows from row0: the scores to probabilities in place over columns 0..last (zeros
// after), then dropout when d.on (cpu's SoftmaxRow and DropoutQueryRows).
__global__ void RowsSoftmaxKernel(float* __restrict__ probs, const int64_t* __restrict__ qpos, int64_t row0, int64_t tq,
                                  int64_t t, int64_t nh, DropoutArgs d) {
  __shared__ float smax[33];
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const QueryRow q = RowOf(d, qpos, row, tq, nh);
  float* r = probs + row * t;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= q.last; j += blockDim.x) mx = fmaxf(mx, r[j]);
  mx = BlockMax(mx, smax);
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j <= q.last; j += blockDim.x) {
    const float e = expf(r[j] - mx);
    r[j] = e;
    sum += static_cast<double>(e);
  }
  sum = BlockSum(sum, ssum);
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = 0.0f;
    if (j <= q.last) {
      v = r[j] * inv;
      if (d.on) v = DropoutKeepKeyed(q.key, static_cast<uint64_t>(q.last * t + j), d.threshold) ? v * d.scale : 0.0f;
    }
    r[j] = v;
  }
}

// dst's rows 0.. = dropout(probs' rows [row0, row0 + gridDim.x)) over the visible columns (the rest copied).
__global__ void RowsDropoutCopyKernel(float* __restrict__ dst, const float* __restrict__ src,
                                      const int64_t* __restrict__ qpos, int64_t row0, int64_t tq, int64_t t, int64_t nh,
                                      DropoutArgs d) {
  const int64_t row = row0 + blockIdx.x;
  const QueryRow q = RowOf(d, qpos, row, tq, nh);
  const float* s = src + row * t;
  float* o = dst + static_cast<int64_t>(blockIdx.x) * t;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = s[j];
    if (j <= q.last)
      v = DropoutKeepKeyed(q.key, static_cast<uint64_t>(q.last * t + j), d.threshold) ? v * d.scale : 0.0f;
    o[j] = v;
  }
}

// Softmax backward of one row in place in dp (dp's rows from 0, probs' from row0): dP = dropout(dP'),
// dot = sum_j P dP in double, dS = P * (dP - dot) * scale, zeros after column last (cpu's SoftmaxBackwardRow).
__global__ void RowsSoftmaxBackwardKernel(float* __restrict__ dp, const float* __restrict__ probs,
                                          const int64_t* __restrict__ qpos, int64_t row0, int64_t tq, int64_t t,
                                          int64_t nh, float scale, DropoutArgs d) {
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const QueryRow q = RowOf(d, qpos, row, tq, nh);
  const float* p = probs + row * t;
  float* g = dp + static_cast<int64_t>(blockIdx.x) * t;
  double dot = 0.0;
  for (int64_t j = threadIdx.x; j <= q.last; j += blockDim.x) {
    float v = g[j];
    if (d.on) {
      v = DropoutKeepKeyed(q.key, static_cast<uint64_t>(q.last * t + j), d.threshold) ? v * d.scale : 0.0f;
      g[j] = v;
    }
    dot += static_cast<double>(p[j]) * static_cast<double>(v);
  }
  dot = BlockSum(dot, ssum);
  const float tdot = static_cast<float>(dot);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) g[j] = j <= q.last ? p[j] * (g[j] - tdot) * scale : 0.0f;
}

// S = scale Q K^T of every head, into probs (b, nh, tq, t).
absl::Status RowScores(float* probs, const float* q_rows, const float* kv, int64_t tq, const AttentionShape& s,
                       float scale, const CudaContext& ctx, const std::string& where) {
  const Heads H(s);
  const int64_t t = s.t, hd = s.hd, W = H.width, G = H.group_stride, qt = tq * t;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < H.per_group; ++i)
      // S^T(j, i) = sum_d K[j, d] Q[i, d]: A = K stored (hd, t) op T, B = Q stored (hd, tq) op N.
      PTK_ROWS_RETURN_IF_ERROR(
          RunBatched({CUBLAS_OP_T, CUBLAS_OP_N, t, tq, hd, kv + b * t * W + H.Key(hd), W, G,
                      q_rows + b * tq * W + H.Query(i, hd), W, G, probs + (b * s.nh + i) * qt, t, H.per_group * qt},
                     scale, H.groups, ctx, where));
  return absl::OkStatus();
}

absl::Status RowSoftmax(float* probs, const int64_t* qpos, int64_t tq, const AttentionShape& s, const DropoutArgs& d,
                        const CudaContext& ctx, const std::string& where) {
  const int64_t rows = s.b * s.nh * tq;
  constexpr int64_t kMaxGrid = INT_MAX;  // grid.x's limit: rows go in launches of at most that many
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGrid) {
    const int64_t count = rows - r0 < kMaxGrid ? rows - r0 : kMaxGrid;
    RowsSoftmaxKernel<<<static_cast<unsigned>(count), RowThreadsFor(s.t), 0, ctx.stream>>>(probs, qpos, r0, tq, s.t,
                                                                                           s.nh, d);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  }
  return absl::OkStatus();
}

absl::Status CheckRows(const AttentionShape& s, int64_t tq, const std::string& where) {
  PTK_ROWS_RETURN_IF_ERROR(CheckShape(s, where));
  if (tq <= 0 || tq > s.t)
    return absl::InvalidArgumentError(fmt::format("{}: {} query rows of samples of {} positions", where, tq, s.t));
  if (s.nh * tq > INT_MAX) return absl::InvalidArgumentError(fmt::format("{}: nh * tq beyond one launch", where));
  if (s.v_dim() != s.hd || s.scale > 0)  // multi-latent attention's heads: attention_cuda.cu's kernels have them
    return absl::UnimplementedError(
        fmt::format("{}: value heads of {} channels (queries and keys {}) or a scale of its own: the rows attention "
                    "takes one head width",
                    where, s.v_dim(), s.hd));
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionRowsForward(float* out, float* probs, const float* q_rows, const float* kv, const int64_t* qpos,
                                  int64_t tq, const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                                  const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionRowsForward<fp32>({}, tq={}, p={})", ShapeString(s), tq, p);
  PTK_ROWS_RETURN_IF_ERROR(CheckRows(s, tq, where));
  if (!out || !probs || !q_rows || !kv || !qpos)
    return absl::InvalidArgumentError(fmt::format("{}: out, probs, q_rows, kv, qpos must be set", where));
  DropoutArgs d;
  PTK_ROWS_RETURN_IF_ERROR(MakeDropout(p, seed, streams, where, &d));
  PTK_ROWS_RETURN_IF_ERROR(UseStream(ctx, where));
  const Heads H(s);
  const int64_t t = s.t, hd = s.hd, c = s.nh * s.hd, W = H.width, G = H.group_stride, qt = tq * t;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  PTK_ROWS_RETURN_IF_ERROR(RowScores(probs, q_rows, kv, tq, s, scale, ctx, where));
  PTK_ROWS_RETURN_IF_ERROR(RowSoftmax(probs, qpos, tq, s, d, ctx, where));  // P, or P' with dropout
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < H.per_group; ++i)
      // out^T(d, i) = sum_j V[j, d] P'[i, j]: A = V stored (hd, t) op N, B = P' stored (t, tq) op N.
      PTK_ROWS_RETURN_IF_ERROR(
          RunBatched({CUBLAS_OP_N, CUBLAS_OP_N, hd, tq, t, kv + b * t * W + H.Value(hd), W, G,
                      probs + (b * s.nh + i) * qt, t, H.per_group * qt, out + b * tq * c + i * hd, c, H.per_group * hd},
                     1.0f, H.groups, ctx, where));
  if (d.on) {  // probs back to the probabilities before dropout (attention_cuda.cu's recomputation)
    PTK_ROWS_RETURN_IF_ERROR(RowScores(probs, q_rows, kv, tq, s, scale, ctx, where));
    PTK_ROWS_RETURN_IF_ERROR(RowSoftmax(probs, qpos, tq, s, DropoutArgs{}, ctx, where));
  }
  return absl::OkStatus();
}

int64_t AttentionRowsBackwardScratch(const AttentionShape& s, int64_t tq) { return s.nh * tq * s.t; }

absl::Status AttentionRowsBackward(float* dq_rows, float* dkv, const float* dout, const float* q_rows, const float* kv,
                                   const float* probs, const int64_t* qpos, int64_t tq, const AttentionShape& s,
                                   double p, uint64_t seed, const uint64_t* streams, float* scratch,
                                   const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionRowsBackward<fp32>({}, tq={}, p={})", ShapeString(s), tq, p);
  PTK_ROWS_RETURN_IF_ERROR(CheckRows(s, tq, where));
  if (!dq_rows || !dkv || !dout || !q_rows || !kv || !probs || !qpos || !scratch)
    return absl::InvalidArgumentError(
        fmt::format("{}: dq_rows, dkv, dout, q_rows, kv, probs, qpos, scratch must be set", where));
  DropoutArgs d;
  PTK_ROWS_RETURN_IF_ERROR(MakeDropout(p, seed, streams, where, &d));
  PTK_ROWS_RETURN_IF_ERROR(UseStream(ctx, where));
  const Heads H(s);
  const int64_t t = s.t, hd = s.hd, nh = s.nh, c = nh * hd, W = H.width, G = H.group_stride, qt = tq * t,
                pg = H.per_group, rows = nh * tq;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int threads = RowThreadsFor(t);
  for (int64_t b = 0; b < s.b; ++b) {
    const float* q = q_rows + b * tq * W;
    const float* k = kv + b * t * W + H.Key(hd);
    const float* v = kv + b * t * W + H.Value(hd);
    float* dk = dkv + b * t * W + H.Key(hd);
    float* dv = dkv + b * t * W + H.Value(hd);
    const float* dy = dout + b * tq * c;
    const int64_t row0 = b * rows;
    const float* pd = probs + b * nh * qt;
    if (d.on) {  // P' = dropout(P) into the scratch
      RowsDropoutCopyKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, qpos, row0, tq, t,
                                                                                     nh, d);
      PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
      pd = scratch;
    }
    for (int64_t i = 0; i < pg; ++i)  // dV^T(d, j) = sum_i dY[i, d] P'[i, j]: B = P' stored (t, tq) op T
      PTK_ROWS_RETURN_IF_ERROR(
          RunBatched({CUBLAS_OP_N, CUBLAS_OP_T, hd, t, tq, dy + i * hd, c, pg * hd, pd + i * qt, t, pg * qt, dv, W, G},
                     1.0f, H.groups, ctx, where, i == 0 ? 0.0f : 1.0f));
    for (int64_t i = 0; i < pg; ++i)  // dP'^T(j, i) = sum_d V[j, d] dY[i, d]
      PTK_ROWS_RETURN_IF_ERROR(RunBatched(
          {CUBLAS_OP_T, CUBLAS_OP_N, t, tq, hd, v, W, G, dy + i * hd, c, pg * hd, scratch + i * qt, t, pg * qt}, 1.0f,
          H.groups, ctx, where));
    RowsSoftmaxBackwardKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, qpos, row0, tq,
                                                                                       t, nh, scale, d);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
    for (int64_t i = 0; i < pg; ++i) {
      // dQ^T(d, i) = sum_j K[j, d] dS[i, j]: B = dS stored (t, tq) op N.
      PTK_ROWS_RETURN_IF_ERROR(RunBatched({CUBLAS_OP_N, CUBLAS_OP_N, hd, tq, t, k, W, G, scratch + i * qt, t, pg * qt,
                                           dq_rows + b * tq * W + H.Query(i, hd), W, G},
                                          1.0f, H.groups, ctx, where));
      // dK^T(d, j) = sum_i Q[i, d] dS[i, j]: A = Q stored (hd, tq) op N, B = dS stored (t, tq) op T.
      PTK_ROWS_RETURN_IF_ERROR(RunBatched(
          {CUBLAS_OP_N, CUBLAS_OP_T, hd, t, tq, q + H.Query(i, hd), W, G, scratch + i * qt, t, pg * qt, dk, W, G}, 1.0f,
          H.groups, ctx, where, i == 0 ? 0.0f : 1.0f));
    }
  }
  return absl::OkStatus();
}

}  // namespace ptk::cuda
