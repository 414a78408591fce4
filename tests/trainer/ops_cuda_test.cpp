// The hand-written CUDA ops, each against its CPU op (trainer/cpu/), for fp32, bf16 and fp16 on
// random inputs of awkward sizes (channels not a multiple of 4 or 8, one row, a 50304-column
// vocabulary, pointers off the 16-byte boundary), and their determinism. gpu-labelled: skipped
// (exit 77) without a device.
//
// Tolerances. fp32: |gpu - cpu| <= rel * |cpu| + abs with rel = 1e-5 and abs as stated per op
// (1e-6 where the value is O(1)); bitwise where the GPU does the very same fp32 operations in the
// same order: embedding forward and backward, dropout, AdamW (adamw_cuda.cu is built with
// --fmad=false; sqrt and division are IEEE without fast math), Scale, the casts and the residual
// add. bf16 / fp16: the CPU op runs in fp32 on the inputs rounded to T, and the GPU's output, rounded
// to T once, must be within one unit in the last place of T of it (2^-7 relative for bf16, 2^-10
// for fp16) on top of the fp32 tolerance; what stays fp32 (LayerNorm statistics, weight
// gradients, losses) keeps the fp32 tolerance. The LayerNorm kernels with hidden dropout fused in
// are checked against the dropout pass and the plain kernels in ops_cuda_fused_test.cpp (the same
// binary).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/counter_rng.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/cuda/adamw_table.h"
#include "trainer/cuda/ops_cuda.h"

