// ptk-download: the Hub's rate-limit headers and the shared limiter's sleep.
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

void SleepFor(double s, const std::atomic<bool>& stop) {
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  while (!stop && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace ptk::download_detail
