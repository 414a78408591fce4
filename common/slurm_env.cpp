// Rank and array-task information from the environment.
#include "common/slurm_env.h"

#include <cstdlib>

#include <fmt/core.h>

#include "absl/strings/numbers.h"

namespace ptk {
namespace {
std::optional<int64_t> EnvInt(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  int64_t x;
  if (!absl::SimpleAtoi(v, &x)) return std::nullopt;
  return x;
}
}  // namespace

absl::StatusOr<ShardSpec> ResolveShard(std::optional<int64_t> index, std::optional<int64_t> count) {
  ShardSpec s;
  if (index.has_value() || count.has_value()) {
    if (!index.has_value() || !count.has_value())
      return absl::InvalidArgumentError("--shard-index and --num-shards must be given together");
    s.index = *index;
    s.count = *count;
    s.source = "flags";
  } else if (auto id = EnvInt("SLURM_ARRAY_TASK_ID")) {
    auto cnt = EnvInt("SLURM_ARRAY_TASK_COUNT");
    auto mn = EnvInt("SLURM_ARRAY_TASK_MIN").value_or(0);
    auto step = EnvInt("SLURM_ARRAY_TASK_STEP").value_or(1);
    if (!cnt.has_value()) return absl::InvalidArgumentError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not");
    if (step <= 0) step = 1;
    s.index = (*id - mn) / step;
    s.count = *cnt;
    s.source = "SLURM_ARRAY_TASK_ID";
  } else {
    s.source = "default";
  }
  if (s.count < 1) return absl::InvalidArgumentError(fmt::format("number of shards must be >= 1, got {}", s.count));
  if (s.index < 0 || s.index >= s.count)
    return absl::InvalidArgumentError(fmt::format("shard index {} is outside [0, {}) (from {})", s.index, s.count, s.source));
  return s;
}

RankInfo RankFromEnv() {
  RankInfo r;
  if (auto v = EnvInt("SLURM_PROCID")) r.rank = static_cast<int>(*v);
  else if (auto v2 = EnvInt("RANK")) r.rank = static_cast<int>(*v2);
  if (auto v = EnvInt("SLURM_NTASKS")) r.world_size = static_cast<int>(*v);
  else if (auto v2 = EnvInt("WORLD_SIZE")) r.world_size = static_cast<int>(*v2);
  if (auto v = EnvInt("SLURM_LOCALID")) r.local_rank = static_cast<int>(*v);
  else if (auto v2 = EnvInt("LOCAL_RANK")) r.local_rank = static_cast<int>(*v2);
  if (const char* j = std::getenv("SLURM_JOB_ID")) r.job_id = j;
  return r;
}

}  // namespace ptk
