// Multi-latent attention's assembly, its gradient's split and the column copy (mla_ops_cuda.h), as
// trainer/cpu/mla_cpu.cpp's MlaQkvForward / MlaQkvBackward loops.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/mla_ops_cuda.h"

namespace ptk::cuda {
namespace {

// MLA's rotation of channel p of a pe-wide vector x (channels (2j, 2j + 1) to (j, j + pe/2); x2j points at x[2j],
// j = p mod pe/2): cpu RotateForward's out[j] = x1 c - x2 s, out[half + j] = x2 c + x1 s.
template <typename T>
__device__ __forceinline__ float RotatedAt(const T* x2j, int64_t p, int64_t half, const float* cs, const float* sn) {
  const int64_t j = p < half ? p : p - half;
  const float a = ToFloat(x2j[0]), b = ToFloat(x2j[1]), c = cs[j], s = sn[j];
  return p < half ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)) : __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}
// Its transpose's channel p (cpu RotateBackward): dx[2j] = d1 c + d2 s, dx[2j + 1] = d2 c - d1 s.
template <typename T>
__device__ __forceinline__ float RotatedBackAt(const T* dout, int64_t p, int64_t half, const float* cs,
                                               const float* sn) {
  const int64_t j = p / 2;
  const float d1 = ToFloat(dout[j]), d2 = ToFloat(dout[half + j]), c = cs[j], s = sn[j];
  return p % 2 == 0 ? __fadd_rn(__fmul_rn(d1, c), __fmul_rn(d2, s)) : __fsub_rn(__fmul_rn(d2, c), __fmul_rn(d1, s));
}

// One block per token row; its threads over the row's width.
template <typename T>
__global__ void AssembleKernel(T* qkv, const T* q, const T* kvu, const T* kvd, const float* cos, const float* sin,
                               MlaDims d) {
  const int64_t i = blockIdx.x, half = d.pe / 2, dq = d.qk + d.pe, head = 2 * dq + d.v, width = d.heads * head;
  const int64_t kvw = d.kv_lora + d.pe, kvh = d.qk + d.v;
  const float* cs = cos + (i % d.t) * half;
  const float* sn = sin + (i % d.t) * half;
  const T* qi = q + i * d.heads * dq;
  const T* kvui = kvu + i * d.heads * kvh;
  const T* kpe = kvd + i * kvw + d.kv_lora;
  for (int64_t e = threadIdx.x; e < width; e += blockDim.x) {
    const int64_t h = e / head, col = e % head;
    T out;
    if (col < d.qk) {
      out = qi[h * dq + col];
    } else if (col < dq) {
      const int64_t p = col - d.qk, j = p < half ? p : p - half;
      out = FromFloat<T>(RotatedAt(qi + h * dq + d.qk + 2 * j, p, half, cs, sn));
    } else if (col < dq + d.qk) {
      out = kvui[h * kvh + col - dq];
    } else if (col < 2 * dq) {
      const int64_t p = col - dq - d.qk, j = p < half ? p : p - half;
      out = FromFloat<T>(RotatedAt(kpe + 2 * j, p, half, cs, sn));
    } else {
      out = kvui[h * kvh + d.qk + col - 2 * dq];
    }
    qkv[i * width + e] = out;
  }
}

template <typename T>
__global__ void SplitGradKernel(T* dq, T* dkvu, T* dkvd, const T* dqkv, const float* cos, const float* sin, MlaDims d) {
  const int64_t i = blockIdx.x, half = d.pe / 2, dqw = d.qk + d.pe, head = 2 * dqw + d.v, width = d.heads * head;
  const int64_t kvh = d.qk + d.v, kvw = d.kv_lora + d.pe;
  const float* cs = cos + (i % d.t) * half;
  const float* sn = sin + (i % d.t) * half;
  const T* row = dqkv + i * width;
  for (int64_t e = threadIdx.x; e < d.heads * dqw; e += blockDim.x) {
    const int64_t h = e / dqw, col = e % dqw;
    dq[i * d.heads * dqw + e] =
        col < d.qk ? row[h * head + col] : FromFloat<T>(RotatedBackAt(row + h * head + d.qk, col - d.qk, half, cs, sn));
  }
  for (int64_t e = threadIdx.x; e < d.heads * kvh; e += blockDim.x) {
    const int64_t h = e / kvh, col = e % kvh;
    dkvu[i * d.heads * kvh + e] = col < d.qk ? row[h * head + dqw + col] : row[h * head + 2 * dqw + col - d.qk];
  }
  for (int64_t p = threadIdx.x; p < d.pe; p += blockDim.x) {  // the shared rotary key: summed over the heads in order
    float acc = 0.0f;
    for (int64_t h = 0; h < d.heads; ++h)
      acc = __fadd_rn(acc, RotatedBackAt(row + h * head + dqw + d.qk, p, half, cs, sn));
    dkvd[i * kvw + d.kv_lora + p] = FromFloat<T>(acc);
  }
}

