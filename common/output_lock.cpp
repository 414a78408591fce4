// One writer per output (see output_lock.h).
#include "common/output_lock.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <mutex>
#include <set>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"

namespace ptk {
namespace {

constexpr std::string_view kBusyTag = "is being written by another run";

std::string HostName() {
  char h[256] = {0};
  if (::gethostname(h, sizeof(h) - 1) != 0) return "unknown-host";
  return h;
}

std::string HolderText() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &tm);
  const std::string& prog = log::ProgramName();
  return fmt::format("{} (pid {} on host {}, since {})", prog.empty() ? "ptk" : prog, ::getpid(), HostName(), when);
}

// Printable form of what a lock file says about its holder (it is only ever written by ptk, but
// a lock file is just a file: never print raw bytes from it).
std::string ReadHolder(int fd) {
  char buf[512];
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  std::string s;
  for (ssize_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(buf[i]);
    if (c == '\n') break;
    s += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return s;
}

// The lock files this process holds (RemoveLiveLocks). A path leaves it, under the mutex, just before
// its file is unlinked and the lock let go, so that a file is never unlinked after another run may
// have created one of the same name.
std::mutex& LiveMutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& LiveLocks() {
  static std::set<std::string> s;
  return s;
}
// Set by RemoveLiveLocks (the process is about to die of a signal): a lock file created after it
// would outlive the process, so Acquire creates none.
bool dying = false;

// The name of the holder of the lock `fd` could not take, once it wrote it. The holder writes its name just
// after it locks: wait for it, up to 30 s (a loaded machine can keep a process off the CPU, or its ftruncate
// and pwrite behind the file system, for seconds: with 2 s the run was refused naming no holder). A holder
// killed between locking and naming itself lets go of the lock without a name: *freed, the output is free.
std::string BusyHolder(int fd, bool* freed) {
  std::string holder = ReadHolder(fd);
  *freed = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (holder.empty() && !*freed && std::chrono::steady_clock::now() < until) {
    ::usleep(10000);
    holder = ReadHolder(fd);
    struct flock probe = {};
    probe.l_type = F_WRLCK;
    probe.l_whence = SEEK_SET;
    *freed = holder.empty() && ::fcntl(fd, F_OFD_GETLK, &probe) == 0 && probe.l_type == F_UNLCK;
  }
  return holder.empty() ? "a process that has not written its name" : holder;
}

std::string SecondsWords(int64_t ms) { return fmt::format("{:g} s", static_cast<double>(ms) / 1000.0); }

}  // namespace

void RemoveLiveLocks() {
  std::lock_guard<std::mutex> g(LiveMutex());
  for (const std::string& p : LiveLocks()) ::unlink(p.c_str());
  LiveLocks().clear();
  dying = true;
}

