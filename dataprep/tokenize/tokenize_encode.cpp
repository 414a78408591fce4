// ptk-tokenize's parallel stage: a batch's JSON lines -> GPT-2 ids, Megatron's way.
#include <cstring>

#include <fmt/core.h>

#include "common/utf8.h"
#include "dataprep/tokenize/tokenize_stages.h"

namespace ptk::tokenize_detail {
namespace {

// Code points in a UTF-8 byte string (continuation bytes are not counted).
uint64_t CountChars(const char* p, size_t n) {
  uint64_t cont = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    // Bit 7 of each byte set for continuation bytes (10xxxxxx); summed with one multiply (no
    // POPCNT in baseline x86-64).
    const uint64_t m = ((w & ~(w << 1)) & 0x8080808080808080ull) >> 7;
    cont += (m * 0x0101010101010101ull) >> 56;
  }
  for (; i < n; ++i) cont += (static_cast<unsigned char>(p[i]) & 0xC0) == 0x80;
  return n - cont;
}

// Where a BOM that begins a record inside a file is, and how it likely got there: only the one that
// starts the file is the encoding's (Python's utf-8-sig drops it); `cat` leaves one inside wherever it
// joined files that each had theirs.
std::string BomWhere(uint64_t offset) {
  return fmt::format(
      " at byte {}: only one that starts a file is dropped (files joined with their BOMs? ptk-concat drops each "
      "input's)",
      offset);
}

}  // namespace

BatchEncoder::BatchEncoder(const Gpt2Tokenizer& tok, const TokenizeOptions& opt)
    : opt_(opt),
      parser_(opt.json_keys),
      encoder_(tok, Gpt2Encoder::Options{.special_endoftext = !opt.endoftext_as_text}),
      eod_(tok.eod()) {}

void BatchEncoder::Encode(Batch& b) {
  // A recycled batch: every result is set again, buffers keep their memory.
  const size_t nkeys = opt_.json_keys.size();
  b.tokens.resize(nkeys);
  b.seq_lens.resize(nkeys);
  b.doc_nseq.resize(nkeys);
  for (size_t k = 0; k < nkeys; ++k) {
    b.tokens[k].clear();
    // Room for the whole batch at once (an id covers at least a byte): the buffer never regrows,
    // so no copy and no second set of fresh pages; only what is written is touched.
    b.tokens[k].Reserve(b.size + Gpt2Encoder::kEncodeSlack);
    b.seq_lens[k].clear();
    b.doc_nseq[k].clear();
  }
  b.status.assign(b.lines.size(), RecordStatus::kOk);
  b.messages.resize(b.lines.size());
  for (std::string& m : b.messages) m.clear();
  b.replaced.assign(b.lines.size(), 0);
  b.chars = 0;
  b.invalid_utf8 = b.lone_surrogates = 0;
  for (size_t i = 0; i < b.lines.size(); ++i) {
    const auto& ln = b.lines[i];
    std::string_view line(b.data.get() + ln.off, ln.len);
    b.chars += CountChars(line.data(), line.size()) + 1;
    RecordResult r = parser_.Parse(line, /*padded=*/true);
    b.status[i] = r.status;
    if (r.status != RecordStatus::kOk) {
      b.messages[i] = std::move(r.message);
      if (line.starts_with(kUtf8Bom)) b.messages[i] += BomWhere(b.file_offset + ln.off);
      continue;
    }
    b.replaced[i] = (r.invalid_utf8 || r.lone_surrogates) ? 1 : 0;
    b.invalid_utf8 += static_cast<int64_t>(r.invalid_utf8);
    b.lone_surrogates += static_cast<int64_t>(r.lone_surrogates);
    const auto& fields = parser_.fields();
    for (size_t k = 0; k < nkeys; ++k) {
      // Megatron: each sentence tokenized on its own; empty ones dropped; EOD on the last one.
      IdBuffer& toks = b.tokens[k];
      auto& lens = b.seq_lens[k];
      int32_t nseq = 0;
      for (std::string_view sentence : fields[k]) {
        // Straight into the batch's buffer: EncodeTo needs room for one id a byte at most (and
        // its slack).
        const size_t before = toks.size();
        toks.Commit(encoder_.EncodeTo(sentence, toks.Reserve(sentence.size() + Gpt2Encoder::kEncodeSlack)));
        const size_t n = toks.size() - before;
        if (n > 0) {
          lens.push_back(static_cast<int32_t>(n));
          ++nseq;
        }
      }
      if (nseq > 0 && opt_.append_eod) {
        toks.push_back(eod_);
        ++lens.back();
      }
      b.doc_nseq[k].push_back(nseq);
    }
  }
}

}  // namespace ptk::tokenize_detail
