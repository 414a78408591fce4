// Ports for the tests' rendezvous (MASTER_PORT), reserved on this machine for the life of the test process
// that picks them: no other test process (ctest -j beside it, the sanitizer stage's parallel runs) can pick one
// while it lives, however the two picks interleave. Each is
// - below 20000: under the range that ptk-train's Slurm default takes (20000 + job id x 7 mod 12000, which the
//   slurm tests' emulated jobs use) and under the kernel's ephemeral range, so that no outgoing connection (gloo's
//   pairs, another test's clients) can be holding it;
// - reserved by a POSIX record lock on its byte of /tmp/ptk-test-ports.lock, which the kernel lets go when the
//   process ends, however it ends (a random pick that was only checked free could be picked by a test starting
//   beside it before its rank 0 bound it: "Address already in use", or ranks of two tests meeting);
// - free when picked (a port that another program holds, or one in TIME_WAIT, is passed over).
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace ptk::testing {

inline constexpr int kTestPortLo = 10000, kTestPortHi = 20000;  // [lo, hi)

// Locks byte `port` of the machine-wide reservation file for this process; false when another process
// holds it. The file stays open for the life of the process (closing any descriptor of it would let go
// of every lock this process holds on it).
inline bool ReserveTestPort(int port) {
  static const int fd = ::open("/tmp/ptk-test-ports.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return true;  // no reservation possible: the bind check alone
  struct flock l {};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = port;
  l.l_len = 1;
  return ::fcntl(fd, F_SETLK, &l) == 0;
}

inline bool PortIsFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return true;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return free;
}

// A port that no other test process holds, spread by process, never the same twice in a process.
inline int FreeTestPort() {
  static std::mutex mu;
  static std::vector<bool> given(kTestPortHi - kTestPortLo);
  std::lock_guard<std::mutex> lock(mu);
  const size_t span = given.size(), start = static_cast<unsigned>(::getpid()) * 2654435761u % span;
  for (size_t i = 0; i < span; ++i) {
    const size_t at = (start + i * 7919) % span;  // 7919 is prime to the span: every port once
    if (given[at]) continue;
    const int port = kTestPortLo + static_cast<int>(at);
    if (ReserveTestPort(port) && PortIsFree(port)) {
      given[at] = true;
      return port;
    }
  }
  return kTestPortLo;
}

}  // namespace ptk::testing
