// Command-line conventions shared by every tool.
#include "common/cli.h"

#include <pthread.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <new>
#include <set>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/status.h"

namespace ptk::cli {

namespace {

// CLI11's formatter, except that a flag's names show bare: CLI11 writes the value a negated flag
// sets after its name ("--check-for-nan-in-loss-and-grad,--no-check-for-nan-in-loss-and-grad{false}"),
// which reads as "off by default". The help text says what a flag does; a valued option's default
// ("--chunks INT=72") still shows. Subcommands share their parent's formatter.
class Formatter : public CLI::Formatter {
 public:
  std::string make_option_name(const CLI::Option* opt, bool is_positional) const override {
    std::string names = CLI::Formatter::make_option_name(opt, is_positional);
    if (is_positional || opt->get_items_expected() != 0) return names;  // as CLI11 annotates
    for (const std::string value : {"{true}", "{false}"})
      for (size_t at; (at = names.find(value)) != std::string::npos;) names.erase(at, value.size());
    return names;
  }
};

}  // namespace

std::unique_ptr<CLI::App> MakeApp(const std::string& name, const std::string& description) {
  auto app = std::make_unique<CLI::App>(description, name);
  app->formatter(std::make_shared<Formatter>());
  app->set_version_flag("--version", name + " (" + VersionString() + ")\n" + BuildDescription(),
                        "Print the version, commit, build type and backends, and exit");
  app->option_defaults()->always_capture_default();
  app->get_formatter()->column_width(34);
  log::SetProgramName(name);
  return app;
}

namespace {

// Long option names -> supported (false for the kUnsupportedGroup and kIgnoredGroup ones); short ones ("-h").
void CollectLongNames(const CLI::App& app, std::map<std::string, bool>* names, std::set<std::string>* shorts) {
  for (const CLI::Option* opt : app.get_options()) {
    for (const std::string& n : opt->get_lnames()) (*names)["--" + n] = !IsCompatOnly(*opt);
    for (const std::string& n : opt->get_snames()) shorts->insert("-" + n);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    CollectLongNames(*sub, names, shorts);
}

// Reads long options as Python's argparse does (Megatron's and NeMo's scripts use it): an
// unambiguous prefix stands for the option (--vocab for --vocab-file), `--flag=value` works; an
// ambiguous prefix or an unknown flag is a usage error naming the candidates or the closest flag.
// The usage error for an unknown flag `given` (as typed; `name` with two dashes): the tool's hint for
// it, else the flag most likely meant, if any.
absl::Status UnknownFlag(const std::string& given, const std::string& name, const std::map<std::string, bool>& names,
                         const UnknownFlagHints& hints, bool one_dash) {
  std::string key = name;
  std::replace(key.begin(), key.end(), '_', '-');
  if (auto it = hints.find(key); it != hints.end())
    return UsageError(fmt::format("unknown flag {}: {}", given, it->second));
  std::vector<std::string> flags;
  for (const auto& [n, supported] : names) flags.push_back(n);
  std::string best = NearestFlagName(name, flags);
  if (one_dash && names.count(name)) best = name;
  if (best.empty())
    return UsageError(
        fmt::format("unknown flag {}{}", given, one_dash ? " (ptk's flags are long ones, with two dashes)" : ""));
  return UsageError(
      fmt::format("unknown flag {}; did you mean {}?{}", given, best, one_dash ? " (long flags take two dashes)" : ""));
}

// A long flag written with one dash (-input, -workers: Go's and some Python scripts' spelling):
// argparse and CLI11 would take it for short flags or a value and report something else (a
// required --input missing, an unexpected "2"). The error names the long flag it most likely is.
absl::Status OneDashLongFlag(const std::string& arg, const std::map<std::string, bool>& names,
                             const UnknownFlagHints& hints) {
  const std::string name = "-" + arg.substr(0, arg.find('='));
  std::vector<std::string> matches;
  for (auto it = names.lower_bound(name); it != names.end() && it->first.compare(0, name.size(), name) == 0; ++it)
    matches.push_back(it->first);
  const std::string given = arg.substr(0, arg.find('='));
  if (!names.count(name) && matches.size() == 1)
    return UsageError(fmt::format("unknown flag {}; did you mean {}? (long flags take two dashes)", given, matches[0]));
  return UnknownFlag(given, name, names, hints, /*one_dash=*/true);
}

// "-inf", "-infinity", "-nan", in any case: what strtod reads as a non-finite number.
bool IsNonFiniteWord(const std::string& arg) {
  std::string w;
  for (char c : arg.substr(1)) w += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return w == "inf" || w == "infinity" || w == "nan";
}

// A flag that takes a fixed number of values above one (--rampup-batch-size START INCR SAMPLES) given
// another number of them, as argparse counts them (up to the next --flag): a usage error. CLI11 kept
// the last three of four, and took one or two.
absl::Status CheckValueCount(const CLI::App& app, const std::string& name, bool inline_value, int argc, char** argv,
                             int i) {
  const CLI::Option* opt = app.get_option_no_throw(name);
  if (opt == nullptr || inline_value) return absl::OkStatus();
  const int want = opt->get_items_expected_min();
  if (want <= 1 || opt->get_items_expected_max() != want) return absl::OkStatus();
  int n = 0;
  std::string values;
  for (int j = i + 1;
       j < argc && !(std::string_view(argv[j]).substr(0, 2) == "--" && std::string_view(argv[j]).size() > 2); ++j, ++n)
    values += std::string(" ") + argv[j];
  if (n == want) return absl::OkStatus();
  return UsageError(fmt::format("{}{}: takes {} values, not {}", name, values, want, n));
}

// The option of `app` itself (not of its subcommands) with this long name ("--plan"), or null.
const CLI::Option* OwnOption(const CLI::App& app, const std::string& name) {
  for (const CLI::Option* opt : app.get_options())
    if (opt->check_lname(name.substr(2))) return opt;
  return nullptr;
}

// `given` counts each long flag's occurrences (before a "--") per (sub)command: the key is the
// subcommand's name, a space and the flag ("run --plan"), or the flag alone for the tool itself.
// A subcommand's name starts its context (unless it is the value a flag waits for); in a context a
// name or prefix is first looked for among that (sub)command's own flags, so that `ptk-concat run
// --chunk 5` is run's --chunk-index, not also the tool's --chunks.
absl::StatusOr<std::vector<std::string>> ArgparseForms(const CLI::App& app, int argc, char** argv,
                                                       const UnknownFlagHints& hints,
                                                       std::map<std::string, int>* given) {
  std::map<std::string, bool> names;
  std::set<std::string> shorts;
  CollectLongNames(app, &names, &shorts);
  std::vector<std::string> out;
  bool options_done = false;
  const CLI::App* context = &app;
  std::string context_key;     // "" for the tool, "NAME " for a subcommand
  bool value_pending = false;  // the previous argument was a flag that takes exactly one value
  auto count = [&](const std::string& flag) {
    ++(*given)[context_key + flag];
    const CLI::Option* opt = OwnOption(*context, flag);
    value_pending = opt != nullptr && opt->get_type_size() != 0 && opt->get_expected_max() == 1;
  };
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && !options_done && !value_pending && !arg.empty() && arg[0] != '-')
      for (const CLI::App* sub : context->get_subcommands([](const CLI::App*) { return true; }))
        if (sub->check_name(arg)) {
          context = sub;
          context_key += sub->get_name() + " ";
          break;
        }
    if (i > 0 && !(arg.size() >= 2 && arg[0] == '-' && !std::isdigit(static_cast<unsigned char>(arg[1]))))
      value_pending = false;
    // -x... where -x is no short flag: a long flag with one dash (not a negative number, not "-").
    // -inf or -nan where a flag waits for its value is that value (its range check refuses it).
    if (i > 0 && !options_done && arg.size() >= 2 && arg[0] == '-' &&
        std::isalpha(static_cast<unsigned char>(arg[1])) && !shorts.count(arg.substr(0, 2)) &&
        !(value_pending && IsNonFiniteWord(arg)))
      return OneDashLongFlag(arg, names, hints);
    if (i == 0 || options_done || arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      if (arg == "--") options_done = true;
      out.push_back(std::move(arg));
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const std::string rest = eq == std::string::npos ? "" : arg.substr(eq);
    if (names.count(name)) {
      count(name);
      if (eq != std::string::npos) value_pending = false;
      PTK_RETURN_IF_ERROR(CheckValueCount(*context, name, eq != std::string::npos, argc, argv, i));
      out.push_back(std::move(arg));
      continue;
    }
    std::vector<std::string> own;  // this (sub)command's flags that `name` starts
    for (const CLI::Option* opt : context->get_options())
      for (const std::string& n : opt->get_lnames())
        if (!IsCompatOnly(*opt) && ("--" + n).compare(0, name.size(), name) == 0) own.push_back("--" + n);
    if (own.size() == 1) {
      count(own[0]);
      if (eq != std::string::npos) value_pending = false;
      PTK_RETURN_IF_ERROR(CheckValueCount(*context, own[0], eq != std::string::npos, argc, argv, i));
      out.push_back(own[0] + rest);
      continue;
    }
    std::vector<std::string> matches, supported;
    for (auto it = names.lower_bound(name); it != names.end() && it->first.compare(0, name.size(), name) == 0; ++it) {
      matches.push_back(it->first);
      if (it->second) supported.push_back(it->first);
    }
    if (matches.size() > 1 && supported.size() == 1) matches = supported;
    if (matches.size() == 1) {
      count(matches[0]);
      if (eq != std::string::npos) value_pending = false;
      PTK_RETURN_IF_ERROR(CheckValueCount(*context, matches[0], eq != std::string::npos, argc, argv, i));
      out.push_back(matches[0] + rest);
      continue;
    }
    if (matches.size() > 1) {
      std::string list;
      for (const auto& m : matches) list += (list.empty() ? "" : ", ") + m;
      return UsageError(fmt::format("ambiguous option {} could match {}", name, list));
    }
    return UnknownFlag(name, name, names, hints, /*one_dash=*/false);
  }
  return out;
}

// Numbers on the command line are decimal, as argparse's int() and float() read them: CLI11 reads
// integers with strtoll's base 0 (0x10 is 16, 010 is 8) and reals with strtold (0x10, inf, nan).
// Every INT/UINT/FLOAT option (and each element of a list of them) gets this check; an integer
// with a leading zero (octal to CLI11, decimal to Python) is refused too.
constexpr const char* kDecimalValidator = "ptk-decimal";

std::string DecimalError(const std::string& in, const char* what) {
  return fmt::format("{:?} is not {} (numbers are decimal: no 0x, 0o, 0b, inf or nan)",
                     in.size() > 40 ? in.substr(0, 40) + "..." : in, what);
}

// An integer's digits that CLI11 would read as another number: strtoll and strtoull saturate
// (99999999999999999999 became 9223372036854775807) and strtoull wraps a negative one (-1 became
// 18446744073709551615). "" when `in` (decimal, sign allowed) fits the option's type.
std::string IntegerRangeError(const std::string& in, bool is_unsigned) {
  const char* b = in.data() + (in[0] == '+' ? 1 : 0);
  const char* e = in.data() + in.size();
  if (is_unsigned) {
    if (*b == '-') {
      if (in.find_first_not_of('0', 1) == std::string::npos) return "";  // -0
      return fmt::format("{:?} is negative (the flag takes a number >= 0)", in);
    }
    uint64_t u = 0;
    if (std::from_chars(b, e, u).ec == std::errc()) return "";
    return fmt::format("{:?} is too large (at most {})", in, std::numeric_limits<uint64_t>::max());
  }
  int64_t v = 0;
  if (std::from_chars(b, e, v).ec == std::errc()) return "";
  return fmt::format("{:?} is out of range [{}, {}]", in.size() > 40 ? in.substr(0, 40) + "..." : in,
                     std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
}

CLI::Validator DecimalValidator(bool integer, bool is_unsigned) {
  CLI::Validator v(
      [integer, is_unsigned](std::string& in) -> std::string {
        size_t i = (!in.empty() && (in[0] == '-' || in[0] == '+')) ? 1 : 0;
        const size_t digits_begin = i;
        while (i < in.size() && std::isdigit(static_cast<unsigned char>(in[i]))) ++i;
        size_t int_digits = i - digits_begin;
        if (integer) {
          if (int_digits == 0 || i != in.size()) return DecimalError(in, "a decimal integer");
          // CLI11 would read 010 as octal 8; Python's int() as 10. Neither guess: refused.
          if (int_digits > 1 && in[digits_begin] == '0')
            return fmt::format("{:?} has a leading zero (numbers are decimal: write {})", in,
                               in.substr(0, digits_begin) +
                                   in.substr(std::min(in.find_first_not_of('0', digits_begin), in.size() - 1)));
          return IntegerRangeError(in, is_unsigned);
        }
        size_t frac_digits = 0;
        if (i < in.size() && in[i] == '.') {
          ++i;
          const size_t b = i;
          while (i < in.size() && std::isdigit(static_cast<unsigned char>(in[i]))) ++i;
          frac_digits = i - b;
        }
        if (int_digits + frac_digits == 0) return DecimalError(in, "a decimal number");
        if (i < in.size() && (in[i] == 'e' || in[i] == 'E')) {
          ++i;
          if (i < in.size() && (in[i] == '-' || in[i] == '+')) ++i;
          const size_t b = i;
          while (i < in.size() && std::isdigit(static_cast<unsigned char>(in[i]))) ++i;
          if (i == b) return DecimalError(in, "a decimal number");
        }
        if (i != in.size()) return DecimalError(in, "a decimal number");
        return "";
      },
      "");
  v.name(kDecimalValidator);
  return v;
}

void RequireDecimalNumbers(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_type_size() == 0) continue;  // a flag without a value
    const std::string type = opt->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    const bool integer = base == "INT" || base == "UINT";
    if (!integer && base != "FLOAT") continue;
    try {
      opt->get_validator(kDecimalValidator);
      continue;  // already checked (Parse called again on this app)
    } catch (const CLI::OptionNotFound&) {
    }
    opt->check(DecimalValidator(integer, base == "UINT"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) RequireDecimalNumbers(*sub);
}

// --help shows each option's default; one its own check refuses is a sentinel for "not given"
// (0 where 1.. is allowed: --train-iters, --ffn-hidden-size; -1 for none: --doc), not a value the
// user can give. "--ffn-hidden-size INT:an integer in [1, ...]=0" read as a default of 0 that the
// option then refuses: such a default is not shown (the help text says what not giving it means).
// Run before RequireDecimalNumbers adds its own check, so only the tool's checks judge.
void HideSentinelDefaults(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string shown = opt->get_default_str();
    if (shown.empty()) continue;
    for (int i = 0;; ++i) {
      const CLI::Validator* check = nullptr;
      try {
        check = opt->get_validator(i);
      } catch (const CLI::OptionNotFound&) {
        break;
      }
      std::string value = shown;
      if (!(*check)(value).empty()) {
        opt->default_str("");
        break;
      }
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) HideSentinelDefaults(*sub);
}

// As argparse: a flag given again replaces what it was given before, a list flag's whole list too
// (CLI11 would refuse a second value, or join both lists). A repeatable flag (Repeatable) adds up.
void LastOccurrenceCounts(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_lnames().empty() || opt == app.get_help_ptr() || opt == app.get_version_ptr()) continue;
    if (opt->get_multi_option_policy() == CLI::MultiOptionPolicy::TakeAll) continue;  // Repeatable
    opt->trigger_on_parse();  // each occurrence runs the callback; the next one clears the results first
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) LastOccurrenceCounts(*sub);
}

// `key` as ArgparseForms counts: "--flag" for the tool's own, "SUB --flag" for a subcommand's.
bool IsRepeatable(const CLI::App& app, const std::string& key) {
  const size_t space = key.find(' ');
  if (space != std::string::npos) {
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->check_name(key.substr(0, space))) return IsRepeatable(*sub, key.substr(space + 1));
    return false;
  }
  const CLI::Option* opt = OwnOption(app, key);
  return opt != nullptr && opt->get_multi_option_policy() == CLI::MultiOptionPolicy::TakeAll;
}

}  // namespace

