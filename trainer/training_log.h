// ptk-train's outputs beside the log line: --metrics-file's JSON lines and the log line's clock.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

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

// --metrics-file and --tensorboard-dir: one run writes to each at a time (a second run while the
// first one still writes is refused naming it, instead of interleaving lines or event files).
// --metrics-file: runs one after the other append, as Megatron's do (a resume, a requeue), and a
// run that starts anew (`fresh`) where an earlier run left lines says so. The lock is kept in *lock.
absl::Status OpenMetricsFile(const std::string& path, bool fresh, std::unique_ptr<OutputLock>* lock, MetricsFile* file);
// Locks --tensorboard-dir `dir` for this run (the lock kept in *lock) and returns the directory its
// event files go to. A run resumed from a checkpoint (not `fresh`) continues its own curves: in the
// subdirectory that a fresh start of it made (one whose record names its --load, `load`), else in
// `dir`, as Megatron's. A fresh run (from iteration 0) writes in `dir`, unless another run's event
// files are there: then in a new subdirectory run-2, run-3, ... (TensorBoard shows each subdirectory
// of its --logdir as a run of its own), said in one line and recorded with its --save (`save`) so
// that resuming it writes there again. A *metrics_path that is `dir`/metrics.jsonl (--metrics-file's
// default) goes along to the directory returned.
absl::StatusOr<std::string> ClaimTensorBoardDir(const std::string& dir, bool fresh, const std::string& save,
                                                const std::string& load, std::string* metrics_path,
                                                std::unique_ptr<OutputLock>* lock);
// A new event file in `dir` (a resume adds one), as Megatron's SummaryWriter.
absl::StatusOr<std::unique_ptr<SummaryWriter>> OpenTensorBoardDir(const std::string& dir);

// A run's --metrics-file and --tensorboard-dir, the locks released after the files are closed.
struct RunOutputs {
  std::unique_ptr<OutputLock> metrics_lock, tb_lock;
  MetricsFile metrics;
  std::unique_ptr<SummaryWriter> tb;
};
// Opens them, one run at a time each: a resumed run appends, a fresh one beside another run's event
// files gets a subdirectory of its own (ClaimTensorBoardDir). `lead` (world rank 0) writes the
// metrics, `tb_writer` the events; over pipeline stages the writer (the last stage) is not rank 0,
// which then keeps --metrics-file where it was given.
absl::Status OpenRunOutputs(const std::string& tensorboard_dir, const std::string& metrics_path,
                            const std::string& save, const std::string& load, bool fresh, bool lead, bool tb_writer,
                            RunOutputs* out);

// A JSON number, or null for NaN/Inf (which JSON cannot spell).
std::string JsonNumber(double v);

// The log line's local time, "2024-05-01 12:34:56".
std::string Timestamp();

}  // namespace ptk
