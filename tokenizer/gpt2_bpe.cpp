// GPT-2 BPE's merge of one piece: the portable short-piece kernel, the run-time choice of the AVX2 one, long pieces.
#include <algorithm>
#include <queue>
#include <vector>

#include "common/status.h"
#include "tokenizer/gpt2_bpe_kernels.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

void Gpt2Tokenizer::BpePiece(const uint8_t* p, size_t n, std::vector<int32_t>* out) const {
  if (n <= kShortPiece)
    BpeShort(p, n, out);
  else
    BpeLong(p, n, out);
}

namespace {

struct ScalarRounds {
  static uint32_t Min(const uint32_t* rk, unsigned end) {
    uint32_t best = Gpt2Tokenizer::kNoRank;
    for (unsigned i = 0; i < end; ++i) best = std::min(best, rk[i]);
    return best;
  }
  static uint64_t Occurrences(const uint32_t* rk, unsigned end, uint32_t best) {
    uint64_t m = 0;
    for (unsigned i = 0; i < end; ++i) m |= static_cast<uint64_t>(rk[i] == best) << i;
    return m;
  }
};

}  // namespace

#if defined(__x86_64__)
static const bool kAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
#endif

size_t Gpt2Tokenizer::BpeShortTo(const uint8_t* p, size_t n, int32_t* out) const {
  if (n == 0) return 0;
  if (n == 1) {
    *out = byte_to_id_[p[0]];
    return 1;
  }
  PTK_CHECK(n <= kShortPiece);
#if defined(__x86_64__)
  if (kAvx2) return BpeShortAvx2(p, n, out);
#endif
  return BpeShortRounds<ScalarRounds>(p, n, out);
}

void Gpt2Tokenizer::BpeShortPair(ShortPiece* a, ShortPiece* b, bool portable) const {
  PTK_CHECK(a->n <= kShortPiece && b->n <= kShortPiece);
  if (a->n < 2 || b->n < 2) {
    a->count = BpeShortTo(a->p, a->n, a->out);
    b->count = BpeShortTo(b->p, b->n, b->out);
    return;
  }
#if defined(__x86_64__)
  if (kAvx2 && !portable) return BpeShortPairAvx2(a, b);
#endif
  BpeShortPairRounds<ScalarRounds>(a, b);
}

void Gpt2Tokenizer::BpeShort(const uint8_t* p, size_t n, std::vector<int32_t>* out) const {
  const size_t old = out->size();
  out->resize(old + n);
  out->resize(old + BpeShortTo(p, n, out->data() + old));
}

void Gpt2Tokenizer::BpeShortPortable(const uint8_t* p, size_t n, std::vector<int32_t>* out) const {
  if (n <= 1) return BpeShort(p, n, out);
  PTK_CHECK(n <= kShortPiece);
  const size_t old = out->size();
  out->resize(old + n);
  out->resize(old + BpeShortRounds<ScalarRounds>(p, n, out->data() + old));
}

// O(n log n) variant for long pieces: a heap of (rank, position) over a linked list of symbols,
// stale entries skipped lazily. Equal ranks are the same pair and pop leftmost first, which is the
// left-to-right rule of BpeShort.
void Gpt2Tokenizer::BpeLong(const uint8_t* p, size_t n, std::vector<int32_t>* out) const {
  if (n == 0) return;
  std::vector<uint32_t> sym(n);
  std::vector<int64_t> prev(n), next(n);
  std::vector<uint32_t> ver(n, 0);
  for (size_t i = 0; i < n; ++i) {
    sym[i] = p[i];
    prev[i] = static_cast<int64_t>(i) - 1;
    next[i] = (i + 1 < n) ? static_cast<int64_t>(i + 1) : -1;
  }
  struct Entry {
    uint32_t rank;
    int64_t pos;
    uint32_t ver_l, ver_r;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int64_t i) {
    if (i < 0) return;
    int64_t j = next[i];
    if (j < 0) return;
    const uint32_t rank = PairRank(sym[i], sym[j]);
    if (rank != kNoRank) heap.push(Entry{rank, i, ver[i], ver[j]});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int64_t>(i));
  while (!heap.empty()) {
    Entry e = heap.top();
    heap.pop();
    int64_t i = e.pos, j = next[i];
    if (j < 0 || ver[i] != e.ver_l || ver[j] != e.ver_r) continue;
    if (PairRank(sym[i], sym[j]) != e.rank) continue;
    sym[i] = 256 + e.rank;
    ++ver[i];
    ++ver[j];
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int64_t i = 0; i >= 0; i = next[i]) out->push_back(sym_ids_[sym[i]]);
}

}  // namespace ptk