CLI::Option* Repeatable(CLI::Option* opt) { return opt->multi_option_policy(CLI::MultiOptionPolicy::TakeAll); }

namespace {
// Flushes standard output: what failed to be written there (a full disk, a closed pipe's EPIPE aside
// from SIGPIPE) as a status naming it. `earlier`: the errno of a write that failed before, if known.
absl::Status FlushStdout(int earlier = 0) {
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return absl::OkStatus();
  int e = errno != 0 ? errno : earlier;  // 0 when a write failed earlier, unknown, and the flush had nothing left
  struct statvfs vfs {};
  if (e == 0 && ::fstatvfs(STDOUT_FILENO, &vfs) == 0 && vfs.f_bavail == 0) e = ENOSPC;
  return e != 0 ? ErrnoToStatus(e, "write standard output")
                : absl::InternalError("write standard output failed (a full disk, or an output that was closed?)");
}

// What --help and --version return once printed: exit 0, or the write's failure as every tool's output
// errors end (exit 3 for a full disk), not 0 with the text lost.
int PrintedExit(const CLI::App& app, int print_errno) {
  absl::Status st = FlushStdout(print_errno);
  if (st.ok()) return kExitOk;
  std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), std::string(StatusMessage(st)).c_str());
  return ExitCodeFor(st);
}

}  // namespace

