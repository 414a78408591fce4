// Rank 0's TCP key-value store for the ranks' rendezvous, and what it knows of ranks that failed.
#include "trainer/rendezvous.h"

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
#include <set>
#include <thread>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/status.h"

namespace ptk {

using Clock = std::chrono::steady_clock;

namespace {

// ---- wire: [u8 op][u32 key][key]([u32 value][value]) ; replies [u32 value][value] or one byte.
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

constexpr char kSet = 'S', kGet = 'G', kHello = 'H', kPeers = 'P';
constexpr char kAbortQuery = 'A';  // kAbortKey's value, empty while none: a poll (the peer list is larger)
constexpr const char* kFailedPrefix = "ptk/failed/";
constexpr const char* kFinishedPrefix = "ptk/finished/";  // MarkFinished's: a rank that left when its run ended
// Set by a rank that failed before it joined (RendezvousStore::ReportEarlyFailure): "u\t" (a usage
// error) or "f\t", then the message. Every get waiting or to come is answered with it, marked by a
// length of kAbortMarker, so that no rank waits for one that will never join.
constexpr const char* kAbortKey = "ptk/abort";
constexpr uint32_t kAbortMarker = 0xFFFFFFFFu;

// One "rank\thost\tstate" line of the peer list (RendezvousServer::Peers).
struct PeerLine {
  int rank = 0;
  std::string host, state;
};
// The peer list's rank lines, in its order (its "!\t" line, kAbortKey's value, left out).
std::vector<PeerLine> PeerLines(const std::string& text) {
  std::vector<PeerLine> lines;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size()), t1 = text.find('\t', pos);
    const size_t t2 = t1 < nl ? text.find('\t', t1 + 1) : std::string::npos;
    if (text.compare(pos, 2, "!\t") != 0 && t2 < nl)
      lines.push_back({std::atoi(text.substr(pos, t1 - pos).c_str()), text.substr(t1 + 1, t2 - t1 - 1),
                       text.substr(t2 + 1, nl - t2 - 1)});
    pos = nl + 1;
  }
  return lines;
}

absl::Status AbortStatus(const std::string& value, const std::string& context = "") {
  const std::string text = context + (value.size() > 2 ? value.substr(2) : value);
  if (value.rfind("u\t", 0) == 0) return UsageError(text);
  return absl::AbortedError(text);
}

// kAbortKey's value for `failure` of this rank: one line (the store's peer list is line-based).
std::string AbortValue(const absl::Status& failure, const std::string& who) {
  std::string text = who + std::string(StatusMessage(failure));
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\t', ' ');
  return (IsUsageError(failure) ? "u\t" : "f\t") + text;
}

}  // namespace

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

