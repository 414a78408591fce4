// numpy.random.RandomState(seed) as Megatron uses it: MT19937 seeded like std::mt19937(seed), and
// the legacy RandomState.shuffle (Fisher-Yates with numpy's masked rejection sampling), so that
// shuffles are identical to numpy's element for element.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/status.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ptk {
namespace numpy_random_detail {

#if defined(__x86_64__)
// GCC 12's AVX-512 shift intrinsics start from an undefined vector and trip -Wuninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Whether the AVX-512 paths run: detected once; tests turn it off to check the portable paths.
inline bool& Avx512Enabled() {
  static bool on = __builtin_cpu_supports("avx512f");
  return on;
}
inline bool HaveAvx512() { return Avx512Enabled(); }

// One MT19937 refill (the twist of all 624 words, then their tempering) sixteen words at a time.
// A block reads its "next" words before storing, and its "far" words are old ones (first part)
// or ones already twisted (second part), exactly as the one-word recurrence sees them.
__attribute__((target("avx512f"))) inline void Mt19937Twist16(uint32_t* mt, uint32_t i, uint32_t far) {
  const __m512i cur = _mm512_loadu_si512(mt + i), next = _mm512_loadu_si512(mt + i + 1),
                f = _mm512_loadu_si512(mt + far);
  const __m512i y = _mm512_or_si512(_mm512_and_si512(cur, _mm512_set1_epi32(static_cast<int>(0x80000000u))),
                                    _mm512_and_si512(next, _mm512_set1_epi32(0x7fffffff)));
  const __mmask16 odd = _mm512_test_epi32_mask(y, _mm512_set1_epi32(1));
  _mm512_storeu_si512(mt + i,
                      _mm512_xor_si512(_mm512_xor_si512(f, _mm512_srli_epi32(y, 1)),
                                       _mm512_maskz_mov_epi32(odd, _mm512_set1_epi32(static_cast<int>(0x9908b0dfu)))));
}
inline void Mt19937Twist1(uint32_t* mt, uint32_t i, uint32_t next, uint32_t far) {
  const uint32_t y = (mt[i] & 0x80000000u) | (mt[next] & 0x7fffffffu);
  mt[i] = mt[far] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
}
__attribute__((target("avx512f"))) inline void Mt19937RefillAvx512(uint32_t* mt, uint32_t* out) {
  constexpr uint32_t kN = 624, kM = 397;
  uint32_t i = 0;
  for (; i + 16 <= kN - kM; i += 16) Mt19937Twist16(mt, i, i + kM);
  for (; i < kN - kM; ++i) Mt19937Twist1(mt, i, i + 1, i + kM);
  for (; i + 16 <= kN - 1; i += 16) Mt19937Twist16(mt, i, i + kM - kN);
  for (; i < kN - 1; ++i) Mt19937Twist1(mt, i, i + 1, i + kM - kN);
  Mt19937Twist1(mt, kN - 1, 0, kM - 1);
  for (uint32_t k = 0; k < kN; k += 16) {
    __m512i y = _mm512_loadu_si512(mt + k);
    y = _mm512_xor_si512(y, _mm512_srli_epi32(y, 11));
    y = _mm512_xor_si512(y,
                         _mm512_and_si512(_mm512_slli_epi32(y, 7), _mm512_set1_epi32(static_cast<int>(0x9d2c5680u))));
    y = _mm512_xor_si512(y,
                         _mm512_and_si512(_mm512_slli_epi32(y, 15), _mm512_set1_epi32(static_cast<int>(0xefc60000u))));
    y = _mm512_xor_si512(y, _mm512_srli_epi32(y, 18));
    _mm512_storeu_si512(out + k, y);
  }
}
#pragma GCC diagnostic pop
#endif

}  // namespace numpy_random_detail

// MT19937 with the exact output of std::mt19937 (and numpy's legacy seeding), producing its 624
// words per refill sixteen at a time with AVX-512 where the CPU has it, else four at a time with
// SSE2 (part of baseline x86-64).
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
#if defined(__x86_64__)
    if (numpy_random_detail::HaveAvx512()) {
      numpy_random_detail::Mt19937RefillAvx512(mt_, out_);
      pos_ = 0;
      return;
    }
#endif
    uint32_t i = 0;
#if defined(__SSE2__)
    for (; i + 4 <= kN - kM - 3; i += 4) Block(i, i + kM);  // far = old words
    for (; i < kN - kM; ++i) mt_[i] = Twist1(mt_[i], mt_[i + 1], mt_[i + kM]);
    for (; i + 4 <= kN - 4; i += 4) Block(i, i + kM - kN);  // far = words already twisted
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

