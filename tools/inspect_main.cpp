// ptk-inspect: summary, documents, integrity and statistics of a Megatron .bin/.idx dataset.
#include <cstdint>
#include <cstdio>
#include <memory>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/utf8.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/indexed_dataset.h"
#include "indexed_dataset/inspect.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace {

// Ids the tokenizer has no entry for (a dataset of another tokenizer) decode to nothing: without a
// note the text read as whole. Empty when every id is the tokenizer's.
std::string UnknownIdsNote(const ptk::Gpt2Tokenizer& tok, const std::vector<int32_t>& ids) {
  int64_t n = 0, first = 0;
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size())
      if (n++ == 0) first = id;
  if (n == 0) return "";
  return fmt::format(
      "\n(not shown: {} id(s) the tokenizer's {} entries do not hold, the first {}: a dataset of another tokenizer? "
      "give its --vocab-file and --merge-file)",
      n, tok.vocab_size(), first);
}

// A GPTDataset sample's text. A sample starts and ends at token boundaries anywhere in a document,
// and byte-level BPE tokens split characters: the bytes of characters cut at the edges would show
// as U+FFFD and read as damage. They are left out, and a note says so.
std::string SampleText(const ptk::Gpt2Tokenizer& tok, const std::vector<int32_t>& ids) {
  const std::string raw = tok.DecodeBytes(ids);
  auto continuation = [&](size_t i) { return (static_cast<unsigned char>(raw[i]) & 0xC0) == 0x80; };
  size_t head = 0;
  while (head < raw.size() && head < 3 && continuation(head)) ++head;
  size_t tail = 0;  // bytes of a character begun in the last 3 bytes but not finished
  for (size_t back = 1; back <= 3 && back <= raw.size() - head; ++back) {
    const unsigned char c = static_cast<unsigned char>(raw[raw.size() - back]);
    if ((c & 0xC0) == 0x80) continue;
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) tail = back;
    break;
  }
  std::string text;
  ptk::AppendUtf8Replacing(std::string_view(raw).substr(head, raw.size() - head - tail), &text);
  if (head > 0 || tail > 0)
    text += fmt::format(
        "\n(not shown: {} byte(s) of the character the sample starts inside, {} of the one it ends "
        "inside; byte-level BPE tokens split characters)",
        head, tail);
  return text;
}

// Every flag's value.
struct InspectFlags {
  std::string prefix, vocab_file, merge_file, format = "both";
  int64_t doc = -1;
  bool verify = false, stats = false, multimodal = false;
  // --sample: Megatron's GPTDataset / BlendedDataset view of the data.
  int64_t sample = -1, seq_length = 0, seed = 1234;
  double surplus = 0.005;
  std::vector<std::string> data_path, train_path, valid_path, test_path;
  std::string split = "969, 30, 1", sample_split = "train", cache_path;
  std::optional<int64_t> train_samples, valid_samples, test_samples;
  bool eod_mask_loss = false, reset_position_ids = false, write_cache = false;
  bool sample_given = false;
};

