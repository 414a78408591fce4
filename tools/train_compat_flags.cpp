// ptk-train's policy for Megatron's flags that it does not implement: accepted with a note when
// they only tune speed or memory, refused with one line saying what ptk has instead when they ask
// for another model.
#include <map>
#include <utility>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/status.h"
#include "tools/train_flag_parts.h"

namespace ptk::train_flags {
namespace {

// Flags of Megatron's that change only speed or memory, never results, on the paths ptk runs.
enum class Arg { kNone, kText, kCount, kPositiveInt, kPositive, kLevel };  // kLevel: 0, 1 or 2
struct CompatFlag {
  const char* name;
  Arg arg;
  const char* note;
};
constexpr CompatFlag kCompatFlags[] = {
    {"--overlap-param-gather", Arg::kNone,
     "with --use-distributed-optimizer the parameters are all-gathered after the update, not during the next "
     "forward (same results)"},
    {"--attention-backend", Arg::kText, "attention runs through ptk's BLAS path"},
    {"--use-flash-attn", Arg::kNone, "attention runs through ptk's BLAS path"},
    {"--transformer-impl", Arg::kText, "ptk has one implementation"},
    {"--use-mcore-models", Arg::kNone, "ptk's model is Megatron-core's GPT layout"},
    {"--use-legacy-models", Arg::kNone, "ptk's model is Megatron-core's GPT layout"},
    {"--no-masked-softmax-fusion", Arg::kNone, "kernel fusion flag"},
    // With the GELU MLP it selects the exact GELU (ResolveLlamaFlags): Megatron's unfused GELU is torch's F.gelu.
    {"--no-bias-gelu-fusion", Arg::kNone,
     "the GELU MLP computes the exact erf GELU (torch's F.gelu, Megatron's unfused GELU) instead of the tanh "
     "one; no effect on the SwiGLU or squared-ReLU MLP"},
    {"--no-bias-dropout-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-gradient-accumulation-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-rope-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-async-tensor-model-parallel-allreduce", Arg::kNone, "the tensor-parallel all-reduces are synchronous"},
    {"--accumulate-allreduce-grads-in-fp32", Arg::kNone, "gradients are fp32 already"},
    {"--num-workers", Arg::kCount, "one prefetching loader thread per rank"},
    {"--ckpt-format", Arg::kText, "checkpoints are ptk's single-file format in Megatron's directory layout"},
    {"--async-save", Arg::kNone, "checkpoints are written synchronously"},
    {"--log-memory-to-tensorboard", Arg::kNone, "no memory statistics are written to TensorBoard"},
    {"--tensorboard-queue-size", Arg::kPositiveInt, "events are written at every --log-interval and evaluation"},
    {"--wandb-project", Arg::kText, "no Weights & Biases client; metrics go to metrics.jsonl"},
    {"--wandb-exp-name", Arg::kText, "no Weights & Biases client"},
    {"--manual-gc", Arg::kNone, "no garbage collector"},
    {"--use-cpu-initialization", Arg::kNone, "initialisation is on the CPU already"},
    {"--no-persist-layer-norm", Arg::kNone, "kernel choice"},
    {"--empty-unused-memory-level", Arg::kLevel, "memory tuning"},
    {"--cross-entropy-loss-fusion", Arg::kNone, "kernel fusion flag"},
    {"--ckpt-fully-parallel-load", Arg::kNone, "checkpoints are ptk's single file, read by rank 0"},
    {"--ckpt-fully-parallel-save", Arg::kNone, "checkpoints are ptk's single file, written by rank 0"},
    {"--use-persistent-ckpt-worker", Arg::kNone, "checkpoints are written synchronously"},
    {"--ckpt-assume-constant-structure", Arg::kNone, "checkpoints are ptk's single file"},
    {"--use-sharp", Arg::kNone, "NCCL's SHARP in-network reductions are left to NCCL's own settings"},
    {"--tp-comm-overlap", Arg::kNone, "the tensor-parallel collectives are not overlapped with compute"},
    {"--data-impl", Arg::kText, "ptk reads Megatron's mmap .bin/.idx format"},
    {"--profile-step-start", Arg::kCount, "--profile covers the whole run (ptk's per-op CUDA timing)"},
    {"--profile-step-end", Arg::kCount, "--profile covers the whole run (ptk's per-op CUDA timing)"},
    // --recompute-granularity full's companions (Megatron requires them with it): memory only.
    {"--recompute-method", Arg::kText,
     "ptk recomputes the attention probabilities (selective), whatever --recompute-granularity asks"},
    {"--recompute-num-layers", Arg::kPositiveInt,
     "ptk recomputes the attention probabilities (selective), whatever --recompute-granularity asks"},
    {"--distribute-saved-activations", Arg::kNone, "activations are not split over the tensor ranks (memory only)"},
    // More of the flags Megatron's own Llama and GPT example scripts carry (speed, memory, logging).
    {"--no-create-attention-mask-in-dataloader", Arg::kNone, "the causal mask is implicit: the loader builds none"},
    {"--no-mmap-bin-files", Arg::kNone, "the .bin files are read through mmap (the same tokens)"},
    {"--no-bias-swiglu-fusion", Arg::kNone, "kernel fusion flag"},
    {"--manual-gc-interval", Arg::kCount, "no garbage collector"},
    {"--num-dataset-builder-threads", Arg::kPositiveInt, "the dataset indices are built with ptk's own threads"},
    {"--log-progress", Arg::kNone, "no progress.txt is written; the log line and metrics.jsonl have the figures"},
    // Model flags that name what ptk's model does already, or that Megatron ignores here.
    // megatron-core's GPT does not read it (core_transformer_config_from_args): its GELU MLP is the fused kernel's
    // tanh GELU, or F.gelu's exact one without the fusion (--no-bias-gelu-fusion, --disable-bias-linear), as ptk's.
    {"--openai-gelu", Arg::kNone,
     "megatron-core's GPT does not read it: the GELU MLP is the tanh GELU (the fused bias-GELU kernel's, as "
     "--openai-gelu's), or the exact one with --no-bias-gelu-fusion or --disable-bias-linear"},
    {"--attention-softmax-in-fp32", Arg::kNone, "the attention softmax is computed in fp32 already"},
    // The Neuron tutorial's pretrain_gpt.py line (its Megatron fork, seed-pipelines.md section 4): the local
    // DDP's gradient buffer layout, memory only.
    {"--no-contiguous-buffers-in-local-ddp", Arg::kNone,
     "the gradients are reduced from ptk's own buffers (memory layout only)"},
    {"--apply-query-key-layer-scaling", Arg::kNone,
     "it only keeps fp16 attention scores from overflowing in Megatron's unfused softmax"},
};

// Megatron's flags for models other than GPT-3's (the Llama, Qwen and Mixtral lines): accepted by the
// parser only to be refused with what ptk's model has instead (a bare "unknown flag" leaves a
// Megatron user guessing whether it was a typo).
struct ModelRefusal {
  const char* name;
  bool takes_value;
  const char* why;
  bool other_model = true;  // false: not a model flag (the line then says no more than `why`)
};
constexpr ModelRefusal kModelRefusals[] = {
    {"--apply-residual-connection-post-layernorm", false,
     "the residual is taken before LayerNorm in ptk's model (pre-LN, Megatron's default)"},
    {"--fp8-format", true, "fp8 training is not implemented; use --bf16 or --fp16 on a GPU"},
    {"--tokenizer-model", true,
     "ptk-train reads GPT-2 BPE data (--tokenizer-type GPT2BPETokenizer, --vocab-file); a SentencePiece or "
     "tiktoken model is not used"},
    // Megatron's checkpoint contents: an unknown flag, with "did you mean --no-load-optim?" (the other end).
    {"--no-save-optim", false,
     "the optimizer state is always saved (a resume is bit for bit); drop the flag (--no-load-optim leaves it "
     "out when loading)",
     false},
    {"--no-save-rng", false,
     "the random state is always saved (a resume is bit for bit); drop the flag (--no-load-rng leaves it out when "
     "loading)",
     false},
    // The Neuron tutorial's Megatron fork (torch-xla on Trainium): its serialized checkpoints.
    {"--save-xser", true,
     "Neuron's torch-xla serialized checkpoints are not written; give --save DIR (Megatron's checkpoint "
     "layout, resumed with --load DIR)",
     false},
    {"--load-xser", true,
     "Neuron's torch-xla serialized checkpoints are not read; give --load DIR of a checkpoint ptk-train saved "
     "(ptk-convert --loader megatron imports Megatron's)",
     false},
};

}  // namespace

void AddModelRefusalFlags(CLI::App* app, TrainFlags* f) {
  for (const ModelRefusal& r : kModelRefusals) {
    const std::string name = r.name;
    CLI::Option* opt = r.takes_value ? app->add_option_function<std::string>(
                                           name, [f, name](const std::string& v) { f->refused[name] = v; })
                                     : app->add_flag_callback(name, [f, name] { f->refused[name] = ""; });
    opt->description(std::string("Not supported: ") + r.why)->group(cli::kUnsupportedGroup);
  }
}

void AddCompatFlags(CLI::App* app, TrainFlags* f) {
  for (const CompatFlag& c : kCompatFlags) {
    std::string name = c.name;
    std::string help = std::string("Accepted for compatibility: ") + c.note;
    if (c.arg != Arg::kNone) {
      CLI::Option* opt = app->add_option_function<std::string>(
          name, [f, name](const std::string& v) { f->compat[name] = v; }, help);
      if (c.arg == Arg::kCount) opt->check(IntIn(0, kMaxSize));
      if (c.arg == Arg::kPositiveInt) opt->check(IntIn(1, kMaxSize));
      if (c.arg == Arg::kPositive) opt->check(Positive());
      if (c.arg == Arg::kLevel) opt->check(IntIn(0, 2));
    } else {
      app->add_flag_callback(
          name, [f, name] { f->compat[name] = ""; }, help);
    }
  }
}

absl::Status RefuseOtherModel(const TrainFlags& f) {
  // Another model than ptk's (or a checkpoint format it does not have): every such flag given, the first
  // with its reason.
  std::vector<std::pair<std::string, std::string>> other;
  bool first_is_model = true;
  for (const ModelRefusal& r : kModelRefusals)
    if (auto it = f.refused.find(r.name); it != f.refused.end()) {
      if (other.empty()) first_is_model = r.other_model;
      other.emplace_back(it->second.empty() ? it->first : it->first + " " + it->second, r.why);
    }
  for (const auto& [name, value] : f.refused)  // the rest of Megatron's flags refused (train_megatron_table.cpp)
    if (const char* why = MegatronTableReason(name, true)) {
      if (other.empty()) first_is_model = false;
      other.emplace_back(value.empty() ? name : name + " " + value, why);
    }
  if (other.empty()) return absl::OkStatus();
  std::string also;
  for (size_t i = 1; i < other.size(); ++i) also += (i > 1 ? ", " : "") + other[i].first;
  if (!also.empty()) also = "; also not implemented here: " + also;
  if (!first_is_model) return UsageError(fmt::format("{}: {}{}", other[0].first, other[0].second, also));
  return UsageError(
      fmt::format("{}: {}. ptk-train trains Megatron's GPT-3-style GPT and the Llama line (RMSNorm, RoPE, SwiGLU, "
                  "grouped-query attention, no biases){}",
                  other[0].first, other[0].second, also));
}

void NoteCompatFlags(const TrainFlags& f, std::vector<std::string>* notes) {
  for (const auto& [name, value] : f.compat) {
    const char* note = MegatronTableReason(name, false);
    for (const CompatFlag& c : kCompatFlags)
      if (name == c.name) note = c.note;
    if (note != nullptr)
      notes->push_back(fmt::format("{}{}: accepted, {}", name, value.empty() ? "" : " " + value, note));
  }
}

}  // namespace ptk::train_flags
