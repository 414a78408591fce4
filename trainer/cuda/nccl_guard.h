// The state machine around one NCCL communicator, apart from NCCL itself: which calls may still
// reach the communicator, from which thread, and in what order it is aborted or finalized and
// destroyed. The NCCL calls go through NcclCalls (comm_nccl.cpp wraps a real ncclComm_t; a test
// puts a fake in its place that records the calls and can block or fail), so that the lock order is
// checked on a machine without a GPU.
//
// The rules:
//  - every call on the communicator, from the training thread and from the watchdog, is made
//    holding mu_, and only while aborted_ is false;
//  - Abort sets aborted_ under mu_ and calls ncclCommAbort under the same lock: once a thread has
//    seen aborted_ false under mu_, its call completes before the abort frees the communicator, and
//    no call starts after it;
//  - a nonblocking call's ncclInProgress is polled (ncclCommGetAsyncError) up to a deadline, each
//    poll under mu_, the sleeps between polls without it (the watchdog can abort meanwhile);
//  - Close (the destructor's) finalizes (ncclCommFinalize, then ncclCommGetAsyncError polled
//    until the communicator leaves ncclInProgress) before ncclCommDestroy; a finalize that fails
//    or does not finish aborts instead, and says so.
// Header-only and free of CUDA and NCCL headers.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <fmt/core.h>

#include "absl/status/status.h"

namespace ptk::cuda {

// NCCL's ncclResult_t values this file needs (comm_nccl.cpp checks them against nccl.h).
inline constexpr int kNcclSuccess = 0;
inline constexpr int kNcclInternalError = 3;
inline constexpr int kNcclInProgress = 7;

// The calls made on one communicator (the ncclComm_t is the implementation's). Never called
// concurrently by NcclGuard, and never after Abort or Destroy.
class NcclCalls {
 public:
  virtual ~NcclCalls() = default;
  virtual int GetAsyncError(int* async) = 0;        // ncclCommGetAsyncError
  virtual std::string LastError() = 0;              // ncclGetLastError(comm)
  virtual std::string ErrorString(int result) = 0;  // ncclGetErrorString
  virtual int Finalize() = 0;                       // ncclCommFinalize
  virtual int Destroy() = 0;                        // ncclCommDestroy
  virtual int Abort() = 0;                          // ncclCommAbort
};

// The watchdog's decision every 100 ms (comm_nccl.cpp), from what it found: NCCL's asynchronous
// error (NcclGuard::AsyncProblem), the oldest collective still in flight (`oldest`: its name, null
// when none; `age`), and whether another rank's reported failure was heard (the cause then, named
// in every rank's line with the call in flight here: an asynchronous error after it is its effect).
struct WatchVerdict {
  bool abort = false;
  bool heard = false;   // the cause is another rank's reported failure (RendezvousStore::HeardFailure)
  std::string call;     // the call in flight (the oldest); empty when none was
  std::string problem;  // not heard: NCCL's error, or the timeout
};
inline WatchVerdict DecideWatch(const std::string& async_problem, const std::string* oldest,
                                std::chrono::steady_clock::duration age, std::chrono::milliseconds timeout,
                                bool heard) {
  WatchVerdict v;
  v.call = oldest ? *oldest : "";
  if (heard) {
    v.abort = v.heard = true;
  } else if (!async_problem.empty()) {
    v.abort = true;
    if (v.call.empty()) v.call = "a collective";
    v.problem = async_problem;
  } else if (oldest && age > timeout) {
    v.abort = true;
    v.problem = fmt::format("not complete after {} s (--distributed-timeout-minutes); the communicator was aborted",
                            static_cast<double>(timeout.count()) / 1000.0);
  }
  return v;
}

class NcclGuard {
 public:
  using Clock = std::chrono::steady_clock;
  // `failed(what, why)`: the status of a failed call (comm_nccl.cpp adds the rank, the host and what
  // the rendezvous store knows of the other ranks); called without the lock.
  NcclGuard(std::unique_ptr<NcclCalls> calls, std::chrono::milliseconds timeout,
            std::function<absl::Status(const std::string&, const std::string&)> failed)
      : calls_(std::move(calls)), timeout_(timeout), failed_(std::move(failed)) {}
  NcclGuard(const NcclGuard&) = delete;
  NcclGuard& operator=(const NcclGuard&) = delete;

  bool aborted() const { return aborted_.load(); }
  absl::Status abort_status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return abort_status_;
  }
  Clock::time_point aborted_at() const {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_at_;
  }

