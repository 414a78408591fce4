// The CUDA model's interleaved pipeline schedule (Megatron's virtual stages) and its pipeline stages
// under --sequence-parallel, on one GPU: the stages are threads of this process sharing the device,
// each its own CUDA model over its stage's chunks; NCCL cannot put two ranks on one GPU, so the
// pipeline (and tensor) groups are gloo ranks offered as device communicators
// (testing::StagedDeviceCollectives): the stages take the direct exchange (their device buffers in
// the model's dtype, batched as NCCL's groups are: BatchSendRecvDevice), which that communicator
// stages through the host. Over 8 micro-batches with dropout on, against the one-GPU CUDA model,
// the CUDA 1F1B schedule without chunks and the CPU backend's interleaved schedule: the last
// stage's loss sum, every stage's gradients put back into the whole layout, the evaluation loss;
// fp32 tightly (the CPU within the CUDA backend's fp32 tolerance), bf16 within its rounding. The
// direct exchange against the host exchange (CudaModelOptions::unfused.pipeline_host_exchange, the
// oracle) bit for bit. T = 2 x P = 2 with --sequence-parallel (V = 1 and 2): the stages exchange
// each tensor rank's positions, and the run follows one GPU. --overlap-grad-reduce with chunks
// (P = 2 x D = 2 x V = 2, TrainStep, the data group staged too): each chunk's buckets launched on
// the communication stream by its last backward, the parameters of the reduction after the
// schedule bit for bit. --qk-layernorm with chunks follows one GPU. gpu-labelled: exit 77 without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;
using cuda_model_test::RelL2;

GPTConfig Config(int64_t layers) {
  GPTConfig c = cuda_model_test::SmallConfig(/*dropout=*/true);
  c.num_layers = layers;
  return c;
}

// grads: every stage's (and tensor rank's) put back into the whole layout.
struct StageRun : cuda_model_test::OneDeviceRun {
  int device_messages = 0;  // the direct exchange's calls, all stages
};

struct Case {
  int P = 2, V = 1, T = 1;
  Precision precision = Precision::kFp32;
  bool cpu = false, host_exchange = false, sequence_parallel = false;
};

struct Data {
  Batches batches;
  std::vector<ModelBatch> mbs;
  std::vector<double> scales;
  explicit Data(int64_t vocab) : batches(8, vocab) {
    for (int k = 0; k < 8; ++k) {
      mbs.push_back(batches.Get(k));
      scales.push_back(1.0 / 2048.0 * (1.0 + 0.01 * k));
    }
  }
};

StageRun OneGpu(const GPTConfig& c, Precision p, const Data& d) {
  return StageRun{cuda_model_test::OneDevice(c, p, d.mbs, d.scales)};
}

std::unique_ptr<Communicator> Group(Communicator* comm, std::vector<int> members, const char* name) {
  auto g = comm->Subgroup(members, name);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *std::move(g) : nullptr;
}

