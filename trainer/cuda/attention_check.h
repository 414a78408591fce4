// Attention's argument checks, shared by the fp32 kernels (attention_cuda.cu) and cuDNN's (flash_attention_cuda.cpp),
// and the one kernel cuDNN's half launches (in attention_cuda.cu: flash_attention_cuda.cpp is host code, built by the
// C++ compiler).
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include <fmt/core.h>

#include "absl/status/status.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda::attention_detail {

inline std::string ShapeString(const AttentionShape& s) {
  return fmt::format("b={}, t={}, nh={}, hd={}, groups={}{}{}", s.b, s.t, s.nh, s.hd, s.groups(),
                     s.window >= 0 ? fmt::format(", window={}", s.window) : "", s.sink ? ", softmax offset" : "");
}

inline absl::Status CheckShape(const AttentionShape& s, const std::string& where) {
  if (s.b <= 0 || s.t <= 0 || s.nh <= 0 || s.hd <= 0)
    return absl::InvalidArgumentError(fmt::format("{}: every size must be positive", where));
  if (s.ng < 0 || s.nh % s.groups() != 0)
    return absl::InvalidArgumentError(
        fmt::format("{}: {} query groups do not divide {} query heads", where, s.groups(), s.nh));
  if (s.window < -1) return absl::InvalidArgumentError(fmt::format("{}: window {} below -1", where, s.window));
  if (s.t > INT_MAX / 4 || s.qkv_width() > INT_MAX || s.nh > INT_MAX || s.window >= INT_MAX)
    return absl::InvalidArgumentError(fmt::format("{}: sizes beyond cuBLAS's int range", where));
  return absl::OkStatus();
}

// Writes cuDNN's dropout seed and offset to the device's rng[0] and rng[1] on `stream` (one thread; in stream
// order: a graph launched before reads the previous values, one after these). The caller checks the launch.
void LaunchSetFlashRng(int64_t* rng, int64_t seed, int64_t offset, cudaStream_t stream);

}  // namespace ptk::cuda::attention_detail
