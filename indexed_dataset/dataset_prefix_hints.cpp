// The hints of a dataset prefix with nothing at it (dataset_prefix_hints.h).
#include "indexed_dataset/dataset_prefix_hints.h"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/file_paths.h"
#include "indexed_dataset/indexed_dataset.h"

namespace ptk {

std::vector<std::string> DatasetsIn(const std::string& dir) {
  std::vector<std::string> held;
  auto found = ExpandGlobs({JoinPath(dir, "*.idx")});
  if (!found.ok()) return held;
  for (const auto& idx : *found)
    if (std::string prefix = idx.substr(0, idx.size() - 4); PathExists(BinPath(prefix))) held.push_back(prefix);
  return held;
}

absl::Status NoDatasetAt(const std::string& arg, const std::string& prefix) {
  const std::string none =
      fmt::format("{}: no dataset here (neither {} nor {} exists)", arg, IdxPath(prefix), BinPath(prefix));
  if (PathExists(arg) && !IsDirectory(arg)) {
    const bool text = arg.find(".json") != std::string::npos || arg.find(".txt") != std::string::npos;
    return absl::NotFoundError(fmt::format(
        "{}: no dataset here: a file, not a dataset (a PREFIX.bin and PREFIX.idx pair, named by PREFIX){}", arg,
        text ? fmt::format("; tokenize it first: ptk-tokenize --input {} --output-prefix NAME writes the dataset "
                           "NAME_text_document",
                           arg)
             : ""));
  }
  const std::string dir = Dirname(prefix);
  if (!IsDirectory(dir)) return absl::NotFoundError(fmt::format("{}; there is no directory {}", none, dir));
  // The datasets beside it whose names are within a few edits of the one given (a typo: my_text_documnt).
  const std::string name = Basename(prefix);
  const std::vector<std::string> held = DatasetsIn(dir);
  std::vector<std::string> names;
  for (const std::string& h : held) names.push_back(Basename(h));
  std::vector<std::string> nearest;
  for (size_t i : cli::NearestNames(name, names, std::max<size_t>(2, name.size() / 5)))
    nearest.push_back(prefix.find('/') == std::string::npos ? names[i] : held[i]);
  if (nearest.empty()) return absl::NotFoundError(none);
  std::string list;
  for (size_t i = 0; i < nearest.size() && i < 4; ++i) list += (i ? ", " : "") + nearest[i];
  return absl::NotFoundError(fmt::format("{}; did you mean {}{}?", none, list, nearest.size() > 4 ? ", ..." : ""));
}

}  // namespace ptk
