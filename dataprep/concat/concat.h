// ptk-concat's engine: many jsonl files (or .zst/.xz read through) -> N chunks, balanced by bytes,
// order preserved. A plan written once lets every chunk be built by its own array task.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/slurm_env.h"
#include "dataprep/input/input_list.h"

namespace ptk {

struct ConcatInput {
  std::string path;
  uint64_t size = 0;  // bytes on disk (compressed size for .zst/.xz)
};

struct ConcatChunk {
  std::string name;                 // file name inside the output directory
  std::vector<ConcatInput> inputs;  // in order
  uint64_t bytes = 0;
};

struct ConcatPlan {
  std::string output_dir;
  std::vector<ConcatChunk> chunks;
  // The directory the plan's relative paths (output_dir, inputs) are relative to: where it was
  // made. Empty: the current directory (a plan made in this process, or read where it was made).
  std::string base_dir;
  // A path of the plan as this process opens it.
  std::string Resolve(const std::string& path) const;
};

struct ConcatPlanOptions {
  int64_t chunks = 72;          // balanced by bytes, contiguous runs of inputs
  int64_t files_per_chunk = 0;  // > 0: consecutive groups of this many files (NeMo's concat.sh)
  std::string name_pattern;     // fmt pattern with the chunk index; default train_{:02d}.jsonl
};

// Inputs must already be in the wanted order, each file once (a path given twice, however
// spelled, is an error: it would be concatenated twice). Balanced mode: chunk k ends at the first
// input whose midpoint passes (k+1)/N of the total bytes; every chunk gets at least one input
// (fewer inputs than chunks gives one chunk per input).
absl::StatusOr<ConcatPlan> MakeConcatPlan(const std::vector<ConcatInput>& inputs, const std::string& output_dir,
                                          const ConcatPlanOptions& options);

// The plan file records the directory it was made in ("base_dir"), so that an array task started
// in another directory reads the same files and writes the same chunks (a relative path used to
// name other files there, or none).
// Reading refuses (kDataLoss) a plan that lists one input path twice, names two chunks alike, or
// names a chunk with a '/'; building a chunk refuses one file listed twice under two names.
absl::Status WriteConcatPlan(const ConcatPlan& plan, const std::string& path);
// Before WriteConcatPlan: `path` (`what` names it: "--plan P") is no file of the plan's chunks (an output, its
// sidecar or lock, which `run` would write over the plan) and no existing file other than a ptk-concat plan (an
// input, anything else, which the plan would replace): a UsageError naming it.
absl::Status CheckPlanPath(const ConcatPlan& plan, const std::string& path, const std::string& what);
absl::StatusOr<ConcatPlan> ReadConcatPlan(const std::string& path);

struct ConcatChunkResult {
  bool skipped = false;  // already complete
  uint64_t bytes = 0;
  int64_t newlines_added = 0;  // inputs without a final newline
};

// Builds one chunk (idempotent: a complete chunk with a matching sidecar is skipped). Checks that
// every input still has the size the plan recorded, for a complete chunk too (every input still there:
// one that changed since the chunk was built is refused, not skipped).
// durable: the chunk is fsynced before its rename (and its directory after), so that a chunk that
// exists survives a crash. Without it the chunk is still atomic (complete or absent) but, like
// cat's output, only in the page cache when the call returns.
// lock_wait: how long to keep trying for the chunk while another run builds it (OutputLock::Acquire).
absl::StatusOr<ConcatChunkResult> BuildConcatChunk(const ConcatPlan& plan, size_t index, bool durable = true,
                                                   std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));

// What `ptk-concat plan` asks for: inputs (files, globs, directories) and how to group them.
struct ConcatPlanRequest {
  std::vector<std::string> inputs;
  std::string output_dir;
  std::string order = "natural";  // natural (shard2 before shard10) or bytes (LC_ALL=C ls)
  std::string plan_path;          // never an input itself
  ConcatPlanOptions plan;
  // How long RemoveChunksNotInPlan keeps trying for a chunk another run is building (--lock-wait).
  std::chrono::milliseconds lock_wait{0};
};
// Collects the inputs and makes the plan. Nothing inside the output directory and not the plan
// file are inputs, judged by identity (the resolved path), never by spelling: `c/`, `./c` and an
// absolute path are one directory. A request
// that cannot be planned (more chunks than allowed, a bad pattern) is an InvalidArgument "usage:".
absl::StatusOr<ConcatPlan> PlanConcat(const ConcatPlanRequest& request);

// The plan owns its output directory: chunks an earlier plan built there (files with a ptk-concat
// sidecar) that are not in this plan are removed with their sidecars, so that no later stage
// takes them for this plan's data. Returns the names removed. A chunk another run is still
// building is an error naming that run (after `lock_wait`, the request's --lock-wait).
absl::StatusOr<std::vector<std::string>> RemoveChunksNotInPlan(
    const ConcatPlan& plan, std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));

// The plan's chunk files (OUTPUT_DIR/NAME), in order: what later stages read.
std::vector<std::string> PlanChunkPaths(const ConcatPlan& plan);
// PlanConcat's inputs less what other plans left among them (moved to `left_out`, with the reason):
// a ptk-concat plan file (never data), and the chunks of a plan made from inputs that are among
// `files` too (their records would be taken twice). A plan over chunks alone keeps them.
void LeaveOutOtherPlans(std::vector<std::string>* files, std::vector<LeftOutFile>* left_out);

// What `ptk-concat list` prints: the plan's chunk files, then `with` (e.g. the validation folder).
// An item named twice (however spelled, a link, a hard link), or a `with` that is one of the
// chunks, is a UsageError naming both: each item is one array task's output, and two tasks would
// write one output (or one process read the data twice).
absl::StatusOr<std::vector<std::string>> ConcatListItems(const ConcatPlan& plan, const std::vector<std::string>& with);

struct ConcatRunOptions {
  std::optional<int64_t> chunk_index;  // build this chunk only
  ShardSpec shard;                     // otherwise this array task's share of the chunks
  int jobs = 4;
  bool durable = true;  // fsync each chunk (see BuildConcatChunk)
  bool progress = true;
  std::chrono::milliseconds lock_wait{0};  // --lock-wait (BuildConcatChunk)
};
struct ConcatSummary {
  int64_t built = 0, skipped = 0, failed = 0;  // chunks
  uint64_t bytes = 0;                          // written by this run
  int64_t newlines_added = 0;
  std::vector<std::pair<size_t, absl::Status>> errors;  // chunk index, why
};
// Builds the chunks of the plan this run owns, `jobs` at a time. A chunk that fails is reported
// (and logged) and the others still run.
absl::StatusOr<ConcatSummary> RunConcat(const ConcatPlan& plan, const ConcatRunOptions& options);

namespace concat_detail {
// Chunk `index` of `count`'s file name from --name-pattern (a {}-pattern of the index; "" for
// train_{:02d}.jsonl, wider past 100 chunks); a UsageError for a name no later stage would read.
absl::StatusOr<std::string> ChunkName(const std::string& pattern, int64_t index, int64_t count);
}  // namespace concat_detail

}  // namespace ptk
