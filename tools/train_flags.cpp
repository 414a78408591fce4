// ptk-train's Megatron-compatible option table and its resolution into TrainOptions.
#include "tools/train_flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/cli.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"
#include "trainer/backend.h"
#include "trainer/checkpoint.h"
#include "trainer/parallel_layout.h"

namespace ptk {
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
    {"--no-bias-gelu-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-bias-dropout-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-gradient-accumulation-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-rope-fusion", Arg::kNone, "kernel fusion flag"},
    {"--no-async-tensor-model-parallel-allreduce", Arg::kNone, "the tensor-parallel all-reduces are synchronous"},
    {"--accumulate-allreduce-grads-in-fp32", Arg::kNone, "gradients are fp32 already"},
    {"--num-workers", Arg::kCount, "one prefetching loader thread per rank"},
    {"--ckpt-format", Arg::kText, "checkpoints are ptk's single-file format in Megatron's directory layout"},
    {"--async-save", Arg::kNone, "checkpoints are written synchronously"},
    {"--log-throughput", Arg::kNone,
     "the throughput field is always printed (and written to TensorBoard with --log-timers-to-tensorboard)"},
    {"--log-memory-to-tensorboard", Arg::kNone, "no memory statistics are written to TensorBoard"},
    {"--tensorboard-queue-size", Arg::kPositiveInt, "events are written at every --log-interval and evaluation"},
    {"--timing-log-level", Arg::kLevel, "timers are not itemised"},
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
    // Model flags that name what ptk's model does already, or that Megatron ignores here.
    {"--openai-gelu", Arg::kNone, "ptk's GELU is this tanh approximation already"},
    {"--attention-softmax-in-fp32", Arg::kNone, "the attention softmax is computed in fp32 already"},
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
};
constexpr ModelRefusal kModelRefusals[] = {
    {"--rotary-interleaved", false,
     "the interleaved rotary layout (pairs of adjacent channels) is not implemented; ptk rotates Megatron's default "
     "halves (channel i with i + d/2), as Llama's Hugging Face checkpoints do"},
    {"--rotary-seq-len-interpolation-factor", true,
     "rotary position interpolation is not implemented; Llama 3.1's scaling is --use-rope-scaling"},
    {"--rope-scaling-factor", true, "--use-rope-scaling has Llama 3.1's factor 8 only"},
    {"--squared-relu", false, "the squared-ReLU activation is not implemented; ptk's MLP uses GELU"},
    {"--qk-layernorm", false, "LayerNorm on queries and keys is not implemented"},
    {"--apply-layernorm-1p", false, "LayerNorm with a zero-centred gamma is not implemented"},
    {"--apply-residual-connection-post-layernorm", false,
     "the residual is taken before LayerNorm in ptk's model (pre-LN, Megatron's default)"},
    {"--multi-latent-attention", false, "multi-latent attention is not implemented"},
    {"--num-experts", true, "mixture of experts is not implemented; ptk's MLP is dense"},
    {"--moe-router-topk", true, "mixture of experts is not implemented; ptk's MLP is dense"},
    {"--init-method-xavier-uniform", false, "ptk initialises as Megatron's default, N(0, --init-method-std)"},
    {"--fp8-format", true, "fp8 training is not implemented; use --bf16 or --fp16 on a GPU"},
    {"--num-layers-per-virtual-pipeline-stage", true, "ptk-train is data parallel only (no pipeline)"},
    {"--tokenizer-model", true,
     "ptk-train reads GPT-2 BPE data (--tokenizer-type GPT2BPETokenizer, --vocab-file); a SentencePiece or "
     "tiktoken model is not used"},
};

absl::Status Refuse(const std::string& msg) { return UsageError(msg); }

// GPTConfig::Validate names the model's settings as Megatron's arguments are named (hidden_size);
// ptk-train names each as the flag that sets it (--hidden-size).
std::string SettingsAsFlags(std::string msg) {
  static constexpr const char* kSettings[] = {"num_layers",        "hidden_size",     "num_attention_heads",
                                              "ffn_hidden_size",   "seq_length",      "max_position_embeddings",
                                              "vocab_size",        "hidden_dropout",  "attention_dropout",
                                              "layernorm_epsilon", "init_method_std", "num_query_groups",
                                              "kv_channels",       "rotary_base",     "rotary_percent"};
  auto is_word = [](char c) { return (c >= 'a' && c <= 'z') || c == '_' || c == '-'; };
  for (const std::string setting : kSettings) {
    std::string flag = "--" + setting;
    std::replace(flag.begin() + 2, flag.end(), '_', '-');
    for (size_t at = msg.find(setting); at != std::string::npos; at = msg.find(setting, at + 1)) {
      const size_t end = at + setting.size();
      if ((at > 0 && is_word(msg[at - 1])) || (end < msg.size() && is_word(msg[end]))) continue;
      msg.replace(at, setting.size(), flag);
    }
  }
  return msg;
}

// Range checks, attached where each flag is declared (CLI11 runs them on the text before
// converting it): a value outside the range, or not a number, is a usage error naming the flag.
// Sizes and counts are capped where products of them would overflow 64-bit integers.
constexpr int64_t kMaxSize = (int64_t{1} << 31) - 1;  // a dimension, a vocabulary, a batch
constexpr int64_t kMaxCount = int64_t{1} << 40;       // iterations, samples

