// What ResolveDatasetPrefix says when nothing is at a dataset prefix: the datasets a directory holds,
// and the name most likely meant.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ptk {

// The datasets a directory holds (PREFIX.idx beside PREFIX.bin), by the prefixes that name them.
std::vector<std::string> DatasetsIn(const std::string& dir);

// NotFound for ARG (PREFIX: ARG without .bin/.idx), where no dataset and no half of one is: a file that is
// not a dataset (the jsonl itself: tokenize it first), a misspelt name beside datasets (the nearest
// ones), a directory that does not exist, or else that neither PREFIX.idx nor PREFIX.bin exists.
absl::Status NoDatasetAt(const std::string& arg, const std::string& prefix);

}  // namespace ptk
