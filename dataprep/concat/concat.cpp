// ptk-concat's engine.
#include "dataprep/concat/concat.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include <fmt/core.h>
#include <fmt/format.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/status.h"
#include "common/utf8.h"
#include "dataprep/input/byte_source.h"
#include "dataprep/input/input_list.h"

namespace ptk {
namespace {

constexpr std::string_view kDoneSuffix = ".ptk-done";

// `path` made absolute (against the current directory) with "." components and repeated slashes
// dropped, so that two spellings of one path compare equal. ".." is kept: through a link it need
// not lead back where it came from.
std::string PathKey(const std::string& path) {
  std::string abs = path;
  if (abs.empty() || abs[0] != '/') {
    std::error_code ec;
    abs = JoinPath(std::filesystem::current_path(ec).string(), path);
  }
  std::string key;
  for (size_t at = 0; at < abs.size();) {
    size_t end = abs.find('/', at);
    if (end == std::string::npos) end = abs.size();
    const std::string_view part(abs.data() + at, end - at);
    if (!part.empty() && part != ".") key.append("/").append(part);
    at = end + 1;
  }
  return key.empty() ? "/" : key;
}

// Identifies a chunk's content: its inputs (by their absolute, normal names: in/a.jsonl, ./in/a.jsonl and
// /data/in/a.jsonl are one input, not a change that builds the chunk again), their sizes, their order.
std::string ChunkDigest(const ConcatPlan& plan, const ConcatChunk& c) {
  std::string s;
  for (const auto& in : c.inputs) s += fmt::format("{}\t{}\n", PathKey(plan.Resolve(in.path)), in.size);
  return Sha256Hex(s);
}

// "in/a.jsonl is empty", "the 3 inputs in/a.jsonl, in/b.jsonl and in/c.jsonl are all empty" (the first
// and last of more than four): inputs [first, end), for a message.
std::string EmptyInputs(const std::vector<ConcatInput>& inputs, size_t first, size_t end) {
  const size_t n = end - first;
  if (n == 1) return fmt::format("{} is empty", inputs[first].path);
  std::string names;
  if (n > 4) {
    names = fmt::format("{} ... {}", inputs[first].path, inputs[end - 1].path);
  } else {
    for (size_t i = first; i < end; ++i) names += (i == first ? "" : i + 1 == end ? " and " : ", ") + inputs[i].path;
  }
  return fmt::format("the {} inputs {} are all empty", n, names);
}

// A file listed twice would be concatenated twice: training data silently duplicated. The first
// input the plan lists twice (however its path is spelled), as an error naming both places.
absl::Status CheckEachInputOnce(const ConcatPlan& plan, std::string_view where) {
  std::map<std::string, std::pair<size_t, size_t>> first;  // key -> (chunk, input)
  for (size_t k = 0; k < plan.chunks.size(); ++k)
    for (size_t i = 0; i < plan.chunks[k].inputs.size(); ++i) {
      const std::string& path = plan.chunks[k].inputs[i].path;
      auto [it, fresh] = first.emplace(PathKey(plan.Resolve(path)), std::make_pair(k, i));
      if (fresh) continue;
      const auto [k0, i0] = it->second;
      return absl::InvalidArgumentError(
          fmt::format("{} {} twice (chunk {} input {}: {}; chunk {} input {}: {}): it would be concatenated twice",
                      where, path, k0, i0, plan.chunks[k0].inputs[i0].path, k, i, path));
    }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConcatPlan> MakeConcatPlan(const std::vector<ConcatInput>& inputs, const std::string& output_dir,
                                          const ConcatPlanOptions& opt) {
  if (inputs.empty()) return absl::InvalidArgumentError("no input files to concatenate");
  if (std::all_of(inputs.begin(), inputs.end(), [](const ConcatInput& in) { return in.size == 0; }))
    return absl::FailedPreconditionError(
        fmt::format("no data to concatenate: {} (0 bytes), and ptk-tokenize refuses an empty chunk",
                    EmptyInputs(inputs, 0, inputs.size())));
  ConcatPlan plan;
  plan.output_dir = output_dir;
  const size_t n = inputs.size();
  std::vector<std::pair<size_t, size_t>> ranges;  // [first, end)
  if (opt.files_per_chunk > 0) {
    for (size_t first = 0; first < n; first += static_cast<size_t>(opt.files_per_chunk))
      ranges.emplace_back(first, std::min(n, first + static_cast<size_t>(opt.files_per_chunk)));
  } else {
    if (opt.chunks < 1) return UsageError("--chunks must be >= 1");
    // An empty input holds no record: a chunk of empty inputs only would be an empty file, which
    // ptk-tokenize refuses. Each chunk holds one non-empty input at least; empty ones go with their neighbours.
    std::vector<size_t> nonempty_from(n + 1, 0);  // non-empty inputs in [i, n)
    for (size_t i = n; i-- > 0;) nonempty_from[i] = nonempty_from[i + 1] + (inputs[i].size > 0);
    const size_t nchunks = std::min<size_t>(static_cast<size_t>(opt.chunks), nonempty_from[0]);
    long double total = 0;
    for (const auto& in : inputs) total += static_cast<long double>(in.size);
    std::vector<long double> before(n + 1, 0);
    for (size_t i = 0; i < n; ++i) before[i + 1] = before[i] + static_cast<long double>(inputs[i].size);
    size_t idx = 0;
    for (size_t k = 0; k < nchunks; ++k) {
      const size_t first = idx;
      while (inputs[idx].size == 0) ++idx;  // there is a non-empty one left for this chunk and each after it
      ++idx;
      const size_t left_after = nchunks - k - 1;  // chunks still to fill
      if (k + 1 == nchunks) {
        idx = n;
      } else {
        const long double target = total * static_cast<long double>(k + 1) / static_cast<long double>(nchunks);
        while (idx < n && nonempty_from[idx] > left_after && before[idx] + inputs[idx].size / 2.0L < target) ++idx;
      }
      ranges.emplace_back(first, idx);
    }
  }
  std::map<std::string, size_t> names;
  for (size_t k = 0; k < ranges.size(); ++k) {
    ConcatChunk c;
    PTK_ASSIGN_OR_RETURN(c.name, concat_detail::ChunkName(opt.name_pattern, static_cast<int64_t>(k),
                                                          static_cast<int64_t>(ranges.size())));
    auto [it, fresh] = names.emplace(c.name, k);
    if (!fresh)
      return UsageError(
          fmt::format("--name-pattern {:?} gives chunks {} and {} the same name {:?}; put {{}} (the chunk index) in it",
                      opt.name_pattern, it->second, k, c.name));
    for (size_t i = ranges[k].first; i < ranges[k].second; ++i) {
      c.inputs.push_back(inputs[i]);
      c.bytes += inputs[i].size;
    }
    if (c.bytes == 0)  // --files-per-chunk: NeMo's grouping is kept, so a group of empty files is refused
      return absl::FailedPreconditionError(fmt::format(
          "chunk {} ({}) would be an empty file, which ptk-tokenize refuses: {} (0 bytes); remove the empty files "
          "(--files-per-chunk then groups the files after them otherwise) or use --chunks",
          k, c.name, EmptyInputs(inputs, ranges[k].first, ranges[k].second)));
    plan.chunks.push_back(std::move(c));
  }
  PTK_RETURN_IF_ERROR(CheckEachInputOnce(plan, "the inputs name"));
  return plan;
}

std::string ConcatPlan::Resolve(const std::string& path) const {
  return base_dir.empty() || path.empty() || path[0] == '/' ? path : JoinPath(base_dir, path);
}

absl::Status WriteConcatPlan(const ConcatPlan& plan, const std::string& path) {
  std::string base = plan.base_dir;
  if (base.empty()) {
    std::error_code ec;
    base = std::filesystem::current_path(ec).string();
    if (ec) return ErrnoToStatus(ec.value(), "cannot tell the current directory (the plan's base_dir)");
  }
  JsonWriter w;
  w.BeginObject()
      .Field("version", 1)
      .Field("output_dir", plan.output_dir)
      .Field("base_dir", base)
      .Key("chunks")
      .BeginArray(/*one_per_line=*/true);
  for (const auto& c : plan.chunks) {
    w.BeginObject().Field("name", c.name).Field("bytes", c.bytes).Key("inputs").BeginArray();
    for (const auto& in : c.inputs) w.BeginObject().Field("path", in.path).Field("size", in.size).EndObject();
    w.EndArray().EndObject();
  }
  w.EndArray().EndObject();
  return WriteFileAtomic(path, w.str() + "\n");
}

absl::Status CheckPlanPath(const ConcatPlan& plan, const std::string& path, const std::string& what) {
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::weakly_canonical(path, ec);
  for (size_t k = 0; !ec && k < plan.chunks.size(); ++k)
    for (std::string_view suffix : {std::string_view(), kDoneSuffix, std::string_view(OutputLock::kSuffix)}) {
      const std::string name = plan.chunks[k].name + std::string(suffix);
      std::error_code chunk_ec;
      const auto chunk = std::filesystem::weakly_canonical(JoinPath(plan.Resolve(plan.output_dir), name), chunk_ec);
      if (!chunk_ec && chunk == real)
        return UsageError(fmt::format(
            "{} is chunk {}'s {} ({}): `ptk-concat run` would write it over the plan; give the plan a name of its own "
            "(by default OUTPUT_DIR/concat-plan.json) or the chunks another --name-pattern",
            what, k, suffix.empty() ? "output" : "sidecar or lock", name));
    }
  if (!PathExists(path)) return absl::OkStatus();
  if (auto old = ReadConcatPlan(path); !old.ok())
    return UsageError(fmt::format(
        "{} exists and is not a ptk-concat plan: writing the plan would replace it ({}); give the plan a path of its "
        "own",
        what, StatusMessage(old.status())));
  return absl::OkStatus();
}

absl::StatusOr<ConcatPlan> ReadConcatPlan(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  simdjson::dom::parser p;
  simdjson::dom::element root;
  auto bad = [&](const char* what) {
    return absl::DataLossError(fmt::format("{}: not a ptk-concat plan ({})", path, what));
  };
  if (p.parse(text).get(root)) return bad("invalid JSON");
  int64_t version;
  if (root["version"].get(version) || version != 1) return bad("unknown version");
  ConcatPlan plan;
  std::string_view od;
  if (root["output_dir"].get(od)) return bad("no output_dir");
  plan.output_dir = std::string(od);
  // Relative paths are relative to where the plan was made; in that very directory (however it is
  // reached) they are used as written. A plan without base_dir (older) is read from the current one.
  std::string_view base;
  if (!root["base_dir"].get(base) && !base.empty()) {
    auto here = IdentifyFile("."), there = IdentifyFile(std::string(base));
    if (!(here.ok() && there.ok() && here->dev == there->dev && here->ino == there->ino))
      plan.base_dir = std::string(base);
  }
  simdjson::dom::array chunks;
  if (root["chunks"].get(chunks)) return bad("no chunks");
  for (auto ce : chunks) {
    ConcatChunk c;
    std::string_view name;
    if (ce["name"].get(name)) return bad("chunk without a name");
    c.name = std::string(name);
    // A name is a file in the output directory; two chunks of one name would overwrite each other.
    if (c.name.empty() || c.name == "." || c.name == ".." || c.name.find('/') != std::string::npos)
      return absl::DataLossError(
          fmt::format("{}: chunk {} is named {:?}, which is no file name in the output directory", path,
                      plan.chunks.size(), c.name));
    for (size_t k = 0; k < plan.chunks.size(); ++k)
      if (plan.chunks[k].name == c.name)
        return absl::DataLossError(
            fmt::format("{}: chunks {} and {} are both named {:?}: one would overwrite the other", path, k,
                        plan.chunks.size(), c.name));
    simdjson::dom::array ins;
    if (ce["inputs"].get(ins)) return bad("chunk without inputs");
    for (auto ie : ins) {
      std::string_view ip;
      uint64_t sz;
      if (ie["path"].get(ip) || ie["size"].get(sz)) return bad("bad input entry");
      c.inputs.push_back({std::string(ip), sz});
      c.bytes += sz;
    }
    plan.chunks.push_back(std::move(c));
  }
  if (absl::Status once = CheckEachInputOnce(plan, path + ": the plan lists"); !once.ok())
    return absl::DataLossError(once.message());
  return plan;
}

namespace {

// Before a chunk is built: every input is a regular file that still has the size the plan recorded,
// no file is listed twice by two names (a link, a hard link), which the plan's paths cannot show,
// and what is to be copied as it is is no binary data.
absl::Status CheckChunkInputs(const ConcatPlan& plan, size_t index) {
  std::map<std::pair<uint64_t, uint64_t>, std::string> seen;
  for (const auto& in : plan.chunks[index].inputs) {
    const std::string in_path = plan.Resolve(in.path);
    PTK_ASSIGN_OR_RETURN(const FileIdentity id, IdentifyFile(in_path));
    if (!id.regular)
      return absl::FailedPreconditionError(
          fmt::format("{} is {}, not a regular file: inputs are read from regular files", in_path, id.kind));
    PTK_ASSIGN_OR_RETURN(const uint64_t size, FileSize(in_path));
    if (size != in.size)
      return absl::FailedPreconditionError(
          fmt::format("{}: is {} bytes but the plan recorded {}; the inputs changed since the plan was made", in_path,
                      size, in.size));
    auto [it, fresh] = seen.emplace(std::make_pair(id.dev, id.ino), in_path);
    if (!fresh)
      return absl::FailedPreconditionError(
          fmt::format("{}: the same file as {}, which chunk {} also lists: it would be concatenated twice", in_path,
                      it->second, index));
    // What is copied as it is must be text: a file named .zst whose content is none of the formats (a
    // damaged download) or bzip2 data named .jsonl is refused as ptk-extract refuses it (it was
    // copied into the chunk, exit 0).
    if (DetectCompression(in_path) == Compression::kNone) PTK_RETURN_IF_ERROR(OpenByteSource(in_path).status());
  }
  return absl::OkStatus();
}

// Before a complete chunk is skipped: every input that is still there has the size the plan recorded,
// which is the size the chunk was built from (its sidecar records the plan's sizes). A chunk whose input
// changed since was kept, "already complete", exit 0, while a chunk not yet built refused the same
// change: it is refused the same way. An input removed after its chunk was built changes nothing.
absl::Status CheckBuiltChunkInputs(const ConcatPlan& plan, size_t index) {
  for (const auto& in : plan.chunks[index].inputs) {
    const std::string in_path = plan.Resolve(in.path);
    if (!PathExists(in_path)) continue;
    auto size = FileSize(in_path);
    if (size.ok() && *size == in.size) continue;
    if (!size.ok()) return size.status();
    return absl::FailedPreconditionError(
        fmt::format("{}: is {} bytes but the plan recorded {}, and chunk {} ({}) was built from those {}; the inputs "
                    "changed since the plan was made",
                    in_path, *size, in.size, index, plan.chunks[index].name, in.size));
  }
  return absl::OkStatus();
}

// One input's bytes (decoded when compressed) appended to the chunk, but a UTF-8 BOM at its start:
// ptk-tokenize drops one at the start of a file, but inside a chunk it began a record, which was
// then skipped as malformed JSON (Megatron's json.loads refuses it anywhere). Returns the last byte
// copied ('\n' when none was).
absl::StatusOr<char> CopyInput(const std::string& in_path, uint64_t size, AtomicFileWriter& out,
                               std::vector<char>& buf) {
  char last = '\n';
  if (DetectCompression(in_path) == Compression::kNone) {
    PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(in_path));
    char head[3] = {};
    const ssize_t h = size >= 3 ? ::pread(fd, head, 3, 0) : 0;
    const ssize_t r = size > 0 ? ::pread(fd, &last, 1, static_cast<off_t>(size - 1)) : 1;
    ::close(fd);
    if (h < 0 || r != 1) return absl::DataLossError(fmt::format("{}: cannot read its first or last bytes", in_path));
    const uint64_t skip = h == 3 && std::string_view(head, 3) == kUtf8Bom ? 3 : 0;
    if (size == skip) return '\n';
    PTK_RETURN_IF_ERROR(out.AppendFileRange(in_path, skip, size - skip));
    return last;
  }
  if (buf.empty()) buf.resize(4 << 20);
  PTK_ASSIGN_OR_RETURN(auto src, OpenByteSource(in_path));
  for (bool first = true;; first = false) {
    PTK_ASSIGN_OR_RETURN(size_t n, src->Read(buf.data(), buf.size()));
    while (first && n > 0 && n < kUtf8Bom.size()) {  // the first bytes whole before they are judged
      PTK_ASSIGN_OR_RETURN(const size_t more, src->Read(buf.data() + n, buf.size() - n));
      if (more == 0) break;
      n += more;
    }
    if (n == 0) break;
    const size_t skip = first && std::string_view(buf.data(), std::min(n, kUtf8Bom.size())) == kUtf8Bom ? 3 : 0;
    if (n == skip) continue;
    PTK_RETURN_IF_ERROR(out.Write(buf.data() + skip, n - skip));
    last = buf[n - 1];
  }
  return last;
}

}  // namespace

absl::StatusOr<ConcatChunkResult> BuildConcatChunk(const ConcatPlan& plan, size_t index, bool durable,
                                                   std::chrono::milliseconds lock_wait) {
  if (index >= plan.chunks.size())
    return absl::OutOfRangeError(
        fmt::format("chunk index {} is outside the plan's {} chunks", index, plan.chunks.size()));
  const ConcatChunk& c = plan.chunks[index];
  const std::string out_dir = plan.Resolve(plan.output_dir);
  const std::string out_path = JoinPath(out_dir, c.name);
  const std::string digest = ChunkDigest(plan, c);
  ConcatChunkResult res;
  PTK_RETURN_IF_ERROR(MakeDirs(out_dir));
  // One builder per chunk: a second run of the same chunk stops here, naming the first.
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(out_path, lock_wait));
  RemoveStaleTemporaries(out_path);
  // Skip when the sidecar says this exact chunk is complete and the file has its size.
  auto side = ReadFileToString(out_path + std::string(kDoneSuffix));
  if (side.ok()) {
    simdjson::dom::parser p;
    simdjson::dom::element e;
    std::string_view d;
    uint64_t size;
    auto fs = FileSize(out_path);
    if (!p.parse(*side).get(e) && !e["inputs_sha256"].get(d) && !e["size"].get(size) && d == digest && fs.ok() &&
        *fs == size) {
      PTK_RETURN_IF_ERROR(CheckBuiltChunkInputs(plan, index));
      res.skipped = true;
      res.bytes = size;
      return res;
    }
  }
  PTK_RETURN_IF_ERROR(CheckChunkInputs(plan, index));
  // A chunk without its sidecar (a kill or a full disk between its publish and the sidecar's) is no
  // complete chunk: removed first, so that rebuilding it needs room for one copy, not two.
  if (!PathExists(out_path + std::string(kDoneSuffix))) PTK_RETURN_IF_ERROR(RemoveFileIfExists(out_path));
  PTK_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(out_path));
  std::vector<char> buf;
  for (const auto& in : c.inputs) {
    PTK_ASSIGN_OR_RETURN(const char last, CopyInput(plan.Resolve(in.path), in.size, *out, buf));
    // A file without a final newline must not merge its last record with the next file's first.
    if (last != '\n') {
      PTK_RETURN_IF_ERROR(out->Write("\n", 1));
      ++res.newlines_added;
    }
  }
  res.bytes = out->bytes_written();
  // The plan gives no chunk of empty inputs only; compressed ones can still hold nothing (or a BOM).
  if (res.bytes == 0)
    return absl::FailedPreconditionError(fmt::format(
        "{}: chunk {} would be an empty file, which ptk-tokenize refuses: {} once read (decompressed, a UTF-8 "
        "BOM that starts it dropped); nothing written",
        out_path, index, EmptyInputs(c.inputs, 0, c.inputs.size())));
  PTK_RETURN_IF_ERROR(out->Seal(durable));
  // Inputs are copied in the kernel (copy_file_range), so the checksum reads the finished file.
  PTK_ASSIGN_OR_RETURN(std::string sum, Xxh3FileHex(out->tmp_path()));
  // The old sidecar goes first: a kill in between leaves a chunk without a sidecar (rebuilt by the
  // next run), never a new chunk described by an old sidecar.
  PTK_RETURN_IF_ERROR(RemoveFileIfExists(out_path + std::string(kDoneSuffix)));
  PTK_RETURN_IF_ERROR(out->Commit(durable));
  PTK_RETURN_IF_ERROR(WriteFileAtomic(out_path + std::string(kDoneSuffix),
                                      JsonWriter()
                                              .BeginObject()
                                              .Field("inputs_sha256", digest)
                                              .Field("size", res.bytes)
                                              .Field("xxh3_128", sum)
                                              .Field("inputs", c.inputs.size())
                                              .EndObject()
                                              .str() +
                                          "\n",
                                      durable));
  return res;
}

