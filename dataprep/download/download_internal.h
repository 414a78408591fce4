// ptk-download's internals, one concern per file: the Hub's rate limits (rate_limiter.cpp), the
// Hub API: listing and revision pinning (hub_api.cpp), the download state: manifest, URL list,
// done log (download_state.cpp), and fetching one file: resume, transfer, verify (file_fetch.cpp).
// RunDownload (download.cpp) orchestrates them. Not a public header.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/hash.h"
#include "common/human_format.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/numbers.h"
#include "common/output_lock.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/status.h"
#include "dataprep/download/download.h"
#include "dataprep/download/http.h"

namespace ptk::download_detail {

using Clock = std::chrono::steady_clock;
inline constexpr const char* kStateDir = ".ptk-download";

// ---- hub_api.cpp: small helpers
std::string StripQuotes(std::string s);
bool IsHex(const std::string& s, size_t n);
std::string HubErrorText(const HttpResponse& r);

// ---- rate_limiter.cpp
// RateLimit: "resolvers";r=2976;t=166 (IETF draft 9, as the Hub sends it).
struct RateLimitHeader {
  bool ok = false;
  std::string bucket;
  int64_t remaining = 0, reset_s = 0;
};
RateLimitHeader ParseRateLimit(const std::string& h);
// Retry-After (RFC 9110 10.2.3) in seconds, at most a day: delay-seconds, or an HTTP-date taken
// against the response's own Date (the server's clock; this machine's when it sends none).
// nullopt when there is none or it is neither.
std::optional<double> RetryAfterSeconds(const HttpResponse& r);

// Pauses every worker's new resolves: after a 429, or when the window's quota is used up.
class RateLimiter {
 public:
  RateLimiter(double base_s, double max_s) : base_s_(base_s), max_s_(max_s), rng_(std::random_device{}()) {}

  // One resolve between WaitForResolve and its response (or its failure): while it lasts, what a
  // response says is left of the window is less this and the other resolves still in flight, which
  // the server may not have counted yet.
  class InFlight {
   public:
    InFlight() = default;
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    ~InFlight() { Release(); }
    void Release() {
      if (limiter_ != nullptr) limiter_->EndResolve();
      limiter_ = nullptr;
    }

   private:
    friend class RateLimiter;
    RateLimiter* limiter_ = nullptr;
  };

  // Waits until a resolve may be sent. A pause that would last past `deadline` (what the caller's
  // --max-retry-time leaves) is not slept through: DeadlineExceeded, saying why and how long.
  // With `in_flight`, the resolve counts as in flight until `in_flight` is released.
  absl::Status WaitForResolve(const std::atomic<bool>& stop, Clock::time_point deadline, double max_retry_time_s,
                              InFlight* in_flight = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop) {
      auto now = Clock::now();
      if (now < paused_until_) {
        if (paused_until_ > deadline)
          return absl::DeadlineExceededError(fmt::format(
              "{}: the Hub asks to wait {} more, longer than --max-retry-time {} allows ({} left); rerun later",
              pause_why_, HumanDuration(std::chrono::duration<double>(paused_until_ - now).count()),
              HumanDuration(max_retry_time_s),
              HumanDuration(std::max(0.0, std::chrono::duration<double>(deadline - now).count()))));
        cv_.wait_until(lock, paused_until_);
        continue;
      }
      if (known_ && remaining_ <= 0 && now < reset_at_) {
        double s = std::chrono::duration<double>(reset_at_ - now).count() + 1.0;
        PauseLocked(s, "the resolver quota of this window is used up");
        continue;
      }
      if (known_ && now >= reset_at_ && remaining_ <= 0) {
        // A new window: its quota is the policy's q (when the Hub announced one); the next
        // response corrects the count.
        remaining_ = quota_ > 0 ? quota_ : 1;
        reset_at_ = now + std::chrono::seconds(window_s_ > 0 ? window_s_ : 1);
      }
      if (known_) --remaining_;  // optimistic: the response corrects it
      if (in_flight != nullptr) {
        in_flight->Release();
        ++in_flight_;
        in_flight->limiter_ = this;
      }
      return absl::OkStatus();
    }
    return absl::CancelledError("interrupted");
  }

