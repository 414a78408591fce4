// Casts between the fp32 master copies and the activation type, the residual add and the
// non-finite check of the loss-scaled gradients: elementwise, over 128-bit packs with a scalar
// head and tail. Conversions to bf16/fp16 round to nearest even (FromFloat).
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

// Either direction between fp32 and the activation type: loads widen to float, stores round.
template <typename To, typename From>
struct CastOp {
  To* out;
  const From* in;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N];
    kernel::LoadFloats<N>(in + i, x);
    kernel::StoreFloats<N>(out + i, x);
  }
};

// out may be a or b: every element is read before it is written, by the same thread.
template <typename T>
struct ResidualAddOp {
  T* out;
  const T* a;
  const T* b;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N], y[N];
    kernel::LoadFloats<N>(a + i, x);
    kernel::LoadFloats<N>(b + i, y);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = kernel::ResidualSum(x[k], y[k]);
    kernel::StoreFloats<N>(out + i, x);
  }
};

// Every thread that sees a NaN or an Inf stores 1 (the same value: the order does not matter).
struct NonFiniteOp {
  int* flag;
  const float* x;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float v[N];
    kernel::LoadFloats<N>(x + i, v);
    bool bad = false;
#pragma unroll
    for (int k = 0; k < N; ++k) bad |= !isfinite(v[k]);
    if (bad) *flag = 1;
  }
};

}  // namespace

template <typename T>
absl::Status CastFromFloat(T* out, const float* in, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("CastFromFloat<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(in, "in", where));
  constexpr int kV = kernel::kVec<T>;  // 16 bytes of T, 16 or 32 bytes of float
  const int64_t head = kernel::HeadTo16(out, sizeof(T));
  const bool vec = kernel::AlignedAt(in, head, sizeof(float), 16);
  kernel::LaunchElementwise<kV>(CastOp<T, float>{out, in}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status CastToFloat(float* out, const T* in, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("CastToFloat<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(in, "in", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(in, sizeof(T));
  const bool vec = kernel::AlignedAt(out, head, sizeof(float), 16);
  kernel::LaunchElementwise<kV>(CastOp<float, T>{out, in}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualAdd(T* out, const T* a, const T* b, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("ResidualAdd<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(a, "a", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(b, "b", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(out, sizeof(T));
  const bool vec = kernel::AlignedAt(a, head, sizeof(T), 16) && kernel::AlignedAt(b, head, sizeof(T), 16);
  kernel::LaunchElementwise<kV>(ResidualAddOp<T>{out, a, b}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

absl::Status NonFiniteFlag(int* flag, const float* x, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("NonFiniteFlag(n={})", n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(flag, "flag", where));
  PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(int), ctx.stream), where());
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(x, "x", where));
  constexpr int kV = kernel::kVec<float>;
  const int64_t head = kernel::HeadTo16(x, sizeof(float));
  kernel::LaunchElementwise<kV>(NonFiniteOp{flag, x}, n, head, true, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                               \
  template absl::Status CastFromFloat<T>(T*, const float*, int64_t, const CudaContext&); \
  template absl::Status CastToFloat<T>(float*, const T*, int64_t, const CudaContext&);   \
  template absl::Status ResidualAdd<T>(T*, const T*, const T*, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
