// ptk-extract and the outputs whose input is gone (--delete-input, or removed since): --verify checks each
// against the size and checksum its sidecar recorded (the only check left without the input), and a rerun
// knows the arguments that name nothing now from the sidecars.
#include <fnmatch.h>
#include <simdjson.h>

#include <filesystem>
#include <optional>
#include <utility>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/mmap_file.h"
#include "common/status.h"
#include "dataprep/extract/extract.h"
#include "dataprep/input/byte_source.h"

namespace ptk {
namespace {

constexpr std::string_view kSidecar = ".ptk-done";

struct Recorded {
  std::string source;  // the input, by its absolute name
  uint64_t size = 0;
  std::string checksum;
};

std::optional<Recorded> ReadSidecar(const std::string& output) {
  auto side = ReadFileToString(output + std::string(kSidecar));
  if (!side.ok()) return std::nullopt;
  simdjson::dom::parser p;
  simdjson::dom::element e;
  std::string_view source, sum;
  uint64_t size = 0;
  if (p.parse(*side).get(e) || e["source"].get(source) || e["output_size"].get(size) || e["output_xxh3_128"].get(sum) ||
      source.empty())
    return std::nullopt;
  return Recorded{std::string(source), size, std::string(sum)};
}

absl::Status CheckAgainstSidecar(const std::string& output, const Recorded& r) {
  const std::string gone =
      fmt::format("; its input {} is gone, so it cannot be extracted again: fetch the input again and rerun", r.source);
  auto size = FileSize(output);
  if (!size.ok())
    return absl::DataLossError(fmt::format("{}: missing, though its {} sidecar records it{}", output, kSidecar, gone));
  if (*size != r.size)
    return absl::DataLossError(
        fmt::format("{}: is {} bytes but its {} sidecar recorded {}{}", output, *size, kSidecar, r.size, gone));
  Xxh3 h;
  if (*size > 0) {
    PTK_ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(output));
    h.Update(mapped->data(), mapped->size());
  }
  if (h.HexDigest() != r.checksum)
    return absl::DataLossError(fmt::format(
        "{}: content checksum differs from the one its {} sidecar recorded: changed or damaged since it was written{}",
        output, kSidecar, gone));
  return absl::OkStatus();
}

// RunExtract's shard rule (FNV-1a of the input's name below its directory argument).
bool Owns(const ShardSpec& shard, const std::string& key) {
  if (shard.count <= 1) return true;
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h % static_cast<uint64_t>(shard.count)) == shard.index;
}

}  // namespace

std::vector<ExtractFileResult> VerifyOutputsWithoutInput(const std::vector<std::string>& roots,
                                                         const ShardSpec& shard) {
  struct Found {
    std::string output;
    std::string key;  // the input's name as RunExtract's shard rule reads it (less its suffix below a directory)
    bool add_suffix = false;
  };
  std::vector<Found> found;
  for (const std::string& root : roots) {
    if (!IsDirectory(root)) {  // a file argument: its output beside it, sharded by its base name
      found.push_back({StripCompressionSuffix(root), Basename(root), false});
      continue;
    }
    auto files = ListFilesRecursive(root);
    if (!files.ok()) continue;
    for (const std::string& rel : *files)
      if (rel.size() > kSidecar.size() && rel.ends_with(kSidecar)) {
        const std::string out_rel = rel.substr(0, rel.size() - kSidecar.size());
        found.push_back({JoinPath(root, out_rel), out_rel, true});
      }
  }
  std::vector<ExtractFileResult> results;
  for (const Found& f : found) {
    const std::optional<Recorded> rec = ReadSidecar(f.output);
    // Not ptk-extract's, or its input is there: the run itself checked that one.
    if (!rec || PathExists(rec->source)) continue;
    const std::string suffix = rec->source.substr(StripCompressionSuffix(rec->source).size());
    if (!Owns(shard, f.add_suffix ? f.key + suffix : f.key)) continue;
    ExtractFileResult& r = results.emplace_back();
    r.input = f.output;  // what failed is the output (its message names the input that is gone)
    r.output = f.output;
    r.error = CheckAgainstSidecar(f.output, *rec);
    r.state = r.error.ok() ? ExtractFileResult::State::kSkipped : ExtractFileResult::State::kFailed;
  }
  return results;
}

bool ArgumentWasExtracted(const std::string& arg, const std::string& output_dir) {
  std::error_code ec;
  const std::string pattern = std::filesystem::absolute(arg, ec).lexically_normal().string();
  const std::string root = output_dir.empty() ? Dirname(arg) : output_dir;
  if (ec || !IsDirectory(root)) return false;
  auto files = ListFilesRecursive(root);
  if (!files.ok()) return false;
  for (const std::string& rel : *files) {
    if (rel.size() <= kSidecar.size() || !rel.ends_with(kSidecar)) continue;
    const std::optional<Recorded> rec = ReadSidecar(JoinPath(root, rel.substr(0, rel.size() - kSidecar.size())));
    // As glob(3) expands it (a '*' does not cross a '/'); a plain name is itself.
    if (rec && ::fnmatch(pattern.c_str(), rec->source.c_str(), FNM_PATHNAME) == 0) return true;
  }
  return false;
}

}  // namespace ptk
