// Two jobs on one MASTER_ADDR:MASTER_PORT, and a port held by something that is not ptk: no rank of
// one job ever joins the other's store (whatever the order the ranks come in), and the one refused
// stops at once with one line naming the address, both jobs (WORLD_SIZE, run id) and what holds the
// port. Stores on loopback ports, ranks as objects; the listeners that are not ptk are raw sockets.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/test_ports.h"
#include "trainer/rendezvous.h"

namespace ptk {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::unique_ptr<RendezvousStore> Join(int rank, int world, int port, const std::string& run_id,
                                      const std::string& settings = "") {
  auto s = RendezvousStore::Connect(rank, world, "127.0.0.1", port, 60s, run_id, 0, settings);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Connect as `rank` of another job, which must be refused at once (kFailedPrecondition, well before
// its 60 s timeout); its message.
std::string Refused(int rank, int world, int port, const std::string& run_id, std::chrono::milliseconds timeout = 60s,
                    const std::string& settings = "") {
  const auto t0 = Clock::now();
  auto s = RendezvousStore::Connect(rank, world, "127.0.0.1", port, timeout, run_id, 0, settings);
  EXPECT_FALSE(s.ok()) << "rank " << rank << " of " << run_id << " joined";
  EXPECT_LT(Clock::now() - t0, 30s) << "it waited for the timeout";
  if (s.ok()) return "";
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  return std::string(s.status().message());
}

std::string Who() { return "host " + HostName() + ", pid " + std::to_string(::getpid()); }

// A second job of the same WORLD_SIZE on the port, its ranks coming before the first job's own rank 1
// (two jobs started together) and after (a job started while another runs): each is refused at once,
// naming both jobs; the first job's rank 1 still joins, and its store knows none of the other's ranks.
// Before, a rank of the same WORLD_SIZE joined the first job when it came first (the two trainings
// mixed), and waited for the whole timeout when it came after.
TEST(RendezvousJobs, NoRankOfAnotherJobJoinsWhateverTheOrder) {
  const int port = testing::FreeTestPort();
  auto a0 = Join(0, 2, port, "PTK_RUN_ID=a");
  ASSERT_NE(a0, nullptr);
  const std::string where = "127.0.0.1:" + std::to_string(port);
  const std::string line = "rendezvous: the rank 0 at " + where + " is another job's (" + Who() +
                           "; WORLD_SIZE 2, run id PTK_RUN_ID=a), not this rank's (WORLD_SIZE 2, run id "
                           "PTK_RUN_ID=b): two jobs use MASTER_PORT " +
                           std::to_string(port) + "; give each job a MASTER_PORT of its own";
  EXPECT_EQ(Refused(1, 2, port, "PTK_RUN_ID=b"), line);  // before the first job's rank 1
  auto a1 = Join(1, 2, port, "PTK_RUN_ID=a");
  ASSERT_NE(a1, nullptr);
  EXPECT_EQ(Refused(1, 2, port, "PTK_RUN_ID=b"), line);  // after it
  // No run id against one, another WORLD_SIZE: another job's too.
  EXPECT_NE(Refused(1, 2, port, "").find("not this rank's (WORLD_SIZE 2, no run id)"), std::string::npos);
  EXPECT_NE(Refused(3, 4, port, "PTK_RUN_ID=a").find("not this rank's (WORLD_SIZE 4, run id PTK_RUN_ID=a)"),
            std::string::npos);
  ASSERT_TRUE(a1->Set("1", "rank 1's address").ok());
  auto got = a0->Get("1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "rank 1's address");
  a1.reset();  // the first job's own ranks are all its store knows of
  const std::string peers = a0->DiagnosePeers("barrier: Connection reset by peer");
  EXPECT_EQ(peers.substr(0, 7), "rank 1 ") << peers;
  EXPECT_EQ(peers.find("rank 3"), std::string::npos) << peers;
}

// Two jobs that nothing tells apart (ranks started by hand, no run id): a rank whose number is
// connected now is another process as that rank, refused at once naming the one connected; one that
// joined and left is a restart, which waits for a fresh rank 0 (comm_test's
// ARestartedRankWaitsForAFreshRankZero).
TEST(RendezvousJobs, ARankConnectedNowIsNotClaimedTwice) {
  const int port = testing::FreeTestPort();
  auto a0 = Join(0, 2, port, "");
  auto a1 = Join(1, 2, port, "");
  ASSERT_NE(a1, nullptr);
  EXPECT_EQ(Refused(1, 2, port, ""), "rendezvous: the rank 0 at 127.0.0.1:" + std::to_string(port) + " (" + Who() +
                                         "; WORLD_SIZE 2, no run id) already has a rank 1 connected (" + Who() +
                                         "): another job launched alike (WORLD_SIZE 2, no run id) uses MASTER_PORT " +
                                         std::to_string(port) +
                                         ", or rank 1 was started twice; give each job a MASTER_PORT of its own and "
                                         "a run id (PTK_RUN_ID)");
  // Rank 0 claimed again: its port is taken, by this job's rank 0.
  EXPECT_EQ(Refused(0, 2, port, "PTK_RUN_ID=b"),
            "rank 0: MASTER_PORT " + std::to_string(port) + " on this host is held by another ptk rank 0 (" + Who() +
                "; WORLD_SIZE 2, no run id), this job being WORLD_SIZE 2, run id PTK_RUN_ID=b: give each job a "
                "MASTER_PORT of its own");
}

// Two jobs started by hand at the same moment (no run id), the same WORLD_SIZE and port, but other
// settings (AgreedSettingsText's lines): the other job's rank, coming before this job's own rank 1, is
// refused at once naming the first setting that differs with both values (before, it joined as rank 1
// and this job's own rank 1 was refused as "already connected": the two jobs mixed until their
// settings check stopped both); rank 0 warns naming it and this job's rank 1 still joins. Refused the
// same once rank 1 is connected; a rank that brings no settings (one that failed before it knew
// them: ReportEarlyFailure) is not compared; with a run id the ranks are one launch, and meet (their
// settings check stops them all, naming the flag).
TEST(RendezvousJobs, WithoutRunIdsARankOfOtherSettingsNeverJoins) {
  const std::string mine = "--num-layers\t12\n--seed\t1234\n--save\t\n";
  const std::string other_layers = "--num-layers\t24\n--seed\t1234\n--save\t\n";
  const std::string other_two = "--num-layers\t12\n--seed\t5\n--save\t/ckpt\n";
  const int port = testing::FreeTestPort();
  const std::string p = std::to_string(port);
  auto a0 = Join(0, 3, port, "", mine);
  ASSERT_NE(a0, nullptr);
  const std::string line = "rendezvous: the rank 0 at 127.0.0.1:" + p + " (" + Who() +
                           "; WORLD_SIZE 3, no run id) runs other settings than this rank 1: --num-layers differs: "
                           "rank 0 has 12, rank 1 has 24: another job started by hand (WORLD_SIZE 3, no run id) uses "
                           "MASTER_PORT " +
                           p +
                           ", or this rank was started with other flags than rank 0; every rank of a job needs the "
                           "same flags, each job a MASTER_PORT of its own (and a run id: PTK_RUN_ID)";
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(Refused(1, 3, port, "", 60s, other_layers), line);  // before this job's rank 1
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("rank 0's rendezvous refused a rank 1 (" + Who() +
                        "): --num-layers differs: rank 0 has 12, rank 1 has 24: another job started by hand on this "
                        "MASTER_PORT, or a rank of this job started with other flags; still waiting for this job's "
                        "rank 1"),
            std::string::npos)
      << warned;
  auto a1 = Join(1, 3, port, "", mine);
  ASSERT_NE(a1, nullptr);
  EXPECT_EQ(Refused(1, 3, port, "", 60s, other_layers), line);  // after it: not "already has a rank 1 connected"
  EXPECT_NE(Refused(2, 3, port, "", 60s, other_two)
                .find("this rank 2: --seed differs: rank 0 has 1234, rank 2 has 5 (and 1 other setting): "),
            std::string::npos);
  auto a2 = Join(2, 3, port, "", "");  // no settings: not compared
  ASSERT_NE(a2, nullptr);
  ASSERT_TRUE(a1->Set("1", "rank 1's address").ok());
  auto got = a0->Get("1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "rank 1's address");

  const int port2 = testing::FreeTestPort();
  auto c0 = Join(0, 2, port2, "PTK_RUN_ID=c", mine);
  auto c1 = Join(1, 2, port2, "PTK_RUN_ID=c", other_layers);  // one launch: it meets
  EXPECT_NE(c1, nullptr);
}

// A rank of this job started with other flags (no run id): refused as another job's would be, so
// rank 0 waits for its rank 2 until the timeout; its error then says what it refused meanwhile of the
// ranks that never came, with the setting that differs (it said only "rank 2 did not join ...; is that
// rank running?"); a refused rank 1 that then came with the job's settings is not named.
TEST(RendezvousJobs, ATimeoutNamesTheRanksRefusedForTheirSettings) {
  const int port = testing::FreeTestPort();
  auto a0 = RendezvousStore::Connect(0, 3, "127.0.0.1", port, 1000ms, "", 0, "--seed\t1234\n");
  ASSERT_TRUE(a0.ok()) << a0.status();
  for (int rank : {1, 2})
    EXPECT_NE(Refused(rank, 3, port, "", 60s, "--seed\t5\n").find("--seed differs: rank 0 has 1234"),
              std::string::npos);
  auto a1 = Join(1, 3, port, "", "--seed\t1234\n");
  ASSERT_NE(a1, nullptr);
  auto got = (*a0)->Get("2");
  ASSERT_TRUE(absl::IsDeadlineExceeded(got.status())) << got.status();
  EXPECT_EQ(got.status().message(),
            "rank 2 did not join within 1 s (--distributed-timeout-minutes): start all 3 ranks (WORLD_SIZE) with the "
            "same MASTER_ADDR and MASTER_PORT and the same flags; is that rank running? Refused meanwhile: a rank 2 (" +
                Who() + ") with other settings: --seed differs: rank 0 has 1234, rank 2 has 5");
}

// A listener on the port that is not ptk's: silent, answering something else, or closing each
// connection. Its thread accepts until the object ends.
class ForeignListener {
 public:
  enum Mode { kSilent, kAnswers, kCloses };
  ForeignListener(int port, Mode mode) : mode_(mode) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    ok_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd_, 16) == 0;
    thread_ = std::thread([this] { Loop(); });
  }
  ~ForeignListener() {
    stop_ = true;
    thread_.join();
    for (int c : accepted_) ::close(c);
    ::close(fd_);
  }
  bool ok() const { return ok_; }

 private:
  void Loop() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      if (mode_ == kAnswers) (void)!::write(c, "HTTP/1.1 400 Bad Request\r\n\r\n", 28);
      if (mode_ == kCloses) {
        ::close(c);
      } else {
        accepted_.push_back(c);
      }
    }
  }
  Mode mode_;
  int fd_ = -1;
  bool ok_ = false;
  std::atomic<bool> stop_{false};
  std::vector<int> accepted_;
  std::thread thread_;
};

