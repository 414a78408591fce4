// HTTP over libcurl.
#include "dataprep/download/http.h"

#include <curl/curl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <vector>

#include <fmt/core.h>

#include "absl/strings/ascii.h"

namespace ptk {
namespace {

std::once_flag g_curl_init;

using Clock = std::chrono::steady_clock;

struct Ctx {
  HttpResponse* resp = nullptr;
  BodySink* sink = nullptr;
  bool headers_done = false;
  bool in_redirect = false;
  uint64_t max_body = 0;
  // Deadlines the low-speed check cannot give (a server that drips a byte a second never stalls):
  // the response's headers complete within connect + stall timeout of the start, and the body of
  // an answer that is not a 2xx (a redirect, an error: a few bytes) within the stall timeout of its
  // headers.
  Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> header_end;
  double header_limit_s = 0, side_body_limit_s = 0;
  std::string cut;  // why the transfer was cut by a deadline
};

std::string Trim(const std::string& s) { return std::string(absl::StripAsciiWhitespace(s)); }

size_t HeaderCb(char* data, size_t size, size_t n, void* user) {
  Ctx* c = static_cast<Ctx*>(user);
  std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {  // a new response (libcurl reports each one)
    c->resp->headers.clear();
    size_t sp = line.find(' ');
    c->resp->status = sp == std::string::npos ? 0 : std::atol(line.c_str() + sp + 1);
    c->headers_done = false;
    c->header_end.reset();
    return size * n;
  }
  if (line == "\r\n" || line == "\n") {
    c->header_end = Clock::now();
    return size * n;
  }
  size_t colon = line.find(':');
  if (colon != std::string::npos) {
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::tolower(ch); });
    c->resp->headers[name] = Trim(line.substr(colon + 1));
  }
  return size * n;
}

size_t WriteCb(char* data, size_t size, size_t n, void* user) {
  Ctx* c = static_cast<Ctx*>(user);
  const size_t len = size * n;
  if (!c->headers_done) {
    c->headers_done = true;
    if (c->sink && c->sink->on_headers && !c->sink->on_headers(*c->resp)) {
      c->resp->aborted_by_sink = true;
      return 0;
    }
  }
  c->resp->body_bytes += len;
  if (c->sink && c->sink->on_data) {
    if (!c->sink->on_data(data, len)) {
      c->resp->aborted_by_sink = true;
      return 0;
    }
    return len;
  }
  if (c->resp->body.size() + len > c->max_body) {
    c->resp->body_limit_hit = true;
    return 0;
  }
  c->resp->body.append(data, len);
  return len;
}

int XferInfoCb(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  Ctx* c = static_cast<Ctx*>(user);
  const auto now = Clock::now();
  if (!c->header_end) {
    const double waited = std::chrono::duration<double>(now - c->start).count();
    if (c->header_limit_s > 0 && waited > c->header_limit_s) {
      c->cut = fmt::format("no complete response headers after {:.1f} s (a server sending them too slowly)", waited);
      return 1;
    }
    return 0;
  }
  const long status = c->resp->status;
  if (status >= 200 && status < 300) return 0;  // the content: the low-speed check and the total timeout
  const double waited = std::chrono::duration<double>(now - *c->header_end).count();
  if (c->side_body_limit_s > 0 && waited > c->side_body_limit_s) {
    c->cut =
        fmt::format("the body of an HTTP {} answer still coming after {:.1f} s (--stall-timeout); cut", status, waited);
    return 1;
  }
  return 0;
}

}  // namespace

std::string FindCaBundle() {
  for (const char* env : {"CURL_CA_BUNDLE", "SSL_CERT_FILE"})
    if (const char* v = std::getenv(env); v && *v) return v;
  std::vector<std::string> candidates;
  const curl_version_info_data* info = curl_version_info(CURLVERSION_NOW);
  if (info->age >= CURLVERSION_SEVENTH && info->cainfo) candidates.push_back(info->cainfo);
  for (const char* p :
       {"/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", "/etc/ssl/ca-bundle.pem", "/etc/ssl/cert.pem"})
    candidates.push_back(p);
  for (const auto& c : candidates)
    if (::access(c.c_str(), R_OK) == 0) return c;
  return "";
}

HttpClient::HttpClient() {
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  curl_ = curl_easy_init();
  ca_bundle_ = FindCaBundle();
  const curl_version_info_data* info = curl_version_info(CURLVERSION_NOW);
  no_ca_path_ = info->age >= CURLVERSION_SEVENTH && info->capath && ::access(info->capath, R_OK) != 0;
}

