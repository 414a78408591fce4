// Expanding the inputs of the dataprep tools.
#include "dataprep/input_list.h"

#include <fnmatch.h>

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

namespace {
bool GlobLike(const std::string& pattern, const std::string& rel) {
  if (::fnmatch(pattern.c_str(), rel.c_str(), 0) == 0) return true;
  // "**/x" also matches at the top, as Python's recursive glob does.
  return pattern.rfind("**/", 0) == 0 && ::fnmatch(pattern.c_str() + 3, rel.c_str(), 0) == 0;
}
bool TokenizeCandidate(const std::string& rel) {
  size_t start = 0;
  while (start < rel.size()) {
    if (rel[start] == '.') return false;  // a hidden file or directory
    const size_t slash = rel.find('/', start);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  if (rel.find(".ptk-") != std::string::npos) return false;
  for (std::string_view suf : {"_document.bin", "_document.idx"})
    if (rel.size() >= suf.size() && rel.compare(rel.size() - suf.size(), suf.size(), suf) == 0) return false;
  return true;
}
}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandTokenizeInputs(const std::vector<std::string>& args,
                                                              const std::string& filter) {
  std::vector<std::string> out;
  for (const auto& a : args) {
    if (a != "-" && IsDirectory(a)) {
      PTK_ASSIGN_OR_RETURN(auto rels, ListFilesRecursive(a));
      std::vector<std::string> mine;
      for (const auto& rel : rels)
        if (TokenizeCandidate(rel) && (filter.empty() || GlobLike(filter, rel))) mine.push_back(JoinPath(a, rel));
      if (mine.empty())
        return absl::NotFoundError(fmt::format("{}: no input files in this directory{}", a,
                                               filter.empty() ? "" : fmt::format(" match {:?}", filter)));
      SortPaths(&mine, PathOrder::kNatural);
      out.insert(out.end(), mine.begin(), mine.end());
      continue;
    }
    PTK_ASSIGN_OR_RETURN(auto files, ExpandGlobs({a}));
    out.insert(out.end(), files.begin(), files.end());
  }
  return out;
}

}  // namespace ptk
