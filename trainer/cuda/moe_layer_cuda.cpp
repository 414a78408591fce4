// The device mixture-of-experts MLP (moe_layer_cuda.h).
#include "trainer/cuda/moe_layer_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include <fmt/core.h>

#include "common/status.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

template <typename U>
U* At(char* base, int64_t offset) {
  return reinterpret_cast<U*>(base + offset);
}

// The input (n, c) and the router's weight (E, c) in fp32: T's own buffers in fp32, else cast into the
// scratch (xf, then the weight after it).
template <typename T>
absl::Status RouterInputs(const float** xf, const float** wf, const T* x, const T* w_router, const MoeLayerSpec& spec,
                          char* scratch, const MoeBuffers& b, const CudaContext& ctx) {
  if constexpr (std::is_same_v<T, float>) {
    *xf = x;
    *wf = w_router;
    return absl::OkStatus();
  } else {
    const int64_t n = spec.shape.n, c = spec.shape.c;
    float* xs = At<float>(scratch, b.xf);
    float* ws = At<float>(scratch, b.wf);
    PTK_RETURN_IF_ERROR(CastToFloat<T>(xs, x, n * c, ctx));
    PTK_RETURN_IF_ERROR(CastToFloat<T>(ws, w_router, spec.shape.experts * c, ctx));
    *xf = xs;
    *wf = ws;
    return absl::OkStatus();
  }
}

template <typename T>
absl::Status ActivationForward(MoeActivation a, T* out, const T* in, int64_t rows, int64_t f, const CudaContext& ctx) {
  switch (a) {
    case MoeActivation::kSwiglu: return SwigluForward<T>(out, in, rows, f, ctx);
    case MoeActivation::kSquaredRelu: return SquaredReluForward<T>(out, in, rows * f, ctx);
    case MoeActivation::kGeluExact: return GeluExactForward<T>(out, in, rows * f, ctx);
    case MoeActivation::kGelu: return GeluForward<T>(out, in, rows * f, ctx);
  }
  return absl::InternalError("MoE: unknown activation");
}

// din (rows, fc1 width) assigned from dout (rows, f) and fc1's output in.
template <typename T>
absl::Status ActivationBackward(MoeActivation a, T* din, const T* in, const T* dout, int64_t rows, int64_t f,
                                const CudaContext& ctx) {
  switch (a) {
    case MoeActivation::kSwiglu: return SwigluBackward<T>(din, in, dout, rows, f, ctx);
    case MoeActivation::kSquaredRelu: return SquaredReluBackward<T>(din, in, dout, rows * f, ctx);
    case MoeActivation::kGeluExact: return GeluExactBackward<T>(din, in, dout, rows * f, ctx);
    case MoeActivation::kGelu: return GeluBackward<T>(din, in, dout, rows * f, ctx);
  }
  return absl::InternalError("MoE: unknown activation");
}

// The router's choices (and the losses' inputs) to the host, the plan built and uploaded.
absl::Status PlanDispatch(const MoeLayerSpec& spec, char* saved, char* scratch, const MoeBuffers& b, MoeLayerHost* host,
                          bool aux, bool z, const CudaContext& ctx) {
  const int64_t n = spec.shape.n, E = spec.shape.experts, K = spec.shape.topk;
  host->expert.resize(static_cast<size_t>(n * K));
  host->colsum.resize(static_cast<size_t>(E));
  host->lse.resize(static_cast<size_t>(n));
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host->expert.data(), At<int32_t>(saved, b.expert), n * K * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, ctx.stream),
                           "MoE: copying the router's choices to the host");
  if (aux)
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host->colsum.data(), At<float>(scratch, b.colsum), E * sizeof(float),
                                             cudaMemcpyDeviceToHost, ctx.stream),
                             "MoE: copying the scores' column sums to the host");
  if (z)
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host->lse.data(), At<float>(saved, b.lse), n * sizeof(float),
                                             cudaMemcpyDeviceToHost, ctx.stream),
                             "MoE: copying the logits' log-sum-exps to the host");
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream),
                           fmt::format("MoE: the router over {} tokens and {} experts", n, E));
  PTK_RETURN_IF_ERROR(BuildMoeDispatch(&host->plan, host->expert.data(), n, K, E));
  host->aux_loss = aux ? MoeAuxLossOf(host->colsum.data(), host->plan, n, K, E) : 0.0;
  host->z_loss = z ? MoeZLossOf(host->lse.data(), n) : 0.0;
  // Pageable sources: each copy has left them once it returns; they stay in `host` anyway.
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<int32_t>(saved, b.order), host->plan.order.data(),
                                           n * K * sizeof(int32_t), cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the dispatch order");
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<int32_t>(saved, b.combine), host->plan.combine.data(),
                                           n * K * sizeof(int32_t), cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the un-permute's rows");
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<float>(saved, b.counts), host->plan.counts.data(), E * sizeof(float),
                                           cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the experts' token counts");
  return absl::OkStatus();
}

}  // namespace

