// ptk-train's outputs beside the log line: --metrics-file's JSON lines and the log line's clock.
#pragma once

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
  absl::Status Take(const std::string& dir);
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
// written) leaves nothing on disk that it made: no directory, run-N or empty file.
absl::Status OpenRunOutputs(const std::string& tensorboard_dir, const std::string& metrics_path,
                            const std::string& save, const std::string& load, int64_t iteration, bool writer,
                            RunOutputs* out);

// A JSON number, or null for NaN/Inf (which JSON cannot spell).
std::string JsonNumber(double v);

// The log line's local time, "2024-05-01 12:34:56".
std::string Timestamp();

struct TrainOptions;  // train_options.h
// The line of a --load whose checkpoint (of `iteration`, `consumed` samples) is at the run's last
// iteration (`train_iters`, as planned) already: nothing to train, and which flag to raise.
std::string NothingToTrainLine(const TrainOptions& o, int64_t iteration, int64_t consumed, int64_t train_iters);

// When the run starting at iteration `first` prints its first log line: as Megatron, at multiples of
// --log-interval only, so none when the run ends before the next one ("its log line comes at
// iteration 100" with --train-iters 8 promised a line that never came).
std::string FirstLogLineNote(int64_t first, int64_t log_interval, int64_t train_iters);

}  // namespace ptk
