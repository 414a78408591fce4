// Rank and array-task information from the environment.
#include "common/slurm_env.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include <fmt/core.h>

#include "common/numbers.h"
#include "common/status.h"

namespace ptk {
namespace {
// A variable's integer value (none when unset or empty); a value that is set and is not a decimal
// integer is a usage error naming the variable (no sign but '-', no spaces, no hex: what a launcher
// writes).
absl::StatusOr<std::optional<int64_t>> EnvIntChecked(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::optional<int64_t>();
  std::optional<int64_t> x = ParseInt64(v);
  if (!x) return UsageError(fmt::format("{}={:?} is not an integer", name, std::string(v)));
  return x;
}

// A launch variable that must be set (when `required`) and lie in [lo, hi]: anything else is a
// usage error naming the variable, its value and what it must be. `hi_why` says where hi comes from.
absl::StatusOr<std::optional<int64_t>> EnvIntIn(const char* name, int64_t lo, int64_t hi, bool required,
                                                const std::string& hi_why = "") {
  PTK_ASSIGN_OR_RETURN(std::optional<int64_t> v, EnvIntChecked(name));
  if (!v) {
    if (required) return UsageError(fmt::format("{} is not set", name));
    return v;
  }
  if (*v < lo || *v > hi)
    return UsageError(fmt::format("{}={} is outside [{}, {}]{}", name, *v, lo, hi, hi_why.empty() ? "" : " " + hi_why));
  return v;
}

constexpr int64_t kMaxRanks = std::numeric_limits<int>::max();

// The ranks sharing this machine (TrainingRanks::ranks_on_node), once the launch's ranks are read.
absl::Status ReadRanksOnNode(TrainingRanks* t) {
  const std::string below =
      fmt::format("({}={})", t->source == "srun" ? "SLURM_STEP_NUM_TASKS" : "WORLD_SIZE", t->world_size);
  std::optional<int64_t> n;
  if (t->source == "torchrun variables") {
    PTK_ASSIGN_OR_RETURN(n, EnvIntIn("LOCAL_WORLD_SIZE", 1, t->world_size, false, below));
    if (n) t->ranks_on_node_source = "LOCAL_WORLD_SIZE";
  } else if (t->source == "srun") {
    const char* per_node = std::getenv("SLURM_TASKS_PER_NODE");
    if (per_node != nullptr && *per_node != '\0') {
      PTK_ASSIGN_OR_RETURN(n, SlurmTasksOnNode("SLURM_TASKS_PER_NODE", per_node, t->node_rank));
      if (n)
        t->ranks_on_node_source = fmt::format("SLURM_TASKS_PER_NODE={} at SLURM_NODEID={}", per_node, t->node_rank);
    }
    if (!n) {
      PTK_ASSIGN_OR_RETURN(n, EnvIntIn("SLURM_NTASKS_PER_NODE", 1, kMaxRanks, false));
      if (n) t->ranks_on_node_source = "SLURM_NTASKS_PER_NODE";
    }
    // The job's figure can count more tasks than this step has: no more than the step's.
    if (n) n = std::min<int64_t>(*n, t->world_size);
  }
  t->ranks_on_node = static_cast<int>(n.value_or(0));
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::optional<int64_t>> SlurmTasksOnNode(const std::string& name, const std::string& value,
                                                        int64_t node) {
  auto bad = [&] {
    return UsageError(fmt::format("{}={:?} is not a Slurm tasks-per-node list (like \"4(x2),3\")", name, value));
  };
  int64_t first = 0;             // the first node of the entry being read
  std::optional<int64_t> found;  // the whole list is read: a malformed one is refused on every node
  for (size_t at = 0; at <= value.size();) {
    const size_t end = std::min(value.find(',', at), value.size());
    const std::string entry = value.substr(at, end - at);
    const size_t open = entry.find("(x");
    const std::optional<int64_t> tasks = ParseInt64(entry.substr(0, open));
    std::optional<int64_t> repeat = int64_t{1};
    if (open != std::string::npos) {
      if (entry.back() != ')') return bad();
      repeat = ParseInt64(entry.substr(open + 2, entry.size() - open - 3));
    }
    if (!tasks || !repeat || *tasks < 1 || *repeat < 1 || *repeat > kMaxRanks) return bad();
    if (node >= first && node < first + *repeat) found = *tasks;
    first += *repeat;
    at = end + 1;
  }
  return found;
}

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

namespace {

TrainingThreadsChoice Choice(int threads, std::string reason) { return {threads, std::move(reason), ""}; }

// A rank's own CPUs (--cpus-per-task, a narrower affinity mask), capped by its share of the cgroup
// quota: the ranks on this node share it when the launcher says how many they are.
TrainingThreadsChoice OwnCpus(const CpuBudget& budget, int machine_cpus, const std::string& launcher_cpus_var,
                              const TrainingRanks& ranks) {
  const int cpus = std::max(1, budget.affinity_cpus);
  const bool known = ranks.ranks_on_node > 0;
  TrainingThreadsChoice c = Choice(
      cpus,
      fmt::format("this process's {} of the machine's {} CPUs ({}), not split among the ranks on this node{}", cpus,
                  machine_cpus, launcher_cpus_var.empty() ? "its affinity mask" : launcher_cpus_var + " is set",
                  known ? fmt::format(" ({}: {})", ranks.ranks_on_node_source, ranks.ranks_on_node) : ""));
  const int sharing = known ? ranks.ranks_on_node : 1;
  const int share = budget.cgroup_cpus > 0 ? std::max(1, budget.cgroup_cpus / sharing) : 0;
  if (share > 0 && share < cpus) {
    c.threads = share;
    c.reason += sharing > 1 ? fmt::format(", capped at {} by the {} shared by the {} ranks on this node", share,
                                          budget.cgroup, sharing)
                            : fmt::format(", capped at {} by the {}", share, budget.cgroup);
  }
  return c;
}

// ChooseTrainingThreads without --threads.
TrainingThreadsChoice DefaultTrainingThreads(const CpuBudget& budget, int machine_cpus,
                                             const std::string& launcher_cpus_var, const TrainingRanks& ranks) {
  const int cpus = std::max(1, budget.affinity_cpus);
  const bool known = ranks.ranks_on_node > 0;
  const bool quota_binds = budget.cgroup_cpus > 0 && budget.cgroup_cpus < cpus;
  if (ranks.world_size <= 1) {
    if (quota_binds)
      return Choice(budget.cgroup_cpus, fmt::format("this process's {} CPUs ({}), fewer than its affinity mask's {}",
                                                    budget.cgroup_cpus, budget.cgroup, cpus));
    return Choice(cpus, "");
  }
  if (!launcher_cpus_var.empty() || cpus != machine_cpus)
    return OwnCpus(budget, machine_cpus, launcher_cpus_var, ranks);
  if (quota_binds && !known)
    return Choice(
        budget.cgroup_cpus,
        fmt::format("this rank's {} CPUs ({}), not split among the {} ranks: the launcher does not say how many "
                    "share this node (LOCAL_WORLD_SIZE, SLURM_TASKS_PER_NODE), so the quota is this rank's own",
                    budget.cgroup_cpus, budget.cgroup, ranks.world_size));
  const int pool = quota_binds ? budget.cgroup_cpus : cpus;
  const std::string pool_text =
      quota_binds ? fmt::format("{} CPUs ({})", pool, budget.cgroup) : fmt::format("{} CPUs", pool);
  const int sharing = known ? ranks.ranks_on_node : ranks.world_size;
  return Choice(std::max(1, pool / sharing),
                known ? fmt::format("{} / {} rank{} on this node ({})", pool_text, sharing, sharing == 1 ? "" : "s",
                                    ranks.ranks_on_node_source)
                      : fmt::format("{} / {} ranks (the launcher does not say how many share this node: "
                                    "LOCAL_WORLD_SIZE, SLURM_TASKS_PER_NODE)",
                                    pool_text, sharing));
}

std::string EnvOf(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// TrainingRanks::run_id: the launcher's identity of this launch, as its variables give it.
std::string RunIdFromEnv(const TrainingRanks& t) {
  if (!EnvOf("PTK_RUN_ID").empty()) return "PTK_RUN_ID=" + EnvOf("PTK_RUN_ID");
  if (t.source == "torchrun variables") {
    // --rdzv-id (--standalone makes one); its default is "none". Not with TORCHELASTIC_RESTART_COUNT,
    // which an agent moves alone when the others restart for a node that came or went.
    const std::string id = EnvOf("TORCHELASTIC_RUN_ID");
    if (!id.empty() && id != "none") return "TORCHELASTIC_RUN_ID=" + id;
    // One agent on one node (every rank local): its log directory of this attempt, made fresh by each
    // launch (<log dir>/<run id>_<random>/attempt_<n>/<local rank>/error.json).
    const std::string error_file = EnvOf("TORCHELASTIC_ERROR_FILE");
    auto slash_before = [&](size_t end) {
      return end == std::string::npos || end == 0 ? std::string::npos : error_file.rfind('/', end - 1);
    };
    const size_t rank_dir = slash_before(slash_before(error_file.size()));
    const size_t attempt = slash_before(rank_dir);
    if (t.ranks_on_node == t.world_size && attempt != std::string::npos &&
        error_file.compare(attempt + 1, 8, "attempt_") == 0)
      return "torchrun's log directory " + error_file.substr(0, rank_dir);
  }
  if (EnvOf("SLURM_JOB_ID").empty()) return "";
  // srun's ranks are one step's; ranks started otherwise inside a job may come from several steps.
  std::string id = "SLURM_JOB_ID=" + EnvOf("SLURM_JOB_ID");
  if (t.source == "srun" && !EnvOf("SLURM_STEP_ID").empty()) id += " SLURM_STEP_ID=" + EnvOf("SLURM_STEP_ID");
  if (!EnvOf("SLURM_RESTART_COUNT").empty()) id += " SLURM_RESTART_COUNT=" + EnvOf("SLURM_RESTART_COUNT");
  return id;
}

}  // namespace

TrainingThreadsChoice ChooseTrainingThreads(int64_t flag_threads, const CpuBudget& budget, int machine_cpus,
                                            const std::string& launcher_cpus_var, const TrainingRanks& ranks) {
  TrainingThreadsChoice d = DefaultTrainingThreads(budget, machine_cpus, launcher_cpus_var, ranks);
  // The cgroup files that could not be read are named (ReadCpuBudget's reason after "; ").
  if (const size_t left_out = budget.reason.find("; "); left_out != std::string::npos) {
    if (d.reason.empty()) d.reason = fmt::format("this process's {} CPUs (its affinity mask)", d.threads);
    d.reason += budget.reason.substr(left_out);
  }
  if (flag_threads <= 0) return d;
  const int threads = static_cast<int>(std::min<int64_t>(flag_threads, std::numeric_limits<int>::max()));
  TrainingThreadsChoice c{threads, "", ""};
  if (threads > d.threads)
    c.warning =
        fmt::format("--threads {}: more than the {} CPU thread{} of this rank's default ({}): oversubscribing", threads,
                    d.threads, d.threads == 1 ? "" : "s", d.reason.empty() ? "this process's affinity mask" : d.reason);
  return c;
}

absl::StatusOr<TrainingRanks> TrainingRanksFromEnv() {
  TrainingRanks t;
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  // Every number is decimal and in range, each a usage error naming the variable: a launcher's
  // typo must not shrink the job to one rank or make two ranks 0.
  if (!env("WORLD_SIZE").empty() || !env("RANK").empty()) {
    if (env("WORLD_SIZE").empty() || env("RANK").empty())
      return UsageError(fmt::format("torchrun-style launch: {} is set but {} is not; set both RANK and WORLD_SIZE",
                                    env("RANK").empty() ? "WORLD_SIZE" : "RANK",
                                    env("RANK").empty() ? "RANK" : "WORLD_SIZE"));
    std::optional<int64_t> world, rank, local, group;
    PTK_ASSIGN_OR_RETURN(world, EnvIntIn("WORLD_SIZE", 1, kMaxRanks, true));
    const std::string below = fmt::format("(WORLD_SIZE={})", *world);
    PTK_ASSIGN_OR_RETURN(rank, EnvIntIn("RANK", 0, *world - 1, true, below));
    PTK_ASSIGN_OR_RETURN(local, EnvIntIn("LOCAL_RANK", 0, *world - 1, false, below));
    PTK_ASSIGN_OR_RETURN(group, EnvIntIn("GROUP_RANK", 0, *world - 1, false, below));
    t.world_size = static_cast<int>(*world);
    t.rank = static_cast<int>(*rank);
    t.local_rank = static_cast<int>(local.value_or(0));
    t.node_rank = static_cast<int>(group.value_or(0));
    t.source = "torchrun variables";
  } else {
    // srun: SLURM_STEP_NUM_TASKS (set inside every step) counts the ranks; SLURM_PROCID is this one.
    // A batch script outside srun has SLURM_PROCID 0 and no step count: one process. A rank above 0
    // without a step count is not a launch srun makes: refused rather than run as a job of one.
    std::optional<int64_t> step_tasks, procid, ntasks;
    PTK_ASSIGN_OR_RETURN(step_tasks, EnvIntIn("SLURM_STEP_NUM_TASKS", 1, kMaxRanks, false));
    PTK_ASSIGN_OR_RETURN(ntasks, EnvIntIn("SLURM_NTASKS", 1, kMaxRanks, false));  // its form only
    (void)ntasks;
    PTK_ASSIGN_OR_RETURN(procid, EnvIntIn("SLURM_PROCID", 0, kMaxRanks - 1, false));
    if (!step_tasks) {
      if (procid.value_or(0) > 0)
        return UsageError(fmt::format(
            "SLURM_PROCID={} without SLURM_STEP_NUM_TASKS: srun sets both in every step; start the ranks with srun "
            "(or with torchrun's RANK and WORLD_SIZE)",
            *procid));
    } else {
      if (!procid) return UsageError("SLURM_STEP_NUM_TASKS is set but SLURM_PROCID is not (srun sets both)");
      const std::string below = fmt::format("(SLURM_STEP_NUM_TASKS={})", *step_tasks);
      PTK_ASSIGN_OR_RETURN(procid, EnvIntIn("SLURM_PROCID", 0, *step_tasks - 1, true, below));
      // SLURM_NODEID counts the job's nodes, not the step's: only its form is checked.
      std::optional<int64_t> local, node;
      PTK_ASSIGN_OR_RETURN(local, EnvIntIn("SLURM_LOCALID", 0, *step_tasks - 1, false, below));
      PTK_ASSIGN_OR_RETURN(node, EnvIntIn("SLURM_NODEID", 0, kMaxRanks - 1, false));
      t.world_size = static_cast<int>(*step_tasks);
      t.rank = static_cast<int>(*procid);
      t.local_rank = static_cast<int>(local.value_or(0));
      t.node_rank = static_cast<int>(node.value_or(0));
      std::string nodes_list =
          !env("SLURM_STEP_NODELIST").empty() ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
      if (!nodes_list.empty()) t.master_addr = FirstSlurmHost(nodes_list);
      // A requeued job keeps its id: the restart count moves the port, so that a rank left over
      // from the previous run cannot hold it. Below 32768, Linux's first ephemeral port: there an
      // outgoing connection of any process on the node (gloo's own pairs among them) could hold it.
      std::optional<int64_t> job, restarts;
      PTK_ASSIGN_OR_RETURN(job, EnvIntIn("SLURM_JOB_ID", 0, std::numeric_limits<int64_t>::max() / 8, false));
      PTK_ASSIGN_OR_RETURN(restarts, EnvIntIn("SLURM_RESTART_COUNT", 0, std::numeric_limits<int32_t>::max(), false));
      if (job) t.master_port = 20000 + static_cast<int>((*job * 7 + restarts.value_or(0)) % 12000);
      t.source = "srun";
    }
  }
  if (!env("MASTER_ADDR").empty()) t.master_addr = env("MASTER_ADDR");
  if (!env("MASTER_PORT").empty()) {
    std::optional<int64_t> port;
    PTK_ASSIGN_OR_RETURN(port, EnvIntIn("MASTER_PORT", 1, 65535, true));
    t.master_port = static_cast<int>(*port);
  }
  // Under torchrun, MASTER_PORT is its agent's own store, bound before the ranks start, which torch's workers
  // join as clients (TORCHELASTIC_USE_AGENT_STORE=True). ptk's rank 0 serves a rendezvous of its own: on the
  // next port, the same for every rank (on MASTER_PORT itself every torchrun launch failed 'Address already in
  // use').
  if (t.source == "torchrun variables" && env("TORCHELASTIC_USE_AGENT_STORE") == "True") {
    t.torchrun_store_port = t.master_port;
    t.master_port = t.master_port < 65535 ? t.master_port + 1 : t.master_port - 1;
  }
  PTK_RETURN_IF_ERROR(ReadRanksOnNode(&t));
  t.run_id = RunIdFromEnv(t);
  return t;
}

namespace {

// Why the rendezvous is not on MASTER_PORT under torchrun: "MASTER_PORT 29500 + 1: torchrun's store holds 29500".
std::string TorchrunPortNote(int port, int store_port) {
  return fmt::format("MASTER_PORT {} {} 1: torchrun's store holds {}", store_port, port > store_port ? '+' : '-',
                     store_port);
}

}  // namespace

std::string RendezvousPortWords(int port, int torchrun_store_port) {
  if (torchrun_store_port == 0 || torchrun_store_port == port) return fmt::format("MASTER_PORT {}", port);
  return fmt::format("port {} ({})", port, TorchrunPortNote(port, torchrun_store_port));
}

std::string RendezvousAddressWords(const std::string& addr, int port, int torchrun_store_port) {
  if (torchrun_store_port == 0 || torchrun_store_port == port) return fmt::format("{}:{}", addr, port);
  return fmt::format("{}:{} ({})", addr, port, TorchrunPortNote(port, torchrun_store_port));
}

}  // namespace ptk
