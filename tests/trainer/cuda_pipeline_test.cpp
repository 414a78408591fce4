// The CUDA model's pipeline stages on one GPU: P = 2 and 4 stages of a 4-layer model as threads of
// this process sharing the device, each its own CUDA model over its stage's layers, running
// Megatron's 1F1B schedule (ForwardBackwardPipelining) over gloo's point-to-point messages (the
// host spans the stages exchange; NCCL cannot put two ranks on one GPU), the tied embeddings'
// copies summed over the embedding group through the host. Against the one-stage CUDA model over
// the same 8 micro-batches (dropout on): the last stage's loss sum, each stage's gradients mapped
// into the whole layout, the evaluation loss; fp32 tightly, bf16 within its rounding. Also the
// slots: a backward of a slot that holds no forward pass, and a slot past the P - s this stage
// keeps, are refused. gpu-labelled: exit 77 without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;

GPTConfig Config() {
  GPTConfig c = cuda_model_test::SmallConfig(/*dropout=*/true);
  c.num_layers = 4;
  return c;
}

std::vector<PipelineStage> Stages(int P) {
  std::vector<int64_t> layers(static_cast<size_t>(P), 4 / P);
  std::vector<PipelineStage> v;
  for (int s = 0; s < P; ++s) v.push_back(StageOf(layers, s));
  return v;
}

struct Reference {
  LossSum loss, eval;
  std::vector<float> grads;
};

Reference OneStage(const GPTConfig& c, Precision p, const std::vector<ModelBatch>& mbs,
                   const std::vector<double>& scales) {
  Reference ref;
  std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, p);
  EXPECT_NE(m, nullptr);
  if (!m) return ref;
  EXPECT_TRUE(m->ZeroGrads().ok());
  for (size_t k = 0; k < mbs.size(); ++k) {
    auto l = m->ForwardBackward(mbs[k], scales[k], /*train=*/true, 99);
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return ref;
    ref.loss.loss_sum += l->loss_sum;
    ref.loss.tokens += l->tokens;
  }
  ref.grads.assign(static_cast<size_t>(m->num_params()), 0.0f);
  EXPECT_TRUE(m->ReadGrads(ref.grads).ok());
  auto e = m->Forward(mbs[0], nullptr);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) ref.eval = *e;
  return ref;
}

// `loss_tol`: relative, the loss sums; `grad_tol`: of the largest gradient of each tensor.
void CheckStagesGiveOneStage(int P, Precision p, double loss_tol, double grad_tol) {
  const GPTConfig c = Config();
  const Batches data(8, c.vocab_size);
  std::vector<ModelBatch> mbs;
  std::vector<double> scales;
  for (int k = 0; k < 8; ++k) {
    mbs.push_back(data.Get(k));
    scales.push_back(1.0 / 2048.0 * (1.0 + 0.01 * k));
  }
  const Reference ref = OneStage(c, p, mbs, scales);
  ASSERT_FALSE(ref.grads.empty());
  const std::vector<PipelineStage> stages = Stages(P);
  std::mutex mu;
  testing::RunRanks(P, [&](Communicator* comm, int s) {
    cuda::CudaModelOptions o;
    o.pipeline = stages[static_cast<size_t>(s)];
    std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, p, /*deterministic=*/true, o);
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(m->ZeroGrads().ok());
    PipelineStats stats;
    auto loss = ForwardBackwardPipelining(m.get(), comm, mbs, scales, 99, &stats);
    ASSERT_TRUE(loss.ok()) << loss.status();
    std::unique_ptr<Communicator> emb;  // the embedding group: the first and the last stage
    if (s == 0 || s == P - 1) {
      const std::vector<int> members = {0, P - 1};
      auto g = comm->Subgroup(members, "embedding");
      ASSERT_TRUE(g.ok()) << g.status();
      emb = *std::move(g);
      const ParamLayout& lay = m->layout();
      ASSERT_TRUE(
          m->AllReduceGradRange(emb.get(), s == 0 ? lay.wte : lay.out_w, c.padded_vocab_size * c.hidden_size).ok());
    }
    auto eval = ForwardPipelining(m.get(), comm, mbs[0]);
    ASSERT_TRUE(eval.ok()) << eval.status();
    std::vector<float> mine(static_cast<size_t>(m->num_params())), want(mine.size());
    ASSERT_TRUE(m->ReadGrads(mine).ok());
    CopyToShard(m->layout(), ref.grads, want);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(stats.max_in_flight, P - s) << "stage " << s;
    if (s == P - 1) {
      EXPECT_NEAR(loss->loss_sum, ref.loss.loss_sum, loss_tol * ref.loss.loss_sum);
      EXPECT_EQ(loss->tokens, ref.loss.tokens);
      EXPECT_NEAR(eval->loss_sum, ref.eval.loss_sum, loss_tol * ref.eval.loss_sum);
      std::printf("P=%d %s: loss sum %.9g vs one stage %.9g\n", P, PrecisionName(p).data(), loss->loss_sum,
                  ref.loss.loss_sum);
    } else {
      EXPECT_EQ(loss->tokens, 0.0);
    }
    for (const ParamInfo& info : m->params_info()) {
      double worst = 0, scale = 0;
      for (int64_t i = info.offset; i < info.offset + info.size; ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(mine[i]) - want[i]));
        scale = std::max(scale, std::abs(static_cast<double>(want[i])));
      }
      EXPECT_LE(worst, grad_tol * scale) << info.name << " on stage " << s << " of " << P;
    }
  });
}

TEST(CudaPipeline, TwoStagesFollowOneStageFp32) { CheckStagesGiveOneStage(2, Precision::kFp32, 1e-6, 1e-5); }
TEST(CudaPipeline, FourStagesFollowOneStageFp32) { CheckStagesGiveOneStage(4, Precision::kFp32, 1e-6, 1e-5); }
TEST(CudaPipeline, TwoStagesFollowOneStageBf16) { CheckStagesGiveOneStage(2, Precision::kBf16, 1e-3, 3e-2); }

TEST(CudaPipeline, SlotsAreChecked) {
  const GPTConfig c = Config();
  const Batches data(1, c.vocab_size);
  cuda::CudaModelOptions o;
  o.pipeline = Stages(2)[0];  // the first of two stages: two slots
  std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
  ASSERT_NE(m, nullptr);
  const ModelBatch mb = data.Get(0);
  std::vector<float> y(static_cast<size_t>(m->StageExchangeFloats(mb))), dy(y.size());
  auto past = m->StageForward(mb, 2, {}, y, 1.0, true, 99);
  EXPECT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("slot 2 outside the 2"), std::string_view::npos) << past.status();
  const absl::Status none = m->StageBackward(mb, 1, dy, {}, true, 99);
  EXPECT_NE(none.message().find("holds no forward pass"), std::string_view::npos) << none;
  auto fwd = m->StageForward(mb, 1, {}, y, 1.0, true, 99);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(m->StageBackward(mb, 1, dy, {}, true, 99).ok());
  EXPECT_FALSE(m->StageBackward(mb, 1, dy, {}, true, 99).ok());  // its forward pass is spent
}

}  // namespace
}  // namespace ptk
