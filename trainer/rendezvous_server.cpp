// Rank 0's TCP key-value store for the ranks' rendezvous: its wire, and whom it lets join.
#include "trainer/rendezvous_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/core.h>

#include "common/logging.h"
#include "common/slurm_env.h"
#include "common/status.h"

namespace ptk {

namespace rendezvous_detail {

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
  if (!RecvAll(fd, &n, 4) || n > kMaxBlob) return false;
  s->resize(n);
  return RecvAll(fd, s->data(), n);
}

namespace {
std::string OneField(std::string s) {
  std::replace(s.begin(), s.end(), '\t', ' ');
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}
std::vector<std::string> Fields(const std::string& line) {
  std::vector<std::string> out;
  for (size_t pos = 0;;) {
    const size_t tab = line.find('\t', pos);
    out.push_back(line.substr(pos, tab == std::string::npos ? std::string::npos : tab - pos));
    if (tab == std::string::npos) return out;
    pos = tab + 1;
  }
}
}  // namespace

std::string HelloValue(const std::string& host, int world_size, const std::string& run_id, int64_t pid,
                       const std::string& settings) {
  return fmt::format("{}\t{}\t{}\t{}{}", OneField(host), world_size, OneField(run_id), pid,
                     settings.empty() ? "" : "\n" + settings);
}

namespace {
// "flag\tvalue" lines: their flags in order, and each flag's value.
std::vector<std::pair<std::string, std::string>> SettingLines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size()), tab = text.find('\t', pos);
    if (tab < nl) out.emplace_back(text.substr(pos, tab - pos), text.substr(tab + 1, nl - tab - 1));
    pos = nl + 1;
  }
  return out;
}
std::string Has(const std::string& value) { return value.empty() ? "none" : value; }
}  // namespace

std::string SettingsDifference(const std::string& rank0, const std::string& other, int rank) {
  const auto mine = SettingLines(rank0), theirs = SettingLines(other);
  const std::map<std::string, std::string> by_flag(theirs.begin(), theirs.end());
  std::set<std::string> flags;  // rank 0's
  std::string first;
  int differing = 0;
  for (const auto& [flag, value] : mine) {
    flags.insert(flag);
    const auto it = by_flag.find(flag);
    if (it != by_flag.end() && it->second == value) continue;
    if (differing++ == 0)
      first = fmt::format("{} differs: rank 0 has {}, rank {} has {}", flag, Has(value), rank,
                          it == by_flag.end() ? "no such setting (another ptk version?)" : Has(it->second));
  }
  for (const auto& [flag, value] : theirs)
    if (!flags.count(flag) && differing++ == 0)
      first = fmt::format("{} differs: rank 0 has no such setting (another ptk version?), rank {} has {}", flag, rank,
                          Has(value));
  if (differing > 1) first += fmt::format(" (and {} other setting{})", differing - 1, differing > 2 ? "s" : "");
  return first;
}

std::vector<PeerLine> PeerLines(const std::string& text) {
  std::vector<PeerLine> lines;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size()), t1 = text.find('\t', pos);
    const size_t t2 = t1 < nl ? text.find('\t', t1 + 1) : std::string::npos;
    if (text.compare(pos, 2, "!\t") != 0 && text.compare(pos, 2, "?\t") != 0 && t2 < nl)
      lines.push_back({std::atoi(text.substr(pos, t1 - pos).c_str()), text.substr(t1 + 1, t2 - t1 - 1),
                       text.substr(t2 + 1, nl - t2 - 1)});
    pos = nl + 1;
  }
  return lines;
}

std::map<int, std::string> RefusedLines(const std::string& text) {
  std::map<int, std::string> out;
  for (size_t pos = 0; pos < text.size();) {
    const size_t nl = std::min(text.find('\n', pos), text.size()), tab = text.find('\t', pos + 2);
    if (text.compare(pos, 2, "?\t") == 0 && tab < nl)
      out[std::atoi(text.substr(pos + 2, tab - pos - 2).c_str())] = text.substr(tab + 1, nl - tab - 1);
    pos = nl + 1;
  }
  return out;
}

