// The CUDA model's context parallelism with pipeline stages, on one GPU: T x C x P ranks as threads of this process
// sharing the device in Megatron's order (ParallelLayout, tp-cp-ep-dp-pp: each rank's tensor, context, pipeline and
// embedding groups are the layout's), each its own CUDA model over its stage's layers and its context rank's positions
// of every sample (ContextParallelPositions). NCCL cannot put two ranks on one GPU, so the tensor, context and pipeline
// groups are gloo ranks offered as device communicators (testing::StagedDeviceCollectives, as
// cuda_context_parallel_test and cuda_pipeline_test have them): the stages take the direct exchange (a context rank's
// rows in the model's dtype) and the context attention its all-gather and key and value gradient exchange, the paths
// they take over NCCL. Over 4 micro-batches of Megatron's schedule, dropout on: C = 2 x P = 2 (1F1B, and the
// interleaved schedule with 2 chunks per stage) and T = 2 x C = 2 x P = 2 (with and without --sequence-parallel) follow
// the same split without stages within cuda_pipeline_test's bounds (fp32: loss 1e-6 relative, gradients 1e-5 of the
// largest) and one GPU within cuda_context_parallel_test's (fp32: 1e-5, 1e-4); bf16 (context parallelism's attention
// in fp32 on widened rows) with hidden dropout against bf16 without stages (1e-3, 3e-2) and bf16 on one GPU (1e-2,
// 6e-2), and with attention dropout against fp32 on one GPU, whose masks it shares. The last stage's loss sums and
// tokens, the evaluation loss, every gradient (the ranks' slices put back together, each stage's summed over its
// context group, a tied embedding's copies over the embedding group). gpu-labelled: exit 77 without a device.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "tests/trainer/context_rank_rows.h"
#include "tests/trainer/context_split.h"
#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_layout.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;
using testing::ContextRows;
using testing::SplitRun;
using testing::StagedGroup;

constexpr int kMicroBatches = 4;

GPTConfig Config(bool attention_dropout = true) {
  GPTConfig c = cuda_model_test::SmallConfig(/*dropout=*/true);
  c.num_layers = 4;
  if (!attention_dropout) c.attention_dropout = 0;
  return c;
}

// Tensor x context x pipeline ranks (one data rank), V model chunks per stage, in precision p.
struct Split {
  int T = 1, C = 1, P = 1, V = 1;
  bool sp = false;
  Precision p = Precision::kFp32;
  std::string Name() const {
    return fmt::format("{} T={} C={} P={}{}{}", PrecisionName(p), T, C, P, V > 1 ? fmt::format(" V={}", V) : "",
                       sp ? " sequence-parallel" : "");
  }
};

// A group of `layout` for world rank r (none for a group of one rank), and its device collectives staged.
void MakeGroup(Communicator* world, const ParallelLayout& layout, ParallelGroup kind, int r, const char* name,
               StagedGroup* out) {
  const std::vector<int> members = layout.Group(kind, r);
  if (members.size() < 2) return;
  ASSERT_NO_FATAL_FAILURE(testing::MakeStagedGroup(world, members, name, out));
}

struct RankGroups {
  StagedGroup tensor, pipeline, embedding, context;
};

// Every rank's groups, in train_main's order.
void MakeGroups(Communicator* world, const ParallelLayout& layout, int r, bool tied, RankGroups* g) {
  ASSERT_NO_FATAL_FAILURE(MakeGroup(world, layout, ParallelGroup::kTensor, r, "tensor", &g->tensor));
  ASSERT_NO_FATAL_FAILURE(MakeGroup(world, layout, ParallelGroup::kPipeline, r, "pipeline", &g->pipeline));
  if (tied) {
    ASSERT_NO_FATAL_FAILURE(MakeGroup(world, layout, ParallelGroup::kEmbedding, r, "embedding", &g->embedding));
  }
  ASSERT_NO_FATAL_FAILURE(MakeGroup(world, layout, ParallelGroup::kContext, r, "context", &g->context));
}

// The step's passes: through the schedule with stages, else micro-batch by micro-batch.
absl::StatusOr<LossSum> Passes(GPTModel* m, Communicator* pipeline, const std::vector<ModelBatch>& mbs,
                               const std::vector<double>& scales) {
  if (pipeline) return ForwardBackwardPipelining(m, pipeline, mbs, scales, 99);
  LossSum sum;
  for (size_t i = 0; i < mbs.size(); ++i) {
    PTK_ASSIGN_OR_RETURN(const LossSum l, m->ForwardBackward(mbs[i], scales[i], /*train=*/true, 99));
    sum.loss_sum += l.loss_sum;
    sum.tokens += l.tokens;
  }
  return sum;
}

// Megatron's finalize_model_grads after the passes: the data x context sums (the context group here), the tensor
// group's sums of the sequence-parallel gradients, then the embedding group's.
void FinalizeGrads(GPTModel* m, const RankGroups& g, int T, bool first_stage) {
  if (g.context.device) {
    ASSERT_TRUE(m->AllReduceGradRange(g.context.device.get(), 0, m->num_params()).ok());
  }
  if (m->sums_non_tensor_parallel_grads()) {
    ASSERT_TRUE(m->SumNonTensorParallelGrads().ok());
  }
  if (g.embedding.host) {
    const ParamLayout& lay = m->layout();
    const int64_t n = m->config().padded_vocab_size / T * m->config().hidden_size;
    ASSERT_TRUE(m->AllReduceGradRange(g.embedding.host.get(), first_stage ? lay.wte : lay.out_w, n).ok());
  }
}

