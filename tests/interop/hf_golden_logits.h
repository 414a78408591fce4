// A model saved by transformers against ptk's Forward (the MoE lines' hf_*_convert_test.cpp): each sequence of the
// model's golden.json (its tokens, transformers' logits and loss) run through ptk.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "trainer/backend.h"

namespace ptk::testing {

// ptk's Forward of `config` with `params` on each sequence of `golden` (HF's loss: each token's logits against the
// next token): the largest difference of its logits (`vocab` to a row) from transformers'. With `expect_equal`, each
// sequence's loss within 1e-5 of transformers' (printed).
inline double WorstHfLogitDifference(simdjson::dom::element golden, const GPTConfig& config,
                                     const std::vector<float>& params, int64_t vocab, bool expect_equal) {
  auto model = CreateModel(config, BackendOptions{});
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return 0.0;
  EXPECT_TRUE((*model)->WriteParams(params).ok());
  double worst = 0;
  for (simdjson::dom::element s : golden["sequences"].get_array()) {
    std::vector<int32_t> tokens;
    for (int64_t id : s["tokens"].get_array()) tokens.push_back(static_cast<int32_t>(id));
    const int64_t t = static_cast<int64_t>(tokens.size());
    std::vector<int32_t> labels(tokens.size(), 0), pos(tokens.size());
    std::vector<float> mask(tokens.size(), 0.0f), logits;
    for (int64_t i = 0; i < t; ++i) {
      pos[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      if (i + 1 < t) {
        labels[static_cast<size_t>(i)] = tokens[static_cast<size_t>(i + 1)];
        mask[static_cast<size_t>(i)] = 1.0f;
      }
    }
    ModelBatch b{1, t, tokens.data(), labels.data(), pos.data(), mask.data(), nullptr};
    auto loss = (*model)->Forward(b, &logits);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (!loss.ok()) return 0.0;
    int64_t k = 0;
    for (double want : s["logits"].get_array()) {
      worst = std::max(worst, std::abs(want - logits[static_cast<size_t>(k)]));
      ++k;
    }
    EXPECT_EQ(k, t * vocab);
    if (expect_equal) {
      const double want = s["loss"].get_double().value(), got = loss->loss_sum / loss->tokens;
      EXPECT_NEAR(got, want, 1e-5);
      std::printf("%lld tokens: loss %.7f, transformers' %.7f\n", static_cast<long long>(t), got, want);
    }
  }
  return worst;
}

}  // namespace ptk::testing
