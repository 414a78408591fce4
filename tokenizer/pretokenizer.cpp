// The pre-tokenizer's two-byte prefix table (see pretokenizer.h).
#include "tokenizer/pretokenizer.h"

namespace ptk::pretok_detail {
namespace {

// One entry per (first byte, second byte) of a non-ASCII character: 1 + its class when those two
// bytes decide it (a whole 2-byte character, or a 3-byte prefix whose 64 characters share one class), else
// kPrefixUndecided. Invalid prefixes (overlong forms, surrogates, bad continuation bytes) and 4-byte
// characters stay undecided and take the exact path. A valid 3-byte prefix whose characters differ
// (Indic scripts interleave letters and combining marks) is kPrefixMixed: looked up by code point.
struct PrefixTable {
  uint8_t cls[1 << 16];
  PrefixTable() {
    for (uint8_t& c : cls) c = kPrefixUndecided;
    auto entry = [](unicode::CharClass k) { return static_cast<uint8_t>(1 + k); };
    for (uint32_t c0 = 0xC2; c0 < 0xE0; ++c0)
      for (uint32_t c1 = 0x80; c1 < 0xC0; ++c1)
        cls[c0 << 8 | c1] = entry(unicode::ClassOf(((c0 & 0x1F) << 6) | (c1 & 0x3F)));
    for (uint32_t c0 = 0xE0; c0 < 0xF0; ++c0) {
      for (uint32_t c1 = 0x80; c1 < 0xC0; ++c1) {
        const uint32_t base = ((c0 & 0x0F) << 12) | ((c1 & 0x3F) << 6);
        if (base < 0x800 || (base >= 0xD800 && base <= 0xDFFF)) continue;  // overlong, surrogate
        const unicode::CharClass k = unicode::ClassOf(base);
        bool uniform = true;
        for (uint32_t c2 = 1; c2 < 64 && uniform; ++c2) uniform = unicode::ClassOf(base | c2) == k;
        cls[c0 << 8 | c1] = uniform ? entry(k) : kPrefixMixed;
      }
    }
  }
};
const PrefixTable kTable;

}  // namespace

const uint8_t* const kPrefixClass = kTable.cls;

unicode::CharClass ClassAtExact(const uint8_t* p, const uint8_t* end, int* len) {
  return unicode::ClassOf(unicode::DecodeUtf8(p, end, len));
}

}  // namespace ptk::pretok_detail
