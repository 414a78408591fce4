// ptk-download: the Hub's rate-limit headers and the shared limiter's sleep.
#include "dataprep/download_internal.h"

namespace ptk::download_detail {

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

void SleepFor(double s, const std::atomic<bool>& stop) {
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  while (!stop && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace ptk::download_detail
