// gloo communicator and the TCP key-value store its rendezvous uses.
#include "trainer/comm_gloo.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "common/status.h"

namespace ptk::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// ---- wire helpers: [u8 op][u32 key][key]([u32 value][value]) ; replies [u32 value][value]
bool SendAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
bool RecvAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
bool SendBlob(int fd, const std::string& s) {
  uint32_t n = static_cast<uint32_t>(s.size());
  return SendAll(fd, &n, 4) && SendAll(fd, s.data(), s.size());
}
bool RecvBlob(int fd, std::string* s) {
  uint32_t n = 0;
  if (!RecvAll(fd, &n, 4) || n > (64u << 20)) return false;
  s->resize(n);
  return RecvAll(fd, s->data(), n);
}

// Rank 0's store: one thread, poll(2) over the listening socket and the clients.
class StoreServer {
 public:
  ~StoreServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : clients_) ::close(fd);
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }
  absl::Status Start(int port) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listen_fd_ < 0) return ErrnoToStatus(errno, "rendezvous socket");
    int one = 1, zero = 0;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (v6) {
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0)
      return ErrnoToStatus(errno, fmt::format("rank 0: rendezvous on MASTER_PORT {} (is another job using it?)", port));
    if (::listen(listen_fd_, 512) != 0) return ErrnoToStatus(errno, "rendezvous listen");
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

 private:
  void Loop() {
    std::map<int, std::vector<std::string>> waiting;  // fd -> keys it waits for (one get at a time)
    while (!stop_) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      for (int fd : clients_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        int c = ::accept(listen_fd_, nullptr, nullptr);
        if (c >= 0) clients_.push_back(c);
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        int fd = fds[i].fd;
        uint8_t op = 0;
        std::string key, value;
        bool ok = RecvAll(fd, &op, 1) && RecvBlob(fd, &key);
        if (ok && op == 'S') {
          ok = RecvBlob(fd, &value);
          if (ok) {
            kv_[key] = value;
            ok = SendAll(fd, "k", 1);
          }
        } else if (ok && op == 'G') {
          waiting[fd].push_back(key);
        } else {
          ok = false;
        }
        if (!ok) {
          ::close(fd);
          waiting.erase(fd);
          clients_.erase(std::find(clients_.begin(), clients_.end(), fd));
        }
      }
      for (auto it = waiting.begin(); it != waiting.end();) {  // answer gets whose key has arrived
        auto& keys = it->second;
        while (!keys.empty() && kv_.count(keys.front())) {
          SendBlob(it->first, kv_[keys.front()]);
          keys.erase(keys.begin());
        }
        it = keys.empty() ? waiting.erase(it) : std::next(it);
      }
    }
  }
  int listen_fd_ = -1;
  std::vector<int> clients_;
  std::map<std::string, std::string> kv_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// gloo's Store interface over one connection to rank 0's server. gloo catches nothing: failures
