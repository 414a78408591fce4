// ptk-download: one file fetched, resumed and verified.
//
// Three parts: PartFile (the `.part` on disk, its running digest and what is known of the remote
// object), RetryBudget (how long one file keeps being retried) and FileFetch (the loop of HTTP
// attempts and what each answer means).
#include "dataprep/download/download_internal.h"
#include "dataprep/download/publish_part.h"

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

// The `.part` of one file: the bytes received so far, their running digest (kept by the worker's
// StreamHasher, off the receive path), and what the transfers learnt of the remote object (its
// size, its ETag). Closed on destruction, unless handed to the publisher.
class PartFile {
 public:
  PartFile(const RemoteFile& f, StreamHasher& hasher, ProgressReporter& progress)
      : f_(f),
        path_(f.local_path + ".part"),
        meta_path_(path_ + ".json"),
        git_(f.sha256.empty() && !f.git_sha1.empty()),
        want_digest_(git_ ? f.git_sha1 : f.sha256),
        hasher_(hasher),
        progress_(progress),
        expected_(f.size),
        size_known_(f.size_known) {}
  ~PartFile() {
    if (fd_ < 0) return;
    hasher_.Abandon();
    ::close(fd_);
  }
  PartFile(const PartFile&) = delete;
  PartFile& operator=(const PartFile&) = delete;

  // Opens the `.part` (never through a symlink: a planted link would make the download overwrite
  // its target) and resumes it when its record says it was started for this very file (same size
  // and digest); otherwise starts over. The bytes already there are re-read for the digest (by the
  // hasher, while the transfer goes on). The record is written once the first answer's headers are
  // accepted (a `.part` without one is never resumed). The bytes there count as progress until
  // the `.part` starts over.
  absl::Status Open() {
    auto meta = ReadFileToString(meta_path_);
    if (meta.ok()) {
      const size_t nl = meta->find('\n');
      if (meta->substr(0, nl) != MetaKey()) {
        (void)RemoveFileIfExists(path_);
      } else if (nl != std::string::npos) {
        etag_ = meta->substr(nl + 1, meta->find('\n', nl + 1) - nl - 1);
        meta_ok_ = true;
      }
    } else if (PathExists(path_)) {
      (void)RemoveFileIfExists(path_);  // no record of what it was: start over
    }
    while (!etag_.empty() && (etag_.back() == '\n' || etag_.back() == '\r')) etag_.pop_back();
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) return ErrnoToStatus(errno, fmt::format("open {}", path_));
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path_));
    offset_ = static_cast<uint64_t>(st.st_size);
    if (size_known_ && offset_ > expected_) {
      (void)::ftruncate(fd_, 0);
      offset_ = 0;
    }
    RestartHash();
    hasher_.Advance(offset_);
    progress_.AddBytes(offset_);
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
  // The size of the whole object a 200 sent (asked without Range) when it is not the listed one: no
  // attempt can mend that.
  const std::optional<uint64_t>& server_size() const { return server_size_; }

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
        // Asked without Range, the whole object of another size: the listed size is wrong, and no retry
        // mends that. (A 200 to a Range request may be a misbehaving server's slice: started over.)
        if (f_.size_known && attempt_start_ == 0 && *length != f_.size) return RefuseSize(*length);
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
    if (offset_ == 0 && (tag != etag_ || !meta_ok_)) {  // the .part starts here: it is of this object
      etag_ = tag;
      WriteMeta();
    }
    return true;
  }

  // Body bytes of an accepted response, written in place from libcurl's receive buffer (no copy
  // of ours); the hasher reads them back from the page cache on its own thread.
  bool AcceptBody(const char* p, size_t n) {
    if (size_known_ && offset_ + n > expected_) return Refuse("body longer than the expected size");
    write_error_ = PwriteAll(fd_, p, n, offset_, path_);
    if (!write_error_.ok()) return false;
    offset_ += n;
    hasher_.Advance(offset_);
    progress_.AddBytes(n);
    return true;
  }
  const absl::Status& write_error() const { return write_error_; }

  // Empties the `.part`: the next attempt starts from byte 0, and the bytes it held no longer count
  // as progress.
  void Restart() {
    progress_.TakeBackBytes(offset_);
    (void)::ftruncate(fd_, 0);
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
  absl::StatusOr<bool> DigestMatches(std::string* got) {
    PTK_ASSIGN_OR_RETURN(*got, hasher_.Finish(offset_));
    return want_digest_.empty() || *got == want_digest_;
  }
  // Hands the complete, verified `.part` (its fd and the file's lock) to be made durable and
  // renamed into place.
  absl::Status MoveIntoPlace(Session& s, DoneLog& done, std::unique_ptr<OutputLock> lock) {
    return PublishPart(s, done, f_, &fd_, path_, meta_path_, offset_, std::move(lock));
  }

  uint64_t offset() const { return offset_; }
  uint64_t expected() const { return expected_; }
  bool size_known() const { return size_known_; }
  const std::string& etag() const { return etag_; }
  const std::string& want_digest() const { return want_digest_; }
  const char* digest_name() const { return git_ ? "git sha1" : "sha256"; }

 private:
  std::string MetaKey() const { return fmt::format("{}\t{}", f_.size, want_digest_); }
  // What the `.part` is (size, digest, ETag): atomic but not fsynced. Losing it in a crash only
  // means the `.part` is not resumed; a stale one cannot pass the final size + digest check.
  void WriteMeta() {
    (void)WriteFileAtomic(meta_path_, fmt::format("{}\n{}\n", MetaKey(), etag_), /*durable=*/false);
    meta_ok_ = true;
  }
  void RestartHash() { hasher_.Start(fd_, git_, f_.size); }
  bool Refuse(std::string why) {
    problem_ = std::move(why);
    return false;
  }
  bool RefuseSize(uint64_t server) {
    server_size_ = server;
    return Refuse("size mismatch");
  }

  const RemoteFile& f_;
  const std::string path_, meta_path_;
  const bool git_;
  const std::string want_digest_;
  StreamHasher& hasher_;
  ProgressReporter& progress_;  // counts offset_: every byte of the `.part`, once
  int fd_ = -1;
  uint64_t offset_ = 0, attempt_start_ = 0, expected_;
  bool size_known_;
  bool meta_ok_ = false;  // the record on disk is this `.part`'s
  std::string etag_, problem_;
  std::optional<uint64_t> server_size_;
  absl::Status write_error_;
};

}  // namespace

