// The device mixture-of-experts MLP (moe_layer_cuda.h).
#include "trainer/cuda/moe_layer_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// A device-to-host copy of count T's from src into `to` (resized).
template <typename U>
absl::Status ToHost(std::vector<U>* to, const U* src, int64_t count, const char* what, const CudaContext& ctx) {
  to->resize(static_cast<size_t>(count));
  if (count == 0) return absl::OkStatus();
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to->data(), src, count * sizeof(U), cudaMemcpyDeviceToHost, ctx.stream),
                           fmt::format("MoE: copying {} to the host", what));
  return absl::OkStatus();
}

// The router's choices (and the losses' inputs) to the host, the plan built and uploaded, the losses' values.
absl::Status PlanDispatch(const MoeLayerSpec& spec, char* saved, char* scratch, const MoeBuffers& b, MoeLayerHost* host,
                          const MoeLossFlags& losses, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const int64_t n = s.n, E = s.experts, K = s.topk;
  const bool aux = losses.aux, seq = losses.seq && s.seq_tokens > 0;
  const bool plain_aux = aux && (s.grouped || s.biased), plain = plain_aux || seq;
  PTK_RETURN_IF_ERROR(ToHost(&host->expert, At<int32_t>(saved, b.expert), n * K, "the router's choices", ctx));
  PTK_RETURN_IF_ERROR(ToHost(&host->colsum, At<float>(scratch, b.colsum), aux ? E : 0, "the scores' sums", ctx));
  PTK_RETURN_IF_ERROR(
      ToHost(&host->plain, At<int32_t>(scratch, b.plain), plain ? n * K : 0, "the plain top-k routing map", ctx));
  PTK_RETURN_IF_ERROR(ToHost(&host->seq_colsum, At<float>(scratch, b.seq_colsum), seq ? s.seqs() * E : 0,
                             "the scores' sums per sequence", ctx));
  PTK_RETURN_IF_ERROR(ToHost(&host->lse, At<float>(saved, b.lse), losses.z ? n : 0, "the log-sum-exps", ctx));
  PTK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream),
                           fmt::format("MoE: the router over {} tokens and {} experts", n, E));
  PTK_RETURN_IF_ERROR(BuildMoeDispatch(&host->plan, host->expert.data(), n, K, E));
  host->aux_counts = host->plan.counts;
  if (plain_aux)  // the load-balancing loss counts each token's plain top-k
    PTK_RETURN_IF_ERROR(MoeRoutingCounts(&host->aux_counts, host->plain.data(), n, K, E));
  host->seq_counts.clear();
  if (seq) PTK_RETURN_IF_ERROR(MoeRoutingCounts(&host->seq_counts, host->plain.data(), n, K, E, s.seq_tokens));
  host->aux_loss = aux ? MoeAuxLossOf(host->colsum.data(), host->aux_counts, n, K, E) : 0.0;
  host->seq_loss = seq ? MoeSeqAuxLossOf(host->seq_colsum.data(), host->seq_counts, n, K, E, s.seq_tokens) : 0.0;
  host->z_loss = losses.z ? MoeZLossOf(host->lse.data(), n) : 0.0;
  // Pageable sources: each copy has left them once it returns; they stay in `host` anyway.
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<int32_t>(saved, b.order), host->plan.order.data(),
                                           n * K * sizeof(int32_t), cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the dispatch order");
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<int32_t>(saved, b.combine), host->plan.combine.data(),
                                           n * K * sizeof(int32_t), cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the un-permute's rows");
  return absl::OkStatus();
}

