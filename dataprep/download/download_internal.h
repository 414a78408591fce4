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

// Pauses every worker's new resolves: after a 429, or when the window's quota is used up.
class RateLimiter {
 public:
  RateLimiter(double base_s, double max_s) : base_s_(base_s), max_s_(max_s), rng_(std::random_device{}()) {}

  // Waits until a resolve may be sent. A pause that would last past `deadline` (what the caller's
  // --max-retry-time leaves) is not slept through: DeadlineExceeded, saying why and how long.
  absl::Status WaitForResolve(const std::atomic<bool>& stop, Clock::time_point deadline, double max_retry_time_s) {
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
      return absl::OkStatus();
    }
    return absl::CancelledError("interrupted");
  }

  // Every Hub response carries the current window state.
  void Observe(const HttpResponse& r) {
    RateLimitHeader h = ParseRateLimit(r.Header("ratelimit"));
    if (!h.ok || (h.bucket != "resolvers" && h.bucket != "RESOLVERS")) return;
    std::lock_guard<std::mutex> lock(mu_);
    known_ = true;
    remaining_ = h.remaining;
    reset_at_ = Clock::now() + std::chrono::seconds(h.reset_s);
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
  void On429(const HttpResponse& r, int attempt) {
    RateLimitHeader h = ParseRateLimit(r.Header("ratelimit"));
    std::string ra = r.Header("retry-after");
    double s;
    std::string why;
    if (h.ok && h.remaining == 0) {
      s = static_cast<double>(h.reset_s) + 1.0;
      why = fmt::format("429 rate limited ({} quota used up, resets in {} s)", h.bucket, h.reset_s);
    } else if (auto secs = ParseUint64(ra)) {
      s = static_cast<double>(std::min<uint64_t>(*secs, 24 * 3600));
      why = fmt::format("429 rate limited (Retry-After {} s)", ra);
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
  }

  double Backoff(int attempt) {
    double cap = std::min(max_s_, base_s_ * std::pow(2.0, std::min(attempt, 20)));
    std::lock_guard<std::mutex> lock(rng_mu_);
    return std::uniform_real_distribution<double>(cap / 2, cap)(rng_);
  }

  void Wake() { cv_.notify_all(); }

 private:
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
  int64_t remaining_ = 0, quota_ = 0, window_s_ = 0;
  std::string policy_, pause_why_;
  double base_s_, max_s_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
};
void SleepFor(double s, const std::atomic<bool>& stop);

// ---- hub_api.cpp
struct Session {
  const DownloadOptions& opt;
  RateLimiter limiter;
  std::string hub_authority;
  std::atomic<bool> stop{false};
  std::atomic<bool> disk_full{false};
  std::atomic<int64_t> resolves{0}, retries{0}, rate_limited{0};
  explicit Session(const DownloadOptions& o)
      : opt(o), limiter(o.retry_base_s, o.retry_max_s), hub_authority(UrlAuthority(o.endpoint)) {}

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
void RemoveStalePart(const RemoteFile& f);
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

class FileDownloader {
 public:
  FileDownloader(Session& s, HttpClient& http, DoneLog& done, ProgressReporter& progress)
      : s_(s), http_(http), done_(done), progress_(progress) {}

  FileResult Run(const RemoteFile& f);

 private:
  bool IsHub(const std::string& url) const { return UrlAuthority(url) == s_.hub_authority; }
  std::string ResolveUrlFor(const RemoteFile& f) const {
    if (!f.url.empty()) return f.url;
    return fmt::format("{}/{}s/{}/resolve/{}/{}", s_.opt.endpoint, s_.opt.repo_type, s_.opt.repo, commit_,
                       UrlQuote(f.path, true));
  }
  friend class FileFetch;  // file_fetch.cpp: one file's attempts

  Session& s_;
  HttpClient& http_;
  DoneLog& done_;
  ProgressReporter& progress_;

 public:
  std::string commit_;
};

}  // namespace ptk::download_detail
