// The memory this process can still take: MemAvailable, the cgroup limits, ulimit -v.
#include "common/system_memory.h"

#include <sys/resource.h>

#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>

#include <fmt/core.h>

#include "common/human_format.h"
#include "common/numbers.h"

namespace ptk {
namespace {

std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file holding one integer (a cgroup's limit or usage); nullopt for "max" or no such file.
std::optional<int64_t> ReadNumberFile(const std::string& path) {
  const std::optional<std::string> s = ReadSmallFile(path);
  if (!s) return std::nullopt;
  const size_t end = s->find_first_of(" \n");
  return ParseInt64(s->substr(0, end));
}

// "KEY VALUE" lines (memory.stat) or "KEY: VALUE kB" lines (/proc/meminfo, /proc/self/status):
// VALUE of KEY, times `unit`.
std::optional<int64_t> ReadKey(const std::string& path, const std::string& key, int64_t unit) {
  const std::optional<std::string> s = ReadSmallFile(path);
  if (!s) return std::nullopt;
  std::istringstream lines(*s);
  for (std::string line; std::getline(lines, line);) {
    if (line.compare(0, key.size(), key) != 0 || line.size() == key.size()) continue;
    const char next = line[key.size()];
    if (next != ' ' && next != ':' && next != '\t') continue;
    const size_t b = line.find_first_of("0123456789", key.size());
    if (b == std::string::npos) return std::nullopt;
    const std::optional<int64_t> v = ParseInt64(line.substr(b, line.find_first_not_of("0123456789", b) - b));
    if (v) return *v * unit;
  }
  return std::nullopt;
}

// This process's memory cgroup: v2's path ("0::/a/b") or v1's ("4:memory:/a/b").
struct CgroupPath {
  std::string dir;  // the cgroup's directory under /sys/fs/cgroup (or /sys/fs/cgroup/memory)
  bool v2 = false;
};
std::vector<CgroupPath> OwnCgroups(const std::string& root) {
  std::vector<CgroupPath> out;
  const std::optional<std::string> s = ReadSmallFile(root + "/proc/self/cgroup");
  if (!s) return out;
  std::istringstream lines(*s);
  for (std::string line; std::getline(lines, line);) {
    const size_t c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1), path = line.substr(c2 + 1);
    if (controllers.empty()) {
      out.push_back({root + "/sys/fs/cgroup" + path, true});
      continue;
    }
    for (std::istringstream list(controllers); std::getline(list, line, ',');)
      if (line == "memory") out.push_back({root + "/sys/fs/cgroup/memory" + path, false});
  }
  return out;
}

void TakeLeast(AvailableMemory* a, int64_t bytes, std::string source) {
  bytes = std::max<int64_t>(0, bytes);
  if (a->bytes < 0 || bytes < a->bytes) {
    a->bytes = bytes;
    a->source = std::move(source);
  }
}

// Every level from the cgroup up to the hierarchy's root limits the process.
void CgroupLimits(const CgroupPath& g, const std::string& top, AvailableMemory* a) {
  for (std::string dir = g.dir;; dir = dir.substr(0, dir.find_last_of('/'))) {
    while (dir.size() > top.size() && dir.back() == '/') dir.pop_back();
    const std::optional<int64_t> limit = ReadNumberFile(dir + (g.v2 ? "/memory.max" : "/memory.limit_in_bytes"));
    const std::optional<int64_t> usage = ReadNumberFile(dir + (g.v2 ? "/memory.current" : "/memory.usage_in_bytes"));
    // v1 writes no limit as a number near 2^63.
    if (limit && usage && *limit < (int64_t{1} << 60)) {
      const int64_t cache =
          ReadKey(dir + "/memory.stat", g.v2 ? "inactive_file" : "total_inactive_file", 1).value_or(0);
      TakeLeast(a, *limit - std::max<int64_t>(0, *usage - cache),
                fmt::format("the cgroup limit {} ({}) less its use", HumanBytes(static_cast<double>(*limit)),
                            dir.substr(dir.find("/sys/fs/cgroup"))));
    }
    if (dir.size() <= top.size() || dir.find('/', top.size()) == std::string::npos) break;
  }
}

}  // namespace

AvailableMemory ReadAvailableMemory(const std::string& root) {
  AvailableMemory a;
  if (const std::optional<int64_t> avail = ReadKey(root + "/proc/meminfo", "MemAvailable", 1024))
    TakeLeast(&a, *avail, "MemAvailable in /proc/meminfo");
  for (const CgroupPath& g : OwnCgroups(root))
    CgroupLimits(g, root + (g.v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory"), &a);
  a.shared_bytes = a.bytes;
  a.shared_source = a.source;
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      rl.rlim_cur < static_cast<rlim_t>(std::numeric_limits<int64_t>::max())) {
    const int64_t vm = ReadKey(root + "/proc/self/status", "VmSize", 1024).value_or(0);
    TakeLeast(&a, static_cast<int64_t>(rl.rlim_cur) - vm,
              fmt::format("ulimit -v {} KiB less this process's {} of address space", rl.rlim_cur / 1024,
                          HumanBytes(static_cast<double>(vm))));
  }
  return a;
}

}  // namespace ptk
