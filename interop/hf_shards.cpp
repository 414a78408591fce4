// Hugging Face's sharded safetensors weights: save_pretrained's shard assignment and index, and the index read back.
#include "interop/hf_shards.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <set>
#include <utility>

#include <fmt/core.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/json_keys.h"
#include "common/json_writer.h"
#include "common/status.h"

namespace ptk::hf_detail {
namespace {

std::string_view Strip(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

absl::StatusOr<uint64_t> ParseMaxShardSize(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return UsageError(fmt::format(
        "--max-shard-size {:?}: {} (save_pretrained's forms: a number and KB, MB, GB or TB, decimal: 5GB = 5 x 10^9 "
        "bytes; or a byte count)",
        text, why));
  };
  const std::string_view s = Strip(text);
  if (!s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos) {
    if (s.size() > 18) return bad("too large");
    const uint64_t n = std::strtoull(std::string(s).c_str(), nullptr, 10);
    if (n == 0) return bad("a shard holds at least 1 byte");
    return n;
  }
  std::string unit(s.size() >= 2 ? s.substr(s.size() - 2) : s);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  static const std::pair<const char*, double> kUnits[] = {{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}};
  double multiplier = 0;
  for (const auto& [name, m] : kUnits)
    if (unit == name) multiplier = m;
  if (multiplier == 0)
    return bad(unit == "IB" ? "binary units (KiB, MiB, GiB) are not save_pretrained's (transformers 4.44 refuses them)"
                            : "no unit KB, MB, GB or TB at the end");
  const std::string number(Strip(s.substr(0, s.size() - 2)));
  char* end = nullptr;
  const double value = number.empty() ? 0 : std::strtod(number.c_str(), &end);
  // Python's float() has no hexadecimal form, which strtod reads.
  if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(value) ||
      number.find_first_of("xX") != std::string::npos)
    return bad(fmt::format("{:?} is not a number", number));
  const double bytes = std::trunc(value * multiplier);  // Python's int(value * multiplier)
  if (!(bytes >= 1)) return bad("a shard holds at least 1 byte");
  if (bytes > 0x1p62) return bad("too large");
  return static_cast<uint64_t>(bytes);
}

std::vector<int> AssignShards(const std::vector<uint64_t>& sizes, uint64_t max_shard_size) {
  std::vector<int> shard(sizes.size(), -1);
  std::vector<size_t> current;  // the tensors of the shard being filled
  uint64_t current_size = 0;
  int shards = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_shard_size) {  // alone, numbered now
      shard[i] = shards++;
      continue;
    }
    if (current_size + sizes[i] > max_shard_size) {
      for (size_t j : current) shard[j] = shards;
      ++shards;
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += sizes[i];
  }
  for (size_t j : current) shard[j] = shards;
  return shard;
}

std::string ShardFileName(int shard, int shards) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", shard + 1, shards);
}

bool IsShardFileName(std::string_view name) {
  constexpr std::string_view kHead = "model-", kMid = "-of-", kTail = ".safetensors";
  auto digits = [](std::string_view d) { return d.size() == 5 && d.find_first_not_of("0123456789") == d.npos; };
  return name.size() == kHead.size() + 5 + kMid.size() + 5 + kTail.size() && name.substr(0, kHead.size()) == kHead &&
         digits(name.substr(6, 5)) && name.substr(11, 4) == kMid && digits(name.substr(15, 5)) &&
         name.substr(20) == kTail;
}

