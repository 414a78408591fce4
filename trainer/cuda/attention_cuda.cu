// Causal self-attention on the GPU, beside trainer/cpu/attention_cpu.cpp, over Megatron's fused
// QKV layout qkv(b, t, nh, 3, hd).
//
// fp32 (AttentionForward / AttentionBackward): the CPU op's algorithm, step for step, so that it is
// compared tightly with it. Products are cuBLAS strided-batched GEMMs over the heads of one batch
// element (the head stride of q/k/v is 3*hd, the row stride 3*c; pedantic fp32, never TF32), the
// causal softmax and its backward are kernels here with the CPU's arithmetic (max, exp in fp32,
// sums in double, one rounding of 1/sum), and attention dropout uses the CPU's counter hash with
// the CPU's keys: stream streams[batch] + head, element index i * t + j of the t x t matrix.
// Column-major views of the row-major matrices (see matmul_cuda.cu): S^T = K Q^T, out^T = V^T P'^T,
// dV^T = dY^T P', dP'^T = V dY^T, dQ^T = K^T dS^T, dK^T = Q^T dS.
// With dropout the forward has no buffer for the dropped probabilities (probs must keep them before
// dropout, and the op takes no scratch): it writes them into probs, takes the product with V, then
// computes S and the softmax again into probs (the same bits: the same GEMM and kernel on the same
// inputs). That costs one more t x t product per head than the CPU, in fp32 mode only.
//
// bf16/fp16 (FlashAttentionForward / Backward): cuDNN's fused flash attention through the
// cudnn-frontend graph API; Q, K, V, O, dO, dQ, dK, dV are strided views into qkv / out / dqkv (no
// copies), stats(b, nh, t) the fp32 log-sum-exp cuDNN keeps for backward. Graphs are built once per
// shape (and dropout probability, direction, determinism) per cuDNN handle and cached.
#include <cudnn.h>
#include <fmt/core.h>

// cudnn-frontend without its JSON serialisation (only needed for graph (de)serialisation): faster
// to compile, the same graphs.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

std::string ShapeString(const AttentionShape& s) {
  return fmt::format("b={}, t={}, nh={}, hd={}", s.b, s.t, s.nh, s.hd);
}

absl::Status CheckShape(const AttentionShape& s, const std::string& where) {
  if (s.b <= 0 || s.t <= 0 || s.nh <= 0 || s.hd <= 0)
    return absl::InvalidArgumentError(fmt::format("{}: every size must be positive", where));
  if (s.t > INT_MAX / 4 || 3 * s.nh * s.hd > INT_MAX || s.nh > INT_MAX)
    return absl::InvalidArgumentError(fmt::format("{}: sizes beyond cuBLAS's int range", where));
  return absl::OkStatus();
}

// ---- fp32: kernels -------------------------------------------------------------------------------

constexpr int kMaxRowThreads = 256;

int RowThreadsFor(int64_t t) {
  int64_t n = CeilDiv(t, 32) * 32;
  if (n > kMaxRowThreads) n = kMaxRowThreads;
  return static_cast<int>(n);
}

// Block reductions in a fixed order (warp trees, then warp 0 over the warps' results): the same
// inputs give the same bits. Every thread gets the result. blockDim.x is a multiple of 32.
__device__ __forceinline__ float BlockMax(float v, float* shared) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float x = lane < warps ? shared[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_down_sync(0xffffffffu, x, o));
    if (lane == 0) shared[32] = x;
  }
  __syncthreads();
  const float r = shared[32];
  __syncthreads();  // shared may be reused right after
  return r;
}
__device__ __forceinline__ double BlockSum(double v, double* shared) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double x = lane < warps ? shared[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if (lane == 0) shared[32] = x;
  }
  __syncthreads();
  const double r = shared[32];
  __syncthreads();
  return r;
}

struct DropoutArgs {
  bool on = false;
  uint32_t threshold = 0;
  float scale = 1.0f;  // 1/(1-p) rounded to fp32, as the CPU's static_cast<T>(1.0 / (1.0 - p))
  uint64_t seed = 0;
  const uint64_t* streams = nullptr;  // device, one per batch element; head h uses streams[b] + h
};

// The dropout key of row `row` of a (b, nh, t, t) tensor: stream streams[b] + h (cpu::AttentionForward).
__device__ __forceinline__ uint64_t RowKey(const DropoutArgs& d, int64_t row, int64_t t, int64_t nh) {
  const int64_t bh = row / t;
  const uint64_t stream = d.streams[bh / nh] + static_cast<uint64_t>(bh % nh);
  return DropoutKey(d.seed, stream);
}

