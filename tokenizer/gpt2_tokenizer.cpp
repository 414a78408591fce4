// GPT-2 byte-level BPE: the vocabulary and merges read and built into the tokenizer's tables, lookups, decoding.
#include "tokenizer/gpt2_tokenizer.h"

#include <algorithm>
#include <cstring>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/hash.h"
#include "common/json_keys.h"
#include "common/status.h"
#include "common/utf8.h"
#include "tokenizer/gpt2_piece_key.h"
#include "tokenizer/unicode_tables.h"

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

// A line of a file quoted in an error: its first 60 characters (a vocab.json given as the merges file is
// one line of a megabyte).
std::string Shown(std::string_view line) {
  constexpr size_t kShown = 60;
  return line.size() <= kShown ? fmt::format("{:?}", std::string(line))
                               : fmt::format("{:?}... ({} bytes)", std::string(line.substr(0, kShown)), line.size());
}

// vocab.json's (id, token) entries in the file's order.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> ParseVocabEntries(std::string_view vocab_json,
                                                                               std::string_view origin,
                                                                               bool known_good) {
  simdjson::dom::parser parser;
  simdjson::padded_string padded(vocab_json);
  simdjson::dom::element root;
  if (auto err = parser.parse(padded).get(root)) {
    // The two files swapped (merges.txt as the vocab): said so, not only that the JSON is bad.
    if (vocab_json.rfind("#version", 0) == 0)
      return absl::InvalidArgumentError(
          fmt::format("{}: the vocab is not JSON but a merges file ({}): are the vocab and merges files swapped?",
                      origin, Shown(vocab_json.substr(0, vocab_json.find('\n')))));
    return absl::InvalidArgumentError(
        fmt::format("{}: vocab is not valid JSON: {}", origin, simdjson::error_message(err)));
  }
  simdjson::dom::object obj;
  if (root.get_object().get(obj))
    return absl::InvalidArgumentError(fmt::format("{}: vocab must be a JSON object", origin));
  std::vector<std::pair<int64_t, std::string>> entries;
  // A token given twice: Python's json (Megatron's and HF's GPT-2 tokenizers) keeps its last id and
  // leaves the first id without a token, a vocabulary ptk cannot represent: refused by name.
  if (auto dup = known_good ? std::nullopt : FirstDuplicateJsonKey(root))
    return absl::InvalidArgumentError(
        fmt::format("{}: vocab token {:?} is given twice (Python's json would keep only its last id)", origin, *dup));
  for (auto field : obj) {
    int64_t id;
    if (field.value.get_int64().get(id))
      return absl::InvalidArgumentError(
          fmt::format("{}: vocab entry {:?} has a non-integer id", origin, std::string(field.key)));
    entries.emplace_back(id, std::string(field.key));
  }
  return entries;
}

}  // namespace

using gpt2_detail::HashKey;
using gpt2_detail::LoadKey;

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
    if (t->Attach(DefaultTables(), /*trusted=*/true).ok()) {
      t->vocab_hash_ = Xxh3Hex(DefaultVocabJson());
      t->merges_hash_ = Xxh3Hex(DefaultMergesTxt());
      return t;
    }
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
  vocab_hash_ = Xxh3Hex(vocab_json);
  merges_hash_ = Xxh3Hex(merges_txt);
  std::vector<bool> byte_level, mergeable;
  PTK_ASSIGN_OR_RETURN(const auto str_to_id, BuildVocab(vocab_json, origin, known_good, &byte_level, &mergeable));
  PTK_ASSIGN_OR_RETURN(const std::vector<MergeLine> merges, ParseMerges(merges_txt, origin, str_to_id, &mergeable));
  num_merges_ = static_cast<int64_t>(merges.size());
  PTK_RETURN_IF_ERROR(BuildMerges(merges, origin));
  BuildWholeTokenTables(known_good, mergeable, byte_level);
  return absl::OkStatus();
}

absl::StatusOr<absl::flat_hash_map<std::string, int32_t>> Gpt2Tokenizer::BuildVocab(std::string_view vocab_json,
                                                                                    std::string_view origin,
                                                                                    bool known_good,
                                                                                    std::vector<bool>* byte_level,
                                                                                    std::vector<bool>* mergeable) {
  PTK_ASSIGN_OR_RETURN(auto entries, ParseVocabEntries(vocab_json, origin, known_good));
  absl::flat_hash_map<std::string, int32_t> str_to_id;
  const int64_t n = static_cast<int64_t>(entries.size());
  std::vector<std::string> id_to_bytes(n);
  std::vector<bool> seen(n, false);
  byte_level->assign(n, false);
  std::string bytes;
  for (auto& [id, key] : entries) {
    if (id < 0 || id >= n)
      return absl::InvalidArgumentError(fmt::format("{}: vocab id {} of {:?} is outside [0, {})", origin, id, key, n));
    if (seen[id]) return absl::InvalidArgumentError(fmt::format("{}: vocab id {} appears twice", origin, id));
    seen[id] = true;
    if (ByteLevelDecode(key, &bytes)) {
      id_to_bytes[id] = bytes;
      (*byte_level)[id] = true;
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
  mergeable->assign(n, false);
  for (int b = 0; b < 256; ++b) {
    std::string key;
    AppendUtf8(m.byte_to_cp[b], &key);
    auto it = str_to_id.find(key);
    if (it == str_to_id.end())
      return absl::InvalidArgumentError(fmt::format("{}: vocab lacks the byte token {:?} (byte {})", origin, key, b));
    byte_to_id_[b] = it->second;
    (*mergeable)[it->second] = true;
  }
  return str_to_id;
}

absl::StatusOr<std::vector<Gpt2Tokenizer::MergeLine>> Gpt2Tokenizer::ParseMerges(
    std::string_view merges_txt, std::string_view origin, const absl::flat_hash_map<std::string, int32_t>& str_to_id,
    std::vector<bool>* mergeable) {
  auto find_id = [&](std::string_view k) -> int32_t {
    auto it = str_to_id.find(absl::string_view(k.data(), k.size()));
    return it == str_to_id.end() ? -1 : it->second;
  };
  size_t pos = 0;
  int64_t line_no = 0;
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
          "{}: merges line {} must hold two symbols separated by one space: {}{}", origin, line_no, Shown(line),
          merges.empty() && line.front() == '{'
              ? " (a JSON object: the vocab.json given as the merges file? It is merges.txt, one merge a line)"
              : ""));
    std::string_view a = line.substr(0, sp), b = line.substr(sp + 1);
    joined.assign(a);
    joined.append(b);
    int32_t ia = find_id(a), ib = find_id(b), ic = find_id(joined);
    if (ia < 0 || ib < 0 || ic < 0)
      return absl::InvalidArgumentError(fmt::format("{}: merges line {} ({:?}) uses a symbol that is not in the vocab",
                                                    origin, line_no, std::string(line)));
    merges.push_back({ia, ib, ic});
    (*mergeable)[ic] = true;
  }
  return merges;
}

void Gpt2Tokenizer::BuildWholeTokenTables(bool known_good, const std::vector<bool>& mergeable,
                                          const std::vector<bool>& byte_level) {
  const int64_t n = vocab_n_;
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

}  // namespace ptk
