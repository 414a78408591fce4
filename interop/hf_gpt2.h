// ptk checkpoints <-> Hugging Face GPT-2 directories (what transformers' GPT2LMHeadModel,
// lm-eval-harness and vLLM load): ptk-convert's work, flags as Megatron's tools/checkpoint/convert.py.
// A model of Megatron's Llama line goes to and from LlamaForCausalLM instead (hf_llama.h), with the
// same files, checks and publishing.
//
// ptk -> hf: config.json (model_type gpt2, activation gelu_new: the tanh GELU ptk computes, gelu
// for the exact GELU of --no-bias-gelu-fusion, relu2 for --squared-relu;
// n_positions = --max-position-embeddings; layer_norm_epsilon; tie_word_embeddings false for an
// untied output layer), model.safetensors (fp32; Megatron's fused per-head QKV rows reordered into
// c_attn's [q | k | v] columns; every linear weight transposed into Conv1D's (in, out); the padded
// vocabulary rows dropped: HF's logits are the first vocab_size of ptk's, the padded ones, which no
// label ever names, are gone; above --max-shard-size, 5GB, sharded as save_pretrained shards:
// model-0000K-of-0000N.safetensors and model.safetensors.index.json), vocab.json, merges.txt,
// tokenizer_config.json, generation_config.json. Each file is replaced atomically.
// hf -> ptk: the directory's config.json and model.safetensors (or the shards its
// model.safetensors.index.json names, as from_pretrained reads them) checked against each other (every
// tensor present with its shape and nothing else; the tensor's name in every refusal), the
// padded rows filled as Megatron's checkpoint saver fills them (copies of the last row), written
// as a ptk checkpoint of iteration 0 with zero AdamW moments, for ptk-train --load ... --finetune
// (or --no-load-optim); or of ConvertOptions::iteration with its consumed samples, which
// ptk-train --load resumes (the moments still zero: an HF directory holds no optimizer state).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/checkpoint.h"
#include "trainer/param_layout.h"