MoeLayerSpec MoeLayerSpecOf(const GPTConfig& cf, int64_t n, int64_t act_bytes) {
  MoeLayerSpec s;
  s.shape = MoeShapeOf(cf, n, act_bytes);
  s.routing.experts = cf.num_experts;
  s.routing.topk = cf.moe_router_topk;
  s.routing.sigmoid = cf.moe_router_sigmoid;
  s.routing.pre_softmax = cf.moe_router_pre_softmax && !cf.moe_router_sigmoid;
  s.routing.scaling = static_cast<float>(cf.moe_router_topk_scaling_factor);
  s.activation = cf.swiglu         ? MoeActivation::kSwiglu
                 : cf.squared_relu ? MoeActivation::kSquaredRelu
                 : cf.gelu_exact   ? MoeActivation::kGeluExact
                                   : MoeActivation::kGelu;
  return s;
}

template <typename T>
absl::Status MoeLayerForward(T* out, const T* x, const T* w_router, const T* w_experts, const MoeLayerSpec& spec,
                             char* saved, char* scratch, MoeLayerHost* host, bool aux, bool z, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const MoeBuffers b = PlanMoeBuffers(s);
  const int64_t n = s.n, c = s.c, E = s.experts, K = s.topk, f = s.ffn, f1 = s.fc1_rows, rows = s.rows();
  const int64_t per_expert = (f1 + f) * c;
  const float *xf = nullptr, *wf = nullptr;
  PTK_RETURN_IF_ERROR(RouterInputs<T>(&xf, &wf, x, w_router, spec, scratch, b, ctx));
  float* logits = At<float>(saved, b.logits);
  PTK_RETURN_IF_ERROR(MatmulForward<float>(logits, xf, wf, nullptr, n, c, E, ctx));
  float* scores = At<float>(saved, b.scores);
  float* gates = s.sigmoid ? At<float>(saved, b.gates) : nullptr;
  PTK_RETURN_IF_ERROR(MoeRouteForward(scores, gates, At<float>(saved, b.prob), At<int32_t>(saved, b.expert),
                                      At<float>(saved, b.lse), logits, n, spec.routing, ctx));
  if (aux) PTK_RETURN_IF_ERROR(MoeScoreColumnSums(At<float>(scratch, b.colsum), scores, n, E, ctx));
  PTK_RETURN_IF_ERROR(PlanDispatch(spec, saved, scratch, b, host, aux, z, ctx));
  const int32_t* order = At<int32_t>(saved, b.order);
  T* xr = At<T>(saved, b.x);
  T* fc1 = At<T>(saved, b.fc1);
  T* act = At<T>(saved, b.act);
  T* scaled = At<T>(saved, b.scaled);
  T* yr = At<T>(scratch, b.rows);
  PTK_RETURN_IF_ERROR(MoeGatherRows<T>(xr, x, order, rows, K, c, ctx));
  const std::vector<int64_t>& begin = host->plan.begin;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = begin[static_cast<size_t>(e)], ne = begin[static_cast<size_t>(e) + 1] - r0;
    if (ne == 0) continue;
    const T* w1 = w_experts + e * per_expert;
    PTK_RETURN_IF_ERROR(MatmulForward<T>(fc1 + r0 * f1, xr + r0 * c, w1, nullptr, ne, c, f1, ctx));
  }
  PTK_RETURN_IF_ERROR(ActivationForward<T>(spec.activation, act, fc1, rows, f, ctx));
  PTK_RETURN_IF_ERROR(MoeScaleRows<T>(scaled, act, At<float>(saved, b.prob), order, rows, f, ctx));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = begin[static_cast<size_t>(e)], ne = begin[static_cast<size_t>(e) + 1] - r0;
    if (ne == 0) continue;
    const T* w2 = w_experts + e * per_expert + f1 * c;
    PTK_RETURN_IF_ERROR(MatmulForward<T>(yr + r0 * c, scaled + r0 * f, w2, nullptr, ne, f, c, ctx));
  }
  return MoeCombineRows<T>(out, yr, At<int32_t>(saved, b.combine), nullptr, n, K, c, ctx);
}

