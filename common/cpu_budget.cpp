// The CPUs this process may use: its affinity mask capped by its cgroups' CPU quotas.
#include "common/cpu_budget.h"

#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/numbers.h"
#include "common/status.h"

namespace ptk {
namespace {

// What the cgroups said: the smallest quota, which cgroup set it, and what could not be read.
struct QuotaSearch {
  int cpus = 0;
  std::string cgroup;
  std::vector<std::string> problems;
};

// A quota of 1.5 CPUs lets 2 threads run (each some of the time): rounded up, at least 1.
int CeilCpus(int64_t quota, int64_t period) {
  const int64_t cpus = quota / period + (quota % period != 0 ? 1 : 0);
  return static_cast<int>(std::clamp<int64_t>(cpus, 1, std::numeric_limits<int>::max()));
}

std::string Trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  return s;
}

// A cgroup file's content, trimmed; nullopt when the file does not exist (no quota at that level: the
// v2 root has no cpu.max, a cgroup without the cpu controller neither); an error when it cannot be read.
absl::StatusOr<std::optional<std::string>> ReadIfExists(const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(path);
  if (absl::IsNotFound(s.status())) return std::optional<std::string>();
  if (!s.ok()) return s.status();
  return std::optional<std::string>(Trimmed(*std::move(s)));
}

// cgroup v2's cpu.max in `dir`: "QUOTA PERIOD" (microseconds) or "max PERIOD"; 0: no quota there.
absl::StatusOr<int> CpuMaxQuota(const std::string& dir) {
  const std::string path = dir + "/cpu.max";
  PTK_ASSIGN_OR_RETURN(const std::optional<std::string> text, ReadIfExists(path));
  if (!text) return 0;
  std::istringstream in(*text);
  std::string quota, period, extra;
  in >> quota >> period >> extra;
  const std::optional<int64_t> q = ParseInt64(quota), p = ParseInt64(period);
  if (!extra.empty() || !p || *p <= 0 || (quota != "max" && (!q || *q <= 0)))
    return absl::DataLossError(fmt::format("{}: {:?} is not \"QUOTA PERIOD\" or \"max PERIOD\"", path, *text));
  return quota == "max" ? 0 : CeilCpus(*q, *p);
}

// cgroup v1's cpu.cfs_quota_us over cpu.cfs_period_us in `dir`; -1 (or no file): no quota there.
absl::StatusOr<int> CfsQuota(const std::string& dir) {
  const std::string quota_path = dir + "/cpu.cfs_quota_us", period_path = dir + "/cpu.cfs_period_us";
  PTK_ASSIGN_OR_RETURN(const std::optional<std::string> quota_text, ReadIfExists(quota_path));
  if (!quota_text) return 0;
  const std::optional<int64_t> quota = ParseInt64(*quota_text);
  if (!quota || (*quota <= 0 && *quota != -1))
    return absl::DataLossError(fmt::format("{}: {:?} is not a quota in microseconds or -1", quota_path, *quota_text));
  if (*quota == -1) return 0;
  PTK_ASSIGN_OR_RETURN(const std::optional<std::string> period_text, ReadIfExists(period_path));
  if (!period_text) return absl::NotFoundError(fmt::format("{}: missing beside its cpu.cfs_quota_us", period_path));
  const std::optional<int64_t> period = ParseInt64(*period_text);
  if (!period || *period <= 0)
    return absl::DataLossError(fmt::format("{}: {:?} is not a period in microseconds", period_path, *period_text));
  return CeilCpus(*quota, *period);
}

// The cgroup `path` (as /proc/self/cgroup names it, below the hierarchy's folder `base`) and each of
// its ancestors up to `base`: every level's quota limits the process, the smallest is kept. A cgroup
// outside this namespace's root ("/../x") is read at the root only. Levels that are absent (a
// container that mounts its own cgroup as the root without a cgroup namespace) have no files: no quota.
void SearchLevels(const std::string& base, std::string path, bool v2, QuotaSearch* s) {
  if (path.empty() || path[0] != '/' || path.find("/..") != std::string::npos)
    path.assign(1, '/');  // not = "/": g++ 12 -O3 warns -Wrestrict (a false positive)
  while (true) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    std::string dir = base;
    if (path != "/") dir.append(path);
    const absl::StatusOr<int> cpus = v2 ? CpuMaxQuota(dir) : CfsQuota(dir);
    if (!cpus.ok()) {
      s->problems.push_back(fmt::format("{}: left out", StatusMessage(cpus.status())));
    } else if (*cpus > 0 && (s->cpus == 0 || *cpus < s->cpus)) {
      s->cpus = *cpus;
      s->cgroup = fmt::format("cgroup {} {} at {}", v2 ? "cpu.max" : "cpu.cfs_quota_us", *cpus, path);
    }
    if (path == "/") return;
    path = path.substr(0, path.find_last_of('/'));
    if (path.empty()) path.assign(1, '/');  // not = "/": g++ 12 -O3 warns -Wrestrict (a false positive)
  }
}

