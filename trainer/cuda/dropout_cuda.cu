// Counter-hash dropout on the device: the CPU's masks exactly (DropoutKey / DropoutKeepKeyed of
// trainer/counter_rng.h, row r keyed by streams[r], element i of a row tested at index index0 + i), kept
// elements scaled by 1/(1-p) in fp32. Tiles of (row, chunk) so that a few long rows still fill
// the device.
#include "trainer/counter_rng.h"
#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
__global__ void DropoutRowsKernel(T* x, int64_t rows, int64_t row_len, int64_t tiles_per_row, const uint64_t* streams,
                                  uint64_t seed, uint32_t threshold, float scale, int64_t index0) {
  const int64_t tiles = rows * tiles_per_row;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r = t / tiles_per_row;
    const int64_t i = ((t - r * tiles_per_row) * blockDim.x + threadIdx.x) * N;
    if (i >= row_len) continue;  // N divides row_len: a pack is whole or absent
    const uint64_t key = DropoutKey(seed, streams[r]);
    T* p = x + r * row_len + i;
    float v[N];
    kernel::LoadFloats<N>(p, v);
#pragma unroll
    for (int k = 0; k < N; ++k)
      v[k] =
          kernel::DropoutScaled(DropoutKeepKeyed(key, static_cast<uint64_t>(index0 + i + k), threshold), v[k], scale);
    kernel::StoreFloats<N>(p, v);
  }
}

template <typename T, int N>
void Launch(T* x, int64_t rows, int64_t row_len, const uint64_t* streams, uint64_t seed, uint32_t threshold,
            float scale, int64_t index0, const CudaContext& ctx) {
  const int64_t tiles_per_row = CeilDiv(row_len, int64_t{kThreads} * N);
  const unsigned blocks = kernel::GridBlocks(rows * tiles_per_row, 1, kernel::MaxBlocks(ctx));
  DropoutRowsKernel<T, N>
      <<<blocks, kThreads, 0, ctx.stream>>>(x, rows, row_len, tiles_per_row, streams, seed, threshold, scale, index0);
}

}  // namespace

template <typename T>
absl::Status DropoutRows(T* inout, int64_t rows, int64_t row_len, const uint64_t* streams, double p, uint64_t seed,
                         const CudaContext& ctx, int64_t index0) {
  auto where = [&] {
    return fmt::format("DropoutRows<{}>(rows={}, row_len={}, p={}, index0={})", kernel::TypeName<T>(), rows, row_len, p,
                       index0);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(rows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(row_len, "row_len", where));
  if (index0 < 0) return absl::InvalidArgumentError(fmt::format("{}: negative first index", where()));
  if (!(p >= 0.0 && p <= 1.0)) {
    return absl::InvalidArgumentError(fmt::format("{}: the probability is not in [0, 1]", where()));
  }
  if (p == 0.0 || rows == 0 || row_len == 0) return absl::OkStatus();  // as cpu::Dropout: p = 0 keeps all
  PTK_KERNEL_CHECK(kernel::CheckPointer(inout, "inout", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(streams, "streams", where));
  const uint32_t threshold = DropoutKeepThreshold(p);
  const auto scale = static_cast<float>(1.0 / (1.0 - p));  // as cpu::Dropout<float>
  constexpr int kV = kernel::kVec<T>;
  if (row_len % kV == 0 && kernel::Aligned(inout, 16)) {
    Launch<T, kV>(inout, rows, row_len, streams, seed, threshold, scale, index0, ctx);
  } else {
    Launch<T, 1>(inout, rows, row_len, streams, seed, threshold, scale, index0, ctx);
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template absl::Status DropoutRows<T>(T*, int64_t, int64_t, const uint64_t*, double, uint64_t, const CudaContext&, \
                                       int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
