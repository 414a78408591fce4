// Deterministic micro-batches for the model tests (tensor_parallel_test, pipeline_parallel_test):
// k of them, each of 2 samples of t tokens from a vocabulary of 97, a loss mask with holes, and
// the samples' dropout keys.
#pragma once

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/gpt_model.h"

namespace ptk::testing {

struct Batches {
  int64_t t;
  std::vector<std::vector<int32_t>> tokens, labels, positions;
  std::vector<std::vector<float>> mask;
  std::vector<std::vector<int64_t>> keys;
  Batches(int count, int64_t seq) : t(seq) {
    for (int k = 0; k < count; ++k) {
      std::vector<int32_t> tk, l, p;
      std::vector<float> m;
      for (int64_t i = 0; i < 2 * t; ++i) {
        tk.push_back(static_cast<int32_t>((i * 37 + 5 + 13 * k) % 97));
        l.push_back(static_cast<int32_t>((i * 11 + 3 + 7 * k) % 97));
        p.push_back(static_cast<int32_t>(i % t));
        m.push_back(i % 7 == 6 ? 0.0f : 1.0f);
      }
      tokens.push_back(tk);
      labels.push_back(l);
      positions.push_back(p);
      mask.push_back(m);
      keys.push_back({2 * k, 2 * k + 1});
    }
  }
  ModelBatch Get(size_t k) const {
    return ModelBatch{2, t, tokens[k].data(), labels[k].data(), positions[k].data(), mask[k].data(), keys[k].data()};
  }
  std::vector<ModelBatch> All() const {
    std::vector<ModelBatch> v;
    for (size_t k = 0; k < tokens.size(); ++k) v.push_back(Get(k));
    return v;
  }
};

// One rank's loss and gradients over the micro-batches, as TrainStep would scale them.
struct Reference {
  LossSum loss, eval;
  std::vector<float> grads;
};
inline Reference OneRank(const GPTConfig& c, const std::vector<ModelBatch>& mbs, const std::vector<double>& scales) {
  Reference ref;
  auto m = CpuGPTModel::Create(c);
  EXPECT_TRUE(m.ok());
  EXPECT_TRUE((*m)->InitWeights(11).ok());
  EXPECT_TRUE((*m)->ZeroGrads().ok());
  for (size_t k = 0; k < mbs.size(); ++k) {
    auto l = (*m)->ForwardBackward(mbs[k], scales[k], true, 99);
    EXPECT_TRUE(l.ok()) << l.status();
    ref.loss.loss_sum += l->loss_sum;
    ref.loss.tokens += l->tokens;
  }
  ref.grads.resize(static_cast<size_t>((*m)->num_params()));
  EXPECT_TRUE((*m)->ReadGrads(ref.grads).ok());
  auto e = (*m)->Forward(mbs[0]);
  EXPECT_TRUE(e.ok());
  ref.eval = *e;
  return ref;
}

}  // namespace ptk::testing
