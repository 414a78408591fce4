// The mixture-of-experts ops on the device (moe_ops_cuda.h), each mirroring trainer/cpu/moe_cpu.cpp: the
// router's scores, top-k and probabilities, the scores' column sums, the gather of the tokens into the
// experts' rows, the probabilities' scaling of the activation and its backward, the un-permute, and the
// router's backward. No atomics: every sum has a fixed order.
#include <algorithm>
#include <functional>
#include <string>

#include "trainer/cuda/kernel_util.cuh"
#include "trainer/cuda/moe_ops_cuda.h"

namespace ptk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGroups = 64;  // group-limited routing's groups (a bit mask)

__device__ __forceinline__ bool Chosen(const int32_t* chosen, int64_t k, int64_t e) {
  for (int64_t j = 0; j < k; ++j)
    if (chosen[j] == e) return true;
  return false;
}

// v[e] + bias[e] (bias null: v[e]), in fp32 as the CPU's biased scores.
__device__ __forceinline__ float Biased(const float* v, const float* bias, int64_t e) {
  return bias != nullptr ? v[e] + bias[e] : v[e];
}

// The k largest of v (+ bias) (E values) into chosen, by descending value, the lower index first among equals
// (strictly larger wins); with a group mask the experts outside the masked groups of `per` count as -inf.
__device__ void TopK(int32_t* chosen, const float* v, int64_t E, int64_t K, uint64_t mask = 0, int64_t per = 1,
                     const float* bias = nullptr) {
  for (int64_t k = 0; k < K; ++k) {
    int32_t best = -1;
    float bv = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (Chosen(chosen, k, e)) continue;
      const float x = mask == 0 || (mask >> (e / per) & 1) != 0 ? Biased(v, bias, e) : -INFINITY;
      if (best < 0 || x > bv) best = static_cast<int32_t>(e), bv = x;
    }
    chosen[k] = best;
  }
}

// cpu Choose: the K largest of v, or under group-limited routing the K largest within the group_topk groups
// whose topk / group_topk largest values add up to the most (each group's sum in descending order).
__device__ void Choose(int32_t* chosen, const float* v, const float* bias, const MoeRouting& r) {
  const int64_t E = r.experts, K = r.topk;
  if (r.group_topk == 0) return TopK(chosen, v, E, K, 0, 1, bias);
  const int64_t per = E / r.groups, take = K / r.group_topk;
  float sum[kMaxGroups];
  for (int64_t g = 0; g < r.groups; ++g) {
    const float* gb = bias != nullptr ? bias + g * per : nullptr;
    TopK(chosen, v + g * per, per, take, 0, 1, gb);  // chosen as scratch: take <= K
    float s = 0;
    for (int64_t t = 0; t < take; ++t) s += Biased(v + g * per, gb, chosen[t]);
    sum[g] = s;
  }
  uint64_t mask = 0;
  for (int64_t j = 0; j < r.group_topk; ++j) {
    int64_t best = -1;
    for (int64_t g = 0; g < r.groups; ++g)
      if ((mask >> g & 1) == 0 && (best < 0 || sum[g] > sum[best])) best = g;
    mask |= uint64_t{1} << best;
  }
  TopK(chosen, v, E, K, mask, per, bias);
}

