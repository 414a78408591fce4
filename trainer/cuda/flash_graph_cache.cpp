// cuDNN's fused-attention graph cache (flash_graph_cache.h): the plans built, the graphs kept per key and cuDNN
// handle, the dropout RNG buffer, the execution; and the cuDNN handle whose destruction drops them.
#include "trainer/cuda/flash_graph_cache.h"

#include <exception>
#include <map>
#include <mutex>
#include <string_view>

#include "trainer/cuda/cuda_common.h"

namespace ptk::cuda {
namespace flash_detail {
namespace {

absl::Status CudnnError(cudnnStatus_t st, std::string_view call, std::string_view where) {
  return absl::InternalError(fmt::format("cuDNN error in {}: {} failed: {}", where, call, cudnnGetErrorString(st)));
}
#define PTK_CUDNN_RETURN_IF_ERROR(call, where)                                                     \
  do {                                                                                             \
    cudnnStatus_t ptk_cudnn_err_ = (call);                                                         \
    if (ptk_cudnn_err_ != CUDNN_STATUS_SUCCESS) return CudnnError(ptk_cudnn_err_, #call, (where)); \
  } while (0)

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

}  // namespace

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

absl::Status FindGraph(const FlashKey& key, const CudaContext& ctx, int64_t max_workspace, const std::string& where,
                       GraphBuilder build, FlashGraph* out) {
  CudnnState& st = State();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.graphs.find(key);
  if (it != st.graphs.end() && (max_workspace < 0 || it->second.workspace <= max_workspace)) {
    *out = it->second;
    return absl::OkStatus();
  }
  FlashGraph built;
  absl::Status s = build(max_workspace, &built);
  if (!s.ok() && max_workspace >= 0) {
    // No plan within the limit: is it the limit? A plan without one says how much it would take.
    FlashGraph free_plan;
    // Not even without a limit: the shape or type is what cuDNN refuses, and its error says so (the
    // limited build's would blame the workspace limit).
    if (absl::Status free_status = build(-1, &free_plan); !free_status.ok()) return free_status;
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

}  // namespace flash_detail

using flash_detail::CudnnError;
using flash_detail::CudnnState;
using flash_detail::State;

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

}  // namespace ptk::cuda
