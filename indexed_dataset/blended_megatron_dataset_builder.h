// Megatron-LM's BlendedMegatronDatasetBuilder (megatron/core/datasets/blended_megatron_dataset_builder.py):
// --data-path / per-split paths, --split and the sample counts -> one top-level dataset per split.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/blended_dataset.h"
#include "indexed_dataset/gpt_dataset.h"

namespace ptk {

// Megatron's data arguments, resolved to datasets exactly as BlendedMegatronDatasetBuilder does.
struct DataArgs {
  std::vector<std::string> data_path;                           // --data-path: "w1 p1 w2 p2 ..." or "p1 p2 ..."
  std::array<std::vector<std::string>, 3> per_split_data_path;  // --train/--valid/--test-data-path
  std::string split = "969, 30, 1";
  std::array<std::optional<int64_t>, 3> sizes;  // samples requested per split (None = one epoch/exhaustive)
  // Megatron's multiple_validation_sets: a --valid-data-path of several prefixes gives one validation dataset per
  // prefix (their weights unused), each built as a single prefix is, instead of their blend.
  bool multiple_validation_sets = false;
};

// Returns one dataset per split (nullptr where that split is empty or not given). What a caller
// should print (IndexedDataset::IdxTrailingBytesWarning and BinTrailingBytesWarning of each dataset
// opened) goes to *warnings. `validation_sets` (when given) receives the validation datasets: the
// validation split's one, or with multiple_validation_sets one per --valid-data-path prefix, in order
// (the returned validation split is then the first).
absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildGPTDatasets(
    const DataArgs& args, GPTDatasetConfig config, std::vector<std::string>* warnings = nullptr,
    std::vector<std::shared_ptr<TopLevelDataset>>* validation_sets = nullptr);

// Megatron's get_blend_from_list: even count -> (weights, prefixes), odd -> prefixes only.
absl::Status ParseBlend(const std::vector<std::string>& list, std::vector<std::string>* prefixes,
                        std::optional<std::vector<double>>* weights);

// Before anything is built or read: every prefix the data paths name is a whole dataset (each
// ResolveDatasetPrefix's NotFound naming what is wrong: a missing pair, half of one, a misspelt
// name), and the blends parse. So that a run stops at once, not after its model is made.
absl::Status CheckDataPaths(const DataArgs& args);

// Why these data flags give the run no validation dataset, or "" when they give it one: with
// per-split paths, no --valid-data-path; else a --split whose validation part is 0, or so small
// beside the others that its range in the split matrix is empty (999999999999999999999,1,1), where
// Megatron's convert_split_vector_to_split_matrix gives None too.
absl::StatusOr<std::string> NoValidationSplit(const DataArgs& args);

}  // namespace ptk
