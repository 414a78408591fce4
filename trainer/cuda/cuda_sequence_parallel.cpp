// The CUDA model's --sequence-parallel (Megatron's sequence parallelism on the tensor group), the
// CPU model's (trainer/cpu/sequence_parallel_cpu.cpp) over the CUDA ops: each tensor rank keeps
// positions [r·t/T, (r+1)·t/T) of every sample, (b, t/T, c) in order, for the norms (LayerNorm or
// RMSNorm), the hidden dropout and the residual stream; a norm's output is all-gathered (NCCL on
// the compute stream, through the sp_stage buffer) into the whole (n, c) buffer the column-parallel
// product that follows reads (QKV, fc1, the output layer; their weight gradients read it again in
// backward), and a row-parallel product's partial output (proj, fc2, the vocabulary-slice
// embedding) is reduce-scattered in fp32 to this rank's rows instead of all-reduced. Backward
// mirrors it: the gradient of a branch's output is all-gathered, the column-parallel products' input
// gradients are reduce-scattered, and the norms' and the row-parallel biases' gradients are this
// rank's rows' only, summed over the group after the data-parallel reduction (TrainStep, through
// GPTModel::SumNonTensorParallelGrads), as Megatron's finalize_model_grads does. The hidden dropout runs as its own
// pass (the norm kernels' fused dropout keys whole samples), each element keyed by its place in the whole sample, so
// the masks are those of one rank.
#include <cuda_runtime.h>