// One rank of T x P (rank t + T p: Megatron's order, tensor ranks adjacent): its model, the step
// through the schedule, the sums TrainStep makes after it, the evaluation; its gradients into `out`.
void RunRank(const GPTConfig& c, const Case& su, const Data& d, Communicator* world, int rank, std::mutex* mu,
             StageRun* out) {
  const int t = rank % su.T, s = rank / su.T;
  std::unique_ptr<Communicator> tensor_host = su.T > 1 ? Group(world, {s * su.T, s * su.T + 1}, "tensor") : nullptr;
  std::vector<int> pipe_members;
  for (int q = 0; q < su.P; ++q) pipe_members.push_back(t + q * su.T);
  std::unique_ptr<Communicator> pipe_host = su.T > 1 ? Group(world, pipe_members, "pipeline") : nullptr;
  Communicator* pipe_comm = pipe_host ? pipe_host.get() : world;
  testing::StagedDeviceCollectives pipe(pipe_comm);
  std::unique_ptr<testing::StagedDeviceCollectives> tensor;
  if (tensor_host) tensor = std::make_unique<testing::StagedDeviceCollectives>(tensor_host.get());
  const PipelineStage stage = StageOf(std::vector<int64_t>(static_cast<size_t>(su.P), c.num_layers / su.P), s, su.V);
  std::unique_ptr<GPTModel> m;
  if (su.cpu) {
    auto made = CpuGPTModel::Create(c, nullptr, false, stage);
    ASSERT_TRUE(made.ok()) << made.status();
    m = std::move(*made);
    ASSERT_TRUE(m->InitWeights(1234).ok());
  } else {
    cuda::CudaModelOptions o;
    o.pipeline = stage;
    o.unfused.pipeline_host_exchange = su.host_exchange;
    o.tensor = tensor.get();
    o.sequence_parallel = su.sequence_parallel;
    m = cuda_model_test::Cuda(c, su.precision, /*deterministic=*/true, o);
  }
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->ZeroGrads().ok());
  Communicator* schedule_comm = su.cpu ? pipe_comm : static_cast<Communicator*>(&pipe);
  auto loss = ForwardBackwardPipelining(m.get(), schedule_comm, d.mbs, d.scales, 99);
  ASSERT_TRUE(loss.ok()) << loss.status();
  // TrainStep's order (Megatron's finalize_model_grads): the tensor group's partial sums, then the
  // embedding group's copies (stages 0 and P - 1: the whole pipeline group here).
  if (m->sums_non_tensor_parallel_grads()) {
    ASSERT_TRUE(m->SumNonTensorParallelGrads().ok());
  }
  const ParamLayout& lay = m->layout();
  if (s == 0 || s == su.P - 1) {
    std::unique_ptr<Communicator> emb = su.P == 2 ? nullptr : Group(pipe_comm, {0, su.P - 1}, "embedding");
    const int64_t rows = c.padded_vocab_size / su.T;
    ASSERT_TRUE(
        m->AllReduceGradRange(emb ? emb.get() : pipe_comm, s == 0 ? lay.wte : lay.out_w, rows * c.hidden_size).ok());
  }
  auto eval = ForwardPipelining(m.get(), schedule_comm, d.mbs[0]);
  ASSERT_TRUE(eval.ok()) << eval.status();
  std::vector<float> mine(static_cast<size_t>(m->num_params()));
  ASSERT_TRUE(m->ReadGrads(mine).ok());
  std::lock_guard<std::mutex> lock(*mu);
  CopyFromShard(lay, mine, out->grads);
  out->device_messages += pipe.device_messages();
  if (s == su.P - 1 && t == 0) {
    out->loss = *loss;
    out->eval = *eval;
  }
}

StageRun Stages(const GPTConfig& c, const Case& su, const Data& d) {
  StageRun out;
  out.grads.assign(static_cast<size_t>(ParamLayout::Create(c)->num_params), 0.0f);
  std::mutex mu;
  testing::RunRanks(su.T * su.P, [&](Communicator* world, int rank) { RunRank(c, su, d, world, rank, &mu, &out); });
  return out;
}

// `loss_tol`: relative, the loss sums; `grad_tol`: of the largest gradient of each tensor.
void ExpectFollows(const GPTConfig& c, const StageRun& got, const StageRun& want, double loss_tol, double grad_tol,
                   const char* what) {
  SCOPED_TRACE(what);
  EXPECT_NEAR(got.loss.loss_sum, want.loss.loss_sum, loss_tol * want.loss.loss_sum);
  EXPECT_EQ(got.loss.tokens, want.loss.tokens);
  EXPECT_NEAR(got.eval.loss_sum, want.eval.loss_sum, loss_tol * want.eval.loss_sum);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  auto whole = ParamLayout::Create(c);
  for (const ParamInfo& info : whole->infos) {
    double worst = 0, scale = 0;
    for (int64_t i = info.offset; i < info.offset + info.size; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(got.grads[i]) - want.grads[i]));
      scale = std::max(scale, std::abs(static_cast<double>(want.grads[i])));
    }
    EXPECT_LE(worst, grad_tol * scale) << info.name;
  }
  std::printf("%s: loss sum %.9g vs %.9g\n", what, got.loss.loss_sum, want.loss.loss_sum);
}

