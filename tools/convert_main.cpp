// ptk-convert: ptk checkpoints <-> Hugging Face GPT-2 directories and Megatron checkpoints (its
// torch format), with the flags of Megatron's tools/checkpoint/convert.py (--model-type, --loader,
// --saver, --load-dir, --save-dir, --target-tensor/pipeline-parallel-size).
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/human_format.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/status.h"
#include "interop/hf_gpt2.h"

namespace {

// Megatron's convert.py flags (and its Megatron loader's) that ptk needs no value of: accepted, so that
// the lines users copy run.
struct CompatFlags {
  int64_t max_queue_size = 50;
  std::string megatron_path, loader_transformer_impl;
  bool no_checking = false;
};

void AddCompatFlags(CLI::App& app, CompatFlags* c) {
  app.add_option("--max-queue-size", c->max_queue_size, "Accepted for compatibility (no queue: one process)")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 31));
  // More of convert.py's and its Megatron loader's and saver's flags, in the lines users copy: they were
  // unknown flags here.
  app.add_option("--megatron-path", c->megatron_path,
                 "Accepted for compatibility (ptk reads and writes Megatron's files itself: no Megatron-LM needed)");
  app.add_flag("--no-checking", c->no_checking,
               "Accepted for compatibility (convert.py's queue checks; no queue here)");
  app.add_option("--loader-transformer-impl", c->loader_transformer_impl,
                 "Accepted for compatibility: --loader megatron tells Transformer Engine and local layer names "
                 "apart itself")
      ->check(CLI::IsMember({"transformer_engine", "local"}));
}

// --saver megatron's flags: the layout and optimizer of the Megatron run to write.
void AddSaverFlags(CLI::App& app, ptk::ConvertOptions* o) {
  app.add_option("--target-tensor-parallel-size", o->target_tensor_parallel_size,
                 "--saver megatron: the tensor-parallel size to split into (1); other savers: must be 1")
      ->check(ptk::cli::IntIn(1, 1024));
  app.add_option("--target-pipeline-parallel-size", o->target_pipeline_parallel_size,
                 "--saver megatron: the pipeline-parallel size to split into (1); other savers: must be 1")
      ->check(ptk::cli::IntIn(1, 1024));
  app.add_option("--target-num-layers-per-virtual-pipeline-stage", o->target_num_layers_per_virtual_pipeline_stage,
                 "--saver megatron: write an interleaved run's model chunks (model0, model1, ...) of this many "
                 "layers each, as Megatron's --num-layers-per-virtual-pipeline-stage (default: no chunks)")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 20));
  app.add_option("--saver-transformer-impl", o->saver_transformer_impl,
                 "--saver megatron: the layer names Megatron's model has: transformer_engine (its default: "
                 "linear_qkv.layer_norm_weight ...) or local (input_layernorm.weight ...)")
      ->check(CLI::IsMember({"transformer_engine", "local"}));
  app.add_flag("--target-use-distributed-optimizer", o->target_use_distributed_optimizer,
               "--saver megatron: write what Megatron's --use-distributed-optimizer loads (each rank's "
               "distrib_optim.pt with the fp32 params and AdamW moments, the param groups in model_optim_rng.pt)");
  app.add_option("--target-ddp-bucket-size", o->target_ddp_bucket_size,
                 "With --target-use-distributed-optimizer: the Megatron run's --ddp-bucket-size under "
                 "--overlap-grad-reduce (its default: 40000000), which sets where distrib_optim.pt holds each "
                 "parameter (default: no --overlap-grad-reduce, one bucket)")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 40));
}

