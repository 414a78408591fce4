// ptk-download: one file fetched, resumed and verified.
#include "dataprep/download_internal.h"

#include "common/output_lock.h"

namespace ptk::download_detail {

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
    res.error = mk;
    return res;
  }
  // One downloader per file: another run on this --local-dir (a requeued job that still runs)
  // holding it makes this file fail at once, naming that run; its .part is never touched.
  auto lock = OutputLock::Acquire(f.local_path);
  if (!lock.ok()) {
    res.error = lock.status();
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
  // Never through a symlink: a planted `.part` link would make the download overwrite its target.
  int fd = ::open(part.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    res.error = ErrnoToStatus(errno, fmt::format("open {}", part));
    if (errno == ENOSPC || errno == EDQUOT) s_.disk_full = true;
    return res;
  }
  // What the .part is (size, digest, ETag): atomic but not fsynced. Losing it in a crash only
  // means the .part is not resumed; a stale one cannot pass the final size + digest check.
  auto write_meta = [&](const std::string& tag) {
    (void)WriteFileAtomic(meta_path, fmt::format("{}\t{}\n{}\n", f.size, want_digest, tag), /*durable=*/false);
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
  std::optional<std::chrono::steady_clock::time_point> failing_since;
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
  // A failure that retrying did not (or cannot) mend: the transfer's error (kUnavailable), unless
  // the status says more (disk full, a lock held by another run, ...).
  auto fail = [&](const absl::Status& why) {
    res.error = why;
    ::close(fd);
    return res;
  };
  auto fail_msg = [&](const std::string& why) { return fail(absl::UnavailableError(why)); };

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
        if (std::regex_search(cr, m, re) && ParseUint64(m[1].str()) == offset && size_known &&
            ParseUint64(m[3].str()) == expected && ParseUint64(m[2].str()) == expected - 1) {
          return true;
        }
        truncate_to_zero();
        return true;
      }
      if (r.status == 200) {
        if (offset > 0) truncate_to_zero();  // the server ignored Range (or the object changed)
        std::string cl = r.Header("content-length");
        if (!size_known && !cl.empty()) {
          auto v = ParseUint64(cl);
          if (!v) {
            range_ok = false;
            bad_range = fmt::format("Content-Length {:?}", cl);
            return false;
          }
          expected = *v;
          size_known = true;
        }
      } else if (r.status == 206) {
        static const std::regex re(R"(bytes\s+(\d+)-(\d+)/(\d+|\*))");
        std::smatch m;
        std::string cr = r.Header("content-range");
        const bool matched = std::regex_search(cr, m, re);
        const auto first = matched ? ParseUint64(m[1].str()) : std::nullopt;
        const auto last = matched ? ParseUint64(m[2].str()) : std::nullopt;
        const bool star = matched && m[3] == "*";
        const auto total = matched && !star ? ParseUint64(m[3].str()) : std::nullopt;
        if (!matched || !first || !last || (!star && !total) || *first != offset ||
            (total && size_known && *total != expected) || (total && (*total == 0 || *last != *total - 1))) {
          range_ok = false;
          bad_range = cr;
          return false;
        }
        if (!size_known && total) {
          expected = *total;
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
    if (!st.ok()) return fail(st);
    if (hub) s_.limiter.Observe(resp);
    if (!write_error.ok()) {
      if (write_error.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
      return fail(write_error);
    }
    const bool progressed = offset > attempt_start;
    if (progressed) {
      no_progress = 0;
      res.fetched = true;
    }
    if (progressed) failing_since.reset();
    auto retry = [&](const std::string& why, double sleep_s) -> bool {
      ++s_.retries;
      const auto now = std::chrono::steady_clock::now();
      if (!failing_since) failing_since = now;
      const double failing_s = std::chrono::duration<double>(now - *failing_since).count();
      if (++no_progress > s_.opt.max_retries) {
        res.error = absl::UnavailableError(
            fmt::format("{} (gave up after {} attempts without progress)", why, s_.opt.max_retries));
        return false;
      }
      if (failing_s + sleep_s > s_.opt.max_retry_time_s) {
        res.error = absl::DeadlineExceededError(
            fmt::format("{} (gave up: failing for {} without progress, --max-retry-time {})", why,
                        HumanDuration(failing_s), HumanDuration(s_.opt.max_retry_time_s)));
        return false;
      }
      // Never silent: what failed and when the next attempt is.
      log::Warning("{}: {}; attempt {} of {} in {}", log::Printable(f.path), why, no_progress + 1,
                   s_.opt.max_retries + 1, HumanDuration(sleep_s));
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
      if (loc.empty()) return fail_msg(fmt::format("{}: redirect without a Location", url));
      if (++redirects > kMaxRedirects)
        return fail_msg(fmt::format("{}: more than {} redirects (a redirect loop?)", url, kMaxRedirects));
      std::string linked = resp.Header("x-linked-size");
      if (!linked.empty() && !ParseUint64(linked))
        return fail_msg(fmt::format("the Hub sent a malformed X-Linked-Size {:?}", linked));
      if (!linked.empty() && size_known && ParseUint64(linked) != expected)
        return fail_msg(fmt::format("the Hub says {} bytes, the listing {}: the listing is stale", linked, expected));
      std::string ltag = StripQuotes(resp.Header("x-linked-etag"));
      if (!ltag.empty() && !f.sha256.empty() && IsHex(ltag, 64) && ltag != f.sha256)
        return fail_msg(fmt::format("the Hub's sha256 {} differs from the listing's {}", ltag, f.sha256));
      const std::string next = ResolveUrl(url, loc);
      if (!IsHttpUrl(next))
        return fail_msg(fmt::format("{}: redirected to {:?}; only http:// and https:// are followed", url, next));
      url = next;
      continue;
    }
    if (code == 200 || code == 206 || code == 416) {
      if (code == 416) {
        static const std::regex re(R"(bytes\s+\*/(\d+))");
        std::smatch m;
        std::string cr = resp.Header("content-range");
        bool complete =
            std::regex_search(cr, m, re) && size_known && ParseUint64(m[1].str()) == expected && offset == expected;
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
          return fail_msg(fmt::format("{} still mismatches after 3 downloads", git ? "git sha1" : "sha256"));
        url = ResolveUrlFor(f);
        continue;
      }
      absl::Status fin = Finish(f, part, fd);
      ::close(fd);
      if (!fin.ok()) {
        if (fin.code() == absl::StatusCode::kResourceExhausted) s_.disk_full = true;
        res.error = fin;
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
      if (hub && ++no_progress > s_.opt.max_retries + 20) return fail_msg("rate limited too many times");
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
    return fail_msg(fmt::format("{}: {}", url, HubErrorText(resp)));
  }
  ::close(fd);
  res.error = absl::CancelledError("interrupted");
  return res;
}

}  // namespace ptk::download_detail
