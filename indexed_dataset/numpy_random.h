// numpy.random.RandomState(seed) as Megatron uses it: MT19937 seeded like std::mt19937(seed), and
// the legacy RandomState.shuffle (Fisher-Yates with numpy's masked rejection sampling), so that
// shuffles are identical to numpy's element for element.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
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
  // The outputs not yet consumed (refilling when there are none): *n of them at the returned
  // pointer. Consume(k) then marks the first k of them as used.
  const uint32_t* Pending(size_t* n) {
    if (pos_ == kN) Refill();
    *n = kN - pos_;
    return out_ + pos_;
  }
  void Consume(size_t k) { pos_ += static_cast<uint32_t>(k); }

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

template <typename Int>
struct DrawRing;

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

  // random_interval(i) for i = hi, hi-1, ..., lo (1 <= lo <= hi), in that order, to out[0..hi-lo].
  // Bounds below 2^32 take a branch-free path over the generator's output block: every output is
  // masked, written and kept (k advances, the bound drops) only when it is accepted; the same
  // outputs are accepted and rejected as by RandomInterval, one after the other.
  template <typename Int>
  void DrawDescending(uint64_t hi, uint64_t lo, Int* out) {
    size_t k = 0;
    for (; hi >= lo && hi > 0xFFFFFFFFull; --hi) out[k++] = static_cast<Int>(RandomInterval(hi));
    if (hi < lo) return;
    uint32_t b = static_cast<uint32_t>(hi);
    while (b >= lo) {
      // The mask is the same down to the next power of two: [low, b] shares it.
      const uint32_t mask = 0xFFFFFFFFu >> __builtin_clz(b);
      const uint32_t low = std::max<uint32_t>(static_cast<uint32_t>(lo), (mask >> 1) + 1);
      while (b >= low) {
        size_t n;
        const uint32_t* x = gen_.Pending(&n);
        size_t j = 0;
        for (; j < n && b >= low; ++j) {
          const uint32_t v = x[j] & mask;
          out[k] = static_cast<Int>(v);
          const uint32_t acc = v <= b;
          k += acc;
          b -= acc;
        }
        gen_.Consume(j);
      }
    }
  }

  // The draws shuffles of these lengths would make, in order, into `ring` (see DrawRing): for a
  // shuffle of length m, random_interval(i) for i = m-1 down to 1. A shuffle is then ApplyDraws.
  template <typename Int>
  void Draw(const std::vector<uint64_t>& lengths, DrawRing<Int>* ring);

  // RandomState.shuffle of a 1-D array: for i = n-1 .. 1, swap x[i] with x[random_interval(i)].
  // The random targets depend only on the generator, so they are drawn a block at a time and the
  // swaps, random accesses into a large array, prefetched a few dozen ahead so that they overlap
  // instead of waiting for memory one by one. Same draws, same order, same result.
  template <typename T>
  void Shuffle(T* x, size_t n) {
    if (n < 2) return;
    constexpr size_t kBlock = 2048, kLookahead = 32;
    uint64_t block[kBlock];
    for (size_t hi = n - 1; hi >= 1;) {
      const size_t lo = hi >= kBlock ? hi - kBlock + 1 : 1;
      const size_t cnt = hi - lo + 1;
      DrawDescending(hi, lo, block);
      for (size_t k = 0; k < std::min(cnt, kLookahead); ++k) __builtin_prefetch(&x[block[k]], 1);
      for (size_t k = 0; k < cnt; ++k) {
        if (k + kLookahead < cnt) __builtin_prefetch(&x[block[k + kLookahead]], 1);
        std::swap(x[hi - k], x[static_cast<size_t>(block[k])]);
      }
      hi = lo - 1;
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

// Draws handed from the thread that makes them to the thread that applies them: a ring of
// `capacity` (a power of two) entries; the producer waits while the ring is full, the consumer
// while it is empty. A ring at least as large as all the draws is a plain buffer.
template <typename Int>
struct DrawRing {
  Int* buf = nullptr;
  size_t capacity = 0;  // power of two
  std::atomic<size_t> produced{0}, consumed{0};
};

template <typename Int>
void NumpyRandomState::Draw(const std::vector<uint64_t>& lengths, DrawRing<Int>* ring) {
  constexpr uint64_t kStep = 4096;
  Int block[kStep];
  const size_t mask = ring->capacity - 1;
  size_t k = 0;
  for (uint64_t m : lengths) {
    if (m < 2) continue;
    for (uint64_t hi = m - 1; hi >= 1;) {
      const uint64_t lo = hi > kStep ? hi - kStep + 1 : 1;
      const size_t cnt = static_cast<size_t>(hi - lo + 1);
      DrawDescending(hi, lo, block);
      while (k + cnt - ring->consumed.load(std::memory_order_acquire) > ring->capacity) {
#if defined(__SSE2__)
        _mm_pause();
#endif
      }
      const size_t at = k & mask, first = std::min(cnt, ring->capacity - at);
      std::memcpy(ring->buf + at, block, first * sizeof(Int));
      std::memcpy(ring->buf, block + first, (cnt - first) * sizeof(Int));
      k += cnt;
      ring->produced.store(k, std::memory_order_release);
      hi = lo - 1;
    }
  }
}

// Applies the draws of one shuffle of n elements (n-1 of them, the draws first_draw.. of the ring)
// to x, waiting for the producer when it is behind and telling it what has been used.
template <typename T, typename Int>
void ApplyDraws(T* x, size_t n, DrawRing<Int>* ring, size_t first_draw) {
  if (n < 2) return;
  constexpr size_t kLookahead = 64, kReport = 4096;
  const size_t mask = ring->capacity - 1;
  const Int* draws = ring->buf;
  size_t avail = ring->produced.load(std::memory_order_acquire);
  size_t k = first_draw;
  for (size_t i = n - 1; i >= 1; --i, ++k) {
    while (avail <= k) {
      avail = ring->produced.load(std::memory_order_acquire);
#if defined(__SSE2__)
      if (avail <= k) _mm_pause();
#endif
    }
    if (k + kLookahead < avail) __builtin_prefetch(&x[draws[(k + kLookahead) & mask]], 1);
    std::swap(x[i], x[static_cast<size_t>(draws[k & mask])]);
    if ((i & (kReport - 1)) == 0) ring->consumed.store(k + 1, std::memory_order_release);
  }
  ring->consumed.store(k, std::memory_order_release);
}

}  // namespace ptk
