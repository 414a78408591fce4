// Gpt2Tokenizer against goldens produced by the real reference tokenizers
// (tests/support/gen_tokenizer_goldens.py: Hugging Face GPT2TokenizerFast and tiktoken).
#include <fstream>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/hash.h"
#include "tests/test_util.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {
namespace {

std::string IdsSha256(const std::vector<int32_t>& ids) {
  return Sha256Hex(std::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
}

std::vector<int32_t> ToIds(simdjson::dom::array arr) {
  std::vector<int32_t> v;
  for (auto x : arr) v.push_back(static_cast<int32_t>(int64_t(x)));
  return v;
}

class GoldenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Gpt2Tokenizer::LoadDefault();
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = t->release();
  }
  static void TearDownTestSuite() { delete tok_; }
  static Gpt2Tokenizer* tok_;
};
Gpt2Tokenizer* GoldenTest::tok_ = nullptr;

TEST_F(GoldenTest, VocabShape) {
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->eod(), 50256);
  EXPECT_EQ(tok_->num_merges(), 50000);
  EXPECT_EQ(tok_->TokenBytes(220), " ");
  EXPECT_EQ(tok_->TokenBytes(0), "!");
  EXPECT_EQ(tok_->TokenBytes(50256), "<|endoftext|>");
}

TEST_F(GoldenTest, NotesGoldens) {
  Gpt2Encoder enc(*tok_, {.special_endoftext = false});
  auto ids = [&](std::string_view s) {
    std::vector<int32_t> v;
    enc.Encode(s, &v);
    return v;
  };
  EXPECT_EQ(ids("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(ids(" Hello  world\n\n"), (std::vector<int32_t>{18435, 220, 995, 628}));
  EXPECT_EQ(ids("I'm  here"), (std::vector<int32_t>{40, 1101, 220, 994}));
  EXPECT_EQ(ids("\xC3\x9Cn\xC3\xAF"
                "c\xC3\xB6"
                "d\xC3\xA9 \xF0\x9F\x98\x80"),
            (std::vector<int32_t>{127, 250, 77, 26884, 66, 9101, 67, 2634, 30325, 222}));
  EXPECT_EQ(ids("a<|endoftext|>b"), (std::vector<int32_t>{64, 27, 91, 437, 1659, 5239, 91, 29, 65}));
  Gpt2Encoder hf(*tok_);
  std::vector<int32_t> v;
  hf.Encode("a<|endoftext|>b", &v);
  EXPECT_EQ(v, (std::vector<int32_t>{64, 50256, 65}));
}

TEST_F(GoldenTest, CorpusMatchesHuggingFaceAndTiktoken) {
  const std::string dir = testing::SourceDir() + "/tests/data/tokenizer/";
  simdjson::dom::parser p_corpus, p_gold;
  std::ifstream corpus(dir + "corpus.jsonl"), golden(dir + "golden.jsonl");
  ASSERT_TRUE(corpus.good() && golden.good());
  std::string cl, gl;
  int cases = 0, compared_tiktoken = 0;
  Gpt2Encoder hf_mode(*tok_);
  Gpt2Encoder ordinary_mode(*tok_, {.special_endoftext = false});
  while (std::getline(corpus, cl)) {
    ASSERT_TRUE(std::getline(golden, gl));
    simdjson::dom::element c = p_corpus.parse(cl);
    simdjson::dom::element g = p_gold.parse(gl);
    std::string name{std::string_view(c["name"])};
    ASSERT_EQ(name, std::string(std::string_view(g["name"])));
    std::string text;
    if (c["text"].error() == simdjson::SUCCESS) {
      text = std::string(std::string_view(c["text"]));
    } else {
      std::string unit{std::string_view(c["repeat"])};
      int64_t count = int64_t(c["count"]);
      text.reserve(unit.size() * count);
      for (int64_t i = 0; i < count; ++i) text += unit;
    }
    std::vector<int32_t> got, got_ord;
    hf_mode.Encode(text, &got);
    ordinary_mode.Encode(text, &got_ord);
    if (g["hf"].error() == simdjson::SUCCESS) {
      std::vector<int32_t> want = ToIds(g["hf"]);
      ASSERT_EQ(got, want) << name;
      std::vector<int32_t> want_ord = g["hf_ordinary"].error() == simdjson::SUCCESS ? ToIds(g["hf_ordinary"]) : want;
      ASSERT_EQ(got_ord, want_ord) << name;
      if (g["tiktoken"].error() != simdjson::SUCCESS) {
        ++compared_tiktoken;  // tiktoken's encode_ordinary equals hf_ordinary here
      }
    } else {
      ASSERT_EQ(static_cast<int64_t>(got.size()), int64_t(g["hf_n"])) << name;
      ASSERT_EQ(IdsSha256(got), std::string(std::string_view(g["hf_sha256"]))) << name;
      ASSERT_EQ(IdsSha256(got_ord), std::string(std::string_view(g["hf_ordinary_sha256"]))) << name;
      if (g["tiktoken"].error() != simdjson::SUCCESS) ++compared_tiktoken;
    }
    // Round trip: decoding gives the text back (valid UTF-8 input).
    if (text.size() < 100000) {
      ASSERT_EQ(tok_->Decode(got), text) << name;
    }
    ++cases;
  }
  EXPECT_GT(cases, 1000);
  EXPECT_EQ(compared_tiktoken, cases);
}

}  // namespace
}  // namespace ptk
