// ptk-train's outputs beside the log line: --metrics-file's JSON lines and the log line's clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/output_lock.h"
#include "tensorboard/summary_writer.h"
#include "trainer/training.h"

namespace ptk {

// --metrics-file: one JSON line per iteration, each written and flushed with its errors checked
// (a full disk stops the run with exit 3 instead of leaving an empty file behind a success).
class MetricsFile {
 public:
  ~MetricsFile();
  absl::Status Open(const std::string& path);
  bool is_open() const { return f_ != nullptr; }
  absl::Status Append(const std::string& line);
  // On disk (a regular file; /dev/null and pipes have nothing to sync), before a checkpoint.
  absl::Status Sync();
  absl::Status Close();

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

// What a start makes on disk before it can be refused (directories, a run-N subdirectory and its
// record, an empty metrics file), removed again when it is: a refused run leaves nothing behind.
class MadeOnDisk {
 public:
  // MakeDirs, remembering the directories it made.
  absl::Status MakeDirs(const std::string& dir);
  void Made(const std::string& path) { paths_.push_back(path); }
  // Removes them, the last made first (a directory only once it is empty again).
  void Undo();

 private:
  std::vector<std::string> paths_;
};

// --save, taken at start-up by the rank that saves (world rank 0): made where missing and locked
// for this run (one training run per checkpoint directory: a second one is refused naming the
// first). The lock is released (its file removed) when this goes; unless Keep() was called (the
// run started), so do the directories Take made: a refused start leaves no --save behind, and one
// that existed before stays as it was, without a lock file.
class SaveDirectory {
 public:
  SaveDirectory() = default;
  SaveDirectory(const SaveDirectory&) = delete;
  SaveDirectory& operator=(const SaveDirectory&) = delete;
  ~SaveDirectory() { Abandon(); }
  // `lock_name`: the lock file's (ptk-train's, which ptk-convert's imports take too; ptk-convert's exports').
  // `wait`: how long to keep trying while another run holds it (--lock-wait; OutputLock::Acquire).
  absl::Status Take(const std::string& dir, const std::string& lock_name = "ptk-train",
                    std::chrono::milliseconds wait = std::chrono::milliseconds(0));
  void Keep() {
    std::lock_guard<std::mutex> lock(mu_);
    kept_ = true;
  }
  // What the destructor does, now: for a process about to end without unwinding (AbandonedOnStop),
  // from any thread.
  void Abandon();

