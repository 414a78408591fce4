// ptk-extract's engine.
#include "dataprep/extract/extract.h"

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/mmap_file.h"
#include "common/output_lock.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/status.h"
#include "common/utf8.h"
#include "dataprep/extract/set_filter.h"
#include "dataprep/input/byte_source.h"

namespace ptk {
namespace {

constexpr std::string_view kDoneSuffix = ".ptk-done";
// Written before an output is published and removed once its sidecar is: an output a kill (or a
// crash: the output's publish fsyncs their directory) left without a sidecar is still known to be
// ptk-extract's own. Its existence is what counts.
constexpr std::string_view kPendingSuffix = ".ptk-extracting";

// Whether ptk-extract wrote `output` (or was publishing it when it was killed): its sidecar or its
// pending record names a source. Anything else at that path is not overwritten without --force.
bool WrittenByExtract(const std::string& output) {
  if (PathExists(output + std::string(kPendingSuffix))) return true;
  auto side = ReadFileToString(output + std::string(kDoneSuffix));
  if (!side.ok()) return false;
  simdjson::dom::parser p;
  simdjson::dom::element e;
  std::string_view source;
  return !p.parse(*side).get(e) && !e["source"].get(source);
}

bool Occupied(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

struct SourceId {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
};

absl::StatusOr<SourceId> StatSource(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, fmt::format("stat {}", path));
  return SourceId{static_cast<uint64_t>(st.st_size),
                  static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

std::string DropKey(const std::vector<std::string>& drops) {
  std::string k;
  for (const auto& d : drops) k += (k.empty() ? "" : ",") + d;
  return k;
}

// An input by its absolute, normal name, as its output's sidecar records it: raw/x.zst, ./raw/x.zst and
// /data/raw/x.zst (or a rerun from another directory) are one source, not a change that extracts again.
std::string SourceName(const std::string& input) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(input, ec);
  return ec ? input : abs.lexically_normal().string();
}

// The sidecar written after an output is complete; a rerun skips the file when it still matches.
std::string SidecarJson(const std::string& input, const SourceId& src, uint64_t out_size, const std::string& sum,
                        const std::string& drops, int64_t records, int64_t dropped) {
  return JsonWriter()
             .BeginObject()
             .Field("source", SourceName(input))
             .Field("source_size", src.size)
             .Field("source_mtime_ns", src.mtime_ns)
             .Field("output_size", out_size)
             .Field("output_xxh3_128", sum)
             .Field("drop_sets", drops)
             .Field("records", records)
             .Field("dropped", dropped)
             .EndObject()
             .str() +
         "\n";
}

// The output's checksum as its sidecar recorded it ("" when the sidecar has none).
std::string RecordedChecksum(const std::string& output) {
  auto side = ReadFileToString(output + std::string(kDoneSuffix));
  if (!side.ok()) return "";
  simdjson::dom::parser p;
  simdjson::dom::element e;
  std::string_view sum;
  if (p.parse(*side).get(e) || e["output_xxh3_128"].get(sum)) return "";
  return std::string(sum);
}

// True when `output` is complete per its sidecar: same source (when the source still exists),
// same drop sets, and the output has the recorded size.
bool LooksComplete(const std::string& input, const std::string& output, const std::string& drops, bool source_exists,
                   const SourceId& src) {
  auto side = ReadFileToString(output + std::string(kDoneSuffix));
  if (!side.ok()) return false;
  simdjson::dom::parser p;
  simdjson::dom::element e;
  if (p.parse(*side).get(e)) return false;
  uint64_t out_size, ssize;
  int64_t mtime;
  std::string_view sdrops, spath;
  if (e["output_size"].get(out_size) || e["source_size"].get(ssize) || e["source_mtime_ns"].get(mtime) ||
      e["drop_sets"].get(sdrops) || e["source"].get(spath))
    return false;
  if (sdrops != drops || (spath != input && spath != SourceName(input))) return false;  // or as an older run gave it
  if (source_exists && (ssize != src.size || mtime != src.mtime_ns)) return false;
  auto osz = FileSize(output);
  return osz.ok() && *osz == out_size;
}

using ByteSink = std::function<absl::Status(const char*, size_t)>;

// Decodes `input` and hands the output bytes to `sink` in order (records of --drop-set sets left
// out). Without filtering, decoding overlaps the sink (as zstd's CLI does with --asyncio): block k
// goes to the sink on a second thread while block k+1 is decoded into the other buffer.
absl::Status Decode(const std::string& input, const ExtractOptions& opt, ExtractFileResult* res,
                    ProgressReporter* progress, const ByteSink& sink) {
  PTK_ASSIGN_OR_RETURN(auto source, OpenByteSource(input));
  std::vector<char> buf(4 << 20);
  std::string carry;
  extract_detail::SetFilter filter(opt.drop_sets);
  res->dropped_by_set.assign(opt.drop_sets.size(), 0);
  const bool filtering = !opt.drop_sets.empty();
  uint64_t last_raw = 0;
  bool file_start = true;
  // One line ended by '\n' (or the file's last bytes), record by record as ptk-tokenize reads them
  // (Python's universal newlines: a bare '\r' ends a record too; a UTF-8 BOM before the file's first
  // is not its JSON): each dropped with its line end, or written. A dropped set's record after a
  // bare '\r', or first in a file with a BOM, was kept (the line was no JSON), and tokenized.
  auto emit_line = [&](std::string_view line) -> absl::Status {
    for (size_t from = 0; from < line.size();) {
      size_t end = line.size();
      for (size_t cr = line.find('\r', from); cr != std::string_view::npos; cr = line.find('\r', cr + 1))
        if (cr + 1 < line.size() && line[cr + 1] != '\n') {
          end = cr + 1;
          break;
        }
      const std::string_view record = line.substr(from, end - from);
      std::string_view json = record;
      if (file_start && json.starts_with(kUtf8Bom)) json.remove_prefix(kUtf8Bom.size());
      file_start = false;
      ++res->records;
      if (const int k = filter.Match(json); k >= 0) {
        ++res->dropped;
        ++res->dropped_by_set[k];
      } else {
        PTK_RETURN_IF_ERROR(sink(record.data(), record.size()));
      }
      from = end;
    }
    return absl::OkStatus();
  };
  auto emit_lines = [&](const char* data, size_t n, bool final) -> absl::Status {
    size_t pos = 0;
    while (pos < n) {
      const void* nl = std::memchr(data + pos, '\n', n - pos);
      if (!nl) break;
      size_t end = static_cast<size_t>(static_cast<const char*>(nl) - data) + 1;
      PTK_RETURN_IF_ERROR(emit_line(std::string_view(data + pos, end - pos)));
      pos = end;
    }
    carry.assign(data + pos, n - pos);
    if (final && !carry.empty()) {
      PTK_RETURN_IF_ERROR(emit_line(carry));
      carry.clear();
    }
    return absl::OkStatus();
  };
  std::vector<char> spare(filtering ? 0 : buf.size());
  std::future<absl::Status> pending;
  auto wait_pending = [&]() -> absl::Status { return pending.valid() ? pending.get() : absl::OkStatus(); };
  while (true) {
    auto n_or = source->Read(buf.data(), buf.size());
    if (!n_or.ok()) {
      (void)wait_pending();
      return n_or.status();
    }
    const size_t n = *n_or;
    uint64_t raw = source->raw_bytes_read();
    progress->AddBytes(raw - last_raw);
    last_raw = raw;
    if (n == 0) break;
    res->bytes_in = raw;
    if (!filtering) {
      PTK_RETURN_IF_ERROR(wait_pending());
      pending = std::async(std::launch::async, [&sink, p = buf.data(), n] { return sink(p, n); });
      buf.swap(spare);
      continue;
    }
    if (carry.empty()) {
      PTK_RETURN_IF_ERROR(emit_lines(buf.data(), n, false));
      continue;
    }
    // A line that began in an earlier block: only the new bytes are searched and appended, so a
    // line of any length costs time linear in its length.
    const void* nl = std::memchr(buf.data(), '\n', n);
    if (!nl) {
      carry.append(buf.data(), n);
      continue;
    }
    const size_t k = static_cast<size_t>(static_cast<const char*>(nl) - buf.data()) + 1;
    carry.append(buf.data(), k);
    std::string line = std::move(carry);
    carry.clear();
    PTK_RETURN_IF_ERROR(emit_lines(line.data(), line.size(), false));
    PTK_RETURN_IF_ERROR(emit_lines(buf.data() + k, n - k, false));
  }
  PTK_RETURN_IF_ERROR(wait_pending());
  if (filtering && !carry.empty()) {
    std::string last = std::move(carry);
    PTK_RETURN_IF_ERROR(emit_lines(last.data(), last.size(), true));
  }
  res->bytes_in = source->raw_bytes_read();
  return absl::OkStatus();
}

// Writes `output` (atomically) and then its sidecar with size and XXH3-128. The caller holds the
// output's lock.
absl::Status ExtractOne(const std::string& input, const std::string& output, const ExtractOptions& opt,
                        ExtractFileResult* res, ProgressReporter* progress) {
  PTK_ASSIGN_OR_RETURN(SourceId src, StatSource(input));
  PTK_RETURN_IF_ERROR(MakeDirs(Dirname(output)));
  // An output a kill or a full disk left published without its sidecar (the pending record says it
  // is this tool's) is no complete output: removed first, so that redoing it needs room for one
  // copy, not two (after a disk filled up while the sidecar was written, the rerun failed for want
  // of room for a second copy).
  const std::string pending = output + std::string(kPendingSuffix);
  if (PathExists(pending) && !PathExists(output + std::string(kDoneSuffix)) && !IsDirectory(output))
    PTK_RETURN_IF_ERROR(RemoveFileIfExists(output));
  PTK_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(output));
  Xxh3 sum;
  PTK_RETURN_IF_ERROR(Decode(input, opt, res, progress, [&](const char* p, size_t n) {
    sum.Update(p, n);
    return out->Write(p, n);
  }));
  res->bytes_out = out->bytes_written();
  // The pending record first (the output is ptk-extract's from here on, whatever happens), then
  // the old sidecar goes before the new output appears: a kill in between leaves an output without
  // a sidecar (redone by the next run), never a new output described by an old sidecar.
  PTK_RETURN_IF_ERROR(WriteFileAtomic(pending, JsonWriter().BeginObject().Field("source", input).EndObject().str(),
                                      /*durable=*/false));
  absl::Status st = RemoveFileIfExists(output + std::string(kDoneSuffix));
  if (st.ok()) st = out->Commit();
  if (st.ok())
    st = WriteFileAtomic(
        output + std::string(kDoneSuffix),
        SidecarJson(input, src, res->bytes_out, sum.HexDigest(), DropKey(opt.drop_sets), res->records, res->dropped));
  // Kept after a failure only where an output is left (it is this tool's, to be redone).
  if (st.ok() || !Occupied(output)) PTK_RETURN_IF_ERROR(RemoveFileIfExists(pending));
  return st;
}

// --verify: the output's checksum against its sidecar, then (when the source still exists) the
// source decoded again and compared with the output byte for byte, in memory: no scratch file.
absl::Status VerifyOne(const std::string& input, const std::string& output, const ExtractOptions& opt) {
  PTK_ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(output));
  const std::string recorded = RecordedChecksum(output);
  if (!recorded.empty()) {
    Xxh3 h;
    h.Update(mapped->data(), mapped->size());
    if (h.HexDigest() != recorded)
      return absl::DataLossError(fmt::format(
          "{}: content checksum differs from the one its {} sidecar recorded: changed or damaged since it was written",
          output, kDoneSuffix));
  }
  if (!PathExists(input)) return absl::OkStatus();
  ExtractFileResult r;
  ProgressReporter quiet({.label = "verify", .enabled = false});
  uint64_t pos = 0;
  PTK_RETURN_IF_ERROR(Decode(input, opt, &r, &quiet, [&](const char* p, size_t n) -> absl::Status {
    if (pos + n > mapped->size() || std::memcmp(mapped->data() + pos, p, n) != 0)
      return absl::DataLossError(fmt::format(
          "{}: does not match what {} decodes to (first difference within bytes {}..{})", output, input, pos, pos + n));
    pos += n;
    return absl::OkStatus();
  }));
  if (pos != mapped->size())
    return absl::DataLossError(fmt::format("{}: is {} bytes but {} decodes to {}", output, mapped->size(), input, pos));
  return absl::OkStatus();
}

}  // namespace

