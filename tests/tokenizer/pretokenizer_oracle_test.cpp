// Differential test of the hand-written pre-tokenizer against a regex oracle: PCRE2 running the
// GPT-2 pattern verbatim, with \s, \p{L} and \p{N} spelled out as explicit classes from ptk's
// Unicode 16.0 table (so the test checks the scanner's logic, the goldens check the table).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <random>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/utf8.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/unicode_tables.h"

namespace ptk {
namespace {

std::string ClassRanges(unicode::CharClass k) {
  std::string out;
  uint32_t cp = 0;
  while (cp < 0x110000) {
    bool in = (cp < 0xD800 || cp > 0xDFFF) && unicode::ClassOf(cp) == k;
    if (!in) {
      ++cp;
      continue;
    }
    uint32_t lo = cp;
    while (cp + 1 < 0x110000 && (cp + 1 < 0xD800 || cp + 1 > 0xDFFF) && unicode::ClassOf(cp + 1) == k) ++cp;
    out += lo == cp ? fmt::format("\\x{{{:x}}}", lo) : fmt::format("\\x{{{:x}}}-\\x{{{:x}}}", lo, cp);
    ++cp;
  }
  return out;
}

class Oracle {
 public:
  Oracle() {
    std::string ws = ClassRanges(unicode::kSpace), l = ClassRanges(unicode::kLetter), n = ClassRanges(unicode::kNumber);
    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    std::string pat = "'s|'t|'re|'ve|'m|'ll|'d| ?[" + l + "]+| ?[" + n + "]+| ?[^" + ws + l + n + "]+|[" + ws +
                      "]+(?![^" + ws + "])|[" + ws + "]+";
    int err;
    PCRE2_SIZE off;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), PCRE2_UTF, &err, &off, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof(buf));
      ADD_FAILURE() << "pcre2_compile: " << reinterpret_cast<char*>(buf) << " at " << off;
      return;
    }
    md_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  }
  ~Oracle() {
    pcre2_match_data_free(md_);
    pcre2_code_free(code_);
  }
  std::vector<std::pair<size_t, size_t>> Split(const std::string& s) {
    std::vector<std::pair<size_t, size_t>> out;
    size_t pos = 0;
    while (pos < s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_ANCHORED, md_, nullptr);
      if (rc < 0) {
        ADD_FAILURE() << "oracle found no match at " << pos;
        return out;
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md_);
      out.emplace_back(ov[0], ov[1] - ov[0]);
      pos = ov[1];
    }
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* md_ = nullptr;
};

// The pieces of s taken one by one by PieceEnd (the character path, no 64-byte blocks).
std::vector<std::pair<size_t, size_t>> CharacterPathPieces(const std::string& s) {
  std::vector<std::pair<size_t, size_t>> pieces;
  const uint8_t* b = reinterpret_cast<const uint8_t*>(s.data());
  for (const uint8_t* p = b; p < b + s.size();) {
    const uint8_t* q = PieceEnd(p, b + s.size());
    pieces.emplace_back(static_cast<size_t>(p - b), static_cast<size_t>(q - p));
    p = q;
  }
  return pieces;
}

std::string Show(const std::string& s) {
  std::string o;
  for (unsigned char c : s)
    o += (c >= 0x20 && c < 0x7f) ? std::string(1, static_cast<char>(c)) : fmt::format("\\x{:02x}", c);
  return o;
}

std::vector<uint32_t> AdversarialAlphabet() {
  std::vector<uint32_t> a = {'a',  'b',  'Z',  's',  't',  'r', 'e', 'v', 'l', 'm', 'd', 'S',
                             'T',  'L',  '\'', '\'', '\'', '0', '1', '9', ' ', ' ', ' ', ' ',
                             '\t', '\n', '\r', 0x0B, 0x0C, '!', '.', ',', '-', '<', '|'};
  // The whole whitespace zoo, and near-misses that are not White_Space.
  for (uint32_t c : {0x85u, 0xA0u, 0x1680u, 0x2000u, 0x2005u, 0x200Au, 0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u,
                     0x1Cu, 0x1Du, 0x1Eu, 0x1Fu, 0x180Eu, 0x200Bu, 0xFEFFu})
    a.push_back(c);
  // Marks, other numbers, letters of other scripts, emoji and joiners, CJK, private use, unassigned.
  for (uint32_t c : {0x301u,   0x93Fu,  0x5BCu, 0xB2u,     0xBDu,    0x216Bu, 0x663u,   0xFF11u,  0xE9u,   0xDFu,
                     0x3A9u,   0x436u,  0x5D0u, 0x915u,    0x4E2Du,  0xAC00u, 0x1F600u, 0x1F44Du, 0x200Du, 0xFE0Fu,
                     0x1F3FDu, 0xE000u, 0x378u, 0x10FFFDu, 0xE0001u, 0x1C89u, 0x88Fu,   0x2EBF0u, 0x2019u})
    a.push_back(c);
  return a;
}