// A flag that only one direction reads was ignored in the others, exit 0 (--vocab-file naming no file
// with --loader megatron; --force with --saver ptk, which never replaces a directory whole): refused, as
// convert.py refuses a flag its loader and saver do not add.
absl::Status CheckFlagsApply(const CLI::App& app, const ptk::ConvertOptions& o) {
  // An empty one was the current directory: --saver megatron --save-dir "" wrote iter_N/ there, exit 0.
  for (const auto& [flag, dir] :
       {std::pair<const char*, const std::string&>{"--load-dir", o.load_dir}, {"--save-dir", o.save_dir}})
    if (dir.empty()) return ptk::UsageError(fmt::format("{} is empty: give a directory (. for this one)", flag));
  const bool to_hf = o.loader == "ptk" && o.saver == "hf";
  const struct {
    const char* flag;
    bool applies;
    const char* reader;
  } scopes[] = {{"--vocab-file", to_hf, "--loader ptk --saver hf"},
                {"--merge-file", to_hf, "--loader ptk --saver hf"},
                {"--force", to_hf, "--loader ptk --saver hf"},
                {"--saver-transformer-impl", o.saver == "megatron", "--saver megatron"}};
  for (const auto& s : scopes)
    if (app.count(s.flag) > 0 && !s.applies)
      return ptk::UsageError(
          fmt::format("{}: only {} reads it; this is --loader {} --saver {}", s.flag, s.reader, o.loader, o.saver));
  return absl::OkStatus();
}

