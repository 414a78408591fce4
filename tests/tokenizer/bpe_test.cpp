// BPE internals: the two merge algorithms agree, every vocab token encodes to itself, the cache is
// transparent, bad vocab/merges files are rejected with a clear message.
#include <random>

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/pretokenizer.h"

namespace ptk {
namespace {

const Gpt2Tokenizer& Tok() {
  static Gpt2Tokenizer* t = Gpt2Tokenizer::LoadDefault()->release();
  return *t;
}

TEST(Bpe, ShortAndLongAlgorithmsAgree) {
  std::mt19937 rng(7);
  const std::string alphabet = "aaabbbeeesst  ---..__00112233xyz\xC3\xA9\xE4\xB8\xAD";
  for (int iter = 0; iter < 3000; ++iter) {
    size_t n = 1 + rng() % 60;
    std::string s;
    for (size_t i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
    std::vector<int32_t> a, b, c;
    Tok().BpeShort(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &a);
    Tok().BpeLong(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &b);
    Tok().BpeShortPortable(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &c);
    ASSERT_EQ(a, b) << s;
    ASSERT_EQ(c, b) << s;
    ASSERT_EQ(Tok().DecodeBytes(a), s);
  }
}

// The round's minimum and its occurrences are taken 8 ranks at a time on AVX2 machines: every piece
// length up to kShortPiece (the padding past the last symbol included), with repeated pairs that
// merge several times in one round, must give the portable path's ids.
TEST(Bpe, VectorAndPortableRoundsAgreeAtEveryLength) {
  std::mt19937 rng(11);
  const std::string alphabets[] = {"aaaa", "ab", "  \n", "\xD0\xB0\xD0\xB1", "\xE0\xA4\x95\xE0\xA5\x8D", "e s.t0"};
  for (const std::string& alphabet : alphabets) {
    for (size_t n = 2; n <= Gpt2Tokenizer::kShortPiece; ++n) {
      for (int iter = 0; iter < 20; ++iter) {
        std::string s;
        for (size_t i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
        std::vector<int32_t> a, b, c;
        Tok().BpeShort(reinterpret_cast<const uint8_t*>(s.data()), n, &a);
        Tok().BpeShortPortable(reinterpret_cast<const uint8_t*>(s.data()), n, &b);
        Tok().BpeLong(reinterpret_cast<const uint8_t*>(s.data()), n, &c);
        ASSERT_EQ(a, b) << n;
        ASSERT_EQ(a, c) << n;
      }
    }
  }
}

// Misses are merged two at a time, their rounds interleaved (pieces of at most 16 bytes in vector
// registers on AVX2): every pairing of lengths, on both paths, gives each piece's own ids.
TEST(Bpe, PairedMergesEqualSingleOnes) {
  std::mt19937 rng(13);
  const std::string alphabets[] = {"aaaa", "ab", " e s.t0", "\xD0\xB0\xD0\xB1\xD0\xB2", "\xE0\xA4\x95\xE0\xA5\x8D"};
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s[2];
    for (std::string& x : s) {
      const std::string& alphabet = alphabets[rng() % 5];
      const size_t n = rng() % 4 == 0 ? rng() % (Gpt2Tokenizer::kShortPiece + 1) : rng() % 17;
      for (size_t i = 0; i < n; ++i) x += alphabet[rng() % alphabet.size()];
    }
    std::vector<int32_t> want[2];
    for (int k = 0; k < 2; ++k) Tok().BpeShort(reinterpret_cast<const uint8_t*>(s[k].data()), s[k].size(), &want[k]);
    for (bool portable : {false, true}) {
      int32_t out[2][Gpt2Tokenizer::kShortPiece];
      Gpt2Tokenizer::ShortPiece a{reinterpret_cast<const uint8_t*>(s[0].data()), s[0].size(), out[0], 0};
      Gpt2Tokenizer::ShortPiece b{reinterpret_cast<const uint8_t*>(s[1].data()), s[1].size(), out[1], 0};
      Tok().BpeShortPair(&a, &b, portable);
      ASSERT_EQ(std::vector<int32_t>(out[0], out[0] + a.count), want[0]) << s[0] << " | " << s[1] << " " << portable;
      ASSERT_EQ(std::vector<int32_t>(out[1], out[1] + b.count), want[1]) << s[0] << " | " << s[1] << " " << portable;
    }
  }
}

TEST(Bpe, EveryMergeableTokenEncodesToItself) {
  int checked = 0;
  for (int32_t id = 0; id < 50256; ++id) {
    std::string_view b = Tok().TokenBytes(id);
    std::vector<int32_t> out;
    Tok().BpePiece(reinterpret_cast<const uint8_t*>(b.data()), b.size(), &out);
    ASSERT_EQ(out, std::vector<int32_t>{id}) << "token " << id;
    ++checked;
  }
  EXPECT_EQ(checked, 50256);
}

// Whole tokens of more than 16 bytes are found in the vocabulary the first time and in the long-piece
// cache after that: both give the token.
TEST(Bpe, LongWholeTokensEncodeToThemselvesTwice) {
  Gpt2Encoder enc(Tok());
  int checked = 0;
  for (int32_t id = 0; id < 50256; ++id) {
    const std::string_view b = Tok().TokenBytes(id);
    if (b.size() <= 16 || Pretokenize(b).size() != 1) continue;
    for (int round = 0; round < 2; ++round) {
      std::vector<int32_t> ids;
      enc.EncodeOrdinary(b, &ids);
      ASSERT_EQ(ids, std::vector<int32_t>{id}) << "token " << id << ", round " << round;
    }
    ++checked;
  }
  EXPECT_GT(checked, 50);  // 72 in GPT-2
  EXPECT_EQ(enc.cache_misses(), 0u);
}

TEST(Bpe, CacheIsTransparent) {
  // A cache full from the start (short and long pieces) must give the same ids as an uncached BPE.
  Gpt2Encoder small(Tok(), {.special_endoftext = true, .cache_slots = 16, .long_cache_bytes = 64});
  Gpt2Encoder big(Tok());
  std::mt19937 rng(3);
  const char* words[] = {" the",         " quick",
                         " brown",       "fox",
                         " jumped",      "ooooover",
                         " lazy",        "\xE4\xB8\xAD\xE6\x96\x87",
                         " dogs",        "!!",
                         "\n\n",         " 12345",
                         "tokenization", " antidisestablishmentarianism"};
  for (int iter = 0; iter < 500; ++iter) {
    std::string text;
    for (int w = 0; w < 30; ++w) text += words[rng() % 14];
    std::vector<int32_t> a, b, c;
    small.Encode(text, &a);
    big.Encode(text, &b);
    ForEachPiece(text, [&](const uint8_t* x, const uint8_t* y) { Tok().BpePiece(x, static_cast<size_t>(y - x), &c); });
    ASSERT_EQ(a, b);
    ASSERT_EQ(a, c);
  }
  EXPECT_GT(big.cache_hits(), 0u);
  EXPECT_LE(small.cache_bytes(), small.max_cache_bytes());
  EXPECT_LE(big.cache_bytes(), big.max_cache_bytes());
}

// A batch's misses are learnt after the batch is looked up, so a new piece met twice in one batch
// misses twice: it must still be cached once.
TEST(Bpe, APieceMetTwiceInABatchIsLearntOnce) {
  std::mt19937 rng(17);
  std::string once, twice;
  for (int i = 0; i < 3000; ++i) {
    std::string w = " ";
    for (int k = 0; k < 7; ++k) w += static_cast<char>('a' + rng() % 26);
    once += w;
    twice += w + w;
  }
  Gpt2Encoder a(Tok()), b(Tok());
  std::vector<int32_t> x, y;
  a.Encode(once, &x);
  b.Encode(twice, &y);
  EXPECT_EQ(a.cache_entries(), b.cache_entries());
  EXPECT_GT(a.cache_entries(), 50000u);
  x.clear();
  a.Encode(twice, &x);
  EXPECT_EQ(x, y);
}

TEST(Bpe, CacheKeepsWhatItLearntAndStaysBounded) {
  // Distinct pieces beyond the cache's room: nothing is thrown away (a piece seen early still hits
  // after the cache filled up) and the memory stays within the stated bound.
  Gpt2Encoder enc(Tok(), {.special_endoftext = true, .cache_slots = 1 << 18, .long_cache_bytes = 1 << 16});
  std::vector<int32_t> ids;
  enc.Encode(" zqxjkvw", &ids);
  enc.Encode(" zqxjkvwzqxjkvwzqxjkvwzqxjkvw", &ids);  // 29 bytes: a long piece
  std::mt19937 rng(5);
  for (int i = 0; i < 300000; ++i) {
    std::string w = " ";
    for (int k = 0; k < 6; ++k) w += static_cast<char>('a' + rng() % 26);
    enc.Encode(w, &ids);
  }
  const uint64_t misses = enc.cache_misses();
  ids.clear();
  enc.Encode(" zqxjkvw", &ids);
  enc.Encode(" zqxjkvwzqxjkvwzqxjkvwzqxjkvw", &ids);
  EXPECT_EQ(enc.cache_misses(), misses) << "pieces learnt before the cache filled were forgotten";
  EXPECT_LE(enc.cache_bytes(), enc.max_cache_bytes());
  EXPECT_LE(enc.max_cache_bytes(), (size_t{1} << 18) * 32 * 3 / 2 + 4 * (size_t{1} << 16));
}

// Encodes every piece, then every piece again: the second time each must be found in the cache (no
// new miss: a probe path cut by a table's in-place doubling would miss, and BPE would run again)
// and give the same ids.
void ExpectAllFoundAgain(Gpt2Encoder& enc, const std::vector<std::string>& pieces) {
  std::vector<std::vector<int32_t>> first(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) enc.Encode(pieces[i], &first[i]);
  const uint64_t misses = enc.cache_misses();
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::vector<int32_t> ids;
    enc.Encode(pieces[i], &ids);
    ASSERT_EQ(ids, first[i]) << pieces[i];
  }
  EXPECT_EQ(enc.cache_misses(), misses) << "pieces learnt before a doubling were not found after it";
}

TEST(Bpe, CacheGrowsInPlaceAndFindsEveryPiece) {
  // The table doubles in place three times (2^17 -> 2^20 slots) while these pieces are learnt.
  Gpt2Encoder enc(Tok(), {.special_endoftext = true, .cache_slots = 1 << 20, .long_cache_bytes = 0});
  std::mt19937 rng(8);
  std::vector<std::string> words;
  for (int i = 0; i < 420000; ++i) {
    std::string w = i % 3 ? " " : "";
    const int len = 4 + static_cast<int>(rng() % 10);
    for (int k = 0; k < len; ++k) w += static_cast<char>('a' + rng() % 26);
    words.push_back(std::move(w));
  }
  ExpectAllFoundAgain(enc, words);
  EXPECT_GE(enc.cache_bytes(), (size_t{1} << 20) * 32) << "the table did not grow to 2^20 slots";
}

TEST(Bpe, LongPieceCacheGrowsInPlaceAndFindsEveryPiece) {
  // 40,000 distinct pieces of 21 bytes: the long-piece table starts at 2^17 slots and doubles once,
  // at a quarter full.
  Gpt2Encoder enc(Tok(), {.special_endoftext = true, .cache_slots = 1 << 17, .long_cache_bytes = 16 << 20});
  std::mt19937 rng(11);
  std::vector<std::string> pieces;
  for (int i = 0; i < 40000; ++i) {
    std::string w = " ";
    for (int k = 0; k < 20; ++k) w += static_cast<char>('a' + rng() % 26);
    pieces.push_back(std::move(w));
  }
  ExpectAllFoundAgain(enc, pieces);
  EXPECT_GE(enc.cache_bytes(), (size_t{1} << 18) * 16) << "the long-piece table did not double";
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)  // sanitizers reserve terabytes
// Caches are reserved at their most up front. Where the system refuses that much address space
// (strict overcommit, `ulimit -v`), an encoder must still work, with smaller caches, not abort.
TEST(Bpe, EncoderWorksWhenTheAddressSpaceIsShort) {
  const Gpt2Tokenizer& tok = Tok();
  std::string text;
  std::mt19937 rng(3);
  for (int i = 0; i < 20000; ++i) {
    text += " w";
    for (int k = 0; k < 3 + static_cast<int>(rng() % 8); ++k) text += static_cast<char>('a' + rng() % 26);
  }
  text += " " + std::string(40, 'q') + "zz";  // a long piece
  std::vector<int32_t> want;
  Gpt2Encoder(tok).Encode(text, &want);
  const auto limited = [&]() {
    // Room for about 40 MiB more than is mapped now: less than the 64 MiB cache, its 16 MiB of
    // overflow ids and the long-piece arena.
    long pages = 0;
    FILE* f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr || std::fscanf(f, "%ld", &pages) != 1) std::exit(3);
    std::fclose(f);
    const rlim_t limit = static_cast<rlim_t>(pages) * 4096 + (40u << 20);
    struct rlimit r = {limit, limit};
    if (::setrlimit(RLIMIT_AS, &r) != 0) std::exit(4);
    Gpt2Encoder enc(tok);
    std::vector<int32_t> got;
    enc.Encode(text, &got);
    got.clear();
    enc.Encode(text, &got);  // again, from the (smaller) caches
    std::exit(got == want && enc.max_cache_bytes() < (64u << 20) ? 0 : 1);
  };
  EXPECT_EXIT(limited(), ::testing::ExitedWithCode(0), "");
}
#endif

TEST(Bpe, LongPiecesAreNotQuadratic) {
  // 1 MB single pieces of several shapes; checked for content, timing is the benchmark's job.
  for (const std::string unit : {"a", "^", "-", "0", " ", "xy"}) {
    std::string s;
    while (s.size() < (1u << 20)) s += unit;
    Gpt2Encoder enc(Tok());
    std::vector<int32_t> ids;
    enc.Encode(s, &ids);
    ASSERT_FALSE(ids.empty());
    ASSERT_EQ(Tok().DecodeBytes(ids), s);
  }
}

TEST(Bpe, InvalidUtf8NeverCrashes) {
  Gpt2Encoder enc(Tok());
  std::mt19937 rng(11);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s;
    size_t n = rng() % 40;
    for (size_t i = 0; i < n; ++i) s += static_cast<char>(rng());
    std::vector<int32_t> ids;
    enc.Encode(s, &ids);
    ASSERT_EQ(Tok().DecodeBytes(ids), s);  // byte-level BPE is lossless on any bytes
  }
}