// throw gloo::IoException, turned into a Status by the communicator.
class TcpStore : public gloo::rendezvous::Store {
 public:
  ~TcpStore() override {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
    timeout_ = timeout;
    const auto deadline = Clock::now() + timeout;
    std::string last = "no attempt";
    while (Clock::now() < deadline) {
      addrinfo hints{}, *res = nullptr;
      hints.ai_socktype = SOCK_STREAM;
      int g = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
      if (g != 0) return absl::InvalidArgumentError(fmt::format("MASTER_ADDR {}: {}", host, gai_strerror(g)));
      for (addrinfo* a = res; a; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          timeval tv{static_cast<time_t>(timeout.count() / 1000),
                     static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
          ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          fd_ = fd;
          ::freeaddrinfo(res);
          return absl::OkStatus();
        }
        last = std::strerror(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return absl::DeadlineExceededError(
        fmt::format("rendezvous: rank 0 at {}:{} did not answer within {} s ({}); is rank 0 running, "
                    "MASTER_ADDR/MASTER_PORT right?",
                    host, port, timeout.count() / 1000, last));
  }
  void set(const std::string& key, const std::vector<char>& data) override {
    uint8_t op = 'S';
    char ack = 0;
    if (!SendAll(fd_, &op, 1) || !SendBlob(fd_, key) || !SendBlob(fd_, std::string(data.begin(), data.end())) ||
        !RecvAll(fd_, &ack, 1))
      throw std::runtime_error("lost the connection to rank 0 (which serves the rendezvous): did rank 0 exit?");
  }
  std::vector<char> get(const std::string& key) override {
    uint8_t op = 'G';
    std::string v;
    errno = 0;
    if (!SendAll(fd_, &op, 1) || !SendBlob(fd_, key) || !RecvBlob(fd_, &v)) {
      const int e = errno;
      // gloo's full-mesh rendezvous waits for each rank's address under the rank's number.
      const bool is_rank = !key.empty() && key.find_first_not_of("0123456789") == std::string::npos;
      const std::string what = is_rank ? "rank " + key : "key '" + key + "'";
      if (e == EAGAIN || e == EWOULDBLOCK)
        throw std::runtime_error(fmt::format(
            "{} did not join within {} s (--distributed-timeout-minutes): start all {} ranks (WORLD_SIZE) with the "
            "same MASTER_ADDR and MASTER_PORT{}",
            what, timeout_.count() / 1000.0, world_size_, is_rank ? "; is that rank running?" : ""));
      throw std::runtime_error(fmt::format(
          "lost the connection to rank 0 (which serves the rendezvous) while waiting for {}: did rank 0 exit?", what));
    }
    return {v.begin(), v.end()};
  }
  void set_world_size(int n) { world_size_ = n; }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& k : keys) get(k);  // get blocks until the key exists
  }

 private:
  int fd_ = -1;
  int world_size_ = 0;
  std::chrono::milliseconds timeout_{0};
};

class GlooCommunicator : public Communicator {
 public:
  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  std::string_view backend() const override { return "gloo"; }
  // Floats: a reduce-scatter in rank order over near-equal pieces, then an all-gather (gloo's own
  // ring would add each element in an order that depends on where it lies in the buffer).
  absl::Status AllReduceSum(float* data, int64_t n) override {
    if (n <= 0 || size() == 1) return absl::OkStatus();
    std::vector<int64_t> counts(static_cast<size_t>(size())), bytes(counts.size());
    for (int r = 0; r < size(); ++r) {
      counts[static_cast<size_t>(r)] = n / size() + (r < n % size() ? 1 : 0);
      bytes[static_cast<size_t>(r)] = counts[static_cast<size_t>(r)] * static_cast<int64_t>(sizeof(float));
    }
    PTK_RETURN_IF_ERROR(ReduceScatterSum(data, counts));
    return AllGather(data, bytes);
  }
  absl::Status AllReduceSum(double* data, int64_t n) override { return Reduce(data, n); }

