// Summaries and statistics of an indexed dataset (used by ptk-inspect).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/indexed_dataset.h"

namespace ptk {

struct DatasetSummary {
  int64_t documents = 0, sequences = 0, tokens = 0, empty_documents = 0;
  int64_t min_doc_tokens = 0, max_doc_tokens = 0;
  double mean_doc_tokens = 0;
  // Histogram of document lengths: bucket 0 = empty, bucket k>=1 = [2^(k-1), 2^k).
  std::vector<int64_t> histogram;
};

DatasetSummary Summarize(const IndexedDataset& ds);
std::string FormatSummary(const IndexedDataset& ds, const DatasetSummary& s);
std::string FormatHistogram(const DatasetSummary& s);

// Turns token ids into text (the caller's tokenizer); null: ids only.
using DecodeFn = std::function<std::string(const std::vector<int32_t>&)>;

// Document `doc`: its size, ids (with `ids`) and text (with `decode`).
absl::StatusOr<std::string> FormatDocument(const IndexedDataset& ds, int64_t doc, bool ids, const DecodeFn& decode);

// Sample `index` of one split of Megatron's GPTDataset/BlendedDataset built from `args`/`config`,
// as __getitem__ gives it: tokens, labels' last id, loss-mask zeros, and the text with `decode`.
// What the caller should print (BuildGPTDatasets' warnings) goes to *warnings.
absl::StatusOr<std::string> FormatGPTSample(const DataArgs& args, const GPTDatasetConfig& config, Split split,
                                            int64_t index, const DecodeFn& decode,
                                            std::vector<std::string>* warnings = nullptr);

}  // namespace ptk
