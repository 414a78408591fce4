// matmul_cuda.cu and attention_cuda.cu against their CPU ops (trainer/cpu/), forward and backward,
// on random inputs; gpu-labelled (exit 77 without a device).
//
// Tolerances (|gpu - reference| per element):
//   fp32 matmul      <= 1e-5 * mag, mag = the same product over absolute values (|inp| |w|^T + |bias|,
//                    and so on): a bound on any summation order's rounding, never loose by more than
//                    the cancellation in the data. GELU outputs 2e-5 * mag + 1e-6.
//   bf16/fp16 matmul outputs in T (out, gelu, dinp) <= rtol * |ref| + 1e-3 * mag with rtol 1e-2 (bf16,
//                    2.5 ulps) / 2e-3 (fp16, 2 ulps); dw and dbias (fp32 outputs) <= 1e-4 * mag.
//                    References in double on the inputs rounded to T.
//   GELU backward    through the product (gelu_pre): rtol * |ref| + atol * (|dout| @ |w|), atol 1e-5
//                    (fp32), 4e-3 (bf16), 2e-3 (fp16); BiasBackward: MatmulBackward's dbias bits.
//   fp32 attention   <= 1e-5 * (|ref| + max |ref| of the tensor), probabilities and dropout masks
//                    included (a mask that differs from the CPU's changes values by 10%).
//   flash attention  bf16: out <= 2e-2 * max|ref|, dqkv <= 5e-2 * max|ref| of its q/k/v part;
//                    fp16: 1e-2 and 2.5e-2; against the CPU op in double on the rounded inputs, p = 0.
//   determinism      two runs give the same bits (memcmp).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/attention_cuda_test_util.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/launch_math.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/op_math.h"

