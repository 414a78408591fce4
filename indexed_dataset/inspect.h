// Summaries and statistics of an indexed dataset (used by ptk-inspect).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace ptk
