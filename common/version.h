// ptk's version and what --version says about the build (common/version.cpp). Apart from common/cli.h
// (which includes it) so that version.cpp compiles without CLI11's header-only library.
#pragma once

#include <string>

namespace ptk::cli {

// ptk's version, as --version prints it ("ptk 0.1.0").
std::string VersionString();

// The lines --version prints after "TOOL (ptk 0.1.0)": "commit: 6e69829abcde[-dirty]" ("unknown"
// outside a git checkout), "build type: Release", "backends: CPU; CUDA 13.0 for sm_80 sm_90 (cuBLASLt
// 13.1.0, cuDNN 9.19.0); NCCL 2.28.9" (the CUDA part where the build has the CUDA backend).
std::string BuildDescription();

}  // namespace ptk::cli
