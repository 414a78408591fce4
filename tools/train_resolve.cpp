// ptk-train's flags into TrainOptions, after parsing: what ptk cannot do refused (one line naming
// the flag), notes for flags accepted without effect, and the settings that depend on other flags.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/cli.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/numbers.h"
#include "common/py_format.h"
#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/indexed_dataset.h"
#include "tools/train_flag_parts.h"
#include "tools/train_flags.h"
#include "trainer/backend.h"
#include "trainer/parallel_layout.h"
#include "trainer/parallel_params.h"

namespace ptk {
namespace {

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
  // Read as every file is (a FIFO refused at once, not waited on), then parsed.
  auto text = ReadFileToString(path);
  if (!text.ok()) return UsageError(fmt::format("--per-split-data-args-path: {}", StatusMessage(text.status())));
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (auto err = p.parse(*text).get(obj))
    return UsageError(
        fmt::format("--per-split-data-args-path {}: not a JSON object ({})", path, simdjson::error_message(err)));
  const char* keys[] = {"train", "valid", "test"};
  // Megatron reads per_split_data_args["train"], ["valid"] and ["test"]: a missing key is its
  // KeyError (a "validation" list ptk took and left unused: no evaluation, without a word).
  std::string others;
  for (auto field : obj)
    if (field.key != "train" && field.key != "valid" && field.key != "test")
      others += fmt::format("{}\"{}\"", others.empty() ? "" : ", ", field.key);
  for (const char* key : keys) {
    simdjson::dom::element e;
    if (obj[key].get(e))
      return UsageError(
          fmt::format("--per-split-data-args-path {}: no \"{}\" key: Megatron's file has \"train\", \"valid\" and "
                      "\"test\" (null for "
                      "none){}",
                      path, key, others.empty() ? "" : "; this one has " + others));
  }
  for (int i = 0; i < 3; ++i) {
    simdjson::dom::element e;
    if (obj[keys[i]].get(e) || e.is_null()) continue;
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

// One dataset's entry of --per-dataset-sequences-path against its .idx: Megatron's _IndexReader takes
// the sequence count and the document-index count from the entry instead of the header, and the token
// type from the vocabulary (GPTDataset: uint16 up to 65536 tokens, else int32), then reads the arrays
// at those counts. ptk reads the header: the same dataset exactly when they agree.
absl::Status CheckSequencesEntry(const std::string& path, simdjson::dom::object obj, const std::string& prefix,
                                 int64_t vocab) {
  const std::string where = "--per-dataset-sequences-path " + path;
  simdjson::dom::array entry;
  if (obj[prefix].get(entry))
    return Refuse(fmt::format("{}: no [sequences, documents] entry for {} (Megatron's KeyError)", where, prefix));
  int64_t sequences = 0, documents = 0;
  if (entry.size() != 2 || entry.at(0).get(sequences) || entry.at(1).get(documents))
    return Refuse(fmt::format("{}: the entry for {} is not two integers [sequences, documents]", where, prefix));
  PTK_ASSIGN_OR_RETURN(auto ds, IndexedDataset::Open(prefix));
  const DType token = vocab > 65536 ? DType::kInt32 : DType::kUInt16;
  if (sequences != ds->num_sequences() || documents != ds->num_documents() + 1 || ds->dtype() != token)
    return Refuse(fmt::format(
        "{}: {} is [{}, {}] there ({} tokens by the vocabulary), its .idx has {} sequences, {} document indices "
        "and {} tokens: Megatron would read that index at the file's counts; ptk reads the header (fix or drop "
        "the file)",
        where, prefix, sequences, documents, DTypeName(token), ds->num_sequences(), ds->num_documents() + 1,
        DTypeName(ds->dtype())));
  return absl::OkStatus();
}

// --per-dataset-sequences-path: every dataset the data paths name checked (CheckSequencesEntry), a note
// when all agree; with --mock-data not read, as Megatron's mock dataset reads no index.
absl::Status CheckSequencesPerDataset(const TrainFlags& f, const TrainOptions& o, std::vector<std::string>* notes) {
  const std::string& path = f.per_dataset_sequences_path;
  if (path.empty()) return absl::OkStatus();
  if (o.mock_data) {
    notes->push_back("--per-dataset-sequences-path " + path + ": accepted, not read with --mock-data (as Megatron)");
    return absl::OkStatus();
  }
  auto text = ReadFileToString(path);
  if (!text.ok()) return Refuse(fmt::format("--per-dataset-sequences-path: {}", StatusMessage(text.status())));
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (auto err = p.parse(*text).get(obj))
    return Refuse(
        fmt::format("--per-dataset-sequences-path {}: not a JSON object ({})", path, simdjson::error_message(err)));
  std::vector<std::string> prefixes;
  for (const auto* list : {&o.data.data_path, &o.data.per_split_data_path[0], &o.data.per_split_data_path[1],
                           &o.data.per_split_data_path[2]}) {
    if (list->empty()) continue;
    std::vector<std::string> names;
    std::optional<std::vector<double>> weights;
    PTK_RETURN_IF_ERROR(ParseBlend(*list, &names, &weights));
    prefixes.insert(prefixes.end(), names.begin(), names.end());
  }
  const int64_t vocab = o.model.vocab_size > 0 ? o.model.vocab_size : 50257;
  for (const std::string& prefix : prefixes) PTK_RETURN_IF_ERROR(CheckSequencesEntry(path, obj, prefix, vocab));
  notes->push_back("--per-dataset-sequences-path " + path +
                   ": accepted, its counts are each .idx header's, which ptk reads (checked)");
  return absl::OkStatus();
}

// --exit-signal and --disable-bf16-reduced-precision-matmul, by what Megatron does with their values:
// Megatron's --exit-signal is the one signal its --exit-signal-handler catches (a name of Python's
// signal.Signals), read by nothing else; ptk's handler saves on SIGTERM, SIGUSR1 and SIGINT alike.
// The matmul flag sets torch's allow_bf16_reduced_precision_reduction = False only with --bf16
// (TransformerConfig.__post_init__): ResolveRunSettings passes it to the CUDA backend then, and notes it
// as no effect without --bf16.
absl::Status ResolveSignalAndMatmulFlags(const TrainFlags& f, std::vector<std::string>* notes) {
  static constexpr const char* kCaught[] = {"SIGTERM", "SIGUSR1", "SIGINT"};
  const std::string& sig = f.exit_signal;
  if (!sig.empty()) {
    const bool caught = std::find(std::begin(kCaught), std::end(kCaught), sig) != std::end(kCaught);
    if (f.exit_signal_handler && !caught)
      return Refuse("--exit-signal " + sig +
                    ": ptk's --exit-signal-handler saves on SIGTERM, SIGUSR1 and SIGINT only; another signal is not "
                    "caught");
    if (!f.exit_signal_handler && (sig.size() < 4 || sig.compare(0, 3, "SIG") != 0))
      return Refuse("--exit-signal " + sig + ": not a signal name (SIGTERM, SIGUSR1, ...)");
    notes->push_back("--exit-signal " + sig +
                     (f.exit_signal_handler ? ": accepted, --exit-signal-handler saves on SIGTERM, SIGUSR1 and SIGINT"
                                            : ": accepted, no effect without --exit-signal-handler (as Megatron)"));
  }
  if (f.disable_bf16_reduced_precision_matmul && !f.bf16)
    notes->push_back("--disable-bf16-reduced-precision-matmul: accepted, no effect without --bf16 (as Megatron)");
  return absl::OkStatus();
}

// The flags that ask for what ptk has not (the model's, the data's, the optimizer's), after the
// device is known; notes for the flags accepted for compatibility.
absl::Status RefuseWhatPtkLacks(const TrainFlags& f, int64_t tp, std::vector<std::string>* notes) {
  if (tp > 1 && f.options.model.num_attention_heads % tp != 0)
    return Refuse(fmt::format("--num-attention-heads {} is not divisible by --tensor-model-parallel-size {}",
                              f.options.model.num_attention_heads, tp));
  if (f.optimizer != "adam") return Refuse("--optimizer " + f.optimizer + ": ptk has AdamW (--optimizer adam) only");
  if (f.tokenizer_type != "GPT2BPETokenizer")
    return Refuse("--tokenizer-type " + f.tokenizer_type + ": ptk-train reads GPT-2 BPE data (GPT2BPETokenizer) only");
  PTK_RETURN_IF_ERROR(train_flags::RefuseOtherModel(f));
  if (f.gpus_per_node > 0 && !f.dry_run) notes->push_back("--gpus-per-node: accepted, used by --dry-run only");
  if (f.reset_attention_mask)
    return Refuse("--reset-attention-mask: attention is causal over the whole sequence in ptk");
  if (f.dataloader_type != "single")
    return Refuse("--dataloader-type " + f.dataloader_type + ": ptk has Megatron's pretraining sampler (single) only");
  if (!f.recompute_granularity.empty() && f.recompute_granularity != "selective" && f.recompute_granularity != "full")
    return Refuse("--recompute-granularity must be selective or full");
  PTK_RETURN_IF_ERROR(ResolveSignalAndMatmulFlags(f, notes));
  train_flags::NoteCompatFlags(f, notes);
  return absl::OkStatus();
}

// The model's settings that depend on other flags (Llama's, the defaults, the vocabulary from
// --vocab-file padded for `tp` tensor ranks), sequence parallelism, checked as one model.
absl::Status ResolveModel(const TrainFlags& f, int64_t tp, TrainOptions* out, std::vector<std::string>* notes) {
  TrainOptions& o = *out;
  GPTConfig& m = o.model;
  PTK_RETURN_IF_ERROR(ResolveLlamaFlags(f, tp, &m));
  PTK_RETURN_IF_ERROR(ResolveMoeFlags(f, &m, notes));
  PTK_RETURN_IF_ERROR(ResolveMlaFlags(f, &m, notes));
  PTK_RETURN_IF_ERROR(ResolveMtpFlags(f, &m, notes));
  PTK_RETURN_IF_ERROR(ResolveAttentionVariantFlags(f, &m, notes));
  NoteRotaryFlags(m, notes);
  if (m.ffn_hidden_size == 0) m.ffn_hidden_size = 4 * m.hidden_size;
  if (m.max_position_embeddings == 0) m.max_position_embeddings = m.seq_length;
  if (m.vocab_size == 0 || (f.checkpoint_vocab && f.checkpoint_vocab->vocab_size_taken && !o.vocab_file.empty())) {
    PTK_RETURN_IF_ERROR(cli::CheckGpt2FileFlags(o.vocab_file, o.merge_file));
    PTK_ASSIGN_OR_RETURN(const int64_t tokens, Gpt2VocabSize(o.vocab_file));
    if (m.vocab_size != 0 && m.vocab_size != tokens)  // the checkpoint's --vocab-size, and a vocabulary file
      return Refuse(fmt::format(
          "--use-checkpoint-args: --vocab-file {} has {} tokens, and the checkpoint of iteration {} in {} was "
          "trained on --vocab-size {}: give the vocabulary it was trained with",
          o.vocab_file, tokens, f.checkpoint_vocab->iteration, f.checkpoint_vocab->load, m.vocab_size));
    m.vocab_size = tokens;
  }
  // Megatron's tokenizer.eod: --vocab-file's <|endoftext|> (was always GPT-2's 50256, so with another
  // vocabulary --eod-mask-loss and --reset-position-ids looked for a token the data did not hold).
  if ((o.eod_mask_loss || o.reset_position_ids) && !o.vocab_file.empty()) {
    PTK_RETURN_IF_ERROR(cli::CheckGpt2FileFlags(o.vocab_file, o.merge_file));
    PTK_ASSIGN_OR_RETURN(o.eod, Gpt2EndOfTextId(o.vocab_file));
  }
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
  PTK_ASSIGN_OR_RETURN(m.padded_vocab_size, PaddedVocabSize(f, m.vocab_size, tp));
  // Recorded beside the padded vocabulary it gave: with --use-checkpoint-args the checkpoint's divisor,
  // which padded the vocabulary this run takes (the command line's would not give it again on the next
  // resume).
  o.make_vocab_size_divisible_by = f.checkpoint_vocab && f.checkpoint_vocab->make_vocab_size_divisible_by
                                       ? *f.checkpoint_vocab->make_vocab_size_divisible_by
                                       : f.make_vocab_size_divisible_by;
  if (!f.recompute_granularity.empty()) m.recompute_activations = true;
  if (f.recompute_granularity == "full")
    notes->push_back("--recompute-granularity full: ptk recomputes the attention probabilities (selective)");
  if (absl::Status st = m.Validate(); !st.ok()) return Refuse(SettingsAsFlags(std::string(StatusMessage(st))));
  return absl::OkStatus();
}

// The data paths from --data-args-path / --per-split-data-args-path, and the cache path.
// Megatron's parse of --phase-transition-iterations: int() of each comma-separated part, sorted.
absl::Status ParsePhaseTransitions(const std::string& given, std::vector<int64_t>* out) {
  out->clear();
  if (given.empty()) return absl::OkStatus();  // Megatron's `if args.phase_transition_iterations:`
  size_t start = 0;
  while (start <= given.size()) {
    const size_t comma = std::min(given.find(',', start), given.size());
    std::string_view part = std::string_view(given).substr(start, comma - start);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front()))) part.remove_prefix(1);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back()))) part.remove_suffix(1);
    std::optional<int64_t> v = ParseInt64(part);
    if (!v || *v > train_flags::kMaxCount || *v < -train_flags::kMaxCount)
      return Refuse(
          fmt::format("--phase-transition-iterations {}: '{}' is not an integer (a comma-separated list of "
                      "iterations)",
                      given, part));
    out->push_back(*v);
    start = comma + 1;
  }
  std::sort(out->begin(), out->end());
  return absl::OkStatus();
}

