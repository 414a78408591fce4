// Expanding the inputs of the dataprep tools: files, globs and directories, in a documented order.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
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
  uint64_t dev = 0, ino = 0;
};

// A file below a directory argument that is not an input, and why.
struct LeftOutFile {
  std::string path;
  std::string reason;
};

// Whether `rel` (a path, relative or not) names something ptk writes, so that no tool takes it for
// data: X.ptk-done, X.ptk-lock, X.ptk-extracting, X.ptk-tmp-PID-RANDOM (any of them +
// .ptk-tmp-...), PREFIX.ptk-resume and .ptk-resume-index, PREFIX.ptk-inorder.bin/.idx,
// X.ptk-verify*, a checkpoint's iter_*.ptk-old-*, ptk-download's state directory .ptk-download/: a
// ".ptk-" followed by one of these tags and then the end of the name, "-", "." or "/". A user's
// x.ptk-v2.jsonl is not.
bool IsPtkOwnName(std::string_view rel);

// Files: kept. Globs: expanded. Directories: every regular file below whose name ends with one of
// `dir_suffixes` (recursively, WalkDirectory: links followed, each directory and file once). The
// whole list is then sorted by `order` (of the paths), and a file reached twice (by two spellings,
// a link, a hard link: the same device and inode) is kept once, its first path (a warning names the
// other). A named (or matched) input that is not a regular file (a FIFO, a device) is an error
// naming it. The files below a directory that are not taken go to `left_out` with the reason (a
// name with another or an upper-case extension, no extension, a FIFO, a broken link), but ptk's own
// (the names it writes: X.ptk-done, X.ptk-lock, X.ptk-tmp-*, PREFIX.ptk-resume, ...; a user's
// x.ptk-v2.jsonl is an input), which are left out without a word.
absl::StatusOr<std::vector<InputFile>> CollectInputFiles(const std::vector<std::string>& args,
                                                         const std::vector<std::string>& dir_suffixes, PathOrder order,
                                                         std::vector<LeftOutFile>* left_out = nullptr);
absl::StatusOr<std::vector<std::string>> CollectInputs(const std::vector<std::string>& args,
                                                       const std::vector<std::string>& dir_suffixes, PathOrder order,
                                                       std::vector<LeftOutFile>* left_out = nullptr);
// Logs each left-out file (a warning: "left out PATH: REASON").
void ReportLeftOut(const std::vector<LeftOutFile>& left_out);

// ptk-tokenize's inputs: files and globs as given (each glob's matches in natural order). A
// directory stands for every regular file below it, extension-less ones such as WikiExtractor's
// wiki_00 included (hidden files, ptk's own sidecars, locks, temporaries and concat plans, and datasets:
// *_document.bin/.idx, and any PREFIX.bin beside its PREFIX.idx, left out), in natural order; with `filter` (NeMo's
// --files-filter, e.g.
// "**/*.json*") only those whose path below the directory matches it. Each file is read once
// however often it is reached (by device and inode; a warning names the repeats); a named input
// that is not a regular file (a FIFO: use - for a stream) is an error; "-" is stdin.
absl::StatusOr<std::vector<std::string>> ExpandTokenizeInputs(const std::vector<std::string>& args,
                                                              const std::string& filter);

// Whether `path` begins as ptk-concat writes its plan (a .json whose first bytes are {"version": 1,
// "output_dir": ): ptk's own file, which ptk-tokenize's directory walk leaves out, and ptk-concat's
// reads whole to tell (LeaveOutOtherPlans).
bool StartsLikeAConcatPlan(const std::string& path);

void SortPaths(std::vector<std::string>* paths, PathOrder order);

}  // namespace ptk
