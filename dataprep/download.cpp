// ptk-download's engine.
#include "dataprep/download.h"

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
#include <random>
#include <regex>
#include <set>
#include <thread>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_util.h"
#include "common/hash.h"
#include "common/json_escape.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/status.h"
#include "dataprep/http.h"

namespace ptk {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kStateDir = ".ptk-download";

std::string StripQuotes(std::string s) {
  if (s.rfind("W/", 0) == 0) s = s.substr(2);
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

bool IsHex(const std::string& s, size_t n) {
  return s.size() == n &&
         std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// RateLimit: "resolvers";r=2976;t=166 (IETF draft 9, as the Hub sends it).
struct RateLimitHeader {
  bool ok = false;
  std::string bucket;
  int64_t remaining = 0, reset_s = 0;
};
RateLimitHeader ParseRateLimit(const std::string& h) {
  static const std::regex re(R"RE("?(\w+)"?\s*;\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+))RE", std::regex::icase);
  std::smatch m;
  RateLimitHeader r;
  if (std::regex_search(h, m, re)) {
    r.ok = true;
    r.bucket = m[1];
    r.remaining = std::stoll(m[2]);
    r.reset_s = std::stoll(m[3]);
  }
  return r;
}

// Pauses every worker's new resolves: after a 429, or when the window's quota is used up.
class RateLimiter {
 public:
  RateLimiter(double base_s, double max_s) : base_s_(base_s), max_s_(max_s), rng_(std::random_device{}()) {}

  void WaitForResolve(const std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop) {
      auto now = Clock::now();
      if (now < paused_until_) {
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
      return;
    }
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
        quota_ = std::stoll(m[1]);
        window_s_ = std::stoll(m[2]);
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
    } else if (!ra.empty() && std::all_of(ra.begin(), ra.end(), ::isdigit)) {
      s = std::stod(ra);
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
      log::Info("{}: pausing all resolves for {:.1f} s", why, s);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  Clock::time_point paused_until_{}, reset_at_{};
  bool known_ = false;
  int64_t remaining_ = 0, quota_ = 0, window_s_ = 0;
  std::string policy_;
  double base_s_, max_s_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
};

void SleepFor(double s, const std::atomic<bool>& stop) {
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  while (!stop && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

std::string HubErrorText(const HttpResponse& r) {
  std::string code = r.Header("x-error-code"), msg = r.Header("x-error-message");
  std::string s = fmt::format("HTTP {}", r.status);
  if (!code.empty()) s += " " + code;
  if (!msg.empty())
    s += ": " + msg;
  else if (!r.body.empty() && r.body.size() < 300)
    s += ": " + r.body;
  return s;
}

// ---------------------------------------------------------------- listing

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

// GET of a Hub API URL with retries on 429/5xx/transport errors; follows relative redirects.
absl::StatusOr<HttpResponse> ApiGet(Session& s, HttpClient& http, std::string url) {
  HttpResponse r;
  for (int attempt = 0;; ++attempt) {
    PTK_RETURN_IF_ERROR(http.Get(s.Req(url), &r));
    if (r.curl_code == 0 && r.status >= 300 && r.status < 400 && !r.Header("location").empty()) {
      url = ResolveUrl(url, r.Header("location"));
      continue;
    }
    bool retry = r.curl_code != 0 || r.status == 429 || r.status == 408 || r.status >= 500;
    if (!retry) return r;
    if (attempt >= s.opt.max_retries)
      return absl::UnavailableError(fmt::format("{}: {}", url, r.curl_code ? r.curl_error : HubErrorText(r)));
    ++s.retries;
    if (r.status == 429) {
      ++s.rate_limited;
      s.limiter.On429(r, attempt);
      s.limiter.WaitForResolve(s.stop);
    } else {
      SleepFor(s.limiter.Backoff(attempt), s.stop);
    }
  }
}

std::string ApiBase(const DownloadOptions& o) { return fmt::format("{}/api/{}s/{}", o.endpoint, o.repo_type, o.repo); }

absl::StatusOr<std::string> PinRevision(Session& s, HttpClient& http) {
  if (IsHex(s.opt.revision, 40)) return s.opt.revision;
  std::string url = fmt::format("{}/revision/{}", ApiBase(s.opt), UrlQuote(s.opt.revision, false));
  PTK_ASSIGN_OR_RETURN(HttpResponse r, ApiGet(s, http, url));
  if (r.status != 200) {
    std::string hint = (r.status == 401 || r.status == 403)
                           ? " (private or gated repo? set HF_TOKEN or --token-file, and accept the repo's terms)"
                           : "";
    return absl::NotFoundError(
        fmt::format("{} {}@{}: {}{}", s.opt.repo_type, s.opt.repo, s.opt.revision, HubErrorText(r), hint));
  }
  simdjson::dom::parser p;
  simdjson::dom::element e;
  std::string_view sha;
  if (p.parse(r.body).get(e) || e["sha"].get(sha) || !IsHex(std::string(sha), 40))
    return absl::DataLossError(fmt::format("{}: the Hub's revision answer has no commit sha", url));
  return std::string(sha);
}

std::string NextLink(const std::string& link) {
  // <https://...>; rel="next", possibly among other links
  static const std::regex re(R"RE(<([^>]+)>\s*;\s*rel="?next"?)RE");
  std::smatch m;
  if (std::regex_search(link, m, re)) return m[1];
  return "";
}

absl::StatusOr<std::vector<RemoteFile>> ListTree(Session& s, HttpClient& http, const std::string& sha) {
  std::vector<RemoteFile> files;
  std::string url = fmt::format("{}/tree/{}?recursive=true&expand=false", ApiBase(s.opt), sha);
  int pages = 0;
  while (!url.empty()) {
    PTK_ASSIGN_OR_RETURN(HttpResponse r, ApiGet(s, http, url));
    if (r.status != 200) return absl::NotFoundError(fmt::format("listing {}: {}", url, HubErrorText(r)));
    simdjson::dom::parser p;
    simdjson::dom::element root;
    simdjson::dom::array arr;
    if (p.parse(r.body).get(root) || root.get_array().get(arr))
      return absl::DataLossError(fmt::format("listing {}: not a JSON array", url));
    for (auto e : arr) {
      std::string_view type, path;
      if (e["type"].get(type) || e["path"].get(path))
        return absl::DataLossError(fmt::format("listing {}: bad entry", url));
      if (type != "file") continue;
      RemoteFile f;
      f.path = std::string(path);
      uint64_t size;
      std::string_view oid;
      simdjson::dom::element lfs;
      if (!e["lfs"].get(lfs)) {
        std::string_view sha256;
        if (lfs["oid"].get(sha256) || lfs["size"].get(size))
          return absl::DataLossError(fmt::format("listing: LFS entry {} lacks oid/size", f.path));
        f.sha256 = std::string(sha256);
        f.size = size;
      } else {
        if (e["size"].get(size)) return absl::DataLossError(fmt::format("listing: entry {} lacks a size", f.path));
        f.size = size;
        if (!e["oid"].get(oid)) f.git_sha1 = std::string(oid);
      }
      f.size_known = true;
      files.push_back(std::move(f));
    }
    ++pages;
    std::string next = NextLink(r.Header("link"));
    url = next.empty() ? "" : ResolveUrl(url, next);
  }
  log::Info("listed {} files of {} {}@{} in {} page(s)", files.size(), s.opt.repo_type, s.opt.repo, sha.substr(0, 12),
            pages);
  return files;
}

std::string ManifestLine(const RemoteFile& f) {
  return fmt::format("{{\"path\": \"{}\", \"size\": {}, \"sha256\": \"{}\", \"git_sha1\": \"{}\"}}\n",
                     JsonEscape(f.path), f.size, f.sha256, f.git_sha1);
}

absl::StatusOr<std::vector<RemoteFile>> ReadManifest(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<RemoteFile> out;
  simdjson::dom::parser p;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string::npos) e = text.size();
    std::string_view line(text.data() + pos, e - pos);
    pos = e + 1;
    if (line.empty()) continue;
    simdjson::dom::element el;
    std::string_view fp, sha, git;
    uint64_t size;
    if (p.parse(line.data(), line.size()).get(el) || el["path"].get(fp) || el["size"].get(size) ||
        el["sha256"].get(sha) || el["git_sha1"].get(git))
      return absl::DataLossError(fmt::format("{}: corrupt manifest line", path));
    RemoteFile f;
    f.path = std::string(fp);
    f.size = size;
    f.size_known = true;
    f.sha256 = std::string(sha);
    f.git_sha1 = std::string(git);
    out.push_back(std::move(f));
  }
  return out;
}

absl::StatusOr<std::vector<RemoteFile>> ReadUrlList(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<RemoteFile> out;
  size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string::npos) e = text.size();
    std::string line = text.substr(pos, e - pos);
    pos = e + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    std::vector<std::string> fields;
    size_t i = first;
    while (i < line.size()) {
      size_t j = line.find_first_of(" \t", i);
      if (j == std::string::npos) j = line.size();
      if (j > i) fields.push_back(line.substr(i, j - i));
      i = line.find_first_not_of(" \t", j);
      if (i == std::string::npos) break;
    }
    RemoteFile f;
    f.url = fields[0];
    if (f.url.find("://") == std::string::npos)
      return absl::InvalidArgumentError(fmt::format("{}:{}: not a URL: {}", path, line_no, f.url));
    std::string p = f.url.substr(0, f.url.find_first_of("?#"));
    f.path = UrlUnquote(p.substr(p.rfind('/') + 1));
    for (size_t k = 1; k < fields.size(); ++k) {
      const std::string& kv = fields[k];
      if (kv.rfind("sha256=", 0) == 0)
        f.sha256 = kv.substr(7);
      else if (kv.rfind("size=", 0) == 0) {
        f.size = std::stoull(kv.substr(5));
        f.size_known = true;
      } else if (kv.rfind("path=", 0) == 0) {
        f.path = kv.substr(5);
      } else {
        return absl::InvalidArgumentError(
            fmt::format("{}:{}: unknown field {:?} (sha256=, size=, path=)", path, line_no, kv));
      }
    }
    if (!f.sha256.empty() && !IsHex(f.sha256, 64))
      return absl::InvalidArgumentError(fmt::format("{}:{}: sha256 must be 64 hex digits", path, line_no));
    if (f.path.empty())
      return absl::InvalidArgumentError(fmt::format("{}:{}: cannot name the file; add path=NAME", path, line_no));
    out.push_back(std::move(f));
  }
  return out;
}

// ---------------------------------------------------------------- done logs

std::string DoneLogKey(const RemoteFile& f) {
  return fmt::format("{}\t{}\t{}", f.local_path, f.size, f.sha256.empty() ? f.git_sha1 : f.sha256);
}

std::set<std::string> ReadDoneLogs(const std::string& dir) {
  std::set<std::string> done;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return done;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind("done-", 0) != 0 || name.size() < 9 || name.substr(name.size() - 4) != ".tsv") continue;
    auto text = ReadFileToString(JoinPath(dir, name));
    if (!text.ok()) continue;
    size_t pos = 0;
    while (pos < text->size()) {
      size_t nl = text->find('\n', pos);
      if (nl == std::string::npos) break;  // a torn last line is ignored
      done.insert(text->substr(pos, nl - pos));
      pos = nl + 1;
    }
  }
  ::closedir(d);
  return done;
}

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

