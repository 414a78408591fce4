// Context parallelism with pipeline stages on the CPU model, ranks as gloo threads in Megatron's order
// (ParallelLayout, tp-cp-ep-dp-pp: each rank's tensor, context, pipeline and embedding groups are the layout's,
// which parallel_layout_test checks against megatron-core's RankGenerator). Each context rank keeps its positions of
// every micro-batch (KeepContextRows) and its stage sends and receives that rank's rows only; the gradients are summed
// over the context group, then (tied embeddings) over the embedding group, as Megatron's finalize_model_grads. Over
// 4 micro-batches with dropout on: C = 2 x P = 2 (1F1B, and the interleaved schedule with 2 chunks of a 4-layer model),
// C = 2 x P = 4 (middle stages) and T = 2 x C = 2 x P = 2 (with and without --sequence-parallel) give the same split
// without stages bit for bit (loss, evaluation loss, every gradient but a tied embedding's, which the embedding group
// adds in another order: within 1e-5 of its largest), and one rank's within context_parallel_test's bounds (loss 1e-6
// relative, gradients 2e-6 of the largest); each stage keeps at most P - s micro-batches in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "tests/trainer/context_split.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/parallel_layout.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/training_data.h"

namespace ptk {
namespace {

using testing::SplitRun;

GPTConfig Config(int64_t layers, bool untied) {
  GPTConfig c = testing::SmallGpt(layers, 32, 4, 32, 97, 128);
  c.hidden_dropout = c.attention_dropout = 0.1;
  c.untie_embeddings_and_output_weights = untied;
  return c;
}

// Tensor x context x pipeline ranks (one data rank), V model chunks per stage.
struct Split {
  int T = 1, C = 1, P = 1, V = 1;
  bool sp = false;
  std::string Name() const {
    return "T=" + std::to_string(T) + " C=" + std::to_string(C) + " P=" + std::to_string(P) +
           (V > 1 ? " V=" + std::to_string(V) : "") + (sp ? " sequence-parallel" : "");
  }
};

constexpr int kMicroBatches = 4;

// The groups of world rank `r` in `layout`, made by every member (Communicator::Subgroup).
struct RankGroups {
  std::unique_ptr<Communicator> tensor, context, pipeline, embedding;
};
void MakeGroups(Communicator* world, const ParallelLayout& layout, int r, bool tied, RankGroups* g) {
  auto make = [&](ParallelGroup kind, const char* name, std::unique_ptr<Communicator>* out) {
    const std::vector<int> members = layout.Group(kind, r);
    if (members.size() < 2) return;
    auto made = world->Subgroup(members, name);
    ASSERT_TRUE(made.ok()) << made.status();
    *out = *std::move(made);
  };
  // train_main's MakeGroups, in its order (every rank makes the same groups in the same order).
  ASSERT_NO_FATAL_FAILURE(make(ParallelGroup::kTensor, "tensor", &g->tensor));
  ASSERT_NO_FATAL_FAILURE(make(ParallelGroup::kPipeline, "pipeline", &g->pipeline));
  if (tied) {
    ASSERT_NO_FATAL_FAILURE(make(ParallelGroup::kEmbedding, "embedding", &g->embedding));
  }
  ASSERT_NO_FATAL_FAILURE(make(ParallelGroup::kContext, "context", &g->context));
}

// One step's forward and backward passes (dropout seed 99) of split `k` over `data`, then the evaluation pass over
// micro-batch 0.
SplitRun RunSplit(const GPTConfig& c, const Split& k, const testing::Batches& data, const std::vector<double>& scales) {
  const int world = k.T * k.C * k.P;
  auto layout = ParallelLayout::Create(world, k.T, k.P, k.C);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return {};
  testing::SplitGather gather(k.C, k.P, ParamLayout::Create(c)->num_params);
  auto body = [&](Communicator* world_comm, int r) {
    const RankCoords at = layout->Coords(r);
    RankGroups g;
    const bool tied = !c.untie_embeddings_and_output_weights;
    if (world > 1) {
      ASSERT_NO_FATAL_FAILURE(MakeGroups(world_comm, *layout, r, tied, &g));
    }
    const PipelineStage stage =
        k.P > 1 ? StageOf(std::vector<int64_t>(static_cast<size_t>(k.P), c.num_layers / k.P), at.pipeline, k.V)
                : PipelineStage{};
    auto made = CpuGPTModel::Create(c, g.tensor.get(), k.sp, stage);
    ASSERT_TRUE(made.ok()) << made.status();
    CpuGPTModel& m = **made;
    ASSERT_TRUE(m.SetContextParallel(g.context.get()).ok());
    ASSERT_TRUE(m.InitWeights(11).ok());
    ASSERT_TRUE(m.ZeroGrads().ok());
    // This context rank's rows of every micro-batch.
    std::vector<MicroBatch> held(kMicroBatches);
    std::vector<std::vector<int64_t>> keys(kMicroBatches);
    std::vector<ModelBatch> mbs;
    for (size_t i = 0; i < held.size(); ++i) {
      held[i] = data.Loaded(i);
      if (k.C > 1) KeepContextRows(&held[i], ContextParallelPositions(c.seq_length, k.C, at.context));
      mbs.push_back(View(held[i], &keys[i]));
    }
    LossSum loss, eval;
    if (k.P > 1) {
      PipelineStats stats;
      auto l = ForwardBackwardPipelining(&m, g.pipeline.get(), mbs, scales, 99, &stats);
      ASSERT_TRUE(l.ok()) << l.status();
      loss = *l;
      if (k.V == 1) {
        EXPECT_EQ(stats.max_in_flight, k.P - at.pipeline) << "rank " << r;
      }
    } else {
      for (size_t i = 0; i < mbs.size(); ++i) {
        auto l = m.ForwardBackward(mbs[i], scales[i], /*train=*/true, 99);
        ASSERT_TRUE(l.ok()) << l.status();
        loss.loss_sum += l->loss_sum;
        loss.tokens += l->tokens;
      }
    }
    // Megatron's finalize_model_grads: the data x context sums, the tensor group's sum of the sequence-parallel
    // gradients, then the embedding group's.
    if (g.context) {
      ASSERT_TRUE(m.AllReduceGradRange(g.context.get(), 0, m.num_params()).ok());
    }
    ASSERT_TRUE(m.SumNonTensorParallelGrads().ok());
    if (g.embedding) {
      const ParamLayout& lay = m.layout();
      const bool first = at.pipeline == 0;
      ASSERT_TRUE(m.AllReduceGradRange(g.embedding.get(), first ? lay.wte : lay.out_w,
                                       c.padded_vocab_size / k.T * c.hidden_size)
                      .ok());
    }
    std::vector<float> grads(static_cast<size_t>(m.num_params()));
    ASSERT_TRUE(m.ReadGrads(grads).ok());
    if (k.P > 1) {
      auto e = ForwardPipelining(&m, g.pipeline.get(), mbs[0]);
      ASSERT_TRUE(e.ok()) << e.status();
      eval = *e;
    } else {
      auto e = m.Forward(mbs[0]);
      ASSERT_TRUE(e.ok()) << e.status();
      eval = *e;
    }
    gather.Add(r, at, m.layout(), grads, loss, eval);
  };
  if (world == 1) {
    auto local = MakeLocalCommunicator();
    body(local.get(), 0);
  } else {
    testing::RunRanks(world, body);
  }
  return gather.Sum();
}

// The largest difference of two gradient vectors over [begin, end), and the largest of `want`'s there.
std::pair<double, double> Worst(const std::vector<float>& got, const std::vector<float>& want, int64_t begin,
                                int64_t end) {
  double worst = 0, scale = 0;
  for (int64_t i = begin; i < end; ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(got[static_cast<size_t>(i)]) - want[static_cast<size_t>(i)]));
    scale = std::max(scale, std::abs(static_cast<double>(want[static_cast<size_t>(i)])));
  }
  return {worst, scale};
}