  // Makes one call on the communicator (an enqueue: ncclAllReduce, a group, ...) under the lock,
  // unless it was aborted, then settles its result.
  template <typename F>
  absl::Status Call(const std::string& what, F&& call) {
    int r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return abort_status_;
      r = call();
    }
    return Settle(r, what);
  }

  // A nonblocking communicator's result: ncclInProgress is polled up to the timeout (then the
  // communicator is aborted); an error aborts it.
  absl::Status Settle(int r, const std::string& what) {
    const auto deadline = Clock::now() + timeout_;
    std::string last_error;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (aborted_) return abort_status_;
        if (r != kNcclInProgress) {
          if (r == kNcclSuccess) return absl::OkStatus();
          last_error = calls_->LastError();
          break;
        }
        if (Clock::now() > deadline) break;
        int async = kNcclSuccess;
        r = calls_->GetAsyncError(&async) == kNcclSuccess ? async : kNcclInternalError;
      }
      if (r == kNcclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    const std::string why = r == kNcclInProgress ? fmt::format("not done within {} s (--distributed-timeout-minutes)",
                                                               static_cast<double>(timeout_.count()) / 1000.0)
                                                 : fmt::format("{} ({})", calls_->ErrorString(r), last_error);
    absl::Status st = failed_(what, why);
    Abort(st);
    return abort_status();  // this abort's status, or an earlier one's
  }

  // The watchdog's check: NCCL's asynchronous error ("" when none, or after an abort).
  std::string AsyncProblem() {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return "";
    int async = kNcclSuccess;
    if (calls_->GetAsyncError(&async) != kNcclSuccess || async == kNcclSuccess || async == kNcclInProgress) return "";
    return fmt::format("NCCL reported {} ({})", calls_->ErrorString(async), calls_->LastError());
  }

  // Aborts the communicator once (ncclCommAbort ends the kernels of the collectives in flight and
  // frees it); later calls return `why`. Returns whether this call aborted it.
  bool Abort(const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || closed_) return false;
    abort_status_ = why;
    aborted_at_ = Clock::now();
    aborted_ = true;  // before the abort: no call starts after this
    const int r = calls_->Abort();
    if (r != kNcclSuccess)
      abort_status_ = absl::Status(why.code(), fmt::format("{}; ncclCommAbort failed too: {}",
                                                           std::string(why.message()), calls_->ErrorString(r)));
    return true;
  }

  // Ends the communicator: finalized (polled to completion, up to the timeout) and destroyed, or,
  // when `healthy` is false (its stream did not drain) or the finalize fails or does not finish,
  // aborted. Nothing after an abort (the communicator is freed). An error says what happened; the
  // communicator is gone either way.
  absl::Status Close(bool healthy) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || closed_) return absl::OkStatus();
    closed_ = true;
    std::string problem;
    if (!healthy) {
      problem = "its stream did not drain";
    } else {
      // A nonblocking communicator's finalize returns at once (ncclSuccess, or ncclInProgress) and
      // leaves the communicator in progress until every operation is flushed: its state is polled
      // until it leaves ncclInProgress.
      int r = calls_->Finalize();
      const auto deadline = Clock::now() + timeout_;
      if (r == kNcclSuccess || r == kNcclInProgress) {
        while (true) {
          int async = kNcclSuccess;
          r = calls_->GetAsyncError(&async) == kNcclSuccess ? async : kNcclInternalError;
          if (r != kNcclInProgress || Clock::now() > deadline) break;
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      if (r == kNcclSuccess) {
        r = calls_->Destroy();
        if (r == kNcclSuccess) return absl::OkStatus();
        return absl::InternalError(fmt::format("ncclCommDestroy failed: {}", calls_->ErrorString(r)));
      }
      problem = r == kNcclInProgress
                    ? fmt::format("ncclCommFinalize did not finish within {} s",
                                  static_cast<double>(timeout_.count()) / 1000.0)
                    : fmt::format("ncclCommFinalize failed: {} ({})", calls_->ErrorString(r), calls_->LastError());
    }
    aborted_ = true;
    const int r = calls_->Abort();
    return absl::InternalError(
        fmt::format("closing the NCCL communicator: {}; aborted it instead{}", problem,
                    r == kNcclSuccess ? "" : ", and ncclCommAbort failed: " + calls_->ErrorString(r)));
  }

 private:
  std::unique_ptr<NcclCalls> calls_;
  const std::chrono::milliseconds timeout_;
  std::function<absl::Status(const std::string&, const std::string&)> failed_;
  mutable std::mutex mu_;
  std::atomic<bool> aborted_{false};
  bool closed_ = false;
  absl::Status abort_status_;
  Clock::time_point aborted_at_;
};

}  // namespace ptk::cuda
