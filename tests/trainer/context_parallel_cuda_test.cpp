// Context parallelism's attention on the GPU (context_parallel_cuda.cu, attention_rows_cuda.cu) for C context
// ranks simulated on one device: each rank's chunks computed by the device code the CUDA model runs
// (ContextAttentionForward / Backward, AddContextShares), the all-gather and the exchange of the key and value
// gradients done here on the host (their collectives are NCCL's). Checked against the unsplit CUDA attention
// (AttentionForward / Backward over the whole samples, rows picked at the rank's positions) and against the CPU
// context-parallel op (cpu::AttentionRowsForward / Backward, the shares summed in rank order as the CPU model's
// gloo reduce-scatter does); gpu-labelled (exit 77 without a device).
//
// Tolerances (|gpu - reference| per element): <= 1e-5 * (|ref| + max |ref| of the tensor), the fp32 attention
// tests' bound (matmul_attention_cuda_test), probabilities and dropout masks included (a mask that differs changes
// values by 10% or more); reruns give the same bits.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/attention_cuda_test_util.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/parallel_layout.h"

namespace ptk::cuda {
namespace {

using cuda_test::DeviceBuffer;
using cuda_test::Random;

// A context as the CUDA model makes one in fp32: stream, cuBLAS with pedantic math.
class Gpu {
 public:
  Gpu() {
    EXPECT_EQ(cudaGetDevice(&ctx.device), cudaSuccess);
    EXPECT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
    EXPECT_EQ(cublasCreate(&ctx.cublas), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(ctx.cublas, ctx.stream), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetMathMode(ctx.cublas, CUBLAS_PEDANTIC_MATH), CUBLAS_STATUS_SUCCESS);
  }
  ~Gpu() {
    cudaStreamSynchronize(ctx.stream);
    cublasDestroy(ctx.cublas);
    cudaStreamDestroy(ctx.stream);
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  CudaContext ctx;
};

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double mx = 0;
  for (float w : want) mx = std::max(mx, std::fabs(static_cast<double>(w)));
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    const double tol = 1e-5 * (std::fabs(static_cast<double>(want[i])) + mx);
    if (std::fabs(static_cast<double>(got[i]) - want[i]) > tol) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i] << " (tol " << tol << ")";
      ++bad;
    }
  }
}

// Rows `positions` of each sample of x (b, S, w): (b, positions.size(), w).
std::vector<float> PickRows(const std::vector<float>& x, int64_t b, int64_t S, int64_t w,
                            const std::vector<int64_t>& positions) {
  const int64_t t = static_cast<int64_t>(positions.size());
  std::vector<float> out(static_cast<size_t>(b * t * w));
  for (int64_t s = 0; s < b; ++s)
    for (int64_t i = 0; i < t; ++i)
      std::copy_n(x.begin() + (s * S + positions[static_cast<size_t>(i)]) * w, w, out.begin() + (s * t + i) * w);
  return out;
}

// What every simulated rank computes, for one (shape, C, p).
struct RankResult {
  std::vector<float> out, probs, dqkv;
};