namespace ptk::cuda {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

using cuda_test::Abs;
using cuda_test::DeviceBuffer;
using cuda_test::Gpu;
using cuda_test::Random;
using cuda_test::ToDouble;
using cuda_test::ToT;

// ---- host data ---------------------------------------------------------------------------------

template <typename V>
double MaxAbs(const std::vector<V>& v) {
  double m = 0;
  for (const V& x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}
template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Every element within tol(i); reports the first few that are not.
template <typename G, typename R, typename Tol>
void ExpectClose(const std::vector<G>& got, const std::vector<R>& ref, const Tol& tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(ToFloat(got[i])), r = static_cast<double>(ref[i]);
    const double err = std::fabs(g - r), t = tol(i);
    if (!(err <= t)) {
      if (++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << r << " (tolerance " << t << ")";
    }
    if (t > 0 && err / t > worst) {
      worst = err / t;
      worst_i = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside tolerance";
  ::testing::Test::RecordProperty(what + "_worst_error_over_tolerance",
                                  std::to_string(worst) + " at " + std::to_string(worst_i));
}

// ---- matmul ------------------------------------------------------------------------------------

struct MatmulShape {
  int64_t n, ic, oc;
};
// t not a multiple of 8, n*ic off every tile, oc odd; and GPT-like aligned ones.
// (1100 rows: dbias summed in chunks of 512 rows through the workspace.)
const MatmulShape kMatmulShapes[] = {{37, 51, 29}, {130, 77, 255}, {64, 96, 160}, {256, 128, 512}, {1100, 64, 96}};

TEST(MatmulCuda, Fp32ForwardMatchesCpu) {
  Gpu gpu;
  for (const MatmulShape& s : kMatmulShapes) {
    for (int variant = 0; variant < 3; ++variant) {  // no bias, bias, bias + GELU
      SCOPED_TRACE("n=" + std::to_string(s.n) + " ic=" + std::to_string(s.ic) + " oc=" + std::to_string(s.oc) +
                   " variant=" + std::to_string(variant));
      const bool bias = variant >= 1, gelu = variant == 2;
      auto inp = Random(s.n * s.ic, 1), w = Random(s.oc * s.ic, 2), b = Random(s.oc, 3);
      std::vector<float> ref(s.n * s.oc), mag(s.n * s.oc), gref(s.n * s.oc);
      cpu::MatmulForward<float>(ref.data(), inp.data(), w.data(), bias ? b.data() : nullptr, s.n, s.ic, s.oc);
      auto ainp = Abs(inp), aw = Abs(w), ab = Abs(b);
      cpu::MatmulForward<float>(mag.data(), ainp.data(), aw.data(), bias ? ab.data() : nullptr, s.n, s.ic, s.oc);
      cpu::GeluForward<float>(gref.data(), ref.data(), s.n * s.oc);
      DeviceBuffer<float> dinp(inp), dw(w), db(b), dout(s.n * s.oc), dgelu(s.n * s.oc);
      STATUS_OK(MatmulForward<float>(dout.get(), dinp.get(), dw.get(), bias ? db.get() : nullptr, s.n, s.ic, s.oc,
                                     gpu.ctx, gelu ? dgelu.get() : nullptr));
      ExpectClose(
          dout.Download(), ref, [&](size_t i) { return 1e-5 * mag[i]; }, "out");
      if (gelu)
        ExpectClose(
            dgelu.Download(), gref, [&](size_t i) { return 2e-5 * mag[i] + 1e-6; }, "gelu");
    }
  }
}

TEST(MatmulCuda, Fp32BackwardMatchesCpu) {
  Gpu gpu;
  for (const MatmulShape& s : kMatmulShapes) {
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE("n=" + std::to_string(s.n) + " ic=" + std::to_string(s.ic) + " oc=" + std::to_string(s.oc) +
                   (accumulate ? " accumulate" : ""));
      auto inp = Random(s.n * s.ic, 11), w = Random(s.oc * s.ic, 12), dout = Random(s.n * s.oc, 13);
      auto dinp0 = Random(s.n * s.ic, 14), dw0 = Random(s.oc * s.ic, 15), db0 = Random(s.oc, 16);
      // CPU: dinp += (so from zero unless accumulating), dw +=, dbias +=
      std::vector<float> rdinp = accumulate ? dinp0 : std::vector<float>(dinp0.size(), 0.0f), rdw = dw0, rdb = db0;
      cpu::MatmulBackward<float>(rdinp.data(), rdw.data(), rdb.data(), dout.data(), inp.data(), w.data(), s.n, s.ic,
                                 s.oc);
      auto ainp = Abs(inp), aw = Abs(w), adout = Abs(dout);
      std::vector<float> mdinp = accumulate ? Abs(dinp0) : std::vector<float>(dinp0.size(), 0.0f), mdw = Abs(dw0),
                         mdb = Abs(db0);
      cpu::MatmulBackward<float>(mdinp.data(), mdw.data(), mdb.data(), adout.data(), ainp.data(), aw.data(), s.n, s.ic,
                                 s.oc);
      DeviceBuffer<float> d_inp(inp), d_w(w), d_dout(dout), d_dinp(dinp0), d_dw(dw0), d_db(db0);
      STATUS_OK(MatmulBackward<float>(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.n,
                                      s.ic, s.oc, gpu.ctx, accumulate));
      ExpectClose(
          d_dinp.Download(), rdinp, [&](size_t i) { return 1e-5 * mdinp[i]; }, "dinp");
      ExpectClose(
          d_dw.Download(), rdw, [&](size_t i) { return 1e-5 * mdw[i]; }, "dw");
      ExpectClose(
          d_db.Download(), rdb, [&](size_t i) { return 1e-5 * mdb[i]; }, "dbias");
    }
  }
}

template <typename T>
void LowPrecisionMatmul(double rtol) {
  Gpu gpu;
  for (const MatmulShape& s : kMatmulShapes) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " ic=" + std::to_string(s.ic) + " oc=" + std::to_string(s.oc));
    const auto inp = ToT<T>(Random(s.n * s.ic, 21)), w = ToT<T>(Random(s.oc * s.ic, 22)), b = ToT<T>(Random(s.oc, 23));
    const auto dout = ToT<T>(Random(s.n * s.oc, 24));
    const auto xi = ToDouble(inp), xw = ToDouble(w), xb = ToDouble(b), xd = ToDouble(dout);
    const auto ai = Abs(xi), aw = Abs(xw), ab = Abs(xb), ad = Abs(xd);
    // forward with bias and GELU (the fused epilogue where cuBLASLt has it)
    std::vector<double> ref(s.n * s.oc), mag(s.n * s.oc), gref(s.n * s.oc);
    cpu::MatmulForward<double>(ref.data(), xi.data(), xw.data(), xb.data(), s.n, s.ic, s.oc);
    cpu::MatmulForward<double>(mag.data(), ai.data(), aw.data(), ab.data(), s.n, s.ic, s.oc);
    cpu::GeluForward<double>(gref.data(), ref.data(), s.n * s.oc);
    DeviceBuffer<T> d_inp(inp), d_w(w), d_b(b), d_out(s.n * s.oc), d_gelu(s.n * s.oc), d_dout(dout), d_dinp(s.n * s.ic);
    STATUS_OK(MatmulForward<T>(d_out.get(), d_inp.get(), d_w.get(), d_b.get(), s.n, s.ic, s.oc, gpu.ctx, d_gelu.get()));
    ExpectClose(
        d_out.Download(), ref, [&](size_t i) { return rtol * std::fabs(ref[i]) + 1e-3 * mag[i]; }, "out");
    ExpectClose(
        d_gelu.Download(), gref, [&](size_t i) { return rtol * std::fabs(gref[i]) + 2e-3 * mag[i]; }, "gelu");
    // backward: dinp assigned, dw and dbias accumulated in fp32
    const auto dw0 = Random(s.oc * s.ic, 25), db0 = Random(s.oc, 26);
    std::vector<double> rdinp(s.n * s.ic, 0.0), rdw(dw0.begin(), dw0.end()), rdb(db0.begin(), db0.end());
    cpu::MatmulBackward<double>(rdinp.data(), rdw.data(), rdb.data(), xd.data(), xi.data(), xw.data(), s.n, s.ic, s.oc);
    std::vector<double> mdinp(s.n * s.ic, 0.0), mdw = Abs(std::vector<double>(dw0.begin(), dw0.end())),
                                                mdb = Abs(std::vector<double>(db0.begin(), db0.end()));
    cpu::MatmulBackward<double>(mdinp.data(), mdw.data(), mdb.data(), ad.data(), ai.data(), aw.data(), s.n, s.ic, s.oc);
    DeviceBuffer<float> d_dw(dw0), d_db(db0);
    STATUS_OK(MatmulBackward<T>(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic,
                                s.oc, gpu.ctx));
    ExpectClose(
        d_dinp.Download(), rdinp, [&](size_t i) { return rtol * std::fabs(rdinp[i]) + 1e-3 * mdinp[i]; }, "dinp");
    ExpectClose(
        d_dw.Download(), rdw, [&](size_t i) { return 1e-4 * mdw[i]; }, "dw");
    ExpectClose(
        d_db.Download(), rdb, [&](size_t i) { return 1e-4 * mdb[i]; }, "dbias");
  }
}
TEST(MatmulCuda, Bf16MatchesCpu) { LowPrecisionMatmul<__nv_bfloat16>(1e-2); }
TEST(MatmulCuda, Fp16MatchesCpu) { LowPrecisionMatmul<__half>(2e-3); }

// The GELU's backward through the product that follows it (gelu_pre, the (n, ic) pre-activation):
// dinp = (dout @ w) * gelu'(gelu_pre). fp32, and bf16/fp16 with ic not a multiple of 8: the product,
// then GeluBackward; bf16/fp16 with ic a multiple of 8: cuBLASLt's DGELU epilogue. Against double on
// the rounded inputs within rtol * |ref| + atol * (|dout| @ |w|) (atol: the roundings of the product,
// and a GELU derivative that need not be bit for bit the CPU's formula); dw and dbias the bits of the
// same call without gelu_pre. gelu_pre with an accumulated or absent dinp is refused.
template <typename T>
void GeluBackwardThroughTheProduct(double rtol, double atol) {
  Gpu gpu;
  for (const MatmulShape& s : {MatmulShape{37, 51, 29}, MatmulShape{64, 96, 160}, MatmulShape{130, 128, 77}}) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " ic=" + std::to_string(s.ic) + " oc=" + std::to_string(s.oc));
    const auto inp = ToT<T>(Random(s.n * s.ic, 101)), w = ToT<T>(Random(s.oc * s.ic, 102));
    const auto pre = ToT<T>(Random(s.n * s.ic, 103, -3.0f, 3.0f)), dout = ToT<T>(Random(s.n * s.oc, 104));
    const auto xw = ToDouble(w), xd = ToDouble(dout), xpre = ToDouble(pre);
    std::vector<double> ref(s.n * s.ic, 0.0), mag(s.n * s.ic, 0.0);
    for (int64_t i = 0; i < s.n; ++i)
      for (int64_t k = 0; k < s.oc; ++k)
        for (int64_t j = 0; j < s.ic; ++j) {
          ref[i * s.ic + j] += xd[i * s.oc + k] * xw[k * s.ic + j];
          mag[i * s.ic + j] += std::fabs(xd[i * s.oc + k] * xw[k * s.ic + j]);
        }
    for (size_t i = 0; i < ref.size(); ++i) ref[i] *= GeluDerivative<double>(xpre[i]);
    const auto dw0 = Random(s.oc * s.ic, 105), db0 = Random(s.oc, 106);
    DeviceBuffer<T> d_inp(inp), d_w(w), d_pre(pre), d_dout(dout), d_dinp(s.n * s.ic), d_plain(s.n * s.ic);
    DeviceBuffer<float> d_dw(dw0), d_db(db0), p_dw(dw0), p_db(db0);
    STATUS_OK(MatmulBackward<T>(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic,
                                s.oc, gpu.ctx, false, d_pre.get()));
    ExpectClose(
        d_dinp.Download(), ref, [&](size_t i) { return rtol * std::fabs(ref[i]) + atol * mag[i]; }, "dinp");
    STATUS_OK(MatmulBackward<T>(d_plain.get(), p_dw.get(), p_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic,
                                s.oc, gpu.ctx));
    EXPECT_TRUE(SameBits(d_dw.Download(), p_dw.Download())) << "dw";
    EXPECT_TRUE(SameBits(d_db.Download(), p_db.Download())) << "dbias";
    EXPECT_EQ(MatmulBackward<T>(d_dinp.get(), d_dw.get(), nullptr, d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic,
                                s.oc, gpu.ctx, true, d_pre.get())
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(MatmulBackward<T>(nullptr, d_dw.get(), nullptr, d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic, s.oc,
                                gpu.ctx, false, d_pre.get())
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}
TEST(MatmulCuda, Fp32GeluBackwardThroughTheProduct) { GeluBackwardThroughTheProduct<float>(1e-5, 1e-5); }
TEST(MatmulCuda, Bf16GeluBackwardThroughTheProduct) { GeluBackwardThroughTheProduct<__nv_bfloat16>(1e-2, 4e-3); }
TEST(MatmulCuda, Fp16GeluBackwardThroughTheProduct) { GeluBackwardThroughTheProduct<__half>(2e-3, 2e-3); }

// BiasBackward is MatmulBackward's bias gradient alone: the same bits (the same column sums in the
// same order), in one chunk of rows and in chunks of 512 through the workspace.
template <typename T>
void BiasBackwardIsTheProductsBiasGradient() {
  Gpu gpu;
  for (const MatmulShape& s : {MatmulShape{37, 16, 29}, MatmulShape{1100, 8, 96}}) {
    SCOPED_TRACE("n=" + std::to_string(s.n) + " oc=" + std::to_string(s.oc));
    const auto inp = ToT<T>(Random(s.n * s.ic, 111)), w = ToT<T>(Random(s.oc * s.ic, 112));
    const auto dout = ToT<T>(Random(s.n * s.oc, 113));
    const auto dw0 = Random(s.oc * s.ic, 114), db0 = Random(s.oc, 115);
    DeviceBuffer<T> d_inp(inp), d_w(w), d_dout(dout);
    DeviceBuffer<float> d_dw(dw0), d_db(db0), b_db(db0);
    STATUS_OK(MatmulBackward<T>(nullptr, d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.n, s.ic, s.oc,
                                gpu.ctx));
    STATUS_OK(BiasBackward<T>(b_db.get(), d_dout.get(), s.n, s.oc, gpu.ctx));
    const auto got = b_db.Download();
    EXPECT_TRUE(SameBits(got, d_db.Download()));
    std::vector<double> ref(db0.begin(), db0.end()), mag = Abs(ref);
    const auto xd = ToDouble(dout);
    for (int64_t i = 0; i < s.n; ++i)
      for (int64_t j = 0; j < s.oc; ++j) {
        ref[j] += xd[i * s.oc + j];
        mag[j] += std::fabs(xd[i * s.oc + j]);
      }
    ExpectClose(
        got, ref, [&](size_t j) { return 1e-6 * mag[j]; }, "dbias");
  }
  EXPECT_EQ(BiasBackward<T>(nullptr, nullptr, 4, 4, gpu.ctx).code(), absl::StatusCode::kInvalidArgument);
}
TEST(MatmulCuda, BiasBackwardIsTheProductsBiasGradient) {
  BiasBackwardIsTheProductsBiasGradient<float>();
  BiasBackwardIsTheProductsBiasGradient<__nv_bfloat16>();
  BiasBackwardIsTheProductsBiasGradient<__half>();
}

TEST(MatmulCuda, BackwardIsDeterministic) {
  for (bool deterministic : {false, true}) {
    Gpu gpu(deterministic);
    const int64_t n = 1000, ic = 192, oc = 384;
    const auto inp = ToT<__nv_bfloat16>(Random(n * ic, 31)), w = ToT<__nv_bfloat16>(Random(oc * ic, 32));
    const auto dout = ToT<__nv_bfloat16>(Random(n * oc, 33));
    const auto dw0 = Random(oc * ic, 34), db0 = Random(oc, 35);
    std::vector<float> first_dw, first_db;
    std::vector<__nv_bfloat16> first_dinp;
    for (int run = 0; run < 2; ++run) {
      DeviceBuffer<__nv_bfloat16> d_inp(inp), d_w(w), d_dout(dout), d_dinp(n * ic);
      DeviceBuffer<float> d_dw(dw0), d_db(db0);
      STATUS_OK(MatmulBackward<__nv_bfloat16>(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(),
                                              d_w.get(), n, ic, oc, gpu.ctx));
      if (run == 0) {
        first_dw = d_dw.Download();
        first_db = d_db.Download();
        first_dinp = d_dinp.Download();
      } else {
        EXPECT_TRUE(SameBits(first_dw, d_dw.Download())) << "dw, deterministic=" << deterministic;
        EXPECT_TRUE(SameBits(first_db, d_db.Download())) << "dbias, deterministic=" << deterministic;
        EXPECT_TRUE(SameBits(first_dinp, d_dinp.Download())) << "dinp, deterministic=" << deterministic;
      }
    }
  }
}

TEST(MatmulCuda, BadSizesAreErrors) {
  Gpu gpu;
  DeviceBuffer<float> a(64), b(64), c(64);
  absl::Status st = MatmulForward<float>(c.get(), a.get(), b.get(), nullptr, 4, 0, 4, gpu.ctx);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const absl::Status st1 =
      MatmulBackward<float>(nullptr, nullptr, nullptr, a.get(), b.get(), c.get(), 4, 4, 4, gpu.ctx);
  EXPECT_EQ(st1.code(), absl::StatusCode::kInvalidArgument) << st1;
  EXPECT_TRUE(MatmulForward<float>(c.get(), a.get(), b.get(), nullptr, 0, 4, 4, gpu.ctx).ok());  // no rows
}

// ---- fp32 attention ------------------------------------------------------------------------------

const AttentionShape kAttentionShapes[] = {{2, 37, 3, 16}, {1, 64, 2, 32}, {3, 9, 4, 8}};

std::string Name(const AttentionShape& s, double p) {
  return "b=" + std::to_string(s.b) + " t=" + std::to_string(s.t) + " nh=" + std::to_string(s.nh) +
         " hd=" + std::to_string(s.hd) + " p=" + std::to_string(p);
}

template <typename V>
auto RelToMax(const std::vector<V>& ref, double rtol) {
  const double m = MaxAbs(ref);
  return [&ref, m, rtol](size_t i) { return rtol * (std::fabs(static_cast<double>(ref[i])) + m); };
}

TEST(AttentionCuda, Fp32MatchesCpuWithAndWithoutDropout) {
  Gpu gpu;
  for (const AttentionShape& s : kAttentionShapes) {
    for (double p : {0.0, 0.1, 0.5}) {
      SCOPED_TRACE(Name(s, p));
      const int64_t c = s.nh * s.hd, n = s.b * s.t;
      const auto qkv = Random(n * 3 * c, 41, -2.0f, 2.0f), dout = Random(n * c, 42);
      std::vector<uint64_t> streams(s.b);
      for (int64_t b = 0; b < s.b; ++b) streams[b] = DropoutStream(static_cast<uint64_t>(b + 7), 3, kAttentionProbs);
      const uint64_t seed = 1234;
      std::vector<float> out(n * c), probs(s.b * s.nh * s.t * s.t), dqkv(n * 3 * c);
      cpu::AttentionForward<float>(out.data(), probs.data(), qkv.data(), s, p, seed, streams.data());
      cpu::AttentionBackward<float>(dqkv.data(), dout.data(), qkv.data(), probs.data(), s, p, seed, streams.data());
      DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(out.size()), d_probs(probs.size()), d_dqkv(dqkv.size()),
          d_scratch(AttentionBackwardScratch(s));
      DeviceBuffer<uint64_t> d_streams(streams);
      STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), s, p, seed, d_streams.get(), gpu.ctx));
      STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), s, p, seed, d_streams.get(),
                                  d_scratch.get(), gpu.ctx));
      ExpectClose(d_probs.Download(), probs, RelToMax(probs, 1e-5), "probs");
      ExpectClose(d_out.Download(), out, RelToMax(out, 1e-5), "out");
      ExpectClose(d_dqkv.Download(), dqkv, RelToMax(dqkv, 1e-5), "dqkv");
    }
  }
}

