// Two runs on one output (a Slurm requeue or a second submission while the first still runs),
// with one of them killed at a random moment, then a rerun: real processes, 20 trials per tool.
// Whatever the interleaving, the output ends byte-identical to an undisturbed run, the run that
// was refused says which run holds the output, and nothing is left behind.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/hash.h"
#include "common/output_lock.h"
#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::TempDir;

constexpr int kTrials = 20;

// Text that xz cannot squeeze to nothing, so that decoding takes a while (~0.3 s).
std::string Docs(int n, int seed) {
  std::mt19937 rng(seed);
  static const char* kWords[] = {"alpha", "bravo",  "charlie", "delta", "echo", "foxtrot",  "golf",  "hotel",
                                 "india", "juliet", "kilo",    "lima",  "mike", "november", "oscar", "papa"};
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += fmt::format("{{\"text\": \"doc {} {}", i, rng());
    for (int w = 0; w < 120; ++w) s += fmt::format(" {}{}", kWords[rng() % 16], rng() % 100);
    s += "\"}\n";
  }
  return s;
}

struct Tally {
  int refused = 0, completed = 0, killed = 0;
};

// How long an undisturbed run of `cmd` takes, in microseconds (it must succeed).
double TimedRun(const std::string& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunCmd(cmd);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `reset` (removes the finished output, so that both runs really write), starts `cmd` twice
// (the second 0-150 ms after the first), kills one of them 0-300 ms later (the first in odd trials,
// the second in even ones), then reruns it to completion; `check` compares the outputs with an
// undisturbed run's. `run_us`, when given, is how long an undisturbed run takes: the two delays are
// then drawn from its first third and its next half instead, so that a faster tool (or machine)
// is still killed mid-run.
Tally Race(const TempDir& dir, const std::string& cmd, const std::string& out_dir, const std::string& reset,
           const std::function<void(const std::string& when)>& check, double run_us = 0) {
  const uint32_t second_us = run_us > 0 ? static_cast<uint32_t>(run_us / 3) + 1 : 150000;
  const uint32_t kill_us = run_us > 0 ? static_cast<uint32_t>(run_us / 2) + 1 : 300000;
  std::mt19937 rng(12345);
  Tally t;
  for (int trial = 0; trial < kTrials; ++trial) {
    if (!reset.empty()) {
      EXPECT_EQ(RunCmd(reset).exit_code, 0);  // both runs really write
    }
    const std::string log_a = dir / "a.log", log_b = dir / "b.log";
    pid_t a = testing::SpawnShell(cmd, log_a);
    ::usleep(static_cast<useconds_t>(rng() % second_us));
    pid_t b = testing::SpawnShell(cmd, log_b);
    ::usleep(static_cast<useconds_t>(rng() % kill_us));
    const bool kill_first = trial % 2 == 1;
    ::kill(kill_first ? a : b, SIGKILL);
    const int rc_a = testing::WaitExit(a), rc_b = testing::WaitExit(b);
    const int survivor_rc = kill_first ? rc_b : rc_a;
    const std::string survivor_log = testing::ReadFile(kill_first ? log_b : log_a);
    const int victim_rc = kill_first ? rc_a : rc_b;
    if (victim_rc == 128 + SIGKILL) ++t.killed;
    if (survivor_rc == 0) {
      ++t.completed;
      check(fmt::format("trial {}: after the surviving run", trial));
    } else {
      // The only acceptable failure: refused because the other run held the output.
      EXPECT_EQ(survivor_rc, 1) << "trial " << trial << ": " << survivor_log;
      EXPECT_NE(survivor_log.find("is being written by another run"), std::string::npos)
          << "trial " << trial << ": " << survivor_log;
      EXPECT_NE(survivor_log.find("pid "), std::string::npos) << survivor_log;
      ++t.refused;
    }
    auto rerun = RunCmd(cmd);
    EXPECT_EQ(rerun.exit_code, 0) << "trial " << trial << ": " << rerun.output;
    check(fmt::format("trial {}: after the rerun", trial));
    EXPECT_EQ(testing::Leftovers(out_dir), "") << "trial " << trial;
  }
  std::printf(
      "%d trials: %d times the second run was refused, %d completed, %d killed mid-run (an undisturbed run: %.0f ms)\n",
      kTrials, t.refused, t.completed, t.killed, run_us / 1000);
  return t;
}

TEST(ConcurrentRuns, ConcatSameChunk) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 2; ++i)
    testing::WriteFile(dir / fmt::format("in/part{}.jsonl.xz", i), testing::XzCompress(Docs(15000, 10 + i), 0));
  auto plan = RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"),
                                 dir / "in", dir / "out"));
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const std::string want = Docs(15000, 10) + Docs(15000, 11);
  const std::string run = fmt::format("{} run --quiet --plan {} --chunk-index 0", testing::Tool("ptk-concat"),
                                      dir / "out/concat-plan.json");
  const std::string reset = fmt::format("rm -f {0}/train_00.jsonl {0}/train_00.jsonl.ptk-done", dir / "out");
  const double run_us = TimedRun(run);
  const Tally t = Race(
      dir, run, dir / "out", reset,
      [&](const std::string& when) { ASSERT_EQ(testing::ReadFile(dir / "out/train_00.jsonl"), want) << when; }, run_us);
  EXPECT_GT(t.killed, 0);
}

TEST(ConcurrentRuns, ExtractSameOutput) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string text = Docs(25000, 7);
  testing::WriteFile(dir / "in/big.jsonl.xz", testing::XzCompress(text, 0));
  const std::string run =
      fmt::format("{} --quiet --input {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out");
  const std::string reset = fmt::format("rm -f {0}/big.jsonl {0}/big.jsonl.ptk-done", dir / "out");
  const double run_us = TimedRun(run);
  const Tally t = Race(
      dir, run, dir / "out", reset,
      [&](const std::string& when) { ASSERT_EQ(testing::ReadFile(dir / "out/big.jsonl"), text) << when; }, run_us);
  EXPECT_GT(t.killed, 0);
}

// A run killed just after it took the lock of outputs another run had completed leaves the lock
// file, which nobody holds: the next run finds the outputs up to date and removes it (it failed
// TokenizeSamePrefix once in CI: 'ds_text_document.ptk-lock' left after the rerun). A lock a live
// run holds stays.
TEST(ConcurrentRuns, TokenizeRerunRemovesAStaleLock) {
  TempDir dir;
  std::filesystem::create_directories(dir / "out");
  testing::WriteFile(dir / "in.jsonl", Docs(200, 3));
  const std::string tok = fmt::format("{} --quiet --input {} --output-prefix {} --workers 1 --append-eod",
                                      testing::Tool("ptk-tokenize"), dir / "in.jsonl", dir / "out/ds");
  ASSERT_EQ(RunCmd(tok).exit_code, 0);
  const std::string lock = dir / "out/ds_text_document.ptk-lock";
  testing::WriteFile(lock, "ptk-tokenize pid 999999 (killed)\n");
  auto r = RunCmd(tok);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
  {
    auto held = OutputLock::Acquire(dir / "out/ds_text_document");
    ASSERT_TRUE(held.ok()) << held.status();
    auto again = RunCmd(tok);
    EXPECT_EQ(again.exit_code, 0) << again.output;  // up to date: nothing to write, nothing to wait for
    EXPECT_TRUE(std::filesystem::exists(lock)) << "a held lock was removed";
  }
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
}

// A requeued task on a node whose predecessor died holding the output's lock (on NFS the lock outlives
// its holder for the server's lease, ~90 s) failed at once and burned its retries. With --lock-wait it
// keeps trying, saying so, and writes once the holder lets go: the output byte-identical to an
// undisturbed run's, nothing left behind.
TEST(ConcurrentRuns, TokenizeWithLockWaitWritesOnceTheHolderLetsGo) {
  TempDir dir;
  std::filesystem::create_directories(dir / "out");
  std::filesystem::create_directories(dir / "ref");
  testing::WriteFile(dir / "in.jsonl", Docs(300, 5));
  const std::string tok =
      fmt::format("{} --input {} --workers 1 --append-eod", testing::Tool("ptk-tokenize"), dir / "in.jsonl");
  auto ref = RunCmd(tok + " --quiet --output-prefix " + (dir / "ref/ds"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string log = dir / "waiting.log";
  auto held = OutputLock::Acquire(dir / "out/ds_text_document");  // the dead node's lock, still held
  ASSERT_TRUE(held.ok()) << held.status();
  const pid_t waiting = testing::SpawnShell(tok + " --lock-wait 600 --output-prefix " + (dir / "out/ds"), log);
  // Its first line says it waits (then one every 10 s); only then is the lock let go.
  bool said = false;
  for (int i = 0; i < 6000 && !said; ++i) {
    said = testing::ReadFile(log).find("waited 0 s of 600 s (--lock-wait)") != std::string::npos;
    if (!said) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::string before = testing::ReadFile(log);
  held->reset();
  const int rc = testing::WaitExit(waiting);
  const std::string out = testing::ReadFile(log);
  ASSERT_TRUE(said) << out;
  EXPECT_NE(before.find(dir / "out/ds_text_document is being written by another run (lock "), std::string::npos)
      << before;
  EXPECT_NE(before.find(fmt::format("(pid {} on host", ::getpid())), std::string::npos) << before;  // the holder
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(testing::ReadFile(dir / "out/ds_text_document.bin"), testing::ReadFile(dir / "ref/ds_text_document.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "out/ds_text_document.idx"), testing::ReadFile(dir / "ref/ds_text_document.idx"));
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
}

// A wait that runs out fails (exit 1) in one line naming the output, its holder and the wait; the
// flag's bad values are usage errors (exit 2) naming it.
TEST(ConcurrentRuns, TokenizeLockWaitThatRunsOutFailsNamingTheWait) {
  TempDir dir;
  std::filesystem::create_directories(dir / "out");
  testing::WriteFile(dir / "in.jsonl", Docs(20, 5));
  const std::string tok = fmt::format("{} --quiet --input {} --output-prefix {} --workers 1",
                                      testing::Tool("ptk-tokenize"), dir / "in.jsonl", dir / "out/ds");
  {
    auto held = OutputLock::Acquire(dir / "out/ds_text_document");
    ASSERT_TRUE(held.ok()) << held.status();
    auto r = RunCmd(tok + " --lock-wait 1.5");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(dir / "out/ds_text_document is being written by another run"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("still held after waiting 1.5 s (--lock-wait)"), std::string::npos) << r.output;
    EXPECT_FALSE(testing::Exists(dir / "out/ds_text_document.bin"));
    auto at_once = RunCmd(tok);  // the default: no wait, as before
    EXPECT_EQ(at_once.exit_code, 1) << at_once.output;
    EXPECT_NE(at_once.output.find("is being written by another run"), std::string::npos) << at_once.output;
    EXPECT_EQ(at_once.output.find("--lock-wait"), std::string::npos) << at_once.output;
  }
  for (const char* bad : {"-1", "abc", "nan", "1e400", ""}) {
    auto r = RunCmd(tok + " --lock-wait '" + bad + "'");
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("--lock-wait"), std::string::npos) << bad << ": " << r.output;
  }
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
}

TEST(ConcurrentRuns, TokenizeSamePrefix) {
  TempDir dir;
  std::filesystem::create_directories(dir / "out");
  testing::WriteFile(dir / "in.jsonl", Docs(20000, 3));
  const std::string tok = fmt::format("{} --quiet --input {} --output-prefix {} --workers 1 --append-eod",
                                      testing::Tool("ptk-tokenize"), dir / "in.jsonl", dir / "out/ds");
  const double run_us = TimedRun(tok);
  const std::string bin = testing::ReadFile(dir / "out/ds_text_document.bin");
  const std::string idx = testing::ReadFile(dir / "out/ds_text_document.idx");
  // Without its sidecar the output is not up to date: both runs really write (a rerun after a
  // complete run leaves it alone).
  const std::string reset = fmt::format("rm -f {}", dir / "out/ds_text_document.ptk-done");
  const Tally t = Race(
      dir, tok, dir / "out", reset,
      [&](const std::string& when) {
        ASSERT_EQ(testing::ReadFile(dir / "out/ds_text_document.bin"), bin) << when;
        ASSERT_EQ(testing::ReadFile(dir / "out/ds_text_document.idx"), idx) << when;
        auto v = RunCmd(fmt::format("{} --verify {}", testing::Tool("ptk-inspect"), dir / "out/ds_text_document"));
        ASSERT_EQ(v.exit_code, 0) << when << ": " << v.output;
        EXPECT_NE(v.output.find("checksums match"), std::string::npos) << v.output;
      },
      run_us);
  EXPECT_GT(t.refused, 0);
  EXPECT_GT(t.killed, 0);
}

// ptk-tokenize always started over. A run killed at a random point (and, in odd trials, its rerun
// killed too) is continued from the last resume point by the next run, and the output is
// byte-identical to an uninterrupted run's. 20 trials. The kills fall at random points of the run's
// progress, the bytes of its temporary .bin: fixed delays stopped killing anything once the
// tokenizer got faster, and delays drawn from an undisturbed run's time missed the runs that a
// machine whose load fell since that run finished sooner.
// The modification time of `path` in nanoseconds, -1 when it does not exist.
int64_t MtimeNs(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

// Waits until `record` was written after `after_ns` (MtimeNs) while `pid` runs: true then, false when
// the process ended first (it is left to WaitExit to reap) or 60 s passed.
bool WaitForNewRecord(pid_t pid, const std::string& record, int64_t after_ns) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    if (MtimeNs(record) > after_ns) return true;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid)
      return false;
    ::usleep(500);
  }
  return false;
}

// The bytes of the temporary .bin of PREFIX in `dir` (0 before there is one).
int64_t TmpBinBytes(const std::string& dir, const std::string& prefix) {
  int64_t bytes = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().rfind(prefix + ".bin.ptk-tmp", 0) != 0) continue;
    std::error_code size_ec;
    const uintmax_t n = it->file_size(size_ec);
    if (!size_ec) bytes = std::max(bytes, static_cast<int64_t>(n));
  }
  return bytes;
}

