// Ports for the tests' rendezvous (MASTER_PORT): below the kernel's ephemeral range, so that no
// outgoing connection (gloo's pairs, another test's clients, running side by side under ctest -j)
// can be holding one; spread by process and call; and free when picked. A port inside the
// ephemeral range could be taken between the pick and rank 0's bind ("Address already in use"),
// and the other ranks would then wait for the whole distributed timeout.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>

namespace ptk::testing {

inline int FreeTestPort() {
  static std::atomic<unsigned> calls{0};
  int ephemeral_lo = 32768;
  {
    std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
    int lo = 0;
    if (range >> lo && lo > 12000) ephemeral_lo = lo;
  }
  const int base = 10000;
  const unsigned span = static_cast<unsigned>(ephemeral_lo - base);
  for (int attempt = 0; attempt < 500; ++attempt) {
    const unsigned mix = static_cast<unsigned>(::getpid()) * 2654435761u + 7919u * calls.fetch_add(1);
    const int port = base + static_cast<int>(mix % span);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return port;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) return port;
  }
  return base;
}

}  // namespace ptk::testing