// One block per row of probs(b, nh, t, t), rows starting at `row0`: the causal softmax of the
// scores in place (S(i, j) for j <= i; zeros above the diagonal), then dropout when d.on.
__global__ void CausalSoftmaxKernel(float* __restrict__ probs, int64_t row0, int64_t t, int64_t nh, DropoutArgs d) {
  __shared__ float smax[33];
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t;
  float* r = probs + row * t;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, r[j]);
  mx = BlockMax(mx, smax);
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(r[j] - mx);
    r[j] = e;
    sum += static_cast<double>(e);
  }
  sum = BlockSum(sum, ssum);
  const float inv = static_cast<float>(1.0 / sum);
  const uint64_t key = d.on ? RowKey(d, row, t, nh) : 0;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = 0.0f;
    if (j <= i) {
      v = r[j] * inv;
      if (d.on) v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
    }
    r[j] = v;
  }
}

// dst = dropout(src) over rows of (t, t) matrices (the causal part; above the diagonal copied,
// where the probabilities are zero): rows [row0, row0 + gridDim.x) of probs into dst's rows 0...
__global__ void DropoutCopyKernel(float* __restrict__ dst, const float* __restrict__ src, int64_t row0, int64_t t,
                                  int64_t nh, DropoutArgs d) {
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t;
  const float* s = src + row * t;
  float* o = dst + static_cast<int64_t>(blockIdx.x) * t;
  const uint64_t key = RowKey(d, row, t, nh);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float v = s[j];
    if (j <= i) v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
    o[j] = v;
  }
}

// Softmax backward of one row, in place in dp (rows [row0, row0 + gridDim.x) of probs; dp's rows
// from 0): dP = dropout(dP'), dot = sum_j P dP (double), dS = P * (dP - dot) * scale, zeros above
// the diagonal. The CPU's expression order throughout.
__global__ void SoftmaxBackwardKernel(float* __restrict__ dp, const float* __restrict__ probs, int64_t row0, int64_t t,
                                      int64_t nh, float scale, DropoutArgs d) {
  __shared__ double ssum[33];
  const int64_t row = row0 + blockIdx.x;
  const int64_t i = row % t;
  const float* p = probs + row * t;
  float* g = dp + static_cast<int64_t>(blockIdx.x) * t;
  const uint64_t key = d.on ? RowKey(d, row, t, nh) : 0;
  double dot = 0.0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    float v = g[j];
    if (d.on) {
      v = DropoutKeepKeyed(key, static_cast<uint64_t>(i * t + j), d.threshold) ? v * d.scale : 0.0f;
      g[j] = v;
    }
    dot += static_cast<double>(p[j]) * static_cast<double>(v);
  }
  dot = BlockSum(dot, ssum);
  const float tdot = static_cast<float>(dot);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) g[j] = j <= i ? p[j] * (g[j] - tdot) * scale : 0.0f;
}

// ---- fp32: products ------------------------------------------------------------------------------

// C = alpha op(A) op(B) + beta C, column-major, batched over the heads (fp32, pedantic: no TF32).
struct Batched {
  cublasOperation_t ta, tb;
  int64_t m, n, k;
  const float* a;
  int64_t lda, stride_a;
  const float* b;
  int64_t ldb, stride_b;
  float* c;
  int64_t ldc, stride_c;
};

