// Megatron's --qk-layernorm on the device, forward and backward, as the CPU op
// (trainer/cpu/qk_norm_cpu.cpp): each query and key head of the fused QKV normalised (LayerNorm or
// RMSNorm) with statistics in double, the weights fp32 (master weights), the weight and bias
// gradients summed over fixed 64-token blocks in double, heads in row order, and the blocks then in
// order: the CPU op's order of additions.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int64_t kTokenBlock = 64;  // as the CPU op's blocks
constexpr int kColumnThreads = 128;

// Head h of a token's row: 0 query, 1 key, 2 value; `normed` its index among the row's normalised
// heads (the statistics' order).
struct QKHead {
  int kind;
  int64_t normed;
};
__device__ __forceinline__ QKHead HeadOf(int64_t h, int64_t per) {
  const int64_t g = h / per, k = h % per;
  return {k < per - 2 ? 0 : (k == per - 2 ? 1 : 2), g * (per - 1) + k};
}

// One block per (token, head): value heads copied, query and key heads normalised (null weights: ones, the L2 norm).
template <typename T>
__global__ void QKNormForwardKernel(T* qkv, float* mean, float* rstd, const T* raw, const float* wq, const float* bq,
                                    const float* wk, const float* bk, int64_t width, int64_t hd, int64_t per,
                                    int64_t normed_per_token, double eps) {
  __shared__ double shared[66];
  const int64_t token = blockIdx.x, h = blockIdx.y;
  const QKHead head = HeadOf(h, per);
  const T* x = raw + token * width + h * hd;
  T* y = qkv + token * width + h * hd;
  if (head.kind == 2) {
    for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) y[j] = x[j];
    return;
  }
  const bool centred = mean != nullptr;
  double s = 0, unused = 0;
  if (centred) {
    for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) s += static_cast<double>(ToFloat(x[j]));
    kernel::BlockSum2(s, unused, shared);
  }
  const double m = centred ? s / static_cast<double>(hd) : 0.0;
  double v = 0;
  unused = 0;
  for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
    const double d = static_cast<double>(ToFloat(x[j])) - m;
    v += d * d;
  }
  kernel::BlockSum2(v, unused, shared);
  const double r = 1.0 / sqrt(v / static_cast<double>(hd) + eps);
  const float* w = head.kind == 0 ? wq : wk;
  const float* b = head.kind == 0 ? bq : bk;
  for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
    const float xhat = static_cast<float>((static_cast<double>(ToFloat(x[j])) - m) * r);
    y[j] = FromFloat<T>(__fadd_rn(__fmul_rn(xhat, w ? w[j] : 1.0f), b ? b[j] : 0.0f));
  }
  if (threadIdx.x == 0) {
    const int64_t row = token * normed_per_token + head.normed;
    if (centred) mean[row] = static_cast<float>(m);
    rstd[row] = static_cast<float>(r);
  }
}

// partial[blk][k][j], k = dwq, dbq, dwk, dbk: over the block's tokens in order, and each token's
// query (key) heads in order, dy * xhat and dy in double. Reads dqkv before the row kernel rewrites it.
template <typename T>
__global__ void QKNormParamPartialKernel(double* partial, const T* dqkv, const T* raw, const float* mean,
                                         const float* rstd, int64_t n, int64_t width, int64_t hd, int64_t per,
                                         int64_t heads, int64_t normed_per_token) {
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= hd) return;
  const int64_t blk = blockIdx.x, end = (blk + 1) * kTokenBlock < n ? (blk + 1) * kTokenBlock : n;
  double sw[2] = {0, 0}, sb[2] = {0, 0};
  for (int64_t i = blk * kTokenBlock; i < end; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const QKHead head = HeadOf(h, per);
      if (head.kind == 2) continue;
      const int64_t row = i * normed_per_token + head.normed, at = i * width + h * hd + j;
      const double m = mean ? static_cast<double>(mean[row]) : 0.0, r = rstd[row];
      const double xhat = (static_cast<double>(ToFloat(raw[at])) - m) * r, dy = ToFloat(dqkv[at]);
      sw[head.kind] += dy * xhat;
      sb[head.kind] += dy;
    }
  double* p = partial + blk * 4 * hd;
  p[j] = sw[0];
  p[hd + j] = sb[0];
  p[2 * hd + j] = sw[1];
  p[3 * hd + j] = sb[1];
}