  // Round k moves chunk k (kChunk floats) of every piece to its owner, which adds the copies in
  // rank order: memory beside the buffer is (ranks - 1) chunks.
  absl::Status ReduceScatterSum(float* data, std::span<const int64_t> counts) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(counts, size()));
    const int world = size(), me = rank();
    if (world == 1) return absl::OkStatus();
    int64_t rounds = 0;
    for (int64_t c : counts) rounds = std::max(rounds, (c + kChunk - 1) / kChunk);
    if (rounds == 0) return absl::OkStatus();
    const int64_t mine = counts[static_cast<size_t>(me)], cap = std::min(kChunk, mine);
    scratch_.resize(static_cast<size_t>((world - 1) * cap));
    const std::chrono::milliseconds timeout = context_->getTimeout();
    return Guard("reduce-scatter", [&] {
      auto in = context_->createUnboundBuffer(data, static_cast<size_t>(off.back()) * sizeof(float));
      std::unique_ptr<gloo::transport::UnboundBuffer> out;
      if (cap > 0) out = context_->createUnboundBuffer(scratch_.data(), scratch_.size() * sizeof(float));
      // Rank q's copy of this rank's chunk lands in scratch slot q (q < me) or q - 1.
      auto from = [&](int q) { return scratch_.data() + (q < me ? q : q - 1) * cap; };
      for (int64_t k = 0; k < rounds; ++k) {
        const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
        const int64_t at = k * kChunk, len = std::clamp<int64_t>(mine - at, 0, kChunk);
        int recvs = 0, sends = 0;
        for (int q = 0; q < world && len > 0; ++q) {
          if (q == me) continue;
          out->recv(q, slot, static_cast<size_t>(from(q) - scratch_.data()) * sizeof(float),
                    static_cast<size_t>(len) * sizeof(float));
          ++recvs;
        }
        for (int q = 0; q < world; ++q) {
          const int64_t lq = std::clamp<int64_t>(counts[static_cast<size_t>(q)] - at, 0, kChunk);
          if (q == me || lq == 0) continue;
          in->send(q, slot, static_cast<size_t>(off[static_cast<size_t>(q)] + at) * sizeof(float),
                   static_cast<size_t>(lq) * sizeof(float));
          ++sends;
        }
        for (; recvs > 0; --recvs)
          if (!out->waitRecv(timeout)) throw std::runtime_error("receive aborted");
        for (; sends > 0; --sends)
          if (!in->waitSend(timeout)) throw std::runtime_error("send aborted");
        // ((x0 + x1) + x2) + ...: accumulated in rank 0's copy (this rank's own values when it is
        // rank 0), element by element.
        float* own = data + off[static_cast<size_t>(me)] + at;
        float* acc = me == 0 ? own : from(0);
        for (int q = 1; q < world; ++q) {
          const float* x = q == me ? own : from(q);
          for (int64_t i = 0; i < len; ++i) acc[i] += x[i];
        }
        if (acc != own) std::copy(acc, acc + len, own);
      }
    });
  }

  absl::Status AllGather(void* data, std::span<const int64_t> bytes) override {
    PTK_ASSIGN_OR_RETURN(const std::vector<int64_t> off, PieceOffsets(bytes, size()));
    const int world = size(), me = rank();
    if (world == 1 || off.back() == 0) return absl::OkStatus();
    const std::chrono::milliseconds timeout = context_->getTimeout();
    return Guard("all-gather", [&] {
      auto buf = context_->createUnboundBuffer(data, static_cast<size_t>(off.back()));
      const uint64_t slot = gloo::Slot::build(kSlotPrefix, tag_++);
      int recvs = 0, sends = 0;
      for (int q = 0; q < world; ++q) {
        const size_t uq = static_cast<size_t>(q);
        if (q == me) continue;
        if (bytes[uq] > 0) {
          buf->recv(q, slot, static_cast<size_t>(off[uq]), static_cast<size_t>(bytes[uq]));
          ++recvs;
        }
        if (bytes[static_cast<size_t>(me)] > 0) {
          buf->send(q, slot, static_cast<size_t>(off[static_cast<size_t>(me)]),
                    static_cast<size_t>(bytes[static_cast<size_t>(me)]));
          ++sends;
        }
      }
      for (; recvs > 0; --recvs)
        if (!buf->waitRecv(timeout)) throw std::runtime_error("receive aborted");
      for (; sends > 0; --sends)
        if (!buf->waitSend(timeout)) throw std::runtime_error("send aborted");
    });
  }
  absl::Status Broadcast(void* data, int64_t bytes, int root) override {
    return Guard("broadcast", [&] {
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<uint8_t*>(data), static_cast<size_t>(bytes));
      o.setRoot(root);
      o.setTag(tag_++);
      gloo::broadcast(o);
    });
  }
  absl::Status Barrier() override {
    return Guard("barrier", [&] {
      gloo::BarrierOptions o(context_);
      o.setTag(tag_++);
      gloo::barrier(o);
    });
  }

  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<TcpStore> store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;

 private:
  template <typename T>
  absl::Status Reduce(T* data, int64_t n) {
    if (n == 0) return absl::OkStatus();
    return Guard("all-reduce", [&] {
      gloo::AllreduceOptions o(context_);
      o.setOutput(data, static_cast<size_t>(n));
      o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
      o.setTag(tag_++);
      gloo::allreduce(o);
    });
  }
  template <typename F>
  absl::Status Guard(const char* what, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          fmt::format("rank {}: {} failed (a rank died or the network failed): {}", context_->rank, what, e.what()));
    }
    return absl::OkStatus();
  }
  static constexpr int64_t kChunk = int64_t{1} << 18;  // floats per reduce-scatter round and rank (1 MiB)
  static constexpr uint8_t kSlotPrefix = 0x50;         // ptk's own collectives (gloo's use 0x01-0x08)
  uint32_t tag_ = 1;
  std::vector<float> scratch_;
};

bool IsLoopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(const GlooOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return absl::InvalidArgumentError(fmt::format("rank {} of {}: not a valid rank", o.rank, o.world_size));
  auto comm = std::make_unique<GlooCommunicator>();
  if (o.rank == 0) {
    comm->server_ = std::make_unique<StoreServer>();
    PTK_RETURN_IF_ERROR(comm->server_->Start(o.master_port));
  }
  comm->store_ = std::make_unique<TcpStore>();
  comm->store_->set_world_size(o.world_size);
  PTK_RETURN_IF_ERROR(comm->store_->Connect(o.rank == 0 ? "127.0.0.1" : o.master_addr, o.master_port, o.timeout));
  try {
    gloo::transport::tcp::attr attr;
    if (!o.iface.empty()) {
      attr.iface = o.iface;
    } else if (IsLoopback(o.master_addr)) {
      attr.hostname = "127.0.0.1";
    } else {
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      attr.hostname = host;
    }
    comm->device_ = gloo::transport::tcp::CreateDevice(attr);
    comm->context_ = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
    comm->context_->setTimeout(o.timeout);
    comm->context_->connectFullMesh(*comm->store_, comm->device_);
  } catch (const std::exception& e) {
    return absl::UnavailableError(fmt::format("rank {} of {}: rendezvous at {}:{} failed: {}", o.rank, o.world_size,
                                              o.master_addr, o.master_port, e.what()));
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace ptk::trainer
