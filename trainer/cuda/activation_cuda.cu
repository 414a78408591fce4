// The MLP's elementwise activations on the device, forward and backward: GELU (Megatron's tanh
// approximation; GeluValue, GeluDerivative), torch's exact erf GELU (Megatron's GELU MLP without the
// fused bias-GELU kernel; GeluExactValue, GeluExactDerivative) and Megatron's --squared-relu (relu(x)^2;
// SquaredReluValue, SquaredReluDerivative), the functions of trainer/op_math.h the CPU ops run, in
// fp32 over 128-bit packs with a scalar head and tail. One kernel pair serves all three: an activation
// is a type with Value and Derivative.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

struct Gelu {
  static constexpr const char* kName = "Gelu";
  __device__ __forceinline__ static float Value(float x) { return GeluValue(x); }
  __device__ __forceinline__ static float Derivative(float x) { return GeluDerivative(x); }
};

struct GeluExact {
  static constexpr const char* kName = "GeluExact";
  __device__ __forceinline__ static float Value(float x) { return GeluExactValue(x); }
  __device__ __forceinline__ static float Derivative(float x) { return GeluExactDerivative(x); }
};

struct SquaredRelu {
  static constexpr const char* kName = "SquaredRelu";
  __device__ __forceinline__ static float Value(float x) { return SquaredReluValue(x); }
  __device__ __forceinline__ static float Derivative(float x) { return SquaredReluDerivative(x); }
};

template <typename Act, typename T>
struct ForwardOp {
  T* out;
  const T* inp;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N];
    kernel::LoadFloats<N>(inp + i, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = Act::Value(x[k]);
    kernel::StoreFloats<N>(out + i, x);
  }
};

// dinp may be dout: each element is read before it is written, by the same thread.
template <typename Act, typename T>
struct BackwardOp {
  T* dinp;
  const T* inp;
  const T* dout;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N], d[N];
    kernel::LoadFloats<N>(inp + i, x);
    kernel::LoadFloats<N>(dout + i, d);
#pragma unroll
    for (int k = 0; k < N; ++k) d[k] = d[k] * Act::Derivative(x[k]);
    kernel::StoreFloats<N>(dinp + i, d);
  }
};

template <typename Act, typename T>
absl::Status ActivationForward(T* out, const T* inp, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("{}Forward<{}>(n={})", Act::kName, kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(out, sizeof(T));
  const bool vec = kernel::AlignedAt(inp, head, sizeof(T), 16);
  kernel::LaunchElementwise<kV>(ForwardOp<Act, T>{out, inp}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename Act, typename T>
absl::Status ActivationBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("{}Backward<{}>(n={})", Act::kName, kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dinp, "dinp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(dinp, sizeof(T));
  const bool vec = kernel::AlignedAt(inp, head, sizeof(T), 16) && kernel::AlignedAt(dout, head, sizeof(T), 16);
  kernel::LaunchElementwise<kV>(BackwardOp<Act, T>{dinp, inp, dout}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status GeluForward(T* out, const T* inp, int64_t n, const CudaContext& ctx) {
  return ActivationForward<Gelu>(out, inp, n, ctx);
}
template <typename T>
absl::Status GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx) {
  return ActivationBackward<Gelu>(dinp, inp, dout, n, ctx);
}
template <typename T>
absl::Status GeluExactForward(T* out, const T* inp, int64_t n, const CudaContext& ctx) {
  return ActivationForward<GeluExact>(out, inp, n, ctx);
}
template <typename T>
absl::Status GeluExactBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx) {
  return ActivationBackward<GeluExact>(dinp, inp, dout, n, ctx);
}
template <typename T>
absl::Status SquaredReluForward(T* out, const T* inp, int64_t n, const CudaContext& ctx) {
  return ActivationForward<SquaredRelu>(out, inp, n, ctx);
}
template <typename T>
absl::Status SquaredReluBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx) {
  return ActivationBackward<SquaredRelu>(dinp, inp, dout, n, ctx);
}

#define PTK_INSTANTIATE(T)                                                                         \
  template absl::Status GeluForward<T>(T*, const T*, int64_t, const CudaContext&);                 \
  template absl::Status GeluBackward<T>(T*, const T*, const T*, int64_t, const CudaContext&);      \
  template absl::Status GeluExactForward<T>(T*, const T*, int64_t, const CudaContext&);            \
  template absl::Status GeluExactBackward<T>(T*, const T*, const T*, int64_t, const CudaContext&); \
  template absl::Status SquaredReluForward<T>(T*, const T*, int64_t, const CudaContext&);          \
  template absl::Status SquaredReluBackward<T>(T*, const T*, const T*, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