absl::Status ResolveDataFlags(const TrainFlags& f, TrainOptions* out) {
  TrainOptions& o = *out;
  PTK_RETURN_IF_ERROR(ParsePhaseTransitions(f.phase_transition_iterations, &o.phase_transition_iterations));
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
  return ResolveFimFlags(f, o);
}

// Checkpoints' schedule, seed, device, precision, profiling, loss scaling, communicator, metrics.
// Flags whose work needs another flag that is not given: a note for each, as --save-interval without --save
// has (they were taken without a word: --log-timers-to-tensorboard without --tensorboard-dir wrote nothing,
// --no-load-optim without --load loaded nothing). Megatron takes them as silently.
void NoteFlagsWithoutTheirTarget(const TrainFlags& f, const TrainOptions& o, std::vector<std::string>* notes) {
  std::string tb;
  for (const auto& [name, given] : {std::pair{"--tensorboard-log-interval", o.tensorboard.log_interval != 1},
                                    std::pair{"--no-log-loss-scale-to-tensorboard", !o.tensorboard.log_loss_scale},
                                    std::pair{"--log-validation-ppl-to-tensorboard", o.tensorboard.log_validation_ppl},
                                    std::pair{"--log-world-size-to-tensorboard", o.tensorboard.log_world_size},
                                    std::pair{"--log-timers-to-tensorboard", o.tensorboard.log_timers}})
    if (given) tb += (tb.empty() ? "" : ", ") + std::string(name);
  if (!tb.empty() && o.tensorboard.dir.empty())
    notes->push_back(tb + " without --tensorboard-dir: nothing is written to TensorBoard (as in Megatron)");
  std::string load;
  for (const auto& [name, given] :
       {std::pair{"--no-load-optim", o.no_load_optim}, std::pair{"--no-load-rng", o.no_load_rng},
        std::pair{"--finetune", o.finetune}, std::pair{"--exit-on-missing-checkpoint", o.exit_on_missing_checkpoint},
        std::pair{"--ckpt-step", o.ckpt_step.has_value()},
        std::pair{"--override-opt_param-scheduler", f.override_opt_param_scheduler},
        std::pair{"--use-checkpoint-opt_param-scheduler", f.use_checkpoint_opt_param_scheduler}})
    if (given) load += (load.empty() ? "" : ", ") + std::string(name);
  if (!load.empty() && o.load.empty() && o.pretrained_checkpoint.empty())
    notes->push_back(load + " without --load: nothing is loaded; the run starts from random initialization");
  for (int64_t it : o.iterations_to_skip)
    if (it < 0)
      notes->push_back(fmt::format(
          "--iterations-to-skip {}: accepted, skips nothing: the count of iterations done is never negative (as "
          "Megatron)",
          it));
}

