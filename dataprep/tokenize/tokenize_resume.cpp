// ptk-tokenize's resume points: the record PREFIX.ptk-resume, rewritten atomically at each, and
// the index log PREFIX.ptk-resume-index it extends, appended to.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <fmt/core.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/status.h"
#include "dataprep/tokenize/tokenize_stages.h"

namespace ptk::tokenize_detail {
namespace {

// Version 3: the index entries live in the log, the record holds their counts (version 2 held
// them all, rewritten at every point: the I/O of a run grew with the square of its length).
// A record of another version is foreign: the run starts over.
constexpr std::string_view kResumeMagic = "PTKRESUME3\n";
constexpr size_t kFingerprintChars = 32;
constexpr size_t kHexChars = 32;  // Xxh3Hex

void PutI64(std::string& o, int64_t v) { o.append(reinterpret_cast<const char*>(&v), 8); }

// Reads little pieces off a byte string; `ok` goes false (and stays) at the first overrun.
struct Cursor {
  std::string_view data;
  size_t pos = 0;
  bool ok = true;
  int64_t I64() {
    if (!ok || pos + 8 > data.size()) {
      ok = false;
      return 0;
    }
    int64_t v;
    std::memcpy(&v, data.data() + pos, 8);
    pos += 8;
    return v;
  }
  size_t Count(int64_t limit) {
    const int64_t n = I64();
    if (n < 0 || n > limit) ok = false;
    return ok ? static_cast<size_t>(n) : 0;
  }
  // n items of `size` bytes into `out`.
  void Bytes(void* out, size_t n, size_t size) {
    if (!ok || n > (data.size() - pos) / size) {
      ok = false;
      return;
    }
    if (n > 0) std::memcpy(out, data.data() + pos, n * size);
    pos += n * size;
  }
};

std::string SerializeRecord(const ResumeState& r, const std::vector<std::pair<int64_t, int64_t>>& counts,
                            uint64_t log_bytes) {
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
  for (size_t k = 0; k < r.builders.size(); ++k) {
    const std::string name = Basename(r.builders[k].bin_tmp);
    PutI64(o, static_cast<int64_t>(name.size()));
    o += name;
    PutI64(o, static_cast<int64_t>(r.builders[k].bin_bytes));
    PutI64(o, r.builders[k].tokens);
    PutI64(o, counts[k].first);
    PutI64(o, counts[k].second);
  }
  PutI64(o, static_cast<int64_t>(log_bytes));
  o += Xxh3Hex(o);  // a damaged record is refused, not half-believed
  return o;
}

// The record; each builder's lengths and doc_idx sized to their counts (filled from the log).
absl::StatusOr<ResumeState> ParseRecord(const std::string& path, uint64_t* log_bytes) {
  PTK_ASSIGN_OR_RETURN(std::string data, ReadFileToString(path));
  auto bad = [&](const char* what) { return absl::DataLossError(fmt::format("{}: {}", path, what)); };
  if (data.size() < kResumeMagic.size() + kFingerprintChars + 1 + kHexChars ||
      data.compare(0, kResumeMagic.size(), kResumeMagic) != 0)
    return bad("not a ptk-tokenize resume record of this version");
  const std::string_view body(data.data(), data.size() - kHexChars);
  if (Xxh3Hex(body) != data.substr(body.size())) return bad("damaged (checksum)");
  ResumeState r;
  r.fingerprint = std::string(body.substr(kResumeMagic.size(), kFingerprintChars));
  if (body[kResumeMagic.size() + kFingerprintChars] != '\n') return bad("not a ptk-tokenize resume record");
  Cursor c{body, kResumeMagic.size() + kFingerprintChars + 1};
  r.next.file = c.I64();
  r.next.offset = static_cast<uint64_t>(c.I64());
  r.next.line_no = c.I64();
  r.next.global_line = c.I64();
  TokenizeStats& t = r.stats;
  for (int64_t* v : {&t.documents, &t.empty_documents, &t.tokens}) *v = c.I64();
  t.bytes = static_cast<uint64_t>(c.I64());
  t.chars = static_cast<uint64_t>(c.I64());
  for (int64_t* v : {&t.lines, &t.skipped, &t.invalid_utf8, &t.lone_surrogates}) *v = c.I64();
  for (int64_t& v : t.skipped_by_kind) v = c.I64();
  r.tallies.resize(c.Count(static_cast<int64_t>(body.size()) / 16));
  for (auto& [docs, badn] : r.tallies) {
    docs = c.I64();
    badn = c.I64();
  }
  r.builders.resize(c.Count(64));
  for (BuilderCheckpoint& b : r.builders) {
    std::string name(c.Count(4096), '\0');
    c.Bytes(name.data(), name.size(), 1);
    b.bin_tmp = JoinPath(Dirname(path), name);
    b.bin_bytes = static_cast<uint64_t>(c.I64());
    b.tokens = c.I64();
    b.lengths.resize(c.Count(int64_t{1} << 40));
    b.doc_idx.resize(c.Count(int64_t{1} << 40));
  }
  *log_bytes = static_cast<uint64_t>(c.I64());
  if (!c.ok || c.pos != body.size()) return bad("truncated or damaged");
  return r;
}

// The log's chunks up to `log_bytes`, each checked, into the builders' index arrays, which must
// come out exactly full.
absl::Status ReadIndexLog(const std::string& path, uint64_t log_bytes, std::vector<BuilderCheckpoint>* builders) {
  PTK_ASSIGN_OR_RETURN(std::string data, ReadFileToString(path));
  if (data.size() < log_bytes)
    return absl::DataLossError(fmt::format("{}: {} bytes, the record counts {}", path, data.size(), log_bytes));
  std::vector<std::pair<size_t, size_t>> filled(builders->size());
  Cursor c{std::string_view(data.data(), log_bytes)};
  while (c.ok && c.pos < log_bytes) {
    const size_t begin = c.pos;
    const size_t key = c.Count(static_cast<int64_t>(builders->size()) - 1);
    const size_t nlen = c.Count(static_cast<int64_t>(log_bytes) / 4),
                 ndoc = c.Count(static_cast<int64_t>(log_bytes) / 8);
    if (!c.ok) break;
    BuilderCheckpoint& b = (*builders)[key];
    auto& [lens, docs] = filled[key];
    if (lens + nlen > b.lengths.size() || docs + ndoc > b.doc_idx.size())
      return absl::DataLossError(fmt::format("{}: more index entries than the record counts", path));
    c.Bytes(b.lengths.data() + lens, nlen, 4);
    c.Bytes(b.doc_idx.data() + docs, ndoc, 8);
    if (!c.ok || c.pos + kHexChars > log_bytes) break;
    if (Xxh3Hex(std::string_view(data.data() + begin, c.pos - begin)) !=
        std::string_view(data.data() + c.pos, kHexChars))
      return absl::DataLossError(fmt::format("{}: damaged (checksum of the entries at byte {})", path, begin));
    c.pos += kHexChars;
    lens += nlen;
    docs += ndoc;
  }
  if (!c.ok || c.pos != log_bytes) return absl::DataLossError(fmt::format("{}: truncated or damaged", path));
  for (size_t k = 0; k < builders->size(); ++k)
    if (filled[k].first != (*builders)[k].lengths.size() || filled[k].second != (*builders)[k].doc_idx.size())
      return absl::DataLossError(fmt::format("{}: fewer index entries than the record counts", path));
  return absl::OkStatus();
}

}  // namespace

ResumeJournal::ResumeJournal(std::string record) : record_(std::move(record)), log_(record_ + "-index") {}

ResumeJournal::~ResumeJournal() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<ResumeState> ResumeJournal::Read() const {
  uint64_t log_bytes = 0;
  PTK_ASSIGN_OR_RETURN(ResumeState r, ParseRecord(record_, &log_bytes));
  PTK_RETURN_IF_ERROR(ReadIndexLog(log_, log_bytes, &r.builders));
  r.log_bytes = log_bytes;
  return r;
}

absl::Status ResumeJournal::Start(const ResumeState* resumed) {
  fd_ = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return ErrnoToStatus(errno, "open " + log_);
  log_bytes_ = resumed ? resumed->log_bytes : 0;
  // What a killed run appended after its last record is not part of it.
  if (::ftruncate(fd_, static_cast<off_t>(log_bytes_)) != 0 ||
      ::lseek(fd_, static_cast<off_t>(log_bytes_), SEEK_SET) < 0)
    return ErrnoToStatus(errno, "truncate " + log_);
  logged_.assign(resumed ? resumed->builders.size() : 0, {0, 0});
  if (resumed)
    for (size_t k = 0; k < logged_.size(); ++k)
      logged_[k] = {resumed->builders[k].lengths.size(), resumed->builders[k].doc_idx.size()};
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ResumeJournal::Write(const ResumeState& r) {
  logged_.resize(r.builders.size(), {0, 0});
  std::string chunks;
  for (size_t k = 0; k < r.builders.size(); ++k) {
    const BuilderCheckpoint& b = r.builders[k];  // the entries from logged_[k] on
    if (b.lengths.empty() && b.doc_idx.empty()) continue;
    const size_t begin = chunks.size();
    for (int64_t v :
         {static_cast<int64_t>(k), static_cast<int64_t>(b.lengths.size()), static_cast<int64_t>(b.doc_idx.size())})
      PutI64(chunks, v);
    chunks.append(reinterpret_cast<const char*>(b.lengths.data()), 4 * b.lengths.size());
    chunks.append(reinterpret_cast<const char*>(b.doc_idx.data()), 8 * b.doc_idx.size());
    chunks += Xxh3Hex(std::string_view(chunks).substr(begin));
  }
  PTK_RETURN_IF_ERROR(WriteAll(fd_, chunks.data(), chunks.size(), log_));
  PTK_RETURN_IF_ERROR(FsyncFile(fd_, log_));
  std::vector<std::pair<int64_t, int64_t>> counts;
  for (size_t k = 0; k < r.builders.size(); ++k) {
    logged_[k].first += r.builders[k].lengths.size();
    logged_[k].second += r.builders[k].doc_idx.size();
    counts.emplace_back(logged_[k].first, logged_[k].second);
  }
  log_bytes_ += chunks.size();
  const std::string record = SerializeRecord(r, counts, log_bytes_);
  PTK_RETURN_IF_ERROR(WriteFileAtomic(record_, record));
  return chunks.size() + record.size();
}

void ResumeJournal::Remove() {
  (void)RemoveFileIfExists(record_);  // first: a log without its record is never read
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  (void)RemoveFileIfExists(log_);
}

}  // namespace ptk::tokenize_detail