bool IsDirectoryPath(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Each line of /proc/self/cgroup: "0::PATH" (v2), "ID:CONTROLLERS:PATH" (v1; the cpu controller's
// folder is named by its controllers, "cpu,cpuacct", or "cpu", as systemd links it).
QuotaSearch SearchCgroups(const CgroupFiles& files) {
  QuotaSearch s;
  const absl::StatusOr<std::string> text = ReadFileToString(files.proc_self_cgroup);
  if (!text.ok()) {
    s.problems.push_back(fmt::format("no cgroup read: {}", StatusMessage(text.status())));
    return s;
  }
  std::istringstream lines(*text);
  int line_number = 0;
  for (std::string line; std::getline(lines, line);) {
    ++line_number;
    if (line.empty()) continue;
    const size_t c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) {
      s.problems.push_back(
          fmt::format("{}:{}: {:?} is not \"ID:CONTROLLERS:PATH\"", files.proc_self_cgroup, line_number, line));
      continue;
    }
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1), path = line.substr(c2 + 1);
    if (controllers.empty()) {
      SearchLevels(files.cgroup_root, path, true, &s);
      continue;
    }
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c != "cpu") continue;
      const std::string joined = files.cgroup_root + "/" + controllers;
      SearchLevels(IsDirectoryPath(joined) ? joined : files.cgroup_root + "/cpu", path, false, &s);
    }
  }
  return s;
}

}  // namespace

int AffinityCpus() {
  // A cpu_set_t holds 1024 CPUs; sched_getaffinity refuses a set smaller than the kernel's mask.
  for (int n = CPU_SETSIZE; n <= (1 << 20); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set);
    const int rc = ::sched_getaffinity(0, size, set);
    const int err = errno;
    const int count = rc == 0 ? CPU_COUNT_S(size, set) : 0;
    CPU_FREE(set);
    if (rc == 0) return std::max(1, count);
    if (err != EINVAL) break;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

CpuBudget ReadCpuBudget(int affinity_cpus, const CgroupFiles& files) {
  CpuBudget b;
  b.affinity_cpus = std::max(1, affinity_cpus);
  const QuotaSearch s = SearchCgroups(files);
  b.cgroup_cpus = s.cpus;
  b.cgroup = s.cgroup;
  const bool quota_binds = s.cpus > 0 && s.cpus < b.affinity_cpus;
  b.cpus = quota_binds ? s.cpus : b.affinity_cpus;
  b.reason = quota_binds ? s.cgroup : "affinity";
  if (!s.problems.empty()) b.reason += "; " + absl::StrJoin(s.problems, "; ");
  return b;
}

CpuBudget ThisProcessCpuBudget() { return ReadCpuBudget(AffinityCpus()); }

std::string OversubscriptionNote(const std::string& flag, int requested, const CpuBudget& budget) {
  if (requested <= budget.cpus) return "";
  return fmt::format("{} {}: more than the {} CPU{} this process may use ({}): oversubscribing", flag, requested,
                     budget.cpus, budget.cpus == 1 ? "" : "s", budget.reason);
}

}  // namespace ptk
