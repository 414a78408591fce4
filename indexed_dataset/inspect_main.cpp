// ptk-inspect: summary, documents, integrity and statistics of a Megatron .bin/.idx dataset.
#include <cstdio>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/logging.h"
#include "common/status.h"
#include "indexed_dataset/indexed_dataset.h"
#include "indexed_dataset/inspect.h"
#include "tokenizer/gpt2_tokenizer.h"

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp("ptk-inspect", "Inspect a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).");
  std::string prefix, vocab_file, merge_file, format = "both";
  int64_t doc = -1;
  bool verify = false, stats = false, multimodal = false;
  app->add_option("prefix", prefix, "Dataset path without .bin/.idx")->required();
  app->add_option("--doc", doc, "Print document N (0-based): its token ids and decoded text");
  app->add_option("--format", format, "What --doc prints: ids, text or both")->check(CLI::IsMember({"ids", "text", "both"}));
  app->add_flag("--verify", verify, "Check integrity (header, sizes, pointers, document indices, .bin size); exit 1 on damage");
  app->add_flag("--stats", stats, "Print a histogram of document lengths");
  app->add_flag("--multimodal", multimodal, "The index carries a per-sequence modes array");
  app->add_option("--vocab-file", vocab_file, "GPT-2 vocab.json for decoding (default: the built-in GPT-2 vocab)");
  app->add_option("--merge-file", merge_file, "GPT-2 merges.txt for decoding (default: the built-in GPT-2 merges)");
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    PTK_ASSIGN_OR_RETURN(auto ds, ptk::IndexedDataset::Open(prefix, multimodal));
    if (verify) {
      PTK_RETURN_IF_ERROR(ds->Verify());
      std::printf("OK: %s: %lld documents, %lld sequences, %lld tokens; index and data consistent\n", prefix.c_str(),
                  static_cast<long long>(ds->num_documents()), static_cast<long long>(ds->num_sequences()),
                  static_cast<long long>(ds->num_tokens()));
      if (doc < 0 && !stats) return absl::OkStatus();
    }
    if (doc >= 0) {
      if (doc >= ds->num_documents())
        return absl::OutOfRangeError(fmt::format("--doc {}: the dataset has {} documents", doc, ds->num_documents()));
      ptk::TokenSpan span = ds->document(doc);
      std::vector<int32_t> ids(static_cast<size_t>(span.size));
      for (int64_t i = 0; i < span.size; ++i) ids[i] = static_cast<int32_t>(span[i]);
      std::printf("document %lld: %lld tokens in %lld sequences\n", static_cast<long long>(doc),
                  static_cast<long long>(span.size), static_cast<long long>(ds->document_num_sequences(doc)));
      if (format != "text") {
        std::string line = "ids:";
        for (int32_t id : ids) line += fmt::format(" {}", id);
        std::printf("%s\n", line.c_str());
      }
      if (format != "ids") {
        std::unique_ptr<ptk::Gpt2Tokenizer> tok;
        if (!vocab_file.empty() || !merge_file.empty()) {
          if (vocab_file.empty() || merge_file.empty()) return ptk::cli::UsageError("--vocab-file and --merge-file go together");
          PTK_ASSIGN_OR_RETURN(tok, ptk::Gpt2Tokenizer::Load(vocab_file, merge_file));
        } else {
          PTK_ASSIGN_OR_RETURN(tok, ptk::Gpt2Tokenizer::LoadDefault());
        }
        std::string text = tok->Decode(ids);
        std::printf("text:\n%s\n", text.c_str());
      }
      return absl::OkStatus();
    }
    ptk::DatasetSummary s = ptk::Summarize(*ds);
    if (!verify) std::fputs(ptk::FormatSummary(*ds, s).c_str(), stdout);
    if (stats) std::fputs(ptk::FormatHistogram(s).c_str(), stdout);
    return absl::OkStatus();
  });
}
