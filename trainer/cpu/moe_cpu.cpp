// The mixture-of-experts MLP's router, dispatch, experts and combine, forward and backward (moe_cpu.h).
#include "trainer/cpu/moe_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/status.h"
#include "trainer/cpu/moe_capacity_cpu.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk::cpu {
namespace {

// Softmax of `m` values into out (max subtracted, as torch.softmax).
template <typename T>
void Softmax(T* out, const T* in, int64_t m) {
  T mx = in[0];
  for (int64_t j = 1; j < m; ++j) mx = std::max(mx, in[j]);
  T sum = 0;
  for (int64_t j = 0; j < m; ++j) sum += out[j] = std::exp(in[j] - mx);
  for (int64_t j = 0; j < m; ++j) out[j] /= sum;
}

// log(sum(exp(x))) of `m` values (max subtracted, as torch.logsumexp).
template <typename T>
T LogSumExp(const T* x, int64_t m) {
  T mx = x[0];
  for (int64_t j = 1; j < m; ++j) mx = std::max(mx, x[j]);
  T sum = 0;
  for (int64_t j = 0; j < m; ++j) sum += std::exp(x[j] - mx);
  return mx + std::log(sum);
}

// y's gradient through y = softmax(x) (m values): dx = y (dy - sum(y dy)), added to dx.
template <typename T>
void SoftmaxBackwardAdd(T* dx, const T* y, const T* dy, int64_t m) {
  T dot = 0;
  for (int64_t j = 0; j < m; ++j) dot += y[j] * dy[j];
  for (int64_t j = 0; j < m; ++j) dx[j] += y[j] * (dy[j] - dot);
}

// The K largest of `v` (E values), by descending value, the lower index first among equals.
void TopK(int32_t* idx, const auto* v, int64_t E, int64_t K) {
  std::vector<int32_t> all(static_cast<size_t>(E));
  std::iota(all.begin(), all.end(), 0);
  std::partial_sort(all.begin(), all.begin() + K, all.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  std::copy(all.begin(), all.begin() + K, idx);
}

// A token's K experts by its scores `v`: the K largest, or under group-limited routing the K largest of the
// group_topk groups whose topk / group_topk largest scores add up to the most (Megatron's group_limited_topk).
template <typename T>
void Choose(int32_t* idx, const T* v, const MoeSettings& s) {
  const int64_t E = s.experts, K = s.topk;
  if (s.group_topk == 0) return TopK(idx, v, E, K);
  const int64_t per = E / s.groups, take = K / s.group_topk;
  std::vector<T> group(static_cast<size_t>(s.groups));
  std::vector<int32_t> top(static_cast<size_t>(std::max(take, s.group_topk)));
  for (int64_t g = 0; g < s.groups; ++g) {
    TopK(top.data(), v + g * per, per, take);
    T sum = 0;
    for (int64_t t = 0; t < take; ++t) sum += v[g * per + top[t]];
    group[g] = sum;
  }
  TopK(top.data(), group.data(), s.groups, s.group_topk);
  std::vector<T> masked(static_cast<size_t>(E), -std::numeric_limits<T>::infinity());
  for (int64_t j = 0; j < s.group_topk; ++j) std::copy_n(v + top[j] * per, per, masked.data() + top[j] * per);
  TopK(idx, masked.data(), E, K);
}

// The tokens sent to each expert in token order (Megatron's permute by the routing map).
template <typename T>
void Dispatch(MoeActivations<T>* a, const MoeSettings& s) {
  const int64_t n = a->n, E = s.experts, K = s.topk;
  a->begin.assign(static_cast<size_t>(E + 1), 0);
  auto sent = [&](int64_t i) { return a->dropped.empty() || a->dropped[static_cast<size_t>(i)] == 0; };
  for (int64_t i = 0; i < n * K; ++i)
    if (sent(i)) ++a->begin[static_cast<size_t>(a->expert[i] + 1)];
  for (int64_t e = 0; e < E; ++e) a->begin[e + 1] += a->begin[e];
  std::vector<int64_t> next(a->begin.begin(), a->begin.end() - 1);
  a->order.resize(static_cast<size_t>(a->begin[E]));
  for (int64_t i = 0; i < n * K; ++i)
    if (sent(i)) a->order[next[a->expert[i]]++] = i;
}

// Token i's routing under the sigmoid score function (MoeSettings::sigmoid).
template <typename T>
void RouteSigmoid(MoeActivations<T>* a, int64_t i, const MoeSettings& s) {
  const int64_t E = s.experts, K = s.topk;
  const T* z = a->logits.data() + i * E;
  T* g = a->gates.data() + i * E;
  T* sc = a->scores.data() + i * E;
  int32_t* chosen = a->expert.data() + i * K;
  T* p = a->prob.data() + i * K;
  T all = 0;
  for (int64_t e = 0; e < E; ++e) all += g[e] = T{1} / (T{1} + std::exp(-z[e]));
  for (int64_t e = 0; e < E; ++e) sc[e] = g[e] / (all + T(1e-20));
  if (s.expert_bias != nullptr) {  // the top k of the biased scores, their unbiased gates the probabilities
    std::vector<T> biased(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) biased[e] = g[e] + static_cast<T>(s.expert_bias[e]);
    Choose(chosen, biased.data(), s);
  } else {
    Choose(chosen, g, s);
  }
  T top = 0;
  for (int64_t k = 0; k < K; ++k) top += p[k] = g[chosen[k]];
  if (K > 1)
    for (int64_t k = 0; k < K; ++k) p[k] /= top + T(1e-20);
}

// Its backward: token i's logits' gradient added to dz from its probabilities' (p, dp: before the scaling
// factor) and, with aux_unit, the load-balancing loss's (aux_unit x the tokens each expert got, per normalised
// score).
template <typename T>
void SigmoidRouterBackward(T* dz, const MoeActivations<T>& a, int64_t i, const T* p, const T* dp, const MoeSettings& s,
                           double aux_unit) {
  const int64_t E = s.experts, K = s.topk;
  const T* g = a.gates.data() + i * E;
  const T* sc = a.scores.data() + i * E;
  const int32_t* chosen = a.expert.data() + i * K;
  std::vector<T> ds(static_cast<size_t>(E), T{0});  // the gates' gradient
  if (K == 1) {
    ds[chosen[0]] = dp[0];
  } else {
    T top = 0, dot = 0;
    for (int64_t k = 0; k < K; ++k) top += g[chosen[k]], dot += p[k] * dp[k];
    for (int64_t k = 0; k < K; ++k) ds[chosen[k]] = (dp[k] - dot) / (top + T(1e-20));
  }
  if (aux_unit != 0 || !a.balance_grad.empty()) {
    T all = 0, dot = 0;
    std::vector<T> d(static_cast<size_t>(E));  // the normalised scores' gradient
    for (int64_t e = 0; e < E; ++e) d[e] = static_cast<T>(aux_unit * a.AuxCount(e) + a.BalanceGrad(i, e, E));
    for (int64_t e = 0; e < E; ++e) all += g[e];
    for (int64_t e = 0; e < E; ++e) dot += sc[e] * d[e];
    for (int64_t e = 0; e < E; ++e) ds[e] += (d[e] - dot) / (all + T(1e-20));
  }
  for (int64_t e = 0; e < E; ++e) dz[e] += ds[e] * g[e] * (T{1} - g[e]);
}

// Tensor ranks' token dropping (MoeSettings::shards): each rank's rows (its positions of every sample) dropped as
// one rank's router would, with the capacity of its own tokens; a->dropped assigned for all rows. Returns the count.
template <typename T>
int64_t DropOverShardCapacity(MoeActivations<T>* a, const MoeSettings& s) {
  const int64_t n = a->n, E = s.experts, K = s.topk, t = s.sample_rows > 0 ? s.sample_rows : n, tl = t / s.shards,
                b = n / t, nl = b * tl;
  const int64_t capacity = MoeExpertCapacity(nl, K, E, s.capacity_factor);
  a->dropped.assign(static_cast<size_t>(n * K), 0);
  std::vector<T> prob(static_cast<size_t>(nl * K));
  std::vector<int32_t> expert(static_cast<size_t>(nl * K));
  std::vector<uint8_t> dropped;
  int64_t count = 0;
  auto row = [&](int64_t r, int64_t j) { return j / tl * t + r * tl + j % tl; };  // shard r's row j: sample, position
  for (int64_t r = 0; r < s.shards; ++r) {
    for (int64_t j = 0; j < nl; ++j)
      for (int64_t k = 0; k < K; ++k) {
        prob[static_cast<size_t>(j * K + k)] = a->prob[static_cast<size_t>(row(r, j) * K + k)];
        expert[static_cast<size_t>(j * K + k)] = a->expert[static_cast<size_t>(row(r, j) * K + k)];
      }
    count += MoeDropOverCapacity(&dropped, prob.data(), expert.data(), nl, K, E, capacity, s.drop_by_position, tl);
    for (int64_t j = 0; j < nl; ++j)
      for (int64_t k = 0; k < K; ++k)
        a->dropped[static_cast<size_t>(row(r, j) * K + k)] = dropped[static_cast<size_t>(j * K + k)];
  }
  return count;
}

// With a capacity factor: the slots over each expert's capacity marked in a->dropped; the load-balancing loss
// then counts the routing before the drop (group_count, unless group-limited routing filled it already).
template <typename T>
void DropOverCapacity(MoeActivations<T>* a, const MoeSettings& s) {
  a->dropped.clear();
  if (s.capacity_factor < 0) return;
  const int64_t n = a->n, E = s.experts, K = s.topk;
  if ((s.shards > 1 ? DropOverShardCapacity(a, s)
                    : MoeDropOverCapacity(&a->dropped, a->prob.data(), a->expert.data(), n, K, E,
                                          MoeExpertCapacity(n, K, E, s.capacity_factor), s.drop_by_position,
                                          s.sample_rows > 0 ? s.sample_rows : n)) == 0 ||
      !a->group_count.empty())
    return;
  a->group_count.assign(static_cast<size_t>(E), 0.0);
  a->group_n = static_cast<double>(n);
  for (int64_t i = 0; i < n * K; ++i) a->group_count[static_cast<size_t>(a->expert[i])] += 1;
}

}  // namespace

template <typename T>
void MlpActivationForward(MlpActivation act, T* out, const T* in, int64_t rows, int64_t f) {
  switch (act) {
    case MlpActivation::kSwiglu: return SwigluForward(out, in, rows, f);
    case MlpActivation::kSquaredRelu: return SquaredReluForward(out, in, rows * f);
    case MlpActivation::kGeluExact: return GeluExactForward(out, in, rows * f);
    case MlpActivation::kGelu: return GeluForward(out, in, rows * f);
  }
}

template <typename T>
void MlpActivationBackward(MlpActivation act, T* din, const T* in, const T* dout, int64_t rows, int64_t f) {
  switch (act) {
    case MlpActivation::kSwiglu: return SwigluBackward(din, in, dout, rows, f);
    case MlpActivation::kSquaredRelu: return SquaredReluBackward(din, in, dout, rows * f);
    case MlpActivation::kGeluExact: return GeluExactBackward(din, in, dout, rows * f);
    case MlpActivation::kGelu: return GeluBackward(din, in, dout, rows * f);
  }
}

template <typename T>
void MoeRouterForward(MoeActivations<T>* a, const T* x, const T* w_router, int64_t n, int64_t c, const MoeSettings& s) {
  const int64_t E = s.experts, K = s.topk;
  PTK_CHECK(E >= 1 && K >= 1 && K <= E);
  a->n = n;
  a->group_count.clear();
  a->balance_grad.clear();
  a->logits.resize(static_cast<size_t>(n * E));
  a->scores.resize(static_cast<size_t>(n * E));
  a->prob.resize(static_cast<size_t>(n * K));
  a->expert.resize(static_cast<size_t>(n * K));
  MatmulForward(a->logits.data(), x, w_router, static_cast<const T*>(nullptr), n, c, E);
  if (s.sigmoid) a->gates.resize(static_cast<size_t>(n * E));
  for (int64_t i = 0; i < n; ++i) {
    if (s.sigmoid) {
      RouteSigmoid(a, i, s);
      continue;
    }
    const T* z = a->logits.data() + i * E;
    T* sc = a->scores.data() + i * E;
    int32_t* chosen = a->expert.data() + i * K;
    T* p = a->prob.data() + i * K;
    Softmax(sc, z, E);
    if (s.pre_softmax) {  // the softmax over all experts, its K largest entries
      Choose(chosen, sc, s);
      for (int64_t k = 0; k < K; ++k) p[k] = sc[chosen[k]];
    } else {  // the K largest logits, then a softmax over them
      Choose(chosen, z, s);
      std::vector<T> top(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) top[k] = z[chosen[k]];
      Softmax(p, top.data(), K);
    }
  }
  if (s.scaling != 0)
    for (T& p : a->prob) p *= static_cast<T>(s.scaling);
  if (s.group_topk > 0 || s.expert_bias != nullptr) {  // the load-balancing loss's counts: each plain top-k
    a->group_count.assign(static_cast<size_t>(E), 0.0);
    a->group_n = static_cast<double>(n);
    std::vector<int32_t> top(static_cast<size_t>(K));
    for (int64_t i = 0; i < n; ++i) {
      TopK(top.data(), a->scores.data() + i * E, E, K);
      for (int64_t k = 0; k < K; ++k) a->group_count[static_cast<size_t>(top[k])] += 1;
    }
  }
  DropOverCapacity(a, s);
  Dispatch(a, s);
  a->x.resize(static_cast<size_t>(a->begin[E] * c));
  for (int64_t r = 0; r < a->begin[E]; ++r) std::copy_n(x + a->order[r] / K * c, c, a->x.data() + r * c);
}

template <typename T>
double MoeAuxLoss(const MoeActivations<T>& a, const MoeSettings& s) {
  const int64_t n = a.n, E = s.experts, K = s.topk;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    T col = 0;  // the scores' sum over the tokens (probs.sum(dim=0))
    for (int64_t i = 0; i < n; ++i) col += a.scores[i * E + e];
    sum += static_cast<double>(col) * a.AuxCount(e);
  }
  const double N = a.AuxTokens();
  return sum * static_cast<double>(E) / (static_cast<double>(K) * N * N);
}

