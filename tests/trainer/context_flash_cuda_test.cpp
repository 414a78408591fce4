// Context parallelism's cuDNN pairs (trainer/cuda/context_flash_cuda.h) on one GPU: every rank of C = 1, 2 (and 3)
// runs its pairs (ContextFlashPairs) over the all-gathered pieces of whole samples' qkv rows; the partial outputs
// and log-sum-exps merged on the device in pair order (MergeContextFlashPair) are the direct causal softmax's
// output and natural log-sum-exp (cuDNN's stats are what context_flash.h's merge assumes); the pairs' backward
// with the merged output and stats, added on the device to the rank's query gradient and key/value shares
// (AddContextFlashPairGrads), the shares then summed over the ranks at their chunks' rows, is the softmax's
// gradient. bf16 and fp16, with and without query groups, against a
// double reference on the same rounded inputs. gpu-labelled: exit 77 without a device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tests/trainer/attention_cuda_test_util.h"
#include "trainer/cuda/context_flash.h"
#include "trainer/cuda/context_flash_cuda.h"
#include "trainer/cuda/context_rows.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/parallel_layout.h"

namespace ptk::cuda {
namespace {

using context_detail::FlashPair;
using context_detail::FlashPairShape;
using cuda_test::DeviceBuffer;
using cuda_test::Gpu;
using cuda_test::Random;

template <typename T>
std::vector<T> Narrow(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FromFloat<T>(x[i]);
  return out;
}
template <typename T>
std::vector<float> Round(const std::vector<float>& x) {  // x as T holds it
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = ToFloat(FromFloat<T>(x[i]));
  return out;
}

// Column of head h's query (part 0), key (1) or value (2) element d in a qkv row (context_flash.h's layouts).
int64_t Col(const FlashPairShape& s, int part, int64_t h, int64_t d) {
  if (s.ng == s.nh) return (h * 3 + part) * s.hd + d;
  return (part == 0 ? h * s.hd : (s.nh + (part - 1) * s.ng + h) * s.hd) + d;
}

// Whole samples (b, S) of qkv rows and output gradients, and the direct causal softmax on them in double.
struct Problem {
  FlashPairShape s;
  int64_t S, w, c;
  std::vector<float> qkv, dout;        // (b, S, w), (b, S, c): values T holds exactly
  std::vector<double> out, lse, dqkv;  // (b, S, c), (b, nh, S), (b, S, w)
};

// Row (b, i) of head h: its log-sum-exp, output, and its gradient's contributions to dqkv.
void DirectRow(Problem& p, int64_t b, int64_t h, int64_t i) {
  const FlashPairShape& s = p.s;
  const int64_t g = h / (s.nh / s.ng);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  auto x = [&](int part, int64_t head, int64_t row, int64_t d) {
    return static_cast<double>(p.qkv[static_cast<size_t>((b * p.S + row) * p.w + Col(s, part, head, d))]);
  };
  std::vector<double> sc(static_cast<size_t>(i + 1));
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j <= i; ++j) {
    double acc = 0;
    for (int64_t d = 0; d < s.hd; ++d) acc += x(0, h, i, d) * x(1, g, j, d);
    sc[static_cast<size_t>(j)] = acc * scale;
    m = std::max(m, acc * scale);
  }
  for (const double v : sc) sum += std::exp(v - m);
  const double lse = m + std::log(sum);
  p.lse[static_cast<size_t>((b * s.nh + h) * p.S + i)] = lse;
  double* o = &p.out[static_cast<size_t>((b * p.S + i) * p.c + h * s.hd)];
  const float* dout = &p.dout[static_cast<size_t>((b * p.S + i) * p.c + h * s.hd)];
  for (int64_t j = 0; j <= i; ++j)
    for (int64_t d = 0; d < s.hd; ++d) o[d] += std::exp(sc[static_cast<size_t>(j)] - lse) * x(2, g, j, d);
  double D = 0;
  for (int64_t d = 0; d < s.hd; ++d) D += o[d] * dout[d];
  auto grad = [&](int part, int64_t head, int64_t row, int64_t d) -> double& {
    return p.dqkv[static_cast<size_t>((b * p.S + row) * p.w + Col(s, part, head, d))];
  };
  for (int64_t j = 0; j <= i; ++j) {
    const double prob = std::exp(sc[static_cast<size_t>(j)] - lse);
    double dp = 0;
    for (int64_t d = 0; d < s.hd; ++d) dp += dout[d] * x(2, g, j, d);
    const double ds = prob * (dp - D) * scale;
    for (int64_t d = 0; d < s.hd; ++d) {
      grad(0, h, i, d) += ds * x(1, g, j, d);
      grad(1, g, j, d) += ds * x(0, h, i, d);
      grad(2, g, j, d) += prob * dout[d];
    }
  }
}

template <typename T>
Problem MakeProblem(const FlashPairShape& s) {
  Problem p{s, s.context * s.t, (s.nh + 2 * s.ng) * s.hd, s.nh * s.hd, {}, {}, {}, {}, {}};
  p.qkv = Round<T>(Random(static_cast<size_t>(s.b * p.S * p.w), 91, -2.0f, 2.0f));
  p.dout = Round<T>(Random(static_cast<size_t>(s.b * p.S * p.c), 92));
  p.out.assign(static_cast<size_t>(s.b * p.S * p.c), 0.0);
  p.lse.assign(static_cast<size_t>(s.b * s.nh * p.S), 0.0);
  p.dqkv.assign(static_cast<size_t>(s.b * p.S * p.w), 0.0);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.nh; ++h)
      for (int64_t i = 0; i < p.S; ++i) DirectRow(p, b, h, i);
  return p;
}

