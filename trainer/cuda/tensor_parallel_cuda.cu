// Megatron's tensor-parallel pieces of the CUDA model that are not plain products, each the twin of
// trainer/cpu/tensor_parallel_cpu.cpp's: the vocabulary-parallel embedding (this rank's rows of the
// padded vocabulary, zeros for the other tokens), the finish of a sum over the tensor group (the
// fp32 sum rounded to T with a bias or the position embeddings added), and the vocabulary-parallel
// cross-entropy's local passes (row maxima and target logits, sums of exponentials, losses and the
// slice's gradient). The collectives between them are the caller's (NCCL on the compute stream).
#include <cmath>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool InSlice(int32_t token, int64_t v0, int64_t rows) {
  return token >= v0 && token < v0 + rows;
}

template <typename T>
__global__ void VocabSliceEmbeddingKernel(float* out, const int32_t* tokens, const T* wte, int64_t v0, int64_t rows,
                                          int64_t n, int64_t c) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n * c;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / c, j = k % c;
    const int32_t token = tokens[i];
    out[k] = InSlice(token, v0, rows) ? ToFloat(wte[(token - v0) * c + j]) : 0.0f;
  }
}

template <typename T>
__global__ void TensorSumFinishKernel(T* out, const float* sum, const T* bias, const int32_t* positions, const T* wpe,
                                      int64_t n, int64_t c) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n * c;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / c, j = k % c;
    float v = sum[k];
    if (bias) v += ToFloat(bias[j]);
    if (wpe) v += ToFloat(wpe[static_cast<int64_t>(positions[i]) * c + j]);
    out[k] = FromFloat<T>(v);
  }
}

// One block per row: its maximum (into maxima[row]) and its target's logit (0 when the target is
// another rank's: the sum over the group is then the target's logit).
template <typename T>
__global__ void XentLocalKernel(float* maxima, float* target, const T* logits, const int32_t* targets, int64_t rows,
                                int64_t vt, int64_t v0) {
  __shared__ float shared[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * vt;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < vt; j += blockDim.x) m = fmaxf(m, ToFloat(x[j]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
    const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) m = fmaxf(m, shared[w]);
      maxima[row] = m;
      const int32_t t = targets[row];
      target[row] = InSlice(t, v0, vt) ? ToFloat(x[t - v0]) : 0.0f;
    }
    __syncthreads();
  }
}

// The group's maximum of each row from the gathered maxima(ranks, rows) into global[row], then the
// slice's sum of exp(logit - max) (accumulated in double, stored in fp32 for the all-reduce).
template <typename T>
__global__ void XentSumKernel(float* global, float* sums, const float* maxima, int ranks, const T* logits, int64_t rows,
                              int64_t vt) {
  __shared__ double shared[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float m = maxima[row];
    for (int r = 1; r < ranks; ++r) m = fmaxf(m, maxima[r * rows + row]);
    const T* x = logits + row * vt;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < vt; j += blockDim.x) s += static_cast<double>(expf(ToFloat(x[j]) - m));
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
    if (lane == 0) shared[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) s += shared[w];
      global[row] = m;
      sums[row] = static_cast<float>(s);
    }
    __syncthreads();
  }
}

// losses[row] = log(sum) + max - target logit; with dlosses the slice becomes
// (softmax - onehot) * dlosses[row].
template <typename T>
__global__ void XentFinishKernel(T* logits, float* losses, const float* global, const float* sums, const float* target,
                                 const int32_t* targets, const float* dlosses, int64_t rows, int64_t vt, int64_t v0) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const double s = sums[row];
    const float m = global[row];
    if (threadIdx.x == 0)
      losses[row] = static_cast<float>(log(s) + static_cast<double>(m) - static_cast<double>(target[row]));
    if (!dlosses) continue;
    const float d = dlosses[row], scale = static_cast<float>(static_cast<double>(d) / s);
    const int32_t t = targets[row];
    T* x = logits + row * vt;
    for (int64_t j = threadIdx.x; j < vt; j += blockDim.x) {
      float v = expf(ToFloat(x[j]) - m) * scale;
      if (j + v0 == t) v -= d;
      x[j] = FromFloat<T>(v);
    }
  }
}

