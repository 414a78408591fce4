// Usage errors as a typed part of absl::Status (common/status.h): the payload, kept by Annotate,
// decides exit code 2 (common/cli.h), not the message.
#include <gtest/gtest.h>

#include "common/cli.h"
#include "common/status.h"

namespace ptk {
namespace {

TEST(UsageError, IsInvalidArgumentWithThePayloadAndAPlainMessage) {
  const absl::Status st = UsageError("--chunks must be at least 1");
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_TRUE(IsUsageError(st));
  EXPECT_EQ(StatusMessage(st), "--chunks must be at least 1");
  EXPECT_EQ(cli::ExitCodeFor(st), cli::kExitUsage);
}

TEST(UsageError, AnnotateKeepsItAndItsCode) {
  const absl::Status st = Annotate(Annotate(UsageError("bad value"), "--data-path"), "rank 1");
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_TRUE(IsUsageError(st));
  EXPECT_EQ(StatusMessage(st), "rank 1: --data-path: bad value");
  EXPECT_EQ(cli::ExitCodeFor(st), cli::kExitUsage);
}

TEST(UsageError, OtherStatusesAreNotUsageErrorsWhateverTheirText) {
  EXPECT_FALSE(IsUsageError(absl::OkStatus()));
  EXPECT_FALSE(IsUsageError(absl::InvalidArgumentError("usage: a bad record in x.jsonl line 3")));
  EXPECT_EQ(cli::ExitCodeFor(absl::InvalidArgumentError("usage: a bad record")), cli::kExitFailure);
  EXPECT_EQ(cli::ExitCodeFor(absl::DataLossError("x.idx: truncated")), cli::kExitFailure);
  EXPECT_EQ(cli::ExitCodeFor(absl::ResourceExhaustedError("x.bin: No space left on device")), cli::kExitDiskFull);
  EXPECT_FALSE(IsUsageError(Annotate(absl::NotFoundError("missing"), "x")));
}

TEST(UsageError, AsUsageErrorMarksAStatusKeepingCodeAndMessage) {
  const absl::Status st = AsUsageError(absl::InvalidArgumentError("--chunks 0: must be at least 1"));
  EXPECT_TRUE(IsUsageError(st));
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_EQ(StatusMessage(st), "--chunks 0: must be at least 1");
  EXPECT_TRUE(AsUsageError(absl::OkStatus()).ok());
}

TEST(Annotate, KeepsEveryPayload) {
  absl::Status st = absl::UnavailableError("503");
  st.SetPayload("type.googleapis.com/test.Other", absl::Cord("x"));
  const absl::Status a = Annotate(st, "GET /x");
  EXPECT_EQ(StatusMessage(a), "GET /x: 503");
  ASSERT_TRUE(a.GetPayload("type.googleapis.com/test.Other").has_value());
  EXPECT_EQ(std::string(*a.GetPayload("type.googleapis.com/test.Other")), "x");
}

}  // namespace
}  // namespace ptk