std::string Shown(const std::string& in) { return fmt::format("{:?}", in.size() > 40 ? in.substr(0, 40) + "..." : in); }

CLI::Validator IntIn(int64_t lo, int64_t hi) {
  const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(in.c_str(), &end, 10);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || v < lo || v > hi)
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
}

// A finite number in the range from lo to hi, each end open or closed.
CLI::Validator RealIn(double lo, bool lo_open, double hi, bool hi_open) {
  std::string range;
  if (std::isinf(hi)) {
    range = fmt::format("a finite number {} {}", lo_open ? ">" : ">=", lo);
  } else {
    range = fmt::format("a number in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || !std::isfinite(v) ||
            (lo_open ? v <= lo : v < lo) || (hi_open ? v >= hi : v > hi))
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
}

constexpr double kInf = std::numeric_limits<double>::infinity();
const CLI::Validator& Positive() {
  static const CLI::Validator v = RealIn(0, true, kInf, false);
  return v;
}
const CLI::Validator& NonNegative() {
  static const CLI::Validator v = RealIn(0, false, kInf, false);
  return v;
}
const CLI::Validator& Probability() {  // dropout: [0, 1)
  static const CLI::Validator v = RealIn(0, false, 1, true);
  return v;
}

// The model's flags --use-checkpoint-args takes from the checkpoint (Megatron's
// load_args_from_checkpoint), as the checkpoint's settings name them.
constexpr const char* kCheckpointModelFlags[] = {
    "--num-layers",      "--hidden-size",       "--num-attention-heads",
    "--ffn-hidden-size", "--seq-length",        "--max-position-embeddings",
    "--vocab-size",      "--layernorm-epsilon", "--untie-embeddings-and-output-weights",
    "--hidden-dropout",  "--attention-dropout",
};

// The flags of Megatron's logging, batch ramp, data files and profiling, and --help's required
// flags shown without a default.
void AddMoreTrainFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  app->add_flag("--log-params-norm", o.log_params_norm,
                "Log the L2 norm of the weights (log line 'params norm:', TensorBoard params-norm)");
  app->add_flag("--log-num-zeros-in-grad", o.log_num_zeros_in_grad,
                "Log the number of zeros among the gradients (log line 'num zeros:', TensorBoard num-zeros)");
  app->add_option("--rampup-batch-size", o.rampup_batch_size,
                  "START INCR SAMPLES: grow the global batch from START by INCR up to --global-batch-size over "
                  "SAMPLES samples (Megatron's ramp; with --train-samples)")
      ->expected(3)
      ->check(IntIn(1, kMaxCount))
      ->default_str("");
  app->add_flag_callback(
         "--use-checkpoint-args",
         [app, f] {
           f->use_checkpoint_args = true;
           // The model's shape comes from --load's checkpoint: its flags are no longer required
           // (callbacks run before CLI11 checks the required options).
           for (const char* name : kCheckpointModelFlags) app->get_option(name)->required(false);
         },
         "Take the model's flags from --load's latest checkpoint (a flag given with another value is refused)")
      ->trigger_on_parse();
  app->add_option("--data-args-path", f->data_args_path,
                  "A file holding the --data-path arguments ([W1] P1 [W2] P2 ..., whitespace-separated)");
  app->add_option("--per-split-data-args-path", f->per_split_data_args_path,
                  "A JSON file {\"train\": [...], \"valid\": [...], \"test\": [...]} of per-split data paths");
  app->add_flag("--profile", f->profile,
                "Profile the run: ptk's per-op CUDA timing, printed at the end (as --ptk-profile-ops)");
  // A required flag's help says REQUIRED, with no default that does not exist (the value the
  // variable happens to hold before parsing).
  for (CLI::Option* opt : app->get_options())
    if (opt->get_required()) opt->default_str("");
}

// Megatron's get_blend_from_list over a file's whitespace-separated words (--data-args-path).
absl::StatusOr<std::vector<std::string>> ReadDataArgs(const std::string& path, const char* flag) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<std::string> words;
  size_t pos = 0;
  while (true) {
    pos = text.find_first_not_of(" \t\r\n\f\v", pos);
    if (pos == std::string::npos) break;
    const size_t end = text.find_first_of(" \t\r\n\f\v", pos);
    words.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  if (words.empty()) return UsageError(fmt::format("{} {}: the file names no dataset", flag, path));
  return words;
}

