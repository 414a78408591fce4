// Status helpers.
#include "common/status.h"

#include <cerrno>
#include <cstring>

#include <fmt/core.h>

namespace ptk {

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), fmt::format("{}: {}", context, StatusMessage(status)));
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
