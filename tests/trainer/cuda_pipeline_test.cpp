// The CUDA model's pipeline stages on one GPU: P = 2 and 4 stages of a 4-layer model as threads of
// this process sharing the device, each its own CUDA model over its stage's layers, running
// Megatron's 1F1B schedule (ForwardBackwardPipelining). NCCL cannot put two ranks on one GPU, so
// the pipeline group is gloo ranks offered as a device communicator
// (testing::StagedDeviceCollectives): the stages take the direct exchange (their device buffers
// in the model's dtype through SendRecvDevice), which that communicator stages through the host;
// the tied embeddings' copies are summed over the embedding group through the host. Against the
// one-stage CUDA model over the same 8 micro-batches (dropout on): the last stage's loss sum, each
// stage's gradients mapped into the whole layout, the evaluation loss; fp32 tightly, bf16 within
// its rounding. The direct exchange against the host exchange (the oracle,
// CudaModelOptions::unfused.pipeline_host_exchange: fp32 host spans) over three training steps
// with dropout: losses, the first step's gradients and the parameters after the steps bit for bit,
// fp32 at P = 2 and 4, bf16 at P = 2 (bf16 values survive the fp32 staging exactly). Also the
// slots: a backward of a slot that holds no forward pass, and a slot past the P - s this stage
// keeps, are refused; the direct buffers are the slot's device memory in the model's dtype; an input
// received into a slot survives the re-plan another slot's larger micro-batch causes before its forward. Tied
// embeddings at P = 2 x D = 2 with ZeRO-1 get Megatron's finalize_model_grads order, bit for bit.
// The same stage checks with --qk-layernorm. gpu-labelled: exit 77 without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/param_shard.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/train_step.h"

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

// The embedding group (the first and the last stage) for stage s of P; null on the other stages.
std::unique_ptr<Communicator> EmbeddingGroup(Communicator* comm, int s, int P) {
  if (s != 0 && s != P - 1) return nullptr;
  const std::vector<int> members = {0, P - 1};
  auto g = comm->Subgroup(members, "embedding");
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *std::move(g) : nullptr;
}

