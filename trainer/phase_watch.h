// Ends a rank's long work of its own (building the model, loading a checkpoint, building the
// datasets' indices) once another rank reports its own failure or dies, instead of at its next
// collective.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "trainer/rendezvous.h"

namespace ptk {

// While it lives, polls rank 0's store every `poll` on a thread of its own: for another rank's
// reported failure (PollReportedFailure), and for a rank that left it without finishing or
// reporting (PollExitedRank: killed, crashed; rank 0 too, whose store then closes this rank's
// connection). Once one is found, the phase has `grace` of this process's own work (its CPU time),
// within `grace_at_most` of wall time, to end by itself (it then meets the failure at its next
// collective, and unwinds as any failure does); if it has not, `stop` is called, on the watch's
// thread, with "rank R (host H): <phase> stopped: " and the failure (HeardFailure's: a usage error
// when the peer's was one; or "rank N (host H) exited (...)"): the caller ends the process there
// (ptk-train's main prints the line and exits). Rank 0 first serves its store until the other ranks
// heard (ServeUntilAllHeard, at most min(timeout, 30 s)), as a rank that reports does. Nothing is
// watched without a store or `stop` (one process, a test's run). End, or the destructor, ends the
// thread: none outlives the phase. A healthy run's work is untouched (nothing but the polls).
class LocalPhaseWatch {
 public:
  // The grace is counted in the process's CPU time, not the wall clock's, so that what a rank reports
  // does not depend on the load of its machine: a phase starved of CPU (ranks of two jobs on two cores)
  // still gets the second of work that lets one about to end end by itself (a wall-clock second gave it
  // a fraction of that); `grace_at_most` bounds the wait for a phase that does not run (starved for
  // good, or blocked reading a file), so that the failure is still reported within seconds.
  struct Timing {
    std::chrono::milliseconds poll{250}, grace{1000}, grace_at_most{5000};
  };
  using Stop = std::function<void(const absl::Status&)>;
  LocalPhaseWatch(std::shared_ptr<RendezvousStore> store, Stop stop, std::string phase, Timing timing);
  LocalPhaseWatch(std::shared_ptr<RendezvousStore> store, Stop stop, std::string phase)
      : LocalPhaseWatch(std::move(store), std::move(stop), std::move(phase), Timing{}) {}
  ~LocalPhaseWatch() { End(); }
  LocalPhaseWatch(const LocalPhaseWatch&) = delete;
  LocalPhaseWatch& operator=(const LocalPhaseWatch&) = delete;

  // The phase this rank is in from now on ("loading the checkpoint"), for the line.
  void Enter(std::string phase);
  // The phases are over: the thread ends (it may first finish a `stop` already begun).
  void End();

 private:
  void Run();
  // After a failure was heard: waits (`lock` held) until the phase ends (true), or it used its grace
  // of CPU time, or grace_at_most passed (false).
  bool WaitGrace(std::unique_lock<std::mutex>& lock);

  std::shared_ptr<RendezvousStore> store_;
  Stop stop_fn_;
  Timing timing_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string phase_;   // under mu_
  bool ended_ = false;  // under mu_
  std::thread thread_;
};

}  // namespace ptk