// --skip-train: Megatron's --no-load-optim (no optimizer is made), and no checkpoint written (no iteration runs).
void SkipTrainSettings(TrainOptions* o, std::vector<std::string>* notes) {
  if (!o->load.empty() && !o->no_load_optim) {
    o->no_load_optim = true;
    notes->push_back("enabling --no-load-optim when skipping training.");
  }
  if (o->load.empty() && o->pretrained_checkpoint.empty())
    notes->push_back("--skip-train without --load: the randomly initialized model is evaluated (as in Megatron)");
  if (!o->tensorboard.dir.empty() || !o->metrics_path.empty())
    notes->push_back(
        "--tensorboard-dir / --metrics-file with --skip-train: nothing is written there (the losses are in the lines; "
        "as in Megatron)");
  if (!o->save.empty()) {
    notes->push_back(fmt::format("--save {} with --skip-train: nothing is saved (no iteration runs)", o->save));
    o->save.clear();
    o->save_interval = 0;
  }
}

absl::Status ResolveRunSettings(const TrainFlags& f, Device device, Precision precision, TrainOptions* out,
                                std::vector<std::string>* notes) {
  if (out->no_initialization && out->load.empty() && out->pretrained_checkpoint.empty())
    return Refuse(
        "--no-initialization without --load (or --pretrained-checkpoint): no weights to start from (Megatron would "
        "train from uninitialised memory)");
  TrainOptions& o = *out;
  if (o.skip_train) SkipTrainSettings(&o, notes);
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
  o.backend.disable_bf16_reduced_precision_matmul =
      f.disable_bf16_reduced_precision_matmul && precision == Precision::kBf16;
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
  train_flags::ResolveLossScale(f, &o, notes);
  NoteFlagsWithoutTheirTarget(f, o, notes);
  o.distributed_backend = !f.distributed_backend.empty()      ? f.distributed_backend
                          : o.backend.device == Device::kCuda ? "nccl"
                                                              : "gloo";
  if (o.optimizer.ddp_bucket_size > 0 && !o.optimizer.overlap_grad_reduce)
    notes->push_back("--ddp-bucket-size: accepted, buckets matter with --overlap-grad-reduce only");
  o.metrics_path = !f.metrics_file.empty()      ? f.metrics_file
                   : !o.tensorboard.dir.empty() ? JoinPath(o.tensorboard.dir, "metrics.jsonl")
                                                : "";
  return absl::OkStatus();
}