TEST(AttentionCuda, Fp32DropoutKeepsProbsBeforeDropoutAndIsDeterministic) {
  Gpu gpu;
  const AttentionShape s{2, 45, 2, 16};
  const int64_t c = s.nh * s.hd, n = s.b * s.t;
  const auto qkv = Random(n * 3 * c, 51), dout = Random(n * c, 52);
  const std::vector<uint64_t> streams{99, 1u << 20};
  DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(n * c), d_probs(s.b * s.nh * s.t * s.t), d_dqkv(n * 3 * c),
      d_scratch(AttentionBackwardScratch(s));
  DeviceBuffer<uint64_t> d_streams(streams);
  STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), s, 0.0, 7, nullptr, gpu.ctx));
  const auto probs_no_dropout = d_probs.Download();
  std::vector<float> out1, dqkv1;
  for (int run = 0; run < 2; ++run) {
    STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), s, 0.2, 7, d_streams.get(), gpu.ctx));
    EXPECT_TRUE(SameBits(probs_no_dropout, d_probs.Download())) << "probs after a dropout forward, run " << run;
    STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), s, 0.2, 7, d_streams.get(),
                                d_scratch.get(), gpu.ctx));
    if (run == 0) {
      out1 = d_out.Download();
      dqkv1 = d_dqkv.Download();
    } else {
      EXPECT_TRUE(SameBits(out1, d_out.Download()));
      EXPECT_TRUE(SameBits(dqkv1, d_dqkv.Download()));
    }
  }
}

