// ptk-tokenize: a drop-in for Megatron-LM's tools/preprocess_data.py (GPT-2 BPE).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/cpu_budget.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "dataprep/input/input_list.h"
#include "dataprep/tokenize/json_record.h"
#include "dataprep/tokenize/tokenize_pipeline.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace {

// The flags as parsed: TokenizeOptions' own, and those checked or turned into its fields.
struct TokenizeFlags {
  ptk::TokenizeOptions opt;
  std::vector<std::string> inputs;
  std::string tokenizer_type = "GPT2BPETokenizer", vocab_file, merge_file, dataset_impl = "mmap";
  std::string tokenizer_library = "megatron", files_filter;
  std::optional<std::string> tokenizer_model;
  bool preproc_folder = false, legacy_tokenizer = false;
  CLI::Option* tokenizer_type_opt = nullptr;
  const CLI::Option* special_tokens_opt = nullptr;    // --tokenizer-special-tokens (ignored or refused)
  ptk::CpuBudget cpus = ptk::ThisProcessCpuBudget();  // --workers' default
  int workers = cpus.cpus;
  CLI::Option* workers_opt = nullptr;
  bool quiet = false;
  double batch_mb = 1.0;
  CLI::Option* batch_opt = nullptr;
};

// Megatron's and NeMo's flags, as their scripts take them.
void AddOptions(CLI::App& app, TokenizeFlags* f) {
  app.add_option("--input", f->inputs,
                 "Input files, globs or directories, read in the order given (a glob's matches, and the files below "
                 "a directory, in natural order; extension-less files such as wiki_00 included)")
      ->required();
  // NeMo's preprocess_data_for_megatron.py flags.
  app.add_option("--tokenizer-library", f->tokenizer_library,
                 "NeMo: the tokenizer library; only megatron (GPT-2 BPE) is implemented");
  // NeMo's launcher passes --tokenizer-model=None (its config's null) with the GPT-2 BPE tokenizer, which does
  // not read it: refused as a SentencePiece model, the launcher's line failed.
  app.add_option("--tokenizer-model", f->tokenizer_model,
                 "Megatron/NeMo: a SentencePiece/tiktoken model, which GPT2BPETokenizer does not read: None (as "
                 "NeMo's launcher passes it) is accepted, and a model with an explicit --tokenizer-type "
                 "GPT2BPETokenizer ignored with a warning, as Megatron does; without one it is refused");
  app.add_flag("--preproc-folder", f->preproc_folder,
               "NeMo: --input is a directory; its files matching --files-filter (default **/*.json*) are inputs");
  app.add_option("--files-filter", f->files_filter,
                 "NeMo: glob of the files to take below an --input directory (e.g. '**/*.json*')");
  app.add_option("--output-prefix", f->opt.output_prefix, "Output path prefix: writes PREFIX_{key}_document.bin/.idx")
      ->required();
  app.add_option("--json-keys", f->opt.json_keys, "Keys to extract from each JSON line; one dataset per key");
  f->tokenizer_type_opt =
      app.add_option("--tokenizer-type", f->tokenizer_type, "Tokenizer; only GPT2BPETokenizer is supported");
  app.add_flag("--legacy-tokenizer", f->legacy_tokenizer,
               "Megatron's legacy GPT2BPETokenizer (megatron/training/tokenizer): a literal <|endoftext|> in the text "
               "is ordinary tokens there, as --endoftext-as-text gives");
  app.add_option("--vocab-file", f->vocab_file, "GPT-2 vocab.json (default: the GPT-2 vocab shipped with ptk)");
  app.add_option("--merge-file", f->merge_file, "GPT-2 merges.txt (default: the GPT-2 merges shipped with ptk)");
  app.add_flag("--append-eod", f->opt.append_eod, "Append <|endoftext|> (50256) to every non-empty document");
  f->workers_opt = app.add_option("--workers", f->workers,
                                  "Encoding threads (default: the CPUs this process may use: its affinity mask "
                                  "capped by its cgroup CPU quota)")
                       ->check(ptk::cli::IntIn(1, 65536));
  app.add_option("--partitions", f->opt.partitions,
                 "Megatron's file partitions: round-robin document order across P parts")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app.add_option("--log-interval", f->opt.log_interval, "Print 'Processed N documents ...' every N documents")
      ->check(ptk::cli::IntIn(1, INT64_MAX));
  app.add_flag("--keep-sequential-samples", f->opt.keep_sequential_samples,
               "With --partitions: contiguous partitions, so the document order is the input order");
  app.add_option("--dataset-impl", f->dataset_impl, "Legacy Megatron flag; only mmap exists");
  app.add_flag(
      "--strict", f->opt.strict,
      "Fail on the first bad record, invalid UTF-8 or lone surrogate escape (default: skip or repair, count, report)");
  app.add_flag(
      "--endoftext-as-text", f->opt.endoftext_as_text,
      "Legacy: encode a literal <|endoftext|> in the text as ordinary tokens (Megatron's pre-2026 GPT-2 "
      "tokenizer, tiktoken encode_ordinary). Default: it becomes id 50256, as current Megatron-LM (Hugging Face)");
  f->batch_opt = app.add_option("--batch-mb", f->batch_mb,
                                "Input batch size in MiB handed to one worker (default: from the input size, "
                                "0.25 to 1, about 8 batches a worker)")
                     ->check(ptk::cli::RealIn(0, true, 4096, false))
                     ->default_str("");  // the 1 it holds is not the default: that comes from the input size
  app.add_option("--max-bad-fraction", f->opt.max_bad_fraction,
                 "Fail (publishing nothing) when more than this fraction of the non-blank records cannot be read "
                 "(default 0.01; 1 tolerates any)")
      ->check(ptk::cli::RealIn(0, false, 1, false));
  app.add_option("--resume-interval", f->opt.resume_interval_s,
                 "Seconds between resume points: a rerun after a kill continues from the last one (default 60; 0: "
                 "always start over)")
      ->check(ptk::cli::RealIn(0, false, ptk::cli::kMaxSeconds, false));
  app.add_flag("--quiet", f->quiet, "No progress line and no per-interval log lines");
  ptk::cli::AddLockWait(app, &f->opt.lock_wait);
  app.add_flag("--force", f->opt.force,
               "Tokenize again even when every output's .ptk-done sidecar records these inputs and settings (a "
               "rerun leaves such outputs as they are)");
}

