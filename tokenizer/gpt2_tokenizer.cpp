// GPT-2 byte-level BPE.
#include "tokenizer/gpt2_tokenizer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <queue>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_util.h"
#include "common/status.h"
#include "common/utf8.h"
#include "tokenizer/pretokenizer.h"

extern "C" {
extern const char ptk_gpt2_vocab_start[];
extern const char ptk_gpt2_vocab_end[];
extern const char ptk_gpt2_merges_start[];
extern const char ptk_gpt2_merges_end[];
#ifndef PTK_TOKENIZER_NO_TABLES  // defined only for the generator of those tables
extern const char ptk_gpt2_tables_start[];
extern const char ptk_gpt2_tables_end[];
#endif
}

namespace ptk {
namespace {

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 to U+0100 + n.
struct ByteLevelMap {
  uint32_t byte_to_cp[256];
  int16_t cp_to_byte[324];
  ByteLevelMap() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), -1);
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : 256 + n++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap m;
  return m;
}

// Byte-level unicode string -> raw bytes. False if a char is outside the byte-level alphabet.
bool ByteLevelDecode(std::string_view s, std::string* out) {
  const ByteLevelMap& m = ByteLevel();
  const uint8_t* p = reinterpret_cast<const uint8_t*>(s.data());
  const uint8_t* end = p + s.size();
  out->clear();
  while (p < end) {
    int len;
    uint32_t cp = unicode::DecodeUtf8(p, end, &len);
    if (cp >= 324 || m.cp_to_byte[cp] < 0) return false;
    out->push_back(static_cast<char>(m.cp_to_byte[cp]));
    p += len;
  }
  return true;
}

// wyhash-style "mum" mix: every key bit reaches the low bits used as the table index.
inline uint64_t HashKey(uint64_t k0, uint64_t k1, uint32_t len) {
  const uint64_t a = k0 ^ (static_cast<uint64_t>(len) * 0x9E3779B97F4A7C15ull);
  const uint64_t b = k1 ^ 0xE7037ED1A0B428DBull;
  const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

// Masks keeping the first n bytes of a piece in its two key words (n = 0..16).
struct KeyMasks {
  uint64_t m0[17], m1[17];
  constexpr KeyMasks() : m0(), m1() {
    for (int n = 0; n <= 16; ++n) {
      m0[n] = n >= 8 ? ~0ull : (n == 0 ? 0 : (~0ull >> (64 - 8 * n)));
      m1[n] = n <= 8 ? 0 : (n == 16 ? ~0ull : (~0ull >> (64 - 8 * (n - 8))));
    }
  }
};
inline constexpr KeyMasks kKeyMasks;

// Loads the (at most 16) bytes of a piece into two little-endian words, zero padded. Reads 16
// bytes when they lie before `limit` (branch-free masking), else copies.
inline void LoadKey(const uint8_t* p, size_t n, const uint8_t* limit, uint64_t* k0, uint64_t* k1) {
  if (__builtin_expect(limit - p >= 16, 1)) {
    uint64_t a, b;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    *k0 = a & kKeyMasks.m0[n];
    *k1 = b & kKeyMasks.m1[n];
    return;
  }
  uint8_t tmp[16] = {0};
  std::memcpy(tmp, p, n);
  std::memcpy(k0, tmp, 8);
  std::memcpy(k1, tmp + 8, 8);
}

// Hash of a piece of more than 16 bytes (16 at a time, the last 16 overlapping); never 0 (the
// long-piece table's empty mark).
inline uint64_t HashLong(const uint8_t* p, size_t n) {
  uint64_t h = n * 0x9E3779B97F4A7C15ull, a, b;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    std::memcpy(&a, p + i, 8);
    std::memcpy(&b, p + i + 8, 8);
    h = HashKey(a ^ h, b, static_cast<uint32_t>(n));
  }
  if (i < n) {
    std::memcpy(&a, p + n - 16, 8);
    std::memcpy(&b, p + n - 8, 8);
    h = HashKey(a ^ h, b, static_cast<uint32_t>(n));
  }
  return h | 1;
}

}  // namespace

