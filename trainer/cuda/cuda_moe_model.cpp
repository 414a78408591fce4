// The CUDA model's mixture-of-experts MLP (the CPU model's trainer/cpu/cpu_moe_layer.cpp, data-parallel only):
// the layer's router, experts and shared experts over the pre-MLP norm's output (moe_layer_cuda.h) into the
// projection scratch, the load-balancing loss's, seq_aux_loss's (moe_balance.cpp's) and the router z-loss's values
// kept for the log and their gradients injected with the step's scale in backward, as Megatron's
// MoEAuxLossAutoScaler does.
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/cuda_gpt_model_impl.h"
#include "trainer/cuda/moe_layer_cuda.h"

namespace ptk::cuda::model_detail {

template <typename T>
MoeWeights<T> CudaGPTModelImpl<T>::MoeWeightsOf(const LayerParams& lp) const {
  return MoeWeights<T>{Compute(lp.router_w), Compute(lp.experts), Compute(lp.shared_fc1), Compute(lp.shared_fc2),
                       Compute(lp.shared_gate)};
}

template <typename T>
MoeLayerSpec CudaGPTModelImpl<T>::MoeSpec() const {
  MoeLayerSpec spec = MoeLayerSpecOf(config(), n_, plan_.act_bytes);
  if (spec.shape.seq_tokens > 0) spec.shape.seq_tokens = t_;  // seq_aux_loss: the pass's sequences
  return spec;
}

template <typename T>
MoeBalanceLosses CudaGPTModelImpl<T>::TakeMoeBalanceLosses() {
  return std::exchange(moe_balance_sums_, MoeBalanceLosses{});
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MoeMlpForward(int64_t l, bool train) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  if (plan_.moe_saved < 0 || plan_.moe_scratch < 0 || tensor_size() > 1 || sequence_parallel_ || cp())
    return absl::FailedPreconditionError(fmt::format(
        "MoE layer {}: the CUDA backend runs mixture-of-experts layers data-parallel only, with their buffers "
        "planned",
        l));
  if (cf.moe_expert_capacity_factor >= 0 || cf.moe_global_aux_loss_coeff > 0)
    return absl::UnimplementedError(fmt::format(
        "MoE layer {}: the CUDA backend has no token dropping or global_aux_loss (trainer/backend.cpp refuses them "
        "first)",
        l));
  if (moe_host_.size() < layout().layers.size()) moe_host_.resize(layout().layers.size());
  MoeLayerHost& h = moe_host_[static_cast<size_t>(SlotLayer(l))];
  h.train = train;
  const MoeLossFlags losses{train && cf.moe_aux_loss_coeff > 0, train && cf.moe_z_loss_coeff > 0,
                            train && cf.moe_seq_aux_loss_coeff > 0};
  const int64_t c = cf.hidden_size, k = MoeLayersIn(cf, chunk_layer_begin(), l);
  const MoeLayerSpec spec = MoeSpec();
  MoeWeights<T> w = MoeWeightsOf(lp);
  if (spec.shape.biased) w.expert_bias = MoeBiasOf(l).first.data();  // cuda_moe_bias.cpp
  PTK_RETURN_IF_ERROR(Op("moe", "moe layer (router, dispatch, experts)",
                         MoeLayerForward<T>(Buf<T>(plan_.tmp), Act(plan_.ln2, l, n_ * c), w, spec,
                                            Buf<char>(plan_.moe_saved) + k * plan_.moe_saved_bytes,
                                            Buf<char>(plan_.moe_scratch), &h, losses, ctx_)));
  if (train && spec.shape.biased) {  // the dispatch's counts (the biased routing map), for the step's update
    std::vector<double>& tokens = MoeBiasOf(l).second;
    for (size_t e = 0; e < tokens.size(); ++e) tokens[e] += static_cast<double>(h.plan.counts[e]);
  }
  moe_aux_sum_ += h.aux_loss;
  moe_z_sum_ += h.z_loss;
  moe_balance_sums_.seq += h.seq_loss;
  return absl::OkStatus();
}

template <typename T>
absl::Status CudaGPTModelImpl<T>::MoeMlpBackward(int64_t l, const T* dmlp) {
  const GPTConfig& cf = config();
  const LayerParams& lp = layout().layers[static_cast<size_t>(l)];
  if (moe_host_.size() <= static_cast<size_t>(SlotLayer(l)))
    return absl::FailedPreconditionError(fmt::format("MoE layer {}: backward before its forward", l));
  const MoeLayerHost& h = moe_host_[static_cast<size_t>(SlotLayer(l))];
  // The losses' MoEAuxLossAutoScaler scale: the step's (with --calculate-per-token-loss the micro-batch's tokens).
  MoeLossGrads losses;
  if (h.train) {
    losses.aux = cf.moe_aux_loss_coeff * moe_aux_loss_scale_;
    losses.z = cf.moe_z_loss_coeff * moe_aux_loss_scale_;
    losses.seq = cf.moe_seq_aux_loss_coeff * moe_aux_loss_scale_;
  }
  const int64_t c = cf.hidden_size, k = MoeLayersIn(cf, chunk_layer_begin(), l);
  const MoeGrads grads{Grad(lp.router_w), Grad(lp.experts), Grad(lp.shared_fc1), Grad(lp.shared_fc2),
                       Grad(lp.shared_gate)};
  return Op("moe", "moe layer backward",
            MoeLayerBackward<T>(Buf<T>(plan_.dln), grads, dmlp, Act(plan_.ln2, l, n_ * c), MoeWeightsOf(lp), MoeSpec(),
                                Buf<char>(plan_.moe_saved) + k * plan_.moe_saved_bytes, Buf<char>(plan_.moe_scratch), h,
                                losses, ctx_));
}

#define PTK_INSTANTIATE(T)                                                               \
  template MoeWeights<T> CudaGPTModelImpl<T>::MoeWeightsOf(const LayerParams& lp) const; \
  template MoeLayerSpec CudaGPTModelImpl<T>::MoeSpec() const;                            \
  template MoeBalanceLosses CudaGPTModelImpl<T>::TakeMoeBalanceLosses();                 \
  template absl::Status CudaGPTModelImpl<T>::MoeMlpForward(int64_t l, bool train);       \
  template absl::Status CudaGPTModelImpl<T>::MoeMlpBackward(int64_t l, const T* dmlp);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda::model_detail