// The load-balancing losses' score gradients uploaded into b.dscore (null: none asked for).
absl::StatusOr<const float*> UploadScoreGradients(const MoeShape& s, char* scratch, const MoeBuffers& b,
                                                  const MoeLayerHost& host, const MoeLossGrads& grads,
                                                  const CudaContext& ctx) {
  const bool seq = grads.seq != 0 && !host.seq_counts.empty();
  if ((grads.aux == 0 && !seq) || s.n == 0) return static_cast<const float*>(nullptr);
  const std::vector<float> d =
      MoeScoreGradients(MoeAuxUnit(grads.aux, s.n, s.topk, s.experts), host.aux_counts, seq ? grads.seq : 0.0,
                        seq ? host.seq_counts : std::vector<float>{}, s.n, s.topk, s.experts, s.seq_tokens);
  float* to = At<float>(scratch, b.dscore);
  PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, d.data(), d.size() * sizeof(float), cudaMemcpyHostToDevice, ctx.stream),
                           "MoE: uploading the load-balancing losses' score gradients");
  return to;
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
  s.routing.groups = cf.moe_router_group_topk > 0 ? cf.moe_router_num_groups : 0;
  s.routing.group_topk = cf.moe_router_group_topk;
  s.activation = cf.swiglu         ? MoeActivation::kSwiglu
                 : cf.squared_relu ? MoeActivation::kSquaredRelu
                 : cf.gelu_exact   ? MoeActivation::kGeluExact
                                   : MoeActivation::kGelu;
  return s;
}

namespace {

// The per-expert products, each expert over its rows [r0, r0 + ne) of the dispatch (none without rows).
template <typename Fn>
absl::Status ForEachExpert(const std::vector<int64_t>& begin, int64_t experts, Fn&& fn) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = begin[static_cast<size_t>(e)], ne = begin[static_cast<size_t>(e) + 1] - r0;
    if (ne > 0) PTK_RETURN_IF_ERROR(fn(e, r0, ne));
  }
  return absl::OkStatus();
}

// The shared experts' forward on x (n, c): their output (x the gate) into b.shared_add (fp32).
template <typename T>
absl::Status SharedForward(const T* x, const MoeWeights<T>& w, const MoeLayerSpec& spec, char* saved, char* scratch,
                           const MoeBuffers& b, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const int64_t n = s.n, c = s.c, f = s.shared_ffn, f1 = s.shared_fc1_rows;
  T* fc1 = At<T>(saved, b.shared_fc1);
  T* act = At<T>(saved, b.shared_act);
  T* y = s.shared_gate ? At<T>(saved, b.shared_y) : At<T>(scratch, b.shared_dy);
  PTK_RETURN_IF_ERROR(MatmulForward<T>(fc1, x, w.shared_fc1, nullptr, n, c, f1, ctx));
  PTK_RETURN_IF_ERROR(ActivationForward<T>(spec.activation, act, fc1, n, f, ctx));
  PTK_RETURN_IF_ERROR(MatmulForward<T>(y, act, w.shared_fc2, nullptr, n, f, c, ctx));
  float* gate = nullptr;
  if (s.shared_gate) {
    gate = At<float>(saved, b.shared_gate);
    PTK_RETURN_IF_ERROR(MoeSharedGateForward<T>(gate, x, w.shared_gate, n, c, ctx));
  }
  return MoeSharedScale<T>(At<float>(scratch, b.shared_add), y, gate, n, c, ctx);
}

