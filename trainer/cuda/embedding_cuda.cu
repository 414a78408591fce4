// Token + learned absolute position embeddings on the device. Forward: out = wte[token] +
// wpe[position] in fp32, rounded once. Backward without atomics: the rows are grouped by id on
// the host (tokens_host / positions_host, a counting sort), the grouping is uploaded through the
// plan's pinned staging, and one block per (id, channel chunk) adds the id's rows in order of i to
// the gradient, the CPU op's order of additions.
#include <fmt/core.h>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kMaxThreads = 256;

template <typename T, int N>
__global__ void EmbeddingForwardKernel(T* out, const int32_t* tokens, const int32_t* positions, const T* wte,
                                       const T* wpe, int64_t n, int64_t c, int64_t chunks) {
  const int64_t tiles = n * chunks;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row = t / chunks;
    const int64_t j = ((t - row * chunks) * blockDim.x + threadIdx.x) * N;
    if (j >= c) continue;  // N divides c: a pack is whole or absent
    float a[N], p[N];
    kernel::LoadFloats<N>(wte + static_cast<int64_t>(tokens[row]) * c + j, a);
    if (wpe != nullptr) {  // none under rotary (or no) position embeddings
      kernel::LoadFloats<N>(wpe + static_cast<int64_t>(positions[row]) * c + j, p);
#pragma unroll
      for (int k = 0; k < N; ++k) a[k] = a[k] + p[k];
    }
    kernel::StoreFloats<N>(out + row * c + j, a);
  }
}

// Group g: rows order[starts[g]], ..., order[starts[g+1] - 1] (increasing) all have id ids[g].
template <typename T, int N>
__global__ void EmbeddingBackwardKernel(float* dtable, const T* dout, const int32_t* order, const int32_t* starts,
                                        const int32_t* ids, int64_t groups, int64_t c, int64_t chunks) {
  const int64_t tiles = groups * chunks;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t g = t / chunks;
    const int64_t j = ((t - g * chunks) * blockDim.x + threadIdx.x) * N;
    if (j >= c) continue;
    float* dst = dtable + static_cast<int64_t>(ids[g]) * c + j;
    float acc[N];
    kernel::LoadFloats<N>(dst, acc);
    const int32_t r1 = starts[g + 1];
#pragma unroll 4
    for (int32_t r = starts[g]; r < r1; ++r) {
      float v[N];
      kernel::LoadFloats<N>(dout + static_cast<int64_t>(order[r]) * c + j, v);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += v[k];
    }
    kernel::StoreFloats<N>(dst, acc);
  }
}

// Counting sort of the ids of n rows into [order (n)][starts (groups + 1)][ids (groups)] at out;
// returns the ints written, or an error naming the first id outside [0, rows).
template <typename Where>
absl::Status GroupRows(const int32_t* id_of, int64_t n, int64_t rows, std::string_view what,
                       std::vector<int32_t>& counts, int32_t* out, int64_t* groups, int64_t* written,
                       const Where& where, int64_t first = -1) {
  // A slice [first, first + rows): ids outside it are left out.
  const int64_t shift = first >= 0 ? first : 0;
  auto skip = [&](int32_t id) { return first >= 0 && (id < first || id >= first + rows); };
  counts.assign(static_cast<size_t>(rows), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (skip(id_of[i])) continue;
    const int32_t id = static_cast<int32_t>(id_of[i] - shift);
    if (id < 0 || id >= rows) {
      return absl::InvalidArgumentError(
          fmt::format("{}: {} id {} at row {} is outside [0, {})", where(), what, id, i, rows));
    }
    ++counts[static_cast<size_t>(id)];
  }
  int64_t g = 0;
  for (int64_t id = 0; id < rows; ++id) g += counts[static_cast<size_t>(id)] > 0;
  int32_t* order = out;
  int32_t* starts = out + n;
  int32_t* ids = starts + g + 1;
  int32_t pos = 0;
  g = 0;
  for (int64_t id = 0; id < rows; ++id) {
    const int32_t k = counts[static_cast<size_t>(id)];
    if (k == 0) continue;
    starts[g] = pos;
    ids[g] = static_cast<int32_t>(id);
    ++g;
    counts[static_cast<size_t>(id)] = pos;  // from here on: the next free slot of the id
    pos += k;
  }
  starts[g] = pos;
  for (int64_t i = 0; i < n; ++i)
    if (!skip(id_of[i])) order[counts[static_cast<size_t>(id_of[i] - shift)]++] = static_cast<int32_t>(i);
  *groups = g;
  *written = n + 2 * g + 1;
  return absl::OkStatus();
}