// Grouped-query attention (Megatron's per-group QKV: a group's query heads, then its key and value
// heads): the CPU op's algorithm, a group's key and value gradients summed over its heads in order.
TEST(AttentionCuda, Fp32GroupedQueryMatchesCpu) {
  Gpu gpu;
  const AttentionShape shapes[] = {{2, 37, 4, 16, 2}, {1, 40, 6, 32, 3}, {3, 9, 4, 8, 1}};
  for (const AttentionShape& s : shapes) {
    for (double p : {0.0, 0.1}) {
      SCOPED_TRACE(Name(s, p) + " groups=" + std::to_string(s.groups()));
      const int64_t c = s.nh * s.hd, w = s.qkv_width(), n = s.b * s.t;
      const auto qkv = Random(n * w, 43, -2.0f, 2.0f), dout = Random(n * c, 44);
      std::vector<uint64_t> streams(s.b);
      for (int64_t b = 0; b < s.b; ++b) streams[b] = DropoutStream(static_cast<uint64_t>(b + 3), 1, kAttentionProbs);
      std::vector<float> out(n * c), probs(s.b * s.nh * s.t * s.t), dqkv(n * w);
      cpu::AttentionForward<float>(out.data(), probs.data(), qkv.data(), s, p, 77, streams.data());
      cpu::AttentionBackward<float>(dqkv.data(), dout.data(), qkv.data(), probs.data(), s, p, 77, streams.data());
      DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(out.size()), d_probs(probs.size()), d_dqkv(dqkv.size()),
          d_scratch(AttentionBackwardScratch(s));
      DeviceBuffer<uint64_t> d_streams(streams);
      STATUS_OK(AttentionForward(d_out.get(), d_probs.get(), d_qkv.get(), s, p, 77, d_streams.get(), gpu.ctx));
      STATUS_OK(AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_probs.get(), s, p, 77, d_streams.get(),
                                  d_scratch.get(), gpu.ctx));
      ExpectClose(d_probs.Download(), probs, RelToMax(probs, 1e-5), "probs");
      ExpectClose(d_out.Download(), out, RelToMax(out, 1e-5), "out");
      ExpectClose(d_dqkv.Download(), dqkv, RelToMax(dqkv, 1e-5), "dqkv");
    }
  }
}

