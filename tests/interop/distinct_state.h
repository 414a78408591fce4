// Weights and AdamW moments that differ from element to element, for the Megatron conversion tests'
// checkpoints: what comes back from a conversion is each one's own, bit for bit.
#pragma once

#include <vector>

#include "trainer/param_layout.h"

namespace ptk::testing {

// `layout`'s initial weights (seed 5) plus a ramp, and first and second moments of their own patterns.
inline void DistinctWeightsAndMoments(const ParamLayout& layout, std::vector<float>* params, std::vector<float>* m1,
                                      std::vector<float>* m2) {
  params->resize(static_cast<size_t>(layout.num_params));
  layout.InitWeights(5, *params);
  m1->resize(params->size());
  m2->resize(params->size());
  for (size_t i = 0; i < params->size(); ++i) {
    (*params)[i] += 1e-3f * static_cast<float>(i % 97);
    (*m1)[i] = 1e-4f * static_cast<float>(i % 89) - 3e-3f;
    (*m2)[i] = 1e-6f * static_cast<float>(1 + i % 83);
  }
}

}  // namespace ptk::testing
