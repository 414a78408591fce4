// Status helpers: PTK_RETURN_IF_ERROR / PTK_ASSIGN_OR_RETURN over absl::Status, PTK_CHECK.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

// The message of a status as std::string_view (Debian's Abseil has its own string_view type).
inline std::string_view StatusMessage(const absl::Status& s) { return {s.message().data(), s.message().size()}; }

// Prefixes a status message with context ("path: ..."), keeping the code and the payloads (so a
// usage error stays one).
absl::Status Annotate(const absl::Status& status, std::string_view context);

// A usage error: a bad flag, flag value, flag combination or environment setting, whoever finds it
// (a main or a library). It is kInvalidArgument carrying the payload kUsageErrorUrl, a typed part of
// the status that Annotate keeps; the message has no prefix. cli::RunMain prints it as
// "PROG: usage error: MESSAGE" and exits 2; other kInvalidArgument statuses (a bad record) exit 1.
inline constexpr std::string_view kUsageErrorUrl = "type.googleapis.com/ptk.UsageError";
absl::Status UsageError(std::string_view msg);
bool IsUsageError(const absl::Status& status);
// `status` marked as a usage error (message and code kept); an ok status stays ok.
absl::Status AsUsageError(absl::Status status);

// errno -> absl::Status with "what: strerror" message. ENOSPC/EDQUOT map to kResourceExhausted.
absl::Status ErrnoToStatus(int err, std::string_view what);

[[noreturn]] void CheckFailed(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace ptk

#define PTK_STATUS_CONCAT_INNER_(a, b) a##b
#define PTK_STATUS_CONCAT_(a, b) PTK_STATUS_CONCAT_INNER_(a, b)

#define PTK_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status ptk_status_ = (expr);       \
    if (!ptk_status_.ok()) return ptk_status_; \
  } while (0)

#define PTK_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(*tmp)

#define PTK_ASSIGN_OR_RETURN(lhs, expr) \
  PTK_ASSIGN_OR_RETURN_IMPL_(PTK_STATUS_CONCAT_(ptk_statusor_, __LINE__), lhs, expr)

// Programmer errors only: aborts with file:line. Bad input must produce a Status instead.
#define PTK_CHECK(cond)                                                                  \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) ::ptk::CheckFailed(__FILE__, __LINE__, #cond, ""); \
  } while (0)
#define PTK_CHECK_MSG(cond, msg)                                                            \
  do {                                                                                      \
    if (__builtin_expect(!(cond), 0)) ::ptk::CheckFailed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
