// Causal self-attention on the GPU in fp32: the CPU op's algorithm over cuBLAS products and softmax kernels.
//
// AttentionForward / AttentionBackward, beside trainer/cpu/attention_cpu.cpp, over Megatron's fused
// QKV layout qkv(b, t, nh, 3, hd), or with grouped-query attention its per-group order (a group's
// query heads, then its key and value heads) (bf16/fp16 attention is cuDNN's: flash_attention_cuda.cpp): the
// CPU op's algorithm, step for step, so that it is compared tightly with it. Products are cuBLAS strided-batched GEMMs
// over the query groups of one batch element, one call per head index within a group (without GQA one call over
// every head: the head stride of q/k/v is 3*hd, the row stride 3*c; pedantic fp32, never TF32); a group's key and
// value gradients take its first head's term, then add the others' in order (beta 1), the causal softmax and its
// backward are kernels here with the CPU's arithmetic (max, exp in fp32, sums in double, one rounding of 1/sum), and
// attention dropout uses the CPU's counter hash with the CPU's keys: stream streams[batch] + head, element index i * t
// + j of the t x t matrix. Column-major views of the row-major matrices (see matmul_cuda.cu): S^T = K Q^T, out^T = V^T
// P'^T, dV^T = dY^T P', dP'^T = V dY^T, dQ^T = K^T dS^T, dK^T = Q^T dS. With dropout the forward has no buffer for the
// dropped probabilities (probs must keep them before dropout, and the op takes no scratch): it writes them into probs,
// takes the product with V, then computes S and the softmax again into probs (the same bits: the same GEMM and kernel
// on the same inputs). That costs one more t x t product per head than the CPU, in fp32 mode only.
#include <fmt/core.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/attention_check.h"
#include "trainer/cuda/attention_util.cuh"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using attention_detail::Batched;
using attention_detail::BlockMax;
using attention_detail::BlockSum;
using attention_detail::CheckShape;
using attention_detail::DropoutArgs;
using attention_detail::Heads;
using attention_detail::MakeDropout;
using attention_detail::RowThreadsFor;
using attention_detail::RunBatched;
using attention_detail::ScoreScale;
using attention_detail::ShapeString;
using attention_detail::UseStream;

// ---- fp32: kernels -------------------------------------------------------------------------------

// The dropout key of row `row` of a (b, nh, t, t) tensor: stream streams[b] + h (cpu::AttentionForward).
__device__ __forceinline__ uint64_t RowKey(const DropoutArgs& d, int64_t row, int64_t t, int64_t nh) {
  const int64_t bh = row / t;
  const uint64_t stream = d.streams[bh / nh] + static_cast<uint64_t>(bh % nh);
  return DropoutKey(d.seed, stream);
}

// The first key of query row i: 0, or under Megatron's sliding window (window, 0) i - window when that is later
// (cpu FirstKey: keys i - window..i, both ends included).
__device__ __forceinline__ int64_t FirstKey(int64_t i, int64_t window) {
  return window < 0 || i <= window ? 0 : i - window;
}

// One block per row of probs(b, nh, t, t), rows starting at `row0`: the causal softmax of the
// scores in place (S(i, j) for first <= j <= i, FirstKey; zeros elsewhere), then dropout when d.on.
// sink (device, per head; may be null): Megatron's softmax offset, a logit beside the row's scores in the softmax,
// dropped after it (its exp() adds to the denominator), as cpu SoftmaxRow.
__global__ void CausalSoftmaxKernel(float* __restrict__ probs, int64_t row0, int64_t t, int64_t nh, DropoutArgs d,
                                    int64_t window, const float* __restrict__ sink) {
  __shared__ float smax[33];
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t, first = FirstKey(i, window);
  const float offset = sink ? sink[(row / t) % nh] : 0.0f;
  float* r = probs + row * t;
  float mx = sink ? offset : -INFINITY;
  for (int64_t j = first + threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, r[j]);
  mx = BlockMax(mx, smax);
  double sum = 0.0;
  for (int64_t j = first + threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(r[j] - mx);
    r[j] = e;
    sum += static_cast<double>(e);
  }
  sum = BlockSum(sum, ssum);
  if (sink) sum += static_cast<double>(expf(offset - mx));
  const float inv = static_cast<float>(1.0 / sum);
  const uint64_t key = d.on ? RowKey(d, row, t, nh) : 0;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = 0.0f;
    if (j >= first && j <= i) {
      v = r[j] * inv;
      if (d.on) v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
    }
    r[j] = v;
  }
}

