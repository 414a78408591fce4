// The CUDA model's fused paths against their unfused oracles (CudaModelOptions::unfused), part of
// cuda_model_test (gpu-labelled: exits 77 without a device). Each compares one step's loss and
// gradients of two deterministic models: equal bits where the arithmetic is the same, else within
// the relative L2 stated per check.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"
#include "trainer/param_shard.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

// One step's loss and gradients of two CUDA models, one with a fused path and one with its unfused
// oracle (CudaModelOptions::unfused), deterministic: equal bits, or within a relative L2 of `tol`
// per tensor (and `tol` relative on the loss) where the arithmetic differs.
// `base`: options both models share.
void ExpectFusedMatchesUnfused(const GPTConfig& c, Precision p, const cuda::CudaModelOptions& unfused, double tol,
                               const cuda::CudaModelOptions& base = {}) {
  Batches data(2, c.vocab_size);
  auto fused = Cuda(c, p, true, base);
  auto oracle = Cuda(c, p, true, unfused);
  ASSERT_TRUE(fused && oracle);
  ASSERT_TRUE(fused->ZeroGrads().ok() && oracle->ZeroGrads().ok());
  for (int k = 0; k < 2; ++k) {
    auto a = fused->ForwardBackward(data.Get(k), 1.0 / 400, /*train=*/true, 3);
    auto b = oracle->ForwardBackward(data.Get(k), 1.0 / 400, /*train=*/true, 3);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    if (tol == 0)
      EXPECT_EQ(a->loss_sum, b->loss_sum) << PrecisionName(p);
    else
      EXPECT_NEAR(a->loss_sum, b->loss_sum, tol * b->loss_sum) << PrecisionName(p);
  }
  std::vector<float> ga(static_cast<size_t>(fused->num_params())), gb(ga.size());
  ASSERT_TRUE(fused->ReadGrads(ga).ok() && oracle->ReadGrads(gb).ok());
  if (tol == 0) {
    EXPECT_EQ(ga, gb) << PrecisionName(p);
    return;
  }
  for (const ParamInfo& info : fused->params_info())
    EXPECT_LT(RelL2(ga.data() + info.offset, gb.data() + info.offset, info.size), tol)
        << info.name << " " << PrecisionName(p);
}

// The residual gradient passed to the branches' products where no dropout runs, against the copy
// the unfused backward made: the same arithmetic, so the same bits (with dropout both copy).
TEST(CudaModel, ResidualGradPassThroughMatchesCopyBitwise) {
  cuda::CudaModelOptions unfused;
  unfused.unfused.residual_grad_copy = true;
  for (bool dropout : {false, true})
    for (Precision p : {Precision::kFp32, Precision::kBf16})
      ExpectFusedMatchesUnfused(SmallConfig(dropout), p, unfused, 0.0);
}

// Hidden dropout (p = 0.1) inside the residual add + LayerNorm kernels, forward and backward: the
// embedding's (with the first LayerNorm), the attention output's (residual + ln2), the MLP
// output's (residual + the next ln1, and the final residual + the final LayerNorm), against its own
// pass over the branch's output and, in backward, over a copy of the residual gradient. The same
// masks at the same coordinates and the same roundings (the dropped value and the gradient rounded
// to T as the pass stores them), so the same bits in fp32, bf16 and fp16, with the warp-per-row
// LayerNorm backward and with the rows in series. Attention dropout (p = 0.1) runs the same way in
// both (cuDNN's own in bf16/fp16). Without dropout both models run the same kernels (bitwise).
TEST(CudaModel, FusedHiddenDropoutMatchesTheDropoutPassBitwise) {
  cuda::CudaModelOptions pass;
  pass.unfused.dropout_pass = true;
  cuda::CudaModelOptions series = pass, series_base;
  series.unfused.layernorm_rows_in_series = series_base.unfused.layernorm_rows_in_series = true;
  for (bool dropout : {true, false})
    for (Precision p : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
      ExpectFusedMatchesUnfused(SmallConfig(dropout), p, pass, 0.0);
      if (dropout) ExpectFusedMatchesUnfused(SmallConfig(dropout), p, series, 0.0, series_base);
    }
}

// fc2's input gradient with GELU's derivative applied in the product (cuBLASLt's DGELU epilogue,
// aux = fc1's pre-activation) against GELU's backward as its own pass: fp32 runs the same product
// and kernel either way (bitwise); bf16/fp16 take the derivative from the fp32 accumulator instead
// of the product rounded to T, one rounding apart: the loss (forward) bitwise, the gradients within
// 2e-2 (bf16) and 1e-2 (fp16) relative L2 per tensor.
TEST(CudaModel, DgeluEpilogueMatchesSeparateGeluBackward) {
  cuda::CudaModelOptions unfused;
  unfused.unfused.gelu_backward = true;
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kFp32, unfused, 0.0);
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kBf16, unfused, 2e-2);
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kFp16, unfused, 1e-2);
}

