// LayerNorm over the last dimension on the device, forward (optionally with the residual add in
// front); its backward is layernorm_backward_cuda.cu, the arithmetic both share layernorm_math.cuh.
// As the CPU op: statistics in double over the row (two passes: mean, then the squared deviations),
// y = float((x - mean) * rstd) * w + b with the product and the sum rounded apart (no contraction:
// fp32 forward gives the CPU's bits up to the order of the double sums and the multiply-adds of the
// squares), mean and rstd stored as fp32; backward in double per element (two multiply-adds where
// the CPU rounds the products apart), dinp +=, and the weight gradients reduced without atomics.
//
// Hidden dropout fused in (the masks of DropoutRows, indexed per token row by TokenDropoutAt of
// trainer/counter_rng.h): the forward drops the branch before the residual add, the dropped value
// rounded to T as the standalone pass stores it; the backward writes the masked gradient of the
// branch beside dinp, from dinp rounded to T as stored. So either is bitwise the standalone pass
// followed (forward) or preceded (backward) by the plain kernel: the dropped value is DropoutRows'
// own function (kernel::DropoutScaled), and every rounding of the norm's arithmetic is spelled out
// in functions all the kernels call (layernorm_math.cuh), so nvcc cannot contract one kernel's
// multiply-adds differently from another's.
#include <cmath>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/layernorm_math.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using layernorm_detail::AddSquaredDeviation;
using layernorm_detail::AffineOut;
using layernorm_detail::CheckDropout;
using layernorm_detail::Normalized;
using layernorm_detail::ResolveDrop;
using layernorm_detail::RowDrop;

constexpr int kForwardThreads = 256;  // one warp per row, 8 rows at a time

// What the forward kernel normalises: a (kPlain); resid_out = a + b (kAdd); resid_out = a +
// dropout(b) (kAddDropout); resid_out = dropout(b) (kDropout, a unused; b may be resid_out).
enum ForwardMode { kPlain = 0, kAdd = 1, kAddDropout = 2, kDropout = 3 };

template <typename T, int N, int kMode>
__global__ void LayerNormForwardKernel(T* resid_out, T* out, float* mean, float* rstd, const T* a, const T* b,
                                       const float* w, const float* bias, int64_t n, int64_t c, double eps,
                                       RowDrop drop) {
  constexpr bool kResidual = kMode != kPlain, kDrop = kMode == kAddDropout || kMode == kDropout;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = blockDim.x >> 5;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); row < n; row += stride) {
    const int64_t off = row * c;
    // With the residual, the stored (rounded) sum is what is normalised, as the CPU model does.
    const T* x = kResidual ? resid_out + off : a + off;
    uint64_t key = 0, first = 0;
    if constexpr (kDrop) drop.Row(row, c, &key, &first);
    double sum = 0;
    for (int64_t j = static_cast<int64_t>(lane) * N; j < c; j += 32 * N) {
      float v[N];
      if constexpr (kResidual) {
        float u[N];
        kernel::LoadFloats<N>(b + off + j, u);
        if constexpr (kDrop) {
#pragma unroll
          for (int k = 0; k < N; ++k) u[k] = drop.template Apply<T>(u[k], key, first + static_cast<uint64_t>(j + k));
        }
        if constexpr (kMode == kDropout) {
#pragma unroll
          for (int k = 0; k < N; ++k) v[k] = u[k];
        } else {
          kernel::LoadFloats<N>(a + off + j, v);
#pragma unroll
          for (int k = 0; k < N; ++k) v[k] = kernel::ResidualSum(v[k], u[k]);
        }
        kernel::StoreFloats<N>(resid_out + off + j, v);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = ToFloat(FromFloat<T>(v[k]));
      } else {
        kernel::LoadFloats<N>(x + j, v);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) sum += static_cast<double>(v[k]);
    }
    const double m = kernel::WarpSum(sum) / static_cast<double>(c);
    double var = 0;
    for (int64_t j = static_cast<int64_t>(lane) * N; j < c; j += 32 * N) {
      float v[N];
      kernel::LoadFloats<N>(x + j, v);
#pragma unroll
      for (int k = 0; k < N; ++k) var = AddSquaredDeviation(var, v[k], m);
    }
    const double r = 1.0 / sqrt(kernel::WarpSum(var) / static_cast<double>(c) + eps);
    for (int64_t j = static_cast<int64_t>(lane) * N; j < c; j += 32 * N) {
      float v[N], wv[N], bv[N];
      kernel::LoadFloats<N>(x + j, v);
      kernel::LoadFloats<N>(w + j, wv);
      kernel::LoadFloats<N>(bias + j, bv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = AffineOut(Normalized(v[k], m, r), wv[k], bv[k]);
      kernel::StoreFloats<N>(out + off + j, v);
    }
    if (lane == 0) {
      if (mean != nullptr) mean[row] = static_cast<float>(m);
      if (rstd != nullptr) rstd[row] = static_cast<float>(r);
    }
  }
}

