// File helpers.
#include "common/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <set>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp_path, int fd)
    // The buffer is not zero-filled: its pages are faulted in only as they are written.
    : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd), buf_(new char[kBufSize]) {}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    uint32_t r = 0;
    if (::getrandom(&r, sizeof(r), 0) != sizeof(r)) r = static_cast<uint32_t>(counter.load() * 2654435761u);
    std::string tmp = fmt::format("{}{}-{}-{:08x}", path, kTmpSuffix, ::getpid(), r ^ counter.fetch_add(1));
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd >= 0) return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp, fd));
    if (errno == EEXIST && attempt < 16) continue;
    return ErrnoToStatus(errno, fmt::format("cannot create {}", tmp));
  }
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Reopen(const std::string& path,
                                                                           const std::string& tmp_path, uint64_t size) {
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("cannot reopen {}", tmp_path));
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < size) {
    ::close(fd);
    return absl::DataLossError(fmt::format("{}: shorter than the {} bytes recorded for it", tmp_path, size));
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 || ::lseek(fd, static_cast<off_t>(size), SEEK_SET) < 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoToStatus(e, fmt::format("truncate {}", tmp_path));
  }
  std::unique_ptr<AtomicFileWriter> w(new AtomicFileWriter(path, tmp_path, fd));
  w->bytes_written_ = size;
  w->synced_ = size;
  return w;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!done_) Abort();
}

absl::Status AtomicFileWriter::Write(const void* data, size_t size) {
  if (done_) return absl::FailedPreconditionError(fmt::format("{}: write after close", path_));
  const char* p = static_cast<const char*>(data);
  if (buf_used_ + size <= kBufSize) {
    std::memcpy(buf_.get() + buf_used_, p, size);
    buf_used_ += size;
  } else {
    PTK_RETURN_IF_ERROR(Flush());
    if (size >= kBufSize) {
      PTK_RETURN_IF_ERROR(WriteAll(fd_, p, size, Describe()));
      bytes_written_ += size;
      StartWriteback();
      return absl::OkStatus();
    } else {
      std::memcpy(buf_.get(), p, size);
      buf_used_ = size;
    }
  }
  bytes_written_ += size;
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::AppendFileRange(const std::string& src_path, uint64_t offset, uint64_t length) {
  if (done_) return absl::FailedPreconditionError(fmt::format("{}: write after close", path_));
  PTK_RETURN_IF_ERROR(Flush());
  int in = ::open(src_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return ErrnoToStatus(errno, fmt::format("cannot open {}", src_path));
  absl::Status st = CopyFdRange(in, offset, fd_, length, fmt::format("{} into {}", src_path, Describe()));
  ::close(in);
  if (st.ok()) {
    bytes_written_ += length;
  }
  return st;
}

absl::Status CopyFdRange(int in_fd, uint64_t in_off, int out_fd, uint64_t length, std::string_view what) {
  loff_t off = static_cast<loff_t>(in_off);
  bool use_cfr = true;
  std::vector<char> buf;
  while (length > 0) {
    if (use_cfr) {
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(length, 1ull << 30));
      ssize_t n = ::copy_file_range(in_fd, &off, out_fd, nullptr, chunk, 0);
      if (n > 0) {
        length -= static_cast<uint64_t>(n);
        continue;
      }
      if (n == 0) return absl::DataLossError(fmt::format("{}: file ended {} bytes early", what, length));
      if (errno == EINTR) continue;
      if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == EBADF) {
        use_cfr = false;
        continue;
      }
      return ErrnoToStatus(errno, fmt::format("copy from {}", what));
    }
    if (buf.empty()) buf.resize(1 << 20);
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(length, buf.size()));
    ssize_t n = ::pread(in_fd, buf.data(), chunk, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, fmt::format("read {}", what));
    }
    if (n == 0) return absl::DataLossError(fmt::format("{}: file ended {} bytes early", what, length));
    PTK_RETURN_IF_ERROR(WriteAll(out_fd, buf.data(), static_cast<size_t>(n), "output"));
    off += n;
    length -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

