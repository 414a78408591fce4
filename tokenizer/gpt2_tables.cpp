// Gpt2Tokenizer's tables as one blob (SerializeTables / FromTables): what tools/gen_gpt2_tables.cpp
// writes at build time and LoadDefault reads back.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include <fmt/core.h>

#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

namespace {

constexpr std::string_view kTablesMagic = "PTKGPT2TABLES\x02\n";

class BlobWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutBytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class BlobReader {
 public:
  explicit BlobReader(std::string_view b) : b_(b) {}
  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    return GetBytes(v, sizeof(T));
  }
  bool GetBytes(void* p, size_t n) {
    if (b_.size() - pos_ < n) return false;
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

}  // namespace

// Layout: magic, the struct sizes (a blob of another layout is refused), the vocabulary's bytes,
// byte ids, EOD, the pair table, the BPE symbols' ids, the short-token table and the long tokens, all native-endian
// (the blob is made by the same build that reads it).
std::string Gpt2Tokenizer::SerializeTables() const {
  BlobWriter w;
  w.PutBytes(kTablesMagic.data(), kTablesMagic.size());
  w.Put(static_cast<uint32_t>(sizeof(PieceSlot)));
  w.Put(static_cast<uint32_t>(sizeof(PairBucket)));
  w.Put(static_cast<uint64_t>(id_to_bytes_.size()));
  for (const std::string& b : id_to_bytes_) {
    w.Put(static_cast<uint32_t>(b.size()));
    w.PutBytes(b.data(), b.size());
  }
  w.PutBytes(byte_to_id_, sizeof byte_to_id_);
  w.Put(eod_id_);
  w.Put(num_merges_);
  // The hash tables sparsely (the occupied slots with their indices): the same layout, half the bytes.
  w.Put(static_cast<uint64_t>(pairs_.size()));
  w.Put(pair_shift_);
  w.Put(pair_mul_);
  uint64_t used = 0;
  for (const PairBucket& b : pairs_) used += (b.w[0] != kNoPairWord) + (b.w[1] != kNoPairWord);
  w.Put(used);
  for (size_t i = 0; i < pairs_.size() * 2; ++i) {
    const uint64_t word = pairs_[i / 2].w[i % 2];
    if (word == kNoPairWord) continue;
    w.Put(static_cast<uint32_t>(i));
    w.Put(word);
  }
  w.Put(static_cast<uint64_t>(sym_ids_.size()));
  w.PutBytes(sym_ids_.data(), sym_ids_.size() * sizeof(int32_t));
  w.Put(static_cast<uint64_t>(short_table_.size()));
  w.Put(static_cast<uint64_t>(short_count_));
  for (size_t i = 0; i < short_table_.size(); ++i) {
    if (short_table_[i].len == 0) continue;
    w.Put(static_cast<uint32_t>(i));
    w.Put(short_table_[i]);
  }
  std::vector<std::pair<std::string, int32_t>> longs(long_tokens_.begin(), long_tokens_.end());
  std::sort(longs.begin(), longs.end());  // the same bytes for the same tables
  w.Put(static_cast<uint64_t>(longs.size()));
  for (const auto& [bytes, id] : longs) {
    w.Put(static_cast<uint32_t>(bytes.size()));
    w.PutBytes(bytes.data(), bytes.size());
    w.Put(id);
  }
  return std::move(w.str());
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::FromTables(std::string_view blob) {
  auto bad = [](const char* what) { return absl::DataLossError(fmt::format("tokenizer tables: {}", what)); };
  BlobReader r(blob);
  std::string magic(kTablesMagic.size(), '\0');
  uint32_t piece_size = 0, pair_size = 0;
  if (!r.GetBytes(magic.data(), magic.size()) || magic != kTablesMagic) return bad("not a ptk tokenizer table blob");
  if (!r.Get(&piece_size) || !r.Get(&pair_size) || piece_size != sizeof(PieceSlot) || pair_size != sizeof(PairBucket))
    return bad("made by a build with another layout");
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());
  uint64_t n = 0;
  if (!r.Get(&n) || n > (1u << 24)) return bad("vocabulary size");
  t->id_to_bytes_.resize(n);
  for (std::string& b : t->id_to_bytes_) {
    uint32_t len = 0;
    if (!r.Get(&len) || len > blob.size()) return bad("truncated vocabulary");
    b.resize(len);
    if (!r.GetBytes(b.data(), len)) return bad("truncated vocabulary");
  }
  uint64_t buckets = 0, short_slots = 0, short_count = 0, nlong = 0, nsym = 0;
  if (!r.GetBytes(t->byte_to_id_, sizeof t->byte_to_id_) || !r.Get(&t->eod_id_) || !r.Get(&t->num_merges_) ||
      !r.Get(&buckets) || !r.Get(&t->pair_shift_) || !r.Get(&t->pair_mul_))
    return bad("truncated header");
  if (buckets < 2 || (buckets & (buckets - 1)) != 0 || buckets > blob.size() ||
      t->pair_shift_ != 64 - __builtin_ctzll(buckets))
    return bad("pair table size");
  t->pairs_.Assign(buckets, PairBucket{{kNoPairWord, kNoPairWord}});
  uint64_t used = 0;
  if (!r.Get(&used) || used > buckets * 2) return bad("pair count");
  for (uint64_t k = 0; k < used; ++k) {
    uint32_t i = 0;
    if (!r.Get(&i) || i >= buckets * 2 || !r.Get(&t->pairs_[i / 2].w[i % 2])) return bad("truncated pair table");
  }
  if (!r.Get(&nsym) || t->num_merges_ < 0 || nsym != 256 + static_cast<uint64_t>(t->num_merges_) ||
      nsym >= kNoSymbol)
    return bad("symbol count");
  t->sym_ids_.resize(nsym);
  if (!r.GetBytes(t->sym_ids_.data(), nsym * sizeof(int32_t))) return bad("truncated symbols");
  for (int32_t id : t->sym_ids_)
    if (id < 0 || id >= static_cast<int64_t>(n)) return bad("symbol id");
  if (!r.Get(&short_slots) || !r.Get(&short_count)) return bad("truncated short table header");
  if (short_slots == 0 || (short_slots & (short_slots - 1)) != 0 || short_slots > blob.size() ||
      short_count > short_slots)
    return bad("short table size");
  t->short_table_.Assign(short_slots, PieceSlot{});
  t->short_mask_ = short_slots - 1;
  t->short_count_ = short_count;
  for (uint64_t k = 0; k < short_count; ++k) {
    uint32_t i = 0;
    if (!r.Get(&i) || i >= short_slots || !r.Get(&t->short_table_[i])) return bad("truncated short table");
  }
  if (!r.Get(&nlong)) return bad("truncated short table");
  for (uint64_t i = 0; i < nlong; ++i) {
    uint32_t len = 0;
    int32_t id = 0;
    if (!r.Get(&len) || len > blob.size()) return bad("truncated long tokens");
    std::string bytes(len, '\0');
    if (!r.GetBytes(bytes.data(), len) || !r.Get(&id)) return bad("truncated long tokens");
    t->long_tokens_[bytes] = id;
  }
  if (!r.done()) return bad("trailing bytes");
  return t;
}

}  // namespace ptk
