// Gpt2Tokenizer's tables as one blob (SerializeTables / FromTables): what tools/gen_gpt2_tables.cpp
// writes at build time and LoadDefault reads back.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include <fmt/core.h>

#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

namespace {

constexpr std::string_view kTablesMagic = "PTKGPT2TABLES\x01\n";

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
// byte ids, EOD, the merge table, the short-token table and the long tokens, all native-endian
// (the blob is made by the same build that reads it).
std::string Gpt2Tokenizer::SerializeTables() const {
  BlobWriter w;
  w.PutBytes(kTablesMagic.data(), kTablesMagic.size());
  w.Put(static_cast<uint32_t>(sizeof(PieceSlot)));
  w.Put(static_cast<uint32_t>(sizeof(MergeSlot)));
  w.Put(static_cast<uint64_t>(id_to_bytes_.size()));
  for (const std::string& b : id_to_bytes_) {
    w.Put(static_cast<uint32_t>(b.size()));
    w.PutBytes(b.data(), b.size());
  }
  w.PutBytes(byte_to_id_, sizeof byte_to_id_);
  w.Put(eod_id_);
  w.Put(num_merges_);
  // The hash tables sparsely (the occupied slots with their indices): the same layout, half the bytes.
  w.Put(static_cast<uint64_t>(merge_table_.size()));
  w.Put(merge_shift_);
  uint64_t used = 0;
  for (const MergeSlot& m : merge_table_) used += m.key != kNoPair;
  w.Put(used);
  for (size_t i = 0; i < merge_table_.size(); ++i) {
    if (merge_table_[i].key == kNoPair) continue;
    w.Put(static_cast<uint32_t>(i));
    w.Put(merge_table_[i]);
  }
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
  uint32_t piece_size = 0, merge_size = 0;
  if (!r.GetBytes(magic.data(), magic.size()) || magic != kTablesMagic) return bad("not a ptk tokenizer table blob");
  if (!r.Get(&piece_size) || !r.Get(&merge_size) || piece_size != sizeof(PieceSlot) || merge_size != sizeof(MergeSlot))
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
  uint64_t merge_slots = 0, short_slots = 0, short_count = 0, nlong = 0;
  if (!r.GetBytes(t->byte_to_id_, sizeof t->byte_to_id_) || !r.Get(&t->eod_id_) || !r.Get(&t->num_merges_) ||
      !r.Get(&merge_slots) || !r.Get(&t->merge_shift_))
    return bad("truncated header");
  if (merge_slots == 0 || (merge_slots & (merge_slots - 1)) != 0 || merge_slots > blob.size() ||
      t->merge_shift_ != 64 - __builtin_ctzll(merge_slots))
    return bad("merge table size");
  t->merge_table_.Assign(merge_slots, MergeSlot{kNoPair, MergeInfo{0, 0}});
  t->merge_mask_ = merge_slots - 1;
  uint64_t used = 0;
  if (!r.Get(&used) || used > merge_slots) return bad("merge count");
  for (uint64_t k = 0; k < used; ++k) {
    uint32_t i = 0;
    if (!r.Get(&i) || i >= merge_slots || !r.Get(&t->merge_table_[i])) return bad("truncated merge table");
  }
  if (!r.Get(&short_slots) || !r.Get(&short_count)) return bad("truncated merge table");
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