// ---------------------------------------------------------------- one file

absl::StatusOr<std::string> HashFile(const std::string& path, bool git, uint64_t size) {
  Sha256 h(git ? Sha256::Algorithm::kSha1 : Sha256::Algorithm::kSha256);
  if (git) {
    std::string hdr = fmt::format("blob {}", size);
    h.Update(hdr.data(), hdr.size() + 1);  // includes the NUL
  }
  PTK_RETURN_IF_ERROR(ReadFileChunks(path, 1 << 20, [&](const char* p, size_t n) { h.Update(p, n); }));
  return h.HexDigest();
}

struct FileResult {
  bool ok = false;
  bool fetched = false;
  uint64_t bytes = 0;
  std::string error;
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
  absl::Status Finish(const RemoteFile& f, const std::string& part, int fd);

  Session& s_;
  HttpClient& http_;
  DoneLog& done_;
  ProgressReporter& progress_;

 public:
  std::string commit_;
};

absl::Status FileDownloader::Finish(const RemoteFile& f, const std::string& part, int fd) {
  // The data is durable before the rename; the directories (the renames) are fsynced once per
  // run, at its end (a rename lost in a crash leaves a complete, fsynced .part to resume).
  PTK_RETURN_IF_ERROR(FsyncFile(fd, part));
  PTK_RETURN_IF_ERROR(RenameFile(part, f.local_path));
  (void)RemoveFileIfExists(part + ".json");
  return done_.Append(DoneLogKey(f));
}