template <typename T>
double MoeZLoss(const MoeActivations<T>& a, const MoeSettings& s) {
  const int64_t E = s.experts;
  double sum = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const T lse = LogSumExp(a.logits.data() + i * E, E);
    sum += static_cast<double>(lse * lse);
  }
  return a.n > 0 ? sum / static_cast<double>(a.n) : 0.0;
}

template <typename T>
double MoeZLossOfShard(const MoeActivations<T>& a, const MoeSettings& s, int64_t shard) {
  const int64_t E = s.experts, t = s.sample_rows > 0 ? s.sample_rows : a.n, tl = t / s.shards;
  double sum = 0;
  int64_t rows = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    if (i % t / tl != shard) continue;
    const T lse = LogSumExp(a.logits.data() + i * E, E);
    sum += static_cast<double>(lse * lse);
    ++rows;
  }
  return rows > 0 ? sum / static_cast<double>(rows) : 0.0;
}

template <typename T>
void MoeExpertsForward(T* out, MoeActivations<T>* a, const T* w_experts, int64_t c, const MoeSettings& s) {
  const int64_t rows = a->begin[s.experts], f1 = s.fc1_rows(), f = s.ffn;  // n·K, or an expert rank's rows
  a->fc1.resize(static_cast<size_t>(rows * f1));
  a->act.resize(static_cast<size_t>(rows * f));
  a->scaled.resize(static_cast<size_t>(rows * f));
  a->out.resize(static_cast<size_t>(rows * c));
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t r0 = a->begin[e], ne = a->begin[e + 1] - r0;
    if (ne == 0) continue;
    const T* w1 = w_experts + e * s.expert_floats(c);
    const T* w2 = w1 + f1 * c;
    MatmulForward(a->fc1.data() + r0 * f1, a->x.data() + r0 * c, w1, static_cast<const T*>(nullptr), ne, c, f1);
    MlpActivationForward(s.activation, a->act.data() + r0 * f, a->fc1.data() + r0 * f1, ne, f);
    for (int64_t r = r0; r < r0 + ne; ++r) {
      const T p = a->prob[a->order[r]];
      for (int64_t j = 0; j < f; ++j) a->scaled[r * f + j] = a->act[r * f + j] * p;
    }
    MatmulForward(a->out.data() + r0 * c, a->scaled.data() + r0 * f, w2, static_cast<const T*>(nullptr), ne, f, c);
  }
  std::fill(out, out + a->n * c, T{0});
  for (int64_t r = 0; r < rows; ++r) {  // the combine: each row added to its token, expert by expert
    T* y = out + a->order[r] / s.topk * c;
    for (int64_t j = 0; j < c; ++j) y[j] += a->out[r * c + j];
  }
}

