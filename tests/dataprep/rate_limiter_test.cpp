// The Hub resolver limiter: what a response says is left of the window, less the resolves still in
// flight.
#include <gtest/gtest.h>
#include <atomic>
#include <chrono>
#include "dataprep/download/download_internal.h"

namespace ptk::download_detail {
namespace {

HttpResponse Answer(int left, int reset_s) {
  HttpResponse r;
  r.status = 200;
  r.headers["ratelimit"] = "\"resolvers\";r=" + std::to_string(left) + ";t=" + std::to_string(reset_s);
  r.headers["ratelimit-policy"] = "\"fixed window\";\"resolvers\";q=5;w=10";
  return r;
}

TEST(RateLimiter, ResolvesInFlightAreTakenOffWhatAnAnswerSaysIsLeft) {
  RateLimiter limiter(0.1, 1.0);
  std::atomic<bool> stop{false};
  const auto later = Clock::now() + std::chrono::seconds(60);
  // Four workers send at once (the window's state not known yet).
  RateLimiter::InFlight a, b, c, d;
  for (auto* in_flight : {&a, &b, &c, &d}) ASSERT_TRUE(limiter.WaitForResolve(stop, later, 60, in_flight).ok());
  EXPECT_EQ(limiter.InFlightCount(), 4);
  // The first answer: the server has counted one of its 5, so "4 left"; but three more are on the
  // way, so one is left to send.
  limiter.Observe(Answer(4, 10));
  a.Release();
  EXPECT_EQ(limiter.RemainingForTest(), 1);
  EXPECT_EQ(limiter.InFlightCount(), 3);
  {
    RateLimiter::InFlight e;
    ASSERT_TRUE(limiter.WaitForResolve(stop, later, 60, &e).ok());
    EXPECT_EQ(limiter.InFlightCount(), 4);
  }  // released when it goes out of scope (a failed transfer returns early)
  EXPECT_EQ(limiter.InFlightCount(), 3);
  // The quota is used up until the window resets (10 s): a caller with 1 s left is told so.
  const absl::Status waited = limiter.WaitForResolve(stop, Clock::now() + std::chrono::seconds(1), 1);
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  // Later answers of the same window correct the count with the ones still in flight.
  limiter.Observe(Answer(1, 9));
  b.Release();
  EXPECT_EQ(limiter.RemainingForTest(), -1);
  c.Release();
  d.Release();
  EXPECT_EQ(limiter.InFlightCount(), 0);
}

TEST(RateLimiter, AnAnswerThatArrivesLateCannotRaiseWhatIsLeft) {
  RateLimiter limiter(0.1, 1.0);
  std::atomic<bool> stop{false};
  const auto later = Clock::now() + std::chrono::seconds(60);
  limiter.Observe(Answer(5, 10));  // a new window: 5 left
  RateLimiter::InFlight a, b, c, d;
  for (auto* in_flight : {&a, &b, &c, &d}) ASSERT_TRUE(limiter.WaitForResolve(stop, later, 60, in_flight).ok());
  EXPECT_EQ(limiter.RemainingForTest(), 1);
  // The answers to b, c, d come first; a's ("4 left", counted first by the server) comes last.
  limiter.Observe(Answer(3, 10));
  b.Release();
  limiter.Observe(Answer(2, 10));
  c.Release();
  limiter.Observe(Answer(1, 10));
  d.Release();
  // What is left is never more than the truth (1): taken as "what the server says, less what may
  // not be counted yet", it is 0 here, since a's answer has not come.
  EXPECT_EQ(limiter.RemainingForTest(), 0);
  limiter.Observe(Answer(4, 10));  // stale: read alone it would let four more go
  a.Release();
  EXPECT_EQ(limiter.RemainingForTest(), 0);
}

TEST(RateLimiter, AnAnswerWithNoResolveInFlightIsTakenAsIs) {
  RateLimiter limiter(0.1, 1.0);
  limiter.Observe(Answer(3, 10));
  EXPECT_EQ(limiter.RemainingForTest(), 3);
  EXPECT_EQ(limiter.InFlightCount(), 0);
}

// Retry-After is delay-seconds or an HTTP-date (RFC 9110 10.2.3). A date was read as no hint: the
// limiter backed off for under a second (at most --retry-max) where the server had asked for an hour.
TEST(RateLimiter, RetryAfterAsAnHttpDateIsTheWaitItNames) {
  RateLimiter limiter(0.1, 1.0);
  HttpResponse r;
  r.status = 429;
  r.headers["date"] = "Sun, 29 Nov 2026 17:00:00 GMT";
  r.headers["retry-after"] = "Sun, 29 Nov 2026 18:00:00 GMT";
  EXPECT_EQ(RetryAfterSeconds(r), 3600.0);
  EXPECT_EQ(limiter.On429(r, 0), 3600.0);
  // RFC 850's and asctime's forms, which a recipient must read too.
  r.headers["retry-after"] = "Sunday, 29-Nov-26 17:02:00 GMT";
  EXPECT_EQ(RetryAfterSeconds(r), 120.0);
  r.headers["retry-after"] = "Sun Nov 29 17:00:30 2026";
  EXPECT_EQ(RetryAfterSeconds(r), 30.0);
  // A date already past is no wait; a wait is at most a day, as delay-seconds are.
  r.headers["retry-after"] = "Sun, 29 Nov 2026 16:00:00 GMT";
  EXPECT_EQ(RetryAfterSeconds(r), 0.0);
  r.headers["retry-after"] = "Sun, 06 Dec 2026 17:00:00 GMT";
  EXPECT_EQ(RetryAfterSeconds(r), 24 * 3600.0);
  r.headers["retry-after"] = "120";
  EXPECT_EQ(RetryAfterSeconds(r), 120.0);
  r.headers["retry-after"] = "soon";
  EXPECT_EQ(RetryAfterSeconds(r), std::nullopt);
  // Without a Date the date is taken against this machine's clock.
  r.headers.erase("date");
  r.headers["retry-after"] = "Fri, 01 Jan 2100 00:00:00 GMT";
  EXPECT_EQ(RetryAfterSeconds(r), 24 * 3600.0);
}

}  // namespace
}  // namespace ptk::download_detail
