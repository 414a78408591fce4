// The Llama line's CUDA ops (RMSNorm, with the residual add fused in, RoPE, SwiGLU, --qk-layernorm's
// norms) against their CPU ops (trainer/cpu/), for fp32, bf16 and fp16 on random inputs of awkward
// sizes (channels not a multiple of 8, one row, query groups, partial rotary), and the RMSNorm and
// query/key norm weight gradients' determinism. gpu-labelled (part of ops_cuda_test): skipped (exit
// 77) without a device. Tolerances as ops_cuda_test.cpp states them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using namespace ops_test;  // NOLINT

template <typename T>
class LlamaCudaOps : public CudaOps {};

TYPED_TEST_SUITE(LlamaCudaOps, ActivationTypes, TypeNames);

struct Rows {
  int64_t n, c;
};

// fp32: out and rstd within 1e-5 rel / 1e-6 abs (the same double statistics, summed in another order).
TYPED_TEST(LlamaCudaOps, RMSNormForwardMatchesCpu) {
  using T = TypeParam;
  for (Rows s : {Rows{1, 9}, Rows{70, 768}, Rows{33, 1027}, Rows{3, 1}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const auto x = RoundTrip<T>(Normal(s.n * s.c, 1, 0.3f, 2.0f));
    const auto w = Normal(s.c, 2, 1.0f, 0.2f);
    std::vector<float> out(s.n * s.c), rstd(s.n);
    cpu::RMSNormForward(out.data(), rstd.data(), x.data(), w.data(), s.n, s.c, 1e-5);
    DeviceArray<T> dx(ToT<T>(x)), dout(s.n * s.c);
    DeviceArray<float> dw(w), drstd(s.n);
    ASSERT_OK(RMSNormForward<T>(dout.get(), drstd.get(), dx.get(), dw.get(), s.n, s.c, 1e-5, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out " + what, true);
    ExpectClose(drstd.Download(), rstd, 1e-6, 1e-7, "rstd " + what);
    ASSERT_OK(RMSNormForward<T>(dout.get(), nullptr, dx.get(), dw.get(), s.n, s.c, 1e-5, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out without statistics " + what, true);
  }
}

// The residual add fused in front (the CUDA model's RMSNorm): bitwise ResidualAdd (the sum rounded
// to T) and then RMSNormForward, the sum written beside the norm; also with resid_out aliasing a.
// Bitwise by construction: both kernels call kernel::ResidualSum and the same explicitly rounded
// norm functions (cuda_fmad_test).
TYPED_TEST(LlamaCudaOps, ResidualRMSNormForwardIsTheAddThenTheNorm) {
  using T = TypeParam;
  for (Rows s : {Rows{1, 9}, Rows{70, 768}, Rows{33, 1027}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const auto a = RoundTrip<T>(Normal(s.n * s.c, 11, 0.2f, 1.0f)), b = RoundTrip<T>(Normal(s.n * s.c, 12, 0.0f, 0.5f));
    const auto w = Normal(s.c, 13, 1.0f, 0.2f);
    DeviceArray<T> da(ToT<T>(a)), db(ToT<T>(b)), sum(s.n * s.c), out(s.n * s.c), fused_sum(s.n * s.c),
        fused_out(s.n * s.c);
    DeviceArray<float> dw(w), rstd(s.n), fused_rstd(s.n);
    ASSERT_OK(ResidualAdd<T>(sum.get(), da.get(), db.get(), s.n * s.c, this->ctx_));
    ASSERT_OK(RMSNormForward<T>(out.get(), rstd.get(), sum.get(), dw.get(), s.n, s.c, 1e-5, this->ctx_));
    ASSERT_OK(ResidualRMSNormForward<T>(fused_sum.get(), fused_out.get(), fused_rstd.get(), da.get(), db.get(),
                                        dw.get(), s.n, s.c, 1e-5, this->ctx_));
    ExpectBitwise(fused_sum.Download(), sum.Download(), "sum " + what);
    ExpectBitwise(fused_out.Download(), out.Download(), "out " + what);
    ExpectBitwise(fused_rstd.Download(), rstd.Download(), "rstd " + what);
    ASSERT_OK(ResidualRMSNormForward<T>(da.get(), fused_out.get(), fused_rstd.get(), da.get(), db.get(), dw.get(), s.n,
                                        s.c, 1e-5, this->ctx_));
    ExpectBitwise(da.Download(), sum.Download(), "sum in place " + what);
    ExpectBitwise(fused_out.Download(), out.Download(), "out, sum in place " + what);
  }
}

// dinp accumulates (+=) as the CPU op's; dw (fp32) within 1e-5 rel / 1e-5 abs, and the same bits on
// a second run (no atomics).
TYPED_TEST(LlamaCudaOps, RMSNormBackwardMatchesCpuAndIsDeterministic) {
  using T = TypeParam;
  for (Rows s : {Rows{1, 9}, Rows{130, 768}, Rows{33, 1027}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const auto x = RoundTrip<T>(Normal(s.n * s.c, 4, 0.3f, 2.0f));
    const auto dy = RoundTrip<T>(Normal(s.n * s.c, 5, 0.0f, 1.0f));
    const auto dx0 = RoundTrip<T>(Normal(s.n * s.c, 6, 0.0f, 0.5f));
    const auto w = Normal(s.c, 7, 1.0f, 0.2f), dw0 = Normal(s.c, 8, 0.0f, 0.1f);
    std::vector<float> y(s.n * s.c), rstd(s.n), dx = dx0, dwc = dw0;
    cpu::RMSNormForward(y.data(), rstd.data(), x.data(), w.data(), s.n, s.c, 1e-5);
    cpu::RMSNormBackward(dx.data(), dwc.data(), dy.data(), x.data(), w.data(), rstd.data(), s.n, s.c);
    DeviceArray<T> ddx(ToT<T>(dx0)), ddy(ToT<T>(dy)), dx_in(ToT<T>(x));
    DeviceArray<float> dw(w), ddw(dw0), drstd(rstd);
    DeviceArray<double> scratch(RMSNormBackwardScratch(s.n, s.c));
    ASSERT_OK(RMSNormBackward<T>(ddx.get(), ddw.get(), ddy.get(), dx_in.get(), dw.get(), drstd.get(), s.n, s.c,
                                 scratch.get(), this->ctx_));
    ExpectClose<T>(ToF(ddx.Download()), dx, 1e-5, 1e-5, "dinp " + what, true);
    const std::vector<float> first = ddw.Download();
    ExpectClose(first, dwc, 1e-5, 1e-5, "dw " + what);
    ddw.Upload(dw0);
    ASSERT_OK(RMSNormBackward<T>(ddx.get(), ddw.get(), ddy.get(), dx_in.get(), dw.get(), drstd.get(), s.n, s.c,
                                 scratch.get(), this->ctx_));
    ExpectBitwise(ddw.Download(), first, "dw on a second run " + what);
  }
}

// Forward and backward on a QKV of query groups (4 heads in 2 groups, 6 in 3 with a partial rotary),
// the tables cpu::RopeTables's, in both layouts and under each frequency setting (Llama 3.1's factor 8,
// Llama 3.2's 32, linear interpolation by 4); value heads untouched.
TYPED_TEST(LlamaCudaOps, RopeMatchesCpu) {
  using T = TypeParam;
  struct Case {
    AttentionShape s;
    int64_t rd;
  };
  const RopeSettings settings[] = {
      {500000.0, 8.0, 0, false}, {500000.0, 32.0, 0, true}, {10000.0, 0, 4.0, true}, {10000.0, 0, 4.0, false}};
  for (const RopeSettings& rs : settings)
    for (Case k : {Case{{2, 17, 4, 8, 2}, 8}, Case{{1, 33, 6, 12, 3}, 6}, Case{{3, 5, 4, 16, 0}, 16}}) {
      const AttentionShape& s = k.s;
      const std::string what = "t=" + std::to_string(s.t) + " groups=" + std::to_string(s.groups()) +
                               " factor=" + std::to_string(rs.llama3_factor) +
                               " interpolation=" + std::to_string(rs.interpolation) +
                               (rs.interleaved ? " interleaved" : "");
      const int64_t half = k.rd / 2, size = s.b * s.t * s.qkv_width();
      std::vector<float> cos(s.t * half), sin(s.t * half);
      cpu::RopeTables(cos.data(), sin.data(), s.t, k.rd, rs);
      const auto x = RoundTrip<T>(Normal(size, 9, 0.0f, 1.0f));
      DeviceArray<float> dcos(cos), dsin(sin);
      for (bool backward : {false, true}) {
        std::vector<float> want = x;
        if (backward)
          cpu::RopeBackward(want.data(), cos.data(), sin.data(), s, k.rd, rs.interleaved);
        else
          cpu::RopeForward(want.data(), cos.data(), sin.data(), s, k.rd, rs.interleaved);
        DeviceArray<T> dx(ToT<T>(x));
        if (backward)
          ASSERT_OK(RopeBackward<T>(dx.get(), dcos.get(), dsin.get(), s, k.rd, rs.interleaved, this->ctx_));
        else
          ASSERT_OK(RopeForward<T>(dx.get(), dcos.get(), dsin.get(), s, k.rd, rs.interleaved, this->ctx_));
        ExpectClose<T>(ToF(dx.Download()), want, 1e-5, 1e-6, (backward ? "backward " : "forward ") + what, true);
      }
    }
}

// --qk-layernorm's norms over the query and key heads (LayerNorm and RMSNorm; query groups, a head
// dimension not a multiple of 32, more tokens than one 64-token block): the normalised QKV, statistics,
// the input gradient (in place) and the weights' and biases' gradients as the CPU op's, and the
// parameters' gradients the same bits on a second run (no atomics).
TYPED_TEST(LlamaCudaOps, QKNormMatchesCpuAndIsDeterministic) {
  using T = TypeParam;
  for (const AttentionShape& s : {AttentionShape{2, 37, 4, 12, 2}, AttentionShape{1, 5, 6, 40, 0}}) {
    for (bool layernorm : {true, false}) {
      const std::string what = std::string(layernorm ? "LayerNorm" : "RMSNorm") + " t=" + std::to_string(s.t) +
                               " hd=" + std::to_string(s.hd) + " groups=" + std::to_string(s.groups());
      const int64_t size = s.b * s.t * s.qkv_width(), rows = s.b * s.t * (s.nh + s.groups());
      const auto x = RoundTrip<T>(Normal(size, 30, 0.2f, 1.5f)), dy = RoundTrip<T>(Normal(size, 31, 0.0f, 1.0f));
      const auto wq = Normal(s.hd, 32, 1.0f, 0.2f), bq = Normal(s.hd, 33, 0.0f, 0.2f),
                 wk = Normal(s.hd, 34, 1.0f, 0.2f), bk = Normal(s.hd, 35, 0.0f, 0.2f);
      const auto g0 = Normal(s.hd, 36, 0.0f, 0.1f);  // gradients accumulate
      std::vector<float> y(size), mean(rows), rstd(rows), dx = dy, dwq = g0, dbq = g0, dwk = g0, dbk = g0;
      float* m = layernorm ? mean.data() : nullptr;
      cpu::QKNormForward(y.data(), m, rstd.data(), x.data(), wq.data(), layernorm ? bq.data() : nullptr, wk.data(),
                         layernorm ? bk.data() : nullptr, s, 1e-5);
      cpu::QKNormBackward(dx.data(), dwq.data(), layernorm ? dbq.data() : nullptr, dwk.data(),
                          layernorm ? dbk.data() : nullptr, x.data(), wq.data(), wk.data(), m, rstd.data(), s);
      DeviceArray<T> draw(ToT<T>(x)), dout(size), dgrad(ToT<T>(dy));
      DeviceArray<float> dwq_in(wq), dbq_in(bq), dwk_in(wk), dbk_in(bk), dmean(rows), drstd(rows), gwq(g0), gbq(g0),
          gwk(g0), gbk(g0);
      DeviceArray<double> scratch(QKNormBackwardScratch(s));
      float* dm = layernorm ? dmean.get() : nullptr;
      ASSERT_OK(QKNormForward<T>(dout.get(), dm, drstd.get(), draw.get(), dwq_in.get(),
                                 layernorm ? dbq_in.get() : nullptr, dwk_in.get(), layernorm ? dbk_in.get() : nullptr,
                                 s, 1e-5, this->ctx_));
      ExpectClose<T>(ToF(dout.Download()), y, 1e-5, 1e-6, "out " + what, true);
      ExpectClose(drstd.Download(), rstd, 1e-6, 1e-7, "rstd " + what);
      if (layernorm) ExpectClose(dmean.Download(), mean, 1e-6, 1e-7, "mean " + what);
      // The backward from the CPU's statistics, so that only the op's own arithmetic differs.
      drstd.Upload(rstd);
      if (layernorm) dmean.Upload(mean);
      auto backward = [&] {
        return QKNormBackward<T>(dgrad.get(), gwq.get(), layernorm ? gbq.get() : nullptr, gwk.get(),
                                 layernorm ? gbk.get() : nullptr, draw.get(), dwq_in.get(), dwk_in.get(), dm,
                                 drstd.get(), s, scratch.get(), this->ctx_);
      };
      ASSERT_OK(backward());
      ExpectClose<T>(ToF(dgrad.Download()), dx, 1e-5, 1e-5, "dinp " + what, true);
      const std::vector<float> first = gwq.Download(), first_k = gwk.Download();
      ExpectClose(first, dwq, 1e-5, 1e-5, "dwq " + what);
      ExpectClose(first_k, dwk, 1e-5, 1e-5, "dwk " + what);
      if (layernorm) {
        ExpectClose(gbq.Download(), dbq, 1e-5, 1e-5, "dbq " + what);
        ExpectClose(gbk.Download(), dbk, 1e-5, 1e-5, "dbk " + what);
      }
      gwq.Upload(g0);
      gwk.Upload(g0);
      dgrad.Upload(ToT<T>(dy));
      ASSERT_OK(backward());
      ExpectBitwise(gwq.Download(), first, "dwq on a second run " + what);
      ExpectBitwise(gwk.Download(), first_k, "dwk on a second run " + what);
    }
  }
}

TYPED_TEST(LlamaCudaOps, SwigluMatchesCpu) {
  using T = TypeParam;
  for (Rows s : {Rows{1, 7}, Rows{65, 1000}, Rows{3, 1}}) {
    const std::string what = "n=" + std::to_string(s.n) + " f=" + std::to_string(s.c);
    const auto x = RoundTrip<T>(Normal(s.n * 2 * s.c, 10, 0.0f, 2.0f));
    const auto dy = RoundTrip<T>(Normal(s.n * s.c, 11, 0.0f, 1.0f));
    std::vector<float> out(s.n * s.c), dx(s.n * 2 * s.c);
    cpu::SwigluForward(out.data(), x.data(), s.n, s.c);
    cpu::SwigluBackward(dx.data(), x.data(), dy.data(), s.n, s.c);
    DeviceArray<T> dinp(ToT<T>(x)), dout(s.n * s.c), ddy(ToT<T>(dy)), ddx(s.n * 2 * s.c);
    ASSERT_OK(SwigluForward<T>(dout.get(), dinp.get(), s.n, s.c, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out " + what, true);
    ASSERT_OK(SwigluBackward<T>(ddx.get(), dinp.get(), ddy.get(), s.n, s.c, this->ctx_));
    ExpectClose<T>(ToF(ddx.Download()), dx, 1e-5, 1e-6, "dinp " + what, true);
  }
}

TEST_F(CudaOps, LlamaOpsRefuseBadArguments) {
  DeviceArray<float> buf(64);
  const AttentionShape s{1, 2, 2, 4, 1};
  EXPECT_FALSE(RMSNormForward<float>(buf.get(), nullptr, nullptr, buf.get(), 1, 4, 1e-5, ctx_).ok());
  EXPECT_FALSE(
      RMSNormBackward<float>(buf.get(), buf.get(), buf.get(), buf.get(), buf.get(), buf.get(), 1, 4, nullptr, ctx_)
          .ok());
  EXPECT_FALSE(RopeForward<float>(buf.get(), buf.get(), buf.get(), s, 3, false, ctx_).ok());  // odd rotated channels
  EXPECT_FALSE(RopeForward<float>(buf.get(), buf.get(), buf.get(), s, 8, true, ctx_).ok());   // more than hd
  EXPECT_FALSE(SwigluForward<float>(buf.get(), nullptr, 1, 4, ctx_).ok());
  EXPECT_FALSE(SwigluBackward<float>(buf.get(), buf.get(), buf.get(), -1, 4, ctx_).ok());
}

}  // namespace
}  // namespace ptk::cuda
