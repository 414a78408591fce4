// The flags of the program a tool replaces (cli.h): refused with the reason, or accepted and noted.
#include <string>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/logging.h"
#include "common/status.h"

namespace ptk::cli {

bool IsCompatOnly(const CLI::Option& opt) {
  return opt.get_group() == kUnsupportedGroup || opt.get_group() == kIgnoredGroup;
}

void Refusals::Add(CLI::Option* opt, std::string why) {
  opt->description("Not supported: " + why)->group(kUnsupportedGroup);
  refused_.emplace_back(opt, std::move(why));
}

absl::Status Refusals::Check() const {
  for (const auto& [opt, why] : refused_)
    if (opt->count() > 0) return UsageError(fmt::format("{} is not supported: {}", opt->get_name(), why));
  return absl::OkStatus();
}

void IgnoredFlags::Add(CLI::Option* opt, std::string why) {
  opt->description(fmt::format("Ignored, {}: {}", as_, why))->group(kIgnoredGroup);
  ignored_.emplace_back(opt, std::move(why));
}

void IgnoredFlags::Note() const {
  for (const auto& [opt, why] : ignored_) {
    if (opt->count() == 0) continue;
    std::string given = opt->get_name();
    if (opt->get_expected_max() > 0)  // not a flag (a flag's result is "true")
      for (const std::string& v : opt->results()) given += " " + v;
    log::Warning("{}: ignored, {}: {}", given, as_, why);
  }
}

}  // namespace ptk::cli