absl::Status RunBatched(const Batched& g, float alpha, int64_t count, const CudaContext& ctx,
                        const std::string& where) {
  const float beta = 0.0f;
  PTK_CUBLAS_RETURN_IF_ERROR(
      cublasGemmStridedBatchedEx(ctx.cublas, g.ta, g.tb, static_cast<int>(g.m), static_cast<int>(g.n),
                                 static_cast<int>(g.k), &alpha, g.a, CUDA_R_32F, static_cast<int>(g.lda),
                                 static_cast<long long>(g.stride_a), g.b, CUDA_R_32F, static_cast<int>(g.ldb),
                                 static_cast<long long>(g.stride_b), &beta, g.c, CUDA_R_32F, static_cast<int>(g.ldc),
                                 static_cast<long long>(g.stride_c), static_cast<int>(count),
                                 CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
      where);
  return absl::OkStatus();
}

absl::Status UseStream(const CudaContext& ctx, const std::string& where) {
  if (!ctx.cublas) return absl::FailedPreconditionError(fmt::format("{}: the context has no cuBLAS handle", where));
  cudaStream_t current = nullptr;
  PTK_CUBLAS_RETURN_IF_ERROR(cublasGetStream(ctx.cublas, &current), where);
  if (current != ctx.stream) PTK_CUBLAS_RETURN_IF_ERROR(cublasSetStream(ctx.cublas, ctx.stream), where);
  return absl::OkStatus();
}

absl::Status MakeDropout(double p, uint64_t seed, const uint64_t* streams, const std::string& where, DropoutArgs* d) {
  if (!(p >= 0.0 && p < 1.0))
    return absl::InvalidArgumentError(fmt::format("{}: dropout probability {} outside [0, 1)", where, p));
  if (p <= 0.0) return absl::OkStatus();
  if (!streams) return absl::InvalidArgumentError(fmt::format("{}: dropout {} without streams", where, p));
  d->on = true;
  d->threshold = DropoutKeepThreshold(p);
  d->scale = static_cast<float>(1.0 / (1.0 - p));
  d->seed = seed;
  d->streams = streams;
  return absl::OkStatus();
}

// S = scale Q K^T for every head of every batch element, into probs (b, nh, t, t).
absl::Status Scores(float* probs, const float* qkv, const AttentionShape& s, float scale, const CudaContext& ctx,
                    const std::string& where) {
  const int64_t t = s.t, hd = s.hd, c3 = 3 * s.nh * s.hd;
  for (int64_t b = 0; b < s.b; ++b) {
    const float* q = qkv + b * t * c3;
    // S^T(j, i) = sum_d K[j, d] Q[i, d]: A = K stored (hd, t) op T, B = Q stored (hd, t) op N.
    absl::Status st = RunBatched(
        {CUBLAS_OP_T, CUBLAS_OP_N, t, t, hd, q + hd, c3, 3 * hd, q, c3, 3 * hd, probs + b * s.nh * t * t, t, t * t},
        scale, s.nh, ctx, where);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status Softmax(float* probs, const AttentionShape& s, const DropoutArgs& d, const CudaContext& ctx,
                     const std::string& where) {
  const int64_t rows = s.b * s.nh * s.t;
  // grid.x is at most 2^31 - 1 blocks: rows go in launches of at most that many
  constexpr int64_t kMaxGrid = INT_MAX;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGrid) {
    const int64_t count = rows - r0 < kMaxGrid ? rows - r0 : kMaxGrid;
    CausalSoftmaxKernel<<<static_cast<unsigned>(count), RowThreadsFor(s.t), 0, ctx.stream>>>(probs, r0, s.t, s.nh, d);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  }
  return absl::OkStatus();
}

// ---- bf16 / fp16: cuDNN --------------------------------------------------------------------------

namespace fe = cudnn_frontend;

absl::Status CudnnError(cudnnStatus_t st, std::string_view call, std::string_view where) {
  return absl::InternalError(fmt::format("cuDNN error in {}: {} failed: {}", where, call, cudnnGetErrorString(st)));
}
#define PTK_CUDNN_RETURN_IF_ERROR(call, where)                                                     \
  do {                                                                                             \
    cudnnStatus_t ptk_cudnn_err_ = (call);                                                         \
    if (ptk_cudnn_err_ != CUDNN_STATUS_SUCCESS) return CudnnError(ptk_cudnn_err_, #call, (where)); \
  } while (0)

// Tensor ids in the graphs' variant packs.
enum : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeed, kOffset };

struct FlashKey {
  const void* handle;
  int io_type;
  bool backward;
  int64_t b, t, nh, hd;
  uint64_t p_bits;  // the dropout probability, bit for bit (it is part of the graph)
  bool deterministic;
  auto Tie() const { return std::tie(handle, io_type, backward, b, t, nh, hd, p_bits, deterministic); }
  bool operator<(const FlashKey& o) const { return Tie() < o.Tie(); }
};
struct FlashGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

struct CudnnState {
  std::mutex mu;
  std::map<FlashKey, FlashGraph> graphs;
  std::map<const void*, int64_t*> rng;  // per handle: device int64[2], the dropout seed and offset
};
CudnnState& State() {
  static auto* s = new CudnnState;  // never destroyed: no static-destruction order with CUDA's
  return *s;
}

__global__ void SetRngKernel(int64_t* rng, int64_t seed, int64_t offset) {
  rng[0] = seed;
  rng[1] = offset;
}

std::string FeMessage(fe::error_t e) { return e.get_message(); }

// Builds the forward or backward graph. An empty workspace limit (< 0) lets cuDNN choose freely;
// otherwise plans needing more than `max_workspace` bytes are set aside.
absl::Status BuildFlashGraph(const FlashKey& key, double p, cudnnHandle_t handle, int64_t max_workspace,
                             const std::string& where, FlashGraph* out) {
  const int64_t b = key.b, t = key.t, nh = key.nh, hd = key.hd, c = nh * hd, c3 = 3 * c;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const bool dropout = p > 0.0;
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(key.io_type == CUDA_R_16BF ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    // qkv(b, t, nh, 3, hd) seen as (b, nh, t, hd): batch stride t*3c, head stride 3hd, row stride 3c.
    auto qkv_view = [&](const char* name, int64_t uid) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({b, nh, t, hd})
                           .set_stride({t * c3, 3 * hd, c3, 1}));
    };
    // out(b, t, nh*hd) as (b, nh, t, hd).
    const std::vector<int64_t> o_dim{b, nh, t, hd}, o_stride{t * c, hd, c, 1};
    const std::vector<int64_t> stats_dim{b, nh, t, 1}, stats_stride{nh * t, t, 1, 1};
    auto Q = qkv_view("Q", kQ), K = qkv_view("K", kK), V = qkv_view("V", kV);
    std::shared_ptr<fe::graph::Tensor_attributes> seed, offset;
    if (dropout) {
      seed = g->tensor(fe::graph::Tensor_attributes()
                           .set_name("Seed")
                           .set_uid(kSeed)
                           .set_dim({1, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT64));
      offset = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("Offset")
                             .set_uid(kOffset)
                             .set_dim({1, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::INT64));
    }
    if (!key.backward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("ptk_flash_attention")
                      .set_generate_stats(true)
                      .set_causal_mask(true)
                      .set_attn_scale(scale);
      if (dropout) opts.set_dropout(static_cast<float>(p), seed, offset);
      auto [O, Stats] = g->sdpa(Q, K, V, opts);
      O->set_output(true).set_uid(kO).set_dim(o_dim).set_stride(o_stride);
      Stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(stats_dim)
          .set_stride(stats_stride);
    } else {
      auto O = g->tensor(fe::graph::Tensor_attributes().set_name("O").set_uid(kO).set_dim(o_dim).set_stride(o_stride));
      auto dO =
          g->tensor(fe::graph::Tensor_attributes().set_name("dO").set_uid(kDO).set_dim(o_dim).set_stride(o_stride));
      auto Stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim(stats_dim)
                                 .set_stride(stats_stride)
                                 .set_data_type(fe::DataType_t::FLOAT));
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("ptk_flash_attention_backward")
                      .set_causal_mask(true)
                      .set_attn_scale(scale);
      if (dropout) opts.set_dropout(static_cast<float>(p), seed, offset);
      if (key.deterministic) opts.set_deterministic_algorithm(true);
      auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
      const std::vector<int64_t> qkv_dim{b, nh, t, hd}, qkv_stride{t * c3, 3 * hd, c3, 1};
      dQ->set_output(true).set_uid(kDQ).set_dim(qkv_dim).set_stride(qkv_stride);
      dK->set_output(true).set_uid(kDK).set_dim(qkv_dim).set_stride(qkv_stride);
      dV->set_output(true).set_uid(kDV).set_dim(qkv_dim).set_stride(qkv_stride);
    }
    if (max_workspace >= 0) g->deselect_workspace_greater_than(max_workspace);
    // validate, lower to cuDNN, ask the heuristics (A, then the fallback list), keep the first plan
    // that builds: Graph::build's steps, one by one so that a failure names its step.
    // (error_t is [[nodiscard]], its assignments too: hence the (void) casts.)
    const char* step = "validate";
    fe::error_t e = g->validate();
    if (e.is_good()) (void)(e = (step = "build_operation_graph", g->build_operation_graph(handle)));
    if (e.is_good())
      (void)(e = (step = "create_execution_plans",
                  g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})));
    if (e.is_good()) (void)(e = (step = "check_support", g->check_support()));
    if (e.is_good()) (void)(e = (step = "build_plans", g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE)));
    if (e.is_bad()) {
      std::string why = fmt::format("{}: {}", step, e.get_message());
      return absl::UnimplementedError(
          fmt::format("{}: cuDNN has no fused attention for this {}{}: {}", where,
                      max_workspace >= 0 ? "workspace limit, shape and type" : "shape and type",
                      max_workspace >= 0 ? fmt::format(" ({} bytes)", max_workspace) : "", why));
    }
    int64_t ws = 0;
    (void)(e = g->get_workspace_size(ws));
    if (e.is_bad()) return absl::InternalError(fmt::format("{}: cuDNN workspace query: {}", where, FeMessage(e)));
    out->graph = std::move(g);
    out->workspace = ws;
  } catch (const std::exception& ex) {
    return absl::InternalError(fmt::format("{}: cudnn-frontend threw while building the graph: {}", where, ex.what()));
  }
  return absl::OkStatus();
}

