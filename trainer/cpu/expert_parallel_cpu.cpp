// Expert parallelism's allgather dispatch and reduce-scatter combine (expert_parallel_cpu.h).
#include "trainer/cpu/expert_parallel_cpu.h"

#include <algorithm>

#include "common/status.h"

namespace ptk::cpu {
namespace {

// Each rank's piece of a gathered buffer: its n tokens' inputs (n·c), probabilities (n·K) and experts (n·K,
// as floats: exact below 2^24).
int64_t PieceFloats(int64_t n, int64_t c, int64_t K) { return n * (c + 2 * K); }

// `rows` from the gathered pieces: the slots routed to experts [first, first + L), expert by expert, each
// expert's in the group's token order (rank 0's tokens, then rank 1's, ...), as one rank's dispatch orders
// its own.
void LocalDispatch(MoeActivations<float>* rows, const float* gathered, int size, int64_t n, int64_t c,
                   const MoeSettings& s, int64_t first, int64_t L) {
  const int64_t K = s.topk, N = n * size, piece = PieceFloats(n, c, K);
  rows->n = N;
  rows->prob.resize(static_cast<size_t>(N * K));
  std::vector<int32_t> local(static_cast<size_t>(N * K), -1);
  for (int r = 0; r < size; ++r) {
    const float* p = gathered + r * piece;
    for (int64_t i = 0; i < n * K; ++i) {
      rows->prob[r * n * K + i] = p[n * c + i];
      const int64_t e = static_cast<int64_t>(p[n * c + n * K + i]) - first;
      if (e >= 0 && e < L) local[r * n * K + i] = static_cast<int32_t>(e);
    }
  }
  rows->begin.assign(static_cast<size_t>(L + 1), 0);
  for (const int32_t e : local)
    if (e >= 0) ++rows->begin[static_cast<size_t>(e + 1)];
  for (int64_t e = 0; e < L; ++e) rows->begin[e + 1] += rows->begin[e];
  std::vector<int64_t> next(rows->begin.begin(), rows->begin.end() - 1);
  rows->order.resize(static_cast<size_t>(rows->begin[L]));
  for (int64_t i = 0; i < N * K; ++i)
    if (local[i] >= 0) rows->order[next[local[i]]++] = i;
  rows->x.resize(static_cast<size_t>(rows->begin[L] * c));
  for (int64_t r = 0; r < rows->begin[L]; ++r) {
    const int64_t token = rows->order[r] / K;  // of the group: rank token / n's token token % n
    std::copy_n(gathered + token / n * piece + token % n * c, c, rows->x.data() + r * c);
  }
}

MoeSettings LocalSettings(const MoeSettings& s, int size) {
  MoeSettings local = s;
  local.experts = s.experts / size;
  return local;
}

}  // namespace

absl::Status ExpertParallelForward(float* out, MoeActivations<float>* mine, MoeActivations<float>* rows, const float* x,
                                   const float* w_local, int64_t c, const MoeSettings& s, Communicator* expert,
                                   std::vector<float>* buf) {
  const int size = expert->size(), me = expert->rank();
  const int64_t n = mine->n, K = s.topk, piece = PieceFloats(n, c, K);
  PTK_CHECK(s.experts % size == 0);
  buf->assign(static_cast<size_t>(piece * size), 0.0f);
  float* own = buf->data() + me * piece;
  std::copy_n(x, n * c, own);
  std::copy_n(mine->prob.data(), n * K, own + n * c);
  for (int64_t i = 0; i < n * K; ++i)  // a slot dropped over capacity goes to no rank (-1)
    own[n * c + n * K + i] =
        mine->dropped.empty() || mine->dropped[i] == 0 ? static_cast<float>(mine->expert[i]) : -1.0f;
  const std::vector<int64_t> bytes(static_cast<size_t>(size), piece * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(expert->AllGather(buf->data(), bytes));
  const MoeSettings local = LocalSettings(s, size);
  LocalDispatch(rows, buf->data(), size, n, c, s, local.experts * me, local.experts);
  // The combine: each rank's share of every token of the group, summed over the group into the owner's rows.
  std::vector<float> whole(static_cast<size_t>(n * size * c));
  MoeExpertsForward(whole.data(), rows, w_local, c, local);
  const std::vector<int64_t> counts(static_cast<size_t>(size), n * c);
  PTK_RETURN_IF_ERROR(expert->ReduceScatterSum(whole.data(), counts));
  std::copy_n(whole.data() + me * n * c, n * c, out);
  return absl::OkStatus();
}

absl::Status ExpertParallelBackward(float* dx, float* dw_router, float* dw_local, const float* dout,
                                    MoeActivations<float>* mine, MoeActivations<float>* rows, const float* x,
                                    const float* w_router, const float* w_local, int64_t c, const MoeSettings& s,
                                    double aux_grad, double z_grad, Communicator* expert, std::vector<float>* buf) {
  PTK_RETURN_IF_ERROR(ExpertParallelExpertsBackward(dx, dw_local, dout, mine, rows, w_local, c, s, expert, buf));
  MoeRouterBackward(dx, dw_router, mine, x, w_router, c, s, aux_grad, z_grad);
  return absl::OkStatus();
}

absl::Status ExpertParallelExpertsBackward(float* dx, float* dw_local, const float* dout, MoeActivations<float>* mine,
                                           MoeActivations<float>* rows, const float* w_local, int64_t c,
                                           const MoeSettings& s, Communicator* expert, std::vector<float>* buf) {
  const int size = expert->size(), me = expert->rank();
  const int64_t n = mine->n, K = s.topk, N = n * size;
  // The output gradients of the group's tokens.
  std::vector<float> dout_all(static_cast<size_t>(N * c));
  std::copy_n(dout, n * c, dout_all.data() + me * n * c);
  const std::vector<int64_t> bytes(static_cast<size_t>(size), n * c * static_cast<int64_t>(sizeof(float)));
  PTK_RETURN_IF_ERROR(expert->AllGather(dout_all.data(), bytes));
  const MoeSettings local = LocalSettings(s, size);
  std::vector<float> dx_all(static_cast<size_t>(N * c), 0.0f);
  MoeExpertsBackward(dx_all.data(), dw_local, dout_all.data(), rows, w_local, c, local);
  // Each owner's input and probability gradients, rank by rank: (n·c then n·K) per rank.
  const int64_t piece = n * (c + K);
  buf->assign(static_cast<size_t>(piece * size), 0.0f);
  for (int r = 0; r < size; ++r) {
    std::copy_n(dx_all.data() + r * n * c, n * c, buf->data() + r * piece);
    std::copy_n(rows->dprob.data() + r * n * K, n * K, buf->data() + r * piece + n * c);
  }
  const std::vector<int64_t> counts(static_cast<size_t>(size), piece);
  PTK_RETURN_IF_ERROR(expert->ReduceScatterSum(buf->data(), counts));
  const float* own = buf->data() + me * piece;
  for (int64_t i = 0; i < n * c; ++i) dx[i] += own[i];
  mine->dprob.assign(own + n * c, own + n * c + n * K);
  return absl::OkStatus();
}

}  // namespace ptk::cpu