TEST(AttentionCuda, Fp32ErrorsAreStatuses) {
  Gpu gpu;
  const AttentionShape s{1, 8, 1, 8};
  DeviceBuffer<float> a(1024), b(1024), c(1024);
  absl::Status st = AttentionForward(a.get(), b.get(), c.get(), s, 0.1, 1, nullptr, gpu.ctx);  // dropout, no streams
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const absl::Status st2 =
      AttentionForward(a.get(), b.get(), c.get(), AttentionShape{1, 0, 1, 8}, 0.0, 1, nullptr, gpu.ctx);
  EXPECT_EQ(st2.code(), absl::StatusCode::kInvalidArgument) << st2;
}

// ---- flash attention (cuDNN) ----------------------------------------------------------------------

template <typename T>
void FlashMatchesCpu(double fwd_tol, double bwd_tol) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape shapes[] = {{2, 64, 4, 64}, {1, 37, 2, 32}, {2, 130, 3, 128}};
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(Name(s, 0.0));
    const int64_t c = s.nh * s.hd, n = s.b * s.t;
    const auto qkv = ToT<T>(Random(n * 3 * c, 61, -2.0f, 2.0f)), dout = ToT<T>(Random(n * c, 62));
    const auto xqkv = ToDouble(qkv), xdout = ToDouble(dout);
    std::vector<double> out(n * c), probs(s.b * s.nh * s.t * s.t), dqkv(n * 3 * c);
    cpu::AttentionForward<double>(out.data(), probs.data(), xqkv.data(), s, 0.0, 0, nullptr);
    cpu::AttentionBackward<double>(dqkv.data(), xdout.data(), xqkv.data(), probs.data(), s, 0.0, 0, nullptr);
    auto ws = FlashAttentionWorkspaceBytes<T>(s, 0.0, gpu.ctx);
    ASSERT_TRUE(ws.ok()) << ws.status();
    EXPECT_LE(*ws, static_cast<int64_t>(gpu.ctx.workspace_bytes));
    DeviceBuffer<T> d_qkv(qkv), d_dout(dout), d_out(n * c), d_dqkv(n * 3 * c);
    DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
    STATUS_OK(FlashAttentionForward<T>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0, gpu.ctx));
    STATUS_OK(FlashAttentionBackward<T>(d_dqkv.get(), d_dout.get(), d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0,
                                        0, gpu.ctx));
    const double mo = MaxAbs(out);
    ExpectClose(
        d_out.Download(), out, [&](size_t) { return fwd_tol * mo; }, "out");
    // dq, dk, dv each against its own largest magnitude
    double m[3] = {0, 0, 0};
    for (size_t i = 0; i < dqkv.size(); ++i) {
      const size_t part = (i / static_cast<size_t>(s.hd)) % 3;
      m[part] = std::max(m[part], std::fabs(dqkv[i]));
    }
    ExpectClose(
        d_dqkv.Download(), dqkv, [&](size_t i) { return bwd_tol * m[(i / static_cast<size_t>(s.hd)) % 3]; }, "dqkv");
  }
}
TEST(FlashAttentionCuda, Bf16MatchesCpuWithoutDropout) { FlashMatchesCpu<__nv_bfloat16>(2e-2, 5e-2); }