template <typename T>
__global__ void CopyColumnsKernel(T* out, int64_t out_stride, const T* in, int64_t in_stride, int64_t n, int64_t cols) {
  const int64_t total = n * cols, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += stride)
    out[(k / cols) * out_stride + k % cols] = in[(k / cols) * in_stride + k % cols];
}

template <typename Where>
absl::Status CheckDims(const MlaDims& d, const Where& where) {
  if (d.n < 0 || d.t < 1 || d.heads < 1 || d.qk < 0 || d.pe < 2 || d.pe % 2 != 0 || d.v < 1 || d.kv_lora < 1 ||
      d.n % d.t != 0)
    return absl::InvalidArgumentError(where() +
                                      ": the rows must be whole samples of t, the rotary channels even and "
                                      "at least 2, the heads, value and latent widths positive");
  if (d.n > 2147483647) return absl::InvalidArgumentError(where() + ": rows beyond one launch's grid");
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status MlaAssembleQkv(T* qkv, const T* q, const T* kvu, const T* kvd, const float* cos, const float* sin,
                            const MlaDims& d, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MlaAssembleQkv<{}>(n={}, t={}, heads={}, qk={}, pe={}, v={}, kv_lora={})",
                       kernel::TypeName<T>(), d.n, d.t, d.heads, d.qk, d.pe, d.v, d.kv_lora);
  };
  PTK_KERNEL_CHECK(CheckDims(d, where));
  if (d.n == 0) return absl::OkStatus();
  for (const void* p : {static_cast<const void*>(qkv), static_cast<const void*>(q), static_cast<const void*>(kvu),
                        static_cast<const void*>(kvd), static_cast<const void*>(cos), static_cast<const void*>(sin)})
    PTK_KERNEL_CHECK(kernel::CheckPointer(p, "qkv, q, kvu, kvd, cos and sin", where));
  AssembleKernel<T><<<static_cast<unsigned>(d.n), kernel::RowThreads(d.width(), 256), 0, ctx.stream>>>(qkv, q, kvu, kvd,
                                                                                                       cos, sin, d);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MlaSplitQkvGrad(T* dq, T* dkvu, T* dkvd, const T* dqkv, const float* cos, const float* sin,
                             const MlaDims& d, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MlaSplitQkvGrad<{}>(n={}, t={}, heads={}, qk={}, pe={}, v={}, kv_lora={})",
                       kernel::TypeName<T>(), d.n, d.t, d.heads, d.qk, d.pe, d.v, d.kv_lora);
  };
  PTK_KERNEL_CHECK(CheckDims(d, where));
  if (d.n == 0) return absl::OkStatus();
  for (const void* p : {static_cast<const void*>(dq), static_cast<const void*>(dkvu), static_cast<const void*>(dkvd),
                        static_cast<const void*>(dqkv), static_cast<const void*>(cos), static_cast<const void*>(sin)})
    PTK_KERNEL_CHECK(kernel::CheckPointer(p, "dq, dkvu, dkvd, dqkv, cos and sin", where));
  SplitGradKernel<T><<<static_cast<unsigned>(d.n), kernel::RowThreads(d.heads * d.dq(), 256), 0, ctx.stream>>>(
      dq, dkvu, dkvd, dqkv, cos, sin, d);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status CopyColumns(T* out, int64_t out_stride, const T* in, int64_t in_stride, int64_t n, int64_t cols,
                         const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("CopyColumns<{}>(n={}, cols={}, strides {} <- {})", kernel::TypeName<T>(), n, cols, out_stride,
                       in_stride);
  };
  if (n < 0 || cols < 0 || out_stride < cols || in_stride < cols)
    return absl::InvalidArgumentError(where() + ": the row strides must hold the columns");
  if (n == 0 || cols == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(in, "in", where));
  constexpr int kThreads = 256;
  CopyColumnsKernel<T><<<kernel::GridBlocks(n * cols, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      out, out_stride, in, in_stride, n, cols);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                   \
  template absl::Status MlaAssembleQkv<T>(T*, const T*, const T*, const T*, const float*, const float*,      \
                                          const MlaDims&, const CudaContext&);                               \
  template absl::Status MlaSplitQkvGrad<T>(T*, T*, T*, const T*, const float*, const float*, const MlaDims&, \
                                           const CudaContext&);                                              \
  template absl::Status CopyColumns<T>(T*, int64_t, const T*, int64_t, int64_t, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
