// Expanding the inputs of the dataprep tools.
#include "dataprep/input/input_list.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <utility>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/logging.h"
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

namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string SuffixList(const std::vector<std::string>& suffixes) {
  std::string s;
  for (const auto& x : suffixes) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Why a regular file below a directory is not an input of a tool that takes `suffixes`.
std::string LeftOutReason(const std::string& rel, const std::vector<std::string>& suffixes) {
  const std::string name = Basename(rel);
  const std::string lower = Lower(name);
  for (const auto& suf : suffixes)
    if (EndsWith(lower, suf))
      return fmt::format("its extension is not in lower case (taken: {})", SuffixList(suffixes));
  static const std::pair<const char*, const char*> kOther[] = {
      {".bz2", "bzip2"}, {".lz4", "lz4"}, {".lzma", "lzma"}, {".br", "brotli"},      {".zip", "zip"},
      {".7z", "7-zip"},  {".tar", "tar"}, {".tgz", "tar"},   {".z", "compress (.Z)"}};
  for (const auto& [ext, what] : kOther)
    if (EndsWith(lower, ext))
      return fmt::format("{} is not a format ptk reads (taken: {})", what, SuffixList(suffixes));
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || dot == 0) return fmt::format("no extension (taken: {})", SuffixList(suffixes));
  return fmt::format("extension {} (taken: {})", name.substr(dot), SuffixList(suffixes));
}

std::string NotRegular(const std::string& path, const FileIdentity& id, std::string_view hint) {
  return fmt::format("{} is {}, not a regular file: inputs are read from regular files{}", path, id.kind, hint);
}

}  // namespace

bool IsPtkOwnName(std::string_view rel) {
  static constexpr std::string_view kTags[] = {"tmp",     "done",   "lock", "extracting", "resume",
                                               "inorder", "verify", "old",  "download"};
  for (size_t at = rel.find(".ptk-"); at != std::string_view::npos; at = rel.find(".ptk-", at + 1)) {
    const std::string_view rest = rel.substr(at + 5);
    for (std::string_view tag : kTags) {
      if (rest.substr(0, tag.size()) != tag) continue;
      if (rest.size() == tag.size() || std::string_view("-./").find(rest[tag.size()]) != std::string_view::npos)
        return true;
    }
  }
  return false;
}

void ReportLeftOut(const std::vector<LeftOutFile>& left_out) {
  for (const auto& l : left_out) log::Warning("left out {}: {}", log::Printable(l.path), l.reason);
}

absl::StatusOr<std::vector<InputFile>> CollectInputFiles(const std::vector<std::string>& args,
                                                         const std::vector<std::string>& dir_suffixes, PathOrder order,
                                                         std::vector<LeftOutFile>* left_out) {
  std::vector<InputFile> out;
  std::vector<LeftOutFile> ignored;
  if (!left_out) left_out = &ignored;
  for (const auto& a : args) {
    if (IsDirectory(a)) {
      PTK_ASSIGN_OR_RETURN(auto files, WalkDirectory(a));
      for (const auto& f : files) {
        if (IsPtkOwnName(f.rel)) continue;
        const std::string path = JoinPath(a, f.rel);
        if (!f.id.regular) {
          left_out->push_back({path, f.id.kind + ", not a regular file"});
          continue;
        }
        const bool taken = std::any_of(dir_suffixes.begin(), dir_suffixes.end(),
                                       [&](const std::string& suf) { return EndsWith(f.rel, suf); });
        if (taken)
          out.push_back({path, f.rel, f.id.dev, f.id.ino});
        else
          left_out->push_back({path, LeftOutReason(f.rel, dir_suffixes)});
      }
      continue;
    }
    PTK_ASSIGN_OR_RETURN(auto files, ExpandGlobs({a}));
    for (const auto& f : files) {
      PTK_ASSIGN_OR_RETURN(FileIdentity id, IdentifyFile(f));
      if (id.directory && f != a) {  // a glob's match that is a directory: its files are not taken
        left_out->push_back({f, fmt::format("a directory matched by {:?} (name the directory to take its files)", a)});
        continue;
      }
      if (!id.regular) return absl::FailedPreconditionError(NotRegular(f, id, ""));
      out.push_back({f, Basename(f), id.dev, id.ino});
    }
  }
  auto less = [order](const InputFile& x, const InputFile& y) {
    return order == PathOrder::kNatural ? NaturalLess(x.path, y.path) : x.path < y.path;
  };
  std::sort(out.begin(), out.end(), less);
  std::map<std::pair<uint64_t, uint64_t>, std::string> first;
  std::vector<InputFile> once;
  for (auto& f : out) {
    auto [it, fresh] = first.emplace(std::make_pair(f.dev, f.ino), f.path);
    if (fresh) {
      once.push_back(std::move(f));
    } else if (f.path != it->second) {
      log::Warning("{} is the same file as {}: taken once", log::Printable(f.path), log::Printable(it->second));
    }
  }
  return once;
}

