// Context parallelism's fused attention in bf16/fp16, one pair of chunks at a time (context_flash_cuda.h): cuDNN's
// SDPA graphs over ContextFlashViews' strided views of the gathered rows (context_flash.h), built and cached with the
// single-GPU ones (flash_graph_cache.h), keyed apart by the pair's mask. Host code, built by the C++ compiler.
#include "trainer/cuda/flash_graph_cache.h"

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/core.h>

#include "absl/status/statusor.h"
#include "trainer/cuda/context_flash_cuda.h"

namespace ptk::cuda {
namespace {

using namespace flash_detail;  // NOLINT: the graph cache's ids and types, this file's vocabulary
using context_detail::FlashPair;
using context_detail::FlashPairShape;

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

// A pair's graph for `key` from the cache, built on first use; with `max_workspace` >= 0 one whose workspace fits.
absl::Status FindPairGraph(const FlashKey& key, const CudaContext& ctx, int64_t max_workspace, const std::string& where,
                           FlashGraph* out) {
  auto build = [&](int64_t limit, FlashGraph* built) {
    return BuildPairGraph(key, static_cast<cudnnHandle_t>(ctx.cudnn), limit, where, built);
  };
  return FindGraph(key, ctx, max_workspace, where, build, out);
}

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
      if (absl::Status st = FindPairGraph(MakePairKey<T>(ctx, backward, s, p), ctx, -1, where, &fg); !st.ok())
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
  if (absl::Status st = FindPairGraph(MakePairKey<T>(ctx, false, s, pair), ctx, limit, where, &fg); !st.ok()) return st;
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
  if (absl::Status st = FindPairGraph(MakePairKey<T>(ctx, true, s, pair), ctx, limit, where, &fg); !st.ok()) return st;
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

#define PTK_INSTANTIATE(T)                                                                                      \
  template absl::StatusOr<int64_t> ContextFlashWorkspaceBytes<T>(const context_detail::FlashPairShape&,         \
                                                                 const CudaContext&);                           \
  template absl::Status ContextFlashPairForward<T>(T*, float*, const T*, const context_detail::FlashPairShape&, \
                                                   const context_detail::FlashPair&, const CudaContext&);       \
  template absl::Status ContextFlashPairBackward<T>(T*, T*, T*, const T*, const T*, const float*, const T*,     \
                                                    const context_detail::FlashPairShape&,                      \
                                                    const context_detail::FlashPair&, const CudaContext&);
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
