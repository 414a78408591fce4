// RMSNorm on the device, forward and backward, as the CPU op (trainer/cpu/rmsnorm_cpu.cpp): the
// statistics in double, the weight fp32 (a master weight: never rounded), the weight gradient summed
// over fixed 64-row blocks in double and the blocks then in order: the CPU op's order of additions.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int64_t kRowBlock = 64;  // as the CPU op's blocks
constexpr int kColumnThreads = 256;

// The forward's per-element arithmetic, written once with each rounding spelled out, so that the
// plain kernel and the one with the residual add in front run one instruction sequence (nvcc's
// default --fmad=true contracts a * b + c at its discretion, kernel by kernel): the sum of squares
// as multiply-adds, out = float(x * rstd) * w rounded apart. The multiply-adds are those nvcc chose
// unprompted (checked in the SASS).
__device__ __forceinline__ double AddSquare(double acc, double v) { return __fma_rn(v, v, acc); }
__device__ __forceinline__ float NormalizedScaled(float x, double r, float w) {
  return __fmul_rn(static_cast<float>(__dmul_rn(static_cast<double>(x), r)), w);
}

// One block per row: rstd = 1 / sqrt(mean(x^2) + eps) in double, out = float(x * rstd) * w. With
// kResidual the row normalised is resid_out = a + b (rounded to T; the stored sum, as the CPU model
// normalises it), else a. Each element is written and read again by the same thread, so resid_out
// may be a or b.
template <typename T, bool kResidual>
__global__ void RMSNormForwardKernel(T* resid_out, T* out, float* rstd, const T* a, const T* b, const float* w,
                                     int64_t c, double eps) {
  __shared__ double shared[66];
  const int64_t row = blockIdx.x;
  const T* x = (kResidual ? resid_out : a) + row * c;
  double ss = 0, unused = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    double v;
    if constexpr (kResidual) {
      const T sum = FromFloat<T>(kernel::ResidualSum(ToFloat(a[row * c + j]), ToFloat(b[row * c + j])));
      resid_out[row * c + j] = sum;
      v = ToFloat(sum);
    } else {
      v = ToFloat(x[j]);
    }
    ss = AddSquare(ss, v);
  }
  kernel::BlockSum2(ss, unused, shared);
  const double r = 1.0 / sqrt(ss / static_cast<double>(c) + eps);
  T* y = out + row * c;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    y[j] = FromFloat<T>(NormalizedScaled(ToFloat(x[j]), r, w[j]));
  }
  if (rstd && threadIdx.x == 0) rstd[row] = static_cast<float>(r);
}

// One block per row: dinp += r (dy w - x r mean(dy w x r)), the mean in double. The roundings spelled
// out as for the forward (the multiply-adds nvcc chose unprompted): the kernel's arithmetic does not
// depend on --fmad.
template <typename T>
__global__ void RMSNormBackwardRowKernel(T* dinp, const T* dout, const T* inp, const float* w, const float* rstd,
                                         int64_t c) {
  __shared__ double shared[66];
  const int64_t row = blockIdx.x;
  const T* x = inp + row * c;
  const T* dy = dout + row * c;
  T* dx = dinp + row * c;
  const double r = rstd[row];
  double dot = 0, unused = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
    dot = __fma_rn(__dmul_rn(ToFloat(dy[j]), w[j]), __dmul_rn(ToFloat(x[j]), r), dot);
  kernel::BlockSum2(dot, unused, shared);
  dot /= static_cast<double>(c);
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const double g = __dmul_rn(r, __fma_rn(ToFloat(dy[j]), w[j], -__dmul_rn(__dmul_rn(ToFloat(x[j]), r), dot)));
    dx[j] = FromFloat<T>(__fadd_rn(ToFloat(dx[j]), static_cast<float>(g)));
  }
}