std::optional<int> Parse(CLI::App& app, int argc, char** argv, const UnknownFlagHints& hints) {
  // Every tool: a file-size limit (ulimit -f, a quota) must surface as EFBIG, handled like a full
  // disk (exit 3, the file named, nothing half-written), not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  // PTK_CHECK_OPTIONS=1: check the option table and exit (the CLI test runs every tool this way).
  if (const char* check = std::getenv("PTK_CHECK_OPTIONS"); check && std::string(check) == "1") {
    absl::Status st = CheckOptionTable(app);
    if (!st.ok()) {
      std::fprintf(stderr, "%s: option table: %s\n", app.get_name().c_str(), std::string(StatusMessage(st)).c_str());
      return kExitFailure;
    }
    std::printf("%s: option table OK (%zu options)\n", app.get_name().c_str(), app.get_options().size());
    return kExitOk;
  }
  std::map<std::string, int> given;
  auto args = ArgparseForms(app, argc, argv, hints, &given);
  if (!args.ok()) {
    std::fprintf(stderr, "%s: usage error: %s\nRun with --help for more information.\n", app.get_name().c_str(),
                 std::string(StatusMessage(args.status())).c_str());
    return kExitUsage;
  }
  HideSentinelDefaults(app);
  RequireDecimalNumbers(app);
  LastOccurrenceCounts(app);
  std::vector<char*> cargv;
  for (auto& a : *args) cargv.push_back(a.data());
  try {
    app.parse(static_cast<int>(cargv.size()), cargv.data());
  } catch (const CLI::CallForHelp&) {
    errno = 0;
    std::fputs(app.help().c_str(), stdout);
    return PrintedExit(app, errno);
  } catch (const CLI::CallForAllHelp&) {
    errno = 0;
    std::fputs(app.help("", CLI::AppFormatMode::All).c_str(), stdout);
    return PrintedExit(app, errno);
  } catch (const CLI::CallForVersion&) {
    errno = 0;
    std::puts(app.version().c_str());
    return PrintedExit(app, errno);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: usage error: %s\nRun with --help for more information.\n", app.get_name().c_str(),
                 ParseErrorMessage(app, e).c_str());
    return kExitUsage;
  }
  // Every tool: a progress interval that would print without pause, or never wait, is refused.
  if (auto interval = ProgressIntervalFromEnv(); !interval.ok()) {
    std::fprintf(stderr, "%s: usage error: %s\n", app.get_name().c_str(),
                 std::string(StatusMessage(interval.status())).c_str());
    return kExitUsage;
  }
  // A script's default then an override is the usual reason; a list given in two parts is the
  // mistake this names (argparse says nothing and takes the last).
  for (const auto& [name, n] : given)
    if (n > 1 && !IsRepeatable(app, name))
      log::Warning("{} given {} times: only the last counts (as in argparse)", name, n);
  return std::nullopt;
}

