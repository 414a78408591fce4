// A model saved by transformers against ptk's Forward (the MoE lines' hf_*_convert_test.cpp): the model imported,
// and each sequence of its golden.json (its tokens, transformers' logits and loss) run through ptk.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "interop/hf_gpt2.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "trainer/backend.h"

namespace ptk::testing {

// tests/data/interop/NAME (a model transformers saved, and its golden.json) imported into dir/ck, padded with
// --make-vocab-size-divisible-by 32 to its 96 rows, none added (ptk's loss is then the softmax over transformers' 96
// logits; the default 128 would add 32 copies of the last row to the softmax): the import's ptk-train flags hold
// `flags`; *ck is the checkpoint, *golden golden.json parsed by *parser. Call under ASSERT_NO_FATAL_FAILURE.
inline void ImportHfGolden(const std::string& name, const TempDir& dir, const std::string& flags, PtkCheckpoint* ck,
                           simdjson::dom::parser* parser, simdjson::dom::element* golden) {
  const std::string src = SourceDir() + "/tests/data/interop/" + name;
  ConvertOptions o = ConvertOpts("hf", "ptk", src, dir / "ck");
  o.make_vocab_size_divisible_by = 32;
  auto imp = ImportFromHf(o);
  ASSERT_TRUE(imp.ok()) << imp.status();
  EXPECT_NE(imp->train_flags.find(flags), std::string::npos) << imp->train_flags;
  auto loaded = LoadPtkCheckpoint(dir / "ck");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  *ck = *std::move(loaded);
  ASSERT_EQ(parser->load(src + "/golden.json").get(*golden), simdjson::SUCCESS);
}

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
