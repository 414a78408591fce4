// The CUDA model's context parallelism (Megatron's --context-parallel-size, its allgather exchange; the CPU
// model's trainer/cpu/context_parallel_cpu.cpp over the CUDA ops): each micro-batch holds this rank's positions
// of its samples (ContextParallelPositions: chunks r and 2C - 1 - r of 2C), and every op but the attention runs on
// them alone. The attention all-gathers the fused QKV rows of the context group (NCCL on the compute stream) and
// runs this rank's queries over the whole samples (ContextAttentionForward: the causal mask and attention-dropout
// keys of the queries' true positions); backward gathers them again, computes this rank's queries' gradients and
// its share of every position's key and value gradients, sends each rank its share (NCCL point to point) and adds
// the shares of its own rows in rank order (AddContextShares): deterministic, and the bits of the CPU model's gloo
// reduce-scatter. RoPE's tables and the hidden dropout masks are those of the rows' true positions.
//
// bf16/fp16 without attention dropout or query groups (ContextFlash) run cuDNN's fused attention over pairs of
// chunks (context_flash.h's plan, context_flash_cuda.h's graphs): the rows all-gathered in the activation type,
// each of the rank's 2C + 1 pairs' partial output merged in pair order by its log-sum-exp into an fp32 output and
// log-sum-exp (kept per layer in attn_saved, as cuDNN's statistics on one GPU: nothing is recomputed), the output
// rounded once; backward each pair's gradients with the layer's output and merged log-sum-exp added into an fp32
// query gradient and fp32 key/value shares, then the same exchange and AddContextShares as the rows path.
//
// Otherwise the attention is attention_rows_cuda.cu's fp32 one (fp32; bf16/fp16 with attention dropout or query
// groups, and as the cuDNN pairs' oracle in the tests): in bf16/fp16 the QKV rows are all-gathered in the activation
// type (half fp32's bytes) and widened to fp32, the output is narrowed back, and backward widens the output gradient,
// exchanges the key and value gradients' shares in fp32 (summed in rank order in fp32) and narrows the QKV gradient
// once. fp32 math throughout, so the same masks and sums as fp32 context parallelism; the (t, C t) fp32 scores per head
// and cuBLAS products instead of a fused kernel: slower and larger than the one-rank bf16 attention. fp16's loss
// scaling: an overflow narrowing the gradient is an inf in this rank's gradients, which the data x context all-reduce
// carries to every rank (each skips the step).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/context_flash_cuda.h"
#include "trainer/cuda/context_rows.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"
#include "trainer/parallel_layout.h"

namespace ptk::cuda::model_detail {

template <typename T>
absl::Status CudaGPTModelImpl<T>::SetContext(Communicator* context) {
  if (context == nullptr || context->size() <= 1) return absl::OkStatus();
  const int64_t C = context->size();
  if (!context->device_collectives())
    return UsageError(fmt::format(
        "--context-parallel-size {} on the CUDA backend needs NCCL for the context group (--distributed-backend "
        "nccl, the default with --device cuda), not {}",
        C, context->backend()));
  if (config().seq_length % (2 * C) != 0)
    return UsageError(fmt::format("--context-parallel-size {}: --seq-length {} must be a multiple of 2 x {}", C,
                                  config().seq_length, C));
  context_comm_ = context;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::UploadContextTables() {
  const int C = context_comm_->size();
  const int64_t S = plan_.t * C;
  context_positions_ = ContextParallelPositions(S, C, context_comm_->rank());
  const std::vector<int64_t> table = ContextParallelPositionTable(S, C);
  // On the compute stream, after the plan's zeroing of the arena; synchronised before the host tables go.
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<int64_t>(plan_.cp_positions), table.data(),
                                           table.size() * sizeof(int64_t), cudaMemcpyHostToDevice, ctx_.stream),
                           "copying the context ranks' positions to the device");
  if (!config().rope()) return Sync("copying the context ranks' positions");
  // The whole sample's tables, then this rank's positions' rows of them (the CPU model's Prepare).
  const int64_t half = config().rotary_dim() / 2;
  std::vector<float> whole(static_cast<size_t>(2 * S * half)), mine(static_cast<size_t>(2 * plan_.t * half));
  RopeAngleTables(whole.data(), whole.data() + S * half, S, config().rotary_dim(), config().rope_settings());
  for (int64_t i = 0; i < plan_.t; ++i)
    for (int64_t k = 0; k < 2; ++k) {  // cos, then sin
      const float* from = whole.data() + k * S * half + context_positions_[static_cast<size_t>(i)] * half;
      std::copy(from, from + half, mine.begin() + k * plan_.t * half + i * half);
    }
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Buf<float>(plan_.rope_tables), mine.data(), mine.size() * sizeof(float),
                                           cudaMemcpyHostToDevice, ctx_.stream),
                           "copying a context rank's rotary embedding tables to the device");
  return Sync("copying a context rank's rotary embedding tables");
}

