// ptk-train --dry-run: a run's plan on a cluster, from its flags and the launcher's world size,
// without building the model or reading data: Megatron's parallel layout and start-up lines, the
// parameters of every (tensor, pipeline) rank, and the memory each GPU needs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"
#include "trainer/param_layout.h"

namespace ptk {

// The job being planned: its number of ranks and GPUs per node, and where each came from.
struct DryRunCluster {
  int world_size = 1;
  std::string world_source = "no launcher variables: one process";
  int gpus_per_node = 0;  // 0: not known (the check of T against a node is then skipped)
  std::string gpus_source;
  int rank = 0;  // this process's rank under a launcher: only rank 0 prints the plan
};

// WORLD_SIZE (torchrun, a PyTorchJob; RANK need not be set to plan), else SLURM_STEP_NUM_TASKS
// (srun), else one process. GPUs per node: `gpus_per_node_flag` if above 0, else LOCAL_WORLD_SIZE
// (torchrun), else SLURM_GPUS_ON_NODE. A value that is not a positive decimal is a usage error
// naming the variable.
absl::StatusOr<DryRunCluster> DryRunClusterFromEnv(int gpus_per_node_flag);

struct DryRunOptions {
  GPTConfig model;  // vocab_size: the tokenizer's; padded_vocab_size is computed for T
  int64_t make_vocab_size_divisible_by = 128;
  int64_t padded_vocab_size = 0;  // > 0: the model's as is (ptk-train --use-checkpoint-args: the checkpoint's)
  int tensor = 1, pipeline = 1, context = 1;
  int expert = 1;  // --expert-model-parallel-size: its groups are listed, each rank's experts counted (E / expert)
  std::optional<int64_t> first_stage_layers, last_stage_layers;
  int virtual_size = 1;           // model chunks per stage: Megatron's interleaved schedule
  int microbatch_group_size = 0;  // its micro-batches in a row on one chunk; 0: the pipeline size
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: micro-batch × data-parallel size
  // --decrease-batch-size-if-needed: a global batch that micro-batch × data-parallel size does not divide trains
  // on its largest multiple (Megatron's microbatch calculator), else it is refused.
  bool decrease_batch_size = false;
  bool sequence_parallel = false, use_distributed_optimizer = false;
  Precision precision = Precision::kFp32;
  DryRunCluster cluster;
};

// Megatron's activation memory of one transformer layer on one tensor rank, in bytes, as Table 2 of
// Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022):
// sbh(34 + 5as/h) with 2-byte activations and an MLP of 4h, generalised to an MLP of F
// (sbh(18 + 4F/h) + 5as²b) and to 4-byte activations (fp32: the 1-byte dropout masks stay).
// The Llama line's shapes in the same terms: Q, K, V and the projection's input as their heads have
// them (sb(2a·kv + 2G·kv) in place of 4sbh), SwiGLU's MLP 3sbF in place of 2sbF.
// Tensor parallelism splits all but the LayerNorm and linear inputs and the dropout masks
// (10sbh of the 34); sequence parallelism splits those too. Selective recomputation
// (--recompute-activations) drops the attention core's 5as²b.
double ActivationBytesPerLayer(const GPTConfig& config, int64_t micro_batch_size, int tensor, bool sequence_parallel,
                               bool selective_recompute, int activation_bytes);

// One pipeline stage's GPU (every tensor rank of a stage holds the same), in bytes.
struct StageMemory {
  int64_t layers = 0, params = 0;
  // Micro-batches whose activations the stage keeps (1F1B: min(P - p, micro-batches)); with V model
  // chunks, virtual micro-batches of one chunk's layers each (Megatron's interleaved warm-up plus
  // one: min((P - p - 1) * 2 + (V - 1) * N + 1, V x micro-batches), N the micro-batch group).
  int64_t in_flight = 0;
  double weights = 0, gradients = 0, optimizer = 0, optimizer_zero1 = 0, activations = 0, activations_recomputed = 0;
  double total = 0;  // as the run is configured (ZeRO-1 or not, recomputation or not)
};

struct DryRunPlan {
  GPTConfig model;  // defaults resolved, the vocabulary padded for T
  int data_parallel = 1;
  // Context-parallel ranks: each holds 1/C of every sample's positions (Megatron's CP: the activations
  // over C; ZeRO-1 shards the optimizer state over data × context ranks).
  int context_parallel = 1;
  int64_t global_batch_size = 0, micro_batches = 0;  // the batch each iteration trains on
  int64_t decreased_from = 0;      // --decrease-batch-size-if-needed cut the global batch: the one given (else 0)
  bool sequence_parallel = false;  // in effect (T > 1)
  int weight_bytes = 4, gradient_bytes = 4, optimizer_bytes = 8, activation_bytes = 4;
  std::vector<StageMemory> stages;
};

// The plan's figures. Usage errors for what Megatron refuses: a world not divisible by T × C × P,
// a sequence not divisible by 2C,
// heads or MLP not divisible by T, layers not divisible by P, a global batch not divisible by
// micro-batch × data-parallel size.
absl::StatusOr<DryRunPlan> PlanDryRun(const DryRunOptions& options);

// The plan as printed, lines ending in '\n': the cluster, Megatron's start-up lines, the layout,
// the parameter line of every (tensor, pipeline) rank, the memory per GPU of each stage.
absl::StatusOr<std::string> DryRunReport(const DryRunOptions& options);

}  // namespace ptk
