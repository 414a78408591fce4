// Gpt2Tokenizer's tables as one blob (SerializeTables / FromTables / Attach): what
// generators/gen_gpt2_tables.cpp writes at build time and LoadDefault reads in place.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include <fmt/core.h>

#include "common/hash.h"
#include "common/status.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {

namespace {

constexpr std::string_view kTablesMagic = "PTKGPT2TABLES\x03\n";
constexpr size_t kSectionAlign = 64;  // each table starts on a cache line of the blob

class BlobWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutBytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  template <typename T>
  void PutSection(std::span<const T> s) {
    out_.resize((out_.size() + kSectionAlign - 1) / kSectionAlign * kSectionAlign, '\0');
    PutBytes(s.data(), s.size_bytes());
  }
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
    if (b_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // n values of T where they lie (the blob is aligned for T): false when the blob ends first.
  template <typename T>
  bool Section(uint64_t n, std::span<const T>* out) {
    static_assert(std::is_trivially_copyable_v<T> && kSectionAlign % alignof(T) == 0);
    const size_t at = (pos_ + kSectionAlign - 1) / kSectionAlign * kSectionAlign;
    if (at > b_.size() || n > (b_.size() - at) / sizeof(T)) return false;
    *out = std::span<const T>(reinterpret_cast<const T*>(b_.data() + at), n);
    pos_ = at + n * sizeof(T);
    return true;
  }
  bool Bytes(uint64_t n, const char** out) {
    if (n > b_.size() - pos_) return false;
    *out = b_.data() + pos_;
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

}  // namespace

// Layout (native-endian: the blob is made by the same build that reads it): magic, the struct sizes
// (a blob of another layout is refused), the counts and scalars, then each table as it lies in
// memory, 64-byte aligned: vocabulary offsets and bytes, the BPE symbols' ids, the pair table, the
// short-token table; then the long tokens (length, bytes, id).
std::string Gpt2Tokenizer::SerializeTables() const {
  BlobWriter w;
  w.PutBytes(kTablesMagic.data(), kTablesMagic.size());
  w.Put(static_cast<uint32_t>(sizeof(PieceSlot)));
  w.Put(static_cast<uint32_t>(sizeof(PairBucket)));
  w.Put(static_cast<uint64_t>(vocab_n_));
  w.Put(static_cast<uint64_t>(vocab_off_[vocab_n_]));
  w.PutBytes(byte_to_id_, sizeof byte_to_id_);
  w.Put(eod_id_);
  w.Put(num_merges_);
  w.Put(static_cast<uint64_t>(sym_ids_.size()));
  w.Put(static_cast<uint64_t>(pairs_.size()));
  w.Put(static_cast<int64_t>(pair_shift_));
  w.Put(pair_mul_);
  w.Put(static_cast<uint64_t>(short_table_.size()));
  w.Put(static_cast<uint64_t>(short_count_));
  std::vector<std::pair<std::string, int32_t>> longs(long_tokens_.begin(), long_tokens_.end());
  std::sort(longs.begin(), longs.end());  // the same bytes for the same tables
  w.Put(static_cast<uint64_t>(longs.size()));
  w.PutSection(vocab_off_);
  w.PutSection(std::span<const char>(vocab_bytes_, vocab_off_[vocab_n_]));
  w.PutSection(sym_ids_);
  w.PutSection(pairs_);
  w.PutSection(short_table_);
  for (const auto& [bytes, id] : longs) {
    w.Put(static_cast<uint32_t>(bytes.size()));
    w.PutBytes(bytes.data(), bytes.size());
    w.Put(id);
  }
  return std::move(w.str());
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::FromTables(std::string_view blob) {
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());
  // A copy the tokenizer owns, page-aligned (so every table is aligned), read in place.
  if (!blob.empty()) {
    t->blob_copy_ = ZeroPages(blob.size());
    std::memcpy(t->blob_copy_.as<char>(), blob.data(), blob.size());
  }
  PTK_RETURN_IF_ERROR(t->Attach(std::string_view(t->blob_copy_.as<char>(), blob.size()), /*trusted=*/false));
  t->vocab_hash_ = t->merges_hash_ = "tables-" + Xxh3Hex(blob);
  return t;
}

absl::Status Gpt2Tokenizer::Attach(std::string_view blob, bool trusted) {
  auto bad = [](const char* what) { return absl::DataLossError(fmt::format("tokenizer tables: {}", what)); };
  if (reinterpret_cast<uintptr_t>(blob.data()) % kSectionAlign != 0) return bad("blob not aligned");
  BlobReader r(blob);
  const char* magic = nullptr;
  uint32_t piece_size = 0, pair_size = 0;
  if (!r.Bytes(kTablesMagic.size(), &magic) || std::string_view(magic, kTablesMagic.size()) != kTablesMagic)
    return bad("not a ptk tokenizer table blob");
  if (!r.Get(&piece_size) || !r.Get(&pair_size) || piece_size != sizeof(PieceSlot) || pair_size != sizeof(PairBucket))
    return bad("made by a build with another layout");
  uint64_t n = 0, nbytes = 0, nsym = 0, buckets = 0, short_slots = 0, short_count = 0, nlong = 0;
  int64_t shift = 0;
  if (!r.Get(&n) || !r.Get(&nbytes) || !r.Get(&byte_to_id_) || !r.Get(&eod_id_) || !r.Get(&num_merges_) ||
      !r.Get(&nsym) || !r.Get(&buckets) || !r.Get(&shift) || !r.Get(&pair_mul_) || !r.Get(&short_slots) ||
      !r.Get(&short_count) || !r.Get(&nlong))
    return bad("truncated header");
  if (n == 0 || n > (1u << 24)) return bad("vocabulary size");
  if (num_merges_ < 0 || nsym != 256 + static_cast<uint64_t>(num_merges_) || nsym >= kNoSymbol)
    return bad("symbol count");
  if (buckets < 2 || (buckets & (buckets - 1)) != 0 || shift != 64 - __builtin_ctzll(buckets))
    return bad("pair table size");
  if (short_slots == 0 || (short_slots & (short_slots - 1)) != 0 || short_count >= short_slots)
    return bad("short table size");
  std::span<const char> bytes;
  if (!r.Section(n + 1, &vocab_off_) || !r.Section(nbytes, &bytes) || !r.Section(nsym, &sym_ids_) ||
      !r.Section(buckets, &pairs_) || !r.Section(short_slots, &short_table_))
    return bad("truncated tables");
  vocab_bytes_ = bytes.data();
  vocab_n_ = static_cast<int64_t>(n);
  pair_shift_ = static_cast<int>(shift);
  short_mask_ = short_slots - 1;
  short_count_ = short_count;
  // What indexes memory is checked whatever the blob: token offsets, ids, the ranks the pair table
  // gives (a symbol is 256 + rank) and the short table's slots (an embedded blob's slots are this
  // build's own, read back when it was made).
  auto id_ok = [n](int64_t id) { return id >= 0 && static_cast<uint64_t>(id) < n; };
  if (vocab_off_[0] != 0 || vocab_off_[n] != nbytes) return bad("vocabulary offsets");
  for (uint64_t i = 0; i < n; ++i)
    if (vocab_off_[i] > vocab_off_[i + 1]) return bad("vocabulary offsets");
  for (int32_t id : byte_to_id_)
    if (!id_ok(id)) return bad("byte id");
  if (!id_ok(eod_id_)) return bad("end-of-text id");
  for (int32_t id : sym_ids_)
    if (!id_ok(id)) return bad("symbol id");
  if (!trusted) {
    for (const PairBucket& b : pairs_)
      for (uint64_t w : b.w)
        if (w != kNoPairWord && (w & kRankMask) >= static_cast<uint64_t>(num_merges_)) return bad("pair rank");
    size_t used = 0;
    for (const PieceSlot& s : short_table_) {
      if (s.len == 0) continue;
      ++used;
      if (s.len > 16 || s.n != 1 || !id_ok(s.ids[0])) return bad("short token");
    }
    if (used != short_count) return bad("short token count");
  }
  long_tokens_.clear();
  for (uint64_t i = 0; i < nlong; ++i) {
    uint32_t len = 0;
    int32_t id = 0;
    const char* p = nullptr;
    if (!r.Get(&len) || !r.Bytes(len, &p) || !r.Get(&id)) return bad("truncated long tokens");
    if (len <= 16 || !id_ok(id)) return bad("long token");
    long_tokens_[std::string(p, len)] = id;
  }
  if (!r.done()) return bad("trailing bytes");
  return absl::OkStatus();
}

}  // namespace ptk
