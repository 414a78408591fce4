// Progress reporting.
#include "common/progress.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <fmt/core.h>

#include "common/human_format.h"
#include "common/logging.h"
#include "common/status.h"

namespace ptk {

absl::StatusOr<std::optional<double>> ProgressIntervalFromEnv() {
  const char* env = std::getenv("PTK_PROGRESS_INTERVAL");
  if (env == nullptr || *env == '\0') return std::nullopt;
  const std::string_view text(env);
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // from_chars takes inf and nan; a hexadecimal float would need its own format.
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v))
    return UsageError(fmt::format("PTK_PROGRESS_INTERVAL={:?} is not a number of seconds (e.g. 0.5 or 60)",
                                  text.size() > 40 ? std::string(text.substr(0, 40)) + "..." : std::string(text)));
  if (!(v >= kMinProgressInterval && v <= kMaxProgressInterval))
    return UsageError(fmt::format("PTK_PROGRESS_INTERVAL={} is outside [{}, {}] seconds", text, kMinProgressInterval,
                                  kMaxProgressInterval));
  return v;
}

ProgressReporter::ProgressReporter(Options options) : opt_(std::move(options)) {
  start_ = std::chrono::steady_clock::now();
  items_total_ = opt_.items_total;
  bytes_total_ = opt_.bytes_total;
  tty_ = ::isatty(STDERR_FILENO) == 1;
  if (opt_.interval_s < 0) {
    const auto env = ProgressIntervalFromEnv();  // a bad value: cli::Parse has refused it already
    opt_.interval_s = env.ok() && env->has_value() ? **env : tty_ ? 0.25 : 30.0;
  }
  // A zero or tiny wait would print without pause; a huge one overflows the clock's nanoseconds
  // (and then does not wait at all).
  opt_.interval_s = std::clamp(opt_.interval_s, kMinProgressInterval, kMaxProgressInterval);
  if (opt_.enabled) thread_ = std::thread([this] { Run(); });
}

ProgressReporter::~ProgressReporter() { Finish(); }

void ProgressReporter::SetTotals(uint64_t items_total, uint64_t bytes_total) {
  items_total_ = items_total;
  bytes_total_ = bytes_total;
}

double ProgressReporter::ElapsedSeconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::string ProgressReporter::Line() const {
  double el = ElapsedSeconds();
  uint64_t it = items(), by = bytes();
  uint64_t it_t = items_total_.load(), by_t = bytes_total_.load();
  std::string s = opt_.label + ": ";
  if (it_t > 0)
    s += fmt::format("{}/{} {}", it, it_t, opt_.item_unit);
  else
    s += fmt::format("{} {}", it, opt_.item_unit);
  if (by > 0 || by_t > 0) {
    s += ", " + HumanBytes(static_cast<double>(by));
    if (by_t > 0) s += " / " + HumanBytes(static_cast<double>(by_t));
  }
  double rate_b = el > 0 ? by / el : 0;
  double rate_i = el > 0 ? it / el : 0;
  if (by > 0)
    s += fmt::format(", {:.1f} MB/s", rate_b / 1e6);
  else
    s += fmt::format(", {:.1f} {}/s", rate_i, opt_.item_unit);
  double eta = -1;
  if (by_t > 0 && rate_b > 0 && by <= by_t)
    eta = (by_t - by) / rate_b;
  else if (it_t > 0 && rate_i > 0 && it <= it_t)
    eta = (it_t - it) / rate_i;
  if (eta >= 0) s += ", ETA " + HumanDuration(eta);
  s += ", elapsed " + HumanDuration(el);
  return s;
}

void ProgressReporter::Refresh() {
  if (!tty_ || !opt_.enabled) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!stop_) log::SetStatusLine(Line());
}

void ProgressReporter::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::duration<double>(opt_.interval_s));
    if (stop_) break;
    std::string line = Line();
    if (tty_) {
      log::SetStatusLine(line);
    } else {
      log::Info("{}", line);
    }
  }
}

void ProgressReporter::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (tty_ && opt_.enabled) log::SetStatusLine("");
}

}  // namespace ptk
