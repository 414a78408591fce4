// Hidden dropout fused into the LayerNorm kernels (part of ops_cuda_test; gpu-labelled: exits 77
// without a device), each against what it replaces: DropoutRows over the samples' rows and the
// plain kernel. The same masks at the same coordinates (TokenDropoutAt) and the same roundings (the
// dropped value, the gradient as stored; every multiply-add spelled out in functions all the kernels
// call, so nvcc's --fmad cannot contract one kernel's differently: cuda_fmad_test checks that without
// a GPU), so every output is compared bitwise in fp32, bf16 and fp16: the residual sum, the
// LayerNorm output, mean and rstd forward; dinp, the branch gradient, dw and db backward, with a
// warp per row and with the rows in series.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/counter_rng.h"
#include "trainer/cuda/layernorm_oracle.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using namespace ops_test;  // NOLINT

template <typename T>
class FusedDropoutOps : public CudaOps {};
TYPED_TEST_SUITE(FusedDropoutOps, ActivationTypes, TypeNames);
class FusedDropoutArgs : public CudaOps {};

// samples x seq_len token rows of c channels.
struct Tokens {
  int64_t samples, seq_len, c;
  int64_t n() const { return samples * seq_len; }
  std::string Name(double p) const {
    return "samples=" + std::to_string(samples) + " seq_len=" + std::to_string(seq_len) + " c=" + std::to_string(c) +
           " p=" + std::to_string(p);
  }
};
// Awkward shapes: c not a multiple of the vector width, one token, many rows (several backward blocks);
// c = 6144, whose backward partials (2c floats, 48 KiB) with the rows-in-series kernel's own block sums
// pass 48 KiB of shared memory (the opt-in: NeedsSharedMemoryOptIn).
const Tokens kShapes[] = {{1, 1, 9}, {2, 35, 768}, {3, 5, 1027}, {4, 250, 64}, {1, 3, 6144}};

std::vector<uint64_t> SampleStreams(int64_t samples, uint64_t site) {
  std::vector<uint64_t> s(static_cast<size_t>(samples));
  for (int64_t r = 0; r < samples; ++r)
    s[static_cast<size_t>(r)] = DropoutStream(static_cast<uint64_t>(70 + r), 2, site);
  return s;
}

// resid_out = a + dropout(b), out = LayerNorm(resid_out): DropoutRows over b's samples, then the
// residual kernel without dropout; b is left as it was. Also in place (resid_out == a).
TYPED_TEST(FusedDropoutOps, ResidualLayerNormWithDropoutIsThePassThenTheKernel) {
  using T = TypeParam;
  for (const Tokens& s : kShapes) {
    for (double p : {0.1, 0.5}) {
      const std::string what = s.Name(p);
      const int64_t n = s.n(), nc = n * s.c;
      const auto a = ToT<T>(Normal(nc, 20)), b = ToT<T>(Normal(nc, 21, 0.1f, 0.5f));
      const auto w = Normal(s.c, 22, 1.0f, 0.2f), bias = Normal(s.c, 23, 0.0f, 0.2f);
      DeviceArray<uint64_t> streams(SampleStreams(s.samples, kAttentionOutDropout));
      const uint64_t seed = 99;
      // The unfused oracle.
      DeviceArray<T> oa(a), ob(b), oresid(nc), oout(nc);
      DeviceArray<float> dw(w), dbias(bias), omean(n), orstd(n);
      ASSERT_OK(DropoutRows<T>(ob.get(), s.samples, s.seq_len * s.c, streams.get(), p, seed, this->ctx_));
      ASSERT_OK(ResidualLayerNormForward<T>(oresid.get(), oout.get(), omean.get(), orstd.get(), oa.get(), ob.get(),
                                            dw.get(), dbias.get(), n, s.c, 1e-5, this->ctx_));
      const LnDropout drop{streams.get(), s.seq_len, p, seed};
      for (bool in_place : {false, true}) {
        const std::string w2 = what + (in_place ? " in place" : "");
        DeviceArray<T> fa(a), fb(b), fresid(nc), fout(nc);
        DeviceArray<float> fmean(n), frstd(n);
        T* resid_out = in_place ? fa.get() : fresid.get();
        ASSERT_OK(ResidualLayerNormForward<T>(resid_out, fout.get(), fmean.get(), frstd.get(), fa.get(), fb.get(),
                                              dw.get(), dbias.get(), n, s.c, 1e-5, this->ctx_, drop));
        ExpectBitwise((in_place ? fa : fresid).Download(), oresid.Download(), "resid_out " + w2);
        ExpectBitwise(fout.Download(), oout.Download(), "out " + w2);
        ExpectBitwise(fmean.Download(), omean.Download(), "mean " + w2);
        ExpectBitwise(frstd.Download(), orstd.Download(), "rstd " + w2);
        ExpectBitwise(fb.Download(), b, "b unchanged " + w2);
      }
    }
  }
}

