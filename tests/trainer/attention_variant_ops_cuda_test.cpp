// The attention variants' CUDA ops against their CPU ops (trainer/cpu/output_gate_cpu.cpp, qk_norm_cpu.cpp): the
// --attention-output-gate split and merge of the fused product's rows (bitwise: copies), the gate's forward and
// backward, and --qk-l2-norm's norms (QKNormForward / Backward with unit weights, no parameters), for fp32, bf16 and
// fp16 on random inputs of awkward sizes (query groups, a head dimension not a multiple of 32, one token).
// gpu-labelled: skipped (exit 77) without a device. Never run on a GPU yet (written without one).
//
// Tolerances: the gate's sigmoid is expf on the device, glibc's expf on the CPU (each within 1 ulp or so): fp32
// out and gradients within 1e-6 rel / 1e-7 abs; bf16/fp16 outputs one ulp of T more (the CPU op's fp32 result
// rounded once). The L2 norm as ops_cuda_test's --qk-layernorm (the same double statistics summed in another order):
// out 1e-5 rel / 1e-6 abs, rstd 1e-6 / 1e-7, the input gradient 1e-5 / 1e-5.
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
class AttentionVariantCudaOps : public CudaOps {};

TYPED_TEST_SUITE(AttentionVariantCudaOps, ActivationTypes, TypeNames);

const AttentionShape kShapes[] = {{2, 37, 4, 12, 2}, {1, 5, 6, 40, 0}, {1, 1, 2, 8, 1}};

std::string Describe(const AttentionShape& s) {
  return "b=" + std::to_string(s.b) + " t=" + std::to_string(s.t) + " nh=" + std::to_string(s.nh) +
         " hd=" + std::to_string(s.hd) + " groups=" + std::to_string(s.groups());
}

// Split and merge move elements only: the CPU op's bits, and merge(split(x)) == x.
TYPED_TEST(AttentionVariantCudaOps, GatedQkvSplitAndMergeAreTheCpuCopies) {
  using T = TypeParam;
  for (const AttentionShape& s : kShapes) {
    const std::string what = Describe(s);
    const int64_t n = s.b * s.t, w = s.qkv_width(), ct = s.nh * s.hd;
    const auto fused = RoundTrip<T>(Normal(n * (w + ct), 70, 0.0f, 1.0f));
    std::vector<float> qkv(n * w), gate(n * ct);
    cpu::SplitGatedQkv(qkv.data(), gate.data(), fused.data(), s);
    DeviceArray<T> dfused(ToT<T>(fused)), dqkv(n * w), dgate(n * ct), merged(n * (w + ct));
    ASSERT_OK(SplitGatedQkv<T>(dqkv.get(), dgate.get(), dfused.get(), s, this->ctx_));
    ExpectBitwise(ToF(dqkv.Download()), qkv, "qkv " + what);
    ExpectBitwise(ToF(dgate.Download()), gate, "gate " + what);
    ASSERT_OK(MergeGatedQkv<T>(merged.get(), dqkv.get(), dgate.get(), s, this->ctx_));
    ExpectBitwise(ToF(merged.Download()), fused, "merged " + what);
  }
}

TYPED_TEST(AttentionVariantCudaOps, OutputGateMatchesCpu) {
  using T = TypeParam;
  for (int64_t n : {1, 7, 4099}) {
    const std::string what = "n=" + std::to_string(n);
    const auto attn = RoundTrip<T>(Normal(n, 71, 0.0f, 1.0f)), gate = RoundTrip<T>(Normal(n, 72, 0.0f, 3.0f));
    const auto dy = RoundTrip<T>(Normal(n, 73, 0.0f, 1.0f));
    std::vector<float> out(n), dattn = dy, dgate(n);
    cpu::OutputGateForward(out.data(), attn.data(), gate.data(), n);
    cpu::OutputGateBackward(dattn.data(), dgate.data(), attn.data(), gate.data(), n);
    DeviceArray<T> da(ToT<T>(attn)), dg(ToT<T>(gate)), dout(n), ddattn(ToT<T>(dy)), ddgate(n);
    ASSERT_OK(OutputGateForward<T>(dout.get(), da.get(), dg.get(), n, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), out, 1e-6, 1e-7, "out " + what, true);
    ASSERT_OK(OutputGateBackward<T>(ddattn.get(), ddgate.get(), da.get(), dg.get(), n, this->ctx_));
    ExpectClose<T>(ToF(ddattn.Download()), dattn, 1e-6, 1e-7, "dattn " + what, true);
    ExpectClose<T>(ToF(ddgate.Download()), dgate, 1e-6, 1e-7, "dgate " + what, true);
  }
}

