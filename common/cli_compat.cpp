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

void IgnoredFlags::Add(CLI::Option* opt, std::string why, ArgType type) {
  opt->description(fmt::format("Ignored, {}: {}", as_, why))->group(kIgnoredGroup);
  ignored_.push_back({opt, std::move(why), type});
}

bool IsPythonInt(const std::string& text) {
  const char* ws = " \t\n\r\f\v";
  const size_t first = text.find_first_not_of(ws);
  if (first == std::string::npos) return false;
  const std::string s = text.substr(first, text.find_last_not_of(ws) - first + 1);
  size_t i = s[0] == '+' || s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  for (bool digit_before = false; i < s.size(); ++i) {
    const bool digit = s[i] >= '0' && s[i] <= '9';
    if (!digit && !(s[i] == '_' && digit_before && i + 1 < s.size())) return false;
    digit_before = digit;
  }
  return true;
}

namespace {

// Python's repr of a str, as argparse shows a value: in single quotes, or double ones when it holds a
// single quote and no double quote; backslashes and the other quote escaped.
std::string PyStrRepr(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (const char c : s) {
    if (c == '\\' || c == q) out += '\\';
    out += c;
  }
  return out + q;
}

}  // namespace

absl::Status IgnoredFlags::CheckValues() const {
  for (const Ignored& i : ignored_) {
    if (i.type != ArgType::kInt) continue;
    for (const std::string& v : i.opt->results())
      if (!IsPythonInt(v))
        return UsageError(fmt::format(
            "argument {}: invalid int value: {} (the flag is ignored, {}, but its argparse takes only an int)",
            i.opt->get_name(), PyStrRepr(v), as_));
  }
  return absl::OkStatus();
}

void IgnoredFlags::Note() const {
  for (const Ignored& i : ignored_) {
    if (i.opt->count() == 0) continue;
    std::string given = i.opt->get_name();
    if (i.opt->get_expected_max() > 0)  // not a flag (a flag's result is "true")
      for (const std::string& v : i.opt->results()) given += " " + v;
    log::Warning("{}: ignored, {}: {}", given, as_, i.why);
  }
}

}  // namespace ptk::cli
