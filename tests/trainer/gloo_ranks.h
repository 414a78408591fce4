// Test helper: `world` gloo ranks as threads of this process, meeting on loopback; each runs `body`
// with its communicator. A rank whose communicator fails to start fails the test.
#pragma once

#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/comm_gloo.h"

namespace ptk::testing {

// A port per call and process (tests of one binary run one after another).
inline int NextPort() {
  static std::atomic<int> n{0};
  return 21000 + static_cast<int>(::getpid() % 15000) + 37 * n.fetch_add(1) % 4000;
}

inline void RunRanks(int world, const std::function<void(Communicator*, int)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
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
