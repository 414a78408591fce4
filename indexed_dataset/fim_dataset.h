// Megatron-LM's fill-in-the-middle samples (GPTFIMDataset, megatron/training/datasets/fim_dataset.py):
// a GPT sample's EOD-separated segments (and, with a split token, their fragments) rewritten as
// prefix/suffix/middle with sentinel tokens, by the same numpy draws, then cut or padded to its length.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "indexed_dataset/numpy_random.h"

namespace ptk {

// The tokenizer FIM re-tokenizes with (indexed_dataset does not reach the tokenizer: the trainer
// passes one in). One codec serves every split's datasets, whose loaders run in their own threads:
// an implementation is thread-safe.
class FimTextCodec {
 public:
  virtual ~FimTextCodec() = default;
  // Megatron's ids_to_text: the tokens' bytes, special tokens left out, decoded as UTF-8 with
  // U+FFFD for ill-formed bytes (Python's "replace"). An id outside the vocabulary is an error.
  virtual absl::StatusOr<std::string> Decode(std::span<const int64_t> ids) = 0;
  // Megatron's text_to_ids, appended to *out.
  virtual absl::Status Encode(std::string_view text, std::vector<int64_t>* out) = 0;
};

struct FimConfig {
  double rate = 0.5;                                             // --fim-rate
  double spm_rate = 0.5;                                         // --fim-spm-rate
  double fragment_rate = 0;                                      // --fim-fragment-rate (needed with split_sample)
  std::optional<int64_t> split_sample;                           // --fim-split-sample's token id
  std::optional<std::string> no_prefix;                          // --fim-no-prefix
  int64_t prefix = 0, middle = 0, suffix = 0, pad = 0, eod = 0;  // the --fim-*-token ids
  std::shared_ptr<FimTextCodec> codec;
};

// One GPTFIMDataset's RNG and rules. Megatron's RNG is the dataset's own numpy RandomState seeded
// with the run's seed once, so a sample's FIM depends on every sample the dataset gave before it:
// Apply must see the samples in the order they are read.
class FimTransform {
 public:
  FimTransform(FimConfig config, uint32_t seed) : c_(std::move(config)), rng_(seed) {}
  // The sample's tokens (all of them, Megatron's concatenated parts) rewritten in place, its length kept.
  absl::Status Apply(std::vector<int64_t>* sample);

 private:
  // _fim_split_and_permute_sequence and _permute (without truncate_or_pad, as GPTFIMDataset calls it).
  absl::Status SplitAndPermute(std::span<const int64_t> seq, std::vector<int64_t>* out);
  absl::Status Permute(std::span<const int64_t> seq, double rate, std::vector<int64_t>* out);
  bool Draw(double p) { return rng_.Binomial(1, p) != 0; }
  FimConfig c_;
  NumpyRandomState rng_;
};

// Python's str slicing over UTF-8 text: the byte offset of code point `cp` (the text's size past its end).
size_t Utf8Offset(std::string_view text, int64_t cp);
int64_t Utf8Length(std::string_view text);

}  // namespace ptk
