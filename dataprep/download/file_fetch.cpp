// ptk-download: one file fetched, resumed and verified.
//
// Three parts: PartFile (the `.part` on disk, its running digest and what is known of the remote
// object), RetryBudget (how long one file keeps being retried) and FileFetch (the loop of HTTP
// attempts and what each answer means).
#include "dataprep/download/download_internal.h"

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
#include "common/output_lock.h"

namespace ptk::download_detail {

absl::StatusOr<std::string> HashFile(const std::string& path, bool git, uint64_t size) {
  Sha256 h(git ? Sha256::Algorithm::kSha1 : Sha256::Algorithm::kSha256);
  if (git) {
    std::string hdr = fmt::format("blob {}", size);
    h.Update(hdr.data(), hdr.size() + 1);  // includes the NUL
  }
  PTK_RETURN_IF_ERROR(ReadFileChunks(path, 1 << 20, [&](const char* p, size_t n) { h.Update(p, n); }));
  return h.HexDigest();
}

namespace {

// A strong entity tag ("xyzzy", not W/"xyzzy"): the only kind If-Range may carry (RFC 9110 13.1.5).
bool IsStrongEtag(const std::string& tag) { return tag.size() >= 2 && tag.front() == '"' && tag.back() == '"'; }

// The `.part` of one file: the bytes received so far, their running digest, and what the
// transfers learnt of the remote object (its size, its ETag). Closed on destruction.
class PartFile {
 public:
  explicit PartFile(const RemoteFile& f)
      : f_(f),
        path_(f.local_path + ".part"),
        meta_path_(path_ + ".json"),
        git_(f.sha256.empty() && !f.git_sha1.empty()),
        want_digest_(git_ ? f.git_sha1 : f.sha256),
        hasher_(git_ ? Sha256::Algorithm::kSha1 : Sha256::Algorithm::kSha256),
        expected_(f.size),
        size_known_(f.size_known) {
    wbuf_.reserve(kWriteSize);
  }
  ~PartFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  PartFile(const PartFile&) = delete;
  PartFile& operator=(const PartFile&) = delete;

