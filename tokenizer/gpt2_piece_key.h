// A piece's bytes as the key of GPT-2 BPE's tables and caches: two words and their hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ptk::gpt2_detail {

// wyhash-style "mum" mix: every key bit reaches the low bits used as the table index.
inline uint64_t HashKey(uint64_t k0, uint64_t k1, uint32_t len) {
  const uint64_t a = k0 ^ (static_cast<uint64_t>(len) * 0x9E3779B97F4A7C15ull);
  const uint64_t b = k1 ^ 0xE7037ED1A0B428DBull;
  const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

// Masks keeping the first n bytes of a piece in its two key words (n = 0..16).
struct KeyMasks {
  uint64_t m0[17], m1[17];
  constexpr KeyMasks() : m0(), m1() {
    for (int n = 0; n <= 16; ++n) {
      m0[n] = n >= 8 ? ~0ull : (n == 0 ? 0 : (~0ull >> (64 - 8 * n)));
      m1[n] = n <= 8 ? 0 : (n == 16 ? ~0ull : (~0ull >> (64 - 8 * (n - 8))));
    }
  }
};
inline constexpr KeyMasks kKeyMasks;

// Loads the (at most 16) bytes of a piece into two little-endian words, zero padded. Reads 16
// bytes when they lie before `limit` (branch-free masking), else copies.
inline void LoadKey(const uint8_t* p, size_t n, const uint8_t* limit, uint64_t* k0, uint64_t* k1) {
  if (__builtin_expect(limit - p >= 16, 1)) {
    uint64_t a, b;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    *k0 = a & kKeyMasks.m0[n];
    *k1 = b & kKeyMasks.m1[n];
    return;
  }
  uint8_t tmp[16] = {0};
  std::memcpy(tmp, p, n);
  std::memcpy(k0, tmp, 8);
  std::memcpy(k1, tmp + 8, 8);
}

// Hash of a piece of more than 16 bytes (16 at a time, the last 16 overlapping); never 0 (the
// long-piece table's empty mark).
inline uint64_t HashLong(const uint8_t* p, size_t n) {
  uint64_t h = n * 0x9E3779B97F4A7C15ull, a, b;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    std::memcpy(&a, p + i, 8);
    std::memcpy(&b, p + i + 8, 8);
    h = HashKey(a ^ h, b, static_cast<uint32_t>(n));
  }
  if (i < n) {
    std::memcpy(&a, p + n - 16, 8);
    std::memcpy(&b, p + n - 8, 8);
    h = HashKey(a ^ h, b, static_cast<uint32_t>(n));
  }
  return h | 1;
}

}  // namespace ptk::gpt2_detail
