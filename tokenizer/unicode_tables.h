// Character classes of the GPT-2 pre-tokenizer (\s, \p{L}, \p{N}, other), Unicode 16.0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ptk::unicode {

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

extern const char kUnicodeVersion[];
extern const uint16_t kClassStage1[0x1100];
extern const uint8_t kClassStage2[][64];

inline CharClass ClassOf(uint32_t cp) {
  if (cp >= 0x110000) return kOther;
  const uint8_t packed = kClassStage2[kClassStage1[cp >> 8]][(cp & 0xFF) >> 2];
  return static_cast<CharClass>((packed >> ((cp & 3) * 2)) & 3);
}

// Decodes one UTF-8 code point at p (p < end). Invalid or truncated sequences decode as a single
// byte with cp = 0xFFFFFFFF (class kOther), so any byte string is handled without reading past end.
inline uint32_t DecodeUtf8(const uint8_t* p, const uint8_t* end, int* len) {
  const uint8_t c0 = p[0];
  if (c0 < 0x80) {
    *len = 1;
    return c0;
  }
  const ptrdiff_t avail = end - p;
  if (c0 >= 0xC2 && c0 < 0xE0) {
    if (avail >= 2 && (p[1] & 0xC0) == 0x80) {
      *len = 2;
      return ((c0 & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    }
  } else if (c0 >= 0xE0 && c0 < 0xF0) {
    if (avail >= 3 && (p[1] & 0xC0) == 0x80 && (p[2] & 0xC0) == 0x80) {
      uint32_t cp = ((c0 & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
      if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
        *len = 3;
        return cp;
      }
    }
  } else if (c0 >= 0xF0 && c0 < 0xF5) {
    if (avail >= 4 && (p[1] & 0xC0) == 0x80 && (p[2] & 0xC0) == 0x80 && (p[3] & 0xC0) == 0x80) {
      uint32_t cp = ((c0 & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
      if (cp >= 0x10000 && cp < 0x110000) {
        *len = 4;
        return cp;
      }
    }
  }
  *len = 1;
  return 0xFFFFFFFFu;
}

}  // namespace ptk::unicode
