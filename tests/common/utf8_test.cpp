// UTF-8 validation and repair with CPython's errors="replace" semantics.
#include "common/utf8.h"

#include <gtest/gtest.h>

namespace ptk {
namespace {

std::string Repair(std::string_view in, size_t* n = nullptr) {
  std::string out;
  size_t r = AppendUtf8Replacing(in, &out);
  if (n) *n = r;
  return out;
}

const std::string kR = "\xEF\xBF\xBD";

TEST(Utf8, ValidStringsPassUnchanged) {
  for (std::string s :
       {std::string(""), std::string("abc"), std::string("\xC3\xA9"), std::string("\xE4\xB8\xAD"),
        std::string("\xF0\x9F\x98\x80"), std::string("\xF4\x8F\xBF\xBF"), std::string("\xEF\xBF\xBD")}) {
    EXPECT_TRUE(IsValidUtf8(s)) << s;
    size_t n;
    EXPECT_EQ(Repair(s, &n), s);
    EXPECT_EQ(n, 0u);
  }
}

// Expected outputs are what CPython 3.11 prints for bytes(...).decode("utf-8", "replace").
TEST(Utf8, MaximalSubpartReplacementLikePython) {
  struct Case {
    std::string in, out;
    size_t n;
  } cases[] = {
      {"\xE2\x82"
       "a",
       kR + "a", 1},                      // truncated 3-byte sequence
      {"\xED\xA0\x80", kR + kR + kR, 3},  // UTF-8 encoded surrogate
      {"\xC0\x80", kR + kR, 2},           // overlong NUL
      {"\xE0\x80\x80", kR + kR + kR, 3},  // overlong
      {"\xF0\x80", kR + kR, 2},
      {"\xF0\x9F\x98", kR, 1},                     // truncated emoji at end
      {"\xF4\x90\x80\x80", kR + kR + kR + kR, 4},  // above U+10FFFF
      {"\xFF"
       "x\xFE",
       kR + "x" + kR, 2},
      {"\x80\x80", kR + kR, 2},
      {"a\xC3", "a" + kR, 1},
      {"\xE4\xB8"
       "\xE4\xB8\xAD",
       kR + "\xE4\xB8\xAD", 1},
  };
  for (const auto& c : cases) {
    EXPECT_FALSE(IsValidUtf8(c.in));
    size_t n;
    EXPECT_EQ(Repair(c.in, &n), c.out);
    EXPECT_EQ(n, c.n);
  }
}

TEST(Utf8, AppendUtf8Encodes) {
  std::string s;
  AppendUtf8(0x41, &s);
  AppendUtf8(0xE9, &s);
  AppendUtf8(0x4E2D, &s);
  AppendUtf8(0x1F600, &s);
  EXPECT_EQ(s, "A\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80");
}

}  // namespace
}  // namespace ptk