#include <type_traits>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::model_detail {
namespace {

// The rows of T ranks between rank-major order ([rank][sample][tl], what the collectives exchange)
// and sample-major order ([sample][rank · tl + i], the micro-batch's), row_bytes a row: one
// strided copy per rank on `stream`.
absl::Status Rearrange(void* dst, const void* src, int64_t ranks, int64_t b, int64_t tl, int64_t row_bytes,
                       bool to_sample_major, cudaStream_t stream) {
  const size_t block = static_cast<size_t>(tl * row_bytes);  // one sample's rows of one rank
  for (int64_t q = 0; q < ranks; ++q) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const size_t rank_major = static_cast<size_t>(q * b) * block, sample_major = static_cast<size_t>(q) * block;
    const size_t whole_pitch = static_cast<size_t>(ranks) * block;
    const cudaError_t e = to_sample_major
                              ? cudaMemcpy2DAsync(d + sample_major, whole_pitch, s + rank_major, block, block,
                                                  static_cast<size_t>(b), cudaMemcpyDeviceToDevice, stream)
                              : cudaMemcpy2DAsync(d + rank_major, block, s + sample_major, whole_pitch, block,
                                                  static_cast<size_t>(b), cudaMemcpyDeviceToDevice, stream);
    PTK_CUDA_RETURN_IF_ERROR(
        e, fmt::format("sequence-parallel copy of rank {}'s rows ({} samples x {} positions)", q, b, tl));
  }
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqGather(T* whole, const T* local) {
  const int Tn = tensor_size();
  const int64_t c = config().hidden_size, nl = SeqRows();
  T* stage = Buf<T>(plan_.sp_stage);
  T* mine = SeqSlot();
  if (local != mine)
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(mine, local, static_cast<size_t>(nl * c) * sizeof(T), cudaMemcpyDeviceToDevice, ctx_.stream),
        "copying this rank's rows for the sequence-parallel all-gather");
  const std::vector<int64_t> bytes(static_cast<size_t>(Tn), nl * c * static_cast<int64_t>(sizeof(T)));
  PTK_RETURN_IF_ERROR(
      Op("tensor parallel", "sequence-parallel all-gather", tensor_comm()->AllGatherDevice(stage, bytes, ctx_.stream)));
  return Op("copies", "sequence-parallel gather to sample order",
            Rearrange(whole, stage, Tn, b_, t_ / Tn, c * static_cast<int64_t>(sizeof(T)), true, ctx_.stream));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqReduceScatter(T* local, const T* whole, const float* whole_f32, const T* bias,
                                                   const T* wpe) {
  const int Tn = tensor_size(), me = tensor_rank();
  const int64_t c = config().hidden_size, n = n_, nl = SeqRows(), tl = t_ / Tn;
  float* stage = Buf<float>(plan_.sp_stage);
  const float* src = whole_f32;
  if (!src) {
    if constexpr (std::is_same_v<T, float>) {
      src = whole;
    } else {
      float* sum = Buf<float>(plan_.tp_sum);
      PTK_RETURN_IF_ERROR(
          Op("tensor parallel", "to fp32 for the reduce-scatter", CastToFloat<T>(sum, whole, n * c, ctx_)));
      src = sum;
    }
  }
  PTK_RETURN_IF_ERROR(
      Op("copies", "sequence-parallel scatter to rank order",
         Rearrange(stage, src, Tn, b_, tl, c * static_cast<int64_t>(sizeof(float)), false, ctx_.stream)));
  const std::vector<int64_t> counts(static_cast<size_t>(Tn), nl * c);
  PTK_RETURN_IF_ERROR(Op("tensor parallel", "sequence-parallel reduce-scatter",
                         tensor_comm()->ReduceScatterSumDevice(stage, counts, ctx_.stream)));
  // This rank's positions (b, tl), after the staging's fp32 rows, for the position embeddings.
  int32_t* positions = nullptr;
  if (wpe) {
    positions = reinterpret_cast<int32_t*>(stage + plan_.n * c);
    PTK_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(positions, static_cast<size_t>(tl) * sizeof(int32_t), Positions() + me * tl,
                          static_cast<size_t>(t_) * sizeof(int32_t), static_cast<size_t>(tl) * sizeof(int32_t),
                          static_cast<size_t>(b_), cudaMemcpyDeviceToDevice, ctx_.stream),
        "copying this rank's positions");
  }
  return Op("tensor parallel", "sequence-parallel sum finish",
            TensorSumFinish<T>(local, stage + me * nl * c, bias, positions, wpe, nl, c, ctx_));
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqDropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed) {
  if (p <= 0.0) return absl::OkStatus();
  const int64_t tl = t_ / tensor_size(), c = config().hidden_size;
  // With context parallelism this rank's rows are tl of the context rank's positions, keyed by their true ones.
  if (cp()) return ContextDropout(x, tensor_rank() * tl, tl, layer, site, p, seed);
  return DropoutRows<T>(x, b_, tl * c, Streams(layer, site), p, seed, ctx_, tensor_rank() * tl * c);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqNormForward(const char* name, T* resid_out, T* out, float* stats, const T* a,
                                                 const T* b, int64_t w, int64_t bias) {
  const int64_t nl = SeqRows(), c = config().hidden_size;
  const double eps = config().layernorm_epsilon;
  T* local = SeqSlot();
  if (Rms()) {
    PTK_RETURN_IF_ERROR(Op("rmsnorm", name,
                           b ? ResidualRMSNormForward<T>(resid_out, local, stats + n_, a, b, LnW(w), nl, c, eps, ctx_)
                             : RMSNormForward<T>(local, stats + n_, a, LnW(w), nl, c, eps, ctx_)));
  } else {
    PTK_RETURN_IF_ERROR(Op(
        "layernorm", name,
        b ? ResidualLayerNormForward<T>(resid_out, local, stats, stats + n_, a, b, LnW(w), Ln(bias), nl, c, eps, ctx_)
          : LayerNormForward<T>(local, stats, stats + n_, a, LnW(w), Ln(bias), nl, c, eps, ctx_)));
  }
  return SeqGather(out, local);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqNormBackward(const char* name, T* dpartial, const T* inp, float* stats, int64_t w,
                                                  int64_t bias) {
  const int64_t nl = SeqRows(), c = config().hidden_size;
  T* dout = Buf<T>(plan_.dln);  // this rank's rows of the summed gradient, at dln's start
  PTK_RETURN_IF_ERROR(SeqReduceScatter(dout, dpartial, nullptr, nullptr, nullptr));
  // The norm's gradients of this rank's rows (weight at 0, LayerNorm's bias at c), in the fp32 sum
  // buffer the reduce-scatter above no longer needs.
  float* g = Buf<float>(plan_.tp_sum);
  const int64_t k = Rms() ? c : 2 * c;
  PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g, 0, static_cast<size_t>(k) * sizeof(float), ctx_.stream),
                           "zeroing the norm's gradients");
  PTK_RETURN_IF_ERROR(Op(Rms() ? "rmsnorm" : "layernorm", name,
                         LnBackward(Buf<T>(plan_.dresid), g, Rms() ? nullptr : g + c, dout, inp, LnW(w), stats,
                                    stats + n_, nl, c, Buf<float>(plan_.ln_scratch), ctx_)));
  // Added as a micro-batch's gradient is to Megatron's main_grad; the sum over the tensor group
  // comes after the data-parallel reduction (GPTModel::SumNonTensorParallelGrads).
  PTK_RETURN_IF_ERROR(Op("tensor parallel", "norm gradients added", ResidualAdd<float>(Grad(w), Grad(w), g, c, ctx_)));
  if (!Rms() && bias >= 0)
    PTK_RETURN_IF_ERROR(
        Op("tensor parallel", "norm gradients added", ResidualAdd<float>(Grad(bias), Grad(bias), g + c, c, ctx_)));
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::SeqBranchGrad(int64_t l, int64_t site, double p, uint64_t seed, int64_t bias) {
  const int64_t nl = SeqRows(), c = config().hidden_size;
  T* local = SeqSlot();
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(local, Buf<T>(plan_.dresid), static_cast<size_t>(nl * c) * sizeof(T),
                                           cudaMemcpyDeviceToDevice, ctx_.stream),
                           "copying the residual gradient");
  PTK_RETURN_IF_ERROR(Op("dropout",
                         site == kMlpOutDropout ? "mlp-out dropout backward" : "attention-out dropout backward",
                         SeqDropout(local, l, site, p, seed)));
  // The row-parallel product's bias is added after the reduce-scatter: its gradient is this rank's
  // rows' (summed over the group with the norms', after the data-parallel reduction).
  if (bias >= 0)
    PTK_RETURN_IF_ERROR(Op("matmul", site == kMlpOutDropout ? "fc2 bias backward" : "proj bias backward",
                           BiasBackward<T>(Grad(bias), local, nl, c, ctx_)));
  return SeqGather(Buf<T>(plan_.dtmp), local);
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::RunForwardSequenceParallel(bool train, uint64_t seed) {
  const GPTConfig& cf = config();
  const ParamLayout& pl = layout();
  const AttentionShape shape = Shape();
  const int Tn = tensor_size();
  if (t_ % Tn != 0)
    return absl::InvalidArgumentError(fmt::format(
        "--sequence-parallel: a micro-batch of {} positions does not divide by the tensor group's {} ranks", t_, Tn));
  // L: the stage's layers (the embedding's dropout streams); the selected model chunk's are [l0, l1).
  const int64_t n = n_, nl = SeqRows(), c = cf.hidden_size, ct = OutWidth(shape), f = cf.ffn_hidden_size / Tn,
                L = StageLayers(), l0 = chunk_layer_begin(), l1 = chunk_layer_end();
  const bool pre = chunk_pre_process(), post = chunk_post_process();
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  T* tmp = Buf<T>(plan_.tmp);
  // Row-parallel products: the partial products reduce-scattered to this rank's rows (at tmp's
  // start), the bias added once.
  auto row_parallel = [&](const char* name, const T* inp, int64_t w, int64_t bias, int64_t k) -> absl::Status {
    PTK_RETURN_IF_ERROR(
        Op("matmul", name, MatmulForward<T>(tmp, inp, Compute(w), static_cast<const T*>(nullptr), n, k, c, ctx_)));
    return SeqReduceScatter(tmp, tmp, nullptr, Compute(bias), nullptr);
  };

  layer_ = -1;
  // A later pipeline stage (or model chunk) starts from the previous one's output, this rank's
  // rows, already in resid[l0].
  T* x0 = Act(plan_.resid, l0, nl * c);
  if (pre) {
    // Vocabulary-parallel embedding: each rank its rows, zeros elsewhere, reduce-scattered to this
    // rank's positions, their position embeddings added.
    const int64_t vt = cf.padded_vocab_size / Tn;
    float* sum = Buf<float>(plan_.tp_sum);
    PTK_RETURN_IF_ERROR(
        Op("embedding", "vocabulary-slice embedding",
           VocabSliceEmbeddingForward<T>(sum, Tokens(), Compute(pl.wte), tensor_rank() * vt, vt, n, c, ctx_)));
    PTK_RETURN_IF_ERROR(SeqReduceScatter(x0, nullptr, sum, nullptr, Compute(pl.wpe)));
    PTK_RETURN_IF_ERROR(Op("dropout", "embedding dropout", SeqDropout(x0, L, kEmbeddingDropout, hp, seed)));
  }
  const LayerParams& first = pl.layers[static_cast<size_t>(l0)];
  PTK_RETURN_IF_ERROR(SeqNormForward("ln1", nullptr, Act(plan_.ln1, l0, n * c), Stats(plan_.ln1_stats, l0), x0, nullptr,
                                     first.ln1_w, first.ln1_b));
  for (int64_t l = l0; l < l1; ++l) {
    layer_ = l;
    const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
    T* atty = Act(plan_.atty, l, n * ct);
    PTK_RETURN_IF_ERROR(SelfAttentionForward(l, ap, seed));
    PTK_RETURN_IF_ERROR(row_parallel("proj", atty, lp.proj_w, lp.proj_b, ct));
    PTK_RETURN_IF_ERROR(Op("dropout", "attention-out dropout", SeqDropout(tmp, l, kAttentionOutDropout, hp, seed)));
    // resid_mid[l] = resid[l] + dropout(proj), then ln2 (gathered whole for fc1).
    PTK_RETURN_IF_ERROR(SeqNormForward("residual+ln2", Act(plan_.resid_mid, l, nl * c), Act(plan_.ln2, l, n * c),
                                       Stats(plan_.ln2_stats, l), Act(plan_.resid, l, nl * c), tmp, lp.ln2_w,
                                       lp.ln2_b));
    PTK_RETURN_IF_ERROR(Fc1Forward(l));
    PTK_RETURN_IF_ERROR(row_parallel("fc2", MlpAct(plan_.gelu, l, n * f), lp.fc2_w, lp.fc2_b, f));
    PTK_RETURN_IF_ERROR(Op("dropout", "mlp-out dropout", SeqDropout(tmp, l, kMlpOutDropout, hp, seed)));
    // resid[l+1] = resid_mid[l] + dropout(fc2), then the next norm (the next layer's or the final one).
    // A stage (or chunk) before the last has no final norm: the residual (the next stage's input)
    // is what counts; its norm, taken with the chunk's first ln1 weights, lands in the unused lnf buffers.
    const bool last = l + 1 == l1;
    const LayerParams* next = last ? (post ? nullptr : &first) : &pl.layers[static_cast<size_t>(l + 1)];
    PTK_RETURN_IF_ERROR(SeqNormForward(
        "residual+ln", Act(plan_.resid, l + 1, nl * c), last ? Buf<T>(plan_.lnf) : Act(plan_.ln1, l + 1, n * c),
        last ? Buf<float>(plan_.lnf_stats) : Stats(plan_.ln1_stats, l + 1), Act(plan_.resid_mid, l, nl * c), tmp,
        next ? next->ln1_w : pl.lnf_w, next ? next->ln1_b : pl.lnf_b));
  }
  layer_ = -1;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::RunBackwardSequenceParallel(bool train, uint64_t seed) {
  const GPTConfig& cf = config();
  const ParamLayout& pl = layout();
  const int Tn = tensor_size();
  // L: the stage's layers (the embedding's dropout streams); the selected model chunk's are [l0, l1).
  const int64_t n = n_, nl = SeqRows(), c = cf.hidden_size, L = StageLayers(), l0 = chunk_layer_begin(),
                l1 = chunk_layer_end();
  const bool pre = chunk_pre_process(), post = chunk_post_process();
  const double hp = train ? cf.hidden_dropout : 0.0, ap = train ? cf.attention_dropout : 0.0;
  T *dresid = Buf<T>(plan_.dresid), *dtmp = Buf<T>(plan_.dtmp), *dln = Buf<T>(plan_.dln);

  layer_ = -1;
  // A stage (or chunk) before the last starts from the next one's gradient of this rank's rows,
  // already in dresid (StageBackward).
  if (post) {
    PTK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dresid, 0, static_cast<size_t>(nl * c) * sizeof(T), ctx_.stream),
                             "zeroing the residual gradient");
    // The output layer's input gradient (RunHead left this rank's partial in dln), reduce-scattered.
    PTK_RETURN_IF_ERROR(SeqNormBackward("final norm backward", dln, Act(plan_.resid, l1, nl * c),
                                        Buf<float>(plan_.lnf_stats), pl.lnf_w, pl.lnf_b));
  }
  GradsReady(0);  // the final norm (and an untied output layer): --overlap-grad-reduce's buckets
  for (int64_t l = l1 - 1; l >= l0; --l) {
    layer_ = l;
    const LayerParams& lp = pl.layers[static_cast<size_t>(l)];
    // MLP: resid[l+1] = resid_mid + dropout(fc2(act(fc1(ln2(resid_mid))))); the branch's output
    // gradient gathered whole into dtmp.
    PTK_RETURN_IF_ERROR(SeqBranchGrad(l, kMlpOutDropout, hp, seed, lp.fc2_b));
    PTK_RETURN_IF_ERROR(MlpBackward(l, dtmp, /*fc2_bias=*/false));
    PTK_RETURN_IF_ERROR(SeqNormBackward("ln2 backward", dln, Act(plan_.resid_mid, l, nl * c), Stats(plan_.ln2_stats, l),
                                        lp.ln2_w, lp.ln2_b));
    // Attention: resid_mid = resid[l] + dropout(proj(attention(rope(qkv(ln1(resid[l]))))))
    PTK_RETURN_IF_ERROR(SeqBranchGrad(l, kAttentionOutDropout, hp, seed, lp.proj_b));
    PTK_RETURN_IF_ERROR(AttentionBranchBackward(l, dtmp, ap, seed, /*proj_bias=*/false));
    PTK_RETURN_IF_ERROR(SeqNormBackward("ln1 backward", dln, Act(plan_.resid, l, nl * c), Stats(plan_.ln1_stats, l),
                                        lp.ln1_w, lp.ln1_b));
    GradsReady(static_cast<size_t>(L - l));  // layer l
  }
  layer_ = -1;
  // A later stage (or chunk) leaves its input's gradient, this rank's rows, in dresid for the previous one.
  if (!pre) {
    GradsReady(static_cast<size_t>(L) + 1);  // the embeddings (none here)
    return absl::OkStatus();
  }
  // The embedding: its dropout's mask on this rank's rows, then the gradient gathered whole (the
  // reduce-scatter's mirror) for the vocabulary slice's rows and the position table.
  PTK_RETURN_IF_ERROR(Op("dropout", "embedding dropout backward", SeqDropout(dresid, L, kEmbeddingDropout, hp, seed)));
  PTK_RETURN_IF_ERROR(SeqGather(dtmp, dresid));
  const int64_t vt = cf.padded_vocab_size / Tn;
  PTK_RETURN_IF_ERROR(
      Op("embedding", "embedding backward",
         EmbeddingBackward<T>(Grad(pl.wte), Grad(pl.wpe), dtmp, Tokens(), Positions(), tokens_host_, positions_host_, n,
                              c, vt, cf.max_position_embeddings, &embedding_plan_, ctx_, tensor_rank() * vt)));
  GradsReady(static_cast<size_t>(L) + 1);  // the embeddings
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                           \
  template absl::Status CudaGPTModelImpl<T>::SeqGather(T* whole, const T* local);                                    \
  template absl::Status CudaGPTModelImpl<T>::SeqReduceScatter(T* local, const T* whole, const float* whole_f32,      \
                                                              const T* bias, const T* wpe);                          \
  template absl::Status CudaGPTModelImpl<T>::SeqDropout(T* x, int64_t layer, int64_t site, double p, uint64_t seed); \
  template absl::Status CudaGPTModelImpl<T>::SeqNormForward(const char* name, T* resid_out, T* out, float* stats,    \
                                                            const T* a, const T* b, int64_t w, int64_t bias);        \
  template absl::Status CudaGPTModelImpl<T>::SeqNormBackward(const char* name, T* dpartial, const T* inp,            \
                                                             float* stats, int64_t w, int64_t bias);                 \
  template absl::Status CudaGPTModelImpl<T>::SeqBranchGrad(int64_t l, int64_t site, double p, uint64_t seed,         \
                                                           int64_t bias);                                            \
  template absl::Status CudaGPTModelImpl<T>::RunForwardSequenceParallel(bool train, uint64_t seed);                  \
  template absl::Status CudaGPTModelImpl<T>::RunBackwardSequenceParallel(bool train, uint64_t seed);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