std::string ExtractOutputPath(const std::string& input, const std::string& rel, const std::string& output_dir) {
  if (output_dir.empty()) return StripCompressionSuffix(input);
  return JoinPath(output_dir, StripCompressionSuffix(rel.empty() ? Basename(input) : rel));
}

int64_t CountExtractedOutputs(const std::vector<std::string>& paths) {
  int64_t n = 0;
  for (const auto& p : paths) {
    if (!IsDirectory(p)) {
      n += PathExists(p + std::string(kDoneSuffix)) ? 1 : 0;
      continue;
    }
    auto files = ListFilesRecursive(p);
    if (!files.ok()) continue;
    for (const auto& f : *files)
      if (f.size() > kDoneSuffix.size() &&
          f.compare(f.size() - kDoneSuffix.size(), kDoneSuffix.size(), kDoneSuffix) == 0)
        ++n;
  }
  return n;
}

namespace {

// Whether two paths name one file (device and inode, links followed); false where either is missing.
bool SameFile(const std::string& a, const std::string& b) {
  auto x = IdentifyFile(a), y = IdentifyFile(b);
  return x.ok() && y.ok() && x->dev == y->dev && x->ino == y->ino;
}

// Every input's output, checked for collisions over the whole list (not only this shard's).
absl::StatusOr<std::vector<std::string>> OutputsOf(const ExtractOptions& opt) {
  std::vector<std::string> outputs(opt.inputs.size());
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < opt.inputs.size(); ++i) {
    outputs[i] = ExtractOutputPath(opt.inputs[i], i < opt.relative_outputs.size() ? opt.relative_outputs[i] : "",
                                   opt.output_dir);
    auto [it, fresh] = seen.emplace(outputs[i], i);
    if (!fresh)
      return absl::InvalidArgumentError(
          fmt::format("{} and {} would both be extracted to {}", opt.inputs[it->second], opt.inputs[i], outputs[i]));
  }
  return outputs;
}

