// The CUDA model's aux-loss-free routing state (--moe-router-enable-expert-bias; the CPU model's
// trainer/cpu/moe_balance.cpp): each MoE layer's expert bias and the tokens its experts got in the step, on the
// host (the router's kernel reads the bias uploaded with each forward); after the step the counts summed over the
// data group move the bias by rate x sign(mean - load) (Megatron's get_updated_expert_bias, in fp32); the biases
// are the model's checkpoint buffers under Megatron's names (router.expert_bias).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/expert_bias_buffers.h"

namespace ptk::cuda::model_detail {

template <typename T>
std::pair<std::vector<float>, std::vector<double>>& CudaGPTModelImpl<T>::MoeBiasOf(int64_t l) {
  const size_t E = static_cast<size_t>(config().num_experts);
  if (moe_bias_.size() < layout().layers.size()) moe_bias_.resize(layout().layers.size());
  auto& st = moe_bias_[static_cast<size_t>(l)];
  if (st.first.empty()) st.first.assign(E, 0.0f), st.second.assign(E, 0.0);
  return st;
}

template <typename T>
std::string CudaGPTModelImpl<T>::ExpertBiasName(int64_t l) const {
  const GPTConfig& cf = config();
  if (!cf.moe_router_enable_expert_bias || !cf.moe_layer(l)) return "";
  const int64_t at = layout().layers[static_cast<size_t>(l)].router_w;
  const std::string weight = "weight";
  for (const ParamInfo& p : layout().infos)
    if (p.offset == at && p.name.size() >= weight.size())
      return p.name.substr(0, p.name.size() - weight.size()) + "expert_bias";
  return "";
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::FinishMoeStep() {
  const GPTConfig& cf = config();
  if (!cf.moe() || !cf.moe_router_enable_expert_bias) return absl::OkStatus();
  for (int64_t l = 0; l < static_cast<int64_t>(layout().layers.size()); ++l) {
    if (!cf.moe_layer(l)) continue;
    auto& [bias, tokens] = MoeBiasOf(l);
    if (moe_data_comm_ != nullptr && moe_data_comm_->size() > 1)
      PTK_RETURN_IF_ERROR(moe_data_comm_->AllReduceSum(tokens.data(), static_cast<int64_t>(tokens.size())));
    float total = 0;  // get_updated_expert_bias in fp32: the mean load minus each expert's, its sign times the rate
    for (double t : tokens) total += static_cast<float>(t);
    const float mean = total / static_cast<float>(tokens.size()),
                rate = static_cast<float>(cf.moe_router_bias_update_rate);
    for (size_t e = 0; e < tokens.size(); ++e) {
      const float offset = mean - static_cast<float>(tokens[e]);
      bias[e] += (offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f) * rate;
    }
    std::fill(tokens.begin(), tokens.end(), 0.0);
  }
  return absl::OkStatus();
}

template <typename T>
ModelBuffers CudaGPTModelImpl<T>::ReadBuffers() const {
  ModelBuffers out;
  for (int64_t l = 0; l < static_cast<int64_t>(layout().layers.size()); ++l) {
    const std::string name = ExpertBiasName(l);
    if (name.empty()) continue;
    const bool held = static_cast<size_t>(l) < moe_bias_.size() && !moe_bias_[static_cast<size_t>(l)].first.empty();
    out.emplace_back(name, held ? moe_bias_[static_cast<size_t>(l)].first
                                : std::vector<float>(static_cast<size_t>(config().num_experts), 0.0f));
  }
  return out;
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::WriteBuffers(const ModelBuffers& in) {
  return LoadExpertBiases(
      in, static_cast<int64_t>(layout().layers.size()), config().num_experts,
      [&](int64_t l) { return ExpertBiasName(l); },
      [&](int64_t l, const std::vector<float>& v) { MoeBiasOf(l).first = v; });
}

#define PTK_INSTANTIATE(T)                                                                                \
  template std::pair<std::vector<float>, std::vector<double>>& CudaGPTModelImpl<T>::MoeBiasOf(int64_t l); \
  template std::string CudaGPTModelImpl<T>::ExpertBiasName(int64_t l) const;                              \
  template absl::Status CudaGPTModelImpl<T>::FinishMoeStep();                                             \
  template ModelBuffers CudaGPTModelImpl<T>::ReadBuffers() const;                                         \
  template absl::Status CudaGPTModelImpl<T>::WriteBuffers(const ModelBuffers& in);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
