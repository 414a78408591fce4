// AdamW over the flat fp32 buffers (AdamWElement of trainer/op_math.h, the function cpu::AdamW runs,
// with the coefficients MakeAdamWCoefficients computes on the host), the global sum of squares in
// double in a fixed order, and scaling. This file is compiled with --fmad=false (CMakeLists.txt):
// no multiply-add is contracted, so with IEEE sqrt and division (nvcc's defaults, no fast math)
// an fp32 AdamW step gives the CPU op's bits.
#include "trainer/cuda/adamw_table.h"
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

constexpr int kSumThreads = 256;
constexpr int64_t kSumMaxBlocks = 1024;
constexpr int kFinalThreads = 1024;

template <typename T>
struct AdamWOp {
  float* p;
  const float* g;
  float* m;
  float* v;
  T* p_compute;  // may be null
  AdamWCoefficients<float> c;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float pp[N], gg[N], mm[N], vv[N];
    kernel::LoadFloats<N>(p + i, pp);
    kernel::LoadFloats<N>(g + i, gg);
    kernel::LoadFloats<N>(m + i, mm);
    kernel::LoadFloats<N>(v + i, vv);
#pragma unroll
    for (int k = 0; k < N; ++k) AdamWElement(pp[k], gg[k], mm[k], vv[k], c);
    kernel::StoreFloats<N>(p + i, pp);
    kernel::StoreFloats<N>(m + i, mm);
    kernel::StoreFloats<N>(v + i, vv);
    if (p_compute != nullptr) kernel::StoreFloats<N>(p_compute + i, pp);
  }
};

struct ScaleOp {
  float* x;
  float s;
  template <int N>
  __device__ __forceinline__ void Apply(int64_t i) const {
    float v[N];
    kernel::LoadFloats<N>(x + i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = v[k] * s;
    kernel::StoreFloats<N>(x + i, v);
  }
};

// Block b of a grid of SumSquaresPartials(n) blocks: thread t sums, in double, the squares of the
// 4-element groups t, t + threads*blocks, ... (each group in index order), then the block sums its
// threads along a fixed tree into partials[b]. The order depends on n only (not on the alignment
// of x, not on the device), so the same x gives the same bits.
template <bool kAligned>
__global__ void SumSquaresPartialsKernel(double* partials, const float* x, int64_t n) {
  __shared__ double shared[66];
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double s = 0;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < groups; q += stride) {
    const int64_t i = q * 4;
    if (kAligned && i + 4 <= n) {
      float v[4];
      kernel::LoadFloats<4>(x + i, v);
#pragma unroll
      for (int k = 0; k < 4; ++k) s += static_cast<double>(v[k]) * static_cast<double>(v[k]);
    } else {
      const int64_t end = i + 4 < n ? i + 4 : n;
      for (int64_t j = i; j < end; ++j) s += static_cast<double>(x[j]) * static_cast<double>(x[j]);
    }
  }
  double unused = 0;
  kernel::BlockSum2(s, unused, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block: thread t sums partials t, t + blockDim, ... in order, then a fixed tree.
__global__ void SumPartialsKernel(double* out, const double* partials, int64_t count) {
  __shared__ double shared[66];
  double s = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) s += partials[k];
  double unused = 0;
  kernel::BlockSum2(s, unused, shared);
  if (threadIdx.x == 0) *out = s;
}

// The coefficients of every optimizer group (AdamWGroups), passed by value as a kernel argument.
struct AdamWGroupCoefficients {
  AdamWCoefficients<float> group[AdamWGroups::kCount];
};

// Block k: chunk k of the table, its elements in strides of the block (coalesced; the pieces'
// offsets need not be 16-byte aligned).
template <typename T>
__global__ void AdamWMultiKernel(const AdamWChunk* table, float* master, int64_t master_shift, const float* g, float* m,
                                 float* v, int64_t moment_shift, T* p_compute, float grad_scale,
                                 AdamWGroupCoefficients groups) {
  const AdamWChunk chunk = table[blockIdx.x];
  const AdamWCoefficients<float> c = groups.group[chunk.group];
  for (int j = static_cast<int>(threadIdx.x); j < chunk.size; j += static_cast<int>(blockDim.x)) {
    const int64_t i = chunk.offset + j;
    float p = master[i - master_shift];
    float mm = m[i - moment_shift], vv = v[i - moment_shift];
    const float gg = g[i] * grad_scale;
    AdamWElement(p, gg, mm, vv, c);
    master[i - master_shift] = p;
    m[i - moment_shift] = mm;
    v[i - moment_shift] = vv;
    if (p_compute != nullptr) p_compute[i] = FromFloat<T>(p);
  }
}

}  // namespace

