// Summaries and statistics of an indexed dataset.
#include "indexed_dataset/inspect.h"

#include <algorithm>

#include <fmt/core.h>

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
  out += fmt::format("dtype:       {} (code {}, {} bytes per token)\n", DTypeName(ds.dtype()), static_cast<int>(ds.dtype()),
                     ds.itemsize());
  out += fmt::format("documents:   {}\n", s.documents);
  out += fmt::format("sequences:   {}\n", s.sequences);
  out += fmt::format("tokens:      {}\n", s.tokens);
  out += fmt::format("bin bytes:   {}\n", ds.bin_size());
  out += fmt::format("idx bytes:   {}\n", ds.idx_size());
  out += fmt::format("doc tokens:  min {}, mean {:.2f}, max {}\n", s.min_doc_tokens, s.mean_doc_tokens, s.max_doc_tokens);
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

}  // namespace ptk