namespace {
// The z-loss's gradient added to token i's logits' (dz): z_unit x 2 logsumexp(z) softmax(z).
template <typename T>
void ZLossBackward(T* dz, const T* z, int64_t E, double z_unit) {
  std::vector<T> sm(static_cast<size_t>(E));
  Softmax(sm.data(), z, E);
  const T scale = static_cast<T>(2 * z_unit) * LogSumExp(z, E);
  for (int64_t e = 0; e < E; ++e) dz[e] += scale * sm[e];
}

// The router's logits' gradient from the probabilities' (dprob), the load-balancing loss's and the z-loss's.
template <typename T>
void RouterBackward(MoeActivations<T>* a, const MoeSettings& s, double aux_grad, double z_grad) {
  const int64_t n = a->n, E = s.experts, K = s.topk;
  a->dlogits.assign(static_cast<size_t>(n * E), T{0});
  std::vector<T> d(static_cast<size_t>(std::max(E, K)));
  const double N = a->AuxTokens(), aux_unit = aux_grad * static_cast<double>(E) / (static_cast<double>(K) * N * N);
  // With a scaling factor f the probabilities before it (p / f) and their gradient (f x dprob).
  std::vector<T> raw(static_cast<size_t>(K)), draw(static_cast<size_t>(K));
  const T f = static_cast<T>(s.scaling);
  for (int64_t i = 0; i < n; ++i) {
    T* dz = a->dlogits.data() + i * E;
    const T* sc = a->scores.data() + i * E;
    const int32_t* chosen = a->expert.data() + i * K;
    const T* prob = a->prob.data() + i * K;
    const T* dp = a->dprob.data() + i * K;
    if (s.scaling != 0) {
      for (int64_t k = 0; k < K; ++k) raw[k] = prob[k] / f, draw[k] = dp[k] * f;
      prob = raw.data();
      dp = draw.data();
    }
    if (z_grad != 0) ZLossBackward(dz, a->logits.data() + i * E, E, z_grad / static_cast<double>(n));
    if (s.sigmoid) {
      SigmoidRouterBackward(dz, *a, i, prob, dp, s, aux_unit);
      continue;
    }
    if (s.pre_softmax) {
      std::fill(d.begin(), d.begin() + E, T{0});
      for (int64_t k = 0; k < K; ++k) d[chosen[k]] = dp[k];
      SoftmaxBackwardAdd(dz, sc, d.data(), E);
    } else {
      std::vector<T> top(static_cast<size_t>(K));
      SoftmaxBackwardAdd(top.data(), prob, dp, K);  // top starts at zero
      for (int64_t k = 0; k < K; ++k) dz[chosen[k]] += top[k];
    }
    if (aux_grad == 0 && a->balance_grad.empty()) continue;
    for (int64_t e = 0; e < E; ++e) d[e] = static_cast<T>(aux_unit * a->AuxCount(e) + a->BalanceGrad(i, e, E));
    SoftmaxBackwardAdd(dz, sc, d.data(), E);
  }
}
}  // namespace