// The shard that owns input i. Membership hangs on the file's own name (FNV-1a of its output path
// below output_dir), not on its position in the list: with --delete-input the list shrinks while
// array tasks run, and every task must still agree on who owns which file.
int64_t ShardOwner(const ExtractOptions& opt, size_t i) {
  const std::string key = i < opt.relative_outputs.size() && !opt.relative_outputs[i].empty() ? opt.relative_outputs[i]
                                                                                              : Basename(opt.inputs[i]);
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h % static_cast<uint64_t>(opt.shard.count));
}

// An input that is its own output is done as it is, when it is plain text and no records are to be
// dropped. Compressed data under a plain name was "already complete", and so was a --drop-set run
// that dropped nothing: neither can be done without writing the input over itself.
absl::Status InPlace(const ExtractOptions& opt, const std::string& input) {
  static constexpr std::string_view kName[] = {"", "zstd", "xz", "gzip"}, kExt[] = {"", ".zst", ".xz", ".gz"};
  const Compression c = DetectCompression(input);
  if (c != Compression::kNone)
    return absl::FailedPreconditionError(
        fmt::format("{} holds {} data under a plain name, and its output would be itself: rename it {}{} (or give "
                    "another output directory)",
                    input, kName[static_cast<int>(c)], Basename(input), kExt[static_cast<int>(c)]));
  if (!opt.drop_sets.empty())
    return absl::FailedPreconditionError(fmt::format(
        "{} is its own output: records cannot be dropped from it in place; give another output directory", input));
  return absl::OkStatus();
}