namespace ptk::cuda {
namespace {

using namespace ops_test;  // NOLINT

template <typename T>
class TypedCudaOps : public CudaOps {};

TYPED_TEST_SUITE(TypedCudaOps, ActivationTypes, TypeNames);

struct Shape {
  int64_t n, c;
};

// ---- LayerNorm -----------------------------------------------------------------------------------

// fp32: out within 1e-5 rel / 1e-6 abs (expected within an ulp: the same double statistics and
// the same rounding of the product and the sum), mean and rstd within 1e-6 rel.
TYPED_TEST(TypedCudaOps, LayerNormForwardMatchesCpu) {
  using T = TypeParam;
  for (Shape s : {Shape{1, 9}, Shape{70, 768}, Shape{33, 1027}, Shape{5, 1536}, Shape{3, 1}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const auto x = RoundTrip<T>(Normal(s.n * s.c, 1, 0.3f, 2.0f));
    const auto w = Normal(s.c, 2, 1.0f, 0.2f), b = Normal(s.c, 3, 0.0f, 0.2f);
    std::vector<float> out(s.n * s.c), mean(s.n), rstd(s.n);
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.n, s.c, 1e-5);

    DeviceArray<T> dx(ToT<T>(x)), dout(s.n * s.c);
    DeviceArray<float> dw(w), db(b), dmean(s.n), drstd(s.n);
    ASSERT_OK(LayerNormForward<T>(dout.get(), dmean.get(), drstd.get(), dx.get(), dw.get(), db.get(), s.n, s.c, 1e-5,
                                  this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out " + what, true);
    ExpectClose(dmean.Download(), mean, 1e-6, 1e-7, "mean " + what);
    ExpectClose(drstd.Download(), rstd, 1e-6, 1e-7, "rstd " + what);
    // Evaluation: no statistics kept.
    ASSERT_OK(
        LayerNormForward<T>(dout.get(), nullptr, nullptr, dx.get(), dw.get(), db.get(), s.n, s.c, 1e-5, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out without statistics " + what, true);
  }
}

// resid_out = round(a + b) bitwise; out as LayerNormForward of it. Also with resid_out == a.
TYPED_TEST(TypedCudaOps, ResidualLayerNormForwardMatchesCpu) {
  using T = TypeParam;
  for (Shape s : {Shape{1, 9}, Shape{70, 768}, Shape{17, 1027}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const auto a = ToT<T>(Normal(s.n * s.c, 4)), b = ToT<T>(Normal(s.n * s.c, 5, 0.1f, 0.5f));
    const auto w = Normal(s.c, 6, 1.0f, 0.2f), bias = Normal(s.c, 7, 0.0f, 0.2f);
    std::vector<T> resid(s.n * s.c);
    for (size_t i = 0; i < resid.size(); ++i) resid[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
    const auto rf = ToF(resid);
    std::vector<float> out(s.n * s.c), mean(s.n), rstd(s.n);
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), rf.data(), w.data(), bias.data(), s.n, s.c, 1e-5);

    for (bool in_place : {false, true}) {
      DeviceArray<T> da(a), dbb(b), dresid(s.n * s.c), dout(s.n * s.c);
      DeviceArray<float> dw(w), dbias(bias), dmean(s.n), drstd(s.n);
      T* resid_out = in_place ? da.get() : dresid.get();
      ASSERT_OK(ResidualLayerNormForward<T>(resid_out, dout.get(), dmean.get(), drstd.get(), da.get(), dbb.get(),
                                            dw.get(), dbias.get(), s.n, s.c, 1e-5, this->ctx_));
      const std::string w2 = what + (in_place ? " in place" : "");
      ExpectBitwise((in_place ? da : dresid).Download(), resid, "resid_out " + w2);
      ExpectClose<T>(ToF(dout.Download()), out, 1e-5, 1e-6, "out " + w2, true);
      ExpectClose(dmean.Download(), mean, 1e-6, 1e-7, "mean " + w2);
      ExpectClose(drstd.Download(), rstd, 1e-6, 1e-7, "rstd " + w2);
    }
  }
}

// dinp (+= onto a non-zero start) within 1e-5 rel / 1e-5 abs (its terms are O(1) and cancel);
// dw, db (+=) within 1e-5 rel + 2e-6 * sum over rows of |term| (fp32 partials of at most 32 rows,
// each add within 2^-24 of its sum, then summed in double);
// two runs give the same bits.
TYPED_TEST(TypedCudaOps, LayerNormBackwardMatchesCpuAndIsDeterministic) {
  using T = TypeParam;
  for (Shape s : {Shape{1, 9}, Shape{70, 9}, Shape{1000, 768}, Shape{9000, 33}, Shape{40, 1027}, Shape{3, 6144}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    const int64_t nc = s.n * s.c;
    const auto x = RoundTrip<T>(Normal(nc, 10, 0.2f, 1.5f)), dy = RoundTrip<T>(Normal(nc, 11));
    const auto w = Normal(s.c, 12, 1.0f, 0.3f), b = Normal(s.c, 13);
    const auto dinp0 = RoundTrip<T>(Normal(nc, 14, 0.0f, 0.5f));
    const auto dw0 = Normal(s.c, 15), db0 = Normal(s.c, 16);
    std::vector<float> out(nc), mean(s.n), rstd(s.n);
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.n, s.c, 1e-5);
    std::vector<float> dinp = dinp0, dw = dw0, db = db0;
    cpu::LayerNormBackward(dinp.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                           s.n, s.c);
    // The size of what dw and db sum, per channel.
    std::vector<float> sw(s.c, 0.0f), sb(s.c, 0.0f);
    for (int64_t i = 0; i < s.n; ++i) {
      for (int64_t j = 0; j < s.c; ++j) {
        const double xhat = (static_cast<double>(x[i * s.c + j]) - mean[i]) * rstd[i];
        sw[j] += static_cast<float>(std::fabs(dy[i * s.c + j] * xhat));
        sb[j] += std::fabs(dy[i * s.c + j]);
      }
    }

    std::vector<T> got_dinp[2];
    std::vector<float> got_dw[2], got_db[2];
    for (int run = 0; run < 2; ++run) {
      DeviceArray<T> ddinp(ToT<T>(dinp0)), ddy(ToT<T>(dy)), dx(ToT<T>(x));
      DeviceArray<float> ddw(dw0), ddb(db0), dw_(w), dmean(mean), drstd(rstd);
      DeviceArray<float> scratch(LayerNormBackwardScratch(s.n, s.c));
      ASSERT_OK(LayerNormBackward<T>(ddinp.get(), ddw.get(), ddb.get(), ddy.get(), dx.get(), dw_.get(), dmean.get(),
                                     drstd.get(), s.n, s.c, scratch.get(), this->ctx_));
      got_dinp[run] = ddinp.Download();
      got_dw[run] = ddw.Download();
      got_db[run] = ddb.Download();
    }
    ExpectClose<T>(ToF(got_dinp[0]), dinp, 1e-5, 1e-5, "dinp " + what, true);
    for (int64_t j = 0; j < s.c; ++j) {
      EXPECT_NEAR(got_dw[0][j], dw[j], 1e-5 * std::fabs(dw[j]) + 2e-6 * sw[j] + 1e-7) << "dw[" << j << "] " << what;
      EXPECT_NEAR(got_db[0][j], db[j], 1e-5 * std::fabs(db[j]) + 2e-6 * sb[j] + 1e-7) << "db[" << j << "] " << what;
    }
    ExpectBitwise(got_dinp[1], got_dinp[0], "dinp, two runs " + what);
    ExpectBitwise(got_dw[1], got_dw[0], "dw, two runs " + what);
    ExpectBitwise(got_db[1], got_db[0], "db, two runs " + what);
  }
}

// ---- embedding -----------------------------------------------------------------------------------

// Forward bitwise (one fp32 add, rounded once); backward bitwise against the CPU op (the same fp32
// additions in the same order), with repeated tokens and reset position ids, and run to run.
TYPED_TEST(TypedCudaOps, EmbeddingMatchesCpuBitwiseAndIsDeterministic) {
  using T = TypeParam;
  const int64_t vocab = 50, positions_rows = 40;
  for (Shape s : {Shape{1, 9}, Shape{300, 1}, Shape{300, 9}, Shape{257, 768}}) {
    const std::string what = "n=" + std::to_string(s.n) + " c=" + std::to_string(s.c);
    std::mt19937 gen(static_cast<uint32_t>(s.n * 31 + s.c));
    std::vector<int32_t> tokens(s.n), positions(s.n);
    for (int64_t i = 0; i < s.n; ++i) {
      // A third of the rows share token 7; the rest are spread with repeats.
      tokens[i] = i % 3 == 0 ? 7 : static_cast<int32_t>(gen() % vocab);
      // Position ids reset every 37 rows (reset-position-ids at document ends), some arbitrary.
      positions[i] = i % 11 == 5 ? static_cast<int32_t>(gen() % positions_rows) : static_cast<int32_t>(i % 37);
    }
    const auto wte = RoundTrip<T>(Normal(vocab * s.c, 20)), wpe = RoundTrip<T>(Normal(positions_rows * s.c, 21));
    std::vector<float> out(s.n * s.c);
    cpu::EmbeddingForward(out.data(), tokens.data(), positions.data(), wte.data(), wpe.data(), s.n, s.c);

    DeviceArray<int32_t> dtok(tokens), dpos(positions);
    DeviceArray<T> dwte(ToT<T>(wte)), dwpe(ToT<T>(wpe)), dout(s.n * s.c);
    ASSERT_OK(EmbeddingForward<T>(dout.get(), dtok.get(), dpos.get(), dwte.get(), dwpe.get(), s.n, s.c, this->ctx_));
    ExpectBitwise(dout.Download(), ToT<T>(out), "forward " + what);

    const auto dy = RoundTrip<T>(Normal(s.n * s.c, 22));
    const auto gte0 = Normal(vocab * s.c, 23), gpe0 = Normal(positions_rows * s.c, 24);
    std::vector<float> gte = gte0, gpe = gpe0;
    cpu::EmbeddingBackward(gte.data(), gpe.data(), dy.data(), tokens.data(), positions.data(), s.n, s.c);
    EmbeddingBackwardPlan plan;
    ASSERT_OK(plan.Reserve(s.n + 5));
    std::vector<float> runs[2][2];
    for (int run = 0; run < 2; ++run) {
      DeviceArray<float> dgte(gte0), dgpe(gpe0);
      DeviceArray<T> ddy(ToT<T>(dy));
      ASSERT_OK(EmbeddingBackward<T>(dgte.get(), dgpe.get(), ddy.get(), dtok.get(), dpos.get(), tokens.data(),
                                     positions.data(), s.n, s.c, vocab, positions_rows, &plan, this->ctx_));
      runs[run][0] = dgte.Download();
      runs[run][1] = dgpe.Download();
    }
    ExpectBitwise(runs[0][0], gte, "dwte " + what);
    ExpectBitwise(runs[0][1], gpe, "dwpe " + what);
    ExpectBitwise(runs[1][0], runs[0][0], "dwte, two runs " + what);
    ExpectBitwise(runs[1][1], runs[0][1], "dwpe, two runs " + what);
  }
}

TEST_F(CudaOps, EmbeddingBackwardRefusesBadIdsAndASmallPlan) {
  const int64_t n = 4, c = 3;
  std::vector<int32_t> tokens = {1, 2, 50, 0}, positions = {0, 1, 2, 3};
  DeviceArray<int32_t> dtok(tokens), dpos(positions);
  DeviceArray<float> dgte(std::vector<float>(50 * c, 1.0f)), dgpe(std::vector<float>(4 * c, 1.0f)),
      dy(std::vector<float>(n * c, 2.0f));
  EmbeddingBackwardPlan plan;
  ASSERT_OK(plan.Reserve(n));
  const absl::Status st = EmbeddingBackward<float>(dgte.get(), dgpe.get(), dy.get(), dtok.get(), dpos.get(),
                                                   tokens.data(), positions.data(), n, c, 50, 4, &plan, ctx_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("token id 50 at row 2"), std::string::npos) << st;
  EXPECT_EQ(dgte.Download(), std::vector<float>(50 * c, 1.0f));  // nothing launched
  tokens[2] = 3;
  positions[3] = -1;
  const absl::Status st2 = EmbeddingBackward<float>(dgte.get(), dgpe.get(), dy.get(), dtok.get(), dpos.get(),
                                                    tokens.data(), positions.data(), n, c, 50, 4, &plan, ctx_);
  EXPECT_NE(st2.message().find("position id -1 at row 3"), std::string::npos) << st2;
  positions[3] = 3;
  EmbeddingBackwardPlan small;
  ASSERT_OK(small.Reserve(n - 1));
  const absl::Status st3 = EmbeddingBackward<float>(dgte.get(), dgpe.get(), dy.get(), dtok.get(), dpos.get(),
                                                    tokens.data(), positions.data(), n, c, 50, 4, &small, ctx_);
  EXPECT_EQ(st3.code(), absl::StatusCode::kInvalidArgument) << st3;
  EXPECT_OK(EmbeddingBackward<float>(dgte.get(), dgpe.get(), dy.get(), dtok.get(), dpos.get(), tokens.data(),
                                     positions.data(), n, c, 50, 4, &plan, ctx_));
}

// A gate on a stream: a host function that holds the stream until the test opens the gate. A call that
// waited on the host for the held stream would wait for ever; the gate gives up after 60 s (`expired`) so
// that such a call fails the test instead of hanging it (no figure of time is checked).
struct StreamGate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, expired = false;
  static void CUDART_CB Hold(void* p) {
    auto* g = static_cast<StreamGate*>(p);
    std::unique_lock<std::mutex> lock(g->mu);
    if (!g->cv.wait_for(lock, std::chrono::seconds(60), [g] { return g->open; })) g->expired = true;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
};

// Regression: each call waited on the host for the previous call's upload before it rewrote the plan's one
// staging buffer, so the next micro-batch's call stalled the host until the stream caught up. Two staging
// buffers in turn: with the stream held, two calls return at once, and once it runs, both gradients are
// the CPU op's, bit for bit (the second call's staging did not overwrite the first's queued upload).
TEST_F(CudaOps, EmbeddingBackwardDoesNotWaitForThePreviousCallsUpload) {
  const int64_t n = 64, c = 16, vocab = 50, position_rows = 64;
  std::vector<int32_t> first(n), second(n), positions(n);
  for (int64_t i = 0; i < n; ++i) {
    first[i] = static_cast<int32_t>(i * 7 % vocab);
    second[i] = static_cast<int32_t>((i * 3 + 1) % vocab);
    positions[i] = static_cast<int32_t>(i % position_rows);
  }
  const auto dy1 = Normal(n * c, 30), dy2 = Normal(n * c, 31);
  const auto gte0 = Normal(vocab * c, 32), gpe0 = Normal(position_rows * c, 33);
  std::vector<float> gte = gte0, gpe = gpe0;
  cpu::EmbeddingBackward(gte.data(), gpe.data(), dy1.data(), first.data(), positions.data(), n, c);
  cpu::EmbeddingBackward(gte.data(), gpe.data(), dy2.data(), second.data(), positions.data(), n, c);
  DeviceArray<int32_t> dfirst(first), dsecond(second), dpos(positions);
  DeviceArray<float> dgte(gte0), dgpe(gpe0), ddy1(dy1), ddy2(dy2);
  EmbeddingBackwardPlan plan;
  ASSERT_OK(plan.Reserve(n));
  StreamGate gate;
  ASSERT_EQ(cudaLaunchHostFunc(ctx_.stream, StreamGate::Hold, &gate), cudaSuccess);
  const absl::Status one =
      EmbeddingBackward<float>(dgte.get(), dgpe.get(), ddy1.get(), dfirst.get(), dpos.get(), first.data(),
                               positions.data(), n, c, vocab, position_rows, &plan, ctx_);
  const absl::Status two =
      EmbeddingBackward<float>(dgte.get(), dgpe.get(), ddy2.get(), dsecond.get(), dpos.get(), second.data(),
                               positions.data(), n, c, vocab, position_rows, &plan, ctx_);
  const bool held = cudaStreamQuery(ctx_.stream) == cudaErrorNotReady;
  gate.Open();
  ASSERT_EQ(cudaStreamSynchronize(ctx_.stream), cudaSuccess);
  EXPECT_OK(one);
  EXPECT_OK(two);
  EXPECT_TRUE(held) << "the stream ran before the gate opened";
  EXPECT_FALSE(gate.expired) << "a call waited on the host for the held stream";
  ExpectBitwise(dgte.Download(), gte, "dwte after two calls");
  ExpectBitwise(dgpe.Download(), gpe, "dwpe after two calls");
}

// ---- GELU ----------------------------------------------------------------------------------------

// fp32: forward within 1e-5 rel / 1e-6 abs (the device's tanhf against glibc's), backward within
// 1e-5 rel / 1e-5 * |dout| abs (1 - tanh^2 cancels for |x| > 4). Sizes below, at and past a pack,
// pointers one element off the 16-byte boundary (scalar head), backward in place.
TYPED_TEST(TypedCudaOps, GeluMatchesCpu) {
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      const auto x = RoundTrip<T>(Normal(n, 30, 0.0f, 3.0f)), dy = RoundTrip<T>(Normal(n, 31));
      std::vector<float> y(n), dx(n);
      cpu::GeluForward(y.data(), x.data(), n);
      cpu::GeluBackward(dx.data(), x.data(), dy.data(), n);
      DeviceArray<T> dxin(n + offset), dyout(n + offset), dd(n + offset);
      dxin.Upload(ToT<T>(x), offset);
      dd.Upload(ToT<T>(dy), offset);
      ASSERT_OK(GeluForward<T>(dyout.get() + offset, dxin.get() + offset, n, this->ctx_));
      ExpectClose<T>(ToF(dyout.Download(n, offset)), y, 1e-5, 1e-6, "forward " + what, true);
      ASSERT_OK(GeluBackward<T>(dd.get() + offset, dxin.get() + offset, dd.get() + offset, n, this->ctx_));
      const auto got = ToF(dd.Download(n, offset));
      std::vector<float> want_err(n);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double tol = (1e-5 + Prec<T>::ulp) * std::fabs(dx[i]) + 1e-5 * std::fabs(dy[i]) + Prec<T>::floor;
        bad += !(std::fabs(got[i] - dx[i]) <= tol);
      }
      EXPECT_EQ(bad, 0) << "backward (in place) " << what;
    }
  }
}

// ---- exact GELU (Megatron's GELU MLP without the fused bias-GELU kernel) ----------------------------

// fp32: the device's erff/expf against glibc's, forward within 1e-5 rel / 1e-6 abs, backward within
// 1e-5 rel / 1e-5 * |dout| abs (Phi(x) and x phi(x) cancel for x < -3); bf16/fp16 within their rounding.
// Sizes below, at and past a pack, pointers one element off the 16-byte boundary, backward in place.
TYPED_TEST(TypedCudaOps, GeluExactMatchesCpu) {
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      const auto x = RoundTrip<T>(Normal(n, 32, 0.0f, 3.0f)), dy = RoundTrip<T>(Normal(n, 33));
      std::vector<float> y(n), dx(n);
      cpu::GeluExactForward(y.data(), x.data(), n);
      cpu::GeluExactBackward(dx.data(), x.data(), dy.data(), n);
      DeviceArray<T> dxin(n + offset), dyout(n + offset), dd(n + offset);
      dxin.Upload(ToT<T>(x), offset);
      dd.Upload(ToT<T>(dy), offset);
      ASSERT_OK(GeluExactForward<T>(dyout.get() + offset, dxin.get() + offset, n, this->ctx_));
      ExpectClose<T>(ToF(dyout.Download(n, offset)), y, 1e-5, 1e-6, "forward " + what, true);
      ASSERT_OK(GeluExactBackward<T>(dd.get() + offset, dxin.get() + offset, dd.get() + offset, n, this->ctx_));
      const auto got = ToF(dd.Download(n, offset));
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double tol = (1e-5 + Prec<T>::ulp) * std::fabs(dx[i]) + 1e-5 * std::fabs(dy[i]) + Prec<T>::floor;
        bad += !(std::fabs(got[i] - dx[i]) <= tol);
      }
      EXPECT_EQ(bad, 0) << "backward (in place) " << what;
    }
  }
  // Not the tanh GELU's kernel: at x = 1 the two differ by 1.6e-4, above fp32's tolerance.
  DeviceArray<float> one(1), out(1);
  one.Upload(std::vector<float>{1.0f}, 0);
  ASSERT_OK(GeluExactForward<float>(out.get(), one.get(), 1, this->ctx_));
  EXPECT_NEAR(out.Download(1, 0)[0], 0.8413447f, 2e-6f);
}