absl::StatusOr<std::vector<std::string>> CollectInputs(const std::vector<std::string>& args,
                                                       const std::vector<std::string>& dir_suffixes, PathOrder order,
                                                       std::vector<LeftOutFile>* left_out) {
  PTK_ASSIGN_OR_RETURN(auto files, CollectInputFiles(args, dir_suffixes, order, left_out));
  std::vector<std::string> out;
  for (auto& f : files) out.push_back(std::move(f.path));
  return out;
}

bool StartsLikeAConcatPlan(const std::string& path) {
  static constexpr std::string_view kStart = "{\"version\": 1, \"output_dir\": ";  // WriteConcatPlan's
  if (!EndsWith(path, ".json")) return false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char head[kStart.size()];
  const ssize_t n = ::pread(fd, head, sizeof head, 0);
  ::close(fd);
  return n == static_cast<ssize_t>(sizeof head) && std::string_view(head, sizeof head) == kStart;
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
  if (IsPtkOwnName(rel)) return false;
  for (std::string_view suf : {"_document.bin", "_document.idx"})
    if (EndsWith(rel, suf)) return false;
  return true;
}
// PREFIX.bin beside PREFIX.idx (or the .idx beside its .bin): a dataset whatever its prefix (a
// ptk-merge output, merged.bin), never text, as PREFIX_text_document's are not.
bool HalfOfADataset(const std::string& path) {
  for (auto [half, other] : {std::pair{".bin", ".idx"}, std::pair{".idx", ".bin"}})
    if (EndsWith(path, half) && PathExists(path.substr(0, path.size() - 4) + other)) return true;
  return false;
}
}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandTokenizeInputs(const std::vector<std::string>& args,
                                                              const std::string& filter) {
  std::vector<std::string> out;
  std::map<std::pair<uint64_t, uint64_t>, std::string> first;  // each file read once
  auto take = [&](const std::string& path, const FileIdentity& id) {
    auto [it, fresh] = first.emplace(std::make_pair(id.dev, id.ino), path);
    if (fresh)
      out.push_back(path);
    else
      log::Warning("{} is the same file as {}: read once", log::Printable(path), log::Printable(it->second));
  };
  for (const auto& a : args) {
    if (a != "-" && IsDirectory(a)) {
      PTK_ASSIGN_OR_RETURN(auto files, WalkDirectory(a));
      std::vector<std::string> mine;
      std::map<std::string, FileIdentity> ids;
      for (const auto& f : files) {
        if (!TokenizeCandidate(f.rel) || (!filter.empty() && !GlobLike(filter, f.rel))) continue;
        const std::string path = JoinPath(a, f.rel);
        if (f.id.regular && (StartsLikeAConcatPlan(path) || HalfOfADataset(path))) continue;
        if (!f.id.regular) {
          log::Warning("left out {}: {}, not a regular file", log::Printable(path), f.id.kind);
          continue;
        }
        mine.push_back(path);
        ids[path] = f.id;
      }
      if (mine.empty())
        return absl::NotFoundError(fmt::format("{}: no input files in this directory{}", a,
                                               filter.empty() ? "" : fmt::format(" match {:?}", filter)));
      SortPaths(&mine, PathOrder::kNatural);
      for (const auto& p : mine) take(p, ids[p]);
      continue;
    }
    PTK_ASSIGN_OR_RETURN(auto files, ExpandGlobs({a}));
    for (const auto& f : files) {
      if (f == "-") {
        // Standard input is read to its end once: a second "-" would be read as an empty file.
        if (std::find(out.begin(), out.end(), "-") != out.end())
          return UsageError("- (standard input) is given twice; it can be read once");
        out.push_back(f);
        continue;
      }
      PTK_ASSIGN_OR_RETURN(FileIdentity id, IdentifyFile(f));
      if (!id.regular)
        return absl::FailedPreconditionError(NotRegular(f, id, id.directory ? "" : "; for a stream, use - (stdin)"));
      take(f, id);
    }
  }
  return out;
}

}  // namespace ptk
