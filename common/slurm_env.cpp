// Rank and array-task information from the environment.
#include "common/slurm_env.h"

#include <cstdlib>

#include <fmt/core.h>

#include "absl/strings/numbers.h"
#include "common/status.h"

namespace ptk {
namespace {
std::optional<int64_t> EnvInt(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  int64_t x;
  if (!absl::SimpleAtoi(v, &x)) return std::nullopt;
  return x;
}

// As EnvInt, but a value that is set and is not an integer is a usage error naming the variable.
absl::StatusOr<std::optional<int64_t>> EnvIntChecked(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::optional<int64_t>();
  int64_t x;
  if (!absl::SimpleAtoi(v, &x)) return UsageError(fmt::format("{}={:?} is not an integer", name, std::string(v)));
  return std::optional<int64_t>(x);
}
}  // namespace

absl::StatusOr<ShardSpec> ResolveShard(std::optional<int64_t> index, std::optional<int64_t> count) {
  ShardSpec s;
  if (index.has_value() || count.has_value()) {
    if (!index.has_value() || !count.has_value())
      return UsageError("--shard-index and --num-shards must be given together");
    s.index = *index;
    s.count = *count;
    s.source = "flags";
  } else if (std::getenv("SLURM_ARRAY_TASK_ID") && *std::getenv("SLURM_ARRAY_TASK_ID")) {
    std::optional<int64_t> id, cnt, mn_v, step_v;
    PTK_ASSIGN_OR_RETURN(id, EnvIntChecked("SLURM_ARRAY_TASK_ID"));
    PTK_ASSIGN_OR_RETURN(cnt, EnvIntChecked("SLURM_ARRAY_TASK_COUNT"));
    PTK_ASSIGN_OR_RETURN(mn_v, EnvIntChecked("SLURM_ARRAY_TASK_MIN"));
    PTK_ASSIGN_OR_RETURN(step_v, EnvIntChecked("SLURM_ARRAY_TASK_STEP"));
    const int64_t mn = mn_v.value_or(0);
    int64_t step = step_v.value_or(1);
    if (!cnt.has_value()) return UsageError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not");
    if (step <= 0) step = 1;
    s.index = (*id - mn) / step;
    s.count = *cnt;
    s.source = "SLURM_ARRAY_TASK_ID";
  } else if (std::getenv("JOB_COMPLETION_INDEX") && *std::getenv("JOB_COMPLETION_INDEX")) {
    std::optional<int64_t> id, cnt;
    PTK_ASSIGN_OR_RETURN(id, EnvIntChecked("JOB_COMPLETION_INDEX"));
    PTK_ASSIGN_OR_RETURN(cnt, EnvIntChecked("JOB_COMPLETIONS"));
    if (!cnt.has_value())
      return UsageError(
          "JOB_COMPLETION_INDEX is set but JOB_COMPLETIONS is not (set it in the Job's container env to "
          "the Job's spec.completions)");
    s.index = *id;
    s.count = *cnt;
    s.source = "JOB_COMPLETION_INDEX";
  } else {
    s.source = "default";
  }
  if (s.count < 1) return UsageError(fmt::format("number of shards must be >= 1, got {} (from {})", s.count, s.source));
  if (s.index < 0 || s.index >= s.count)
    return UsageError(fmt::format("shard index {} is outside [0, {}) (from {})", s.index, s.count, s.source));
  return s;
}

RankInfo RankFromEnv() {
  RankInfo r;
  if (auto v = EnvInt("SLURM_PROCID"))
    r.rank = static_cast<int>(*v);
  else if (auto v2 = EnvInt("RANK"))
    r.rank = static_cast<int>(*v2);
  if (auto v = EnvInt("SLURM_NTASKS"))
    r.world_size = static_cast<int>(*v);
  else if (auto v2 = EnvInt("WORLD_SIZE"))
    r.world_size = static_cast<int>(*v2);
  if (auto v = EnvInt("SLURM_LOCALID"))
    r.local_rank = static_cast<int>(*v);
  else if (auto v2 = EnvInt("LOCAL_RANK"))
    r.local_rank = static_cast<int>(*v2);
  if (const char* j = std::getenv("SLURM_JOB_ID")) r.job_id = j;
  return r;
}

std::string FirstSlurmHost(const std::string& nodelist) {
  std::string first;
  int depth = 0;
  for (char c : nodelist) {  // the first comma outside brackets ends the first group
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  size_t open = first.find('[');
  if (open == std::string::npos) return first;
  std::string range = first.substr(open + 1);
  size_t end = range.find_first_of(",-]");
  return first.substr(0, open) + range.substr(0, end);
}

absl::StatusOr<TrainingRanks> TrainingRanksFromEnv() {
  TrainingRanks t;
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  if (!env("WORLD_SIZE").empty() || !env("RANK").empty()) {
    auto rank = EnvInt("RANK"), world = EnvInt("WORLD_SIZE");
    if (!rank || !world) return absl::InvalidArgumentError("torchrun-style launch: set both RANK and WORLD_SIZE");
    t.rank = static_cast<int>(*rank);
    t.world_size = static_cast<int>(*world);
    if (auto l = EnvInt("LOCAL_RANK")) t.local_rank = static_cast<int>(*l);
    if (auto n = EnvInt("GROUP_RANK")) t.node_rank = static_cast<int>(*n);
    t.source = "torchrun variables";
  } else if (auto step_tasks = EnvInt("SLURM_STEP_NUM_TASKS")) {
    t.world_size = static_cast<int>(*step_tasks);
    if (auto r = EnvInt("SLURM_PROCID")) t.rank = static_cast<int>(*r);
    if (auto l = EnvInt("SLURM_LOCALID")) t.local_rank = static_cast<int>(*l);
    if (auto n = EnvInt("SLURM_NODEID")) t.node_rank = static_cast<int>(*n);
    std::string nodes = !env("SLURM_STEP_NODELIST").empty() ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    if (!nodes.empty()) t.master_addr = FirstSlurmHost(nodes);
    // A requeued job keeps its id: the restart count moves the port, so that a rank left over
    // from the previous run cannot hold it.
    if (auto job = EnvInt("SLURM_JOB_ID"))
      t.master_port = 20000 + static_cast<int>((*job * 7 + EnvInt("SLURM_RESTART_COUNT").value_or(0)) % 20000);
    t.source = "srun";
  }
  if (!env("MASTER_ADDR").empty()) t.master_addr = env("MASTER_ADDR");
  if (!env("MASTER_PORT").empty()) {
    auto p = EnvInt("MASTER_PORT");
    if (!p || *p < 1 || *p > 65535) return absl::InvalidArgumentError("MASTER_PORT must be a port number");
    t.master_port = static_cast<int>(*p);
  }
  if (t.world_size < 1 || t.rank < 0 || t.rank >= t.world_size)
    return absl::InvalidArgumentError(
        fmt::format("rank {} of world size {} (from {}): not a valid rank", t.rank, t.world_size, t.source));
  return t;
}

}  // namespace ptk