// One file's attempts until it is in place, verified, or given up on. A failure that retrying did
// not (or cannot) mend is kUnavailable, unless the status says more (disk full, a lock held by
// another run, a deadline, ...).
class FileFetch {
 public:
  FileFetch(FileDownloader& d, const RemoteFile& f, PartFile& part, FileResult& res, std::unique_ptr<OutputLock>& lock)
      : d_(d), s_(d.s_), f_(f), part_(part), res_(res), lock_(lock), budget_(d.s_, f.path), url_(d.ResolveUrlFor(f)) {}

  absl::Status Run() {
    while (!s_.stop) {
      const bool hub = d_.IsHub(url_);
      RateLimiter::InFlight resolve;
      if (hub && f_.url.empty()) {
        PTK_RETURN_IF_ERROR(s_.limiter.WaitForResolve(s_.stop, budget_.Deadline(), s_.opt.max_retry_time_s, &resolve));
        ++s_.resolves;
      }
      if (s_.stop) break;
      HttpResponse resp;
      PTK_RETURN_IF_ERROR(Transfer(resp));
      if (hub) s_.limiter.Observe(resp);
      resolve.Release();
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
      return part_.AcceptBody(p, n);
    };
    return d_.http_.Get(req, &resp, &sink);
  }

  // What the answer means: true when the file is in place; false to try again.
  absl::StatusOr<bool> OnResponse(const HttpResponse& resp, bool hub, bool progressed) {
    if (part_.server_size()) return SizeMismatch();
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
      const double wait_s = s_.limiter.On429(resp, budget_.failures());
      if (!hub) PTK_RETURN_IF_ERROR(budget_.Again("429 from the download host", wait_s));  // as the 429 asks
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
    if (code == 408 || code >= 500) {  // after the wait a Retry-After names (a 503's), else a backoff
      PTK_RETURN_IF_ERROR(
          budget_.Again(fmt::format("HTTP {}", code), RetryAfterSeconds(resp).value_or(budget_.Backoff(false))));
      return false;
    }
    return absl::UnavailableError(fmt::format("{}: {}", url_, HubErrorText(resp)));
  }

  // The server's size is not the listed one: definite, so no retries, and nothing of it kept.
  absl::Status SizeMismatch() {
    part_.Discard();
    const std::string listed = f_.url.empty()
                                   ? fmt::format("the repo listing says {} bytes (a stale listing?)", f_.size)
                                   : fmt::format("the --url-list gives size={}", f_.size);
    return absl::FailedPreconditionError(fmt::format("{}: the server's file is {} bytes, {}; not downloaded",
                                                     f_.url.empty() ? url_ : f_.url, *part_.server_size(), listed));
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
    PTK_ASSIGN_OR_RETURN(const bool matches, part_.DigestMatches(&digest));
    if (!matches) {
      log::Warning("{}: {} mismatch (got {}, want {}); downloading it again", f_.path, part_.digest_name(), digest,
                   part_.want_digest());
      part_.Discard();
      if (++digest_failures_ >= 3)
        return absl::UnavailableError(fmt::format("{} still mismatches after 3 downloads", part_.digest_name()));
      url_ = d_.ResolveUrlFor(f_);
      return false;
    }
    res_.bytes = part_.offset();
    PTK_RETURN_IF_ERROR(part_.MoveIntoPlace(s_, d_.done_, std::move(lock_)));
    return true;
  }

  FileDownloader& d_;
  Session& s_;
  const RemoteFile& f_;
  PartFile& part_;
  FileResult& res_;
  std::unique_ptr<OutputLock>& lock_;
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
    PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(f.local_path, s_.opt.lock_wait));
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
    // One connection for this file (a ranged fetch opens more while --max-connections allows).
    s_.slots.Acquire();
    struct SlotRelease {
      ConnectionSlots& slots;
      ~SlotRelease() { slots.Release(); }
    } slot{s_.slots};
    if (Ranged(f)) {
      absl::Status st = RunRanged(f, res, lock);
      if (!absl::IsUnimplemented(st)) return st;
      // The server answered a range with the whole file: one stream, from byte 0.
      log::Info("{}: {}; downloading it over one connection", log::Printable(f.path), StatusMessage(st));
    }
    PartFile part(f, hasher_, progress_);
    PTK_RETURN_IF_ERROR(part.Open());
    absl::Status st = FileFetch(*this, f, part, res, lock).Run();
    // Failed with nothing received (a 404, a size mismatch): no empty `.part` is left; one with bytes
    // stays for the next run to resume.
    if (!st.ok() && lock && part.offset() == 0) RemovePartOf(f);
    return st;
  }();
  res.ok = res.error.ok();
  // A full disk stops the whole run (no other file can be written either).
  if (res.error.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
  return res;
}

}  // namespace ptk::download_detail
