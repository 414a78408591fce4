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

void SortPaths(std::vector<std::string>* paths, PathOrder order);

}  // namespace ptk
