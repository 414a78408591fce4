// Hugging Face's sharded weights (model-00001-of-0000N.safetensors and model.safetensors.index.json), as
// transformers 4.44's save_pretrained writes them and from_pretrained reads them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "interop/safetensors.h"

namespace ptk::hf_detail {

inline constexpr char kWeightsName[] = "model.safetensors";
inline constexpr char kWeightsIndexName[] = "model.safetensors.index.json";
// save_pretrained's default max_shard_size.
inline constexpr char kDefaultMaxShardSize[] = "5GB";

// --max-shard-size as save_pretrained reads its max_shard_size (huggingface_hub 0.24's
// parse_size_to_int): a number (a decimal fraction too) and a unit KB, MB, GB or TB in any case, decimal
// (1GB = 10^9 bytes), truncated to whole bytes; or a byte count (save_pretrained's int). Binary units
// (GiB) are refused, as save_pretrained refuses them. A UsageError names the flag.
absl::StatusOr<uint64_t> ParseMaxShardSize(std::string_view text);

// The shard of each tensor (sizes in bytes, in state_dict order) as huggingface_hub's
// split_torch_state_dict_into_shards assigns them: in order, a new shard when the next tensor would take
// the current one past `max_shard_size`; a tensor larger than that alone in a shard of its own, numbered
// when it is met (before the shard still filling). Returns each tensor's shard (0-based); the shards
// are 1 + the largest.
std::vector<int> AssignShards(const std::vector<uint64_t>& sizes, uint64_t max_shard_size);

// model-00002-of-00005.safetensors for shard 1 of 5.
std::string ShardFileName(int shard, int shards);
// True for a name ShardFileName can give.
bool IsShardFileName(std::string_view name);

// model.safetensors.index.json as save_pretrained writes it (json.dumps(indent=2, sort_keys=True) and a
// newline): metadata.total_size and weight_map, tensor name -> file.
std::string ShardIndexJson(const std::map<std::string, std::string>& weight_map, uint64_t total_size);

// A tensor of an HF directory and the file that holds it.
struct PresentTensor {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

// An HF directory's weights, mapped: model.safetensors, or else every shard its index names (mapped,
// as one file is: pages are read as the tensors are, nothing is held). `source` is the file named in
// a refusal of a missing tensor (model.safetensors or the index).
struct HfWeights {
  std::string source;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, PresentTensor> tensors;
  // Counts each tensor read and its bytes (ReadPresentTensors sets its totals); nullptr: none.
  ProgressReporter* progress = nullptr;
};

// Opens `load_dir`'s weights as from_pretrained picks them: model.safetensors when it is there (an index
// beside it is not read: a note says so), else model.safetensors.index.json and its shards, checked
// against each other: every file it names there, every tensor in the file it names and nowhere else, no
// tensor of a shard missing from the index, none named twice, total_size the tensors' bytes. A
// violation is kDataLoss naming the file and the tensor; a pytorch_model.bin alone is FailedPrecondition.
absl::StatusOr<HfWeights> OpenHfWeights(const std::string& load_dir, std::vector<std::string>* notes);

}  // namespace ptk::hf_detail
