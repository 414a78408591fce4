// Sizes and durations for people to read.
#include "common/human_format.h"

#include <fmt/core.h>

namespace ptk {

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} {}", bytes, units[u]);
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

std::string HumanDuration(double s) {
  if (s < 0 || s != s) return "?";
  if (s < 60) return fmt::format("{:.1f}s", s);
  long t = static_cast<long>(s + 0.5);
  if (t < 3600) return fmt::format("{}m{:02d}s", t / 60, static_cast<int>(t % 60));
  return fmt::format("{}h{:02d}m", t / 3600, static_cast<int>((t % 3600) / 60));
}

}  // namespace ptk