// A stale program holding the port: this job's rank 0 says so (not "another ptk job"; a silent one
// may be a ptk rank 0 that hangs, and is said to be), and its other
// ranks stop at once instead of waiting for the timeout: one answered with something else is named
// by its first byte; one that closes every connection, after three; one silent, after 10 s at most
// (here the 4 s timeout, but as "not a ptk rank 0", not as a rank 0 that never answered).
TEST(RendezvousJobs, APortHeldByAnotherProgramIsNamedAtOnce) {
  struct Case {
    ForeignListener::Mode mode;
    std::string says;
    std::chrono::milliseconds timeout;
    std::string holder;  // rank 0's words for it
  };
  const std::string not_ptk = "a program that is not a ptk rendezvous (it did not answer ptk's question as ptk does)";
  for (const Case& c :
       {Case{ForeignListener::kAnswers, "is not a ptk rank 0 (it answered ptk's hello with byte 0x48)", 60s, not_ptk},
        Case{ForeignListener::kCloses, "closed the connection without answering ptk's hello, 3 times", 60s, not_ptk},
        Case{ForeignListener::kSilent, "did not answer ptk's hello within 4 s: not a ptk rank 0", 4s,
             "a program that did not answer ptk's question within 4 s (not a ptk rendezvous, or a ptk rank 0 that "
             "hangs)"}}) {
    const int port = testing::FreeTestPort();
    ForeignListener stale(port, c.mode);
    ASSERT_TRUE(stale.ok());
    const std::string rank0 = Refused(0, 2, port, "PTK_RUN_ID=b", c.timeout);
    EXPECT_EQ(rank0, "rank 0: MASTER_PORT " + std::to_string(port) + " on this host is held by " + c.holder +
                         ", this job being WORLD_SIZE 2, run id PTK_RUN_ID=b: give this job a free MASTER_PORT");
    const std::string rank1 = Refused(1, 2, port, "PTK_RUN_ID=b", c.timeout);
    EXPECT_EQ(rank1.rfind("rendezvous: what listens at 127.0.0.1:" + std::to_string(port) + " ", 0), 0u) << rank1;
    EXPECT_NE(rank1.find(c.says), std::string::npos) << rank1;
    EXPECT_NE(rank1.find("another program or job holds MASTER_PORT " + std::to_string(port)), std::string::npos)
        << rank1;
  }
}

