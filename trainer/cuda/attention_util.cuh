// What the fp32 attention kernels share: attention_cuda.cu's whole-sample attention and
// attention_rows_cuda.cu's rows of it (context parallelism): block reductions in a fixed order,
// the dropout arguments, the batched cuBLAS products and the heads' columns in the fused QKV row.
#pragma once

#include <cublas_v2.h>
#include <fmt/core.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::attention_detail {

constexpr int kMaxRowThreads = 256;

inline int RowThreadsFor(int64_t t) {
  int64_t n = CeilDiv(t, 32) * 32;
  if (n > kMaxRowThreads) n = kMaxRowThreads;
  return static_cast<int>(n);
}

// Block reductions in a fixed order (warp trees, then warp 0 over the warps' results): the same
// inputs give the same bits. Every thread gets the result. blockDim.x is a multiple of 32.
__device__ __forceinline__ float BlockMax(float v, float* shared) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float x = lane < warps ? shared[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, o));
    if (lane == 0) shared[32] = x;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();  // shared may be reused right after
  return r;
}
__device__ __forceinline__ double BlockSum(double v, double* shared) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double x = lane < warps ? shared[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if (lane == 0) shared[32] = x;
  }
  __syncthreads();
  const double r = shared[32];
  __syncthreads();
  return r;
}

struct DropoutArgs {
  bool on = false;
  uint32_t threshold = 0;
  float scale = 1.0f;  // 1/(1-p) rounded to fp32, as the CPU's static_cast<T>(1.0 / (1.0 - p))
  uint64_t seed = 0;
  const uint64_t* streams = nullptr;  // device, one per batch element; head h uses streams[b] + h
};

// C = alpha op(A) op(B) + beta C, column-major, batched over the heads (fp32, pedantic: no TF32).
struct Batched {
  cublasOperation_t ta, tb;
  int64_t m, n, k;
  const float* a;
  int64_t lda, stride_a;
  const float* b;
  int64_t ldb, stride_b;
  float* c;
  int64_t ldc, stride_c;
};

inline absl::Status RunBatched(const Batched& g, float alpha, int64_t count, const CudaContext& ctx,
                               const std::string& where, float beta = 0.0f) {
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasGemmStridedBatchedEx(ctx.cublas, g.ta, g.tb, static_cast<int>(g.m), static_cast<int>(g.n),
                                 static_cast<int>(g.k), &alpha, g.a, CUDA_R_32F, static_cast<int>(g.lda),
                                 static_cast<long long>(g.stride_a), g.b, CUDA_R_32F, static_cast<int>(g.ldb),
                                 static_cast<long long>(g.stride_b), &beta, g.c, CUDA_R_32F, static_cast<int>(g.ldc),
                                 static_cast<long long>(g.stride_c), static_cast<int>(count),
                                 CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
      where);
  return absl::OkStatus();
}

// The scores' scale: 1 / sqrt(hd), or the shape's own (multi-latent attention's), rounded to fp32 as the CPU op's.
inline float ScoreScale(const AttentionShape& s) {
  return static_cast<float>(s.scale > 0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.hd)));
}

inline absl::Status UseStream(const CudaContext& ctx, const std::string& where) {
  if (!ctx.cublas) return absl::FailedPreconditionError(fmt::format("{}: the context has no cuBLAS handle", where));
  cudaStream_t current = nullptr;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasGetStream(ctx.cublas, &current), where);
  if (current != ctx.stream) PTK_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx.cublas, ctx.stream), where);
  return absl::OkStatus();
}

inline absl::Status MakeDropout(double p, uint64_t seed, const uint64_t* streams, const std::string& where,
                                DropoutArgs* d) {
  if (!(p >= 0.0 && p < 1.0))
    return absl::InvalidArgumentError(fmt::format("{}: dropout probability {} outside [0, 1)", where, p));
  if (p <= 0.0) return absl::OkStatus();
  if (!streams) return absl::InvalidArgumentError(fmt::format("{}: dropout {} without streams", where, p));
  d->on = true;
  d->threshold = DropoutKeepThreshold(p);
  d->scale = static_cast<float>(1.0 / (1.0 - p));
  d->seed = seed;
  d->streams = streams;
  return absl::OkStatus();
}

// Where the heads lie in a token's row of the fused QKV (Megatron's order: per query group its
// per_group query heads, then its key and value heads; one group per head without GQA): query head
// h = g * per_group + i is at column (g * (per_group + 2) + i) * hd, its key at
// (g * (per_group + 2) + per_group) * hd, the value one head further. The products go over the
// groups in one batched call per head index i within a group (the stride from group to group is
// group_stride for q, k, v and per_group heads for the probabilities, the output and the scratch):
// without GQA that is one call over every head, as before. Multi-latent attention's value heads are
// s.v_dim() wide (a group: per_group query heads and a key of hd, a value of vd).
struct Heads {
  int64_t per_group, groups, width, group_stride, vd;
  explicit Heads(const AttentionShape& s)
      : per_group(s.nh / s.groups()),
        groups(s.groups()),
        width(s.qkv_width()),
        group_stride((s.nh / s.groups() + 1) * s.hd + s.v_dim()),
        vd(s.v_dim()) {}
  int64_t Query(int64_t i, int64_t hd) const { return i * hd; }
  int64_t Key(int64_t hd) const { return per_group * hd; }
  int64_t Value(int64_t hd) const { return (per_group + 1) * hd; }
};

}  // namespace ptk::cuda::attention_detail
