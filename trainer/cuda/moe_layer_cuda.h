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
// z-loss's gradients, and the input gradient assigned. Shared experts (Megatron's SharedExpertMLP, trainer/cpu/
// shared_experts_cpu.h): a dense MLP on every token, its output (x its sigmoid gate) added in the un-permute in
// fp32; its input gradient added to the router's (fp32) before the rows' un-permute.
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
  std::vector<int32_t> plain;     // each token's plain top-k (the losses' routing map; grouped aux_loss, seq_aux_loss)
  std::vector<float> aux_counts;  // the load-balancing loss's counts: the plan's, or plain's
  std::vector<float> seq_colsum, seq_counts;      // seq_aux_loss: (sequences, E) the scores' sums, plain's counts
  double aux_loss = 0, z_loss = 0, seq_loss = 0;  // without their coefficients (0 when not asked for)
  bool train = false;  // the forward was a training pass (its backward adds the losses' gradients)
};

// The layer's weights in T, as the products read them: the router's (E, c); the experts' (E x expert floats: each
// expert's fc1 (fc1_rows, c) then fc2 (c, ffn)); with shared experts (spec.shape.shared_ffn > 0) their fc1
// (shared_fc1_rows, c), fc2 (c, shared_ffn) and with the gate its weight (1, c) (null otherwise).
template <typename T>
struct MoeWeights {
  const T *router = nullptr, *experts = nullptr, *shared_fc1 = nullptr, *shared_fc2 = nullptr, *shared_gate = nullptr;
  const float* expert_bias = nullptr;  // on the host (E): the router's bias where spec.shape.biased (else null)
};
// Their gradients in fp32, added to (the shared ones null without shared experts, or without the gate).
struct MoeGrads {
  float *router = nullptr, *experts = nullptr, *shared_fc1 = nullptr, *shared_fc2 = nullptr, *shared_gate = nullptr;
};

// The losses a forward computes: aux (the load-balancing loss, aux_loss), z (the z-loss), seq (seq_aux_loss; with
// spec.shape.seq_tokens), their values into host->aux_loss, z_loss, seq_loss.
struct MoeLossFlags {
  bool aux = false, z = false, seq = false;
};
// The backward's d(objective) / d(each loss without its coefficient) (0: none).
struct MoeLossGrads {
  double aux = 0, z = 0, seq = 0;
};

// out (n, c) assigned from x (n, c): the routed experts' output plus the shared experts' where the spec has them.
// saved: the layer's saved region, scratch: the pass's (PlanMoeBuffers' sizes).
template <typename T>
absl::Status MoeLayerForward(T* out, const T* x, const MoeWeights<T>& w, const MoeLayerSpec& spec, char* saved,
                             char* scratch, MoeLayerHost* host, const MoeLossFlags& losses, const CudaContext& ctx);
// dx (n, c) assigned from dout (n, c); the gradients in g added to.
template <typename T>
absl::Status MoeLayerBackward(T* dx, const MoeGrads& g, const T* dout, const T* x, const MoeWeights<T>& w,
                              const MoeLayerSpec& spec, char* saved, char* scratch, const MoeLayerHost& host,
                              const MoeLossGrads& losses, const CudaContext& ctx);

}  // namespace ptk::cuda