// The connections waiting in the accept queue of what listens on `port` (its LISTEN line's rx_queue
// in /proc/net/tcp6 or tcp); -1 when none listens.
int AcceptQueue(int port) {
  for (const char* table : {"/proc/net/tcp6", "/proc/net/tcp"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string sl, local, remote, state, queues;
      fields >> sl >> local >> remote >> state >> queues;
      if (state != "0A" || local.size() < 5 || std::stoi(local.substr(local.size() - 4), nullptr, 16) != port) continue;
      return std::stoi(queues.substr(queues.find(':') + 1), nullptr, 16);
    }
  }
  return -1;
}

// A ptk rank 0 that does not run for longer than ptk used to wait for it (stopped here, SIGSTOP; a
// machine starved of CPU does the same to its store's thread): a rank 0 of another job that finds the
// port held, and this job's own rank 1, both connected and their questions sent (in the stopped rank 0's
// accept queue), wait for it; once it runs again (SIGCONT) the first names it as the ptk rank 0 it is and
// the second joins. Before, the first gave up after 2 s ("a program that did not answer ptk's question
// within 2 s") and the second after 10 s ("did not answer ptk's hello within 10 s: not a ptk rank 0").
TEST(RendezvousJobs, ARankZeroThatDoesNotRunForSecondsIsWaitedFor) {
  const int port = testing::FreeTestPort();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();  // before this test starts any thread
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    auto s = RendezvousStore::Connect(0, 2, "127.0.0.1", port, 60s, "PTK_RUN_ID=a");
    const char byte = s.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &byte, 1);
    for (;;) ::pause();  // until killed
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(byte, 'y');
  ASSERT_EQ(::kill(holder, SIGSTOP), 0);
  int st = 0;
  ASSERT_EQ(::waitpid(holder, &st, WUNTRACED), holder);
  ASSERT_TRUE(WIFSTOPPED(st));
  std::string rank0;
  absl::Status rank1 = absl::UnknownError("not run");
  std::thread other_job([&] { rank0 = Refused(0, 2, port, "PTK_RUN_ID=b"); });
  std::unique_ptr<RendezvousStore> joined;
  std::thread this_job([&] {
    auto s = RendezvousStore::Connect(1, 2, "127.0.0.1", port, 60s, "PTK_RUN_ID=a");
    rank1 = s.status();
    if (s.ok()) joined = *std::move(s);
  });
  while (AcceptQueue(port) < 2) std::this_thread::sleep_for(10ms);  // both connected, their questions sent
  std::this_thread::sleep_for(11s);  // past ptk's old waits: 2 s (the holder's question), 10 s (the hello)
  ASSERT_EQ(::kill(holder, SIGCONT), 0);
  other_job.join();
  this_job.join();
  EXPECT_EQ(rank0, "rank 0: MASTER_PORT " + std::to_string(port) +
                       " on this host is held by another ptk rank 0 (host " + HostName() + ", pid " +
                       std::to_string(holder) +
                       "; WORLD_SIZE 2, run id PTK_RUN_ID=a), this job being WORLD_SIZE 2, run id PTK_RUN_ID=b: give "
                       "each job a MASTER_PORT of its own");
  EXPECT_TRUE(rank1.ok()) << rank1;
  joined.reset();
  ::kill(holder, SIGKILL);
  ::waitpid(holder, &st, 0);
}

}  // namespace
}  // namespace ptk
