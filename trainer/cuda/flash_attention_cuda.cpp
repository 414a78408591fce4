// Causal self-attention on the GPU in bf16/fp16: cuDNN's fused flash attention, its graphs built and cached.
//
// FlashAttentionForward / Backward, beside the fp32 kernels of attention_cuda.cu, over Megatron's fused QKV layout
// qkv(b, t, nh, 3, hd) (grouped-query attention: heads first, QkvGroupsToHeads), through the cudnn-frontend graph
// API; Q, K, V, O, dO, dQ, dK, dV are strided views into qkv / out / dqkv (no copies), stats(b, nh, t) the fp32
// log-sum-exp cuDNN keeps for backward. Graphs are built once per shape (and dropout probability, direction,
// determinism) per cuDNN handle and cached. Context parallelism's pairs of chunks (context_flash_cuda.h) build
// theirs here too, over ContextFlashViews' strided views of the gathered rows, keyed apart by the pair's mask.
// Host code (the one kernel, the dropout seed's, is attention_cuda.cu's): the C++ compiler builds it once,
// where nvcc parsed cudnn-frontend's headers again for each architecture (twice the CPU time).
#include <cudnn.h>
#include <fmt/core.h>

// cudnn-frontend without its JSON serialisation (only needed for graph (de)serialisation): faster
// to compile, the same graphs.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "trainer/cuda/attention_check.h"
#include "trainer/cuda/context_flash_cuda.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using attention_detail::CheckShape;
using attention_detail::ShapeString;

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
// A context-parallel pair's mask (FlashKey::pair): the query chunk with itself (causal) or an earlier chunk (none).
enum : int { kPairCausal = 1, kPairFull = 2 };

struct FlashKey {
  const void* handle;
  int io_type;
  bool backward;
  int64_t b, t, nh, hd, groups;  // groups < nh: grouped-query attention, qkv heads first
  uint64_t p_bits;               // the dropout probability, bit for bit (it is part of the graph)
  bool deterministic;
  int pair = 0;  // 0: the single-GPU graph; a context-parallel pair's (ContextFlashPair*): kPairCausal, kPairFull
  auto Tie() const { return std::tie(handle, io_type, backward, b, t, nh, hd, groups, p_bits, deterministic, pair); }
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

std::string FeMessage(fe::error_t e) { return e.get_message(); }

// Validates `g`, lowers it to cuDNN, asks the heuristics (A, then the fallback list) and keeps the first plan that
// builds: Graph::build's steps, one by one so that a failure names its step. An empty workspace limit (< 0) lets
// cuDNN choose freely; otherwise plans needing more than `max_workspace` bytes are set aside.
// (error_t is [[nodiscard]], its assignments too: hence the (void) casts.)
absl::Status BuildPlans(std::shared_ptr<fe::graph::Graph> g, cudnnHandle_t handle, int64_t max_workspace,
                        const std::string& where, FlashGraph* out) {
  try {
    if (max_workspace >= 0) g->deselect_workspace_greater_than(max_workspace);
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

// Builds a context-parallel pair's forward or backward graph (key.pair: the mask; key.t: the rank's rows of a
// sample, two chunks) over ContextFlashViews' strided views; no dropout (the rows path keeps attention dropout).
absl::Status BuildPairGraph(const FlashKey& key, cudnnHandle_t handle, int64_t max_workspace, const std::string& where,
                            FlashGraph* out) {
  const context_detail::FlashPairShape s{key.b, key.t, key.nh, key.groups, key.hd, 1};
  const bool causal = key.pair == kPairCausal;
  const context_detail::FlashPairViews v = context_detail::ContextFlashViews(s, {0, 0, 0, causal, true});
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(key.hd)));
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(key.io_type == CUDA_R_16BF ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto dims = [](const context_detail::FlashView& fv) { return std::vector<int64_t>(fv.dim, fv.dim + 4); };
    auto strides = [](const context_detail::FlashView& fv) { return std::vector<int64_t>(fv.stride, fv.stride + 4); };
    auto input = [&](const char* name, int64_t uid, const context_detail::FlashView& fv) {
      return g->tensor(
          fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims(fv)).set_stride(strides(fv)));
    };
    auto Q = input("Q", kQ, v.q), K = input("K", kK, v.k), V = input("V", kV, v.v);
    if (!key.backward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("ptk_context_flash_pair")
                      .set_generate_stats(true)
                      .set_causal_mask(causal)
                      .set_attn_scale(scale);
      auto [O, Stats] = g->sdpa(Q, K, V, opts);
      O->set_output(true).set_uid(kO).set_dim(dims(v.part_out)).set_stride(strides(v.part_out));
      Stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(dims(v.part_stats))
          .set_stride(strides(v.part_stats));
    } else {
      auto O = input("O", kO, v.out), dO = input("dO", kDO, v.out), Stats = input("Stats", kStats, v.stats);
      Stats->set_data_type(fe::DataType_t::FLOAT);
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("ptk_context_flash_pair_backward")
                      .set_causal_mask(causal)
                      .set_attn_scale(scale);
      if (key.deterministic) opts.set_deterministic_algorithm(true);
      auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
      dQ->set_output(true).set_uid(kDQ).set_dim(dims(v.part_out)).set_stride(strides(v.part_out));
      dK->set_output(true).set_uid(kDK).set_dim(dims(v.part_kv)).set_stride(strides(v.part_kv));
      dV->set_output(true).set_uid(kDV).set_dim(dims(v.part_kv)).set_stride(strides(v.part_kv));
    }
    return BuildPlans(std::move(g), handle, max_workspace, where, out);
  } catch (const std::exception& ex) {
    return absl::InternalError(fmt::format("{}: cudnn-frontend threw while building the graph: {}", where, ex.what()));
  }
}