// --qk-l2-norm: RMSNorm's arithmetic with unit weights (null on the device, ones on the CPU, as the CPU model's
// l2_ones), no statistics' mean, no parameter gradients (null dw, null scratch).
TYPED_TEST(AttentionVariantCudaOps, QKL2NormMatchesCpu) {
  using T = TypeParam;
  for (const AttentionShape& s : kShapes) {
    const std::string what = Describe(s);
    const int64_t size = s.b * s.t * s.qkv_width(), rows = s.b * s.t * (s.nh + s.groups());
    const auto x = RoundTrip<T>(Normal(size, 74, 0.2f, 1.5f)), dy = RoundTrip<T>(Normal(size, 75, 0.0f, 1.0f));
    const std::vector<float> ones(s.hd, 1.0f);
    std::vector<float> y(size), rstd(rows), dx = dy;
    float* none = nullptr;
    cpu::QKNormForward(y.data(), none, rstd.data(), x.data(), ones.data(), static_cast<const float*>(nullptr),
                       ones.data(), static_cast<const float*>(nullptr), s, 1e-6, 0.0f);
    cpu::QKNormBackward(dx.data(), none, none, none, none, x.data(), ones.data(), ones.data(),
                        static_cast<const float*>(nullptr), rstd.data(), s, 0.0f);
    DeviceArray<T> draw(ToT<T>(x)), dout(size), dgrad(ToT<T>(dy));
    DeviceArray<float> drstd(rows);
    ASSERT_OK(QKNormForward<T>(dout.get(), nullptr, drstd.get(), draw.get(), nullptr, nullptr, nullptr, nullptr, s,
                               1e-6, this->ctx_));
    ExpectClose<T>(ToF(dout.Download()), y, 1e-5, 1e-6, "out " + what, true);
    ExpectClose(drstd.Download(), rstd, 1e-6, 1e-7, "rstd " + what);
    drstd.Upload(rstd);  // the backward from the CPU's statistics: only its own arithmetic differs
    ASSERT_OK(QKNormBackward<T>(dgrad.get(), nullptr, nullptr, nullptr, nullptr, draw.get(), nullptr, nullptr, nullptr,
                                drstd.get(), s, nullptr, this->ctx_));
    ExpectClose<T>(ToF(dgrad.Download()), dx, 1e-5, 1e-5, "dinp " + what, true);
  }
}

TEST_F(CudaOps, AttentionVariantOpsRefuseBadArguments) {
  DeviceArray<float> buf(256);
  DeviceArray<double> scratch(256);
  const AttentionShape s{1, 2, 4, 4, 2}, bad{1, 2, 3, 4, 2};  // 2 groups do not divide 3 heads
  EXPECT_FALSE(SplitGatedQkv<float>(buf.get(), buf.get(), buf.get(), bad, ctx_).ok());
  EXPECT_FALSE(MergeGatedQkv<float>(buf.get(), nullptr, buf.get(), s, ctx_).ok());
  EXPECT_FALSE(OutputGateForward<float>(buf.get(), buf.get(), nullptr, 4, ctx_).ok());
  EXPECT_FALSE(OutputGateBackward<float>(buf.get(), buf.get(), buf.get(), buf.get(), -1, ctx_).ok());
  // Unit weights on one side only, or with LayerNorm's mean; parameter gradients without the weights.
  EXPECT_FALSE(QKNormForward<float>(buf.get(), nullptr, buf.get(), buf.get(), nullptr, nullptr, buf.get(), nullptr, s,
                                    1e-6, ctx_)
                   .ok());
  EXPECT_FALSE(QKNormForward<float>(buf.get(), buf.get(), buf.get(), buf.get(), nullptr, buf.get(), nullptr, buf.get(),
                                    s, 1e-6, ctx_)
                   .ok());
  EXPECT_FALSE(QKNormBackward<float>(buf.get(), buf.get(), nullptr, buf.get(), nullptr, buf.get(), nullptr, nullptr,
                                     nullptr, buf.get(), s, scratch.get(), ctx_)
                   .ok());
}

}  // namespace
}  // namespace ptk::cuda