// x holds rows [row0, row0 + rows) of this rank's t_ positions of each sample (all of them, or a tensor rank's
// --sequence-parallel share): each run of consecutive positions of a sample is a part of the whole sample's row,
// DropoutRows from its first element's index in the whole sample (the masks of one rank, as the CPU model's
// DropoutRows by position).
template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextDropout(T* x, int64_t row0, int64_t rows, int64_t layer, int64_t site,
                                                 double p, uint64_t seed) {
  const int64_t c = config().hidden_size;
  const std::vector<context_detail::PositionRun> runs =
      context_detail::PositionRuns(context_positions_.data(), row0, rows);
  for (int64_t s = 0; s < b_; ++s)
    for (const context_detail::PositionRun& r : runs)
      PTK_RETURN_IF_ERROR(DropoutRows<T>(x + (s * rows + r.row) * c, 1, r.count * c, Streams(layer, site) + s, p, seed,
                                         ctx_, r.position * c));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::GatherContextRows(const T* qkv, int64_t piece) {
  const int C = context_comm_->size();
  // fp32 and ContextFlash gather in place; the rows path's bf16/fp16 into cp_whole's room (read before anything
  // writes it), then widened.
  const bool widen = kFlash && !ContextFlash();
  T* staged = widen ? Buf<T>(plan_.cp_whole) : Buf<T>(plan_.cp_gathered);
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staged + context_comm_->rank() * piece, qkv, static_cast<size_t>(piece) * sizeof(T),
                      cudaMemcpyDeviceToDevice, ctx_.stream),
      "copying a context rank's QKV rows for the all-gather");
  const std::vector<int64_t> bytes(static_cast<size_t>(C), piece * static_cast<int64_t>(sizeof(T)));
  PTK_RETURN_IF_ERROR(
      Op("context parallel", "QKV all-gather", context_comm_->AllGatherDevice(staged, bytes, ctx_.stream)));
  if (widen)
    return Op("context parallel", "QKV to fp32",
              CastToFloat<T>(Buf<float>(plan_.cp_gathered), staged, C * piece, ctx_));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextAttnFwd(T* atty, float* probs, const T* qkv, const AttentionShape& shape,
                                                 double ap, uint64_t seed, const uint64_t* streams) {
  const int64_t piece = shape.b * shape.t * shape.qkv_width();
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, piece));
  if (ContextFlash()) return ContextFlashFwd(atty, probs, shape);
  const ContextAttentionArgs cp{context_comm_->size(), context_comm_->rank(), Buf<int64_t>(plan_.cp_positions)};
  float* gathered = Buf<float>(plan_.cp_gathered);
  float* whole = Buf<float>(plan_.cp_whole);
  if constexpr (!kFlash) {
    return ContextAttentionForward(atty, probs, qkv, gathered, whole, cp, shape, ap, seed, streams, ctx_);
  } else {
    // This rank's fp32 query rows are its piece of the widened gathered rows; the output in fp32, then narrowed.
    float* out = Buf<float>(plan_.cp_rows);
    PTK_RETURN_IF_ERROR(ContextAttentionForward(out, probs, gathered + cp.rank * piece, gathered, whole, cp, shape, ap,
                                                seed, streams, ctx_));
    if (atty == nullptr) return absl::OkStatus();
    return Op("context parallel", "attention output from fp32",
              CastFromFloat<T>(atty, out, shape.b * shape.t * shape.nh * shape.hd, ctx_));
  }
}