TEST(Gpt2Tokenizer, BadFilesAreClearErrors) {
  auto bad_json = Gpt2Tokenizer::FromStrings("{not json", "#version: 0.2\n", "v");
  EXPECT_FALSE(bad_json.ok());
  EXPECT_NE(std::string(bad_json.status().message()).find("not valid JSON"), std::string::npos);
  std::string vocab(Gpt2Tokenizer::DefaultVocabJson());
  auto bad_merge = Gpt2Tokenizer::FromStrings(vocab, "#version: 0.2\nĠ t\nthis is three\n", "m");
  EXPECT_FALSE(bad_merge.ok());
  EXPECT_NE(std::string(bad_merge.status().message()).find("merges line 3"), std::string::npos);
  auto unknown = Gpt2Tokenizer::FromStrings(vocab, "#version: 0.2\nzzzzzz qqqqqq\n", "m");
  EXPECT_FALSE(unknown.ok());
  EXPECT_NE(std::string(unknown.status().message()).find("not in the vocab"), std::string::npos);
  auto no_eot = Gpt2Tokenizer::FromStrings("{\"a\": 0}", "", "v");
  EXPECT_FALSE(no_eot.ok());
  // A token given twice: Python's json keeps its last id, leaving the first id without a token;
  // refused naming the token (before, both ids were kept and " the" encoded as the last).
  std::string dup = vocab.substr(0, vocab.rfind('}')) + ", \"\\u0120the\": 50257}";
  auto twice = Gpt2Tokenizer::FromStrings(dup, Gpt2Tokenizer::DefaultMergesTxt(), "v");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(std::string(twice.status().message()).find("v: vocab token \"\u0120the\" is given twice"),
            std::string::npos)
      << twice.status();
  // Azure's tutorial gives vocab.json as the merge file too: the error quoted the whole megabyte line.
  auto vocab_as_merges = Gpt2Tokenizer::FromStrings(vocab, vocab, "v / v");
  ASSERT_FALSE(vocab_as_merges.ok());
  const std::string said(vocab_as_merges.status().message());
  EXPECT_LT(said.size(), 400u) << said.substr(0, 400);
  EXPECT_NE(said.find("v / v: merges line 1 must hold two symbols separated by one space: \"{"), std::string::npos)
      << said;
  EXPECT_NE(said.find("the vocab.json given as the merges file?"), std::string::npos) << said;
  // The two files swapped: said so, not only "not valid JSON".
  auto swapped = Gpt2Tokenizer::FromStrings(Gpt2Tokenizer::DefaultMergesTxt(), vocab, "m / v");
  ASSERT_FALSE(swapped.ok());
  EXPECT_NE(std::string(swapped.status().message())
                .find("m / v: the vocab is not JSON but a merges file (\"#version: 0.2\"): are the vocab and merges "
                      "files swapped?"),
            std::string::npos)
      << swapped.status();
  auto missing = Gpt2Tokenizer::Load("/nonexistent/vocab.json", "/nonexistent/merges.txt");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

// GPT-2's byte-level alphabet (bytes_to_unicode): the vocab key of each byte's token.
std::string ByteLevelKey(uint8_t b) {
  uint32_t cp = b;
  if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE))) {
    int n = 0;
    for (int c = 0; c < b; ++c) n += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE));
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The merge rule as GPT-2's encoder.py states it, over token strings: take the adjacent pair of
// lowest rank (a pair listed twice keeps its last rank: a dict assignment), merge its occurrences
// left to right, repeat.
std::vector<std::string> ReferenceBpe(const std::string& piece,
                                      const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> w;
  for (char c : piece) w.emplace_back(1, c);
  while (w.size() > 1) {
    int best = -1;
    std::pair<std::string, std::string> pair;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      auto it = ranks.find({w[i], w[i + 1]});
      if (it != ranks.end() && (best < 0 || it->second < best)) {
        best = it->second;
        pair = it->first;
      }
    }
    if (best < 0) break;
    std::vector<std::string> merged;
    for (size_t i = 0; i < w.size(); ++i) {
      if (i + 1 < w.size() && w[i] == pair.first && w[i + 1] == pair.second) {
        merged.push_back(w[i] + w[i + 1]);
        ++i;
      } else {
        merged.push_back(w[i]);
      }
    }
    w = std::move(merged);
  }
  return w;
}