 private:
  std::mutex mu_;
  MadeOnDisk made_;                   // under mu_
  std::unique_ptr<OutputLock> lock_;  // under mu_
  bool kept_ = false;                 // under mu_
};
// `stop` (TrainOptions::on_peer_failure, which ends the process) with `dir` abandoned first, so that
// a start stopped by another rank's failure leaves no --save it made either; empty when `stop` is.
std::function<void(const absl::Status&)> AbandonedOnStop(std::function<void(const absl::Status&)> stop,
                                                         SaveDirectory* dir);

// A run's --metrics-file and --tensorboard-dir, the locks released after the files are closed.
struct RunOutputs {
  std::unique_ptr<OutputLock> metrics_lock, tb_lock;
  MetricsFile metrics;
  std::unique_ptr<SummaryWriter> tb;
  // Both flushed and on disk (before a checkpoint names the iterations they hold).
  absl::Status Sync();
};
// Opens them on the rank that writes them (`writer`: Megatron's last rank, the last stage's first
// data and tensor rank; world rank 0 without pipeline stages); the other ranks open nothing.
// One run writes to each at a time: a second run while the first still writes is refused naming
// the holder (--tensorboard-dir first), instead of interleaving lines or event files.
// --tensorboard-dir: a run resumed from a checkpoint (`iteration` > 0) continues its own curves, in
// the subdirectory that a fresh start of it made (one whose record names its --load, `load`), else
// in the directory, as Megatron's; a fresh run (from iteration 0) writes in the directory, unless
// another run's event files are there: then in a new subdirectory run-2, run-3, ... (TensorBoard
// shows each subdirectory of its --logdir as a run of its own), said in one line and recorded with
// its --save (`save`) so that resuming it writes there again. Each start adds an event file.
// --metrics-file: runs one after the other append, as Megatron's logs do (a resume, a requeue); its
// default, TENSORBOARD_DIR/metrics.jsonl, goes along with the events. A fresh run where an earlier
// run left lines says so, and so does a resumed run whose file ends before its checkpoint's
// iteration (lines that are not its own). A start refused (a busy lock, a path that cannot be
// written) leaves nothing on disk that it made: no directory, run-N or empty file. `lock_wait`: how long
// to keep trying for each while another run holds it (--lock-wait; OutputLock::Acquire).
absl::Status OpenRunOutputs(const std::string& tensorboard_dir, const std::string& metrics_path,
                            const std::string& save, const std::string& load, int64_t iteration, bool writer,
                            RunOutputs* out, std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));

// A JSON number, or null for NaN/Inf (which JSON cannot spell).
std::string JsonNumber(double v);

// The log line's local time, "2024-05-01 12:34:56.123456" (Megatron 0.16's '%Y-%m-%d %H:%M:%S.%f').
std::string Timestamp();

struct TrainOptions;  // train_options.h
// The line of a --load whose checkpoint (of `iteration`, `consumed` samples) is at the run's last
// iteration (`train_iters`, as planned) already: nothing to train, which flag to raise, and what runs all the same.
std::string NothingToTrainLine(const TrainOptions& o, int64_t iteration, int64_t consumed, int64_t train_iters);

// Megatron's training_log accumulators between two log lines: the iterations that advanced, were
// skipped, or skipped with a NaN/Inf loss, the lm loss summed over those that advanced, the time.
// As megatron-core 0.16's, a line comes every --log-interval iterations and after the run's first
// iteration (is_first_iteration, which documents the start-up's cost); that first line does not
// reset the accumulators, so the next line still averages over every iteration since the start.
// One difference: a first iteration that is a multiple of --log-interval resets them (Megatron's
// does not, so its next line averages over that iteration too: with --log-interval 1 its second
// line is the mean of two iterations).
class LogInterval {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogInterval(int64_t log_interval) : log_interval_(log_interval) {}
  void Start(Clock::time_point now = Clock::now()) { start_ = now; }
  // The clock stops between the two (nested pairs count once): as Megatron stops its 'interval-time'
  // timer around evaluations and checkpoint saves, their time is no iteration's.
  void Pause(Clock::time_point now = Clock::now());
  void Resume(Clock::time_point now = Clock::now());
  void Add(const StepResult& r);
  // Whether iteration `iteration` prints the line (the run's first iteration does).
  bool Due(int64_t iteration) const { return iteration % log_interval_ == 0 || !logged_; }
  // Whether the line of iteration `iteration` resets the accumulators (and the timers).
  bool Resets(int64_t iteration) const { return logged_ || iteration % log_interval_ == 0; }
  // The line's averages (elapsed time per iteration, lm loss, skipped and nan counts; the throughput,
  // `flops` per iteration over `world` ranks, only with --log-throughput: `throughput`) and what it
  // shows of the interval's last step `r`, as Megatron: its grad norm unless it was skipped (Megatron's
  // optimizer returns none then), the loss scale after its update, its count of zeros.
  void Fill(const StepResult& r, double flops, int world, bool throughput, LogLineFields* f,
            Clock::time_point now = Clock::now()) const;
  // After the line of iteration `iteration`: the accumulators start over where Resets says so.
  void Logged(int64_t iteration, Clock::time_point now = Clock::now());

 private:
  int64_t log_interval_;
  bool logged_ = false;
  Clock::time_point start_, paused_at_;
  double paused_seconds_ = 0;  // since start_
  int pauses_ = 0;             // open Pause calls
  int64_t iters_ = 0, advanced_ = 0, skipped_ = 0, nan_ = 0;
  double loss_ = 0;  // over the iterations that advanced
  // Mixture of experts: the iterations' load_balancing_loss, each added (as Megatron's total_loss_dict), the
  // sum shown over the iterations that advanced.
  double load_balancing_ = 0, z_loss_ = 0;  // z_loss likewise
  // And seq_ and global_load_balancing_loss.
  double seq_load_balancing_ = 0, global_load_balancing_ = 0;
  std::vector<double> mtp_;  // multi-token prediction's mtp_K loss likewise
};

// Pauses a LogInterval's clock for its lifetime.
class IntervalPause {
 public:
  explicit IntervalPause(LogInterval* interval) : interval_(interval) { interval_->Pause(); }
  ~IntervalPause() { interval_->Resume(); }
  IntervalPause(const IntervalPause&) = delete;
  IntervalPause& operator=(const IntervalPause&) = delete;

 private:
  LogInterval* interval_;
};

}  // namespace ptk
