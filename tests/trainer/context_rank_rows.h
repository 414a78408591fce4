// A context rank's share of a model batch, for the CUDA model's context parallelism tests
// (cuda_context_parallel_test, cuda_context_pipeline_test): its rows (ContextParallelPositions) of each
// sample, at their true positions, the samples' dropout keys kept. The CPU tests cut a loader's
// MicroBatch instead (KeepContextRows).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/gpt_model.h"
#include "trainer/parallel_layout.h"

namespace ptk::testing {

// Rows `pos` of each of the b samples of x (b, t).
template <typename V>
std::vector<V> Rows(const V* x, int64_t b, int64_t t, const std::vector<int64_t>& pos) {
  std::vector<V> out;
  for (int64_t s = 0; s < b; ++s)
    for (const int64_t p : pos) out.push_back(x[s * t + p]);
  return out;
}

// Context rank `rank` of C's micro-batch of `whole`: `batch` (b samples of t / C rows) points into the
// vectors it holds, so it is neither copied nor moved.
struct ContextRows {
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask;
  ModelBatch batch;
  ContextRows(const ModelBatch& whole, int C, int rank) {
    const std::vector<int64_t> pos = ContextParallelPositions(whole.t, C, rank);
    tokens = Rows(whole.tokens, whole.b, whole.t, pos);
    labels = Rows(whole.labels, whole.b, whole.t, pos);
    positions = Rows(whole.position_ids, whole.b, whole.t, pos);
    mask = Rows(whole.loss_mask, whole.b, whole.t, pos);
    batch = ModelBatch{whole.b,          whole.t / C, tokens.data(),    labels.data(),
                       positions.data(), mask.data(), whole.sample_keys};
  }
  ContextRows(const ContextRows&) = delete;
  ContextRows& operator=(const ContextRows&) = delete;
};

}  // namespace ptk::testing
