// cuDNN's fused-attention graphs, shared by the single-GPU attention (flash_attention_cuda.cpp) and context
// parallelism's pairs of chunks (context_flash_graphs.cpp): the cache key, a built graph and its workspace, the cache
// (one graph per key and cuDNN handle, kept until DestroyCudnnHandle), the plan building, the dropout RNG buffer and
// the execution on the context's stream. Host code, built by the C++ compiler.
#pragma once

#include <cudnn.h>

// cudnn-frontend without its JSON serialisation (only needed for graph (de)serialisation): faster
// to compile, the same graphs.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include <fmt/core.h>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "trainer/cuda/attention_check.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::flash_detail {

namespace fe = cudnn_frontend;

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
  // Megatron's sliding window (AttentionShape::window; the single-GPU graph only): -1 none, else the keys a query
  // row attends before itself (cuDNN's diagonal band left bound window + 1: it keeps key > query - bound).
  int64_t window = -1;
  // Multi-latent attention (the single-GPU graph only): the value heads' width (0: hd) and the scores' scale, bit
  // for bit (0: 1 / sqrt(hd)).
  int64_t vd = 0;
  uint64_t scale_bits = 0;
  auto Tie() const {
    return std::tie(handle, io_type, backward, b, t, nh, hd, groups, p_bits, deterministic, pair, window, vd,
                    scale_bits);
  }
  bool operator<(const FlashKey& o) const { return Tie() < o.Tie(); }
};
struct FlashGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

// Validates `g`, lowers it to cuDNN, asks the heuristics (A, then the fallback list) and keeps the first plan that
// builds: Graph::build's steps, one by one so that a failure names its step. An empty workspace limit (< 0) lets
// cuDNN choose freely; otherwise plans needing more than `max_workspace` bytes are set aside.
absl::Status BuildPlans(std::shared_ptr<fe::graph::Graph> g, cudnnHandle_t handle, int64_t max_workspace,
                        const std::string& where, FlashGraph* out);

// Builds the graph of the cache's key with plans within `max_workspace` bytes (< 0: no limit).
using GraphBuilder = absl::FunctionRef<absl::Status(int64_t max_workspace, FlashGraph* out)>;

// The graph for `key`, built by `build` on first use; with `max_workspace` >= 0 one whose workspace fits.
absl::Status FindGraph(const FlashKey& key, const CudaContext& ctx, int64_t max_workspace, const std::string& where,
                       GraphBuilder build, FlashGraph* out);

// The context's cuDNN handle's device int64[2], the dropout seed and offset, set to `seed` and `offset` in stream
// order.
absl::Status RngPointer(const CudaContext& ctx, uint64_t seed, uint64_t offset, const std::string& where,
                        int64_t** rng);

// Runs `fg` on the context's stream over the tensors of `pack` (by the ids above), in the context's workspace.
absl::Status ExecuteGraph(const FlashGraph& fg, std::unordered_map<int64_t, void*>& pack, const CudaContext& ctx,
                          const std::string& where);

// The arguments every bf16/fp16 graph takes: the shape, the dropout probability, the context's cuDNN handle.
template <typename T>
absl::Status CheckFlash(const AttentionShape& s, double p, const CudaContext& ctx, const std::string& where) {
  static_assert(!std::is_same_v<T, float>, "fp32 attention is AttentionForward / AttentionBackward");
  if (absl::Status st = attention_detail::CheckShape(s, where); !st.ok()) return st;
  if (!(p >= 0.0 && p < 1.0))
    return absl::InvalidArgumentError(fmt::format("{}: dropout probability {} outside [0, 1)", where, p));
  if (s.v_dim() != s.hd && s.groups() != s.nh)  // multi-latent attention has a key and value per head
    return absl::UnimplementedError(fmt::format(
        "{}: value heads of {} channels with query groups: ptk's graphs take them per head", where, s.v_dim()));
  if (s.sink || s.dsink)  // cuDNN 9.13+ has a sink token; ptk's graphs do not use it yet
    return absl::UnimplementedError(
        fmt::format("{}: a softmax offset (--softmax-type) in bf16/fp16 attention: ptk's cuDNN graphs take none (the "
                    "fp32 kernels of attention_cuda.cu do)",
                    where));
  if (!ctx.cudnn)
    return absl::FailedPreconditionError(
        fmt::format("{}: the context has no cuDNN handle (CreateCudnnHandle first)", where));
  return absl::OkStatus();
}

// The type's name in messages.
template <typename T>
constexpr const char* FlashType() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

}  // namespace ptk::cuda::flash_detail