FileResult FileDownloader::Run(const RemoteFile& f) {
  FileResult res;
  const std::string part = f.local_path + ".part";
  const std::string meta_path = part + ".json";
  absl::Status mk = MakeDirs(Dirname(f.local_path));
  if (!mk.ok()) {
    res.error = std::string(StatusMessage(mk));
    return res;
  }
  const bool git = f.sha256.empty() && !f.git_sha1.empty();
  const std::string want_digest = git ? f.git_sha1 : f.sha256;
  // A .part is only resumed if it was started for this very file (same size and digest).
  std::string etag;
  {
    auto meta = ReadFileToString(meta_path);
    std::string expect = fmt::format("{}\t{}", f.size, want_digest);
    if (meta.ok()) {
      size_t nl = meta->find('\n');
      if (meta->substr(0, nl) != expect)
        (void)RemoveFileIfExists(part);
      else if (nl != std::string::npos)
        etag = meta->substr(nl + 1);
    } else if (PathExists(part)) {
      (void)RemoveFileIfExists(part);  // no record of what it was: start over
    }
    while (!etag.empty() && (etag.back() == '\n' || etag.back() == '\r')) etag.pop_back();
  }
  int fd = ::open(part.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    res.error = std::string(StatusMessage(ErrnoToStatus(errno, fmt::format("open {}", part))));
    if (errno == ENOSPC || errno == EDQUOT) s_.disk_full = true;
    return res;
  }
  // What the .part is (size, digest, ETag): atomic but not fsynced. Losing it in a crash only
  // means the .part is not resumed; a stale one cannot pass the final size + digest check.
  auto write_meta = [&](const std::string& tag) {
    (void)WriteFileAtomic(meta_path, fmt::format("{}\t{}\n{}\n", f.size, want_digest, tag), false, /*durable=*/false);
  };
  write_meta(etag);
  struct stat st;
  ::fstat(fd, &st);
  uint64_t offset = static_cast<uint64_t>(st.st_size);
  if (f.size_known && offset > f.size) {
    (void)::ftruncate(fd, 0);
    offset = 0;
  }
  ::lseek(fd, static_cast<off_t>(offset), SEEK_SET);

  // Hash of the bytes already in the .part (re-read on resume).
  Sha256 hasher(git ? Sha256::Algorithm::kSha1 : Sha256::Algorithm::kSha256);
  auto restart_hash = [&]() {
    hasher.Reset();
    if (git) {
      std::string hdr = fmt::format("blob {}", f.size);
      hasher.Update(hdr.data(), hdr.size() + 1);
    }
  };
  restart_hash();
  if (offset > 0) {
    std::vector<char> buf(1 << 20);
    uint64_t done = 0;
    while (done < offset) {
      ssize_t n = ::pread(fd, buf.data(), std::min<uint64_t>(buf.size(), offset - done), static_cast<off_t>(done));
      if (n <= 0) break;
      hasher.Update(buf.data(), static_cast<size_t>(n));
      done += static_cast<uint64_t>(n);
    }
    progress_.AddBytes(offset);
  }

  std::string url = ResolveUrlFor(f);
  uint64_t expected = f.size;
  bool size_known = f.size_known;
  int no_progress = 0, digest_failures = 0, redirects = 0;
  absl::Status write_error;
  // libcurl hands the body over in 16 KiB pieces; they are gathered into writes of 1 MiB, or of
  // what came in the last half second on a slow link (so a kill loses little). The buffer is
  // always written out when a transfer ends, before anything looks at the .part.
  std::vector<char> wbuf;
  wbuf.reserve(1 << 20);
  auto last_flush = std::chrono::steady_clock::now();
  auto flush_wbuf = [&]() {
    last_flush = std::chrono::steady_clock::now();
    if (wbuf.empty() || !write_error.ok()) return;
    write_error = WriteAll(fd, wbuf.data(), wbuf.size(), part);
    wbuf.clear();
  };
  auto truncate_to_zero = [&]() {
    wbuf.clear();
    (void)::ftruncate(fd, 0);
    ::lseek(fd, 0, SEEK_SET);
    offset = 0;
    restart_hash();
  };
  auto fail = [&](const std::string& why) {
    res.error = why;
    ::close(fd);
    return res;
  };

  while (!s_.stop) {
    const bool hub = IsHub(url);
    if (hub && f.url.empty()) {
      s_.limiter.WaitForResolve(s_.stop);
      ++s_.resolves;
    }
    if (s_.stop) break;
    HttpRequest req = s_.Req(url);
    if (offset > 0) {
      req.headers.push_back(fmt::format("Range: bytes={}-", offset));
      if (!etag.empty()) req.headers.push_back("If-Range: " + etag);
    }
    uint64_t attempt_start = offset;
    bool range_ok = true;
    std::string bad_range;
    BodySink sink;
    sink.on_headers = [&](const HttpResponse& r) {
      if (r.status == 200 && offset > 0 && !r.Header("content-range").empty()) {
        // Some servers answer a Range request with 200 and just the slice (and its Content-Range):
        // accept it exactly when the range is the one asked for.
        static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+))");
        std::smatch m;
        std::string cr = r.Header("content-range");
        if (std::regex_search(cr, m, re) && std::stoull(m[1]) == offset && size_known &&
            std::stoull(m[3]) == expected && std::stoull(m[2]) + 1 == expected) {
          return true;
        }
        truncate_to_zero();
        return true;
      }
      if (r.status == 200) {
        if (offset > 0) truncate_to_zero();  // the server ignored Range (or the object changed)
        std::string cl = r.Header("content-length");
        if (!size_known && !cl.empty()) {
          expected = std::stoull(cl);
          size_known = true;
        }
      } else if (r.status == 206) {
        static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+|\*))");
        std::smatch m;
        std::string cr = r.Header("content-range");
        if (!std::regex_search(cr, m, re) || std::stoull(m[1]) != offset ||
            (m[3] != "*" && size_known && std::stoull(m[3]) != expected) ||
            (m[3] != "*" && std::stoull(m[2]) + 1 != std::stoull(m[3]))) {
          range_ok = false;
          bad_range = cr;
          return false;
        }
        if (!size_known && m[3] != "*") {
          expected = std::stoull(m[3]);
          size_known = true;
        }
      } else {
        return true;  // an error body: collected for the message, not written
      }
      std::string enc = r.Header("content-encoding");
      if (!enc.empty() && enc != "identity") {
        bad_range = "Content-Encoding " + enc;
        range_ok = false;
        return false;
      }
      std::string tag = r.Header("etag");
      if (!tag.empty() && tag != etag) {
        etag = tag;
        write_meta(etag);
      }
      return true;
    };
    HttpResponse resp;
    sink.on_data = [&](const char* p, size_t n) {
      if (resp.status != 200 && resp.status != 206) {
        if (resp.body.size() < 4096) resp.body.append(p, std::min<size_t>(n, 4096 - resp.body.size()));
        return true;
      }
      if (size_known && offset + n > expected) {  // longer than the listing says: corrupt
        bad_range = "body longer than the expected size";
        range_ok = false;
        return false;
      }
      wbuf.insert(wbuf.end(), p, p + n);
      if (wbuf.size() >= (1u << 20) || std::chrono::steady_clock::now() - last_flush > std::chrono::milliseconds(500)) {
        flush_wbuf();
        if (!write_error.ok()) return false;
      }
      hasher.Update(p, n);
      offset += n;
      progress_.AddBytes(n);
      return true;
    };
    absl::Status st = http_.Get(req, &resp, &sink);
    flush_wbuf();
    if (!st.ok()) return fail(std::string(StatusMessage(st)));
    if (hub) s_.limiter.Observe(resp);
    if (!write_error.ok()) {
      if (write_error.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
      return fail(std::string(StatusMessage(write_error)));
    }
    const bool progressed = offset > attempt_start;
    if (progressed) {
      no_progress = 0;
      res.fetched = true;
    }
    auto retry = [&](const std::string& why, double sleep_s) -> bool {
      ++s_.retries;
      if (++no_progress > s_.opt.max_retries) {
        res.error = fmt::format("{} (gave up after {} attempts without progress)", why, s_.opt.max_retries);
        return false;
      }
      log::Debug("{}: {}; retrying", f.path, why);
      SleepFor(sleep_s, s_.stop);
      return true;
    };
    if (!range_ok) {
      // Wrong Content-Range or a body that does not fit: start over without Range.
      truncate_to_zero();
      if (!retry(fmt::format("bad partial response ({})", bad_range), 0)) return fail(res.error);
      continue;
    }
    if (resp.curl_code != 0) {
      if (!retry(fmt::format("transfer error: {}", resp.curl_error),
                 progressed ? 0.0 : s_.limiter.Backoff(no_progress)))
        return fail(res.error);
      continue;
    }
    const long code = resp.status;
    if (code >= 300 && code < 400) {
      std::string loc = resp.Header("location");
      if (loc.empty() || ++redirects > 10) return fail(fmt::format("{}: redirect without a usable Location", url));
      std::string linked = resp.Header("x-linked-size");
      if (!linked.empty() && size_known && std::stoull(linked) != expected)
        return fail(fmt::format("the Hub says {} bytes, the listing {}: the listing is stale", linked, expected));
      std::string ltag = StripQuotes(resp.Header("x-linked-etag"));
      if (!ltag.empty() && !f.sha256.empty() && IsHex(ltag, 64) && ltag != f.sha256)
        return fail(fmt::format("the Hub's sha256 {} differs from the listing's {}", ltag, f.sha256));
      url = ResolveUrl(url, loc);
      continue;
    }
    if (code == 200 || code == 206 || code == 416) {
      if (code == 416) {
        static const std::regex re(R"(bytes\s+\*/(\d+))");
        std::smatch m;
        std::string cr = resp.Header("content-range");
        bool complete =
            std::regex_search(cr, m, re) && size_known && std::stoull(m[1]) == expected && offset == expected;
        if (!complete) {
          truncate_to_zero();
          if (!retry(fmt::format("416 with Content-Range {:?}", cr), 0)) return fail(res.error);
          continue;
        }
      }
      if (size_known && offset < expected) {  // the connection ended early but cleanly
        if (!retry(fmt::format("short body ({} of {} bytes)", offset, expected),
                   progressed ? 0 : s_.limiter.Backoff(no_progress)))
          return fail(res.error);
        continue;
      }
      std::string digest = hasher.HexDigest();
      if (!want_digest.empty() && digest != want_digest) {
        ++digest_failures;
        log::Warning("{}: {} mismatch (got {}, want {}); downloading it again", f.path, git ? "git sha1" : "sha256",
                     digest, want_digest);
        truncate_to_zero();
        etag.clear();
        write_meta("");
        if (digest_failures >= 3)
          return fail(fmt::format("{} still mismatches after 3 downloads", git ? "git sha1" : "sha256"));
        url = ResolveUrlFor(f);
        continue;
      }
      absl::Status fin = Finish(f, part, fd);
      ::close(fd);
      if (!fin.ok()) {
        if (fin.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
        res.error = std::string(StatusMessage(fin));
        return res;
      }
      res.ok = true;
      res.bytes = offset;
      return res;
    }
    if (code == 429) {
      ++s_.rate_limited;
      s_.limiter.On429(resp, no_progress);
      if (!hub && !retry("429 from the download host", s_.limiter.Backoff(no_progress))) return fail(res.error);
      if (hub && ++no_progress > s_.opt.max_retries + 20) return fail("rate limited too many times");
      continue;
    }
    if (!hub && (code == 403 || code == 400 || code == 410 || code == 404) && f.url.empty()) {
      // A signed CDN URL that expired or was refused: resolve again (costs one resolve).
      url = ResolveUrlFor(f);
      if (!retry(fmt::format("download host answered {}; resolving again", code), s_.limiter.Backoff(no_progress)))
        return fail(res.error);
      continue;
    }
    if (code == 408 || code >= 500) {
      if (!retry(fmt::format("HTTP {}", code), s_.limiter.Backoff(no_progress))) return fail(res.error);
      continue;
    }
    return fail(fmt::format("{}: {}", url, HubErrorText(resp)));
  }
  ::close(fd);
  res.error = "interrupted";
  return res;
}

}  // namespace