  // Opens the `.part` (never through a symlink: a planted link would make the download overwrite
  // its target) and resumes it when its record says it was started for this very file (same size
  // and digest); otherwise starts over. The bytes already there are re-read for the digest.
  absl::Status Open(ProgressReporter& progress) {
    auto meta = ReadFileToString(meta_path_);
    if (meta.ok()) {
      const size_t nl = meta->find('\n');
      if (meta->substr(0, nl) != MetaKey())
        (void)RemoveFileIfExists(path_);
      else if (nl != std::string::npos)
        etag_ = meta->substr(nl + 1);
    } else if (PathExists(path_)) {
      (void)RemoveFileIfExists(path_);  // no record of what it was: start over
    }
    while (!etag_.empty() && (etag_.back() == '\n' || etag_.back() == '\r')) etag_.pop_back();
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) return ErrnoToStatus(errno, fmt::format("open {}", path_));
    WriteMeta();
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path_));
    offset_ = static_cast<uint64_t>(st.st_size);
    if (size_known_ && offset_ > expected_) {
      (void)::ftruncate(fd_, 0);
      offset_ = 0;
    }
    ::lseek(fd_, static_cast<off_t>(offset_), SEEK_SET);
    RestartHash();
    std::vector<char> buf(offset_ > 0 ? kWriteSize : 0);
    for (uint64_t done = 0; done < offset_;) {
      ssize_t n = ::pread(fd_, buf.data(), std::min<uint64_t>(buf.size(), offset_ - done), static_cast<off_t>(done));
      if (n <= 0) break;
      hasher_.Update(buf.data(), static_cast<size_t>(n));
      done += static_cast<uint64_t>(n);
    }
    progress.AddBytes(offset_);
    return absl::OkStatus();
  }

  // Before each attempt: what is there now, and no problem yet.
  void BeginAttempt() {
    attempt_start_ = offset_;
    problem_.clear();
  }
  bool Progressed() const { return offset_ > attempt_start_; }
  // A response that does not fit this `.part` (a wrong Content-Range, a body longer than the file,
  // an encoded body): the transfer was stopped and the bytes must not be kept.
  const std::string& problem() const { return problem_; }

  // Whether the bytes of the `.part` may be continued with a Range request. A resume must be able
  // to prove that it continues the same object: a strong ETag (sent as If-Range, and required on
  // the 206), or a digest that checks the whole file once it is complete. Without either (a URL
  // list with no sha256 from a server that sends no ETag) a `.part` is never continued.
  bool Resumable() const { return IsStrongEtag(etag_) || !want_digest_.empty(); }
  bool IfRangeUsable() const { return IsStrongEtag(etag_); }

  // The response headers of a 200 or 206: accepted when they continue this `.part` (or start it
  // over, which truncates it); false, with problem() set, when they cannot. Never a splice: a
  // response that cannot show it continues the bytes already there starts the file over.
  bool AcceptHeaders(const HttpResponse& r) {
    const std::string tag = r.Header("etag");
    const std::string cr = r.Header("content-range");
    if (r.status == 200) {
      // A 200 is the whole object from byte 0, whatever was asked (RFC 9110 14.4: Content-Range
      // means something on a 206 and a 416 only). A server that sends a slice with a 200 is caught
      // by its length, or by a Content-Range that does not cover the whole body.
      if (offset_ > 0) Restart();
      const std::string cl = r.Header("content-length");
      std::optional<uint64_t> length;
      if (!cl.empty()) {
        length = ParseUint64(cl);
        if (!length) return Refuse(fmt::format("Content-Length {:?}", cl));
        if (size_known_ && *length != expected_)
          return Refuse(
              fmt::format("a 200 of {} bytes for a file of {} bytes (Content-Range {:?})", *length, expected_, cr));
      }
      if (!cr.empty()) {
        static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+))");
        std::smatch m;
        const bool whole = std::regex_search(cr, m, re) && ParseUint64(m[1].str()) == 0u && ParseUint64(m[3].str()) &&
                           ParseUint64(m[2].str()) == *ParseUint64(m[3].str()) - 1 &&
                           (!length || ParseUint64(m[3].str()) == *length) &&
                           (!size_known_ || ParseUint64(m[3].str()) == expected_);
        if (!whole)
          return Refuse(
              fmt::format("a 200 with Content-Range {:?}: a 200's body starts at byte 0, this one says it "
                          "does not",
                          cr));
      }
      if (length && !size_known_) {
        expected_ = *length;
        size_known_ = true;
      }
    } else {  // 206
      static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+|\*))");
      std::smatch m;
      const bool matched = std::regex_search(cr, m, re);
      const auto first = matched ? ParseUint64(m[1].str()) : std::nullopt;
      const auto last = matched ? ParseUint64(m[2].str()) : std::nullopt;
      const bool star = matched && m[3] == "*";
      const auto total = matched && !star ? ParseUint64(m[3].str()) : std::nullopt;
      if (!matched || !first || !last || (!star && !total) || *first != offset_ ||
          (total && size_known_ && *total != expected_) || (total && (*total == 0 || *last != *total - 1)))
        return Refuse(cr.empty() ? std::string("a 206 without Content-Range") : fmt::format("Content-Range {:?}", cr));
      // The 206 must be of the object the `.part` was started with: the same ETag (strong
      // comparison, as If-Range uses). A server or cache that ignored If-Range is caught here.
      if (offset_ > 0 && !etag_.empty() && tag != etag_)
        return Refuse(
            fmt::format("a 206 with ETag {} for a .part started with ETag {}: the file changed on the "
                        "server, starting over",
                        tag.empty() ? "(none)" : tag, etag_));
      if (!size_known_ && total) {
        expected_ = *total;
        size_known_ = true;
      }
    }
    const std::string enc = r.Header("content-encoding");
    if (!enc.empty() && enc != "identity") return Refuse("Content-Encoding " + enc);
    if (offset_ == 0 && tag != etag_) {  // the .part starts here: it is of this object
      etag_ = tag;
      WriteMeta();
    }
    return true;
  }

  // Body bytes of an accepted response. They are gathered into writes of 1 MiB, or of what came in
  // the last half second on a slow link (so a kill loses little); Flush() writes the rest.
  bool AcceptBody(const char* p, size_t n, ProgressReporter& progress) {
    if (size_known_ && offset_ + n > expected_) return Refuse("body longer than the expected size");
    wbuf_.insert(wbuf_.end(), p, p + n);
    if (wbuf_.size() >= kWriteSize || std::chrono::steady_clock::now() - last_flush_ > std::chrono::milliseconds(500)) {
      Flush();
      if (!write_error_.ok()) return false;
    }
    hasher_.Update(p, n);
    offset_ += n;
    progress.AddBytes(n);
    return true;
  }
  void Flush() {
    last_flush_ = std::chrono::steady_clock::now();
    if (wbuf_.empty() || !write_error_.ok()) return;
    write_error_ = WriteAll(fd_, wbuf_.data(), wbuf_.size(), path_);
    wbuf_.clear();
  }
  const absl::Status& write_error() const { return write_error_; }

  // Empties the `.part`: the next attempt starts from byte 0.
  void Restart() {
    wbuf_.clear();
    (void)::ftruncate(fd_, 0);
    ::lseek(fd_, 0, SEEK_SET);
    offset_ = 0;
    RestartHash();
  }
  // After a digest mismatch: start over and forget the ETag (the next transfer must not resume).
  void Discard() {
    Restart();
    etag_.clear();
    WriteMeta();
  }
  // Whether the bytes are the file's, by its listed digest (no digest listed: by size alone).
  bool DigestMatches(std::string* got) {
    *got = hasher_.HexDigest();
    return want_digest_.empty() || *got == want_digest_;
  }
  // The data is durable before the rename; the directories (the renames) are fsynced once per run,
  // at its end (a rename lost in a crash leaves a complete, fsynced `.part` to resume).
  absl::Status MoveIntoPlace() {
    PTK_RETURN_IF_ERROR(FsyncFile(fd_, path_));
    PTK_RETURN_IF_ERROR(RenameFile(path_, f_.local_path));
    (void)RemoveFileIfExists(meta_path_);
    return absl::OkStatus();
  }

  uint64_t offset() const { return offset_; }
  uint64_t expected() const { return expected_; }
  bool size_known() const { return size_known_; }
  const std::string& etag() const { return etag_; }
  const std::string& want_digest() const { return want_digest_; }
  const char* digest_name() const { return git_ ? "git sha1" : "sha256"; }

 private:
  static constexpr size_t kWriteSize = 1 << 20;
  std::string MetaKey() const { return fmt::format("{}\t{}", f_.size, want_digest_); }
  // What the `.part` is (size, digest, ETag): atomic but not fsynced. Losing it in a crash only
  // means the `.part` is not resumed; a stale one cannot pass the final size + digest check.
  void WriteMeta() { (void)WriteFileAtomic(meta_path_, fmt::format("{}\n{}\n", MetaKey(), etag_), /*durable=*/false); }
  void RestartHash() {
    hasher_.Reset();
    if (git_) {
      const std::string hdr = fmt::format("blob {}", f_.size);
      hasher_.Update(hdr.data(), hdr.size() + 1);
    }
  }
  bool Refuse(std::string why) {
    problem_ = std::move(why);
    return false;
  }

  const RemoteFile& f_;
  const std::string path_, meta_path_;
  const bool git_;
  const std::string want_digest_;
  Sha256 hasher_;
  int fd_ = -1;
  uint64_t offset_ = 0, attempt_start_ = 0, expected_;
  bool size_known_;
  std::string etag_, problem_;
  std::vector<char> wbuf_;
  std::chrono::steady_clock::time_point last_flush_ = std::chrono::steady_clock::now();
  absl::Status write_error_;
};

