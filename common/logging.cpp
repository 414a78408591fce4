// Minimal logging to stderr.
#include "common/logging.h"

#include <cstdio>
#include <mutex>

namespace ptk::log {
namespace {
std::string& Name() {
  static std::string name = "ptk";
  return name;
}
Level g_min_level = Level::kInfo;
std::mutex g_mu;
}  // namespace

void SetProgramName(std::string_view name) { Name() = std::string(name); }
const std::string& ProgramName() { return Name(); }
void SetMinLevel(Level level) { g_min_level = level; }
Level MinLevel() { return g_min_level; }

void Write(Level level, std::string_view message) {
  const char* tag = "";
  switch (level) {
    case Level::kDebug: tag = "debug: "; break;
    case Level::kInfo: tag = ""; break;
    case Level::kWarning: tag = "warning: "; break;
    case Level::kError: tag = "error: "; break;
  }
  std::string line = fmt::format("{}: {}{}\n", Name(), tag, message);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void Raw(std::string_view line) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

std::string Printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else if (c == '\\')
      out += "\\\\";
    else
      out += static_cast<char>(c);
  }
  return out;
}

}  // namespace ptk::log
