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

namespace pretok_detail {

#if defined(__SSE2__)
// Bytes a block needs readable: 64 positions and the 16 after them (the rules look ahead).
inline constexpr ptrdiff_t kBlockBytes = 80;

// Piece starts among the 64 bytes at p, which begin a piece, as a bit mask (bit 0 set), when those
// bytes hold ASCII, 2-byte and 3-byte characters other than whitespace (Latin with diacritics,
// Greek, Cyrillic, Hebrew, Arabic, Indic scripts, CJK...), *last_bad = -1; else 0 with *last_bad set to the offset
// of the last byte that stops a block (no block that starts at or before it can pass). Every set
// bit is a true piece start; the piece at the highest one may end past the block. The 80 bytes at
// p must be readable. The rules of PieceEnd as mask arithmetic over class masks (SSE2, part of
// baseline x86-64), a character's bytes all carrying its class:
//   a letter/number/other run starts a piece unless a space (U+0020) comes just before it;
//   a whitespace run starts a piece, and so does its last character when it has two or more and a
//   non-space follows (which the last character then joins, if it is a space, or stands alone);
//   an apostrophe that starts a piece followed by s|t|m|d or re|ve|ll is a piece of its own.
__attribute__((always_inline)) inline uint64_t BlockBoundaries(const uint8_t* p, int* last_bad) {
  const auto bits = [](__m128i m) -> uint64_t { return static_cast<uint32_t>(_mm_movemask_epi8(m)); };
  const auto below = [](__m128i v, int lo, int n) {  // lo <= v < lo + n, bytewise as unsigned (n < 128)
    return _mm_cmplt_epi8(_mm_add_epi8(v, _mm_set1_epi8(static_cast<char>(-128 - lo))),
                          _mm_set1_epi8(static_cast<char>(-128 + n)));
  };
  __m128i v[5];
  for (int c = 0; c < 5; ++c) v[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c));
  uint64_t lo_l = 0, lo_n = 0, lo_s = 0, lo_sp = 0, lo_ap = 0;
  for (int c = 0; c < 4; ++c) {  // non-ASCII bytes are in none of these
    const __m128i sp = _mm_cmpeq_epi8(v[c], _mm_set1_epi8(' '));
    lo_l |= bits(below(_mm_or_si128(v[c], _mm_set1_epi8(0x20)), 'a', 26)) << (16 * c);
    lo_n |= bits(below(v[c], '0', 10)) << (16 * c);
    lo_s |= bits(_mm_or_si128(sp, below(v[c], 9, 5))) << (16 * c);  // U+0009..U+000D, U+0020
    lo_sp |= bits(sp) << (16 * c);
    lo_ap |= bits(_mm_cmpeq_epi8(v[c], _mm_set1_epi8('\''))) << (16 * c);
  }
  const __m128i v4 = v[4];
  uint64_t s64;  // the character after the block is whitespace
  const uint64_t high = bits(v[0]) | bits(v[1]) << 16 | bits(v[2]) << 32 | bits(v[3]) << 48;
  const uint64_t high4 = bits(v4);
  if ((high | high4) == 0) {
    s64 = bits(_mm_or_si128(_mm_cmpeq_epi8(v4, _mm_set1_epi8(' ')), below(v4, 9, 5))) & 1;
  } else {
    uint64_t lead2 = 0, lead3 = 0, cont = 0;  // bytes C2..DF, E0..EF (first bytes), 80..BF
    for (int c = 0; c < 4; ++c) {
      lead2 |= bits(below(v[c], 0xC2, 30)) << (16 * c);
      lead3 |= bits(below(v[c], 0xE0, 16)) << (16 * c);
      cont |= bits(below(v[c], 0x80, 64)) << (16 * c);
    }
    const uint64_t cont4 = bits(below(v4, 0x80, 64));
    // Well formed: every first byte followed by its continuation bytes, every continuation byte where
    // a first byte says, and no other non-ASCII byte (continuation bytes past 63 are checked below).
    const uint64_t bad = (high & ~(lead2 | lead3 | cont)) | (cont ^ ((lead2 << 1) | (lead3 << 1) | (lead3 << 2)));
    if (bad != 0) {
      *last_bad = 63 - __builtin_clzll(bad);
      return 0;
    }
    // The characters' classes from the two-byte table, or by code point where a 3-byte prefix's
    // characters differ; whitespace, an ill-formed character (overlong, surrogate, a continuation
    // byte missing past 63) or a table not yet initialised stops the block. A character's bytes
    // all carry its class (bits past 63 fall off).
    for (uint64_t m = lead2 | lead3; m != 0; m &= m - 1) {
      const int i = __builtin_ctzll(m);
      const uint8_t c0 = p[i];
      uint8_t k = kPrefixClass[static_cast<uint32_t>(c0) << 8 | p[i + 1]];
      uint64_t bytes = uint64_t{3} << i;
      bool stop = false;
      if (c0 >= 0xE0) {
        bytes = uint64_t{7} << i;
        stop = (p[i + 2] & 0xC0) != 0x80;
        if (k == kPrefixMixed)
          k = static_cast<uint8_t>(
              1 + unicode::ClassOf(((c0 & 0x0Fu) << 12) | ((p[i + 1] & 0x3Fu) << 6) | (p[i + 2] & 0x3Fu)));
      }
      lo_l |= k == 1 + unicode::kLetter ? bytes : 0;
      lo_n |= k == 1 + unicode::kNumber ? bytes : 0;
      if (stop | (k == kPrefixUndecided) | (k == 1 + unicode::kSpace)) {
        *last_bad = i + 1;
        return 0;
      }
    }
    if (high4 & 1 & ~cont4) {  // a character starts at 64: its class, exactly
      int len;
      s64 = ClassAt(p + 64, p + kBlockBytes, &len) == unicode::kSpace;
    } else {
      s64 = bits(_mm_or_si128(_mm_cmpeq_epi8(v4, _mm_set1_epi8(' ')), below(v4, 9, 5))) & 1;
    }
  }
  *last_bad = -1;
  // Class changes from the previous character (bit 0, the block's start, is a piece start anyway).
  const uint64_t change = ((lo_l ^ (lo_l << 1)) | (lo_n ^ (lo_n << 1)) | (lo_s ^ (lo_s << 1))) & ~1ull;
  const uint64_t run_start = change & ~lo_s & ~(lo_sp << 1);
  const uint64_t ws_start = change & lo_s;
  const uint64_t s_next = (lo_s >> 1) | (s64 << 63);
  const uint64_t ws_last = lo_s & (lo_s << 1) & ~s_next;
  uint64_t b = run_start | ws_start | ws_last | 1;
  // Contractions, at apostrophes that start a piece (rare: handled one by one).
  for (uint64_t a = lo_ap & b; a != 0; a &= a - 1) {
    const int i = __builtin_ctzll(a);
    const uint8_t c1 = p[i + 1], c2 = p[i + 2];
    int len = 0;
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
      len = 2;
    else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
      len = 3;
    if (len == 0) continue;
    if (i + 1 < 64) b &= ~(1ull << (i + 1));
    if (i + len < 64) b |= 1ull << (i + len);
  }
  return b;
}
#endif

}  // namespace pretok_detail