// BPE runs over symbols (bytes, and 256 + the line that made a token), not vocab ids. Files other
// than GPT-2's may make one token by two lines ("ab c" and "a bc") and list a pair twice: the ids
// must still be the reference rule's, on the short, portable and long paths.
TEST(Bpe, TokensMadeByTwoLinesAndPairsListedTwice) {
  const std::vector<std::pair<std::string, std::string>> lines = {
      {"b", "c"},   {"a", "b"},   {"a", "a"}, {"ab", "c"},  {"a", "bc"}, {"abc", "abc"}, {"a", "b"},
      {"abc", "a"}, {"c", "abc"}, {"c", "c"}, {"cc", "cc"}, {"b", "cc"}, {"bcc", "cc"}};
  std::map<std::string, int> vocab;
  std::string vocab_json = "{";
  for (int b = 0; b < 256; ++b) vocab[ByteLevelKey(static_cast<uint8_t>(b))] = b;
  std::string merges_txt = "#version: 0.2\n";
  std::map<std::pair<std::string, std::string>, int> ranks;
  for (size_t r = 0; r < lines.size(); ++r) {
    vocab.emplace(lines[r].first + lines[r].second, static_cast<int>(vocab.size()));
    merges_txt += lines[r].first + " " + lines[r].second + "\n";
    ranks[lines[r]] = static_cast<int>(r);
  }
  vocab.emplace("<|endoftext|>", static_cast<int>(vocab.size()));
  for (const auto& [key, id] : vocab) {
    if (vocab_json.size() > 1) vocab_json += ",";
    std::string escaped;
    for (char c : key) escaped += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    vocab_json += "\"" + escaped + "\": " + std::to_string(id);
  }
  vocab_json += "}";
  auto tok = Gpt2Tokenizer::FromStrings(vocab_json, merges_txt, "test");
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::mt19937 rng(5);
  const std::string alphabet = "aabbcccx";
  for (int iter = 0; iter < 4000; ++iter) {
    const size_t n = 2 + rng() % 90;
    std::string s;
    for (size_t i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
    std::vector<int32_t> want;
    for (const std::string& t : ReferenceBpe(s, ranks))
      want.push_back(vocab.at(t.size() == 1 ? ByteLevelKey(t[0]) : t));
    std::vector<int32_t> got, portable, longer;
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    (*tok)->BpePiece(p, n, &got);
    ASSERT_EQ(got, want) << s;
    (*tok)->BpeLong(p, n, &longer);
    ASSERT_EQ(longer, want) << s;
    if (n <= Gpt2Tokenizer::kShortPiece) {
      (*tok)->BpeShortPortable(p, n, &portable);
      ASSERT_EQ(portable, want) << s;
    }
  }
}

TEST(Gpt2Tokenizer, LoadFromFilesEqualsBuiltIn) {
  auto t = Gpt2Tokenizer::Load(testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json",
                               testing::SourceDir() + "/tokenizer/data/gpt2-merges.txt");
  ASSERT_TRUE(t.ok()) << t.status();
  Gpt2Encoder a(**t), b(Tok());
  std::vector<int32_t> x, y;
  a.Encode("The same ids from the files on disk. \xF0\x9F\x98\x80", &x);
  b.Encode("The same ids from the files on disk. \xF0\x9F\x98\x80", &y);
  EXPECT_EQ(x, y);
}

}  // namespace
// The tables embedded at build time are the ones the vocab and merges give; a damaged or foreign
// blob is refused, never half-read.
TEST(Bpe, PrecomputedTablesEqualBuiltOnes) {
  auto built = Gpt2Tokenizer::FromStrings(Gpt2Tokenizer::DefaultVocabJson(), Gpt2Tokenizer::DefaultMergesTxt());
  ASSERT_TRUE(built.ok());
  const std::string blob = (*built)->SerializeTables();
  EXPECT_EQ(Tok().SerializeTables(), blob);
  auto embedded = Gpt2Tokenizer::FromTables(Gpt2Tokenizer::DefaultTables());  // what LoadDefault uses
  ASSERT_TRUE(embedded.ok()) << embedded.status();
  EXPECT_EQ((*embedded)->SerializeTables(), blob);
  auto back = Gpt2Tokenizer::FromTables(blob);
  ASSERT_TRUE(back.ok()) << back.status();
  std::vector<int32_t> a, b;
  Gpt2Encoder(**back).Encode("Hello, world! \xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 <|endoftext|> 12345", &a);
  Gpt2Encoder(**built).Encode("Hello, world! \xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 <|endoftext|> 12345", &b);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(Gpt2Tokenizer::FromTables(blob.substr(0, blob.size() / 2)).ok());
  EXPECT_FALSE(Gpt2Tokenizer::FromTables(blob + "x").ok());
  EXPECT_FALSE(Gpt2Tokenizer::FromTables("not tables").ok());
  std::string other = blob;
  other[other.find('\n') + 1] ^= 1;  // a PieceSlot of another size: another build's layout
  EXPECT_FALSE(Gpt2Tokenizer::FromTables(other).ok());
}

