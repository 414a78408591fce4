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
// The attention is attention_rows_cuda.cu's fp32 one in every precision (cuDNN's fused attention has no
// context-parallel path here): in bf16/fp16 the QKV rows are all-gathered in the activation type (half fp32's
// bytes) and widened to fp32, the output is narrowed back, and backward widens the output gradient, exchanges
// the key and value gradients' shares in fp32 (summed in rank order in fp32) and narrows the QKV gradient once.
// fp32 math throughout, so the same masks and sums as fp32 context parallelism; the (t, C t) fp32 scores per
// head and cuBLAS products instead of a fused kernel: slower and larger than the one-rank bf16 attention.
// fp16's loss scaling: an overflow narrowing the gradient is an inf in this rank's gradients, which the data x
// context all-reduce carries to every rank (each skips the step).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
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
  float* gathered = Buf<float>(plan_.cp_gathered);
  const int C = context_comm_->size();
  // fp32 gathers in place; bf16/fp16 into cp_whole's room (read before anything writes it), then widened.
  T* staged = nullptr;
  if constexpr (kFlash)
    staged = Buf<T>(plan_.cp_whole);
  else
    staged = gathered;
  PTK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staged + context_comm_->rank() * piece, qkv, static_cast<size_t>(piece) * sizeof(T),
                      cudaMemcpyDeviceToDevice, ctx_.stream),
      "copying a context rank's QKV rows for the all-gather");
  const std::vector<int64_t> bytes(static_cast<size_t>(C), piece * static_cast<int64_t>(sizeof(T)));
  PTK_RETURN_IF_ERROR(
      Op("context parallel", "QKV all-gather", context_comm_->AllGatherDevice(staged, bytes, ctx_.stream)));
  if constexpr (kFlash) return Op("context parallel", "QKV to fp32", CastToFloat<T>(gathered, staged, C * piece, ctx_));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextAttnFwd(T* atty, float* probs, const T* qkv, const AttentionShape& shape,
                                                 double ap, uint64_t seed, const uint64_t* streams) {
  const int64_t piece = shape.b * shape.t * shape.qkv_width();
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, piece));
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

template <typename T>
absl::Status CudaGPTModelImpl<T>::ContextAttnBwd(T* dqkv, const T* datt, const T* qkv, const float* probs,
                                                 const AttentionShape& shape, double ap, uint64_t seed,
                                                 const uint64_t* streams) {
  const int C = context_comm_->size(), rank = context_comm_->rank();
  const int64_t piece = shape.b * shape.t * shape.qkv_width();
  PTK_RETURN_IF_ERROR(GatherContextRows(qkv, piece));  // the whole samples' keys and values again
  const ContextAttentionArgs cp{C, rank, Buf<int64_t>(plan_.cp_positions)};
  // The shares overwrite the gathered rows (read first); the whole samples' buffer receives the others' shares.
  float* shares = Buf<float>(plan_.cp_gathered);
  float* received = Buf<float>(plan_.cp_whole);
  // fp32 as it is; bf16/fp16: the output gradient widened, this rank's query rows its widened gathered piece
  // (read before the shares overwrite it), the QKV gradient in fp32 until the shares are added.
  float* dq = nullptr;
  const float* dout = nullptr;
  const float* q = nullptr;
  if constexpr (kFlash) {
    float* dout32 = Buf<float>(plan_.cp_rows);
    PTK_RETURN_IF_ERROR(Op("context parallel", "attention output gradient to fp32",
                           CastToFloat<T>(dout32, datt, shape.b * shape.t * shape.nh * shape.hd, ctx_)));
    dq = Buf<float>(plan_.cp_dqkv);
    dout = dout32;
    q = shares + rank * piece;
  } else {
    dq = dqkv;
    dout = datt;
    q = qkv;
  }
  PTK_RETURN_IF_ERROR(ContextAttentionBackward(dq, shares, dout, q, shares, received, Buf<float>(plan_.cp_dwhole),
                                               probs, cp, shape, ap, seed, streams, Buf<float>(plan_.attn_scratch),
                                               ctx_));
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
  template absl::Status CudaGPTModelImpl<T>::ContextAttnBwd(T*, const T*, const T*, const float*,                      \
                                                            const AttentionShape&, double, uint64_t, const uint64_t*);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
