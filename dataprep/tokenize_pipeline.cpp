// ptk-tokenize's engine.
#include "dataprep/tokenize_pipeline.h"

#include <sys/stat.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>

#include <fmt/core.h>
#include <simdjson.h>

#include "absl/strings/ascii.h"

#include "common/file_util.h"
#include "common/happens_before.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/py_format.h"
#include "common/status.h"
#include "dataprep/byte_source.h"
#include "dataprep/json_record.h"
#include "indexed_dataset/indexed_dataset.h"
#include "indexed_dataset/merge.h"

namespace ptk {
namespace {

constexpr size_t kPadding = simdjson::SIMDJSON_PADDING;

// A batch of whole lines from one input file, and what the workers made of them.
struct Batch {
  std::unique_ptr<char[]> data;  // lines, followed by kPadding readable bytes
  size_t size = 0;
  struct Line {
    size_t off, len;
  };
  std::vector<Line> lines;
  int file = 0;
  int64_t first_line_no = 1;      // 1-based line number of lines[0] in its file
  int64_t first_global_line = 0;  // 0-based index over all inputs (partition assignment)
  uint64_t file_offset = 0;       // decoded byte offset of lines[0]'s batch start in its file
  bool last_of_file = false;      // the file ends with this batch
  uint64_t raw_bytes = 0;         // input bytes consumed for this batch (progress)

  // Results, per key: ids and sequence lengths of all documents, and per line the number of
  // sequences; status per line.
  std::vector<std::vector<int32_t>> tokens, seq_lens, doc_nseq;
  std::vector<RecordStatus> status;
  std::vector<std::string> messages;  // for bad lines (index parallel to `status`, empty for ok)
  uint64_t chars = 0;
  int64_t invalid_utf8 = 0, lone_surrogates = 0;
  std::vector<uint8_t> replaced;  // per line: some character was replaced by U+FFFD
};

// Where reading starts (or resumes): a file, a decoded byte offset at a line start, the line
// numbers there.
struct ReadPoint {
  int64_t file = 0;
  uint64_t offset = 0;
  int64_t line_no = 1, global_line = 0;
};

class LineReader {
 public:
  LineReader(const std::vector<std::string>& files, size_t batch_bytes, const ReadPoint& start, bool announce)
      : files_(files), batch_bytes_(batch_bytes), start_(start), announce_(announce) {
    file_ = static_cast<int>(start.file);
    global_line_ = start.global_line;
  }