// Rank 0's store: one thread, poll(2) over the listening socket and the clients. A registered
// client whose connection closes is a rank that exited.
class RendezvousServer {
 public:
  ~RendezvousServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : clients_) ::close(fd);
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }
  absl::Status Start(int port, int world_size) {
    world_size_ = world_size;
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
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len) == 0)
      port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

 public:
  // Connected ranks (for rank 0's exit after a failure: the others may still ask what happened).
  int live() const { return live_; }
  // Distinct ranks that have registered since the start.
  int ever() const { return ever_; }
  int port() const { return port_; }  // the one bound (any free one for port 0)

 private:
  void Drop(int fd, std::map<int, std::vector<std::string>>* waiting) {
    ::close(fd);
    waiting->erase(fd);
    clients_.erase(std::find(clients_.begin(), clients_.end(), fd));
    if (auto it = registered_.find(fd); it != registered_.end()) {
      left_[it->second.first] = it->second.second;
      registered_.erase(it);
      live_ = static_cast<int>(registered_.size());
    }
  }
  // Each rank's "rank\thost\tstate" line, after a "!\t" line with kAbortKey's value once a rank set it.
  std::string Peers() const {
    std::string out = abort_.empty() ? "" : "!\t" + abort_ + "\n";
    for (const auto& [fd, who] : registered_)
      out += fmt::format("{}\t{}\t{}\n", who.first, who.second,
                         kv_.count(kFailedPrefix + std::to_string(who.first)) ? "failed" : "alive");
    // A rank that reported its own failure before it left is not the cause.
    for (const auto& [rank, host] : left_)
      out += fmt::format("{}\t{}\t{}\n", rank, host,
                         kv_.count(kFailedPrefix + std::to_string(rank))     ? "failed"
                         : kv_.count(kFinishedPrefix + std::to_string(rank)) ? "finished"
                                                                             : "left");
    return out;
  }
  void Loop() {
    std::map<int, std::vector<std::string>> waiting;  // fd -> keys it waits for (one get at a time)
    while (!stop_) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      for (int fd : clients_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        int c = ::accept(listen_fd_, nullptr, nullptr);
        if (c >= 0) {
          // A reply is two writes (its length, then its bytes): with Nagle's algorithm the second
          // waited for the client's delayed ACK, 40 ms per answer.
          int one = 1;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          clients_.push_back(c);
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        int fd = fds[i].fd;
        uint8_t op = 0;
        std::string key, value;
        bool ok = RecvAll(fd, &op, 1) && RecvBlob(fd, &key);
        if (ok && op == kSet) {
          ok = RecvBlob(fd, &value);
          if (ok) {
            if (key == kAbortKey && abort_.empty()) abort_ = value;  // the first rank's reason
            if (key != kAbortKey) kv_[key] = value;
            ok = SendAll(fd, "k", 1);
          }
        } else if (ok && op == kGet) {
          waiting[fd].push_back(key);
        } else if (ok && op == kHello) {
          ok = RecvBlob(fd, &value);  // "host\tWORLD_SIZE"
          const int r = std::atoi(key.c_str());
          const size_t tab = value.find('\t');
          const int world = tab == std::string::npos ? -1 : std::atoi(value.c_str() + tab + 1);
          value = value.substr(0, tab);
          if (ok && world != world_size_) {
            ok = SendAll(fd, "w", 1);  // another job's rank (two jobs on one MASTER_PORT): it stops
          } else if (ok && ever_ranks_.count(r)) {
            // This rank joined this store before: its new incarnation (a pod restarted in place
            // while this rank 0 still runs the old job) must not meet the old run's addresses.
            // Refused, it retries until a fresh rank 0 serves.
            ok = SendAll(fd, "r", 1);
          } else if (ok) {
            registered_[fd] = {r, value};
            live_ = static_cast<int>(registered_.size());
            ever_ranks_.insert(registered_[fd].first);
            ever_ = static_cast<int>(ever_ranks_.size());
            ok = SendAll(fd, "k", 1);
          }
        } else if (ok && op == kPeers) {
          ok = SendBlob(fd, Peers());
        } else if (ok && op == kAbortQuery) {
          ok = SendBlob(fd, abort_);
        } else {
          ok = false;
        }
        if (!ok) Drop(fd, &waiting);
      }
      for (auto it = waiting.begin(); it != waiting.end();) {  // answer gets whose key has arrived
        auto& keys = it->second;
        while (!keys.empty() && !abort_.empty()) {  // a rank failed before it joined: nobody waits
          SendAll(it->first, &kAbortMarker, 4);
          SendBlob(it->first, abort_);
          keys.erase(keys.begin());
        }
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
  std::map<int, std::pair<int, std::string>> registered_;  // fd -> (rank, host)
  std::map<int, std::string> left_;                        // rank -> host
  std::set<int> ever_ranks_;                               // every rank that registered
  std::string abort_;                                      // kAbortKey's value, once set
  std::atomic<bool> stop_{false};
  std::atomic<int> live_{0}, ever_{0};
  int port_ = 0, world_size_ = 0;
  std::thread thread_;
};

RendezvousStore::~RendezvousStore() {
  if (fd_ >= 0) ::close(fd_);
  // Rank 0 after a failed collective: the other ranks may still ask its store what happened (which
  // rank exited); it serves them until they are gone, for a few seconds at most.
  if (server_ && diagnosed_) {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (server_->live() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  server_.reset();
}

absl::StatusOr<std::unique_ptr<RendezvousStore>> RendezvousStore::Connect(int rank, int world_size,
                                                                          const std::string& master_addr, int port,
                                                                          std::chrono::milliseconds timeout) {
  std::unique_ptr<RendezvousStore> s(new RendezvousStore());
  s->rank_ = rank;
  s->world_size_ = world_size;
  s->timeout_ = timeout;
  s->host_ = HostName();
  if (rank == 0) {
    s->server_ = std::make_unique<RendezvousServer>();
    PTK_RETURN_IF_ERROR(s->server_->Start(port, world_size));
    port = s->server_->port();  // port 0 (one rank alone): the free one it got
  }
  const std::string host = rank == 0 ? "127.0.0.1" : master_addr;
  const auto deadline = Clock::now() + timeout;
  std::string last = "no attempt";
  const std::string hello_value = s->host_ + "\t" + std::to_string(world_size);
  // Ranks start together and rank 0 listens moments later: the first retries come soon, the later
  // ones every 200 ms.
  std::chrono::milliseconds retry(5);
  while (s->fd_ < 0 && Clock::now() < deadline) {
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
        s->fd_ = fd;
        break;
      }
      last = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (s->fd_ >= 0) {
      char ack = 0;
      const absl::Status hello = s->Request(kHello, std::to_string(rank), &hello_value, nullptr, &ack);
      if (hello.ok() && ack == 'w')
        return absl::FailedPreconditionError(fmt::format(
            "rendezvous: the rank 0 at {}:{} runs a job of another WORLD_SIZE than this rank's {}: another job "
            "uses MASTER_PORT {}; give each job a MASTER_PORT of its own",
            host, port, world_size, port));
      if (!hello.ok() || ack != 'k') {  // 'r': that rank 0 still runs an earlier start of the job
        last = hello.ok() ? fmt::format(
                                "it still runs an earlier start of this job, which rank {} already joined, "
                                "or another job uses this MASTER_PORT",
                                rank)
                          : StatusMessage(hello);
        ::close(s->fd_);
        s->fd_ = -1;
      }
    }
    if (s->fd_ < 0) {
      std::this_thread::sleep_for(retry);
      retry = std::min(retry * 2, std::chrono::milliseconds(200));
    }
  }
  if (s->fd_ < 0)
    return absl::DeadlineExceededError(
        fmt::format("rendezvous: rank 0 at {}:{} did not answer within {} s ({}); is rank 0 running, "
                    "MASTER_ADDR/MASTER_PORT right?",
                    host, port, timeout.count() / 1000, last));
  return s;
}

absl::Status RendezvousStore::Request(char op, const std::string& key, const std::string* value, std::string* reply,
                                      char* ack_out) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint8_t o = static_cast<uint8_t>(op);
  errno = 0;
  bool ok = SendAll(fd_, &o, 1) && SendBlob(fd_, key) && (!value || SendBlob(fd_, *value));
  uint32_t n = 0;
  if (ok && reply && (ok = RecvAll(fd_, &n, 4)) && n == kAbortMarker) {
    std::string abort;
    if (RecvBlob(fd_, &abort)) {
      std::lock_guard<std::mutex> heard_lock(heard_mu_);
      if (heard_.empty()) heard_ = abort;
      return AbortStatus(abort);
    }
    ok = false;
  } else if (ok && reply) {
    ok = n <= (64u << 20);
    if (ok) {
      reply->resize(n);
      ok = RecvAll(fd_, reply->data(), n);
    }
  } else if (ok) {
    char ack = 0;
    ok = RecvAll(fd_, &ack, 1);
    if (ack_out) *ack_out = ack;
  }
  if (ok) return absl::OkStatus();
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return absl::DeadlineExceededError(fmt::format("no answer within {} s", timeout_.count() / 1000.0));
  return absl::UnavailableError("lost the connection to rank 0 (which serves the rendezvous): did rank 0 exit?");
}

absl::Status RendezvousStore::Set(const std::string& key, const std::string& value) {
  return Request(kSet, key, &value, nullptr);
}

absl::StatusOr<std::string> RendezvousStore::Get(const std::string& key) {
  std::string v;
  absl::Status st = Request(kGet, key, nullptr, &v);
  if (st.ok()) return v;
  if (absl::IsAborted(st) || IsUsageError(st)) return st;  // a rank failed before it joined: its reason
  // gloo's full-mesh rendezvous waits for each rank's address under the rank's number.
  const bool is_rank = !key.empty() && key.find_first_not_of("0123456789") == std::string::npos;
  std::string what = is_rank ? "rank " + key : "key '" + key + "'";
  // Every rank that never came, not only the first one waited for.
  const std::vector<int> missing = absl::IsDeadlineExceeded(st) ? NeverJoined() : std::vector<int>{};
  if (!missing.empty()) {
    what = missing.size() == 1 ? "rank" : "ranks";
    for (size_t i = 0; i < missing.size(); ++i) what += fmt::format("{} {}", i ? "," : "", missing[i]);
    return absl::DeadlineExceededError(fmt::format(
        "{} did not join within {} s (--distributed-timeout-minutes): start all {} ranks (WORLD_SIZE) with the same "
        "MASTER_ADDR and MASTER_PORT; {} running?",
        what, timeout_.count() / 1000.0, world_size_, missing.size() == 1 ? "is that rank" : "are they"));
  }
  if (absl::IsDeadlineExceeded(st))
    return absl::DeadlineExceededError(fmt::format(
        "{} did not join within {} s (--distributed-timeout-minutes): start all {} ranks (WORLD_SIZE) with the "
        "same MASTER_ADDR and MASTER_PORT{}",
        what, timeout_.count() / 1000.0, world_size_, is_rank ? "; is that rank running?" : ""));
  return absl::UnavailableError(fmt::format(
      "lost the connection to rank 0 (which serves the rendezvous) while waiting for {}: did rank 0 exit?", what));
}

void RendezvousStore::MarkFinished() {
  if (world_size_ <= 1) return;
  // Rank 0 answers at once unless it hangs itself (or has ended): a few seconds, not the timeout.
  const auto wait = std::min<std::chrono::milliseconds>(std::chrono::seconds(5), timeout_);
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>(wait.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)Set(kFinishedPrefix + std::to_string(rank_), "1");
}

std::string RendezvousStore::PollExitedRank() {
  std::string text;
  if (!Request(kPeers, "", nullptr, &text).ok()) return "";
  for (const PeerLine& p : PeerLines(text))
    if (p.state == "left")
      return fmt::format(
          "rank {} (host {}) exited (its connection to the rendezvous closed: killed, crashed or "
          "stopped early)",
          p.rank, p.host);
  return "";
}

std::vector<int> RendezvousStore::NeverJoined() {
  std::string text;
  if (!Request(kPeers, "", nullptr, &text).ok()) return {};
  std::set<int> came;
  for (const PeerLine& p : PeerLines(text)) came.insert(p.rank);
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r)
    if (!came.count(r)) missing.push_back(r);
  return missing.size() < static_cast<size_t>(world_size_) ? missing : std::vector<int>{};  // none came: no answer
}

void RendezvousStore::ReportEarlyFailure(int rank, int world_size, const std::string& master_addr, int port,
                                         std::chrono::milliseconds timeout, const absl::Status& failure) {
  if (world_size <= 1 || failure.ok()) return;
  // The ranks start together and check their flags in moments: a minute is plenty for rank 0 to
  // come up (or, on rank 0, for the others to come and hear why), and bounds this rank's exit.
  const auto wait = std::min<std::chrono::milliseconds>(timeout, std::chrono::minutes(1));
  auto store = Connect(rank, world_size, master_addr, port, wait);
  if (!store.ok()) return;  // no rank 0 to tell: the others time out as before
  const std::string value =
      AbortValue(failure, fmt::format("rank {} (host {}) stopped before the ranks met: ", rank, (*store)->host()));
  if (!(*store)->Set(kAbortKey, value).ok()) return;
  (*store)->ServeUntilAllHeard(wait);
}

bool RendezvousStore::ReportFailure(const absl::Status& failure) {
  if (world_size_ <= 1 || failure.ok() || diagnosed_) return false;  // diagnosed: a peer's failure, reported
  {
    std::lock_guard<std::mutex> lock(heard_mu_);
    if (!heard_.empty()) return false;  // a peer's failure reached this rank: it is the cause
  }
  // Rank 0 answers at once unless it hangs itself: a few seconds, not the timeout.
  const auto wait = std::min<std::chrono::milliseconds>(std::chrono::seconds(5), timeout_);
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>(wait.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return Set(kAbortKey, AbortValue(failure, fmt::format("rank {} (host {}) stopped: ", rank_, host_))).ok();
}

absl::Status RendezvousStore::HeardFailure(const std::string& context) {
  std::lock_guard<std::mutex> lock(heard_mu_);
  return heard_.empty() ? absl::OkStatus() : AbortStatus(heard_, context);
}

bool RendezvousStore::PollReportedFailure() {
  {
    std::lock_guard<std::mutex> lock(heard_mu_);
    if (!heard_.empty()) return true;
  }
  std::string abort;
  if (!Request(kAbortQuery, "", nullptr, &abort).ok() || abort.empty()) return false;
  std::lock_guard<std::mutex> lock(heard_mu_);
  if (heard_.empty()) heard_ = abort;
  return true;
}

void RendezvousStore::ServeUntilAllHeard(std::chrono::milliseconds at_most) {
  if (!server_) return;
  const auto start = Clock::now(), deadline = start + at_most;
  bool said = false;
  while (Clock::now() < deadline && (server_->ever() < world_size_ || server_->live() > 1)) {
    if (!said && Clock::now() - start > std::chrono::seconds(5)) {
      said = true;  // a rank that never comes, or never asks: say why rank 0 does not end yet
      const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - Clock::now()).count();
      if (server_->ever() < world_size_)
        log::Info("rank 0: {} of {} ranks came to hear why this run stops; waiting up to {} s for the others",
                  server_->ever(), world_size_, left);
      else
        log::Info(
            "rank 0: {} other rank(s) still connected to the rendezvous, which tells them why this run "
            "stops; waiting up to {} s for them to end",
            server_->live() - 1, left);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string RendezvousStore::DiagnosePeers(const std::string& what_failed) {
  diagnosed_ = true;
  // Rank 0 answers at once unless it hangs itself: a few seconds, not another timeout.
  const auto wait = std::min<std::chrono::milliseconds>(std::chrono::seconds(5), timeout_);
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>(wait.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  // Rank 0's connection closed: it exited (killed, crashed); still open but silent: it hangs.
  auto rank0 = [](const absl::Status& st) {
    return absl::IsUnavailable(st) ? std::string(
                                         "rank 0 (which serves the rendezvous) exited (its connection closed: "
                                         "killed, crashed or stopped early)")
                                   : std::string(
                                         "rank 0 (which serves the rendezvous) does not answer: it exited or "
                                         "hangs");
  };
  if (const absl::Status told = Set(kFailedPrefix + std::to_string(rank_), what_failed); !told.ok())
    return rank_ == 0 ? "" : rank0(told);
  // The others' failures arrive within moments of this one's when a rank died; give them a few
  // seconds (a rank that hangs never reports).
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(std::chrono::seconds(5), timeout_);
  std::map<int, std::pair<std::string, std::string>> peers;  // rank -> (host, state)
  for (;;) {
    std::string text;
    if (const absl::Status asked = Request(kPeers, "", nullptr, &text); !asked.ok()) return rank0(asked);
    peers.clear();
    if (text.rfind("!\t", 0) == 0) {  // a rank reported its own failure (ReportFailure): the answer
      const size_t nl = text.find('\n');
      std::lock_guard<std::mutex> lock(heard_mu_);
      if (heard_.empty()) heard_ = text.substr(2, nl == std::string::npos ? std::string::npos : nl - 2);
      const std::string& v = heard_;
      return v.size() > 2 ? v.substr(2) : v;
    }
    for (const PeerLine& p : PeerLines(text)) peers[p.rank] = {p.host, p.state};
    // A rank that left is the answer; otherwise wait until every other rank reported a failure.
    bool settled = true;
    for (int r = 0; r < world_size_; ++r) {
      auto it = peers.find(r);
      if (r == rank_) continue;
      if (it == peers.end() || it->second.second == "left") {
        settled = true;
        break;
      }
      if (it->second.second == "alive") settled = false;
    }
    if (settled || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::vector<std::string> left, silent;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    auto it = peers.find(r);
    if (it == peers.end()) {
      left.push_back(fmt::format("rank {}", r));
    } else if (it->second.second == "left") {
      left.push_back(fmt::format("rank {} (host {})", r, it->second.first));
    } else if (it->second.second == "alive") {
      silent.push_back(fmt::format("rank {} (host {})", r, it->second.first));
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
    return out;
  };
  if (!left.empty())
    return fmt::format("{} exited (its connection to the rendezvous closed: killed, crashed or stopped early)",
                       join(left));
  if (!silent.empty())
    return fmt::format("{} did not report a failure: it hangs (or is cut off from the others)", join(silent));
  return "every rank reports a failure: the network between them failed";
}

}  // namespace ptk