// Returns the --sample option (whether it was given is known only after parsing).
CLI::Option* AddFlags(CLI::App& app, InspectFlags& f) {
  app.add_option("prefix", f.prefix, "Dataset: PREFIX, PREFIX.bin or PREFIX.idx");
  app.add_option("--doc", f.doc, "Print document N (0-based): its token ids and decoded text")
      ->check(ptk::cli::IntIn(0, INT64_MAX));
  app.add_option("--format", f.format, "What --doc or --sample prints: ids, text or both")
      ->check(CLI::IsMember({"ids", "text", "both"}));
  app.add_flag("--verify", f.verify,
               "Check integrity (header, sizes, pointers, document indices, .bin size); exit 1 on damage");
  app.add_flag("--stats", f.stats, "Print a histogram of document lengths");
  app.add_flag("--multimodal", f.multimodal, "The index carries a per-sequence modes array");
  app.add_option("--vocab-file", f.vocab_file, "GPT-2 vocab.json for decoding (default: the built-in GPT-2 vocab)");
  app.add_option("--merge-file", f.merge_file, "GPT-2 merges.txt for decoding (default: the built-in GPT-2 merges)");
  auto* sample_opt =
      app.add_option("--sample", f.sample, "Print top-level sample I as Megatron's GPTDataset/BlendedDataset gives it")
          ->check(ptk::cli::IntIn(0, INT64_MAX));
  app.add_option("--data-path", f.data_path, "Megatron's --data-path (default: the prefix): 'p' or 'w1 p1 w2 p2 ...'");
  app.add_option("--train-data-path", f.train_path, "Megatron's --train-data-path");
  app.add_option("--valid-data-path", f.valid_path, "Megatron's --valid-data-path");
  app.add_option("--test-data-path", f.test_path, "Megatron's --test-data-path");
  app.add_option("--split", f.split, "Megatron's --split");
  app.add_option("--seq-length", f.seq_length, "Megatron's --seq-length (required with --sample)")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  // numpy's RandomState takes seeds in [0, 2**32): another would wrap (4294967296 is seed 0).
  app.add_option("--seed", f.seed, "Megatron's --seed")->check(ptk::cli::IntIn(0, 4294967295));
  app.add_option("--sample-split", f.sample_split, "Which split --sample reads")
      ->check(CLI::IsMember({"train", "valid", "test"}));
  app.add_option("--train-samples", f.train_samples,
                 "Samples of the train split (Megatron: --train-samples or train_iters*GBS)")
      ->check(ptk::cli::IntIn(0, INT64_MAX));
  app.add_option("--valid-samples", f.valid_samples,
                 "Samples of the valid split (Megatron: (iters//eval_interval+1)*eval_iters*GBS)")
      ->check(ptk::cli::IntIn(0, INT64_MAX));
  app.add_option("--test-samples", f.test_samples, "Samples of the test split (Megatron: eval_iters*GBS)")
      ->check(ptk::cli::IntIn(0, INT64_MAX));
  app.add_option("--data-cache-path", f.cache_path,
                 "Megatron's --data-cache-path (index cache read from and, with --write-cache, written to)");
  app.add_option("--mid-level-dataset-surplus", f.surplus, "Megatron's --mid-level-dataset-surplus")
      ->check(ptk::cli::RealIn(0, false, 1e6, false));
  app.add_flag("--eod-mask-loss", f.eod_mask_loss, "Megatron's --eod-mask-loss");
  app.add_flag("--reset-position-ids", f.reset_position_ids, "Megatron's --reset-position-ids");
  app.add_flag("--write-cache", f.write_cache,
               "Save the index cache the way Megatron does (off by default: inspect only reads); one that cannot be "
               "saved is an error (exit 1; 3 on a full disk)");
  return sample_opt;
}