// How long one file keeps being retried: --max-retries attempts without progress, and no longer
// than --max-retry-time since its last progress. Never silent: every retry is logged with what
// failed and when the next attempt is.
class RetryBudget {
 public:
  RetryBudget(Session& s, const std::string& path) : s_(s), path_(path) {}
  void Progressed() {
    failures_ = 0;
    failing_since_.reset();
  }
  int failures() const { return failures_; }
  // A failure that is not retried through Again (a 429 of the Hub: the limiter decides the wait).
  int AddFailure() {
    if (!failing_since_) failing_since_ = std::chrono::steady_clock::now();
    return ++failures_;
  }
  // Until when this file may still wait for an answer: --max-retry-time after its last progress.
  std::chrono::steady_clock::time_point Deadline() const {
    return failing_since_.value_or(std::chrono::steady_clock::now()) +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(s_.opt.max_retry_time_s));
  }
  // OkStatus after sleeping sleep_s: try again. Otherwise why to give up.
  absl::Status Again(const std::string& why, double sleep_s) {
    ++s_.retries;
    const auto now = std::chrono::steady_clock::now();
    if (!failing_since_) failing_since_ = now;
    const double failing_s = std::chrono::duration<double>(now - *failing_since_).count();
    if (++failures_ > s_.opt.max_retries)
      return absl::UnavailableError(
          fmt::format("{} (gave up after {} attempts without progress)", why, s_.opt.max_retries));
    if (failing_s + sleep_s > s_.opt.max_retry_time_s)
      return absl::DeadlineExceededError(
          fmt::format("{} (gave up: failing for {} without progress, --max-retry-time {})", why,
                      HumanDuration(failing_s), HumanDuration(s_.opt.max_retry_time_s)));
    log::Warning("{}: {}; attempt {} of {} in {}", log::Printable(path_), why, failures_ + 1, s_.opt.max_retries + 1,
                 HumanDuration(sleep_s));
    SleepFor(sleep_s, s_.stop);
    return absl::OkStatus();
  }
  // The backoff before the next attempt: none right after progress, else growing per failure.
  double Backoff(bool progressed) const { return progressed ? 0.0 : s_.limiter.Backoff(failures_); }

 private:
  Session& s_;
  const std::string& path_;
  int failures_ = 0;
  std::optional<std::chrono::steady_clock::time_point> failing_since_;
};

}  // namespace

