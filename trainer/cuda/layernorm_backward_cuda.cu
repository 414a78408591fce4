// LayerNorm's backward on the device, beside its forward (layernorm_cuda.cu, whose opening comment
// gives the arithmetic both follow; layernorm_math.cuh holds it): dinp += in double per element, and
// the weight gradients reduced without atomics: per-block partial sums (each channel owned by one
// thread, the block's rows in series; or a warp per row, four rows in flight per block) into a
// scratch, then a second kernel sums the partials in a fixed order in double and adds them to dw,
// db. With hidden dropout fused in, the masked gradient of the branch is written beside dinp.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/layernorm_math.cuh"
#include "trainer/cuda/layernorm_oracle.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using layernorm_detail::AccumulateBackward;
using layernorm_detail::AddInputGrad;
using layernorm_detail::CheckDropout;
using layernorm_detail::ResolveDrop;
using layernorm_detail::RowDrop;

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