// Grouped-query attention through cuDNN: Megatron's per-group QKV copied heads first
// (QkvGroupsToHeads), the fused attention over fewer key/value heads, the gradient copied back
// (QkvHeadsToGroups), against the CPU op in double; the copies round-trip exactly.
TEST(FlashAttentionCuda, Bf16GroupedQueryMatchesCpu) {
  using T = __nv_bfloat16;
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape shapes[] = {{2, 64, 4, 64, 2}, {1, 37, 6, 32, 3}, {2, 48, 4, 32, 1}};
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(Name(s, 0.0) + " groups=" + std::to_string(s.groups()));
    const int64_t c = s.nh * s.hd, w = s.qkv_width(), n = s.b * s.t;
    const auto qkv = ToT<T>(Random(n * w, 63, -2.0f, 2.0f)), dout = ToT<T>(Random(n * c, 64));
    const auto xqkv = ToDouble(qkv), xdout = ToDouble(dout);
    std::vector<double> out(n * c), probs(s.b * s.nh * s.t * s.t), dqkv(n * w);
    cpu::AttentionForward<double>(out.data(), probs.data(), xqkv.data(), s, 0.0, 0, nullptr);
    cpu::AttentionBackward<double>(dqkv.data(), xdout.data(), xqkv.data(), probs.data(), s, 0.0, 0, nullptr);
    auto ws = FlashAttentionWorkspaceBytes<T>(s, 0.0, gpu.ctx);
    ASSERT_TRUE(ws.ok()) << ws.status();
    DeviceBuffer<T> d_qkv(qkv), d_heads(n * w), d_back(n * w), d_dout(dout), d_out(n * c), d_dheads(n * w),
        d_dqkv(n * w);
    DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
    STATUS_OK(QkvGroupsToHeads<T>(d_heads.get(), d_qkv.get(), s, gpu.ctx));
    STATUS_OK(QkvHeadsToGroups<T>(d_back.get(), d_heads.get(), s, gpu.ctx));
    EXPECT_TRUE(SameBits(ToDouble(d_back.Download()), xqkv)) << "the copies round-trip";
    // Heads first: query head h, key and value of group g at their places.
    const auto heads = ToDouble(d_heads.Download());
    const int64_t pg = s.nh / s.groups();
    for (int64_t row = 0; row < n; row += std::max<int64_t>(1, n / 5))
      for (int64_t g = 0; g < s.groups(); ++g)
        for (int64_t d = 0; d < s.hd; ++d) {
          const double* src = xqkv.data() + row * w + g * (pg + 2) * s.hd + d;
          EXPECT_EQ(heads[row * w + (g * pg) * s.hd + d], src[0]);
          EXPECT_EQ(heads[row * w + (s.nh + g) * s.hd + d], src[pg * s.hd]);
          EXPECT_EQ(heads[row * w + (s.nh + s.groups() + g) * s.hd + d], src[(pg + 1) * s.hd]);
        }
    STATUS_OK(FlashAttentionForward<T>(d_out.get(), d_stats.get(), d_heads.get(), s, 0.0, 0, 0, gpu.ctx));
    STATUS_OK(FlashAttentionBackward<T>(d_dheads.get(), d_dout.get(), d_out.get(), d_stats.get(), d_heads.get(), s, 0.0,
                                        0, 0, gpu.ctx));
    STATUS_OK(QkvHeadsToGroups<T>(d_dqkv.get(), d_dheads.get(), s, gpu.ctx));
    const double mo = MaxAbs(out), md = MaxAbs(dqkv);
    ExpectClose(
        d_out.Download(), out, [&](size_t) { return 2e-2 * mo; }, "out");
    ExpectClose(
        d_dqkv.Download(), dqkv, [&](size_t) { return 5e-2 * md; }, "dqkv");
  }
}
TEST(FlashAttentionCuda, Fp16MatchesCpuWithoutDropout) { FlashMatchesCpu<__half>(1e-2, 2.5e-2); }

