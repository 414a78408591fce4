// The tools' default thread counts follow the CPUs the process may use (its affinity mask, capped by
// its cgroup CPU quota), not the machine's: under `taskset` to one CPU, ptk-tokenize's --workers and
// ptk-extract's --jobs are 1, --help shows it and the run says so; a flag above it is warned once.
#include <sched.h>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

// `taskset -c C` for the first CPU this test may run on (a CI container's mask may lack CPU 0).
std::string OnOneCpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return "";
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) return fmt::format("taskset -c {} ", c);
  return "";
}

class DefaultWorkers : public ::testing::Test {
 protected:
  void SetUp() override {
    if (RunCmd("taskset -c 0-1023 true").exit_code != 0 || OnOneCpu().empty()) GTEST_SKIP() << "no taskset";
    testing::WriteFile(dir_ / "in.jsonl", "{\"text\": \"Hello world\"}\n{\"text\": \"two\"}\n");
  }
  std::string Tokenize(const std::string& args) {
    return OnOneCpu() + testing::Tool("ptk-tokenize") + " --input " + ShellQuote(dir_ / "in.jsonl") +
           " --output-prefix " + ShellQuote(dir_ / "out") + " " + args;
  }
  TempDir dir_;
};

TEST_F(DefaultWorkers, TheDefaultFollowsTheAffinityMask) {
  const auto help = RunCmd(OnOneCpu() + testing::Tool("ptk-tokenize") + " --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("--workers INT:an integer in [1, 65536]=1\n"), std::string::npos) << help.output;
  const auto r = RunCmd(Tokenize("--force"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ptk-tokenize: 1 worker: the CPUs this process may use (affinity"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("MB/s, 1 workers)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("oversubscribing"), std::string::npos) << r.output;
  // --quiet: no line for the default.
  const auto quiet = RunCmd(Tokenize("--force --quiet"));
  EXPECT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("worker:"), std::string::npos) << quiet.output;
}

// An explicit --workers wins, above the budget too, with one warning; at the budget, no word.
TEST_F(DefaultWorkers, AFlagAboveTheBudgetIsKeptAndWarnedOnce) {
  const auto r = RunCmd(Tokenize("--force --quiet --workers 3"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string warning = "ptk-tokenize: warning: --workers 3: more than the 1 CPU this process may use (affinity";
  EXPECT_NE(r.output.find(warning), std::string::npos) << r.output;
  int warnings = 0;
  for (size_t at = r.output.find("oversubscribing"); at != std::string::npos;
       at = r.output.find("oversubscribing", at + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1) << r.output;
  EXPECT_NE(r.output.find("MB/s, 3 workers)"), std::string::npos) << r.output;
  // And the 3 ran: oneTBB capped the arena at the 1 CPU it sees, saying "TBB Warning: The number of workers
  // is currently limited to 0. The request for 2 workers is ignored."
  EXPECT_EQ(r.output.find("TBB Warning"), std::string::npos) << r.output;
  const auto one = RunCmd(Tokenize("--force --quiet --workers 1"));
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.output.find("warning"), std::string::npos) << one.output;
}

// ptk-extract's 4 files at once, capped by the budget (decompression is CPU-bound).
TEST_F(DefaultWorkers, ExtractJobsAreCappedByTheBudget) {
  std::filesystem::create_directories(dir_ / "raw");
  testing::WriteFile(
      dir_ / "raw/a.jsonl.gz",
      std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00", 20));
  const std::string extract = OnOneCpu() + testing::Tool("ptk-extract") + " " + ShellQuote(dir_ / "raw");
  const auto help = RunCmd(extract + " --help");
  EXPECT_NE(help.output.find("--jobs INT:an integer in [1, 2147483647]=1\n"), std::string::npos) << help.output;
  const auto r = RunCmd(extract);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ptk-extract: --jobs 1: the CPUs this process may use (affinity"), std::string::npos)
      << r.output;
  const auto two = RunCmd(extract + " --quiet --jobs 2");
  EXPECT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("ptk-extract: warning: --jobs 2: more than the 1 CPU this process may use (affinity"),
            std::string::npos)
      << two.output;
}

}  // namespace
}  // namespace ptk
