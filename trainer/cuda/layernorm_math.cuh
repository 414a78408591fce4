// What LayerNorm's forward (layernorm_cuda.cu) and backward (layernorm_backward_cuda.cu) kernels
// share: the fused hidden dropout resolved for a kernel (RowDrop, the masks of DropoutRows indexed
// per token row by TokenDropoutAt of trainer/counter_rng.h), its argument check, and the
// per-element arithmetic of every LayerNorm kernel with each rounding spelled out, so that the
// plain and the fused kernels of both files run one instruction sequence (cuda_fmad_test holds both
// files to it).
#pragma once

#include <fmt/core.h>

#include <cstdint>

#include "trainer/counter_rng.h"
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::layernorm_detail {

// The dropout of a fused kernel, resolved on the host (LnDropout's p as the threshold and scale).
struct RowDrop {
  const uint64_t* streams = nullptr;
  int64_t seq_len = 1;
  uint64_t seed = 0;
  uint32_t threshold = 0;
  float scale = 1.0f;
  // Token row `row`'s key and the mask index of its element 0.
  __device__ __forceinline__ void Row(int64_t row, int64_t c, uint64_t* key, uint64_t* first) const {
    const TokenDropoutIndex at = TokenDropoutAt(row, seq_len, c);
    *key = DropoutKey(seed, streams[at.sample]);
    *first = at.first;
  }
  // v dropped at mask index i (DropoutRows' own DropoutScaled), rounded to T as DropoutRows stores it.
  template <typename T>
  __device__ __forceinline__ float Apply(float v, uint64_t key, uint64_t i) const {
    return ToFloat(FromFloat<T>(kernel::DropoutScaled(DropoutKeepKeyed(key, i, threshold), v, scale)));
  }
};

inline RowDrop ResolveDrop(const LnDropout& d) {
  return RowDrop{d.streams, d.seq_len, d.seed, DropoutKeepThreshold(d.p), static_cast<float>(1.0 / (1.0 - d.p))};
}

// A fused dropout's settings checked against n rows: p in [0, 1], the streams with p > 0, whole
// samples of seq_len rows.
template <typename Where>
absl::Status CheckDropout(const LnDropout& d, int64_t n, Where where) {
  if (!(d.p >= 0.0 && d.p <= 1.0))
    return absl::InvalidArgumentError(fmt::format("{}: the dropout probability {} is not in [0, 1]", where(), d.p));
  if (d.p == 0.0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(d.streams, "the dropout streams", where));
  if (d.seq_len <= 0 || n % d.seq_len != 0)
    return absl::InvalidArgumentError(
        fmt::format("{}: dropout over samples of seq_len={} rows, which do not tile n={}", where(), d.seq_len, n));
  return absl::OkStatus();
}

// The per-element arithmetic of every LayerNorm kernel, written once with each rounding spelled out.
// nvcc's default --fmad=true contracts a * b + c into a multiply-add at its discretion, kernel by
// kernel, so two kernels compiled from like source need not round alike; through these functions
// the plain and the fused kernels (the four forward modes; backward with and without the branch
// gradient, a warp per row and rows in series) run one instruction sequence on the same values, so
// the same bits. The multiply-adds are those nvcc chose unprompted (checked in the SASS): no result
// and no instruction count changes.

// The running sum of squared deviations: d = x - mean, then acc + d * d as one multiply-add.
__device__ __forceinline__ double AddSquaredDeviation(double acc, float x, double m) {
  const double d = __dsub_rn(static_cast<double>(x), m);
  return __fma_rn(d, d, acc);
}
// xhat = (x - mean) * rstd, in double.
__device__ __forceinline__ double Normalized(float x, double m, double r) {
  return __dmul_rn(__dsub_rn(static_cast<double>(x), m), r);
}
// y = float(xhat) * w + b, the product and the sum rounded apart (the CPU op's roundings).
__device__ __forceinline__ float AffineOut(double xhat, float w, float b) {
  return __fadd_rn(__fmul_rn(static_cast<float>(xhat), w), b);
}
// One element's share of the backward row sums (s1 += dxhat, s2 += dxhat * xhat as a multiply-add,
// dxhat = dy * w) and of the weight-gradient partials (pw += float(dy * xhat), pb += dy).
__device__ __forceinline__ void AccumulateBackward(float x, float dy, float w, double m, double r, double& s1,
                                                   double& s2, float& pw, float& pb) {
  const double xhat = Normalized(x, m, r);
  const double dxhat = __dmul_rn(static_cast<double>(dy), static_cast<double>(w));
  s1 = __dadd_rn(s1, dxhat);
  s2 = __fma_rn(dxhat, xhat, s2);
  pw = __fadd_rn(pw, static_cast<float>(__dmul_rn(static_cast<double>(dy), xhat)));
  pb = __fadd_rn(pb, dy);
}
// g + float(r * (dxhat - s1 - xhat * s2)), s1 and s2 the row means: dy * w - s1 and then - xhat * s2
// as two multiply-adds.
__device__ __forceinline__ float AddInputGrad(float g, float x, float dy, float w, double m, double r, double s1,
                                              double s2) {
  const double xhat = Normalized(x, m, r);
  const double t = __fma_rn(static_cast<double>(dy), static_cast<double>(w), -s1);
  return __fadd_rn(g, static_cast<float>(__dmul_rn(r, __fma_rn(-xhat, s2, t))));
}

}  // namespace ptk::cuda::layernorm_detail
