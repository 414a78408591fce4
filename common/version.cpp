// ptk's version and what --version says about the build: the commit (at build time,
// cmake/PtkGitCommit.cmake), the build type and the backends built in (at configure time).
#include "common/version.h"

#include <string>

#include "ptk_build_config.h"
#include "ptk_git_commit.h"

namespace ptk::cli {

std::string VersionString() { return std::string("ptk ") + PTK_VERSION; }

std::string BuildDescription() {
  return std::string("commit: ") + PTK_GIT_COMMIT + "\nbuild type: " + PTK_BUILD_TYPE + "\nbackends: " + PTK_BACKENDS;
}

}  // namespace ptk::cli
