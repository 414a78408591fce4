// LayerNorm over the last dimension on the device, forward (optionally with the residual add in
// front) and backward. As the CPU op: statistics in double over the row (two passes: mean, then
// the squared deviations), y = float((x - mean) * rstd) * w + b with the product and the sum
// rounded apart (no contraction: fp32 forward gives the CPU's bits up to the order of the double
// sums and the multiply-adds of the squares), mean and rstd stored as fp32; backward in double per
// element (two multiply-adds where the CPU rounds the products apart), dinp +=, and the weight
// gradients reduced without atomics: per-block partial sums (each channel owned by one thread, the
// block's rows in order) into a scratch, then a second kernel sums the partials in a fixed order
// in double and adds them to dw, db.
//
// Hidden dropout fused in (the masks of DropoutRows, indexed per token row by TokenDropoutAt of
// trainer/counter_rng.h): the forward drops the branch before the residual add, the dropped value
// rounded to T as the standalone pass stores it; the backward writes the masked gradient of the
// branch beside dinp, from dinp rounded to T as stored. So either is bitwise the standalone pass
// followed (forward) or preceded (backward) by the plain kernel: the dropped value is DropoutRows'
// own function (kernel::DropoutScaled), and every rounding of the norm's arithmetic is spelled out
// in functions all the kernels call (below), so nvcc cannot contract one kernel's multiply-adds
// differently from another's.
#include <cmath>

#include "trainer/counter_rng.h"
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kForwardThreads = 256;  // one warp per row, 8 rows at a time
constexpr int kBackwardMaxThreads = 512;
constexpr int64_t kBackwardMinRows = 16;     // rows per block at least...
constexpr int64_t kBackwardMaxBlocks = 512;  // ...and at most this many blocks (a function of n only)
constexpr int kBackwardWarps = 4;            // rows in flight per block (LayerNormBackwardWarpKernel)
constexpr int kReduceGroups = 8;             // the second kernel: 8 interleaved groups of partials per channel

int64_t BackwardBlocks(int64_t n) {
  int64_t b = CeilDiv(n, kBackwardMinRows);
  if (b < 1) b = 1;
  return b < kBackwardMaxBlocks ? b : kBackwardMaxBlocks;
}

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

RowDrop ResolveDrop(const LnDropout& d) {
  return RowDrop{d.streams, d.seq_len, d.seed, DropoutKeepThreshold(d.p), static_cast<float>(1.0 / (1.0 - d.p))};
}

// The per-element arithmetic of every kernel here, written once with each rounding spelled out.
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

// dinp's values g (rounded to T on the store); with kDrop, dbranch = dropout(g as stored), and
// where dbranch is dinp only the masked gradient is kept.
template <typename T, int N, bool kDrop>
__device__ __forceinline__ void StoreGrad(T* dinp, T* dbranch, const float (&g)[N], const RowDrop& drop, uint64_t key,
                                          uint64_t i) {
  if constexpr (kDrop) {
    float h[N];
#pragma unroll
    for (int k = 0; k < N; ++k) h[k] = drop.template Apply<T>(ToFloat(FromFloat<T>(g[k])), key, i + k);
    if (dbranch != dinp) kernel::StoreFloats<N>(dinp, g);
    kernel::StoreFloats<N>(dbranch, h);
  } else {
    kernel::StoreFloats<N>(dinp, g);
  }
}

