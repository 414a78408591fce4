// The fused QKV's rows between Megatron's order (per query group: its query heads, then its key and
// value heads) and heads first (every query head, then every key head, then every value head), in
// which each of Q, K and V has one head stride: what cuDNN's fused attention reads under
// grouped-query attention. A copy, element for element.
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

// One thread per element of a row's head. to_heads: out (heads first) from in (Megatron's order);
// else the reverse.
template <typename T>
__global__ void QkvLayoutKernel(T* out, const T* in, int64_t rows, int64_t nh, int64_t groups, int64_t hd,
                                bool to_heads) {
  const int64_t per_group = nh / groups, heads = nh + 2 * groups, width = heads * hd, total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total; k += stride) {
    const int64_t d = k % hd, slot = (k / hd) % heads, row = k / width;
    const int64_t g = slot / (per_group + 2), h = slot % (per_group + 2);
    const int64_t head = h < per_group ? g * per_group + h : (h == per_group ? nh + g : nh + groups + g);
    const int64_t grouped = row * width + slot * hd + d, first = row * width + head * hd + d;
    if (to_heads)
      out[first] = in[grouped];
    else
      out[grouped] = in[first];
  }
}

template <typename T>
absl::Status QkvLayout(const char* name, T* out, const T* in, const AttentionShape& s, bool to_heads,
                       const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("{}<{}>(b={}, t={}, nh={}, hd={}, groups={})", name, kernel::TypeName<T>(), s.b, s.t, s.nh, s.hd,
                       s.groups());
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(s.b, "b", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(s.t, "t", where));
  if (s.nh < 1 || s.hd < 1 || s.ng < 0 || s.nh % s.groups() != 0)
    return absl::InvalidArgumentError(where() + ": the heads must be positive and the groups divide them");
  if (s.b == 0 || s.t == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(in, "in", where));
  if (static_cast<const void*>(out) == static_cast<const void*>(in))
    return absl::InvalidArgumentError(where() + ": out and in must differ (not in place)");
  constexpr int kThreads = 256;
  const int64_t total = s.b * s.t * s.qkv_width();
  QkvLayoutKernel<T><<<kernel::GridBlocks(total, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      out, in, s.b * s.t, s.nh, s.groups(), s.hd, to_heads);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status QkvGroupsToHeads(T* out, const T* qkv, const AttentionShape& s, const CudaContext& ctx) {
  return QkvLayout("QkvGroupsToHeads", out, qkv, s, true, ctx);
}
template <typename T>
absl::Status QkvHeadsToGroups(T* out, const T* heads, const AttentionShape& s, const CudaContext& ctx) {
  return QkvLayout("QkvHeadsToGroups", out, heads, s, false, ctx);
}

#define PTK_INSTANTIATE(T)                                                                            \
  template absl::Status QkvGroupsToHeads<T>(T*, const T*, const AttentionShape&, const CudaContext&); \
  template absl::Status QkvHeadsToGroups<T>(T*, const T*, const AttentionShape&, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