std::string_view Gpt2Tokenizer::DefaultVocabJson() {
  return std::string_view(ptk_gpt2_vocab_start, static_cast<size_t>(ptk_gpt2_vocab_end - ptk_gpt2_vocab_start));
}
std::string_view Gpt2Tokenizer::DefaultMergesTxt() {
  return std::string_view(ptk_gpt2_merges_start, static_cast<size_t>(ptk_gpt2_merges_end - ptk_gpt2_merges_start));
}

std::string_view Gpt2Tokenizer::DefaultTables() {
#ifndef PTK_TOKENIZER_NO_TABLES
  return std::string_view(ptk_gpt2_tables_start, static_cast<size_t>(ptk_gpt2_tables_end - ptk_gpt2_tables_start));
#else
  return {};
#endif
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::LoadDefault() {
  if (!DefaultTables().empty()) {
    std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());
    if (t->Attach(DefaultTables(), /*trusted=*/true).ok()) return t;
  }
  return FromStrings(DefaultVocabJson(), DefaultMergesTxt(), "built-in gpt2");
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::LoadOrDefault(const std::string& vocab_path,
                                                                            const std::string& merges_path) {
  if (vocab_path.empty() && merges_path.empty()) return LoadDefault();
  if (vocab_path.empty() || merges_path.empty())
    return UsageError("--vocab-file and --merge-file go together (or give neither for GPT-2's)");
  return Load(vocab_path, merges_path);
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::Load(const std::string& vocab_path,
                                                                   const std::string& merges_path) {
  PTK_ASSIGN_OR_RETURN(std::string vocab, ReadFileToString(vocab_path));
  PTK_ASSIGN_OR_RETURN(std::string merges, ReadFileToString(merges_path));
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());
  absl::Status st = t->Build(vocab, merges, vocab_path + " / " + merges_path);
  if (!st.ok()) return st;
  return t;
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::FromStrings(std::string_view vocab_json,
                                                                          std::string_view merges_txt,
                                                                          std::string_view origin) {
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());
  PTK_RETURN_IF_ERROR(t->Build(vocab_json, merges_txt, origin));
  return t;
}

absl::Status Gpt2Tokenizer::Build(std::string_view vocab_json, std::string_view merges_txt, std::string_view origin) {
  const bool known_good = vocab_json == DefaultVocabJson() && merges_txt == DefaultMergesTxt();
  // ---- vocab.json
  simdjson::dom::parser parser;
  simdjson::padded_string padded(vocab_json);
  simdjson::dom::element root;
  if (auto err = parser.parse(padded).get(root))
    return absl::InvalidArgumentError(
        fmt::format("{}: vocab is not valid JSON: {}", origin, simdjson::error_message(err)));
  simdjson::dom::object obj;
  if (root.get_object().get(obj))
    return absl::InvalidArgumentError(fmt::format("{}: vocab must be a JSON object", origin));
  absl::flat_hash_map<std::string, int32_t> str_to_id;
  std::vector<std::pair<int64_t, std::string>> entries;
  for (auto field : obj) {
    int64_t id;
    if (field.value.get_int64().get(id))
      return absl::InvalidArgumentError(
          fmt::format("{}: vocab entry {:?} has a non-integer id", origin, std::string(field.key)));
    entries.emplace_back(id, std::string(field.key));
  }
  const int64_t n = static_cast<int64_t>(entries.size());
  std::vector<std::string> id_to_bytes(n);
  std::vector<bool> seen(n, false), byte_level(n, false);
  std::string bytes;
  for (auto& [id, key] : entries) {
    if (id < 0 || id >= n)
      return absl::InvalidArgumentError(fmt::format("{}: vocab id {} of {:?} is outside [0, {})", origin, id, key, n));
    if (seen[id]) return absl::InvalidArgumentError(fmt::format("{}: vocab id {} appears twice", origin, id));
    seen[id] = true;
    if (ByteLevelDecode(key, &bytes)) {
      id_to_bytes[id] = bytes;
      byte_level[id] = true;
    } else {
      id_to_bytes[id] = key;  // an added token outside the byte-level alphabet: literal text
    }
    str_to_id[key] = static_cast<int32_t>(id);
  }
  vocab_off_built_.assign(1, 0);
  for (const std::string& b : id_to_bytes) {
    vocab_bytes_built_ += b;
    if (vocab_bytes_built_.size() > UINT32_MAX)
      return absl::InvalidArgumentError(fmt::format("{}: the vocab's tokens exceed 4 GB", origin));
    vocab_off_built_.push_back(static_cast<uint32_t>(vocab_bytes_built_.size()));
  }
  vocab_off_ = vocab_off_built_;
  vocab_bytes_ = vocab_bytes_built_.data();
  vocab_n_ = n;
  auto eot = str_to_id.find(std::string(kEndOfText));
  if (eot == str_to_id.end()) return absl::InvalidArgumentError(fmt::format("{}: vocab has no {}", origin, kEndOfText));
  eod_id_ = eot->second;
  const ByteLevelMap& m = ByteLevel();
  std::vector<bool> mergeable(n, false);
  for (int b = 0; b < 256; ++b) {
    std::string key;
    AppendUtf8(m.byte_to_cp[b], &key);
    auto it = str_to_id.find(key);
    if (it == str_to_id.end())
      return absl::InvalidArgumentError(fmt::format("{}: vocab lacks the byte token {:?} (byte {})", origin, key, b));
    byte_to_id_[b] = it->second;
    mergeable[it->second] = true;
  }

  // ---- merges.txt
  auto find_id = [&](std::string_view k) -> int32_t {
    auto it = str_to_id.find(absl::string_view(k.data(), k.size()));
    return it == str_to_id.end() ? -1 : it->second;
  };
  size_t pos = 0;
  int64_t line_no = 0;
  uint32_t rank = 0;
  std::string joined;
  std::vector<MergeLine> merges;
  merges.reserve(60000);
  while (pos < merges_txt.size()) {
    size_t eol = merges_txt.find('\n', pos);
    if (eol == std::string_view::npos) eol = merges_txt.size();
    std::string_view line = merges_txt.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 >= line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos)
      return absl::InvalidArgumentError(fmt::format(
          "{}: merges line {} must hold two symbols separated by one space: {:?}", origin, line_no, std::string(line)));
    std::string_view a = line.substr(0, sp), b = line.substr(sp + 1);
    joined.assign(a);
    joined.append(b);
    int32_t ia = find_id(a), ib = find_id(b), ic = find_id(joined);
    if (ia < 0 || ib < 0 || ic < 0)
      return absl::InvalidArgumentError(fmt::format("{}: merges line {} ({:?}) uses a symbol that is not in the vocab",
                                                    origin, line_no, std::string(line)));
    merges.push_back({ia, ib, ic});
    mergeable[ic] = true;
    ++rank;
  }
  num_merges_ = rank;
  PTK_RETURN_IF_ERROR(BuildMerges(merges, origin));

  // ---- whole-token tables: only tokens that BPE itself produces for their own bytes
  size_t slots = 1;
  while (slots < static_cast<size_t>(n) * 2) slots <<= 1;
  short_built_.Assign(slots, PieceSlot{});
  short_table_ = std::span<const PieceSlot>(short_built_.data(), slots);
  short_mask_ = slots - 1;
  short_count_ = 0;
  std::vector<int32_t> ids;
  for (int64_t id = 0; id < n; ++id) {
    if (!mergeable[id] || !byte_level[id]) continue;
    const std::string_view tb = TokenBytes(static_cast<int32_t>(id));
    if (!known_good) {
      // BPE must produce the token itself for its own bytes, or the whole-token shortcut would
      // change the ids. True for every GPT-2 token (checked by tests/tokenizer/bpe_test.cpp), so
      // only other vocabularies pay for this check.
      ids.clear();
      BpePiece(reinterpret_cast<const uint8_t*>(tb.data()), tb.size(), &ids);
      if (ids.size() != 1 || ids[0] != id) continue;
    }
    if (tb.size() <= 16) {
      uint64_t k0, k1;
      LoadKey(reinterpret_cast<const uint8_t*>(tb.data()), tb.size(), reinterpret_cast<const uint8_t*>(tb.data()), &k0,
              &k1);
      uint64_t h = HashKey(k0, k1, static_cast<uint32_t>(tb.size())) & short_mask_;
      while (short_built_[h].len != 0) h = (h + 1) & short_mask_;
      short_built_[h] = PieceSlot{k0, k1, static_cast<uint8_t>(tb.size()), 1, 0, {static_cast<int32_t>(id), 0, 0}};
      ++short_count_;
    } else {
      long_tokens_[std::string(tb)] = static_cast<int32_t>(id);
    }
  }
  return absl::OkStatus();
}

