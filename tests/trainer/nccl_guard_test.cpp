// NcclGuard, the NCCL communicator's state machine (trainer/cuda/nccl_guard.h), with a fake
// communicator in NCCL's place: no call reaches the communicator after ncclCommAbort freed it (an
// abort racing the training thread's enqueues and polls), the abort flag is set before the abort,
// a nonblocking communicator is finalized and polled to completion before it is destroyed, and
// failures abort once and say what failed. Runs without a GPU.
#include "trainer/cuda/nccl_guard.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ptk::cuda {
namespace {

using namespace std::chrono_literals;

// A communicator that records its calls, fails a test on any call after it was freed (Abort or
// Destroy) or made while another call is in progress, and can be told what to answer.
struct FakeState {
  std::mutex mu;
  std::vector<std::string> calls;
  bool freed = false;
  int use_after_free = 0;
  int concurrent = 0;
  std::atomic<int> in_call{0};
  int async_in_progress = 0;  // GetAsyncError answers ncclInProgress this many times, then async_result
  int async_result = kNcclSuccess;
  int finalize_result = kNcclInProgress;
  // Abort: called while the guard's flag is already set? (checked through `aborted_probe`)
  std::function<bool()> aborted_probe;
  int abort_before_flag = 0;
  // Abort waits for this (the test's racing thread has started a call), then lingers: a window in
  // which a thread that did not see the flag would reach the communicator.
  std::function<void()> abort_pause;
};

class FakeCalls : public NcclCalls {
 public:
  explicit FakeCalls(FakeState* s) : s_(s) {}
  int GetAsyncError(int* async) override {
    Enter("GetAsyncError");
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (s_->async_in_progress > 0) {
        --s_->async_in_progress;
        *async = kNcclInProgress;
      } else {
        *async = s_->async_result;
      }
    }
    Leave();
    return kNcclSuccess;
  }
  std::string LastError() override {
    Enter("LastError");
    Leave();
    return "fake last error";
  }
  std::string ErrorString(int r) override { return "fake error " + std::to_string(r); }
  int Finalize() override {
    Enter("Finalize");
    Leave();
    return s_->finalize_result;
  }
  int Destroy() override {
    Enter("Destroy");
    Free();
    Leave();
    return kNcclSuccess;
  }
  int Abort() override {
    Enter("Abort");
    if (s_->aborted_probe && !s_->aborted_probe()) ++s_->abort_before_flag;
    if (s_->abort_pause) s_->abort_pause();
    Free();
    Leave();
    return kNcclSuccess;
  }
  // What an enqueue (ncclAllReduce, ...) does to the communicator.
  int Enqueue(int result) {
    Enter("Enqueue");
    Leave();
    return result;
  }

 private:
  void Enter(const char* what) {
    if (s_->in_call.fetch_add(1) != 0) {
      std::lock_guard<std::mutex> lock(s_->mu);
      ++s_->concurrent;
    }
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->calls.push_back(what);
    if (s_->freed) ++s_->use_after_free;
  }
  void Leave() { s_->in_call.fetch_sub(1); }
  void Free() {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->freed = true;
  }
  FakeState* s_;
};

absl::Status Failed(const std::string& what, const std::string& why) {
  return absl::UnavailableError(what + " failed: " + why);
}

struct Fixture {
  FakeState state;
  FakeCalls* calls = nullptr;  // owned by the guard
  std::unique_ptr<NcclGuard> guard;
  explicit Fixture(std::chrono::milliseconds timeout = 10s) {
    auto c = std::make_unique<FakeCalls>(&state);
    calls = c.get();
    guard = std::make_unique<NcclGuard>(std::move(c), timeout, Failed);
    state.aborted_probe = [this] { return guard->aborted(); };
  }
  std::vector<std::string> Calls() {
    std::lock_guard<std::mutex> lock(state.mu);
    return state.calls;
  }
};

