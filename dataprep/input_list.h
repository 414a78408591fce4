// Expanding the inputs of the dataprep tools: files, globs and directories, in a documented order.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

enum class PathOrder {
  kNatural,  // digit runs by value: shard2 < shard10 (default)
  kBytes,    // C-locale byte order, what `ls`/bash globs give with LC_ALL=C (NeMo's concat.sh)
};

struct InputFile {
  std::string path;  // as found
  std::string rel;   // path below the directory argument it came from; the base name otherwise
};

// Files: kept. Globs: expanded. Directories: every regular file below whose name ends with one of
// `dir_suffixes` (recursively). The whole list is then sorted by `order` (of the paths) and
// de-duplicated.
absl::StatusOr<std::vector<InputFile>> CollectInputFiles(const std::vector<std::string>& args,
                                                         const std::vector<std::string>& dir_suffixes, PathOrder order);
absl::StatusOr<std::vector<std::string>> CollectInputs(const std::vector<std::string>& args,
                                                       const std::vector<std::string>& dir_suffixes, PathOrder order);

// ptk-tokenize's inputs: files and globs as given (each glob's matches in natural order). A
// directory stands for every regular file below it, extension-less ones such as WikiExtractor's
// wiki_00 included (hidden files, ptk's own sidecars, locks and temporaries, and Megatron outputs
// *_document.bin/.idx left out), in natural order; with `filter` (NeMo's --files-filter, e.g.
// "**/*.json*") only those whose path below the directory matches it.
absl::StatusOr<std::vector<std::string>> ExpandTokenizeInputs(const std::vector<std::string>& args,
                                                              const std::string& filter);

void SortPaths(std::vector<std::string>* paths, PathOrder order);

}  // namespace ptk
