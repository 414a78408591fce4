// The MoE layer's host side (moe_plan.h).
#include "trainer/cuda/moe_plan.h"

#include <algorithm>
#include <limits>

#include <fmt/core.h>

namespace ptk::cuda {
namespace {
constexpr int64_t kAlign = 256;  // MemoryPlan::kAlignment
int64_t Take(int64_t* at, int64_t bytes) {
  const int64_t offset = *at;
  *at += (bytes + kAlign - 1) / kAlign * kAlign;
  return offset;
}
}  // namespace

MoeBuffers PlanMoeBuffers(const MoeShape& s) {
  MoeBuffers b;
  const int64_t n = s.n, E = s.experts, K = s.topk, rows = s.rows(), t = s.act_bytes;
  int64_t at = 0;
  b.logits = Take(&at, n * E * 4);
  b.scores = Take(&at, n * E * 4);
  b.gates = s.sigmoid ? Take(&at, n * E * 4) : -1;
  b.prob = Take(&at, n * K * 4);
  b.expert = Take(&at, n * K * 4);
  b.lse = Take(&at, n * 4);
  b.order = Take(&at, rows * 4);
  b.combine = Take(&at, n * K * 4);
  b.x = Take(&at, rows * s.c * t);
  b.fc1 = Take(&at, rows * s.fc1_rows * t);
  b.act = Take(&at, rows * s.ffn * t);
  b.scaled = Take(&at, rows * s.ffn * t);
  const bool shared = s.shared_ffn > 0;
  if (shared) {
    b.shared_fc1 = Take(&at, n * s.shared_fc1_rows * t);
    b.shared_act = Take(&at, n * s.shared_ffn * t);
  }
  if (shared && s.shared_gate) {
    b.shared_y = Take(&at, n * s.c * t);
    b.shared_gate = Take(&at, n * 4);
  }
  b.saved_bytes = at;
  at = 0;
  b.xf = Take(&at, n * s.c * 4);
  b.wf = Take(&at, E * s.c * 4);
  b.colsum = Take(&at, E * 4);
  b.rows = Take(&at, rows * s.c * t);
  b.dscaled = Take(&at, rows * s.ffn * t);
  b.dfc1 = Take(&at, rows * s.fc1_rows * t);
  b.dx_rows = Take(&at, rows * s.c * t);
  b.dprob = Take(&at, n * K * 4);
  b.dlogits = Take(&at, n * E * 4);
  b.dx_router = Take(&at, n * s.c * 4);
  b.dscore = Take(&at, std::max<int64_t>(s.seqs(), 1) * E * 4);
  if (s.grouped || s.biased || s.seq_tokens > 0) b.plain = Take(&at, n * K * 4);
  if (s.seq_tokens > 0) b.seq_colsum = Take(&at, s.seqs() * E * 4);
  if (s.biased) b.bias = Take(&at, E * 4);
  if (shared) {
    b.shared_add = b.dx_router;
    b.shared_dy = Take(&at, n * s.c * t);
    b.shared_dact = Take(&at, n * s.shared_ffn * t);
    b.shared_dfc1 = Take(&at, n * s.shared_fc1_rows * t);
    b.shared_dx = Take(&at, n * s.c * t);
    if (s.shared_gate) b.shared_dlogit = Take(&at, n * 4);
  }
  b.scratch_bytes = at;
  return b;
}

MoeShape MoeShapeOf(const GPTConfig& cf, int64_t n, int64_t act_bytes) {
  MoeShape s;
  s.n = n;
  s.c = cf.hidden_size;
  s.experts = cf.num_experts;
  s.topk = cf.moe_router_topk;
  s.ffn = cf.moe_ffn();
  s.fc1_rows = (cf.swiglu ? 2 : 1) * s.ffn;
  s.act_bytes = act_bytes;
  s.sigmoid = cf.moe_router_sigmoid;
  s.shared_ffn = cf.moe_shared_expert_intermediate_size;
  s.shared_fc1_rows = (cf.swiglu ? 2 : 1) * s.shared_ffn;
  s.shared_gate = s.shared_ffn > 0 && cf.moe_shared_expert_gate;
  s.grouped = cf.moe_router_group_topk > 0;
  s.biased = cf.moe_router_enable_expert_bias && cf.moe_router_sigmoid;
  s.seq_tokens = cf.moe_seq_aux_loss_coeff > 0 ? cf.seq_length : 0;
  return s;
}

int64_t MoeLayersIn(const GPTConfig& cf, int64_t begin, int64_t end) {
  int64_t count = 0;
  for (int64_t l = begin; l < end; ++l) count += cf.num_experts > 0 && cf.moe_layer(l) ? 1 : 0;
  return count;
}

absl::Status BuildMoeDispatch(MoeDispatchPlan* plan, const int32_t* expert, int64_t n, int64_t topk, int64_t experts) {
  const int64_t slots = n * topk;
  if (n < 0 || topk < 1 || experts < 1 || slots > std::numeric_limits<int32_t>::max())
    return absl::InvalidArgumentError(
        fmt::format("MoE dispatch: {} tokens x top-{} over {} experts does not fit the int32 plan", n, topk, experts));
  plan->begin.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = expert[i];
    if (e < 0 || e >= experts)
      return absl::InvalidArgumentError(
          fmt::format("MoE dispatch: token {} slot {} names expert {} of {}", i / topk, i % topk, e, experts));
    ++plan->begin[static_cast<size_t>(e) + 1];
  }
  plan->counts.resize(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) {
    plan->counts[static_cast<size_t>(e)] = static_cast<float>(plan->begin[static_cast<size_t>(e) + 1]);
    plan->begin[static_cast<size_t>(e) + 1] += plan->begin[static_cast<size_t>(e)];
  }
  std::vector<int64_t> next(plan->begin.begin(), plan->begin.end() - 1);
  plan->order.resize(static_cast<size_t>(slots));
  std::vector<int32_t> row_of(static_cast<size_t>(slots));
  for (int64_t i = 0; i < slots; ++i) {  // slots in token order: each expert's rows in token order
    const int64_t r = next[static_cast<size_t>(expert[i])]++;
    plan->order[static_cast<size_t>(r)] = static_cast<int32_t>(i);
    row_of[static_cast<size_t>(i)] = static_cast<int32_t>(r);
  }
  plan->combine.resize(static_cast<size_t>(slots));
  for (int64_t i = 0; i < n; ++i) {  // token i's rows ascending (insertion sort of K entries)
    int32_t* rows = plan->combine.data() + i * topk;
    for (int64_t k = 0; k < topk; ++k) {
      const int32_t r = row_of[static_cast<size_t>(i * topk + k)];
      int64_t j = k;
      for (; j > 0 && rows[j - 1] > r; --j) rows[j] = rows[j - 1];
      rows[j] = r;
    }
  }
  return absl::OkStatus();
}