std::string ShardIndexJson(const std::map<std::string, std::string>& weight_map, uint64_t total_size) {
  std::string out =
      fmt::format("{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{", total_size);
  bool first = true;
  for (const auto& [name, file] : weight_map) {  // std::map: sorted as Python sorts str keys (bytes, for ASCII)
    out += fmt::format("{}\n    \"{}\": \"{}\"", first ? "" : ",", JsonEscape(name), JsonEscape(file));
    first = false;
  }
  out += first ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

namespace {

// The index: weight_map (tensor -> file, each a file name of the directory, no name twice) and total_size.
absl::Status ReadShardIndex(const std::string& index_path, std::map<std::string, std::string>* weight_map,
                            std::optional<uint64_t>* total_size) {
  PTK_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(index_path));
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not a valid safetensors index: {}", index_path, why));
  };
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  simdjson::dom::object map, metadata;
  if (parser.parse(text).get(root) || !root.is_object()) return bad("not a JSON object");
  if (root["weight_map"].get(map)) return bad("no weight_map object");
  if (root["metadata"].get(metadata)) return bad("no metadata object (transformers reads it)");
  if (auto dup = FirstDuplicateJsonKey(root["weight_map"].value_unsafe()))
    return bad(fmt::format("tensor {} is named twice in weight_map", *dup));
  for (auto [key, value] : map) {
    std::string_view file;
    if (value.get(file)) return bad(fmt::format("weight_map's {}: not a file name", std::string(key)));
    if (file.empty() || file == "." || file == ".." || file.find('/') != file.npos)
      return bad(fmt::format("weight_map's {}: {:?} is not a file of the index's directory", std::string(key), file));
    (*weight_map)[std::string(key)] = std::string(file);
  }
  simdjson::dom::element total;
  if (!metadata["total_size"].get(total)) {
    uint64_t n = 0;
    double d = 0;
    if (!total.get(n)) {
      *total_size = n;
    } else if (!total.get(d) && d >= 0 && d < 0x1p63 && d == std::floor(d)) {
      *total_size = static_cast<uint64_t>(d);  // some writers give a float
    } else {
      return bad(fmt::format("metadata.total_size {}: not a byte count", simdjson::minify(total)));
    }
  }
  return absl::OkStatus();
}

// Every shard the index names, in from_pretrained's order (sorted), checked against the index.
absl::Status OpenShards(const std::string& load_dir, const std::string& index_path, HfWeights* w) {
  std::map<std::string, std::string> weight_map;
  std::optional<uint64_t> total_size;
  PTK_RETURN_IF_ERROR(ReadShardIndex(index_path, &weight_map, &total_size));
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : weight_map) by_file[file].push_back(name);
  uint64_t bytes = 0;
  for (const auto& [file, names] : by_file) {
    const std::string path = JoinPath(load_dir, file);
    if (!PathExists(path))
      return absl::DataLossError(fmt::format("{}: missing ({} places {} tensor{} there, {} the first)", path,
                                             kWeightsIndexName, names.size(), names.size() > 1 ? "s" : "",
                                             names.front()));
    PTK_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(path));
    for (const SafetensorsTensor& t : f->tensors()) {
      auto it = weight_map.find(t.name);
      if (it == weight_map.end())
        return absl::DataLossError(fmt::format("{}: tensor {}: not in {} (its weight_map names every tensor)", path,
                                               t.name, kWeightsIndexName));
      if (it->second != file)
        return absl::DataLossError(
            fmt::format("{}: tensor {}: {} places it in {}, not here", path, t.name, kWeightsIndexName, it->second));
      w->tensors[t.name] = {f.get(), &t};
      bytes += t.end - t.begin;
    }
    for (const std::string& name : names)
      if (f->Find(name) == nullptr)
        return absl::DataLossError(
            fmt::format("{}: tensor {}: missing ({} places it in this file)", path, name, kWeightsIndexName));
    w->files.push_back(std::move(f));
  }
  if (total_size && *total_size != bytes)
    return absl::DataLossError(fmt::format("{}: metadata.total_size {}, but the {} tensors of its shards hold {} bytes",
                                           index_path, *total_size, weight_map.size(), bytes));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HfWeights> OpenHfWeights(const std::string& load_dir, std::vector<std::string>* notes) {
  HfWeights w;
  const std::string single = JoinPath(load_dir, kWeightsName), index = JoinPath(load_dir, kWeightsIndexName);
  if (PathExists(single)) {
    // from_pretrained takes model.safetensors before an index.
    if (PathExists(index))
      notes->push_back(fmt::format("{} is not read: {} is there, which transformers' from_pretrained loads first",
                                   index, kWeightsName));
    w.source = single;
    PTK_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(single));
    for (const SafetensorsTensor& t : f->tensors()) w.tensors[t.name] = {f.get(), &t};
    w.files.push_back(std::move(f));
    return w;
  }
  if (PathExists(index)) {
    w.source = index;
    PTK_RETURN_IF_ERROR(OpenShards(load_dir, index, &w));
    return w;
  }
  if (PathExists(JoinPath(load_dir, "pytorch_model.bin")) ||
      PathExists(JoinPath(load_dir, "pytorch_model.bin.index.json")))
    return absl::FailedPreconditionError(fmt::format(
        "{}: the weights are a PyTorch pickle (pytorch_model.bin); ptk reads model.safetensors (save the model "
        "with safe_serialization=True)",
        load_dir));
  return absl::NotFoundError(fmt::format("{}: missing (and no {})", single, kWeightsIndexName));
}

}  // namespace ptk::hf_detail
