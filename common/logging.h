// Minimal logging to stderr: one line per message, prefixed with the tool name and level.
#pragma once

#include <string>
#include <string_view>

#include <fmt/core.h>

namespace ptk::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Set once by main: "ptk-tokenize". Lines become "ptk-tokenize: warning: ...".
void SetProgramName(std::string_view name);
const std::string& ProgramName();
void SetMinLevel(Level level);
Level MinLevel();

void Write(Level level, std::string_view message);
// Untrusted text (a name from a server's listing) made safe for one log line: control characters
// and DEL as \xNN, backslashes doubled, so that it cannot forge or split log lines.
std::string Printable(std::string_view text);
// Writes a raw line to stderr (no prefix): used for Megatron-shaped progress lines.
void Raw(std::string_view line);
// Writes a line to stdout (Megatron prints "Opening FILE" there), after the status line is cleared.
void Out(std::string_view line);
// The transient status line on a terminal (ProgressReporter's rate and ETA), drawn in place on
// stderr; "" removes it. Every line written through this file clears it first and draws it again
// below, so a log line and the status line never run together on one screen line.
void SetStatusLine(std::string_view line);

template <typename... Args>
void Debug(fmt::format_string<Args...> f, Args&&... args) {
  if (MinLevel() <= Level::kDebug) Write(Level::kDebug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Info(fmt::format_string<Args...> f, Args&&... args) {
  if (MinLevel() <= Level::kInfo) Write(Level::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Warning(fmt::format_string<Args...> f, Args&&... args) {
  if (MinLevel() <= Level::kWarning) Write(Level::kWarning, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Error(fmt::format_string<Args...> f, Args&&... args) {
  Write(Level::kError, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ptk::log
