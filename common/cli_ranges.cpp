// Numeric options' ranges (IntIn, RealIn and their shorthands) and the check that every numeric
// option of a tool has one (CheckOptionTable).
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/status.h"

namespace ptk::cli {

namespace {
// A numeric option's range: an IntIn for an integer, IntIn or RealIn for a real; "" when it has one.
std::string RangeProblem(const CLI::Option& opt) {
  const std::string type = opt.get_type_name().substr(0, opt.get_type_name().find(':'));
  const bool integer = type == "INT" || type == "UINT";
  if (opt.get_type_size() == 0 || IsCompatOnly(opt) || (!integer && type != "FLOAT")) return "";
  const CLI::Validator* range = nullptr;
  try {
    range = const_cast<CLI::Option&>(opt).get_validator(kRangeValidator);
  } catch (const CLI::OptionNotFound&) {
    return fmt::format("numeric option {} has no range (cli::IntIn, cli::RealIn)", opt.get_name());
  }
  if (integer && range->get_description().rfind("an integer", 0) != 0)
    return fmt::format("integer option {} has a range of reals ({}): give it cli::IntIn", opt.get_name(),
                       range->get_description());
  return "";
}
}  // namespace

absl::Status CheckOptionTable(const CLI::App& app) {
  std::set<std::string> seen;
  std::string ranges;  // every numeric option without its range, at once
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_name() == "--help" || opt->get_name() == "-h") continue;
    for (const std::string& n : opt->get_lnames()) {
      if (!seen.insert(n).second)
        return absl::InternalError(fmt::format("{}: flag --{} defined twice", app.get_name(), n));
    }
    if (opt->get_positional()) {
      if (!seen.insert("pos:" + opt->get_name()).second) return absl::InternalError("positional defined twice");
    } else if (opt->get_lnames().empty()) {
      return absl::InternalError(fmt::format("{}: option {} has no long name", app.get_name(), opt->get_name()));
    }
    if (opt->get_description().empty())
      return absl::InternalError(fmt::format("{}: option {} has no help text", app.get_name(), opt->get_name()));
    if (const std::string problem = RangeProblem(*opt); !problem.empty())
      ranges += (ranges.empty() ? "" : "; ") + problem;
  }
  if (!ranges.empty()) return absl::InternalError(fmt::format("{}: {}", app.get_name(), ranges));
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    absl::Status st = CheckOptionTable(*sub);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

namespace {
std::string Shown(const std::string& in) { return fmt::format("{:?}", in.size() > 40 ? in.substr(0, 40) + "..." : in); }
}  // namespace

CLI::Validator IntIn(int64_t lo, int64_t hi) {
  const std::string range = fmt::format("an integer in [{}, {}]", lo, hi);
  CLI::Validator v(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long x = std::strtoll(in.c_str(), &end, 10);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || x < lo || x > hi)
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
  v.name(kRangeValidator);
  return v;
}

CLI::Validator RealIn(double lo, bool lo_open, double hi, bool hi_open) {
  const std::string range =
      std::isinf(hi) ? fmt::format("a finite number {} {}", lo_open ? ">" : ">=", lo)
                     : fmt::format("a number in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  CLI::Validator v(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double x = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return fmt::format("must be {}, not {}", range, Shown(in));
        // strtod's ERANGE: beyond a double (inf) or below its smallest (0 or a subnormal).
        if (errno == ERANGE)
          return fmt::format("must be {}, not {} ({} a double's range)", range, Shown(in),
                             std::fabs(x) > 1 ? "beyond" : "below");
        if (!std::isfinite(x)) return fmt::format("must be {}, not {}", range, Shown(in));
        if ((lo_open ? x <= lo : x < lo) || (hi_open ? x >= hi : x > hi))
          return fmt::format("must be {}, not {}", range, Shown(in));
        return "";
      },
      range);
  v.name(kRangeValidator);
  return v;
}

const CLI::Validator& Positive() {
  static const CLI::Validator v = RealIn(0, true, std::numeric_limits<double>::infinity(), false);
  return v;
}
const CLI::Validator& NonNegative() {
  static const CLI::Validator v = RealIn(0, false, std::numeric_limits<double>::infinity(), false);
  return v;
}

CLI::Option* AddLockWait(CLI::App& app, std::chrono::milliseconds* wait) {
  return app
      .add_option_function<double>(
          "--lock-wait",
          [wait](double seconds) {
            *wait = std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000)));
          },
          "Seconds to keep trying for an output another run is writing (its .ptk-lock held), a line every 10 s "
          "naming the holder, before failing (default 0: fail at once). On NFS a dead node's lock lasts the "
          "server's lease (~90 s): a requeued task given --lock-wait 180 waits it out")
      ->check(RealIn(0, false, kMaxSeconds, false));
}

}  // namespace ptk::cli
