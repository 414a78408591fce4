// ptk checkpoints <-> Megatron-LM checkpoints in its `torch` format (--ckpt-format torch):
// <dir>/latest_checkpointed_iteration.txt and <dir>/iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt, one
// PyTorch file per tensor- and pipeline-parallel rank holding a pickled dict (args, checkpoint_version,
// iteration, model, optimizer, opt_param_scheduler, ...), read and written by ptk itself
// (interop/torch_format.h; no Python).
//
// megatron -> ptk merges the shards (column-parallel tensors along their rows, row-parallel ones
// along their columns, the layers of the pipeline stages renumbered in order; an interleaved run's
// model chunks model0, model1, ... as virtual stages v * pp + p), takes the fp32 master
// weights where the optimizer holds them (--bf16/--fp16 runs) and AdamW's moments from the
// optimizer's state (Megatron's parameter groups: the weights, then the biases and LayerNorms; or the
// distributed optimizer's distrib_optim.pt, one grad buffer per model chunk), and
// writes a ptk checkpoint of the same iteration, consumed samples and schedule.
// ptk -> megatron splits a ptk checkpoint at --target-tensor/pipeline-parallel-size (and into model
// chunks at --target-num-layers-per-virtual-pipeline-stage), as a run of
// Megatron with the plain (non-distributed) optimizer saves it in the precision the ptk run trained
// (fp32; bf16/fp16 weights with the fp32 masters in the optimizer), or with
// --target-use-distributed-optimizer as its distributed optimizer saves it (the param groups in
// model_optim_rng.pt, the fp32 params and moments in each rank's distrib_optim.pt); the vocabulary is padded to a
// multiple of --make-vocab-size-divisible-by x tensor-parallel size as Megatron pads it (new rows:
// copies of the last token's row, zero moments).
#pragma once

#include "absl/status/statusor.h"
#include "interop/hf_gpt2.h"

namespace ptk {

absl::StatusOr<ConvertSummary> ImportFromMegatron(const ConvertOptions& options);
absl::StatusOr<ConvertSummary> ExportToMegatron(const ConvertOptions& options);

}  // namespace ptk
