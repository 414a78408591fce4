// ptk-tokenize's engine.
#include "dataprep/tokenize_pipeline.h"

#include <sys/stat.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>

#include <fmt/core.h>
#include <simdjson.h>

#include "absl/strings/ascii.h"

#include "common/file_util.h"
#include "common/happens_before.h"
#include "common/logging.h"
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

class LineReader {
 public:
  LineReader(const std::vector<std::string>& files, size_t batch_bytes) : files_(files), batch_bytes_(batch_bytes) {}

  // Next batch, nullptr at the end of all input.
  absl::StatusOr<std::unique_ptr<Batch>> Next() {
    while (true) {
      if (!src_) {
        if (file_ >= static_cast<int>(files_.size())) return std::unique_ptr<Batch>();
        PTK_ASSIGN_OR_RETURN(src_, OpenByteSource(files_[file_]));
        std::printf("Opening %s\n", files_[file_].c_str());
        std::fflush(stdout);
        line_no_ = 1;
        at_file_start_ = true;
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
  for (int p = 0; p < nparts; ++p)
    for (size_t k = 0; k < nkeys; ++k) {
      PTK_ASSIGN_OR_RETURN(auto b, IndexedDatasetBuilder::Create(part_prefix(p, k), dtype));
      builders[p].push_back(std::move(b));
    }

  uint64_t total_raw = 0;
  for (const auto& f : opt.inputs) {
    struct stat st;
    if (f != "-" && ::stat(f.c_str(), &st) == 0) total_raw += static_cast<uint64_t>(st.st_size);
  }
  ProgressReporter progress(
      {.label = "tokenize", .item_unit = "docs", .bytes_total = total_raw, .enabled = opt.progress});

  std::printf("Processing data with %d workers.\n", workers);
  std::fflush(stdout);
  // The caller's --workers, in an arena of this call's own: no process-wide oneTBB setting.
  tbb::task_arena arena(workers);
  tbb::enumerable_thread_specific<std::unique_ptr<Worker>> tls;
  LineReader reader(opt.inputs, opt.batch_bytes);
  TokenizeStats stats;
  std::vector<FileTally> tallies(opt.inputs.size());
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
