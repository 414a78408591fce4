// The CUDA mixture-of-experts ops and layer (trainer/cuda/moe_ops_cuda.h, moe_layer_cuda.h) against the CPU MoE
// (trainer/cpu/moe_cpu.h). gpu-labelled: skipped (exit 77) without a device.
//
// Tolerances. fp32: the router's choices equal; probabilities, scores and log-sum-exps within 1e-5 relative +
// 1e-6 (expf / logf against std::exp / std::log, the same fp32 formulas); the layer's output, input gradient and
// weight gradients within 1e-5 relative L2 (cuBLASLt's products in fp32 against the CPU's: the order of the
// sums only), the load-balancing and z-losses within 1e-5 relative. bf16: the inputs and weights rounded to bf16
// for both (so both routers see the same values and choose alike), the output and gradients within 3e-2
// relative L2 (8-bit mantissas in the products and activations). Every pass twice: the same bits (no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/attention_cuda_test_util.h"
#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/cpu/moe_cpu.h"
#include "trainer/cuda/moe_layer_cuda.h"

namespace ptk::cuda {
namespace {

using namespace ops_test;  // NOLINT
using cuda_test::Gpu;

struct Case {
  int64_t n, c, E, K, ffn;
  cpu::MlpActivation act;
  bool sigmoid, pre_softmax;
  double scaling;
  std::string name;
};

std::vector<Case> Cases() {
  return {{45, 24, 4, 2, 20, cpu::MlpActivation::kGelu, false, false, 0, "gelu softmax top-2 of 4"},
          {37, 16, 6, 3, 12, cpu::MlpActivation::kSwiglu, true, false, 2.5, "swiglu sigmoid top-3 of 6 scaled"},
          {30, 20, 5, 1, 8, cpu::MlpActivation::kSquaredRelu, false, true, 0, "squared relu pre-softmax top-1"},
          {5, 8, 16, 1, 4, cpu::MlpActivation::kGeluExact, false, false, 0, "exact gelu, most experts empty"}};
}

cpu::MoeSettings CpuSettings(const Case& k) {
  cpu::MoeSettings s;
  s.experts = k.E;
  s.topk = k.K;
  s.ffn = k.ffn;
  s.activation = k.act;
  s.sigmoid = k.sigmoid;
  s.pre_softmax = k.pre_softmax;
  s.scaling = k.scaling;
  return s;
}

MoeLayerSpec GpuSpec(const Case& k, int64_t act_bytes) {
  MoeLayerSpec s;
  s.shape.n = k.n, s.shape.c = k.c, s.shape.experts = k.E, s.shape.topk = k.K, s.shape.ffn = k.ffn;
  s.shape.fc1_rows = (k.act == cpu::MlpActivation::kSwiglu ? 2 : 1) * k.ffn;
  s.shape.act_bytes = act_bytes;
  s.shape.sigmoid = k.sigmoid;
  s.routing.experts = k.E, s.routing.topk = k.K, s.routing.sigmoid = k.sigmoid;
  s.routing.pre_softmax = k.pre_softmax, s.routing.scaling = static_cast<float>(k.scaling);
  s.activation = k.act == cpu::MlpActivation::kSwiglu        ? MoeActivation::kSwiglu
                 : k.act == cpu::MlpActivation::kSquaredRelu ? MoeActivation::kSquaredRelu
                 : k.act == cpu::MlpActivation::kGeluExact   ? MoeActivation::kGeluExact
                                                             : MoeActivation::kGelu;
  return s;
}

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

TEST(MoeCuda, RouterMatchesTheCpuRouter) {
  Gpu gpu;
  for (const Case& k : Cases()) {
    const cpu::MoeSettings s = CpuSettings(k);
    const std::vector<float> x = Normal(k.n * k.c, 1), w = Normal(k.E * k.c, 2, 0.0f, 0.5f);
    cpu::MoeActivations<float> a;
    cpu::MoeRouterForward(&a, x.data(), w.data(), k.n, k.c, s);
    DeviceArray<float> logits(a.logits), scores(k.n * k.E), gates(k.n * k.E), prob(k.n * k.K), lse(k.n), colsum(k.E);
    DeviceArray<int32_t> expert(k.n * k.K);
    const MoeLayerSpec spec = GpuSpec(k, 4);
    ASSERT_OK(MoeRouteForward(scores.get(), gates.get(), prob.get(), expert.get(), lse.get(), logits.get(), k.n,
                              spec.routing, gpu.ctx));
    ASSERT_OK(MoeScoreColumnSums(colsum.get(), scores.get(), k.n, k.E, gpu.ctx));
    EXPECT_EQ(expert.Download(), a.expert) << k.name;
    ExpectClose(prob.Download(), a.prob, 1e-5, 1e-6, "prob " + k.name);
    ExpectClose(scores.Download(), a.scores, 1e-5, 1e-6, "scores " + k.name);
    if (k.sigmoid) ExpectClose(gates.Download(), a.gates, 1e-5, 1e-6, "gates " + k.name);
    std::vector<float> want_lse(k.n), want_col(k.E, 0.0f);
    for (int64_t i = 0; i < k.n; ++i) {
      double sum = 0;
      for (int64_t e = 0; e < k.E; ++e) sum += std::exp(double(a.logits[i * k.E + e]));
      want_lse[i] = static_cast<float>(std::log(sum));
      for (int64_t e = 0; e < k.E; ++e) want_col[e] += a.scores[i * k.E + e];
    }
    ExpectClose(lse.Download(), want_lse, 1e-5, 1e-6, "lse " + k.name);
    ExpectClose(colsum.Download(), want_col, 1e-5, 1e-5, "column sums " + k.name);
  }
}

// The whole layer, forward and backward with the load-balancing loss's and the z-loss's gradients.
template <typename T>
void ExpectLayerMatches(const Case& k, double tol) {
  Gpu gpu(/*deterministic=*/true);
  const cpu::MoeSettings s = CpuSettings(k);
  const int64_t per = s.expert_floats(k.c);
  const std::vector<float> x = RoundTrip<T>(Normal(k.n * k.c, 3));
  const std::vector<float> wr = RoundTrip<T>(Normal(k.E * k.c, 4, 0.0f, 0.5f));
  const std::vector<float> we = RoundTrip<T>(Normal(k.E * per, 5, 0.0f, 0.3f));
  const std::vector<float> dout = RoundTrip<T>(Normal(k.n * k.c, 6));
  const double aux_grad = 0.3, z_grad = 0.2;
  cpu::MoeActivations<float> a;
  std::vector<float> out(k.n * k.c), dx(k.n * k.c, 0.0f), dwr(k.E * k.c, 0.0f), dwe(k.E * per, 0.0f);
  cpu::MoeRouterForward(&a, x.data(), wr.data(), k.n, k.c, s);
  cpu::MoeExpertsForward(out.data(), &a, we.data(), k.c, s);
  const double aux = cpu::MoeAuxLoss(a, s), z = cpu::MoeZLoss(a, s);
  cpu::MoeBackward(dx.data(), dwr.data(), dwe.data(), dout.data(), &a, x.data(), wr.data(), we.data(), k.c, s, aux_grad,
                   z_grad);

  const MoeLayerSpec spec = GpuSpec(k, sizeof(T));
  const MoeBuffers b = PlanMoeBuffers(spec.shape);
  DeviceArray<T> gx(ToT<T>(x)), gwr(ToT<T>(wr)), gwe(ToT<T>(we)), gdout(ToT<T>(dout)), gout(k.n * k.c), gdx(k.n * k.c);
  DeviceArray<char> saved(b.saved_bytes), scratch(b.scratch_bytes);
  std::vector<float> first_dx, first_dwr, first_dwe;
  for (int run = 0; run < 2; ++run) {
    const std::string what = k.name + (run ? " (again)" : "");
    DeviceArray<float> gdwr(std::vector<float>(k.E * k.c, 0.0f)), gdwe(std::vector<float>(k.E * per, 0.0f));
    MoeLayerHost host;
    ASSERT_OK(MoeLayerForward<T>(gout.get(), gx.get(), gwr.get(), gwe.get(), spec, saved.get(), scratch.get(), &host,
                                 true, true, gpu.ctx));
    EXPECT_EQ(host.plan.begin, a.begin) << what;
    EXPECT_NEAR(host.aux_loss, aux, 1e-5 * std::fabs(aux) + 1e-7) << what;
    EXPECT_NEAR(host.z_loss, z, 1e-5 * std::fabs(z) + 1e-7) << what;
    EXPECT_LE(RelL2(ToF(gout.Download()), out), tol) << "out " << what;
    ASSERT_OK(MoeLayerBackward<T>(gdx.get(), gdwr.get(), gdwe.get(), gdout.get(), gx.get(), gwr.get(), gwe.get(), spec,
                                  saved.get(), scratch.get(), host, aux_grad, z_grad, gpu.ctx));
    const std::vector<float> got_dx = ToF(gdx.Download()), got_dwr = gdwr.Download(), got_dwe = gdwe.Download();
    EXPECT_LE(RelL2(got_dx, dx), tol) << "dx " << what;
    EXPECT_LE(RelL2(got_dwr, dwr), tol) << "router weight gradient " << what;
    EXPECT_LE(RelL2(got_dwe, dwe), tol) << "experts' weight gradients " << what;
    if (run == 0) {
      first_dx = got_dx, first_dwr = got_dwr, first_dwe = got_dwe;
    } else {
      ExpectBitwise(got_dx, first_dx, "dx twice " + k.name);
      ExpectBitwise(got_dwr, first_dwr, "router weight gradient twice " + k.name);
      ExpectBitwise(got_dwe, first_dwe, "experts' weight gradients twice " + k.name);
    }
  }
}

TEST(MoeCuda, Fp32LayerMatchesTheCpuLayer) {
  for (const Case& k : Cases()) ExpectLayerMatches<float>(k, 1e-5);
}

TEST(MoeCuda, Bf16LayerFollowsTheCpuLayer) {
  for (const Case& k : Cases()) ExpectLayerMatches<__nv_bfloat16>(k, 3e-2);
}

// Bad arguments are refused before any launch.
TEST(MoeCuda, RefusesBadShapes) {
  Gpu gpu;
  MoeRouting r;
  r.experts = 4;
  r.topk = 5;
  DeviceArray<float> f(64);
  DeviceArray<int32_t> i(64);
  EXPECT_EQ(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.topk = 2;
  EXPECT_EQ(MoeRouteForward(nullptr, f.get(), f.get(), i.get(), f.get(), f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MoeGatherRows<float>(f.get(), f.get(), i.get(), 4, 0, 4, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  MoeLayerHost none;
  const MoeLayerSpec spec = GpuSpec(Cases()[0], 4);
  EXPECT_EQ(MoeLayerBackward<float>(f.get(), f.get(), f.get(), f.get(), f.get(), f.get(), f.get(), spec, nullptr,
                                    nullptr, none, 0, 0, gpu.ctx)
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ptk::cuda