namespace ptk {

struct ConvertOptions {
  std::string loader;  // "ptk", "hf" or "megatron"
  std::string saver;   // "hf", "ptk" or "megatron"
  std::string load_dir, save_dir;
  // ptk -> hf: the tokenizer's vocabulary size (0: the one the checkpoint's run recorded), and the
  // tokenizer files to ship (empty: ptk's built-in GPT-2 files).
  int64_t true_vocab_size = 0;
  std::string vocab_file, merge_file;
  // hf -> ptk: the padded vocabulary, as ptk-train's flag.
  int64_t make_vocab_size_divisible_by = 128;
  std::string args_json;  // stored in the checkpoint an import writes
  // ptk -> megatron: the tensor- and pipeline-parallel sizes to write, and the layer names
  // (transformer_engine: linear_qkv.layer_norm_weight ...; local: input_layernorm.weight ...).
  int64_t target_tensor_parallel_size = 1, target_pipeline_parallel_size = 1;
  // ptk -> megatron: the layers of each model chunk of an interleaved run (Megatron's
  // --num-layers-per-virtual-pipeline-stage); 0: no chunks.
  int64_t target_num_layers_per_virtual_pipeline_stage = 0;
  std::string saver_transformer_impl = "transformer_engine";
  // ptk -> megatron: as a run of Megatron's --use-distributed-optimizer saves it (the fp32 params and
  // moments in each rank's distrib_optim.pt, the param groups alone in model_optim_rng.pt).
  bool target_use_distributed_optimizer = false;
  // ... for a run of --overlap-grad-reduce --ddp-bucket-size N: the first pipeline stage's first chunk
  // in buckets of N elements, as its grad buffer lays them out (0: one bucket, no --overlap-grad-reduce).
  int64_t target_ddp_bucket_size = 0;
  // ptk -> hf: replace a --save-dir that holds files an export does not write (all removed).
  bool force = false;
  // How long to keep trying for a --save-dir another run is writing (--lock-wait; OutputLock::Acquire).
  std::chrono::milliseconds lock_wait{0};
  // ptk -> hf: save_pretrained's max_shard_size ("5GB", "500MB", a byte count): weights above it are
  // written as model-0000K-of-0000N.safetensors shards with model.safetensors.index.json.
  std::string max_shard_size = "5GB";
  // hf -> ptk: the checkpoint's iteration (0: a start for --finetune), and the samples consumed by
  // then: consumed_train_samples, or iteration x global_batch_size (a run without batch ramp-up),
  // so that ptk-train --load resumes at iteration + 1 at that data position and schedule step.
  int64_t iteration = 0, global_batch_size = 0, consumed_train_samples = -1;
  // A progress line (ProgressReporter "convert": tensors and bytes done of the total, rate, ETA) while
  // an HF export writes its weights and an HF import reads them, and from 1 GiB a line before each long
  // silent step (a checkpoint read and verified whole, a weights file or a checkpoint written);
  // ptk-convert's --quiet clears it.
  bool progress = false;
};
// The size from which ConvertOptions::progress says a step before it starts.
inline constexpr uint64_t kConvertLongStepBytes = uint64_t{1} << 30;

struct ConvertSummary {
  std::string source, destination;  // the files read and the directory written
  int64_t iteration = 0;            // the checkpoint's
  // megatron -> ptk: the tracker says "release" (a converted model): imported as Megatron loads it, at
  // iteration 0 without the optimizer state and the scheduler.
  bool release = false;
  GPTConfig config;
  int64_t num_params = 0;   // as stored in the destination
  std::string train_flags;  // hf -> ptk: the model flags ptk-train needs to load the result
  std::vector<std::string> notes;
};

absl::StatusOr<ConvertSummary> RunConvert(const ConvertOptions& options);

// The latest checkpoint of a ptk-train --save directory with its model configuration: the header's
// model description, completed by the settings the run recorded (--vocab-size unless
// `true_vocab_size` is given, --layernorm-epsilon, the dropouts, --init-method-std; Megatron's
// defaults, with a note, where a checkpoint does not record them), verified whole by LoadCheckpoint.
struct PtkCheckpoint {
  std::string file;
  int64_t iteration = 0;
  GPTConfig config;
  std::vector<float> params;  // in ParamLayout order
  std::vector<std::string> notes;
  // With `with_optimizer`: AdamW's moments (ParamLayout order) and the run's state, from the same read.
  std::vector<float> m1, m2;
  TrainState state;
};
// `progress`: from kConvertLongStepBytes a line names the file before it is read and verified.
// `with_optimizer`: the moments and the state kept (a Megatron export writes them; it read the whole
// checkpoint a second time for them).
absl::StatusOr<PtkCheckpoint> LoadPtkCheckpoint(const std::string& load_dir, int64_t true_vocab_size = 0,
                                                bool progress = false, bool with_optimizer = false);

// ptk -> hf publishes the export whole: written into SAVE.ptk-tmp-PID beside --save-dir and swapped
// in (renameat2 RENAME_EXCHANGE; two renames where the filesystem cannot exchange, the old export
// aside as SAVE.ptk-old-PID, renamed back by the next export if a kill fell between them). A
// --save-dir holding anything but an export's files is refused unless `force`.
// hf -> ptk refuses a --save-dir that holds a training run's checkpoints (any iteration but the
// one it writes), so that it never moves `latest` of a run.
// An import of iteration `iteration` into `save` (under its lock): refused (exit 2) when `save`
// holds a training run's checkpoints, any iteration but that one, or that one saved by a run; an
// earlier import of it is replaced; so is one whose iteration holds another tool's files (a Megatron
// checkpoint: --load-dir given as --save-dir). `with_moments`: the import carries AdamW's moments (a Megatron
// checkpoint's), so an earlier import is told by ptk-convert's command line in its header, not by
// an AdamW step of 0.
absl::Status CheckImportTarget(const std::string& save, int64_t iteration, bool with_moments);
// A Megatron export (RunConvert calls this before ExportToMegatron) into a directory that holds ptk
// checkpoints (a training run's --save, or --load-dir itself) would replace one of them and move its
// latest_checkpointed_iteration.txt: refused, a usage error naming a ptk file found there.
absl::Status CheckMegatronExportTarget(const std::string& save);

// The directions on their own.
absl::StatusOr<ConvertSummary> ExportToHf(const ConvertOptions& options);
absl::StatusOr<ConvertSummary> ImportFromHf(const ConvertOptions& options);

// Fault injection for tests: ExportToHf calls the hook before each step of writing and publishing
// an export, by name ("write config.json", "write model-00001-of-00003.safetensors" (a sharded export's
// shards, then "write model.safetensors.index.json"), "exchange directories", "rename old export aside",
// "rename new export in", "remove old export", ...); a non-OK status fails the export there as an
// I/O error would (Unimplemented at "exchange directories": as a filesystem without
// RENAME_EXCHANGE, the two renames follow), and a hook may end the process there (a kill).
// Not thread-safe; an empty function removes the hook.
using ExportStepHook = std::function<absl::Status(std::string_view step)>;
void SetExportStepHookForTesting(ExportStepHook hook);

}  // namespace ptk