// One file's attempts until it is in place, verified, or given up on. A failure that retrying did
// not (or cannot) mend is kUnavailable, unless the status says more (disk full, a lock held by
// another run, a deadline, ...).
class FileFetch {
 public:
  FileFetch(FileDownloader& d, const RemoteFile& f, PartFile& part, FileResult& res)
      : d_(d), s_(d.s_), f_(f), part_(part), res_(res), budget_(d.s_, f.path), url_(d.ResolveUrlFor(f)) {}

  absl::Status Run() {
    while (!s_.stop) {
      const bool hub = d_.IsHub(url_);
      if (hub && f_.url.empty()) {
        PTK_RETURN_IF_ERROR(s_.limiter.WaitForResolve(s_.stop, budget_.Deadline(), s_.opt.max_retry_time_s));
        ++s_.resolves;
      }
      if (s_.stop) break;
      HttpResponse resp;
      PTK_RETURN_IF_ERROR(Transfer(resp));
      if (hub) s_.limiter.Observe(resp);
      PTK_RETURN_IF_ERROR(part_.write_error());
      const bool progressed = part_.Progressed();
      if (progressed) {
        budget_.Progressed();
        res_.fetched = true;
      }
      PTK_ASSIGN_OR_RETURN(const bool done, OnResponse(resp, hub, progressed));
      if (done) return absl::OkStatus();
    }
    return absl::CancelledError("interrupted");
  }

