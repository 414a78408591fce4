// Megatron-LM's BlendedDataset (megatron/core/datasets/blended_dataset.py): several GPTDatasets
// mixed by weight with Megatron's blending indices, or exhaustively by their lengths.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "indexed_dataset/gpt_dataset.h"

namespace ptk {

class BlendedDataset : public TopLevelDataset {
 public:
  // With a size: weights are normalized (again) and build_blending_indices runs; without one the
  // weights must be integers (dataset lengths) and the exhaustive blend is built.
  static absl::StatusOr<std::shared_ptr<BlendedDataset>> Build(std::vector<std::shared_ptr<GPTDataset>> datasets,
                                                               std::vector<double> weights, bool integer_weights,
                                                               std::optional<int64_t> size, Split split,
                                                               const GPTDatasetConfig& config);
  int64_t size() const override { return dataset_index_.size(); }
  absl::Status Text(int64_t idx, int64_t* out, int64_t* dataset_id) const override;
  py::Json unique_identifiers() const override { return identifiers_; }
  const IndexArray& dataset_index() const { return dataset_index_; }
  const IndexArray& dataset_sample_index() const { return dataset_sample_index_; }
  const std::vector<std::shared_ptr<GPTDataset>>& datasets() const { return datasets_; }

 private:
  std::vector<std::shared_ptr<GPTDataset>> datasets_;
  py::Json identifiers_;
  IndexArray dataset_index_, dataset_sample_index_;
};

}  // namespace ptk