  // Every Hub response carries the current window state. The other resolves in flight (sent before
  // this answer came, perhaps not yet counted by the server) are taken off what it says is left:
  // four workers woken at once by a new window would otherwise each read "4 left" from the first
  // answer and send four more. Within a window the server's count only falls, so an answer that
  // arrives after a later one (answers overtake each other) cannot raise it again.
  void Observe(const HttpResponse& r) {
    RateLimitHeader h = ParseRateLimit(r.Header("ratelimit"));
    if (!h.ok || (h.bucket != "resolvers" && h.bucket != "RESOLVERS")) return;
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t left = h.remaining - std::max<int64_t>(0, in_flight_ - 1);
    const auto now = Clock::now();
    if (!known_ || now >= reset_at_) {  // the first answer of a window
      remaining_ = left;
      reset_at_ = now + std::chrono::seconds(h.reset_s);
    } else {
      remaining_ = std::min(remaining_, left);
    }
    known_ = true;
    std::string policy = r.Header("ratelimit-policy");
    if (!policy.empty() && policy != policy_) {
      policy_ = policy;
      static const std::regex re(R"(q\s*=\s*(\d+).*?w\s*=\s*(\d+))");
      std::smatch m;
      if (std::regex_search(policy, m, re)) {
        quota_ = ParseInt64(m[1].str()).value_or(quota_);
        window_s_ = ParseInt64(m[2].str()).value_or(window_s_);
      }
      log::Info("Hub rate-limit policy: {}", policy);
    }
  }

  // A 429: RateLimit r=0 -> wait t+1 s; else Retry-After; else exponential backoff with jitter.
  // Returns that wait in seconds.
  double On429(const HttpResponse& r, int attempt) {
    RateLimitHeader h = ParseRateLimit(r.Header("ratelimit"));
    const std::string ra = r.Header("retry-after");
    double s;
    std::string why;
    if (h.ok && h.remaining == 0) {
      s = static_cast<double>(h.reset_s) + 1.0;
      why = fmt::format("429 rate limited ({} quota used up, resets in {} s)", h.bucket, h.reset_s);
    } else if (const std::optional<double> secs = RetryAfterSeconds(r)) {
      s = *secs;
      why = ParseUint64(ra) ? fmt::format("429 rate limited (Retry-After {} s)", ra)
                            : fmt::format("429 rate limited (Retry-After {}: in {} s)", ra, s);
    } else {
      s = Backoff(attempt);
      why = "429 rate limited (no hint; backing off)";
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (h.ok) {
      known_ = true;
      remaining_ = h.remaining;
      reset_at_ = Clock::now() + std::chrono::seconds(h.reset_s);
    }
    PauseLocked(s, why);
    return s;
  }

  double Backoff(int attempt) {
    double cap = std::min(max_s_, base_s_ * std::pow(2.0, std::min(attempt, 20)));
    std::lock_guard<std::mutex> lock(rng_mu_);
    return std::uniform_real_distribution<double>(cap / 2, cap)(rng_);
  }

  void Wake() { cv_.notify_all(); }

  // What Observe takes off: the resolves in flight now (for tests).
  int64_t InFlightCount() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }
  int64_t RemainingForTest() {
    std::lock_guard<std::mutex> lock(mu_);
    return remaining_;
  }

 private:
  void EndResolve() {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_ > 0) --in_flight_;
  }

  void PauseLocked(double s, const std::string& why) {
    auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    if (until > paused_until_) {
      paused_until_ = until;
      pause_why_ = why;
      log::Info("{}: pausing all resolves for {:.1f} s", why, s);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  Clock::time_point paused_until_{}, reset_at_{};
  bool known_ = false;
  int64_t remaining_ = 0, quota_ = 0, window_s_ = 0, in_flight_ = 0;
  std::string policy_, pause_why_;
  double base_s_, max_s_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
};
void SleepFor(double s, const std::atomic<bool>& stop);

class DoneLog;

// Writes all of [p, p + n) at `offset` of fd (pwrite until done; EINTR retried).
inline absl::Status PwriteAll(int fd, const char* p, size_t n, uint64_t offset, const std::string& what) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, fmt::format("write {}", what));
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

