// The largest LayerNorm epsilon and init std a GPT model takes (GPTConfig::Validate, and
// ptk-convert's config.json import, which names the key).
#pragma once

namespace ptk {

// An epsilon past 1 swamps the variance it guards (1e300 makes every LayerNorm output its bias); a
// std past 1 is no initialisation a GPT uses.
inline constexpr double kGptConfigMaxLayerNormEpsilon = 1.0;
inline constexpr double kGptConfigMaxInitMethodStd = 1.0;

}  // namespace ptk