// --context-parallel-size above 1 on the CUDA backend: what its context parallelism lacks (the CUDA model
// refuses the same, CudaGPTModelImpl::SetContext), refused before the backend is looked for.
absl::Status RefuseCudaContextParallel(const TrainFlags& f) {
  const std::string flag = fmt::format("--context-parallel-size {}", f.context_parallel_size);
  if (f.distributed_backend == "gloo")
    return Refuse(flag +
                  " on the CUDA backend needs NCCL for the context group (--distributed-backend nccl, the default "
                  "with --device cuda), not gloo");
  return absl::OkStatus();
}

// --context-parallel-size above 1: what ptk's context parallelism covers (the CPU model, and the CUDA one, with
// data and tensor parallelism and pipeline stages; the whole causal attention from all-gathered keys and values), the
// rest refused naming the flag.
absl::Status ResolveContextParallel(const TrainFlags& f, TrainOptions* out) {
  TrainOptions& o = *out;
  const int64_t cp = f.context_parallel_size;
  o.context_parallel_size = static_cast<int>(cp);
  if (cp == 1) return absl::OkStatus();
  const std::string flag = fmt::format("--context-parallel-size {}", cp);
  if (f.cp_comm_type == "a2a" || f.cp_comm_type == "a2a+p2p")
    return Refuse(fmt::format(
        "{} --cp-comm-type {}: ptk has allgather (and p2p, run as allgather: the same attention); use one of them",
        flag, f.cp_comm_type));
  if (o.model.seq_length % (2 * cp) != 0)
    return Refuse(
        fmt::format("{}: --seq-length {} must be a multiple of 2 x {} = {} (Megatron's 2C chunks of a sample)", flag,
                    o.model.seq_length, cp, 2 * cp));
  const int64_t tp = o.tensor_model_parallel_size;
  if (o.backend.sequence_parallel && o.model.seq_length / cp % tp != 0)
    return Refuse(fmt::format(
        "{} with --sequence-parallel: a context rank's --seq-length {} / {} = {} positions must be a multiple of "
        "--tensor-model-parallel-size {}",
        flag, o.model.seq_length, cp, o.model.seq_length / cp, tp));
  if (o.sample.interval > 0)
    return Refuse(flag + " with --sample-interval: text samples are not implemented with context parallelism");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainOptions> ResolveTrainFlags(const TrainFlags& f, std::vector<std::string>* notes) {
  // Megatron's split of the layers over the pipeline stages (refusals in its terms).
  std::vector<int64_t> stage_layers;
  if (f.pipeline_model_parallel_size > 1 || f.decoder_first_pipeline_num_layers || f.decoder_last_pipeline_num_layers) {
    PTK_ASSIGN_OR_RETURN(
        stage_layers, PipelineStageLayers(f.options.model.num_layers, static_cast<int>(f.pipeline_model_parallel_size),
                                          f.decoder_first_pipeline_num_layers, f.decoder_last_pipeline_num_layers));
  }
  const bool pipelined = stage_layers.size() > 1;
  // Megatron's interleaved schedule, on either backend (ptk refuses nothing beyond Megatron's checks).
  PTK_ASSIGN_OR_RETURN(const int virtual_size, VirtualPipelineSize(f));
  if (f.fp16 && f.bf16) return Refuse("--fp16 and --bf16: give one precision");
  const Device device = f.device.empty() ? DefaultDevice() : f.device == "cuda" ? Device::kCuda : Device::kCpu;
  const Precision precision = f.bf16 ? Precision::kBf16 : f.fp16 ? Precision::kFp16 : Precision::kFp32;
  const int64_t tp = f.tensor_model_parallel_size;
  if (tp > 1 && device == Device::kCuda && f.distributed_backend == "gloo") return Refuse(kCudaTensorParallelMissing);
  if (f.context_parallel_size > 1 && device == Device::kCuda)  // before the backend is looked for
    PTK_RETURN_IF_ERROR(RefuseCudaContextParallel(f));
  PTK_RETURN_IF_ERROR(RefuseMoeParallelism(f));
  PTK_RETURN_IF_ERROR(RefuseMoeDevice(f, device));
  PTK_RETURN_IF_ERROR(RefuseMlaParallelismAndDevice(f, device));
  PTK_RETURN_IF_ERROR(RefuseMtpCombinations(f, device));
  PTK_RETURN_IF_ERROR(RefuseAttentionVariantCombinations(f, device));
  PTK_RETURN_IF_ERROR(CheckBackendChoice(device, precision, /*device_given=*/!f.device.empty()));
  if (device == Device::kCuda) {  // the module and its CUDA libraries: found now, before any data is read
    if (auto cuda = LoadCudaBackend(); !cuda.ok())
      return absl::FailedPreconditionError(fmt::format("--device cuda: {}", StatusMessage(cuda.status())));
  } else if (f.device.empty() && CudaBuilt() && NvidiaDriverPresent()) {
    if (auto cuda = LoadCudaBackend(); !cuda.ok())
      notes->push_back(fmt::format("no --device given and {}: training on the CPU", StatusMessage(cuda.status())));
  }
  PTK_RETURN_IF_ERROR(RefuseWhatPtkLacks(f, tp, notes));
  TrainOptions o = f.options;
  PTK_RETURN_IF_ERROR(ResolveModel(f, tp, &o, notes));
  PTK_RETURN_IF_ERROR(ResolveDataFlags(f, &o));
  PTK_RETURN_IF_ERROR(CheckSequencesPerDataset(f, o, notes));
  PTK_RETURN_IF_ERROR(ResolveRunSettings(f, device, precision, &o, notes));
  PTK_RETURN_IF_ERROR(train_flags::ResolveCheckpointKeeping(f, &o, notes));
  PTK_RETURN_IF_ERROR(train_flags::ResolveParamGroups(f, &o, notes));
  if (pipelined) o.pipeline_stage_layers = stage_layers;
  o.pipeline_virtual_size = virtual_size;
  PTK_RETURN_IF_ERROR(ResolveContextParallel(f, &o));
  o.expert_model_parallel_size = static_cast<int>(f.moe.expert_parallel);
  if (const auto& n = f.microbatch_group_size_per_vp_stage; n && virtual_size > 1)
    o.pipeline_microbatch_group_size = static_cast<int>(*n);
  else if (n)  // Megatron's 1F1B schedule does not read it either
    notes->push_back(fmt::format(
        "--microbatch-group-size-per-virtual-pipeline-stage {}: without model chunks "
        "(--num-layers-per-virtual-pipeline-stage) the 1F1B schedule has no micro-batch groups; it changes nothing",
        *n));
  return o;
}

absl::StatusOr<int> VirtualPipelineSize(const TrainFlags& f) {
  const auto& per_chunk = f.num_layers_per_virtual_pipeline_stage;
  const auto& chunks = f.num_virtual_stages_per_pipeline_rank;
  if (!per_chunk && !chunks) return 1;
  const std::string flag = per_chunk ? fmt::format("--num-layers-per-virtual-pipeline-stage {}", *per_chunk)
                                     : fmt::format("--num-virtual-stages-per-pipeline-rank {}", *chunks);
  if (per_chunk && chunks)
    return Refuse(
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank: give one of them");
  if (f.pipeline_model_parallel_size < 2)
    return Refuse(fmt::format("{}: the interleaved schedule needs --pipeline-model-parallel-size above 1 (it is {})",
                              flag, f.pipeline_model_parallel_size));
  if (f.decoder_first_pipeline_num_layers || f.decoder_last_pipeline_num_layers)
    return Refuse(
        fmt::format("{} with --decoder-first/last-pipeline-num-layers: ptk's interleaved schedule splits "
                    "the layers evenly; drop one of them",
                    flag));
  const int64_t per_stage = f.options.model.num_layers / f.pipeline_model_parallel_size;
  const int64_t divisor = per_chunk ? *per_chunk : *chunks;
  if (per_stage % divisor != 0)
    return Refuse(
        fmt::format("{}: the layers of a pipeline stage (--num-layers {} / --pipeline-model-parallel-size "
                    "{} = {}) must be divisible by the {}",
                    flag, f.options.model.num_layers, f.pipeline_model_parallel_size, per_stage,
                    per_chunk ? "layers of a virtual stage" : "virtual stages"));
  return static_cast<int>(per_chunk ? per_stage / *per_chunk : *chunks);  // 1: Megatron's plain 1F1B
}

absl::StatusOr<int32_t> Gpt2EndOfTextId(const std::string& vocab_file) {
  if (!PathExists(vocab_file)) return absl::NotFoundError(vocab_file + ": --vocab-file does not exist");
  PTK_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(vocab_file));
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (p.parse(text).get(obj)) return absl::InvalidArgumentError(vocab_file + ": not a JSON object (GPT-2 vocab.json)");
  int64_t id = -1;
  if (obj["<|endoftext|>"].get(id) || id < 0 || id > INT32_MAX)
    return UsageError(
        fmt::format("--eod-mask-loss / --reset-position-ids: --vocab-file {} has no <|endoftext|> "
                    "token id, the end of document they look for",
                    vocab_file));
  return static_cast<int32_t>(id);
}

absl::StatusOr<int64_t> Gpt2VocabSize(const std::string& vocab_file) {
  if (vocab_file.empty()) return 50257;
  if (!PathExists(vocab_file)) return absl::NotFoundError(vocab_file + ": --vocab-file does not exist");
  PTK_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(vocab_file));  // a FIFO refused, not waited on
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (p.parse(text).get(obj)) return absl::InvalidArgumentError(vocab_file + ": not a JSON object (GPT-2 vocab.json)");
  return static_cast<int64_t>(obj.size());
}

}  // namespace ptk