absl::StatusOr<std::unique_ptr<OutputLock>> OutputLock::Acquire(const std::string& target,
                                                                std::chrono::milliseconds wait) {
  const std::string path = target + kSuffix;
  // --lock-wait: a held output is tried again until the wait is over, a line every 10 s saying so.
  const int64_t wait_ms = std::max<int64_t>(0, static_cast<int64_t>(wait.count()));
  const auto start = std::chrono::steady_clock::now();
  auto next_line = start;
  for (int attempt = 0; attempt < 64;) {
    // Created, locked and recorded as one step under the mutex: RemoveLiveLocks (a signal's cleanup on
    // another thread) never misses a lock file this process made, nor runs before one is made.
    std::unique_lock<std::mutex> live(LiveMutex());
    if (dying) return absl::CancelledError(fmt::format("{}: not locked: the process is being interrupted", target));
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return ErrnoToStatus(errno, fmt::format("cannot create lock file {}", path));
    struct flock fl = {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (::fcntl(fd, F_OFD_SETLK, &fl) != 0) {
      const int e = errno;
      if (e == EAGAIN || e == EACCES) {
        live.unlock();  // another process's file: nothing of ours to record while we wait for its name
        bool freed = false;
        const std::string holder = BusyHolder(fd, &freed);
        ::close(fd);
        if (freed) {
          ++attempt;
          continue;  // its holder died before naming itself: start over to take it
        }
        const auto now = std::chrono::steady_clock::now();
        const int64_t waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count();
        if (waited >= wait_ms)
          return absl::AbortedError(fmt::format(
              "{} {} {}: {}{}; wait for it to finish or stop it (a killed run's lock is released by the kernel)",
              target, kBusyTag, "(lock " + path + ")", holder,
              wait_ms > 0 ? fmt::format("; still held after waiting {} (--lock-wait)", SecondsWords(wait_ms)) : ""));
        if (now >= next_line) {
          log::Info("{} {} (lock {}): {}; waited {} of {} (--lock-wait)", target, kBusyTag, path, holder,
                    SecondsWords(waited / 1000 * 1000), SecondsWords(wait_ms));
          next_line = now + std::chrono::seconds(10);
        }
        ::usleep(static_cast<useconds_t>(std::min<int64_t>(wait_ms - waited, 500) * 1000));
        continue;
      }
      if (e == ENOSYS || e == ENOLCK || e == EOPNOTSUPP || e == EINVAL) {
        static std::atomic<bool> warned{false};
        if (!warned.exchange(true))
          log::Warning(
              "{}: the file system does not support locks ({}); overlapping runs on one output are not "
              "detected (each still publishes only complete files). On Lustre, mount with -o flock.",
              path, std::strerror(e));
        return std::unique_ptr<OutputLock>(new OutputLock(path, fd, false));
      }
      ::close(fd);
      return ErrnoToStatus(e, fmt::format("lock {}", path));
    }
    // The previous holder unlinks the file before it lets go: if what we locked is no longer the
    // file at `path`, someone else may lock a fresh one; start over.
    struct stat a, b;
    if (::fstat(fd, &a) != 0 || ::stat(path.c_str(), &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
      ::close(fd);
      ++attempt;
      continue;
    }
    const std::string text = HolderText() + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
      // Only informational; the lock itself is held.
    }
    LiveLocks().insert(path);
    return std::unique_ptr<OutputLock>(new OutputLock(path, fd, true));
  }
  return absl::AbortedError(fmt::format("{} {} (lock {} keeps changing hands)", target, kBusyTag, path));
}

OutputLock::~OutputLock() {
  if (fd_ < 0) return;
  std::lock_guard<std::mutex> g(LiveMutex());
  // Before letting go (see Acquire); not when RemoveLiveLocks has removed it already.
  if (locked_ && LiveLocks().erase(path_) == 1) ::unlink(path_.c_str());
  ::close(fd_);
}

bool IsOutputBusy(const absl::Status& status) {
  return status.code() == absl::StatusCode::kAborted && StatusMessage(status).find(kBusyTag) != std::string_view::npos;
}

namespace {
// Whether `rest` (a name past TARGET) is one of ptk's temporaries of TARGET: `.ptk-tmp` or `.ptk-verify`,
// alone or followed by `-...` (AtomicFileWriter's `-PID-RANDOM`), directly or after the sidecar's
// `.ptk-done`. A user's `TARGET.ptk-tmpl` or `TARGET.ptk-verifying` is not.
bool IsStaleTemporarySuffix(std::string_view rest) {
  if (rest.rfind(".ptk-done", 0) == 0) rest.remove_prefix(std::string_view(".ptk-done").size());
  for (std::string_view marker : {std::string_view(".ptk-tmp"), std::string_view(".ptk-verify")}) {
    if (rest.rfind(marker, 0) != 0) continue;
    const std::string_view tail = rest.substr(marker.size());
    if (tail.empty() || tail[0] == '-') return true;
  }
  return false;
}
}  // namespace

void RemoveStaleTemporaries(const std::string& target, const std::string& keep) {
  const std::string dir = Dirname(target);
  const std::string base = Basename(target);
  DIR* d = ::opendir(dir.empty() ? "." : dir.c_str());
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name.rfind(base, 0) != 0) continue;
    if (!keep.empty() && name == Basename(keep)) continue;
    // ".ptk-tmp-...", ".ptk-done.ptk-tmp-...", ...
    if (IsStaleTemporarySuffix(name.substr(base.size()))) ::unlinkat(::dirfd(d), e->d_name, 0);
  }
  ::closedir(d);
}

}  // namespace ptk