HttpClient::~HttpClient() { curl_easy_cleanup(static_cast<CURL*>(curl_)); }

absl::Status HttpClient::Get(const HttpRequest& req, HttpResponse* resp, BodySink* sink) {
  CURL* c = static_cast<CURL*>(curl_);
  if (!c) return absl::InternalError("curl_easy_init failed");
  curl_easy_reset(c);
  *resp = HttpResponse();
  Ctx ctx;
  ctx.resp = resp;
  ctx.sink = sink;
  ctx.max_body = req.max_body_bytes;
  if (!IsHttpUrl(req.url))
    return absl::InvalidArgumentError(fmt::format("{:?}: only http:// and https:// URLs are fetched", req.url));
  curl_slist* hdrs = nullptr;
  for (const auto& h : req.headers) hdrs = curl_slist_append(hdrs, h.c_str());
  char errbuf[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(c, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_USERAGENT, "ptk-download/0.1");
  if (!ca_bundle_.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, ca_bundle_.c_str());
  if (no_ca_path_) curl_easy_setopt(c, CURLOPT_CAPATH, static_cast<const char*>(nullptr));
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(req.connect_timeout_s * 1000));
  if (req.stall_timeout_s > 0) {
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(req.stall_timeout_s + 0.5)));
  }
  if (req.total_timeout_s > 0) curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(req.total_timeout_s * 1000));
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, HeaderCb);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &ctx);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, WriteCb);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &ctx);
  // Larger receive buffer: fewer recv() calls, write() calls and callbacks per MB (default 16 KiB).
  curl_easy_setopt(c, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
  ctx.header_limit_s = req.stall_timeout_s > 0 ? req.connect_timeout_s + req.stall_timeout_s : 0;
  ctx.side_body_limit_s = req.stall_timeout_s;
  curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, XferInfoCb);
  curl_easy_setopt(c, CURLOPT_XFERINFODATA, &ctx);
  curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(hdrs);
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  if (code) resp->status = code;
  // A response with no body never reached WriteCb: give the sink its headers now.
  if (rc == CURLE_OK && !ctx.headers_done && sink && sink->on_headers) {
    ctx.headers_done = true;
    if (!sink->on_headers(*resp)) resp->aborted_by_sink = true;
  }
  resp->curl_code = rc;
  if (rc != CURLE_OK) resp->curl_error = errbuf[0] ? errbuf : curl_easy_strerror(rc);
  if (!ctx.cut.empty()) resp->curl_error = ctx.cut;
  if (resp->body_limit_hit)
    resp->curl_error = fmt::format("the response body passed the limit of {} bytes; stopped reading", ctx.max_body);
  return absl::OkStatus();
}

bool IsHttpUrl(const std::string& url) {
  auto starts = [&](std::string_view scheme) {
    if (url.size() < scheme.size()) return false;
    for (size_t i = 0; i < scheme.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(url[i])) != scheme[i]) return false;
    return true;
  };
  return starts("http://") || starts("https://");
}

std::string UrlAuthority(const std::string& url) {
  size_t s = url.find("://");
  if (s == std::string::npos) return "";
  size_t start = s + 3;
  size_t end = url.find_first_of("/?#", start);
  std::string a = url.substr(start, end == std::string::npos ? std::string::npos : end - start);
  size_t at = a.rfind('@');
  if (at != std::string::npos) a = a.substr(at + 1);
  std::transform(a.begin(), a.end(), a.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return a;
}

std::string UrlOrigin(const std::string& url) {
  size_t s = url.find("://");
  if (s == std::string::npos) return "";
  size_t end = url.find_first_of("/?#", s + 3);
  return url.substr(0, end);
}

std::string ResolveUrl(const std::string& base, const std::string& loc) {
  if (loc.find("://") != std::string::npos) return loc;
  if (loc.rfind("//", 0) == 0) return base.substr(0, base.find("://") + 1) + loc;
  if (!loc.empty() && loc[0] == '/') return UrlOrigin(base) + loc;
  std::string b = base.substr(0, base.find_first_of("?#"));
  return b.substr(0, b.rfind('/') + 1) + loc;
}

std::string UrlQuote(const std::string& s, bool keep_slash) {
  std::string o;
  for (unsigned char ch : s) {
    if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~' || (keep_slash && ch == '/'))
      o += static_cast<char>(ch);
    else
      o += fmt::format("%{:02X}", ch);
  }
  return o;
}

std::string UrlUnquote(const std::string& s) {
  std::string o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      o += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      o += s[i];
    }
  }
  return o;
}

}  // namespace ptk
