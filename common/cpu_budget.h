// The CPUs this process may use: its affinity mask (taskset, Slurm's binding) capped by its cgroups'
// CPU quota (a Kubernetes pod's resources.limits.cpu, docker --cpus), so that a default thread count
// does not oversubscribe a container on a big machine and get throttled.
#pragma once

#include <string>

namespace ptk {

// Where the cgroup files are: tests give a tree of their own; the defaults are the real ones.
struct CgroupFiles {
  std::string proc_self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";  // the mount root (cgroup v2, or v1's controller folders)
};

struct CpuBudget {
  int cpus = 1;           // the least of affinity_cpus and cgroup_cpus (when set); at least 1
  int affinity_cpus = 1;  // CPUs in this process's affinity mask
  int cgroup_cpus = 0;    // the smallest CPU quota of its cgroups and their ancestors, rounded up; 0: none
  std::string cgroup;     // with cgroup_cpus: which, e.g. "cgroup cpu.max 4 at /kubepods/pod1"
  // What bounds `cpus`: "affinity" or `cgroup`, then "; " and what could not be read, if anything.
  std::string reason;
};

// The CPUs this process's affinity mask holds (sched_getaffinity, of any size); the machine's online
// CPUs when it cannot be read; at least 1.
int AffinityCpus();

// `affinity_cpus` capped by the cgroup CPU quotas of this process: for each cgroup /proc/self/cgroup
// names (v2 "0::/a/b"; v1 "N:cpu,cpuacct:/a/b"), the cgroup and every ancestor up to the mount root
// (v2 cpu.max "QUOTA PERIOD" or "max PERIOD"; v1 cpu.cfs_quota_us over cpu.cfs_period_us, -1 none).
// The smallest wins; a fractional quota rounds up. A level without the file has no quota; a file that
// cannot be read or parsed is left out and named in `reason`. Never fails: no cgroups, affinity.
CpuBudget ReadCpuBudget(int affinity_cpus, const CgroupFiles& files = {});

// This process's: ReadCpuBudget(AffinityCpus()).
CpuBudget ThisProcessCpuBudget();

// The note for a flag that asks for more threads than the budget: "--workers 16: more than the 4 CPUs
// this process may use (cgroup cpu.max 4 at /kubepods/pod1): oversubscribing"; empty when it does not.
std::string OversubscriptionNote(const std::string& flag, int requested, const CpuBudget& budget);

}  // namespace ptk