// ---- squared ReLU (--squared-relu) ----------------------------------------------------------------

// The CPU op's formula (no transcendental): fp32 forward and backward within 1e-6 relative (one
// product each); bf16/fp16 within their rounding of the result. Exact zeros and both signs, sizes
// below, at and past a pack, pointers one element off the 16-byte boundary, backward in place.
TYPED_TEST(TypedCudaOps, SquaredReluMatchesCpu) {
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      auto x = Normal(n, 40, 0.0f, 3.0f);
      for (int64_t i = 0; i < n; i += 5) x[i] = 0.0f;
      x = RoundTrip<T>(x);
      const auto dy = RoundTrip<T>(Normal(n, 41));
      std::vector<float> y(n), dx(n);
      cpu::SquaredReluForward(y.data(), x.data(), n);
      cpu::SquaredReluBackward(dx.data(), x.data(), dy.data(), n);
      DeviceArray<T> dxin(n + offset), dyout(n + offset), dd(n + offset);
      dxin.Upload(ToT<T>(x), offset);
      dd.Upload(ToT<T>(dy), offset);
      ASSERT_OK(SquaredReluForward<T>(dyout.get() + offset, dxin.get() + offset, n, this->ctx_));
      ExpectClose<T>(ToF(dyout.Download(n, offset)), y, 1e-6, 0.0, "forward " + what, true);
      ASSERT_OK(SquaredReluBackward<T>(dd.get() + offset, dxin.get() + offset, dd.get() + offset, n, this->ctx_));
      ExpectClose<T>(ToF(dd.Download(n, offset)), dx, 1e-6, 0.0, "backward (in place) " + what, true);
    }
  }
}