template <typename Where>
absl::Status CheckRows(int64_t n, int64_t c, const Where& where) {
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  return kernel::CheckCount(c, "c", where);
}

}  // namespace

template <typename T>
absl::Status VocabSliceEmbeddingForward(float* out, const int32_t* tokens, const T* wte, int64_t v0, int64_t rows,
                                        int64_t n, int64_t c, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("VocabSliceEmbeddingForward<{}>(n={}, c={}, rows {}..{})", kernel::TypeName<T>(), n, c, v0,
                       v0 + rows);
  };
  PTK_KERNEL_CHECK(CheckRows(n, c, where));
  if (n == 0 || c == 0) return absl::OkStatus();
  const unsigned blocks = kernel::GridBlocks(n * c, kThreads, kernel::MaxBlocks(ctx));
  VocabSliceEmbeddingKernel<T><<<blocks, kThreads, 0, ctx.stream>>>(out, tokens, wte, v0, rows, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status TensorSumFinish(T* out, const float* sum, const T* bias, const int32_t* positions, const T* wpe, int64_t n,
                             int64_t c, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("TensorSumFinish<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(CheckRows(n, c, where));
  if (n == 0 || c == 0) return absl::OkStatus();
  const unsigned blocks = kernel::GridBlocks(n * c, kThreads, kernel::MaxBlocks(ctx));
  TensorSumFinishKernel<T><<<blocks, kThreads, 0, ctx.stream>>>(out, sum, bias, positions, wpe, n, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status VocabParallelXentLocal(float* maxima, float* target, const T* logits, const int32_t* targets, int64_t rows,
                                    int64_t vt, int64_t v0, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("VocabParallelXentLocal<{}>(rows={}, vt={})", kernel::TypeName<T>(), rows, vt);
  };
  PTK_KERNEL_CHECK(CheckRows(rows, vt, where));
  if (rows == 0) return absl::OkStatus();
  XentLocalKernel<T><<<kernel::GridBlocks(rows, 1, 0x7fffffff), kThreads, 0, ctx.stream>>>(maxima, target, logits,
                                                                                           targets, rows, vt, v0);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status VocabParallelXentSums(float* global_max, float* sums, const float* maxima, int ranks, const T* logits,
                                   int64_t rows, int64_t vt, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("VocabParallelXentSums<{}>(rows={}, vt={})", kernel::TypeName<T>(), rows, vt);
  };
  PTK_KERNEL_CHECK(CheckRows(rows, vt, where));
  if (rows == 0) return absl::OkStatus();
  XentSumKernel<T><<<kernel::GridBlocks(rows, 1, 0x7fffffff), kThreads, 0, ctx.stream>>>(global_max, sums, maxima,
                                                                                         ranks, logits, rows, vt);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status VocabParallelXentFinish(T* logits, float* losses, const float* global_max, const float* sums,
                                     const float* target, const int32_t* targets, const float* dlosses, int64_t rows,
                                     int64_t vt, int64_t v0, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("VocabParallelXentFinish<{}>(rows={}, vt={})", kernel::TypeName<T>(), rows, vt);
  };
  PTK_KERNEL_CHECK(CheckRows(rows, vt, where));
  if (rows == 0) return absl::OkStatus();
  XentFinishKernel<T><<<kernel::GridBlocks(rows, 1, 0x7fffffff), kThreads, 0, ctx.stream>>>(
      logits, losses, global_max, sums, target, targets, dlosses, rows, vt, v0);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status VocabSliceEmbeddingForward<T>(float*, const int32_t*, const T*, int64_t, int64_t, int64_t,     \
                                                      int64_t, const CudaContext&);                                    \
  template absl::Status TensorSumFinish<T>(T*, const float*, const T*, const int32_t*, const T*, int64_t, int64_t,     \
                                           const CudaContext&);                                                        \
  template absl::Status VocabParallelXentLocal<T>(float*, float*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                                  const CudaContext&);                                                 \
  template absl::Status VocabParallelXentSums<T>(float*, float*, const float*, int, const T*, int64_t, int64_t,        \
                                                 const CudaContext&);                                                  \
  template absl::Status VocabParallelXentFinish<T>(T*, float*, const float*, const float*, const float*,               \
                                                   const int32_t*, const float*, int64_t, int64_t, int64_t,            \
                                                   const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