void CheckInterleavedFollows(int P, int64_t layers) {
  const GPTConfig c = Config(layers);
  const Data d(c.vocab_size);
  const StageRun one = OneGpu(c, Precision::kFp32, d);
  ASSERT_FALSE(one.grads.empty());
  const StageRun v = Stages(c, Case{.P = P, .V = 2}, d);
  EXPECT_GT(v.device_messages, 0);  // the direct exchange ran
  ExpectFollows(c, v, one, 1e-6, 1e-5, "CUDA interleaved vs one GPU");
  ExpectFollows(c, v, Stages(c, Case{.P = P, .V = 1}, d), 1e-6, 1e-5, "CUDA interleaved vs CUDA 1F1B");
  const StageRun cpu = Stages(c, Case{.P = P, .V = 2, .cpu = true}, d);
  ExpectFollows(c, v, cpu, 1e-5, 1e-4, "CUDA interleaved vs CPU interleaved");
  EXPECT_LE(RelL2(v.grads.data(), cpu.grads.data(), static_cast<int64_t>(cpu.grads.size())), 1e-4);
}

TEST(CudaPipelineInterleaved, TwoStagesOfTwoChunksFollowOneGpu1F1BAndTheCpu) { CheckInterleavedFollows(2, 4); }
TEST(CudaPipelineInterleaved, FourStagesOfTwoChunksFollowOneGpu1F1BAndTheCpu) { CheckInterleavedFollows(4, 8); }

TEST(CudaPipelineInterleaved, Bf16FollowsOneGpu) {
  const GPTConfig c = Config(4);
  const Data d(c.vocab_size);
  const StageRun one = OneGpu(c, Precision::kBf16, d);
  ASSERT_FALSE(one.grads.empty());
  ExpectFollows(c, Stages(c, Case{.P = 2, .V = 2, .precision = Precision::kBf16}, d), one, 1e-3, 3e-2,
                "CUDA bf16 interleaved vs one GPU");
}

// --qk-layernorm with model chunks: each slot keeps its chunk's layers' query and key norm statistics
// (the second chunk's were once written past the slot's, where attention's output then overwrote them).
TEST(CudaPipelineInterleaved, QKLayerNormChunksFollowOneGpu) {
  GPTConfig c = Config(4);
  c.qk_layernorm = true;
  const Data d(c.vocab_size);
  const StageRun one = OneGpu(c, Precision::kFp32, d);
  ASSERT_FALSE(one.grads.empty());
  ExpectFollows(c, Stages(c, Case{.P = 2, .V = 2}, d), one, 1e-6, 1e-5, "CUDA interleaved --qk-layernorm vs one GPU");
}

// The direct exchange (device buffers, a slot's own output gradient) gives the host exchange's bits
// (fp32 host spans: exact for bf16 values too).
TEST(CudaPipelineInterleaved, DirectExchangeGivesTheHostExchangesBits) {
  const GPTConfig c = Config(4);
  const Data d(c.vocab_size);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(PrecisionName(p));
    const StageRun direct = Stages(c, Case{.P = 2, .V = 2, .precision = p}, d);
    const StageRun host = Stages(c, Case{.P = 2, .V = 2, .precision = p, .host_exchange = true}, d);
    EXPECT_GT(direct.device_messages, 0);
    EXPECT_EQ(direct.loss.loss_sum, host.loss.loss_sum);
    EXPECT_EQ(direct.eval.loss_sum, host.eval.loss_sum);
    EXPECT_EQ(direct.grads, host.grads);
  }
}