// ---- publish.cpp
// How many connections are open at once, all files together (--max-connections).
class ConnectionSlots {
 public:
  explicit ConnectionSlots(int n) : free_(std::max(1, n)) {}
  void Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return free_ > 0; });
    --free_;
  }
  bool TryAcquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_ <= 0) return false;
    --free_;
    return true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++free_;
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int free_;
};

// SHA-256 (or git SHA-1) of a file as its bytes land, off the receive path: the receiving thread
// writes, then says how far the file is contiguous (Advance); this object's own thread reads those
// bytes back from the page cache and hashes them. OpenSSL's SHA-256 uses the CPU's SHA extensions
// where there are some. One per download worker, reused file after file.
class StreamHasher {
 public:
  StreamHasher();
  ~StreamHasher();
  StreamHasher(const StreamHasher&) = delete;
  StreamHasher& operator=(const StreamHasher&) = delete;
  // Starts over on `fd` (the git blob header of a `git_size`-byte file first when `git`); forgets
  // the file hashed before. The fd must stay open until Finish or the next Start.
  void Start(int fd, bool git, uint64_t git_size);
  // Bytes [0, end) are in the file: they may be hashed.
  void Advance(uint64_t end);
  // Waits until [0, end) is hashed: its hex digest, or why the bytes could not be read.
  absl::StatusOr<std::string> Finish(uint64_t end);
  // Stops hashing the current file (one that failed) before its fd is closed.
  void Abandon();

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  int fd_ = -1;
  uint64_t target_ = 0, hashed_ = 0;
  bool busy_ = false, quit_ = false;
  absl::Status error_;
  std::unique_ptr<Sha256> sha_;
  std::vector<char> buf_;
  std::thread thread_;
};

// A complete, verified `.part` waiting to become its file.
struct PublishItem {
  std::string path;  // repo path, for messages
  int fd = -1;       // the `.part`, open; closed once published
  std::string part_path, final_path, meta_path, done_key;
  uint64_t bytes = 0;
  std::unique_ptr<OutputLock> lock;  // the file's lock, released once it is in place
};

// Makes verified files durable and puts them in place, off the download workers: each `.part`
// fdatasynced (by a few threads at once, so that the journal commits them together), renamed over
// its name, its record removed, its done-log line appended, its lock released. A file whose sync or rename fails keeps
// its complete `.part` (the next run publishes it without a transfer) and is reported by Failures().
class Publisher {
 public:
  explicit Publisher(DoneLog& done);
  ~Publisher();
  void Submit(PublishItem item);
  // Waits until every submitted file is published (or failed).
  void Drain();
  std::vector<std::pair<PublishItem, absl::Status>> TakeFailures();

 private:
  void Loop();
  DoneLog& done_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  static constexpr int kThreads = 8;
  std::deque<PublishItem> queue_;
  std::vector<std::pair<PublishItem, absl::Status>> failures_;
  int busy_ = 0;
  bool quit_ = false;
  std::vector<std::thread> threads_;
};

// ---- hub_api.cpp
struct Session {
  const DownloadOptions& opt;
  RateLimiter limiter;
  std::string hub_authority;
  std::atomic<bool> stop{false};
  std::atomic<bool> disk_full{false};
  std::atomic<int64_t> resolves{0}, retries{0}, rate_limited{0}, ranged_files{0}, range_requests{0};
  ConnectionSlots slots;
  Publisher* publisher = nullptr;  // RunDownload's; files are published inline when null
  explicit Session(const DownloadOptions& o)
      : opt(o),
        limiter(o.retry_base_s, o.retry_max_s),
        hub_authority(UrlAuthority(o.endpoint)),
        slots(o.max_connections) {}

