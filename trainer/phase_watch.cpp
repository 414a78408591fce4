// A rank's long local phases, ended when another rank reports its own failure (see phase_watch.h).
#include "trainer/phase_watch.h"

#include <time.h>

#include <algorithm>
#include <utility>

#include <fmt/core.h>

namespace ptk {

LocalPhaseWatch::LocalPhaseWatch(std::shared_ptr<RendezvousStore> store, Stop stop, std::string phase, Timing timing)
    : store_(std::move(store)), stop_fn_(std::move(stop)), timing_(timing), phase_(std::move(phase)) {
  if (store_ && stop_fn_ && store_->world_size() > 1) thread_ = std::thread([this] { Run(); });
}

void LocalPhaseWatch::Enter(std::string phase) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = std::move(phase);
}

void LocalPhaseWatch::End() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

namespace {

// This process's CPU time so far (all its threads); the wall clock's where it cannot be read.
std::chrono::nanoseconds ProcessCpu() {
  timespec ts{};
  if (::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

}  // namespace

bool LocalPhaseWatch::WaitGrace(std::unique_lock<std::mutex>& lock) {
  const auto cpu0 = ProcessCpu();
  const auto at_most = std::chrono::steady_clock::now() + timing_.grace_at_most;
  // Checked every 20 ms (or the grace, if shorter): a clock read, nothing sent.
  const auto step =
      std::clamp<std::chrono::milliseconds>(timing_.grace, std::chrono::milliseconds(1), std::chrono::milliseconds(20));
  for (;;) {
    if (cv_.wait_for(lock, step, [this] { return ended_; })) return true;
    if (ProcessCpu() - cpu0 >= timing_.grace || std::chrono::steady_clock::now() >= at_most) return false;
  }
}

void LocalPhaseWatch::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  std::string exited;  // a rank killed (no report): its connection to rank 0's store closed
  for (;;) {
    if (cv_.wait_for(lock, timing_.poll, [this] { return ended_; })) return;
    lock.unlock();
    // Requests of their own, without the lock: End never waits on them long.
    const bool heard = store_->PollReportedFailure();
    if (!heard) exited = store_->PollExitedRank();
    lock.lock();
    if (heard || !exited.empty()) break;
  }
  // A phase that ends within the grace meets the failure at its next collective and unwinds as any
  // failure does (what this run made removed); one still busy is ended from here.
  if (WaitGrace(lock)) return;
  const std::string phase = phase_;
  lock.unlock();
  FailedCall me;
  me.rank = store_->rank();
  me.host = store_->host();
  const std::string prefix = fmt::format("{}: {} stopped: ", FailedCallWho(me), phase);
  // A rank that reported and then left is named with its reason, not as exited.
  const absl::Status why =
      store_->PollReportedFailure() ? store_->HeardFailure(prefix) : absl::AbortedError(prefix + exited);
  if (store_->rank() == 0)
    store_->ServeUntilAllHeard(std::min<std::chrono::milliseconds>(store_->timeout(), std::chrono::seconds(30)));
  stop_fn_(why);
}

}  // namespace ptk
