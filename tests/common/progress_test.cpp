// ProgressReporter's interval (common/progress.h): PTK_PROGRESS_INTERVAL is a number of seconds in
// [0.001, 86400]; 0, negative, tiny, huge, inf, nan and text are usage errors naming it (1e300 and
// inf overflowed the clock: no wait, millions of log lines, a run that did not end).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <string>
#include <thread>

#include "common/progress.h"
#include "common/status.h"

namespace ptk {
namespace {

class ProgressInterval : public ::testing::Test {
 protected:
  void TearDown() override { ::unsetenv("PTK_PROGRESS_INTERVAL"); }
  absl::StatusOr<std::optional<double>> With(const char* value) {
    ::setenv("PTK_PROGRESS_INTERVAL", value, 1);
    return ProgressIntervalFromEnv();
  }
};

TEST_F(ProgressInterval, UnsetOrEmptyMeansTheDefault) {
  ::unsetenv("PTK_PROGRESS_INTERVAL");
  ASSERT_TRUE(ProgressIntervalFromEnv().ok());
  EXPECT_EQ(*ProgressIntervalFromEnv(), std::nullopt);
  auto empty = With("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, std::nullopt);
}

TEST_F(ProgressInterval, SecondsInRangeAreTaken) {
  for (auto [text, v] :
       {std::pair{"0.001", 0.001}, {"0.25", 0.25}, {"60", 60.0}, {"3600", 3600.0}, {"86400", 86400.0}}) {
    auto r = With(text);
    ASSERT_TRUE(r.ok()) << text << ": " << r.status();
    EXPECT_EQ(**r, v) << text;
  }
}

TEST_F(ProgressInterval, AnythingElseIsAUsageErrorNamingTheVariable) {
  const std::pair<const char*, const char*> cases[] = {
      {"0", "PTK_PROGRESS_INTERVAL=0 is outside [0.001, 86400] seconds"},
      {"-1", "PTK_PROGRESS_INTERVAL=-1 is outside"},
      {"1e-9", "PTK_PROGRESS_INTERVAL=1e-9 is outside"},
      {"1e300", "PTK_PROGRESS_INTERVAL=1e300 is outside"},
      {"100000", "PTK_PROGRESS_INTERVAL=100000 is outside"},
      {"inf", "PTK_PROGRESS_INTERVAL=\"inf\" is not a number of seconds"},
      {"nan", "PTK_PROGRESS_INTERVAL=\"nan\" is not a number of seconds"},
      {"abc", "PTK_PROGRESS_INTERVAL=\"abc\" is not a number of seconds"},
      {"5s", "PTK_PROGRESS_INTERVAL=\"5s\" is not a number of seconds"},
      {" 5", "PTK_PROGRESS_INTERVAL=\" 5\" is not a number of seconds"},
  };
  for (auto [text, expected] : cases) {
    auto r = With(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(std::string(StatusMessage(r.status())).find(expected), std::string::npos) << r.status();
  }
}

// An interval a library caller sets is clamped too: 1e300 seconds did not wait at all (the
// clock's nanoseconds overflowed) and printed a line without pause.
TEST_F(ProgressInterval, AHugeIntervalWaits) {
  testing::internal::CaptureStderr();
  {
    ProgressReporter p({.label = "test", .interval_s = 1e300});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("test: "), std::string::npos) << err.substr(0, 500);
}

}  // namespace
}  // namespace ptk