template <typename T>
void MoeExpertsBackward(T* dx, T* dw_experts, const T* dout, MoeActivations<T>* a, const T* w_experts, int64_t c,
                        const MoeSettings& s) {
  const int64_t n = a->n, K = s.topk, rows = a->begin[s.experts], f1 = s.fc1_rows(), f = s.ffn;
  a->dout.resize(static_cast<size_t>(rows * c));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(dout + a->order[r] / K * c, c, a->dout.data() + r * c);
  a->dact.assign(static_cast<size_t>(rows * f), T{0});
  a->dfc1.resize(static_cast<size_t>(rows * f1));
  a->dx.assign(static_cast<size_t>(rows * c), T{0});
  a->dprob.assign(static_cast<size_t>(n * K), T{0});
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t r0 = a->begin[e], ne = a->begin[e + 1] - r0;
    if (ne == 0) continue;
    const T* w1 = w_experts + e * s.expert_floats(c);
    const T* w2 = w1 + f1 * c;
    T* dw1 = dw_experts + e * s.expert_floats(c);
    T* dw2 = dw1 + f1 * c;
    T* dscaled = a->dact.data() + r0 * f;  // the scaled activation's gradient, then the activation's
    MatmulBackward(dscaled, dw2, static_cast<T*>(nullptr), a->dout.data() + r0 * c, a->scaled.data() + r0 * f, w2, ne,
                   f, c);
    for (int64_t r = r0; r < r0 + ne; ++r) {
      const int64_t slot = a->order[r];
      T dp = 0;
      for (int64_t j = 0; j < f; ++j) dp += a->dact[r * f + j] * a->act[r * f + j];
      a->dprob[slot] = dp;
      for (int64_t j = 0; j < f; ++j) a->dact[r * f + j] *= a->prob[slot];
    }
    MlpActivationBackward(s.activation, a->dfc1.data() + r0 * f1, a->fc1.data() + r0 * f1, dscaled, ne, f);
    MatmulBackward(a->dx.data() + r0 * c, dw1, static_cast<T*>(nullptr), a->dfc1.data() + r0 * f1, a->x.data() + r0 * c,
                   w1, ne, c, f1);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* y = dx + a->order[r] / K * c;
    for (int64_t j = 0; j < c; ++j) y[j] += a->dx[r * c + j];
  }
}