// The training thread enqueues and settles collectives (each polled through a few ncclInProgress
// answers) while the watchdog polls for asynchronous errors and then aborts: no call after the
// abort, none concurrent with another, and every call after it returns the abort's status.
TEST(NcclGuard, AbortRacingTheTrainingThreadNeverUsesTheFreedCommunicator) {
  for (int round = 0; round < 200; ++round) {
    Fixture f;
    f.state.async_in_progress = 1 << 30;  // every collective stays in progress until aborted
    std::atomic<bool> stop{false};
    std::atomic<int> ok_after_abort{0};
    std::thread training([&] {
      while (!stop) {
        absl::Status st = f.guard->Call("all-reduce", [&] { return f.calls->Enqueue(kNcclInProgress); });
        if (st.ok() && f.guard->aborted()) ++ok_after_abort;
        if (!st.ok()) {
          EXPECT_NE(std::string(st.message()).find("watchdog"), std::string::npos) << st;
          break;
        }
      }
    });
    std::thread watchdog([&] {
      for (int i = 0; i < round % 7; ++i) EXPECT_EQ(f.guard->AsyncProblem(), "");
      std::this_thread::sleep_for(std::chrono::microseconds(50 * (round % 5)));
      EXPECT_TRUE(f.guard->Abort(absl::UnavailableError("the watchdog aborted it")));
      EXPECT_FALSE(f.guard->Abort(absl::UnavailableError("a second abort")));
      EXPECT_EQ(f.guard->AsyncProblem(), "");
    });
    watchdog.join();
    training.join();
    stop = true;
    EXPECT_EQ(f.state.use_after_free, 0) << "round " << round;
    EXPECT_EQ(f.state.concurrent, 0) << "round " << round;
    EXPECT_EQ(f.state.abort_before_flag, 0) << "round " << round;
    EXPECT_EQ(ok_after_abort, 0);
    // After the abort: statuses, never a call, and Close leaves the freed communicator alone.
    const size_t before = f.Calls().size();
    absl::Status st = f.guard->Call("broadcast", [&] { return f.calls->Enqueue(kNcclSuccess); });
    EXPECT_NE(std::string(st.message()).find("the watchdog aborted it"), std::string::npos) << st;
    EXPECT_TRUE(f.guard->Settle(kNcclInProgress, "all-gather").code() == absl::StatusCode::kUnavailable);
    EXPECT_TRUE(f.guard->Close(true).ok());
    EXPECT_EQ(f.Calls().size(), before);
    if (HasFailure()) break;
  }
}

// The window the old order left open (ncclCommAbort first, the flag after): the abort lingers
// until the training thread has started its next call. With the flag set under the lock first,
// that call waits for the abort and returns its status without touching the communicator.
TEST(NcclGuard, ACallStartedDuringTheAbortWaitsAndFails) {
  Fixture f;
  std::mutex m;
  std::condition_variable cv;
  bool calling = false;
  f.state.abort_pause = [&] {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, 5s, [&] { return calling; });
    lock.unlock();
    std::this_thread::sleep_for(50ms);  // time for a call that did not wait to reach the communicator
  };
  std::thread watchdog([&] { f.guard->Abort(absl::UnavailableError("timed out")); });
  while (!f.guard->aborted() && f.Calls().empty()) std::this_thread::yield();
  {
    std::lock_guard<std::mutex> lock(m);
    calling = true;
  }
  cv.notify_all();
  absl::Status st = f.guard->Call("all-reduce", [&] { return f.calls->Enqueue(kNcclSuccess); });
  watchdog.join();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("timed out"), std::string::npos) << st;
  EXPECT_EQ(f.state.use_after_free, 0);
  EXPECT_EQ(f.state.abort_before_flag, 0);
  EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Abort"}));
}

// A nonblocking communicator is finalized, its state polled until the finalize completes, then
// destroyed: NCCL's finalize returns ncclSuccess and leaves the communicator in progress (or
// returns ncclInProgress), and it is polled either way.
TEST(NcclGuard, CloseFinalizesAndPollsBeforeDestroying) {
  for (int finalize : {kNcclSuccess, kNcclInProgress}) {
    Fixture f;
    f.state.finalize_result = finalize;
    f.state.async_in_progress = 3;
    EXPECT_TRUE(f.guard->Close(true).ok());
    EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Finalize", "GetAsyncError", "GetAsyncError", "GetAsyncError",
                                                   "GetAsyncError", "Destroy"}));
  }
  Fixture f;
  f.state.finalize_result = kNcclSuccess;
  EXPECT_TRUE(f.guard->Close(true).ok());
  EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Finalize", "GetAsyncError", "Destroy"}));
  // Closed: nothing more reaches it.
  EXPECT_TRUE(f.guard->Close(true).ok());
  EXPECT_FALSE(f.guard->Abort(absl::InternalError("late")));
  EXPECT_EQ(f.Calls().size(), 3u);
  EXPECT_EQ(f.state.use_after_free, 0);
}

// A finalize that fails is aborted instead of destroyed, and the status says so.
TEST(NcclGuard, AFailedFinalizeAborts) {
  Fixture f;
  f.state.finalize_result = kNcclInProgress;
  f.state.async_result = 6;  // ncclRemoteError
  absl::Status st = f.guard->Close(true);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("ncclCommFinalize failed: fake error 6"), std::string::npos) << st;
  EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Finalize", "GetAsyncError", "LastError", "Abort"}));
  EXPECT_EQ(f.state.use_after_free, 0);
}