// dst = dropout(src) over rows of (t, t) matrices (the causal part; above the diagonal copied,
// where the probabilities are zero): rows [row0, row0 + gridDim.x) of probs into dst's rows 0...
__global__ void DropoutCopyKernel(float* __restrict__ dst, const float* __restrict__ src, int64_t row0, int64_t t,
                                  int64_t nh, DropoutArgs d) {
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t;
  const float* s = src + row * t;
  float* o = dst + static_cast<int64_t>(blockIdx.x) * t;
  const uint64_t key = RowKey(d, row, t, nh);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = s[j];
    if (j <= i) v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
    o[j] = v;
  }
}

// Softmax backward of one row, in place in dp (rows [row0, row0 + gridDim.x) of probs; dp's rows
// from 0): dP = dropout(dP'), dot = sum_j P dP (double), dS = P * (dP - dot) * scale over the row's keys
// first..i (FirstKey), zeros elsewhere. The CPU's expression order throughout. With sink_rows (the softmax offset's
// gradient wanted) each row's share of it, -p_sink * dot (p_sink = 1 - the row's probabilities' sum, in double),
// goes to sink_rows[blockIdx.x], as cpu AttentionRowsBackward's.
__global__ void SoftmaxBackwardKernel(float* __restrict__ dp, const float* __restrict__ probs, int64_t row0, int64_t t,
                                      int64_t nh, float scale, DropoutArgs d, int64_t window,
                                      double* __restrict__ sink_rows) {
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t, first = FirstKey(i, window);
  const float* p = probs + row * t;
  float* g = dp + static_cast<int64_t>(blockIdx.x) * t;
  const uint64_t key = d.on ? RowKey(d, row, t, nh) : 0;
  double dot = 0.0;
  for (int64_t j = first + threadIdx.x; j <= i; j += blockDim.x) {
    float v = g[j];
    if (d.on) {
      v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
      g[j] = v;
    }
    dot += static_cast<double>(p[j]) * static_cast<double>(v);
  }
  dot = BlockSum(dot, ssum);
  const float tdot = static_cast<float>(dot);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x)
    g[j] = j >= first && j <= i ? p[j] * (g[j] - tdot) * scale : 0.0f;
  if (!sink_rows) return;
  double kept = 0.0;
  for (int64_t j = first + threadIdx.x; j <= i; j += blockDim.x) kept += static_cast<double>(p[j]);
  kept = BlockSum(kept, ssum);
  if (threadIdx.x == 0) sink_rows[blockIdx.x] = -((1.0 - kept) * dot);
}

// One thread per head h: batch element b's rows' shares of the softmax offset's gradient (sink_rows, (nh, t) as
// SoftmaxBackwardKernel left them) summed in row order, then added to the head's running sum over the batch (acc,
// double): the CPU op's order. With `finish` acc[h] is added to dsink[h] in fp32.
__global__ void SinkGradKernel(double* __restrict__ acc, float* __restrict__ dsink,
                               const double* __restrict__ sink_rows, int64_t t, int64_t nh, bool first_batch,
                               bool finish) {
  const int64_t h = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= nh) return;
  double rows = 0.0;
  for (int64_t i = 0; i < t; ++i) rows += sink_rows[h * t + i];
  const double total = (first_batch ? 0.0 : acc[h]) + rows;
  acc[h] = total;
  if (finish) dsink[h] += static_cast<float>(total);
}

// ---- fp32: products ------------------------------------------------------------------------------