// The shared experts' backward from dout (n, c): their weights' gradients added to, their input gradient (and
// the gate's) added to dx_router (fp32).
template <typename T>
absl::Status SharedBackward(float* dx_router, const MoeGrads& g, const T* dout, const T* x, const MoeWeights<T>& w,
                            const MoeLayerSpec& spec, char* saved, char* scratch, const MoeBuffers& b,
                            const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const int64_t n = s.n, c = s.c, f = s.shared_ffn, f1 = s.shared_fc1_rows;
  const T* dy = dout;
  float* dlogit = nullptr;
  if (s.shared_gate) {
    dlogit = At<float>(scratch, b.shared_dlogit);
    T* dyg = At<T>(scratch, b.shared_dy);
    PTK_RETURN_IF_ERROR(MoeSharedGateBackward<T>(dlogit, dyg, dout, At<T>(saved, b.shared_y),
                                                 At<float>(saved, b.shared_gate), n, c, ctx));
    dy = dyg;
  }
  T* dact = At<T>(scratch, b.shared_dact);
  T* dfc1 = At<T>(scratch, b.shared_dfc1);
  T* dxs = At<T>(scratch, b.shared_dx);
  PTK_RETURN_IF_ERROR(
      MatmulBackward<T>(dact, g.shared_fc2, nullptr, dy, At<T>(saved, b.shared_act), w.shared_fc2, n, f, c, ctx));
  PTK_RETURN_IF_ERROR(ActivationBackward<T>(spec.activation, dfc1, At<T>(saved, b.shared_fc1), dact, n, f, ctx));
  PTK_RETURN_IF_ERROR(MatmulBackward<T>(dxs, g.shared_fc1, nullptr, dfc1, x, w.shared_fc1, n, c, f1, ctx));
  return MoeSharedInputGrad<T>(dx_router, g.shared_gate, dxs, dlogit, x, w.shared_gate, n, c, ctx);
}

absl::Status CheckSharedWeights(const MoeShape& s, const void* fc1, const void* fc2, const void* gate,
                                const char* what) {
  const bool shared = s.shared_ffn > 0;
  if ((fc1 != nullptr) != shared || (fc2 != nullptr) != shared || (gate != nullptr) != (shared && s.shared_gate))
    return absl::InvalidArgumentError(
        fmt::format("MoE layer over {} tokens: the shared experts' {} do not match the shape (shared ffn {}, gate {})",
                    s.n, what, s.shared_ffn, s.shared_gate ? "on" : "off"));
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status MoeLayerForward(T* out, const T* x, const MoeWeights<T>& w, const MoeLayerSpec& spec, char* saved,
                             char* scratch, MoeLayerHost* host, const MoeLossFlags& losses, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  PTK_RETURN_IF_ERROR(CheckSharedWeights(s, w.shared_fc1, w.shared_fc2, w.shared_gate, "weights"));
  const MoeBuffers b = PlanMoeBuffers(s);
  const int64_t n = s.n, c = s.c, E = s.experts, K = s.topk, f = s.ffn, f1 = s.fc1_rows, rows = s.rows();
  const int64_t per_expert = (f1 + f) * c;
  MoeRouting routing = spec.routing;
  if (s.biased != (w.expert_bias != nullptr))
    return absl::InvalidArgumentError(fmt::format("MoE layer over {} tokens: the expert bias {} the shape's", n,
                                                  s.biased ? "missing, as" : "given, not"));
  if (s.biased) {  // pageable: the copy has left the host's values once it returns
    routing.expert_bias = At<float>(scratch, b.bias);
    PTK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At<float>(scratch, b.bias), w.expert_bias, E * sizeof(float),
                                             cudaMemcpyHostToDevice, ctx.stream),
                             "MoE: uploading the expert bias");
  }
  const float *xf = nullptr, *wf = nullptr;
  PTK_RETURN_IF_ERROR(RouterInputs<T>(&xf, &wf, x, w.router, spec, scratch, b, ctx));
  float* logits = At<float>(saved, b.logits);
  PTK_RETURN_IF_ERROR(MatmulForward<float>(logits, xf, wf, nullptr, n, c, E, ctx));
  float* scores = At<float>(saved, b.scores);
  float* gates = s.sigmoid ? At<float>(saved, b.gates) : nullptr;
  PTK_RETURN_IF_ERROR(MoeRouteForward(scores, gates, At<float>(saved, b.prob), At<int32_t>(saved, b.expert),
                                      At<float>(saved, b.lse), b.plain >= 0 ? At<int32_t>(scratch, b.plain) : nullptr,
                                      logits, n, routing, ctx));
  if (losses.aux) PTK_RETURN_IF_ERROR(MoeScoreColumnSums(At<float>(scratch, b.colsum), scores, n, E, ctx));
  if (losses.seq && s.seq_tokens > 0)
    PTK_RETURN_IF_ERROR(MoeScoreColumnSums(At<float>(scratch, b.seq_colsum), scores, n, E, ctx, s.seq_tokens));
  PTK_RETURN_IF_ERROR(PlanDispatch(spec, saved, scratch, b, host, losses, ctx));
  const int32_t* order = At<int32_t>(saved, b.order);
  T* xr = At<T>(saved, b.x);
  T* fc1 = At<T>(saved, b.fc1);
  T* act = At<T>(saved, b.act);
  T* scaled = At<T>(saved, b.scaled);
  T* yr = At<T>(scratch, b.rows);
  PTK_RETURN_IF_ERROR(MoeGatherRows<T>(xr, x, order, rows, K, c, ctx));
  const std::vector<int64_t>& begin = host->plan.begin;
  PTK_RETURN_IF_ERROR(ForEachExpert(begin, E, [&](int64_t e, int64_t r0, int64_t ne) {
    return MatmulForward<T>(fc1 + r0 * f1, xr + r0 * c, w.experts + e * per_expert, nullptr, ne, c, f1, ctx);
  }));
  PTK_RETURN_IF_ERROR(ActivationForward<T>(spec.activation, act, fc1, rows, f, ctx));
  PTK_RETURN_IF_ERROR(MoeScaleRows<T>(scaled, act, At<float>(saved, b.prob), order, rows, f, ctx));
  PTK_RETURN_IF_ERROR(ForEachExpert(begin, E, [&](int64_t e, int64_t r0, int64_t ne) {
    const T* w2 = w.experts + e * per_expert + f1 * c;
    return MatmulForward<T>(yr + r0 * c, scaled + r0 * f, w2, nullptr, ne, f, c, ctx);
  }));
  const float* add = nullptr;
  if (s.shared_ffn > 0) {
    PTK_RETURN_IF_ERROR(SharedForward<T>(x, w, spec, saved, scratch, b, ctx));
    add = At<float>(scratch, b.shared_add);
  }
  return MoeCombineRows<T>(out, yr, At<int32_t>(saved, b.combine), add, n, K, c, ctx);
}