template <typename T>
FlashKey MakeKey(const CudaContext& ctx, bool backward, const AttentionShape& s, double p) {
  uint64_t bits = 0;
  static_assert(sizeof(bits) == sizeof(p));
  std::memcpy(&bits, &p, sizeof(p));
  return FlashKey{ctx.cudnn, static_cast<int>(CudaDataType<T>()), backward, s.b, s.t, s.nh, s.hd,
                  bits,      backward && ctx.deterministic};
}

template <typename T>
absl::Status CheckFlash(const AttentionShape& s, double p, const CudaContext& ctx, const std::string& where) {
  static_assert(!std::is_same_v<T, float>, "fp32 attention is AttentionForward / AttentionBackward");
  if (absl::Status st = CheckShape(s, where); !st.ok()) return st;
  if (!(p >= 0.0 && p < 1.0))
    return absl::InvalidArgumentError(fmt::format("{}: dropout probability {} outside [0, 1)", where, p));
  if (!ctx.cudnn)
    return absl::FailedPreconditionError(
        fmt::format("{}: the context has no cuDNN handle (CreateCudnnHandle first)", where));
  return absl::OkStatus();
}

// The graph for `key`, built on first use; with `max_workspace` >= 0 one whose workspace fits.
absl::Status FindGraph(const FlashKey& key, double p, const CudaContext& ctx, int64_t max_workspace,
                       const std::string& where, FlashGraph* out) {
  CudnnState& st = State();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.graphs.find(key);
  if (it != st.graphs.end() && (max_workspace < 0 || it->second.workspace <= max_workspace)) {
    *out = it->second;
    return absl::OkStatus();
  }
  FlashGraph built;
  absl::Status s = BuildFlashGraph(key, p, static_cast<cudnnHandle_t>(ctx.cudnn), max_workspace, where, &built);
  if (!s.ok() && max_workspace >= 0) {
    // No plan within the limit: is it the limit? A plan without one says how much it would take.
    FlashGraph free_plan;
    if (BuildFlashGraph(key, p, static_cast<cudnnHandle_t>(ctx.cudnn), -1, where, &free_plan).ok()) {
      st.graphs[key] = free_plan;  // what FlashAttentionWorkspaceBytes reports
      if (free_plan.workspace > max_workspace)
        return absl::ResourceExhaustedError(fmt::format(
            "{}: cuDNN's fused attention needs {} bytes of workspace for this shape, the context has {} (size the "
            "workspace with FlashAttentionWorkspaceBytes)",
            where, free_plan.workspace, max_workspace));
      *out = free_plan;  // cuDNN's choice among fewer plans failed, its free choice fits
      return absl::OkStatus();
    }
  }
  if (!s.ok()) return s;
  st.graphs[key] = built;
  *out = built;
  return absl::OkStatus();
}

