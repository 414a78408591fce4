// numpy.random.RandomState(seed) as Megatron uses it: MT19937 seeded like std::mt19937(seed), and
// the legacy RandomState.shuffle (Fisher-Yates with numpy's masked rejection sampling), so that
// shuffles are identical to numpy's element for element.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ptk {

// MT19937 with the exact output of std::mt19937 (and numpy's legacy seeding), producing its 624
// words per refill with SSE2 (part of baseline x86-64): the twist in blocks of four, the tempering
// four at a time.
class Mt19937 {
 public:
  explicit Mt19937(uint32_t seed) {
    mt_[0] = seed;
    for (uint32_t i = 1; i < kN; ++i) mt_[i] = 1812433253u * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + i;
  }
  uint32_t operator()() {
    if (pos_ == kN) Refill();
    return out_[pos_++];
  }

 private:
  static constexpr uint32_t kN = 624, kM = 397;
  static uint32_t Twist1(uint32_t cur, uint32_t next, uint32_t far) {
    uint32_t y = (cur & 0x80000000u) | (next & 0x7fffffffu);
    return far ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
  }
#if defined(__SSE2__)
  static __m128i Twist4(__m128i cur, __m128i next, __m128i far) {
    const __m128i upper = _mm_set1_epi32(static_cast<int>(0x80000000u)), lower = _mm_set1_epi32(0x7fffffff);
    __m128i y = _mm_or_si128(_mm_and_si128(cur, upper), _mm_and_si128(next, lower));
    __m128i odd = _mm_cmpeq_epi32(_mm_and_si128(y, _mm_set1_epi32(1)), _mm_set1_epi32(1));
    __m128i mag = _mm_and_si128(odd, _mm_set1_epi32(static_cast<int>(0x9908b0dfu)));
    return _mm_xor_si128(_mm_xor_si128(far, _mm_srli_epi32(y, 1)), mag);
  }
  void Block(uint32_t i, uint32_t far) {
    __m128i cur = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mt_ + i));
    __m128i next = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mt_ + i + 1));  // read before writing
    __m128i f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mt_ + far));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mt_ + i), Twist4(cur, next, f));
  }
#endif
  void Refill() {
    uint32_t i = 0;
#if defined(__SSE2__)
    for (; i + 4 <= kN - kM - 3; i += 4) Block(i, i + kM);       // far = old words
    for (; i < kN - kM; ++i) mt_[i] = Twist1(mt_[i], mt_[i + 1], mt_[i + kM]);
    for (; i + 4 <= kN - 4; i += 4) Block(i, i + kM - kN);       // far = words already twisted
#endif
    for (; i < kN - kM; ++i) mt_[i] = Twist1(mt_[i], mt_[i + 1], mt_[i + kM]);
    for (; i < kN - 1; ++i) mt_[i] = Twist1(mt_[i], mt_[i + 1], mt_[i + kM - kN]);
    mt_[kN - 1] = Twist1(mt_[kN - 1], mt_[0], mt_[kM - 1]);
    uint32_t k = 0;
#if defined(__SSE2__)
    for (; k < kN; k += 4) {
      __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mt_ + k));
      y = _mm_xor_si128(y, _mm_srli_epi32(y, 11));
      y = _mm_xor_si128(y, _mm_and_si128(_mm_slli_epi32(y, 7), _mm_set1_epi32(static_cast<int>(0x9d2c5680u))));
      y = _mm_xor_si128(y, _mm_and_si128(_mm_slli_epi32(y, 15), _mm_set1_epi32(static_cast<int>(0xefc60000u))));
      y = _mm_xor_si128(y, _mm_srli_epi32(y, 18));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out_ + k), y);
    }
#endif
    for (; k < kN; ++k) {
      uint32_t y = mt_[k];
      y ^= y >> 11;
      y ^= (y << 7) & 0x9d2c5680u;
      y ^= (y << 15) & 0xefc60000u;
      y ^= y >> 18;
      out_[k] = y;
    }
    pos_ = 0;
  }
  alignas(16) uint32_t mt_[kN + 4] = {};
  alignas(16) uint32_t out_[kN] = {};
  uint32_t pos_ = kN;
};

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : gen_(seed) {}

  // numpy's legacy random_interval(max): uniform in [0, max].
  uint64_t RandomInterval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    uint64_t value;
    if (max <= 0xFFFFFFFFull) {
      while ((value = (static_cast<uint64_t>(gen_()) & mask)) > max) {
      }
    } else {
      while ((value = (Next64() & mask)) > max) {
      }
    }
    return value;
  }

  // The draws shuffles of these lengths would make, in order, appended to *out: for a shuffle of
  // length m, random_interval(i) for i = m-1 down to 1. A shuffle is then ApplyDraws.
  // `produced` (optional) is advanced as draws are appended, for a consumer on another thread.
  template <typename Int>
  void Draw(const std::vector<uint64_t>& lengths, Int* out, std::atomic<size_t>* produced) {
    size_t k = 0;
    for (uint64_t m : lengths) {
      for (uint64_t i = m - 1; i >= 1 && m >= 2; --i) {
        out[k++] = static_cast<Int>(RandomInterval(i));
        if (produced && (k & 1023) == 0) produced->store(k, std::memory_order_release);
      }
    }
    if (produced) produced->store(k, std::memory_order_release);
  }

  // RandomState.shuffle of a 1-D array: for i = n-1 .. 1, swap x[i] with x[random_interval(i)].
  // The random targets depend only on the generator, so they are drawn kLookahead swaps early and
  // their cache lines prefetched: the swaps, random accesses into a large array, then overlap
  // instead of waiting for memory one by one. Same draws, same order, same result.
  template <typename T>
  void Shuffle(T* x, size_t n) {
    if (n < 2) return;
    constexpr size_t kLookahead = 64;
    size_t ring[kLookahead];
    size_t next_draw = n - 1;  // the next i whose target is drawn
    auto draw = [&](size_t slot) {
      ring[slot] = static_cast<size_t>(RandomInterval(next_draw));
      __builtin_prefetch(&x[ring[slot]], 1);
      --next_draw;
    };
    for (size_t k = 0; k < kLookahead && next_draw >= 1; ++k) draw(k);
    size_t slot = 0;
    for (size_t i = n - 1; i >= 1; --i) {
      const size_t j = ring[slot];
      std::swap(x[i], x[j]);
      if (next_draw >= 1) draw(slot);
      slot = slot + 1 == kLookahead ? 0 : slot + 1;
    }
  }

 private:
  uint64_t Next64() {
    uint64_t hi = gen_();
    uint64_t lo = gen_();
    return (hi << 32) | lo;
  }
  Mt19937 gen_;
};

// Applies the draws of one shuffle of n elements (n-1 of them, as Draw wrote them) to x, waiting
// for `produced` to pass each draw when another thread is still writing them.
template <typename T, typename Int>
void ApplyDraws(T* x, size_t n, const Int* draws, size_t first_draw, const std::atomic<size_t>* produced) {
  if (n < 2) return;
  constexpr size_t kLookahead = 64;
  size_t avail = produced ? produced->load(std::memory_order_acquire) : SIZE_MAX;
  size_t k = first_draw;
  for (size_t i = n - 1; i >= 1; --i, ++k) {
    while (avail <= k) {
      avail = produced->load(std::memory_order_acquire);
#if defined(__SSE2__)
      if (avail <= k) _mm_pause();
#endif
    }
    if (k + kLookahead < avail) __builtin_prefetch(&x[draws[k + kLookahead]], 1);
    std::swap(x[i], x[static_cast<size_t>(draws[k])]);
  }
}

}  // namespace ptk