std::string AtomicFileWriter::Describe() const { return fmt::format("{} (temporary {})", path_, Basename(tmp_path_)); }

absl::Status AtomicFileWriter::Flush() {
  if (buf_used_ == 0) return absl::OkStatus();
  absl::Status st = WriteAll(fd_, buf_.get(), buf_used_, Describe());
  buf_used_ = 0;
  StartWriteback();
  return st;
}

// Starts writeback of what has accumulated (without waiting), so that the fsync at Commit finds
// little left to do and disk writes overlap with the caller's work.
void AtomicFileWriter::StartWriteback() {
  const uint64_t on_disk = bytes_written_ - buf_used_;
  if (on_disk - synced_ < (1u << 20)) return;
  ::sync_file_range(fd_, static_cast<off64_t>(synced_), static_cast<off64_t>(on_disk - synced_), SYNC_FILE_RANGE_WRITE);
  synced_ = on_disk;
}

absl::Status AtomicFileWriter::Seal(bool durable) {
  if (done_ || fd_ < 0) return absl::FailedPreconditionError(fmt::format("{}: already closed", path_));
  PTK_RETURN_IF_ERROR(Flush());
  if (durable) PTK_RETURN_IF_ERROR(FsyncFile(fd_, Describe()));
  if (::close(fd_) != 0) {
    fd_ = -1;
    return ErrnoToStatus(errno, fmt::format("close {}", tmp_path_));
  }
  fd_ = -1;
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit(bool durable) {
  if (done_) return absl::FailedPreconditionError(fmt::format("{}: already closed", path_));
  if (fd_ >= 0) PTK_RETURN_IF_ERROR(Seal(durable));  // else sealed already
  PTK_RETURN_IF_ERROR(RenameFile(tmp_path_, path_));
  done_ = true;
  return durable ? FsyncDir(Dirname(path_)) : absl::OkStatus();
}

void AtomicFileWriter::Abort() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!done_) ::unlink(tmp_path_.c_str());
  done_ = true;
}

absl::Status WriteFileAtomic(const std::string& path, std::string_view contents, bool durable) {
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  PTK_RETURN_IF_ERROR(w->Write(contents));
  return w->Commit(durable);
}

