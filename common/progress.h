// Progress reporting for long work: a redrawn line with rate and ETA on a TTY (every 0.25 s; log
// lines scroll above it, log::SetStatusLine), periodic log lines otherwise (every 30 s);
// PTK_PROGRESS_INTERVAL (seconds) sets either. Counters are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace ptk {

// The interval PTK_PROGRESS_INTERVAL sets: a decimal number of seconds in [kMinProgressInterval,
// kMaxProgressInterval], or nullopt when it is unset or empty. Anything else (0, a negative or
// tiny number that would print without pause, a huge one that overflows a clock, inf, nan, text)
// is a UsageError naming the variable; every tool checks it at start (cli::Parse).
inline constexpr double kMinProgressInterval = 0.001, kMaxProgressInterval = 86400;
absl::StatusOr<std::optional<double>> ProgressIntervalFromEnv();

class ProgressReporter {
 public:
  struct Options {
    std::string label;  // "download", "tokenize"
    std::string item_unit = "items";
    uint64_t items_total = 0;  // 0 = unknown
    uint64_t bytes_total = 0;  // 0 = unknown
    // <0: $PTK_PROGRESS_INTERVAL, else 0.25 s on a TTY and 30 s otherwise; clamped to
    // [kMinProgressInterval, kMaxProgressInterval].
    double interval_s = -1;
    bool enabled = true;
  };
  explicit ProgressReporter(Options options);
  ~ProgressReporter();  // calls Finish()

  void AddItems(uint64_t n) { items_.fetch_add(n, std::memory_order_relaxed); }
  void AddBytes(uint64_t n) { bytes_.fetch_add(n, std::memory_order_relaxed); }
  // Takes back bytes counted before that no longer count (a transfer that starts over from byte 0):
  // the byte count, its rate and the ETA say what is really done.
  void TakeBackBytes(uint64_t n) { bytes_.fetch_sub(n, std::memory_order_relaxed); }
  void SetTotals(uint64_t items_total, uint64_t bytes_total);
  uint64_t items() const { return items_.load(std::memory_order_relaxed); }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  double ElapsedSeconds() const;
  // Stops the reporter thread and clears the TTY line. Idempotent.
  void Finish();
  // The current status line (what would be printed now).
  std::string Line() const;
  // Draws the status line now (a TTY only), so that it says what a log line just printed says
  // instead of what it said at its last periodic redraw.
  void Refresh();

 private:
  void Run();
  Options opt_;
  std::atomic<uint64_t> items_{0}, bytes_{0};
  std::atomic<uint64_t> items_total_{0}, bytes_total_{0};
  std::chrono::steady_clock::time_point start_;
  bool tty_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ptk