bool ParseServerInfo(const std::string& text, ServerInfo* info) {
  const size_t nl = text.find('\n');
  const std::vector<std::string> f = Fields(text.substr(0, nl));
  if (f.size() != 5 || f[0] != kInfoMagic) return false;
  info->world_size = std::atoi(f[1].c_str());
  info->pid = std::atoll(f[2].c_str());
  info->host = f[3];
  info->run_id = f[4];
  if (nl != std::string::npos) {
    const std::vector<std::string> r = Fields(text.substr(nl + 1));
    if (r.size() == 2) {
      info->rank_host = r[0];
      info->rank_pid = std::atoll(r[1].c_str());
    }
  }
  return true;
}

std::string JobWords(int world_size, const std::string& run_id) {
  return fmt::format("WORLD_SIZE {}, {}", world_size, run_id.empty() ? "no run id" : "run id " + run_id);
}

namespace {
// The blob at `at` of `in` (a u32 length, then its bytes): its end, 0 while incomplete, npos when too long.
size_t BlobAt(const std::string& in, size_t at, std::string* blob) {
  uint32_t n = 0;
  if (in.size() < at + 4) return 0;
  std::memcpy(&n, in.data() + at, 4);
  if (n > kMaxBlob) return std::string::npos;
  if (in.size() < at + 4 + n) return 0;
  blob->assign(in, at + 4, n);
  return at + 4 + n;
}
}  // namespace

bool TakeRequest(std::string* in, Request* request, bool* bad) {
  *bad = false;
  if (in->empty()) return false;
  const char op = (*in)[0];
  const bool valued = op == kSet || op == kHello;
  if (!valued && op != kGet && op != kPeers && op != kAbortQuery && op != kInfo && op != kSettingsQuery) {
    *bad = true;
    return false;
  }
  size_t end = BlobAt(*in, 1, &request->key);
  if (valued && end != 0 && end != std::string::npos) end = BlobAt(*in, end, &request->value);
  *bad = end == std::string::npos;
  if (end == 0 || *bad) return false;
  request->op = op;
  if (!valued) request->value.clear();
  in->erase(0, end);
  return true;
}

}  // namespace rendezvous_detail

using namespace rendezvous_detail;

RendezvousServer::~RendezvousServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  for (int fd : clients_) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

absl::Status RendezvousServer::Start(int port, int world_size, const std::string& run_id, int torchrun_store_port,
                                     const std::string& settings) {
  world_size_ = world_size;
  run_id_ = OneField(run_id);
  settings_ = settings;
  char host[256] = {};
  host_ = ::gethostname(host, sizeof host - 1) == 0 ? host : "?";
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
  if (rc != 0) {
    bind_errno_ = errno;
    return ErrnoToStatus(errno,
                         fmt::format("rank 0: rendezvous on {}", RendezvousPortWords(port, torchrun_store_port)));
  }
  if (::listen(listen_fd_, 512) != 0) return ErrnoToStatus(errno, "rendezvous listen");
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len) == 0)
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void RendezvousServer::Drop(int fd, Waiting* waiting) {
  const size_t unsent = sending_[fd].size();
  const bool unread = unsent > kMaxUnsentReplies;
  if (unread) {
    const auto it = registered_.find(fd);
    log::Warning(
        "rank 0's rendezvous store dropped {}: it sent requests and read none of their answers ({} bytes "
        "unsent; stopped or hung?)",
        it == registered_.end() ? std::string("a client that never joined")
                                : fmt::format("rank {} (host {}, pid {})", it->second.rank,
                                              log::Printable(it->second.host), it->second.pid),
        unsent);
  }
  ::close(fd);
  waiting->erase(fd);
  received_.erase(fd);
  sending_.erase(fd);
  clients_.erase(std::find(clients_.begin(), clients_.end(), fd));
  if (auto it = registered_.find(fd); it != registered_.end()) {
    left_[it->second.rank] = it->second.host;
    if (unread) dropped_.insert(it->second.rank);
    registered_.erase(it);
    SetLive();
  }
}