  // Next batch, nullptr at the end of all input.
  absl::StatusOr<std::unique_ptr<Batch>> Next() {
    while (true) {
      if (!src_) {
        if (file_ >= static_cast<int>(files_.size())) return std::unique_ptr<Batch>();
        PTK_ASSIGN_OR_RETURN(src_, OpenByteSource(files_[file_]));
        if (announce_) {  // Megatron's line
          std::printf("Opening %s\n", files_[file_].c_str());
          std::fflush(stdout);
        }
        line_no_ = 1;
        at_file_start_ = true;
        consumed_ = 0;
        if (file_ == start_.file && start_.offset > 0) {  // resuming inside this file
          PTK_RETURN_IF_ERROR(src_->Skip(start_.offset));
          consumed_ = start_.offset;
          line_no_ = start_.line_no;
          at_file_start_ = false;
        }
        carry_.clear();
        last_raw_ = 0;
      }
      auto b = std::make_unique<Batch>();
      b->file = file_;
      size_t cap = std::max(batch_bytes_, carry_.size() * 2) + (64 << 10);
      b->data.reset(new char[cap + kPadding]);
      std::memcpy(b->data.get(), carry_.data(), carry_.size());
      size_t size = carry_.size();
      size_t scan_from = 0;
      size_t last_nl = std::string::npos;
      carry_.clear();
      bool eof = false;
      while (true) {
        if (size >= batch_bytes_ && last_nl != std::string::npos) break;
        if (size == cap) {
          if (last_nl != std::string::npos) break;
          size_t ncap = cap * 2;  // a line longer than the batch: grow until it ends
          std::unique_ptr<char[]> nd(new char[ncap + kPadding]);
          std::memcpy(nd.get(), b->data.get(), size);
          b->data = std::move(nd);
          cap = ncap;
        }
        PTK_ASSIGN_OR_RETURN(size_t n, src_->Read(b->data.get() + size, cap - size));
        if (n == 0) {
          eof = true;
          break;
        }
        size += n;
        const void* nl = memrchr(b->data.get() + scan_from, '\n', size - scan_from);
        if (nl) last_nl = static_cast<size_t>(static_cast<const char*>(nl) - b->data.get());
        scan_from = size;
      }
      size_t end = size;
      if (!eof) {
        end = last_nl + 1;
        carry_.assign(b->data.get() + end, size - end);
      }
      b->size = end;
      std::memset(b->data.get() + end, 0, kPadding);
      // Split into lines as Python's universal newlines do (Megatron reads with open(..., "r")):
      // "\n", "\r\n" and a bare "\r" each end a line.
      size_t pos = 0;
      while (pos < end) {
        const void* nl = std::memchr(b->data.get() + pos, '\n', end - pos);
        const size_t stop = nl ? static_cast<size_t>(static_cast<const char*>(nl) - b->data.get()) : end;
        while (true) {
          const void* cr = std::memchr(b->data.get() + pos, '\r', stop - pos);
          if (!cr) break;
          const size_t at = static_cast<size_t>(static_cast<const char*>(cr) - b->data.get());
          if (at + 1 == stop && nl) break;  // "\r\n"
          b->lines.push_back({pos, at - pos});
          pos = at + 1;
        }
        size_t len = stop - pos;
        if (len > 0 && b->data[pos + len - 1] == '\r') --len;
        if (pos < stop || nl) b->lines.push_back({pos, len});
        pos = stop + 1;
      }
      if (at_file_start_ && !b->lines.empty()) {
        auto& l0 = b->lines[0];
        if (l0.len >= 3 && std::memcmp(b->data.get() + l0.off, "\xEF\xBB\xBF", 3) == 0) {  // UTF-8 BOM
          l0.off += 3;
          l0.len -= 3;
        }
        at_file_start_ = false;
      }
      b->first_line_no = line_no_;
      b->first_global_line = global_line_;
      b->file_offset = consumed_;
      b->last_of_file = eof;
      consumed_ += end;
      line_no_ += static_cast<int64_t>(b->lines.size());
      global_line_ += static_cast<int64_t>(b->lines.size());
      uint64_t raw = src_->raw_bytes_read();
      b->raw_bytes = raw - last_raw_;
      last_raw_ = raw;
      if (eof) {
        src_.reset();
        ++file_;
      }
      if (b->lines.empty()) continue;  // an empty file
      return b;
    }
  }

  const std::string& file_name(int i) const { return files_[i]; }