// The tables are read where they lie, so what a blob says is used to index memory: a blob whose
// entries point outside the tables is refused, naming what is wrong (found here by their values:
// the pair of the first merge line, the slot of the token "the", the first token offsets, the
// first byte symbols' ids).
TEST(Bpe, TablesPointingOutsideThemselvesAreRefused) {
  const std::string blob = Tok().SerializeTables();
  // The first (or, last = true, the last) place the bytes of a pattern occur.
  auto find = [&](const void* pattern, size_t n, bool last = false) {
    const std::string_view p(static_cast<const char*>(pattern), n);
    return last ? blob.rfind(p) : blob.find(p);
  };
  auto refused = [&](size_t at, const void* value, size_t n, const char* why) {
    if (at == std::string::npos) return ::testing::AssertionFailure() << why << ": pattern not found";
    std::string damaged = blob;
    std::memcpy(damaged.data() + at, value, n);
    auto t = Gpt2Tokenizer::FromTables(damaged);
    if (t.ok()) return ::testing::AssertionFailure() << why << ": accepted";
    if (std::string(t.status().message()).find(why) == std::string::npos)
      return ::testing::AssertionFailure() << why << ": refused for another reason: " << t.status();
    return ::testing::AssertionSuccess();
  };
  // Merge line 0 ("Ġ t") pairs the symbols of bytes 0x20 and 't' with rank 0; a rank past the last
  // merge would name a symbol that does not exist.
  const uint64_t word = ((uint64_t{0x20} << 21 | 't') << 22) | 0;
  const uint64_t bad_word = word | ((uint64_t{1} << 22) - 1);
  EXPECT_TRUE(refused(find(&word, 8), &bad_word, 8, "pair rank"));
  // The slot of "the" (id 1169): one inline id.
  const uint64_t the_key[2] = {0x656874, 0};
  const size_t slot = find(the_key, 16);
  const uint8_t overflow = 0xFF, long_len = 17;
  const int32_t past_vocab = 50257;
  EXPECT_TRUE(refused(slot + 17, &overflow, 1, "short token"));
  EXPECT_TRUE(refused(slot + 16, &long_len, 1, "short token"));
  EXPECT_TRUE(refused(slot + 20, &past_vocab, 4, "short token"));
  // Token offsets 255, 256, 258 (256 one-byte tokens, then "Ġt"): one going backwards.
  const uint32_t offsets[3] = {255, 256, 258}, backwards = 0x10000;
  EXPECT_TRUE(refused(find(offsets, 12) + 4, &backwards, 4, "vocabulary offsets"));
  // Bytes 0..7 are ids 188..195: in the header's byte ids, and last in the symbols' ids.
  const int32_t byte_ids[8] = {188, 189, 190, 191, 192, 193, 194, 195};
  EXPECT_TRUE(refused(find(byte_ids, 32), &past_vocab, 4, "byte id"));
  EXPECT_TRUE(refused(find(byte_ids, 32, /*last=*/true), &past_vocab, 4, "symbol id"));
  // The same blob undamaged reads back.
  EXPECT_TRUE(Gpt2Tokenizer::FromTables(blob).ok());
}

}  // namespace ptk
