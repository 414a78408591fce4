// Megatron's --squared-relu (relu(x)^2) on the device, forward and backward: SquaredReluValue and
// SquaredReluDerivative of trainer/op_math.h in fp32 (the functions the CPU op runs), over 128-bit
// packs with a scalar head and tail, as gelu_cuda.cu.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

template <typename T>
struct SquaredReluForwardOp {
  T* out;
  const T* inp;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N];
    kernel::LoadFloats<N>(inp + i, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = SquaredReluValue(x[k]);
    kernel::StoreFloats<N>(out + i, x);
  }
};

// dinp may be dout: each element is read before it is written, by the same thread.
template <typename T>
struct SquaredReluBackwardOp {
  T* dinp;
  const T* inp;
  const T* dout;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N], d[N];
    kernel::LoadFloats<N>(inp + i, x);
    kernel::LoadFloats<N>(dout + i, d);
#pragma unroll
    for (int k = 0; k < N; ++k) d[k] = d[k] * SquaredReluDerivative(x[k]);
    kernel::StoreFloats<N>(dinp + i, d);
  }
};

}  // namespace

template <typename T>
absl::Status SquaredReluForward(T* out, const T* inp, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SquaredReluForward<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(out, sizeof(T));
  const bool vec = kernel::AlignedAt(inp, head, sizeof(T), 16);
  kernel::LaunchElementwise<kV>(SquaredReluForwardOp<T>{out, inp}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status SquaredReluBackward(T* dinp, const T* inp, const T* dout, int64_t n, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SquaredReluBackward<{}>(n={})", kernel::TypeName<T>(), n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dinp, "dinp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  constexpr int kV = kernel::kVec<T>;
  const int64_t head = kernel::HeadTo16(dinp, sizeof(T));
  const bool vec = kernel::AlignedAt(inp, head, sizeof(T), 16) && kernel::AlignedAt(dout, head, sizeof(T), 16);
  kernel::LaunchElementwise<kV>(SquaredReluBackwardOp<T>{dinp, inp, dout}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                \
  template absl::Status SquaredReluForward<T>(T*, const T*, int64_t, const CudaContext&); \
  template absl::Status SquaredReluBackward<T>(T*, const T*, const T*, int64_t, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