// The embedding's dropout and the first LayerNorm: DropoutRows in place, then LayerNormForward.
TYPED_TEST(FusedDropoutOps, DropoutLayerNormIsThePassThenTheKernel) {
  using T = TypeParam;
  for (const Tokens& s : kShapes) {
    for (double p : {0.0, 0.1}) {
      const std::string what = s.Name(p);
      const int64_t n = s.n(), nc = n * s.c;
      const auto x = ToT<T>(Normal(nc, 30));
      const auto w = Normal(s.c, 31, 1.0f, 0.2f), bias = Normal(s.c, 32, 0.0f, 0.2f);
      DeviceArray<uint64_t> streams(SampleStreams(s.samples, kEmbeddingDropout));
      DeviceArray<float> dw(w), dbias(bias), omean(n), orstd(n), fmean(n), frstd(n);
      DeviceArray<T> ox(x), oout(nc), fx(x), fout(nc);
      ASSERT_OK(DropoutRows<T>(ox.get(), s.samples, s.seq_len * s.c, streams.get(), p, 5, this->ctx_));
      ASSERT_OK(LayerNormForward<T>(oout.get(), omean.get(), orstd.get(), ox.get(), dw.get(), dbias.get(), n, s.c, 1e-5,
                                    this->ctx_));
      ASSERT_OK(DropoutLayerNormForward<T>(fx.get(), fout.get(), fmean.get(), frstd.get(), dw.get(), dbias.get(), n,
                                           s.c, 1e-5, LnDropout{streams.get(), s.seq_len, p, 5}, this->ctx_));
      ExpectBitwise(fx.Download(), ox.Download(), "inout " + what);
      ExpectBitwise(fout.Download(), oout.Download(), "out " + what);
      ExpectBitwise(fmean.Download(), omean.Download(), "mean " + what);
      ExpectBitwise(frstd.Download(), orstd.Download(), "rstd " + what);
    }
  }
}

