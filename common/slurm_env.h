// Rank and array-task information from Slurm (and torchrun-style) environment variables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace ptk {

struct ShardSpec {
  int64_t index = 0;
  int64_t count = 1;
  std::string source;  // "flags", "SLURM_ARRAY_TASK_ID", or "default"
};

// Picks the shard of an array job. Explicit values win; otherwise SLURM_ARRAY_TASK_ID /
// SLURM_ARRAY_TASK_COUNT (normalised with SLURM_ARRAY_TASK_MIN and _STEP, so --array=1-8 or
// --array=0-14:2 give indices 0..count-1); otherwise 0 of 1.
absl::StatusOr<ShardSpec> ResolveShard(std::optional<int64_t> index, std::optional<int64_t> count);

struct RankInfo {
  int rank = 0;        // SLURM_PROCID or RANK
  int world_size = 1;  // SLURM_NTASKS or WORLD_SIZE
  int local_rank = 0;  // SLURM_LOCALID or LOCAL_RANK
  std::string job_id;  // SLURM_JOB_ID
};
RankInfo RankFromEnv();

// Is item i (0-based) in this shard? Round-robin, deterministic.
inline bool InShard(int64_t i, const ShardSpec& s) { return s.count <= 1 || (i % s.count) == s.index; }

}  // namespace ptk