// C ranks through the model's device code: forward, backward, the exchange in rank order, the shares added.
std::vector<RankResult> RunContextRanks(const AttentionShape& whole, int C, const std::vector<float>& qkv,
                                        const std::vector<float>& dout, double p, uint64_t seed,
                                        const std::vector<uint64_t>& streams, Gpu& gpu) {
  const int64_t S = whole.t, t = S / C, w = whole.qkv_width(), c = whole.nh * whole.hd, b = whole.b;
  const int64_t piece = b * t * w;
  AttentionShape local = whole;
  local.t = t;
  const std::vector<int64_t> table = ContextParallelPositionTable(S, C);
  std::vector<float> gathered;  // the all-gather's result: every rank's rows, rank by rank
  for (int q = 0; q < C; ++q) {
    const std::vector<float> mine = PickRows(qkv, b, S, w, ContextParallelPositions(S, C, q));
    gathered.insert(gathered.end(), mine.begin(), mine.end());
  }
  DeviceBuffer<int64_t> d_table(table);
  DeviceBuffer<uint64_t> d_streams(streams);
  DeviceBuffer<float> d_gathered(gathered), d_whole(static_cast<size_t>(C * piece)),
      d_dwhole(static_cast<size_t>(C * piece)), d_scratch(static_cast<size_t>(AttentionRowsBackwardScratch(whole, t)));
  std::vector<RankResult> results(static_cast<size_t>(C));
  std::vector<std::vector<float>> shares(static_cast<size_t>(C));
  for (int r = 0; r < C; ++r) {
    const ContextAttentionArgs cp{C, r, d_table.get()};
    const std::vector<int64_t> pos = ContextParallelPositions(S, C, r);
    DeviceBuffer<float> d_qkv(PickRows(qkv, b, S, w, pos)), d_dout(PickRows(dout, b, S, c, pos)),
        d_out(static_cast<size_t>(b * t * c)), d_probs(static_cast<size_t>(b * whole.nh * t * S)),
        d_dqkv(static_cast<size_t>(piece)), d_shares(static_cast<size_t>(C * piece));
    EXPECT_TRUE(ContextAttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), d_gathered.get(), d_whole.get(), cp,
                                        local, p, seed, d_streams.get(), gpu.ctx)
                    .ok());
    EXPECT_TRUE(ContextAttentionBackward(d_dqkv.get(), d_shares.get(), d_dout.get(), d_qkv.get(), d_gathered.get(),
                                         d_whole.get(), d_dwhole.get(), d_probs.get(), cp, local, p, seed,
                                         d_streams.get(), d_scratch.get(), gpu.ctx)
                    .ok());
    results[static_cast<size_t>(r)] = {d_out.Download(), d_probs.Download(), d_dqkv.Download()};
    shares[static_cast<size_t>(r)] = d_shares.Download();
  }
  for (int r = 0; r < C; ++r) {  // the exchange: rank q's share of rank r's rows into piece q
    std::vector<float> received(static_cast<size_t>(C * piece), 0.0f);
    for (int q = 0; q < C; ++q)
      if (q != r) std::copy_n(shares[static_cast<size_t>(q)].begin() + r * piece, piece, received.begin() + q * piece);
    DeviceBuffer<float> d_dqkv(results[static_cast<size_t>(r)].dqkv), d_received(received),
        d_own(std::vector<float>(shares[static_cast<size_t>(r)].begin() + r * piece,
                                 shares[static_cast<size_t>(r)].begin() + (r + 1) * piece));
    EXPECT_TRUE(AddContextShares(d_dqkv.get(), d_received.get(), d_own.get(), ContextAttentionArgs{C, r, d_table.get()},
                                 piece, gpu.ctx)
                    .ok());
    results[static_cast<size_t>(r)].dqkv = d_dqkv.Download();
  }
  return results;
}

// The CPU context-parallel op for rank r of C: its out, probs, and dqkv with the shares of its rows summed in rank
// order (CpuGPTModel::ContextAttentionBackward over a gloo group).
RankResult CpuRank(const AttentionShape& whole, int C, int r, const std::vector<float>& qkv,
                   const std::vector<float>& dout, double p, uint64_t seed, const std::vector<uint64_t>& streams) {
  const int64_t S = whole.t, t = S / C, w = whole.qkv_width(), c = whole.nh * whole.hd, b = whole.b;
  RankResult res;
  res.out.resize(static_cast<size_t>(b * t * c));
  res.probs.resize(static_cast<size_t>(b * whole.nh * t * S));
  std::vector<float> sum(static_cast<size_t>(b * t * w), 0.0f);
  for (int q = 0; q < C; ++q) {
    const std::vector<int64_t> pos = ContextParallelPositions(S, C, q);
    const std::vector<float> q_rows = PickRows(qkv, b, S, w, pos), q_dout = PickRows(dout, b, S, c, pos);
    std::vector<float> out(res.out.size()), probs(res.probs.size()), dq(static_cast<size_t>(b * t * w), 0.0f),
        dkv(qkv.size(), 0.0f);
    cpu::AttentionRowsForward<float>(out.data(), probs.data(), q_rows.data(), qkv.data(), pos.data(), t, whole, p, seed,
                                     streams.data());
    cpu::AttentionRowsBackward<float>(dq.data(), dkv.data(), q_dout.data(), q_rows.data(), qkv.data(), probs.data(),
                                      pos.data(), t, whole, p, seed, streams.data());
    const std::vector<float> share = PickRows(dkv, b, S, w, ContextParallelPositions(S, C, r));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += share[i];
    if (q == r) {
      res.out = out;
      res.probs = probs;
      res.dqkv = dq;
    }
  }
  for (size_t i = 0; i < sum.size(); ++i) res.dqkv[i] += sum[i];
  return res;
}

