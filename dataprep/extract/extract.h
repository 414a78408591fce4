// ptk-extract's engine: .zst / .xz (or plain) -> .jsonl, streaming, one file per worker.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/slurm_env.h"

namespace ptk {

struct ExtractOptions {
  std::vector<std::string> inputs;  // this run's candidates, in a deterministic order
  // Output name of each input below output_dir (parallel to `inputs`; compression suffix still on);
  // empty: base names. Two inputs with the same output are an error.
  std::vector<std::string> relative_outputs;
  std::string output_dir;  // empty: next to each input
  int jobs = 1;
  ShardSpec shard;  // a file belongs to shard FNV-1a(its relative name) % count
  bool delete_input = false;
  std::vector<std::string> drop_sets;  // records whose meta.redpajama_set_name is one of these are dropped
  bool verify = false;                 // re-decode and compare outputs that look complete
  // Overwrite an existing output that ptk-extract did not write (one without its sidecar or pending
  // record). Without it such an output is a failed file naming it, as `zstd -d` refuses.
  bool force = false;
  bool progress = true;
  // How long to keep trying for an output another run is writing (--lock-wait; OutputLock::Acquire).
  std::chrono::milliseconds lock_wait{0};
};

struct ExtractFileResult {
  enum class State { kExtracted, kSkipped, kFailed };
  std::string input, output;
  State state = State::kFailed;
  absl::Status error;
  uint64_t bytes_in = 0, bytes_out = 0;
  int64_t records = 0, dropped = 0;
  std::vector<int64_t> dropped_by_set;  // parallel to ExtractOptions::drop_sets
};

struct ExtractSummary {
  std::vector<ExtractFileResult> files;  // this shard's files, in input order
  int64_t extracted = 0, skipped = 0, failed = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  int64_t dropped = 0, records = 0;     // records: of the files decoded in this run
  std::vector<int64_t> dropped_by_set;  // parallel to ExtractOptions::drop_sets
  double seconds = 0;
};

// Output path for an input: compression suffix removed, at output_dir/rel when output_dir is given.
std::string ExtractOutputPath(const std::string& input, const std::string& rel, const std::string& output_dir);

// Per-file failures are reported in the summary; the others still run.
// Outputs below these directories (or these files) that carry a completion sidecar: what a
// finished --delete-input run leaves.
int64_t CountExtractedOutputs(const std::vector<std::string>& paths);

absl::StatusOr<ExtractSummary> RunExtract(const ExtractOptions& options);

// --verify for the outputs whose input is gone (a --delete-input run's, or an input removed since),
// which RunExtract never meets: every output below `roots` (directories; a file argument stands for
// its output beside it) whose sidecar names an input that no longer exists, and that `shard` owns as
// RunExtract would have owned its input, checked against the size and XXH3-128 its sidecar recorded.
// kSkipped when whole; kFailed with a DataLoss error naming the output and the input otherwise
// (changed, cut or missing: it cannot be extracted again). A result's `input` and `output` are both
// the output's path: the input is not there.
// For a rerun of a --delete-input job: whether `arg`, an input argument (a file or a glob) that names
// nothing now, was extracted: an output's sidecar (below `output_dir`, or beside the argument when
// empty) records an input whose absolute name it matches (as glob(3) would have).
bool ArgumentWasExtracted(const std::string& arg, const std::string& output_dir);

std::vector<ExtractFileResult> VerifyOutputsWithoutInput(const std::vector<std::string>& roots, const ShardSpec& shard);

}  // namespace ptk
