// A small blocking HTTP client over libcurl for the downloader: one request at a time per
// HttpClient (one per worker thread), http and https only (no file://, gopher://, ... however a
// server redirects), redirects never followed automatically (the caller decides where credentials
// go and bounds the hops), no Accept-Encoding (so servers honour Range), stall detection, bounded
// bodies.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ptk {

struct HttpRequest {
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  double connect_timeout_s = 30;
  // Abort when no byte arrives for this long; also the most the headers may take (after the
  // connect timeout), and the most the body of an answer that is not a 2xx (a redirect's, an
  // error's) may take after its headers: a server dripping a byte a second is cut too.
  double stall_timeout_s = 60;
  double total_timeout_s = 0;  // 0: none
  // A body collected in HttpResponse::body (no sink) longer than this aborts the transfer
  // (HttpResponse::body_limit_hit): a server that never stops sending is not read forever.
  uint64_t max_body_bytes = 64ull << 20;
};

struct HttpResponse {
  long status = 0;
  std::map<std::string, std::string> headers;  // lower-case names; the last value of repeated ones
  std::string body;                            // collected only when no body sink took it
  int curl_code = 0;                           // CURLE_OK = 0
  std::string curl_error;
  uint64_t body_bytes = 0;
  bool aborted_by_sink = false;
  bool body_limit_hit = false;
  std::string Header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// Called once when the headers of the final response are complete and before its first body
// byte; returning false aborts the transfer. Then called with each body piece; returning false
// aborts (e.g. a write error).
struct BodySink {
  std::function<bool(const HttpResponse&)> on_headers;
  std::function<bool(const char*, size_t)> on_data;
};

// The CA certificate bundle https is verified with: $CURL_CA_BUNDLE or $SSL_CERT_FILE when set
// (as curl and Python honour them), else the first readable file of libcurl's built-in path and
// the other distributions' usual places (RHEL, SUSE, Alpine): a portable ptk tree built on Debian
// runs where the certificates are kept elsewhere. Empty: none found (libcurl's default is used).
std::string FindCaBundle();

class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Performs a GET. Transport problems are reported in curl_code/curl_error (not as a Status);
  // a non-OK Status means the request could not be made at all.
  absl::Status Get(const HttpRequest& req, HttpResponse* resp, BodySink* sink = nullptr);

 private:
  void* curl_;
  std::string ca_bundle_;
  bool no_ca_path_ = false;  // libcurl's built-in CA directory does not exist here
};

// "http://host:port/path" -> "host:port" (lower-case); empty when unparsable.
std::string UrlAuthority(const std::string& url);
// "http://host:port" of an absolute URL.
std::string UrlOrigin(const std::string& url);
// True for http:// and https:// URLs (case-insensitive scheme): the only ones ptk fetches.
bool IsHttpUrl(const std::string& url);
// Resolves a Location header against the URL it came from.
std::string ResolveUrl(const std::string& base, const std::string& location);
// Percent-encodes everything but unreserved characters (and '/' when keep_slash).
std::string UrlQuote(const std::string& s, bool keep_slash);
std::string UrlUnquote(const std::string& s);

}  // namespace ptk