// --sample: top-level sample f.sample of Megatron's datasets, as text (decode given) or ids; `eod` is
// the end of document --eod-mask-loss and --reset-position-ids look for.
absl::Status PrintSample(const InspectFlags& f, const ptk::Gpt2Tokenizer* tok, int32_t eod) {
  if (f.seq_length == 0) return ptk::UsageError("--sample needs --seq-length");  // 1: GPTDataset says why not
  ptk::DecodeFn decode;
  if (tok != nullptr)
    decode = [tok](const std::vector<int32_t>& ids) { return SampleText(*tok, ids) + UnknownIdsNote(*tok, ids); };
  ptk::DataArgs args;
  args.data_path =
      f.data_path.empty() && f.train_path.empty() && f.valid_path.empty() && f.test_path.empty() && !f.prefix.empty()
          ? std::vector<std::string>{f.prefix}
          : f.data_path;
  args.per_split_data_path = {f.train_path, f.valid_path, f.test_path};
  args.split = f.split;
  args.sizes = {f.train_samples, f.valid_samples, f.test_samples};
  ptk::GPTDatasetConfig cfg;
  cfg.sequence_length = f.seq_length;
  cfg.random_seed = static_cast<uint32_t>(f.seed);
  cfg.tokenizer = ptk::Gpt2TokenizerIdentifiers(f.vocab_file.empty() ? "gpt2-vocab.json" : f.vocab_file,
                                                f.merge_file.empty() ? "gpt2-merges.txt" : f.merge_file);
  if (!f.cache_path.empty()) cfg.path_to_cache = f.cache_path;
  cfg.write_cache = f.write_cache;
  cfg.cache_write_required = f.write_cache;  // its point: a cache that cannot be saved is an error, not a warning
  cfg.mid_level_dataset_surplus = f.surplus;
  cfg.eod_mask_loss = f.eod_mask_loss;
  cfg.reset_position_ids = f.reset_position_ids;
  cfg.eod = eod;
  const ptk::Split which = f.sample_split == "train"   ? ptk::Split::kTrain
                           : f.sample_split == "valid" ? ptk::Split::kValid
                                                       : ptk::Split::kTest;
  std::vector<std::string> warnings;
  PTK_ASSIGN_OR_RETURN(std::string text, ptk::FormatGPTSample(args, cfg, which, f.sample, decode, &warnings));
  for (const std::string& w : warnings) ptk::log::Warning("{}", w);
  std::fwrite(text.data(), 1, text.size(), stdout);  // whole: a decoded text may hold U+0000
  return absl::OkStatus();
}

// The dataset PREFIX itself: --verify, --doc, the summary and --stats.
absl::Status InspectDataset(const InspectFlags& f, const ptk::Gpt2Tokenizer* tok) {
  if (f.prefix.empty()) return ptk::UsageError("give the dataset PREFIX");
  PTK_ASSIGN_OR_RETURN(const std::string prefix, ptk::ResolveDatasetPrefix(f.prefix));  // PREFIX, .bin or .idx
  PTK_ASSIGN_OR_RETURN(auto ds, ptk::IndexedDataset::Open(prefix, f.multimodal));
  for (const std::string& w : {ds->IdxTrailingBytesWarning(), ds->BinTrailingBytesWarning()})
    if (!w.empty()) ptk::log::Warning("{}", w);
  if (f.verify) {
    PTK_ASSIGN_OR_RETURN(bool summed, ds->VerifyChecksums());
    std::string trailing;
    if (ds->idx_trailing_bytes() > 0)
      trailing += fmt::format(" (the index's {} trailing bytes ignored)", ds->idx_trailing_bytes());
    if (ds->bin_trailing_bytes() > 0)
      trailing += fmt::format(" (the data's {} trailing bytes ignored)", ds->bin_trailing_bytes());
    std::printf("OK: %s: %lld documents, %lld sequences, %lld tokens; index and data consistent%s; %s\n",
                prefix.c_str(), static_cast<long long>(ds->num_documents()),
                static_cast<long long>(ds->num_sequences()), static_cast<long long>(ds->num_tokens()), trailing.c_str(),
                summed ? "checksums match the .ptk-done sidecar" : "no .ptk-done sidecar, so no checksums to check");
    if (f.doc < 0 && !f.stats) return absl::OkStatus();
  }
  if (f.doc >= 0) {
    ptk::DecodeFn decode;
    if (tok != nullptr)
      decode = [tok](const std::vector<int32_t>& ids) { return tok->Decode(ids) + UnknownIdsNote(*tok, ids); };
    PTK_ASSIGN_OR_RETURN(std::string text, ptk::FormatDocument(*ds, f.doc, f.format != "text", decode));
    std::fwrite(text.data(), 1, text.size(), stdout);  // whole: a decoded text may hold U+0000
    return absl::OkStatus();
  }
  ptk::DatasetSummary s = ptk::Summarize(*ds);
  if (!f.verify) std::fputs(ptk::FormatSummary(*ds, s).c_str(), stdout);
  if (f.stats) std::fputs(ptk::FormatHistogram(s).c_str(), stdout);
  return absl::OkStatus();
}

