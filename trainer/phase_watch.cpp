// A rank's long local phases, ended when another rank reports its own failure (see phase_watch.h).
#include "trainer/phase_watch.h"

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

void LocalPhaseWatch::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (cv_.wait_for(lock, timing_.poll, [this] { return ended_; })) return;
    lock.unlock();
    const bool heard = store_->PollReportedFailure();  // one request, without the lock: End never waits on it long
    lock.lock();
    if (heard) break;
  }
  // A phase that ends within the grace meets the failure at its next collective and unwinds as any
  // failure does (what this run made removed); one still busy is ended from here.
  if (cv_.wait_for(lock, timing_.grace, [this] { return ended_; })) return;
  const std::string phase = phase_;
  lock.unlock();
  FailedCall me;
  me.rank = store_->rank();
  me.host = store_->host();
  const absl::Status why = store_->HeardFailure(fmt::format("{}: {} stopped: ", FailedCallWho(me), phase));
  if (store_->rank() == 0)
    store_->ServeUntilAllHeard(std::min<std::chrono::milliseconds>(store_->timeout(), std::chrono::seconds(30)));
  stop_fn_(why);
}

}  // namespace ptk