template <typename T, int N>
void LaunchBackward(float* dtable, const T* dout, const int32_t* plan, int64_t n, int64_t groups, int64_t c,
                    const CudaContext& ctx) {
  const int threads = kernel::RowThreads(CeilDiv(c, N), kMaxThreads);
  const int64_t chunks = CeilDiv(CeilDiv(c, N), threads);
  const unsigned blocks = kernel::GridBlocks(groups * chunks, 1, 0x7fffffff);
  const int32_t* order = plan;
  const int32_t* starts = plan + n;
  const int32_t* ids = starts + groups + 1;
  EmbeddingBackwardKernel<T, N>
      <<<blocks, threads, 0, ctx.stream>>>(dtable, dout, order, starts, ids, groups, c, chunks);
}

}  // namespace

EmbeddingBackwardPlan::~EmbeddingBackwardPlan() {
  // Errors here cannot be reported: a destructor frees what it can, once the last uploads have left
  // the staging.
  for (int k = 0; k < 2; ++k) {
    if (uploaded[k] != nullptr) (void)cudaEventSynchronize(uploaded[k]);
    if (host[k] != nullptr) (void)cudaFreeHost(host[k]);
    if (uploaded[k] != nullptr) (void)cudaEventDestroy(uploaded[k]);
  }
  if (device != nullptr) (void)cudaFree(device);
}

int64_t EmbeddingBackwardPlanInts(int64_t max_n) { return 6 * (max_n > 0 ? max_n : 0) + 2; }

absl::Status EmbeddingBackwardPlan::Reserve(int64_t rows) {
  const std::string where = fmt::format("EmbeddingBackwardPlan::Reserve(max_n={})", rows);
  if (rows < 0 || rows > 0x7fffffff) {
    return absl::InvalidArgumentError(fmt::format("{}: rows must be in [0, 2^31)", where));
  }
  for (int k = 0; k < 2; ++k) {
    if (uploaded[k] != nullptr) PTK_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(uploaded[k]), where);
    if (host[k] != nullptr) PTK_CUDA_RETURN_IF_ERROR(cudaFreeHost(host[k]), where);
    host[k] = nullptr;
  }
  if (device != nullptr) PTK_CUDA_RETURN_IF_ERROR(cudaFree(device), where);
  device = nullptr;
  max_n = 0;
  const size_t bytes = static_cast<size_t>(EmbeddingBackwardPlanInts(rows)) * sizeof(int32_t);
  for (int k = 0; k < 2; ++k) {
    PTK_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host[k], bytes), where);
    if (uploaded[k] == nullptr)
      PTK_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&uploaded[k], cudaEventDisableTiming), where);
  }
  PTK_CUDA_RETURN_IF_ERROR(cudaMalloc(&device, bytes), where);
  next = 0;
  max_n = rows;
  return absl::OkStatus();
}

