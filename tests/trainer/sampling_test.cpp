// Text samples: the token pick (greedy, temperature draws, padded rows never chosen), Generate
// against a plain argmax over Forward on the exact context (padding the length to 64 changes
// nothing; a long context slides), and ptk-train --sample-interval end to end.
#include "trainer/sampling.h"

#include <cmath>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "trainer/backend.h"

namespace ptk {
namespace {

TEST(PickToken, GreedyTakesTheFirstMaximumOfTheRealVocabulary) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 9.0f, 9.5f};  // the last two: padded rows
  EXPECT_EQ(PickToken(logits, 4, 0.0, 1), 1);
  EXPECT_EQ(PickToken(logits, 6, 0.0, 1), 5);
  // A temperature near 0 is greedy in effect; draws never leave the real vocabulary.
  EXPECT_EQ(PickToken(logits, 4, 1e-4, 7), 1);
  for (uint64_t key = 0; key < 2000; ++key) EXPECT_LT(PickToken(logits, 4, 5.0, key), 4);
}

TEST(PickToken, TemperatureDrawsFollowTheSoftmaxAndTheKey) {
  const std::vector<float> logits = {0.0f, static_cast<float>(std::log(3.0))};
  int ones = 0;
  const int n = 40000;
  for (int k = 0; k < n; ++k) ones += PickToken(logits, 2, 1.0, static_cast<uint64_t>(k) * 7919 + 3);
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.75, 0.01);
  // At temperature 2 the odds are sqrt(3) : 1.
  ones = 0;
  for (int k = 0; k < n; ++k) ones += PickToken(logits, 2, 2.0, static_cast<uint64_t>(k) * 7919 + 3);
  EXPECT_NEAR(static_cast<double>(ones) / n, std::sqrt(3.0) / (1 + std::sqrt(3.0)), 0.01);
  EXPECT_EQ(PickToken(logits, 2, 1.0, 42), PickToken(logits, 2, 1.0, 42));
}

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GPTConfig c;
    c.num_layers = 2;
    c.hidden_size = 32;
    c.num_attention_heads = 4;
    c.ffn_hidden_size = 128;
    c.seq_length = 20;
    c.max_position_embeddings = 20;
    c.vocab_size = 50;
    c.padded_vocab_size = 64;
    c.init_method_std = 0.5;  // large weights: distinct logits
    auto m = CreateModel(c, BackendOptions{});
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    ASSERT_TRUE(model_->InitWeights(7).ok());
  }
  // argmax over the real vocabulary at the last position of Forward on exactly `ctx`.
  int32_t Next(const std::vector<int32_t>& ctx) {
    const int64_t t = static_cast<int64_t>(ctx.size());
    std::vector<int32_t> labels(ctx.size(), 0), pos(ctx.size());
    for (int64_t i = 0; i < t; ++i) pos[i] = static_cast<int32_t>(i);
    std::vector<float> mask(ctx.size(), 0.0f), logits;
    ModelBatch b{1, t, ctx.data(), labels.data(), pos.data(), mask.data(), nullptr};
    EXPECT_TRUE(model_->Forward(b, &logits).ok());
    const int64_t vp = model_->config().padded_vocab_size;
    int32_t best = 0;
    for (int32_t i = 1; i < model_->config().vocab_size; ++i)
      if (logits[(t - 1) * vp + i] > logits[(t - 1) * vp + best]) best = i;
    return best;
  }
  std::unique_ptr<GPTModel> model_;
};

TEST_F(GenerateTest, GreedyEqualsArgmaxOverTheExactContextAndSlides) {
  const std::vector<int32_t> prompt = {3, 14, 15, 9, 26};
  GenerateOptions o;
  o.new_tokens = 30;  // 5 + 30 > --seq-length 20: the context slides
  auto got = Generate(model_.get(), prompt, o);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 30u);
  std::vector<int32_t> ids = prompt;
  for (int k = 0; k < 30; ++k) {
    std::vector<int32_t> ctx(ids.end() - std::min<size_t>(ids.size(), 20), ids.end());
    ids.push_back(Next(ctx));
  }
  EXPECT_EQ(*got, std::vector<int32_t>(ids.begin() + 5, ids.end()));
  std::set<int32_t> distinct(got->begin(), got->end());
  EXPECT_GT(distinct.size(), 1u) << "a degenerate model tests nothing";
}

