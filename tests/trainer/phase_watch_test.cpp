// Another rank's reported failure as every rank's line says it: FailedCallPrefix's words (this rank,
// its group, the call in flight: gloo's and NCCL's alike), and LocalPhaseWatch, which ends a rank
// still busy with its own start-up (the model, --load, the datasets' indices) naming the phase,
// instead of leaving it to the next collective. Stores on loopback ports, ranks as objects.
#include "trainer/phase_watch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "tests/trainer/test_ports.h"
#include "trainer/rendezvous.h"

namespace ptk {
namespace {

using namespace std::chrono_literals;

FailedCall At(int rank, const std::string& group, int world_rank, const std::string& host, int device,
              const std::string& call) {
  FailedCall at;
  at.rank = rank;
  at.group = group;
  at.world_rank = world_rank;
  at.host = host;
  at.device = device;
  at.call = call;
  return at;
}

TEST(FailedCallPrefix, NamesTheRankItsGroupAndTheCallInFlight) {
  EXPECT_EQ(FailedCallPrefix(At(3, "", 3, "node-b", -1, "barrier")), "rank 3 (host node-b): barrier failed: ");
  EXPECT_EQ(FailedCallPrefix(At(1, "tensor", 3, "node-b", 1, "all-reduce")),
            "rank 1 of the tensor group (world rank 3) (host node-b, cuda:1): all-reduce failed: ");
  EXPECT_EQ(FailedCallPrefix(At(0, "pipeline", 4, "n", 0, "")),
            "rank 0 of the pipeline group (world rank 4) (host n, cuda:0): no collective was in flight: ");
  EXPECT_EQ(FailedCallWho(At(2, "", 2, "n", -1, "")), "rank 2 (host n)");
}

std::vector<std::shared_ptr<RendezvousStore>> Stores(int world) {
  const int port = testing::FreeTestPort();
  std::vector<std::shared_ptr<RendezvousStore>> stores(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto s = RendezvousStore::Connect(r, world, "127.0.0.1", port, 60000ms);
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) stores[static_cast<size_t>(r)] = *std::move(s);
  }
  return stores;
}

// What a watch's `stop` was called with, once.
struct Stopped {
  std::mutex mu;
  std::optional<absl::Status> status;
  int calls = 0;
  LocalPhaseWatch::Stop Fn() {
    return [this](const absl::Status& st) {
      std::lock_guard<std::mutex> lock(mu);
      status = st;
      ++calls;
    };
  }
  // Waits, at most 10 s, for the stop. `busy`: as a phase still at work, spending CPU time meanwhile
  // (the watch's grace is counted in it); else asleep, as a phase that does not run.
  std::optional<absl::Status> Wait(bool busy = true) {
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < end) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (status) return status;
      }
      if (!busy) std::this_thread::sleep_for(10ms);
    }
    return std::nullopt;
  }
};

// Rank 2 is still loading its checkpoint when rank 1 reports its own failure: its watch stops it
// naming itself, the phase, rank 1 and the reason (a usage error stays one). Before, rank 2 went on
// until its next collective, however long the phase took.
TEST(LocalPhaseWatch, AReportedFailureEndsAPhaseStillBusyNamingIt) {
  for (const absl::Status& why :
       {absl::DataLossError("iter_0000004: checksum mismatch"), UsageError("--train-samples 14: too few")}) {
    auto stores = Stores(3);
    ASSERT_EQ(stores.size(), 3u);
    Stopped stopped;
    {
      LocalPhaseWatch watch(stores[2], stopped.Fn(), "building the model", {.poll = 20ms, .grace = 100ms});
      watch.Enter("loading the checkpoint");
      ASSERT_TRUE(stores[1]->ReportFailure(why));
      const std::optional<absl::Status> st = stopped.Wait();
      ASSERT_TRUE(st.has_value()) << "the watch did not stop the phase";
      EXPECT_EQ(st->message(), "rank 2 (host " + HostName() + "): loading the checkpoint stopped: rank 1 (host " +
                                   HostName() + ") stopped: " + std::string(why.message()));
      EXPECT_EQ(IsUsageError(*st), IsUsageError(why)) << *st;
      EXPECT_TRUE(IsUsageError(why) || absl::IsAborted(*st)) << *st;
    }
    EXPECT_EQ(stopped.calls, 1);
    for (int r = 2; r >= 0; --r) stores[static_cast<size_t>(r)].reset();  // rank 0, which serves them, last
  }
}