  std::vector<std::string> Headers(const std::string& url) const {
    std::vector<std::string> h;
    if (!opt.token.empty() && UrlAuthority(url) == hub_authority) h.push_back("Authorization: Bearer " + opt.token);
    return h;
  }
  HttpRequest Req(const std::string& url) const {
    HttpRequest r;
    r.url = url;
    r.headers = Headers(url);
    r.connect_timeout_s = opt.connect_timeout_s;
    r.stall_timeout_s = opt.stall_timeout_s;
    return r;
  }
};
inline constexpr int kMaxRedirects = 10;
// Pages of one tree listing at most: the Hub sends up to 1,000 entries a page (SlimPajama's 59,166
// train files take 60 pages), so 100,000 pages are far beyond any repo.
inline constexpr int kMaxListingPages = 100000;

// GET of a Hub API URL with retries on 429/5xx/transport errors; follows relative redirects.
absl::StatusOr<HttpResponse> ApiGet(Session& s, HttpClient& http, std::string url);
std::string ApiBase(const DownloadOptions& o);
absl::StatusOr<std::string> PinRevision(Session& s, HttpClient& http);
absl::StatusOr<std::vector<RemoteFile>> ListTree(Session& s, HttpClient& http, const std::string& sha);

// ---- download_state.cpp
std::string ManifestLine(const RemoteFile& f);
absl::StatusOr<std::vector<RemoteFile>> ReadManifest(const std::string& path);
absl::StatusOr<std::vector<RemoteFile>> ReadUrlList(const std::string& path);
std::string DoneLogKey(const RemoteFile& f);
std::set<std::string> ReadDoneLogs(const std::string& dir);
class DoneLog;
// Whether f.local_path holds f, complete: its size, then its digest (without verify, a done-log
// line in `done` stands for it; with no digest to check, only such a line does). A file found good
// that had no line gets one in `log`; one found damaged is reported (warn) and is not f.
absl::StatusOr<bool> PresentAndVerified(const RemoteFile& f, const std::set<std::string>& done, bool verify,
                                        DoneLog& log, bool warn = true);
// Removes the `.part` (and its record) a killed run left beside a file that is complete: by the
// holder of the file's lock (RemovePartOf), or when nobody holds it (RemoveStalePart).
void RemovePartOf(const RemoteFile& f);
void RemoveStalePart(const RemoteFile& f, std::chrono::milliseconds lock_wait);
class DoneLog {
 public:
  absl::Status Open(const std::string& path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) return ErrnoToStatus(errno, fmt::format("open {}", path));
    return absl::OkStatus();
  }
  ~DoneLog() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Not fsynced per line: a line lost in a crash only makes the next run re-hash that file.
  // Sync() at the end of the run makes the log durable.
  absl::Status Append(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string l = line + "\n";
    return WriteAll(fd_, l.data(), l.size(), "done log");
  }
  absl::Status Sync() { return FsyncFile(fd_, "done log"); }

 private:
  int fd_ = -1;
  std::mutex mu_;
};

// ---- file_fetch.cpp
absl::StatusOr<std::string> HashFile(const std::string& path, bool git, uint64_t size);
class FileFetch;
struct FileResult {
  bool ok = false;
  bool fetched = false;
  bool already_present = false;  // another run on the --local-dir finished it meanwhile
  uint64_t bytes = 0;
  absl::Status error;  // why it failed (ok when it did not)
};

