// The CUDA mixture-of-experts ops and layer (trainer/cuda/moe_ops_cuda.h, moe_layer_cuda.h) against the CPU MoE
// (trainer/cpu/moe_cpu.h). gpu-labelled: skipped (exit 77) without a device.
//
// Tolerances. fp32: the router's choices equal; probabilities, scores and log-sum-exps within 1e-5 relative +
// 1e-6 (expf / logf against std::exp / std::log, the same fp32 formulas); the layer's output, input gradient and
// weight gradients within 1e-5 relative L2 (cuBLASLt's products in fp32 against the CPU's: the order of the
// sums only), the load-balancing and z-losses within 1e-5 relative. bf16: the inputs and weights rounded to bf16
// for both (so both routers see the same values and choose alike), the output and gradients within 3e-2
// relative L2 (8-bit mantissas in the products and activations). Every pass twice: the same bits (no atomics).
// The expert bias (on the host, uploaded by the layer): the same choices as the CPU's biased ones, the
// load-balancing loss counting the plain top-k. seq_aux_loss: its value within 1e-5 relative of its definition's
// (trainer/cpu/moe_balance.cpp's formula, here in the test: the CPU's lives in its model) and its gradient among the
// router's. Group-limited routing (softmax, pre-softmax, sigmoid): the same choices as the CPU's, the load-balancing
// loss's counts from each token's plain top-k equal to the CPU's. Shared experts (with and without their sigmoid gate)
// the same, against trainer/cpu/shared_experts_cpu.h; the gate's own ops against their fp32 definitions within 1e-5
// relative (1e-4 for the sums over a row or column).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/attention_cuda_test_util.h"
#include "tests/trainer/ops_cuda_test_util.cuh"
#include "trainer/cpu/moe_cpu.h"
#include "trainer/cpu/shared_experts_cpu.h"
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
  int64_t shared_ffn = 0;  // shared experts' width (0: none)
  bool shared_gate = false;
  int64_t groups = 0, group_topk = 0;  // group-limited routing (group_topk 0: none)
  int64_t seq = 0;                     // seq_aux_loss: each sequence's tokens (0: none)
  std::vector<float> bias = {};        // the expert bias (sigmoid; empty: none)
};

std::vector<Case> Cases() {
  std::vector<Case> cases = {
      {45, 24, 4, 2, 20, cpu::MlpActivation::kGelu, false, false, 0, "gelu softmax top-2 of 4, seq_aux_loss", 0, false,
       0, 0, 15},
      {37, 16, 6, 3, 12, cpu::MlpActivation::kSwiglu, true, false, 2.5, "swiglu sigmoid top-3 of 6 scaled"},
      {30, 20, 5, 1, 8, cpu::MlpActivation::kSquaredRelu, false, true, 0, "squared relu pre-softmax top-1"},
      {5, 8, 16, 1, 4, cpu::MlpActivation::kGeluExact, false, false, 0, "exact gelu, most experts empty"},
      {29, 24, 4, 2, 12, cpu::MlpActivation::kGelu, false, false, 0, "gelu top-2 with shared experts", 40},
      {33, 16, 6, 2, 8, cpu::MlpActivation::kSwiglu, true, false, 0, "swiglu sigmoid with gated shared experts", 24,
       true},
      {40, 16, 8, 2, 8, cpu::MlpActivation::kGelu, false, false, 0, "softmax top-2 in 2 of 4 groups", 0, false, 4, 2},
      {42, 16, 8, 4, 8, cpu::MlpActivation::kSwiglu, true, false, 2.5,
       "sigmoid top-4 in 2 of 4 groups, gated shared experts, seq_aux_loss (DeepSeek-V3 without the bias)", 16, true, 4,
       2, 21},
      {23, 12, 16, 2, 6, cpu::MlpActivation::kGelu, false, true, 0, "pre-softmax top-2 in 1 of 8 groups", 0, false, 8,
       1}};
  // The expert bias (aux-loss-free routing), alone and with groups: it moves the choices, not the probabilities.
  cases.push_back({36, 16, 8, 2, 8, cpu::MlpActivation::kGelu, true, false, 0, "sigmoid top-2 with the expert bias"});
  cases.back().bias = Normal(8, 17, 0.0f, 0.3f);
  cases.push_back({36, 16, 8, 2, 8, cpu::MlpActivation::kSwiglu, true, false, 2.5,
                   "sigmoid top-2 in 2 of 4 groups with the expert bias and shared experts", 16, false, 4, 2, 12});
  cases.back().bias = Normal(8, 18, 0.0f, 0.3f);
  return cases;
}

