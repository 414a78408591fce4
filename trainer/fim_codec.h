// --fim-data's settings and tokenizer: Megatron-LM's FIM flags (megatron/training/arguments.py) resolved as
// pretrain_gpt.py and GPTFIMDataset do, over GPT-2 BPE as megatron-core 0.16.1's GPT2BPETokenizer runs it
// (Hugging Face's slow GPT2Tokenizer).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "indexed_dataset/fim_dataset.h"

namespace ptk {

// The flags, as given (Megatron's defaults).
struct FimOptions {
  bool enabled = false;  // --fim-data
  double rate = 0.5, spm_rate = 0.5;
  std::optional<double> fragment_rate;
  std::optional<std::string> split_sample, no_prefix;
  std::string prefix_token = "<fim_prefix>", middle_token = "<fim_middle>", suffix_token = "<fim_suffix>",
              pad_token = "<fim_pad>", eod_token = "<|endoftext|>";
};

// The tokens looked up in vocab.json (vocab_file "": ptk's built-in GPT-2 files) by their vocab.json
// spelling, as Megatron's tokens_to_ids; a rate outside [0, 1], --fim-split-sample without
// --fim-fragment-rate, or a token the vocabulary lacks (Megatron's tokenizer would give its unknown
// token, <|endoftext|>, for it without a word) is a usage error naming the flag.
absl::StatusOr<std::shared_ptr<const FimConfig>> MakeFimConfig(const FimOptions& o, const std::string& vocab_file,
                                                               const std::string& merge_file);

}  // namespace ptk