void CompareForShape(const AttentionShape& whole, int C, double p) {
  Gpu gpu;
  const std::string name = "b=" + std::to_string(whole.b) + " S=" + std::to_string(whole.t) +
                           " nh=" + std::to_string(whole.nh) + " groups=" + std::to_string(whole.groups()) +
                           " C=" + std::to_string(C) + " p=" + std::to_string(p);
  SCOPED_TRACE(name);
  const int64_t S = whole.t, w = whole.qkv_width(), c = whole.nh * whole.hd, b = whole.b;
  const std::vector<float> qkv = Random(static_cast<size_t>(b * S * w), 11 + C);
  const std::vector<float> dout = Random(static_cast<size_t>(b * S * c), 23 + C);
  std::vector<uint64_t> streams(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s) streams[static_cast<size_t>(s)] = DropoutStream(static_cast<uint64_t>(s + 5), 2, 3);
  const uint64_t seed = 1234;
  const std::vector<RankResult> ranks = RunContextRanks(whole, C, qkv, dout, p, seed, streams, gpu);
  // The unsplit CUDA attention over the whole samples.
  DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(static_cast<size_t>(b * S * c)),
      d_probs(static_cast<size_t>(b * whole.nh * S * S)), d_dqkv(qkv.size()),
      d_scratch(static_cast<size_t>(AttentionBackwardScratch(whole)));
  DeviceBuffer<uint64_t> d_streams(streams);
  STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), whole, p, seed, d_streams.get(), gpu.ctx));
  STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), whole, p, seed, d_streams.get(),
                              d_scratch.get(), gpu.ctx));
  const std::vector<float> out = d_out.Download(), dqkv = d_dqkv.Download();
  for (int r = 0; r < C; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const std::vector<int64_t> pos = ContextParallelPositions(S, C, r);
    const RankResult& got = ranks[static_cast<size_t>(r)];
    ExpectClose(got.out, PickRows(out, b, S, c, pos), "out vs unsplit CUDA");
    ExpectClose(got.dqkv, PickRows(dqkv, b, S, w, pos), "dqkv vs unsplit CUDA");
    const RankResult cpu = CpuRank(whole, C, r, qkv, dout, p, seed, streams);
    ExpectClose(got.out, cpu.out, "out vs CPU context op");
    ExpectClose(got.probs, cpu.probs, "probs vs CPU context op");
    ExpectClose(got.dqkv, cpu.dqkv, "dqkv vs CPU context op");
  }
}

TEST(ContextParallelCuda, RanksMatchUnsplitCudaAttentionAndTheCpuContextOp) {
  for (const double p : {0.0, 0.2}) {
    CompareForShape({2, 24, 3, 16}, 2, p);
    CompareForShape({1, 48, 2, 32}, 4, p);
    CompareForShape({2, 36, 2, 8}, 3, p);
    CompareForShape({2, 40, 4, 16, 2}, 2, p);  // grouped-query attention
  }
}

TEST(ContextParallelCuda, OneRankIsTheWholeAttention) { CompareForShape({2, 20, 2, 16}, 1, 0.1); }

TEST(ContextParallelCuda, RerunsGiveTheSameBits) {
  Gpu gpu;
  const AttentionShape whole{2, 32, 2, 16};
  const std::vector<float> qkv = Random(static_cast<size_t>(2 * 32 * whole.qkv_width()), 3);
  const std::vector<float> dout = Random(static_cast<size_t>(2 * 32 * 32), 4);
  const std::vector<uint64_t> streams = {7, 9};
  const auto a = RunContextRanks(whole, 2, qkv, dout, 0.1, 5, streams, gpu);
  const auto b = RunContextRanks(whole, 2, qkv, dout, 0.1, 5, streams, gpu);
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].out, b[r].out);
    EXPECT_EQ(a[r].probs, b[r].probs);
    EXPECT_EQ(a[r].dqkv, b[r].dqkv);
  }
}

TEST(ContextParallelCuda, BadArgumentsAreStatuses) {
  Gpu gpu;
  DeviceBuffer<float> x(4096);
  DeviceBuffer<int64_t> table(ContextParallelPositionTable(8, 2));
  const AttentionShape local{1, 4, 1, 8};
  const absl::Status rank =
      ContextAttentionForward(x.get(), x.get(), x.get(), x.get(), x.get(), ContextAttentionArgs{2, 2, table.get()},
                              local, 0.0, 1, nullptr, gpu.ctx);
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument) << rank;
  const absl::Status rows =
      AttentionRowsForward(x.get(), x.get(), x.get(), x.get(), table.get(), 9, {1, 8, 1, 8}, 0.0, 1, nullptr, gpu.ctx);
  EXPECT_EQ(rows.code(), absl::StatusCode::kInvalidArgument) << rows;
}

}  // namespace
}  // namespace ptk::cuda
