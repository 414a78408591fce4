// Causal self-attention on the GPU in bf16/fp16: cuDNN's fused flash attention, its graphs built and cached.
//
// FlashAttentionForward / Backward, beside the fp32 kernels of attention_cuda.cu, over Megatron's fused QKV layout
// qkv(b, t, nh, 3, hd) (grouped-query attention: heads first, QkvGroupsToHeads), through the cudnn-frontend graph
// API; Q, K, V, O, dO, dQ, dK, dV are strided views into qkv / out / dqkv (no copies), stats(b, nh, t) the fp32
// log-sum-exp cuDNN keeps for backward. Graphs are built once per shape (and dropout probability, direction,
// determinism) per cuDNN handle and cached (flash_graph_cache.h, shared with context parallelism's pairs of chunks,
// context_flash_graphs.cpp, keyed apart by the pair's mask).
// Host code (the one kernel, the dropout seed's, is attention_cuda.cu's): the C++ compiler builds it once,
// where nvcc parsed cudnn-frontend's headers again for each architecture (twice the CPU time).
#include "trainer/cuda/flash_graph_cache.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>

#include <fmt/core.h>

#include "absl/status/statusor.h"
#include "trainer/cuda/attention_check.h"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using attention_detail::ShapeString;
using namespace flash_detail;  // NOLINT: the graph cache's ids and types, this file's vocabulary

// Builds the forward or backward graph. An empty workspace limit (< 0) lets cuDNN choose freely;
// otherwise plans needing more than `max_workspace` bytes are set aside.
absl::Status BuildFlashGraph(const FlashKey& key, double p, cudnnHandle_t handle, int64_t max_workspace,
                             const std::string& where, FlashGraph* out) {
  // vd: the value heads' width (multi-latent attention's; hd otherwise): the output is (b, t, nh * vd).
  const int64_t b = key.b, t = key.t, nh = key.nh, hd = key.hd, vd = key.vd > 0 ? key.vd : hd, c = nh * vd,
                ng = key.groups;
  // Row width and head stride of the fused QKV: Megatron's (nh, 3, hd) without grouped-query
  // attention (per head hd + hd + vd under MLA), heads first (nh + 2 ng heads of hd) with it.
  const bool grouped = ng != nh;
  const int64_t c3 = grouped ? (nh + 2 * ng) * hd : nh * (2 * hd + vd), head_stride = grouped ? hd : 2 * hd + vd;
  double scale_value = 0;
  static_assert(sizeof(scale_value) == sizeof(key.scale_bits));
  std::memcpy(&scale_value, &key.scale_bits, sizeof(scale_value));
  const float scale = static_cast<float>(scale_value > 0 ? scale_value : 1.0 / std::sqrt(static_cast<double>(hd)));
  const bool dropout = p > 0.0;
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(key.io_type == CUDA_R_16BF ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    // qkv(b, t, nh, 3, hd) seen as (b, nh, t, hd): batch stride t*3c, head stride 3hd, row stride 3c;
    // heads first (grouped), Q (b, nh, t, hd) and K, V (b, ng, t, hd) with head stride hd.
    auto qkv_view = [&](const char* name, int64_t uid, int64_t heads, int64_t width) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({b, heads, t, width})
                           .set_stride({t * c3, head_stride, c3, 1}));
    };
    // out(b, t, nh*vd) as (b, nh, t, vd).
    const std::vector<int64_t> o_dim{b, nh, t, vd}, o_stride{t * c, vd, c, 1};
    const std::vector<int64_t> stats_dim{b, nh, t, 1}, stats_stride{nh * t, t, 1, 1};
    auto Q = qkv_view("Q", kQ, nh, hd), K = qkv_view("K", kK, ng, hd), V = qkv_view("V", kV, ng, vd);
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
      if (key.window >= 0) opts.set_diagonal_band_left_bound(static_cast<int>(CudnnWindowLeftBound(key.window)));
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
      if (key.window >= 0) opts.set_diagonal_band_left_bound(static_cast<int>(CudnnWindowLeftBound(key.window)));
      if (dropout) opts.set_dropout(static_cast<float>(p), seed, offset);
      if (key.deterministic) opts.set_deterministic_algorithm(true);
      auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
      const std::vector<int64_t> q_dim{b, nh, t, hd}, kv_dim{b, ng, t, hd}, v_dim{b, ng, t, vd},
          qkv_stride{t * c3, head_stride, c3, 1};
      dQ->set_output(true).set_uid(kDQ).set_dim(q_dim).set_stride(qkv_stride);
      dK->set_output(true).set_uid(kDK).set_dim(kv_dim).set_stride(qkv_stride);
      dV->set_output(true).set_uid(kDV).set_dim(v_dim).set_stride(qkv_stride);
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
  FlashKey key{ctx.cudnn, static_cast<int>(CudaDataType<T>()), backward, s.b, s.t, s.nh, s.hd, s.groups(),
               bits,      backward && ctx.deterministic};
  key.window = s.window;
  key.vd = s.vd > 0 && s.vd != s.hd ? s.vd : 0;
  static_assert(sizeof(key.scale_bits) == sizeof(s.scale));
  std::memcpy(&key.scale_bits, &s.scale, sizeof(s.scale));
  return key;
}

// The single-GPU graph for `key` from the cache, built on first use; with `max_workspace` >= 0 one whose workspace
// fits.
absl::Status FindFlashGraph(const FlashKey& key, double p, const CudaContext& ctx, int64_t max_workspace,
                            const std::string& where, FlashGraph* out) {
  auto build = [&](int64_t limit, FlashGraph* built) {
    return BuildFlashGraph(key, p, static_cast<cudnnHandle_t>(ctx.cudnn), limit, where, built);
  };
  return FindGraph(key, ctx, max_workspace, where, build, out);
}

// Where K and V start in a token's row: Megatron's (nh, 3, hd) without grouped-query attention, heads
// first with it (after the nh query heads, and the groups' key heads).
struct QkvOffsets {
  int64_t k, v;
  explicit QkvOffsets(const AttentionShape& s)
      : k(s.groups() != s.nh ? s.nh * s.hd : s.hd), v(s.groups() != s.nh ? (s.nh + s.groups()) * s.hd : 2 * s.hd) {}
  // (Under multi-latent attention a head's query and key are hd wide, its value vd: the same k and v.)
};

}  // namespace

// ---- bf16 / fp16 -----------------------------------------------------------------------------------

template <typename T>
absl::StatusOr<int64_t> FlashAttentionWorkspaceBytes(const AttentionShape& s, double p, const CudaContext& ctx) {
  const std::string where =
      fmt::format("FlashAttentionWorkspaceBytes<{}>({}, p={})", FlashType<T>(), ShapeString(s), p);
  if (absl::Status st = CheckFlash<T>(s, p, ctx, where); !st.ok()) return st;
  int64_t most = 0;
  for (bool backward : {false, true}) {
    FlashGraph fg;
    if (absl::Status st = FindFlashGraph(MakeKey<T>(ctx, backward, s, p), p, ctx, -1, where, &fg); !st.ok()) return st;
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
  if (absl::Status st = FindFlashGraph(MakeKey<T>(ctx, false, s, p), p, ctx, limit, where, &fg); !st.ok()) return st;
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
  if (absl::Status st = FindFlashGraph(MakeKey<T>(ctx, true, s, p), p, ctx, limit, where, &fg); !st.ok()) return st;
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
