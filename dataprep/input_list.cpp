// Expanding the inputs of the dataprep tools.
#include "dataprep/input_list.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/file_util.h"
#include "common/status.h"

namespace ptk {

void SortPaths(std::vector<std::string>* paths, PathOrder order) {
  if (order == PathOrder::kNatural)
    std::sort(paths->begin(), paths->end(),
              [](const std::string& a, const std::string& b) { return NaturalLess(a, b); });
  else
    std::sort(paths->begin(), paths->end());
  paths->erase(std::unique(paths->begin(), paths->end()), paths->end());
}

absl::StatusOr<std::vector<InputFile>> CollectInputFiles(const std::vector<std::string>& args,
                                                         const std::vector<std::string>& dir_suffixes,
                                                         PathOrder order) {
  std::vector<InputFile> out;
  for (const auto& a : args) {
    if (IsDirectory(a)) {
      PTK_ASSIGN_OR_RETURN(auto rel, ListFilesRecursive(a));
      for (const auto& r : rel) {
        for (const auto& suf : dir_suffixes) {
          if (r.size() >= suf.size() && r.compare(r.size() - suf.size(), suf.size(), suf) == 0) {
            out.push_back({JoinPath(a, r), r});
            break;
          }
        }
      }
      continue;
    }
    PTK_ASSIGN_OR_RETURN(auto files, ExpandGlobs({a}));
    for (const auto& f : files) out.push_back({f, Basename(f)});
  }
  auto less = [order](const InputFile& x, const InputFile& y) {
    return order == PathOrder::kNatural ? NaturalLess(x.path, y.path) : x.path < y.path;
  };
  std::sort(out.begin(), out.end(), less);
  out.erase(
      std::unique(out.begin(), out.end(), [](const InputFile& x, const InputFile& y) { return x.path == y.path; }),
      out.end());
  return out;
}

absl::StatusOr<std::vector<std::string>> CollectInputs(const std::vector<std::string>& args,
                                                       const std::vector<std::string>& dir_suffixes, PathOrder order) {
  PTK_ASSIGN_OR_RETURN(auto files, CollectInputFiles(args, dir_suffixes, order));
  std::vector<std::string> out;
  for (auto& f : files) out.push_back(std::move(f.path));
  return out;
}

}  // namespace ptk