TEST(PretokenizerOracle, AdversarialAlphabetFuzz) {
  Oracle oracle;
  auto alphabet = AdversarialAlphabet();
  std::mt19937 rng(20261122);
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s;
    size_t n = 1 + rng() % 24;
    for (size_t i = 0; i < n; ++i) AppendUtf8(alphabet[rng() % alphabet.size()], &s);
    auto want = oracle.Split(s);
    auto got = Pretokenize(s);
    ASSERT_EQ(got, want) << "input: " << Show(s);
  }
}

// Long ASCII stretches go through the 64-byte block path (BlockBoundaries): blocks over every
// ASCII byte and over the bytes the rules care about (apostrophes, contraction letters, runs of
// spaces, tabs and newlines), now and then a non-ASCII character, lengths past several blocks;
// equal to the oracle, and to the character-at-a-time path (PieceEnd alone).
TEST(PretokenizerOracle, AsciiBlocksFuzz) {
  Oracle oracle;
  const std::string rules =
      "asStmdrevlL'''    \t\n\r\x0b\x0c"
      "09.,!-_\x1c";
  std::mt19937 rng(20261123);
  for (int iter = 0; iter < 6000; ++iter) {
    std::string s;
    const size_t n = 1 + rng() % 400;
    const int mode = iter % 4;
    while (s.size() < n) {
      if (mode == 3 && rng() % 97 == 0) {
        AppendUtf8(0xE9, &s);
      } else if (mode == 0) {
        s += static_cast<char>(rng() % 128);
      } else {
        s += rules[rng() % rules.size()];
      }
      if (mode == 2 && rng() % 23 == 0) s += std::string(1 + rng() % 90, rng() % 2 ? ' ' : 'x');
    }
    const auto slow = CharacterPathPieces(s);
    const auto got = Pretokenize(s);
    ASSERT_EQ(got, slow) << "input: " << Show(s);
    ASSERT_EQ(got, oracle.Split(s)) << "input: " << Show(s);
  }
}

// Blocks may hold 2- and 3-byte characters too (BlockBoundaries): letters, numbers and others of
// several scripts (Latin, Cyrillic, Arabic, Hebrew, Devanagari with its combining marks, CJK,
// fullwidth forms) among the ASCII that the rules care about, with the non-ASCII whitespace, 4-byte
// characters and invalid bytes that stop a block, at every offset: equal to the character path and
// to PCRE2.
TEST(PretokenizerOracle, MultiByteBlocksFuzz) {
  Oracle oracle;
  const std::string ascii = "asStmdL'''    \t\n09.,!-";
  const char* const chars[] = {"\xC3\xA9" /* e acute */,
                               "\xC3\x97" /* times (Sm) */,
                               "\xD0\x96" /* Zhe */,
                               "\xD9\xA3" /* Arabic-Indic 3 */,
                               "\xC2\xB9" /* superscript 1 */,
                               "\xC2\xAA" /* ordinal a (Lo) */,
                               "\xCC\x81" /* combining acute */,
                               "\xC2\xAB" /* guillemet */,
                               "\xD7\x90" /* alef */,
                               "\xE4\xB8\xAD" /* CJK */,
                               "\xE3\x80\x81" /* ideographic comma */,
                               "\xEF\xBC\xA1" /* fullwidth A */,
                               "\xEF\xBC\x81" /* fullwidth ! */,
                               "\xE0\xA4\x95" /* Devanagari ka */,
                               "\xE0\xA5\x8D" /* virama (Mn) */,
                               "\xE0\xA5\xA9" /* Devanagari 3 */,
                               "\xE2\x82\xAC" /* euro */,
                               "\xE0\xA4\xBE" /* sign aa (Mc) */};
  constexpr size_t kChars = sizeof(chars) / sizeof(chars[0]);
  const char* const stoppers[] = {"\xC2\xA0" /* NBSP */,
                                  "\xC2\x85" /* NEL */,
                                  "\xE3\x80\x80" /* ideographic space */,
                                  "\xE2\x80\xA8" /* line separator */,
                                  "\xF0\x9F\x98\x80" /* emoji */,
                                  "\x80",
                                  "\xC3",
                                  "\xC3(",
                                  "\xE4\xB8",
                                  "\xED\xA0\x80" /* surrogate */,
                                  "\xE0\x80\x80" /* overlong */};
  constexpr size_t kStoppers = sizeof(stoppers) / sizeof(stoppers[0]);
  constexpr size_t kValidStoppers = 5;  // the first five are valid UTF-8
  std::mt19937 rng(20261124);
  for (int iter = 0; iter < 8000; ++iter) {
    std::string s;
    const size_t n = 1 + rng() % 400;
    const int stop_rate = iter % 3 == 0 ? 0 : (iter % 3 == 1 ? 300 : 40);
    bool valid = true;  // PCRE2 takes valid UTF-8 only
    while (s.size() < n) {
      const uint32_t r = rng() % 1000;
      if (stop_rate != 0 && r % stop_rate == 0) {
        const size_t k = rng() % kStoppers;
        valid &= k < kValidStoppers;
        s += stoppers[k];
      } else if (r < 450)
        s += chars[rng() % kChars];
      else
        s += ascii[rng() % ascii.size()];
      if (rng() % 61 == 0) s += std::string(1 + rng() % 70, rng() % 2 ? ' ' : 'x');
    }
    const auto slow = CharacterPathPieces(s);
    const auto got = Pretokenize(s);
    ASSERT_EQ(got, slow) << "input: " << Show(s);
    if (valid && iter % 2 == 0) {
      ASSERT_EQ(got, oracle.Split(s)) << "input: " << Show(s);
    }
  }
}