// `got` (a split with stages) is `same` (that split without them) bit for bit but for the tied embedding (within
// 1e-5 of its largest), and `one` (one rank) within context parallelism's bounds.
void ExpectFollows(const GPTConfig& c, const SplitRun& got, const SplitRun& same, const SplitRun& one,
                   const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.grads.size(), same.grads.size());
  ASSERT_EQ(got.grads.size(), one.grads.size());
  EXPECT_EQ(got.tokens, one.tokens);
  EXPECT_EQ(got.loss, same.loss);
  EXPECT_EQ(got.eval, same.eval);
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok());
  int64_t differ = 0;
  for (const ParamInfo& p : whole->infos) {
    if (!c.untie_embeddings_and_output_weights && p.name == "embedding.word_embeddings.weight") {
      const auto [worst, scale] = Worst(got.grads, same.grads, p.offset, p.offset + p.size);
      EXPECT_LE(worst, 1e-5 * scale) << p.name;
      continue;
    }
    for (int64_t i = p.offset; i < p.offset + p.size; ++i)
      differ += got.grads[static_cast<size_t>(i)] != same.grads[static_cast<size_t>(i)];
  }
  EXPECT_EQ(differ, 0) << "gradient elements that differ from the split without stages";
  EXPECT_LT(std::abs(got.loss - one.loss) / one.loss, 1e-6) << got.loss << " vs " << one.loss;
  EXPECT_LT(std::abs(got.eval - one.eval) / one.eval, 1e-6) << got.eval << " vs " << one.eval;
  const auto [dmax, gmax] = Worst(got.grads, one.grads, 0, static_cast<int64_t>(one.grads.size()));
  EXPECT_LT(dmax, 2e-6 * gmax) << "largest gradient difference " << dmax << " of " << gmax;
  std::printf("%s: loss %.3g relative, gradients %.3g of the largest from one rank's\n", what.c_str(),
              std::abs(got.loss - one.loss) / one.loss, dmax / gmax);
}

