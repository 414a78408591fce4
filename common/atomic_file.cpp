// Atomic writes and the publish journal.
#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"

namespace ptk {
namespace {

// The temporaries of the writers that are neither committed nor aborted, for RemoveLiveTemporaries.
// Never destroyed: a thread may still finish a writer while the process exits.
std::mutex& LiveMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::set<std::string>& Live() {
  static auto* live = new std::set<std::string>;
  return *live;
}
bool dying = false;  // RemoveLiveTemporaries ran: no new temporary (under LiveMutex)

// Held while PublishWritersTogether hands its writers' temporaries over to a journal, and by
// RemoveLiveTemporaries around its removals (taken before LiveMutex): a cleanup waits for the handover.
std::mutex& HandoverMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

void Untrack(const std::string& tmp) {
  std::lock_guard<std::mutex> lock(LiveMutex());
  Live().erase(tmp);
}

}  // namespace

void RemoveLiveTemporaries() {
  std::lock_guard<std::mutex> handover(HandoverMutex());
  std::lock_guard<std::mutex> lock(LiveMutex());
  for (const std::string& tmp : Live()) ::unlink(tmp.c_str());
  Live().clear();
  dying = true;
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp_path, int fd)
    // The buffer is not zero-filled: its pages are faulted in only as they are written.
    : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd), buf_(new char[kBufSize]) {}

void AtomicFileWriter::Release() {
  done_ = true;
  Untrack(tmp_path_);
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    uint32_t r = 0;
    if (::getrandom(&r, sizeof(r), 0) != sizeof(r)) r = static_cast<uint32_t>(counter.load() * 2654435761u);
    std::string tmp = fmt::format("{}{}-{}-{:08x}", path, kTmpSuffix, ::getpid(), r ^ counter.fetch_add(1));
    // Created and recorded as one step: RemoveLiveTemporaries never misses a file that exists.
    std::lock_guard<std::mutex> lock(LiveMutex());
    if (dying) return absl::CancelledError(fmt::format("{}: not written: the process is being interrupted", path));
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd >= 0) {
      Live().insert(tmp);
      return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp, fd));
    }
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
  {
    std::lock_guard<std::mutex> lock(LiveMutex());
    Live().insert(tmp_path);
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
  PTK_ASSIGN_OR_RETURN(const int in, OpenRegularFile(src_path));
  absl::Status st = CopyFdRange(in, offset, fd_, length, fmt::format("{} into {}", src_path, Describe()));
  ::close(in);
  if (st.ok()) {
    bytes_written_ += length;
  }
  return st;
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
  Untrack(tmp_path_);
  return durable ? FsyncDir(Dirname(path_)) : absl::OkStatus();
}

void AtomicFileWriter::Abort() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!done_) {
    ::unlink(tmp_path_.c_str());
    Untrack(tmp_path_);
  }
  done_ = true;
}

absl::Status WriteFileAtomic(const std::string& path, std::string_view contents, bool durable) {
  PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(path));
  PTK_RETURN_IF_ERROR(w->Write(contents));
  return w->Commit(durable);
}

namespace {
std::atomic<void (*)()> publish_hook{nullptr};
std::atomic<void (*)()> handover_hook{nullptr};
}  // namespace

void SetPublishHookForTesting(void (*hook)()) { publish_hook = hook; }
void SetHandoverHookForTesting(void (*hook)()) { handover_hook = hook; }

namespace {

// The journal of `files` (temporary, final name: one directory) written; before it exists a check
// fails the publish with nothing renamed, the temporaries still the caller's.
absl::Status WritePublishJournal(const std::string& journal,
                                 const std::vector<std::pair<std::string, std::string>>& files, bool durable) {
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
  return WriteFileAtomic(journal, text, durable);
}

// The renames of a written journal.
absl::Status CompletePublish(const std::string& journal,
                             const std::vector<std::pair<std::string, std::string>>& files) {
  if (void (*hook)() = publish_hook.load()) hook();
  // Until the first rename is done nothing is published: a failure there is undone (the journal
  // removed), as if the publish had not begun.
  if (!files.empty() && ::rename(files[0].first.c_str(), files[0].second.c_str()) != 0) {
    const int e = errno;
    (void)RemoveFileIfExists(journal);
    return ErrnoToStatus(e, fmt::format("publish {} -> {}; nothing was published", files[0].first, files[0].second));
  }
  return CompletePendingPublish(journal);
}

}  // namespace

absl::Status PublishTogether(const std::string& journal, const std::vector<std::pair<std::string, std::string>>& files,
                             bool durable) {
  PTK_RETURN_IF_ERROR(WritePublishJournal(journal, files, durable));
  return CompletePublish(journal, files);
}

absl::Status PublishWritersTogether(const std::string& journal,
                                    const std::vector<std::pair<AtomicFileWriter*, std::string>>& writers,
                                    bool durable) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& [writer, final_path] : writers) files.emplace_back(writer->tmp_path(), final_path);
  {
    // One step for a signal's cleanup (RemoveLiveTemporaries, on its own thread): before it the
    // temporaries are tracked (removed by it: nothing published), after it a written journal names
    // them (kept for its completion); released before the journal they were neither, and left behind.
    std::lock_guard<std::mutex> handover(HandoverMutex());
    if (void (*hook)() = handover_hook.load()) hook();
    PTK_RETURN_IF_ERROR(WritePublishJournal(journal, files, durable));
    for (const auto& w : writers) w.first->Release();
  }
  return CompletePublish(journal, files);
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

}  // namespace ptk
