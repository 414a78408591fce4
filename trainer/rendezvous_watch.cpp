// What a rank hears of the others' failures: the words every rank's line starts with
// (FailedCallPrefix), and NCCL's ranks' watch of rank 0's store for a reported failure.
#include <fmt/core.h>

#include "trainer/rendezvous.h"

namespace ptk {

std::string FailedCallWho(const FailedCall& at) {
  const std::string who =
      at.group.empty() ? fmt::format("rank {}", at.rank)
                       : fmt::format("rank {} of the {} group (world rank {})", at.rank, at.group, at.world_rank);
  return at.device >= 0 ? fmt::format("{} (host {}, cuda:{})", who, at.host, at.device)
                        : fmt::format("{} (host {})", who, at.host);
}

std::string FailedCallPrefix(const FailedCall& at) {
  return fmt::format("{}: {}: ", FailedCallWho(at),
                     at.call.empty() ? "no collective was in flight" : at.call + " failed");
}

ReportedFailureWatch::ReportedFailureWatch(std::shared_ptr<RendezvousStore> store, std::chrono::milliseconds interval) {
  thread_ = std::thread([this, store = std::move(store), interval] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      const bool heard = store->PollReportedFailure();
      lock.lock();
      if (heard) break;
      cv_.wait_for(lock, interval, [this] { return stop_; });
    }
  });
}

ReportedFailureWatch::~ReportedFailureWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

}  // namespace ptk