// ---------------------------------------------------------------- public helpers

absl::StatusOr<std::string> SanitizeRepoPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty path in the listing");
  if (path[0] == '/' || path.find('\\') != std::string::npos || path.find('\0') != std::string::npos)
    return absl::InvalidArgumentError(fmt::format("unsafe path in the listing: {:?}", path));
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t e = path.find('/', pos);
    if (e == std::string::npos) e = path.size();
    std::string comp = path.substr(pos, e - pos);
    if (comp.empty() || comp == "." || comp == "..")
      return absl::InvalidArgumentError(fmt::format("unsafe path in the listing: {:?}", path));
    pos = e + 1;
  }
  return path;
}

std::string FlatName(const std::string& repo_path) {
  static const std::regex re(R"(^(?:.*/)?chunk(\d+)/(.+)_(\d+)(\.[^/]+)$)");
  std::smatch m;
  if (std::regex_match(repo_path, m, re))
    return fmt::format("{}_chunk{}_shard{}{}", m[2].str(), m[1].str(), m[3].str(), m[4].str());
  std::string s = repo_path;
  std::replace(s.begin(), s.end(), '/', '_');
  return s;
}

bool GlobMatch(const std::string& pattern, const std::string& path) {
  return ::fnmatch(pattern.c_str(), path.c_str(), 0) == 0;
}