void RendezvousServer::SetLive() {
  std::vector<int> ranks;
  for (const auto& [fd, who] : registered_) ranks.push_back(who.rank);
  std::sort(ranks.begin(), ranks.end());
  std::lock_guard<std::mutex> lock(live_mu_);
  live_ranks_ = std::move(ranks);
  live_ = static_cast<int>(registered_.size());
}

std::vector<int> RendezvousServer::LiveRanks() const {
  std::lock_guard<std::mutex> lock(live_mu_);
  return live_ranks_;
}

std::string RendezvousServer::Peers() const {
  std::string out = abort_.empty() ? "" : "!\t" + abort_ + "\n";
  for (const auto& [fd, who] : registered_)
    out += fmt::format("{}\t{}\t{}\n", who.rank, who.host,
                       kv_.count(kFailedPrefix + std::to_string(who.rank)) ? "failed" : "alive");
  // A rank that reported its own failure before it left is not the cause.
  for (const auto& [rank, host] : left_)
    out += fmt::format("{}\t{}\t{}\n", rank, host,
                       kv_.count(kFailedPrefix + std::to_string(rank))     ? "failed"
                       : kv_.count(kFinishedPrefix + std::to_string(rank)) ? "finished"
                       : dropped_.count(rank)                              ? kDroppedState
                                                                           : "left");
  for (const auto& [rank, words] : refused_) out += fmt::format("?\t{}\t{}\n", rank, words);
  return out;
}

std::string RendezvousServer::Info(const std::string& rank) const {
  std::string out = fmt::format("{}\t{}\t{}\t{}\t{}", kInfoMagic, world_size_, ::getpid(), host_, run_id_);
  for (const auto& [fd, who] : registered_)
    if (!rank.empty() && std::to_string(who.rank) == rank) out += fmt::format("\n{}\t{}", who.host, who.pid);
  return out;
}

char RendezvousServer::Hello(int fd, const std::string& rank, const std::string& value) {
  const size_t nl = value.find('\n');
  const std::vector<std::string> f = Fields(value.substr(0, nl));  // HelloValue's
  const std::string settings = nl == std::string::npos ? "" : value.substr(nl + 1);
  const int r = std::atoi(rank.c_str());
  // Another job's rank (two jobs on one MASTER_PORT): it never joins this one, whatever its number.
  if (f.size() != 4 || std::atoi(f[1].c_str()) != world_size_ || f[2] != run_id_) return kOtherJob;
  // Without a run id (ranks started by hand) the settings are all that tells two jobs apart: a rank
  // whose settings are not this job's never joins it. With one, the ranks are one launch: they meet
  // and all stop on their settings (CheckRanksAgree). A rank that failed before it knew its settings
  // (ReportEarlyFailure) brings none, and is not compared.
  const bool other_settings = run_id_.empty() && !settings_.empty() && !settings.empty() && settings != settings_;
  // A live rank of this number: the claimant is not its restart (that one's connection would have
  // closed) but another process as this job: another job launched alike, or the rank started twice.
  for (const auto& [other_fd, who] : registered_)
    if (who.rank == r) return other_settings ? RefuseSettings(r, f, settings) : kDuplicate;
  // This rank joined this store before and left: its new incarnation (a pod restarted in place while
  // this rank 0 still runs the old job) must not meet the old run's addresses. Refused, it retries
  // until a fresh rank 0 serves (which compares its settings).
  if (ever_ranks_.count(r)) return kRejoin;
  if (other_settings) return RefuseSettings(r, f, settings);
  registered_[fd] = {r, f[0], std::atoll(f[3].c_str())};
  SetLive();
  ever_ranks_.insert(r);
  ever_ = static_cast<int>(ever_ranks_.size());
  return kJoined;
}