cpu::SharedExpertSettings SharedSettings(const Case& k) {
  cpu::SharedExpertSettings s;
  s.ffn = k.shared_ffn;
  s.gate = k.shared_gate;
  s.activation = k.act;
  return s;
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
  s.groups = k.groups;
  s.group_topk = k.group_topk;
  s.expert_bias = k.bias.empty() ? nullptr : k.bias.data();
  return s;
}

MoeLayerSpec GpuSpec(const Case& k, int64_t act_bytes) {
  MoeLayerSpec s;
  s.shape.n = k.n, s.shape.c = k.c, s.shape.experts = k.E, s.shape.topk = k.K, s.shape.ffn = k.ffn;
  s.shape.fc1_rows = (k.act == cpu::MlpActivation::kSwiglu ? 2 : 1) * k.ffn;
  s.shape.act_bytes = act_bytes;
  s.shape.sigmoid = k.sigmoid;
  s.shape.shared_ffn = k.shared_ffn;
  s.shape.shared_fc1_rows = (k.act == cpu::MlpActivation::kSwiglu ? 2 : 1) * k.shared_ffn;
  s.shape.shared_gate = k.shared_gate;
  s.routing.experts = k.E, s.routing.topk = k.K, s.routing.sigmoid = k.sigmoid;
  s.routing.pre_softmax = k.pre_softmax, s.routing.scaling = static_cast<float>(k.scaling);
  s.routing.groups = k.groups, s.routing.group_topk = k.group_topk;
  s.shape.grouped = k.group_topk > 0;
  s.shape.biased = !k.bias.empty();
  s.shape.seq_tokens = k.seq;
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
    DeviceArray<int32_t> expert(k.n * k.K), plain(k.n * k.K);
    DeviceArray<float> bias(k.bias);
    MoeRouting routing = GpuSpec(k, 4).routing;
    if (!k.bias.empty()) routing.expert_bias = bias.get();
    ASSERT_OK(MoeRouteForward(scores.get(), gates.get(), prob.get(), expert.get(), lse.get(), plain.get(), logits.get(),
                              k.n, routing, gpu.ctx));
    if (k.group_topk > 0 ||
        !k.bias.empty()) {  // the load-balancing loss's counts: each token's plain top-k, as the CPU counts them
      std::vector<float> counts;
      ASSERT_OK(MoeRoutingCounts(&counts, plain.Download().data(), k.n, k.K, k.E));
      ASSERT_EQ(a.group_count.size(), counts.size()) << k.name;
      for (int64_t e = 0; e < k.E; ++e) EXPECT_EQ(counts[e], a.group_count[e]) << k.name << " expert " << e;
      const std::vector<int32_t> got_plain = plain.Download();
      int64_t moved = 0;  // tokens the groups sent elsewhere than their plain top-k: the case tests the grouping
      for (int64_t i = 0; i < k.n * k.K; ++i) moved += got_plain[i] != a.expert[i] ? 1 : 0;
      EXPECT_GT(moved, 0) << k.name;
    }
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

// The CPU layer's pass: the routed experts (and the shared ones where the case has them).
struct CpuLayer {
  std::vector<float> out, dx, dwr, dwe, dws1, dws2, dwg;
  double aux = 0, z = 0, seq = 0;
  std::vector<int64_t> begin;
};

// seq_aux_loss by its definition (Megatron's switch loss on each sequence's plain top-k counts and score sums, the
// mean over the sequences: trainer/cpu/moe_balance.cpp's), its gradient per score into a->balance_grad.
double SeqAuxLoss(cpu::MoeActivations<float>* a, int64_t E, int64_t K, int64_t S, double seq_grad) {
  const int64_t B = a->n / S;
  std::vector<double> counts(B * E, 0.0), sums(B * E, 0.0);
  std::vector<float> col(B * E, 0.0f);
  for (int64_t i = 0; i < a->n; ++i) {
    const float* v = a->scores.data() + i * E;
    std::vector<int32_t> all(E);
    std::iota(all.begin(), all.end(), 0);
    std::partial_sort(all.begin(), all.begin() + K, all.end(),
                      [&](int32_t x, int32_t y) { return v[x] > v[y] || (v[x] == v[y] && x < y); });
    for (int64_t k = 0; k < K; ++k) counts[i / S * E + all[k]] += 1;
    for (int64_t e = 0; e < E; ++e) col[i / S * E + e] += v[e];
  }
  const double unit = double(E) / (double(K) * S * S * B);
  double loss = 0;
  a->balance_tokens = S;
  a->balance_grad.assign(B * E, 0.0);
  for (int64_t j = 0; j < B * E; ++j) {
    loss += double(col[j]) * counts[j];
    a->balance_grad[j] = seq_grad * unit * counts[j];
  }
  return loss * unit;
}
struct LayerInputs {
  std::vector<float> x, wr, we, ws1, ws2, wg, dout;
};

CpuLayer RunCpu(const Case& k, const LayerInputs& in, double aux_grad, double z_grad, double seq_grad) {
  const cpu::MoeSettings s = CpuSettings(k);
  const cpu::SharedExpertSettings ss = SharedSettings(k);
  CpuLayer r;
  cpu::MoeActivations<float> a;
  r.out.assign(k.n * k.c, 0.0f), r.dx.assign(k.n * k.c, 0.0f), r.dwr.assign(in.wr.size(), 0.0f);
  r.dwe.assign(in.we.size(), 0.0f), r.dws1.assign(in.ws1.size(), 0.0f), r.dws2.assign(in.ws2.size(), 0.0f);
  r.dwg.assign(in.wg.size(), 0.0f);
  cpu::MoeRouterForward(&a, in.x.data(), in.wr.data(), k.n, k.c, s);
  cpu::MoeExpertsForward(r.out.data(), &a, in.we.data(), k.c, s);
  cpu::SharedExpertActivations<float> sa;
  const float* wg = k.shared_gate ? in.wg.data() : nullptr;
  if (k.shared_ffn > 0)
    cpu::SharedExpertForward(r.out.data(), &sa, in.x.data(), in.ws1.data(), in.ws2.data(), wg, k.n, k.c, ss);
  r.aux = cpu::MoeAuxLoss(a, s), r.z = cpu::MoeZLoss(a, s);
  if (k.seq > 0) r.seq = SeqAuxLoss(&a, k.E, k.K, k.seq, seq_grad);
  r.begin = a.begin;
  if (k.shared_ffn > 0)
    cpu::SharedExpertBackward(r.dx.data(), r.dws1.data(), r.dws2.data(), k.shared_gate ? r.dwg.data() : nullptr,
                              in.dout.data(), &sa, in.x.data(), in.ws1.data(), in.ws2.data(), wg, k.n, k.c, ss);
  cpu::MoeBackward(r.dx.data(), r.dwr.data(), r.dwe.data(), in.dout.data(), &a, in.x.data(), in.wr.data(), in.we.data(),
                   k.c, s, aux_grad, z_grad);
  return r;
}

template <typename T>
LayerInputs Inputs(const Case& k) {
  const cpu::MoeSettings s = CpuSettings(k);
  const int64_t sf1 = SharedSettings(k).fc1_rows();
  LayerInputs in;
  in.x = RoundTrip<T>(Normal(k.n * k.c, 3));
  in.wr = RoundTrip<T>(Normal(k.E * k.c, 4, 0.0f, 0.5f));
  in.we = RoundTrip<T>(Normal(k.E * s.expert_floats(k.c), 5, 0.0f, 0.3f));
  in.dout = RoundTrip<T>(Normal(k.n * k.c, 6));
  in.ws1 = RoundTrip<T>(Normal(sf1 * k.c, 7, 0.0f, 0.3f));
  in.ws2 = RoundTrip<T>(Normal(k.c * k.shared_ffn, 8, 0.0f, 0.3f));
  in.wg = RoundTrip<T>(Normal(k.shared_gate ? k.c : 0, 9, 0.0f, 0.5f));
  return in;
}

// The whole layer, forward and backward with the load-balancing loss's and the z-loss's gradients.
template <typename T>
void ExpectLayerMatches(const Case& k, double tol) {
  Gpu gpu(/*deterministic=*/true);
  const MoeLossGrads grads{0.3, 0.2, k.seq > 0 ? 0.7 : 0.0};
  const LayerInputs in = Inputs<T>(k);
  const CpuLayer want = RunCpu(k, in, grads.aux, grads.z, grads.seq);
  const MoeLayerSpec spec = GpuSpec(k, sizeof(T));
  const MoeBuffers b = PlanMoeBuffers(spec.shape);
  DeviceArray<T> gx(ToT<T>(in.x)), gwr(ToT<T>(in.wr)), gwe(ToT<T>(in.we)), gdout(ToT<T>(in.dout)), gout(k.n * k.c),
      gdx(k.n * k.c), gws1(ToT<T>(in.ws1)), gws2(ToT<T>(in.ws2)), gwg(ToT<T>(in.wg));
  const bool shared = k.shared_ffn > 0;
  const MoeWeights<T> w{gwr.get(),
                        gwe.get(),
                        shared ? gws1.get() : nullptr,
                        shared ? gws2.get() : nullptr,
                        k.shared_gate ? gwg.get() : nullptr,
                        k.bias.empty() ? nullptr : k.bias.data()};
  DeviceArray<char> saved(b.saved_bytes), scratch(b.scratch_bytes);
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    const std::string what = k.name + (run ? " (again)" : "");
    const auto zeros = [](const std::vector<float>& v) { return std::vector<float>(v.size(), 0.0f); };
    DeviceArray<float> gdwr(zeros(want.dwr)), gdwe(zeros(want.dwe)), gdws1(zeros(want.dws1)), gdws2(zeros(want.dws2)),
        gdwg(zeros(want.dwg));
    const MoeGrads g{gdwr.get(), gdwe.get(), shared ? gdws1.get() : nullptr, shared ? gdws2.get() : nullptr,
                     k.shared_gate ? gdwg.get() : nullptr};
    MoeLayerHost host;
    ASSERT_OK(MoeLayerForward<T>(gout.get(), gx.get(), w, spec, saved.get(), scratch.get(), &host,
                                 MoeLossFlags{true, true, k.seq > 0}, gpu.ctx));
    EXPECT_EQ(host.plan.begin, want.begin) << what;
    EXPECT_NEAR(host.seq_loss, want.seq, 1e-5 * std::fabs(want.seq) + 1e-7) << what;
    EXPECT_EQ(want.seq > 0, k.seq > 0) << what;
    EXPECT_NEAR(host.aux_loss, want.aux, 1e-5 * std::fabs(want.aux) + 1e-7) << what;
    EXPECT_NEAR(host.z_loss, want.z, 1e-5 * std::fabs(want.z) + 1e-7) << what;
    EXPECT_LE(RelL2(ToF(gout.Download()), want.out), tol) << "out " << what;
    ASSERT_OK(MoeLayerBackward<T>(gdx.get(), g, gdout.get(), gx.get(), w, spec, saved.get(), scratch.get(), host, grads,
                                  gpu.ctx));
    const std::vector<std::vector<float>> got = {ToF(gdx.Download()), gdwr.Download(),  gdwe.Download(),
                                                 gdws1.Download(),    gdws2.Download(), gdwg.Download()};
    const std::vector<const std::vector<float>*> ref = {&want.dx,   &want.dwr,  &want.dwe,
                                                        &want.dws1, &want.dws2, &want.dwg};
    const char* names[] = {"dx",
                           "router weight gradient",
                           "experts' weight gradients",
                           "shared fc1 gradient",
                           "shared fc2 gradient",
                           "shared gate gradient"};
    for (size_t i = 0; i < got.size(); ++i) {
      if (ref[i]->empty()) continue;
      EXPECT_LE(RelL2(got[i], *ref[i]), tol) << names[i] << " " << what;
      if (run == 1) ExpectBitwise(got[i], first[i], std::string(names[i]) + " twice " + k.name);
    }
    if (run == 0) first = got;
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
  EXPECT_EQ(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.topk = 2;
  EXPECT_EQ(MoeRouteForward(nullptr, f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.groups = 3, r.group_topk = 1;  // 4 experts in 3 groups
  EXPECT_EQ(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.groups = 2, r.group_topk = 1;  // top-2 from one group of 2: valid
  EXPECT_TRUE(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).ok());
  r.groups = 128, r.experts = 128, r.group_topk = 2;  // more groups than the kernel's mask holds
  EXPECT_EQ(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.groups = 0, r.group_topk = 0, r.experts = 4;
  EXPECT_EQ(MoeGatherRows<float>(f.get(), f.get(), i.get(), 4, 0, 4, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  MoeLayerHost none;
  const MoeLayerSpec spec = GpuSpec(Cases()[0], 4);
  const MoeWeights<float> w{f.get(), f.get()};
  const MoeGrads g{f.get(), f.get()};
  EXPECT_EQ(MoeLayerBackward<float>(f.get(), g, f.get(), f.get(), w, spec, nullptr, nullptr, none, {}, gpu.ctx).code(),
            absl::StatusCode::kFailedPrecondition);
  // Shared experts in the shape without their weights (or the gate's weight without the gate) are refused.
  const MoeLayerSpec shared = GpuSpec(Cases()[4], 4);
  MoeLayerHost host;
  EXPECT_EQ(MoeLayerForward<float>(f.get(), f.get(), w, shared, nullptr, nullptr, &host, {}, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  const MoeWeights<float> gated{f.get(), f.get(), f.get(), f.get(), f.get()};
  EXPECT_EQ(MoeLayerForward<float>(f.get(), f.get(), gated, shared, nullptr, nullptr, &host, {}, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  // The expert bias: missing where the shape has it, or on a softmax router.
  const MoeLayerSpec biased = GpuSpec(Cases()[9], 4);
  ASSERT_TRUE(biased.shape.biased);
  EXPECT_EQ(MoeLayerForward<float>(f.get(), f.get(), w, biased, nullptr, nullptr, &host, {}, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
  r.expert_bias = f.get();
  EXPECT_EQ(MoeRouteForward(f.get(), f.get(), f.get(), i.get(), f.get(), nullptr, f.get(), 2, r, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
}

// The shared experts' gate ops against a direct fp32 reference.
TEST(MoeCuda, SharedGateOpsMatchTheirDefinitions) {
  Gpu gpu(/*deterministic=*/true);
  const int64_t n = 37, c = 300;  // c over a block: each thread sums several columns
  const std::vector<float> x = Normal(n * c, 11), w = Normal(c, 12, 0.0f, 0.1f), y = Normal(n * c, 13),
                           dout = Normal(n * c, 14), src = Normal(n * c, 15), dx0 = Normal(n * c, 16);
  std::vector<float> gate(n), add(n * c), dlogit(n), dy(n * c), dx = dx0, dw(c, 0.5f);
  for (int64_t i = 0; i < n; ++i) {
    double s = 0, d = 0;
    for (int64_t j = 0; j < c; ++j) s += double(x[i * c + j]) * w[j], d += double(dout[i * c + j]) * y[i * c + j];
    gate[i] = static_cast<float>(1 / (1 + std::exp(-s)));
    dlogit[i] = static_cast<float>(d * gate[i] * (1 - gate[i]));
    for (int64_t j = 0; j < c; ++j) {
      add[i * c + j] = y[i * c + j] * gate[i];
      dy[i * c + j] = dout[i * c + j] * gate[i];
      dx[i * c + j] += dlogit[i] * w[j] + src[i * c + j];
    }
  }
  for (int64_t j = 0; j < c; ++j)
    for (int64_t i = 0; i < n; ++i) dw[j] += dlogit[i] * x[i * c + j];
  DeviceArray<float> gx(x), gw(w), gy(y), gdout(dout), gsrc(src), ggate(n), gadd(n * c), gdlogit(n), gdy(n * c),
      gdx(dx0), gdw(std::vector<float>(c, 0.5f));
  ASSERT_OK(MoeSharedGateForward<float>(ggate.get(), gx.get(), gw.get(), n, c, gpu.ctx));
  ExpectClose(ggate.Download(), gate, 1e-5, 1e-6, "gate");
  ASSERT_OK(MoeSharedScale<float>(gadd.get(), gy.get(), ggate.get(), n, c, gpu.ctx));
  ExpectClose(gadd.Download(), add, 1e-5, 1e-6, "gated output");
  ASSERT_OK(MoeSharedScale<float>(gadd.get(), gy.get(), nullptr, n, c, gpu.ctx));
  ExpectBitwise(gadd.Download(), y, "ungated output");
  ASSERT_OK(MoeSharedGateBackward<float>(gdlogit.get(), gdy.get(), gdout.get(), gy.get(), ggate.get(), n, c, gpu.ctx));
  ExpectClose(gdlogit.Download(), dlogit, 1e-4, 1e-6, "gate logit gradient");
  ExpectClose(gdy.Download(), dy, 1e-5, 1e-6, "fc2 output gradient");
  ASSERT_OK(
      MoeSharedInputGrad<float>(gdx.get(), gdw.get(), gsrc.get(), gdlogit.get(), gx.get(), gw.get(), n, c, gpu.ctx));
  ExpectClose(gdx.Download(), dx, 1e-4, 1e-5, "input gradient");
  ExpectClose(gdw.Download(), dw, 1e-4, 1e-5, "gate weight gradient");
  EXPECT_EQ(MoeSharedGateForward<float>(nullptr, gx.get(), gw.get(), n, c, gpu.ctx).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ptk::cuda
