// A gloo rank killed in the middle of a message to or from it: the peer's collective fails at once
// with the connection's error, not at the collective timeout (trainer/gloo_peer_watch.h). Rank 1 is
// a child process, so that it can be stopped and killed at the exact moment that was racy.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/test_ports.h"
#include "trainer/comm_gloo.h"
#include "trainer/rendezvous.h"

namespace ptk {
namespace {

// Far more than a loopback socket's buffers hold: a send of it to a rank that does not read stays
// half written.
constexpr int64_t kBig = int64_t{32} << 20;

GlooOptions Rank(int rank, int port) {
  GlooOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.timeout = std::chrono::seconds(30);
  return o;
}

// Rank 1: posts a receive of kBig bytes from rank 0 (channel 0), then sends one byte (channel 1)
// that tells rank 0 the receive is posted, and waits (until killed).
[[noreturn]] void RunRankOne(int port) {
  auto comm = MakeGlooCommunicator(Rank(1, port));
  if (!comm.ok()) ::_exit(3);
  std::vector<char> big(static_cast<size_t>(kBig));
  char ready = 1;
  const Communicator::P2pMessage m[] = {{.recv = big.data(), .bytes = kBig, .peer = 0, .channel = 0},
                                        {.send = &ready, .bytes = 1, .peer = 0, .channel = 1}};
  (void)(*comm)->BatchSendRecv(m);
  ::_exit(0);
}

// gloo writes what fits of a send to a rank whose receive is posted and keeps the rest in the
// pair's transmit queue, which its failure handling does not look at. Rank 1 stopped (it reads
// nothing), rank 0's send of kBig bytes stays there; rank 1 killed as rank 0 starts to wait, rank
// 0's send fails with the connection's error at once. Before the peer watch it waited out the
// whole 30 s collective timeout (ptk-train's ranks so waited out --distributed-timeout-minutes,
// dp_train_cli_test's KILL case in 2 runs of 8).
TEST(GlooPeerWatch, ARankKilledDuringASendToItFailsTheSendAtOnce) {
  ::signal(SIGPIPE, SIG_IGN);  // as ptk-train: a write to the dead rank fails with EPIPE instead
  const int port = testing::FreeTestPort();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) RunRankOne(port);
  auto comm = MakeGlooCommunicator(Rank(0, port));
  ASSERT_TRUE(comm.ok()) << comm.status();
  char ready = 0;
  const Communicator::P2pMessage hear[] = {{.recv = &ready, .bytes = 1, .peer = 1, .channel = 1}};
  ASSERT_TRUE((*comm)->BatchSendRecv(hear).ok());
  ASSERT_EQ(::kill(child, SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));

  bool killed = false;
  SetGlooWaitHookForTesting([&] {
    if (killed) return;
    killed = true;
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);  // reaped: its sockets are closed
  });
  std::vector<char> big(static_cast<size_t>(kBig), 7);
  const Communicator::P2pMessage send[] = {{.send = big.data(), .bytes = kBig, .peer = 1, .channel = 0}};
  const absl::Status st = (*comm)->BatchSendRecv(send);
  SetGlooWaitHookForTesting(nullptr);
  ASSERT_TRUE(killed);
  ASSERT_FALSE(st.ok());
  const std::string msg(st.message());
  EXPECT_NE(msg.find("send to rank 1 failed (a rank died or the network failed)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("Timed out"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1 (host " + HostName() + ") exited"), std::string::npos) << msg;
}

// Rank 1 of the receive case: waits for rank 0's one byte (channel 1: rank 0's receive of kBig
// bytes is posted), sends kBig bytes (channel 0) and stops itself as soon as the send is posted:
// part of it written, the rest never.
[[noreturn]] void RunSendingRankOne(int port) {
  auto comm = MakeGlooCommunicator(Rank(1, port));
  if (!comm.ok()) ::_exit(3);
  char ready = 0;
  const Communicator::P2pMessage hear[] = {{.recv = &ready, .bytes = 1, .peer = 0, .channel = 1}};
  if (!(*comm)->BatchSendRecv(hear).ok()) ::_exit(4);
  SetGlooWaitHookForTesting([] { ::raise(SIGSTOP); });
  std::vector<char> big(static_cast<size_t>(kBig), 7);
  const Communicator::P2pMessage send[] = {{.send = big.data(), .bytes = kBig, .peer = 0, .channel = 0}};
  (void)(*comm)->BatchSendRecv(send);
  ::_exit(0);
}

// The receive's twin: gloo reads a message into the receiver's buffer as it comes and, while it
// does, keeps that receive where its failure handling does not look either (Pair::rx_). Rank 1
// stopped half-way through its send to rank 0, then killed: rank 0's receive fails at once. Rank 1
// stops itself within moments of posting its kBig bytes, long before they could all be written;
// should they be, the attempt proves nothing and is made again.
TEST(GlooPeerWatch, ARankKilledDuringItsSendFailsTheReceiveAtOnce) {
  ::signal(SIGPIPE, SIG_IGN);
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = testing::FreeTestPort();
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) RunSendingRankOne(port);
    auto comm = MakeGlooCommunicator(Rank(0, port));
    ASSERT_TRUE(comm.ok()) << comm.status();
    int status = 0;
    SetGlooWaitHookForTesting([&] {
      ::waitpid(child, &status, WUNTRACED);  // stopped in the middle of its send
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
    });
    std::vector<char> big(static_cast<size_t>(kBig), 0);
    char ready = 1;
    const Communicator::P2pMessage m[] = {{.recv = big.data(), .bytes = kBig, .peer = 1, .channel = 0},
                                          {.send = &ready, .bytes = 1, .peer = 1, .channel = 1}};
    const absl::Status st = (*comm)->BatchSendRecv(m);
    SetGlooWaitHookForTesting(nullptr);
    if (st.ok()) continue;  // every byte came before rank 1 stopped: not the case to check
    const std::string msg(st.message());
    EXPECT_NE(msg.find("receive from rank 1 / send to rank 1 failed (a rank died or the network failed)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("Timed out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1 (host " + HostName() + ") exited"), std::string::npos) << msg;
    return;
  }
  FAIL() << "rank 1's send completed before it stopped, 5 times of 5";
}

}  // namespace
}  // namespace ptk
