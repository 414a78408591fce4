// ptk-train --dry-run's flags: the run's options as ResolveTrainFlags checks them, for any tensor
// and pipeline size and without a device or data, turned into the plan's options.
#include <cstdio>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/status.h"
#include "tools/train_flag_parts.h"
#include "tools/train_flags.h"

namespace ptk {

absl::StatusOr<DryRunOptions> ResolveDryRunFlags(const TrainFlags& flags, const DryRunCluster& cluster,
                                                 std::vector<std::string>* notes) {
  if (flags.fp16 && flags.bf16) return UsageError("--fp16 and --bf16: give one precision");
  // The checks of a real run on a copy that one process on this machine can pass: the plan is of
  // another machine's run (its GPUs, its files).
  PTK_ASSIGN_OR_RETURN(const int virtual_size, VirtualPipelineSize(flags));
  PTK_RETURN_IF_ERROR(RefuseMoeParallelism(flags));  // a plan ptk-train would refuse to run
  PTK_RETURN_IF_ERROR(
      RefuseMoeDevice(flags, flags.device == "cuda" || flags.bf16 || flags.fp16 ? Device::kCuda : Device::kCpu));
  PTK_RETURN_IF_ERROR(RefuseMlaParallelismAndDevice(
      flags, flags.device == "cuda" || flags.bf16 || flags.fp16 ? Device::kCuda : Device::kCpu));
  PTK_RETURN_IF_ERROR(
      RefuseMtpCombinations(flags, flags.device == "cuda" || flags.bf16 || flags.fp16 ? Device::kCuda : Device::kCpu));
  PTK_RETURN_IF_ERROR(RefuseAttentionVariantCombinations(
      flags, flags.device == "cuda" || flags.bf16 || flags.fp16 ? Device::kCuda : Device::kCpu));
  TrainFlags f = flags;
  f.tensor_model_parallel_size = f.pipeline_model_parallel_size = f.context_parallel_size = 1;
  f.moe.expert_tensor_parallel.reset();  // checked above at the plan's tensor size
  f.num_layers_per_virtual_pipeline_stage.reset();
  f.num_virtual_stages_per_pipeline_rank.reset();
  f.decoder_first_pipeline_num_layers.reset();
  f.decoder_last_pipeline_num_layers.reset();
  f.device = "cpu";
  // With --bf16, --disable-bf16-reduced-precision-matmul changes how the products sum, not the plan's
  // memory; cleared with --bf16, it would be noted as having no effect.
  if (f.bf16) f.disable_bf16_reduced_precision_matmul = false;
  f.fp16 = f.bf16 = f.profile = false;
  f.options.backend.profile = false;
  f.data_args_path.clear();
  f.per_split_data_args_path.clear();
  f.per_dataset_sequences_path.clear();  // its datasets are the other machine's
  if (f.options.model.vocab_size == 0 && !f.options.vocab_file.empty() && !PathExists(f.options.vocab_file)) {
    notes->push_back(fmt::format(
        "--vocab-file {} is not on this machine: GPT-2's 50257 tokens assumed (give --vocab-size for another)",
        f.options.vocab_file));
    f.options.model.vocab_size = 50257;
  }
  if (f.options.model.vocab_size != 0) f.options.vocab_file = f.options.merge_file = "";
  std::vector<std::string> run_notes;  // a real run's notes (on flags without effect) do not apply to the plan
  PTK_ASSIGN_OR_RETURN(const TrainOptions o, ResolveTrainFlags(f, &run_notes));
  DryRunOptions d;
  d.model = o.model;
  d.make_vocab_size_divisible_by = flags.make_vocab_size_divisible_by;
  if (flags.checkpoint_vocab) d.padded_vocab_size = o.model.padded_vocab_size;
  d.tensor = static_cast<int>(flags.tensor_model_parallel_size);
  d.pipeline = static_cast<int>(flags.pipeline_model_parallel_size);
  d.context = static_cast<int>(flags.context_parallel_size);
  d.expert = static_cast<int>(flags.moe.expert_parallel);
  d.first_stage_layers = flags.decoder_first_pipeline_num_layers;
  d.last_stage_layers = flags.decoder_last_pipeline_num_layers;
  d.virtual_size = virtual_size;
  if (virtual_size > 1)
    d.microbatch_group_size = static_cast<int>(flags.microbatch_group_size_per_vp_stage.value_or(0));
  d.micro_batch_size = o.micro_batch_size;
  d.global_batch_size = o.global_batch_size;
  d.decrease_batch_size = o.decrease_batch_size_if_needed;
  if (d.decrease_batch_size && !o.rampup_batch_size.empty())  // the real run's refusal (PlanTraining's)
    return UsageError("--decrease-batch-size-if-needed with --rampup-batch-size is not implemented");
  d.sequence_parallel = flags.options.backend.sequence_parallel;
  d.use_distributed_optimizer = o.use_distributed_optimizer;
  d.precision = flags.bf16 ? Precision::kBf16 : flags.fp16 ? Precision::kFp16 : Precision::kFp32;
  d.cluster = cluster;
  return d;
}

absl::Status PrintDryRun(const CLI::App& app, TrainFlags* flags) {
  PTK_ASSIGN_OR_RETURN(const DryRunCluster cluster, DryRunClusterFromEnv(static_cast<int>(flags->gpus_per_node)));
  std::vector<std::string> notes;
  PTK_RETURN_IF_ERROR(ApplyCheckpointArgs(app, flags, &notes));
  PTK_ASSIGN_OR_RETURN(const DryRunOptions options, ResolveDryRunFlags(*flags, cluster, &notes));
  PTK_ASSIGN_OR_RETURN(const std::string report, DryRunReport(options));
  if (cluster.rank != 0) return absl::OkStatus();  // started on every rank: one prints
  for (const std::string& n : notes) fmt::print("note: {}\n", n);
  fmt::print("{}", report);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace ptk