// Block k takes rows [k * rows_per_block, ...) in order; thread t owns the channel packs t,
// t + blockDim, ... of every row (so the shared partials need no synchronisation).
template <typename T, int N, bool kDrop>
__global__ void LayerNormBackwardKernel(T* dinp, T* dbranch, RowDrop drop, float* scratch, const T* dout, const T* inp,
                                        const float* w, const float* mean, const float* rstd, int64_t n, int64_t c,
                                        int64_t rows_per_block) {
  extern __shared__ float part[];  // dw partials [c], db partials [c]
  __shared__ double red[66];
  const int64_t step = static_cast<int64_t>(blockDim.x) * N;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * N;
  for (int64_t j = first; j < c; j += step) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      part[j + k] = 0.0f;
      part[c + j + k] = 0.0f;
    }
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < n ? r0 + rows_per_block : n;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t off = row * c;
    const double m = mean[row], r = rstd[row];
    uint64_t key = 0, first_i = 0;
    if constexpr (kDrop) drop.Row(row, c, &key, &first_i);
    // dxhat = dy * w; dx = r * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    double s1 = 0, s2 = 0;
    for (int64_t j = first; j < c; j += step) {
      float x[N], dy[N], wv[N];
      kernel::LoadFloats<N>(inp + off + j, x);
      kernel::LoadFloats<N>(dout + off + j, dy);
      kernel::LoadFloats<N>(w + j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) AccumulateBackward(x[k], dy[k], wv[k], m, r, s1, s2, part[j + k], part[c + j + k]);
    }
    kernel::BlockSum2(s1, s2, red);
    s1 /= static_cast<double>(c);
    s2 /= static_cast<double>(c);
    for (int64_t j = first; j < c; j += step) {
      float x[N], dy[N], wv[N], g[N];
      kernel::LoadFloats<N>(inp + off + j, x);
      kernel::LoadFloats<N>(dout + off + j, dy);
      kernel::LoadFloats<N>(w + j, wv);
      kernel::LoadFloats<N>(dinp + off + j, g);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = AddInputGrad(g[k], x[k], dy[k], wv[k], m, r, s1, s2);
      StoreGrad<T, N, kDrop>(dinp + off + j, kDrop ? dbranch + off + j : nullptr, g, drop, key,
                             first_i + static_cast<uint64_t>(j));
    }
  }
  float* mine = scratch + static_cast<int64_t>(blockIdx.x) * 2 * c;
  for (int64_t j = first; j < c; j += step) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      mine[j + k] = part[j + k];
      mine[c + j + k] = part[c + j + k];
    }
  }
}

// A warp per row, kBackwardWarps rows in flight per block: block k takes rows
// [k * rows_per_block, ...), warp w of it rows w, w + kBackwardWarps, ... of those, in order; lane t
// owns the channel packs t, t + 32, ... of every row. The row sums are warp shuffles (no block
// barrier per row); each warp adds its rows' dw/db terms to partials of its own in shared memory,
// and at the end the block adds its warps' partials in warp order: a fixed order for a given n.
template <typename T, int N, bool kDrop>
__global__ void LayerNormBackwardWarpKernel(T* dinp, T* dbranch, RowDrop drop, float* scratch, const T* dout,
                                            const T* inp, const float* w, const float* mean, const float* rstd,
                                            int64_t n, int64_t c, int64_t rows_per_block) {
  extern __shared__ float part[];  // per warp: dw partials [c], db partials [c]
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  float* mine = part + static_cast<int64_t>(warp) * 2 * c;
  const int64_t step = 32 * N;
  const int64_t first = static_cast<int64_t>(lane) * N;
  for (int64_t j = first; j < c; j += step) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      mine[j + k] = 0.0f;
      mine[c + j + k] = 0.0f;
    }
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < n ? r0 + rows_per_block : n;
  for (int64_t row = r0 + warp; row < r1; row += kBackwardWarps) {
    const int64_t off = row * c;
    const double m = mean[row], r = rstd[row];
    uint64_t key = 0, first_i = 0;
    if constexpr (kDrop) drop.Row(row, c, &key, &first_i);
    double s1 = 0, s2 = 0;
    for (int64_t j = first; j < c; j += step) {
      float x[N], dy[N], wv[N];
      kernel::LoadFloats<N>(inp + off + j, x);
      kernel::LoadFloats<N>(dout + off + j, dy);
      kernel::LoadFloats<N>(w + j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) AccumulateBackward(x[k], dy[k], wv[k], m, r, s1, s2, mine[j + k], mine[c + j + k]);
    }
    s1 = kernel::WarpSum(s1) / static_cast<double>(c);
    s2 = kernel::WarpSum(s2) / static_cast<double>(c);
    for (int64_t j = first; j < c; j += step) {
      float x[N], dy[N], wv[N], g[N];
      kernel::LoadFloats<N>(inp + off + j, x);
      kernel::LoadFloats<N>(dout + off + j, dy);
      kernel::LoadFloats<N>(w + j, wv);
      kernel::LoadFloats<N>(dinp + off + j, g);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = AddInputGrad(g[k], x[k], dy[k], wv[k], m, r, s1, s2);
      StoreGrad<T, N, kDrop>(dinp + off + j, kDrop ? dbranch + off + j : nullptr, g, drop, key,
                             first_i + static_cast<uint64_t>(j));
    }
  }
  __syncthreads();
  float* out = scratch + static_cast<int64_t>(blockIdx.x) * 2 * c;
  for (int64_t j = threadIdx.x; j < 2 * c; j += blockDim.x) {
    float s = part[j];
    for (int v = 1; v < kBackwardWarps; ++v) s += part[static_cast<int64_t>(v) * 2 * c + j];
    out[j] = s;
  }
}

