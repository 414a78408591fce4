// Megatron-LM's GPTDataset and BlendedDataset (megatron/core/datasets): the same document, sample,
// shuffle and blending indices, the same samples, and the same .npy index cache (file names from the
// MD5 of the same JSON description), so ptk and Megatron can read each other's caches.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/py_format.h"
#include "indexed_dataset/fim_dataset.h"
#include "indexed_dataset/indexed_dataset.h"
#include "indexed_dataset/npy.h"

namespace ptk {

enum class Split { kTrain = 0, kValid = 1, kTest = 2 };
const char* SplitName(Split s);

// Bookends per split; entry i is [lower, upper) of the normalized split vector or null (empty).
struct SplitMatrix {
  std::array<std::optional<std::pair<double, double>>, 3> bookends;
  py::Json ToJson() const;  // Megatron's repr: the very first lower bound is the integer 0
};

// parse_and_normalize_split: numbers from the string (regex [.0-9]+), padded with 0 to three,
// normalized with numpy's sum; then convert_split_vector_to_split_matrix.
absl::StatusOr<std::array<double, 3>> ParseAndNormalizeSplit(const std::string& split);
SplitMatrix MakeSplitMatrix(const std::array<double, 3>& v);

// The tokenizer part of the cache description: what megatron-core 0.16.1's GPT2BPETokenizer
// (MegatronTokenizerText over Hugging Face) reports as its unique_identifiers.
py::Json Gpt2TokenizerIdentifiers(const std::string& vocab_file, const std::string& merge_file);

struct GPTDatasetConfig {
  uint32_t random_seed = 1234;
  int64_t sequence_length = 0;
  std::optional<std::string> split;  // the raw --split string (absent with per-split data paths)
  std::optional<SplitMatrix> split_matrix;
  py::Json tokenizer;
  std::optional<std::string> path_to_cache;  // --data-cache-path
  bool write_cache = true;
  // An index cache write_cache asks for that cannot be saved fails the build (ptk-inspect --write-cache,
  // whose point it is) instead of a warning (a training run, whose indices are the same in memory).
  bool cache_write_required = false;
  bool add_extra_token_to_sequence = true;
  bool reset_position_ids = false, reset_attention_mask = false, eod_mask_loss = false;
  bool drop_last_partial_validation_sequence = true;
  double mid_level_dataset_surplus = 0.005;
  int64_t eod = 50256;
  int64_t pad = -1;  // Megatron's _PAD_TOKEN_ID when the tokenizer has no usable pad id
  // --fim-data: each GPTDataset is Megatron's GPTFIMDataset (its class name in the description and the
  // index cache's file names, its samples rewritten by its own FimTransform seeded with random_seed).
  std::shared_ptr<const FimConfig> fim;
};

// An index cache that could not be written (`what`: "GPTDataset", "BlendedDataset"; `dir`: where
// it goes): a warning naming the directory, why, and what follows (the indices are built in
// memory, the same, so the run is unaffected; the next run builds them again), once per directory
// and process (a run's splits and blended datasets would repeat it).
void WarnIndexCacheNotSaved(const char* what, const std::string& dir, const GPTDatasetConfig& config,
                            const absl::Status& why);
// The warning, or with config.cache_write_required `why` itself, annotated with the directory (its code
// kept: a full disk stays kResourceExhausted).
absl::Status IndexCacheNotSaved(const char* what, const std::string& dir, const GPTDatasetConfig& config,
                                const absl::Status& why);

// One training sample as Megatron's GPTDataset.__getitem__ returns it.
struct GPTSample {
  std::vector<int64_t> tokens, labels, position_ids;
  std::vector<float> loss_mask;
  int64_t dataset_id = 0;  // for blends
};

class TopLevelDataset {
 public:
  virtual ~TopLevelDataset() = default;
  virtual int64_t size() const = 0;
  // The seq_length + 1 token ids of sample idx (padded with `pad` when drop_last is off).
  virtual absl::Status Text(int64_t idx, int64_t* out, int64_t* dataset_id) const = 0;
  absl::Status Get(int64_t idx, GPTSample* s) const;
  const GPTDatasetConfig& config() const { return config_; }
  const std::string& description() const { return description_; }
  const std::string& description_hash() const { return hash_; }
  virtual py::Json unique_identifiers() const = 0;
  bool loaded_from_cache() const { return from_cache_; }

 protected:
  GPTDatasetConfig config_;
  std::string description_, hash_;
  bool from_cache_ = false;
};

class GPTDataset : public TopLevelDataset {
 public:
  // `beg`/`end`: the range of sequences of `dataset` exposed by this split. num_samples: nullopt
  // means one epoch.
  static absl::StatusOr<std::shared_ptr<GPTDataset>> Build(std::shared_ptr<IndexedDataset> dataset,
                                                           const std::string& dataset_path, int64_t beg, int64_t end,
                                                           std::optional<int64_t> num_samples, Split split,
                                                           const GPTDatasetConfig& config);
  int64_t size() const override { return sample_index_.shape()[0] - 1; }
  absl::Status Text(int64_t idx, int64_t* out, int64_t* dataset_id) const override;
  py::Json unique_identifiers() const override { return identifiers_; }

  const IndexArray& document_index() const { return document_index_; }
  const IndexArray& sample_index() const { return sample_index_; }
  const IndexArray& shuffle_index() const { return shuffle_index_; }
  int64_t num_epochs() const { return num_epochs_; }
  std::string cache_prefix() const { return cache_prefix_; }  // ".../{md5}-GPTDataset-{split}-"

 private:
  // Builds the three arrays; with `save`, writes each to the cache as soon as it is final (the
  // writes overlap with the rest of the build).
  absl::Status BuildIndices(std::optional<int64_t> num_samples, bool save);
  // The lengths of the arrays BuildIndices makes for this split of the dataset as it is now.
  struct IndexShapes {
    int64_t documents = 0, samples = 0, epochs = 0;
  };
  absl::StatusOr<IndexShapes> ExpectedIndexShapes(std::optional<int64_t> num_samples) const;
  bool TryLoadCache(std::optional<int64_t> num_samples);
  std::shared_ptr<IndexedDataset> dataset_;
  int64_t beg_ = 0, end_ = 0;
  Split split_ = Split::kTrain;
  py::Json identifiers_;
  IndexArray document_index_, sample_index_, shuffle_index_;
  int64_t num_epochs_ = 0;
  // --fim-data: the transform draws in the order samples are read (Text is called by one loader at a time,
  // the lock keeps it whole).
  struct FimState {
    std::mutex mu;
    FimTransform transform;
  };
  std::unique_ptr<FimState> fim_;
  std::string cache_prefix_;
};

}  // namespace ptk