absl::StatusOr<ConcatPlan> PlanConcat(const ConcatPlanRequest& r) {
  std::vector<LeftOutFile> left_out;
  PTK_ASSIGN_OR_RETURN(auto files,
                       CollectInputs(r.inputs, JsonInputSuffixes(),
                                     r.order == "bytes" ? PathOrder::kBytes : PathOrder::kNatural, &left_out));
  LeaveOutOtherPlans(&files, &left_out);
  std::vector<ConcatInput> inputs;
  std::error_code ec;
  const std::filesystem::path out_real = std::filesystem::canonical(r.output_dir, ec);
  const bool out_exists = !ec;
  std::filesystem::path plan_real;
  if (!r.plan_path.empty()) plan_real = std::filesystem::weakly_canonical(r.plan_path, ec);
  auto ours = [&](const std::string& f) {  // the plan, or inside the output directory: chunks, plans, sidecars
    const std::filesystem::path real = std::filesystem::weakly_canonical(f, ec);
    if (ec) return false;
    if (!plan_real.empty() && real == plan_real) return true;
    if (!out_exists) return false;
    auto [o, _] = std::mismatch(out_real.begin(), out_real.end(), real.begin(), real.end());
    return o == out_real.end();
  };
  for (const auto& f : files) {
    if (ours(f)) continue;
    PTK_ASSIGN_OR_RETURN(uint64_t size, FileSize(f));
    inputs.push_back({f, size});
  }
  // Every other file below a directory input that is not taken is said, with the reason.
  std::erase_if(left_out, [&](const LeftOutFile& l) { return ours(l.path); });
  ReportLeftOut(left_out);
  if (inputs.empty()) {  // named, as ptk-extract names them (it said "no input files to concatenate")
    std::string given;
    for (const std::string& in : r.inputs) given += (given.empty() ? "" : ", ") + in;
    return absl::NotFoundError(fmt::format("no input files to concatenate in {}{}", given,
                                           left_out.empty() ? " (empty)" : " (every file left out, listed above)"));
  }
  return MakeConcatPlan(inputs, r.output_dir, r.plan);  // a bad flag is a UsageError already
}

