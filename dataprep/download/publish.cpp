// ptk-download: what happens to a file's bytes once they are on disk: hashed as they land
// (StreamHasher, off the receiving thread), then made durable and put in place (Publisher, off the
// download workers: their fsyncs committed together).
#include <utility>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "dataprep/download/download_internal.h"
#include "dataprep/download/publish_part.h"

namespace ptk::download_detail {

// ---------------------------------------------------------------- StreamHasher

namespace {
constexpr size_t kHashRead = 1 << 20;
}

StreamHasher::StreamHasher() : buf_(kHashRead) {
  thread_ = std::thread([this] { Loop(); });
}

StreamHasher::~StreamHasher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void StreamHasher::Start(int fd, bool git, uint64_t git_size) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return !busy_; });  // the thread no longer reads the previous file
  fd_ = fd;
  target_ = hashed_ = 0;
  error_ = absl::OkStatus();
  sha_ = std::make_unique<Sha256>(git ? Sha256::Algorithm::kSha1 : Sha256::Algorithm::kSha256);
  if (git) {
    const std::string hdr = fmt::format("blob {}", git_size);
    sha_->Update(hdr.data(), hdr.size() + 1);  // includes the NUL
  }
}

void StreamHasher::Advance(uint64_t end) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (end <= target_) return;
    target_ = end;
  }
  work_cv_.notify_one();
}

absl::StatusOr<std::string> StreamHasher::Finish(uint64_t end) {
  std::unique_lock<std::mutex> lock(mu_);
  target_ = std::max(target_, end);
  // What the hasher's thread has not done yet, the caller does itself: the end of a file never waits
  // for that thread to get a core (on a loaded machine, a wakeup can cost milliseconds).
  done_cv_.wait(lock, [&] { return !busy_; });
  busy_ = true;
  while (hashed_ < end && error_.ok()) {
    const uint64_t from = hashed_;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(end - hashed_, kHashRead));
    lock.unlock();
    ssize_t got = ::pread(fd_, buf_.data(), n, static_cast<off_t>(from));
    if (got > 0) sha_->Update(buf_.data(), static_cast<size_t>(got));
    lock.lock();
    if (got < 0)
      error_ = ErrnoToStatus(errno, "reading back a download to hash it");
    else if (got == 0)
      error_ = absl::DataLossError(fmt::format("a download ends at byte {}, before the bytes written", from));
    else
      hashed_ += static_cast<uint64_t>(got);
  }
  busy_ = false;
  fd_ = -1;
  done_cv_.notify_all();
  work_cv_.notify_all();
  if (!error_.ok()) return error_;
  return sha_->HexDigest();
}

void StreamHasher::Abandon() {
  std::unique_lock<std::mutex> lock(mu_);
  target_ = hashed_;
  done_cv_.wait(lock, [&] { return !busy_; });
  fd_ = -1;
}

void StreamHasher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return quit_ || (fd_ >= 0 && !busy_ && hashed_ < target_ && error_.ok()); });
    if (quit_) return;
    const int fd = fd_;
    const uint64_t from = hashed_;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(target_ - hashed_, kHashRead));
    busy_ = true;
    lock.unlock();
    ssize_t got = ::pread(fd, buf_.data(), n, static_cast<off_t>(from));
    absl::Status err;
    if (got < 0)
      err = ErrnoToStatus(errno, "reading back a download to hash it");
    else if (got == 0)
      err = absl::DataLossError(fmt::format("a download ends at byte {}, before the bytes written", from));
    else
      sha_->Update(buf_.data(), static_cast<size_t>(got));
    lock.lock();
    busy_ = false;
    if (!err.ok())
      error_ = err;
    else
      hashed_ += static_cast<uint64_t>(got);
    done_cv_.notify_all();
  }
}

// ---------------------------------------------------------------- Publisher

namespace {

// The data of a `.part` is durable before the rename; the directories (the renames) are fsynced
// once per run, at its end (a rename lost in a crash leaves a complete, fsynced `.part` to resume).
absl::Status PutInPlace(DoneLog& done, PublishItem& item) {
  PTK_RETURN_IF_ERROR(RenameFile(item.part_path, item.final_path));
  (void)RemoveFileIfExists(item.meta_path);
  PTK_RETURN_IF_ERROR(done.Append(item.done_key));
  return absl::OkStatus();
}

void CloseItem(PublishItem& item) {
  if (item.fd >= 0) ::close(item.fd);
  item.fd = -1;
  item.lock.reset();
}

}  // namespace

absl::Status PublishPart(Session& s, DoneLog& done, const RemoteFile& f, int* fd, const std::string& part_path,
                         const std::string& meta_path, uint64_t bytes, std::unique_ptr<OutputLock> lock) {
  PublishItem item;
  item.path = f.path;
  item.fd = std::exchange(*fd, -1);
  item.part_path = part_path;
  item.final_path = f.local_path;
  item.meta_path = meta_path;
  item.done_key = DoneLogKey(f);
  item.bytes = bytes;
  item.lock = std::move(lock);
  return Publish(s, done, std::move(item));
}

absl::Status Publish(Session& s, DoneLog& done, PublishItem item) {
  if (s.publisher) {
    s.publisher->Submit(std::move(item));
    return absl::OkStatus();
  }
  absl::Status st = FsyncFile(item.fd, item.part_path);
  if (st.ok()) st = PutInPlace(done, item);
  CloseItem(item);
  return st;
}

Publisher::Publisher(DoneLog& done) : done_(done) {
  for (int i = 0; i < kThreads; ++i) threads_.emplace_back([this] { Loop(); });
}

Publisher::~Publisher() {
  Drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Publisher::Submit(PublishItem item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
}

void Publisher::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && busy_ == 0; });
}

std::vector<std::pair<PublishItem, absl::Status>> Publisher::TakeFailures() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(failures_);
}

void Publisher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return quit_ || !queue_.empty(); });
    if (queue_.empty()) return;  // quit_
    PublishItem item = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    // fdatasync: the data and what reading it needs (size, blocks). Several threads sync at once,
    // so that the filesystem's journal commits many files' syncs together (one commit each costs
    // ~10 ms on a VM disk; 64 files: 0.5-0.6 s one after another, 45-90 ms from 8 threads, as much
    // as one syncfs, which would also wait for every other process's writes).
    absl::Status st;
    if (::fdatasync(item.fd) != 0) st = ErrnoToStatus(errno, fmt::format("fsync {}", item.part_path));
    if (st.ok()) st = PutInPlace(done_, item);
    CloseItem(item);
    lock.lock();
    if (!st.ok()) failures_.emplace_back(std::move(item), st);
    --busy_;
    if (queue_.empty() && busy_ == 0) idle_cv_.notify_all();
  }
}

}  // namespace ptk::download_detail