template <typename T>
void MoeRouterBackward(T* dx, T* dw_router, MoeActivations<T>* a, const T* x, const T* w_router, int64_t c,
                       const MoeSettings& s, double aux_grad, double z_grad) {
  RouterBackward(a, s, aux_grad, z_grad);
  MatmulBackward(dx, dw_router, static_cast<T*>(nullptr), a->dlogits.data(), x, w_router, a->n, c, s.experts);
}

template <typename T>
void MoeBackward(T* dx, T* dw_router, T* dw_experts, const T* dout, MoeActivations<T>* a, const T* x, const T* w_router,
                 const T* w_experts, int64_t c, const MoeSettings& s, double aux_grad, double z_grad) {
  MoeExpertsBackward(dx, dw_experts, dout, a, w_experts, c, s);
  MoeRouterBackward(dx, dw_router, a, x, w_router, c, s, aux_grad, z_grad);
}

#define PTK_INSTANTIATE(T)                                                                                         \
  template void MoeRouterForward<T>(MoeActivations<T>*, const T*, const T*, int64_t, int64_t, const MoeSettings&); \
  template double MoeAuxLoss<T>(const MoeActivations<T>&, const MoeSettings&);                                     \
  template double MoeZLoss<T>(const MoeActivations<T>&, const MoeSettings&);                                       \
  template double MoeZLossOfShard<T>(const MoeActivations<T>&, const MoeSettings&, int64_t);                       \
  template void MoeExpertsForward<T>(T*, MoeActivations<T>*, const T*, int64_t, const MoeSettings&);               \
  template void MoeBackward<T>(T*, T*, T*, const T*, MoeActivations<T>*, const T*, const T*, const T*, int64_t,    \
                               const MoeSettings&, double, double);
PTK_INSTANTIATE(float)
PTK_INSTANTIATE(double)
#undef PTK_INSTANTIATE
// MoeBackward's halves (expert parallelism's).
#define PTK_INSTANTIATE_HALVES(T)                                                                                   \
  template void MoeExpertsBackward<T>(T*, T*, const T*, MoeActivations<T>*, const T*, int64_t, const MoeSettings&); \
  template void MoeRouterBackward<T>(T*, T*, MoeActivations<T>*, const T*, const T*, int64_t, const MoeSettings&,   \
                                     double, double);
PTK_INSTANTIATE_HALVES(float)
PTK_INSTANTIATE_HALVES(double)
#undef PTK_INSTANTIATE_HALVES

#define PTK_INSTANTIATE_ACTIVATION(T)                                                   \
  template void MlpActivationForward<T>(MlpActivation, T*, const T*, int64_t, int64_t); \
  template void MlpActivationBackward<T>(MlpActivation, T*, const T*, const T*, int64_t, int64_t);
PTK_INSTANTIATE_ACTIVATION(float)
PTK_INSTANTIATE_ACTIVATION(double)
#undef PTK_INSTANTIATE_ACTIVATION

}  // namespace ptk::cpu