// Builds the forward or backward graph. An empty workspace limit (< 0) lets cuDNN choose freely;
// otherwise plans needing more than `max_workspace` bytes are set aside.
absl::Status BuildFlashGraph(const FlashKey& key, double p, cudnnHandle_t handle, int64_t max_workspace,
                             const std::string& where, FlashGraph* out) {
  if (key.pair != 0) return BuildPairGraph(key, handle, max_workspace, where, out);
  const int64_t b = key.b, t = key.t, nh = key.nh, hd = key.hd, c = nh * hd, ng = key.groups;
  // Row width and head stride of the fused QKV: Megatron's (nh, 3, hd) without grouped-query
  // attention, heads first (nh + 2 ng heads of hd) with it.
  const bool grouped = ng != nh;
  const int64_t c3 = (nh + 2 * ng) * hd, head_stride = grouped ? hd : 3 * hd;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const bool dropout = p > 0.0;
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(key.io_type == CUDA_R_16BF ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    // qkv(b, t, nh, 3, hd) seen as (b, nh, t, hd): batch stride t*3c, head stride 3hd, row stride 3c;
    // heads first (grouped), Q (b, nh, t, hd) and K, V (b, ng, t, hd) with head stride hd.
    auto qkv_view = [&](const char* name, int64_t uid, int64_t heads) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({b, heads, t, hd})
                           .set_stride({t * c3, head_stride, c3, 1}));
    };
    // out(b, t, nh*hd) as (b, nh, t, hd).
    const std::vector<int64_t> o_dim{b, nh, t, hd}, o_stride{t * c, hd, c, 1};
    const std::vector<int64_t> stats_dim{b, nh, t, 1}, stats_stride{nh * t, t, 1, 1};
    auto Q = qkv_view("Q", kQ, nh), K = qkv_view("K", kK, ng), V = qkv_view("V", kV, ng);
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
      const std::vector<int64_t> q_dim{b, nh, t, hd}, kv_dim{b, ng, t, hd}, qkv_stride{t * c3, head_stride, c3, 1};
      dQ->set_output(true).set_uid(kDQ).set_dim(q_dim).set_stride(qkv_stride);
      dK->set_output(true).set_uid(kDK).set_dim(kv_dim).set_stride(qkv_stride);
      dV->set_output(true).set_uid(kDV).set_dim(kv_dim).set_stride(qkv_stride);
    }
    return BuildPlans(std::move(g), handle, max_workspace, where, out);
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
  return FlashKey{ctx.cudnn, static_cast<int>(CudaDataType<T>()), backward, s.b, s.t, s.nh, s.hd, s.groups(),
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
    // Not even without a limit: the shape or type is what cuDNN refuses, and its error says so (the
    // limited build's would blame the workspace limit).
    if (absl::Status free_status =
            BuildFlashGraph(key, p, static_cast<cudnnHandle_t>(ctx.cudnn), -1, where, &free_plan);
        !free_status.ok())
      return free_status;
    st.graphs[key] = free_plan;  // what FlashAttentionWorkspaceBytes reports
    if (free_plan.workspace > max_workspace)
      return absl::ResourceExhaustedError(fmt::format(
          "{}: cuDNN's fused attention needs {} bytes of workspace for this shape, the context has {} (size the "
          "workspace with FlashAttentionWorkspaceBytes)",
          where, free_plan.workspace, max_workspace));
    *out = free_plan;  // cuDNN's choice among fewer plans failed, its free choice fits
    return absl::OkStatus();
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
  attention_detail::LaunchSetFlashRng(*rng, static_cast<int64_t>(seed), static_cast<int64_t>(offset), ctx.stream);
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

// Where K and V start in a token's row: Megatron's (nh, 3, hd) without grouped-query attention, heads
// first with it (after the nh query heads, and the groups' key heads).
struct QkvOffsets {
  int64_t k, v;
  explicit QkvOffsets(const AttentionShape& s)
      : k(s.groups() != s.nh ? s.nh * s.hd : s.hd), v(s.groups() != s.nh ? (s.nh + s.groups()) * s.hd : 2 * s.hd) {}
};

template <typename T>
constexpr const char* FlashType() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

}  // namespace

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
  const QkvOffsets at(s);
  std::unordered_map<int64_t, void*> pack{{kQ, q}, {kK, q + at.k}, {kV, q + at.v}, {kO, out}, {kStats, stats}};
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
  const QkvOffsets at(s);
  std::unordered_map<int64_t, void*> pack{{kQ, q},
                                          {kK, q + at.k},
                                          {kV, q + at.v},
                                          {kO, const_cast<T*>(out)},
                                          {kDO, const_cast<T*>(dout)},
                                          {kStats, const_cast<float*>(stats)},
                                          {kDQ, dqkv},
                                          {kDK, dqkv + at.k},
                                          {kDV, dqkv + at.v}};
  if (p > 0.0) {
    int64_t* rng = nullptr;
    if (absl::Status st = RngPointer(ctx, seed, offset, where, &rng); !st.ok()) return st;
    pack[kSeed] = rng;
    pack[kOffset] = rng + 1;
  }
  return ExecuteGraph(fg, pack, ctx, where);
}