 private:
  const std::vector<std::string>& files_;
  size_t batch_bytes_;
  int file_ = 0;
  std::unique_ptr<ByteSource> src_;
  std::string carry_;
  int64_t line_no_ = 1, global_line_ = 0;
  bool at_file_start_ = true;
  uint64_t last_raw_ = 0;
  uint64_t consumed_ = 0;  // decoded bytes of the current file handed out in batches
  ReadPoint start_;
  bool announce_ = true;
};

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

struct Worker {
  Worker(const Gpt2Tokenizer& tok, const TokenizeOptions& opt)
      : parser(opt.json_keys), encoder(tok, Gpt2Encoder::Options{.special_endoftext = !opt.endoftext_as_text}) {}
  JsonRecordParser parser;
  Gpt2Encoder encoder;
  std::vector<int32_t> ids;
};

void EncodeBatch(Batch& b, Worker& w, const TokenizeOptions& opt, int32_t eod) {
  const size_t nkeys = opt.json_keys.size();
  b.tokens.assign(nkeys, {});
  b.seq_lens.assign(nkeys, {});
  b.doc_nseq.assign(nkeys, {});
  b.status.assign(b.lines.size(), RecordStatus::kOk);
  b.messages.assign(b.lines.size(), std::string());
  b.replaced.assign(b.lines.size(), 0);
  for (size_t k = 0; k < nkeys; ++k) b.tokens[k].reserve(b.size / 3 + 16);
  for (size_t i = 0; i < b.lines.size(); ++i) {
    const auto& ln = b.lines[i];
    std::string_view line(b.data.get() + ln.off, ln.len);
    b.chars += CountChars(line.data(), line.size()) + 1;
    RecordResult r = w.parser.Parse(line, /*padded=*/true);
    b.status[i] = r.status;
    if (r.status != RecordStatus::kOk) {
      b.messages[i] = std::move(r.message);
      continue;
    }
    b.replaced[i] = (r.invalid_utf8 || r.lone_surrogates) ? 1 : 0;
    b.invalid_utf8 += static_cast<int64_t>(r.invalid_utf8);
    b.lone_surrogates += static_cast<int64_t>(r.lone_surrogates);
    const auto& fields = w.parser.fields();
    for (size_t k = 0; k < nkeys; ++k) {
      // Megatron: each sentence tokenized on its own; empty ones dropped; EOD on the last one.
      auto& toks = b.tokens[k];
      auto& lens = b.seq_lens[k];
      int32_t nseq = 0;
      for (std::string_view sentence : fields[k]) {
        size_t before = toks.size();
        w.encoder.Encode(sentence, &toks);
        size_t n = toks.size() - before;
        if (n > 0) {
          lens.push_back(static_cast<int32_t>(n));
          ++nseq;
        }
      }
      if (nseq > 0 && opt.append_eod) {
        toks.push_back(eod);
        ++lens.back();
      }
      b.doc_nseq[k].push_back(nseq);
    }
  }
}

}  // namespace

std::string OutputPrefixFor(const std::string& output_prefix, const std::string& key) {
  return fmt::format("{}_{}_document", output_prefix, key);
}

namespace {

// What the sink saw of one input: enough to fail a run that read nothing, and to say why.
struct FileTally {
  int64_t documents = 0, bad = 0;  // bad: records that could not be read (blank lines aside)
  std::string first_line;          // the first non-blank line's beginning
  std::string first_bad;           // "file:line: message" of the first bad record
  std::string keys_seen;           // the keys of the first record that lacked a --json-keys key
};

std::string TopLevelKeys(std::string_view line) {
  simdjson::dom::parser p;
  simdjson::dom::object obj;
  if (p.parse(std::string(line)).get(obj)) return "";
  std::string keys;
  for (auto field : obj) keys += (keys.empty() ? "" : ", ") + std::string(field.key);
  return keys.empty() ? "(none)" : keys;
}

// The likely reason why a file gave no document, from its first line.
std::string LikelyCause(const FileTally& t, const TokenizeOptions& opt) {
  const std::string first(absl::StripAsciiWhitespace(t.first_line));
  if (!t.keys_seen.empty())
    return fmt::format("; its records have no key {:?}: the first one has {} (choose with --json-keys)",
                       opt.json_keys.front(), t.keys_seen);
  if (!first.empty() && first.front() == '[')
    return "; it looks like a JSON array, not JSON lines (one object per line): convert it with `jq -c '.[]'`";
  if (first == "{" || (first.size() > 1 && first.front() == '{' && first.back() != '}'))
    return "; it looks like pretty-printed JSON, not JSON lines (one object per line): convert it with `jq -c .`";
  int control = 0;
  for (unsigned char c : t.first_line) control += (c < 0x20 && c != '\t') || c == 0x7f;
  if (control > 0) return "; it does not look like text (binary data, or a compression ptk does not detect?)";
  return "";
}

absl::Status CheckInputsWereRead(const TokenizeOptions& opt, const LineReader& reader,
                                 const std::vector<FileTally>& tallies) {
  int64_t docs = 0, bad = 0;
  std::string first_bad;
  for (size_t f = 0; f < tallies.size(); ++f) {
    const FileTally& t = tallies[f];
    docs += t.documents;
    bad += t.bad;
    if (first_bad.empty()) first_bad = t.first_bad;
    if (t.documents > 0) continue;
    const std::string name = reader.file_name(static_cast<int>(f));
    if (t.bad == 0) return absl::FailedPreconditionError(fmt::format("{}: no document in it (empty file)", name));
    return absl::FailedPreconditionError(
        fmt::format("{}: no document could be read: {} records, none usable{}; first: {}", name, t.bad,
                    LikelyCause(t, opt), log::Printable(t.first_bad)));
  }
  if (bad > 0 && static_cast<double>(bad) > opt.max_bad_fraction * static_cast<double>(docs + bad))
    return absl::FailedPreconditionError(
        fmt::format("{} of {} records ({:.2f}%) could not be read, more than --max-bad-fraction {}; first: {}", bad,
                    docs + bad, 100.0 * static_cast<double>(bad) / static_cast<double>(docs + bad),
                    opt.max_bad_fraction, log::Printable(first_bad)));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- resume record
// PREFIX.ptk-resume, rewritten atomically every --resume-interval seconds: where reading goes on,
// the counters, and each key's builder checkpoint (its fsynced temporary .bin and index so far).
// A killed run's rerun with the same inputs and settings continues from there; the output is the
// same bytes as an uninterrupted run's.

constexpr std::string_view kResumeMagic = "PTKRESUME1\n";

struct ResumeState {
  std::string fingerprint;
  ReadPoint next;
  TokenizeStats stats;
  std::vector<std::pair<int64_t, int64_t>> tallies;  // documents, bad records per input
  std::vector<BuilderCheckpoint> builders;           // per key
};

// What must be equal for a resume to give the same bytes: inputs (name, size, mtime), keys, the
// options that change ids, and the tokenizer (its size, EOD id and the ids of a probe text).
std::string ResumeFingerprint(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  std::string s = "ptk-tokenize resume v1\n";
  for (const auto& f : opt.inputs) {
    struct stat st {};
    (void)::stat(f.c_str(), &st);
    s += fmt::format("{}\t{}\t{}.{}\n", f, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  }
  for (const auto& k : opt.json_keys) s += "key " + k + "\n";
  s += fmt::format("{} {} {} {} {}\n", opt.append_eod, opt.endoftext_as_text, opt.strict, tok.vocab_size(), tok.eod());
  Gpt2Encoder enc(tok);
  std::vector<int32_t> ids;
  enc.Encode("ptk resume probe: Hello, world! 12345 \xc3\xa9t\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd <|endoftext|>", &ids);
  for (int32_t id : ids) s += fmt::format("{} ", id);
  return Sha256Hex(s);
}

void PutI64(std::string& o, int64_t v) { o.append(reinterpret_cast<const char*>(&v), 8); }

std::string SerializeResume(const ResumeState& r) {
  std::string o(kResumeMagic);
  o += r.fingerprint + "\n";
  for (int64_t v : {r.next.file, static_cast<int64_t>(r.next.offset), r.next.line_no, r.next.global_line}) PutI64(o, v);
  const TokenizeStats& t = r.stats;
  for (int64_t v : {t.documents, t.empty_documents, t.tokens, static_cast<int64_t>(t.bytes),
                    static_cast<int64_t>(t.chars), t.lines, t.skipped, t.invalid_utf8, t.lone_surrogates})
    PutI64(o, v);
  for (int64_t v : t.skipped_by_kind) PutI64(o, v);
  PutI64(o, static_cast<int64_t>(r.tallies.size()));
  for (const auto& [docs, bad] : r.tallies) {
    PutI64(o, docs);
    PutI64(o, bad);
  }
  PutI64(o, static_cast<int64_t>(r.builders.size()));
  for (const auto& b : r.builders) {
    const std::string name = Basename(b.bin_tmp);
    PutI64(o, static_cast<int64_t>(name.size()));
    o += name;
    PutI64(o, static_cast<int64_t>(b.bin_bytes));
    PutI64(o, b.tokens);
    PutI64(o, static_cast<int64_t>(b.lengths.size()));
    o.append(reinterpret_cast<const char*>(b.lengths.data()), 4 * b.lengths.size());
    PutI64(o, static_cast<int64_t>(b.doc_idx.size()));
    o.append(reinterpret_cast<const char*>(b.doc_idx.data()), 8 * b.doc_idx.size());
  }
  o += Xxh3Hex(o);  // 32 hex digits: a damaged record is refused, not half-believed
  return o;
}

absl::StatusOr<ResumeState> ParseResume(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string data, ReadFileToString(path));
  auto bad = [&](const char* what) { return absl::DataLossError(fmt::format("{}: {}", path, what)); };
  if (data.size() < kResumeMagic.size() + 65 + 32 || data.compare(0, kResumeMagic.size(), kResumeMagic) != 0)
    return bad("not a ptk-tokenize resume record");
  const std::string body = data.substr(0, data.size() - 32);
  if (Xxh3Hex(body) != data.substr(data.size() - 32)) return bad("damaged (checksum)");
  size_t pos = kResumeMagic.size();
  ResumeState r;
  r.fingerprint = body.substr(pos, 64);
  pos += 65;
  bool ok = true;
  auto get = [&]() -> int64_t {
    if (pos + 8 > body.size()) {
      ok = false;
      return 0;
    }
    int64_t v;
    std::memcpy(&v, body.data() + pos, 8);
    pos += 8;
    return v;
  };
  auto count = [&](int64_t limit) -> size_t {
    const int64_t n = get();
    if (n < 0 || n > limit) ok = false;
    return ok ? static_cast<size_t>(n) : 0;
  };
  r.next.file = get();
  r.next.offset = static_cast<uint64_t>(get());
  r.next.line_no = get();
  r.next.global_line = get();
  TokenizeStats& t = r.stats;
  t.documents = get();
  t.empty_documents = get();
  t.tokens = get();
  t.bytes = static_cast<uint64_t>(get());
  t.chars = static_cast<uint64_t>(get());
  t.lines = get();
  t.skipped = get();
  t.invalid_utf8 = get();
  t.lone_surrogates = get();
  for (int64_t& v : t.skipped_by_kind) v = get();
  const int64_t room = static_cast<int64_t>(body.size());
  r.tallies.resize(count(room / 16));
  for (auto& [docs, badn] : r.tallies) {
    docs = get();
    badn = get();
  }
  r.builders.resize(count(64));
  for (auto& b : r.builders) {
    const size_t n = count(4096);
    if (!ok || pos + n > body.size()) return bad("truncated");
    b.bin_tmp = JoinPath(Dirname(path), body.substr(pos, n));
    pos += n;
    b.bin_bytes = static_cast<uint64_t>(get());
    b.tokens = get();
    b.lengths.resize(count(room / 4));
    if (!ok || pos + 4 * b.lengths.size() > body.size()) return bad("truncated");
    std::memcpy(b.lengths.data(), body.data() + pos, 4 * b.lengths.size());
    pos += 4 * b.lengths.size();
    b.doc_idx.resize(count(room / 8));
    if (!ok || pos + 8 * b.doc_idx.size() > body.size()) return bad("truncated");
    std::memcpy(b.doc_idx.data(), body.data() + pos, 8 * b.doc_idx.size());
    pos += 8 * b.doc_idx.size();
  }
  if (!ok || pos != body.size()) return bad("truncated or damaged");
  return r;
}

}  // namespace

absl::StatusOr<TokenizeStats> RunTokenize(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  if (opt.inputs.empty()) return absl::InvalidArgumentError("no input files");
  if (opt.json_keys.empty()) return absl::InvalidArgumentError("no --json-keys");
  if (opt.partitions < 1) return absl::InvalidArgumentError("--partitions must be >= 1");
  const auto t_start = std::chrono::steady_clock::now();
  const int workers = std::max(1, opt.workers);
  const size_t nkeys = opt.json_keys.size();
  const DType dtype = OptimalDType(tok.vocab_size());

  // Round-robin partitions change the document order (line k goes to partition k mod P, then
  // the partitions are concatenated); contiguous ones (--keep-sequential-samples) do not.
  const int nparts = (opt.partitions > 1 && !opt.keep_sequential_samples) ? opt.partitions : 1;
  std::vector<std::vector<std::unique_ptr<IndexedDatasetBuilder>>> builders(nparts);
  auto part_prefix = [&](int p, size_t k) {
    std::string final_prefix = OutputPrefixFor(opt.output_prefix, opt.json_keys[k]);
    return nparts == 1 ? final_prefix : fmt::format("{}.ptk-part{}", final_prefix, p);
  };
  // Resume record: one run's, beside the first key's output; removed whenever this call returns
  // (success or error: an unfinished builder's temporary is gone then), so only a killed run
  // leaves one.
  const bool resumable = nparts == 1 && opt.resume_interval_s > 0 &&
                         std::find(opt.inputs.begin(), opt.inputs.end(), "-") == opt.inputs.end();
  const std::string journal = OutputPrefixFor(opt.output_prefix, opt.json_keys[0]) + ".ptk-resume";
  std::optional<ResumeState> resume;
  std::string fingerprint;
  if (resumable) {
    fingerprint = ResumeFingerprint(opt, tok);
    if (PathExists(journal)) {
      auto r = ParseResume(journal);
      if (r.ok() && r->fingerprint == fingerprint && r->builders.size() == nkeys &&
          r->tallies.size() == opt.inputs.size() && r->next.file >= 0 &&
          r->next.file <= static_cast<int64_t>(opt.inputs.size()))
        resume = std::move(*r);
      else
        log::Warning("{}: {}; starting over", journal,
                     r.ok() ? "left by a run with other inputs or settings" : StatusMessage(r.status()));
    }
  }
  if (resume) {
    for (size_t k = 0; k < nkeys; ++k) {
      auto b = IndexedDatasetBuilder::Resume(part_prefix(0, k), dtype, resume->builders[k]);
      if (!b.ok()) {
        if (IsOutputBusy(b.status())) return b.status();
        log::Warning("cannot resume ({}); starting over", StatusMessage(b.status()));
        builders[0].clear();
        resume.reset();
        break;
      }
      builders[0].push_back(std::move(*b));
    }
  }
  if (!resume) {
    for (int p = 0; p < nparts; ++p)
      for (size_t k = 0; k < nkeys; ++k) {
        PTK_ASSIGN_OR_RETURN(auto b, IndexedDatasetBuilder::Create(part_prefix(p, k), dtype));
        builders[p].push_back(std::move(b));
      }
  }
  if (resumable) RemoveStaleTemporaries(journal);  // a record being written when a run was killed
  struct RemoveJournal {
    const std::string& path;
    bool active;
    ~RemoveJournal() {
      if (active) (void)RemoveFileIfExists(path);
    }
  } remove_journal{journal, resumable};

  uint64_t total_raw = 0;
  for (const auto& f : opt.inputs) {
    struct stat st;
    if (f != "-" && ::stat(f.c_str(), &st) == 0) total_raw += static_cast<uint64_t>(st.st_size);
  }
  ProgressReporter progress(
      {.label = "tokenize", .item_unit = "docs", .bytes_total = total_raw, .enabled = opt.progress});

  if (opt.megatron_log) {  // --quiet is quiet
    std::printf("Processing data with %d workers.\n", workers);
    std::fflush(stdout);
  }
  // The caller's --workers, in an arena of this call's own: no process-wide oneTBB setting.
  tbb::task_arena arena(workers);
  tbb::enumerable_thread_specific<std::unique_ptr<Worker>> tls;
  LineReader reader(opt.inputs, opt.batch_bytes, resume ? resume->next : ReadPoint{}, opt.megatron_log);
  TokenizeStats stats;
  std::vector<FileTally> tallies(opt.inputs.size());
  if (resume) {
    stats = resume->stats;
    for (size_t f = 0; f < tallies.size(); ++f) {
      tallies[f].documents = resume->tallies[f].first;
      tallies[f].bad = resume->tallies[f].second;
    }
    log::Info("resuming a killed run from {}:{} ({} documents already written)",
              resume->next.file < static_cast<int64_t>(opt.inputs.size()) ? opt.inputs[resume->next.file] : "the end",
              resume->next.line_no, stats.documents);
  }
  auto last_resume_point = std::chrono::steady_clock::now();
  // One status per serial stage: oneTBB may run the reader and the sink at the same time.
  absl::Status read_error, sink_error;
  std::atomic<bool> stop{false};
  int warnings = 0;
  const auto proc_start = std::chrono::steady_clock::now();
  const int32_t eod = tok.eod();

  auto report_bad = [&](const Batch& b, size_t i) {
    const std::string where = fmt::format("{}:{}", reader.file_name(b.file), b.first_line_no + static_cast<int64_t>(i));
    if (opt.strict) {
      sink_error = absl::InvalidArgumentError(
          fmt::format("{}: bad record ({}): {}", where, RecordStatusName(b.status[i]), b.messages[i]));
      stop = true;
      return;
    }
    if (warnings < opt.max_warnings) {
      log::Warning("{}: skipped bad record ({}): {}", where, RecordStatusName(b.status[i]), b.messages[i]);
      if (++warnings == opt.max_warnings) log::Warning("further bad records are counted but not shown");
    }
  };

  arena.execute([&] {
    tbb::parallel_pipeline(
        static_cast<size_t>(2 * workers + 2),
        tbb::make_filter<void, Batch*>(tbb::filter_mode::serial_in_order, [&](tbb::flow_control& fc) -> Batch* {
          // oneTBB orders the calls of a serial stage and hands batches on; TSan cannot see how.
          PTK_HAPPENS_AFTER(&reader);
          struct Mark {
            const LineReader* r;
            ~Mark() { PTK_HAPPENS_BEFORE(r); }
          } mark{&reader};
          if (stop) {
            fc.stop();
            return nullptr;
          }
          auto next = reader.Next();
          if (!next.ok()) {
            read_error = next.status();
            stop = true;
            fc.stop();
            return nullptr;
          }
          if (!*next) {
            fc.stop();
            return nullptr;
          }
          progress.AddBytes((*next)->raw_bytes);
          PTK_HAPPENS_BEFORE(next->get());
          return next->release();
        }) & tbb::make_filter<Batch*, Batch*>(tbb::filter_mode::parallel, [&](Batch* b) -> Batch* {
          PTK_HAPPENS_AFTER(b);
          if (stop) {
            PTK_HAPPENS_BEFORE(b);
            return b;
          }
          auto& w = tls.local();
          if (!w) w = std::make_unique<Worker>(tok, opt);
          EncodeBatch(*b, *w, opt, eod);
          PTK_HAPPENS_BEFORE(w.get());
          PTK_HAPPENS_BEFORE(b);
          return b;
        }) & tbb::make_filter<Batch*, void>(tbb::filter_mode::serial_in_order, [&](Batch* raw) {
          PTK_HAPPENS_AFTER(raw);
          PTK_HAPPENS_AFTER(&stats);
          struct Mark {
            const TokenizeStats* s;
            ~Mark() { PTK_HAPPENS_BEFORE(s); }
          } mark{&stats};
          std::unique_ptr<Batch> b(raw);
          if (stop) return;
          stats.lines += static_cast<int64_t>(b->lines.size());
          stats.bytes += b->size;
          stats.chars += b->chars;
          stats.invalid_utf8 += b->invalid_utf8;
          stats.lone_surrogates += b->lone_surrogates;
          std::vector<size_t> tok_off(nkeys, 0), seq_off(nkeys, 0), doc_off(nkeys, 0);
          FileTally& tally = tallies[static_cast<size_t>(b->file)];
          for (size_t i = 0; i < b->lines.size(); ++i) {
            const std::string_view line(b->data.get() + b->lines[i].off, b->lines[i].len);
            if (tally.first_line.empty() && b->status[i] != RecordStatus::kBlank)
              tally.first_line = std::string(line.substr(0, 256));
            if (b->status[i] != RecordStatus::kOk) {
              ++stats.skipped;
              ++stats.skipped_by_kind[static_cast<int>(b->status[i])];
              if (b->status[i] != RecordStatus::kBlank) {
                ++tally.bad;
                if (tally.first_bad.empty())
                  tally.first_bad = fmt::format("{}:{}: {}", reader.file_name(b->file),
                                                b->first_line_no + static_cast<int64_t>(i), b->messages[i]);
                if (b->status[i] == RecordStatus::kMissingKey && tally.keys_seen.empty())
                  tally.keys_seen = TopLevelKeys(line);
              }
              report_bad(*b, i);
              if (stop) return;
              continue;
            }
            ++tally.documents;
            if (opt.strict && b->replaced[i]) {
              sink_error = absl::InvalidArgumentError(
                  fmt::format("{}:{}: invalid UTF-8 or a lone surrogate escape replaced by U+FFFD (--strict)",
                              reader.file_name(b->file), b->first_line_no + static_cast<int64_t>(i)));
              stop = true;
              return;
            }
            const int p = nparts == 1 ? 0 : static_cast<int>((b->first_global_line + static_cast<int64_t>(i)) % nparts);
            bool empty = true;
            for (size_t k = 0; k < nkeys; ++k) {
              int32_t nseq = b->doc_nseq[k][doc_off[k]++];
              int64_t ntok = 0;
              for (int32_t s = 0; s < nseq; ++s) ntok += b->seq_lens[k][seq_off[k] + s];
              std::span<const int32_t> t(b->tokens[k].data() + tok_off[k], static_cast<size_t>(ntok));
              std::span<const int32_t> l(b->seq_lens[k].data() + seq_off[k], static_cast<size_t>(nseq));
              absl::Status st = builders[p][k]->AddDocument(t, l);
              if (!st.ok()) {
                sink_error = st;
                stop = true;
                return;
              }
              tok_off[k] += static_cast<size_t>(ntok);
              seq_off[k] += static_cast<size_t>(nseq);
              stats.tokens += ntok;
              if (ntok > 0) empty = false;
            }
            if (empty) ++stats.empty_documents;
            ++stats.documents;
            progress.AddItems(1);
            if (opt.megatron_log && opt.log_interval > 0 && stats.documents % opt.log_interval == 0) {
              double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - proc_start).count();
              log::Raw(fmt::format("Processed {} documents ({} docs/s, {} MB/s).", stats.documents,
                                   py::FloatRepr(stats.documents / el), py::FloatRepr(stats.chars / el / 1024 / 1024)));
            }
          }
          if (resumable &&
              std::chrono::duration<double>(std::chrono::steady_clock::now() - last_resume_point).count() >=
                  opt.resume_interval_s) {
            // Everything up to the end of this batch is in the builders: record where to go on.
            const int64_t n = static_cast<int64_t>(b->lines.size());
            ResumeState r;
            r.fingerprint = fingerprint;
            r.next = b->last_of_file
                         ? ReadPoint{b->file + 1, 0, 1, b->first_global_line + n}
                         : ReadPoint{b->file, b->file_offset + b->size, b->first_line_no + n, b->first_global_line + n};
            r.stats = stats;
            for (const auto& t : tallies) r.tallies.emplace_back(t.documents, t.bad);
            absl::Status st;
            for (size_t k = 0; k < nkeys && st.ok(); ++k) {
              auto cp = builders[0][k]->Checkpoint();
              if (cp.ok())
                r.builders.push_back(std::move(*cp));
              else
                st = cp.status();
            }
            if (st.ok()) st = WriteFileAtomic(journal, SerializeResume(r));
            if (!st.ok()) {
              sink_error = st;
              stop = true;
              return;
            }
            last_resume_point = std::chrono::steady_clock::now();
          }
        }));
  });
  PTK_HAPPENS_AFTER(&reader);
  PTK_HAPPENS_AFTER(&stats);
  for (auto& w : tls) PTK_HAPPENS_AFTER(w.get());
  progress.Finish();
  // Builders are destroyed unfinalized on error: their temporaries are removed.
  if (!sink_error.ok()) return sink_error;  // about earlier lines than a later read error
  if (!read_error.ok()) return read_error;
  PTK_RETURN_IF_ERROR(CheckInputsWereRead(opt, reader, tallies));

  std::vector<std::string> finals;
  for (size_t k = 0; k < nkeys; ++k) finals.push_back(OutputPrefixFor(opt.output_prefix, opt.json_keys[k]));
  if (nparts == 1) {
    for (size_t k = 0; k < nkeys; ++k) PTK_RETURN_IF_ERROR(builders[0][k]->Finalize());
  } else {
    for (size_t k = 0; k < nkeys; ++k) {
      std::vector<std::string> parts;
      for (int p = 0; p < nparts; ++p) {
        PTK_RETURN_IF_ERROR(builders[p][k]->Finalize());
        parts.push_back(part_prefix(p, static_cast<int>(k)));
      }
      PTK_RETURN_IF_ERROR(MergeDatasets(parts, finals[k]).status());
      for (const auto& part : parts) PTK_RETURN_IF_ERROR(RemoveIndexedDataset(part));
    }
  }
  stats.outputs = finals;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return stats;
}

}  // namespace ptk