 private:
  // One GET from the `.part`'s end (with If-Range on the known ETag); the body goes into the `.part`.
  absl::Status Transfer(HttpResponse& resp) {
    HttpRequest req = s_.Req(url_);
    if (part_.offset() > 0 && !part_.Resumable()) {
      log::Info(
          "{}: {} bytes downloaded, but without an ETag or a digest nothing can show that a resume continues "
          "the same file: starting over",
          log::Printable(f_.path), part_.offset());
      part_.Discard();
    }
    if (part_.offset() > 0) {
      req.headers.push_back(fmt::format("Range: bytes={}-", part_.offset()));
      if (part_.IfRangeUsable()) req.headers.push_back("If-Range: " + part_.etag());
    }
    part_.BeginAttempt();
    BodySink sink;
    sink.on_headers = [&](const HttpResponse& r) {
      return (r.status != 200 && r.status != 206) || part_.AcceptHeaders(r);
    };
    sink.on_data = [&](const char* p, size_t n) {
      if (resp.status != 200 && resp.status != 206) {  // an error body: kept for the message
        if (resp.body.size() < 4096) resp.body.append(p, std::min<size_t>(n, 4096 - resp.body.size()));
        return true;
      }
      return part_.AcceptBody(p, n, d_.progress_);
    };
    absl::Status st = d_.http_.Get(req, &resp, &sink);
    part_.Flush();  // always, before anything looks at the `.part`
    return st;
  }

  // What the answer means: true when the file is in place; false to try again.
  absl::StatusOr<bool> OnResponse(const HttpResponse& resp, bool hub, bool progressed) {
    if (!part_.problem().empty()) {  // a response that does not fit: start over without Range
      part_.Discard();
      PTK_RETURN_IF_ERROR(budget_.Again(fmt::format("bad partial response ({})", part_.problem()), 0));
      return false;
    }
    if (resp.curl_code != 0) {
      PTK_RETURN_IF_ERROR(
          budget_.Again(fmt::format("transfer error: {}", resp.curl_error), budget_.Backoff(progressed)));
      return false;
    }
    const long code = resp.status;
    if (code >= 300 && code < 400) {
      PTK_RETURN_IF_ERROR(FollowRedirect(resp));
      return false;
    }
    if (code == 200 || code == 206 || code == 416) return OnBodyEnd(resp, progressed);
    if (code == 429) {
      ++s_.rate_limited;
      s_.limiter.On429(resp, budget_.failures());
      if (!hub) PTK_RETURN_IF_ERROR(budget_.Again("429 from the download host", budget_.Backoff(false)));
      if (hub && budget_.AddFailure() > s_.opt.max_retries + 20)
        return absl::UnavailableError("rate limited too many times");
      return false;
    }
    if (!hub && (code == 403 || code == 400 || code == 410 || code == 404) && f_.url.empty()) {
      // A signed CDN URL that expired or was refused: resolve again (costs one resolve).
      url_ = d_.ResolveUrlFor(f_);
      PTK_RETURN_IF_ERROR(
          budget_.Again(fmt::format("download host answered {}; resolving again", code), budget_.Backoff(false)));
      return false;
    }
    if (code == 408 || code >= 500) {
      PTK_RETURN_IF_ERROR(budget_.Again(fmt::format("HTTP {}", code), budget_.Backoff(false)));
      return false;
    }
    return absl::UnavailableError(fmt::format("{}: {}", url_, HubErrorText(resp)));
  }

  // A redirect, checked against what the listing says of the file (the Hub's X-Linked-* headers).
  absl::Status FollowRedirect(const HttpResponse& resp) {
    const std::string loc = resp.Header("location");
    if (loc.empty()) return absl::UnavailableError(fmt::format("{}: redirect without a Location", url_));
    if (++redirects_ > kMaxRedirects)
      return absl::UnavailableError(fmt::format("{}: more than {} redirects (a redirect loop?)", url_, kMaxRedirects));
    const std::string linked = resp.Header("x-linked-size");
    if (!linked.empty() && !ParseUint64(linked))
      return absl::UnavailableError(fmt::format("the Hub sent a malformed X-Linked-Size {:?}", linked));
    if (!linked.empty() && part_.size_known() && ParseUint64(linked) != part_.expected())
      return absl::UnavailableError(
          fmt::format("the Hub says {} bytes, the listing {}: the listing is stale", linked, part_.expected()));
    const std::string ltag = StripQuotes(resp.Header("x-linked-etag"));
    if (!ltag.empty() && !f_.sha256.empty() && IsHex(ltag, 64) && ltag != f_.sha256)
      return absl::UnavailableError(fmt::format("the Hub's sha256 {} differs from the listing's {}", ltag, f_.sha256));
    const std::string next = ResolveUrl(url_, loc);
    if (!IsHttpUrl(next))
      return absl::UnavailableError(
          fmt::format("{}: redirected to {:?}; only http:// and https:// are followed", url_, next));
    url_ = next;
    return absl::OkStatus();
  }