// Calls emit(const uint8_t* begin, const uint8_t* end) for every piece of `text`, in order.
// Never reads outside [text.data(), text.data() + text.size()). Invalid UTF-8 bytes act as
// single "other" characters. Stretches without 4-byte characters, non-ASCII whitespace or invalid
// bytes go 64 bytes at a time (BlockBoundaries: the piece
// ends come from class masks, one bit popped per piece, no branch per character); the rest piece
// by piece (PieceEnd). One call site, so the compiler inlines emit into the loop.
template <typename Emit>
inline void ForEachPiece(std::string_view text, Emit&& emit) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(text.data());
  const uint8_t* const end = p + text.size();
#if defined(__SSE2__)
  uint64_t pending = 0;  // piece ends still to hand out, as offsets from base
  const uint8_t* base = p;
  const uint8_t* next_try = p;  // no block starts before this (a byte that stops blocks is in the way)
#endif
  while (p < end) {
    const uint8_t* q;
#if defined(__SSE2__)
    if (pending == 0 && p >= next_try && end - p >= pretok_detail::kBlockBytes) {
      int last_bad = -1;
      pending = pretok_detail::BlockBoundaries(p, &last_bad) & ~1ull;
      base = p;
      if (pending == 0) next_try = p + last_bad + 1;  // past the last byte that stops a block (or this piece)
    }
    if (pending != 0) {
      q = base + __builtin_ctzll(pending);
      pending &= pending - 1;
    } else {
      q = PieceEnd(p, end);
    }
#else
    q = PieceEnd(p, end);
#endif
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
