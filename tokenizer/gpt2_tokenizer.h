// GPT-2 byte-level BPE (vocab.json + merges.txt), exact: ids identical to Hugging Face's
// GPT2TokenizerFast (what Megatron-LM's GPT2BPETokenizer runs) and to tiktoken's "gpt2" encoding.
//
// Gpt2Tokenizer is immutable and shared by all threads; each thread encodes through its own
// Gpt2Encoder, which owns a bounded piece -> ids cache and scratch buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

#include "common/zero_pages.h"

namespace ptk {

class Gpt2Tokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  // Loads vocab.json and merges.txt. Merges: a first line starting with "#version" is skipped,
  // as are empty lines; every other line must hold exactly two symbols.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Load(const std::string& vocab_path,
                                                             const std::string& merges_path);
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> FromStrings(std::string_view vocab_json,
                                                                    std::string_view merges_txt,
                                                                    std::string_view origin = "<memory>");
  // The GPT-2 files shipped inside ptk (identical to ../shared/gpt2, pinned by sha256 in tiktoken).
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> LoadDefault();
  // The one rule every tool uses: no files named -> the built-in GPT-2 files; both named -> those
  // (a missing file is an error, never a silent fall-back); one without the other -> a usage error.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> LoadOrDefault(const std::string& vocab_path,
                                                                      const std::string& merges_path);
  static std::string_view DefaultVocabJson();
  static std::string_view DefaultMergesTxt();

  // A built tokenizer's tables as one blob, and back. The GPT-2 tables are made at build time
  // (generators/gen_gpt2_tables.cpp) and embedded in the layout the tokenizer uses, so LoadDefault
  // reads them where they are (nothing parsed, copied or zero-filled; the binary's pages are mapped
  // as they are read). FromTables copies a blob it is given and checks every entry; a blob of
  // another build's layout is refused.
  std::string SerializeTables() const;
  static std::string_view DefaultTables();  // the embedded blob (empty in the generator itself)
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> FromTables(std::string_view blob);

  int64_t vocab_size() const { return vocab_n_; }  // 50257 for GPT-2
  int32_t eod() const { return eod_id_; }          // 50256
  int64_t num_merges() const { return num_merges_; }
  // XXH3-128 (hex) of the vocab.json and of the merges.txt text the tokenizer was built from (the
  // built-in files' for LoadDefault; both the blob's for FromTables): what a rerun compares to
  // know the tokenizer is the same, byte for byte, whatever the files' sizes and times.
  const std::string& vocab_hash() const { return vocab_hash_; }
  const std::string& merges_hash() const { return merges_hash_; }

  // Raw bytes of a token (no UTF-8 repair); empty for an unknown id.
  std::string_view TokenBytes(int32_t id) const;
  // ids -> bytes, then UTF-8 repaired like Python's decode("utf-8", "replace").
  std::string Decode(std::span<const int32_t> ids) const;
  std::string DecodeBytes(std::span<const int32_t> ids) const;

  // Plain BPE of one piece (no cache), for tests and the cache-miss path.
  void BpePiece(const uint8_t* p, size_t n, std::vector<int32_t>* out) const;
  // The two merge algorithms behind BpePiece: linear scans over a linked list in stack arrays for
  // pieces of at most kShortPiece bytes, a heap for longer ones.
  static constexpr size_t kShortPiece = 64;
  static constexpr uint32_t kNoRank = ~0u;  // the rank of a pair that does not merge
  void BpeShort(const uint8_t* p, size_t n, std::vector<int32_t>* out) const;
  // BpeShort's portable rounds, whatever the CPU (BpeShort takes AVX2 where the CPU has it), so
  // tests compare both paths on any machine.
  void BpeShortPortable(const uint8_t* p, size_t n, std::vector<int32_t>* out) const;
  // BpeShort writing at out (room for n ids); returns how many.
  size_t BpeShortTo(const uint8_t* p, size_t n, int32_t* out) const;
  // Two pieces of at most kShortPiece bytes merged together, the rounds of one running while the
  // other's wait on their pair lookups; the same ids as BpeShort on each. out: room for n ids;
  // count: how many were written. portable: the portable rounds whatever the CPU (for tests).
  struct ShortPiece {
    const uint8_t* p;
    size_t n;
    int32_t* out;
    size_t count;
  };
  void BpeShortPair(ShortPiece* a, ShortPiece* b, bool portable = false) const;
  void BpeLong(const uint8_t* p, size_t n, std::vector<int32_t>* out) const;

  // Whole-token lookup of a piece of at most 16 bytes; -1 if absent.
  int32_t LookupShort(uint64_t k0, uint64_t k1, uint32_t len) const;
  int32_t LookupLong(std::string_view piece) const;

 private:
  friend class Gpt2Encoder;
  Gpt2Tokenizer() = default;
  absl::Status Build(std::string_view vocab_json, std::string_view merges_txt, std::string_view origin);
  // Build's first step: the vocabulary's tables (vocab_off_, eod_id_, byte_to_id_) and the token -> id
  // map the merges are read with. byte_level[id]: the token is byte-level text; mergeable[id]: BPE
  // can produce it (so far: it is a byte).
  absl::StatusOr<absl::flat_hash_map<std::string, int32_t>> BuildVocab(std::string_view vocab_json,
                                                                       std::string_view origin, bool known_good,
                                                                       std::vector<bool>* byte_level,
                                                                       std::vector<bool>* mergeable);
  // Build's last step: the whole-token tables, of the tokens that BPE itself produces for their own
  // bytes (known_good: GPT-2's own files, for which that is known).
  void BuildWholeTokenTables(bool known_good, const std::vector<bool>& mergeable, const std::vector<bool>& byte_level);
  // The tables in `blob` (SerializeTables' layout), read in place: it must outlive the tokenizer.
  // trusted (the embedded blob, made and read back by this build): the whole-token table's slots
  // are not each checked.
  absl::Status Attach(std::string_view blob, bool trusted);
  // BPE runs over symbols, not vocab ids: 0..255 are the bytes, 256 + r is the token that merge
  // line r makes (sym_ids_ gives a symbol's vocab id). So the symbol a merge makes is its rank
  // plus 256, and a pair needs one number: its rank.
  // Pair -> rank in a two-choice cuckoo table of 16-byte buckets, each two packed words (the pair's
  // 42-bit key above its 22-bit rank): a lookup loads the same two buckets whether the pair is there
  // or not and picks the rank without a branch; 512 KB for GPT-2's 50,000 merges.
  struct PairBucket {
    uint64_t w[2];
  };
  static constexpr int kSymbolBits = 21, kRankBits = 22;
  static constexpr uint64_t kRankMask = (uint64_t{1} << kRankBits) - 1;
  static constexpr uint64_t kNoPairWord = ~0ull;                  // its key (all ones) is no pair's key
  static constexpr uint32_t kNoSymbol = (1u << kSymbolBits) - 1;  // never in a pair
  static uint64_t PairKey(uint32_t x, uint32_t y) { return (uint64_t{x} << kSymbolBits) | y; }
  // The rank of the merge of symbols x and y, kNoRank if they do not merge.
  uint32_t PairRank(uint32_t x, uint32_t y) const {
    const uint64_t key = PairKey(x, y);
    const PairBucket& b0 = pairs_[(key * pair_mul_[0]) >> pair_shift_];
    const PairBucket& b1 = pairs_[(key * pair_mul_[1]) >> pair_shift_];
    uint32_t r = kNoRank;
    r = (b0.w[0] >> kRankBits) == key ? static_cast<uint32_t>(b0.w[0] & kRankMask) : r;
    r = (b0.w[1] >> kRankBits) == key ? static_cast<uint32_t>(b0.w[1] & kRankMask) : r;
    r = (b1.w[0] >> kRankBits) == key ? static_cast<uint32_t>(b1.w[0] & kRankMask) : r;
    r = (b1.w[1] >> kRankBits) == key ? static_cast<uint32_t>(b1.w[1] & kRankMask) : r;
    return r;
  }
  // A merges.txt line as vocab ids: a + b -> id.
  struct MergeLine {
    int32_t a, b, id;
  };
  // merges.txt's lines in rank order as vocab ids; each token a line makes is marked mergeable.
  static absl::StatusOr<std::vector<MergeLine>> ParseMerges(std::string_view merges_txt, std::string_view origin,
                                                            const absl::flat_hash_map<std::string, int32_t>& str_to_id,
                                                            std::vector<bool>* mergeable);
  // Merge lines in rank order -> sym_ids_ and the pair table.
  absl::Status BuildMerges(const std::vector<MergeLine>& merges, std::string_view origin);
  // Fills pairs_ with (key, rank) words in `buckets` buckets: false when cuckoo insertion fails.
  bool BuildPairTable(const std::vector<std::pair<uint64_t, uint32_t>>& entries, size_t buckets);
  struct ShortMerge;
  void ShortStart(ShortMerge& s, const uint8_t* p, size_t n) const;
  template <typename Rounds>
  bool ShortRound(ShortMerge& s) const;
  template <typename S>
  static void LinkSymbols(S& s, const uint8_t* p, size_t n);
  template <typename S>
  size_t SymbolIds(const S& s, int32_t* out) const;
  template <typename Rounds>
  size_t BpeShortRounds(const uint8_t* p, size_t n, int32_t* out) const;
  template <typename Rounds>
  void BpeShortPairRounds(ShortPiece* a, ShortPiece* b) const;
  size_t BpeShortAvx2(const uint8_t* p, size_t n, int32_t* out) const;
  struct Short16;
  void Start16(Short16& s, const uint8_t* p, size_t n) const;
  bool Round16(Short16& s) const;
  void BpeShortPairAvx2(ShortPiece* a, ShortPiece* b) const;

  // One slot of the piece tables: a piece of at most 16 bytes and its ids.
  struct PieceSlot {
    uint64_t k0, k1;
    uint8_t len;  // 0 = empty
    uint8_t n;    // number of ids inline (<= 3), or kOverflow
    uint16_t pad;
    int32_t ids[3];
  };
  static constexpr uint8_t kOverflow = 0xFF;
  // The tables are read-only views: into the embedded blob (LoadDefault), into a copy of a blob
  // (FromTables), or into the containers below (built from vocab and merges).
  // Whole tokens of at most 16 bytes, open addressing; encoders start their caches from a copy.
  std::span<const PieceSlot> short_table_;
  uint64_t short_mask_ = 0;
  size_t short_count_ = 0;
  absl::flat_hash_map<std::string, int32_t> long_tokens_;  // whole tokens longer than 16 bytes
  std::span<const PairBucket> pairs_;
  uint64_t pair_mul_[2] = {1, 1};
  int pair_shift_ = 64;
  std::span<const int32_t> sym_ids_;  // BPE symbol -> vocab id
  // Token id -> its bytes: vocab_bytes_[vocab_off_[id], vocab_off_[id + 1]).
  std::span<const uint32_t> vocab_off_;
  const char* vocab_bytes_ = nullptr;
  int64_t vocab_n_ = 0;
  // What the views point into when they are not the embedded blob.
  ZeroPages blob_copy_;
  PageArray<PieceSlot> short_built_;
  PageArray<PairBucket> pairs_built_;
  std::vector<int32_t> sym_ids_built_;
  std::vector<uint32_t> vocab_off_built_;
  std::string vocab_bytes_built_;
  int32_t byte_to_id_[256];
  int32_t eod_id_ = -1;
  int64_t num_merges_ = 0;
  std::string vocab_hash_, merges_hash_;
};