  // A transfer that ended (200, 206, or 416 for a range past the end): complete and verified, the
  // `.part` becomes the file; short or mismatching, another attempt.
  absl::StatusOr<bool> OnBodyEnd(const HttpResponse& resp, bool progressed) {
    if (resp.status == 416) {
      static const std::regex re(R"(bytes\s+\*/(\d+))");
      std::smatch m;
      const std::string cr = resp.Header("content-range");
      const std::string tag = resp.Header("etag");
      const bool complete = std::regex_search(cr, m, re) && part_.size_known() &&
                            ParseUint64(m[1].str()) == part_.expected() && part_.offset() == part_.expected() &&
                            // the same object: by its ETag, or (an ETag missing) by the digest checked below
                            (part_.want_digest().empty() ? tag == part_.etag()
                                                         : tag.empty() || part_.etag().empty() || tag == part_.etag());
      if (!complete) {
        part_.Discard();
        PTK_RETURN_IF_ERROR(budget_.Again(fmt::format("416 with Content-Range {:?}", cr), 0));
        return false;
      }
    }
    if (part_.size_known() && part_.offset() < part_.expected()) {  // the connection ended early but cleanly
      PTK_RETURN_IF_ERROR(budget_.Again(fmt::format("short body ({} of {} bytes)", part_.offset(), part_.expected()),
                                        budget_.Backoff(progressed)));
      return false;
    }
    std::string digest;
    if (!part_.DigestMatches(&digest)) {
      log::Warning("{}: {} mismatch (got {}, want {}); downloading it again", f_.path, part_.digest_name(), digest,
                   part_.want_digest());
      part_.Discard();
      if (++digest_failures_ >= 3)
        return absl::UnavailableError(fmt::format("{} still mismatches after 3 downloads", part_.digest_name()));
      url_ = d_.ResolveUrlFor(f_);
      return false;
    }
    PTK_RETURN_IF_ERROR(part_.MoveIntoPlace());
    PTK_RETURN_IF_ERROR(d_.done_.Append(DoneLogKey(f_)));
    res_.bytes = part_.offset();
    return true;
  }

  FileDownloader& d_;
  Session& s_;
  const RemoteFile& f_;
  PartFile& part_;
  FileResult& res_;
  RetryBudget budget_;
  std::string url_;
  int redirects_ = 0, digest_failures_ = 0;
};

FileResult FileDownloader::Run(const RemoteFile& f) {
  FileResult res;
  res.error = [&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(MakeDirs(Dirname(f.local_path)));
    // One downloader per file: another run on this --local-dir (a requeued job that still runs)
    // holding it makes this file fail at once, naming that run; its .part is never touched.
    PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(f.local_path));
    // Another run on this --local-dir (a requeued job beside the first) may have finished the file
    // since this one listed it: then it is done, and no `.part` is started for it (one killed
    // later would be left beside the complete file). Its digest decides, not the done logs: the
    // file may be one this run found damaged (--verify), which they still list.
    auto sz = FileSize(f.local_path);
    if (sz.ok() && (!f.size_known || *sz == f.size)) {
      PTK_ASSIGN_OR_RETURN(const bool present,
                           PresentAndVerified(f, ReadDoneLogs(JoinPath(s_.opt.local_dir, kStateDir)),
                                              /*verify=*/true, done_, /*warn=*/false));
      if (present) {
        RemovePartOf(f);
        res.already_present = true;
        return absl::OkStatus();
      }
    }
    PartFile part(f);
    PTK_RETURN_IF_ERROR(part.Open(progress_));
    return FileFetch(*this, f, part, res).Run();
  }();
  res.ok = res.error.ok();
  // A full disk stops the whole run (no other file can be written either).
  if (res.error.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
  return res;
}

}  // namespace ptk::download_detail