// out[k][j] += the blocks' partials summed in block order (k = dwq, dbq, dwk, dbk; a null out skipped).
__global__ void QKNormParamSumKernel(float* dwq, float* dbq, float* dwk, float* dbk, const double* partial,
                                     int64_t blocks, int64_t hd) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, k = blockIdx.y;
  float* out[4] = {dwq, dbq, dwk, dbk};
  if (j >= hd || !out[k]) return;
  double s = 0;
  for (int64_t b = 0; b < blocks; ++b) s += partial[(b * 4 + k) * hd + j];
  out[k][j] += static_cast<float>(s);
}

// One block per (token, query or key head), in place: dx = r (dxhat - mean(dxhat) - xhat mean(dxhat
// xhat)), dxhat = dy w, the mean(dxhat) term only for LayerNorm. Each element is read and written by
// the same thread, after the block's sums.
template <typename T>
__global__ void QKNormBackwardRowKernel(T* dqkv, const T* raw, const float* wq, const float* wk, const float* mean,
                                        const float* rstd, int64_t width, int64_t hd, int64_t per,
                                        int64_t normed_per_token) {
  __shared__ double shared[66];
  const int64_t token = blockIdx.x, h = blockIdx.y;
  const QKHead head = HeadOf(h, per);
  if (head.kind == 2) return;
  const int64_t row = token * normed_per_token + head.normed;
  const T* x = raw + token * width + h * hd;
  T* dy = dqkv + token * width + h * hd;
  const float* w = head.kind == 0 ? wq : wk;
  const double m = mean ? static_cast<double>(mean[row]) : 0.0, r = rstd[row];
  double sum_dxhat = 0, sum_dxhat_xhat = 0;
  for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
    const double xhat = (static_cast<double>(ToFloat(x[j])) - m) * r,
                 dxhat = static_cast<double>(ToFloat(dy[j])) * (w ? w[j] : 1.0f);
    sum_dxhat += dxhat;
    sum_dxhat_xhat += dxhat * xhat;
  }
  kernel::BlockSum2(sum_dxhat, sum_dxhat_xhat, shared);
  const double mean_dxhat = mean ? sum_dxhat / static_cast<double>(hd) : 0.0,
               mean_dxhat_xhat = sum_dxhat_xhat / static_cast<double>(hd);
  for (int64_t j = threadIdx.x; j < hd; j += blockDim.x) {
    const double xhat = (static_cast<double>(ToFloat(x[j])) - m) * r,
                 dxhat = static_cast<double>(ToFloat(dy[j])) * (w ? w[j] : 1.0f);
    dy[j] = FromFloat<T>(static_cast<float>(r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)));
  }
}

template <typename Where>
absl::Status CheckShape(const AttentionShape& s, const Where& where) {
  PTK_KERNEL_CHECK(kernel::CheckCount(s.b * s.t, "b*t", where));
  if (s.hd < 1 || s.nh < 1 || s.groups() < 1 || s.nh % s.groups() != 0)
    return absl::InvalidArgumentError(where() + ": not a shape of query groups");
  if (s.b * s.t > 0x7fffffff || (s.nh + 2 * s.groups()) > 65535)
    return absl::InvalidArgumentError(where() + ": more tokens or heads than one grid takes");
  return absl::OkStatus();
}

}  // namespace

int64_t QKNormBackwardScratch(const AttentionShape& s) { return CeilDiv(s.b * s.t, kTokenBlock) * 4 * s.hd; }