double MaxAbs(const std::vector<double>& x) {
  double m = 0;
  for (const double v : x) m = std::max(m, std::fabs(v));
  return m;
}

// One rank's merged output (b, t, c) and log-sum-exp (2, b, nh, chunk): each pair's partials merged on the device
// in pair order (MergeContextFlashPair).
template <typename T>
void RankForward(const Problem& p, int rank, const T* gathered, const CudaContext& ctx, std::vector<float>* out,
                 std::vector<float>* lse) {
  const FlashPairShape& s = p.s;
  const int64_t chunk = s.t / 2;
  DeviceBuffer<T> d_part(static_cast<size_t>(s.b * chunk * p.c));
  DeviceBuffer<float> d_stats(static_cast<size_t>(s.b * s.nh * chunk)), d_out(static_cast<size_t>(s.b * s.t * p.c)),
      d_lse(static_cast<size_t>(2 * s.b * s.nh * chunk));
  for (const FlashPair& pair : context_detail::ContextFlashPairs(s.context, rank)) {
    SCOPED_TRACE("pair " + std::to_string(pair.q_chunk) + " x " + std::to_string(pair.kv_chunk));
    STATUS_OK(ContextFlashPairForward<T>(d_part.get(), d_stats.get(), gathered, s, pair, ctx));
    STATUS_OK(MergeContextFlashPair<T>(d_out.get(), d_lse.get(), d_part.get(), d_stats.get(), s, pair, ctx));
  }
  *out = d_out.Download();
  *lse = d_lse.Download();
}

// One rank's pairs backward with its merged output and stats, added on the device (AddContextFlashPairGrads) to
// its fp32 query gradient rows and its shares of the key/value gradients in the gathered layout; both then added
// to `dqkv` (b, S, w) at the whole samples' rows (the exchange and the rank-order sum, on the host).
template <typename T>
void RankBackward(const Problem& p, int rank, const T* gathered, const std::vector<float>& out,
                  const std::vector<float>& lse, const CudaContext& ctx, std::vector<double>* dqkv) {
  const FlashPairShape& s = p.s;
  const int64_t chunk = s.t / 2, ckv = s.ng * s.hd, piece = s.b * s.t * p.w;
  const std::vector<int64_t> pos = ContextParallelPositions(p.S, s.context, rank);
  std::vector<float> dout(static_cast<size_t>(s.b * s.t * p.c));
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < s.t; ++i)
      for (int64_t e = 0; e < p.c; ++e)
        dout[static_cast<size_t>((b * s.t + i) * p.c + e)] =
            p.dout[static_cast<size_t>((b * p.S + pos[static_cast<size_t>(i)]) * p.c + e)];
  DeviceBuffer<T> d_out(Narrow<T>(out)), d_dout(Narrow<T>(dout)), d_dq(static_cast<size_t>(s.b * chunk * p.c)),
      d_dk(static_cast<size_t>(s.b * chunk * ckv)), d_dv(static_cast<size_t>(s.b * chunk * ckv));
  DeviceBuffer<float> d_lse(lse), d_rows(std::vector<float>(static_cast<size_t>(piece), 0.0f)),
      d_shares(std::vector<float>(static_cast<size_t>(s.context * piece), 0.0f));
  for (const FlashPair& pair : context_detail::ContextFlashPairs(s.context, rank)) {
    SCOPED_TRACE("pair " + std::to_string(pair.q_chunk) + " x " + std::to_string(pair.kv_chunk));
    STATUS_OK(ContextFlashPairBackward<T>(d_dq.get(), d_dk.get(), d_dv.get(), d_dout.get(), d_out.get(), d_lse.get(),
                                          gathered, s, pair, ctx));
    STATUS_OK(
        AddContextFlashPairGrads<T>(d_rows.get(), d_shares.get(), d_dq.get(), d_dk.get(), d_dv.get(), s, pair, ctx));
  }
  const std::vector<float> rows = d_rows.Download(), shares = d_shares.Download();
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < s.t; ++i)
      for (int64_t col = 0; col < p.w; ++col)
        (*dqkv)[static_cast<size_t>((b * p.S + pos[static_cast<size_t>(i)]) * p.w + col)] +=
            rows[static_cast<size_t>((b * s.t + i) * p.w + col)];
  const std::vector<int64_t> table = ContextParallelPositionTable(p.S, s.context);
  for (int64_t e = 0; e < s.context * piece; ++e)
    (*dqkv)[static_cast<size_t>(context_detail::WholeIndex(e, s.b, s.t, p.w, s.context, table.data()))] +=
        shares[static_cast<size_t>(e)];
}