// LayerNorm's backward with a warp per row (four rows in flight per block, the row sums by warp
// shuffles, each warp's dw/db partials added in warp order) against the block's rows in series:
// the same terms summed in another fixed order, so within rounding: fp32 1e-5, bf16/fp16 1e-2
// relative L2 per tensor (the loss, a forward value, bitwise). Both deterministic.
TEST(CudaModel, WarpPerRowLayerNormBackwardMatchesRowsInSeries) {
  cuda::CudaModelOptions unfused;
  unfused.unfused.layernorm_rows_in_series = true;
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kFp32, unfused, 1e-5);
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kBf16, unfused, 1e-2);
  ExpectFusedMatchesUnfused(SmallConfig(false), Precision::kFp16, unfused, 1e-2);
}

// The optimizer as one AdamW launch over the table of pieces with the unscale/clip factor folded
// in, against a scaling pass and one launch per tensor: the same fp32 arithmetic (g * factor, then
// AdamWElement), so the same parameter and moment bits over five steps with clipping active
// (clip 0.05), in fp32, bf16 and fp16 with dynamic loss scaling, whole and under a one-rank ZeRO-1
// shard.
TEST(CudaModel, MultiTensorAdamWMatchesPerTensorBitwise) {
  const GPTConfig c = SmallConfig(/*dropout=*/false);
  Batches data(5, c.vocab_size);
  cuda::CudaModelOptions per_tensor;
  per_tensor.unfused.adamw_per_tensor = true;
  for (bool sharded : {false, true})
    for (Precision p : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
      std::vector<std::vector<float>> params, moments;
      for (const cuda::CudaModelOptions& o : {cuda::CudaModelOptions{}, per_tensor}) {
        auto model = Cuda(c, p, true, o);
        ASSERT_TRUE(model);
        if (sharded) {
          ASSERT_TRUE(model->ShardOptimizerState(*ParamShard::Create(model->num_params(), 1, 0)).ok());
        }
        auto comm = MakeLocalCommunicator();
        LossScaleConfig ls;
        if (p == Precision::kFp16) ls.scale = 65536, ls.dynamic = true;
        TrainStep opt(model.get(), OptimizerConfig{0.9, 0.95, 1e-8, 0.05}, Schedule(), comm.get(), ls);
        for (int i = 0; i < 5; ++i) {
          auto r = opt.Step({data.Get(i)}, data.b, 7);
          ASSERT_TRUE(r.ok()) << r.status();
        }
        std::vector<float> w(static_cast<size_t>(model->num_params())), m(static_cast<size_t>(model->moments_size())),
            v(m.size());
        ASSERT_TRUE(model->ReadOwnedParams(w).ok());
        ASSERT_TRUE(model->ReadMoments(m, v).ok());
        params.push_back(w);
        m.insert(m.end(), v.begin(), v.end());
        moments.push_back(m);
      }
      EXPECT_EQ(params[0], params[1]) << PrecisionName(p) << (sharded ? " sharded" : "");
      EXPECT_EQ(moments[0], moments[1]) << PrecisionName(p) << (sharded ? " sharded" : "");
    }
}

// The LM head in chunks of rows (the budget from free memory never splits these small shapes): a
// budget of 100 rows splits a 4x64 micro-batch's 256 rows into balanced chunks of 86, 85 and 85
// (the plan's arithmetic: cuda_memory_plan_test LogitsBudgetSplitsTheHeadIntoBalancedChunks). Loss,
// gradients and evaluation's logits against the one-chunk model: fp32 within 1e-6 (loss) and 1e-5
// (relative L2 per tensor, logits), bf16 within 1e-3 and 1e-2 (another product shape may round
// differently; the chunks' dW adds in another order).
TEST(CudaModel, ChunkedLmHeadMatchesOneChunk) {
  const GPTConfig c = SmallConfig(/*dropout=*/false);
  Batches data(1, c.vocab_size);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    cuda::CudaModelOptions chunked;
    chunked.logits_budget_bytes = 100 * c.padded_vocab_size * (p == Precision::kFp32 ? 4 : 2);
    auto one = Cuda(c, p);
    auto three = Cuda(c, p, true, chunked);
    ASSERT_TRUE(one && three);
    ASSERT_TRUE(one->ZeroGrads().ok());
    ASSERT_TRUE(three->ZeroGrads().ok());
    auto a = one->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5);
    auto b = three->ForwardBackward(data.Get(0), 1.0 / 200, /*train=*/true, 5);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    const double loss_tol = p == Precision::kFp32 ? 1e-6 : 1e-3, tol = p == Precision::kFp32 ? 1e-5 : 1e-2;
    EXPECT_EQ(a->tokens, b->tokens);
    EXPECT_NEAR(b->loss_sum, a->loss_sum, loss_tol * a->loss_sum) << PrecisionName(p);
    std::vector<float> ga(static_cast<size_t>(one->num_params())), gb(ga.size());
    ASSERT_TRUE(one->ReadGrads(ga).ok());
    ASSERT_TRUE(three->ReadGrads(gb).ok());
    for (const ParamInfo& info : one->params_info())
      EXPECT_LE(RelL2(gb.data() + info.offset, ga.data() + info.offset, info.size), tol)
          << info.name << " " << PrecisionName(p);
    std::vector<float> la, lb;
    ASSERT_TRUE(one->Forward(data.Get(0), &la).ok());
    ASSERT_TRUE(three->Forward(data.Get(0), &lb).ok());
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_LE(RelL2(lb.data(), la.data(), static_cast<int64_t>(la.size())), tol) << PrecisionName(p);
  }
}

}  // namespace
}  // namespace ptk
