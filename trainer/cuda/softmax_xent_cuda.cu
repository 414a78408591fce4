// Softmax cross-entropy over the padded vocabulary on the device, one block per row: a first pass
// keeps, per thread, the running max (fp32) and the sum of exp(logit - max) (double), rescaled
// when the max grows (online softmax), and the block combines them along a fixed tree; loss =
// log(sum) + max - logit[target] in double, as the CPU op. The terms are expf (fp32, as the CPU's),
// the rescalings exp in double (rare: when a thread's max grows); a -inf logit adds nothing
// (SoftmaxOnlineAdd of softmax_math.h). The fused version then overwrites the
// row with (softmax - onehot) * dloss in a second pass: no probability matrix is kept.
#include <cmath>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/cuda/softmax_math.h"

namespace ptk::cuda {
namespace {

constexpr int kMaxThreads = 512;

// (m, s) += (m2, s2): s = s * e^(m - max) + s2 * e^(m2 - max). A side whose max is -inf holds no
// mass (its sum is 0), which also keeps -inf - -inf out of expf.
__device__ __forceinline__ void Combine(float& m, double& s, float m2, double s2) {
  const float mx = fmaxf(m, m2);
  const double a = m == -INFINITY ? 0.0 : s * exp(static_cast<double>(m) - static_cast<double>(mx));
  const double b = m2 == -INFINITY ? 0.0 : s2 * exp(static_cast<double>(m2) - static_cast<double>(mx));
  m = mx;
  s = a + b;
}

// Every thread of the block gets the row's (max, sum), combined along a fixed tree.
__device__ __forceinline__ void BlockCombine(float& m, double& s, float* shared_m, double* shared_s) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, o);
    const double s2 = __shfl_down_sync(0xffffffffu, s, o);
    Combine(m, s, m2, s2);
  }
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? shared_m[lane] : -INFINITY;
    s = lane < warps ? shared_s[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_down_sync(0xffffffffu, m, o);
      const double s2 = __shfl_down_sync(0xffffffffu, s, o);
      Combine(m, s, m2, s2);
    }
    if (lane == 0) {
      shared_m[32] = m;
      shared_s[32] = s;
    }
  }
  __syncthreads();
  m = shared_m[32];
  s = shared_s[32];
}

// kFused: grad (the logits, overwritten) receives (softmax - onehot) * dlosses[row]; else grad is
// null. A target outside [0, vp) gives a NaN loss (never an access outside the row).
template <typename T, int N, bool kFused>
__global__ void SoftmaxXentKernel(T* grad, const T* logits, float* losses, const int32_t* targets, const float* dlosses,
                                  int64_t n, int64_t vp) {
  __shared__ float shared_m[33];
  __shared__ double shared_s[33];
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* x = logits + row * vp;
    const int64_t target = targets[row];
    const bool valid = target >= 0 && target < vp;
    // Read before the block's first barrier, hence before any thread overwrites the row.
    const float target_logit = (threadIdx.x == 0 && valid) ? ToFloat(x[target]) : NAN;
    float m = -INFINITY;
    double s = 0.0;
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * N; j < vp; j += static_cast<int64_t>(blockDim.x) * N) {
      float v[N];
      kernel::LoadFloats<N>(x + j, v);
      SoftmaxOnlineAdd<N>(m, s, v);
    }
    BlockCombine(m, s, shared_m, shared_s);
    if (threadIdx.x == 0) {
      losses[row] = static_cast<float>(log(s) + static_cast<double>(m) - static_cast<double>(target_logit));
    }
    if constexpr (kFused) {
      const float d = dlosses[row];
      const auto scale = static_cast<float>(static_cast<double>(d) / s);
      T* y = grad + row * vp;
      for (int64_t j = static_cast<int64_t>(threadIdx.x) * N; j < vp; j += static_cast<int64_t>(blockDim.x) * N) {
        float v[N];
        kernel::LoadFloats<N>(y + j, v);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          v[k] = expf(v[k] - m) * scale;
          if (j + k == target) v[k] -= d;
        }
        kernel::StoreFloats<N>(y + j, v);
      }
    }
  }
}

template <typename T, bool kFused>
void Launch(T* grad, const T* logits, float* losses, const int32_t* targets, const float* dlosses, int64_t n,
            int64_t vp, const CudaContext& ctx) {
  constexpr int kV = kernel::kVec<T>;
  const unsigned blocks = kernel::GridBlocks(n, 1, 0x7fffffff);
  if (vp % kV == 0 && kernel::Aligned(logits, 16)) {
    const int threads = kernel::RowThreads(vp / kV, kMaxThreads);
    SoftmaxXentKernel<T, kV, kFused><<<blocks, threads, 0, ctx.stream>>>(grad, logits, losses, targets, dlosses, n, vp);
  } else {
    const int threads = kernel::RowThreads(vp, kMaxThreads);
    SoftmaxXentKernel<T, 1, kFused><<<blocks, threads, 0, ctx.stream>>>(grad, logits, losses, targets, dlosses, n, vp);
  }
}

}  // namespace

template <typename T>
absl::Status SoftmaxCrossEntropyForward(float* losses, const T* logits, const int32_t* targets, int64_t n, int64_t vp,
                                        const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SoftmaxCrossEntropyForward<{}>(n={}, vp={})", kernel::TypeName<T>(), n, vp); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(vp, "vp", where));
  if (n == 0) return absl::OkStatus();
  if (vp == 0) return absl::InvalidArgumentError(fmt::format("{}: an empty vocabulary", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(losses, "losses", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(logits, "logits", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(targets, "targets", where));
  Launch<T, false>(nullptr, logits, losses, targets, nullptr, n, vp, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status SoftmaxCrossEntropyFused(T* logits, float* losses, const int32_t* targets, const float* dlosses, int64_t n,
                                      int64_t vp, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SoftmaxCrossEntropyFused<{}>(n={}, vp={})", kernel::TypeName<T>(), n, vp); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(vp, "vp", where));
  if (n == 0) return absl::OkStatus();
  if (vp == 0) return absl::InvalidArgumentError(fmt::format("{}: an empty vocabulary", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(logits, "logits", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(losses, "losses", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(targets, "targets", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dlosses, "dlosses", where));
  Launch<T, true>(logits, logits, losses, targets, dlosses, n, vp, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                      \
  template absl::Status SoftmaxCrossEntropyForward<T>(float*, const T*, const int32_t*, int64_t, int64_t,       \
                                                      const CudaContext&);                                      \
  template absl::Status SoftmaxCrossEntropyFused<T>(T*, float*, const int32_t*, const float*, int64_t, int64_t, \
                                                    const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
