// The memory this process can still take: the machine's (MemAvailable), its cgroups' limits and
// its address-space limit (ulimit -v), the least of them, so that a tool can refuse a job that
// will not fit before it allocates, instead of dying in std::bad_alloc or at the OOM killer.
#pragma once

#include <cstdint>
#include <string>

namespace ptk {

struct AvailableMemory {
  int64_t bytes = -1;  // -1: nothing could be read (no /proc): unknown, nothing to check against
  std::string source;  // which limit it is: "MemAvailable in /proc/meminfo", "the cgroup limit of ...", ...
  // The least of the limits this process shares with the others on the machine (MemAvailable and
  // the cgroups', not ulimit -v, which is each process's own): what the ranks on one node divide.
  int64_t shared_bytes = -1;
  std::string shared_source;
};

// The least of: /proc/meminfo's MemAvailable; for every cgroup (v2 memory.max, v1
// memory.limit_in_bytes) from this process's own up to the root, its limit less what it uses
// (less the inactive page cache it can reclaim); RLIMIT_AS less this process's VmSize. `root`
// prefixes /proc and /sys (tests give a directory of such files; "" for the real ones).
AvailableMemory ReadAvailableMemory(const std::string& root = "");

}  // namespace ptk