// --apply-layernorm-1p's effective weights: 1 + gamma in fp32, exactly the CPU's sum.
TEST_F(CudaOps, AddWeightOffsetIsTheFp32Sum) {
  for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{4099}}) {
    const auto w = Normal(n, 42, 0.0f, 0.2f);
    DeviceArray<float> in(n + 1), out(n + 1);
    in.Upload(w, 1);
    ASSERT_OK(AddWeightOffset(out.get() + 1, in.get() + 1, n, 1.0f, ctx_));
    const auto got = out.Download(n, 1);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], w[i] + 1.0f) << "n=" << n << " i=" << i;
  }
  EXPECT_FALSE(AddWeightOffset(nullptr, nullptr, 3, 1.0f, ctx_).ok());
}

// ---- dropout -------------------------------------------------------------------------------------

// The CPU's masks exactly: fp32 bitwise against cpu::Dropout over each row; bf16/fp16 bitwise against
// the same keep decisions with round(x * 1/(1-p)).
TYPED_TEST(TypedCudaOps, DropoutRowsIsTheCpuMask) {
  using T = TypeParam;
  const int64_t rows = 3;
  for (int64_t row_len : {int64_t{8 * 1000}, int64_t{9 * 1001}, int64_t{1}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      for (double p : {0.1, 0.5}) {
        const std::string what =
            "row_len=" + std::to_string(row_len) + " offset=" + std::to_string(offset) + " p=" + std::to_string(p);
        const uint64_t seed = 777;
        std::vector<uint64_t> streams(rows);
        for (int64_t r = 0; r < rows; ++r)
          streams[r] = DropoutStream(static_cast<uint64_t>(100 + r), 3, kMlpOutDropout);
        const auto x = ToT<T>(Normal(rows * row_len, 40));
        std::vector<T> want(x.size());
        if constexpr (std::is_same_v<T, float>) {
          want = x;
          for (int64_t r = 0; r < rows; ++r) cpu::Dropout(want.data() + r * row_len, row_len, p, seed, streams[r]);
        } else {
          const uint32_t threshold = DropoutKeepThreshold(p);
          const auto scale = static_cast<float>(1.0 / (1.0 - p));
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < row_len; ++i) {
              const size_t k = static_cast<size_t>(r * row_len + i);
              want[k] = DropoutKeep(seed, streams[r], static_cast<uint64_t>(i), threshold)
                            ? FromFloat<T>(ToFloat(x[k]) * scale)
                            : FromFloat<T>(0.0f);
            }
          }
        }
        DeviceArray<T> dx(x.size() + offset);
        dx.Upload(x, offset);
        DeviceArray<uint64_t> dstreams(streams);
        ASSERT_OK(DropoutRows<T>(dx.get() + offset, rows, row_len, dstreams.get(), p, seed, this->ctx_));
        ExpectBitwise(dx.Download(x.size(), offset), want, what);
      }
    }
  }
}