// Megatron and NeMo flags ptk does not implement: each a usage error saying why.
void RefuseUnimplemented(ptk::cli::Refusals& refused) {
  refused.Flag("--split-sentences", "NLTK sentence splitting is not implemented");
  refused.Flag("--keep-newlines", "it goes with --split-sentences (NLTK sentence splitting)");
  refused.Option("--lang", "it goes with --split-sentences (NLTK sentence splitting)");
  refused.Flag("--apply-ftfy", "ftfy is a Python library; run it over the jsonl first, or drop the flag");
  refused.Flag("--need-pad-id", "it adds a pad token to the vocab (GPT-2 has none)");
  for (const char* retrieval :
       {"--delimiter", "--retrieval-db", "--chunk_size,--chunk-size", "--chunk_stride_size,--chunk-stride-size"})
    refused.Option(retrieval, "NeMo retrieval data is not implemented");
  // Megatron's tokenizer flags that change what GPT2BPETokenizer writes (--tokenizer-special-tokens:
  // its values other than <|endoftext|>, CheckSpecialTokens).
  refused.Option("--tokenizer-metadata",
                 "it chooses the tokenizer's library and class from a JSON file; ptk implements GPT2BPETokenizer");
}

// Megatron's tokenizer flags (preprocess_data.py takes every tokenizer's) that do not change what its
// GPT2BPETokenizer writes: accepted, as Megatron accepts them, and each noted when given.
void IgnoreAsMegatronDoes(ptk::cli::IgnoredFlags& ignored, TokenizeFlags* f) {
  ignored.Option("--vocab-size", "the vocab file defines the size", ptk::cli::ArgType::kInt);
  ignored.Option("--padded-vocab-size", "the model's padded vocabulary is training's, not preprocessing's",
                 ptk::cli::ArgType::kInt);
  ignored.Option("--vocab-extra-ids", "preprocess_data.py sets it to 0 (extra ids are BERT's and SentencePiece's)",
                 ptk::cli::ArgType::kInt);
  ignored.Flag("--tokenizer-hf-use-fast", "GPT-2's slow and fast Hugging Face tokenizers give the same ids");
  ignored.Flag("--tokenizer-hf-include-special-tokens", "GPT-2's Hugging Face tokenizer adds no token around a text");
  ignored.Flag("--trust-remote-code", "GPT-2's Hugging Face tokenizer runs no remote code");
  ignored.Option("--tiktoken-pattern", "it goes with --tokenizer-type TikTokenizer");
  ignored.Option("--tiktoken-num-special-tokens", "it goes with --tokenizer-type TikTokenizer",
                 ptk::cli::ArgType::kInt);
  ignored.List("--tiktoken-special-tokens", "it goes with --tokenizer-type TikTokenizer");
  ignored.Flag("--tokenizer-sentencepiece-legacy", "it goes with the SentencePiece --tokenizer-types");
  f->special_tokens_opt = ignored.List(
      "--tokenizer-special-tokens",
      "<|endoftext|> is GPT-2's special token already, and the legacy tokenizer (--legacy-tokenizer) reads none");
}