// Before extracting r.input: its output's lock taken (held in *lock), and whether the work is
// already done (kSkipped), cannot start (kFailed with r.error), or is to do (the state left as is).
void CheckBeforeExtracting(const ExtractOptions& opt, const std::string& drops, ExtractFileResult& r,
                           std::unique_ptr<OutputLock>* lock, ProgressReporter& progress) {
  auto src = StatSource(r.input);
  // A plain input whose output is itself, however spelled (`f.jsonl --output-dir .`, a link): done as
  // it is. Extracting it would rewrite the input from itself, and --delete-input then delete the output.
  const bool in_place = r.output == r.input || SameFile(r.input, r.output);
  if (src.ok() && !in_place) {
    absl::Status made = MakeDirs(Dirname(r.output));
    auto l =
        made.ok() ? OutputLock::Acquire(r.output, opt.lock_wait) : absl::StatusOr<std::unique_ptr<OutputLock>>(made);
    if (l.ok()) {
      *lock = std::move(*l);
      RemoveStaleTemporaries(r.output);
    } else {
      src = l.status();
    }
  }
  if (!src.ok()) {
    r.state = ExtractFileResult::State::kFailed;
    r.error = src.status();
  } else if (!in_place && IsDirectory(r.output)) {
    // Not even with --force (the rename fails, and left the pending record that made the directory
    // look like this tool's output; zstd -d -f crashes).
    r.state = ExtractFileResult::State::kFailed;
    r.error = absl::FailedPreconditionError(
        fmt::format("{} is a directory: the output of {} cannot be written there", r.output, r.input));
  } else if (!in_place && !opt.force && Occupied(r.output) && !WrittenByExtract(r.output)) {
    // As zstd -d: a file this tool did not write is never overwritten unasked.
    r.state = ExtractFileResult::State::kFailed;
    r.error = absl::AlreadyExistsError(
        fmt::format("{} already exists and was not written by ptk-extract (no {} beside it): not overwritten; "
                    "remove it, or pass --force",
                    r.output, kDoneSuffix));
  } else if (in_place) {
    r.error = InPlace(opt, r.input);
    r.state = r.error.ok() ? ExtractFileResult::State::kSkipped : ExtractFileResult::State::kFailed;
  } else if (LooksComplete(r.input, r.output, drops, true, *src)) {
    r.state = ExtractFileResult::State::kSkipped;
    if (opt.verify) {
      absl::Status st = VerifyOne(r.input, r.output, opt);
      if (!st.ok()) {
        log::Warning("{}; extracting again", StatusMessage(st));
        r.state = ExtractFileResult::State::kFailed;
      }
    }
    if (r.state == ExtractFileResult::State::kSkipped) progress.AddBytes(src->size);
  }
}