// Per-thread encoder: owns the piece cache. Not thread-safe; cheap to create.
class Gpt2Encoder {
 public:
  struct Options {
    // Literal "<|endoftext|>" in the text becomes the EOD id (Hugging Face / current Megatron-LM).
    // false: it is encoded as ordinary text (legacy Megatron GPT2 tokenizer, tiktoken encode_ordinary).
    bool special_endoftext = true;
    // Piece cache (pieces of at most 16 bytes): starts with room for the vocabulary and doubles
    // when half full, up to this many slots of 32 bytes (64 MiB at the default); a full cache
    // keeps what it holds (nothing learnt is thrown away) and takes no new pieces.
    size_t cache_slots = 1 << 21;
    // Longer pieces (17 to 256 bytes): the same kind of table, at most this many bytes of pieces
    // and ids (plus 16 bytes a slot).
    size_t long_cache_bytes = 16 << 20;
  };
  explicit Gpt2Encoder(const Gpt2Tokenizer& tok) : Gpt2Encoder(tok, Options()) {}
  Gpt2Encoder(const Gpt2Tokenizer& tok, Options options);

  // Appends the ids of `text` (UTF-8; ill-formed bytes are treated as single "other" characters,
  // callers repair text first, see AppendUtf8Replacing) to *out.
  void Encode(std::string_view text, std::vector<int32_t>* out);
  // Same without special-token handling.
  void EncodeOrdinary(std::string_view text, std::vector<int32_t>* out);
  // Writes the ids at out, which has room for text.size() + kEncodeSlack ids (every id covers at
  // least one byte, a special token's 13 bytes give one id, and up to kEncodeSlack values past the
  // last id may be overwritten); returns the end. No allocation, no zero-filling.
  static constexpr size_t kEncodeSlack = 16;
  int32_t* EncodeTo(std::string_view text, int32_t* out);

