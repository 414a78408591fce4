// ptk-download: one large file fetched as byte ranges over several connections at once.
//
// The file is cut into pieces; connections take the first piece nobody has, ask for its bytes
// (Range, If-Range on the object's ETag), check the answer (206, its Content-Range exactly the range
// asked, the same ETag) and write the body in place with pwrite. The first connection alone resolves
// the URL (one resolve per file); the others start once its first 206 has shown where the bytes are.
// The worker's thread meanwhile hashes the contiguous prefix as it grows (pieces are taken in order,
// so the hash follows a piece or so behind), records each piece's progress in the `.part.json`
// twice a second (a kill resumes each piece where it was) and opens more connections while slots
// are free. Whatever a piece's server does wrong costs that piece a retry, never a splice: a changed
// object starts the file over, a server that ignores Range has the file fetched over one connection,
// and the whole file's digest is checked before it is published.
#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "dataprep/download/download_internal.h"
#include "dataprep/download/publish_part.h"

namespace ptk::download_detail {

bool FileDownloader::Ranged(const RemoteFile& f) const {
  const DownloadOptions& o = s_.opt;
  return o.connections_per_file > 1 && f.size_known && f.size > 0 && f.size >= o.split_above &&
         !(f.sha256.empty() && f.git_sha1.empty());
}

namespace {

uint64_t PieceSize(const DownloadOptions& o, uint64_t size) {
  if (o.piece_size > 0) return o.piece_size;
  // Eight pieces a connection: the last pieces end close together, and the hash is never far behind.
  const uint64_t p =
      std::clamp<uint64_t>(size / (8ull * static_cast<uint64_t>(o.connections_per_file)), 1ull << 20, 32ull << 20);
  return (p + 65535) / 65536 * 65536;
}

}  // namespace

class RangedFetch {
 public:
  RangedFetch(FileDownloader& d, const RemoteFile& f, FileResult& res)
      : d_(d),
        s_(d.s_),
        f_(f),
        res_(res),
        budget_(d.s_, f.path),
        path_(f.local_path + ".part"),
        meta_path_(path_ + ".json"),
        git_(f.sha256.empty()),
        want_(git_ ? f.git_sha1 : f.sha256),
        piece_size_(PieceSize(d.s_.opt, f.size)),
        resolve_url_(d.ResolveUrlFor(f)),
        url_(resolve_url_) {}
  ~RangedFetch() {
    if (fd_ < 0) return;
    d_.hasher_.Abandon();
    ::close(fd_);
  }

  absl::Status Run(std::unique_ptr<OutputLock>& lock) {
    PTK_RETURN_IF_ERROR(Open());
    ++s_.ranged_files;
    while (true) {
      absl::Status transferred = Transfer();
      if (absl::IsUnimplemented(transferred)) {  // fetched over one connection instead, from byte 0
        std::lock_guard<std::mutex> l(mu_);
        d_.progress_.TakeBackBytes(DoneLocked());
      }
      PTK_RETURN_IF_ERROR(transferred);
      PTK_ASSIGN_OR_RETURN(const std::string got, d_.hasher_.Finish(f_.size));
      if (got == want_) break;
      log::Warning("{}: {} mismatch (got {}, want {}); downloading it again", f_.path, git_ ? "git sha1" : "sha256",
                   got, want_);
      if (++digest_failures_ >= 3)
        return absl::UnavailableError(
            fmt::format("{} still mismatches after 3 downloads", git_ ? "git sha1" : "sha256"));
      std::lock_guard<std::mutex> l(mu_);
      StartOverLocked();
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      WriteMetaLocked();  // all pieces done: a kill before the publish needs no transfer
    }
    res_.fetched = true;
    res_.bytes = f_.size;
    return PublishPart(s_, d_.done_, f_, &fd_, path_, meta_path_, f_.size, std::move(lock));
  }

 private:
  struct Piece {
    uint64_t start = 0, end = 0, done = 0;
    bool active = false;
    uint64_t size() const { return end - start; }
  };
  enum class Verdict { kNone, kStale, kUnsupported, kChanged };

  std::string MetaKey() const { return fmt::format("{}\t{}\tpieces of {}", f_.size, want_, piece_size_); }