absl::Status PublishTogether(const std::string& journal, const std::vector<std::pair<std::string, std::string>>& files,
                             bool durable) {
  const std::string dir = Dirname(journal);
  std::string text = "ptk-publish v1\n";
  for (const auto& [tmp, final_path] : files) {
    if (Dirname(tmp) != dir || Dirname(final_path) != dir)
      return absl::InvalidArgumentError(
          fmt::format("publish {}: {} -> {} is not in {}", journal, tmp, final_path, dir));
    const std::string a = Basename(tmp), b = Basename(final_path);
    if (a.find_first_of("\t\n") != std::string::npos || b.find_first_of("\t\n") != std::string::npos)
      return absl::InvalidArgumentError(
          fmt::format("publish {}: file names must not contain tabs or newlines", journal));
    text += a + "\t" + b + "\n";
  }
  // A final name that cannot take a file (a directory) fails the publish before there is a
  // journal: nothing is renamed, and the temporaries stay the caller's to remove.
  for (const auto& [tmp, final_path] : files) {
    struct stat st;
    if (::lstat(final_path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      return absl::FailedPreconditionError(
          fmt::format("cannot publish {}: a directory is in its place; nothing was published", final_path));
  }
  PTK_RETURN_IF_ERROR(WriteFileAtomic(journal, text, durable));
  // Until the first rename is done nothing is published: a failure there is undone (the journal
  // removed), as if the publish had not begun.
  if (!files.empty() && ::rename(files[0].first.c_str(), files[0].second.c_str()) != 0) {
    const int e = errno;
    (void)RemoveFileIfExists(journal);
    return ErrnoToStatus(e, fmt::format("publish {} -> {}; nothing was published", files[0].first, files[0].second));
  }
  return CompletePendingPublish(journal);
}

absl::Status CompletePendingPublish(const std::string& journal) {
  auto text = ReadFileToString(journal);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) return absl::OkStatus();
    return text.status();
  }
  const std::string dir = Dirname(journal);
  std::string_view rest = *text;
  if (rest.rfind("ptk-publish v1\n", 0) != 0)
    return absl::DataLossError(fmt::format("{}: not a ptk publish journal; remove it by hand", journal));
  rest.remove_prefix(15);
  while (!rest.empty()) {
    const size_t nl = rest.find('\n'), tab = rest.find('\t');
    if (nl == std::string_view::npos || tab == std::string_view::npos || tab > nl)
      return absl::DataLossError(fmt::format("{}: truncated publish journal; remove it by hand", journal));
    const std::string from = JoinPath(dir, rest.substr(0, tab)), to = JoinPath(dir, rest.substr(tab + 1, nl - tab - 1));
    rest.remove_prefix(nl + 1);
    if (::rename(from.c_str(), to.c_str()) == 0) continue;
    if (errno == ENOENT && PathExists(to)) continue;  // renamed already (by a run that was killed, or by another)
    return ErrnoToStatus(errno, fmt::format("publish {} -> {} (journal {})", from, to, journal));
  }
  PTK_RETURN_IF_ERROR(FsyncDir(dir));
  if (::unlink(journal.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, fmt::format("remove {}", journal));
  return FsyncDir(dir);
}

absl::Status ReadFileChunks(const std::string& path, size_t chunk, const std::function<void(const char*, size_t)>& fn) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("cannot open {}", path));
  std::unique_ptr<char[]> buf(new char[chunk]);  // not zero-filled: read() writes what is used
  while (true) {
    ssize_t n = ::read(fd, buf.get(), chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      return ErrnoToStatus(e, fmt::format("read {}", path));
    }
    if (n == 0) break;
    fn(buf.get(), static_cast<size_t>(n));
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::string out;
  PTK_RETURN_IF_ERROR(ReadFileChunks(path, 1 << 16, [&](const char* p, size_t n) { out.append(p, n); }));
  return out;
}

absl::Status WriteAll(int fd, const void* data, size_t size, std::string_view what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, fmt::format("write {}", what));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncFile(int fd, std::string_view what) {
  if (::fsync(fd) != 0) return ErrnoToStatus(errno, fmt::format("fsync {}", what));
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("open directory {}", dir));
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  // Some file systems (e.g. certain FUSE mounts) refuse fsync on directories: not fatal.
  if (rc != 0 && e != EINVAL && e != ENOTSUP) return ErrnoToStatus(e, fmt::format("fsync directory {}", dir));
  return absl::OkStatus();
}

absl::Status RenameFile(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoToStatus(errno, fmt::format("rename {} -> {}", from, to));
  return absl::OkStatus();
}

absl::Status RemoveFileIfExists(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, fmt::format("remove {}", path));
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::string cur;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    cur = path.substr(0, j);
    if (!cur.empty() && ::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return ErrnoToStatus(errno, fmt::format("mkdir {}", cur));
    i = j + 1;
  }
  if (!IsDirectory(path)) return absl::FailedPreconditionError(fmt::format("{} is not a directory", path));
  return absl::OkStatus();
}

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
      if (!PathExists(pat)) return absl::NotFoundError(fmt::format("{}: no such file", pat));
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

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} {}", bytes, units[u]);
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

std::string HumanDuration(double s) {
  if (s < 0 || s != s) return "?";
  if (s < 60) return fmt::format("{:.1f}s", s);
  long t = static_cast<long>(s + 0.5);
  if (t < 3600) return fmt::format("{}m{:02d}s", t / 60, static_cast<int>(t % 60));
  return fmt::format("{}h{:02d}m", t / 3600, static_cast<int>((t % 3600) / 60));
}

}  // namespace ptk
