// File I/O on paths and descriptors.
#include "common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <vector>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/status.h"

namespace ptk {

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
    PTK_RETURN_IF_ERROR(WriteAll(out_fd, buf.data(), static_cast<size_t>(n), what));
    off += n;
    length -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> OpenRegularFile(const std::string& path) {
  // O_NONBLOCK: open(2) of a FIFO returns at once instead of waiting for a writer; cleared below
  // (it means nothing for a regular file, but a descriptor handed on should not carry it).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("cannot open {}", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoToStatus(e, fmt::format("stat {}", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                                              : "a special file";
    return absl::InvalidArgumentError(fmt::format("{} is {}, not a regular file: ptk reads regular files", path, kind));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

absl::Status ReadFileChunks(const std::string& path, size_t chunk, const std::function<void(const char*, size_t)>& fn) {
  PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path));
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

}  // namespace ptk