template <typename T>
absl::Status AdamWMulti(const AdamWChunk* table, int64_t table_size, float* master, int64_t master_shift,
                        const float* g, float* m, float* v, int64_t moment_shift, T* p_compute, float grad_scale,
                        const AdamWGroups& groups, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("AdamWMulti<{}>(chunks={}, step={}, lr={}, decoupled lr={}, grad scale={})",
                       kernel::TypeName<T>(), table_size, groups.group[0].step, groups.group[0].lr, groups.group[2].lr,
                       grad_scale);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(table_size, "table_size", where));
  for (const AdamWParams& a : groups.group)
    if (a.step < 1) return absl::InvalidArgumentError(fmt::format("{}: the step is 1-based", where()));
  if (table_size == 0) return absl::OkStatus();
  if (table_size > 0x7fffffff)
    return absl::InvalidArgumentError(fmt::format("{}: too many chunks for one grid", where()));
  PTK_KERNEL_CHECK(kernel::CheckPointer(table, "table", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(master, "master", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(g, "g", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(m, "m", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(v, "v", where));
  auto coefficients = [](const AdamWParams& a) {
    return MakeAdamWCoefficients<float>(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step);
  };
  AdamWGroupCoefficients c;
  for (int k = 0; k < AdamWGroups::kCount; ++k) c.group[k] = coefficients(groups.group[k]);
  AdamWMultiKernel<T><<<static_cast<unsigned>(table_size), 256, 0, ctx.stream>>>(
      table, master, master_shift, g, m, v, moment_shift, p_compute, grad_scale, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status AdamW(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& a, T* p_compute,
                   const CudaContext& ctx) {
  auto where = [&] { return fmt::format("AdamW<{}>(n={}, step={}, lr={})", kernel::TypeName<T>(), n, a.step, a.lr); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (a.step < 1) return absl::InvalidArgumentError(fmt::format("{}: the step is 1-based", where()));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(p, "p", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(g, "g", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(m, "m", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(v, "v", where));
  const AdamWCoefficients<float> c =
      MakeAdamWCoefficients<float>(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step);
  constexpr int kV = 4;  // 16 bytes of float; 4 elements of T for the compute copy
  const int64_t head = kernel::HeadTo16(p, sizeof(float));
  const bool vec = kernel::AlignedAt(g, head, sizeof(float), 16) && kernel::AlignedAt(m, head, sizeof(float), 16) &&
                   kernel::AlignedAt(v, head, sizeof(float), 16) &&
                   (p_compute == nullptr || kernel::AlignedAt(p_compute, head, sizeof(T), kV * sizeof(T)));
  kernel::LaunchElementwise<kV>(AdamWOp<T>{p, g, m, v, p_compute, c}, n, head, vec, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

int64_t SumSquaresPartials(int64_t n) {
  if (n <= 0) return 1;
  int64_t blocks = CeilDiv(CeilDiv(n, 4), kSumThreads);
  return blocks < kSumMaxBlocks ? blocks : kSumMaxBlocks;
}

absl::Status SumSquares(double* out, const float* x, int64_t n, double* partials, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("SumSquares(n={})", n); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  if (n == 0) {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, sizeof(double), ctx.stream), where());
    return absl::OkStatus();
  }
  PTK_KERNEL_CHECK(kernel::CheckPointer(x, "x", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(partials, "partials", where));
  const int64_t blocks = SumSquaresPartials(n);
  if (kernel::Aligned(x, 16)) {
    SumSquaresPartialsKernel<true><<<static_cast<unsigned>(blocks), kSumThreads, 0, ctx.stream>>>(partials, x, n);
  } else {
    SumSquaresPartialsKernel<false><<<static_cast<unsigned>(blocks), kSumThreads, 0, ctx.stream>>>(partials, x, n);
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  SumPartialsKernel<<<1, kFinalThreads, 0, ctx.stream>>>(out, partials, blocks);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

absl::Status Scale(float* x, int64_t n, float s, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("Scale(n={}, s={})", n, s); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(x, "x", where));
  constexpr int kV = kernel::kVec<float>;
  kernel::LaunchElementwise<kV>(ScaleOp{x, s}, n, kernel::HeadTo16(x, sizeof(float)), true, ctx);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                       \
  template absl::Status AdamW<T>(float*, const float*, float*, float*, int64_t, const AdamWParams&, T*,          \
                                 const CudaContext&);                                                            \
  template absl::Status AdamWMulti<T>(const AdamWChunk*, int64_t, float*, int64_t, const float*, float*, float*, \
                                      int64_t, T*, float, const AdamWGroups&, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
