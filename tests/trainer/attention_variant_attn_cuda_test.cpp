// Megatron's sliding window (--window-size W,0) and softmax offset (--softmax-type off-by-one / learnable) in the
// CUDA attention against the CPU op (cpu::AttentionForward / Backward, which run attention_rows_cpu.cpp's FirstKey and
// SoftmaxRow): the fp32 kernels (attention_cuda.cu) with both, with and without dropout, query groups, the offset's
// gradient summed over the batch; cuDNN's bf16/fp16 graphs with the window (the diagonal band, left bound W + 1), and
// their refusal of the offset. gpu-labelled: skipped (exit 77) without a device. Never run on a GPU yet.
//
// Tolerances: fp32 as matmul_attention_cuda_test's (<= 1e-5 * (|ref| + max |ref| of the tensor)); the offset's
// gradient 1e-5 * (|ref| + sum over rows of |p_sink * dot|, a bound on any summation order's rounding). Flash as
// matmul_attention_cuda_test's: bf16 out 2e-2 / dqkv 5e-2 of the largest magnitude, fp16 1e-2 / 2.5e-2, against the
// CPU op in double on the rounded inputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

namespace ptk::cuda {
namespace {

using cuda_test::DeviceBuffer;
using cuda_test::Gpu;
using cuda_test::Random;
using cuda_test::ToDouble;
using cuda_test::ToT;

template <typename G, typename R>
void ExpectWithin(const std::vector<G>& got, const std::vector<R>& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double m = 0;
  for (const R& x : want) m = std::max(m, std::fabs(static_cast<double>(x)));
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(ToFloat(got[i])), w = static_cast<double>(want[i]);
    if (!(std::fabs(g - w) <= rtol * (std::fabs(w) + m)) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside tolerance";
}

struct Case {
  AttentionShape s;
  int64_t window;  // -1: none
  bool sink;       // a softmax offset (learnable's values; off-by-one is the zeros)
};

std::string Describe(const Case& c, double p) {
  return "b=" + std::to_string(c.s.b) + " t=" + std::to_string(c.s.t) + " nh=" + std::to_string(c.s.nh) +
         " groups=" + std::to_string(c.s.groups()) + " window=" + std::to_string(c.window) + (c.sink ? " offset" : "") +
         " p=" + std::to_string(p);
}

// Windows 0 (a row its own key only), shorter than the sequence, as long; offsets with and without the window.
const Case kCases[] = {{{2, 37, 3, 16}, 5, false}, {{1, 40, 4, 8, 2}, 0, false}, {{2, 9, 2, 8}, 8, false},
                       {{2, 37, 3, 16}, -1, true}, {{3, 21, 4, 16, 2}, 6, true}, {{1, 1, 2, 8}, 3, true}};

TEST(AttentionVariantCuda, Fp32WindowAndSoftmaxOffsetMatchCpu) {
  Gpu gpu;
  for (const Case& k : kCases) {
    for (double p : {0.0, 0.1}) {
      SCOPED_TRACE(Describe(k, p));
      const AttentionShape& s0 = k.s;
      const int64_t c = s0.nh * s0.hd, w = s0.qkv_width(), n = s0.b * s0.t;
      const auto qkv = Random(n * w, 81, -2.0f, 2.0f), dout = Random(n * c, 82);
      const auto offset = Random(s0.nh, 83, -1.0f, 2.0f);
      std::vector<uint64_t> streams(s0.b);
      for (int64_t b = 0; b < s0.b; ++b) streams[b] = DropoutStream(static_cast<uint64_t>(b + 5), 2, kAttentionProbs);
      const std::vector<float> dsink0(s0.nh, 0.25f);  // the gradient accumulates
      std::vector<float> out(n * c), probs(s0.b * s0.nh * s0.t * s0.t), dqkv(n * w), dsink = dsink0;
      AttentionShape host = s0;
      host.window = k.window;
      if (k.sink) host.sink = offset.data();
      cpu::AttentionForward<float>(out.data(), probs.data(), qkv.data(), host, p, 99, streams.data());
      if (k.sink) host.dsink = dsink.data();
      cpu::AttentionBackward<float>(dqkv.data(), dout.data(), qkv.data(), probs.data(), host, p, 99, streams.data());
      DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(out.size()), d_probs(probs.size()), d_dqkv(dqkv.size()),
          d_offset(offset), d_dsink(dsink0), d_scratch(AttentionBackwardScratch(s0));
      DeviceBuffer<uint64_t> d_streams(streams);
      AttentionShape dev = s0;
      dev.window = k.window;
      if (k.sink) dev.sink = d_offset.get();
      STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), dev, p, 99, d_streams.get(), gpu.ctx));
      if (k.sink) dev.dsink = d_dsink.get();
      STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), dev, p, 99, d_streams.get(),
                                  d_scratch.get(), gpu.ctx));
      const auto got_probs = d_probs.Download();
      ExpectWithin(got_probs, probs, 1e-5, "probs");
      ExpectWithin(d_out.Download(), out, 1e-5, "out");
      ExpectWithin(d_dqkv.Download(), dqkv, 1e-5, "dqkv");
      if (k.sink) ExpectWithin(d_dsink.Download(), dsink, 1e-5, "dsink");
      // Outside the window the probabilities are exactly zero.
      if (k.window >= 0) {
        for (int64_t r = 0; r < s0.b * s0.nh * s0.t; ++r)
          for (int64_t j = 0; j < std::max<int64_t>(0, r % s0.t - k.window); ++j)
            ASSERT_EQ(got_probs[r * s0.t + j], 0.0f) << "row " << r << " key " << j;
      }
    }
  }
}