absl::Status Gpt2Tokenizer::BuildMerges(const std::vector<MergeLine>& merges, std::string_view origin) {
  const size_t nsym = 256 + merges.size();
  if (nsym >= kNoSymbol)
    return absl::InvalidArgumentError(
        fmt::format("{}: {} merges; at most {} are supported", origin, merges.size(), kNoSymbol - 257));
  sym_ids_built_.assign(nsym, -1);
  sym_ids_ = sym_ids_built_;
  // A token's symbols: its byte, and 256 + r for every line r that makes it (GPT-2 makes each
  // token once; other files may repeat a token under another split).
  absl::flat_hash_map<int32_t, std::vector<uint32_t>> syms;
  for (uint32_t b = 0; b < 256; ++b) {
    sym_ids_built_[b] = byte_to_id_[b];
    syms[byte_to_id_[b]].push_back(b);
  }
  // A pair listed twice keeps its last rank, as a map assignment would: earlier lines are dead.
  absl::flat_hash_map<uint64_t, uint32_t> last;
  auto id_pair = [](const MergeLine& m) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(m.a)) << 32) | static_cast<uint32_t>(m.b);
  };
  for (uint32_t r = 0; r < merges.size(); ++r) last[id_pair(merges[r])] = r;
  for (uint32_t r = 0; r < merges.size(); ++r) {
    sym_ids_built_[256 + r] = merges[r].id;
    if (last[id_pair(merges[r])] == r) syms[merges[r].id].push_back(256 + r);
  }
  std::vector<std::pair<uint64_t, uint32_t>> entries;
  entries.reserve(merges.size());
  for (uint32_t r = 0; r < merges.size(); ++r) {
    if (last[id_pair(merges[r])] != r) continue;
    auto xs = syms.find(merges[r].a), ys = syms.find(merges[r].b);
    if (xs == syms.end() || ys == syms.end()) continue;  // a symbol BPE never makes
    for (uint32_t x : xs->second)
      for (uint32_t y : ys->second) entries.emplace_back(PairKey(x, y), r);
    if (entries.size() > (size_t{1} << 26))
      return absl::InvalidArgumentError(
          fmt::format("{}: its merges repeat tokens so often that their pairs exceed {}", origin, size_t{1} << 26));
  }
  // At most 85 % full (two-choice cuckoo tables of two-slot buckets fill to ~89 %).
  size_t buckets = 16;
  while (buckets * 2 * 85 < entries.size() * 100) buckets <<= 1;
  while (!BuildPairTable(entries, buckets)) buckets <<= 1;
  return absl::OkStatus();
}