absl::StatusOr<DownloadSummary> RunDownload(const DownloadOptions& opt) {
  const auto t0 = Clock::now();
  if (opt.local_dir.empty()) return absl::InvalidArgumentError("--local-dir is required");
  if (opt.repo.empty() == opt.url_list.empty()) return absl::InvalidArgumentError("give either --repo or --url-list");
  PTK_RETURN_IF_ERROR(MakeDirs(JoinPath(opt.local_dir, kStateDir)));
  Session s(opt);
  HttpClient http;
  DownloadSummary sum;

  std::vector<RemoteFile> files;
  if (!opt.repo.empty()) {
    PTK_ASSIGN_OR_RETURN(sum.commit, PinRevision(s, http));
    const std::string manifest =
        JoinPath(JoinPath(opt.local_dir, kStateDir), fmt::format("manifest-{}.jsonl", sum.commit));
    if (PathExists(manifest)) {
      PTK_ASSIGN_OR_RETURN(files, ReadManifest(manifest));
      log::Info("using the listing of {}@{} saved in {}", opt.repo, sum.commit.substr(0, 12), manifest);
    } else {
      PTK_ASSIGN_OR_RETURN(files, ListTree(s, http, sum.commit));
      std::string text;
      for (const auto& f : files) text += ManifestLine(f);
      PTK_RETURN_IF_ERROR(WriteFileAtomic(manifest, text, /*unique_tmp=*/true));
    }
    std::vector<RemoteFile> kept;
    for (auto& f : files) {
      bool inc = opt.include.empty();
      for (const auto& p : opt.include) inc = inc || GlobMatch(p, f.path);
      for (const auto& p : opt.exclude) inc = inc && !GlobMatch(p, f.path);
      if (inc) kept.push_back(std::move(f));
    }
    files = std::move(kept);
  } else {
    PTK_ASSIGN_OR_RETURN(files, ReadUrlList(opt.url_list));
  }
  std::set<std::string> locals;
  for (auto& f : files) {
    PTK_ASSIGN_OR_RETURN(std::string clean, SanitizeRepoPath(f.path));
    f.local_path = JoinPath(opt.local_dir, opt.flat ? FlatName(clean) : clean);
    if (!locals.insert(f.local_path).second)
      return absl::InvalidArgumentError(fmt::format("two files would be written to {}{}", f.local_path,
                                                    opt.flat ? " (--flat: narrow the selection with --include)" : ""));
  }
  std::sort(files.begin(), files.end(), [](const RemoteFile& a, const RemoteFile& b) { return a.path < b.path; });
  sum.files_total = static_cast<int64_t>(files.size());
  if (opt.list_only) {
    log::Info("{} files selected (listing saved in {}/{})", files.size(), opt.local_dir, kStateDir);
    return sum;
  }
  std::vector<RemoteFile> mine;
  for (size_t i = 0; i < files.size(); ++i)
    if (InShard(static_cast<int64_t>(i), opt.shard)) mine.push_back(files[i]);
  sum.files_in_shard = static_cast<int64_t>(mine.size());

  // What is already there and verified.
  const std::string state = JoinPath(opt.local_dir, kStateDir);
  std::set<std::string> done = ReadDoneLogs(state);
  DoneLog log_file;
  PTK_RETURN_IF_ERROR(
      log_file.Open(JoinPath(state, fmt::format("done-{}-of-{}.tsv", opt.shard.index, opt.shard.count))));
  std::vector<RemoteFile> todo;
  uint64_t todo_bytes = 0, total_bytes = 0;
  for (const auto& f : mine) {
    total_bytes += f.size;
    auto sz = FileSize(f.local_path);
    bool present = sz.ok() && (!f.size_known || *sz == f.size);
    if (present && (opt.verify || !done.count(DoneLogKey(f)))) {
      const bool git = f.sha256.empty() && !f.git_sha1.empty();
      const std::string want = git ? f.git_sha1 : f.sha256;
      if (!want.empty()) {
        auto h = HashFile(f.local_path, git, *sz);
        present = h.ok() && *h == want;
        if (!present) log::Warning("{}: present but its digest does not match; downloading it again", f.local_path);
      } else if (!f.size_known) {
        present = done.count(DoneLogKey(f)) > 0;  // nothing to check it against
      }
      if (present && !done.count(DoneLogKey(f))) PTK_RETURN_IF_ERROR(log_file.Append(DoneLogKey(f)));
    }
    if (present) {
      ++sum.already_present;
    } else {
      todo.push_back(f);
      todo_bytes += f.size;
    }
  }
  struct statvfs vfs;
  if (::statvfs(opt.local_dir.c_str(), &vfs) == 0) {
    uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (free_bytes < todo_bytes)
      log::Warning("{} has {} free but {} are still to download", opt.local_dir, HumanBytes(free_bytes),
                   HumanBytes(todo_bytes));
  }
  log::Info("shard {}/{}: {} of {} files ({}), {} already present and verified, {} to download", opt.shard.index,
            opt.shard.count, mine.size(), files.size(), HumanBytes(static_cast<double>(total_bytes)),
            sum.already_present, todo.size());

  ProgressReporter progress({.label = "download",
                             .item_unit = "files",
                             .items_total = todo.size(),
                             .bytes_total = todo_bytes,
                             .enabled = opt.progress});
  std::mutex mu;
  std::atomic<bool> stop_scheduling{false};
  ParallelForEach(
      todo.size(), opt.jobs,
      [&](size_t i) {
        thread_local std::unique_ptr<HttpClient> client;
        if (!client) client = std::make_unique<HttpClient>();
        FileDownloader dl(s, *client, log_file, progress);
        dl.commit_ = sum.commit;
        FileResult r = dl.Run(todo[i]);
        std::lock_guard<std::mutex> lock(mu);
        if (r.ok) {
          ++sum.downloaded;
          sum.bytes_downloaded += r.bytes;
        } else {
          sum.failures.push_back({todo[i].path, r.error});
          if (!s.disk_full) log::Error("{}: {}", todo[i].path, r.error);
        }
        if (s.disk_full) stop_scheduling = true;
        progress.AddItems(1);
      },
      &stop_scheduling);
  progress.Finish();
  // Make this run's renames and done-log lines durable.
  std::set<std::string> dirs;
  for (const auto& f : todo) dirs.insert(Dirname(f.local_path));
  for (const auto& d : dirs) {
    absl::Status st = FsyncDir(d);
    if (!st.ok() && PathExists(d)) log::Warning("{}", StatusMessage(st));
  }
  absl::Status synced = log_file.Sync();
  if (!synced.ok()) log::Warning("{}", StatusMessage(synced));
  sum.resolves = s.resolves;
  sum.retries = s.retries;
  sum.rate_limited = s.rate_limited;
  sum.disk_full = s.disk_full;
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (sum.disk_full) {
    uint64_t have = 0;
    if (::statvfs(opt.local_dir.c_str(), &vfs) == 0) have = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    return absl::ResourceExhaustedError(fmt::format(
        "disk full under {}: stopped with {} file(s) left; partial downloads are kept as .part files and resume "
        "on the next run ({} free, about {} still needed)",
        opt.local_dir, todo.size() - static_cast<size_t>(sum.downloaded), HumanBytes(static_cast<double>(have)),
        HumanBytes(static_cast<double>(todo_bytes - sum.bytes_downloaded))));
  }
  return sum;
}

absl::StatusOr<std::string> FindHfToken(const std::string& token_file) {
  auto read = [](const std::string& p) -> absl::StatusOr<std::string> {
    PTK_ASSIGN_OR_RETURN(std::string s, ReadFileToString(p));
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
    return s;
  };
  auto read_if_exists = [&](const std::string& p) -> std::string {
    auto t = read(p);
    return t.ok() ? *t : "";
  };
  if (!token_file.empty()) {
    auto t = read(token_file);
    if (!t.ok()) return Annotate(t.status(), "--token-file");
    return *t;
  }
  if (const char* t = std::getenv("HF_TOKEN"); t && *t) return std::string(t);
  if (const char* p = std::getenv("HF_TOKEN_PATH"); p && *p) return read_if_exists(p);
  if (const char* h = std::getenv("HF_HOME"); h && *h) return read_if_exists(JoinPath(h, "token"));
  if (const char* home = std::getenv("HOME"); home && *home)
    return read_if_exists(JoinPath(home, ".cache/huggingface/token"));
  return std::string();
}

}  // namespace ptk