template <typename T, int kMode>
absl::Status LaunchForward(T* resid_out, T* out, float* mean, float* rstd, const T* a, const T* b, const float* w,
                           const float* bias, int64_t n, int64_t c, double eps, const CudaContext& ctx,
                           RowDrop drop = {}) {
  constexpr int kV = kernel::kVec<T>;
  const bool vec = c % kV == 0 && kernel::Aligned(out, 16) && (kMode == kDropout || kernel::Aligned(a, 16)) &&
                   kernel::Aligned(w, 16) && kernel::Aligned(bias, 16) &&
                   (kMode == kPlain || (kernel::Aligned(b, 16) && kernel::Aligned(resid_out, 16)));
  const unsigned blocks = kernel::GridBlocks(n, kForwardThreads / 32, kernel::MaxBlocks(ctx));
  if (vec) {
    LayerNormForwardKernel<T, kV, kMode>
        <<<blocks, kForwardThreads, 0, ctx.stream>>>(resid_out, out, mean, rstd, a, b, w, bias, n, c, eps, drop);
  } else {
    LayerNormForwardKernel<T, 1, kMode>
        <<<blocks, kForwardThreads, 0, ctx.stream>>>(resid_out, out, mean, rstd, a, b, w, bias, n, c, eps, drop);
  }
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status LayerNormForward(T* out, float* mean, float* rstd, const T* inp, const float* w, const float* b, int64_t n,
                              int64_t c, double eps, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("LayerNormForward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError(fmt::format("{}: rows of no channels", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(b, "b", where));
  PTK_KERNEL_CHECK(LaunchForward<T, kPlain>(nullptr, out, mean, rstd, inp, nullptr, w, b, n, c, eps, ctx));
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualLayerNormForward(T* resid_out, T* out, float* mean, float* rstd, const T* a, const T* b,
                                      const float* w, const float* bias, int64_t n, int64_t c, double eps,
                                      const CudaContext& ctx, const LnDropout& drop) {
  auto where = [&] {
    return fmt::format("ResidualLayerNormForward<{}>(n={}, c={}, p={})", kernel::TypeName<T>(), n, c, drop.p);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  PTK_KERNEL_CHECK(CheckDropout(drop, n, where));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError(fmt::format("{}: rows of no channels", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(resid_out, "resid_out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(a, "a", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(b, "b", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(bias, "bias", where));
  if (drop.p > 0) {
    PTK_KERNEL_CHECK(
        LaunchForward<T, kAddDropout>(resid_out, out, mean, rstd, a, b, w, bias, n, c, eps, ctx, ResolveDrop(drop)));
  } else {
    PTK_KERNEL_CHECK(LaunchForward<T, kAdd>(resid_out, out, mean, rstd, a, b, w, bias, n, c, eps, ctx));
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status DropoutLayerNormForward(T* inout, T* out, float* mean, float* rstd, const float* w, const float* bias,
                                     int64_t n, int64_t c, double eps, const LnDropout& drop, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("DropoutLayerNormForward<{}>(n={}, c={}, p={})", kernel::TypeName<T>(), n, c, drop.p);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  PTK_KERNEL_CHECK(CheckDropout(drop, n, where));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError(fmt::format("{}: rows of no channels", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inout, "inout", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(bias, "bias", where));
  if (drop.p > 0) {
    PTK_KERNEL_CHECK(
        LaunchForward<T, kDropout>(inout, out, mean, rstd, nullptr, inout, w, bias, n, c, eps, ctx, ResolveDrop(drop)));
  } else {
    PTK_KERNEL_CHECK(LaunchForward<T, kPlain>(nullptr, out, mean, rstd, inout, nullptr, w, bias, n, c, eps, ctx));
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                      \
  template absl::Status LayerNormForward<T>(T*, float*, float*, const T*, const float*, const float*, int64_t,  \
                                            int64_t, double, const CudaContext&);                               \
  template absl::Status ResidualLayerNormForward<T>(T*, T*, float*, float*, const T*, const T*, const float*,   \
                                                    const float*, int64_t, int64_t, double, const CudaContext&, \
                                                    const LnDropout&);                                          \
  template absl::Status DropoutLayerNormForward<T>(T*, T*, float*, float*, const float*, const float*, int64_t, \
                                                   int64_t, double, const LnDropout&, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