double MoeAuxLossOf(const float* colsum, const std::vector<float>& counts, int64_t n, int64_t topk, int64_t experts) {
  double sum = 0;
  for (int64_t e = 0; e < experts; ++e)
    sum += static_cast<double>(colsum[e]) * static_cast<double>(counts[static_cast<size_t>(e)]);
  return n > 0 ? sum * MoeAuxUnit(1.0, n, topk, experts) : 0.0;
}

absl::Status MoeRoutingCounts(std::vector<float>* counts, const int32_t* expert, int64_t n, int64_t topk,
                              int64_t experts, int64_t per) {
  if (per == 0) per = std::max<int64_t>(n, 1);
  if (n < 0 || topk < 1 || experts < 1 || per < 1 || n % per != 0)
    return absl::InvalidArgumentError(fmt::format(
        "MoE routing counts: {} tokens x top-{} over {} experts in groups of {} tokens", n, topk, experts, per));
  counts->assign(static_cast<size_t>(std::max<int64_t>(n / per, 1) * experts), 0.0f);
  for (int64_t i = 0; i < n * topk; ++i) {
    const int32_t e = expert[i];
    if (e < 0 || e >= experts)
      return absl::InvalidArgumentError(
          fmt::format("MoE routing counts: token {} slot {} names expert {} of {}", i / topk, i % topk, e, experts));
    (*counts)[static_cast<size_t>(i / topk / per * experts + e)] += 1.0f;
  }
  return absl::OkStatus();
}

double MoeSeqAuxLossOf(const float* colsum, const std::vector<float>& counts, int64_t n, int64_t topk, int64_t experts,
                       int64_t seq_tokens) {
  if (n <= 0 || seq_tokens <= 0) return 0.0;
  const double S = static_cast<double>(seq_tokens), B = static_cast<double>(n / seq_tokens);
  double sum = 0;
  for (size_t j = 0; j < counts.size(); ++j) sum += static_cast<double>(colsum[j]) * static_cast<double>(counts[j]);
  return sum * static_cast<double>(experts) / (static_cast<double>(topk) * S * S * B);
}

std::vector<float> MoeScoreGradients(double aux_unit, const std::vector<float>& aux_counts, double seq_grad,
                                     const std::vector<float>& seq_counts, int64_t n, int64_t topk, int64_t experts,
                                     int64_t seq_tokens) {
  const bool seq = !seq_counts.empty() && seq_tokens > 0 && n > 0;
  const int64_t rows = seq ? n / seq_tokens : 1;
  const double S = static_cast<double>(seq_tokens), B = static_cast<double>(rows);
  const double seq_unit = seq ? seq_grad * static_cast<double>(experts) / (static_cast<double>(topk) * S * S * B) : 0;
  std::vector<float> d(static_cast<size_t>(rows * experts));
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t e = 0; e < experts; ++e) {
      double v = aux_unit * static_cast<double>(aux_counts[static_cast<size_t>(e)]);
      if (seq) v += seq_unit * static_cast<double>(seq_counts[static_cast<size_t>(b * experts + e)]);
      d[static_cast<size_t>(b * experts + e)] = static_cast<float>(v);
    }
  return d;
}

double MoeAuxUnit(double aux_grad, int64_t n, int64_t topk, int64_t experts) {
  const double N = static_cast<double>(n);
  return n > 0 ? aux_grad * static_cast<double>(experts) / (static_cast<double>(topk) * N * N) : 0.0;
}

double MoeZLossOf(const float* lse, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(lse[i]) * static_cast<double>(lse[i]);
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

}  // namespace ptk::cuda
