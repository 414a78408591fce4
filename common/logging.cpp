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
std::string g_status;  // the status line on stderr now, guarded by g_mu

// Writes `text` to `f` with the status line taken away before and drawn again after it. Holds g_mu.
void WriteAround(FILE* f, std::string_view text) {
  if (!g_status.empty()) {
    std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  }
  std::fwrite(text.data(), 1, text.size(), f);
  std::fflush(f);
  if (!g_status.empty()) {
    std::fwrite(g_status.data(), 1, g_status.size(), stderr);
    std::fflush(stderr);
  }
}
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
  WriteAround(stderr, line);
}

void Raw(std::string_view line) {
  std::lock_guard<std::mutex> lock(g_mu);
  WriteAround(stderr, std::string(line) + "\n");
}

void Out(std::string_view line) {
  std::lock_guard<std::mutex> lock(g_mu);
  WriteAround(stdout, std::string(line) + "\n");
}

void SetStatusLine(std::string_view line) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (line.empty() && g_status.empty()) return;
  g_status = line;
  std::fputs("\r\033[K", stderr);
  std::fwrite(g_status.data(), 1, g_status.size(), stderr);
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
