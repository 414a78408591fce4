// Paths, globs, natural order, directory walks.
#include "common/file_paths.h"

#include <dirent.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <set>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path));
  return static_cast<uint64_t>(st.st_size);
}

std::string Dirname(std::string_view path) {
  size_t p = path.rfind('/');
  if (p == std::string_view::npos) return ".";
  if (p == 0) return "/";
  return std::string(path.substr(0, p));
}

std::string Basename(std::string_view path) {
  size_t p = path.rfind('/');
  return std::string(p == std::string_view::npos ? path : path.substr(p + 1));
}

std::string JoinPath(std::string_view a, std::string_view b) {
  if (a.empty()) return std::string(b);
  if (!b.empty() && b.front() == '/') return std::string(b);
  std::string out(a);
  if (out.back() != '/') out.push_back('/');
  out.append(b);
  return out;
}

bool NaturalLess(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      size_t i0 = i, j0 = j;
      while (i0 < a.size() && a[i0] == '0') ++i0;
      while (j0 < b.size() && b[j0] == '0') ++j0;
      size_t i1 = i0, j1 = j0;
      while (i1 < a.size() && is_digit(a[i1])) ++i1;
      while (j1 < b.size() && is_digit(b[j1])) ++j1;
      size_t la = i1 - i0, lb = j1 - j0;
      if (la != lb) return la < lb;
      int c = a.substr(i0, la).compare(b.substr(j0, lb));
      if (c != 0) return c < 0;
      i = i1;
      j = j1;
      continue;
    }
    unsigned char ca = static_cast<unsigned char>(a[i]), cb = static_cast<unsigned char>(b[j]);
    if (ca != cb) return ca < cb;
    ++i;
    ++j;
  }
  if ((a.size() - i) != (b.size() - j)) return (a.size() - i) < (b.size() - j);
  return a < b;  // equal under natural order: fall back to bytes for a strict total order
}

absl::StatusOr<std::vector<std::string>> ExpandGlobs(const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (const std::string& pat : patterns) {
    if (pat == "-") {
      out.push_back(pat);
      continue;
    }
    if (pat.find_first_of("*?[") == std::string::npos) {
      if (struct stat st; ::stat(pat.c_str(), &st) != 0) {
        const int err = errno;
        if (err == ELOOP) return absl::NotFoundError(fmt::format("{}: a symbolic link that loops", pat));
        if (err == ENOENT && ::lstat(pat.c_str(), &st) == 0) {
          char target[4096];
          const ssize_t n = ::readlink(pat.c_str(), target, sizeof(target));
          return absl::NotFoundError(fmt::format("{}: a broken symbolic link (to {})", pat,
                                                 n > 0 ? std::string(target, static_cast<size_t>(n)) : "?"));
        }
        if (err != ENOENT) return ErrnoToStatus(err, fmt::format("stat {}", pat));
        return absl::NotFoundError(fmt::format("{}: no such file", pat));
      }
      out.push_back(pat);
      continue;
    }
    glob_t g;
    std::memset(&g, 0, sizeof(g));
    int rc = ::glob(pat.c_str(), GLOB_NOSORT, nullptr, &g);
    if (rc == GLOB_NOMATCH) {
      globfree(&g);
      return absl::NotFoundError(fmt::format("{}: pattern matches no file", pat));
    }
    if (rc != 0) {
      globfree(&g);
      return absl::InvalidArgumentError(fmt::format("{}: glob failed", pat));
    }
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    std::sort(matches.begin(), matches.end(),
              [](const std::string& x, const std::string& y) { return NaturalLess(x, y); });
    out.insert(out.end(), matches.begin(), matches.end());
  }
  return out;
}

namespace {
std::string KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}
FileIdentity IdentityOf(const struct stat& st) {
  FileIdentity id;
  id.dev = static_cast<uint64_t>(st.st_dev);
  id.ino = static_cast<uint64_t>(st.st_ino);
  id.regular = S_ISREG(st.st_mode);
  id.directory = S_ISDIR(st.st_mode);
  id.kind = KindOf(st.st_mode);
  return id;
}
}  // namespace

absl::StatusOr<FileIdentity> IdentifyFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path));
  return IdentityOf(st);
}

absl::StatusOr<std::vector<WalkedFile>> WalkDirectory(const std::string& dir) {
  struct Found {
    WalkedFile file;
    bool via_link;  // the name goes through a symbolic link
  };
  std::vector<Found> found;
  std::set<std::pair<uint64_t, uint64_t>> dirs_entered;
  struct stat root;
  if (::stat(dir.c_str(), &root) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", dir));
  if (!S_ISDIR(root.st_mode)) return absl::FailedPreconditionError(fmt::format("{} is not a directory", dir));
  dirs_entered.emplace(root.st_dev, root.st_ino);
  std::deque<std::string> linked_dirs;  // entered after every directory reached without a link
  std::function<absl::Status(const std::string&, bool)> walk = [&](const std::string& rel,
                                                                   bool via_link) -> absl::Status {
    const std::string full = rel.empty() ? dir : JoinPath(dir, rel);
    DIR* d = ::opendir(full.c_str());
    if (!d) return ErrnoToStatus(errno, fmt::format("opendir {}", full));
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    for (const auto& name : names) {
      const std::string child = rel.empty() ? name : rel + "/" + name;
      const std::string path = JoinPath(dir, child);
      struct stat lst, st;
      if (::lstat(path.c_str(), &lst) != 0) continue;  // gone meanwhile
      const bool link = S_ISLNK(lst.st_mode);
      if (::stat(path.c_str(), &st) != 0) {
        FileIdentity id;
        id.kind = errno == ELOOP ? "a symbolic link that loops" : "a broken symbolic link";
        found.push_back({{child, id}, true});
        continue;
      }
      if (S_ISDIR(st.st_mode)) {
        if (link) {
          linked_dirs.push_back(child);
        } else if (dirs_entered.emplace(st.st_dev, st.st_ino).second) {
          PTK_RETURN_IF_ERROR(walk(child, via_link));
        }
        continue;
      }
      found.push_back({{child, IdentityOf(st)}, via_link || link});
    }
    return absl::OkStatus();
  };
  PTK_RETURN_IF_ERROR(walk("", false));
  while (!linked_dirs.empty()) {
    const std::string rel = linked_dirs.front();
    linked_dirs.pop_front();
    struct stat st;
    if (::stat(JoinPath(dir, rel).c_str(), &st) != 0 || !dirs_entered.emplace(st.st_dev, st.st_ino).second) continue;
    PTK_RETURN_IF_ERROR(walk(rel, true));
  }
  // One name per file: without a link first, then byte order.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.via_link != b.via_link ? !a.via_link : a.file.rel < b.file.rel;
  });
  std::set<std::pair<uint64_t, uint64_t>> files_seen;
  std::vector<WalkedFile> out;
  for (auto& f : found)
    if (f.file.id.ino == 0 || files_seen.emplace(f.file.id.dev, f.file.id.ino).second) out.push_back(std::move(f.file));
  std::sort(out.begin(), out.end(), [](const WalkedFile& a, const WalkedFile& b) { return a.rel < b.rel; });
  return out;
}

absl::StatusOr<std::vector<std::string>> ListFilesRecursive(const std::string& dir) {
  PTK_ASSIGN_OR_RETURN(auto files, WalkDirectory(dir));
  std::vector<std::string> out;
  for (auto& f : files)
    if (f.id.regular) out.push_back(std::move(f.rel));
  return out;
}

}  // namespace ptk
