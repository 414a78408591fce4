// Text continuations from the model being trained (ptk-train --sample-interval), as llm.c prints
// them: the model's Forward (or a pipeline's stages) over the whole context for every new token (no KV cache: samples
// are short), greedy or drawn at a temperature with a counter-based generator (the same seed, the same tokens).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/gpt_model.h"

namespace ptk {

class StageExchangeAgreement;  // pipeline_schedule.h

struct GenerateOptions {
  int64_t new_tokens = 32;
  double temperature = 0;  // 0: greedy (the first of equal maxima); > 0: softmax(logits / temperature)
  uint64_t seed = 0;       // keys the draws when temperature > 0
};

// The `new_tokens` ids that continue `prompt` (at least one id). The context is the last
// --seq-length ids; only the real vocabulary (config().vocab_size) is drawn from: the padded rows'
// logits are never chosen. Forward runs on a length rounded up to a multiple of 64 (causal
// attention: the positions after the last id do not change its logits), so a backend sees few
// distinct shapes. With `pipeline` (the model one stage of several) every stage calls it: each
// token's forward goes through the stages, the last stage picks the token and broadcasts it over
// the pipeline group, so every stage returns the same ids (one rank's, the logits having its bits).
// The stages agree on their exchange once per shape (`agreed`, the caller's across calls, or this
// call's own), not per token.
absl::StatusOr<std::vector<int32_t>> Generate(GPTModel* model, std::span<const int32_t> prompt,
                                              const GenerateOptions& options, Communicator* pipeline = nullptr,
                                              StageExchangeAgreement* agreed = nullptr);

// The next id from one position's logits (vocab_size of them are considered).
int32_t PickToken(std::span<const float> logits, int64_t vocab_size, double temperature, uint64_t key);

}  // namespace ptk