// The offset's gradient is summed without atomics: the same bits on a second run.
TEST(AttentionVariantCuda, Fp32SoftmaxOffsetGradientIsDeterministic) {
  Gpu gpu;
  AttentionShape s{3, 33, 2, 16};
  s.window = 7;
  const int64_t c = s.nh * s.hd, n = s.b * s.t;
  DeviceBuffer<float> d_qkv(Random(n * 3 * c, 84)), d_dout(Random(n * c, 85)), d_out(n * c),
      d_probs(s.b * s.nh * s.t * s.t), d_dqkv(n * 3 * c), d_offset(Random(s.nh, 86)), d_dsink(s.nh),
      d_scratch(AttentionBackwardScratch(s));
  s.sink = d_offset.get();
  s.dsink = d_dsink.get();
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    d_dsink.Upload(std::vector<float>(s.nh, 0.0f));
    STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), s, 0.0, 1, nullptr, gpu.ctx));
    STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), s, 0.0, 1, nullptr,
                                d_scratch.get(), gpu.ctx));
    if (run == 0)
      first = d_dsink.Download();
    else
      EXPECT_EQ(first, d_dsink.Download());
  }
  AttentionShape no_sink = s;  // a gradient asked without the offset is an error
  no_sink.sink = nullptr;
  EXPECT_FALSE(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), no_sink, 0.0, 1, nullptr,
                                 d_scratch.get(), gpu.ctx)
                   .ok());
}

template <typename T>
void FlashWindowMatchesCpu(double fwd_tol, double bwd_tol) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  for (const auto& [shape, window] :
       {std::pair{AttentionShape{2, 64, 4, 64}, int64_t{16}}, std::pair{AttentionShape{1, 37, 2, 32}, int64_t{0}},
        std::pair{AttentionShape{2, 130, 3, 128}, int64_t{129}}}) {
    AttentionShape s = shape;
    s.window = window;
    SCOPED_TRACE("t=" + std::to_string(s.t) + " window=" + std::to_string(window));
    const int64_t c = s.nh * s.hd, n = s.b * s.t;
    const auto qkv = ToT<T>(Random(n * 3 * c, 87, -2.0f, 2.0f)), dout = ToT<T>(Random(n * c, 88));
    const auto xqkv = ToDouble(qkv), xdout = ToDouble(dout);
    std::vector<double> out(n * c), probs(s.b * s.nh * s.t * s.t), dqkv(n * 3 * c);
    cpu::AttentionForward<double>(out.data(), probs.data(), xqkv.data(), s, 0.0, 0, nullptr);
    cpu::AttentionBackward<double>(dqkv.data(), xdout.data(), xqkv.data(), probs.data(), s, 0.0, 0, nullptr);
    auto ws = FlashAttentionWorkspaceBytes<T>(s, 0.0, gpu.ctx);
    ASSERT_TRUE(ws.ok()) << ws.status();
    DeviceBuffer<T> d_qkv(qkv), d_dout(dout), d_out(n * c), d_dqkv(n * 3 * c);
    DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
    STATUS_OK(FlashAttentionForward<T>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0, gpu.ctx));
    STATUS_OK(FlashAttentionBackward<T>(d_dqkv.get(), d_dout.get(), d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0,
                                        0, gpu.ctx));
    ExpectWithin(d_out.Download(), out, fwd_tol, "out");
    ExpectWithin(d_dqkv.Download(), dqkv, bwd_tol, "dqkv");
    // The window changes the result (a test that could not tell the band from the causal mask would pass anyway).
    if (window < s.t - 1) {
      AttentionShape causal = s;
      causal.window = -1;
      std::vector<double> full(n * c);
      cpu::AttentionForward<double>(full.data(), probs.data(), xqkv.data(), causal, 0.0, 0, nullptr);
      double differ = 0;
      for (size_t i = 0; i < full.size(); ++i) differ = std::max(differ, std::fabs(full[i] - out[i]));
      EXPECT_GT(differ, 0.1) << "the window's output should differ from the causal one's";
    }
  }
}
TEST(AttentionVariantCuda, Bf16FlashWindowMatchesCpu) { FlashWindowMatchesCpu<__nv_bfloat16>(2e-2, 5e-2); }
TEST(AttentionVariantCuda, Fp16FlashWindowMatchesCpu) { FlashWindowMatchesCpu<__half>(1e-2, 2.5e-2); }

// cuDNN's graphs take no softmax offset in ptk: refused with a status, never run without it.
TEST(AttentionVariantCuda, FlashRefusesTheSoftmaxOffset) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  AttentionShape s{1, 8, 2, 16};
  DeviceBuffer<__nv_bfloat16> qkv(8 * 6 * 16), out(8 * 2 * 16);
  DeviceBuffer<float> stats(16), offset(2);
  s.sink = offset.get();
  const absl::Status st =
      FlashAttentionForward<__nv_bfloat16>(out.get(), stats.get(), qkv.get(), s, 0.0, 0, 0, gpu.ctx);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
}

}  // namespace
}  // namespace ptk::cuda