// ---- context-parallel pairs (context_flash.h) -------------------------------------------------------------

namespace {

using context_detail::FlashPair;
using context_detail::FlashPairShape;

template <typename T>
FlashKey MakePairKey(const CudaContext& ctx, bool backward, const FlashPairShape& s, const FlashPair& p) {
  return FlashKey{ctx.cudnn,
                  static_cast<int>(CudaDataType<T>()),
                  backward,
                  s.b,
                  s.t,
                  s.nh,
                  s.hd,
                  s.ng,
                  0,
                  backward && ctx.deterministic,
                  p.causal ? kPairCausal : kPairFull};
}

std::string PairString(const FlashPairShape& s, const FlashPair& p) {
  return fmt::format("b={}, t={}, nh={}, hd={}, groups={}, context={}, chunks {} x {}{}", s.b, s.t, s.nh, s.hd, s.ng,
                     s.context, p.q_chunk, p.kv_chunk, p.causal ? " (causal)" : "");
}

// The shape (as CheckFlash's, and t even: two chunks) and the pair (one of ContextFlashPairs').
template <typename T>
absl::Status CheckPair(const FlashPairShape& s, const FlashPair& p, const CudaContext& ctx, const std::string& where) {
  if (s.ng <= 0 || s.t % 2 != 0 || s.context < 1)
    return absl::InvalidArgumentError(fmt::format(
        "{}: a context rank's rows are two chunks (t even) of one of context >= 1 ranks, ng >= 1 heads", where));
  if (absl::Status st = CheckFlash<T>(AttentionShape{s.b, s.t, s.nh, s.hd, s.ng}, 0.0, ctx, where); !st.ok()) return st;
  const int chunks = 2 * s.context;
  if (p.q_chunk < 0 || p.q_chunk >= chunks || p.kv_chunk < 0 || p.kv_chunk > p.q_chunk ||
      p.causal != (p.kv_chunk == p.q_chunk) || p.half != context_detail::ChunkHalf(p.q_chunk, s.context))
    return absl::InvalidArgumentError(fmt::format("{}: not a pair of ContextFlashPairs (half {})", where, p.half));
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::StatusOr<int64_t> ContextFlashWorkspaceBytes(const FlashPairShape& s, const CudaContext& ctx) {
  const FlashPair causal{0, 0, 0, true, true}, full{1, 2 * s.context - 1, 0, false, true};
  const std::string where = fmt::format("ContextFlashWorkspaceBytes<{}>({})", FlashType<T>(), PairString(s, causal));
  if (absl::Status st = CheckPair<T>(s, causal, ctx, where); !st.ok()) return st;
  int64_t most = 0;
  for (const FlashPair& p : {causal, full})
    for (bool backward : {false, true}) {
      FlashGraph fg;
      if (absl::Status st = FindGraph(MakePairKey<T>(ctx, backward, s, p), 0.0, ctx, -1, where, &fg); !st.ok())
        return st;
      if (fg.workspace > most) most = fg.workspace;
    }
  return most;
}

template <typename T>
absl::Status ContextFlashPairForward(T* part_out, float* part_stats, const T* gathered, const FlashPairShape& s,
                                     const FlashPair& pair, const CudaContext& ctx) {
  const std::string where = fmt::format("ContextFlashPairForward<{}>({})", FlashType<T>(), PairString(s, pair));
  if (absl::Status st = CheckPair<T>(s, pair, ctx, where); !st.ok()) return st;
  if (!part_out || !part_stats || !gathered)
    return absl::InvalidArgumentError(fmt::format("{}: part_out, part_stats, gathered must be set", where));
  FlashGraph fg;
  const int64_t limit = ctx.workspace ? static_cast<int64_t>(ctx.workspace_bytes) : 0;
  if (absl::Status st = FindGraph(MakePairKey<T>(ctx, false, s, pair), 0.0, ctx, limit, where, &fg); !st.ok())
    return st;
  const context_detail::FlashPairViews v = context_detail::ContextFlashViews(s, pair);
  T* g = const_cast<T*>(gathered);
  std::unordered_map<int64_t, void*> pack{{kQ, g + v.q.offset},
                                          {kK, g + v.k.offset},
                                          {kV, g + v.v.offset},
                                          {kO, part_out + v.part_out.offset},
                                          {kStats, part_stats + v.part_stats.offset}};
  return ExecuteGraph(fg, pack, ctx, where);
}

template <typename T>
absl::Status ContextFlashPairBackward(T* part_dq, T* part_dk, T* part_dv, const T* dout, const T* out,
                                      const float* stats, const T* gathered, const FlashPairShape& s,
                                      const FlashPair& pair, const CudaContext& ctx) {
  const std::string where = fmt::format("ContextFlashPairBackward<{}>({}{})", FlashType<T>(), PairString(s, pair),
                                        ctx.deterministic ? ", deterministic" : "");
  if (absl::Status st = CheckPair<T>(s, pair, ctx, where); !st.ok()) return st;
  if (!part_dq || !part_dk || !part_dv || !dout || !out || !stats || !gathered)
    return absl::InvalidArgumentError(
        fmt::format("{}: part_dq, part_dk, part_dv, dout, out, stats, gathered must be set", where));
  FlashGraph fg;
  const int64_t limit = ctx.workspace ? static_cast<int64_t>(ctx.workspace_bytes) : 0;
  if (absl::Status st = FindGraph(MakePairKey<T>(ctx, true, s, pair), 0.0, ctx, limit, where, &fg); !st.ok()) return st;
  const context_detail::FlashPairViews v = context_detail::ContextFlashViews(s, pair);
  T* g = const_cast<T*>(gathered);
  std::unordered_map<int64_t, void*> pack{{kQ, g + v.q.offset},
                                          {kK, g + v.k.offset},
                                          {kV, g + v.v.offset},
                                          {kO, const_cast<T*>(out) + v.out.offset},
                                          {kDO, const_cast<T*>(dout) + v.out.offset},
                                          {kStats, const_cast<float*>(stats) + v.stats.offset},
                                          {kDQ, part_dq + v.part_out.offset},
                                          {kDK, part_dk + v.part_kv.offset},
                                          {kDV, part_dv + v.part_kv.offset}};
  return ExecuteGraph(fg, pack, ctx, where);
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::StatusOr<int64_t> FlashAttentionWorkspaceBytes<T>(const AttentionShape&, double, const CudaContext&); \
  template absl::Status FlashAttentionForward<T>(T*, float*, const T*, const AttentionShape&, double, uint64_t,        \
                                                 uint64_t, const CudaContext&);                                        \
  template absl::Status FlashAttentionBackward<T>(T*, const T*, const T*, const float*, const T*,                      \
                                                  const AttentionShape&, double, uint64_t, uint64_t,                   \
                                                  const CudaContext&);                                                 \
  template absl::StatusOr<int64_t> ContextFlashWorkspaceBytes<T>(const context_detail::FlashPairShape&,                \
                                                                 const CudaContext&);                                  \
  template absl::Status ContextFlashPairForward<T>(T*, float*, const T*, const context_detail::FlashPairShape&,        \
                                                   const context_detail::FlashPair&, const CudaContext&);              \
  template absl::Status ContextFlashPairBackward<T>(T*, T*, T*, const T*, const T*, const float*, const T*,            \
                                                    const context_detail::FlashPairShape&,                             \
                                                    const context_detail::FlashPair&, const CudaContext&);
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda