// Two ptk-train jobs of the same WORLD_SIZE on one MASTER_ADDR:MASTER_PORT (a reused script, two Slurm
// jobs on one node, a stale job still running), and a port held by a program that is not ptk: no rank
// of one job ever joins the other (the worst outcome: two trainings mixed, both "succeeding"); the
// job refused stops at once, every rank non-zero with one line naming the address and the other job;
// the job that holds the port is undisturbed (its losses those of a run alone). Real processes on
// 127.0.0.1; every rank under `timeout 120`, so that a rank that waited for its rendezvous timeout
// exits 124 and fails the test.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class TwoJobsCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(dir_ / "data_text_document", 300, testing::kSmallVocabEod));
    const std::string host = testing::ReadFile("/proc/sys/kernel/hostname");
    host_ = host.substr(0, host.find('\n'));
  }
  // A tiny data-parallel run; each job in a folder of its own (its index cache).
  std::string Train(const std::string& job) const {
    std::filesystem::create_directories(dir_ / job);
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 8 --lr 1e-3 --split 98,2,0 --eval-interval 1000 --eval-iters 1 --log-interval 1"
           " --train-iters 30 --threads 1 --make-vocab-size-divisible-by 512 --data-path " +
           ShellQuote(dir_ / "data_text_document") + " --data-cache-path " + ShellQuote(dir_ / (job + "/cache"));
  }
  // Bash that starts rank `rank` of `job` on `port` in the background (`extra`: flags after Train's), its log in
  // DIR/<job><rank>.log, $t<job><rank> its `timeout` and $p<job><rank> the ptk-train under it (for SIGSTOP).
  std::string Start(const std::string& job, int rank, int port, const std::string& run_id,
                    const std::string& extra = "") const {
    const std::string v = job + std::to_string(rank);
    return "RANK=" + std::to_string(rank) + " MASTER_PORT=" + std::to_string(port) +
           (run_id.empty() ? "" : " PTK_RUN_ID=" + run_id) + " timeout 120 " + Train(job) + extra + " > " +
           ShellQuote(Log(v)) + " 2>&1 & t" + v + "=$!; ";
  }
  // Bash: wait for rank `rank` of `job`, echo "rc<job><rank>=N".
  static std::string Wait(const std::string& job, int rank) {
    const std::string v = job + std::to_string(rank);
    return "wait $t" + v + "; echo rc" + v + "=$?; ";
  }
  // Bash: wait (at most a minute) until `job`'s rank 0 logged `text`.
  std::string Until(const std::string& job, const std::string& text) const {
    return "for i in $(seq 3000); do grep -q " + ShellQuote(text) + " " + ShellQuote(Log(job + "0")) +
           " && break; sleep 0.02; done; ";
  }
  // Bash: wait (at most a minute) until something listens on `port`.
  static std::string UntilListening(int port) {
    return "for i in $(seq 1200); do (: > /dev/tcp/127.0.0.1/" + std::to_string(port) +
           ") 2>/dev/null && break; sleep 0.05; done; ";
  }
  struct Run {
    std::string out;
    int Rc(const std::string& v) const {
      std::smatch m;
      const std::regex re("rc" + v + "=(\\d+)");
      return std::regex_search(out, m, re) ? std::stoi(m[1]) : -1;
    }
  };
  Run Script(const std::string& body) {
    // No run id from the environment the tests run in (a Slurm job's, say): each job's is its own.
    return {RunCmd("bash -c " + ShellQuote("unset PTK_RUN_ID SLURM_JOB_ID TORCHELASTIC_RUN_ID TORCHELASTIC_ERROR_FILE; "
                                           "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1; " +
                                           body))
                .output};
  }
  std::string Log(const std::string& v) const { return dir_ / (v + ".log"); }
  std::string Read(const std::string& v) const { return testing::ReadFile(Log(v)); }
  std::string Logs(const std::vector<std::string>& vs) const {
    std::string s;
    for (const auto& v : vs) s += "--- " + v + "\n" + Read(v);
    return s;
  }
  // The job's losses (its last rank's log lines: rank 1's), which must be those of the same job run alone, bit for
  // bit (as printed).
  void ExpectUndisturbed(const std::string& job, const std::vector<std::pair<int, double>>& alone) {
    const auto losses = testing::LossesOf(Read(job + "1"));
    EXPECT_EQ(losses.size(), 30u) << Read(job + "1");
    EXPECT_EQ(losses, alone) << "job " << job << " was disturbed";
  }
  std::vector<std::pair<int, double>> Alone() {
    const int port = testing::FreeTestPort();
    Run r = Script(Start("alone", 1, port, "") + Start("alone", 0, port, "") + Wait("alone", 0) + Wait("alone", 1));
    EXPECT_EQ(r.Rc("alone0"), 0) << Logs({"alone0", "alone1"});
    EXPECT_EQ(r.Rc("alone1"), 0) << Logs({"alone0", "alone1"});
    return testing::LossesOf(Read("alone1"));
  }
  // One "ptk-train: error: " line in `log` that contains `text`.
  static bool SaysOnce(const std::string& log, const std::string& text) {
    size_t lines = 0;
    for (size_t at = 0; at < log.size();) {
      const size_t end = std::min(log.find('\n', at), log.size());
      const std::string line = log.substr(at, end - at);
      if (line.rfind("ptk-train: error: ", 0) == 0 && line.find(text) != std::string::npos) ++lines;
      at = end + 1;
    }
    return lines == 1;
  }

  // A listener on `port` that accepts and never answers; ranks 0 and 1 started with MASTER_PORT `master_port` and
  // `env` (torchrun's, say), which name the port `port_words` and the address `where` (RendezvousPortWords,
  // RendezvousAddressWords).
  void HeldByAProgramThatIsNotPtk(int port, int master_port, const std::string& env, const std::string& port_words,
                                  const std::string& where) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::listen(fd, 16), 0);  // the kernel completes the connections; nobody reads them
    // A silent holder is waited for up to 30 s (a ptk rank 0 starved of CPU answers late), or the ranks'
    // timeout: 6 s here.
    const std::string minutes = " --distributed-timeout-minutes 0.1";
    const Run r = Script(env + Start("s", 0, master_port, "", minutes) + env + Start("s", 1, master_port, "", minutes) +
                         Wait("s", 0) + Wait("s", 1));
    ::close(fd);
    const std::string logs = r.out + Logs({"s0", "s1"});
    EXPECT_EQ(r.Rc("s0"), 1) << logs;
    EXPECT_EQ(r.Rc("s1"), 1) << logs;
    EXPECT_TRUE(SaysOnce(Read("s0"), "rank 0: " + port_words +
                                         " on this host is held by a program that did not answer ptk's question within "
                                         "6 s (not a ptk rendezvous, or a ptk rank 0 that hangs), this job being "
                                         "WORLD_SIZE 2, no run id: give this job a free MASTER_PORT"))
        << logs;
    EXPECT_TRUE(SaysOnce(Read("s1"), "rendezvous: what listens at " + where +
                                         " did not answer ptk's hello within 6 s: not a ptk rank 0 (or one that "
                                         "hangs); another program or job holds " +
                                         port_words))
        << logs;
  }

  testing::TempDir dir_;
  std::string host_;
};

// The same script started again while the first job runs (no run id: ranks started by hand). Job A's
// rank 1 is stopped (SIGSTOP) once A's ranks met (rank 0's "rendezvous at" line, before its start-up
// and 30 iterations), so that A surely holds the port and its rank 1 while B starts; B's rank 0 names the ptk rank 0
// holding the port, B's rank 1 the rank 1 connected already; both exit 1 at once. A, let go, ends as a run alone does;
// then B, started again on the port A freed, runs as a run alone does. Before, B's rank 1 waited for the whole
// rendezvous timeout.
TEST_F(TwoJobsCli, AJobStartedWhileAnotherRunsStopsAtOnceTheFirstUndisturbed) {
  const auto alone = Alone();
  ASSERT_EQ(alone.size(), 30u);
  const int port = testing::FreeTestPort();
  const Run r = Script(Start("a", 1, port, "") + Start("a", 0, port, "") + Until("a", "rendezvous at 127.0.0.1") +
                       "pa1=$(pgrep -P $ta1); kill -STOP $pa1 && echo a1-stopped; " + Start("b", 0, port, "") +
                       Start("b", 1, port, "") + Wait("b", 0) + Wait("b", 1) + "kill -CONT $pa1; " + Wait("a", 0) +
                       Wait("a", 1) + Start("c", 0, port, "") + Start("c", 1, port, "") + Wait("c", 0) + Wait("c", 1));
  const std::string logs = r.out + Logs({"a0", "a1", "b0", "b1", "c0"});
  ASSERT_NE(r.out.find("a1-stopped"), std::string::npos) << "job A ended before B started: " << logs;
  EXPECT_EQ(r.Rc("b0"), 1) << logs;
  EXPECT_EQ(r.Rc("b1"), 1) << logs;
  const std::string p = std::to_string(port);
  EXPECT_TRUE(SaysOnce(
      Read("b0"), "rank 0: MASTER_PORT " + p + " on this host is held by another ptk rank 0 (host " + host_ + ", pid "))
      << logs;
  EXPECT_TRUE(SaysOnce(Read("b0"), "; WORLD_SIZE 2, no run id), this job being WORLD_SIZE 2, no run id")) << logs;
  EXPECT_TRUE(SaysOnce(Read("b1"), "rendezvous: the rank 0 at 127.0.0.1:" + p)) << logs;
  EXPECT_TRUE(SaysOnce(Read("b1"), "already has a rank 1 connected (host " + host_ + ", pid ")) << logs;
  EXPECT_EQ(r.Rc("a0"), 0) << logs;
  EXPECT_EQ(r.Rc("a1"), 0) << logs;
  ExpectUndisturbed("a", alone);
  EXPECT_EQ(r.Rc("c0"), 0) << logs;
  EXPECT_EQ(r.Rc("c1"), 0) << logs;
  ExpectUndisturbed("c", alone);
}

// Two jobs started together, told apart by their run ids (PTK_RUN_ID here; srun's and torchrun's
// alike). First B's ranks come while A's rank 0 waits for its own rank 1: B's rank 1 is refused (before,
// it joined A as its rank 1: A's rank 0 and B's rank 1 trained together, both exiting 0, while A's rank
// 1 was refused until the timeout); A's rank 1, coming after, joins and A runs as alone. Then all four
// ranks at once: whichever job's rank 0 takes the port runs as alone, every rank of the other stops
// at once naming it.
TEST_F(TwoJobsCli, TwoJobsStartedTogetherNeverMix) {
  const auto alone = Alone();
  ASSERT_EQ(alone.size(), 30u);
  const int port = testing::FreeTestPort();
  const std::string p = std::to_string(port);
  Run r = Script(Start("a", 0, port, "job-a") + UntilListening(port) + Start("b", 1, port, "job-b") +
                 Start("b", 0, port, "job-b") + Wait("b", 1) + Wait("b", 0) + Start("a", 1, port, "job-a") +
                 Wait("a", 0) + Wait("a", 1));
  std::string logs = r.out + Logs({"a0", "a1", "b0", "b1"});
  EXPECT_EQ(r.Rc("b0"), 1) << logs;
  EXPECT_EQ(r.Rc("b1"), 1) << logs;
  EXPECT_TRUE(
      SaysOnce(Read("b1"), "rendezvous: the rank 0 at 127.0.0.1:" + p + " is another job's (host " + host_ + ", pid "))
      << logs;
  EXPECT_TRUE(SaysOnce(Read("b1"),
                       "; WORLD_SIZE 2, run id PTK_RUN_ID=job-a), not this rank's (WORLD_SIZE 2, run id "
                       "PTK_RUN_ID=job-b): two jobs use MASTER_PORT " +
                           p + "; give each job a MASTER_PORT of its own"))
      << logs;
  EXPECT_TRUE(SaysOnce(Read("b0"),
                       "; WORLD_SIZE 2, run id PTK_RUN_ID=job-a), this job being WORLD_SIZE 2, run id "
                       "PTK_RUN_ID=job-b"))
      << logs;
  EXPECT_EQ(r.Rc("a0"), 0) << logs;
  EXPECT_EQ(r.Rc("a1"), 0) << logs;
  ExpectUndisturbed("a", alone);

  const int port2 = testing::FreeTestPort();
  r = Script(Start("d", 1, port2, "job-d") + Start("e", 1, port2, "job-e") + Start("d", 0, port2, "job-d") +
             Start("e", 0, port2, "job-e") + Wait("d", 0) + Wait("d", 1) + Wait("e", 0) + Wait("e", 1));
  logs = r.out + Logs({"d0", "d1", "e0", "e1"});
  const bool d_ran = r.Rc("d0") == 0;
  const std::string won = d_ran ? "d" : "e", lost = d_ran ? "e" : "d";
  EXPECT_EQ(r.Rc(won + "0"), 0) << logs;
  EXPECT_EQ(r.Rc(won + "1"), 0) << logs;
  ExpectUndisturbed(won, alone);
  EXPECT_EQ(r.Rc(lost + "0"), 1) << logs;
  EXPECT_EQ(r.Rc(lost + "1"), 1) << logs;
  EXPECT_TRUE(SaysOnce(Read(lost + "0"), "held by another ptk rank 0 (host " + host_)) << logs;
  EXPECT_TRUE(SaysOnce(Read(lost + "1"), "run id PTK_RUN_ID=job-" + won + "), not this rank's")) << logs;
}