// A finalize that never completes is aborted at the timeout; a stream that did not drain is
// aborted without a finalize.
TEST(NcclGuard, AHungFinalizeOrUndrainedStreamAborts) {
  {
    Fixture f(20ms);
    f.state.async_in_progress = 1 << 30;
    absl::Status st = f.guard->Close(true);
    EXPECT_NE(std::string(st.message()).find("did not finish"), std::string::npos) << st;
    EXPECT_EQ(f.Calls().back(), "Abort");
    EXPECT_EQ(f.state.use_after_free, 0);
  }
  {
    Fixture f;
    absl::Status st = f.guard->Close(false);
    EXPECT_NE(std::string(st.message()).find("did not drain"), std::string::npos) << st;
    EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Abort"}));
  }
}

// A collective that stays in progress past the timeout aborts the communicator once, naming it; an
// error result aborts with NCCL's message; the watchdog's asynchronous error is reported.
TEST(NcclGuard, SettleTimesOutOrFailsAndAborts) {
  {
    Fixture f(20ms);
    f.state.async_in_progress = 1 << 30;
    absl::Status st = f.guard->Call("all-reduce", [&] { return f.calls->Enqueue(kNcclInProgress); });
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(std::string(st.message()).find("all-reduce failed: not done within 0.02 s"), std::string::npos) << st;
    EXPECT_TRUE(f.guard->aborted());
    EXPECT_EQ(f.Calls().back(), "Abort");
  }
  {
    Fixture f;
    absl::Status st = f.guard->Call("broadcast", [&] { return f.calls->Enqueue(kNcclInternalError); });
    EXPECT_NE(std::string(st.message()).find("broadcast failed: fake error 3 (fake last error)"), std::string::npos)
        << st;
    EXPECT_EQ(f.Calls(), (std::vector<std::string>{"Enqueue", "LastError", "Abort"}));
  }
  {
    Fixture f;
    f.state.async_result = 6;
    EXPECT_EQ(f.guard->AsyncProblem(), "NCCL reported fake error 6 (fake last error)");
    f.state.async_result = kNcclSuccess;
    EXPECT_EQ(f.guard->AsyncProblem(), "");
    EXPECT_TRUE(f.guard->Call("all-reduce", [&] { return f.calls->Enqueue(kNcclSuccess); }).ok());
  }
}

}  // namespace
}  // namespace ptk::cuda

namespace ptk::cuda {
namespace {

// The watchdog's decision (DecideWatch): another rank's reported failure is the cause whatever else
// it finds (an asynchronous error after it is its effect), with the call in flight here (the
// oldest) or none; else NCCL's error (on "a collective" when none is in flight); else the oldest
// collective past the timeout; else nothing. The heard failure's line said "NCCL aborted", without
// the call (the timeout's named it).
TEST(NcclWatchdog, DecidesOnTheHeardFailureFirstWithTheCallInFlight) {
  const std::string call = "all-reduce";
  WatchVerdict v = DecideWatch("NCCL reported unhandled system error", &call, 1s, 60000ms, true);
  EXPECT_TRUE(v.abort && v.heard);
  EXPECT_EQ(v.call, "all-reduce");
  EXPECT_EQ(v.problem, "");
  v = DecideWatch("", nullptr, 0s, 60000ms, true);
  EXPECT_TRUE(v.abort && v.heard);
  EXPECT_EQ(v.call, "");  // no collective in flight: the next call names itself (FailedCallPrefix)

  v = DecideWatch("NCCL reported remote process exited", nullptr, 0s, 60000ms, false);
  EXPECT_TRUE(v.abort);
  EXPECT_FALSE(v.heard);
  EXPECT_EQ(v.call, "a collective");
  EXPECT_EQ(v.problem, "NCCL reported remote process exited");

  v = DecideWatch("", &call, 61s, 60000ms, false);
  EXPECT_TRUE(v.abort);
  EXPECT_EQ(v.call, "all-reduce");
  EXPECT_EQ(v.problem, "not complete after 60 s (--distributed-timeout-minutes); the communicator was aborted");

  EXPECT_FALSE(DecideWatch("", &call, 59s, 60000ms, false).abort);
  EXPECT_FALSE(DecideWatch("", nullptr, 0s, 60000ms, false).abort);
}

}  // namespace
}  // namespace ptk::cuda