__global__ void RouteForwardKernel(float* scores, float* gates, float* prob, int32_t* expert, float* lse,
                                   int32_t* plain, const float* logits, int64_t n, MoeRouting r) {
  const int64_t E = r.experts, K = r.topk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float* z = logits + i * E;
    float* sc = scores + i * E;
    float mx = z[0];
    for (int64_t e = 1; e < E; ++e) mx = fmaxf(mx, z[e]);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += expf(z[e] - mx);
    lse[i] = mx + logf(sum);
    const float* pick = z;  // what the top k are chosen by
    if (r.sigmoid) {
      float* g = gates + i * E;
      float all = 0;
      for (int64_t e = 0; e < E; ++e) all += g[e] = 1.0f / (1.0f + expf(-z[e]));
      for (int64_t e = 0; e < E; ++e) sc[e] = g[e] / (all + 1e-20f);
      pick = g;
    } else {
      for (int64_t e = 0; e < E; ++e) sc[e] = expf(z[e] - mx) / sum;
      if (r.pre_softmax) pick = sc;
    }
    int32_t* chosen = expert + i * K;
    Choose(chosen, pick, r.sigmoid ? r.expert_bias : nullptr, r);
    if (plain != nullptr) TopK(plain + i * K, sc, E, K);  // the load-balancing loss's routing map
    float* p = prob + i * K;
    if (r.sigmoid) {
      float top = 0;
      for (int64_t k = 0; k < K; ++k) top += p[k] = pick[chosen[k]];
      if (K > 1)
        for (int64_t k = 0; k < K; ++k) p[k] /= top + 1e-20f;
    } else if (r.pre_softmax) {
      for (int64_t k = 0; k < K; ++k) p[k] = sc[chosen[k]];
    } else {  // the softmax over the chosen logits (the first is their largest)
      const float m = z[chosen[0]];
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += p[k] = expf(z[chosen[k]] - m);
      for (int64_t k = 0; k < K; ++k) p[k] /= s;
    }
    if (r.scaling != 0)
      for (int64_t k = 0; k < K; ++k) p[k] *= r.scaling;
  }
}

// One block per (group of `per` tokens, expert); each thread's strided partial, then a tree over the block.
__global__ void ColumnSumsKernel(float* colsum, const float* scores, int64_t n, int64_t E, int64_t per,
                                 int64_t groups) {
  __shared__ float part[kThreads];
  for (int64_t ge = blockIdx.x; ge < groups * E; ge += gridDim.x) {
    const int64_t g = ge / E, e = ge % E, end = (g + 1) * per < n ? (g + 1) * per : n;
    float s = 0;
    for (int64_t i = g * per + threadIdx.x; i < end; i += blockDim.x) s += scores[i * E + e];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half >>= 1) {
      if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) colsum[ge] = part[0];
    __syncthreads();
  }
}

template <typename T>
__global__ void GatherRowsKernel(T* rows, const T* src, const int32_t* order, int64_t nrows, int64_t topk, int64_t c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < nrows * c; k += stride) {
    const int64_t r = k / c, j = k % c;
    rows[k] = src[static_cast<int64_t>(order[r]) / topk * c + j];
  }
}

template <typename T>
__global__ void ScaleRowsKernel(T* scaled, const T* act, const float* prob, const int32_t* order, int64_t nrows,
                                int64_t f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < nrows * f; k += stride)
    scaled[k] = FromFloat<T>(ToFloat(act[k]) * prob[order[k / f]]);
}

// One block per row: the dot product over a fixed tree, then the row scaled in place.
template <typename T>
__global__ void ScaleRowsBackwardKernel(float* dprob, T* dscaled, const T* act, const float* prob, const int32_t* order,
                                        int64_t nrows, int64_t f) {
  __shared__ float part[kThreads];
  for (int64_t r = blockIdx.x; r < nrows; r += gridDim.x) {
    T* d = dscaled + r * f;
    const T* a = act + r * f;
    float s = 0;
    for (int64_t j = threadIdx.x; j < f; j += blockDim.x) s += ToFloat(d[j]) * ToFloat(a[j]);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half >>= 1) {
      if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    const int32_t slot = order[r];
    if (threadIdx.x == 0) dprob[slot] = part[0];
    const float p = prob[slot];
    for (int64_t j = threadIdx.x; j < f; j += blockDim.x) d[j] = FromFloat<T>(ToFloat(d[j]) * p);
    __syncthreads();  // part is read by thread 0 above before the next row overwrites it
  }
}

template <typename T>
__global__ void CombineRowsKernel(T* out, const T* rows, const int32_t* combine, const float* add, int64_t n,
                                  int64_t topk, int64_t c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n * c; k += stride) {
    const int64_t i = k / c, j = k % c;
    float acc = 0;
    for (int64_t s = 0; s < topk; ++s) acc += ToFloat(rows[static_cast<int64_t>(combine[i * topk + s]) * c + j]);
    out[k] = FromFloat<T>(add != nullptr ? acc + add[k] : acc);
  }
}

