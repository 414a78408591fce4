// Command-line conventions shared by every tool.
#include "common/cli.h"

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>

#include <cstdio>
#include <cstdlib>
#include <set>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"

namespace ptk::cli {

std::unique_ptr<CLI::App> MakeApp(const std::string& name, const std::string& description) {
  auto app = std::make_unique<CLI::App>(description, name);
  app->option_defaults()->always_capture_default();
  app->get_formatter()->column_width(34);
  log::SetProgramName(name);
  return app;
}

std::optional<int> Parse(CLI::App& app, int argc, char** argv) {
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    std::fputs(app.help("", CLI::AppFormatMode::All).c_str(), stdout);
    return kExitOk;
  } catch (const CLI::CallForVersion&) {
    std::puts(app.version().c_str());
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: usage error: %s\nRun with --help for more information.\n", app.get_name().c_str(),
                 e.what());
    return kExitUsage;
  }
  return std::nullopt;
}

absl::Status CheckOptionTable(const CLI::App& app) {
  std::set<std::string> seen;
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
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    absl::Status st = CheckOptionTable(*sub);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

namespace {
CLI::Validator NumberValidator(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& in) -> std::string {
        const char* what = allow_zero ? "a number >= 0" : "a positive number";
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size() || errno == ERANGE || !std::isfinite(v) ||
            (allow_zero ? v < 0 : v <= 0))
          return fmt::format("must be {}, not {:?}", what, in.size() > 40 ? in.substr(0, 40) + "..." : in);
        return "";
      },
      allow_zero ? "NONNEGATIVE" : "POSITIVE");
}
}  // namespace

const CLI::Validator& Positive() {
  static const CLI::Validator v = NumberValidator(false);
  return v;
}
const CLI::Validator& NonNegative() {
  static const CLI::Validator v = NumberValidator(true);
  return v;
}

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return kExitOk;
  if (status.code() == absl::StatusCode::kResourceExhausted) return kExitDiskFull;
  if (status.code() == absl::StatusCode::kInvalidArgument && StatusMessage(status).rfind("usage: ", 0) == 0)
    return kExitUsage;
  return kExitFailure;
}

int RunMain(const std::function<absl::Status()>& body) {
  absl::Status st;
  try {
    st = body();
  } catch (const std::exception& e) {
    st = absl::InternalError(fmt::format("unexpected exception: {}", e.what()));
  }
  if (st.ok()) return kExitOk;
  std::string msg(StatusMessage(st));
  if (msg.rfind("usage: ", 0) == 0) {
    std::fprintf(stderr, "%s: usage error: %s\nRun with --help for more information.\n", log::ProgramName().c_str(),
                 msg.c_str() + 7);
  } else {
    log::Error("{}", msg);
  }
  return ExitCodeFor(st);
}

}  // namespace ptk::cli