// --tokenizer-special-tokens: megatron-core 0.16.1's GPT2BPETokenizer (the Hugging Face GPT-2 tokenizer)
// adds them as special tokens, which changes its ids for any but <|endoftext|>; the legacy one reads
// none (tests/support/check_gpt2_special_tokens.py).
absl::Status CheckSpecialTokens(const TokenizeFlags& f) {
  if (f.legacy_tokenizer) return absl::OkStatus();
  for (const std::string& token : f.special_tokens_opt->results())
    if (token != "<|endoftext|>")
      return ptk::UsageError(fmt::format(
          "--tokenizer-special-tokens {}: not supported: Megatron's GPT2BPETokenizer (the Hugging Face GPT-2 "
          "tokenizer) adds it as a special token, which changes the ids: a new id after GPT-2's 50257 where the "
          "text holds it, or, for a token of GPT-2's vocabulary, split out of the words that hold it; ptk keeps "
          "GPT-2's tokens. Only <|endoftext|> (GPT-2's special token already) changes nothing, and with "
          "--legacy-tokenizer Megatron reads none",
          token));
  return absl::OkStatus();
}

// The checks the option table cannot make, then TokenizeOptions completed from the flags.
absl::Status CheckFlags(const ptk::cli::Refusals& refused, const ptk::cli::IgnoredFlags& ignored, TokenizeFlags& f) {
  if (f.tokenizer_type != "GPT2BPETokenizer")
    return ptk::UsageError(
        fmt::format("--tokenizer-type {} is not supported; ptk implements GPT2BPETokenizer", f.tokenizer_type));
  if (f.dataset_impl != "mmap")
    return ptk::UsageError(fmt::format("--dataset-impl {}: only mmap is supported", f.dataset_impl));
  PTK_RETURN_IF_ERROR(refused.Check());
  PTK_RETURN_IF_ERROR(ignored.CheckValues());  // --vocab-size abc: refused by Megatron's argparse (type=int)
  PTK_RETURN_IF_ERROR(CheckSpecialTokens(f));
  // Megatron's GPT2BPETokenizer reads no model; but Megatron has no default --tokenizer-type, so a model
  // without one is a SentencePiece/tiktoken run meant, which ptk's GPT-2 default would silently replace.
  if (f.tokenizer_model && *f.tokenizer_model != "None") {
    if (f.tokenizer_type_opt->count() == 0)
      return ptk::UsageError(fmt::format(
          "--tokenizer-model {} is not supported: SentencePiece/tiktoken models are not implemented (GPT-2 BPE "
          "only, which takes no model: drop the flag)",
          *f.tokenizer_model));
    ptk::log::Warning(
        "--tokenizer-model {}: ignored, as Megatron does with GPT2BPETokenizer: it reads no model (SentencePiece and "
        "tiktoken models go with other --tokenizer-types, which ptk does not implement)",
        *f.tokenizer_model);
  }
  ignored.Note();
  if (f.legacy_tokenizer) f.opt.endoftext_as_text = true;  // the legacy tokenizer's one difference
  if (f.tokenizer_library != "megatron")
    return ptk::UsageError(fmt::format(
        "--tokenizer-library {} is not supported: only megatron (GPT-2 BPE) is; use NeMo's script for others",
        f.tokenizer_library));
  if (f.preproc_folder) {
    if (f.inputs.size() != 1 || !ptk::IsDirectory(f.inputs[0]))
      return ptk::UsageError("--preproc-folder: --input must name one directory");
    if (f.files_filter.empty()) f.files_filter = "**/*.json*";  // NeMo's default
  }
  if (!f.files_filter.empty() &&
      std::none_of(f.inputs.begin(), f.inputs.end(), [](const std::string& in) { return ptk::IsDirectory(in); }))
    return ptk::UsageError(fmt::format(
        "--files-filter {:?} selects files below an --input directory, and no --input is one", f.files_filter));
  if (f.vocab_file.empty() != f.merge_file.empty()) return ptk::UsageError("--vocab-file and --merge-file go together");
  PTK_RETURN_IF_ERROR(
      ptk::cli::CheckOutputPrefix("--output-prefix", f.opt.output_prefix,
                                  "_" + (f.opt.json_keys.empty() ? "text" : f.opt.json_keys[0]) + "_document.bin"));
  PTK_RETURN_IF_ERROR(ptk::cli::CheckGpt2FileFlags(f.vocab_file, f.merge_file));
  for (const std::string& key : f.opt.json_keys)  // a dataset's name given for the prefix
    if (const std::string tail = "_" + key + "_document";
        f.opt.output_prefix.size() > tail.size() && f.opt.output_prefix.ends_with(tail))
      ptk::log::Warning(
          "--output-prefix {} ends in {}, which ptk-tokenize (as Megatron) appends itself: the output is {}; give "
          "--output-prefix {} for {}",
          f.opt.output_prefix, tail, ptk::OutputPrefixFor(f.opt.output_prefix, key),
          f.opt.output_prefix.substr(0, f.opt.output_prefix.size() - tail.size()), f.opt.output_prefix);
  PTK_ASSIGN_OR_RETURN(f.opt.inputs, ptk::ExpandTokenizeInputs(f.inputs, f.files_filter));
  // A missing output directory is created (as ptk-extract's and ptk-concat's --output-dir), once the
  // inputs are known to exist: before any tokenizing.
  PTK_RETURN_IF_ERROR(ptk::cli::CreateOutputDirectory("--output-prefix", f.opt.output_prefix));
  f.opt.workers = f.workers;
  if (f.workers_opt->count() == 0) {
    if (!f.quiet)
      ptk::log::Info("{} worker{}: the CPUs this process may use ({})", f.workers, f.workers == 1 ? "" : "s",
                     f.cpus.reason);
  } else if (const std::string note = ptk::OversubscriptionNote("--workers", f.workers, f.cpus); !note.empty()) {
    ptk::log::Warning("{}", note);
  }
  if (f.batch_opt->count() > 0) f.opt.batch_bytes = std::max<size_t>(1, static_cast<size_t>(f.batch_mb * (1 << 20)));
  f.opt.progress = !f.quiet;
  f.opt.megatron_log = !f.quiet;
  return absl::OkStatus();
}

