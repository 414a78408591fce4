// What a process's first touch of fresh memory costs on this machine: MIB MiB of new ZeroPages (the
// allocation ptk's tables and buffers use: anonymous, 2 MiB aligned, transparent huge pages advised)
// written one byte a 4 KB page, by THREADS threads at once, ROUNDS times (each round new memory,
// freed after), PAUSE_MS apart. On a physical machine every round costs about the same (the kernel
// zeroing MIB MiB); on a VM whose host takes back memory the guest has freed, some rounds cost tens
// of times more (the host faulting its own pages in again), and a process that touches more fresh
// memory, or touches it from more threads, draws more of them. No anchor: a property of the machine
// that explains the spread of ptk-tokenize's timings (docs/tokenizer.md).
// Usage: fresh_memory_probe [MIB=16] [THREADS=1] [ROUNDS=40] [PAUSE_MS=200]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "common/zero_pages.h"

namespace {
// Milliseconds to map and write `bytes` of fresh memory, or a negative value where the system
// refuses that much address space.
double TouchMs(size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  ptk::ZeroPages mem = ptk::ZeroPages::Try(bytes);
  if (mem.bytes() == 0) return -1;
  volatile char* p = mem.as<char>();
  for (size_t i = 0; i < bytes; i += 4096) p[i] = 1;
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 16;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 1;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 40;
  const int pause_ms = argc > 4 ? std::atoi(argv[4]) : 200;
  if (mib == 0 || threads < 1 || rounds < 1 || pause_ms < 0) {
    std::fprintf(stderr, "usage: fresh_memory_probe [MIB>0] [THREADS>0] [ROUNDS>0] [PAUSE_MS>=0]\n");
    return 2;
  }
  // All threads' memory at once must fit in half the machine's: the probe measures, it must not
  // make the system swap or kill it.
  const size_t phys_mib =
      static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) >> 20;
  if (mib > phys_mib / 2 / static_cast<size_t>(threads)) {
    std::fprintf(stderr, "fresh_memory_probe: MIB x THREADS must stay under half this machine's %zu MiB\n", phys_mib);
    return 2;
  }
  std::vector<double> ms;  // per round: the slowest thread's time
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> t(static_cast<size_t>(threads));
    std::vector<std::thread> ts;
    for (int i = 0; i < threads; ++i) ts.emplace_back([&, i] { t[static_cast<size_t>(i)] = TouchMs(mib << 20); });
    for (auto& th : ts) th.join();
    if (*std::min_element(t.begin(), t.end()) < 0) {
      std::fprintf(stderr, "fresh_memory_probe: the system refused %zu MiB of address space\n", mib);
      return 1;
    }
    ms.push_back(*std::max_element(t.begin(), t.end()));
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
  }
  std::sort(ms.begin(), ms.end());
  const auto at = [&](double q) {
    return ms[std::min(ms.size() - 1, static_cast<size_t>(q * static_cast<double>(ms.size())))];
  };
  std::printf(
      "%zu MiB of fresh memory, %d thread(s) at once, %d rounds (ms, slowest thread): min %.2f median %.2f "
      "p90 %.2f max %.2f\n",
      mib, threads, rounds, ms.front(), at(0.5), at(0.9), ms.back());
  std::printf(
      "{\"mib\": %zu, \"threads\": %d, \"rounds\": %d, \"min_ms\": %.3f, \"median_ms\": %.3f, \"p90_ms\": %.3f, "
      "\"max_ms\": %.3f}\n",
      mib, threads, rounds, ms.front(), at(0.5), at(0.9), ms.back());
  return 0;
}