TEST(PretokenizerOracle, RandomCodePointsFuzz) {
  Oracle oracle;
  std::mt19937 rng(99);
  for (int iter = 0; iter < 5000; ++iter) {
    std::string s;
    size_t n = 1 + rng() % 16;
    for (size_t i = 0; i < n; ++i) {
      uint32_t cp;
      switch (rng() % 4) {
        case 0: cp = rng() % 0x80; break;
        case 1: cp = rng() % 0x3000; break;
        default: cp = rng() % 0x110000; break;
      }
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;
      AppendUtf8(cp, &s);
    }
    ASSERT_EQ(Pretokenize(s), oracle.Split(s)) << "input: " << Show(s);
  }
}

// The two-byte prefix table (and its "third byte decides" rows) against decoding every character:
// every sequence of up to three bytes that starts with a non-ASCII byte, valid or not, with and
// without room after it, must get the exact path's class and length.
TEST(PretokenizerOracle, PrefixTableMatchesExactDecodingForEveryByteSequence) {
  uint8_t buf[4];
  for (uint32_t c0 = 0x80; c0 < 0x100; ++c0) {
    for (uint32_t c1 = 0; c1 < 0x100; ++c1) {
      for (uint32_t c2 = 0; c2 < 0x100; ++c2) {
        buf[0] = static_cast<uint8_t>(c0);
        buf[1] = static_cast<uint8_t>(c1);
        buf[2] = static_cast<uint8_t>(c2);
        buf[3] = 'a';
        for (int avail = 1; avail <= 4; ++avail) {
          int fast_len = 0, exact_len = 0;
          const auto fast = pretok_detail::ClassAt(buf, buf + avail, &fast_len);
          const auto exact = pretok_detail::ClassAtExact(buf, buf + avail, &exact_len);
          if (fast != exact || fast_len != exact_len)
            FAIL() << fmt::format("bytes {:02x} {:02x} {:02x}, {} readable: class {} len {}, exact {} len {}", c0, c1,
                                  c2, avail, int(fast), fast_len, int(exact), exact_len);
        }
      }
    }
  }
}

TEST(PretokenizerOracle, DocumentedExamples) {
  auto pieces = [](const std::string& s) {
    std::vector<std::string> v;
    for (auto [o, l] : Pretokenize(s)) v.push_back(s.substr(o, l));
    return v;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("IT'S ok"), (V{"IT", "'", "S", " ok"}));
  EXPECT_EQ(pieces("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pieces("a\t\tb"), (V{"a", "\t", "\t", "b"}));
  EXPECT_EQ(pieces("x  \n  y"), (V{"x", "  \n ", " y"}));
  EXPECT_EQ(pieces("e\xCC\x81t\xC3\xA9"), (V{"e", "\xCC\x81", "t\xC3\xA9"}));
  EXPECT_EQ(pieces("!!'s"), (V{"!!'", "s"}));
  EXPECT_EQ(pieces(" 's"), (V{" '", "s"}));
  EXPECT_EQ(pieces("don'texist"), (V{"don", "'t", "exist"}));
  EXPECT_EQ(pieces("1\xC2\xB2\xC2\xBD\xE2\x85\xAB 3"), (V{"1\xC2\xB2\xC2\xBD\xE2\x85\xAB", " 3"}));
  EXPECT_EQ(pieces("end  "), (V{"end", "  "}));
}

}  // namespace
}  // namespace ptk
