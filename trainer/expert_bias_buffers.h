// The expert biases of aux-loss-free routing (--moe-router-enable-expert-bias) as checkpoint buffers: the CPU and
// CUDA models' WriteBuffers share their load and its checks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "trainer/gpt_model.h"

namespace ptk {

// For each layer l < `layers` whose `name(l)` is not empty, the buffer of that name in `in` (of `num_experts`
// values) handed to `set(l, values)`. Refused, naming the buffer: one missing (a checkpoint saved without the
// bias), one of another size, and a buffer in `in` that no layer takes (saved with the bias, resumed without).
absl::Status LoadExpertBiases(const ModelBuffers& in, int64_t layers, int64_t num_experts,
                              const std::function<std::string(int64_t)>& name,
                              const std::function<void(int64_t, const std::vector<float>&)>& set);

}  // namespace ptk