TEST_F(CudaOps, DropoutRowsEdgeProbabilities) {
  const int64_t rows = 2, row_len = 1000;
  const auto x = Normal(rows * row_len, 41);
  std::vector<uint64_t> streams = {1, 2};
  DeviceArray<float> dx(x);
  DeviceArray<uint64_t> dstreams(streams);
  ASSERT_OK(DropoutRows<float>(dx.get(), rows, row_len, dstreams.get(), 0.0, 5, ctx_));
  ExpectBitwise(dx.Download(), x, "p = 0 keeps everything");
  ASSERT_OK(DropoutRows<float>(dx.get(), rows, row_len, dstreams.get(), 1.0, 5, ctx_));
  ExpectBitwise(dx.Download(), std::vector<float>(x.size(), 0.0f), "p = 1 drops everything");
  EXPECT_EQ(DropoutRows<float>(dx.get(), rows, row_len, dstreams.get(), -0.1, 5, ctx_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DropoutRows<float>(dx.get(), rows, row_len, dstreams.get(), std::nan(""), 5, ctx_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DropoutRows<float>(dx.get(), rows, row_len, nullptr, 0.1, 5, ctx_).code(),
            absl::StatusCode::kInvalidArgument);
}

// A sequence-parallel rank's part of each row (its positions, from element index0 on) dropped with
// index0 gets the whole row's mask there, bit for bit, at every rank of T = 2 and 4; a negative
// first index is refused.
TEST_F(CudaOps, DropoutRowsFromAnIndexMatchTheWholeRow) {
  const int64_t rows = 3, row_len = 1024;
  const uint64_t seed = 4242;
  std::vector<uint64_t> streams(rows);
  for (int64_t r = 0; r < rows; ++r) streams[r] = DropoutStream(static_cast<uint64_t>(7 + r), 1, kAttentionOutDropout);
  const auto x = Normal(rows * row_len, 42);
  DeviceArray<float> whole(x);
  DeviceArray<uint64_t> dstreams(streams);
  ASSERT_OK(DropoutRows<float>(whole.get(), rows, row_len, dstreams.get(), 0.3, seed, ctx_));
  const std::vector<float> want = whole.Download();
  for (int64_t T : {2, 4}) {
    const int64_t part = row_len / T;
    for (int64_t q = 0; q < T; ++q) {
      std::vector<float> mine(static_cast<size_t>(rows * part)), expect(mine.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < part; ++i) {
          mine[static_cast<size_t>(r * part + i)] = x[static_cast<size_t>(r * row_len + q * part + i)];
          expect[static_cast<size_t>(r * part + i)] = want[static_cast<size_t>(r * row_len + q * part + i)];
        }
      DeviceArray<float> d(mine);
      ASSERT_OK(DropoutRows<float>(d.get(), rows, part, dstreams.get(), 0.3, seed, ctx_, q * part));
      ExpectBitwise(d.Download(), expect, "T=" + std::to_string(T) + " rank " + std::to_string(q));
    }
  }
  EXPECT_EQ(DropoutRows<float>(whole.get(), rows, row_len, dstreams.get(), 0.1, 5, ctx_, -1).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- softmax cross-entropy -----------------------------------------------------------------------

// Losses within 1e-5 rel / 1e-5 abs in every mode (fp32 softmax over the T inputs); dlogits
// within 1e-5 rel (+ one ulp of T) and, for the target's column (softmax - 1, which cancels),
// 1e-6 * |dloss| abs. Rows with a zero dloss (masked tokens) and columns that underflow included.
TYPED_TEST(TypedCudaOps, SoftmaxCrossEntropyMatchesCpu) {
  using T = TypeParam;
  for (Shape s : {Shape{1, 7}, Shape{5, 50257}, Shape{64, 50304}, Shape{3, 1}}) {
    const std::string what = "n=" + std::to_string(s.n) + " vp=" + std::to_string(s.c);
    const int64_t vp = s.c;
    auto raw = Normal(s.n * vp, 50, 0.0f, 3.0f);
    for (int64_t i = 0; i < s.n; ++i) {  // a few dominant and vanishing columns per row
      raw[i * vp + (i * 7919) % vp] = 30.0f;
      raw[i * vp + (i * 104729 + 3) % vp] = -60.0f;
    }
    const auto logits = RoundTrip<T>(raw);
    std::vector<int32_t> targets(s.n);
    std::vector<float> dl(s.n);
    std::mt19937 gen(51);
    for (int64_t i = 0; i < s.n; ++i) {
      targets[i] = static_cast<int32_t>(gen() % vp);
      dl[i] = i % 4 == 3 ? 0.0f : 0.5f + static_cast<float>(gen() % 1000) / 1000.0f;
    }
    if (s.n > 1) targets[1] = static_cast<int32_t>((1 * 7919) % vp);  // a target on the dominant column
    std::vector<float> losses(s.n), fused_losses(s.n), grad = logits;
    cpu::SoftmaxCrossEntropyForward(losses.data(), logits.data(), targets.data(), s.n, vp);
    cpu::SoftmaxCrossEntropyFused(grad.data(), fused_losses.data(), targets.data(), dl.data(), s.n, vp);

    DeviceArray<T> dlogits(ToT<T>(logits));
    DeviceArray<int32_t> dtargets(targets);
    DeviceArray<float> dlosses(s.n), ddl(dl);
    ASSERT_OK(SoftmaxCrossEntropyForward<T>(dlosses.get(), dlogits.get(), dtargets.get(), s.n, vp, this->ctx_));
    ExpectClose(dlosses.Download(), losses, 1e-5, 1e-5, "forward losses " + what);
    ExpectBitwise(dlogits.Download(), ToT<T>(logits), "forward leaves the logits " + what);

    ASSERT_OK(
        SoftmaxCrossEntropyFused<T>(dlogits.get(), dlosses.get(), dtargets.get(), ddl.get(), s.n, vp, this->ctx_));
    ExpectClose(dlosses.Download(), fused_losses, 1e-5, 1e-5, "fused losses " + what);
    const auto got = ToF(dlogits.Download());
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < s.n; ++i) {
      for (int64_t j = 0; j < vp; ++j) {
        const size_t k = static_cast<size_t>(i * vp + j);
        const double abs = j == targets[i] ? 1e-6 * std::fabs(dl[i]) : 1e-12;
        const double tol = (1e-5 + Prec<T>::ulp) * std::fabs(grad[k]) + abs + Prec<T>::floor;
        if (!(std::fabs(got[k] - grad[k]) <= tol)) {
          if (first < 0) first = static_cast<int64_t>(k);
          ++bad;
        }
      }
    }
    EXPECT_EQ(bad, 0) << "dlogits " << what << ": first at " << first << " got " << (first >= 0 ? got[first] : 0.0f)
                      << " want " << (first >= 0 ? grad[first] : 0.0f);
  }
}

TEST_F(CudaOps, SoftmaxCrossEntropyTargetOutOfRangeGivesNaN) {
  const int64_t n = 2, vp = 16;
  const auto logits = Normal(n * vp, 52);
  std::vector<int32_t> targets = {3, 16};
  DeviceArray<float> dlogits(logits), dlosses(n);
  DeviceArray<int32_t> dtargets(targets);
  ASSERT_OK(SoftmaxCrossEntropyForward<float>(dlosses.get(), dlogits.get(), dtargets.get(), n, vp, ctx_));
  const auto losses = dlosses.Download();
  EXPECT_TRUE(std::isfinite(losses[0]));
  EXPECT_TRUE(std::isnan(losses[1]));
}

// A -inf logit (fp16 logits past -65504) adds nothing to the softmax, as in the CPU op. Each row's
// first 8 logits are -inf: the first pack of the first thread (vectorised, vp = 8192) or the first
// logit of the first threads (scalar, vp = 8193), whose running max is still -inf there. Before
// SoftmaxOnlineAdd, expf(-inf - -inf) = NaN entered that thread's sum and outlived the rescaling
// when its later logits came: a NaN loss and NaN dlogits for every such row.
TYPED_TEST(TypedCudaOps, SoftmaxCrossEntropyMinusInfLogitsAddNothing) {
  using T = TypeParam;
  const float kInf = std::numeric_limits<float>::infinity();
  for (int64_t vp : {int64_t{8192}, int64_t{8193}}) {
    const int64_t n = 3;
    const std::string what = "vp=" + std::to_string(vp);
    auto raw = Normal(n * vp, 53, 0.0f, 2.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < 8; ++j) raw[i * vp + j] = -kInf;
    raw[2 * vp + vp / 2] = -kInf;  // and one in the middle of a row
    const auto logits = RoundTrip<T>(raw);
    const std::vector<int32_t> targets = {8, 100, static_cast<int32_t>(vp - 1)};
    const std::vector<float> dl = {1.0f, 0.5f, 2.0f};
    std::vector<float> losses(n), fused_losses(n), grad = logits;
    cpu::SoftmaxCrossEntropyForward(losses.data(), logits.data(), targets.data(), n, vp);
    cpu::SoftmaxCrossEntropyFused(grad.data(), fused_losses.data(), targets.data(), dl.data(), n, vp);
    DeviceArray<T> dlogits(ToT<T>(logits));
    DeviceArray<int32_t> dtargets(targets);
    DeviceArray<float> dlosses(n), ddl(dl);
    ASSERT_OK(SoftmaxCrossEntropyForward<T>(dlosses.get(), dlogits.get(), dtargets.get(), n, vp, this->ctx_));
    ExpectClose(dlosses.Download(), losses, 1e-5, 1e-5, "forward losses " + what);
    ASSERT_OK(SoftmaxCrossEntropyFused<T>(dlogits.get(), dlosses.get(), dtargets.get(), ddl.get(), n, vp, this->ctx_));
    ExpectClose(dlosses.Download(), fused_losses, 1e-5, 1e-5, "fused losses " + what);
    const auto got = ToF(dlogits.Download());
    for (size_t k = 0; k < got.size(); ++k) {
      const double tol = (1e-5 + Prec<T>::ulp) * std::fabs(grad[k]) + 1e-6 + Prec<T>::floor;
      ASSERT_NEAR(got[k], grad[k], tol) << "dlogits[" << k << "] " << what;
    }
  }
}

// ---- AdamW, sums of squares, scaling ---------------------------------------------------------------

// fp32: p, m, v bitwise equal to cpu::AdamW's over three steps (the same AdamWElement, no contracted
// multiply-adds, IEEE sqrt and division); the compute copy bitwise equal to round(p).
TYPED_TEST(TypedCudaOps, AdamWIsAdamWCpuBitwise) {
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1000003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      auto p = Normal(n, 60), m = Normal(n, 61, 0.0f, 0.01f), v = Normal(n, 62, 0.0f, 0.01f);
      for (float& x : v) x = x * x;
      DeviceArray<float> dp(n + offset), dg(n + offset), dm(n + offset), dv(n + offset);
      DeviceArray<T> dpc(n + offset);
      dp.Upload(p, offset);
      dm.Upload(m, offset);
      dv.Upload(v, offset);
      for (int64_t step = 1; step <= 3; ++step) {
        const auto g = Normal(n, static_cast<uint32_t>(63 + step), 0.0f, 0.1f);
        const AdamWParams a{1e-3 * static_cast<double>(step), 0.9, 0.95, 1e-8, 0.1, step + 10};
        cpu::AdamW(p.data(), g.data(), m.data(), v.data(), n, a);
        dg.Upload(g, offset);
        ASSERT_OK(AdamW<T>(dp.get() + offset, dg.get() + offset, dm.get() + offset, dv.get() + offset, n, a,
                           dpc.get() + offset, this->ctx_));
      }
      ExpectBitwise(dp.Download(n, offset), p, "p " + what);
      ExpectBitwise(dm.Download(n, offset), m, "m " + what);
      ExpectBitwise(dv.Download(n, offset), v, "v " + what);
      ExpectBitwise(dpc.Download(n, offset), ToT<T>(p), "compute copy " + what);
    }
  }
}

// The multi-tensor AdamW over a rank's range of the flat layout (its shard: master and moments
// shifted to start at the range, gradient and compute copy indexed by the flat index), pieces of
// all four optimizer groups (weight decay or none, --lr's or --decoupled-lr's rate) cut into chunks of at
// most kAdamWChunk: bitwise cpu::Scale of the gradient then cpu::AdamW piece by piece with its group's
// settings, two steps; the compute copy round(p) inside the range and untouched outside it.
TYPED_TEST(TypedCudaOps, AdamWMultiIsScaleThenAdamWPerPieceBitwise) {
  using T = TypeParam;
  struct Piece {
    int64_t offset, size;
    int32_t group;
  };
  const int64_t total = 30011, begin = 5003;
  const std::vector<Piece> pieces = {{5003, 9000, 2}, {14003, 5, 1}, {14008, 7, 3}, {14015, 15996, 0}};
  std::vector<AdamWChunk> table;
  for (const Piece& p : pieces)
    for (int64_t at = 0; at < p.size; at += kAdamWChunk)
      table.push_back({p.offset + at, static_cast<int32_t>(std::min(kAdamWChunk, p.size - at)), p.group});
  const int64_t shard = total - begin;
  auto master = Normal(shard, 160), m = Normal(shard, 161, 0.0f, 0.01f), v = Normal(shard, 162, 0.0f, 0.01f);
  for (float& x : v) x = x * x;
  const auto compute0 = ToT<T>(Normal(total, 163));
  DeviceArray<float> dmaster(master), dm(m), dv(v), dg(total);
  DeviceArray<T> dcompute(compute0);
  std::vector<uint8_t> table_bytes(table.size() * sizeof(AdamWChunk));
  std::memcpy(table_bytes.data(), table.data(), table_bytes.size());
  DeviceArray<uint8_t> dtable(table_bytes);
  const float grad_scale = 0.37f;
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Normal(total, static_cast<uint32_t>(170 + step), 0.0f, 0.1f);
    const AdamWParams decay{1e-3, 0.9, 0.95, 1e-8, 0.1, step + 4}, no_decay{1e-3, 0.9, 0.95, 1e-8, 0.0, step + 4},
        decoupled{3e-3, 0.9, 0.95, 1e-8, 0.1, step + 4}, decoupled_no_decay{3e-3, 0.9, 0.95, 1e-8, 0.0, step + 4};
    const AdamWGroups groups{{decay, no_decay, decoupled, decoupled_no_decay}, false};
    for (const Piece& p : pieces) {
      std::vector<float> gs(g.begin() + p.offset, g.begin() + p.offset + p.size);
      cpu::Scale(gs.data(), p.size, grad_scale);
      const int64_t at = p.offset - begin;
      cpu::AdamW(master.data() + at, gs.data(), m.data() + at, v.data() + at, p.size, groups.group[p.group]);
    }
    dg.Upload(g);
    ASSERT_OK(AdamWMulti<T>(reinterpret_cast<const AdamWChunk*>(dtable.get()), static_cast<int64_t>(table.size()),
                            dmaster.get(), begin, dg.get(), dm.get(), dv.get(), begin, dcompute.get(), grad_scale,
                            groups, this->ctx_));
  }
  ExpectBitwise(dmaster.Download(), master, "master");
  ExpectBitwise(dm.Download(), m, "m");
  ExpectBitwise(dv.Download(), v, "v");
  std::vector<T> want = compute0;
  for (int64_t i = begin; i < total; ++i) want[i] = FromFloat<T>(master[i - begin]);
  ExpectBitwise(dcompute.Download(), want, "compute copy");
  const AdamWParams bad{1e-3, 0.9, 0.95, 1e-8, 0.1, 0};
  EXPECT_EQ(AdamWMulti<T>(reinterpret_cast<const AdamWChunk*>(dtable.get()), 1, dmaster.get(), begin, dg.get(),
                          dm.get(), dv.get(), begin, nullptr, 1.0f, AdamWGroups::Uniform(bad, bad), this->ctx_)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaOps, AdamWWithoutComputeCopyAndBadStep) {
  const int64_t n = 5;
  DeviceArray<float> p(std::vector<float>(n, 1.0f)), g(std::vector<float>(n, 0.5f)), m(n), v(n);
  ASSERT_EQ(cudaMemset(m.get(), 0, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(v.get(), 0, n * sizeof(float)), cudaSuccess);
  AdamWParams a{1e-2, 0.9, 0.999, 1e-8, 0.0, 1};
  ASSERT_OK(AdamW<float>(p.get(), g.get(), m.get(), v.get(), n, a, nullptr, ctx_));
  std::vector<float> hp(n, 1.0f), hg(n, 0.5f), hm(n, 0.0f), hv(n, 0.0f);
  cpu::AdamW(hp.data(), hg.data(), hm.data(), hv.data(), n, a);
  ExpectBitwise(p.Download(), hp, "p");
  a.step = 0;
  EXPECT_EQ(AdamW<float>(p.get(), g.get(), m.get(), v.get(), n, a, nullptr, ctx_).code(),
            absl::StatusCode::kInvalidArgument);
}

// Two runs give the same bits; within 1e-12 rel of cpu::SumSquares (both sum exact double squares).
TEST_F(CudaOps, SumSquaresIsReproducibleAndMatchesCpu) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1000003}, int64_t{(1 << 22) + 3}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      const auto x = Normal(n, 70, 0.01f, 1.0f);
      DeviceArray<float> dx(n + offset);
      if (n > 0) dx.Upload(x, offset);
      DeviceArray<double> partials(SumSquaresPartials(n)), out(2);
      ASSERT_OK(SumSquares(out.get(), dx.get() + offset, n, partials.get(), ctx_));
      ASSERT_OK(SumSquares(out.get() + 1, dx.get() + offset, n, partials.get(), ctx_));
      const auto got = out.Download(2);
      const double want = cpu::SumSquares(x.data(), n);
      ExpectBitwise(std::vector<double>{got[1]}, std::vector<double>{got[0]}, "two runs " + what);
      EXPECT_NEAR(got[0], want, 1e-12 * want) << what;
    }
  }
}