bool Gpt2Tokenizer::BuildPairTable(const std::vector<std::pair<uint64_t, uint32_t>>& entries, size_t buckets) {
  // Multipliers from a fixed sequence, tried in turn: the same table for the same merges.
  uint64_t seed = 0x243F6A8885A308D3ull;
  auto next = [&seed] {  // splitmix64
    uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  pair_shift_ = 64 - __builtin_ctzll(buckets);
  for (int attempt = 0; attempt < 8; ++attempt) {
    pair_mul_[0] = next() | 1;
    pair_mul_[1] = next() | 1;
    pairs_built_.Assign(buckets, PairBucket{{kNoPairWord, kNoPairWord}});
    bool ok = true;
    for (const auto& [key, rank] : entries) {
      uint64_t w = (key << kRankBits) | rank;
      bool placed = false;
      for (int kick = 0; kick < 500 && !placed; ++kick) {
        const uint64_t k = w >> kRankBits;
        PairBucket* b[2] = {&pairs_built_[(k * pair_mul_[0]) >> pair_shift_],
                            &pairs_built_[(k * pair_mul_[1]) >> pair_shift_]};
        for (PairBucket* bk : b)
          for (uint64_t& slot : bk->w)
            if (!placed && slot == kNoPairWord) {
              slot = w;
              placed = true;
            }
        if (!placed) {  // evict a random occupant of the two buckets and place it next
          const uint64_t z = next();
          std::swap(w, b[z & 1]->w[(z >> 1) & 1]);
        }
      }
      if (!placed) {
        ok = false;
        break;
      }
    }
    if (ok) {
      pairs_ = std::span<const PairBucket>(pairs_built_.data(), buckets);
      return true;
    }
  }
  return false;
}

int32_t Gpt2Tokenizer::LookupShort(uint64_t k0, uint64_t k1, uint32_t len) const {
  uint64_t h = HashKey(k0, k1, len) & short_mask_;
  while (true) {
    const PieceSlot& s = short_table_[h];
    if (s.len == len && s.k0 == k0 && s.k1 == k1) return s.ids[0];
    if (s.len == 0) return -1;
    h = (h + 1) & short_mask_;
  }
}

int32_t Gpt2Tokenizer::LookupLong(std::string_view piece) const {
  auto it = long_tokens_.find(absl::string_view(piece.data(), piece.size()));
  return it == long_tokens_.end() ? -1 : it->second;
}

std::string_view Gpt2Tokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= vocab_n_) return {};
  return std::string_view(vocab_bytes_ + vocab_off_[id], vocab_off_[id + 1] - vocab_off_[id]);
}

