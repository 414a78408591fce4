// The MoE load-balancing losses over groups of ranks (trainer/cpu/moe_balance_cpu.h): megatron-core 0.16.1's
// switch_load_balancing_loss_func on this rank's scores with the group's counts.
#include "trainer/cpu/moe_balance_cpu.h"

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

namespace ptk::cpu {
namespace {

// Each token's plain top-k of its scores (compute_routing_scores_for_aux_loss's routing map) counted per group
// of `per` consecutive tokens: (n / per, E), and the scores' sums per group and expert alike.
void GroupCounts(const MoeActivations<float>& m, int64_t E, int64_t K, int64_t per, std::vector<double>* counts,
                 std::vector<double>* sums) {
  const int64_t groups = m.n / per;
  counts->assign(static_cast<size_t>(groups * E), 0.0);
  sums->assign(static_cast<size_t>(groups * E), 0.0);
  std::vector<int32_t> all(static_cast<size_t>(E));
  std::vector<float> col(static_cast<size_t>(groups * E), 0.0f);  // fp32 sums, as probs.sum(dim=0)
  for (int64_t i = 0; i < m.n; ++i) {
    const float* v = m.scores.data() + i * E;
    std::iota(all.begin(), all.end(), 0);
    std::partial_sort(all.begin(), all.begin() + K, all.end(),
                      [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
    const int64_t g = i / per;
    for (int64_t k = 0; k < K; ++k) (*counts)[static_cast<size_t>(g * E + all[k])] += 1;
    for (int64_t e = 0; e < E; ++e) col[static_cast<size_t>(g * E + e)] += v[e];
  }
  std::copy(col.begin(), col.end(), sums->begin());
}

bool Several(const Communicator* c) { return c != nullptr && c->size() > 1; }

}  // namespace

absl::Status MoeContextAuxCounts(MoeActivations<float>* a, const MoeSettings& s, Communicator* context) {
  if (!Several(context)) return absl::OkStatus();
  std::vector<double> counts(static_cast<size_t>(s.experts) + 1);
  for (int64_t e = 0; e < s.experts; ++e) counts[static_cast<size_t>(e)] = a->AuxCount(e);
  counts.back() = a->AuxTokens();
  PTK_RETURN_IF_ERROR(context->AllReduceSum(counts.data(), s.experts + 1));
  a->group_n = counts.back();
  counts.pop_back();
  a->group_count = std::move(counts);
  return absl::OkStatus();
}

absl::StatusOr<double> MoeSeqAuxLoss(MoeActivations<float>* a, const MoeSettings& s, int64_t rows, double coeff,
                                     Communicator* context) {
  const int64_t E = s.experts, K = s.topk, B = a->n / rows;
  std::vector<double> counts, sums;
  GroupCounts(*a, E, K, rows, &counts, &sums);
  if (Several(context)) PTK_RETURN_IF_ERROR(context->AllReduceSum(counts.data(), B * E));
  const double S = static_cast<double>(rows) * (Several(context) ? context->size() : 1);  // the whole sequence's
  const double unit = static_cast<double>(E) / (static_cast<double>(K) * S * S * static_cast<double>(B));
  double loss = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    loss += sums[j] * counts[j];
    a->balance_grad[j] += coeff * unit * counts[j];
  }
  return loss * unit;
}

absl::StatusOr<double> MoeGlobalAuxLoss(MoeActivations<float>* a, const MoeSettings& s, double coeff,
                                        Communicator* group, std::vector<double>* counts, double* steps) {
  const int64_t E = s.experts, K = s.topk, B = static_cast<int64_t>(a->balance_grad.size()) / E;
  std::vector<double> mine, sums;
  GroupCounts(*a, E, K, a->n, &mine, &sums);
  const int G = Several(group) ? group->size() : 1;
  if (G > 1) PTK_RETURN_IF_ERROR(group->AllReduceSum(mine.data(), E));
  if (counts->empty()) counts->assign(static_cast<size_t>(E), 0.0);
  *steps += 1;
  const double T = static_cast<double>(a->n) * G, unit = static_cast<double>(E) / (static_cast<double>(K) * T * T);
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    (*counts)[static_cast<size_t>(e)] += mine[static_cast<size_t>(e)];
    // fp32 as Megatron's buffers: global_tokens_per_expert / ga_steps
    const double avg =
        static_cast<float>(static_cast<float>((*counts)[static_cast<size_t>(e)]) / static_cast<float>(*steps));
    loss += sums[static_cast<size_t>(e)] * avg;
    for (int64_t b = 0; b < B; ++b) a->balance_grad[static_cast<size_t>(b * E + e)] += coeff * unit * avg;
  }
  return loss * unit;
}

}  // namespace ptk::cpu