// Flags that would be ignored in this combination: a usage error naming them (--stats beside --doc,
// --verify beside --sample, --seq-length without --sample printed or checked nothing, exit 0).
absl::Status CheckCombination(const CLI::App& app, const InspectFlags& f) {
  auto given = [&](const char* name) { return app.get_option(name)->count() > 0; };
  if (f.sample_given) {
    for (const char* name : {"--doc", "--stats", "--verify"})
      if (given(name))
        return ptk::UsageError(fmt::format(
            "{} inspects the dataset PREFIX; --sample prints a sample of Megatron's datasets: run them separately",
            name));
    if (!f.prefix.empty())
      for (const char* name : {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"})
        if (given(name))
          return ptk::UsageError(
              fmt::format("--sample reads the datasets of {} and ignores PREFIX {}: give one of them", name, f.prefix));
  } else {
    for (const char* name :
         {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--split", "--seq-length",
          "--seed", "--sample-split", "--train-samples", "--valid-samples", "--test-samples", "--data-cache-path",
          "--mid-level-dataset-surplus", "--eod-mask-loss", "--reset-position-ids", "--write-cache"})
      if (given(name)) return ptk::UsageError(fmt::format("{} goes with --sample I, which is not given", name));
    if (given("--doc") && given("--stats"))
      return ptk::UsageError("--stats prints the histogram with the summary, --doc one document: give one of them");
  }
  if (given("--format") && !given("--doc") && !f.sample_given)
    return ptk::UsageError("--format says what --doc or --sample prints; neither is given");
  // Read only to decode (and, for --sample, to name the index cache): beside --verify, --stats or the
  // summary a vocabulary that does not even exist was ignored, exit 0.
  if (!f.sample_given && !(given("--doc") && f.format != "ids"))
    for (const char* name : {"--vocab-file", "--merge-file"})
      if (given(name))
        return ptk::UsageError(fmt::format("{} decodes the text --doc or --sample prints; {}", name,
                                           given("--doc") ? "--format ids prints none" : "neither is given"));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp("ptk-inspect", "Inspect a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).");
  InspectFlags flags;
  CLI::Option* sample_opt = AddFlags(*app, flags);
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;
  flags.sample_given = sample_opt->count() > 0;

  return ptk::cli::RunMain([&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(CheckCombination(*app, flags));
    std::unique_ptr<ptk::Gpt2Tokenizer> tok;  // only when something is decoded
    if (flags.format != "ids" && (flags.doc >= 0 || flags.sample_given)) {
      PTK_RETURN_IF_ERROR(ptk::cli::CheckGpt2FileFlags(flags.vocab_file, flags.merge_file));
      PTK_ASSIGN_OR_RETURN(tok, ptk::Gpt2Tokenizer::LoadOrDefault(flags.vocab_file, flags.merge_file));
    }
    if (flags.sample_given) {
      // Megatron's tokenizer.eod: --vocab-file's <|endoftext|> (was always GPT-2's 50256, so with
      // another vocabulary --eod-mask-loss and --reset-position-ids looked for a token it did not mean).
      int32_t eod = 50256;
      if (flags.eod_mask_loss || flags.reset_position_ids) {
        std::unique_ptr<ptk::Gpt2Tokenizer> vocab;
        if (tok == nullptr) {  // --format ids: read for its <|endoftext|> only
          PTK_RETURN_IF_ERROR(ptk::cli::CheckGpt2FileFlags(flags.vocab_file, flags.merge_file));
          PTK_ASSIGN_OR_RETURN(vocab, ptk::Gpt2Tokenizer::LoadOrDefault(flags.vocab_file, flags.merge_file));
        }
        eod = (tok != nullptr ? tok : vocab)->eod();
      }
      return PrintSample(flags, tok.get(), eod);
    }
    return InspectDataset(flags, tok.get());
  });
}