// Every rank's pairs of `s` against the direct softmax: output within fwd_tol of its largest magnitude, the
// log-sum-exp within lse_tol, dQ, dK, dV within bwd_tol of each one's largest.
template <typename T>
void PairsMatchTheSoftmax(const FlashPairShape& s, double fwd_tol, double lse_tol, double bwd_tol) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const Problem p = MakeProblem<T>(s);
  auto ws = ContextFlashWorkspaceBytes<T>(s, gpu.ctx);
  ASSERT_TRUE(ws.ok()) << ws.status();
  EXPECT_LE(*ws, static_cast<int64_t>(gpu.ctx.workspace_bytes));
  // The all-gathered rank-ordered pieces (context_rows.h's mapping), the same on every rank.
  const std::vector<int64_t> table = ContextParallelPositionTable(p.S, s.context);
  std::vector<float> pieces(p.qkv.size());
  for (size_t e = 0; e < pieces.size(); ++e)
    pieces[e] = p.qkv[static_cast<size_t>(
        context_detail::WholeIndex(static_cast<int64_t>(e), s.b, s.t, p.w, s.context, table.data()))];
  DeviceBuffer<T> gathered(Narrow<T>(pieces));
  std::vector<double> dqkv(p.dqkv.size(), 0.0);
  const double mo = MaxAbs(p.out);
  for (int r = 0; r < s.context; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    std::vector<float> out, lse;
    RankForward<T>(p, r, gathered.get(), gpu.ctx, &out, &lse);
    const std::vector<int64_t> pos = ContextParallelPositions(p.S, s.context, r);
    const int64_t chunk = s.t / 2;
    for (int64_t b = 0; b < s.b; ++b)
      for (int64_t i = 0; i < s.t; ++i) {
        const int64_t at = pos[static_cast<size_t>(i)];
        for (int64_t e = 0; e < p.c; ++e)
          ASSERT_NEAR(out[static_cast<size_t>((b * s.t + i) * p.c + e)],
                      p.out[static_cast<size_t>((b * p.S + at) * p.c + e)], fwd_tol * mo)
              << "out sample " << b << " position " << at << " column " << e;
        for (int64_t h = 0; h < s.nh; ++h)
          ASSERT_NEAR(lse[static_cast<size_t>((((i / chunk) * s.b + b) * s.nh + h) * chunk + i % chunk)],
                      p.lse[static_cast<size_t>((b * s.nh + h) * p.S + at)], lse_tol)
              << "log-sum-exp sample " << b << " head " << h << " position " << at;
      }
    RankBackward<T>(p, r, gathered.get(), out, lse, gpu.ctx, &dqkv);
  }
  double m[3] = {0, 0, 0};
  auto part_of = [&](size_t e) {
    const int64_t col = static_cast<int64_t>(e) % p.w;
    if (s.ng == s.nh) return static_cast<int>(col / s.hd % 3);
    return col < p.c ? 0 : col < p.c + s.ng * s.hd ? 1 : 2;
  };
  for (size_t e = 0; e < p.dqkv.size(); ++e) m[part_of(e)] = std::max(m[part_of(e)], std::fabs(p.dqkv[e]));
  for (size_t e = 0; e < p.dqkv.size(); ++e)
    ASSERT_NEAR(dqkv[e], p.dqkv[e], bwd_tol * m[part_of(e)]) << "dqkv element " << e << " (part " << part_of(e) << ")";
}

TEST(ContextFlashCuda, Bf16PairsMatchTheSoftmax) {
  for (const int C : {1, 2, 3}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    PairsMatchTheSoftmax<__nv_bfloat16>(FlashPairShape{2, 128, 4, 4, 64, C}, 2e-2, 1e-2, 5e-2);
  }
}

TEST(ContextFlashCuda, Bf16GroupedQueryPairsMatchTheSoftmax) {
  PairsMatchTheSoftmax<__nv_bfloat16>(FlashPairShape{2, 96, 4, 2, 64, 2}, 2e-2, 1e-2, 5e-2);
}

TEST(ContextFlashCuda, Fp16PairsMatchTheSoftmax) {
  PairsMatchTheSoftmax<__half>(FlashPairShape{1, 64, 2, 2, 128, 2}, 1e-2, 1e-2, 2.5e-2);
}

TEST(ContextFlashCuda, ShapeAndPairErrorsAreStatuses) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  DeviceBuffer<__nv_bfloat16> buf(1 << 16);
  DeviceBuffer<float> stats(1 << 12);
  const FlashPairShape odd{1, 63, 2, 2, 64, 2}, ok{1, 64, 2, 2, 64, 2};
  const FlashPair first{0, 0, 0, true, true}, not_a_pair{0, 0, 1, false, false}, wrong_mask{1, 3, 1, true, false};
  for (const auto& [shape, pair] : {std::pair{odd, first}, std::pair{ok, not_a_pair}, std::pair{ok, wrong_mask}}) {
    const absl::Status st =
        ContextFlashPairForward<__nv_bfloat16>(buf.get(), stats.get(), buf.get(), shape, pair, gpu.ctx);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
}

}  // namespace
}  // namespace ptk::cuda