std::vector<std::string> PlanChunkPaths(const ConcatPlan& plan) {
  std::vector<std::string> out;
  for (const auto& c : plan.chunks) out.push_back(JoinPath(plan.Resolve(plan.output_dir), c.name));
  return out;
}

absl::StatusOr<std::vector<std::string>> ConcatListItems(const ConcatPlan& plan, const std::vector<std::string>& with) {
  std::vector<std::string> items = PlanChunkPaths(plan);
  const size_t chunks = items.size();
  items.insert(items.end(), with.begin(), with.end());
  auto what = [&](size_t k) {
    return k < chunks ? fmt::format("the plan's chunk {} ({})", k, items[k]) : fmt::format("--with {}", items[k]);
  };
  std::map<std::string, size_t> by_path;
  std::map<std::pair<uint64_t, uint64_t>, size_t> by_id;  // items that exist, by device and inode
  for (size_t k = 0; k < items.size(); ++k) {
    auto [it, fresh] = by_path.emplace(PathKey(items[k]), k);
    std::optional<size_t> first;
    if (!fresh) first = it->second;
    if (auto id = IdentifyFile(items[k]); !first && id.ok()) {
      auto [at, new_id] = by_id.emplace(std::make_pair(id->dev, id->ino), k);
      if (!new_id) first = at->second;
    }
    if (!first) continue;
    // Each item is one array task's output: listed twice, two tasks would write one output.
    if (*first >= chunks && items[*first] == items[k])
      return UsageError(fmt::format("--with {} is given twice; each item is listed once", items[k]));
    return UsageError(fmt::format("{} is {} again; each item is listed once", what(k), what(*first)));
  }
  return items;
}