// The flags that belong to one direction, refused in another.
absl::Status CheckDirectionFlags(const ptk::ConvertOptions& o, bool max_shard_size_given) {
  if (o.saver != "megatron" && (o.target_tensor_parallel_size != 1 || o.target_pipeline_parallel_size != 1))
    return ptk::UsageError(fmt::format(
        "--target-tensor-parallel-size {} --target-pipeline-parallel-size {}: only --saver megatron splits a "
        "checkpoint ({} output is whole)",
        o.target_tensor_parallel_size, o.target_pipeline_parallel_size, o.saver));
  if (o.saver != "megatron" && o.target_num_layers_per_virtual_pipeline_stage != 0)
    return ptk::UsageError(fmt::format(
        "--target-num-layers-per-virtual-pipeline-stage {}: only --saver megatron writes model chunks ({} output "
        "is whole)",
        o.target_num_layers_per_virtual_pipeline_stage, o.saver));
  if (o.saver != "megatron" && (o.target_use_distributed_optimizer || o.target_ddp_bucket_size != 0))
    return ptk::UsageError(fmt::format(
        "--target-use-distributed-optimizer, --target-ddp-bucket-size: only --saver megatron writes an optimizer's "
        "state as Megatron's ({} output)",
        o.saver));
  if (max_shard_size_given && !(o.loader == "ptk" && o.saver == "hf"))
    return ptk::UsageError(fmt::format(
        "--max-shard-size {}: only a Hugging Face export (--loader ptk --saver hf) writes shards", o.max_shard_size));
  if ((o.iteration != 0 || o.global_batch_size != 0 || o.consumed_train_samples >= 0) &&
      !(o.loader == "hf" && o.saver == "ptk"))
    return ptk::UsageError(
        "--iteration, --global-batch-size and --consumed-train-samples place a Hugging Face import (--loader hf "
        "--saver ptk); other checkpoints carry their own iteration");
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp(
      "ptk-convert",
      "Convert a ptk checkpoint to a Hugging Face GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE or Qwen2-MoE directory "
      "(--loader ptk "
      "--saver hf) or a Megatron checkpoint "
      "in its torch format (--saver megatron), or back (--loader hf / megatron --saver ptk).");
  ptk::ConvertOptions o;
  std::string model_type = "GPT";
  app->add_option("--model-type", model_type, "GPT (the only model ptk has)")->check(CLI::IsMember({"GPT"}));
  app->add_option("--loader", o.loader,
                  "What --load-dir holds: ptk (a ptk-train --save directory), hf, or megatron (a Megatron --save "
                  "directory in --ckpt-format torch, any tensor/pipeline-parallel sizes, or torch_dist)")
      ->required()
      ->check(CLI::IsMember({"ptk", "hf", "megatron"}));
  app->add_option("--saver", o.saver, "What to write to --save-dir: hf, megatron or ptk")
      ->required()
      ->check(CLI::IsMember({"hf", "ptk", "megatron"}));
  app->add_option("--load-dir", o.load_dir, "The checkpoint directory (its latest iteration) or HF directory to read")
      ->required();
  app->add_option("--save-dir", o.save_dir, "The HF directory or ptk checkpoint directory to write")->required();
  app->add_option("--true-vocab-size", o.true_vocab_size,
                  "ptk -> hf/megatron: the tokenizer's vocabulary size (default: the one the training run recorded); "
                  "megatron -> ptk: default args.vocab_size, or 50257 for GPT2BPETokenizer")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 31));
  app->add_option("--vocab-file", o.vocab_file, "ptk -> hf: the vocab.json to ship (default: ptk's GPT-2 file)");
  app->add_option("--merge-file", o.merge_file, "ptk -> hf: the merges.txt to ship (default: ptk's GPT-2 file)");
  auto* max_shard = app->add_option(
      "--max-shard-size", o.max_shard_size,
      "ptk -> hf: the largest weights file, as save_pretrained's max_shard_size (5GB; KB, MB, GB, TB are decimal: "
      "1GB = 10^9 bytes; or a byte count): larger weights are written as model-0000K-of-0000N.safetensors "
      "shards with model.safetensors.index.json, a tensor larger than this alone in its shard");
  app->add_flag("--force", o.force,
                "ptk -> hf: replace a --save-dir that holds files an export does not write (they are removed)");
  app->add_option("--make-vocab-size-divisible-by", o.make_vocab_size_divisible_by,
                  "hf -> ptk: pad the vocabulary to a multiple of this, as ptk-train will; ptk -> megatron: the value "
                  "the run was trained with (Megatron pads to a multiple of it x tensor-parallel size) (128)")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 31));
  AddSaverFlags(*app, &o);
  app->add_option("--iteration", o.iteration,
                  "hf -> ptk: the iteration the import stands at (0: a start for ptk-train --finetune); with "
                  "--global-batch-size or --consumed-train-samples, ptk-train --load resumes at the next one with "
                  "that data position and learning-rate schedule (the AdamW moments start at zero)")
      ->check(ptk::cli::IntIn(0, int64_t{1} << 40));
  app->add_option("--global-batch-size", o.global_batch_size,
                  "hf -> ptk with --iteration N: the run's global batch size (N x it samples consumed)")
      ->check(ptk::cli::IntIn(1, int64_t{1} << 31));
  app->add_option("--consumed-train-samples", o.consumed_train_samples,
                  "hf -> ptk with --iteration N: the samples the run had consumed (with batch ramp-up)")
      ->check(ptk::cli::IntIn(0, int64_t{1} << 50));
  bool quiet = false;
  app->add_flag("--quiet", quiet, "No progress output");
  ptk::cli::AddLockWait(*app, &o.lock_wait);
  CompatFlags compat;
  AddCompatFlags(*app, &compat);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(CheckDirectionFlags(o, max_shard->count() > 0));
    PTK_RETURN_IF_ERROR(CheckFlagsApply(*app, o));
    ptk::JsonWriter args;
    args.BeginArray();
    for (int i = 1; i < argc; ++i) args.Value(argv[i]);
    o.args_json = args.EndArray().str();
    o.progress = !quiet;
    const auto start = std::chrono::steady_clock::now();
    PTK_ASSIGN_OR_RETURN(ptk::ConvertSummary s, ptk::RunConvert(o));
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const std::string& n : s.notes) ptk::log::Info("note: {}", n);
    const auto& c = s.config;
    // A mixture of experts' MLP is its experts (the dense width is then unused where every layer is MoE).
    const std::string mlp =
        c.moe() ? fmt::format("{} experts of ffn {} (top {})", c.num_experts, c.moe_ffn(), c.moe_router_topk)
                : fmt::format("ffn {}", c.ffn_hidden_size);
    ptk::log::Info(
        "converted {} (iteration {}) -> {}: {} layers, hidden {}, {} heads, {}, {} positions, vocabulary {}{}, "
        "{} parameters, in {}",
        s.source, s.iteration, s.destination, c.num_layers, c.hidden_size, c.num_attention_heads, mlp,
        c.max_position_embeddings, c.vocab_size, c.untie_embeddings_and_output_weights ? ", untied output layer" : "",
        s.num_params, ptk::HumanDuration(took));
    if (!s.train_flags.empty() && (o.loader == "megatron" || o.iteration > 0))
      ptk::log::Info("resume training with: ptk-train {} --load {} ... (the batch and schedule flags of the {} run)",
                     s.train_flags, o.save_dir, o.loader == "megatron" ? "Megatron" : "original (--seq-length too)");
    else if (!s.train_flags.empty())
      ptk::log::Info("continue training with: ptk-train {} --seq-length N (N <= {}) --load {} --finetune ...",
                     s.train_flags, c.max_position_embeddings, o.save_dir);
    return absl::OkStatus();
  });
}