std::vector<double> Scales() {
  std::vector<double> s;
  for (int i = 0; i < kMicroBatches; ++i) s.push_back(1.0 / (27.0 * 4.0) * (1.0 + 0.01 * i));
  return s;
}

void CheckContextWithStages(int64_t layers, bool untied, const std::vector<Split>& splits) {
  const GPTConfig c = Config(layers, untied);
  const testing::Batches data(kMicroBatches, c.seq_length);
  const std::vector<double> scales = Scales();
  const SplitRun one = RunSplit(c, Split{}, data, scales);
  ASSERT_FALSE(one.grads.empty());
  ASSERT_GT(one.tokens, 0.0);
  for (const Split& k : splits) {
    Split flat = k;
    flat.P = flat.V = 1;
    const SplitRun same = RunSplit(c, flat, data, scales);
    const SplitRun got = RunSplit(c, k, data, scales);
    ASSERT_NO_FATAL_FAILURE(ExpectFollows(c, got, same, one, k.Name() + (untied ? " untied" : " tied")));
  }
}

TEST(ContextPipeline, TwoContextRanksTimesTwoStagesGiveTheSplitWithoutStages) {
  CheckContextWithStages(2, false, {Split{1, 2, 2}});
  CheckContextWithStages(2, true, {Split{1, 2, 2}});
}

// Megatron's interleaved schedule: 4 layers in 2 chunks of one layer on each of 2 stages.
TEST(ContextPipeline, InterleavedScheduleWithContextRanks) { CheckContextWithStages(4, false, {Split{1, 2, 2, 2}}); }

// Middle stages (neither embeddings nor loss) pass a context rank's rows on: P = 4 of one layer each, 8 ranks.
TEST(ContextPipeline, FourStagesWithContextRanks) { CheckContextWithStages(4, false, {Split{1, 2, 4}}); }

// Tensor ranks split each context rank's heads (and with --sequence-parallel its positions); 8 ranks.
TEST(ContextPipeline, TensorTimesContextTimesStages) {
  CheckContextWithStages(2, false, {Split{2, 2, 2, 1, false}, Split{2, 2, 2, 1, true}});
}

}  // namespace
}  // namespace ptk