// --sequence-parallel with pipeline stages: T = 2 x P = 2 (without and with chunks) follows one GPU.
TEST(CudaPipelineInterleaved, SequenceParallelStagesFollowOneGpu) {
  const GPTConfig c = Config(4);
  const Data d(c.vocab_size);
  const StageRun one = OneGpu(c, Precision::kFp32, d);
  ASSERT_FALSE(one.grads.empty());
  for (int V : {1, 2}) {
    const StageRun sp = Stages(c, Case{.P = 2, .V = V, .T = 2, .sequence_parallel = true}, d);
    EXPECT_GT(sp.device_messages, 0);
    ExpectFollows(c, sp, one, 1e-5, 1e-4, V == 1 ? "T=2 x P=2 sequence parallel" : "T=2 x P=2 x V=2 sequence parallel");
  }
}

// Two TrainSteps of P = 2 x D = 2 ranks (world rank d + 2p) of 2 chunks, 2 micro-batches a data
// rank a step, --overlap-grad-reduce with buckets of `bucket` elements (0: none): each rank's
// parameters after them and the buckets its last step's backwards launched.
void TrainOverlap(const GPTConfig& c, int64_t bucket, std::vector<std::vector<float>>* params,
                  std::vector<int>* launched) {
  const Data d(c.vocab_size);
  params->assign(4, {});
  launched->assign(4, -1);
  std::mutex mu;
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    const int dr = rank % 2, p = rank / 2;
    std::unique_ptr<Communicator> dp_host = Group(world, {2 * p, 2 * p + 1}, "data");
    std::unique_ptr<Communicator> pipe_host = Group(world, {dr, dr + 2}, "pipeline");
    ASSERT_TRUE(dp_host && pipe_host);
    testing::StagedDeviceCollectives dp(dp_host.get()), pipe(pipe_host.get());
    cuda::CudaModelOptions o;
    o.pipeline = StageOf({2, 2}, p, 2);
    std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
    ASSERT_NE(m, nullptr);
    OptimizerConfig oc;
    oc.overlap_grad_reduce = bucket > 0;
    oc.ddp_bucket_size = bucket;
    TrainStep step(m.get(), oc, cuda_model_test::Schedule(), &dp);
    step.set_pipeline(&pipe, &pipe);  // at P = 2 the embedding group is the pipeline's
    for (int it = 0; it < 2; ++it) {
      const std::vector<ModelBatch> mine(d.mbs.begin() + 4 * it + 2 * dr, d.mbs.begin() + 4 * it + 2 * dr + 2);
      auto r = step.Step(mine, 4 * d.batches.b, 99);
      ASSERT_TRUE(r.ok()) << r.status();
    }
    std::vector<float> mine(static_cast<size_t>(m->num_params()));
    ASSERT_TRUE(m->ReadParams(mine).ok());
    std::lock_guard<std::mutex> lock(mu);
    (*params)[static_cast<size_t>(rank)] = mine;
    (*launched)[static_cast<size_t>(rank)] = step.pipeline_stats().buckets_launched_in_backward;
  });
}

TEST(CudaPipelineInterleaved, OverlappedBucketsHaveTheBitsOfTheReductionAfterTheSchedule) {
  const GPTConfig c = Config(4);
  std::vector<std::vector<float>> after, overlapped;
  std::vector<int> launched_after, launched;
  TrainOverlap(c, 0, &after, &launched_after);
  TrainOverlap(c, 3000, &overlapped, &launched);
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_FALSE(after[static_cast<size_t>(rank)].empty());
    EXPECT_EQ(overlapped[static_cast<size_t>(rank)], after[static_cast<size_t>(rank)]) << "rank " << rank;
    EXPECT_GE(launched[static_cast<size_t>(rank)], 2) << "rank " << rank;
    EXPECT_EQ(launched_after[static_cast<size_t>(rank)], 0) << "rank " << rank;
  }
}

}  // namespace
}  // namespace ptk