absl::Status RngPointer(const CudaContext& ctx, uint64_t seed, uint64_t offset, const std::string& where,
                        int64_t** rng) {
  CudnnState& st = State();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    int64_t*& buf = st.rng[ctx.cudnn];
    if (!buf) {
      void* p = nullptr;
      PTK_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, 2 * sizeof(int64_t)), where);
      buf = static_cast<int64_t*>(p);
    }
    *rng = buf;
  }
  // Written in stream order: a graph launched before reads the previous values, one after these.
  SetRngKernel<<<1, 1, 0, ctx.stream>>>(*rng, static_cast<int64_t>(seed), static_cast<int64_t>(offset));
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

absl::Status ExecuteGraph(const FlashGraph& fg, std::unordered_map<int64_t, void*>& pack, const CudaContext& ctx,
                          const std::string& where) {
  if (fg.workspace > 0 && (!ctx.workspace || static_cast<int64_t>(ctx.workspace_bytes) < fg.workspace))
    return absl::ResourceExhaustedError(fmt::format("{}: cuDNN's plan needs {} bytes of workspace, the context has {}",
                                                    where, fg.workspace, ctx.workspace ? ctx.workspace_bytes : 0));
  PTK_CUDNN_RETURN_IF_ERROR(cudnnSetStream(static_cast<cudnnHandle_t>(ctx.cudnn), ctx.stream), where);
  try {
    fe::error_t e = fg.graph->execute(static_cast<cudnnHandle_t>(ctx.cudnn), pack, ctx.workspace);
    if (e.is_bad()) return absl::InternalError(fmt::format("{}: cuDNN execution failed: {}", where, FeMessage(e)));
  } catch (const std::exception& ex) {
    return absl::InternalError(fmt::format("{}: cudnn-frontend threw while executing: {}", where, ex.what()));
  }
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
  return absl::OkStatus();
}