// S = scale Q K^T for every head of every batch element, into probs (b, nh, t, t).
absl::Status Scores(float* probs, const float* qkv, const AttentionShape& s, float scale, const CudaContext& ctx,
                    const std::string& where) {
  const Heads H(s);
  const int64_t t = s.t, hd = s.hd, W = H.width, G = H.group_stride, tt = t * t;
  for (int64_t b = 0; b < s.b; ++b) {
    const float* row = qkv + b * t * W;
    for (int64_t i = 0; i < H.per_group; ++i) {
      // S^T(j, i) = sum_d K[j, d] Q[i, d]: A = K stored (hd, t) op T, B = Q stored (hd, t) op N.
      absl::Status st = RunBatched({CUBLAS_OP_T, CUBLAS_OP_N, t, t, hd, row + H.Key(hd), W, G, row + H.Query(i, hd), W,
                                    G, probs + (b * s.nh + i) * tt, t, H.per_group * tt},
                                   scale, H.groups, ctx, where);
      if (!st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status Softmax(float* probs, const AttentionShape& s, const DropoutArgs& d, const CudaContext& ctx,
                     const std::string& where) {
  const int64_t rows = s.b * s.nh * s.t;
  // grid.x is at most 2^31 - 1 blocks: rows go in launches of at most that many
  constexpr int64_t kMaxGrid = INT_MAX;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGrid) {
    const int64_t count = rows - r0 < kMaxGrid ? rows - r0 : kMaxGrid;
    CausalSoftmaxKernel<<<static_cast<unsigned>(count), RowThreadsFor(s.t), 0, ctx.stream>>>(probs, r0, s.t, s.nh, d,
                                                                                             s.window, s.sink);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  }
  return absl::OkStatus();
}

__global__ void SetFlashRngKernel(int64_t* rng, int64_t seed, int64_t offset) {
  rng[0] = seed;
  rng[1] = offset;
}

}  // namespace

// ---- bf16 / fp16: cuDNN's dropout seed and offset (flash_attention_cuda.cpp) ----------------------

void attention_detail::LaunchSetFlashRng(int64_t* rng, int64_t seed, int64_t offset, cudaStream_t stream) {
  SetFlashRngKernel<<<1, 1, 0, stream>>>(rng, seed, offset);
}

// ---- fp32 ------------------------------------------------------------------------------------------

absl::Status AttentionForward(float* out, float* probs, const float* qkv, const AttentionShape& s, double p,
                              uint64_t seed, const uint64_t* streams, const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionForward<fp32>({}, p={})", ShapeString(s), p);
  if (absl::Status st = CheckShape(s, where); !st.ok()) return st;
  if (!out || !probs || !qkv) return absl::InvalidArgumentError(fmt::format("{}: out, probs, qkv must be set", where));
  DropoutArgs d;
  if (absl::Status st = MakeDropout(p, seed, streams, where, &d); !st.ok()) return st;
  if (absl::Status st = UseStream(ctx, where); !st.ok()) return st;
  const Heads H(s);
  // vd: the value heads' width (hd but under multi-latent attention); the output is (b, t, nh * vd).
  const int64_t t = s.t, hd = s.hd, vd = H.vd, c = s.nh * vd, W = H.width, G = H.group_stride, tt = t * t;
  const float scale = ScoreScale(s);
  if (absl::Status st = Scores(probs, qkv, s, scale, ctx, where); !st.ok()) return st;
  if (absl::Status st = Softmax(probs, s, d, ctx, where); !st.ok()) return st;  // P, or P' with dropout
  for (int64_t b = 0; b < s.b; ++b) {
    // out^T(d, i) = sum_j V[j, d] P'[i, j]: A = V stored (vd, t) op N, B = P' stored (t, t) op N.
    const float* v = qkv + b * t * W + H.Value(hd);
    for (int64_t i = 0; i < H.per_group; ++i) {
      if (absl::Status st = RunBatched({CUBLAS_OP_N, CUBLAS_OP_N, vd, t, t, v, W, G, probs + (b * s.nh + i) * tt, t,
                                        H.per_group * tt, out + b * t * c + i * vd, c, H.per_group * vd},
                                       1.0f, H.groups, ctx, where);
          !st.ok())
        return st;
    }
  }
  if (d.on) {  // probs back to the probabilities before dropout
    if (absl::Status st = Scores(probs, qkv, s, scale, ctx, where); !st.ok()) return st;
    if (absl::Status st = Softmax(probs, s, DropoutArgs{}, ctx, where); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// The dP rows, then the softmax offset's doubles (launch_math.h; used when s.dsink is set).
int64_t AttentionBackwardScratch(const AttentionShape& s) { return AttentionScratchFloats(s.nh, s.t); }

absl::Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                               const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                               float* scratch, const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionBackward<fp32>({}, p={})", ShapeString(s), p);
  if (absl::Status st = CheckShape(s, where); !st.ok()) return st;
  if (!dqkv || !dout || !qkv || !probs || !scratch)
    return absl::InvalidArgumentError(fmt::format("{}: dqkv, dout, qkv, probs, scratch must be set", where));
  DropoutArgs d;
  if (absl::Status st = MakeDropout(p, seed, streams, where, &d); !st.ok()) return st;
  if (absl::Status st = UseStream(ctx, where); !st.ok()) return st;
  const Heads H(s);
  const int64_t t = s.t, hd = s.hd, vd = H.vd, nh = s.nh, c = nh * vd, W = H.width, G = H.group_stride, tt = t * t,
                pg = H.per_group;
  const float scale = ScoreScale(s);
  const int threads = RowThreadsFor(t);
  const int64_t rows = nh * t;  // rows of one batch element; scratch holds them
  if (rows > INT_MAX) return absl::InvalidArgumentError(fmt::format("{}: nh * t beyond one launch", where));
  // The softmax offset's gradient (s.dsink): each row's share, then per head over the batch in order.
  double* sink_rows = s.dsink ? reinterpret_cast<double*>(scratch + SinkScratchOffset(nh, t)) : nullptr;
  double* sink_acc = s.dsink ? sink_rows + rows : nullptr;
  if (s.dsink && !s.sink)
    return absl::InvalidArgumentError(fmt::format("{}: the softmax offset's gradient without the offset", where));
  for (int64_t b = 0; b < s.b; ++b) {
    const float* base = qkv + b * t * W;
    const float* k = base + H.Key(hd);
    const float* v = base + H.Value(hd);
    float* dbase = dqkv + b * t * W;
    float* dk = dbase + H.Key(hd);
    float* dv = dbase + H.Value(hd);
    const float* dy = dout + b * t * c;
    const float* pr = probs + b * nh * tt;
    const int64_t row0 = b * nh * t;
    const float* pd = pr;
    if (d.on) {  // P' = dropout(P) into the scratch
      DropoutCopyKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, row0, t, nh, d);
      PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
      pd = scratch;
    }
    // A group's key and value gradients: its first query head's term assigned, the others' added in
    // head order (beta 1), as the CPU op.
    for (int64_t i = 0; i < pg; ++i) {
      // dV^T(d, j) = sum_i dY[i, d] P'[i, j]: A = dY stored (vd, t) op N, B = P' stored (t, t) op T.
      if (absl::Status st = RunBatched(
              {CUBLAS_OP_N, CUBLAS_OP_T, vd, t, t, dy + i * vd, c, pg * vd, pd + i * tt, t, pg * tt, dv, W, G}, 1.0f,
              H.groups, ctx, where, i == 0 ? 0.0f : 1.0f);
          !st.ok())
        return st;
    }
    for (int64_t i = 0; i < pg; ++i) {
      // dP'^T(j, i) = sum_d V[j, d] dY[i, d]: A = V stored (vd, t) op T, B = dY stored (vd, t) op N.
      if (absl::Status st = RunBatched(
              {CUBLAS_OP_T, CUBLAS_OP_N, t, t, vd, v, W, G, dy + i * vd, c, pg * vd, scratch + i * tt, t, pg * tt},
              1.0f, H.groups, ctx, where);
          !st.ok())
        return st;
    }
    SoftmaxBackwardKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, row0, t, nh, scale,
                                                                                   d, s.window, sink_rows);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
    if (s.dsink) {
      SinkGradKernel<<<static_cast<unsigned>((nh + 127) / 128), 128, 0, ctx.stream>>>(sink_acc, s.dsink, sink_rows, t,
                                                                                      nh, b == 0, b + 1 == s.b);
      PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
    }
    for (int64_t i = 0; i < pg; ++i) {
      // dQ^T(d, i) = sum_j K[j, d] dS[i, j]: A = K stored (hd, t) op N, B = dS stored (t, t) op N.
      if (absl::Status st = RunBatched(
              {CUBLAS_OP_N, CUBLAS_OP_N, hd, t, t, k, W, G, scratch + i * tt, t, pg * tt, dbase + H.Query(i, hd), W, G},
              1.0f, H.groups, ctx, where);
          !st.ok())
        return st;
      // dK^T(d, j) = sum_i Q[i, d] dS[i, j]: A = Q stored (hd, t) op N, B = dS stored (t, t) op T.
      if (absl::Status st = RunBatched(
              {CUBLAS_OP_N, CUBLAS_OP_T, hd, t, t, base + H.Query(i, hd), W, G, scratch + i * tt, t, pg * tt, dk, W, G},
              1.0f, H.groups, ctx, where, i == 0 ? 0.0f : 1.0f);
          !st.ok())
        return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace ptk::cuda