// The stats cuDNN keeps are the rows' log-sum-exp of the scaled scores (natural log): checked
// against the CPU's scores in double, to 1e-2 absolute.
TEST(FlashAttentionCuda, StatsAreLogSumExp) {
  Gpu gpu;
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape s{1, 40, 2, 64};
  const int64_t c = s.nh * s.hd, c3 = 3 * c, n = s.b * s.t;
  const auto qkv = ToT<__nv_bfloat16>(Random(n * c3, 71));
  const auto x = ToDouble(qkv);
  DeviceBuffer<__nv_bfloat16> d_qkv(qkv), d_out(n * c);
  DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
  STATUS_OK(FlashAttentionForward<__nv_bfloat16>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0, gpu.ctx));
  const auto stats = d_stats.Download();
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  for (int64_t h = 0; h < s.nh; ++h)
    for (int64_t i = 0; i < s.t; ++i) {
      std::vector<double> sc;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < s.hd; ++d) dot += x[i * c3 + h * 3 * s.hd + d] * x[j * c3 + h * 3 * s.hd + s.hd + d];
        sc.push_back(dot * scale);
      }
      const double mx = *std::max_element(sc.begin(), sc.end());
      double sum = 0;
      for (double v : sc) sum += std::exp(v - mx);
      EXPECT_NEAR(stats[h * s.t + i], mx + std::log(sum), 1e-2) << "head " << h << " row " << i;
    }
}

TEST(FlashAttentionCuda, DropoutRunsAndRepeatsForTheSameSeed) {
  Gpu gpu(/*deterministic=*/true);
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape s{2, 96, 2, 64};
  const int64_t c = s.nh * s.hd, n = s.b * s.t;
  const auto qkv = ToT<__nv_bfloat16>(Random(n * 3 * c, 81)), dout = ToT<__nv_bfloat16>(Random(n * c, 82));
  DeviceBuffer<__nv_bfloat16> d_qkv(qkv), d_dout(dout), d_out(n * c), d_dqkv(n * 3 * c);
  DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
  std::vector<__nv_bfloat16> out[3], dqkv[2];
  const uint64_t seeds[3] = {5, 5, 6};
  for (int run = 0; run < 3; ++run) {
    STATUS_OK(
        FlashAttentionForward<__nv_bfloat16>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.1, seeds[run], 0, gpu.ctx));
    out[run] = d_out.Download();
    if (run < 2) {
      STATUS_OK(FlashAttentionBackward<__nv_bfloat16>(d_dqkv.get(), d_dout.get(), d_out.get(), d_stats.get(),
                                                      d_qkv.get(), s, 0.1, seeds[run], 0, gpu.ctx));
      dqkv[run] = d_dqkv.Download();
    }
  }
  for (const auto& v : out[0]) ASSERT_TRUE(std::isfinite(ToFloat(v)));
  for (const auto& v : dqkv[0]) ASSERT_TRUE(std::isfinite(ToFloat(v)));
  EXPECT_TRUE(SameBits(out[0], out[1])) << "same seed, same output";
  EXPECT_TRUE(SameBits(dqkv[0], dqkv[1])) << "deterministic backward, same seed: same gradient";
  EXPECT_FALSE(SameBits(out[0], out[2])) << "another seed, another mask";
}

TEST(FlashAttentionCuda, DeterministicBackwardRepeats) {
  Gpu gpu(/*deterministic=*/true);
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape s{4, 256, 4, 64};
  const int64_t c = s.nh * s.hd, n = s.b * s.t;
  const auto qkv = ToT<__nv_bfloat16>(Random(n * 3 * c, 91)), dout = ToT<__nv_bfloat16>(Random(n * c, 92));
  DeviceBuffer<__nv_bfloat16> d_qkv(qkv), d_dout(dout), d_out(n * c), d_dqkv(n * 3 * c);
  DeviceBuffer<float> d_stats(s.b * s.nh * s.t);
  STATUS_OK(FlashAttentionForward<__nv_bfloat16>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0, gpu.ctx));
  std::vector<__nv_bfloat16> first;
  for (int run = 0; run < 3; ++run) {
    STATUS_OK(FlashAttentionBackward<__nv_bfloat16>(d_dqkv.get(), d_dout.get(), d_out.get(), d_stats.get(), d_qkv.get(),
                                                    s, 0.0, 0, 0, gpu.ctx));
    if (run == 0)
      first = d_dqkv.Download();
    else
      EXPECT_TRUE(SameBits(first, d_dqkv.Download())) << "run " << run;
  }
}

