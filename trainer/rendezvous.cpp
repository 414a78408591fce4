// A rank's side of the rendezvous: joining rank 0's store, and what it knows of ranks that failed.
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
#include "common/slurm_env.h"
#include "common/status.h"
#include "trainer/rendezvous_server.h"

namespace ptk {

using Clock = std::chrono::steady_clock;

using namespace rendezvous_detail;

namespace {

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

// What became of a rank whose connection to rank 0's store ended (its peer-list state: "left" or
// kDroppedState), after "rank N (host H) ".
std::string GoneWords(const std::string& state) {
  if (state == kDroppedState)
    return "was disconnected by the rendezvous store: it stopped reading its answers (stopped or hung)";
  return "exited (its connection to the rendezvous closed: killed, crashed or stopped early)";
}

}  // namespace

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

RendezvousStore::~RendezvousStore() {
  if (fd_ >= 0) ::close(fd_);
  // Rank 0 after a failed collective: the other ranks may still ask its store what happened (which
  // rank exited); it serves them until they are gone, for a few seconds at most.
  // Not for the ranks the diagnosis found silent: a rank that hangs never asks, and would hold rank 0 the whole wait.
  if (server_ && diagnosed_) {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (PeersToServe() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  server_.reset();
}

int RendezvousStore::PeersToServe() const {
  if (!server_) return 0;
  std::vector<int> silent;
  {
    std::lock_guard<std::mutex> lock(silent_mu_);
    silent = silent_;
  }
  int n = 0;
  for (const int r : server_->LiveRanks())
    if (r != rank_ && std::find(silent.begin(), silent.end(), r) == silent.end()) ++n;
  return n;
}

namespace {

void SetReceiveTimeout(int fd, std::chrono::milliseconds wait) {
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>(wait.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

// A connection to host:port, or -1 (*last: why).
int Dial(const std::string& host, int port, std::string* last, absl::Status* bad_addr) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  int g = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (g != 0) {
    *bad_addr = absl::InvalidArgumentError(fmt::format("MASTER_ADDR {}: {}", host, gai_strerror(g)));
    return -1;
  }
  int out = -1;
  for (addrinfo* a = res; a && out < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      out = fd;
    } else {
      *last = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  return out;
}

// How long a rank waits for a ptk rank 0 that holds its connection open but does not answer yet (the
// question of PortHolder, a rank's hello), at most the rank's timeout. A ptk rank 0 answers within
// moments (its store has a thread of its own), but on a machine starved of CPU or memory (two jobs'
// ranks on two cores) that thread may not run for seconds (the old waits, 2 s for the question and
// 10 s for the hello, named such a rank 0 "a program that did not answer"). Only a listener that
// stays silent waits this long (a program that is not ptk, or a ptk rank 0 that hangs or is
// stopped); every definite answer ends the wait at once: a refused connection, one closed or reset,
// any reply.
constexpr std::chrono::seconds kSilentRankZeroWait{30};

std::chrono::milliseconds SilentRankZeroWait(std::chrono::milliseconds timeout) {
  return std::min<std::chrono::milliseconds>(kSilentRankZeroWait, timeout);
}

// "4 s", "0.5 s": a wait in a message.
std::string Seconds(std::chrono::milliseconds wait) { return fmt::format("{} s", wait.count() / 1000.0); }

// Who holds `port` on this host, which this rank 0 could not bind: another ptk rank 0 (its Info), or
// something else (*ptk false). A silent holder is waited for up to `wait`.
std::string PortHolder(int port, std::chrono::milliseconds wait, bool* ptk) {
  *ptk = false;
  std::string last;
  absl::Status bad;
  const int fd = Dial("127.0.0.1", port, &last, &bad);
  if (fd < 0) return fmt::format("a program that does not accept connections on 127.0.0.1 ({})", last);
  SetReceiveTimeout(fd, wait);
  const uint8_t op = static_cast<uint8_t>(kInfo);
  std::string text;
  ServerInfo info;
  errno = 0;
  const bool answered = SendAll(fd, &op, 1) && SendBlob(fd, "") && RecvBlob(fd, &text);
  const bool silent = !answered && (errno == EAGAIN || errno == EWOULDBLOCK);
  ::close(fd);
  if (silent)
    return fmt::format(
        "a program that did not answer ptk's question within {} (not a ptk rendezvous, or a ptk rank 0 that hangs)",
        Seconds(wait));
  if (!answered || !ParseServerInfo(text, &info))
    return "a program that is not a ptk rendezvous (it did not answer ptk's question as ptk does)";
  *ptk = true;
  return fmt::format("another ptk rank 0 (host {}, pid {}; {})", info.host, info.pid,
                     JobWords(info.world_size, info.run_id));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RendezvousStore>> RendezvousStore::Connect(
    int rank, int world_size, const std::string& master_addr, int port, std::chrono::milliseconds timeout,
    const std::string& run_id, int torchrun_store_port, const std::string& settings) {
  std::unique_ptr<RendezvousStore> s(new RendezvousStore());
  s->settings_ = settings;
  s->torchrun_store_port_ = torchrun_store_port;
  s->rank_ = rank;
  s->world_size_ = world_size;
  s->timeout_ = timeout;
  s->host_ = HostName();
  s->run_id_ = run_id;
  if (rank == 0) {
    s->server_ = std::make_unique<RendezvousServer>();
    if (absl::Status started = s->server_->Start(port, world_size, run_id, torchrun_store_port, settings);
        !started.ok()) {
      if (s->server_->bind_errno() != EADDRINUSE) return started;
      bool ptk = false;
      const std::string holder = PortHolder(port, SilentRankZeroWait(timeout), &ptk);
      return absl::FailedPreconditionError(
          fmt::format("rank 0: {} on this host is held by {}, this job being {}: {}",
                      RendezvousPortWords(port, torchrun_store_port), holder, JobWords(world_size, run_id),
                      ptk ? "give each job a MASTER_PORT of its own" : "give this job a free MASTER_PORT"));
    }
    port = s->server_->port();  // port 0 (one rank alone): the free one it got
  }
  const std::string host = rank == 0 ? "127.0.0.1" : master_addr;
  const auto deadline = Clock::now() + timeout;
  std::string last = "no attempt";
  int closed = 0;  // connections closed without an answer to the hello, in a row
  // Ranks start together and rank 0 listens moments later: the first retries come soon, the later
  // ones every 200 ms.
  std::chrono::milliseconds retry(5);
  while (s->fd_ < 0 && Clock::now() < deadline) {
    absl::Status bad_addr;
    s->fd_ = Dial(host, port, &last, &bad_addr);
    if (!bad_addr.ok()) return bad_addr;
    if (s->fd_ < 0) {
      closed = 0;
    } else if (absl::Status joined = s->Hello(host, port, &last, &closed); !joined.ok()) {
      ::close(s->fd_);
      s->fd_ = -1;
      if (absl::IsFailedPrecondition(joined)) return joined;  // another job's, or not ptk: no retry
    }
    if (s->fd_ < 0) {
      std::this_thread::sleep_for(retry);
      retry = std::min(retry * 2, std::chrono::milliseconds(200));
    }
  }
  if (s->fd_ < 0)
    return absl::DeadlineExceededError(
        fmt::format("rendezvous: rank 0 at {} did not answer within {} s ({}); is rank 0 running, "
                    "MASTER_ADDR/MASTER_PORT right?",
                    RendezvousAddressWords(host, port, torchrun_store_port), timeout.count() / 1000, last));
  return s;
}

absl::Status RendezvousStore::Hello(const std::string& addr, int port, std::string* last, int* closed) {
  // A ptk rank 0 answers at once unless starved (kSilentRankZeroWait): a listener silent that long is
  // not one, or hangs.
  const auto wait = SilentRankZeroWait(timeout_);
  SetReceiveTimeout(fd_, wait);
  const std::string where = RendezvousAddressWords(addr, port, torchrun_store_port_);
  const std::string not_ptk =
      fmt::format("another program or job holds {}; give this job a MASTER_PORT of its own (or stop what holds it)",
                  RendezvousPortWords(port, torchrun_store_port_));
  const std::string value = HelloValue(host_, world_size_, run_id_, ::getpid(), settings_);
  char ack = 0;
  const absl::Status hello = Request(kHello, std::to_string(rank_), &value, nullptr, &ack);
  if (absl::IsDeadlineExceeded(hello))
    return absl::FailedPreconditionError(fmt::format(
        "rendezvous: what listens at {} did not answer ptk's hello within {}: not a ptk rank 0 (or one that hangs); "
        "{}",
        where, Seconds(wait), not_ptk));
  if (!hello.ok()) {  // closed: a rank 0 ending its store, once; what closes every time is not ptk
    if (++*closed >= 3)
      return absl::FailedPreconditionError(fmt::format(
          "rendezvous: what listens at {} closed the connection without answering ptk's hello, {} times: not a ptk "
          "rank 0; {}",
          where, *closed, not_ptk));
    *last = StatusMessage(hello);
    return absl::UnavailableError(*last);
  }
  *closed = 0;
  if (ack == kJoined) {
    SetReceiveTimeout(fd_, timeout_);
    return absl::OkStatus();
  }
  if (ack == kRejoin) {  // that rank 0 still runs an earlier start of the job: retry until a fresh one serves
    *last = fmt::format("it still runs an earlier start of this job, which rank {} already joined", rank_);
    return absl::UnavailableError(*last);
  }
  if (ack != kOtherJob && ack != kDuplicate && ack != kOtherSettings)
    return absl::FailedPreconditionError(fmt::format(
        "rendezvous: what listens at {} is not a ptk rank 0 (it answered ptk's hello with byte 0x{:02x}); {}", where,
        static_cast<unsigned>(static_cast<unsigned char>(ack)), not_ptk));
  return RefusedByRankZero(where, port, ack);
}

absl::Status RendezvousStore::RefusedByRankZero(const std::string& where, int port, char ack) {
  std::string text;
  ServerInfo info;
  const bool known = Request(kInfo, std::to_string(rank_), nullptr, &text).ok() && ParseServerInfo(text, &info);
  const std::string mine = JobWords(world_size_, run_id_);
  const std::string theirs =
      known ? fmt::format("host {}, pid {}; {}", info.host, info.pid, JobWords(info.world_size, info.run_id))
            : "it did not say whose";
  if (ack == kOtherJob)
    return absl::FailedPreconditionError(
        fmt::format("rendezvous: the rank 0 at {} is another job's ({}), not this rank's ({}): two jobs use {}; give "
                    "each job a MASTER_PORT of its own",
                    where, theirs, mine, RendezvousPortWords(port, torchrun_store_port_)));
  if (ack == kOtherSettings) {
    std::string theirs_settings;
    const bool told = Request(kSettingsQuery, "", nullptr, &theirs_settings).ok();
    const std::string differs = told ? SettingsDifference(theirs_settings, settings_, rank_) : "";
    return absl::FailedPreconditionError(fmt::format(
        "rendezvous: the rank 0 at {} ({}) runs other settings than this rank {}: {}: another job started by "
        "hand ({}) uses {}, or this rank was started with other flags than rank 0; every rank of a job needs the "
        "same flags, each job a MASTER_PORT of its own (and a run id: PTK_RUN_ID)",
        where, theirs, rank_, differs.empty() ? "rank 0 did not say which" : differs, mine,
        RendezvousPortWords(port, torchrun_store_port_)));
  }
  const std::string holder =
      known && info.rank_pid > 0 ? fmt::format(" (host {}, pid {})", info.rank_host, info.rank_pid) : "";
  return absl::FailedPreconditionError(fmt::format(
      "rendezvous: the rank 0 at {} ({}) already has a rank {} connected{}: another job launched alike ({}) uses "
      "{}, or rank {} was started twice; give each job a MASTER_PORT of its own{}",
      where, theirs, rank_, holder, mine, RendezvousPortWords(port, torchrun_store_port_), rank_,
      run_id_.empty() ? " and a run id (PTK_RUN_ID)" : ""));
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
  std::vector<std::string> refused;  // hellos rank 0 refused for their settings: perhaps this job's ranks
  const std::vector<int> missing = absl::IsDeadlineExceeded(st) ? NeverJoined(&refused) : std::vector<int>{};
  if (!missing.empty()) {
    what = missing.size() == 1 ? "rank" : "ranks";
    for (size_t i = 0; i < missing.size(); ++i) what += fmt::format("{} {}", i ? "," : "", missing[i]);
    std::string why;
    for (const std::string& r : refused) why += (why.empty() ? " Refused meanwhile: " : "; ") + r;
    return absl::DeadlineExceededError(fmt::format(
        "{} did not join within {} s (--distributed-timeout-minutes): start all {} ranks (WORLD_SIZE) with the same "
        "MASTER_ADDR and MASTER_PORT{}; {} running?{}",
        what, timeout_.count() / 1000.0, world_size_, refused.empty() ? "" : " and the same flags",
        missing.size() == 1 ? "is that rank" : "are they", why));
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
  if (const absl::Status asked = Request(kPeers, "", nullptr, &text); !asked.ok()) {
    // This rank's connection to rank 0's store closed: rank 0 is gone (a rank 0 that hangs keeps it open).
    if (rank_ != 0 && absl::IsUnavailable(asked))
      return "rank 0 (which serves the rendezvous) exited (its connection closed: killed, crashed or stopped early)";
    return "";
  }
  for (const PeerLine& p : PeerLines(text))
    if (p.state == "left" || p.state == kDroppedState)
      return fmt::format("rank {} (host {}) {}", p.rank, p.host, GoneWords(p.state));
  return "";
}

std::vector<int> RendezvousStore::NeverJoined(std::vector<std::string>* refused) {
  std::string text;
  if (!Request(kPeers, "", nullptr, &text).ok()) return {};
  const std::map<int, std::string> refusals = RefusedLines(text);
  std::set<int> came;
  for (const PeerLine& p : PeerLines(text)) came.insert(p.rank);
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r)
    if (!came.count(r)) {
      missing.push_back(r);
      if (refusals.count(r)) refused->push_back(refusals.at(r));
    }
  return missing.size() < static_cast<size_t>(world_size_) ? missing : std::vector<int>{};  // none came: no answer
}

void RendezvousStore::ReportEarlyFailure(int rank, int world_size, const std::string& master_addr, int port,
                                         std::chrono::milliseconds timeout, const absl::Status& failure,
                                         const std::string& run_id) {
  if (world_size <= 1 || failure.ok()) return;
  // The ranks start together and check their flags in moments: a minute is plenty for rank 0 to
  // come up (or, on rank 0, for the others to come and hear why), and bounds this rank's exit.
  const auto wait = std::min<std::chrono::milliseconds>(timeout, std::chrono::minutes(1));
  auto store = Connect(rank, world_size, master_addr, port, wait, run_id);
  if (!store.ok()) return;  // no rank 0 of this job to tell: the others time out as before
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
      if (it == peers.end() || it->second.second == "left" || it->second.second == kDroppedState) {
        settled = true;
        break;
      }
      if (it->second.second == "alive") settled = false;
    }
    if (settled || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::vector<std::string> left, dropped, silent;
  std::vector<int> silent_ranks;
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    auto it = peers.find(r);
    if (it == peers.end()) {
      left.push_back(fmt::format("rank {}", r));
    } else if (it->second.second == "left") {
      left.push_back(fmt::format("rank {} (host {})", r, it->second.first));
    } else if (it->second.second == kDroppedState) {
      dropped.push_back(fmt::format("rank {} (host {})", r, it->second.first));
    } else if (it->second.second == "alive") {
      silent.push_back(fmt::format("rank {} (host {})", r, it->second.first));
      silent_ranks.push_back(r);
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
    return out;
  };
  // Each rank that is gone, under what became of it (exited; dropped by the store for its unread answers).
  std::string gone;
  if (!left.empty()) gone = join(left) + " " + GoneWords("left");
  if (!dropped.empty()) gone += (gone.empty() ? "" : "; ") + join(dropped) + " " + GoneWords(kDroppedState);
  // The ranks still alive beside a gone one are not judged: this rank saw the death first, and they are about
  // to meet it and ask rank 0's store who went (rank 0's destructor serves them). Silent only where no rank is
  // gone and they never reported within the wait: they hang, and will not ask.
  if (!gone.empty()) return gone;
  {
    std::lock_guard<std::mutex> lock(silent_mu_);
    silent_.insert(silent_.end(), silent_ranks.begin(), silent_ranks.end());
  }
  if (!silent.empty())
    return fmt::format("{} did not report a failure: it hangs (or is cut off from the others)", join(silent));
  return "every rank reports a failure: the network between them failed";
}

}  // namespace ptk