// dw[j] += sum over blocks of the partials, in double, in a fixed order: group y (threadIdx.y)
// sums blocks y, y + 8, ... in order, then the 8 groups are added in order.
__global__ void LayerNormBackwardReduceKernel(float* dw, float* db, const float* scratch, int64_t blocks, int64_t c) {
  __shared__ double sw[kReduceGroups][32], sb[kReduceGroups][32];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  double aw = 0, ab = 0;
  if (j < c) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < blocks; k += kReduceGroups) {
      aw += static_cast<double>(scratch[k * 2 * c + j]);
      ab += static_cast<double>(scratch[k * 2 * c + c + j]);
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && j < c) {
    double tw = 0, tb = 0;
#pragma unroll
    for (int y = 0; y < kReduceGroups; ++y) {
      tw += sw[y][threadIdx.x];
      tb += sb[y][threadIdx.x];
    }
    dw[j] += static_cast<float>(tw);
    db[j] += static_cast<float>(tb);
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

// Raises `kernel_fn`'s dynamic shared memory limit to `smem` bytes where the launch needs it: when
// the dynamic bytes and the kernel's own static shared memory (the rows-in-series kernel's block sums)
// together pass 48 KiB (NeedsSharedMemoryOptIn).
template <typename T, typename Kernel>
absl::Status AllowSharedMemory(Kernel* kernel_fn, int64_t smem, int64_t n, int64_t c) {
  const auto where = [&] { return fmt::format("LayerNormBackward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  cudaFuncAttributes attr{};
  PTK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel_fn), where());
  if (NeedsSharedMemoryOptIn(smem, static_cast<int64_t>(attr.sharedSizeBytes)))
    PTK_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
        fmt::format("{}: {} bytes of dynamic shared memory beside the kernel's {}", where(), smem,
                    attr.sharedSizeBytes));
  return absl::OkStatus();
}

template <typename T, int N, bool kDrop>
absl::Status LaunchBackwardWarps(T* dinp, T* dbranch, RowDrop drop, float* scratch, const T* dout, const T* inp,
                                 const float* w, const float* mean, const float* rstd, int64_t n, int64_t c,
                                 const CudaContext& ctx, int64_t blocks, int64_t smem) {
  auto kernel_fn = LayerNormBackwardWarpKernel<T, N, kDrop>;
  PTK_KERNEL_CHECK(AllowSharedMemory<T>(kernel_fn, smem, n, c));
  kernel_fn<<<static_cast<unsigned>(blocks), 32 * kBackwardWarps, static_cast<size_t>(smem), ctx.stream>>>(
      dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, CeilDiv(n, blocks));
  return absl::OkStatus();
}