// Backward: dinp += the LayerNorm's gradient and dbranch = dropout(dinp) in one kernel, against
// the plain kernel, a copy of dinp and DropoutRows over it; dbranch == dinp against DropoutRows in
// place. dw and db are the plain kernel's (the mask touches neither).
TYPED_TEST(FusedDropoutOps, LayerNormBackwardWritesTheMaskedBranchGradient) {
  using T = TypeParam;
  for (const Tokens& s : kShapes) {
    for (bool series : {false, true}) {
      const double p = 0.1;
      const std::string what = s.Name(p) + (series ? " rows in series" : " warp per row");
      const int64_t n = s.n(), nc = n * s.c;
      const auto x = RoundTrip<T>(Normal(nc, 40, 0.2f, 1.5f));
      const auto dy = ToT<T>(Normal(nc, 41)), dinp0 = ToT<T>(Normal(nc, 42, 0.0f, 0.5f));
      const auto w = Normal(s.c, 43, 1.0f, 0.3f), b = Normal(s.c, 44), dw0 = Normal(s.c, 45), db0 = Normal(s.c, 46);
      DeviceArray<uint64_t> streams(SampleStreams(s.samples, kMlpOutDropout));
      DeviceArray<float> dw_(w), db_(b), mean(n), rstd(n);
      DeviceArray<T> dx(ToT<T>(x)), ddy(dy), lnout(nc);
      ASSERT_OK(LayerNormForward<T>(lnout.get(), mean.get(), rstd.get(), dx.get(), dw_.get(), db_.get(), n, s.c, 1e-5,
                                    this->ctx_));
      auto backward = [&](T* dinp, float* gw, float* gb, T* dbranch, const LnDropout& drop) {
        DeviceArray<float> scratch(LayerNormBackwardScratch(n, s.c));
        auto fn = series ? LayerNormBackwardRowsInSeries<T> : LayerNormBackward<T>;
        return fn(dinp, gw, gb, ddy.get(), dx.get(), dw_.get(), mean.get(), rstd.get(), n, s.c, scratch.get(),
                  this->ctx_, dbranch, drop);
      };
      const LnDropout drop{streams.get(), s.seq_len, p, 17};
      // The oracle: the plain backward, then a copy through the dropout pass.
      DeviceArray<T> odinp(dinp0);
      DeviceArray<float> odw(dw0), odb(db0);
      ASSERT_OK(backward(odinp.get(), odw.get(), odb.get(), nullptr, LnDropout{}));
      const auto want_dinp = odinp.Download();
      DeviceArray<T> obranch(want_dinp);
      ASSERT_OK(DropoutRows<T>(obranch.get(), s.samples, s.seq_len * s.c, streams.get(), p, 17, this->ctx_));
      const auto want_branch = obranch.Download();
      for (bool in_place : {false, true}) {
        const std::string w2 = what + (in_place ? " in place" : "");
        DeviceArray<T> fdinp(dinp0), fbranch(nc);
        DeviceArray<float> fdw(dw0), fdb(db0);
        ASSERT_OK(backward(fdinp.get(), fdw.get(), fdb.get(), in_place ? fdinp.get() : fbranch.get(), drop));
        if (in_place) {
          ExpectBitwise(fdinp.Download(), want_branch, "dinp = dbranch " + w2);
        } else {
          ExpectBitwise(fdinp.Download(), want_dinp, "dinp " + w2);
          ExpectBitwise(fbranch.Download(), want_branch, "dbranch " + w2);
        }
        ExpectBitwise(fdw.Download(), odw.Download(), "dw " + w2);
        ExpectBitwise(fdb.Download(), odb.Download(), "db " + w2);
      }
    }
  }
}

// Bad dropout settings are InvalidArgument before anything runs.
TEST_F(FusedDropoutArgs, BadDropoutSettingsAreRefused) {
  const int64_t n = 6, c = 8;
  DeviceArray<float> x(Normal(n * c, 50)), y(n * c), g(n * c), w(Normal(c, 51)), b(c), mean(n), rstd(n);
  DeviceArray<float> scratch(LayerNormBackwardScratch(n, c)), gw(c), gb(c);
  DeviceArray<uint64_t> streams(SampleStreams(2, kMlpOutDropout));
  auto fwd = [&](const LnDropout& d) {
    return ResidualLayerNormForward<float>(y.get(), g.get(), mean.get(), rstd.get(), x.get(), x.get(), w.get(), b.get(),
                                           n, c, 1e-5, ctx_, d);
  };
  auto bwd = [&](float* dbranch, const LnDropout& d) {
    return LayerNormBackward<float>(g.get(), gw.get(), gb.get(), x.get(), x.get(), w.get(), mean.get(), rstd.get(), n,
                                    c, scratch.get(), ctx_, dbranch, d);
  };
  ASSERT_OK(fwd(LnDropout{streams.get(), 3, 0.1, 1}));
  EXPECT_EQ(fwd(LnDropout{streams.get(), 3, 1.5, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fwd(LnDropout{streams.get(), 3, -0.1, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fwd(LnDropout{nullptr, 3, 0.1, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fwd(LnDropout{streams.get(), 4, 0.1, 1}).code(), absl::StatusCode::kInvalidArgument);  // 4 does not tile 6
  EXPECT_EQ(DropoutLayerNormForward<float>(x.get(), y.get(), mean.get(), rstd.get(), w.get(), b.get(), n, c, 1e-5,
                                           LnDropout{streams.get(), 0, 0.1, 1}, ctx_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(bwd(y.get(), LnDropout{streams.get(), 3, 0.1, 1}));
  EXPECT_EQ(bwd(nullptr, LnDropout{streams.get(), 3, 0.1, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bwd(y.get(), LnDropout{}).code(), absl::StatusCode::kInvalidArgument);  // a branch without dropout
}

}  // namespace
}  // namespace ptk::cuda
