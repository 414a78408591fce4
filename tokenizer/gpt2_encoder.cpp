// Gpt2Encoder: one worker's encoding over the shared Gpt2Tokenizer, with its caches of pieces' ids.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/status.h"
#include "common/zero_pages.h"
#include "tokenizer/gpt2_piece_key.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/pretokenizer.h"

namespace ptk {

using gpt2_detail::HashKey;
using gpt2_detail::HashLong;
using gpt2_detail::LoadKey;

Gpt2Encoder::Gpt2Encoder(const Gpt2Tokenizer& tok, Options options)
    : tok_(tok), opt_(options), long_budget_(options.long_cache_bytes) {
  size_t min_slots = 1;
  while (min_slots < tok.short_count_ * 2) min_slots <<= 1;
  max_slots_ = 1;
  while (max_slots_ < opt_.cache_slots) max_slots_ <<= 1;
  max_slots_ = std::max(max_slots_, min_slots);
  AllocateCache(min_slots);
  if (min_slots == tok_.short_table_.size()) {  // the same hash and size: the same layout
    std::memcpy(static_cast<void*>(cache_), tok_.short_table_.data(), min_slots * sizeof(CacheSlot));
  } else {
    for (const auto& s : tok_.short_table_)
      if (s.len != 0) InsertSlot(s);
  }
  cache_used_ = tok_.short_count_;
  // Ids of pieces with more than 3 ids: a quarter of the table's bytes at most (less, or none, where
  // the system refuses the address space: such pieces are then not cached).
  for (max_overflow_ = max_slots_ * sizeof(CacheSlot) / 4 / sizeof(int32_t); max_overflow_ >= 1024;
       max_overflow_ /= 2) {
    overflow_mem_ = ZeroPages::Try(max_overflow_ * sizeof(int32_t));
    if (overflow_mem_.bytes() != 0) break;
  }
  if (overflow_mem_.bytes() == 0) max_overflow_ = 0;
}

// The table's most (max_slots_) is reserved once; it uses the first `slots` and grows in place, so
// a run touches (and the kernel zero-fills) the final table's pages once instead of every
// generation's.
void Gpt2Encoder::AllocateCache(size_t slots) {
  // Where the system refuses that much address space (strict overcommit, `ulimit -v`), a smaller
  // most: the cache then stops growing sooner. Not even the starting table: that is out of memory.
  while (true) {
    cache_mem_ = ZeroPages::Try(max_slots_ * sizeof(CacheSlot));
    if (cache_mem_.bytes() != 0 || max_slots_ <= slots) break;
    max_slots_ /= 2;
  }
  PTK_CHECK(cache_mem_.bytes() != 0);
  cache_ = cache_mem_.as<CacheSlot>();
  cache_slots_ = slots;
  cache_mask_ = slots - 1;
}

inline void Gpt2Encoder::InsertSlot(const CacheSlot& s) {
  uint64_t h = HashKey(s.k0, s.k1, s.len) & cache_mask_;
  while (cache_[h].len != 0) h = (h + 1) & cache_mask_;
  cache_[h] = s;
}

// Room for n more short pieces: the table doubles if they could take it past half full, before
// the batch that brings them looks anything up (so slot pointers stay valid through a batch). A full
// table keeps what it holds and takes nothing new.
inline void Gpt2Encoder::MakeRoom(size_t n) {
  if ((cache_used_ + n) * 2 > cache_slots_ && cache_slots_ < max_slots_) Grow();
}

namespace {
// Doubles an open-addressing table (linear probing) of `old` slots in place, keeping every entry;
// the new upper half must be empty (untouched zero pages). Each old slot is visited once,
// cyclically from an empty one (so every cluster from its first slot), its entry taken out and
// inserted again from its home in the doubled table. An entry so placed lands either in a slot
// already visited or in the upper half (which nothing is taken out of), with only such slots before
// it on its probe path, so no later removal can cut the path; or, wrapping past the end, in a slot
// not yet visited, which the walk reaches and re-inserts. used(slot), clear(slot), home(slot, mask).
template <typename Slot, typename Used, typename Clear, typename Home>
void DoubleInPlace(Slot* slots, size_t old, Used used, Clear clear, Home home) {
  size_t start = 0;
  while (used(slots[start])) ++start;  // never full: there is an empty slot
  const uint64_t mask = old * 2 - 1;
  for (size_t k = 1; k < old; ++k) {
    const size_t i = (start + k) & (old - 1);
    if (!used(slots[i])) continue;
    const Slot e = slots[i];
    clear(slots[i]);
    uint64_t h = home(e, mask);
    while (used(slots[h])) h = (h + 1) & mask;
    slots[h] = e;
  }
}
}  // namespace

void Gpt2Encoder::Grow() {
  DoubleInPlace(
      cache_, cache_slots_, [](const CacheSlot& s) { return s.len != 0; }, [](CacheSlot& s) { s.len = 0; },
      [](const CacheSlot& s, uint64_t mask) { return HashKey(s.k0, s.k1, s.len) & mask; });
  cache_slots_ *= 2;
  cache_mask_ = cache_slots_ - 1;
}

// The long-piece table grows the same way (at a quarter full), from a table of one huge page: a text
// with a few long pieces no longer has the kernel zero the most's 4 MiB.
void Gpt2Encoder::GrowLong() {
  DoubleInPlace(
      long_mem_.as<LongSlot>(), long_nslots_, [](const LongSlot& s) { return s.hash != 0; },
      [](LongSlot& s) { s.hash = 0; }, [](const LongSlot& s, uint64_t mask) { return s.hash & mask; });
  long_nslots_ *= 2;
}

size_t Gpt2Encoder::cache_bytes() const {
  return cache_slots_ * sizeof(CacheSlot) + overflow_size_ * sizeof(int32_t) + long_nslots_ * sizeof(LongSlot) +
         arena_size_;
}

size_t Gpt2Encoder::max_cache_bytes() const {
  size_t long_slots = 16;
  while (long_slots * sizeof(LongSlot) * 4 < long_budget_) long_slots <<= 1;
  return max_slots_ * sizeof(CacheSlot) + max_overflow_ * sizeof(int32_t) +
         (long_budget_ > 0 ? long_slots * sizeof(LongSlot) : 0) + long_budget_;
}

// A short piece's slot, or nullptr.
__attribute__((always_inline)) inline const Gpt2Encoder::CacheSlot* Gpt2Encoder::FindShort(const Pending& pc) const {
  const uint8_t len = static_cast<uint8_t>(pc.n);
  for (uint64_t h = pc.h & cache_mask_;; h = (h + 1) & cache_mask_) {
    const CacheSlot& s = cache_[h];
    if (s.len == len && s.k0 == pc.k0 && s.k1 == pc.k1) return &s;
    if (s.len == 0) return nullptr;
  }
}

// A short piece's ids into the cache, while it is at most half full and the overflow ids have room
// (a piece met twice in one batch is learnt once).
void Gpt2Encoder::LearnShort(const Pending& pc, const int32_t* ids, size_t n) {
  const bool overflow = n > 3;
  // (16 overflow ids stay readable past the last piece's: hits copy sixteen.)
  if ((cache_used_ + 1) * 2 > cache_slots_ || (overflow && overflow_size_ + n + 16 > max_overflow_)) return;
  const uint8_t len = static_cast<uint8_t>(pc.n);
  uint64_t h = pc.h & cache_mask_;
  for (;; h = (h + 1) & cache_mask_) {
    const CacheSlot& s = cache_[h];
    if (s.len == len && s.k0 == pc.k0 && s.k1 == pc.k1) return;
    if (s.len == 0) break;
  }
  CacheSlot& s = cache_[h];
  s.k0 = pc.k0;
  s.k1 = pc.k1;
  s.len = len;
  if (!overflow) {
    s.n = static_cast<uint8_t>(n);
    std::copy(ids, ids + n, s.ids);
  } else {
    s.n = kOverflow;
    s.ids[0] = static_cast<int32_t>(overflow_size_);
    s.ids[1] = static_cast<int32_t>(n);
    std::copy(ids, ids + n, overflow_mem_.as<int32_t>() + overflow_size_);
    overflow_size_ += n;
  }
  ++cache_used_;
}

// One batch of pieces: first every short piece is looked up, and the misses are merged two at a time
// (BpeShortPair: one's rounds run while the other's wait on their lookups) and learnt; then the ids
// are written in order.
__attribute__((always_inline)) inline int32_t* Gpt2Encoder::EncodeBatch(const Pending* batch, int count, int32_t* out) {
  lookups_ += static_cast<uint64_t>(count);
  MakeRoom(static_cast<size_t>(count));
  const CacheSlot* found[kBatch];
  int32_t learnt[kBatch][16];  // a miss's ids (a piece of at most 16 bytes has at most 16)
  uint8_t nlearnt[kBatch];
  int waiting = -1;  // a miss waiting for another
  for (int i = 0; i < count; ++i) {
    const Pending& pc = batch[i];
    found[i] = nullptr;
    if (pc.n > 16) continue;
    found[i] = FindShort(pc);
    if (found[i] != nullptr) continue;
    if (waiting < 0) {
      waiting = i;
      continue;
    }
    LearnTwo(batch[waiting], learnt[waiting], &nlearnt[waiting], pc, learnt[i], &nlearnt[i]);
    waiting = -1;
  }
  if (waiting >= 0) {
    const Pending& pc = batch[waiting];
    nlearnt[waiting] = static_cast<uint8_t>(tok_.BpeShortTo(pc.p, pc.n, learnt[waiting]));
    ++misses_;
    LearnShort(pc, learnt[waiting], nlearnt[waiting]);
  }
  for (int i = 0; i < count; ++i) {
    const Pending& pc = batch[i];
    if (const CacheSlot* s = found[i]) {
      if (__builtin_expect(s->n != kOverflow, 1)) {  // 1 to 3 ids: all three copied, no branch on how many
        out[0] = s->ids[0];
        out[1] = s->ids[1];
        out[2] = s->ids[2];
        out += s->n;
      } else {  // 4 to 16 ids: sixteen copied, again no branch on how many
        std::memcpy(out, overflow_mem_.as<int32_t>() + s->ids[0], 16 * sizeof(int32_t));
        out += s->ids[1];
      }
    } else if (pc.n > 16) {
      out = EncodeLong(pc, out);
    } else {
      std::memcpy(out, learnt[i], 16 * sizeof(int32_t));
      out += nlearnt[i];
    }
  }
  return out;
}

__attribute__((noinline)) void Gpt2Encoder::LearnTwo(const Pending& a, int32_t* ida, uint8_t* na, const Pending& b,
                                                     int32_t* idb, uint8_t* nb) {
  Gpt2Tokenizer::ShortPiece x{a.p, a.n, ida, 0}, y{b.p, b.n, idb, 0};
  tok_.BpeShortPair(&x, &y);
  *na = static_cast<uint8_t>(x.count);
  *nb = static_cast<uint8_t>(y.count);
  misses_ += 2;
  LearnShort(a, ida, x.count);
  LearnShort(b, idb, y.count);
}

const Gpt2Encoder::LongSlot* Gpt2Encoder::FindLong(const uint8_t* p, size_t n, uint64_t hash) const {
  const LongSlot* slots = long_mem_.as<LongSlot>();
  const uint8_t* arena = arena_mem_.as<uint8_t>();
  const uint64_t mask = long_nslots_ - 1;
  for (uint64_t h = hash & mask;; h = (h + 1) & mask) {
    const LongSlot& s = slots[h];
    if (s.hash == 0) return nullptr;
    if (s.hash == hash && s.len == n && std::memcmp(arena + s.off, p, n) == 0) return &s;
  }
}

void Gpt2Encoder::InsertLong(const uint8_t* p, size_t n, uint64_t hash, const int32_t* ids, size_t nids) {
  const size_t off = arena_size_;
  const size_t ids_at = (off + n + 3) & ~size_t{3};
  // Full (a quarter of the most slots, or the byte budget): keep what is there.
  if (ids_at + 4 * nids > long_budget_) return;
  if ((long_used_ + 1) * 4 > long_nslots_) {
    if (long_nslots_ >= long_max_slots_) return;
    GrowLong();
  }
  uint8_t* arena = arena_mem_.as<uint8_t>();
  std::memcpy(arena + off, p, n);
  std::memcpy(arena + ids_at, ids, 4 * nids);
  arena_size_ = ids_at + 4 * nids;
  LongSlot* slots = long_mem_.as<LongSlot>();
  const uint64_t mask = long_nslots_ - 1;
  uint64_t h = hash & mask;
  while (slots[h].hash != 0) h = (h + 1) & mask;
  slots[h] = LongSlot{hash, static_cast<uint32_t>(off), static_cast<uint16_t>(n), static_cast<uint16_t>(nids)};
  ++long_used_;
}

// Pieces of more than 16 bytes: the long-piece cache (pieces up to kLongCached bytes, their hash
// computed and slot prefetched with the batch), then the vocabulary's long tokens, then BPE.
int32_t* Gpt2Encoder::EncodeLong(const Pending& pc, int32_t* out) {
  const uint8_t* p = pc.p;
  const size_t n = pc.n;
  if (long_nslots_ == 0 && long_budget_ > 0) {  // on the first one: most texts have none
    size_t slots = 16;
    while (slots * sizeof(LongSlot) * 4 < long_budget_) slots <<= 1;
    long_mem_ = ZeroPages::Try(slots * sizeof(LongSlot));
    arena_mem_ = ZeroPages::Try(long_budget_);
    if (long_mem_.bytes() != 0 && arena_mem_.bytes() != 0) {
      long_max_slots_ = slots;
      long_nslots_ = std::min<size_t>(slots, (2u << 20) / sizeof(LongSlot));
    } else {  // refused address space: long pieces go uncached
      long_mem_ = ZeroPages();
      arena_mem_ = ZeroPages();
      long_budget_ = 0;
    }
  }
  const bool cacheable = n <= kLongCached && long_nslots_ != 0;
  if (cacheable) {
    if (const LongSlot* s = FindLong(p, n, pc.h)) {
      const size_t ids_at = (s->off + s->len + 3) & ~size_t{3};
      std::memcpy(out, arena_mem_.as<uint8_t>() + ids_at, 4 * s->nids);
      return out + s->nids;
    }
  }
  const int32_t id = tok_.LookupLong(std::string_view(reinterpret_cast<const char*>(p), n));
  if (id >= 0) {  // a whole token: cached too, so that the next time is one lookup
    if (cacheable) InsertLong(p, n, pc.h, &id, 1);
    *out = id;
    return out + 1;
  }
  ++misses_;
  scratch_.clear();
  tok_.BpePiece(p, n, &scratch_);
  if (cacheable) InsertLong(p, n, pc.h, scratch_.data(), scratch_.size());
  return std::copy(scratch_.begin(), scratch_.end(), out);
}

int32_t* Gpt2Encoder::EncodeOrdinaryRaw(std::string_view text, int32_t* out) {
  const uint8_t* end = reinterpret_cast<const uint8_t*>(text.data()) + text.size();
  Pending batch[kBatch];
  int count = 0;
  auto flush = [&]() {
    out = EncodeBatch(batch, count, out);
    count = 0;
  };
  ForEachPiece(text, [&](const uint8_t* b, const uint8_t* e) {
    Pending& pc = batch[count++];
    pc.p = b;
    pc.n = static_cast<uint32_t>(e - b);
    if (pc.n <= 16) {
      LoadKey(b, pc.n, end, &pc.k0, &pc.k1);
      pc.h = HashKey(pc.k0, pc.k1, pc.n);
      __builtin_prefetch(&cache_[pc.h & cache_mask_]);
    } else if (pc.n <= kLongCached) {
      pc.h = HashLong(b, pc.n);
      if (long_nslots_ != 0) __builtin_prefetch(long_mem_.as<LongSlot>() + (pc.h & (long_nslots_ - 1)));
    }
    if (count == kBatch) flush();
  });
  flush();
  return out;
}

// Every token covers at least one byte, so text.size() bounds the ids (a special token's 13 bytes
// give one id); a cached piece's ids are copied 3 or 16 at a time, hence kEncodeSlack.
int32_t* Gpt2Encoder::EncodeTo(std::string_view text, int32_t* out) {
  if (!opt_.special_endoftext || text.find(Gpt2Tokenizer::kEndOfText) == std::string_view::npos)
    return EncodeOrdinaryRaw(text, out);
  // Hugging Face splits added special tokens out of the text first; each segment is then
  // pre-tokenized on its own (so "a <|endoftext|>" keeps a separate trailing-space piece).
  size_t pos = 0;
  while (true) {
    size_t hit = text.find(Gpt2Tokenizer::kEndOfText, pos);
    if (hit == std::string_view::npos) return EncodeOrdinaryRaw(text.substr(pos), out);
    out = EncodeOrdinaryRaw(text.substr(pos, hit - pos), out);
    *out++ = tok_.eod();
    pos = hit + Gpt2Tokenizer::kEndOfText.size();
  }
}

int32_t* Gpt2Encoder::Buffer(size_t n) {
  if (buf_cap_ < n) {
    buf_cap_ = std::max(n, buf_cap_ * 2);
    buf_.reset(new int32_t[buf_cap_]);  // not zero-filled: only what the encoder writes is read
  }
  return buf_.get();
}

void Gpt2Encoder::EncodeOrdinary(std::string_view text, std::vector<int32_t>* out) {
  int32_t* begin = Buffer(text.size() + kEncodeSlack);
  out->insert(out->end(), begin, EncodeOrdinaryRaw(text, begin));
}

void Gpt2Encoder::Encode(std::string_view text, std::vector<int32_t>* out) {
  int32_t* begin = Buffer(text.size() + kEncodeSlack);
  out->insert(out->end(), begin, EncodeTo(text, begin));
}

}  // namespace ptk