// ContextFlash's forward over the rows GatherContextRows left in cp_gathered: the pairs in ContextFlashPairs' order,
// each merged into the fp32 output and the layer's log-sum-exps `stats` (2, b, heads, t/2); the output rounded once.
template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextFlashFwd(T* atty, float* stats, const AttentionShape& shape) {
  if constexpr (!kFlash) {  // ContextFlash is false in fp32: the graphs exist for bf16/fp16 only
    return absl::InternalError("context parallelism's cuDNN pairs called in fp32");
  } else {
    const context_detail::FlashPairShape s{shape.b, shape.t, shape.nh, shape.groups(), shape.hd, context_comm_->size()};
    float* out = Buf<float>(plan_.cp_rows);
    T* part_out = Buf<T>(plan_.cp_part_out);
    float* part_stats = Buf<float>(plan_.cp_part_stats);
    const T* gathered = Buf<T>(plan_.cp_gathered);
    for (const context_detail::FlashPair& pair : context_detail::ContextFlashPairs(s.context, context_comm_->rank())) {
      PTK_RETURN_IF_ERROR(Op("context parallel", "attention pair (cuDNN)",
                             ContextFlashPairForward<T>(part_out, part_stats, gathered, s, pair, ctx_)));
      PTK_RETURN_IF_ERROR(Op("context parallel", "attention pair merge",
                             MergeContextFlashPair<T>(out, stats, part_out, part_stats, s, pair, ctx_)));
    }
    return Op("context parallel", "attention output from fp32",
              CastFromFloat<T>(atty, out, shape.b * shape.t * shape.nh * shape.hd, ctx_));
  }
}

// ContextFlash's backward: the fp32 query gradient dq (b, t, qkv width) and key/value shares (context pieces) zeroed,
// then each pair's gradients with the layer's output `out` and log-sum-exps `stats` added to them.
template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextFlashBwd(float* dq, float* shares, const T* datt, const T* out,
                                                  const float* stats, const AttentionShape& shape) {
  if constexpr (!kFlash) {
    return absl::InternalError("context parallelism's cuDNN pairs called in fp32");
  } else {
    const context_detail::FlashPairShape s{shape.b, shape.t, shape.nh, shape.groups(), shape.hd, context_comm_->size()};
    const int64_t piece = shape.b * shape.t * shape.qkv_width();
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dq, 0, static_cast<size_t>(piece) * sizeof(float), ctx_.stream),
                             "zeroing a context rank's fp32 QKV gradient");
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(shares, 0, static_cast<size_t>(s.context * piece) * sizeof(float), ctx_.stream),
        "zeroing a context rank's key/value gradient shares");
    T* part_dq = Buf<T>(plan_.cp_part_out);
    T* part_dk = Buf<T>(plan_.cp_part_kv);
    T* part_dv = part_dk + shape.b * (shape.t / 2) * shape.groups() * shape.hd;
    const T* gathered = Buf<T>(plan_.cp_gathered);
    for (const context_detail::FlashPair& pair : context_detail::ContextFlashPairs(s.context, context_comm_->rank())) {
      PTK_RETURN_IF_ERROR(
          Op("context parallel", "attention pair backward (cuDNN)",
             ContextFlashPairBackward<T>(part_dq, part_dk, part_dv, datt, out, stats, gathered, s, pair, ctx_)));
      PTK_RETURN_IF_ERROR(Op("context parallel", "attention pair gradients",
                             AddContextFlashPairGrads<T>(dq, shares, part_dq, part_dk, part_dv, s, pair, ctx_)));
    }
    return absl::OkStatus();
  }
}

