// The CUDA backend of GPTModel: the model of trainer/cpu/cpu_gpt_model.cpp on one GPU, fp32 (compared
// tightly with the CPU), bf16 or fp16 (fp32 master weights, gradients, moments, LayerNorm statistics,
// softmax and loss). Device memory is planned once (memory_plan.h); the step and checkpoints see host
// copies only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk::cuda {

// Visible CUDA devices; 0 without a driver or a device.
int VisibleDeviceCount();

// Settings of the CUDA model beside the run's flags. The library reads no environment: ptk-train's
// main fills sync_ops from PTK_CUDA_SYNC_OPS.
struct CudaModelOptions {
  // Tensor parallelism (Megatron's, as CpuGPTModel's): with a group of several ranks, this rank's
  // partition of the model (ParamLayout::Create's slices), its layers' collectives over `tensor`
  // on the compute stream. It must have device collectives (NCCL) and outlive the model.
  Communicator* tensor = nullptr;
  // Pipeline parallelism: this rank's stage (ParamLayout::Create's); its layers only, activations
  // kept on the device for the micro-batches in flight (StageForward / StageBackward).
  PipelineStage pipeline;
  // Megatron's --sequence-parallel over that group (ignored without one): the norms, hidden dropout
  // and residual stream on this rank's 1/T of each sample's positions (the CPU model's rows),
  // all-gathered before the column-parallel products, reduce-scattered after the row-parallel ones.
  // The sequence length must divide by the group's size.
  bool sequence_parallel = false;
  // Context parallelism (Megatron's --context-parallel-size, the CPU model's SetContextParallel): with
  // a group of several ranks (NCCL; it must outlive the model), each micro-batch holds this rank's
  // positions of its samples (ContextParallelPositions) and the attention runs over the group's keys
  // and values (in fp32 in every precision: cuda_context_parallel.cpp); the sequence length a multiple of
  // 2 x ranks (and, with sequence_parallel, a rank's positions a multiple of the tensor group's size).
  Communicator* context = nullptr;
  // Synchronise after every op; the first error names the op, its shapes and the layer (slow: for
  // finding a kernel fault, which otherwise surfaces at the next synchronisation).
  bool sync_ops = false;
  // Megatron's --disable-bf16-reduced-precision-matmul (torch's allow_bf16_reduced_precision_reduction =
  // False), read in bf16 only: every product's split-K partial sums in fp32, never in bf16 (cuBLASLt's
  // reduction schemes restricted, gemm_plan.h; the cuBLAS handle's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
  // for the cublasGemmEx fallbacks).
  bool disable_bf16_reduced_precision_matmul = false;
  // The LM head's logits are computed in chunks of rows within this many bytes; 0: sized from the
  // device's free memory (PlanMemoryWithin: every row in one chunk where the plan fits, else the
  // room left in whole tiles of rows, at least 256 MiB), or 256 MiB under tensor parallelism (the
  // same chunks on every rank of the group). Tests make it small to run the head in several chunks.
  int64_t logits_budget_bytes = 0;
  // The unfused paths the fused ones replaced, kept as their oracles (gpu tests compare the two):
  // each true runs the old path.
  struct Unfused {
    // The residual gradient copied into the branch's buffer before each branch's backward even
    // where no dropout runs (fused: the branch reads the residual gradient itself).
    bool residual_grad_copy = false;
    // The optimizer as a scaling pass over the gradients and one AdamW launch per tensor (fused:
    // one launch over a table of pieces, the scale folded in).
    bool adamw_per_tensor = false;
    // GELU's backward as its own pass over fc1's output (fused: fc2's input gradient through
    // cuBLASLt's DGELU epilogue in bf16/fp16).
    bool gelu_backward = false;
    // LayerNorm's backward with a block's rows in series (fused: a warp per row, four in flight).
    bool layernorm_rows_in_series = false;
    // Hidden dropout as its own pass: over the branch's output before the residual add + LayerNorm
    // (the embedding's in place before the first LayerNorm), and in backward over a copy of the
    // residual gradient (fused: the masks applied inside the LayerNorm kernels, forward and
    // backward; attention-probability dropout is unchanged either way).
    bool dropout_pass = false;
    // A pipeline stage's activations and their gradients cross to the adjacent stages as fp32 host
    // spans (cast from bf16/fp16 through an fp32 staging buffer, copied out, the stream synchronised
    // at every exchange; the communicator's host SendRecv) (direct: the slot's residual stream and
    // the residual gradient themselves, device memory in the model's dtype, sent and received on
    // the compute stream through SendRecvDevice). A pipeline communicator without device memory
    // (gloo) gets the host exchange whatever this says.
    bool pipeline_host_exchange = false;
    // Context parallelism's attention in bf16/fp16 without attention dropout or query groups as the fp32 rows
    // attention on widened rows, its probabilities kept (fused: cuDNN's pairs of chunks merged by their
    // log-sum-exps, cuda_context_parallel.cpp's ContextFlash).
    bool context_rows_attention = false;
  } unfused;
};

// The model on device `device_index` (CUDA_VISIBLE_DEVICES applies). micro_batch_size plans the
// activations for (micro_batch_size, seq_length); a larger batch later re-plans. profile times every
// op with CUDA events (ProfileReport).
absl::StatusOr<std::unique_ptr<GPTModel>> CreateCudaGPTModel(const GPTConfig& config, Precision precision,
                                                             int device_index, bool deterministic,
                                                             int64_t micro_batch_size, bool profile = false,
                                                             const CudaModelOptions& options = {});

}  // namespace ptk::cuda
