// Summaries and statistics of an indexed dataset.
#include "indexed_dataset/inspect.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

DatasetSummary Summarize(const IndexedDataset& ds) {
  DatasetSummary s;
  s.documents = ds.num_documents();
  s.sequences = ds.num_sequences();
  s.tokens = ds.num_tokens();
  s.min_doc_tokens = s.documents > 0 ? INT64_MAX : 0;
  for (int64_t d = 0; d < s.documents; ++d) {
    int64_t n = ds.document_length(d);
    s.min_doc_tokens = std::min(s.min_doc_tokens, n);
    s.max_doc_tokens = std::max(s.max_doc_tokens, n);
    if (n == 0) ++s.empty_documents;
    size_t bucket = n == 0 ? 0 : static_cast<size_t>(64 - __builtin_clzll(static_cast<uint64_t>(n)));
    if (s.histogram.size() <= bucket) s.histogram.resize(bucket + 1, 0);
    ++s.histogram[bucket];
  }
  s.mean_doc_tokens = s.documents > 0 ? static_cast<double>(s.tokens) / s.documents : 0;
  return s;
}

std::string FormatSummary(const IndexedDataset& ds, const DatasetSummary& s) {
  std::string out;
  out += fmt::format("prefix:      {}\n", ds.prefix());
  out += fmt::format("dtype:       {} (code {}, {} bytes per token)\n", DTypeName(ds.dtype()),
                     static_cast<int>(ds.dtype()), ds.itemsize());
  out += fmt::format("documents:   {}\n", s.documents);
  out += fmt::format("sequences:   {}\n", s.sequences);
  out += fmt::format("tokens:      {}\n", s.tokens);
  out += fmt::format("bin bytes:   {}\n", ds.bin_size());
  out += fmt::format("idx bytes:   {}\n", ds.idx_size());
  out +=
      fmt::format("doc tokens:  min {}, mean {:.2f}, max {}\n", s.min_doc_tokens, s.mean_doc_tokens, s.max_doc_tokens);
  out += fmt::format("empty docs:  {}\n", s.empty_documents);
  return out;
}

std::string FormatHistogram(const DatasetSummary& s) {
  std::string out = "document length histogram (tokens):\n";
  int64_t peak = 1;
  for (int64_t c : s.histogram) peak = std::max(peak, c);
  for (size_t b = 0; b < s.histogram.size(); ++b) {
    std::string range = b == 0 ? "0" : fmt::format("[{}, {})", 1ull << (b - 1), 1ull << b);
    int bar = static_cast<int>(40.0 * s.histogram[b] / peak + 0.5);
    out += fmt::format("  {:>22} {:>12} {}\n", range, s.histogram[b], std::string(bar, '#'));
  }
  return out;
}

absl::StatusOr<std::string> FormatDocument(const IndexedDataset& ds, int64_t doc, bool ids, const DecodeFn& decode) {
  if (doc < 0 || doc >= ds.num_documents())
    return absl::OutOfRangeError(fmt::format("--doc {}: the dataset has {} documents", doc, ds.num_documents()));
  TokenSpan span = ds.document(doc);
  std::vector<int32_t> v(static_cast<size_t>(span.size));
  for (int64_t i = 0; i < span.size; ++i) v[i] = static_cast<int32_t>(span[i]);
  std::string out =
      fmt::format("document {}: {} tokens in {} sequences\n", doc, span.size, ds.document_num_sequences(doc));
  if (ids) {
    out += "ids:";
    for (int32_t id : v) out += fmt::format(" {}", id);
    out += "\n";
  }
  if (decode) out += "text:\n" + decode(v) + "\n";
  return out;
}

absl::StatusOr<std::string> FormatGPTSample(const DataArgs& args, const GPTDatasetConfig& config, Split split,
                                            int64_t index, const DecodeFn& decode, std::vector<std::string>* warnings) {
  PTK_ASSIGN_OR_RETURN(auto sets, BuildGPTDatasets(args, config, warnings));
  const int which = static_cast<int>(split);
  if (!sets[which])
    return absl::NotFoundError(fmt::format("the {} split is empty with these arguments", SplitName(split)));
  const TopLevelDataset& ds = *sets[which];
  if (index < 0 || index >= ds.size())
    return absl::OutOfRangeError(
        fmt::format("--sample {}: the {} split has {} samples", index, SplitName(split), ds.size()));
  GPTSample s;
  PTK_RETURN_IF_ERROR(ds.Get(index, &s));
  std::string out =
      fmt::format("{} split: {} samples ({}, index cache {}), seq_length {}\n", SplitName(split), ds.size(),
                  ds.description().find("BlendedDataset") != std::string::npos ? "BlendedDataset" : "GPTDataset",
                  ds.loaded_from_cache() ? "loaded" : "built", config.sequence_length);
  out += fmt::format("sample {} (dataset {}):\ntokens:", index, s.dataset_id);
  for (int64_t t : s.tokens) out += fmt::format(" {}", t);
  int masked = 0;
  for (float m : s.loss_mask) masked += m == 0.0f;
  out += fmt::format("\nlabels: tokens shifted by one, last {}; loss_mask zeros: {}\n", s.labels.back(), masked);
  if (decode) out += "text:\n" + decode(std::vector<int32_t>(s.tokens.begin(), s.tokens.end())) + "\n";
  return out;
}

}  // namespace ptk