// The rows path's backward: this rank's queries' fp32 gradient dq and every row's key/value shares (overwriting the
// gathered rows, read first), from the kept (or recomputed) probabilities. bf16/fp16: the output gradient widened,
// the query rows this rank's widened gathered piece.
template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextRowsBwd(float* dq, float* shares, float* received, const T* datt, const T* qkv,
                                                 const float* probs, const AttentionShape& shape, double ap,
                                                 uint64_t seed, const uint64_t* streams) {
  const int rank = context_comm_->rank();
  const int64_t piece = shape.b * shape.t * shape.qkv_width();
  const ContextAttentionArgs cp{context_comm_->size(), rank, Buf<int64_t>(plan_.cp_positions)};
  const float* dout = nullptr;
  const float* q = nullptr;
  if constexpr (kFlash) {
    float* dout32 = Buf<float>(plan_.cp_rows);
    PTK_RETURN_IF_ERROR(Op("context parallel", "attention output gradient to fp32",
                           CastToFloat<T>(dout32, datt, shape.b * shape.t * shape.nh * shape.hd, ctx_)));
    dout = dout32;
    q = shares + rank * piece;
  } else {
    dout = datt;
    q = qkv;
  }
  return ContextAttentionBackward(dq, shares, dout, q, shares, received, Buf<float>(plan_.cp_dwhole), probs, cp, shape,
                                  ap, seed, streams, Buf<float>(plan_.attn_scratch), ctx_);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextAttnBwd(T* dqkv, const T* datt, const T* out, const T* qkv, const float* probs,
                                                 const AttentionShape& shape, double ap, uint64_t seed,
                                                 const uint64_t* streams) {
  const int C = context_comm_->size(), rank = context_comm_->rank();
  const int64_t piece = shape.b * shape.t * shape.qkv_width();
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, piece));  // the whole samples' keys and values again
  const ContextAttentionArgs cp{C, rank, Buf<int64_t>(plan_.cp_positions)};
  // The rows path's shares overwrite the gathered rows; the whole samples' buffer receives the others' shares.
  // ContextFlash's shares have their own buffer (the gathered rows stay the pairs' input).
  float* shares = Buf<float>(ContextFlash() ? plan_.cp_whole : plan_.cp_gathered);
  float* received = Buf<float>(ContextFlash() ? plan_.cp_dwhole : plan_.cp_whole);
  // fp32: the QKV gradient itself; bf16/fp16: in fp32 until the shares are added.
  float* dq = nullptr;
  if constexpr (kFlash)
    dq = Buf<float>(plan_.cp_dqkv);
  else
    dq = dqkv;
  if (ContextFlash()) {
    PTK_RETURN_IF_ERROR(ContextFlashBwd(dq, shares, datt, out, probs, shape));
  } else {
    PTK_RETURN_IF_ERROR(ContextRowsBwd(dq, shares, received, datt, qkv, probs, shape, ap, seed, streams));
  }
  std::vector<Communicator::P2pMessage> messages;
  const int64_t bytes = piece * static_cast<int64_t>(sizeof(float));
  for (int r = 0; r < C; ++r)
    if (r != rank) {
      messages.push_back({.send = shares + r * piece, .bytes = bytes, .peer = r});
      messages.push_back({.recv = received + r * piece, .bytes = bytes, .peer = r});
    }
  PTK_RETURN_IF_ERROR(
      Op("context parallel", "key/value gradient exchange", context_comm_->BatchSendRecvDevice(messages, ctx_.stream)));
  PTK_RETURN_IF_ERROR(AddContextShares(dq, received, shares + rank * piece, cp, piece, ctx_));
  if constexpr (kFlash)
    return Op("context parallel", "QKV gradient from fp32", CastFromFloat<T>(dqkv, dq, piece, ctx_));
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status CudaGPTModelImpl<T>::SetContext(Communicator* context);                                        \
  template absl::Status CudaGPTModelImpl<T>::UploadContextTables();                                                    \
  template absl::Status CudaGPTModelImpl<T>::ContextDropout(T*, int64_t, int64_t, int64_t, int64_t, double, uint64_t); \
  template absl::Status CudaGPTModelImpl<T>::GatherContextRows(const T* qkv, int64_t piece);                           \
  template absl::Status CudaGPTModelImpl<T>::ContextAttnFwd(T*, float*, const T*, const AttentionShape&, double,       \
                                                            uint64_t, const uint64_t*);                                \
  template absl::Status CudaGPTModelImpl<T>::ContextAttnBwd(T*, const T*, const T*, const T*, const float*,            \
                                                            const AttentionShape&, double, uint64_t, const uint64_t*); \
  template absl::Status CudaGPTModelImpl<T>::ContextFlashFwd(T*, float*, const AttentionShape&);                       \
  template absl::Status CudaGPTModelImpl<T>::ContextFlashBwd(float*, float*, const T*, const T*, const float*,         \
                                                             const AttentionShape&);                                   \
  template absl::Status CudaGPTModelImpl<T>::ContextRowsBwd(float*, float*, float*, const T*, const T*, const float*,  \
                                                            const AttentionShape&, double, uint64_t, const uint64_t*);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