__global__ void RouteBackwardKernel(float* dlogits, const float* logits, const float* scores, const float* gates,
                                    const float* prob, const float* dprob, const int32_t* expert, const float* lse,
                                    const float* dscore, int64_t dscore_per, int64_t n, MoeRouting r, float z_unit) {
  const int64_t E = r.experts, K = r.topk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float* dz = dlogits + i * E;
    const float* sc = scores + i * E;
    const int32_t* chosen = expert + i * K;
    const float* pr = prob + i * K;
    const float* dpr = dprob + i * K;
    // The probabilities before the scaling factor f and their gradient: p / f, dp x f.
    auto P = [&](int64_t k) { return r.scaling != 0 ? pr[k] / r.scaling : pr[k]; };
    auto DP = [&](int64_t k) { return r.scaling != 0 ? dpr[k] * r.scaling : dpr[k]; };
    for (int64_t e = 0; e < E; ++e) dz[e] = 0;
    if (z_unit != 0) {  // z_unit x 2 lse softmax(z)
      const float* z = logits + i * E;
      const float scale = 2 * z_unit * lse[i];
      for (int64_t e = 0; e < E; ++e) dz[e] += scale * expf(z[e] - lse[i]);
    }
    // The load-balancing losses: d(scores[e]) = ds[e], the row of token i's group.
    const float* ds = dscore != nullptr ? dscore + i / dscore_per * E : nullptr;
    float adot = 0;
    if (ds != nullptr)
      for (int64_t e = 0; e < E; ++e) adot += sc[e] * ds[e];
    if (r.sigmoid) {
      const float* g = gates + i * E;
      float top = 0, dot = 0, all = 0;
      for (int64_t k = 0; k < K; ++k) top += g[chosen[k]], dot += P(k) * DP(k);
      if (ds != nullptr)
        for (int64_t e = 0; e < E; ++e) all += g[e];
      for (int64_t e = 0; e < E; ++e) {
        float dg = 0;  // the gate's gradient
        for (int64_t k = 0; k < K; ++k)
          if (chosen[k] == e) dg = K == 1 ? DP(k) : (DP(k) - dot) / (top + 1e-20f);
        if (ds != nullptr) dg += (ds[e] - adot) / (all + 1e-20f);
        dz[e] += dg * g[e] * (1.0f - g[e]);
      }
      continue;
    }
    if (r.pre_softmax) {  // through the softmax over all experts, dp at the chosen ones
      float dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += sc[chosen[k]] * DP(k);
      for (int64_t e = 0; e < E; ++e) {
        float d = 0;
        for (int64_t k = 0; k < K; ++k)
          if (chosen[k] == e) d = DP(k);
        dz[e] += sc[e] * (d - dot);
      }
    } else {  // through the softmax over the chosen logits
      float dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += P(k) * DP(k);
      for (int64_t k = 0; k < K; ++k) dz[chosen[k]] += P(k) * (DP(k) - dot);
    }
    if (ds != nullptr)
      for (int64_t e = 0; e < E; ++e) dz[e] += sc[e] * (ds[e] - adot);
  }
}

std::string RoutingName(const MoeRouting& r) {
  return fmt::format("E={}, K={}, {}{}{}{}", r.experts, r.topk,
                     r.sigmoid       ? "sigmoid"
                     : r.pre_softmax ? "pre-softmax"
                                     : "softmax",
                     r.scaling != 0 ? fmt::format(", scaling {}", r.scaling) : "",
                     r.group_topk != 0 ? fmt::format(", top {} of {} groups", r.group_topk, r.groups) : "",
                     r.expert_bias != nullptr ? ", expert bias" : "");
}