template <typename T>
absl::Status MoeLayerBackward(T* dx, float* dw_router, float* dw_experts, const T* dout, const T* x, const T* w_router,
                              const T* w_experts, const MoeLayerSpec& spec, char* saved, char* scratch,
                              const MoeLayerHost& host, double aux_grad, double z_grad, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const MoeBuffers b = PlanMoeBuffers(s);
  const int64_t n = s.n, c = s.c, E = s.experts, K = s.topk, f = s.ffn, f1 = s.fc1_rows, rows = s.rows();
  const int64_t per_expert = (f1 + f) * c;
  if (static_cast<int64_t>(host.plan.begin.size()) != E + 1 || host.plan.begin[static_cast<size_t>(E)] != rows)
    return absl::FailedPreconditionError(
        fmt::format("MoE backward over {} tokens: the layer's forward left no dispatch plan of {} rows", n, rows));
  const int32_t* order = At<int32_t>(saved, b.order);
  const float* prob = At<float>(saved, b.prob);
  const T* xr = At<T>(saved, b.x);
  const T* fc1 = At<T>(saved, b.fc1);
  const T* act = At<T>(saved, b.act);
  const T* scaled = At<T>(saved, b.scaled);
  T* dyr = At<T>(scratch, b.rows);
  T* dscaled = At<T>(scratch, b.dscaled);
  T* dfc1 = At<T>(scratch, b.dfc1);
  T* dxr = At<T>(scratch, b.dx_rows);
  float* dprob = At<float>(scratch, b.dprob);
  PTK_RETURN_IF_ERROR(MoeGatherRows<T>(dyr, dout, order, rows, K, c, ctx));
  const std::vector<int64_t>& begin = host.plan.begin;
  for (int64_t e = 0; e < E; ++e) {  // fc2: the scaled activation's gradient, fc2's weight gradient
    const int64_t r0 = begin[static_cast<size_t>(e)], ne = begin[static_cast<size_t>(e) + 1] - r0;
    if (ne == 0) continue;
    const int64_t w2 = e * per_expert + f1 * c;
    PTK_RETURN_IF_ERROR(MatmulBackward<T>(dscaled + r0 * f, dw_experts + w2, nullptr, dyr + r0 * c, scaled + r0 * f,
                                          w_experts + w2, ne, f, c, ctx));
  }
  PTK_RETURN_IF_ERROR(MoeScaleRowsBackward<T>(dprob, dscaled, act, prob, order, rows, f, ctx));
  PTK_RETURN_IF_ERROR(ActivationBackward<T>(spec.activation, dfc1, fc1, dscaled, rows, f, ctx));
  for (int64_t e = 0; e < E; ++e) {  // fc1: the rows' input gradient, fc1's weight gradient
    const int64_t r0 = begin[static_cast<size_t>(e)], ne = begin[static_cast<size_t>(e) + 1] - r0;
    if (ne == 0) continue;
    const int64_t w1 = e * per_expert;
    PTK_RETURN_IF_ERROR(MatmulBackward<T>(dxr + r0 * c, dw_experts + w1, nullptr, dfc1 + r0 * f1, xr + r0 * c,
                                          w_experts + w1, ne, c, f1, ctx));
  }
  // The router: dlogits, then its input gradient (fp32) and weight gradient.
  const float *xf = nullptr, *wf = nullptr;
  PTK_RETURN_IF_ERROR(RouterInputs<T>(&xf, &wf, x, w_router, spec, scratch, b, ctx));
  float* dlogits = At<float>(scratch, b.dlogits);
  const float aux_unit = static_cast<float>(MoeAuxUnit(aux_grad, n, K, E));
  const float z_unit = n > 0 ? static_cast<float>(z_grad / static_cast<double>(n)) : 0.0f;
  PTK_RETURN_IF_ERROR(MoeRouteBackward(dlogits, At<float>(saved, b.logits), At<float>(saved, b.scores),
                                       s.sigmoid ? At<float>(saved, b.gates) : nullptr, prob, dprob,
                                       At<int32_t>(saved, b.expert), At<float>(saved, b.lse),
                                       At<float>(saved, b.counts), n, spec.routing, aux_unit, z_unit, ctx));
  float* dx_router = At<float>(scratch, b.dx_router);
  PTK_RETURN_IF_ERROR(MatmulBackward<float>(dx_router, dw_router, nullptr, dlogits, xf, wf, n, c, E, ctx));
  return MoeCombineRows<T>(dx, dxr, At<int32_t>(saved, b.combine), dx_router, n, K, c, ctx);
}

#define PTK_INSTANTIATE(T)                                                                                          \
  template absl::Status MoeLayerForward<T>(T*, const T*, const T*, const T*, const MoeLayerSpec&, char*, char*,     \
                                           MoeLayerHost*, bool, bool, const CudaContext&);                          \
  template absl::Status MoeLayerBackward<T>(T*, float*, float*, const T*, const T*, const T*, const T*,             \
                                            const MoeLayerSpec&, char*, char*, const MoeLayerHost&, double, double, \
                                            const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
