// Megatron's itemised timers (megatron/core/timers.py) for ptk-train's --timing-log-level and
// --timing-log-option: named wall-clock timers, each at a log level (0, 1 or 2), the device's work
// waited for at each start and stop, their times gathered from every rank and printed after the
// log line as Megatron's timers.log prints them, and written to TensorBoard as its timers.write.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tensorboard/summary_writer.h"
#include "trainer/comm.h"

namespace ptk {

// --timing-log-option: the slowest rank's time only, the fastest's and the slowest's, or every rank's.
enum class TimingLogOption { kMax, kMinMax, kAll };
// "max", "minmax" or "all"; nullopt for anything else.
std::optional<TimingLogOption> ParseTimingLogOption(std::string_view text);

// The largest --timing-log-level.
inline constexpr int kMaxTimingLogLevel = 2;

// The timers of one rank. A timer whose level is above the run's is never made: its Start and Stop
// cost nothing and synchronise nothing, and at level 0 no timer of ptk's is made at all.
class Timers {
 public:
  // `level`: --timing-log-level (0 to 2); `synchronize`: waits for the device's queued work (the
  // model's GPTModel::Synchronize), called before each clock reading of a timer that is made;
  // `barrier` (Megatron's barrier_with_L1_time, on unless --no-barrier-with-level-1-timing: a
  // barrier over the world communicator) is called before each start of a level-1 timer that is
  // made, before its synchronize, so that every rank starts it together. Every rank must then
  // start the same level-1 timers in the same order; at level 0 it is never called.
  explicit Timers(int level = 0, TimingLogOption option = TimingLogOption::kMinMax,
                  std::function<absl::Status()> synchronize = {}, std::function<absl::Status()> barrier = {});
  int level() const { return level_; }
  TimingLogOption option() const { return option_; }

  // Starts `name` (made at `level` on its first start when the run's level reaches it), level 1
  // after the barrier. Starting a running timer restarts its current period (what it accumulated stays).
  absl::Status Start(std::string_view name, int level);
  // Stops `name`, adding the time since its start; a timer never made or not running is left alone.
  absl::Status Stop(std::string_view name);
  // Seconds accumulated by `name` since the last reset (a running timer's up to now); 0 if never made.
  double Elapsed(std::string_view name) const;
  // Whether `name` was made (started at a level the run's reaches).
  bool Has(std::string_view name) const { return timers_.contains(std::string(name)); }
  void Reset();

  // Megatron's training_log names for `level`, in its order: the level-1 ones, then the level-2 ones
  // (Megatron-LM's list at megatron-core 0.16.1: layernorm-grads-all-reduce, which nothing times
  // since finalize_model_grads names the sum non-tensor-parallel-grads-all-reduce, not that name).
  static std::vector<std::string> NamesToLog(int level);

  // Every rank's seconds of each of `names` (0: never made there), [world rank][name]: an all-gather
  // over `world`, which every rank must call with the same names. `reset` zeroes the timers after.
  absl::StatusOr<std::vector<std::vector<double>>> GatherElapsed(const std::vector<std::string>& names,
                                                                 Communicator* world, bool reset);

 private:
  struct Timer {
    double elapsed = 0;
    bool running = false;
    std::chrono::steady_clock::time_point started;
  };
  int level_;
  TimingLogOption option_;
  std::function<absl::Status()> synchronize_;
  std::function<absl::Status()> barrier_;
  std::map<std::string, Timer, std::less<>> timers_;
};

// Null-tolerant Start / Stop, for code that runs with or without timers.
inline absl::Status StartTimer(Timers* t, std::string_view name, int level) {
  return t ? t->Start(name, level) : absl::OkStatus();
}
inline absl::Status StopTimer(Timers* t, std::string_view name) { return t ? t->Stop(name) : absl::OkStatus(); }

// Megatron's timers.log text for the gathered `times` (seconds, [rank][name]) of `names`, each
// divided by `normalizer` and shown in ms: "(min, max) time across ranks (ms):" (minmax), "max time
// across ranks (ms):" (max) or "times across ranks (ms):" (all) and a line per name that some rank
// timed (a time above 0); nullopt when none did.
std::optional<std::string> FormatTimers(const std::vector<std::string>& names,
                                        const std::vector<std::vector<double>>& times, TimingLogOption option,
                                        double normalizer);

// Megatron's timers.write: for each name some rank timed, ("<name>-time", the slowest rank's seconds
// divided by `normalizer`), in the order of `names`.
std::vector<std::pair<std::string, double>> TimerScalars(const std::vector<std::string>& names,
                                                         const std::vector<std::vector<double>>& times,
                                                         double normalizer);

// Megatron's training_log at a log line, after the line: every rank's times of the names of the
// run's level gathered over `world` (every rank calls; at level 0 there is nothing to gather and
// nothing is exchanged), then reset. With `tb` (the TensorBoard writer, --log-timers-to-tensorboard)
// each timed name's slowest seconds over `normalizer` iterations as "<name>-time" at `iteration`;
// the last world rank (Megatron's timers.log's) gives `print` the text, when some rank timed anything.
// As megatron-core 0.16's timers.log (logger.info under Megatron-LM's logging set-up), the text comes
// after "INFO:megatron.core.timers:" (kTimersLogPrefix). `reset` false keeps the times (Megatron's
// first-iteration line, which resets nothing).
inline constexpr const char* kTimersLogPrefix = "INFO:megatron.core.timers:";
absl::Status LogTimers(Timers* timers, Communicator* world, int64_t iteration, double normalizer, SummaryWriter* tb,
                       const std::function<void(const std::string&)>& print, bool reset = true);

}  // namespace ptk