template <typename T>
constexpr const char* FlashType() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

}  // namespace

// ---- fp32 ------------------------------------------------------------------------------------------

absl::Status AttentionForward(float* out, float* probs, const float* qkv, const AttentionShape& s, double p,
                              uint64_t seed, const uint64_t* streams, const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionForward<fp32>({}, p={})", ShapeString(s), p);
  if (absl::Status st = CheckShape(s, where); !st.ok()) return st;
  if (!out || !probs || !qkv) return absl::InvalidArgumentError(fmt::format("{}: out, probs, qkv must be set", where));
  DropoutArgs d;
  if (absl::Status st = MakeDropout(p, seed, streams, where, &d); !st.ok()) return st;
  if (absl::Status st = UseStream(ctx, where); !st.ok()) return st;
  const int64_t t = s.t, hd = s.hd, c = s.nh * s.hd, c3 = 3 * c;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  if (absl::Status st = Scores(probs, qkv, s, scale, ctx, where); !st.ok()) return st;
  if (absl::Status st = Softmax(probs, s, d, ctx, where); !st.ok()) return st;  // P, or P' with dropout
  for (int64_t b = 0; b < s.b; ++b) {
    // out^T(d, i) = sum_j V[j, d] P'[i, j]: A = V stored (hd, t) op N, B = P' stored (t, t) op N.
    const float* v = qkv + b * t * c3 + 2 * hd;
    if (absl::Status st = RunBatched({CUBLAS_OP_N, CUBLAS_OP_N, hd, t, t, v, c3, 3 * hd, probs + b * s.nh * t * t, t,
                                      t * t, out + b * t * c, c, hd},
                                     1.0f, s.nh, ctx, where);
        !st.ok())
      return st;
  }
  if (d.on) {  // probs back to the probabilities before dropout
    if (absl::Status st = Scores(probs, qkv, s, scale, ctx, where); !st.ok()) return st;
    if (absl::Status st = Softmax(probs, s, DropoutArgs{}, ctx, where); !st.ok()) return st;
  }
  return absl::OkStatus();
}

int64_t AttentionBackwardScratch(const AttentionShape& s) { return s.nh * s.t * s.t; }