namespace numpy_random_detail {

#if defined(__x86_64__)
// Sixteen generator outputs at a time while the bound b is at least low + 15 (so the mask stays
// the same and at least 16 draws remain): an output masked to at most b - 15 is accepted whatever
// the others do, one above b rejected; a block holding an output in between (rare unless b is
// small) goes one output at a time. Accepted values are packed in order and stored. Returns how
// many outputs were consumed; *b and *k advance as the one-at-a-time loop would.
__attribute__((target("avx512f"))) inline size_t AcceptAvx512(const uint32_t* x, size_t n, uint32_t mask, uint32_t low,
                                                              uint32_t* b_io, uint32_t* out, size_t* k_io) {
  uint32_t b = *b_io;
  size_t k = *k_io, j = 0;
  const __m512i vm = _mm512_set1_epi32(static_cast<int>(mask));
  while (j + 16 <= n && uint64_t{b} >= uint64_t{low} + 15) {  // 64-bit: low + 15 may pass 2^32
    const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + j), vm);
    const __mmask16 sure = _mm512_cmple_epu32_mask(v, _mm512_set1_epi32(static_cast<int>(b - 15)));
    const __mmask16 maybe = _mm512_cmple_epu32_mask(v, _mm512_set1_epi32(static_cast<int>(b)));
    if (sure == maybe) {
      _mm512_storeu_si512(out + k, _mm512_maskz_compress_epi32(sure, v));  // k + 16 <= draws left
      const unsigned c = static_cast<unsigned>(__builtin_popcount(sure));
      k += c;
      b -= c;
    } else {
      for (size_t t = j; t < j + 16; ++t) {
        const uint32_t w = x[t] & mask;
        out[k] = w;
        const uint32_t acc = w <= b;
        k += acc;
        b -= acc;
      }
    }
    j += 16;
  }
  *b_io = b;
  *k_io = k;
  return j;
}
#endif

}  // namespace numpy_random_detail

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
#if defined(__x86_64__)
        if constexpr (std::is_same_v<Int, uint32_t>)
          if (numpy_random_detail::HaveAvx512()) j = numpy_random_detail::AcceptAvx512(x, n, mask, low, &b, out, &k);
#endif
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
    if (n - 1 <= 0xFFFFFFFFull)
      ShuffleWith<uint32_t>(x, n);  // 32-bit draws take the vector path
    else
      ShuffleWith<uint64_t>(x, n);
  }

  // numpy's next_double for MT19937: 53 bits from two outputs (27 and 26 bits), in [0, 1).
  double NextDouble() {
    const int32_t a = static_cast<int32_t>(gen_() >> 5), b = static_cast<int32_t>(gen_() >> 6);
    return (a * 67108864.0 + b) / 9007199254740992.0;
  }

  // RandomState.binomial(n, p) for a scalar p in [0, 1] and n * min(p, 1 - p) <= 30: numpy's
  // legacy_random_binomial (no shortcut for p = 0 or n = 0, unlike Generator's: every call draws), p above
  // one half drawing n - X of 1 - p, both by legacy_random_binomial_inversion, which starts over when X
  // passes its bound. The caller checks p.
  int64_t Binomial(int64_t n, double p) {
    if (p <= 0.5) return BinomialInversion(n, p);
    return n - BinomialInversion(n, 1.0 - p);
  }

 private:
  template <typename Draw, typename T>
  void ShuffleWith(T* x, size_t n) {
    constexpr size_t kBlock = 2048, kLookahead = 32;
    Draw block[kBlock];
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

  uint64_t Next64() {
    uint64_t hi = gen_();
    uint64_t lo = gen_();
    return (hi << 32) | lo;
  }
  int64_t BinomialInversion(int64_t n, double p) {
    PTK_CHECK(static_cast<double>(n) * p <= 30.0);  // numpy's BTPE branch is not mirrored
    const double q = 1.0 - p;
    const double qn = std::exp(static_cast<double>(n) * std::log(q));
    const double np = static_cast<double>(n) * p;
    const int64_t bound = static_cast<int64_t>(std::min(static_cast<double>(n), np + 10.0 * std::sqrt(np * q + 1)));
    int64_t x = 0;
    double px = qn;
    double u = NextDouble();
    while (u > px) {
      ++x;
      if (x > bound) {
        x = 0;
        px = qn;
        u = NextDouble();
      } else {
        u -= px;
        px = (static_cast<double>(n - x + 1) * p * px) / (static_cast<double>(x) * q);
      }
    }
    return x;
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