absl::StatusOr<std::vector<std::string>> RemoveChunksNotInPlan(const ConcatPlan& plan,
                                                               std::chrono::milliseconds lock_wait) {
  std::vector<std::string> removed;
  std::set<std::string> in_plan;
  for (const auto& c : plan.chunks) in_plan.insert(c.name);
  std::error_code ec;
  std::vector<std::string> names;
  const std::string out_dir = plan.Resolve(plan.output_dir);
  for (const auto& e : std::filesystem::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > kDoneSuffix.size() &&
        name.compare(name.size() - kDoneSuffix.size(), kDoneSuffix.size(), kDoneSuffix) == 0)
      names.push_back(name.substr(0, name.size() - kDoneSuffix.size()));
  }
  if (ec) return ErrnoToStatus(ec.value(), fmt::format("list {}", out_dir));
  std::sort(names.begin(), names.end(), NaturalLess);
  for (const auto& name : names) {
    if (in_plan.count(name)) continue;
    const std::string path = JoinPath(out_dir, name);
    auto side = ReadFileToString(path + std::string(kDoneSuffix));
    if (!side.ok() || side->find("\"inputs_sha256\"") == std::string::npos) continue;  // not a ptk-concat chunk
    PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(path, lock_wait));
    PTK_RETURN_IF_ERROR(RemoveFileIfExists(path + std::string(kDoneSuffix)));
    PTK_RETURN_IF_ERROR(RemoveFileIfExists(path));
    RemoveStaleTemporaries(path);
    removed.push_back(name);
  }
  return removed;
}