  // Memory the caches hold now (bytes), and the most they may hold.
  size_t cache_bytes() const;
  size_t max_cache_bytes() const;

  uint64_t cache_hits() const { return lookups_ - misses_; }
  size_t cache_entries() const { return cache_used_; }  // short pieces cached (whole tokens included)
  uint64_t cache_misses() const { return misses_; }

 private:
  // A piece waiting for its lookup: pieces are hashed and their slots prefetched a batch ahead,
  // which hides the memory latency of the multi-megabyte table.
  struct Pending {
    const uint8_t* p;
    uint64_t k0, k1, h;  // h: full hash (of the key, or HashLong), masked at lookup (the table may grow)
    uint32_t n;
  };
  static constexpr int kBatch = 128;
  // Appends the ids of one piece at *out (room for n ids is guaranteed); returns the new end.
  using CacheSlot = Gpt2Tokenizer::PieceSlot;
  int32_t* EncodeBatch(const Pending* batch, int count, int32_t* out);
  const CacheSlot* FindShort(const Pending& pc) const;
  void LearnShort(const Pending& pc, const int32_t* ids, size_t n);
  void LearnTwo(const Pending& a, int32_t* ida, uint8_t* na, const Pending& b, int32_t* idb, uint8_t* nb);
  static constexpr size_t kLongCached = 256;  // longer pieces are rare and unique: not cached
  int32_t* EncodeLong(const Pending& pc, int32_t* out);
  int32_t* EncodeOrdinaryRaw(std::string_view text, int32_t* out);
  static constexpr uint8_t kOverflow = Gpt2Tokenizer::kOverflow;
  void AllocateCache(size_t slots);
  void InsertSlot(const CacheSlot& s);
  void MakeRoom(size_t n);
  void Grow();
  // Long pieces: a flat table over an arena of their bytes and ids.
  struct LongSlot {
    uint64_t hash;  // 0 = empty
    uint32_t off;   // bytes at arena_[off, off + len), then nids ids (4-byte aligned)
    uint16_t len, nids;
  };
  const LongSlot* FindLong(const uint8_t* p, size_t n, uint64_t hash) const;
  void InsertLong(const uint8_t* p, size_t n, uint64_t hash, const int32_t* ids, size_t nids);
  void GrowLong();

