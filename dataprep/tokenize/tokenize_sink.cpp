// ptk-tokenize's last stage: documents into the .bin/.idx builders, counters, resume points,
// the final checks.
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <utility>

#include <fmt/core.h>

#include "absl/strings/ascii.h"

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/mmap_file.h"
#include "common/output_lock.h"
#include "common/py_format.h"
#include "common/status.h"
#include "dataprep/tokenize/tokenize_stages.h"
#include "tokenizer/pretokenizer.h"

namespace ptk::tokenize_detail {
namespace {

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
  // Text that is no JSON at all (a .txt corpus, WikiExtractor without --json): what a record is.
  if (!first.empty() && first.front() != '{' && first.front() != '"')
    return fmt::format(
        "; it looks like plain text, not JSON lines: each line must be one JSON object holding the "
        "text under --json-keys ({{\"{}\": \"...\"}})",
        opt.json_keys.front());
  return "";
}

// More records could not be read than --max-bad-fraction allows.
bool TooManyBad(int64_t bad, int64_t records, double max_bad_fraction) {
  return bad > 0 && static_cast<double>(bad) > max_bad_fraction * static_cast<double>(records);
}

// Input f, read to its end, gave a document.
absl::Status CheckFileWasRead(const TokenizeOptions& opt, const FileTally& t, size_t f) {
  if (t.documents > 0) return absl::OkStatus();
  const std::string& name = opt.inputs[f];
  if (t.bad == 0 && t.blank > 0)  // a file of blank lines is not an empty one
    return absl::FailedPreconditionError(
        fmt::format("{}: no document in it ({} blank line{}, nothing else)", name, t.blank, t.blank == 1 ? "" : "s"));
  if (t.bad == 0) return absl::FailedPreconditionError(fmt::format("{}: no document in it (empty file)", name));
  return absl::FailedPreconditionError(
      fmt::format("{}: no document could be read: {} records, none usable{}; first: {}", name, t.bad,
                  LikelyCause(t, opt), log::Printable(t.first_bad)));
}

absl::Status CheckInputsWereRead(const TokenizeOptions& opt, const std::vector<FileTally>& tallies) {
  int64_t docs = 0, bad = 0;
  std::string first_bad;
  for (size_t f = 0; f < tallies.size(); ++f) {
    const FileTally& t = tallies[f];
    docs += t.documents;
    bad += t.bad;
    if (first_bad.empty()) first_bad = t.first_bad;
    PTK_RETURN_IF_ERROR(CheckFileWasRead(opt, t, f));
  }
  if (TooManyBad(bad, docs + bad, opt.max_bad_fraction))
    return absl::FailedPreconditionError(
        fmt::format("{} of {} records ({:.2f}%) could not be read, more than --max-bad-fraction {}; first: {}", bad,
                    docs + bad, 100.0 * static_cast<double>(bad) / static_cast<double>(docs + bad),
                    opt.max_bad_fraction, log::Printable(first_bad)));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- resume record
// PREFIX.ptk-resume and its index log (ResumeJournal, tokenize_resume.cpp).

// What must be equal for a rerun (or a resume) to give the same bytes, in parts a rerun can name:
// - the inputs: each by name, size and modification time (make's and rsync's quick check; an
//   input rewritten in place with its size and time kept is not seen: --force tokenizes again); the
//   name made absolute and normal, so that my.jsonl, ./my.jsonl and /data/my.jsonl (or a run from
//   another directory) are one input, not a change that tokenizes again;
// - the settings that change the ids or the outputs: the keys, --append-eod, <|endoftext|>
//   handling (and, for a published output, the partition order). Not --strict: it changes no byte
//   of an output (a --strict run fails where the other would skip or repair, and else writes the
//   same bytes); a published output records whether it is clean (nothing skipped or repaired), and
//   a resumed run's counters say whether the part already written is.
// - the tokenizer: the content of vocab.json and of merges.txt (Gpt2Tokenizer's XXH3-128 of each),
//   so a changed tokenizer is never missed, whatever its files' sizes and times.
// XXH3-128, not SHA-256: a content check, not a security one, and OpenSSL's first use costs
// milliseconds of start-up (a quarter of a small run's).
std::string InputsText(const TokenizeOptions& opt) {
  std::string s;
  for (const auto& f : opt.inputs) {
    struct stat st {};
    (void)::stat(f.c_str(), &st);
    std::error_code ec;
    const std::filesystem::path abs = std::filesystem::absolute(f, ec);
    const std::string name = f == "-" || ec ? f : abs.lexically_normal().string();
    s += fmt::format("{}\t{}\t{}.{}\n", name, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  }
  return s;
}
std::string SettingsText(const TokenizeOptions& opt) {
  std::string s;
  for (const auto& k : opt.json_keys) s += "key " + k + "\n";
  s += fmt::format("append_eod {} endoftext_as_text {}\n", opt.append_eod, opt.endoftext_as_text);
  return s;
}
std::string ResumeFingerprint(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  return Xxh3Hex(fmt::format("ptk-tokenize resume v3\n{}{}vocab {}\nmerges {}\n", InputsText(opt), SettingsText(opt),
                             tok.vocab_hash(), tok.merges_hash()));
}

}  // namespace

namespace {
constexpr std::string_view kSourceTag = "ptk-tokenize v4";
// The parts of an OutputSource, by name ("inputs" -> hash), or empty when `source` is not one.
std::map<std::string, std::string> SourceParts(std::string_view source) {
  std::map<std::string, std::string> parts;
  if (!source.starts_with(kSourceTag)) return parts;
  for (std::string_view rest = source.substr(kSourceTag.size()); !rest.empty();) {
    rest.remove_prefix(std::min(rest.size(), rest.find_first_not_of(' ')));
    const std::string_view item = rest.substr(0, rest.find(' '));
    rest.remove_prefix(item.size());
    const size_t colon = item.find(':');
    if (colon != std::string_view::npos)
      parts[std::string(item.substr(0, colon))] = std::string(item.substr(colon + 1));
  }
  return parts;
}
}  // namespace

std::string OutputSource(const TokenizeOptions& opt, const Gpt2Tokenizer& tok) {
  if (std::find(opt.inputs.begin(), opt.inputs.end(), "-") != opt.inputs.end()) return "";
  const int order = opt.partitions > 1 && !opt.keep_sequential_samples ? opt.partitions : 1;
  return fmt::format("{} inputs:{} settings:{} vocab:{} merges:{}", kSourceTag, Xxh3Hex(InputsText(opt)),
                     Xxh3Hex(fmt::format("{}round-robin {}\n", SettingsText(opt), order)), tok.vocab_hash(),
                     tok.merges_hash());
}

namespace {
struct Outcome {
  int64_t bad = 0, records = 0;
  bool clean = false;  // nothing skipped (blank lines included), nothing replaced: what --strict needs
};
// The outcome of a recorded source ("... bad:B/N clean:C"), when it is `source` with one.
std::optional<Outcome> RecordedOutcome(std::string_view recorded, std::string_view source) {
  if (source.empty() || !recorded.starts_with(source) || !recorded.substr(source.size()).starts_with(" bad:"))
    return std::nullopt;
  const std::string_view tail = recorded.substr(source.size() + 5);
  Outcome o{-1, -1, false};
  const char* end = tail.data() + tail.size();
  auto [slash, e1] = std::from_chars(tail.data(), end, o.bad);
  if (e1 != std::errc() || slash == end || *slash != '/') return std::nullopt;
  auto [last, e2] = std::from_chars(slash + 1, end, o.records);
  if (e2 != std::errc() || o.bad < 0 || o.records < o.bad) return std::nullopt;
  const std::string_view clean(last, static_cast<size_t>(end - last));
  if (clean != " clean:0" && clean != " clean:1") return std::nullopt;
  o.clean = clean == " clean:1";
  return o;
}
}  // namespace

std::string SourceWithOutcome(const std::string& source, int64_t bad, int64_t records, bool clean) {
  return source.empty() ? "" : fmt::format("{} bad:{}/{} clean:{:d}", source, bad, records, clean);
}

bool OutputUpToDate(const std::string& prefix, const std::string& source, const TokenizeOptions& opt,
                    int64_t* documents, int64_t* tokens) {
  if (PathExists(prefix + ".ptk-resume")) return false;
  const std::optional<std::string> recorded = RecordedSource(prefix);
  if (!recorded) return false;
  const auto o = RecordedOutcome(*recorded, source);
  return o && !TooManyBad(o->bad, o->records, opt.max_bad_fraction) && (o->clean || !opt.strict) &&
         DatasetMadeFrom(prefix, *recorded, documents, tokens);
}

std::string RerunReason(const std::string& prefix, const std::string& source, const TokenizeOptions& opt) {
  if (PathExists(prefix + ".ptk-resume")) return "";  // a killed run's: Open says whether it resumes
  const bool outputs = PathExists(BinPath(prefix)) || PathExists(IdxPath(prefix));
  const std::optional<std::string> recorded = RecordedSource(prefix);
  if (!recorded) {
    if (!outputs) return "";  // a first run
    return fmt::format("{}: tokenizing again: no .ptk-done sidecar records what its .bin/.idx were made from", prefix);
  }
  if (source.empty())
    return fmt::format("{}: tokenizing again: the input is standard input, which a rerun cannot compare", prefix);
  std::map<std::string, std::string> was = SourceParts(*recorded);
  const bool has_outcome = was.erase("bad") == 1 && was.erase("clean") == 1;
  const auto now = SourceParts(source);
  if (!has_outcome || was.size() != now.size() || was.empty())
    return fmt::format("{}: tokenizing again: its .ptk-done sidecar is from another ptk version or tool", prefix);
  static const std::pair<const char*, const char*> kWhat[] = {
      {"vocab", "the vocabulary file's content (--vocab-file)"},
      {"merges", "the merges file's content (--merge-file)"},
      {"inputs", "the inputs (a name, size or modification time)"},
      {"settings", "the settings that change the output (--json-keys, --append-eod, --partitions, ...)"},
  };
  std::string changed;
  for (const auto& [part, what] : kWhat) {
    const auto w = std::as_const(was).find(part);
    const auto n = now.find(part);
    if (w == was.end() || n == now.end() || w->second != n->second)
      changed += fmt::format("{}{}", changed.empty() ? "" : "; ", what);
  }
  if (!changed.empty()) return fmt::format("{}: tokenizing again: changed since it was made: {}", prefix, changed);
  const auto o = RecordedOutcome(*recorded, source);
  if (o && TooManyBad(o->bad, o->records, opt.max_bad_fraction))
    return fmt::format("{}: tokenizing again: {} of its {} records could not be read, more than --max-bad-fraction {}",
                       prefix, o->bad, o->records, opt.max_bad_fraction);
  if (o && opt.strict && !o->clean)
    return fmt::format(
        "{}: tokenizing again: --strict, and lines were skipped or characters replaced when it was made without it",
        prefix);
  return fmt::format("{}: tokenizing again: its .bin/.idx are not the sizes its .ptk-done sidecar records", prefix);
}

void RemoveStaleResumeRecord(const std::string& final_prefix) {
  const std::string record = final_prefix + ".ptk-resume";
  if (!PathExists(record) && !PathExists(record + "-index")) return;
  RemoveStaleTemporaries(record);
  ResumeJournal(record).Remove();
  log::Info("{}: removed a killed run's resume record, which the output replaces", record);
}

namespace {

// The documents a builder has written (its checkpoint: the flushed temporary .bin, the lengths and
// document indices) in `order`, as the dataset `final_prefix` (its sidecar recording `source`).
absl::Status WriteInOrder(const BuilderCheckpoint& in, DType dtype, const std::string& final_prefix,
                          const std::vector<int64_t>& order, const std::string& source,
                          std::chrono::milliseconds lock_wait) {
  const size_t isz = DTypeSize(dtype);
  std::vector<uint64_t> seq_start(in.lengths.size() + 1, 0);  // token offsets
  for (size_t s = 0; s < in.lengths.size(); ++s) seq_start[s + 1] = seq_start[s] + static_cast<uint64_t>(in.lengths[s]);
  if (in.doc_idx.size() != order.size() + 1 || seq_start.back() * isz != in.bin_bytes)
    return absl::InternalError(fmt::format("{}: {} documents and {} bytes, {} documents expected", in.bin_tmp,
                                           in.doc_idx.size() - 1, in.bin_bytes, order.size()));
  std::unique_ptr<MappedFile> bin;
  if (in.bin_bytes > 0) {
    PTK_ASSIGN_OR_RETURN(bin, MappedFile::Open(in.bin_tmp, MappedFile::Advice::kRandom));
    if (bin->size() < in.bin_bytes)
      return absl::DataLossError(fmt::format("{}: {} bytes, {} written", in.bin_tmp, bin->size(), in.bin_bytes));
  }
  PTK_ASSIGN_OR_RETURN(auto out, IndexedDatasetBuilder::Create(final_prefix, dtype, false, lock_wait));
  RemoveStaleResumeRecord(final_prefix);  // the output's lock is ours now
  std::vector<int32_t> tokens;
  for (const int64_t d : order) {
    const int64_t s0 = in.doc_idx[d], s1 = in.doc_idx[d + 1];
    const uint64_t t0 = seq_start[s0], t1 = seq_start[s1];
    tokens.resize(t1 - t0);
    for (uint64_t t = t0; t < t1; ++t)
      tokens[t - t0] = static_cast<int32_t>(LoadToken(bin->data(), static_cast<int64_t>(t), dtype));
    PTK_RETURN_IF_ERROR(out->AddDocument(tokens, std::span<const int32_t>(in.lengths.data() + s0, s1 - s0)));
  }
  out->SetSource(source);
  return out->Finalize();
}
}  // namespace

DocumentSink::DocumentSink(const TokenizeOptions& opt, const Gpt2Tokenizer& tok, ProgressReporter& progress)
    : opt_(opt),
      tok_(tok),
      progress_(progress),
      nkeys_(opt.json_keys.size()),
      // Round-robin partitions change the document order (line k goes to partition k mod P, then
      // the partitions are concatenated); contiguous ones (--keep-sequential-samples) do not.
      nparts_((opt.partitions > 1 && !opt.keep_sequential_samples) ? opt.partitions : 1),
      resumable_(nparts_ == 1 && opt.resume_interval_s > 0 &&
                 std::find(opt.inputs.begin(), opt.inputs.end(), "-") == opt.inputs.end()),
      journal_(OutputPrefixFor(opt.output_prefix, opt.json_keys[0]) + ".ptk-resume"),
      source_(OutputSource(opt, tok)),
      builders_(1),
      tallies_(opt.inputs.size()) {}

DocumentSink::~DocumentSink() {
  // Success or error, this run is over: its record goes (an unfinished builder's temporary, which
  // the record names, is removed by the builder). Only a killed run leaves one.
  if (journal_owned_) journal_.Remove();
}

std::string DocumentSink::StagingPrefix(size_t key) const {
  const std::string final_prefix = OutputPrefixFor(opt_.output_prefix, opt_.json_keys[key]);
  return nparts_ == 1 ? final_prefix : final_prefix + ".ptk-inorder";
}

absl::StatusOr<ReadPoint> DocumentSink::Open() {
  const DType dtype = OptimalDType(tok_.vocab_size());
  std::optional<ResumeState> resume;
  if (resumable_) {
    fingerprint_ = ResumeFingerprint(opt_, tok_);
    if (PathExists(journal_.path())) {
      auto r = journal_.Read();
      const bool clean = r.ok() && r->stats.skipped == 0 && r->stats.invalid_utf8 == 0 && r->stats.lone_surrogates == 0;
      if (r.ok() && r->fingerprint == fingerprint_ && r->builders.size() == nkeys_ &&
          r->tallies.size() == opt_.inputs.size() && r->next.file >= 0 &&
          r->next.file <= static_cast<int64_t>(opt_.inputs.size()) && (clean || !opt_.strict))
        resume = std::move(*r);
      else
        log::Warning("{}: {}; starting over", journal_.path(),
                     !r.ok() ? StatusMessage(r.status())
                     : clean || r->fingerprint != fingerprint_
                         ? "left by a run with other inputs or settings"
                         : "--strict, and the killed run without it skipped lines or replaced characters");
    }
  }
  if (resume) {
    for (size_t k = 0; k < nkeys_; ++k) {
      auto b = IndexedDatasetBuilder::Resume(StagingPrefix(k), dtype, resume->builders[k], opt_.lock_wait);
      if (!b.ok()) {
        if (IsOutputBusy(b.status())) return b.status();  // another run's: its record is not ours
        log::Warning("cannot resume ({}); starting over", StatusMessage(b.status()));
        builders_[0].clear();
        resume.reset();
        break;
      }
      builders_[0].push_back(std::move(*b));
    }
  }
  if (!resume) {
    for (size_t k = 0; k < nkeys_; ++k) {
      PTK_ASSIGN_OR_RETURN(auto b, IndexedDatasetBuilder::Create(StagingPrefix(k), dtype, false, opt_.lock_wait));
      builders_[0].push_back(std::move(b));
    }
  }
  // The builders hold the outputs' locks: the record is ours from here on, and any other beside
  // them is a killed run's (with round-robin partitions they hold the in-order datasets' locks:
  // WriteInOrder removes those records).
  for (size_t k = 0; k < nkeys_ && nparts_ == 1; ++k)
    if (k > 0 || !resumable_) RemoveStaleResumeRecord(StagingPrefix(k));
  journal_owned_ = resumable_;
  if (resumable_) {
    RemoveStaleTemporaries(journal_.path());  // a record being written when a run was killed
    PTK_RETURN_IF_ERROR(journal_.Start(resume ? &*resume : nullptr));
  }
  if (!resume) return ReadPoint{};
  stats_ = resume->stats;
  for (size_t f = 0; f < tallies_.size(); ++f) {
    tallies_[f].documents = resume->tallies[f].first;
    tallies_[f].bad = resume->tallies[f].second;
  }
  log::Info("resuming a killed run from {}:{} ({} documents already written)",
            resume->next.file < static_cast<int64_t>(opt_.inputs.size()) ? opt_.inputs[resume->next.file] : "the end",
            resume->next.line_no, stats_.documents);
  return resume->next;
}

absl::Status DocumentSink::ReportBad(const Batch& b, size_t i) {
  const std::string where = fmt::format("{}:{}", opt_.inputs[b.file], b.first_line_no + static_cast<int64_t>(i));
  if (opt_.strict)
    return absl::InvalidArgumentError(
        fmt::format("{}: bad record ({}): {}", where, RecordStatusName(b.status[i]), b.messages[i]));
  if (warnings_ < opt_.max_warnings) {
    log::Warning("{}: skipped bad record ({}): {}", where, RecordStatusName(b.status[i]), b.messages[i]);
    if (++warnings_ == opt_.max_warnings) log::Warning("further bad records are counted but not shown");
  }
  return absl::OkStatus();
}

// Line i of b, a good record: one document per key. `offsets` walks b's per-key results
// ([0, nkeys): ids, [nkeys, 2 nkeys): sequence lengths, [2 nkeys, 3 nkeys): documents).
absl::Status DocumentSink::AddDocument(const Batch& b, size_t i, std::vector<size_t>& offsets) {
  if (nparts_ > 1) doc_lines_.push_back(b.first_global_line + static_cast<int64_t>(i));
  bool empty = true;
  for (size_t k = 0; k < nkeys_; ++k) {
    size_t& tok_off = offsets[k];
    size_t& seq_off = offsets[nkeys_ + k];
    size_t& doc_off = offsets[2 * nkeys_ + k];
    const int32_t nseq = b.doc_nseq[k][doc_off++];
    int64_t ntok = 0;
    for (int32_t s = 0; s < nseq; ++s) ntok += b.seq_lens[k][seq_off + s];
    std::span<const int32_t> t(b.tokens[k].data() + tok_off, static_cast<size_t>(ntok));
    std::span<const int32_t> l(b.seq_lens[k].data() + seq_off, static_cast<size_t>(nseq));
    PTK_RETURN_IF_ERROR(builders_[0][k]->AddDocument(t, l));
    tok_off += static_cast<size_t>(ntok);
    seq_off += static_cast<size_t>(nseq);
    stats_.tokens += ntok;
    if (ntok > 0) empty = false;
  }
  if (empty) ++stats_.empty_documents;
  ++stats_.documents;
  progress_.AddItems(1);
  if (opt_.megatron_log && opt_.log_interval > 0 && stats_.documents % opt_.log_interval == 0) {
    // The status line first, so that the log line below redraws it saying what the log line says
    // (not the count of its last periodic redraw).
    progress_.Refresh();
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    log::Raw(fmt::format("Processed {} documents ({} docs/s, {} MB/s).", stats_.documents,
                         py::FloatRepr(stats_.documents / el), py::FloatRepr(stats_.chars / el / 1024 / 1024)));
  }
  return absl::OkStatus();
}

absl::Status DocumentSink::Consume(const Batch& b) {
  stats_.lines += static_cast<int64_t>(b.lines.size());
  stats_.bytes += b.size;
  stats_.chars += b.chars;
  stats_.invalid_utf8 += b.invalid_utf8;
  stats_.lone_surrogates += b.lone_surrogates;
  std::vector<size_t> offsets(3 * nkeys_, 0);
  FileTally& tally = tallies_[static_cast<size_t>(b.file)];
  for (size_t i = 0; i < b.lines.size(); ++i) {
    const std::string_view line(b.data.get() + b.lines[i].off, b.lines[i].len);
    if (b.status[i] == RecordStatus::kBlank)
      ++tally.blank;
    else if (tally.first_line.empty())
      tally.first_line = std::string(line.substr(0, 256));
    if (b.status[i] != RecordStatus::kOk) {
      ++stats_.skipped;
      ++stats_.skipped_by_kind[static_cast<int>(b.status[i])];
      if (b.status[i] != RecordStatus::kBlank) {
        ++tally.bad;
        if (tally.first_bad.empty())
          tally.first_bad =
              fmt::format("{}:{}: {}", opt_.inputs[b.file], b.first_line_no + static_cast<int64_t>(i), b.messages[i]);
        if (b.status[i] == RecordStatus::kMissingKey && tally.keys_seen.empty()) tally.keys_seen = TopLevelKeys(line);
      }
      PTK_RETURN_IF_ERROR(ReportBad(b, i));
      continue;
    }
    ++tally.documents;
    if (opt_.strict && b.replaced[i])
      return absl::InvalidArgumentError(
          fmt::format("{}:{}: invalid UTF-8 or a lone surrogate escape replaced by U+FFFD (--strict)",
                      opt_.inputs[b.file], b.first_line_no + static_cast<int64_t>(i)));
    PTK_RETURN_IF_ERROR(AddDocument(b, i, offsets));
  }
  // An input that gave no document fails the run now, not after every later input is tokenized.
  if (b.last_of_file) PTK_RETURN_IF_ERROR(CheckFileWasRead(opt_, tally, static_cast<size_t>(b.file)));
  if (resumable_ && std::chrono::duration<double>(std::chrono::steady_clock::now() - last_resume_point_).count() >=
                        opt_.resume_interval_s)
    PTK_RETURN_IF_ERROR(WriteResumePoint(b));
  return absl::OkStatus();
}

// Everything up to the end of b is in the builders: record where to go on.
absl::Status DocumentSink::WriteResumePoint(const Batch& b) {
  const int64_t n = static_cast<int64_t>(b.lines.size());
  ResumeState r;
  r.fingerprint = fingerprint_;
  r.next = b.last_of_file ? ReadPoint{b.file + 1, 0, 1, b.first_global_line + n}
                          : ReadPoint{b.file, b.file_offset + b.size, b.first_line_no + n, b.first_global_line + n};
  r.stats = stats_;
  for (const auto& t : tallies_) r.tallies.emplace_back(t.documents, t.bad);
  for (size_t k = 0; k < nkeys_; ++k) {
    const auto [lengths, docs] = journal_.Logged(k);
    PTK_ASSIGN_OR_RETURN(auto cp, builders_[0][k]->Checkpoint(lengths, docs));
    r.builders.push_back(std::move(cp));
  }
  PTK_ASSIGN_OR_RETURN(const uint64_t written, journal_.Write(r));
  stats_.resume_bytes_written += written;
  ++stats_.resume_points;
  last_resume_point_ = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

absl::StatusOr<TokenizeStats> DocumentSink::Finish() {
  PTK_RETURN_IF_ERROR(CheckInputsWereRead(opt_, tallies_));
  // The sidecar records how many records could not be read, not the --max-bad-fraction they
  // passed: a rerun with another one that this output meets is up to date, one it does not is not.
  int64_t bad = 0, records = 0;
  for (const FileTally& t : tallies_) {
    bad += t.bad;
    records += t.documents + t.bad;
  }
  const bool clean = stats_.skipped == 0 && stats_.invalid_utf8 == 0 && stats_.lone_surrogates == 0;
  const std::string source = SourceWithOutcome(source_, bad, records, clean);
  std::vector<std::string> finals;
  for (size_t k = 0; k < nkeys_; ++k) finals.push_back(OutputPrefixFor(opt_.output_prefix, opt_.json_keys[k]));
  if (nparts_ == 1) {
    for (size_t k = 0; k < nkeys_; ++k) {
      builders_[0][k]->SetSource(source);
      PTK_RETURN_IF_ERROR(builders_[0][k]->Finalize());
    }
  } else {
    // Megatron's round-robin partitions: line g goes to partition g mod P, the partitions are
    // tokenized and concatenated in order. The same order is the documents (in input order) sorted,
    // stably, by their line's partition: one pass over what was written, whatever P (P builders,
    // one per partition, cost P files, fsyncs and open descriptors, however few the documents).
    std::vector<int64_t> order(doc_lines_.size());
    for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int64_t>(d);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return doc_lines_[a] % nparts_ < doc_lines_[b] % nparts_; });
    // The in-order datasets are never published: read back from their temporaries, which go with
    // their builders (a killed run's are removed by the next, as every writer's).
    for (size_t k = 0; k < nkeys_; ++k) {
      PTK_ASSIGN_OR_RETURN(const BuilderCheckpoint written, builders_[0][k]->Checkpoint());
      PTK_RETURN_IF_ERROR(WriteInOrder(written, builders_[0][k]->dtype(), finals[k], order, source, opt_.lock_wait));
      builders_[0][k]->Abort();
    }
  }
  stats_.outputs = finals;
  return stats_;
}

}  // namespace ptk::tokenize_detail