std::string Gpt2Tokenizer::DecodeBytes(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += TokenBytes(id);
  return out;
}

std::string Gpt2Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string raw = DecodeBytes(ids);
  std::string out;
  out.reserve(raw.size());
  AppendUtf8Replacing(raw, &out);
  return out;
}

void Gpt2Tokenizer::BpePiece(const uint8_t* p, size_t n, std::vector<int32_t>* out) const {
  if (n <= kShortPiece)
    BpeShort(p, n, out);
  else
    BpeLong(p, n, out);
}

// Megatron/OpenAI's algorithm: repeatedly take the adjacent pair of lowest merge rank and merge all
// its non-overlapping occurrences left to right. Pieces here are at most 64 bytes; everything lives
// in stack arrays indexed by the position a symbol started at, so left to right is index order:
// rk[i] is the rank of the pair starting at live symbol i (kNoRank for the last symbol and for
// symbols merged away). Each round takes the minimum of rk and a bit mask of its occurrences (8
// ranks at a time with AVX2, chosen at run time; a portable loop otherwise), then walks the mask's
// bits: no pointer chasing, no allocation, no compaction, no unpredictable branch per symbol. A
// merge unlinks one symbol and re-ranks the two pairs next to it.
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

#if defined(__x86_64__)
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
#endif

}  // namespace

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

inline __attribute__((always_inline)) void Gpt2Tokenizer::ShortStart(ShortMerge& s, const uint8_t* p,
                                                                     size_t n) const {
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

#if defined(__x86_64__)
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

// ---------------------------------------------------------------- encoder

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
__attribute__((always_inline)) inline int32_t* Gpt2Encoder::EncodeBatch(const Pending* batch, int count,
                                                                        int32_t* out) {
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
