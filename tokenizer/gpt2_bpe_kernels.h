// GPT-2 BPE's short-piece merge rounds, shared by the portable (gpt2_bpe.cpp) and AVX2 (gpt2_bpe_avx2.cpp) kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

// Megatron/OpenAI's algorithm: repeatedly take the adjacent pair of lowest merge rank and merge all
// its non-overlapping occurrences left to right. Pieces here are at most 64 bytes; everything lives
// in stack arrays indexed by the position a symbol started at, so left to right is index order:
// rk[i] is the rank of the pair starting at live symbol i (kNoRank for the last symbol and for
// symbols merged away). Each round takes the minimum of rk and a bit mask of its occurrences (8
// ranks at a time with AVX2, chosen at run time; a portable loop otherwise), then walks the mask's
// bits: no pointer chasing, no allocation, no compaction, no unpredictable branch per symbol. A
// merge unlinks one symbol and re-ranks the two pairs next to it.

// One short piece's merge state. Index `end` is the symbol after the last and kHead the one before
// the first: both kNoSymbol, which pairs with nothing, so a pair's rank is looked up without asking
// where the piece ends.
struct Gpt2Tokenizer::ShortMerge {
  static constexpr uint8_t kHead = kShortPiece + 1;
  uint32_t sym[kShortPiece + 2];
  alignas(32) uint32_t rk[kShortPiece + 2];
  uint8_t next[kShortPiece + 2], prev[kShortPiece + 2];
  uint8_t end;
};

// A piece's bytes as linked symbols, between the two kNoSymbol ends (S: ShortMerge or Short16).
template <typename S>
inline __attribute__((always_inline)) void Gpt2Tokenizer::LinkSymbols(S& s, const uint8_t* p, size_t n) {
  s.end = static_cast<uint8_t>(n);
  for (size_t i = 0; i < n; ++i) {
    s.sym[i] = p[i];
    s.next[i] = static_cast<uint8_t>(i + 1);
    s.prev[i] = static_cast<uint8_t>(i - 1);
  }
  s.prev[0] = S::kHead;
  s.next[S::kHead] = 0;
  s.sym[S::kHead] = s.sym[s.end] = kNoSymbol;
}

// The vocab ids of the merged symbols, in order; returns how many.
template <typename S>
inline size_t Gpt2Tokenizer::SymbolIds(const S& s, int32_t* out) const {
  size_t k = 0;
  for (uint8_t i = 0; i != s.end; i = s.next[i]) out[k++] = sym_ids_[s.sym[i]];
  return k;
}

inline __attribute__((always_inline)) void Gpt2Tokenizer::ShortStart(ShortMerge& s, const uint8_t* p, size_t n) const {
  LinkSymbols(s, p, n);
  for (uint8_t i = 0; i < s.end; ++i) s.rk[i] = PairRank(s.sym[i], s.sym[s.next[i]]);
  for (unsigned i = s.end; i % 8 != 0; ++i) s.rk[i] = kNoRank;
}

// One round: the lowest rank's occurrences merged left to right; false when nothing merges.
template <typename Rounds>
inline __attribute__((always_inline)) bool Gpt2Tokenizer::ShortRound(ShortMerge& s) const {
  const uint32_t best = Rounds::Min(s.rk, s.end);
  if (best == kNoRank) return false;
  for (uint64_t m = Rounds::Occurrences(s.rk, s.end, best); m != 0; m &= m - 1) {
    const uint8_t i = static_cast<uint8_t>(__builtin_ctzll(m));
    if (s.rk[i] != best) continue;  // the right half of a merge made earlier in this round
    const uint8_t j = s.next[i];    // merged away: never a pair start again
    s.rk[j] = kNoRank;
    s.sym[i] = 256 + best;
    s.next[i] = s.next[j];
    s.prev[s.next[j]] = i;
    s.rk[i] = PairRank(s.sym[i], s.sym[s.next[i]]);
    const uint8_t h = s.prev[i];  // kHead when i is the first: rk[kHead] is outside the rounds' range
    s.rk[h] = PairRank(s.sym[h], s.sym[i]);
  }
  return true;
}

template <typename Rounds>
inline __attribute__((always_inline)) size_t Gpt2Tokenizer::BpeShortRounds(const uint8_t* p, size_t n,
                                                                           int32_t* out) const {
  ShortMerge s;
  ShortStart(s, p, n);
  while (ShortRound<Rounds>(s)) {
  }
  return SymbolIds(s, out);
}

// Two pieces' rounds taken in turn: each round waits on its pair lookups, and the other piece's
// round runs meanwhile.
template <typename Rounds>
inline __attribute__((always_inline)) void Gpt2Tokenizer::BpeShortPairRounds(ShortPiece* a, ShortPiece* b) const {
  ShortMerge x, y;
  ShortStart(x, a->p, a->n);
  ShortStart(y, b->p, b->n);
  bool more_x = true, more_y = true;
  while (more_x && more_y) {
    more_x = ShortRound<Rounds>(x);
    more_y = ShortRound<Rounds>(y);
  }
  while (more_x) more_x = ShortRound<Rounds>(x);
  while (more_y) more_y = ShortRound<Rounds>(y);
  a->count = SymbolIds(x, a->out);
  b->count = SymbolIds(y, b->out);
}

}  // namespace ptk
