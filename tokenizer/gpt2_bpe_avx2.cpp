// GPT-2 BPE's short-piece merge on AVX2 (chosen at run time by gpt2_bpe.cpp).
#if defined(__x86_64__)
#include <immintrin.h>

#include "tokenizer/gpt2_bpe_kernels.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {
namespace {

struct Avx2Rounds {  // rk holds kNoRank up to the next multiple of 8 past end
  __attribute__((target("avx2"))) static uint32_t Min(const uint32_t* rk, unsigned end) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rk));
    for (unsigned i = 8; i < end; i += 8)
      v = _mm256_min_epu32(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rk + i)));
    __m128i x = _mm_min_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  __attribute__((target("avx2"))) static uint64_t Occurrences(const uint32_t* rk, unsigned end, uint32_t best) {
    const __m256i b = _mm256_set1_epi32(static_cast<int>(best));
    uint64_t m = 0;
    for (unsigned i = 0; i < end; i += 8) {
      const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rk + i)), b);
      m |= static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(eq)))) << i;
    }
    return m;
  }
};

}  // namespace

// Pieces of at most 16 bytes on AVX2: the ranks live in two vector registers and a merge blends its
// three new ranks in, instead of storing them and reading them back as vectors (a vector load of
// fresh scalar stores cannot be forwarded: it waits until they retire, which serialises rounds).
struct Gpt2Tokenizer::Short16 {
  static constexpr uint8_t kHead = 17;
  uint32_t sym[18];
  uint8_t next[18], prev[18];
  uint8_t end;
  __m256i r0, r1;  // ranks of the pairs starting at 0..7 and 8..15
};

// Lane `lane` of the 16 ranks in r0:r1 set to `rank` (no lane for lane >= 16).
__attribute__((target("avx2"), always_inline)) inline void SetLane(__m256i& r0, __m256i& r1, uint32_t lane,
                                                                   uint32_t rank) {
  const __m256i l = _mm256_set1_epi32(static_cast<int>(lane)), r = _mm256_set1_epi32(static_cast<int>(rank));
  r0 = _mm256_blendv_epi8(r0, r, _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), l));
  r1 = _mm256_blendv_epi8(r1, r, _mm256_cmpeq_epi32(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), l));
}

__attribute__((target("avx2"), always_inline)) inline void Gpt2Tokenizer::Start16(Short16& s, const uint8_t* p,
                                                                                  size_t n) const {
  LinkSymbols(s, p, n);
  alignas(32) uint32_t rk[16];
  for (size_t i = 0; i < 16; ++i) rk[i] = i < n ? PairRank(s.sym[i], s.sym[s.next[i]]) : kNoRank;
  s.r0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rk));
  s.r1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rk + 8));
}

__attribute__((target("avx2"), always_inline)) inline bool Gpt2Tokenizer::Round16(Short16& s) const {
  __m256i v = _mm256_min_epu32(s.r0, s.r1);
  __m128i x = _mm_min_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0xB1));
  const uint32_t best = static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  if (best == kNoRank) return false;
  const __m256i b = _mm256_set1_epi32(static_cast<int>(best));
  uint32_t m = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(s.r0, b)))) |
               static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(s.r1, b)))) << 8;
  while (m != 0) {  // left to right; the right half of a merge is no longer an occurrence
    const uint8_t i = static_cast<uint8_t>(__builtin_ctz(m));
    const uint8_t j = s.next[i];
    m &= m - 1;
    m &= ~(1u << j);
    const uint8_t after = s.next[j];
    s.sym[i] = 256 + best;
    s.next[i] = after;
    s.prev[after] = i;
    const uint8_t h = s.prev[i];
    const uint32_t ri = PairRank(s.sym[i], s.sym[after]), rh = PairRank(s.sym[h], s.sym[i]);
    SetLane(s.r0, s.r1, j, kNoRank);
    SetLane(s.r0, s.r1, i, ri);
    SetLane(s.r0, s.r1, h, rh);  // lane kHead: none
  }
  return true;
}

__attribute__((target("avx2"))) size_t Gpt2Tokenizer::BpeShortAvx2(const uint8_t* p, size_t n, int32_t* out) const {
  if (n <= 16) {
    Short16 s;
    Start16(s, p, n);
    while (Round16(s)) {
    }
    return SymbolIds(s, out);
  }
  return BpeShortRounds<Avx2Rounds>(p, n, out);
}
__attribute__((target("avx2"))) void Gpt2Tokenizer::BpeShortPairAvx2(ShortPiece* a, ShortPiece* b) const {
  if (a->n <= 16 && b->n <= 16) {
    Short16 x, y;
    Start16(x, a->p, a->n);
    Start16(y, b->p, b->n);
    bool more_x = true, more_y = true;
    while (more_x && more_y) {
      more_x = Round16(x);
      more_y = Round16(y);
    }
    while (more_x) more_x = Round16(x);
    while (more_y) more_y = Round16(y);
    a->count = SymbolIds(x, a->out);
    b->count = SymbolIds(y, b->out);
    return;
  }
  BpeShortPairRounds<Avx2Rounds>(a, b);
}

}  // namespace ptk
#endif  // defined(__x86_64__)