// Two jobs started together by hand, no run id, the same WORLD_SIZE and port, other flags (B's seed): B's
// rank 1, coming while A's rank 0 waits for its own rank 1, is refused at once naming the setting with both
// values (before, it joined A: A's rank 0 and B's rank 1 met and both stopped on their settings, A's own
// rank 1 refused as "already connected"); B's rank 0 finds the port held; A's rank 1, coming after, joins
// and A runs as alone, its rank 0 having warned of the rank it refused.
TEST_F(TwoJobsCli, TwoJobsStartedTogetherByHandWithOtherFlagsNeverMix) {
  const auto alone = Alone();
  ASSERT_EQ(alone.size(), 30u);
  const int port = testing::FreeTestPort();
  const std::string p = std::to_string(port);
  const Run r = Script(Start("a", 0, port, "") + UntilListening(port) + Start("b", 1, port, "", " --seed 4321") +
                       Start("b", 0, port, "", " --seed 4321") + Wait("b", 1) + Wait("b", 0) + Start("a", 1, port, "") +
                       Wait("a", 0) + Wait("a", 1));
  const std::string logs = r.out + Logs({"a0", "a1", "b0", "b1"});
  EXPECT_EQ(r.Rc("b0"), 1) << logs;
  EXPECT_EQ(r.Rc("b1"), 1) << logs;
  EXPECT_TRUE(SaysOnce(Read("b1"), "rendezvous: the rank 0 at 127.0.0.1:" + p + " (host " + host_ + ", pid ")) << logs;
  EXPECT_TRUE(
      SaysOnce(Read("b1"),
               "; WORLD_SIZE 2, no run id) runs other settings than this rank 1: --seed differs: rank 0 has "
               "1234, rank 1 has 4321: another job started by hand (WORLD_SIZE 2, no run id) uses MASTER_PORT " +
                   p))
      << logs;
  EXPECT_TRUE(SaysOnce(Read("b0"), "; WORLD_SIZE 2, no run id), this job being WORLD_SIZE 2, no run id")) << logs;
  EXPECT_NE(Read("a0").find("rank 0's rendezvous refused a rank 1 (host " + host_ + ", pid "), std::string::npos)
      << logs;
  EXPECT_EQ(r.Rc("a0"), 0) << logs;
  EXPECT_EQ(r.Rc("a1"), 0) << logs;
  ExpectUndisturbed("a", alone);
}

// A stale program that is not ptk holds the port (it accepts and never answers): rank 0 says so, not
// "another job"; rank 1 stops once its hello goes unanswered 30 s (here its 6 s timeout), naming the
// address, not as a rank 0 that never came.
TEST_F(TwoJobsCli, APortHeldByAProgramThatIsNotPtkStopsTheJobNamingIt) {
  const int port = testing::FreeTestPort();
  const std::string p = std::to_string(port);
  HeldByAProgramThatIsNotPtk(port, port, "", "MASTER_PORT " + p, "127.0.0.1:" + p);
}

// The same under torchrun (its variables, TORCHELASTIC_USE_AGENT_STORE=True: its agent's store holds
// MASTER_PORT, the ranks meet on the port beside it): the messages name the port held, MASTER_PORT + 1, and why.
// Before, they said "MASTER_PORT <that port>", which is not MASTER_PORT: a user checked the wrong port.
TEST_F(TwoJobsCli, UnderTorchrunThePortHeldIsNamedAsMasterPortPlusOne) {
  const int port = testing::FreeTestPort();  // the rendezvous's; MASTER_PORT (torchrun's store) is the one below
  const std::string p = std::to_string(port), m = std::to_string(port - 1);
  const std::string why = " (MASTER_PORT " + m + " + 1: torchrun's store holds " + m + ")";
  HeldByAProgramThatIsNotPtk(port, port - 1, "TORCHELASTIC_USE_AGENT_STORE=True LOCAL_WORLD_SIZE=2 ", "port " + p + why,
                             "127.0.0.1:" + p + why);
}

}  // namespace
}  // namespace ptk
