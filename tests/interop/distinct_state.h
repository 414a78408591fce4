// Weights and AdamW moments that differ from element to element, for the Megatron conversion tests'
// checkpoints (megatron_mla_test, megatron_moe_test): what comes back from a conversion is each one's own, bit for
// bit.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/checkpoint.h"
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

// A test that saves checkpoints of DistinctWeightsAndMoments: the last one's layout, weights, moments and buffers kept.
class DistinctCheckpointTest : public ::testing::Test {
 protected:
  // `c`'s checkpoint in `dir` with the state `st`. Call under ASSERT_NO_FATAL_FAILURE where it matters.
  void SaveDistinct(const GPTConfig& c, const std::string& dir, const TrainState& st) {
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    DistinctWeightsAndMoments(layout_, &params_, &m1_, &m2_);
    buffers_ = st.buffers;
    ASSERT_TRUE(SaveCheckpoint(dir, layout_, params_, m1_, m2_, st, "[]").ok());
  }
  ParamLayout layout_;
  std::vector<float> params_, m1_, m2_;
  ModelBuffers buffers_;
};

}  // namespace ptk::testing