absl::Status ReadPerSplitDataArgs(const std::string& path, DataArgs* data) {
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (auto err = p.load(path).get(obj))
    return UsageError(
        fmt::format("--per-split-data-args-path {}: not a JSON object ({})", path, simdjson::error_message(err)));
  const char* keys[] = {"train", "valid", "test"};
  for (int i = 0; i < 3; ++i) {
    simdjson::dom::element e;
    if (obj[keys[i]].get(e)) continue;
    std::string_view text;
    if (!e.get(text)) {  // a string: its whitespace-separated words, as Megatron splits it
      size_t pos = 0;
      while ((pos = text.find_first_not_of(" \t\r\n", pos)) != std::string_view::npos) {
        const size_t end = std::min(text.find_first_of(" \t\r\n", pos), text.size());
        data->per_split_data_path[i].emplace_back(text.substr(pos, end - pos));
        pos = end;
      }
      continue;
    }
    simdjson::dom::array arr;
    if (e.get(arr))
      return UsageError(
          fmt::format("--per-split-data-args-path {}: \"{}\" must be a string or a list of strings", path, keys[i]));
    for (simdjson::dom::element w : arr) {
      std::string_view v;
      if (w.get(v))
        return UsageError(
            fmt::format("--per-split-data-args-path {}: \"{}\" must be a string or a list of strings", path, keys[i]));
      data->per_split_data_path[i].emplace_back(v);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyCheckpointArgs(const CLI::App& app, TrainFlags* f, std::vector<std::string>* notes) {
  if (!f->use_checkpoint_args) return absl::OkStatus();
  const std::string& load = f->options.load;
  if (load.empty()) return UsageError("--use-checkpoint-args needs --load (the checkpoint to take the model from)");
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(load);
  if (absl::IsNotFound(latest.status()))
    return UsageError(
        fmt::format("--use-checkpoint-args: no checkpoint in --load {} ({})", load, StatusMessage(latest.status())));
  PTK_RETURN_IF_ERROR(latest.status());
  PTK_ASSIGN_OR_RETURN(const auto saved, ReadCheckpointSettings(load, *latest));
  const std::map<std::string, std::string> ckpt(saved.begin(), saved.end());
  GPTConfig& m = f->options.model;
  std::vector<std::string> missing;
  for (const char* name : kCheckpointModelFlags) {
    const CLI::Option* opt = app.get_option(name);
    auto it = ckpt.find(name);
    if (it == ckpt.end()) {
      if (opt->get_required() || opt->count() == 0) missing.push_back(name);
      continue;
    }
    const std::string& value = it->second;
    const std::string flag = name;
    const bool on = value == "on";
    if (opt->count() > 0) {  // given: must agree with the checkpoint
      std::string mine;
      if (flag == "--untie-embeddings-and-output-weights") {
        mine = m.untie_embeddings_and_output_weights ? "on" : "off";
      } else {
        mine = opt->as<std::string>();
        // The same number written otherwise (1e-5, 0.00001) is no conflict.
        char* end = nullptr;
        const double a = std::strtod(mine.c_str(), &end), b = std::strtod(value.c_str(), nullptr);
        if (end != mine.c_str() && *end == '\0' && a == b) mine = value;
      }
      if (mine != value)
        return UsageError(fmt::format(
            "--use-checkpoint-args: {} {} differs from the checkpoint's {} {} (iteration {} in {}): drop the flag "
            "to take the checkpoint's, or drop --use-checkpoint-args",
            flag, mine, flag, value, *latest, load));
      continue;
    }
    auto as_int = [&](int64_t* out) -> absl::Status {
      char* end = nullptr;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || v < 1)
        return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, flag, value));
      *out = v;
      return absl::OkStatus();
    };
    auto as_real = [&](double* out) -> absl::Status {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(v))
        return absl::DataLossError(fmt::format("{}: checkpoint records {} {:?}", load, flag, value));
      *out = v;
      return absl::OkStatus();
    };
    if (flag == "--num-layers") PTK_RETURN_IF_ERROR(as_int(&m.num_layers));
    if (flag == "--hidden-size") PTK_RETURN_IF_ERROR(as_int(&m.hidden_size));
    if (flag == "--num-attention-heads") PTK_RETURN_IF_ERROR(as_int(&m.num_attention_heads));
    if (flag == "--ffn-hidden-size") PTK_RETURN_IF_ERROR(as_int(&m.ffn_hidden_size));
    if (flag == "--seq-length") PTK_RETURN_IF_ERROR(as_int(&m.seq_length));
    if (flag == "--max-position-embeddings") PTK_RETURN_IF_ERROR(as_int(&m.max_position_embeddings));
    if (flag == "--vocab-size") PTK_RETURN_IF_ERROR(as_int(&m.vocab_size));
    if (flag == "--layernorm-epsilon") PTK_RETURN_IF_ERROR(as_real(&m.layernorm_epsilon));
    if (flag == "--hidden-dropout") PTK_RETURN_IF_ERROR(as_real(&m.hidden_dropout));
    if (flag == "--attention-dropout") PTK_RETURN_IF_ERROR(as_real(&m.attention_dropout));
    if (flag == "--untie-embeddings-and-output-weights") m.untie_embeddings_and_output_weights = on;
    notes->push_back(
        fmt::format("--use-checkpoint-args: {} {} from the checkpoint of iteration {}", flag, value, *latest));
  }
  for (const std::string& name : missing)
    if (app.get_option(name)->count() == 0 && (name == "--num-layers" || name == "--hidden-size" ||
                                               name == "--num-attention-heads" || name == "--seq-length"))
      return UsageError(
          fmt::format("--use-checkpoint-args: the checkpoint of iteration {} in {} does not record {}: "
                      "give it",
                      *latest, load, name));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Gpt2VocabSize(const std::string& vocab_file) {
  if (vocab_file.empty()) return 50257;
  if (!PathExists(vocab_file)) return absl::NotFoundError(vocab_file + ": --vocab-file does not exist");
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (p.load(vocab_file).get(obj))
    return absl::InvalidArgumentError(vocab_file + ": not a JSON object (GPT-2 vocab.json)");
  return static_cast<int64_t>(obj.size());
}

