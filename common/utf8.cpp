// UTF-8 validation and repair.
#include "common/utf8.h"

#include <cstring>

namespace ptk {
namespace {

// Length of the maximal well-formed prefix of the sequence starting at p (>= 1 when the sequence
// is ill-formed: that many bytes become one U+FFFD), or 0 with *len set when it is a valid char.
inline size_t CheckSequence(const uint8_t* p, const uint8_t* end, size_t* valid_len) {
  const uint8_t b = p[0];
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b < 0x80) {
    *valid_len = 1;
    return 0;
  } else if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (b == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    return 1;  // 80..C1, F5..FF: never valid as a lead byte
  }
  size_t i = 1;
  for (; i <= need; ++i) {
    if (p + i >= end) return i;  // truncated: the bytes so far form one maximal subpart
    const uint8_t c = p[i];
    const uint8_t l = (i == 1) ? lo : 0x80, h = (i == 1) ? hi : 0xBF;
    if (c < l || c > h) return i;
  }
  *valid_len = need + 1;
  return 0;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(s.data());
  const uint8_t* end = p + s.size();
  while (p < end) {
    // ASCII fast path, 8 bytes at a time.
    while (end - p >= 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      if (w & 0x8080808080808080ull) break;
      p += 8;
    }
    if (p >= end) break;
    size_t len;
    if (CheckSequence(p, end, &len) != 0) return false;
    p += len;
  }
  return true;
}

size_t AppendUtf8Replacing(std::string_view in, std::string* out) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(in.data());
  const uint8_t* end = p + in.size();
  size_t replaced = 0;
  const uint8_t* run = p;
  while (p < end) {
    size_t len;
    size_t bad = CheckSequence(p, end, &len);
    if (bad == 0) {
      p += len;
      continue;
    }
    out->append(reinterpret_cast<const char*>(run), static_cast<size_t>(p - run));
    out->append("\xEF\xBF\xBD", 3);
    ++replaced;
    p += bad;
    run = p;
  }
  out->append(reinterpret_cast<const char*>(run), static_cast<size_t>(p - run));
  return replaced;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace ptk
