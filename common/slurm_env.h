// Rank and array-task information from Slurm (and torchrun-style) environment variables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/cpu_budget.h"

namespace ptk {

struct ShardSpec {
  int64_t index = 0;
  int64_t count = 1;
  std::string source;  // "flags", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX" or "default"
};

// Picks the shard of an array job. Explicit values win; otherwise SLURM_ARRAY_TASK_ID /
// SLURM_ARRAY_TASK_COUNT (normalised with SLURM_ARRAY_TASK_MIN and _STEP, so --array=1-8 or
// --array=0-14:2 give indices 0..count-1); otherwise a Kubernetes Indexed Job's JOB_COMPLETION_INDEX
// with JOB_COMPLETIONS (the Job's spec.completions, which Kubernetes does not pass: the manifest
// sets it, as k8s/*.yaml-template do); otherwise 0 of 1.
absl::StatusOr<ShardSpec> ResolveShard(std::optional<int64_t> index, std::optional<int64_t> count);

// The ranks of a data-parallel training job and where they meet. torchrun's variables (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win; otherwise an srun step's (SLURM_PROCID,
// SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID), with MASTER_ADDR defaulting to the first host
// of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST and MASTER_PORT to 20000 + (7 * SLURM_JOB_ID + SLURM_RESTART_COUNT) %
// 12000 (below Linux's ephemeral ports, from 32768, where a connection of any process on the node could hold it when
// rank 0 binds); otherwise one process. A batch script outside srun is one process (SLURM_NTASKS alone counts the tasks
// srun would start, not this one). Under torchrun itself (TORCHELASTIC_USE_AGENT_STORE=True: its agent serves a
// store on MASTER_PORT) the rendezvous is on MASTER_PORT + 1.
// The ranks on this machine, which share its memory: torchrun's LOCAL_WORLD_SIZE; in an srun step,
// this node's entry of SLURM_TASKS_PER_NODE ("4(x2),3": entry SLURM_NODEID), else
// SLURM_NTASKS_PER_NODE; never more than the world. 0 when the launcher does not say.
struct TrainingRanks {
  int rank = 0, world_size = 1, local_rank = 0, node_rank = 0;
  int ranks_on_node = 0;
  std::string ranks_on_node_source;  // the variable it came from
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // where the ranks meet (rank 0's rendezvous)
  // Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True): MASTER_PORT, which its agent's store holds, master_port
  // being the port beside it; 0 otherwise (master_port is MASTER_PORT).
  int torchrun_store_port = 0;
  std::string source = "single process";  // "torchrun variables", "srun", "single process"
  // This launch's identity, the same on every rank of the launch and another for any other launch,
  // which rank 0's rendezvous compares (two jobs on one MASTER_ADDR:MASTER_PORT never meet):
  // "PTK_RUN_ID=<value>" when set (any text: a Kubernetes Job's uid, `uuidgen` in a script); else under
  // torchrun's variables "TORCHELASTIC_RUN_ID=<id>" (--rdzv-id, or --standalone's), or with its default
  // id ("none") and every rank on this node (LOCAL_WORLD_SIZE = WORLD_SIZE) "torchrun's log directory
  // <dir>/attempt_<n>" (its agent's, fresh for each launch, from TORCHELASTIC_ERROR_FILE); else in a
  // Slurm job "SLURM_JOB_ID=<id>" with, under srun, " SLURM_STEP_ID=<step>", and " SLURM_RESTART_COUNT=<n>"
  // when set; else "" (nothing tells launches apart: ranks started by hand).
  std::string run_id;
};
absl::StatusOr<TrainingRanks> TrainingRanksFromEnv();

// The rendezvous port `port` as every message names it: "MASTER_PORT 29500", or under torchrun
// (`torchrun_store_port` = TrainingRanks::torchrun_store_port, not 0) "port 29501 (MASTER_PORT 29500 + 1:
// torchrun's store holds 29500)", so that a user checks the port really held and picks a MASTER_PORT that
// does not clash. RendezvousAddressWords: "node1:29500", or under torchrun "node1:29501 (MASTER_PORT 29500 + 1:
// torchrun's store holds 29500)".
std::string RendezvousPortWords(int port, int torchrun_store_port);
std::string RendezvousAddressWords(const std::string& addr, int port, int torchrun_store_port);

// CPU threads for one training rank, and why (for the start-up note). An explicit --threads
// (`flag_threads` > 0) wins; `warning` then says when it is more than the default below would be
// (oversubscribing). Otherwise this process's CPUs (`budget`: its affinity mask capped by its cgroups'
// quota); when that mask is the whole machine (`machine_cpus`), the launcher gave no per-rank CPUs
// (`launcher_cpus_var`: the name of SLURM_CPUS_PER_TASK or PTK_THREADS_PER_RANK when set, else empty) and there are
// several ranks, they split the machine's cores (or the cgroup quota, when smaller) among the ranks on this node
// (ranks.ranks_on_node), or among all the ranks (world_size) when the launcher does not say how many share the node
// and no cgroup quota binds; at least 1. A cgroup quota is shared by the ranks on this node when the launcher says
// how many there are (torchrun's LOCAL_WORLD_SIZE in one container, an srun step's tasks in one job's cgroup), and
// is this rank's own when it does not (one rank a Kubernetes pod): it caps per-rank CPUs too (its share of it).
struct TrainingThreadsChoice {
  int threads = 1;
  std::string reason;   // with several ranks (or a cgroup quota) and no --threads: how `threads` was chosen
  std::string warning;  // --threads above the default: oversubscribing, and why the default is less
};
TrainingThreadsChoice ChooseTrainingThreads(int64_t flag_threads, const CpuBudget& budget, int machine_cpus,
                                            const std::string& launcher_cpus_var, const TrainingRanks& ranks);

// Node `node`'s tasks in a SLURM_TASKS_PER_NODE value: "2(x3),1" is 2, 2, 2, 1. None when the list
// has no such node; InvalidArgument naming `name` when the value is not of that form.
absl::StatusOr<std::optional<int64_t>> SlurmTasksOnNode(const std::string& name, const std::string& value,
                                                        int64_t node);

// First host of a Slurm node list: "n[01-04,07],m5" -> "n01".
std::string FirstSlurmHost(const std::string& nodelist);

// Is item i (0-based) in this shard? Round-robin, deterministic.
inline bool InShard(int64_t i, const ShardSpec& s) { return s.count <= 1 || (i % s.count) == s.index; }

}  // namespace ptk