// How long one file keeps being retried: --max-retries attempts without progress, and no longer
// than --max-retry-time since its last progress. Never silent: every retry is logged with what
// failed and when the next attempt is. Thread-safe (the connections of a ranged file share one).
class RetryBudget {
 public:
  RetryBudget(Session& s, const std::string& path) : s_(s), path_(path) {}
  void Progressed() {
    std::lock_guard<std::mutex> lock(mu_);
    failures_ = 0;
    failing_since_.reset();
  }
  int failures() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  // A failure that is not retried through Again (a 429 of the Hub: the limiter decides the wait).
  int AddFailure() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failing_since_) failing_since_ = std::chrono::steady_clock::now();
    return ++failures_;
  }
  // Until when this file may still wait for an answer: --max-retry-time after its last progress.
  std::chrono::steady_clock::time_point Deadline() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failing_since_.value_or(std::chrono::steady_clock::now()) +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(s_.opt.max_retry_time_s));
  }
  // OkStatus after sleeping sleep_s: try again. Otherwise why to give up.
  absl::Status Again(const std::string& why, double sleep_s) {
    ++s_.retries;
    int attempt;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = std::chrono::steady_clock::now();
      if (!failing_since_) failing_since_ = now;
      const double failing_s = std::chrono::duration<double>(now - *failing_since_).count();
      if (++failures_ > s_.opt.max_retries)  // the attempts: the first and --max-retries retries, all failed
        return absl::UnavailableError(fmt::format("{} (gave up after {} attempts without progress, --max-retries {})",
                                                  why, failures_, s_.opt.max_retries));
      if (failing_s + sleep_s > s_.opt.max_retry_time_s)
        return absl::DeadlineExceededError(
            fmt::format("{} (gave up: failing for {} without progress, --max-retry-time {})", why,
                        HumanDuration(failing_s), HumanDuration(s_.opt.max_retry_time_s)));
      attempt = failures_ + 1;
    }
    log::Warning("{}: {}; attempt {} of {} in {}", log::Printable(path_), why, attempt, s_.opt.max_retries + 1,
                 HumanDuration(sleep_s));
    SleepFor(sleep_s, s_.stop);
    return absl::OkStatus();
  }
  // The backoff before the next attempt: none right after progress, else growing per failure.
  double Backoff(bool progressed) const { return progressed ? 0.0 : s_.limiter.Backoff(failures()); }

 private:
  Session& s_;
  const std::string& path_;
  mutable std::mutex mu_;
  int failures_ = 0;
  std::optional<std::chrono::steady_clock::time_point> failing_since_;
};

// A strong entity tag ("xyzzy", not W/"xyzzy"): the only kind If-Range may carry (RFC 9110 13.1.5).
inline bool IsStrongEtag(const std::string& tag) { return tag.size() >= 2 && tag.front() == '"' && tag.back() == '"'; }

// Makes a verified `.part` its file: through the session's publisher (batched fsync), or inline.
absl::Status Publish(Session& s, DoneLog& done, PublishItem item);

class FileDownloader {
 public:
  FileDownloader(Session& s, HttpClient& http, StreamHasher& hasher, DoneLog& done, ProgressReporter& progress)
      : s_(s), http_(http), hasher_(hasher), done_(done), progress_(progress) {}

  FileResult Run(const RemoteFile& f);

 private:
  bool IsHub(const std::string& url) const { return UrlAuthority(url) == s_.hub_authority; }
  std::string ResolveUrlFor(const RemoteFile& f) const {
    if (!f.url.empty()) return f.url;
    return fmt::format("{}/{}s/{}/resolve/{}/{}", s_.opt.endpoint, s_.opt.repo_type, s_.opt.repo, commit_,
                       UrlQuote(f.path, true));
  }
  // Whether f is fetched as concurrent byte ranges (ranged_fetch.cpp), and that fetch: kUnimplemented
  // when the server does not serve ranges (the caller then fetches the file over one connection).
  bool Ranged(const RemoteFile& f) const;
  absl::Status RunRanged(const RemoteFile& f, FileResult& res, std::unique_ptr<OutputLock>& lock);
  friend class FileFetch;    // file_fetch.cpp: one file's attempts
  friend class RangedFetch;  // ranged_fetch.cpp: one file's pieces over several connections

  Session& s_;
  HttpClient& http_;
  StreamHasher& hasher_;
  DoneLog& done_;
  ProgressReporter& progress_;

 public:
  std::string commit_;
};

}  // namespace ptk::download_detail
