// A mixture-of-experts MLP on the device (Megatron's MoELayer with TopKRouter and SequentialMLP, dropless,
// data-parallel: every expert on this rank), the CUDA twin of trainer/cpu/moe_cpu.cpp's MoeRouterForward,
// MoeExpertsForward and MoeBackward over the planned buffers (moe_plan.h):
//   the router: the input and the router's weight in fp32, logits = x W^T (cuBLASLt, fp32), scores, top-k and
//   probabilities (MoeRouteForward); the choices copied to the host, where the dispatch plan is built (each
//   expert's row count is what its products are launched with: one synchronisation per layer, as Megatron's
//   SequentialMLP's tokens_per_expert.tolist()) and the plan uploaded;
//   the experts: the tokens gathered into their rows, each expert's fc1 over its rows, the activation over all
//   rows, the rows scaled by their probabilities, each expert's fc2; the un-permute adds each token's rows in a
//   fixed order.
// Backward runs it in reverse from the output gradient: each expert's fc2 and fc1 backward (weight gradients
// added in fp32), the probabilities' gradient, the router's backward with the load-balancing loss's and the
// z-loss's gradients, and the input gradient assigned.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/cuda/cuda_common.h"
#include "trainer/cuda/moe_ops_cuda.h"
#include "trainer/cuda/moe_plan.h"

namespace ptk::cuda {

enum class MoeActivation { kGelu, kGeluExact, kSquaredRelu, kSwiglu };

struct MoeLayerSpec {
  MoeShape shape;
  MoeRouting routing;
  MoeActivation activation = MoeActivation::kGelu;
};
MoeLayerSpec MoeLayerSpecOf(const GPTConfig& cf, int64_t n, int64_t act_bytes);

// What one layer's forward leaves on the host for its backward and the log.
struct MoeLayerHost {
  MoeDispatchPlan plan;
  std::vector<int32_t> expert;
  std::vector<float> colsum, lse;
  double aux_loss = 0, z_loss = 0;  // without their coefficients (0 when not asked for)
  bool train = false;               // the forward was a training pass (its backward adds the losses' gradients)
};

// out (n, c) assigned from x (n, c). w_router (E, c) and w_experts (E x expert floats: each expert's fc1
// (fc1_rows, c) then fc2 (c, ffn)) in T, as the products read them. saved: the layer's saved region, scratch:
// the pass's (PlanMoeBuffers' sizes). aux / z: compute the load-balancing loss's / the z-loss's value into
// host->aux_loss / z_loss.
template <typename T>
absl::Status MoeLayerForward(T* out, const T* x, const T* w_router, const T* w_experts, const MoeLayerSpec& spec,
                             char* saved, char* scratch, MoeLayerHost* host, bool aux, bool z, const CudaContext& ctx);
// dx (n, c) assigned from dout (n, c); dw_router and dw_experts (fp32) added to. aux_grad / z_grad:
// d(objective) / d(the loss without its coefficient) (0: none).
template <typename T>
absl::Status MoeLayerBackward(T* dx, float* dw_router, float* dw_experts, const T* dout, const T* x, const T* w_router,
                              const T* w_experts, const MoeLayerSpec& spec, char* saved, char* scratch,
                              const MoeLayerHost& host, double aux_grad, double z_grad, const CudaContext& ctx);

}  // namespace ptk::cuda
