// ptk-download: the Hub's rate-limit headers and the shared limiter's sleep.
#include <curl/curl.h>

#include <ctime>

#include "dataprep/download/download_internal.h"

namespace ptk::download_detail {

RateLimitHeader ParseRateLimit(const std::string& h) {
  static const std::regex re(R"RE("?(\w+)"?\s*;\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+))RE", std::regex::icase);
  std::smatch m;
  RateLimitHeader r;
  if (std::regex_search(h, m, re)) {
    auto remaining = ParseInt64(m[2].str()), reset = ParseInt64(m[3].str());
    if (!remaining || !reset) return r;  // digits too many to be a count: ignored, as a missing header
    r.ok = true;
    r.bucket = m[1];
    r.remaining = *remaining;
    r.reset_s = std::min<int64_t>(*reset, 24 * 3600);
  }
  return r;
}

std::optional<double> RetryAfterSeconds(const HttpResponse& r) {
  constexpr int64_t kDay = 24 * 3600;
  const std::string ra = r.Header("retry-after");
  if (ra.empty()) return std::nullopt;
  if (const auto secs = ParseUint64(ra)) return static_cast<double>(std::min<uint64_t>(*secs, kDay));
  // An HTTP-date (IMF-fixdate, or the obsolete RFC 850 and asctime forms: curl_getdate reads all three).
  const time_t at = ::curl_getdate(ra.c_str(), nullptr);
  if (at < 0) return std::nullopt;
  const std::string date = r.Header("date");
  time_t now = date.empty() ? -1 : ::curl_getdate(date.c_str(), nullptr);
  if (now < 0) now = ::time(nullptr);
  return static_cast<double>(std::clamp<int64_t>(static_cast<int64_t>(at) - static_cast<int64_t>(now), 0, kDay));
}

void SleepFor(double s, const std::atomic<bool>& stop) {
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  while (!stop && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace ptk::download_detail
