// Hand-written GPT-2 pre-tokenizer, equivalent to the split pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (verified against a PCRE2 oracle running that pattern verbatim; tests/tokenizer).
//
// At a piece start p:
//  1. "'" followed by s|t|m|d (2 chars) or re|ve|ll (3 chars): a contraction (case-sensitive).
//  2. U+0020 followed by a letter/number/other char X: the space plus the maximal run of X's class.
//  3. A letter/number/other char: the maximal run of its class (apostrophes inside an "other" run
//     are part of it).
//  4. Whitespace: let k be the length (in chars) of the maximal whitespace run. At the end of the
//     text the whole run is one piece; otherwise k-1 chars when k >= 2 (the last one is left to
//     attach to what follows or to stand alone), else 1 char.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/unicode_tables.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ptk {

namespace pretok_detail {

// Classes of the 128 ASCII bytes.
// clang-format off
inline constexpr uint8_t kAsciiClass[128] = {
    // 0x00-0x08 other, 0x09-0x0D space, 0x0E-0x1F other (U+001C-001F are not White_Space)
    0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    // space ! " # $ % & ' ( ) * + , - . /
    3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    // 0-9 : ; < = > ?
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0,
    // @ A-O
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    // P-Z [ \ ] ^ _
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
    // ` a-o
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    // p-z { | } ~ DEL
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
};
// clang-format on

// Classes of non-ASCII characters by their first two bytes, where those decide (pretokenizer.cpp).
// Entries: 0 undecided (the exact path), 1 + class, or kPrefixMixed (a valid 3-byte prefix: the
// third byte decides). Undecided is 0 so that the table, zero before its dynamic initialisation,
// can only send characters down the exact path, whatever the order of static initialisers.
inline constexpr uint8_t kPrefixUndecided = 0;
inline constexpr uint8_t kPrefixMixed = 5;
extern const uint8_t* const kPrefixClass;
// Decodes and looks up the character at p (any byte string; invalid bytes are single "other" chars).
unicode::CharClass ClassAtExact(const uint8_t* p, const uint8_t* end, int* len);

// Class and byte length of the character at p (p < end): ASCII by a 128-byte table, most other
// characters by their two-byte prefix (one load, no decoding), the rest decoded exactly.
__attribute__((always_inline)) inline unicode::CharClass ClassAt(const uint8_t* p, const uint8_t* end, int* len) {
  const uint8_t c0 = *p;
  if (c0 < 0x80) {
    *len = 1;
    return static_cast<unicode::CharClass>(kAsciiClass[c0]);
  }
  if (end - p >= 3) {  // the prefix and a possible third byte are readable
    const uint8_t k = kPrefixClass[static_cast<uint32_t>(c0) << 8 | p[1]];
    if (k != kPrefixUndecided) {
      if (c0 < 0xE0) {
        *len = 2;
        return static_cast<unicode::CharClass>(k - 1);
      }
      if ((p[2] & 0xC0) == 0x80) {
        *len = 3;
        if (k != kPrefixMixed) return static_cast<unicode::CharClass>(k - 1);
        return unicode::ClassOf(((c0 & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu));
      }
    }
  }
  return ClassAtExact(p, end, len);
}

// End of the maximal run of class k starting at p.
__attribute__((always_inline)) inline const uint8_t* RunEnd(const uint8_t* p, const uint8_t* end,
                                                            unicode::CharClass k) {
  while (p < end) {
    if (*p < 0x80) {
      if (kAsciiClass[*p] != k) return p;
      ++p;
      continue;
    }
    int len;
    if (ClassAt(p, end, &len) != k) return p;
    p += len;
  }
  return p;
}

// End of the letter run starting at p: ASCII letters 16 at a time (SSE2 is part of baseline
// x86-64, so no run-time dispatch is needed), then any non-ASCII letters.
__attribute__((always_inline)) inline const uint8_t* LetterRunEnd(const uint8_t* p, const uint8_t* end) {
#if defined(__SSE2__)
  while (end - p >= 16) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i lower = _mm_or_si128(v, _mm_set1_epi8(0x20));
    // 'a'..'z' -> -128..-103 (signed); everything else, non-ASCII included, lands elsewhere.
    __m128i t = _mm_add_epi8(lower, _mm_set1_epi8(static_cast<char>(128 - 'a')));
    unsigned m =
        static_cast<unsigned>(_mm_movemask_epi8(_mm_cmplt_epi8(t, _mm_set1_epi8(static_cast<char>(-128 + 26)))));
    if (m != 0xFFFFu) {
      p += __builtin_ctz(~m);
      if (*p < 0x80) return p;
      return RunEnd(p, end, unicode::kLetter);
    }
    p += 16;
  }
#endif
  return RunEnd(p, end, unicode::kLetter);
}

__attribute__((always_inline)) inline const uint8_t* ClassRunEnd(const uint8_t* p, const uint8_t* end,
                                                                 unicode::CharClass k) {
  return k == unicode::kLetter ? LetterRunEnd(p, end) : RunEnd(p, end, k);
}

}  // namespace pretok_detail

// End of the piece that starts at p (p < end). Invalid UTF-8 bytes act as single "other"
// characters; never reads at or past end.
__attribute__((always_inline)) inline const uint8_t* PieceEnd(const uint8_t* p, const uint8_t* const end) {
  using namespace pretok_detail;
  using unicode::CharClass;
  if (*p == '\'' && end - p >= 2) {
    const uint8_t c1 = p[1];
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return p + 2;
    if (end - p >= 3) {
      const uint8_t c2 = p[2];
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return p + 3;
    }
  }
  int len;
  const CharClass k = ClassAt(p, end, &len);
  if (k != unicode::kSpace) return ClassRunEnd(p + len, end, k);
  if (*p == ' ' && p + 1 < end) {
    int len2;
    const CharClass k2 = ClassAt(p + 1, end, &len2);
    if (k2 != unicode::kSpace) return ClassRunEnd(p + 1 + len2, end, k2);
  }
  // Whitespace run starting at p.
  const uint8_t* last = p;  // start of the last whitespace char seen
  const uint8_t* q = p + len;
  int count = 1;
  while (q < end) {
    int l;
    if (ClassAt(q, end, &l) != unicode::kSpace) break;
    last = q;
    q += l;
    ++count;
  }
  if (q == end) return end;
  return count >= 2 ? last : q;
}

// Calls emit(const uint8_t* begin, const uint8_t* end) for every piece of `text`, in order.
// Never reads outside [text.data(), text.data() + text.size()). Invalid UTF-8 bytes act as
// single "other" characters. One call site, so the compiler inlines emit into the loop.
template <typename Emit>
inline void ForEachPiece(std::string_view text, Emit&& emit) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(text.data());
  const uint8_t* const end = p + text.size();
  while (p < end) {
    const uint8_t* const q = PieceEnd(p, end);
    emit(p, q);
    p = q;
  }
}

// The pieces of `text` as (offset, length) pairs; convenient for tests.
inline std::vector<std::pair<size_t, size_t>> Pretokenize(std::string_view text) {
  std::vector<std::pair<size_t, size_t>> out;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(text.data());
  ForEachPiece(text, [&](const uint8_t* b, const uint8_t* e) {
    out.emplace_back(static_cast<size_t>(b - base), static_cast<size_t>(e - b));
  });
  return out;
}

}  // namespace ptk