TEST_F(CudaOps, ScaleIsScaleCpuBitwise) {
  for (int64_t n : {int64_t{1}, int64_t{1000003}}) {
    auto x = Normal(n, 71);
    DeviceArray<float> dx(n + 1);
    dx.Upload(x, 1);
    ASSERT_OK(Scale(dx.get() + 1, n, 0.37f, ctx_));
    cpu::Scale(x.data(), n, 0.37f);
    ExpectBitwise(dx.Download(n, 1), x, "n=" + std::to_string(n));
  }
}

// ---- casts, residual add, non-finite flag --------------------------------------------------------

TYPED_TEST(TypedCudaOps, CastsAndResidualAddBitwise) {
  using T = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string what = "n=" + std::to_string(n) + " offset=" + std::to_string(offset);
      auto x = Normal(n, 80, 0.0f, 10.0f);
      x[0] = 1e-40f;  // an fp32 subnormal
      DeviceArray<float> dx(n + offset), dback(n + offset);
      DeviceArray<T> dt(n + offset);
      dx.Upload(x, offset);
      ASSERT_OK(CastFromFloat<T>(dt.get() + offset, dx.get() + offset, n, this->ctx_));
      const auto xt = ToT<T>(x);
      ExpectBitwise(dt.Download(n, offset), xt, "CastFromFloat " + what);
      ASSERT_OK(CastToFloat<T>(dback.get() + offset, dt.get() + offset, n, this->ctx_));
      ExpectBitwise(dback.Download(n, offset), ToF(xt), "CastToFloat " + what);

      const auto a = ToT<T>(Normal(n, 81)), b = ToT<T>(Normal(n, 82));
      std::vector<T> sum(n);
      for (int64_t i = 0; i < n; ++i) sum[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
      DeviceArray<T> da(n + offset), db(n + offset), dout(n + offset);
      da.Upload(a, offset);
      db.Upload(b, offset);
      ASSERT_OK(ResidualAdd<T>(dout.get() + offset, da.get() + offset, db.get() + offset, n, this->ctx_));
      ExpectBitwise(dout.Download(n, offset), sum, "ResidualAdd " + what);
      ASSERT_OK(ResidualAdd<T>(da.get() + offset, da.get() + offset, db.get() + offset, n, this->ctx_));
      ExpectBitwise(da.Download(n, offset), sum, "ResidualAdd in place " + what);
    }
  }
}

