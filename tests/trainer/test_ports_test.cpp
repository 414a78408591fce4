// The tests' rendezvous ports (test_ports.h): two test processes running side by side never hold the same
// port, whatever the order of their picks, and every port lies below the range of ptk-train's Slurm default.
#include "tests/trainer/test_ports.h"

#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace ptk {
namespace {

constexpr int kPicks = 500;

// Another test process (a child) picks kPicks ports, hands them over through a pipe and keeps them until
// told to end; this one then picks as many. Before the reservation, each pick was a random port checked
// free by a bind and let go at once: two processes picking 500 each shared about 11 of them (a pair of
// tests run by ctest -j whose ranks meet on one MASTER_PORT, or whose second rank 0 cannot bind it).
TEST(FreeTestPort, TwoProcessesNeverHoldTheSamePort) {
  int ports[2], done[2];
  ASSERT_EQ(::pipe(ports), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ports[0]);
    ::close(done[1]);
    for (int i = 0; i < kPicks; ++i) {
      const int port = testing::FreeTestPort();
      if (::write(ports[1], &port, sizeof port) != sizeof port) ::_exit(1);
    }
    ::close(ports[1]);
    char c;
    (void)::read(done[0], &c, 1);  // holds its ports until the parent has picked
    ::_exit(0);
  }
  ::close(ports[1]);
  ::close(done[0]);
  std::set<int> theirs;
  for (int port; ::read(ports[0], &port, sizeof port) == sizeof port;) theirs.insert(port);
  ::close(ports[0]);
  ASSERT_EQ(theirs.size(), static_cast<size_t>(kPicks)) << "the other process's picks repeat";
  std::vector<int> shared;
  std::set<int> mine;
  for (int i = 0; i < kPicks; ++i) {
    const int port = testing::FreeTestPort();
    EXPECT_GE(port, testing::kTestPortLo);
    EXPECT_LT(port, 20000) << "in the range of ptk-train's Slurm default MASTER_PORT";
    if (theirs.count(port)) shared.push_back(port);
    mine.insert(port);
  }
  ::close(done[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(mine.size(), static_cast<size_t>(kPicks)) << "a process got one port twice";
  EXPECT_TRUE(shared.empty()) << shared.size() << " ports held by both processes, the first " << shared[0];
}

}  // namespace
}  // namespace ptk