void AddTrainFlags(CLI::App* app, TrainFlags* f) {
  TrainOptions& o = f->options;
  GPTConfig& m = o.model;
  // As argparse: a flag given twice takes the last value (scripts append overrides).
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Model.
  app->add_option("--num-layers", m.num_layers, "Number of transformer layers")->required()->check(IntIn(1, kMaxSize));
  app->add_option("--hidden-size", m.hidden_size, "Transformer hidden size")->required()->check(IntIn(1, kMaxSize));
  app->add_option("--num-attention-heads", m.num_attention_heads, "Number of attention heads")
      ->required()
      ->check(IntIn(1, kMaxSize));
  app->add_option("--ffn-hidden-size", m.ffn_hidden_size, "MLP hidden size (default 4 x --hidden-size)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--kv-channels", f->kv_channels, "Head dimension (default --hidden-size / --num-attention-heads)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--seq-length", m.seq_length, "Sequence length")->required()->check(IntIn(1, kMaxSize));
  app->add_option("--max-position-embeddings", m.max_position_embeddings, "Position table size (default --seq-length)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--make-vocab-size-divisible-by", f->make_vocab_size_divisible_by,
                  "Pad the vocabulary to a multiple of this")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--vocab-size", m.vocab_size, "Vocabulary size (default: from --vocab-file, 50257 for GPT-2)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--layernorm-epsilon,--norm-epsilon", m.layernorm_epsilon, "LayerNorm epsilon")->check(Positive());
  app->add_option("--hidden-dropout", m.hidden_dropout, "Dropout on embeddings and block outputs")
      ->check(Probability());
  app->add_option("--attention-dropout", m.attention_dropout, "Dropout on attention probabilities")
      ->check(Probability());
  app->add_option("--init-method-std", m.init_method_std, "Standard deviation of the normal init")->check(Positive());
  app->add_flag("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights,
                "Separate output layer instead of the word embeddings");
  app->add_flag("--recompute-activations", m.recompute_activations,
                "Recompute attention probabilities in backward (selective)");
  app->add_option("--recompute-granularity", f->recompute_granularity,
                  "selective (as --recompute-activations) or full");
  AddLlamaFlags(app, f);
  for (const ModelRefusal& r : kModelRefusals) {
    const std::string name = r.name;
    CLI::Option* opt = r.takes_value ? app->add_option_function<std::string>(
                                           name, [f, name](const std::string& v) { f->refused[name] = v; })
                                     : app->add_flag_callback(name, [f, name] { f->refused[name] = ""; });
    opt->description(std::string("Not supported: ") + r.why)->group(cli::kUnsupportedGroup);
  }
  // Batch and length.
  app->add_option("--micro-batch-size", o.micro_batch_size, "Samples per micro-batch per rank")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--global-batch-size", o.global_batch_size,
                  "Samples per iteration over all ranks (default mbs x ranks)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--train-iters", o.train_iters, "Iterations to train")->check(IntIn(1, kMaxCount));
  app->add_option("--train-samples", o.train_samples, "Samples to train (instead of --train-iters)")
      ->check(IntIn(1, kMaxCount));
  // Optimizer and schedule.
  app->add_option("--optimizer", f->optimizer, "adam (AdamW, the only one ptk has)");
  app->add_option("--lr", o.schedule.max_lr, "Peak learning rate")->required()->check(NonNegative());
  app->add_option("--min-lr", o.schedule.min_lr, "Learning rate at the end of the decay")->check(NonNegative());
  app->add_option("--lr-warmup-init", o.schedule.init_lr, "Learning rate at the start of the warm-up")
      ->check(NonNegative());
  app->add_option("--lr-decay-style", o.schedule.decay_style, "constant, linear, cosine, inverse-square-root or WSD");
  app->add_option("--lr-decay-iters", o.schedule_options.lr_decay_iters,
                  "Decay length in iterations (default --train-iters)")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-decay-samples", o.schedule_options.lr_decay_samples,
                  "Decay length in samples (with --train-samples)")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-warmup-iters", o.schedule_options.lr_warmup_iters, "Warm-up length in iterations")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--lr-warmup-samples", o.schedule_options.lr_warmup_samples, "Warm-up length in samples")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--lr-warmup-fraction", o.schedule_options.lr_warmup_fraction,
                  "Warm-up as a fraction of the decay length")
      ->check(RealIn(0, false, 1, false));
  app->add_option("--lr-wsd-decay-style", o.schedule.wsd_decay_style,
                  "WSD anneal: linear, cosine, exponential or minus_sqrt");
  app->add_option("--lr-wsd-decay-iters", o.schedule_options.lr_wsd_decay_iters, "WSD anneal length in iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--lr-wsd-decay-samples", o.schedule_options.lr_wsd_decay_samples, "WSD anneal length in samples")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--weight-decay", o.schedule_options.weight_decay, "AdamW weight decay (not on biases and LayerNorm)")
      ->check(NonNegative());
  app->add_option("--start-weight-decay", o.schedule_options.start_weight_decay,
                  "Weight decay at the start (with an increment style)")
      ->check(NonNegative());
  app->add_option("--end-weight-decay", o.schedule_options.end_weight_decay,
                  "Weight decay at the end (with an increment style)")
      ->check(NonNegative());
  app->add_option("--weight-decay-incr-style", o.schedule.wd_incr_style, "constant, linear or cosine");
  app->add_option("--adam-beta1", o.optimizer.adam_beta1, "AdamW beta1")->check(RealIn(0, false, 1, true));
  app->add_option("--adam-beta2", o.optimizer.adam_beta2, "AdamW beta2")->check(RealIn(0, false, 1, true));
  app->add_option("--adam-eps", o.optimizer.adam_eps, "AdamW epsilon")->check(Positive());
  app->add_option("--clip-grad", o.optimizer.clip_grad, "Clip the global gradient norm to this (0: off)")
      ->check(NonNegative());
  // Data.
  app->add_option("--data-path", o.data.data_path, "Dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_option("--train-data-path", o.data.per_split_data_path[0], "Prefixes of the train split only")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_option("--valid-data-path", o.data.per_split_data_path[1], "Prefixes of the validation split only")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_option("--test-data-path", o.data.per_split_data_path[2], "Prefixes of the test split only")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_option("--split", o.data.split, "Train/valid/test proportions of --data-path");
  app->add_option("--seed", f->seed, "Random seed (init, data order, dropout)")->check(IntIn(0, 4294967295));
  app->add_option("--data-cache-path", f->data_cache_path, "Where the dataset index caches go");
  app->add_flag("--mock-data", o.mock_data, "Synthetic data instead of --data-path");
  app->add_option("--vocab-file", o.vocab_file, "GPT-2 vocab.json (default: ptk's built-in GPT-2 files)");
  app->add_option("--merge-file", o.merge_file, "GPT-2 merges.txt");
  app->add_option("--tokenizer-type", f->tokenizer_type, "GPT2BPETokenizer (the only one ptk has)");
  app->add_option("--dataloader-type", f->dataloader_type, "single (Megatron's pretraining sampler)");
  app->add_flag("--eod-mask-loss", o.eod_mask_loss, "No loss on end-of-document tokens");
  app->add_flag("--reset-position-ids", o.reset_position_ids, "Restart positions after each end-of-document token");
  app->add_flag("--reset-attention-mask", f->reset_attention_mask,
                "Not supported: attention is causal over the whole sequence");
  // Evaluation, logging, checkpoints.
  app->add_option("--eval-interval", o.eval_interval, "Evaluate on the validation split every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--eval-iters", o.eval_iters, "Global batches per evaluation (0: none)")->check(IntIn(0, kMaxCount));
  app->add_option("--log-interval", o.log_interval, "Print the log line every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--tensorboard-dir", o.tensorboard.dir,
                  "Write TensorBoard event files (Megatron's scalars) and metrics.jsonl to this directory");
  app->add_option("--tensorboard-log-interval", o.tensorboard.log_interval,
                  "Write the per-iteration scalars every N iterations")
      ->check(IntIn(1, kMaxCount));
  app->add_flag("!--no-log-loss-scale-to-tensorboard", o.tensorboard.log_loss_scale,
                "Do not write loss-scale to TensorBoard");
  app->add_flag("--log-validation-ppl-to-tensorboard", o.tensorboard.log_validation_ppl,
                "Write the validation perplexity to TensorBoard");
  app->add_flag("--log-world-size-to-tensorboard", o.tensorboard.log_world_size,
                "Write the number of ranks to TensorBoard");
  app->add_flag("--log-timers-to-tensorboard", o.tensorboard.log_timers,
                "Write iteration-time (and throughput, with --log-throughput) to TensorBoard");
  auto* sample_interval = app->add_option("--sample-interval", o.sample.interval,
                                          "ptk: print a continuation of --sample-prompt every N iterations (0: never)")
                              ->check(IntIn(0, kMaxCount));
  // Without --sample-interval no sample is printed: a sample flag alone is a mistake, not a no-op.
  app->add_option("--sample-prompt", o.sample.prompt_text,
                  "ptk: the text a sample continues (default: <|endoftext|>, an unconditional sample)")
      ->needs(sample_interval);
  app->add_option("--sample-length", o.sample.length, "ptk: tokens per sample (32)")
      ->check(IntIn(1, 4096))
      ->needs(sample_interval);
  app->add_option("--sample-temperature", o.sample.temperature,
                  "ptk: 0 (default) picks the likeliest token; above 0 draws, keyed by --seed and the iteration")
      ->check(RealIn(0, false, 100, false))
      ->needs(sample_interval);
  app->add_option("--metrics-file", f->metrics_file,
                  "ptk: per-iteration metrics as JSON lines (default TENSORBOARD_DIR/metrics.jsonl)");
  app->add_option("--save", o.save, "Checkpoint directory to write");
  app->add_option("--load", o.load, "Checkpoint directory to resume from");
  app->add_option("--save-interval", o.save_interval, "Save every N iterations")->check(IntIn(0, kMaxCount));
  app->add_option("--exit-interval", o.exit_interval, "Save and exit when the iteration is a multiple of N")
      ->check(IntIn(0, kMaxCount));
  app->add_option("--exit-duration-in-mins", o.exit_duration_in_mins, "Save and exit after this many minutes")
      ->check(NonNegative());
  app->add_flag("--exit-signal-handler", f->exit_signal_handler,
                "Save and exit on SIGTERM (and SIGUSR1, for Slurm's --signal)");
  app->add_flag("--no-load-optim", o.no_load_optim, "Do not restore the optimizer state");
  app->add_flag("--no-load-rng", o.no_load_rng, "Do not restore the random seed");
  app->add_flag("--finetune", o.finetune, "Load weights only; iteration and data start at 0");
  app->add_flag("--override-opt_param-scheduler", f->override_opt_param_scheduler,
                "On resume, take the learning-rate schedule of this command line where the checkpoint's differs");
  app->add_flag("--use-checkpoint-opt_param-scheduler", f->use_checkpoint_opt_param_scheduler,
                "On resume, keep the checkpoint's learning-rate schedule where this command line's differs (default: "
                "stop, naming what differs)");
  app->add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad",
                o.check_for_nan_in_loss_and_grad,
                "Stop when the loss or the gradient norm is NaN/Inf (default; --no-...: skip the iteration instead)");
  // Precision, parallelism, device.
  app->add_flag("--fp16", f->fp16,
                "fp16 mixed precision with dynamic loss scaling (--device cuda; fp32 master weights, moments, loss)");
  app->add_flag("--bf16", f->bf16, "bf16 mixed precision (--device cuda; fp32 master weights, moments, loss)");
  app->add_option("--device", f->device,
                  "ptk: cpu or cuda (default: cuda where this build has CUDA and a GPU is visible, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_flag("--ptk-profile-ops", o.backend.profile,
                "ptk: time every CUDA op with events and print the GPU time per iteration by op at the end");
  app->add_flag("--deterministic-mode", o.backend.deterministic,
                "Bitwise-reproducible kernels only: two runs give identical loss lines (the CPU backend always is)");
  app->add_option("--loss-scale", f->loss_scale, "fp16: a constant loss scale instead of dynamic scaling")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--initial-loss-scale", f->initial_loss_scale, "fp16: the dynamic loss scale's start (2^32)")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--min-loss-scale", f->min_loss_scale, "fp16: the dynamic loss scale's floor (1)")
      ->check(RealIn(0, true, 1e300, false));
  app->add_option("--loss-scale-window", f->loss_scale_window, "fp16: good steps before the scale doubles (1000)")
      ->check(RealIn(1, false, 1e15, false));
  app->add_option("--hysteresis", f->hysteresis, "fp16: overflows tolerated before the scale halves (2)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--tensor-model-parallel-size", f->tensor_model_parallel_size,
                  "Tensor-parallel ranks (Megatron's layers split over adjacent ranks; CPU backend over gloo): "
                  "WORLD_SIZE = this x data-parallel ranks (1)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--pipeline-model-parallel-size", f->pipeline_model_parallel_size,
                  "Must be 1: ptk has no pipeline parallelism")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--context-parallel-size", f->context_parallel_size, "Must be 1: ptk is data parallel")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--decoder-first-pipeline-num-layers", f->decoder_first_pipeline_num_layers,
                  "Layers of the first pipeline stage (the rest split evenly; with --dry-run)")
      ->check(IntIn(1, kMaxSize));
  app->add_option("--decoder-last-pipeline-num-layers", f->decoder_last_pipeline_num_layers,
                  "Layers of the last pipeline stage (the rest split evenly; with --dry-run)")
      ->check(IntIn(1, kMaxSize));
  app->add_flag("--dry-run", f->dry_run,
                "ptk: print the plan of this run on WORLD_SIZE ranks (any tensor and pipeline size): Megatron's "
                "layout, start-up and parameter lines, memory per GPU; then exit without building the model");
  app->add_option("--gpus-per-node", f->gpus_per_node,
                  "ptk: GPUs per node for --dry-run (default LOCAL_WORLD_SIZE, else SLURM_GPUS_ON_NODE)")
      ->check(IntIn(1, 65536));
  app->add_flag("--sequence-parallel", o.backend.sequence_parallel,
                "With --tensor-model-parallel-size above 1: LayerNorm, dropout and the residual split along the "
                "sequence over the tensor ranks (all-gather before the column-parallel products, reduce-scatter "
                "after the row-parallel ones)");
  app->add_flag("--use-distributed-optimizer", o.use_distributed_optimizer,
                "ZeRO-1: each data-parallel rank keeps and updates its shard of the optimizer state (AdamW's "
                "moments); gradients reduce-scattered, parameters all-gathered");
  app->add_option("--distributed-backend", f->distributed_backend,
                  "nccl (one process per GPU) or gloo (CPU ranks; GPUs through host memory); default: nccl with "
                  "--device cuda, gloo on the CPU")
      ->check(CLI::IsMember({"nccl", "gloo"}));
  app->add_flag("--overlap-grad-reduce", o.optimizer.overlap_grad_reduce,
                "Reduce the gradients in buckets while the last micro-batch's backward still runs (the same sums as "
                "after backward)");
  app->add_option("--ddp-bucket-size", o.optimizer.ddp_bucket_size,
                  "Elements per bucket of --overlap-grad-reduce (default: Megatron's max(40M, 1M x data-parallel "
                  "size))")
      ->check(IntIn(1, kMaxCount));
  app->add_option("--distributed-timeout-minutes", f->distributed_timeout_minutes,
                  "Rendezvous and collective timeout: a rank that waits longer for the others fails")
      ->check(RealIn(0, true, 1e6, false));
  app->add_option("--threads", f->threads, "ptk: CPU threads per rank (default: the cores given to this rank)")
      ->check(IntIn(0, 65536));
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
  AddMoreTrainFlags(app, f);
}