  // The `.part` (as long as the file, sparse) and its record: resumed piece by piece when the record
  // is of this file cut the same way; otherwise started over.
  absl::Status Open() {
    for (uint64_t at = 0; at < f_.size; at += piece_size_)
      pieces_.push_back(Piece{at, std::min(f_.size, at + piece_size_), 0, false});
    bool resumed = false;
    if (auto meta = ReadFileToString(meta_path_); meta.ok()) {
      std::vector<std::string> lines;
      for (size_t pos = 0; pos < meta->size();) {
        size_t nl = meta->find('\n', pos);
        if (nl == std::string::npos) nl = meta->size();
        lines.push_back(meta->substr(pos, nl - pos));
        pos = nl + 1;
      }
      if (lines.size() >= 3 && lines[0] == MetaKey()) {
        std::vector<uint64_t> done;
        for (size_t pos = 0; pos < lines[2].size();) {
          size_t sp = lines[2].find(' ', pos);
          if (sp == std::string::npos) sp = lines[2].size();
          auto v = ParseUint64(lines[2].substr(pos, sp - pos));
          if (!v) break;
          done.push_back(*v);
          pos = sp + 1;
        }
        resumed = done.size() == pieces_.size();
        for (size_t i = 0; resumed && i < done.size(); ++i) resumed = done[i] <= pieces_[i].size();
        if (resumed) {
          etag_ = lines[1];
          for (size_t i = 0; i < done.size(); ++i) pieces_[i].done = done[i];
        }
      }
    }
    if (!resumed) (void)RemoveFileIfExists(path_);
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) return ErrnoToStatus(errno, fmt::format("open {}", path_));
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path_));
    if (static_cast<uint64_t>(st.st_size) != f_.size && ::ftruncate(fd_, static_cast<off_t>(f_.size)) != 0)
      return ErrnoToStatus(errno, fmt::format("extend {} to {} bytes", path_, f_.size));
    const uint64_t have = DoneLocked();  // no connection yet
    if (have > 0)
      log::Info("{}: resuming {} of {} bytes in {} pieces", log::Printable(f_.path), have, f_.size, pieces_.size());
    d_.progress_.AddBytes(have);
    std::lock_guard<std::mutex> l(mu_);
    d_.hasher_.Start(fd_, git_, f_.size);
    d_.hasher_.Advance(PrefixLocked());
    return absl::OkStatus();
  }

  void WriteMetaLocked() {
    std::string done;
    for (const auto& p : pieces_) done += fmt::format("{}{}", done.empty() ? "" : " ", p.done);
    (void)WriteFileAtomic(meta_path_, fmt::format("{}\n{}\n{}\n", MetaKey(), etag_, done), /*durable=*/false);
    dirty_ = false;
  }
  // The bytes the pieces hold: what the progress line counts of this file.
  uint64_t DoneLocked() const {
    uint64_t done = 0;
    for (const auto& p : pieces_) done += p.done;
    return done;
  }
  uint64_t PrefixLocked() const {
    uint64_t prefix = 0;
    for (const auto& p : pieces_) {
      prefix = p.start + p.done;
      if (p.done < p.size()) break;
    }
    return prefix;
  }
  bool AllDoneLocked() const {
    for (const auto& p : pieces_)
      if (p.done < p.size()) return false;
    return true;
  }
  bool WaitingPieceLocked() const {
    for (const auto& p : pieces_)
      if (!p.active && p.done < p.size()) return true;
    return false;
  }
  // The bytes cannot be trusted (another version of the object, a digest mismatch): every piece
  // from its start, the URL resolved again, the hash from byte 0.
  void StartOverLocked() {
    ++gen_;
    d_.progress_.TakeBackBytes(DoneLocked());
    for (auto& p : pieces_) p.done = 0;
    etag_.clear();
    settled_ = false;
    url_ = resolve_url_;
    d_.hasher_.Start(fd_, git_, f_.size);
    WriteMetaLocked();
  }

  // Runs connections until every piece is complete (or the file fails).
  absl::Status Transfer() {
    std::vector<std::thread> conns;
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = false;
    auto spawn = [&](bool extra) {
      ++active_conns_;
      conns.emplace_back([this, extra] { Connection(extra); });
    };
    auto last_meta = Clock::now();
    while (!AllDoneLocked() && fatal_.ok() && !unsupported_ && !s_.stop) {
      // The worker's own slot keeps one connection; more while pieces wait and slots are free
      // (none after a 429 from this file's server).
      if (active_conns_ == 0) {
        spawn(false);
      } else if (settled_ && !throttled_ && active_conns_ < s_.opt.connections_per_file && WaitingPieceLocked() &&
                 s_.slots.TryAcquire()) {
        spawn(true);
      }
      d_.hasher_.Advance(PrefixLocked());
      if (dirty_ && Clock::now() - last_meta > std::chrono::milliseconds(500)) {
        WriteMetaLocked();
        last_meta = Clock::now();
      }
      cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
    stop_ = true;
    lock.unlock();
    cv_.notify_all();
    for (auto& t : conns) t.join();
    lock.lock();
    d_.hasher_.Advance(PrefixLocked());
    WriteMetaLocked();
    if (!fatal_.ok()) return fatal_;
    if (unsupported_) return absl::UnimplementedError(unsupported_why_);
    if (s_.stop) return absl::CancelledError("interrupted");
    return absl::OkStatus();
  }

  // One connection: pieces, one after another, until none waits.
  void Connection(bool extra) {
    HttpClient http;
    while (true) {
      Piece* piece = nullptr;
      uint64_t gen;
      std::string url;
      bool leader;
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Until a 206 has shown where the bytes are, one connection at a time asks (resolves).
        cv_.wait(lock, [&] { return stop_ || settled_ || !leader_busy_; });
        if (stop_ || leave_) break;
        for (auto& p : pieces_)
          if (!p.active && p.done < p.size()) {
            piece = &p;
            break;
          }
        if (!piece) break;
        piece->active = true;
        gen = gen_;
        leader = !settled_;
        if (leader) leader_busy_ = true;
        url = url_;
      }
      absl::Status st = FetchPiece(http, *piece, gen, std::move(url), leader);
      std::lock_guard<std::mutex> lock(mu_);
      piece->active = false;
      if (leader) leader_busy_ = false;
      if (!st.ok() && fatal_.ok()) fatal_ = st;
      if (!st.ok()) stop_ = true;
      cv_.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --active_conns_;
      leave_ = false;
    }
    cv_.notify_all();
    if (extra) s_.slots.Release();
  }

  // Checks a 200/206 to the request for bytes [from, end) before a byte of its body is written.
  bool AcceptHeaders(const HttpResponse& r, uint64_t from, uint64_t end, uint64_t gen, const std::string& url,
                     std::string* problem, Verdict* verdict) {
    const std::string tag = r.Header("etag");
    const std::string cr = r.Header("content-range");
    std::lock_guard<std::mutex> lock(mu_);
    if (gen != gen_) {
      *verdict = Verdict::kStale;
      return false;
    }
    if (r.status == 200) {
      // A 200 is the whole object from byte 0, whatever was asked (RFC 9110 14.4).
      if (!seen_206_) {
        *verdict = Verdict::kUnsupported;
        unsupported_why_ = fmt::format("the server answered a range request with the whole file (HTTP 200{})",
                                       cr.empty() ? "" : ", Content-Range " + cr);
        return false;
      }
      if (!etag_.empty() && !tag.empty() && tag != etag_) {
        *verdict = Verdict::kChanged;
        changed_why_ = fmt::format("a 200 with ETag {} for a file started with ETag {}: the file changed on the server",
                                   tag, etag_);
        return false;
      }
      *problem = fmt::format("a 200 (the whole file) to a request for bytes {}-{}", from, end - 1);
      return false;
    }
    static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+))");
    std::smatch m;
    if (!std::regex_search(cr, m, re) || ParseUint64(m[1].str()) != from || ParseUint64(m[2].str()) != end - 1 ||
        ParseUint64(m[3].str()) != f_.size) {
      *problem = cr.empty() ? fmt::format("a 206 without Content-Range for bytes {}-{}", from, end - 1)
                            : fmt::format("Content-Range {:?} for bytes {}-{}/{}", cr, from, end - 1, f_.size);
      return false;
    }
    // A 206 whose Content-Length is not its Content-Range's length is the wrong size whatever its bytes.
    const std::string len = r.Header("content-length");
    if (!len.empty() && ParseUint64(len) != end - from) {
      *problem =
          fmt::format("bytes {}-{}: {} bytes for the {} asked (its Content-Length)", from, end - 1, len, end - from);
      return false;
    }
    const std::string enc = r.Header("content-encoding");
    if (!enc.empty() && enc != "identity") {
      *problem = "Content-Encoding " + enc;
      return false;
    }
    if (!etag_.empty() && tag != etag_) {
      *verdict = Verdict::kChanged;
      changed_why_ = fmt::format("a 206 with ETag {} for a file started with ETag {}: the file changed on the server",
                                 tag.empty() ? "(none)" : tag, etag_);
      return false;
    }
    seen_206_ = true;
    if (!settled_) {
      settled_ = true;
      url_ = url;
      if (etag_.empty()) etag_ = tag;
      WriteMetaLocked();
      cv_.notify_all();
    }
    return true;
  }

  // One request of a piece: the bytes asked [from, end), how far its body got (pos), the answer, and
  // what went wrong with it.
  struct Attempt {
    uint64_t from = 0, end = 0, pos = 0;
    HttpResponse resp;
    std::string problem;
    Verdict verdict = Verdict::kNone;
    absl::Status write_error;
  };
  // The sink of an attempt at `piece`: the headers checked before a byte of the body is written, the
  // body written in place from libcurl's receive buffer and counted (unless the pieces started over
  // meanwhile), an error body kept for the message.
  BodySink PieceSink(Attempt& a, Piece& piece, uint64_t gen, const std::string& url) {
    BodySink sink;
    sink.on_headers = [this, &a, gen, &url](const HttpResponse& r) {
      return (r.status != 200 && r.status != 206) || AcceptHeaders(r, a.from, a.end, gen, url, &a.problem, &a.verdict);
    };
    sink.on_data = [this, &a, &piece, gen](const char* p, size_t n) {
      if (a.resp.status != 200 && a.resp.status != 206) {
        if (a.resp.body.size() < 4096) a.resp.body.append(p, std::min<size_t>(n, 4096 - a.resp.body.size()));
        return true;
      }
      if (stop_) return false;
      if (a.pos + n > a.end) {
        a.problem = fmt::format("bytes {}-{}: at least {} bytes for the {} asked", a.from, a.end - 1,
                                a.pos - a.from + n, a.end - a.from);
        return false;
      }
      a.write_error = PwriteAll(fd_, p, n, a.pos, path_);
      if (!a.write_error.ok()) return false;
      a.pos += n;
      std::lock_guard<std::mutex> lock(mu_);
      if (gen != gen_) return false;
      piece.done = a.pos - piece.start;
      dirty_ = true;
      d_.progress_.AddBytes(n);
      return true;
    };
    return sink;
  }

  // One piece's requests (redirects followed) until it is complete or this connection should take
  // another (a failure retried later). A non-OK status fails the file.
  absl::Status FetchPiece(HttpClient& http, Piece& piece, uint64_t gen, std::string url, bool leader) {
    int redirects = 0;
    while (!stop_) {
      {
        // A 429 from the download host (on any connection): no request before the wait it asked for.
        std::unique_lock<std::mutex> lock(mu_);
        while (!stop_ && Clock::now() < paused_until_) cv_.wait_until(lock, paused_until_);
        if (stop_) return absl::OkStatus();
      }
      const bool hub = d_.IsHub(url);
      RateLimiter::InFlight resolve;
      if (hub && f_.url.empty()) {
        PTK_RETURN_IF_ERROR(s_.limiter.WaitForResolve(s_.stop, budget_.Deadline(), s_.opt.max_retry_time_s, &resolve));
        ++s_.resolves;
      }
      uint64_t from, end;
      HttpRequest req = s_.Req(url);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != gen_ || stop_) return absl::OkStatus();
        from = piece.start + piece.done;
        end = piece.end;
        if (from >= end) return absl::OkStatus();
        req.headers.push_back(fmt::format("Range: bytes={}-{}", from, end - 1));
        if (IsStrongEtag(etag_)) req.headers.push_back("If-Range: " + etag_);
      }
      ++s_.range_requests;
      Attempt a;
      a.from = from;
      a.end = end;
      a.pos = from;
      BodySink sink = PieceSink(a, piece, gen, url);
      PTK_RETURN_IF_ERROR(http.Get(req, &a.resp, &sink));
      const HttpResponse& resp = a.resp;
      if (hub) s_.limiter.Observe(resp);
      resolve.Release();
      PTK_RETURN_IF_ERROR(a.write_error);
      if (a.resp.curl_code == 0 && a.resp.status == 206 && a.problem.empty() && a.pos < end)
        a.problem = fmt::format("bytes {}-{}: {} bytes for the {} asked", from, end - 1, a.pos - from, end - from);
      if (!a.problem.empty()) DiscardAttempt(a, piece, gen);  // a wrong-size answer: none of its bytes kept
      const bool progressed = a.pos > from;
      if (progressed) budget_.Progressed();
      if (a.verdict != Verdict::kNone) return OnVerdict(a.verdict, gen);
      if (!a.problem.empty())
        return budget_.Again(fmt::format("bad range response ({})", a.problem), budget_.Backoff(false));
      if (stop_) return absl::OkStatus();
      if (resp.curl_code != 0)
        return budget_.Again(fmt::format("bytes {}-{}: transfer error: {}", from, end - 1, resp.curl_error),
                             budget_.Backoff(progressed));
      const long code = resp.status;
      if (code >= 300 && code < 400) {
        PTK_ASSIGN_OR_RETURN(url, Redirect(resp, url, ++redirects));
        if (leader) {
          std::lock_guard<std::mutex> lock(mu_);
          if (gen == gen_) url_ = url;
        }
        continue;
      }
      // The whole range: a clean end short of it is a wrong-size answer above, a broken connection a transfer error
      // (the bytes it brought kept, the rest asked again).
      if (code == 206) return absl::OkStatus();
      if (code == 429) return OnRateLimited(resp, hub);
      if (!hub && (code == 403 || code == 400 || code == 410 || code == 404) && f_.url.empty())
        return OnUrlRefused(code, gen, url);
      if (code == 408 || code >= 500 || code == 416)  // after the wait a Retry-After names, else a backoff
        return budget_.Again(fmt::format("HTTP {} for bytes {}-{}", code, from, end - 1),
                             RetryAfterSeconds(resp).value_or(budget_.Backoff(false)));
      return absl::UnavailableError(fmt::format("{}: {}", url, HubErrorText(resp)));
    }
    return absl::OkStatus();
  }

  // Forgets what an answer of the wrong size wrote of `piece`: the piece asks again from where the
  // attempt began, and the hash, if it has read past there, starts again from byte 0.
  void DiscardAttempt(Attempt& a, Piece& piece, uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu_);
    if (a.pos == a.from || gen != gen_) return;
    const bool hashed_past = PrefixLocked() > a.from;
    d_.progress_.TakeBackBytes(a.pos - a.from);
    piece.done = a.from - piece.start;
    a.pos = a.from;
    dirty_ = true;
    if (hashed_past) {
      d_.hasher_.Start(fd_, git_, f_.size);
      d_.hasher_.Advance(PrefixLocked());
    }
  }

  // What AcceptHeaders decided against the answer: the piece given up (stale), the file fetched
  // whole instead (ranges unsupported), or started over (it changed on the server).
  absl::Status OnVerdict(Verdict verdict, uint64_t gen) {
    switch (verdict) {
      case Verdict::kUnsupported: {
        std::lock_guard<std::mutex> lock(mu_);
        unsupported_ = true;
        stop_ = true;
        return absl::OkStatus();
      }
      case Verdict::kChanged: {
        std::string why;
        {
          std::lock_guard<std::mutex> lock(mu_);
          why = changed_why_.empty() ? "the file changed on the server" : changed_why_;
          if (gen == gen_) StartOverLocked();
        }
        return budget_.Again(why + "; starting over", 0);
      }
      case Verdict::kStale:
      case Verdict::kNone: break;
    }
    return absl::OkStatus();
  }

  // A 429 to a piece: no more connections for this file, and one fewer; from the download host, no
  // request of this file to it before the wait it asks for.
  absl::Status OnRateLimited(const HttpResponse& resp, bool hub) {
    ++s_.rate_limited;
    const double wait_s = s_.limiter.On429(resp, budget_.failures());
    {
      std::lock_guard<std::mutex> lock(mu_);
      throttled_ = true;
      if (active_conns_ > 1) leave_ = true;
      if (!hub) {
        paused_until_ =
            std::max(paused_until_,
                     Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s)));
      }
    }
    if (!hub) return budget_.Again("429 from the download host", wait_s);
    if (budget_.AddFailure() > s_.opt.max_retries + 20) return absl::UnavailableError("rate limited too many times");
    return absl::OkStatus();
  }

  // A signed CDN URL that expired or was refused: resolve again (costs one resolve).
  absl::Status OnUrlRefused(long code, uint64_t gen, const std::string& url) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gen == gen_ && url_ == url) {
        settled_ = false;
        url_ = resolve_url_;
      }
    }
    return budget_.Again(fmt::format("download host answered {}; resolving again", code), budget_.Backoff(false));
  }

  // A redirect, checked as a single-stream fetch checks it (the Hub's X-Linked-* against the listing).
  absl::StatusOr<std::string> Redirect(const HttpResponse& resp, const std::string& url, int hops) {
    const std::string loc = resp.Header("location");
    if (loc.empty()) return absl::UnavailableError(fmt::format("{}: redirect without a Location", url));
    if (hops > kMaxRedirects)
      return absl::UnavailableError(fmt::format("{}: more than {} redirects (a redirect loop?)", url, kMaxRedirects));
    const std::string linked = resp.Header("x-linked-size");
    if (!linked.empty() && !ParseUint64(linked))
      return absl::UnavailableError(fmt::format("the Hub sent a malformed X-Linked-Size {:?}", linked));
    if (!linked.empty() && ParseUint64(linked) != f_.size)
      return absl::UnavailableError(
          fmt::format("the Hub says {} bytes, the listing {}: the listing is stale", linked, f_.size));
    const std::string ltag = StripQuotes(resp.Header("x-linked-etag"));
    if (!ltag.empty() && !f_.sha256.empty() && IsHex(ltag, 64) && ltag != f_.sha256)
      return absl::UnavailableError(fmt::format("the Hub's sha256 {} differs from the listing's {}", ltag, f_.sha256));
    const std::string next = ResolveUrl(url, loc);
    if (!IsHttpUrl(next))
      return absl::UnavailableError(
          fmt::format("{}: redirected to {:?}; only http:// and https:// are followed", url, next));
    return next;
  }

  FileDownloader& d_;
  Session& s_;
  const RemoteFile& f_;
  FileResult& res_;
  RetryBudget budget_;
  const std::string path_, meta_path_;
  const bool git_;
  const std::string want_;
  const uint64_t piece_size_;
  const std::string resolve_url_;
  int fd_ = -1;
  int digest_failures_ = 0;

  std::mutex mu_;  // guards what follows
  std::condition_variable cv_;
  std::vector<Piece> pieces_;  // never resized once open: connections hold pointers
  uint64_t gen_ = 0;           // bumped when the pieces start over: older requests' bytes are dropped
  std::string url_;            // where the next request goes (the CDN's once settled)
  std::string etag_;           // the object's, from the record or the first 206
  bool settled_ = false, leader_busy_ = false, seen_206_ = false;
  bool dirty_ = false, throttled_ = false, leave_ = false;
  Clock::time_point paused_until_{};  // no request of this file before (a 429 from its download host)
  std::atomic<bool> stop_{false};
  bool unsupported_ = false;
  std::string unsupported_why_, changed_why_;
  int active_conns_ = 0;
  absl::Status fatal_;
};

absl::Status FileDownloader::RunRanged(const RemoteFile& f, FileResult& res, std::unique_ptr<OutputLock>& lock) {
  return RangedFetch(*this, f, res).Run(lock);
}

}  // namespace ptk::download_detail