SplitRun RunSplit(const GPTConfig& c, const Split& k) {
  const Batches data(kMicroBatches, c.vocab_size);
  std::vector<double> scales;
  for (int i = 0; i < kMicroBatches; ++i) scales.push_back(1.0 / 1024.0 * (1.0 + 0.01 * i));
  const int world = k.T * k.C * k.P;
  auto layout = ParallelLayout::Create(world, k.T, k.P, k.C);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return {};
  testing::SplitGather gather(k.C, k.P, ParamLayout::Create(c)->num_params);
  auto body = [&](Communicator* world_comm, int r) {
    const RankCoords at = layout->Coords(r);
    RankGroups g;
    if (world > 1) {
      ASSERT_NO_FATAL_FAILURE(MakeGroups(world_comm, *layout, r, !c.untie_embeddings_and_output_weights, &g));
    }
    cuda::CudaModelOptions o;
    if (k.P > 1)
      o.pipeline = StageOf(std::vector<int64_t>(static_cast<size_t>(k.P), c.num_layers / k.P), at.pipeline, k.V);
    o.tensor = g.tensor.device.get();
    o.sequence_parallel = k.sp;
    o.context = g.context.device.get();
    std::unique_ptr<GPTModel> m = cuda_model_test::Cuda(c, k.p, /*deterministic=*/true, o);
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(m->ZeroGrads().ok());
    std::vector<std::unique_ptr<ContextRows>> rows;
    std::vector<ModelBatch> mbs;
    for (int i = 0; i < kMicroBatches; ++i) {
      rows.push_back(std::make_unique<ContextRows>(data.Get(i), k.C, at.context));
      mbs.push_back(rows.back()->batch);
    }
    auto loss = Passes(m.get(), g.pipeline.device.get(), mbs, scales);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_NO_FATAL_FAILURE(FinalizeGrads(m.get(), g, k.T, at.pipeline == 0));
    std::vector<float> grads(static_cast<size_t>(m->num_params()));
    ASSERT_TRUE(m->ReadGrads(grads).ok());
    auto eval = k.P > 1 ? ForwardPipelining(m.get(), g.pipeline.device.get(), mbs[0]) : m->Forward(mbs[0], nullptr);
    ASSERT_TRUE(eval.ok()) << eval.status();
    gather.Add(r, at, m->layout(), grads, *loss, *eval);
  };
  if (world == 1)
    body(nullptr, 0);
  else
    testing::RunRanks(world, body);
  return gather.Sum();
}

// got's loss and evaluation sums within loss_tol relative of ref's, its tokens exact, its gradients within grad_tol
// of ref's largest.
void ExpectClose(const SplitRun& ref, const SplitRun& got, double loss_tol, double grad_tol, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_FALSE(ref.grads.empty());
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  EXPECT_EQ(got.tokens, ref.tokens);
  EXPECT_NEAR(got.loss, ref.loss, loss_tol * std::abs(ref.loss));
  EXPECT_NEAR(got.eval, ref.eval, loss_tol * std::abs(ref.eval));
  double dmax = 0, gmax = 0;
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    gmax = std::max(gmax, static_cast<double>(std::abs(ref.grads[i])));
    dmax = std::max(dmax, static_cast<double>(std::abs(ref.grads[i] - got.grads[i])));
  }
  EXPECT_LT(dmax, grad_tol * gmax) << "largest gradient difference " << dmax << " of " << gmax;
  std::printf("%s: loss sum %.9g vs %.9g; largest gradient difference %.3g of %.3g\n", what.c_str(), got.loss, ref.loss,
              dmax, gmax);
}

// Split k against the same split without stages (loose: cuda_pipeline_test's bounds) and against `one` (one GPU;
// cuda_context_parallel_test's bounds).
void ExpectFollows(const GPTConfig& c, const Split& k, const SplitRun& one, double one_loss_tol, double one_grad_tol) {
  const bool fp32 = k.p == Precision::kFp32;
  Split flat = k;
  flat.P = flat.V = 1;
  const SplitRun got = RunSplit(c, k);
  ExpectClose(RunSplit(c, flat), got, fp32 ? 1e-6 : 1e-3, fp32 ? 1e-5 : 3e-2, k.Name() + " vs " + flat.Name());
  ExpectClose(one, got, one_loss_tol, one_grad_tol, k.Name() + " vs one GPU");
}

TEST(CudaContextPipeline, ContextRanksTimesStagesFollowOneGpuFp32) {
  const GPTConfig c = Config();
  const SplitRun one = RunSplit(c, Split{});
  ASSERT_GT(one.tokens, 0.0);
  for (const Split& k : {Split{1, 2, 2}, Split{1, 2, 2, 2}, Split{2, 2, 2, 1, false}, Split{2, 2, 2, 1, true}})
    ExpectFollows(c, k, one, 1e-5, 1e-4);
}

// bf16: with hidden dropout only (one GPU's bf16 attention is cuDNN's, its masks not the fp32 rows attention's)
// against bf16 on one GPU; with attention dropout against fp32 on one GPU, whose masks it shares.
TEST(CudaContextPipeline, ContextRanksTimesStagesFollowOneGpuBf16) {
  const GPTConfig hidden = Config(/*attention_dropout=*/false);
  const SplitRun one = RunSplit(hidden, Split{1, 1, 1, 1, false, Precision::kBf16});
  ASSERT_GT(one.tokens, 0.0);
  for (const Split& k : {Split{1, 2, 2, 1, false, Precision::kBf16}, Split{1, 2, 2, 2, false, Precision::kBf16}})
    ExpectFollows(hidden, k, one, 1e-2, 6e-2);
  const GPTConfig dropout = Config();
  ExpectClose(RunSplit(dropout, Split{}), RunSplit(dropout, Split{1, 2, 2, 1, false, Precision::kBf16}), 1e-2, 6e-2,
              "attention dropout: bf16 C=2 P=2 vs fp32 on one GPU");
}

}  // namespace
}  // namespace ptk