absl::StatusOr<TrainOptions> ResolveTrainFlags(const TrainFlags& f, std::vector<std::string>* notes) {
  if (f.pipeline_model_parallel_size != 1)
    return Refuse(
        fmt::format("--pipeline-model-parallel-size {}: ptk-train has no pipeline parallelism (tensor and "
                    "data parallelism only); use 1",
                    f.pipeline_model_parallel_size));
  if (f.context_parallel_size != 1)
    return Refuse(
        fmt::format("--context-parallel-size {}: ptk-train is data parallel only; use 1", f.context_parallel_size));
  if (f.fp16 && f.bf16) return Refuse("--fp16 and --bf16: give one precision");
  const Device device = f.device.empty() ? DefaultDevice() : f.device == "cuda" ? Device::kCuda : Device::kCpu;
  const Precision precision = f.bf16 ? Precision::kBf16 : f.fp16 ? Precision::kFp16 : Precision::kFp32;
  const int64_t tp = f.tensor_model_parallel_size;
  if (tp > 1 && device == Device::kCuda) return Refuse(kCudaTensorParallelMissing);
  PTK_RETURN_IF_ERROR(CheckBackendChoice(device, precision, /*device_given=*/!f.device.empty()));
  if (device == Device::kCuda) {  // the module and its CUDA libraries: found now, before any data is read
    if (auto cuda = LoadCudaBackend(); !cuda.ok())
      return absl::FailedPreconditionError(fmt::format("--device cuda: {}", StatusMessage(cuda.status())));
  } else if (f.device.empty() && CudaBuilt() && NvidiaDriverPresent()) {
    if (auto cuda = LoadCudaBackend(); !cuda.ok())
      notes->push_back(fmt::format("no --device given and {}: training on the CPU", StatusMessage(cuda.status())));
  }
  if (tp > 1 && f.options.model.num_attention_heads % tp != 0)
    return Refuse(fmt::format("--num-attention-heads {} is not divisible by --tensor-model-parallel-size {}",
                              f.options.model.num_attention_heads, tp));
  if (f.optimizer != "adam") return Refuse("--optimizer " + f.optimizer + ": ptk has AdamW (--optimizer adam) only");
  if (f.tokenizer_type != "GPT2BPETokenizer")
    return Refuse("--tokenizer-type " + f.tokenizer_type + ": ptk-train reads GPT-2 BPE data (GPT2BPETokenizer) only");
  {  // Another model than ptk's: every flag that asks for one, the first with its reason.
    std::vector<std::pair<std::string, std::string>> other;
    for (const ModelRefusal& r : kModelRefusals)
      if (auto it = f.refused.find(r.name); it != f.refused.end())
        other.emplace_back(it->second.empty() ? it->first : it->first + " " + it->second, r.why);
    if (!other.empty()) {
      std::string also;
      for (size_t i = 1; i < other.size(); ++i) also += (i > 1 ? ", " : "") + other[i].first;
      return Refuse(
          fmt::format("{}: {}. ptk-train trains Megatron's GPT-3-style GPT and the Llama line (RMSNorm, RoPE, SwiGLU, "
                      "grouped-query attention, no biases){}",
                      other[0].first, other[0].second, also.empty() ? "" : "; also not implemented here: " + also));
    }
  }
  if (f.decoder_first_pipeline_num_layers || f.decoder_last_pipeline_num_layers)
    return Refuse(
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: ptk-train runs one pipeline "
        "stage (--dry-run plans more)");
  if (f.gpus_per_node > 0 && !f.dry_run) notes->push_back("--gpus-per-node: accepted, used by --dry-run only");
  if (f.reset_attention_mask)
    return Refuse("--reset-attention-mask: attention is causal over the whole sequence in ptk");
  if (f.dataloader_type != "single")
    return Refuse("--dataloader-type " + f.dataloader_type + ": ptk has Megatron's pretraining sampler (single) only");
  if (!f.recompute_granularity.empty() && f.recompute_granularity != "selective" && f.recompute_granularity != "full")
    return Refuse("--recompute-granularity must be selective or full");
  for (const auto& [name, value] : f.compat)
    for (const CompatFlag& c : kCompatFlags)
      if (name == c.name)
        notes->push_back(fmt::format("{}{}: accepted, {}", name, value.empty() ? "" : " " + value, c.note));
  TrainOptions o = f.options;
  GPTConfig& m = o.model;
  PTK_RETURN_IF_ERROR(ResolveLlamaFlags(f, device, tp, &m));
  if (m.ffn_hidden_size == 0) m.ffn_hidden_size = 4 * m.hidden_size;
  if (m.max_position_embeddings == 0) m.max_position_embeddings = m.seq_length;
  if (m.vocab_size == 0) {
    PTK_RETURN_IF_ERROR(cli::CheckGpt2FileFlags(o.vocab_file, o.merge_file));
    PTK_ASSIGN_OR_RETURN(m.vocab_size, Gpt2VocabSize(o.vocab_file));
  }
  if (tp > 1 && o.backend.sequence_parallel && !m.gpt3())
    return Refuse(
        "--sequence-parallel: implemented for GPT-3's model only, not with --normalization RMSNorm, "
        "--position-embedding-type rope|none, --swiglu, --group-query-attention, --kv-channels or "
        "--disable-bias-linear");
  if (tp > 1 && o.backend.sequence_parallel && m.seq_length % tp != 0)
    return Refuse(fmt::format(
        "--sequence-parallel: --seq-length {} is not divisible by --tensor-model-parallel-size {}", m.seq_length, tp));
  if (tp == 1 && o.backend.sequence_parallel) {
    notes->push_back("--sequence-parallel: accepted, no effect at --tensor-model-parallel-size 1 (as Megatron)");
    o.backend.sequence_parallel = false;
  }
  if (tp > 1 && m.ffn_hidden_size % tp != 0)
    return Refuse(
        fmt::format("--ffn-hidden-size {} is not divisible by --tensor-model-parallel-size {}", m.ffn_hidden_size, tp));
  o.tensor_model_parallel_size = static_cast<int>(tp);
  // Megatron's padding: a multiple of --make-vocab-size-divisible-by x T, so the slices are equal.
  PTK_ASSIGN_OR_RETURN(m.padded_vocab_size,
                       TensorParallelVocabSize(m.vocab_size, f.make_vocab_size_divisible_by, static_cast<int>(tp)));
  if (!f.recompute_granularity.empty()) m.recompute_activations = true;
  if (f.recompute_granularity == "full")
    notes->push_back("--recompute-granularity full: ptk recomputes the attention probabilities (selective)");
  if (absl::Status st = m.Validate(); !st.ok()) return Refuse(SettingsAsFlags(std::string(StatusMessage(st))));

  if (!f.data_cache_path.empty()) o.data_cache_path = f.data_cache_path;
  if (!f.data_args_path.empty()) {
    if (!o.data.data_path.empty()) return Refuse("--data-args-path and --data-path: give one");
    auto words = ReadDataArgs(f.data_args_path, "--data-args-path");
    if (!words.ok() && !IsUsageError(words.status()))
      return UsageError(fmt::format("--data-args-path: {}", StatusMessage(words.status())));
    PTK_RETURN_IF_ERROR(words.status());
    o.data.data_path = *std::move(words);
  }
  if (!f.per_split_data_args_path.empty()) {
    if (!o.data.data_path.empty() || !o.data.per_split_data_path[0].empty() || !o.data.per_split_data_path[1].empty() ||
        !o.data.per_split_data_path[2].empty())
      return Refuse(
          "--per-split-data-args-path and --data-path / --train-data-path / --valid-data-path / --test-data-path / "
          "--data-args-path: give one");
    PTK_RETURN_IF_ERROR(ReadPerSplitDataArgs(f.per_split_data_args_path, &o.data));
  }
  if (o.save_interval > 0 && o.save.empty())
    notes->push_back(
        fmt::format("--save-interval {} without --save: nothing is saved (as in Megatron)", o.save_interval));
  o.seed = static_cast<uint32_t>(f.seed);
  if (f.override_opt_param_scheduler && f.use_checkpoint_opt_param_scheduler)
    return Refuse("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one");
  o.scheduler_on_load = f.override_opt_param_scheduler         ? SchedulerOnLoad::kOverride
                        : f.use_checkpoint_opt_param_scheduler ? SchedulerOnLoad::kUseCheckpoint
                                                               : SchedulerOnLoad::kCheck;
  o.backend.device = device;
  o.backend.precision = precision;
  if (f.profile) {
    if (device == Device::kCuda) {
      o.backend.profile = true;
      notes->push_back(
          "--profile: ptk times every CUDA op and prints the GPU time per op at the end (no PyTorch or Nsight "
          "trace is written)");
    } else {
      notes->push_back("--profile: accepted, the CPU backend has no profiler (ptk profiles CUDA ops only)");
    }
  } else if (o.backend.profile && device != Device::kCuda)
    notes->push_back("--ptk-profile-ops: accepted, the CPU backend does not time its ops");
  if (f.fp16) {
    o.loss_scale.dynamic = !f.loss_scale.has_value();
    o.loss_scale.scale = f.loss_scale.value_or(f.initial_loss_scale);
    o.loss_scale.min_scale = f.min_loss_scale;
    o.loss_scale.window = static_cast<int64_t>(f.loss_scale_window);
    o.loss_scale.hysteresis = f.hysteresis;
  } else if (f.loss_scale) {
    notes->push_back("--loss-scale: accepted, loss scaling applies to --fp16 only");
  }
  o.distributed_backend = !f.distributed_backend.empty()      ? f.distributed_backend
                          : o.backend.device == Device::kCuda ? "nccl"
                                                              : "gloo";
  if (o.optimizer.ddp_bucket_size > 0 && !o.optimizer.overlap_grad_reduce)
    notes->push_back("--ddp-bucket-size: accepted, buckets matter with --overlap-grad-reduce only");
  o.tensorboard.log_throughput = f.compat.count("--log-throughput") > 0;
  o.metrics_path = !f.metrics_file.empty()      ? f.metrics_file
                   : !o.tensorboard.dir.empty() ? JoinPath(o.tensorboard.dir, "metrics.jsonl")
                                                : "";
  return o;
}

}  // namespace ptk