  const Gpt2Tokenizer& tok_;
  Options opt_;
  // Whole tokens (copied from the tokenizer) plus BPE results of pieces of at most 16 bytes.
  // On huge pages where available: random probes into a multi-megabyte table otherwise miss the
  // TLB on nearly every piece.
  ZeroPages cache_mem_;
  CacheSlot* cache_ = nullptr;
  size_t cache_slots_ = 0, max_slots_ = 0;
  uint64_t cache_mask_ = 0;
  size_t cache_used_ = 0;
  // Ids of cached short pieces with more than 3, reserved at their most and filled in order.
  ZeroPages overflow_mem_;
  size_t overflow_size_ = 0, max_overflow_ = 0;
  // Long pieces: slots (a quarter used at most) and an arena of their bytes and ids, reserved at
  // their most on the first long piece.
  ZeroPages long_mem_, arena_mem_;
  size_t long_nslots_ = 0, long_max_slots_ = 0, arena_size_ = 0;
  size_t long_budget_ = 0;  // opt_.long_cache_bytes, or 0 where the address space was refused
  size_t long_used_ = 0;
  std::vector<int32_t> scratch_;
  int32_t* Buffer(size_t n);        // buf_ with room for n ids
  std::unique_ptr<int32_t[]> buf_;  // Encode's ids before they are appended
  size_t buf_cap_ = 0;
  uint64_t lookups_ = 0, misses_ = 0;
};

}  // namespace ptk