// `loss_tol`: relative, the loss sums; `grad_tol`: of the largest gradient of each tensor.
void CheckStagesGiveOneStage(int P, Precision p, double loss_tol, double grad_tol, const GPTConfig& c = Config()) {
  const Batches data(8, c.vocab_size);
  std::vector<ModelBatch> mbs;
  std::vector<double> scales;
  for (int k = 0; k < 8; ++k) {
    mbs.push_back(data.Get(k));
    scales.push_back(1.0 / 2048.0 * (1.0 + 0.01 * k));
  }
  const cuda_model_test::OneDeviceRun ref = cuda_model_test::OneDevice(c, p, mbs, scales);
  ASSERT_FALSE(ref.grads.empty());
  const std::vector<PipelineStage> stages = Stages(P);
  std::mutex mu;
  testing::RunRanks(P, [&](Communicator* comm, int s) {
    testing::StagedDeviceCollectives pipe(comm);
    cuda::CudaModelOptions o;
    o.pipeline = stages[static_cast<size_t>(s)];
    std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, p, /*deterministic=*/true, o);
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(m->ZeroGrads().ok());
    PipelineStats stats;
    auto loss = ForwardBackwardPipelining(m.get(), &pipe, mbs, scales, 99, &stats);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_GE(pipe.device_messages(), 8);  // the direct exchange ran: each micro-batch's messages
    std::unique_ptr<Communicator> emb = EmbeddingGroup(comm, s, P);
    if (s == 0 || s == P - 1) {
      ASSERT_NE(emb, nullptr);
      const ParamLayout& lay = m->layout();
      ASSERT_TRUE(
          m->AllReduceGradRange(emb.get(), s == 0 ? lay.wte : lay.out_w, c.padded_vocab_size * c.hidden_size).ok());
    }
    auto eval = ForwardPipelining(m.get(), &pipe, mbs[0]);
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
// --qk-layernorm: each stage's layers' query and key norms, their inputs and statistics kept per
// slot (LayerNorm with biases, and RMSNorm), fp32 and bf16.
TEST(CudaPipeline, QKLayerNormStagesFollowOneStage) {
  for (Normalization norm : {Normalization::kLayerNorm, Normalization::kRMSNorm}) {
    GPTConfig c = Config();
    c.qk_layernorm = true;
    c.normalization = norm;
    SCOPED_TRACE(norm == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm");
    CheckStagesGiveOneStage(2, Precision::kFp32, 1e-6, 1e-5, c);
    CheckStagesGiveOneStage(2, Precision::kBf16, 1e-3, 3e-2, c);
  }
}

// Three training steps (TrainStep over the stages, 4 micro-batches a step, dropout on) with the
// direct exchange or the host one: each step's loss, the first step's gradients and the
// parameters after the steps, per stage.
struct StepsRun {
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<float>> grads, params;
};
StepsRun TrainStages(int P, Precision p, bool host_exchange) {
  const GPTConfig c = Config();
  constexpr int kSteps = 3, kMicro = 4;
  const Batches data(kSteps * kMicro, c.vocab_size);
  const std::vector<PipelineStage> stages = Stages(P);
  StepsRun out{std::vector<std::vector<double>>(static_cast<size_t>(P)),
               std::vector<std::vector<float>>(static_cast<size_t>(P)),
               std::vector<std::vector<float>>(static_cast<size_t>(P))};
  std::mutex mu;
  testing::RunRanks(P, [&](Communicator* comm, int s) {
    testing::StagedDeviceCollectives pipe(comm);
    cuda::CudaModelOptions o;
    o.pipeline = stages[static_cast<size_t>(s)];
    o.unfused.pipeline_host_exchange = host_exchange;
    std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, p, /*deterministic=*/true, o);
    ASSERT_NE(m, nullptr);
    std::unique_ptr<Communicator> emb = EmbeddingGroup(comm, s, P);
    ASSERT_EQ(emb == nullptr, s != 0 && s != P - 1);
    std::unique_ptr<Communicator> data_group = MakeLocalCommunicator();
    TrainStep step(m.get(), OptimizerConfig{}, cuda_model_test::Schedule(), data_group.get());
    step.set_pipeline(&pipe, emb.get());
    std::vector<double> losses;
    std::vector<float> grads;
    for (int it = 0; it < kSteps; ++it) {
      std::vector<ModelBatch> mbs;
      for (int k = 0; k < kMicro; ++k) mbs.push_back(data.Get(it * kMicro + k));
      auto r = step.ComputeGradients(mbs, 99);
      ASSERT_TRUE(r.ok()) << r.status();
      losses.push_back(r->loss_sum);
      if (it == 0) {
        grads.assign(static_cast<size_t>(m->num_params()), 0.0f);
        ASSERT_TRUE(m->ReadGrads(grads).ok());
      }
      ASSERT_TRUE(step.ApplyUpdate(*r, kMicro * data.b).ok());
    }
    std::vector<float> params(static_cast<size_t>(m->num_params()));
    ASSERT_TRUE(m->ReadParams(params).ok());
    std::lock_guard<std::mutex> lock(mu);
    out.losses[static_cast<size_t>(s)] = losses;
    out.grads[static_cast<size_t>(s)] = grads;
    out.params[static_cast<size_t>(s)] = params;
  });
  return out;
}

void CheckDirectExchangeGivesHostExchangeBits(int P, Precision p) {
  const StepsRun host = TrainStages(P, p, /*host_exchange=*/true);
  const StepsRun direct = TrainStages(P, p, /*host_exchange=*/false);
  for (int s = 0; s < P; ++s) {
    const size_t i = static_cast<size_t>(s);
    ASSERT_EQ(host.losses[i].size(), 3u) << "stage " << s;
    EXPECT_EQ(direct.losses[i], host.losses[i]) << "stage " << s;
    for (const auto* v : {&host.grads, &host.params}) ASSERT_FALSE((*v)[i].empty()) << "stage " << s;
    ASSERT_EQ(direct.grads[i].size(), host.grads[i].size());
    ASSERT_EQ(direct.params[i].size(), host.params[i].size());
    EXPECT_EQ(std::memcmp(direct.grads[i].data(), host.grads[i].data(), host.grads[i].size() * sizeof(float)), 0)
        << "gradients of stage " << s;
    EXPECT_EQ(std::memcmp(direct.params[i].data(), host.params[i].data(), host.params[i].size() * sizeof(float)), 0)
        << "parameters of stage " << s;
  }
}

TEST(CudaPipeline, DirectExchangeGivesTheHostExchangesBitsTwoStagesFp32) {
  CheckDirectExchangeGivesHostExchangeBits(2, Precision::kFp32);
}
TEST(CudaPipeline, DirectExchangeGivesTheHostExchangesBitsFourStagesFp32) {
  CheckDirectExchangeGivesHostExchangeBits(4, Precision::kFp32);
}
TEST(CudaPipeline, DirectExchangeGivesTheHostExchangesBitsTwoStagesBf16) {
  CheckDirectExchangeGivesHostExchangeBits(2, Precision::kBf16);
}

// P = 2 stages x D = 2 data ranks (world rank d + 2p) of tied embeddings with ZeRO-1, the data
// group a device communicator (its reduce-scatter and all-gather on the model's device buffers):
// each rank's shard of the gradients after one step's ComputeGradients against Megatron's
// finalize_model_grads order built here from each rank's own gradients (its pipeline's backward
// alone): the data-parallel sums first, then the embedding group's sum of the two stages' copies,
// (a0 + a1) + (b0 + b1). The stages' shards cut their copies at different places, so the copies
// must be whole before the embedding group adds them. fp32, bit for bit.
TEST(CudaPipeline, TiedEmbeddingGradientsAreSummedAfterTheDataParallelReductionZero1) {
  const GPTConfig c = Config();
  constexpr int kMicro = 2;
  const Batches data(2 * kMicro, c.vocab_size);
  const std::vector<PipelineStage> stages = Stages(2);
  std::vector<std::vector<float>> local(4), got(4);
  std::vector<std::pair<int64_t, int64_t>> shard_of(4);
  std::vector<int64_t> tied_at(2);
  std::mutex mu;
  for (bool train_step : {false, true})
    testing::RunRanks(4, [&](Communicator* world, int rank) {
      const int d = rank % 2, p = rank / 2;
      const std::vector<int> pm = {d, d + 2}, dm = {2 * p, 2 * p + 1};
      auto pipe_host = world->Subgroup(pm, "pipeline" + std::to_string(d));
      ASSERT_TRUE(pipe_host.ok()) << pipe_host.status();
      auto dp_host = world->Subgroup(dm, "data" + std::to_string(p));
      ASSERT_TRUE(dp_host.ok()) << dp_host.status();
      auto emb_host = world->Subgroup(pm, "embedding" + std::to_string(d));
      ASSERT_TRUE(emb_host.ok()) << emb_host.status();
      testing::StagedDeviceCollectives pipe(pipe_host->get()), dp(dp_host->get()), emb(emb_host->get());
      cuda::CudaModelOptions o;
      o.pipeline = stages[static_cast<size_t>(p)];
      std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
      ASSERT_NE(m, nullptr);
      auto shard = ParamShard::Create(m->num_params(), 2, d);
      ASSERT_TRUE(shard.ok());
      ASSERT_TRUE(m->ShardOptimizerState(*shard).ok());
      std::vector<ModelBatch> mine;
      std::vector<double> scales;  // Megatron's: the token mean / micro-batches / data ranks
      for (int k = 0; k < kMicro; ++k) {
        mine.push_back(data.Get(d * kMicro + k));
        double tokens = 0;
        for (int64_t i = 0; i < mine.back().b * mine.back().t; ++i) tokens += mine.back().loss_mask[i];
        scales.push_back(1.0 / (tokens * kMicro * 2.0));
      }
      if (train_step) {
        TrainStep step(m.get(), OptimizerConfig{}, cuda_model_test::Schedule(), &dp);
        step.set_pipeline(&pipe, &emb);
        auto r = step.ComputeGradients(mine, 99);
        ASSERT_TRUE(r.ok()) << r.status();
      } else {
        ASSERT_TRUE(m->ZeroGrads().ok());
        auto loss = ForwardBackwardPipelining(m.get(), &pipe, mine, scales, 99);
        ASSERT_TRUE(loss.ok()) << loss.status();
      }
      std::vector<float> g(static_cast<size_t>(m->num_params()));
      ASSERT_TRUE(m->ReadGrads(g).ok());
      std::lock_guard<std::mutex> lock(mu);
      (train_step ? got : local)[static_cast<size_t>(rank)] = std::move(g);
      shard_of[static_cast<size_t>(rank)] = {shard->begin(), shard->end()};
      tied_at[static_cast<size_t>(p)] = p == 0 ? m->layout().wte : m->layout().out_w;
    });
  const int64_t tied_n = c.padded_vocab_size * c.hidden_size;
  int64_t tied_checked = 0;
  for (int rank = 0; rank < 4; ++rank) {
    const size_t p = static_cast<size_t>(rank / 2);
    const auto &a0 = local[2 * p], &a1 = local[2 * p + 1], &g = got[static_cast<size_t>(rank)];
    ASSERT_FALSE(a0.empty());
    ASSERT_EQ(g.size(), a0.size());
    const auto [begin, end] = shard_of[static_cast<size_t>(rank)];
    int64_t differ = 0;
    for (int64_t i = begin; i < end; ++i) {
      float want = a0[static_cast<size_t>(i)] + a1[static_cast<size_t>(i)];
      const int64_t e = i - tied_at[p];
      if (e >= 0 && e < tied_n) {
        const size_t e0 = static_cast<size_t>(tied_at[0] + e), e1 = static_cast<size_t>(tied_at[1] + e);
        want = (local[0][e0] + local[1][e0]) + (local[2][e1] + local[3][e1]);
        ++tied_checked;
      }
      differ += std::memcmp(&want, &g[static_cast<size_t>(i)], sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0) << "rank " << rank << ": gradients that differ from Megatron's order";
  }
  EXPECT_EQ(tied_checked, 2 * tied_n);  // each stage's copy, in some data rank's shard
}

// The direct buffers: the slot's device memory in the model's dtype on the model's stream, none
// where the stage has no neighbour; a host communicator gets the host exchange (fp32 host memory).
TEST(CudaPipeline, DirectBuffersAreTheSlotsDeviceMemory) {
  const GPTConfig c = Config();
  const Batches data(1, c.vocab_size);
  const ModelBatch mb = data.Get(0);
  cuda::CudaModelOptions o;
  o.pipeline = Stages(4)[1];  // a middle stage: three slots
  std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, Precision::kBf16, /*deterministic=*/true, o);
  ASSERT_NE(m, nullptr);
  auto b0 = m->StageBuffers(mb, 0, /*device_memory=*/true);
  auto b1 = m->StageBuffers(mb, 1, true);
  ASSERT_TRUE(b0.ok() && b1.ok()) << b0.status() << b1.status();
  EXPECT_EQ(b0->wire, Precision::kBf16);
  EXPECT_EQ(b0->elements, m->StageExchangeFloats(mb));
  EXPECT_EQ(b0->bytes(), b0->elements * 2);
  EXPECT_NE(b0->stream, nullptr);
  EXPECT_NE(b0->input, b1->input);
  EXPECT_NE(b0->output, b1->output);
  EXPECT_EQ(b0->output_grad, b0->input_grad);  // the residual gradient, in and out
  for (const void* ptr : {b0->input, b0->output, b0->output_grad}) {
    cudaPointerAttributes a{};
    ASSERT_EQ(cudaPointerGetAttributes(&a, ptr), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  }
  EXPECT_FALSE(m->StageBuffers(mb, 3, true).ok());  // past the three slots
  auto host = m->StageBuffers(mb, 0, /*device_memory=*/false);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->wire, Precision::kFp32);
  EXPECT_EQ(host->stream, nullptr);
}

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

// An activation received into a slot ahead of its forward pass survives the re-plan another slot's
// larger micro-batch causes before that forward (PlanStageReplan carries it): the slot's output is
// the one a model that never re-planned gives for the same input.
TEST(CudaPipeline, AReceivedInputSurvivesAnotherSlotsReplan) {
  GPTConfig c = Config();
  c.hidden_dropout = c.attention_dropout = 0.0;
  const Batches small(1, c.vocab_size, /*b=*/1), big(1, c.vocab_size, /*b=*/8);  // planned for 4
  cuda::CudaModelOptions o;
  o.pipeline = Stages(4)[1];  // a middle stage: an input and an output, three slots
  std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
  std::unique_ptr<GPTModel> ref = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
  ASSERT_TRUE(m && ref);
  const int64_t n = m->StageExchangeFloats(small.Get(0));
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = static_cast<float>(std::sin(0.37 * i));
  // run: receives x into slot 0 (a device copy in the receive's place), then, when `replan`, asks
  // for slot 1's buffers for a micro-batch larger than planned before slot 0's forward pass.
  auto run = [&](GPTModel* model, bool replan) {
    std::vector<float> y(x.size());
    auto in = model->StageBuffers(small.Get(0), 0, /*device_memory=*/true);
    EXPECT_TRUE(in.ok()) << in.status();
    if (!in.ok()) return y;
    EXPECT_EQ(cudaMemcpy(in->input, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    if (replan) {
      auto other = model->StageBuffers(big.Get(0), 1, true);
      EXPECT_TRUE(other.ok()) << other.status();
    }
    auto fwd = model->StageForwardExchanged(small.Get(0), 0, std::nullopt, /*train=*/false, 99);
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_TRUE(model->Synchronize().ok());  // the pass runs on the model's own (non-blocking) stream
    auto out = model->StageBuffers(small.Get(0), 0, true);
    EXPECT_TRUE(out.ok()) << out.status();
    if (out.ok()) {
      EXPECT_EQ(cudaMemcpy(y.data(), out->output, y.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return y;
  };
  const std::vector<float> want = run(ref.get(), false), got = run(m.get(), true);
  EXPECT_LT(cuda_model_test::RelL2(got.data(), want.data(), n), 1e-6);
}

}  // namespace
}  // namespace ptk
