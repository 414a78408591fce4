// Paths: existence, size, names, natural order, globs, file identity and directory walks.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);
absl::StatusOr<uint64_t> FileSize(const std::string& path);
std::string Dirname(std::string_view path);
std::string Basename(std::string_view path);
std::string JoinPath(std::string_view a, std::string_view b);

// "Natural" order: runs of ASCII digits compare by numeric value, everything else bytewise,
// so shard2 < shard10. Ties (e.g. "01" vs "1") fall back to plain byte order: a total order.
bool NaturalLess(std::string_view a, std::string_view b);

// Expands each pattern with glob(3) (patterns without wildcards must exist). The result keeps the
// order of the patterns and sorts the matches of each pattern with NaturalLess; "-" passes through.
absl::StatusOr<std::vector<std::string>> ExpandGlobs(const std::vector<std::string>& patterns);

// What a path names, its symbolic links followed: its (device, inode), which identify a file
// however it is reached (`in/f`, `in/./f`, a link to it, a hard link), and its kind.
struct FileIdentity {
  uint64_t dev = 0, ino = 0;
  bool regular = false, directory = false;
  std::string kind;  // "a regular file", "a directory", "a FIFO", "a socket", "a character device", ...
};
absl::StatusOr<FileIdentity> IdentifyFile(const std::string& path);

// One file found below a directory by WalkDirectory.
struct WalkedFile {
  std::string rel;  // path below the directory
  FileIdentity id;  // for a broken or looping link: kind says so, regular false
};
// Every file below `dir`, symbolic links followed, each directory entered once and each file listed
// once by (device, inode): a link back to a directory above (`sub/up -> ..`) neither multiplies
// the files nor loops, and a file reached by several names is listed under one. Real directories
// are walked before the ones reached through links, and a name without a link is preferred; among
// the rest, the first name in byte order. Non-regular files (FIFOs, sockets, devices, broken
// links) are listed with their kind, for the caller to refuse or report. Sorted bytewise by rel.
absl::StatusOr<std::vector<WalkedFile>> WalkDirectory(const std::string& dir);

// The regular files of WalkDirectory(dir) (relative paths, sorted bytewise).
absl::StatusOr<std::vector<std::string>> ListFilesRecursive(const std::string& dir);

}  // namespace ptk
