// ptk-download: the Hub API (listing at a pinned revision) and its small helpers.
#include "common/human_format.h"
#include "dataprep/download/download_internal.h"

namespace ptk::download_detail {

std::string StripQuotes(std::string s) {
  if (s.rfind("W/", 0) == 0) s = s.substr(2);
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

bool IsHex(const std::string& s, size_t n) {
  return s.size() == n &&
         std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
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

// GET of a Hub API URL with retries on 429/5xx/transport errors; follows relative redirects.
absl::StatusOr<HttpResponse> ApiGet(Session& s, HttpClient& http, std::string url) {
  HttpResponse r;
  int redirects = 0;
  std::optional<std::chrono::steady_clock::time_point> failing_since;
  for (int attempt = 0;; ++attempt) {
    HttpRequest req = s.Req(url);
    req.total_timeout_s = s.opt.api_timeout_s;  // a listing that trickles forever is cut off
    PTK_RETURN_IF_ERROR(http.Get(req, &r));
    if (r.curl_code == 0 && r.status >= 300 && r.status < 400 && !r.Header("location").empty()) {
      const std::string next = ResolveUrl(url, r.Header("location"));
      if (++redirects > kMaxRedirects)
        return absl::UnavailableError(
            fmt::format("{}: more than {} redirects (a redirect loop?); last to {:?}", url, kMaxRedirects, next));
      if (!IsHttpUrl(next))
        return absl::PermissionDeniedError(
            fmt::format("{}: redirected to {:?}; only http:// and https:// are followed", url, next));
      url = next;
      --attempt;  // a redirect is not a failed attempt
      continue;
    }
    if (r.body_limit_hit) return absl::OutOfRangeError(fmt::format("{}: {}", url, r.curl_error));
    bool retry = r.curl_code != 0 || r.status == 429 || r.status == 408 || r.status >= 500;
    if (!retry) return r;
    const std::string why = r.curl_code ? r.curl_error : HubErrorText(r);
    const auto now = std::chrono::steady_clock::now();
    if (!failing_since) failing_since = now;
    const double failing_s = std::chrono::duration<double>(now - *failing_since).count();
    if (attempt >= s.opt.max_retries)
      return absl::UnavailableError(fmt::format("{}: {} (gave up after {} attempts)", url, why, attempt + 1));
    if (failing_s >= s.opt.max_retry_time_s)
      return absl::UnavailableError(fmt::format("{}: {} (gave up: failing for {}, --max-retry-time {})", url, why,
                                                HumanDuration(failing_s), HumanDuration(s.opt.max_retry_time_s)));
    ++s.retries;
    if (r.status == 429) {
      ++s.rate_limited;
      s.limiter.On429(r, attempt);
      const auto deadline = *failing_since + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(s.opt.max_retry_time_s));
      absl::Status waited = s.limiter.WaitForResolve(s.stop, deadline, s.opt.max_retry_time_s);
      if (!waited.ok()) return Annotate(waited, url);
    } else {
      // A 503's Retry-After (RFC 9110 10.2.3) is the wait it names; otherwise a backoff.
      const double wait =
          r.curl_code ? s.limiter.Backoff(attempt) : RetryAfterSeconds(r).value_or(s.limiter.Backoff(attempt));
      if (failing_s + wait > s.opt.max_retry_time_s)
        return absl::UnavailableError(
            fmt::format("{}: {} (gave up: the next attempt in {} is past --max-retry-time {})", url, why,
                        HumanDuration(wait), HumanDuration(s.opt.max_retry_time_s)));
      // Never silent while the Hub does not answer: what failed and when the next attempt is.
      log::Warning("{}: {}; attempt {} of {} in {}", url, why, attempt + 2, s.opt.max_retries + 1, HumanDuration(wait));
      SleepFor(wait, s.stop);
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
    // The Hub answers a repo of another type as one that does not exist; huggingface-cli's default
    // type is model, ptk-download's dataset (SlimPajama's): `--repo gpt2` alone finds nothing.
    if (r.Header("x-error-code") == "RepoNotFound")
      hint += s.opt.repo_type == "dataset"
                  ? "; a model or space repo? --repo-type is dataset unless given: add --repo-type model (or space)"
                  : fmt::format("; is it not a {} repo? --repo-type dataset, model or space", s.opt.repo_type);
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
  // A listing ends: a next link already followed, or a page that lists nothing new, is a loop (a
  // cursor that comes back), and the pages are counted.
  std::set<std::string> urls_seen, paths_seen;
  int empty_pages = 0;  // in a row
  while (!url.empty()) {
    if (!urls_seen.insert(url).second)
      return absl::DataLossError(fmt::format(
          "listing {} {}: after {} pages the Hub's Link rel=next points back to a page already read ({}): a "
          "pagination loop",
          s.opt.repo_type, s.opt.repo, pages, url));
    if (pages >= kMaxListingPages)
      return absl::DataLossError(fmt::format("listing {} {}: more than {} pages (a pagination loop?); last next {}",
                                             s.opt.repo_type, s.opt.repo, kMaxListingPages, url));
    PTK_ASSIGN_OR_RETURN(HttpResponse r, ApiGet(s, http, url));
    if (r.status != 200) return absl::NotFoundError(fmt::format("listing {}: {}", url, HubErrorText(r)));
    simdjson::dom::parser p;
    simdjson::dom::element root;
    simdjson::dom::array arr;
    if (p.parse(r.body).get(root) || root.get_array().get(arr))
      return absl::DataLossError(fmt::format("listing {}: not a JSON array", url));
    size_t fresh = 0;
    for (auto e : arr) {
      std::string_view type, path;
      if (e["type"].get(type) || e["path"].get(path))
        return absl::DataLossError(fmt::format("listing {}: bad entry", url));
      fresh += paths_seen.emplace(path).second;
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
    empty_pages = arr.size() == 0 ? empty_pages + 1 : 0;
    if (!next.empty() && empty_pages >= 10)
      return absl::DataLossError(
          fmt::format("listing {} {}: {} empty pages in a row, each linking to another: a pagination loop? (last {})",
                      s.opt.repo_type, s.opt.repo, empty_pages, url));
    if (!next.empty() && fresh == 0 && arr.size() > 0)
      return absl::DataLossError(
          fmt::format("listing {} {}: page {} ({}) lists only entries of earlier pages and links to another: a "
                      "pagination loop",
                      s.opt.repo_type, s.opt.repo, pages, url));
    url = next.empty() ? "" : ResolveUrl(url, next);
  }
  log::Info("listed {} files of {} {}@{} in {} page(s)", files.size(), s.opt.repo_type, s.opt.repo, sha.substr(0, 12),
            pages);
  return files;
}

}  // namespace ptk::download_detail