// Round to nearest, ties to even, on the device: exact halfway points and their neighbours.
TEST_F(CudaOps, CastFromFloatRoundsToNearestEven) {
  const std::vector<float> x = {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f,  -(1.0f + 0x1p-8f), 1.0f + 0x1p-8f + 0x1p-20f,
                                1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65504.0f,          70000.0f};
  DeviceArray<float> dx(x);
  DeviceArray<__nv_bfloat16> db(x.size());
  DeviceArray<__half> dh(x.size());
  ASSERT_OK(CastFromFloat<__nv_bfloat16>(db.get(), dx.get(), static_cast<int64_t>(x.size()), ctx_));
  ASSERT_OK(CastFromFloat<__half>(dh.get(), dx.get(), static_cast<int64_t>(x.size()), ctx_));
  const auto gb = db.Download();
  const auto gh = dh.Download();
  auto bits = [](auto v) {
    uint16_t u;
    std::memcpy(&u, &v, 2);
    return u;
  };
  EXPECT_EQ(bits(gb[0]), 0x3F80);  // 1 + 2^-8 -> 1 (even)
  EXPECT_EQ(bits(gb[1]), 0x3F82);  // 1 + 3 * 2^-8 -> 1 + 2^-6 (even)
  EXPECT_EQ(bits(gb[2]), 0xBF80);
  EXPECT_EQ(bits(gb[3]), 0x3F81);  // just past the halfway point -> up
  EXPECT_EQ(bits(gh[4]), 0x3C00);  // 1 + 2^-11 -> 1 (even)
  EXPECT_EQ(bits(gh[5]), 0x3C02);  // 1 + 3 * 2^-11 -> 1 + 2^-9 (even)
  EXPECT_EQ(bits(gh[6]), 0x7BFF);  // fp16's largest
  EXPECT_EQ(bits(gh[7]), 0x7C00);  // past it: +Inf
}

