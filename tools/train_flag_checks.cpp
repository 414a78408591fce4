// ptk-train's range checks: every numeric flag carries one where it is declared.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/core.h>

#include "tools/train_flag_parts.h"

namespace ptk::train_flags {

namespace {

std::string Shown(const std::string& in) { return fmt::format("{:?}", in.size() > 40 ? in.substr(0, 40) + "..." : in); }

}  // namespace

CLI::Validator IntIn(int64_t lo, int64_t hi) {
  const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(in.c_str(), &end, 10);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || v < lo || v > hi)
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
}

// A finite number in the range from lo to hi, each end open or closed.
CLI::Validator RealIn(double lo, bool lo_open, double hi, bool hi_open) {
  std::string range;
  if (std::isinf(hi)) {
    range = fmt::format("a finite number {} {}", lo_open ? ">" : ">=", lo);
  } else {
    range = fmt::format("a number in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || !std::isfinite(v) ||
            (lo_open ? v <= lo : v < lo) || (hi_open ? v >= hi : v > hi))
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
}

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

const CLI::Validator& Positive() {
  static const CLI::Validator v = RealIn(0, true, kInf, false);
  return v;
}
const CLI::Validator& NonNegative() {
  static const CLI::Validator v = RealIn(0, false, kInf, false);
  return v;
}
const CLI::Validator& Probability() {  // dropout: [0, 1)
  static const CLI::Validator v = RealIn(0, false, 1, true);
  return v;
}

}  // namespace ptk::train_flags