// Waits until the run's temporary .bin holds `bytes` while `pid` runs: true then, false when the
// process ended first (it is left to WaitExit to reap) or 60 s passed.
bool WaitForBytes(pid_t pid, const std::string& dir, const std::string& prefix, int64_t bytes) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    if (TmpBinBytes(dir, prefix) >= bytes) return true;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid)
      return false;
    ::usleep(200);
  }
  return false;
}

TEST(ConcurrentRuns, KilledTokenizeResumes) {
  TempDir dir;
  std::filesystem::create_directories(dir / "out");
  testing::WriteFile(dir / "a.jsonl", Docs(25000, 21));
  testing::WriteFile(dir / "b.jsonl", Docs(25000, 22));
  const std::string tok = fmt::format(
      "{} --quiet --input {} {} --output-prefix {} --workers 1 --append-eod --resume-interval 0.02 --batch-mb 0.25",
      testing::Tool("ptk-tokenize"), dir / "a.jsonl", dir / "b.jsonl", dir / "out/ds");
  TimedRun(tok);
  EXPECT_FALSE(testing::Exists(dir / "out/ds_text_document.ptk-resume"));
  const std::string bin = testing::ReadFile(dir / "out/ds_text_document.bin");
  const std::string idx = testing::ReadFile(dir / "out/ds_text_document.idx");
  std::mt19937 rng(99);
  int resumed = 0, killed = 0, last_killed = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::filesystem::remove_all(dir / "out");
    std::filesystem::create_directories(dir / "out");
    const int kills = trial % 2 ? 2 : 1;
    bool landed = false;
    for (int k = 0; k < kills; ++k) {
      const std::string record = dir / "out/ds_text_document.ptk-resume";
      const int64_t before = MtimeNs(record), done = TmpBinBytes(dir / "out", "ds_text_document");
      pid_t pid = testing::SpawnShell(tok, dir / "killed.log");
      // Killed once the run recorded where it is (the first record, or for a resumed run one of
      // its own) and has then written a random share of what is left (up to half of it; a quarter
      // for a resumed run): by its progress, not the clock, so that a slower or faster run on a
      // loaded machine still dies mid-way.
      if (WaitForNewRecord(pid, record, before)) {
        const double share = (k == 0 ? 0.5 : 0.25) * static_cast<double>(rng() % 1000) / 1000.0;
        WaitForBytes(pid, dir / "out", "ds_text_document",
                     done + static_cast<int64_t>(share * static_cast<double>(static_cast<int64_t>(bin.size()) - done)));
      }
      ::kill(pid, SIGKILL);
      landed = testing::WaitExit(pid) == 128 + SIGKILL;
      killed += landed;
    }
    last_killed += landed;
    auto rerun = RunCmd(tok);
    ASSERT_EQ(rerun.exit_code, 0) << "trial " << trial << ": " << rerun.output;
    const bool resuming = rerun.output.find("resuming a killed run") != std::string::npos;
    resumed += resuming;
    if (!landed) {
      EXPECT_FALSE(resuming) << "trial " << trial << ": nothing was killed: " << rerun.output;
    }
    ASSERT_EQ(testing::ReadFile(dir / "out/ds_text_document.bin"), bin) << "trial " << trial << ": " << rerun.output;
    ASSERT_EQ(testing::ReadFile(dir / "out/ds_text_document.idx"), idx) << "trial " << trial;
    EXPECT_FALSE(testing::Exists(dir / "out/ds_text_document.ptk-resume")) << "trial " << trial;
    EXPECT_EQ(testing::Leftovers(dir / "out"), "") << "trial " << trial;
  }
  std::printf("%d trials, %d kills (the last of a trial landed in %d): the rerun resumed %d times\n", kTrials, killed,
              last_killed, resumed);
  EXPECT_GT(last_killed, kTrials / 2);      // most runs really were killed mid-way
  EXPECT_GE(resumed * 4, last_killed * 3);  // and most of those continued, not started over
}

}  // namespace
}  // namespace ptk