template <typename T>
absl::Status MoeLayerBackward(T* dx, const MoeGrads& g, const T* dout, const T* x, const MoeWeights<T>& w,
                              const MoeLayerSpec& spec, char* saved, char* scratch, const MoeLayerHost& host,
                              const MoeLossGrads& losses, const CudaContext& ctx) {
  const MoeShape& s = spec.shape;
  const MoeBuffers b = PlanMoeBuffers(s);
  const int64_t n = s.n, c = s.c, E = s.experts, K = s.topk, f = s.ffn, f1 = s.fc1_rows, rows = s.rows();
  const int64_t per_expert = (f1 + f) * c;
  if (static_cast<int64_t>(host.plan.begin.size()) != E + 1 || host.plan.begin[static_cast<size_t>(E)] != rows)
    return absl::FailedPreconditionError(
        fmt::format("MoE backward over {} tokens: the layer's forward left no dispatch plan of {} rows", n, rows));
  PTK_RETURN_IF_ERROR(CheckSharedWeights(s, w.shared_fc1, w.shared_fc2, w.shared_gate, "weights"));
  PTK_RETURN_IF_ERROR(CheckSharedWeights(s, g.shared_fc1, g.shared_fc2, g.shared_gate, "gradients"));
  const int32_t* order = At<int32_t>(saved, b.order);
  const float* prob = At<float>(saved, b.prob);
  const T* xr = At<T>(saved, b.x);
  const T* scaled = At<T>(saved, b.scaled);
  T* dyr = At<T>(scratch, b.rows);
  T* dscaled = At<T>(scratch, b.dscaled);
  T* dfc1 = At<T>(scratch, b.dfc1);
  T* dxr = At<T>(scratch, b.dx_rows);
  float* dprob = At<float>(scratch, b.dprob);
  PTK_RETURN_IF_ERROR(MoeGatherRows<T>(dyr, dout, order, rows, K, c, ctx));
  const std::vector<int64_t>& begin = host.plan.begin;
  // fc2: the scaled activation's gradient, fc2's weight gradient
  PTK_RETURN_IF_ERROR(ForEachExpert(begin, E, [&](int64_t e, int64_t r0, int64_t ne) {
    const int64_t w2 = e * per_expert + f1 * c;
    return MatmulBackward<T>(dscaled + r0 * f, g.experts + w2, nullptr, dyr + r0 * c, scaled + r0 * f, w.experts + w2,
                             ne, f, c, ctx);
  }));
  PTK_RETURN_IF_ERROR(MoeScaleRowsBackward<T>(dprob, dscaled, At<T>(saved, b.act), prob, order, rows, f, ctx));
  PTK_RETURN_IF_ERROR(ActivationBackward<T>(spec.activation, dfc1, At<T>(saved, b.fc1), dscaled, rows, f, ctx));
  // fc1: the rows' input gradient, fc1's weight gradient
  PTK_RETURN_IF_ERROR(ForEachExpert(begin, E, [&](int64_t e, int64_t r0, int64_t ne) {
    const int64_t w1 = e * per_expert;
    return MatmulBackward<T>(dxr + r0 * c, g.experts + w1, nullptr, dfc1 + r0 * f1, xr + r0 * c, w.experts + w1, ne, c,
                             f1, ctx);
  }));
  // The router: dlogits, then its input gradient (fp32) and weight gradient.
  const float *xf = nullptr, *wf = nullptr;
  PTK_RETURN_IF_ERROR(RouterInputs<T>(&xf, &wf, x, w.router, spec, scratch, b, ctx));
  float* dlogits = At<float>(scratch, b.dlogits);
  const float z_unit = n > 0 ? static_cast<float>(losses.z / static_cast<double>(n)) : 0.0f;
  PTK_ASSIGN_OR_RETURN(const float* dscore, UploadScoreGradients(s, scratch, b, host, losses, ctx));
  const int64_t dscore_per = !host.seq_counts.empty() && losses.seq != 0 ? s.seq_tokens : std::max<int64_t>(n, 1);
  PTK_RETURN_IF_ERROR(MoeRouteBackward(dlogits, At<float>(saved, b.logits), At<float>(saved, b.scores),
                                       s.sigmoid ? At<float>(saved, b.gates) : nullptr, prob, dprob,
                                       At<int32_t>(saved, b.expert), At<float>(saved, b.lse), dscore, dscore_per, n,
                                       spec.routing, z_unit, ctx));
  float* dx_router = At<float>(scratch, b.dx_router);
  PTK_RETURN_IF_ERROR(MatmulBackward<float>(dx_router, g.router, nullptr, dlogits, xf, wf, n, c, E, ctx));
  if (s.shared_ffn > 0) PTK_RETURN_IF_ERROR(SharedBackward<T>(dx_router, g, dout, x, w, spec, saved, scratch, b, ctx));
  return MoeCombineRows<T>(dx, dxr, At<int32_t>(saved, b.combine), dx_router, n, K, c, ctx);
}

#define PTK_INSTANTIATE(T)                                                                                        \
  template absl::Status MoeLayerForward<T>(T*, const T*, const MoeWeights<T>&, const MoeLayerSpec&, char*, char*, \
                                           MoeLayerHost*, const MoeLossFlags&, const CudaContext&);               \
  template absl::Status MoeLayerBackward<T>(T*, const MoeGrads&, const T*, const T*, const MoeWeights<T>&,        \
                                            const MoeLayerSpec&, char*, char*, const MoeLayerHost&,               \
                                            const MoeLossGrads&, const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
