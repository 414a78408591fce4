// Status helpers.
#include "common/status.h"

#include <cerrno>
#include <cstring>

#include <fmt/core.h>

#include "absl/strings/cord.h"

namespace ptk {

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  absl::Status out(status.code(), fmt::format("{}: {}", context, StatusMessage(status)));
  status.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

namespace {
absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }
}  // namespace

absl::Status UsageError(std::string_view msg) { return AsUsageError(absl::InvalidArgumentError(AbslView(msg))); }

bool IsUsageError(const absl::Status& status) {
  return !status.ok() && status.GetPayload(AbslView(kUsageErrorUrl)).has_value();
}

absl::Status AsUsageError(absl::Status status) {
  if (!status.ok()) status.SetPayload(AbslView(kUsageErrorUrl), absl::Cord());
  return status;
}

absl::Status ErrnoToStatus(int err, std::string_view what) {
  std::string msg = fmt::format("{}: {}", what, std::strerror(err));
  switch (err) {
    case ENOENT: return absl::NotFoundError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
    case EFBIG: return absl::ResourceExhaustedError(msg);
    case EINVAL: return absl::InvalidArgumentError(msg);
    case EEXIST: return absl::AlreadyExistsError(msg);
    case EINTR:
    case EAGAIN: return absl::UnavailableError(msg);
    default: return absl::InternalError(msg);
  }
}

void CheckFailed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "%s:%d: PTK_CHECK failed: %s%s%s\n", file, line, cond, msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace ptk
