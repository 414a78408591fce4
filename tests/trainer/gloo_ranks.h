// Test helper: `world` gloo ranks as threads of this process, meeting on loopback; each runs `body`
// with its communicator. A rank whose communicator fails to start fails the test.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/test_ports.h"
#include "trainer/comm_gloo.h"

namespace ptk::testing {

// A port per call, below the ephemeral range and free when picked (test_ports.h).
inline int NextPort() { return FreeTestPort(); }

inline void RunRanks(int world, const std::function<void(Communicator*, int)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  // gloo writes to the other ranks with writev: a rank that writes to the socket of a rank that has
  // gone (ARankThatLeavesIsNamed) would get SIGPIPE, which ends this whole process (comm_test died so
  // here once in about 30 runs). Ignored, as ptk-train ignores it: the write fails with EPIPE and
  // the collective reports it.
  ::signal(SIGPIPE, SIG_IGN);
  const int port = NextPort();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.world_size = world;
      o.master_addr = "127.0.0.1";
      o.master_port = port;
      o.timeout = timeout;
      auto comm = MakeGlooCommunicator(o);
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(comm->get(), r);
    });
  for (auto& t : threads) t.join();
}

}  // namespace ptk::testing