// partial[blk * c + j] = sum over the block's rows, in order, of dy * x * r (double, one multiply-add
// per row).
template <typename T>
__global__ void RMSNormWeightPartialKernel(double* partial, const T* dout, const T* inp, const float* rstd, int64_t n,
                                           int64_t c) {
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const int64_t blk = blockIdx.x, end = (blk + 1) * kRowBlock < n ? (blk + 1) * kRowBlock : n;
  double s = 0;
  for (int64_t i = blk * kRowBlock; i < end; ++i)
    s = __fma_rn(ToFloat(dout[i * c + j]), __dmul_rn(ToFloat(inp[i * c + j]), rstd[i]), s);
  partial[blk * c + j] = s;
}

// dw[j] += the blocks' partials summed in block order.
__global__ void RMSNormWeightSumKernel(float* dw, const double* partial, int64_t blocks, int64_t c) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  double s = 0;
  for (int64_t b = 0; b < blocks; ++b) s += partial[b * c + j];
  dw[j] += static_cast<float>(s);
}

}  // namespace

int64_t RMSNormBackwardScratch(int64_t n, int64_t c) { return CeilDiv(n, kRowBlock) * c; }

template <typename T>
absl::Status RMSNormForward(T* out, float* rstd, const T* inp, const float* w, int64_t n, int64_t c, double eps,
                            const CudaContext& ctx) {
  auto where = [&] { return fmt::format("RMSNormForward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  if (n > 0x7fffffff) return absl::InvalidArgumentError(where() + ": more rows than one grid takes");
  RMSNormForwardKernel<T, false><<<static_cast<unsigned>(n), kernel::RowThreads(c, 1024), 0, ctx.stream>>>(
      nullptr, out, rstd, inp, nullptr, w, c, eps);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualRMSNormForward(T* resid_out, T* out, float* rstd, const T* a, const T* b, const float* w,
                                    int64_t n, int64_t c, double eps, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("ResidualRMSNormForward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(resid_out, "resid_out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(a, "a", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(b, "b", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(w, "w", where));
  if (n > 0x7fffffff) return absl::InvalidArgumentError(where() + ": more rows than one grid takes");
  RMSNormForwardKernel<T, true>
      <<<static_cast<unsigned>(n), kernel::RowThreads(c, 1024), 0, ctx.stream>>>(resid_out, out, rstd, a, b, w, c, eps);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status RMSNormBackward(T* dinp, float* dw, const T* dout, const T* inp, const float* w, const float* rstd,
                             int64_t n, int64_t c, double* scratch, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("RMSNormBackward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  for (auto [p, what] : {std::pair<const void*, const char*>{dinp, "dinp"},
                         {dw, "dw"},
                         {dout, "dout"},
                         {inp, "inp"},
                         {w, "w"},
                         {rstd, "rstd"},
                         {scratch, "scratch"}})
    PTK_KERNEL_CHECK(kernel::CheckPointer(p, what, where));
  if (n > 0x7fffffff) return absl::InvalidArgumentError(where() + ": more rows than one grid takes");
  RMSNormBackwardRowKernel<T>
      <<<static_cast<unsigned>(n), kernel::RowThreads(c, 1024), 0, ctx.stream>>>(dinp, dout, inp, w, rstd, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  const int64_t blocks = CeilDiv(n, kRowBlock), col_blocks = CeilDiv(c, kColumnThreads);
  if (col_blocks > 65535) return absl::InvalidArgumentError(where() + ": too many channels");
  RMSNormWeightPartialKernel<T>
      <<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(col_blocks)), kColumnThreads, 0, ctx.stream>>>(
          scratch, dout, inp, rstd, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  RMSNormWeightSumKernel<<<static_cast<unsigned>(col_blocks), kColumnThreads, 0, ctx.stream>>>(dw, scratch, blocks, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                            \
  template absl::Status RMSNormForward<T>(T*, float*, const T*, const float*, int64_t, int64_t, double,               \
                                          const CudaContext&);                                                        \
  template absl::Status RMSNormBackward<T>(T*, float*, const T*, const T*, const float*, const float*, int64_t,       \
                                           int64_t, double*, const CudaContext&);                                     \
  template absl::Status ResidualRMSNormForward<T>(T*, T*, float*, const T*, const T*, const float*, int64_t, int64_t, \
                                                  double, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