TEST_F(GenerateTest, SeededDrawsRepeatAndDiffer) {
  const std::vector<int32_t> prompt = {1, 2, 3};
  GenerateOptions o;
  o.new_tokens = 12;
  o.temperature = 1.0;
  o.seed = 99;
  auto a = Generate(model_.get(), prompt, o), b = Generate(model_.get(), prompt, o);
  o.seed = 100;
  auto c = Generate(model_.get(), prompt, o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
}

TEST_F(GenerateTest, BadPromptsAreErrors) {
  GenerateOptions o;
  EXPECT_FALSE(Generate(model_.get(), std::vector<int32_t>{}, o).ok());
  auto st = Generate(model_.get(), std::vector<int32_t>{1, 50}, o).status();  // 50: a padded row
  EXPECT_NE(st.message().find("prompt token 50 is outside the vocabulary of 50"), absl::string_view::npos) << st;
}

// ptk-train prints a sample every --sample-interval iterations, the same text in two runs.
TEST(SampleCli, PrintsTheSameGreedySampleInEveryRun) {
  ptk::testing::TempDir dir;
  const std::string base = ptk::testing::Tool("ptk-train") +
                           " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32"
                           " --micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --eval-iters 0"
                           " --log-interval 2 --threads 1 --sample-interval 2 --sample-length 5 ";
  auto a = ptk::testing::RunCmd(base + "--sample-prompt 'Once upon a time'");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::regex line(R"re( sample at iteration +(\d) \(greedy\): "Once upon a time" -> "(.*)")re");
  std::vector<std::string> samples;
  for (auto it = std::sregex_iterator(a.output.begin(), a.output.end(), line); it != std::sregex_iterator(); ++it)
    samples.push_back((*it)[1].str() + ":" + (*it)[2].str());
  ASSERT_EQ(samples.size(), 2u) << a.output;
  EXPECT_EQ(samples[0].substr(0, 2), "2:");
  EXPECT_EQ(samples[1].substr(0, 2), "4:");
  auto b = ptk::testing::RunCmd(base + "--sample-prompt 'Once upon a time'");
  EXPECT_NE(b.output.find(samples[1].substr(2)), std::string::npos) << b.output;
  // Unconditional: the prompt is <|endoftext|>; drawn at a temperature.
  auto u = ptk::testing::RunCmd(base + "--sample-temperature 0.8");
  EXPECT_EQ(u.exit_code, 0) << u.output;
  EXPECT_NE(u.output.find(" sample at iteration        4 (temperature 0.8): \"\" -> "), std::string::npos) << u.output;
  // At this length a sample costs less than the training between two samples: no warning.
  EXPECT_EQ(a.output.find("--sample-length"), std::string::npos) << a.output;
  // A prompt that leaves no room in --seq-length is a usage error.
  auto lng = ptk::testing::RunCmd(base + "--sample-prompt \"$(printf 'word %.0s' $(seq 40))\"");
  EXPECT_EQ(lng.exit_code, 2) << lng.output;
  EXPECT_TRUE(std::regex_search(lng.output, std::regex("--sample-prompt is 4\\d tokens: it must be shorter than "
                                                       "--seq-length 32")))
      << lng.output;
}

// A sample runs the model over the whole context for every new token (no KV cache), on rank 0: a
// long one that costs more than the training between two samples is warned with its cost at the
// start (--sample-length 4096 took minutes a sample on a tiny model without a word).
TEST(SampleCli, ALongSampleIsWarnedWithItsCost) {
  const std::string base = ptk::testing::Tool("ptk-train") +
                           " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32"
                           " --micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --eval-iters 0"
                           " --threads 1 --sample-interval 2 ";
  auto r = ptk::testing::RunCmd(base + "--sample-length 4096");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 4096 forwards of 32 positions against 3 x 2 iterations x 2 samples x 32 positions.
  EXPECT_NE(r.output.find("warning: --sample-length 4096: each sample runs the model 4096 times over up to 32 "
                          "positions (no KV cache), 341.3x the work of the 2 iteration(s) between samples"),
            std::string::npos)
      << r.output;
  auto short_one = ptk::testing::RunCmd(base + "--sample-length 8");
  ASSERT_EQ(short_one.exit_code, 0) << short_one.output;
  EXPECT_EQ(short_one.output.find("--sample-length"), std::string::npos) << short_one.output;
}

}  // namespace
}  // namespace ptk