absl::Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* probs,
                               const AttentionShape& s, double p, uint64_t seed, const uint64_t* streams,
                               float* scratch, const CudaContext& ctx) {
  const std::string where = fmt::format("AttentionBackward<fp32>({}, p={})", ShapeString(s), p);
  if (absl::Status st = CheckShape(s, where); !st.ok()) return st;
  if (!dqkv || !dout || !qkv || !probs || !scratch)
    return absl::InvalidArgumentError(fmt::format("{}: dqkv, dout, qkv, probs, scratch must be set", where));
  DropoutArgs d;
  if (absl::Status st = MakeDropout(p, seed, streams, where, &d); !st.ok()) return st;
  if (absl::Status st = UseStream(ctx, where); !st.ok()) return st;
  const int64_t t = s.t, hd = s.hd, nh = s.nh, c = nh * hd, c3 = 3 * c;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int threads = RowThreadsFor(t);
  const int64_t rows = nh * t;  // rows of one batch element; scratch holds them
  if (rows > INT_MAX) return absl::InvalidArgumentError(fmt::format("{}: nh * t beyond one launch", where));
  for (int64_t b = 0; b < s.b; ++b) {
    const float* q = qkv + b * t * c3;
    const float* k = q + hd;
    const float* v = q + 2 * hd;
    float* dq = dqkv + b * t * c3;
    float* dk = dq + hd;
    float* dv = dq + 2 * hd;
    const float* dy = dout + b * t * c;
    const float* pr = probs + b * nh * t * t;
    const int64_t row0 = b * nh * t;
    const float* pd = pr;
    if (d.on) {  // P' = dropout(P) into the scratch
      DropoutCopyKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, row0, t, nh, d);
      PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
      pd = scratch;
    }
    // dV^T(d, j) = sum_i dY[i, d] P'[i, j]: A = dY stored (hd, t) op N, B = P' stored (t, t) op T.
    if (absl::Status st = RunBatched({CUBLAS_OP_N, CUBLAS_OP_T, hd, t, t, dy, c, hd, pd, t, t * t, dv, c3, 3 * hd},
                                     1.0f, nh, ctx, where);
        !st.ok())
      return st;
    // dP'^T(j, i) = sum_d V[j, d] dY[i, d]: A = V stored (hd, t) op T, B = dY stored (hd, t) op N.
    if (absl::Status st = RunBatched({CUBLAS_OP_T, CUBLAS_OP_N, t, t, hd, v, c3, 3 * hd, dy, c, hd, scratch, t, t * t},
                                     1.0f, nh, ctx, where);
        !st.ok())
      return st;
    SoftmaxBackwardKernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(scratch, probs, row0, t, nh, scale,
                                                                                   d);
    PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where);
    // dQ^T(d, i) = sum_j K[j, d] dS[i, j]: A = K stored (hd, t) op N, B = dS stored (t, t) op N.
    if (absl::Status st =
            RunBatched({CUBLAS_OP_N, CUBLAS_OP_N, hd, t, t, k, c3, 3 * hd, scratch, t, t * t, dq, c3, 3 * hd}, 1.0f, nh,
                       ctx, where);
        !st.ok())
      return st;
    // dK^T(d, j) = sum_i Q[i, d] dS[i, j]: A = Q stored (hd, t) op N, B = dS stored (t, t) op T.
    if (absl::Status st =
            RunBatched({CUBLAS_OP_N, CUBLAS_OP_T, hd, t, t, q, c3, 3 * hd, scratch, t, t * t, dk, c3, 3 * hd}, 1.0f, nh,
                       ctx, where);
        !st.ok())
      return st;
  }
  return absl::OkStatus();
}

// ---- cuDNN handle ------------------------------------------------------------------------------------

absl::Status CreateCudnnHandle(CudaContext* ctx) {
  if (ctx->cudnn) return absl::OkStatus();
  const size_t version = cudnnGetVersion();
  if (version < 90000)
    return absl::FailedPreconditionError(
        fmt::format("cuDNN {} was loaded at run time; ptk's fused attention needs cuDNN 9 (built against {})", version,
                    CUDNN_VERSION));
  cudnnHandle_t h = nullptr;
  PTK_CUDNN_RETURN_IF_ERROR(cudnnCreate(&h), "creating the cuDNN handle");
  if (cudnnStatus_t st = cudnnSetStream(h, ctx->stream); st != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(h);
    return CudnnError(st, "cudnnSetStream", "creating the cuDNN handle");
  }
  ctx->cudnn = h;
  return absl::OkStatus();
}

void DestroyCudnnHandle(CudaContext* ctx) {
  if (!ctx->cudnn) return;
  CudnnState& st = State();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (auto it = st.graphs.begin(); it != st.graphs.end();) {
      if (it->first.handle == ctx->cudnn)
        it = st.graphs.erase(it);
      else
        ++it;
    }
    auto r = st.rng.find(ctx->cudnn);
    if (r != st.rng.end()) {
      cudaFree(r->second);
      st.rng.erase(r);
    }
  }
  cudnnDestroy(static_cast<cudnnHandle_t>(ctx->cudnn));
  ctx->cudnn = nullptr;
}

// ---- bf16 / fp16 -----------------------------------------------------------------------------------