absl::Status CheckRouting(const MoeRouting& r, const std::function<std::string()>& where) {
  if (r.experts < 1 || r.topk < 1 || r.topk > r.experts || r.experts > (int64_t{1} << 30))
    return absl::InvalidArgumentError(fmt::format("{}: top-{} of {} experts", where(), r.topk, r.experts));
  if (r.expert_bias != nullptr && !r.sigmoid)
    return absl::InvalidArgumentError(fmt::format("{}: the expert bias needs the sigmoid score function", where()));
  if (r.group_topk != 0 &&
      (r.groups < 1 || r.groups > kMaxGroups || r.experts % r.groups != 0 || r.group_topk < 1 ||
       r.group_topk > r.groups || r.topk % r.group_topk != 0 || r.topk > r.group_topk * (r.experts / r.groups)))
    return absl::InvalidArgumentError(fmt::format("{}: top-{} of {} experts in {} groups (at most {}), top {} groups",
                                                  where(), r.topk, r.experts, r.groups, kMaxGroups, r.group_topk));
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeRouteForward(float* scores, float* gates, float* prob, int32_t* expert, float* lse, int32_t* plain,
                             const float* logits, int64_t n, const MoeRouting& r, const CudaContext& ctx) {
  std::function<std::string()> where = [&] { return fmt::format("MoeRouteForward(n={}, {})", n, RoutingName(r)); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(CheckRouting(r, where));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(scores, "scores", where));
  if (r.sigmoid) PTK_KERNEL_CHECK(kernel::CheckPointer(gates, "gates", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(prob, "prob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(expert, "expert", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(lse, "lse", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(logits, "logits", where));
  constexpr int kRouteThreads = 128;
  RouteForwardKernel<<<kernel::GridBlocks(n, kRouteThreads, kernel::MaxBlocks(ctx)), kRouteThreads, 0, ctx.stream>>>(
      scores, gates, prob, expert, lse, plain, logits, n, r);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

absl::Status MoeScoreColumnSums(float* colsum, const float* scores, int64_t n, int64_t experts, const CudaContext& ctx,
                                int64_t per) {
  auto where = [&] { return fmt::format("MoeScoreColumnSums(n={}, E={}, groups of {})", n, experts, per); };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(experts, "experts", where));
  if (per == 0) per = std::max<int64_t>(n, 1);
  if (per < 0 || n % per != 0)
    return absl::InvalidArgumentError(fmt::format("{}: {} tokens are not groups of {}", where(), n, per));
  if (experts == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(colsum, "colsum", where));
  if (n > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(scores, "scores", where));
  const int64_t groups = std::max<int64_t>(n / per, 1);  // n = 0: each expert's sum 0
  ColumnSumsKernel<<<kernel::GridBlocks(groups * experts, 1, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      colsum, scores, n, experts, per, groups);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeGatherRows(T* rows, const T* src, const int32_t* order, int64_t nrows, int64_t topk, int64_t c,
                           const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MoeGatherRows<{}>(rows={}, K={}, c={})", kernel::TypeName<T>(), nrows, topk, c);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(nrows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (topk < 1) return absl::InvalidArgumentError(fmt::format("{}: topk {}", where(), topk));
  if (nrows == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(rows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(src, "src", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(order, "order", where));
  GatherRowsKernel<T><<<kernel::GridBlocks(nrows * c, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      rows, src, order, nrows, topk, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeScaleRows(T* scaled, const T* act, const float* prob, const int32_t* order, int64_t nrows, int64_t f,
                          const CudaContext& ctx) {
  auto where = [&] { return fmt::format("MoeScaleRows<{}>(rows={}, f={})", kernel::TypeName<T>(), nrows, f); };
  PTK_KERNEL_CHECK(kernel::CheckCount(nrows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(f, "f", where));
  if (nrows == 0 || f == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(scaled, "scaled", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(act, "act", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(prob, "prob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(order, "order", where));
  ScaleRowsKernel<T><<<kernel::GridBlocks(nrows * f, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      scaled, act, prob, order, nrows, f);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeScaleRowsBackward(float* dprob, T* dscaled, const T* act, const float* prob, const int32_t* order,
                                  int64_t nrows, int64_t f, const CudaContext& ctx) {
  auto where = [&] { return fmt::format("MoeScaleRowsBackward<{}>(rows={}, f={})", kernel::TypeName<T>(), nrows, f); };
  PTK_KERNEL_CHECK(kernel::CheckCount(nrows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(f, "f", where));
  if (nrows == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dprob, "dprob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(prob, "prob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(order, "order", where));
  if (f > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(dscaled, "dscaled", where));
  if (f > 0) PTK_KERNEL_CHECK(kernel::CheckPointer(act, "act", where));
  ScaleRowsBackwardKernel<T><<<kernel::GridBlocks(nrows, 1, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      dprob, dscaled, act, prob, order, nrows, f);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeCombineRows(T* out, const T* rows, const int32_t* combine, const float* add, int64_t n, int64_t topk,
                            int64_t c, const CudaContext& ctx) {
  auto where = [&] {
    return fmt::format("MoeCombineRows<{}>(n={}, K={}, c={}{})", kernel::TypeName<T>(), n, topk, c,
                       add != nullptr ? ", +fp32" : "");
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(kernel::CheckCount(c, "c", where));
  if (topk < 1) return absl::InvalidArgumentError(fmt::format("{}: topk {}", where(), topk));
  if (n == 0 || c == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(out, "out", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(rows, "rows", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(combine, "combine", where));
  CombineRowsKernel<T><<<kernel::GridBlocks(n * c, kThreads, kernel::MaxBlocks(ctx)), kThreads, 0, ctx.stream>>>(
      out, rows, combine, add, n, topk, c);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

absl::Status MoeRouteBackward(float* dlogits, const float* logits, const float* scores, const float* gates,
                              const float* prob, const float* dprob, const int32_t* expert, const float* lse,
                              const float* dscore, int64_t dscore_per, int64_t n, const MoeRouting& r, float z_unit,
                              const CudaContext& ctx) {
  std::function<std::string()> where = [&] {
    return fmt::format("MoeRouteBackward(n={}, {}, {}, z unit {})", n, RoutingName(r),
                       dscore != nullptr ? fmt::format("score gradients per {} tokens", dscore_per) : "no aux loss",
                       z_unit);
  };
  PTK_KERNEL_CHECK(kernel::CheckCount(n, "n", where));
  PTK_KERNEL_CHECK(CheckRouting(r, where));
  if (dscore != nullptr && dscore_per < 1)
    return absl::InvalidArgumentError(fmt::format("{}: score gradient rows of {} tokens", where(), dscore_per));
  if (n == 0) return absl::OkStatus();
  PTK_KERNEL_CHECK(kernel::CheckPointer(dlogits, "dlogits", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(scores, "scores", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(prob, "prob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(dprob, "dprob", where));
  PTK_KERNEL_CHECK(kernel::CheckPointer(expert, "expert", where));
  if (r.sigmoid) PTK_KERNEL_CHECK(kernel::CheckPointer(gates, "gates", where));
  if (z_unit != 0) PTK_KERNEL_CHECK(kernel::CheckPointer(logits, "logits", where));
  if (z_unit != 0) PTK_KERNEL_CHECK(kernel::CheckPointer(lse, "lse", where));
  constexpr int kRouteThreads = 128;
  RouteBackwardKernel<<<kernel::GridBlocks(n, kRouteThreads, kernel::MaxBlocks(ctx)), kRouteThreads, 0, ctx.stream>>>(
      dlogits, logits, scores, gates, prob, dprob, expert, lse, dscore, dscore_per, n, r, z_unit);
  PTK_CUDA_RETURN_IF_LAUNCH_ERROR(where());
  return absl::OkStatus();
}

#define PTK_INSTANTIATE(T)                                                                                             \
  template absl::Status MoeGatherRows<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, const CudaContext&); \
  template absl::Status MoeScaleRows<T>(T*, const T*, const float*, const int32_t*, int64_t, int64_t,                  \
                                        const CudaContext&);                                                           \
  template absl::Status MoeScaleRowsBackward<T>(float*, T*, const T*, const float*, const int32_t*, int64_t, int64_t,  \
                                                const CudaContext&);                                                   \
  template absl::Status MoeCombineRows<T>(T*, const T*, const int32_t*, const float*, int64_t, int64_t, int64_t,       \
                                          const CudaContext&);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(__nv_bfloat16)
PTK_INSTANTIATE(__half)
#undef PTK_INSTANTIATE

}  // namespace ptk::cuda