// What a run did, as the log's last lines.
void ReportStats(const ptk::TokenizeStats& s, int workers) {
  if (s.up_to_date) {
    for (const auto& p : s.outputs)
      ptk::log::Info(
          "{}: up to date, not rewritten: its .ptk-done sidecar records these inputs and settings "
          "(--force tokenizes again)",
          p);
    ptk::log::Info("done: nothing to do ({} documents, {} tokens already written)", s.documents, s.tokens);
    return;
  }

  ptk::log::Info(
      "done: {} documents ({} empty), {} tokens from {:.1f} MB of JSON lines in {:.2f} s ({:.1f} MB/s, {} workers)",
      s.documents, s.empty_documents, s.tokens, s.bytes / 1e6, s.seconds, s.bytes / 1e6 / std::max(s.seconds, 1e-9),
      workers);
  if (s.skipped > 0) {
    std::string kinds;
    for (int k = 1; k < 6; ++k)
      if (s.skipped_by_kind[k] > 0)
        kinds += fmt::format("{}{} {}", kinds.empty() ? "" : ", ", s.skipped_by_kind[k],
                             ptk::RecordStatusName(static_cast<ptk::RecordStatus>(k)));
    ptk::log::Warning("skipped {} bad records of {} lines ({})", s.skipped, s.lines, kinds);
  }
  if (s.invalid_utf8 > 0 || s.lone_surrogates > 0)
    ptk::log::Warning("replaced {} invalid UTF-8 sequences and {} lone surrogate escapes with U+FFFD", s.invalid_utf8,
                      s.lone_surrogates);
  for (const auto& p : s.outputs) ptk::log::Info("wrote {}.bin and {}.idx", p, p);
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp(
      "ptk-tokenize",
      "Tokenize jsonl (plain, .zst, .xz, .gz or - for stdin) with GPT-2 BPE into Megatron .bin/.idx files, "
      "byte-identical "
      "to Megatron-LM's tools/preprocess_data.py with the same flags. Outputs: PREFIX_{key}_document.{bin,idx}.");
  TokenizeFlags f;
  AddOptions(*app, &f);
  ptk::cli::Refusals refused(*app);
  RefuseUnimplemented(refused);
  ptk::cli::IgnoredFlags ignored(*app, "as Megatron does with GPT2BPETokenizer");
  IgnoreAsMegatronDoes(ignored, &f);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(CheckFlags(refused, ignored, f));
    PTK_ASSIGN_OR_RETURN(auto tok, ptk::Gpt2Tokenizer::LoadOrDefault(f.vocab_file, f.merge_file));
    PTK_ASSIGN_OR_RETURN(ptk::TokenizeStats s, ptk::RunTokenize(f.opt, *tok));
    ReportStats(s, f.workers);
    return absl::OkStatus();
  });
}