template <typename T, int N, bool kDrop>
absl::Status LaunchBackward(T* dinp, T* dbranch, RowDrop drop, float* scratch, const T* dout, const T* inp,
                            const float* w, const float* mean, const float* rstd, int64_t n, int64_t c,
                            const CudaContext& ctx, int64_t blocks, int64_t smem) {
  auto kernel_fn = LayerNormBackwardKernel<T, N, kDrop>;
  PTK_KERNEL_CHECK(AllowSharedMemory<T>(kernel_fn, smem, n, c));
  const int threads = kernel::RowThreads(CeilDiv(c, N), kBackwardMaxThreads);
  kernel_fn<<<static_cast<unsigned>(blocks), threads, static_cast<size_t>(smem), ctx.stream>>>(
      dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, CeilDiv(n, blocks));
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

int64_t LayerNormBackwardScratch(int64_t n, int64_t c) { return BackwardBlocks(n) * 2 * (c > 0 ? c : 0); }

namespace {

template <typename T, bool kDrop>
absl::Status LaunchBackwardFor(T* dinp, T* dbranch, RowDrop drop, float* scratch, const T* dout, const T* inp,
                               const float* w, const float* mean, const float* rstd, int64_t n, int64_t c,
                               const CudaContext& ctx, bool rows_in_series, int64_t smem, int smem_max) {
  const int64_t blocks = BackwardBlocks(n);
  constexpr int kV = kernel::kVec<T>;
  const bool vec = c % kV == 0 && kernel::Aligned(dinp, 16) && kernel::Aligned(dout, 16) && kernel::Aligned(inp, 16) &&
                   kernel::Aligned(w, 16) && kernel::Aligned(scratch, 16) && (!kDrop || kernel::Aligned(dbranch, 16));
  // A warp per row where every warp's partials fit in shared memory; else the block's rows in
  // series (one set of partials), which is also the oracle the warp kernel is tested against.
  const int64_t warp_smem = kBackwardWarps * smem;
  if (!rows_in_series && warp_smem + 2048 <= smem_max) {
    if (vec)
      return LaunchBackwardWarps<T, kV, kDrop>(dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, ctx,
                                               blocks, warp_smem);
    return LaunchBackwardWarps<T, 1, kDrop>(dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, ctx, blocks,
                                            warp_smem);
  }
  if (vec)
    return LaunchBackward<T, kV, kDrop>(dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, ctx, blocks,
                                        smem);
  return LaunchBackward<T, 1, kDrop>(dinp, dbranch, drop, scratch, dout, inp, w, mean, rstd, n, c, ctx, blocks, smem);
}

template <typename T>
absl::Status LayerNormBackwardImpl(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                                   const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                                   const CudaContext& ctx, T* dbranch, const LnDropout& drop, bool rows_in_series) {
  auto where = [&] {
    return fmt::format("LayerNormBackward<{}>(n={}, c={}, p={})", kernel::TypeName<T>(), n, c, drop.p);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  PTK_KERNEL_CHECK(CheckDropout(drop, n, where));
  if ((drop.p > 0) != (dbranch != nullptr))
    return absl::InvalidArgumentError(
        fmt::format("{}: the branch gradient (dbranch) is written with dropout and only then", where()));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dinp, "dinp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dw, "dw", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(db, "db", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(mean, "mean", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(rstd, "rstd", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(scratch, "scratch", where));
  const int64_t smem = 2 * c * static_cast<int64_t>(sizeof(float));
  int smem_max = 0;
  PTK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx.device),
                           where());
  // The kernel's own static shared memory (the block sums) comes on top of the partials.
  if (smem + 2048 > smem_max) {
    return absl::InvalidArgumentError(
        fmt::format("{}: the weight-gradient partials take {} bytes of shared memory per block, more than the "
                    "device's {} (c at most {})",
                    where(), smem, smem_max, (smem_max - 2048) / 8));
  }
  if (dbranch != nullptr) {
    PTK_KERNEL_CHECK(LaunchBackwardFor<T, true>(dinp, dbranch, ResolveDrop(drop), scratch, dout, inp, w, mean, rstd, n,
                                                c, ctx, rows_in_series, smem, smem_max));
  } else {
    PTK_KERNEL_CHECK(LaunchBackwardFor<T, false>(dinp, nullptr, RowDrop{}, scratch, dout, inp, w, mean, rstd, n, c, ctx,
                                                 rows_in_series, smem, smem_max));
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  LayerNormBackwardReduceKernel<<<static_cast<unsigned>(CeilDiv(c, 32)), dim3(32, kReduceGroups), 0, ctx.stream>>>(
      dw, db, scratch, BackwardBlocks(n), c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status LayerNormBackward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                               const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                               const CudaContext& ctx, T* dbranch, const LnDropout& drop) {
  return LayerNormBackwardImpl(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx, dbranch, drop, false);
}

template <typename T>
absl::Status LayerNormBackwardRowsInSeries(T* dinp, float* dw, float* db, const T* dout, const T* inp, const float* w,
                                           const float* mean, const float* rstd, int64_t n, int64_t c, float* scratch,
                                           const CudaContext& ctx, T* dbranch, const LnDropout& drop) {
  return LayerNormBackwardImpl(dinp, dw, db, dout, inp, w, mean, rstd, n, c, scratch, ctx, dbranch, drop, true);
}

#define PTK_INSTANTIATE(T)                                                                                       \
  template absl::Status LayerNormForward<T>(T*, float*, float*, const T*, const float*, const float*, int64_t,   \
                                            int64_t, double, const CudaContext&);                                \
  template absl::Status ResidualLayerNormForward<T>(T*, T*, float*, float*, const T*, const T*, const float*,    \
                                                    const float*, int64_t, int64_t, double, const CudaContext&,  \
                                                    const LnDropout&);                                           \
  template absl::Status DropoutLayerNormForward<T>(T*, T*, float*, float*, const float*, const float*, int64_t,  \
                                                   int64_t, double, const LnDropout&, const CudaContext&);       \
  template absl::Status LayerNormBackward<T>(T*, float*, float*, const T*, const T*, const float*, const float*, \
                                             const float*, int64_t, int64_t, float*, const CudaContext&, T*,     \
                                             const LnDropout&);                                                  \
  template absl::Status LayerNormBackwardRowsInSeries<T>(T*, float*, float*, const T*, const T*, const float*,   \
                                                         const float*, const float*, int64_t, int64_t, float*,   \
                                                         const CudaContext&, T*, const LnDropout&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
