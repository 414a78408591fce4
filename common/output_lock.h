// One writer per output: a lock file beside the output (`OUTPUT.ptk-lock`) held with an
// open-file-description lock (fcntl F_OFD_SETLK) for as long as the OutputLock object lives.
//
// What it relies on: the kernel drops the lock when the holder exits, however it exits (kill -9
// included), so a killed run never blocks a rerun. On NFS (v3 through lockd, v4 natively) the
// lock is seen by every client and the server drops it when the holder's client dies; Lustre
// needs the `flock` mount option for the lock to be seen across nodes (`localflock` makes it
// node-local, `noflock` refuses it: then ptk warns once and runs unlocked). Even without a working
// lock, every writer writes under its own temporary name and publishes by rename, so two
// overlapping runs can never mix bytes: the last complete file wins.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

class OutputLock {
 public:
  static constexpr const char* kSuffix = ".ptk-lock";
  // Takes the lock for `target`. When another process (or another writer in this process) holds
  // it, fails with an Aborted status naming the holder (program, pid, host, start time): at once (`wait`
  // 0, the default), or after trying again until `wait` is over (a line every 10 s naming the output and
  // the holder; the failure says how long it waited). A tool's --lock-wait (cli::AddLockWait) gives
  // `wait`, carried in its options to the call: a node that died holding a lock on NFS keeps it until
  // the server's lease ends (~90 s), and a requeued task waits it out.
  static absl::StatusOr<std::unique_ptr<OutputLock>> Acquire(
      const std::string& target, std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  // Releases the lock and removes the lock file.
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  OutputLock(std::string path, int fd, bool locked) : path_(std::move(path)), fd_(fd), locked_(locked) {}
  std::string path_;
  int fd_ = -1;
  bool locked_ = false;
};

// Removes the lock files this process holds, each still held, as ~OutputLock removes its own before it
// lets go: for a main about to die of a signal (cli::RemoveTemporariesOnSignals), which would leave
// `OUT.ptk-lock` naming a dead holder (it blocks nothing, but reads as a run in progress). The locks
// themselves go with the process. Any thread may call it; a signal handler may not.
void RemoveLiveLocks();

// True for the status Acquire returns when another run holds the lock.
bool IsOutputBusy(const absl::Status& status);

// Removes what killed writers of `target` left behind: `TARGET.ptk-tmp[-*]`, `TARGET.ptk-verify[-*]` and
// the temporaries of its sidecar (`TARGET.ptk-done.ptk-tmp[-*]`); nothing else (a user's
// `TARGET.ptk-tmpl` stays).
// Call only while holding the target's OutputLock (no live writer can own them then).
// `keep`: one path to leave (a temporary that a resumed writer continues).
void RemoveStaleTemporaries(const std::string& target, const std::string& keep = "");

}  // namespace ptk
