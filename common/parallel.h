// A plain pool of std::threads over an index range, for I/O-bound work (downloads, per-file
// extraction) where oneTBB's CPU-oriented scheduler is the wrong tool.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

namespace ptk {

// Calls fn(i) for i in [0, n) on up to `jobs` threads; items are taken in increasing order.
// `stop` (optional) is checked before each item: when it becomes true no new item starts.
inline void ParallelForEach(size_t n, int jobs, const std::function<void(size_t)>& fn,
                            const std::atomic<bool>* stop = nullptr) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    while (true) {
      if (stop && stop->load()) return;
      size_t i = next.fetch_add(1);
      if (i >= n) return;
      fn(i);
    }
  };
  int t = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(std::max(1, jobs))));
  if (t <= 1) {
    worker();
    return;
  }
  std::vector<std::thread> threads;
  for (int k = 0; k < t; ++k) threads.emplace_back(worker);
  for (auto& th : threads) th.join();
}

}  // namespace ptk