absl::Status CheckOutputPrefix(const std::string& flag, const std::string& prefix, const std::string& example_suffix) {
  if (prefix.empty()) return UsageError(flag + " is empty: give a path and the start of the file names, e.g. out/NAME");
  const size_t slash = prefix.find_last_of('/');
  const std::string name = slash == std::string::npos ? prefix : prefix.substr(slash + 1);
  if (!name.empty() && name != "." && name != "..") return absl::OkStatus();
  const std::string dir = name.empty() ? prefix.substr(0, prefix.find_last_not_of('/') + 1) : prefix;
  const std::string example = (dir.empty() ? "/" : dir + "/") + "NAME";
  return UsageError(fmt::format(
      "{} {} names a directory, not a prefix: it would write the hidden file {}{}; give the directory and the start "
      "of the file names, e.g. {} {} (writes {}{})",
      flag, prefix, prefix, example_suffix, flag, example, example, example_suffix));
}

absl::Status CheckOutputDirectory(const std::string& flag, const std::string& prefix) {
  const std::string dir = Dirname(prefix);
  if (IsDirectory(dir)) return absl::OkStatus();
  std::string p = dir;  // the deepest part of it that exists
  for (std::string up = Dirname(p); !PathExists(p) && up != p; up = Dirname(p)) p = up;
  if (PathExists(p) && !IsDirectory(p))
    return absl::FailedPreconditionError(fmt::format("{} {}: {} is not a directory", flag, prefix, p));
  return absl::NotFoundError(fmt::format("{} {}: directory {} does not exist", flag, prefix, dir));
}