// Grouped-query attention as the bf16 CUDA model calls it in training with attention dropout: heads
// first, deterministic backward, one sample per call at its offsets, each sample's statistics at
// sample * FlashStatsStride floats (one query group of two heads over 37 positions: 74 floats a
// sample, 76 with the padding that keeps every sample's statistics 16-byte aligned). Without dropout
// the per-sample calls give the whole-batch call's values (within bf16 rounding); with it, the
// backward repeats bit for bit.
TEST(FlashAttentionCuda, Bf16GroupedQueryPerSampleAsTheModelCallsIt) {
  using T = __nv_bfloat16;
  Gpu gpu(/*deterministic=*/true);
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const AttentionShape s{3, 37, 2, 32, 1}, one{1, 37, 2, 32, 1};
  const int64_t c = s.nh * s.hd, w = s.qkv_width(), n = s.b * s.t, ps = FlashStatsStride(s.nh, s.t);
  ASSERT_EQ(ps, 76);
  const auto qkv = ToT<T>(Random(n * w, 95, -2.0f, 2.0f)), dout = ToT<T>(Random(n * c, 96));
  DeviceBuffer<T> d_qkv(qkv), d_dout(dout), d_out(n * c), d_dqkv(n * w), s_out(n * c), s_dqkv(n * w);
  DeviceBuffer<float> d_stats(s.b * s.nh * s.t), s_stats(s.b * ps);
  STATUS_OK(FlashAttentionForward<T>(d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0, gpu.ctx));
  STATUS_OK(FlashAttentionBackward<T>(d_dqkv.get(), d_dout.get(), d_out.get(), d_stats.get(), d_qkv.get(), s, 0.0, 0, 0,
                                      gpu.ctx));
  auto per_sample = [&](double p, uint64_t seed) -> absl::Status {
    for (int64_t r = 0; r < s.b; ++r) {
      const int64_t row = r * s.t;
      const absl::Status fwd =
          FlashAttentionForward<T>(s_out.get() + row * c, s_stats.get() + r * ps, d_qkv.get() + row * w, one, p,
                                   seed + static_cast<uint64_t>(r), 0, gpu.ctx);
      if (!fwd.ok()) return fwd;
      const absl::Status bwd = FlashAttentionBackward<T>(
          s_dqkv.get() + row * w, d_dout.get() + row * c, s_out.get() + row * c, s_stats.get() + r * ps,
          d_qkv.get() + row * w, one, p, seed + static_cast<uint64_t>(r), 0, gpu.ctx);
      if (!bwd.ok()) return bwd;
    }
    return absl::OkStatus();
  };
  STATUS_OK(per_sample(0.0, 0));
  const auto whole_out = ToDouble(d_out.Download()), whole_dqkv = ToDouble(d_dqkv.Download());
  const double mo = MaxAbs(whole_out), md = MaxAbs(whole_dqkv);
  ExpectClose(
      s_out.Download(), whole_out, [&](size_t) { return 1e-2 * mo; }, "out, per sample");
  ExpectClose(
      s_dqkv.Download(), whole_dqkv, [&](size_t) { return 2e-2 * md; }, "dqkv, per sample");
  STATUS_OK(per_sample(0.1, 41));
  const auto first = s_dqkv.Download();
  for (const auto& v : first) ASSERT_TRUE(std::isfinite(ToFloat(v)));
  STATUS_OK(per_sample(0.1, 41));
  EXPECT_TRUE(SameBits(first, s_dqkv.Download())) << "deterministic backward, same seeds: same gradient";
}

TEST(FlashAttentionCuda, RefusedShapesAndMissingHandleAreStatuses) {
  Gpu gpu;
  const AttentionShape odd{1, 16, 1, 12};  // a head dimension cuDNN refuses (not a multiple of 8)
  DeviceBuffer<__nv_bfloat16> qkv(16 * 3 * 12), out(16 * 12);
  DeviceBuffer<float> stats(16);
  absl::Status st = FlashAttentionForward<__nv_bfloat16>(out.get(), stats.get(), qkv.get(), odd, 0.0, 0, 0, gpu.ctx);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;  // no handle yet
  if (gpu.ctx.sm_major < 8) GTEST_SKIP() << "cuDNN's fused attention needs sm_80 or newer";
  STATUS_OK(CreateCudnnHandle(&gpu.ctx));
  const absl::Status st3 =
      FlashAttentionForward<__nv_bfloat16>(out.get(), stats.get(), qkv.get(), odd, 0.0, 0, 0, gpu.ctx);
  EXPECT_FALSE(st3.ok());
  EXPECT_NE(std::string(st3.message()).find("hd=12"), std::string::npos) << st3;
  // The shape is what cuDNN refuses, at any workspace: the message does not blame the context's limit.
  EXPECT_EQ(std::string(st3.message()).find("workspace limit"), std::string::npos) << st3;
  const AttentionShape wide{1, 16, 1, 512};  // beyond cuDNN's largest head dimension
  DeviceBuffer<__nv_bfloat16> qkv2(16 * 3 * 512), out2(16 * 512);
  const absl::Status st4 =
      FlashAttentionForward<__nv_bfloat16>(out2.get(), stats.get(), qkv2.get(), wide, 0.0, 0, 0, gpu.ctx);
  EXPECT_FALSE(st4.ok()) << "hd=512";
  const absl::Status st5 =
      FlashAttentionForward<__nv_bfloat16>(out.get(), stats.get(), qkv.get(), odd, 1.0, 0, 0, gpu.ctx);
  EXPECT_EQ(st5.code(), absl::StatusCode::kInvalidArgument) << st5;
  // the context still works after the refusals
  const AttentionShape ok{1, 16, 1, 64};
  DeviceBuffer<__nv_bfloat16> qkv3(ToT<__nv_bfloat16>(Random(16 * 3 * 64, 5))), out3(16 * 64);
  STATUS_OK(FlashAttentionForward<__nv_bfloat16>(out3.get(), stats.get(), qkv3.get(), ok, 0.0, 0, 0, gpu.ctx));
  EXPECT_EQ(cudaStreamSynchronize(gpu.ctx.stream), cudaSuccess);
}

}  // namespace
}  // namespace ptk::cuda