// A phase that ends within the grace after the failure was heard is left to its next collective
// (which fails naming the same rank, and unwinds, removing what the run made): no stop. A healthy
// phase, with nothing reported, is never stopped; End ends the thread at once.
TEST(LocalPhaseWatch, APhaseEndingWithinTheGraceOrHealthyIsNotStopped) {
  auto stores = Stores(2);
  ASSERT_EQ(stores.size(), 2u);
  Stopped stopped;
  {
    LocalPhaseWatch healthy(stores[1], stopped.Fn(), "building the datasets", {.poll = 10ms, .grace = 10ms});
    std::this_thread::sleep_for(200ms);
    const auto t0 = std::chrono::steady_clock::now();
    healthy.End();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  }
  EXPECT_EQ(stopped.calls, 0);
  {
    LocalPhaseWatch watch(stores[1], stopped.Fn(), "building the datasets",
                          {.poll = 10ms, .grace = 60s, .grace_at_most = 60s});
    ASSERT_TRUE(stores[0]->ReportFailure(absl::NotFoundError("data_text_document.idx: no such file")));
    for (int i = 0; i < 1000 && stores[1]->HeardFailure("").ok(); ++i) std::this_thread::sleep_for(10ms);
    ASSERT_FALSE(stores[1]->HeardFailure("").ok()) << "the watch's poll never heard the failure";
    watch.End();  // the phase ended within its grace
  }
  EXPECT_EQ(stopped.calls, 0);
  // A phase that does not run meanwhile (starved of CPU: here asleep) has its grace of CPU time still to
  // use, however long that takes in wall time (up to grace_at_most): not stopped after 10 times its grace.
  // Before, the grace was a wall-clock second, and a rank on a loaded machine was stopped with a phase
  // that had barely run since.
  {
    auto more = Stores(2);
    ASSERT_EQ(more.size(), 2u);
    LocalPhaseWatch watch(more[1], stopped.Fn(), "building the datasets",
                          {.poll = 10ms, .grace = 100ms, .grace_at_most = 60s});
    ASSERT_TRUE(more[0]->ReportFailure(absl::NotFoundError("data_text_document.idx: no such file")));
    for (int i = 0; i < 1000 && more[1]->HeardFailure("").ok(); ++i) std::this_thread::sleep_for(10ms);
    ASSERT_FALSE(more[1]->HeardFailure("").ok()) << "the watch's poll never heard the failure";
    std::this_thread::sleep_for(1s);
    EXPECT_EQ(stopped.calls, 0) << (stopped.status ? stopped.status->ToString() : "");
    watch.End();  // the phase ended within its grace of work
    more[1].reset();
  }
  EXPECT_EQ(stopped.calls, 0);
  // One process, or no stop to call: nothing is watched.
  LocalPhaseWatch none(nullptr, stopped.Fn(), "building the model");
  LocalPhaseWatch no_stop(stores[1], nullptr, "building the model");
  stores[1].reset();
  stores[0].reset();
}

// A phase that does not run at all after the failure was heard (asleep here; blocked reading a file, or
// starved for good) is stopped once grace_at_most passed, however much of its grace of CPU time is left.
TEST(LocalPhaseWatch, APhaseThatDoesNotRunIsStoppedAfterGraceAtMost) {
  auto stores = Stores(2);
  ASSERT_EQ(stores.size(), 2u);
  Stopped stopped;
  {
    LocalPhaseWatch watch(stores[1], stopped.Fn(), "loading the checkpoint",
                          {.poll = 10ms, .grace = 600s, .grace_at_most = 200ms});
    ASSERT_TRUE(stores[0]->ReportFailure(absl::DataLossError("iter_0000004: checksum mismatch")));
    const std::optional<absl::Status> st = stopped.Wait(/*busy=*/false);
    ASSERT_TRUE(st.has_value()) << "the watch did not stop the phase";
    EXPECT_EQ(st->message(), "rank 1 (host " + HostName() + "): loading the checkpoint stopped: rank 0 (host " +
                                 HostName() + ") stopped: iter_0000004: checksum mismatch");
  }
  stores[1].reset();
  stores[0].reset();
}

// A rank killed while another still starts (its connection to rank 0's store closed, nothing
// reported): the watch stops the phase naming it as exited; a rank that finished (MarkFinished), as
// one with nothing to train does while the others still load, is no death.
TEST(LocalPhaseWatch, ARankThatDiesEndsAPhaseStillBusyOneThatFinishedDoesNot) {
  auto stores = Stores(4);
  ASSERT_EQ(stores.size(), 4u);
  Stopped stopped;
  {
    LocalPhaseWatch watch(stores[2], stopped.Fn(), "building the datasets", {.poll = 10ms, .grace = 10ms});
    stores[3]->MarkFinished();
    stores[3].reset();
    std::this_thread::sleep_for(300ms);
    EXPECT_EQ(stopped.calls, 0) << (stopped.status ? stopped.status->ToString() : "");
    stores[1].reset();  // killed
    const std::optional<absl::Status> st = stopped.Wait();
    ASSERT_TRUE(st.has_value()) << "the watch did not stop the phase";
    EXPECT_TRUE(absl::IsAborted(*st)) << *st;
    EXPECT_EQ(st->message(), "rank 2 (host " + HostName() + "): building the datasets stopped: rank 1 (host " +
                                 HostName() +
                                 ") exited (its connection to the rendezvous closed: killed, crashed or "
                                 "stopped early)");
  }
  stores[2].reset();
  stores[0].reset();
}

// Rank 0 killed while another rank still starts: that rank's own connection to rank 0's store closes,
// and its watch stops the phase naming rank 0 as exited. Before, rank 0's silence read as "nothing to
// report", and the rank went on to its next collective.
TEST(LocalPhaseWatch, RankZeroDyingEndsAPhaseStillBusy) {
  auto stores = Stores(3);
  ASSERT_EQ(stores.size(), 3u);
  Stopped stopped;
  {
    LocalPhaseWatch watch(stores[1], stopped.Fn(), "loading the checkpoint", {.poll = 10ms, .grace = 10ms});
    stores[0].reset();  // killed: its store, and every connection to it, closes
    const std::optional<absl::Status> st = stopped.Wait();
    ASSERT_TRUE(st.has_value()) << "the watch did not stop the phase";
    EXPECT_TRUE(absl::IsAborted(*st)) << *st;
    EXPECT_EQ(st->message(), "rank 1 (host " + HostName() +
                                 "): loading the checkpoint stopped: rank 0 (which serves the rendezvous) exited "
                                 "(its connection closed: killed, crashed or stopped early)");
  }
  stores[2].reset();
  stores[1].reset();
}

}  // namespace
}  // namespace ptk
