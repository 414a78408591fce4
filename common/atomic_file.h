// Atomic writes (a temporary of the writer's own, fsync, rename) and several files published together.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

// Writes to a temporary name of its own (`PATH.ptk-tmp-PID-RANDOM`, created with O_EXCL, so two
// writers of one PATH never share or truncate each other's file), then Commit() flushes, fsyncs,
// renames onto PATH and fsyncs the directory. Destroying an uncommitted writer removes the
// temporary file, so PATH either keeps its old contents or gets the complete new ones: never a
// half-written file. What a killed writer leaves is removed by RemoveStaleTemporaries
// (common/output_lock.h) once the next writer holds the output's lock.
class AtomicFileWriter {
 public:
  static constexpr std::string_view kTmpSuffix = ".ptk-tmp";
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  // Continues a temporary a killed writer left (its first `size` bytes kept, the rest cut off), for
  // resumable writers that recorded how far their temporary was durable.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Reopen(const std::string& path, const std::string& tmp_path,
                                                                  uint64_t size);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  absl::Status Write(const void* data, size_t size);
  absl::Status Write(std::string_view s) { return Write(s.data(), s.size()); }
  // Flushes the user-space buffer to the kernel (not fsync).
  absl::Status Flush();
  // Appends bytes [offset, offset+length) of another file (copy_file_range where possible).
  absl::Status AppendFileRange(const std::string& src_path, uint64_t offset, uint64_t length);
  // Flush + fsync + rename + fsync(dir). After success the writer is closed. durable=false skips
  // the fsyncs (still atomic: readers see the old file or the whole new one), for caches that are
  // validated on load and rebuilt when damaged.
  absl::Status Commit(bool durable = true);
  // Flush + fsync + close without the rename: the complete file stays at tmp_path(), for callers
  // that read it back or publish several files together (IndexedDatasetBuilder). Commit() may
  // follow; otherwise the caller renames it and calls Release().
  absl::Status Seal(bool durable = true);
  // After Seal() and the caller's own rename: forget the temporary name (nothing left to remove).
  void Release();
  // Removes the temporary file. Idempotent.
  void Abort();

  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_path_; }
  uint64_t bytes_written() const { return bytes_written_; }
  int fd() const { return fd_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp_path, int fd);
  void StartWriteback();
  std::string Describe() const;  // names the file for errors: the final path, then the temporary
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  bool done_ = false;
  uint64_t bytes_written_ = 0;
  uint64_t synced_ = 0;  // bytes handed to StartWriteback
  static constexpr size_t kBufSize = 1 << 20;
  std::unique_ptr<char[]> buf_;
  size_t buf_used_ = 0;
};

// Removes the temporaries of this process's writers that are neither committed nor aborted: what a
// main that dies of SIGINT or SIGTERM would leave (cli::RemoveTemporariesOnSignals). Any thread may
// call it; a signal handler may not.
void RemoveLiveTemporaries();

// Publishes several sealed temporaries of one directory together: writes the journal file
// `journal` (one "TMP<TAB>FINAL" line per file, base names), then renames each TMP onto its FINAL
// and removes the journal. A kill or a failure part-way leaves the journal, and
// CompletePendingPublish (which the next writer and reader of those files call) finishes the
// renames: every observer that honours the journal sees all old files or all new ones.
absl::Status PublishTogether(const std::string& journal, const std::vector<std::pair<std::string, std::string>>& files,
                             bool durable = true);
// PublishTogether of sealed writers this process still tracks, each onto its final name: their
// temporaries are handed over to the journal as one step for RemoveLiveTemporaries (a signal's cleanup,
// cli::RemoveTemporariesOnSignals, runs it on its own thread and waits for the step), which so finds
// them either still tracked (removed: nothing published) or named by a written journal (kept for its
// completion), never left untracked. An error before the journal exists leaves them the writers'.
absl::Status PublishWritersTogether(const std::string& journal,
                                    const std::vector<std::pair<AtomicFileWriter*, std::string>>& writers,
                                    bool durable = true);
// For tests: `hook` runs in PublishTogether once the journal is written, before the first rename
// (where a kill leaves the journal and its temporaries); nullptr: none.
void SetPublishHookForTesting(void (*hook)());
// For tests: `hook` runs in PublishWritersTogether's handover, before the journal is written (a signal
// that comes there finds its cleanup waiting for the handover; the hook itself must not call
// RemoveLiveTemporaries, which would wait for it); nullptr: none.
void SetHandoverHookForTesting(void (*hook)());
// Rolls a left-over journal forward; a no-op when there is none. Safe to run from several
// processes at once (a rename already done by another is skipped).
absl::Status CompletePendingPublish(const std::string& journal);

// Writes the whole file atomically.
absl::Status WriteFileAtomic(const std::string& path, std::string_view contents, bool durable = true);

}  // namespace ptk
