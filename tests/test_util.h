// Helpers shared by the tests: temporary directories, running the tools, reading files.
#pragma once

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace ptk::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ptk-test-XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (p == nullptr) std::abort();
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The working directory while it lives (tests whose inputs name relative paths); the previous one after.
class Chdir {
 public:
  explicit Chdir(const std::string& to) : old_(std::filesystem::current_path()) { std::filesystem::current_path(to); }
  ~Chdir() { std::filesystem::current_path(old_); }
  Chdir(const Chdir&) = delete;
  Chdir& operator=(const Chdir&) = delete;

 private:
  std::filesystem::path old_;
};

inline std::string SourceDir() { return PTK_SOURCE_DIR; }
inline std::string BinDir() { return std::string(PTK_BINARY_DIR) + "/bin"; }
inline std::string Tool(const std::string& name) { return BinDir() + "/" + name; }

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline bool Exists(const std::string& path) { return std::filesystem::exists(path); }

inline std::string Dirname(const std::string& path) { return std::filesystem::path(path).parent_path().string(); }

// Names (below `dir`, recursively) of what a writer must never leave behind once it has exited:
// temporaries, locks, publish journals, verify scratch files. Empty when clean.
inline std::string Leftovers(const std::string& dir) {
  std::string out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    for (const char* bad : {".ptk-tmp", ".ptk-lock", ".ptk-publish", ".ptk-verify", ".ptk-removing"})
      if (name.find(bad) != std::string::npos) {
        out += e.path().string() + "\n";
        break;
      }
  }
  return out;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing stdout+stderr.
inline CommandResult RunCmd(const std::string& cmd) {
  CommandResult r;
  std::string full = cmd + " 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

inline std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

// Starts `sh -c "exec CMD"` in the background with stdout and stderr in `log`; see WaitExit.
inline pid_t SpawnShell(const std::string& cmd, const std::string& log) {
  pid_t pid = ::fork();
  if (pid == 0) {
    const std::string sh = "exec " + cmd + " >" + ShellQuote(log) + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", sh.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// Waits for a SpawnShell process: its exit code, or 128 + the signal that ended it.
inline int WaitExit(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace ptk::testing