char RendezvousServer::RefuseSettings(int rank, const std::vector<std::string>& hello, const std::string& settings) {
  const std::string differs = SettingsDifference(settings_, settings, rank);
  log::Warning(
      "rank 0's rendezvous refused a rank {} (host {}, pid {}): {}: another job started by hand on this MASTER_PORT, "
      "or a rank of this job started with other flags; still waiting for this job's rank {}",
      rank, log::Printable(hello[0]), log::Printable(hello[3]), differs, rank);
  refused_[rank] = OneField(fmt::format("a rank {} (host {}, pid {}) with other settings: {}", rank,
                                        log::Printable(hello[0]), log::Printable(hello[3]), differs));
  return kOtherSettings;
}

bool RendezvousServer::Receive(int fd) {
  // What has come, without waiting for the rest of a request: its sender may be stopped half-way
  // (a rank that hangs, SIGSTOP) or slowed down, and the other ranks' requests are served meanwhile.
  char buf[1 << 16];
  const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n > 0) {
    received_[fd].append(buf, static_cast<size_t>(n));
    return true;
  }
  return n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK);
}

bool RendezvousServer::Flush(int fd) {
  std::string& out = sending_[fd];
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t w = ::send(fd, out.data() + sent, out.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) {
      sent += static_cast<size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;  // the rest when its socket takes it
      return false;
    }
  }
  out.erase(0, sent);
  return true;
}

bool RendezvousServer::Reply(int fd, const void* p, size_t n) {
  sending_[fd].append(static_cast<const char*>(p), n);
  return Flush(fd) && sending_[fd].size() <= kMaxUnsentReplies;
}

bool RendezvousServer::ReplyBlob(int fd, const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  return Reply(fd, &n, 4) && Reply(fd, s.data(), s.size());
}

bool RendezvousServer::Serve(int fd, const Request& request, Waiting* waiting) {
  const std::string& key = request.key;
  switch (request.op) {
    case kSet:
      if (key == kAbortKey && abort_.empty()) abort_ = request.value;  // the first rank's reason
      if (key != kAbortKey) kv_[key] = request.value;
      return Reply(fd, "k", 1);
    case kGet: (*waiting)[fd].push_back(key); return true;
    case kHello: {
      const char answer = Hello(fd, key, request.value);
      return Reply(fd, &answer, 1);
    }
    case kPeers: return ReplyBlob(fd, Peers());
    case kAbortQuery: return ReplyBlob(fd, abort_);
    case kInfo: return ReplyBlob(fd, Info(key));
    case kSettingsQuery: return ReplyBlob(fd, settings_);
    default: return false;
  }
}

void RendezvousServer::Answer(Waiting* waiting) {
  std::vector<int> failed;
  for (auto& [fd, keys] : *waiting) {
    bool ok = true;
    while (ok && !keys.empty() && !abort_.empty()) {  // a rank failed before it joined: nobody waits
      ok = Reply(fd, &kAbortMarker, 4) && ReplyBlob(fd, abort_);
      keys.erase(keys.begin());
    }
    while (ok && !keys.empty() && kv_.count(keys.front())) {
      ok = ReplyBlob(fd, kv_[keys.front()]);
      keys.erase(keys.begin());
    }
    if (!ok) failed.push_back(fd);
  }
  for (int fd : failed) Drop(fd, waiting);
  std::erase_if(*waiting, [](const auto& entry) { return entry.second.empty(); });
}

void RendezvousServer::Loop() {
  Waiting waiting;  // a rank asks one get at a time; a client that asks several gets each answer
  while (!stop_) {
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
    for (int fd : clients_) {  // writable wanted while replies wait to be sent
      const auto out = sending_.find(fd);
      const bool unsent = out != sending_.end() && !out->second.empty();
      fds.push_back({fd, static_cast<short>(unsent ? POLLIN | POLLOUT : POLLIN), 0});
    }
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
      const int fd = fds[i].fd;
      bool ok = !(fds[i].revents & POLLOUT) || Flush(fd), bad = false;
      if (ok && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        ok = Receive(fd);
        Request request;
        while (ok && TakeRequest(&received_[fd], &request, &bad)) ok = Serve(fd, request, &waiting);
      }
      if (!ok || bad) Drop(fd, &waiting);
    }
    Answer(&waiting);
  }
}

}  // namespace ptk
