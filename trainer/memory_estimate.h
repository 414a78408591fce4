// What a CPU-backend run's rank needs in memory, worked out before the model is made: printed as
// Megatron's "Theoretical memory footprints" line, and checked against what the machine, the
// cgroup and ulimit -v leave (common/system_memory.h), so that a run that cannot fit stops at once
// saying so instead of in std::bad_alloc or at the OOM killer mid-way.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/system_memory.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"

namespace ptk {

// One rank's buffers, in bytes.
struct CpuTrainingMemory {
  int64_t params = 0;                // this rank's parameters
  double weights_and_optimizer = 0;  // parameters, gradients and AdamW's two moments: 16 bytes each
  int64_t activation_slots = 0;      // micro-batches (of one model chunk) whose activations are kept
  double activations = 0;            // those slots' buffers
  double checkpoint_copies = 0;      // --save / --load: parameters and moments copied out (12 bytes each)
  // Attention's per-thread work buffers (cpu::AttentionForward / AttentionBackward), held only while
  // one layer's attention runs: once at the peak, not per layer nor per micro-batch in flight.
  int64_t attention_threads = 0;  // the threads that run heads at once and hold a buffer each
  double attention_work = 0;      // their buffers together at the peak
  double total() const { return weights_and_optimizer + activations + checkpoint_copies + attention_work; }
};

// The CPU model's buffers (CpuGPTModel: its parameters, gradients and moments, and the activation
// buffers of `micro_batch_size` sequences, exactly as it sizes them) on tensor rank `tensor_rank`
// of `tensor_size` and pipeline stage `stage`, keeping the activations of as many micro-batches as
// the schedule holds in flight (1F1B: min(P - p, micro-batches); interleaved: Megatron's warm-up
// plus one, its (V - 1) x N with N `microbatch_group_size`, 0: P), the copies a checkpoint's
// save or load makes when `checkpoints`, and attention's work buffers on `threads` oneTBB threads
// (each thread running heads holds 2 t^2 floats in backward, t^2 in a forward with attention
// dropout; t = seq_length). `threads` 0: the threads oneTBB may run now (tbb::global_control's
// max_allowed_parallelism: ptk-train's --threads, set by its main). With `context` context-parallel
// ranks: one context rank's buffers (seq_length / context positions of each sample, whose attention
// runs over the whole samples: its probabilities and work buffers t / context x t per head). With `expert_size`
// expert ranks (--expert-model-parallel-size): the rank's num_experts / expert_size experts of each MoE layer.
absl::StatusOr<CpuTrainingMemory> EstimateCpuTrainingMemory(const GPTConfig& model, int tensor_size, int tensor_rank,
                                                            bool sequence_parallel, const PipelineStage& stage,
                                                            int64_t micro_batch_size, int64_t micro_batches,
                                                            bool checkpoints, int microbatch_group_size = 0,
                                                            int threads = 0, int context = 1, int expert_size = 1);

// Megatron's line (megatron/training/theoretical_memory_usage.py), MB of 2^20 bytes:
// "Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB"; the
// checkpoint copies and attention's work buffers count in the total.
std::string TheoreticalMemoryLine(const CpuTrainingMemory& m);

// FailedPrecondition, one line, when the need is more than what is available: both figures, where
// the limit comes from and what to change. OK when it fits or nothing could be read. With
// `ranks_on_node` > 1 ranks of the job on this machine (each needing about as much; the launcher's
// count, named by `ranks_source`), their total is checked first against what they share
// (`available.shared_bytes`: MemAvailable, the cgroups), then this rank's against all of it.
absl::Status CheckFitsInMemory(const CpuTrainingMemory& need, const AvailableMemory& available, int ranks_on_node = 1,
                               const std::string& ranks_source = "");

}  // namespace ptk