template <typename T>
absl::StatusOr<int64_t> FlashAttentionWorkspaceBytes(const AttentionShape& s, double p, const CudaContext& ctx) {
  const std::string where =
      fmt::format("FlashAttentionWorkspaceBytes<{}>({}, p={})", FlashType<T>(), ShapeString(s), p);
  if (absl::Status st = CheckFlash<T>(s, p, ctx, where); !st.ok()) return st;
  int64_t most = 0;
  for (bool backward : {false, true}) {
    FlashGraph fg;
    if (absl::Status st = FindGraph(MakeKey<T>(ctx, backward, s, p), p, ctx, -1, where, &fg); !st.ok()) return st;
    if (fg.workspace > most) most = fg.workspace;
  }
  return most;
}

template <typename T>
absl::Status FlashAttentionForward(T* out, float* stats, const T* qkv, const AttentionShape& s, double p, uint64_t seed,
                                   uint64_t offset, const CudaContext& ctx) {
  const std::string where = fmt::format("FlashAttentionForward<{}>({}, p={})", FlashType<T>(), ShapeString(s), p);
  if (absl::Status st = CheckFlash<T>(s, p, ctx, where); !st.ok()) return st;
  if (!out || !stats || !qkv) return absl::InvalidArgumentError(fmt::format("{}: out, stats, qkv must be set", where));
  FlashGraph fg;
  const int64_t limit = ctx.workspace ? static_cast<int64_t>(ctx.workspace_bytes) : 0;
  if (absl::Status st = FindGraph(MakeKey<T>(ctx, false, s, p), p, ctx, limit, where, &fg); !st.ok()) return st;
  T* q = const_cast<T*>(qkv);
  std::unordered_map<int64_t, void*> pack{{kQ, q}, {kK, q + s.hd}, {kV, q + 2 * s.hd}, {kO, out}, {kStats, stats}};
  if (p > 0.0) {
    int64_t* rng = nullptr;
    if (absl::Status st = RngPointer(ctx, seed, offset, where, &rng); !st.ok()) return st;
    pack[kSeed] = rng;
    pack[kOffset] = rng + 1;
  }
  return ExecuteGraph(fg, pack, ctx, where);
}

template <typename T>
absl::Status FlashAttentionBackward(T* dqkv, const T* dout, const T* out, const float* stats, const T* qkv,
                                    const AttentionShape& s, double p, uint64_t seed, uint64_t offset,
                                    const CudaContext& ctx) {
  const std::string where = fmt::format("FlashAttentionBackward<{}>({}, p={}{})", FlashType<T>(), ShapeString(s), p,
                                        ctx.deterministic ? ", deterministic" : "");
  if (absl::Status st = CheckFlash<T>(s, p, ctx, where); !st.ok()) return st;
  if (!dqkv || !dout || !out || !stats || !qkv)
    return absl::InvalidArgumentError(fmt::format("{}: dqkv, dout, out, stats, qkv must be set", where));
  FlashGraph fg;
  const int64_t limit = ctx.workspace ? static_cast<int64_t>(ctx.workspace_bytes) : 0;
  if (absl::Status st = FindGraph(MakeKey<T>(ctx, true, s, p), p, ctx, limit, where, &fg); !st.ok()) return st;
  T* q = const_cast<T*>(qkv);
  std::unordered_map<int64_t, void*> pack{{kQ, q},
                                          {kK, q + s.hd},
                                          {kV, q + 2 * s.hd},
                                          {kO, const_cast<T*>(out)},
                                          {kDO, const_cast<T*>(dout)},
                                          {kStats, const_cast<float*>(stats)},
                                          {kDQ, dqkv},
                                          {kDK, dqkv + s.hd},
                                          {kDV, dqkv + 2 * s.hd}};
  if (p > 0.0) {
    int64_t* rng = nullptr;
    if (absl::Status st = RngPointer(ctx, seed, offset, where, &rng); !st.ok()) return st;
    pack[kSeed] = rng;
    pack[kOffset] = rng + 1;
  }
  return ExecuteGraph(fg, pack, ctx, where);
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::StatusOr<int64_t> FlashAttentionWorkspaceBytes<T>(const AttentionShape&, double, const CudaContext&); \
  template absl::Status FlashAttentionForward<T>(T*, float*, const T*, const AttentionShape&, double, uint64_t,        \
                                                 uint64_t, const CudaContext&);                                        \
  template absl::Status FlashAttentionBackward<T>(T*, const T*, const T*, const float*, const T*,                      \
                                                  const AttentionShape&, double, uint64_t, uint64_t,                   \
                                                  const CudaContext&);
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
