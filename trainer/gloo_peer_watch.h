// Wakes a gloo wait whose peer is gone. Debian's gloo (0.0~git20220518) forgets two waits when a
// pair's connection fails: the pair fails the operations still queued on it, but not a send whose
// bytes are being written (tcp::Pair::tx_) nor a receive whose bytes are being read
// (tcp::Pair::rx_); their waits sleep until the collective timeout (--distributed-timeout-minutes),
// so a rank killed while a peer sent it a large message held that peer for the whole timeout.
// A PeerWatch keeps a one-byte receive that nobody answers posted to every peer of a context: a
// pair's failure fails it, which wakes the watch's thread; the thread finds the pairs that failed
// (posting to a failed pair throws its error) and aborts the waits of the buffers that use them.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

namespace ptk::gloo_detail {

class PeerWatch {
 public:
  // Watches the pairs of `context` (connected); `slot` is its own: no other message may use it.
  PeerWatch(std::shared_ptr<gloo::Context> context, uint64_t slot);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // One send to or receive from `peer` over [data, data + bytes): Post, then Wait.
  class Buffer {
   public:
    Buffer(PeerWatch* watch, int peer, void* data, size_t bytes, bool send);
    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    // Throws gloo's error (the pair already failed).
    void Post(uint64_t slot);
    // Until the operation completes. Throws gloo's error (the timeout, a failure gloo reports
    // itself), or the pair's error once the watch found that the pair failed before the operation
    // completed; an operation that completed first returns.
    void Wait(std::chrono::milliseconds timeout);

   private:
    friend class PeerWatch;
    void Abort();
    PeerWatch* watch_;
    int peer_;
    bool send_;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  };

 private:
  void Run();
  // Posts a new sentinel's receive to every pair not known to have failed; aborts the waits on
  // those that throw. Returns the sentinel, or null once the watch stops.
  gloo::transport::UnboundBuffer* Arm();
  std::string Error(int peer);

  std::shared_ptr<gloo::Context> context_;
  const uint64_t slot_;
  char byte_ = 0;
  std::mutex mu_;
  bool stop_ = false;                                // under mu_
  gloo::transport::UnboundBuffer* armed_ = nullptr;  // under mu_: the sentinel the thread waits on
  std::vector<std::string> failed_;                  // under mu_: per rank, its pair's error once it failed
  std::multimap<int, Buffer*> waiting_;              // under mu_: peer -> its buffers in use
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sentinels_;  // their receives stay posted
  std::thread thread_;
};

}  // namespace ptk::gloo_detail