template <typename T>
absl::Status QKNormForward(T* qkv, float* mean, float* rstd, const T* raw, const float* wq, const float* bq,
                           const float* wk, const float* bk, const AttentionShape& s, double eps,
                           const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("QKNormForward<{}>(b={}, t={}, nh={}, hd={}, groups={})", kernel::TypeName<T>(), s.b, s.t, s.nh,
                       s.hd, s.groups());
  };
  PTK_KERNEL_CHECK(CheckShape(s, where));
  if (s.b * s.t == 0) return absl::OkStatus();
  for (auto [p, what] : {std::pair<const void*, const char*>{qkv, "qkv"}, {rstd, "rstd"}, {raw, "raw"}})
    PTK_KERNEL_CHECK(kernel::CheckPointer(p, what, where));
  if (mean && (!bq || !bk)) return absl::InvalidArgumentError(where() + ": LayerNorm (mean) without its biases");
  if (!wq != !wk || (!wq && mean))
    return absl::InvalidArgumentError(where() + ": the unit weights (null wq and wk, the L2 norm) are RMSNorm's, both");
  const int64_t per = s.nh / s.groups() + 2, heads = s.groups() * per;
  QKNormForwardKernel<T>
      <<<dim3(static_cast<unsigned>(s.b * s.t), static_cast<unsigned>(heads)), kernel::RowThreads(s.hd, 1024), 0,
         ctx.stream>>>(qkv, mean, rstd, raw, wq, mean ? bq : nullptr, wk, mean ? bk : nullptr, s.qkv_width(), s.hd, per,
                       s.nh + s.groups(), eps);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status QKNormBackward(T* dqkv, float* dwq, float* dbq, float* dwk, float* dbk, const T* raw, const float* wq,
                            const float* wk, const float* mean, const float* rstd, const AttentionShape& s,
                            double* scratch, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("QKNormBackward<{}>(b={}, t={}, nh={}, hd={}, groups={})", kernel::TypeName<T>(), s.b, s.t, s.nh,
                       s.hd, s.groups());
  };
  PTK_KERNEL_CHECK(CheckShape(s, where));
  const int64_t n = s.b * s.t;
  if (n == 0) return absl::OkStatus();
  for (auto [p, what] : {std::pair<const void*, const char*>{dqkv, "dqkv"}, {raw, "raw"}, {rstd, "rstd"}})
    PTK_KERNEL_CHECK(kernel::CheckPointer(p, what, where));
  // The L2 norm (null weights) has no parameters: no gradients asked, none summed.
  const bool params = dwq || dwk;
  if (params && (!dwq || !dwk || !wq || !wk || !scratch))
    return absl::InvalidArgumentError(where() + ": dwq, dwk, wq, wk and scratch must be set together");
  if (!wq != !wk || (!wq && mean))
    return absl::InvalidArgumentError(where() + ": the unit weights (null wq and wk, the L2 norm) are RMSNorm's, both");
  const int64_t per = s.nh / s.groups() + 2, heads = s.groups() * per, normed = s.nh + s.groups();
  const int64_t blocks = CeilDiv(n, kTokenBlock), col_blocks = CeilDiv(s.hd, kColumnThreads);
  if (blocks > 0x7fffffff || col_blocks > 65535) return absl::InvalidArgumentError(where() + ": too large a grid");
  // The parameters' gradients first: the row kernel then overwrites dqkv with the input gradient.
  if (params) {
    QKNormParamPartialKernel<T>
        <<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(col_blocks)), kColumnThreads, 0, ctx.stream>>>(
            scratch, dqkv, raw, mean, rstd, n, s.qkv_width(), s.hd, per, heads, normed);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
    QKNormParamSumKernel<<<dim3(static_cast<unsigned>(col_blocks), 4), kColumnThreads, 0, ctx.stream>>>(
        dwq, mean ? dbq : nullptr, dwk, mean ? dbk : nullptr, scratch, blocks, s.hd);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  }
  QKNormBackwardRowKernel<T>
      <<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(heads)), kernel::RowThreads(s.hd, 1024), 0, ctx.stream>>>(
          dqkv, raw, wq, wk, mean, rstd, s.qkv_width(), s.hd, per, normed);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template absl::Status QKNormForward<T>(T*, float*, float*, const T*, const float*, const float*, const float*,    \
                                         const float*, const AttentionShape&, double, const CudaContext&);          \
  template absl::Status QKNormBackward<T>(T*, float*, float*, float*, float*, const T*, const float*, const float*, \
                                          const float*, const float*, const AttentionShape&, double*,               \
                                          const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
