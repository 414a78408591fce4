// Megatron's --apply-layernorm-1p on the device: the norms' effective fp32 weights 1 + gamma, which
// the norm kernels then read as their weight (the CPU ops take the offset as an argument instead:
// the same fp32 sum, the same products).
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

struct AddOffsetOp {
  float* out;
  const float* inp;
  float offset;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float x[N];
    kernel::LoadFloats<N>(inp + i, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = x[k] + offset;
    kernel::StoreFloats<N>(out + i, x);
  }
};

}  // namespace

absl::Status AddWeightOffset(float* out, const float* inp, int64_t n, float offset, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("AddWeightOffset(n={}, offset={})", n, offset); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(inp, "inp", where));
  constexpr int kV = kernel::kVec<float>;
  const int64_t head = kernel::HeadTo16(out, sizeof(float));
  const bool vec = kernel::AlignedAt(inp, head, sizeof(float), 16);
  kernel::LaunchElementwise<kV>(AddOffsetOp{out, inp, offset}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace ptk::cuda