TEST_F(CudaOps, NonFiniteFlag) {
  const int64_t n = 100003;
  auto x = Normal(n, 90);
  DeviceArray<float> dx(n + 1);
  DeviceArray<int> flag(1);
  auto check = [&](int64_t offset, int want, const std::string& what) {
    ASSERT_OK(NonFiniteFlag(flag.get(), dx.get() + offset, n, ctx_));
    EXPECT_EQ(flag.Download()[0], want) << what;
  };
  dx.Upload(x, 1);
  check(1, 0, "finite");
  x[n - 1] = std::numeric_limits<float>::quiet_NaN();
  dx.Upload(x, 1);
  check(1, 1, "NaN in the tail");
  x[n - 1] = 0.0f;
  x[0] = -std::numeric_limits<float>::infinity();
  dx.Upload(x, 1);
  check(1, 1, "-Inf in the head");
  x[0] = 0.0f;
  x[n / 2] = std::numeric_limits<float>::infinity();
  dx.Upload(x, 1);
  check(1, 1, "+Inf in the middle");
  ASSERT_OK(NonFiniteFlag(flag.get(), dx.get(), 0, ctx_));
  EXPECT_EQ(flag.Download()[0], 0) << "n = 0";
}

// ---- argument checks ------------------------------------------------------------------------------

TEST_F(CudaOps, LaunchersRefuseBadArguments) {
  DeviceArray<float> buf(64);
  float* p = buf.get();
  auto invalid = [](const absl::Status& s) { return s.code() == absl::StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(GeluForward<float>(p, p, -1, ctx_)));
  EXPECT_TRUE(invalid(GeluForward<float>(nullptr, p, 4, ctx_)));
  EXPECT_TRUE(invalid(CastFromFloat<__half>(nullptr, p, 4, ctx_)));
  EXPECT_TRUE(invalid(Scale(p, -5, 1.0f, ctx_)));
  EXPECT_TRUE(invalid(LayerNormForward<float>(p, p, p, p, p, nullptr, 2, 4, 1e-5, ctx_)));
  EXPECT_TRUE(invalid(LayerNormBackward<float>(p, p, p, p, p, p, p, p, 2, 4, nullptr, ctx_)));
  EXPECT_TRUE(invalid(SoftmaxCrossEntropyForward<float>(p, p, nullptr, 2, 4, ctx_)));
  EXPECT_TRUE(invalid(SumSquares(nullptr, p, 4, nullptr, ctx_)));
  const absl::Status s = GeluForward<__nv_bfloat16>(nullptr, nullptr, 7, ctx_);
  EXPECT_NE(s.message().find("GeluForward<bf16>(n=7)"), std::string::npos) << s;
  // Nothing to do is not an error.
  EXPECT_OK(GeluForward<float>(nullptr, nullptr, 0, ctx_));
  EXPECT_OK(LayerNormBackward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4,
                                     nullptr, ctx_));
}

}  // namespace
}  // namespace ptk::cuda