absl::StatusOr<ConcatSummary> RunConcat(const ConcatPlan& plan, const ConcatRunOptions& o) {
  std::vector<size_t> todo;
  if (o.chunk_index) {
    todo.push_back(static_cast<size_t>(*o.chunk_index));
  } else {
    for (size_t k = 0; k < plan.chunks.size(); ++k)
      if (InShard(static_cast<int64_t>(k), o.shard)) todo.push_back(k);
  }
  uint64_t total = 0;
  for (size_t k : todo)
    if (k < plan.chunks.size()) total += plan.chunks[k].bytes;
  ProgressReporter progress({.label = "concat",
                             .item_unit = "chunks",
                             .items_total = todo.size(),
                             .bytes_total = total,
                             .enabled = o.progress});
  std::mutex mu;
  ConcatSummary sum;
  ParallelForEach(todo.size(), o.jobs, [&](size_t i) {
    auto res = BuildConcatChunk(plan, todo[i], o.durable, o.lock_wait);
    std::lock_guard<std::mutex> lock(mu);
    if (!res.ok()) {
      sum.errors.emplace_back(todo[i], res.status());
      log::Error("chunk {}: {}", todo[i], StatusMessage(res.status()));
    } else {
      (res->skipped ? sum.skipped : sum.built) += 1;
      sum.newlines_added += res->newlines_added;
      if (!res->skipped) sum.bytes += res->bytes;
    }
    if (todo[i] < plan.chunks.size()) progress.AddBytes(plan.chunks[todo[i]].bytes);
    progress.AddItems(1);
  });
  progress.Finish();
  std::sort(sum.errors.begin(), sum.errors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  sum.failed = static_cast<int64_t>(sum.errors.size());
  return sum;
}

}  // namespace ptk