// One listed file, start to end; its outcome in r.
void ExtractListed(const ExtractOptions& opt, const std::string& drops, ExtractFileResult& r,
                   ProgressReporter& progress, std::mutex& log_mu) {
  std::unique_ptr<OutputLock> out_lock;
  CheckBeforeExtracting(opt, drops, r, &out_lock, progress);
  if (r.state != ExtractFileResult::State::kSkipped && r.error.ok()) {
    absl::Status st = ExtractOne(r.input, r.output, opt, &r, &progress);
    if (st.ok()) {
      r.state = ExtractFileResult::State::kExtracted;
      if (opt.delete_input) {
        absl::Status d = RemoveFileIfExists(r.input);
        if (!d.ok()) log::Warning("{}", StatusMessage(d));
      }
    } else {
      r.state = ExtractFileResult::State::kFailed;
      r.error = st;
      std::lock_guard<std::mutex> lock(log_mu);
      log::Error("{}", StatusMessage(st));
    }
  }
  progress.AddItems(1);
}

void Tally(ExtractSummary& sum) {
  for (const auto& r : sum.files) {
    switch (r.state) {
      case ExtractFileResult::State::kExtracted: ++sum.extracted; break;
      case ExtractFileResult::State::kSkipped: ++sum.skipped; break;
      case ExtractFileResult::State::kFailed: ++sum.failed; break;
    }
    sum.bytes_in += r.bytes_in;
    sum.bytes_out += r.bytes_out;
    sum.dropped += r.dropped;
    sum.records += r.records;
    sum.dropped_by_set.resize(r.dropped_by_set.size());
    for (size_t k = 0; k < r.dropped_by_set.size(); ++k) sum.dropped_by_set[k] += r.dropped_by_set[k];
  }
}

}  // namespace

absl::StatusOr<ExtractSummary> RunExtract(const ExtractOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!opt.output_dir.empty()) PTK_RETURN_IF_ERROR(MakeDirs(opt.output_dir));
  PTK_ASSIGN_OR_RETURN(const std::vector<std::string> outputs, OutputsOf(opt));
  ExtractSummary sum;
  uint64_t total = 0;
  for (size_t i = 0; i < opt.inputs.size(); ++i)
    if (opt.shard.count <= 1 || ShardOwner(opt, i) == opt.shard.index) {
      ExtractFileResult& r = sum.files.emplace_back();
      r.input = opt.inputs[i];
      r.output = outputs[i];
      auto sz = FileSize(r.input);
      if (sz.ok()) total += *sz;
    }
  ProgressReporter progress({.label = "extract",
                             .item_unit = "files",
                             .items_total = sum.files.size(),
                             .bytes_total = total,
                             .enabled = opt.progress});
  const std::string drops = DropKey(opt.drop_sets);
  std::mutex log_mu;
  ParallelForEach(sum.files.size(), opt.jobs,
                  [&](size_t i) { ExtractListed(opt, drops, sum.files[i], progress, log_mu); });
  progress.Finish();
  Tally(sum);
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

}  // namespace ptk