absl::Status CreateOutputDirectory(const std::string& flag, const std::string& prefix) {
  absl::Status st = CheckOutputDirectory(flag, prefix);
  if (!absl::IsNotFound(st)) return st;
  const std::string dir = Dirname(prefix);
  absl::Status made = MakeDirs(dir);
  if (made.ok()) return made;
  return absl::Status(made.code(),
                      fmt::format("{} {}: cannot create directory {}: {}", flag, prefix, dir, StatusMessage(made)));
}

absl::Status CheckInputFile(const std::string& flag, const std::string& path, const std::string& hint) {
  if (path.empty()) return absl::OkStatus();
  std::string why;
  if (!PathExists(path))
    why = "no such file";
  else if (IsDirectory(path))
    why = "is a directory";
  else if (::access(path.c_str(), R_OK) != 0)
    why = "cannot be read";
  else
    return absl::OkStatus();
  return absl::NotFoundError(fmt::format("{} {}: {}{}", flag, path, why, hint.empty() ? "" : "; " + hint));
}

absl::Status CheckGpt2FileFlags(const std::string& vocab_file, const std::string& merge_file) {
  const std::string hint =
      "ptk has GPT-2's vocab.json and merges.txt built in: leave out --vocab-file and --merge-file to use them";
  PTK_RETURN_IF_ERROR(CheckInputFile("--vocab-file", vocab_file, hint));
  return CheckInputFile("--merge-file", merge_file, hint);
}

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return kExitOk;
  if (status.code() == absl::StatusCode::kResourceExhausted) return kExitDiskFull;
  if (IsUsageError(status)) return kExitUsage;
  return kExitFailure;
}

void RemoveTemporariesOnSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    // A signal the caller ignores stays ignored (`cmd &` in a script ignores SIGINT), as gzip does.
    struct sigaction now {};
    if (sigaction(sig, nullptr, &now) == 0 && now.sa_handler == SIG_IGN) continue;
    sigaddset(&set, sig);
  }
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    RemoveLiveTemporaries();
    RemoveLiveLocks();  // else OUT.ptk-lock names this dead process as the output's writer
    // Then the signal's own end (exit status 128 + sig), as without this.
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    std::raise(sig);
  }).detach();
}

void PrintFailure(const absl::Status& status) {
  const std::string msg(StatusMessage(status));
  if (IsUsageError(status)) {
    std::fprintf(stderr, "%s: usage error: %s\nRun with --help for more information.\n", log::ProgramName().c_str(),
                 msg.c_str());
  } else {
    log::Error("{}", msg);
  }
}

int RunMain(const std::function<absl::Status()>& body) {
  absl::Status st;
  try {
    st = body();
  } catch (const std::bad_alloc&) {
    // A model, batch or sequence too large for the memory: one line saying so (was "unexpected
    // exception: std::bad_alloc").
    st = absl::InternalError(
        "out of memory: an allocation failed (std::bad_alloc): the run asks for more memory than this process can "
        "get (the machine's, a cgroup's or ulimit -v's); ask for less (for ptk-train: a smaller model, "
        "--micro-batch-size or --seq-length; ptk-train --dry-run estimates the memory)");
  } catch (const std::exception& e) {
    st = absl::InternalError(fmt::format("unexpected exception: {}", e.what()));
  }
  // What a tool prints on standard output is a product (a chunk list, a document, a sample, the
  // training log): on a full disk it must not end with exit 0 and the output cut or empty.
  if (absl::Status out = FlushStdout(); st.ok()) st = out;
  if (st.ok()) return kExitOk;
  PrintFailure(st);
  return ExitCodeFor(st);
}

}  // namespace ptk::cli
