#include "trainer/expert_bias_buffers.h"

#include <algorithm>

#include <fmt/format.h>

namespace ptk {

absl::Status LoadExpertBiases(const ModelBuffers& in, int64_t layers, int64_t num_experts,
                              const std::function<std::string(int64_t)>& name,
                              const std::function<void(int64_t, const std::vector<float>&)>& set) {
  size_t used = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string n = name(l);
    if (n.empty()) continue;
    auto it = std::find_if(in.begin(), in.end(), [&](const auto& b) { return b.first == n; });
    if (it == in.end())
      return absl::InvalidArgumentError(fmt::format(
          "the checkpoint holds no {} (saved without --moe-router-enable-expert-bias?): ptk resumes aux-loss-free "
          "routing only from a checkpoint of it",
          n));
    if (it->second.size() != static_cast<size_t>(num_experts))
      return absl::InvalidArgumentError(
          fmt::format("the checkpoint's {} has {} values for --num-experts {}", n, it->second.size(), num_experts));
    set(l, it->second);
    ++used;
  }
  if (used != in.size())
    return absl::InvalidArgumentError(
        fmt::format("the checkpoint holds {} buffer(s) this model has none of (the first: {}; saved with "
                    "--moe-router-enable-expert-bias, which this run does not give?)",
                    in.size() - used, in.empty() ? "" : in.front().first));
  return absl::OkStatus();
}

}  // namespace ptk
