// File I/O on paths and descriptors: whole and chunked reads, full writes, copies, fsync, rename, remove, mkdir.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

// Copies `length` bytes from in_fd at in_off to out_fd at its current position (copy_file_range,
// falling back to read/write).
absl::Status CopyFdRange(int in_fd, uint64_t in_off, int out_fd, uint64_t length, std::string_view what);

// Opens a regular file for reading (O_CLOEXEC) and returns its descriptor. Anything else is refused
// with one line naming it ("PATH is a FIFO, not a regular file"), without blocking: open(2) of a FIFO
// would wait for a writer, and a device or a FIFO has no size to check. Every read of a named file
// goes through here (streams are read from `-`, stdin, where a tool documents that).
absl::StatusOr<int> OpenRegularFile(const std::string& path);

// The whole file (a regular file: OpenRegularFile).
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// Reads the whole file in pieces of up to `chunk` bytes (EINTR retried), handing each to `fn`.
absl::Status ReadFileChunks(const std::string& path, size_t chunk, const std::function<void(const char*, size_t)>& fn);

// write(2) the whole buffer, retrying on EINTR and short writes.
absl::Status WriteAll(int fd, const void* data, size_t size, std::string_view what);
absl::Status FsyncDir(const std::string& dir);
absl::Status FsyncFile(int fd, std::string_view what);
absl::Status RenameFile(const std::string& from, const std::string& to);
absl::Status RemoveFileIfExists(const std::string& path);
absl::Status MakeDirs(const std::string& path);

}  // namespace ptk
