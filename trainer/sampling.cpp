// Greedy or temperature sampling through GPTModel::Forward, one full forward per new token.
#include "trainer/sampling.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/counter_rng.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {

int32_t PickToken(std::span<const float> logits, int64_t vocab_size, double temperature, uint64_t key) {
  const size_t n = std::min(logits.size(), static_cast<size_t>(vocab_size));
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return static_cast<int32_t>(best);
  // Inverse CDF of softmax(logits / T) at one uniform in [0, 1), in double.
  const double top = logits[best];
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += std::exp((logits[i] - top) / temperature);
  const double u = static_cast<double>(Mix64(key) >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += std::exp((logits[i] - top) / temperature);
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(best);  // rounding left u at the very top
}

absl::StatusOr<std::vector<int32_t>> Generate(GPTModel* model, std::span<const int32_t> prompt,
                                              const GenerateOptions& options, Communicator* pipeline,
                                              StageExchangeAgreement* agreed) {
  StageExchangeAgreement own;
  if (!agreed) agreed = &own;
  const GPTConfig& cf = model->config();
  if (prompt.empty()) return absl::InvalidArgumentError("a sample needs a prompt of at least one token");
  for (int32_t id : prompt)
    if (id < 0 || id >= cf.vocab_size)
      return absl::InvalidArgumentError(
          fmt::format("prompt token {} is outside the vocabulary of {}", id, cf.vocab_size));
  std::vector<int32_t> ids(prompt.begin(), prompt.end());
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask, logits;
  const int64_t vp = cf.padded_vocab_size;
  for (int64_t k = 0; k < options.new_tokens; ++k) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(ids.size()), cf.seq_length);
    const int64_t t = std::min<int64_t>(cf.seq_length, (len + 63) / 64 * 64);
    tokens.assign(static_cast<size_t>(t), 0);
    std::copy(ids.end() - len, ids.end(), tokens.begin());
    labels.assign(static_cast<size_t>(t), 0);
    positions.resize(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    mask.assign(static_cast<size_t>(t), 0.0f);
    ModelBatch batch{1, t, tokens.data(), labels.data(), positions.data(), mask.data(), nullptr};
    const bool picks = !pipeline || pipeline->rank() == pipeline->size() - 1;  // the last stage has the logits
    if (pipeline)
      PTK_RETURN_IF_ERROR(ForwardPipelining(model, pipeline, batch, &logits, agreed).status());
    else
      PTK_RETURN_IF_ERROR(model->Forward(batch, &logits).status());
    int32_t next = 0;
    if (picks) {
      if (static_cast<int64_t>(logits.size()) < t * vp)
        return absl::InternalError(fmt::format("Forward returned {} logits for {}x{}", logits.size(), t, vp));
      const std::span<const float> last(logits.data() + (len - 1) * vp, static_cast<size_t>(vp));
      const uint64_t key = Mix64(options.seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(k) + 1);
      next = PickToken(last, cf.vocab_size, options.temperature, key);
    }
    // The last stage's token to every stage (Megatron's broadcast from the last pipeline stage).
    if (pipeline) PTK_RETURN_IF_ERROR(pipeline->Broadcast(&next, sizeof next, pipeline->size() - 1));
    ids.push_back(next);
  }
  return std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(prompt.size()), ids.end());
}

}  // namespace ptk