template <typename T>
absl::Status EmbeddingForward(T* out, const int32_t* tokens, const int32_t* positions, const T* wte, const T* wpe,
                              int64_t n, int64_t c, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("EmbeddingForward<{}>(n={}, c={})", kernel::TypeName<T>(), n, c); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(tokens, "tokens", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(wte, "wte", where));
  if (wpe != nullptr) PTK_KERNEL_CHECK(kernel::CheckPointer(positions, "positions", where));
  constexpr int kV = kernel::kVec<T>;
  const bool vec = c % kV == 0 && kernel::Aligned(out, 16) && kernel::Aligned(wte, 16) && kernel::Aligned(wpe, 16);
  const int n_per = vec ? kV : 1;
  const int threads = kernel::RowThreads(CeilDiv(c, n_per), kMaxThreads);
  const int64_t chunks = CeilDiv(CeilDiv(c, n_per), threads);
  const unsigned blocks = kernel::GridBlocks(n * chunks, 1, kernel::MaxBlocks(ctx));
  if (vec) {
    EmbeddingForwardKernel<T, kV><<<blocks, threads, 0, ctx.stream>>>(out, tokens, positions, wte, wpe, n, c, chunks);
  } else {
    EmbeddingForwardKernel<T, 1><<<blocks, threads, 0, ctx.stream>>>(out, tokens, positions, wte, wpe, n, c, chunks);
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status EmbeddingBackward(float* dwte, float* dwpe, const T* dout, const int32_t* tokens, const int32_t* positions,
                               const int32_t* tokens_host, const int32_t* positions_host, int64_t n, int64_t c,
                               int64_t vocab_rows, int64_t position_rows, EmbeddingBackwardPlan* plan,
                               const CudaContext& ctx, int64_t vocab_first) {
  auto where = [&] {
    return fmt::format("EmbeddingBackward<{}>(n={}, c={}, vocab_rows={}, position_rows={})", kernel::TypeName<T>(), n,
                       c, vocab_rows, position_rows);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(vocab_rows, "vocab_rows", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(position_rows, "position_rows", where));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dwte, "dwte", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dout, "dout", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(tokens_host, "tokens_host", where));
  if (dwpe != nullptr) PTK_KERNEL_CHECK(kernel::CheckPointer(positions_host, "positions_host", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(plan, "plan", where));
  if (plan->host[0] == nullptr || plan->host[1] == nullptr || plan->device == nullptr || plan->uploaded[0] == nullptr ||
      plan->uploaded[1] == nullptr || plan->max_n < n) {
    return absl::InvalidArgumentError(
        fmt::format("{}: the plan holds {} rows (EmbeddingBackwardPlan::Reserve(n) first)", where(), plan->max_n));
  }
  // This call's staging: the other one than the previous call's, whose upload may still be queued. Its own
  // last upload (two calls back) must have left it before it is rewritten.
  const int k = plan->next;
  int32_t* staging = plan->host[k];
  PTK_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(plan->uploaded[k]), where());
  int64_t token_groups = 0, token_ints = 0, position_groups = 0, position_ints = 0;
  PTK_KERNEL_CHECK(GroupRows(tokens_host, n, vocab_rows, "token", plan->counts, staging, &token_groups, &token_ints,
                             where, vocab_first));
  if (dwpe != nullptr)  // no position table under rotary (or no) position embeddings
    PTK_KERNEL_CHECK(GroupRows(positions_host, n, position_rows, "position", plan->counts, staging + token_ints,
                               &position_groups, &position_ints, where));
  // The device plan is rewritten in stream order, after the previous call's kernels have read it.
  const size_t bytes = static_cast<size_t>(token_ints + position_ints) * sizeof(int32_t);
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(plan->device, staging, bytes, cudaMemcpyHostToDevice, ctx.stream), where());
  PTK_CUDA_RETURN_IF_ERROR(cudaEventRecord(plan->uploaded[k], ctx.stream), where());
  plan->next = 1 - k;
  constexpr int kV = kernel::kVec<T>;
  const bool vec = c % kV == 0 && kernel::Aligned(dout, 16) && kernel::Aligned(dwte, 16) && kernel::Aligned(dwpe, 16);
  if (vec) {
    LaunchBackward<T, kV>(dwte, dout, plan->device, n, token_groups, c, ctx);
    if (dwpe != nullptr) LaunchBackward<T, kV>(dwpe, dout, plan->device + token_ints, n, position_groups, c, ctx);
  } else {
    LaunchBackward<T, 1>(dwte, dout, plan->device, n, token_groups, c, ctx);
    if (dwpe != nullptr) LaunchBackward<T, 1>(dwpe, dout, plan->device + token_ints, n, position_groups, c, ctx);
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status EmbeddingForward<T>(T*, const int32_t*, const int32_t*, const T*, const T*, int64_t, int64_t,  \
                                            const CudaContext&);                                                       \
  template absl::Status EmbeddingBackward<T>(float*, float*, const T*, const int32_t*, const int32_t*, const int32_t*, \
                                             const int32_t*, int64_t, int64_t, int64_t, int64_t,                       \
                                             EmbeddingBackwardPlan*, const CudaContext&, int64_t);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
