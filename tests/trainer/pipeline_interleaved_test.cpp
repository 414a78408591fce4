// Megatron's interleaved pipeline schedule on the CPU backend: a stage of V model chunks holds the
// layers of virtual stages v * P + p (the whole model's tensors and init, put back together by
// CopyFromShard); the interleaved 1F1B at P = 2 and 4 with 2 chunks, 8 micro-batches and dropout on
// (and with as many micro-batches as stages, every forward of the first stages in the warm-up)
// gives one rank's loss and gradients bit for bit (the tied embeddings' two copies summed within
// float rounding), and so do micro-batch groups other than P (Megatron's
// --microbatch-group-size-per-virtual-pipeline-stage: 3 of 8, 8 of 8, 5 of 9 at P = 4), and
// forward-only evaluation one rank's loss; a step whose micro-batches are not a
// multiple of P is refused; only the last virtual stage's slots hold the logits; a checkpoint
// header names each tensor by its chunk, Megatron's way. InterleavedSlots (what a backend that plans
// its slots up front reserves: CUDA) is the slots the CPU model made. The batches' messages, as
// NCCL would see them (no channels: a pair's messages matched in the order each end posts them;
// a group completes only with its peers' groups), carry the same channel at both ends of every
// pair and never wait on each other in a cycle, at P = 2 (one peer both ways) to 4.
// --overlap-grad-reduce with chunks (P = 2 x D = 2 x V = 2, TrainStep): each chunk's buckets
// launched by its last backward, the bits of the reduction after the schedule.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "tests/trainer/forwarding_comm.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/test_batches.h"
#include "trainer/checkpoint.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/parallel_params.h"
#include "trainer/param_shard.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::OneRank;
using testing::Reference;

GPTConfig Config(int64_t layers) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = 97;
  c.padded_vocab_size = 128;
  c.hidden_dropout = c.attention_dropout = 0.1;
  return c;
}

PipelineStage Stage(const GPTConfig& c, int P, int p, int V) {
  return StageOf(std::vector<int64_t>(static_cast<size_t>(P), c.num_layers / P), p, V);
}

TEST(InterleavedLayout, ChunksHoldTheirVirtualStagesLayersWithTheWholeModelsInit) {
  const GPTConfig c = Config(8);
  auto whole = ParamLayout::Create(c);
  ASSERT_TRUE(whole.ok());
  std::vector<float> init(static_cast<size_t>(whole->num_params)), back(init.size(), -1.0f);
  whole->InitWeights(5, init);
  int64_t counted = 0;
  for (int p = 0; p < 2; ++p) {
    auto s = ParamLayout::Create(c, 1, 0, Stage(c, 2, p, 2));
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->virtual_size, 2);
    EXPECT_EQ(s->chunk_layers(), 2);
    // Virtual stage v * P + p: rank 0 holds layers 0, 1 and 4, 5; rank 1 layers 2, 3 and 6, 7.
    EXPECT_EQ(s->chunk_first_layer, (std::vector<int64_t>{2 * p, 4 + 2 * p}));
    EXPECT_EQ(s->ChunkPreProcess(0), p == 0);
    EXPECT_FALSE(s->ChunkPreProcess(1));
    EXPECT_EQ(s->ChunkPostProcess(1), p == 1);
    EXPECT_FALSE(s->ChunkPostProcess(0));
    EXPECT_NE(s->Find(fmt::format("decoder.layers.{}.mlp.linear_fc1.weight", 4 + 2 * p)), nullptr);
    EXPECT_EQ(s->Find(fmt::format("decoder.layers.{}.mlp.linear_fc1.weight", 2 - 2 * p)), nullptr);
    std::vector<float> mine(static_cast<size_t>(s->num_params));
    s->InitWeights(5, mine);
    CopyFromShard(*s, mine, back);
    // Each rank holds as many parameters as without chunks (the dry run's count).
    EXPECT_EQ(s->num_params, ParamsOnModelParallelRank(c, 1, 2, p, 4));
    counted += s->norm_end();
    // Megatron's checkpoint names: the chunk, its layers numbered from 0.
    const auto [chunk, name] = ChunkName(*s, fmt::format("decoder.layers.{}.mlp.linear_fc1.weight", 5 + 2 * p));
    EXPECT_EQ(chunk, 1);
    EXPECT_EQ(name, "decoder.layers.1.mlp.linear_fc1.weight");
    EXPECT_EQ(ChunkName(*s, "decoder.final_layernorm.weight").first, 1);
    EXPECT_EQ(ChunkName(*s, "embedding.word_embeddings.weight").first, p == 0 ? 0 : 1);
  }
  EXPECT_EQ(back, init);
  EXPECT_EQ(counted, whole->num_params);
  // Layers that do not split into P x V virtual stages evenly, and chunks without stages.
  EXPECT_FALSE(ParamLayout::Create(c, 1, 0, Stage(c, 2, 0, 3)).ok());
  PipelineStage one = StageOf({8}, 0, 2);
  EXPECT_FALSE(ParamLayout::Create(c, 1, 0, one).ok());
}

// The batches of point-to-point messages each rank posts, in order: (peer, send, channel) each.
struct Posted {
  int peer;
  bool send;
  int channel;
};
using Batches = std::vector<std::vector<Posted>>;

// Records every BatchSendRecv with a peer, then passes it on.
class RecordingComm final : public testing::ForwardingCommunicator {
 public:
  explicit RecordingComm(Communicator* inner) : ForwardingCommunicator(inner) {}
  absl::Status BatchSendRecv(std::span<const P2pMessage> messages) override {
    std::vector<Posted> batch;
    for (const P2pMessage& m : messages)
      if (m.peer >= 0 && m.bytes > 0) batch.push_back({m.peer, m.send != nullptr, m.channel});
    if (!batch.empty()) batches.push_back(batch);
    return inner()->BatchSendRecv(messages);
  }
  Batches batches;
};

// NCCL's view of the ranks' batches: for each ordered pair (a, b) the k-th send from a to b meets
// the k-th receive of b from a, which must be the same channel (else a gradient lands in an
// activation's buffer); and the batches, merged where they meet and ordered as each rank posts
// them, form no cycle (else the groups wait on each other for ever).
void CheckNcclCanMatch(const std::vector<Batches>& ranks) {
  const int P = static_cast<int>(ranks.size());
  std::vector<int> first(static_cast<size_t>(P) + 1, 0);  // node (r, i) = first[r] + i
  for (int r = 0; r < P; ++r)
    first[static_cast<size_t>(r) + 1] =
        first[static_cast<size_t>(r)] + static_cast<int>(ranks[static_cast<size_t>(r)].size());
  std::vector<int> parent(static_cast<size_t>(first.back()));
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = static_cast<int>(i);
  std::function<int(int)> find = [&](int x) {
    return parent[static_cast<size_t>(x)] == x ? x
                                               : parent[static_cast<size_t>(x)] = find(parent[static_cast<size_t>(x)]);
  };
  for (int a = 0; a < P; ++a)
    for (int b = 0; b < P; ++b) {
      if (a == b) continue;
      std::vector<std::pair<int, int>> sends, recvs;  // (batch node, channel)
      for (size_t i = 0; i < ranks[static_cast<size_t>(a)].size(); ++i)
        for (const Posted& m : ranks[static_cast<size_t>(a)][i])
          if (m.send && m.peer == b) sends.push_back({first[static_cast<size_t>(a)] + static_cast<int>(i), m.channel});
      for (size_t i = 0; i < ranks[static_cast<size_t>(b)].size(); ++i)
        for (const Posted& m : ranks[static_cast<size_t>(b)][i])
          if (!m.send && m.peer == a) recvs.push_back({first[static_cast<size_t>(b)] + static_cast<int>(i), m.channel});
      ASSERT_EQ(sends.size(), recvs.size()) << a << " -> " << b;
      for (size_t k = 0; k < sends.size(); ++k) {
        EXPECT_EQ(sends[k].second, recvs[k].second) << "message " << k << " from " << a << " to " << b;
        parent[static_cast<size_t>(find(sends[k].first))] = find(recvs[k].first);
      }
    }
  // Program order between the merged batches; a cycle is a deadlock under NCCL's rendezvous.
  const int n = first.back();
  std::vector<std::vector<int>> next(static_cast<size_t>(n));
  std::vector<int> indegree(static_cast<size_t>(n), 0);
  for (int r = 0; r < P; ++r)
    for (int i = first[static_cast<size_t>(r)]; i + 1 < first[static_cast<size_t>(r) + 1]; ++i) {
      const int u = find(i), v = find(i + 1);
      if (u == v) continue;
      next[static_cast<size_t>(u)].push_back(v);
      ++indegree[static_cast<size_t>(v)];
    }
  std::vector<int> ready;
  int groups = 0, done = 0;
  for (int x = 0; x < n; ++x)
    if (find(x) == x) {
      ++groups;
      if (indegree[static_cast<size_t>(x)] == 0) ready.push_back(x);
    }
  while (!ready.empty()) {
    const int u = ready.back();
    ready.pop_back();
    ++done;
    for (int v : next[static_cast<size_t>(u)])
      if (--indegree[static_cast<size_t>(v)] == 0) ready.push_back(v);
  }
  EXPECT_EQ(done, groups) << "the ranks' batches wait on each other in a cycle";
}

// `group`: --microbatch-group-size-per-virtual-pipeline-stage (0: Megatron's default, P).
void CheckInterleavedGivesOneRank(int P, int V, int64_t layers, int micro_batches = 8, int group = 0) {
  const GPTConfig c = Config(layers);
  const testing::Batches data(micro_batches, 16);
  const std::vector<ModelBatch> mbs = data.All();
  std::vector<double> scales;
  for (size_t k = 0; k < mbs.size(); ++k) scales.push_back(1.0 / (27.0 * 8.0) * (1.0 + 0.01 * static_cast<double>(k)));
  const Reference ref = OneRank(c, mbs, scales);
  std::mutex mu;
  std::vector<int64_t> floats(static_cast<size_t>(P));
  std::vector<Batches> posted(static_cast<size_t>(P));
  testing::RunRanks(P, [&](Communicator* gloo, int s) {
    RecordingComm recording(gloo);
    Communicator* comm = &recording;
    auto made = CpuGPTModel::Create(c, nullptr, false, Stage(c, P, s, V));
    ASSERT_TRUE(made.ok()) << made.status();
    CpuGPTModel& m = **made;
    ASSERT_TRUE(m.InitWeights(11).ok());
    ASSERT_TRUE(m.ZeroGrads().ok());
    PipelineStats stats;
    auto loss = ForwardBackwardPipelining(&m, comm, mbs, scales, 99, &stats, {}, nullptr, group);
    ASSERT_TRUE(loss.ok()) << loss.status();
    const Batches step = recording.batches;
    std::unique_ptr<Communicator> emb;
    if (s == 0 || s == P - 1) {  // the embedding group sums the tied copies
      const std::vector<int> members = {0, P - 1};
      auto g = gloo->Subgroup(members, "embedding");
      ASSERT_TRUE(g.ok()) << g.status();
      emb = *std::move(g);
      ASSERT_TRUE(m.AllReduceGradRange(emb.get(), s == 0 ? m.layout().wte : m.layout().out_w, 128 * 32).ok());
    }
    auto eval = ForwardPipelining(&m, comm, mbs[0]);
    ASSERT_TRUE(eval.ok()) << eval.status();
    // The slots a backend reserves up front are those the step and the evaluation took here.
    auto slots = InterleavedSlots(P, s, V, micro_batches, group);
    ASSERT_TRUE(slots.ok()) << slots.status();
    EXPECT_EQ(*slots, m.activation_slots()) << "stage " << s;
    std::lock_guard<std::mutex> lock(mu);
    posted[static_cast<size_t>(s)] = step;
    floats[static_cast<size_t>(s)] = m.ActivationFloats();  // the last chunk's slot, evaluation's last
    // Megatron's warm-up, (P - s - 1) * 2 + (V - 1) * N forwards, plus the first of the steady state.
    const int N = group > 0 ? group : P;
    EXPECT_EQ(stats.max_in_flight, std::min((P - s - 1) * 2 + (V - 1) * N + 1, micro_batches * V)) << "stage " << s;
    if (s == P - 1) {
      EXPECT_EQ(loss->loss_sum, ref.loss.loss_sum);
      EXPECT_EQ(loss->tokens, ref.loss.tokens);
      EXPECT_EQ(eval->loss_sum, ref.eval.loss_sum);
    } else {
      EXPECT_EQ(loss->tokens, 0.0);
    }
    std::vector<float> mine(static_cast<size_t>(m.num_params())), want(mine.size());
    ASSERT_TRUE(m.ReadGrads(mine).ok());
    CopyToShard(m.layout(), ref.grads, want);
    for (const ParamInfo& p : m.params_info()) {
      double worst = 0, scale = 0;
      int64_t differ = 0;
      for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(mine[i]) - want[i]));
        scale = std::max(scale, std::abs(static_cast<double>(want[i])));
        differ += mine[i] != want[i];
      }
      if (p.name == "embedding.word_embeddings.weight")  // one rank adds the two uses micro-batch by micro-batch
        EXPECT_LE(worst, 1e-5 * scale) << p.name << " on stage " << s;
      else
        EXPECT_EQ(differ, 0) << p.name << " on stage " << s << ": " << differ << " elements differ (worst " << worst
                             << ")";
    }
  });
  CheckNcclCanMatch(posted);
  // Only the slot whose pass ends in the loss holds the final norm (and its statistics), the logits
  // and the losses (and their gradient): 2 x 16 rows of 32, a vocabulary of 128.
  const int64_t n = 2 * 16;
  for (int s = 0; s + 1 < P; ++s)
    EXPECT_EQ(floats[static_cast<size_t>(P - 1)] - floats[static_cast<size_t>(s)], n * 32 + 2 * n + n * 128 + 2 * n)
        << "stage " << s;
}

TEST(InterleavedSchedule, TwoStagesOfTwoChunksGiveOneRanksLossAndGradients) { CheckInterleavedGivesOneRank(2, 2, 4); }
TEST(InterleavedSchedule, FourStagesOfTwoChunksGiveOneRanksLossAndGradients) { CheckInterleavedGivesOneRank(4, 2, 8); }
TEST(InterleavedSchedule, TwoStagesOfThreeChunks) { CheckInterleavedGivesOneRank(2, 3, 6); }
// As many micro-batches as stages: the first stages run every forward in the warm-up.
TEST(InterleavedSchedule, AsManyMicroBatchesAsStages) {
  CheckInterleavedGivesOneRank(2, 2, 4, 2);
  CheckInterleavedGivesOneRank(4, 2, 8, 4);
}

// --microbatch-group-size-per-virtual-pipeline-stage: other orders of the same passes, each chunk's
// backwards still in micro-batch order: one rank's loss and gradients bit for bit (the same as the
// default group's), and batches NCCL can match. Groups of 3 at P = 2 (8 micro-batches: 3, 3, 2), one
// group of the whole step, and at P = 4 9 micro-batches in groups of 5 (5, 4: not a multiple of P).
TEST(InterleavedSchedule, MicroBatchGroupsOtherThanTheStagesGiveOneRanksLossAndGradients) {
  CheckInterleavedGivesOneRank(2, 2, 4, 8, 3);
  CheckInterleavedGivesOneRank(2, 2, 4, 8, 8);
  CheckInterleavedGivesOneRank(2, 3, 6, 6, 4);
  CheckInterleavedGivesOneRank(4, 2, 8, 9, 5);
}

// The slots do not grow with the step (each chunk reuses its own: at P = 8, V = 4 48 of them, the
// CUDA model's most being 64), and a step the schedule refuses has no count.
TEST(InterleavedSchedule, SlotsAreBoundedWhateverTheMicroBatches) {
  for (int P : {2, 3, 4, 8})
    for (int V : {2, 3, 4})
      for (int s = 0; s < P; ++s) {
        auto few = InterleavedSlots(P, s, V, 4 * P), many = InterleavedSlots(P, s, V, 64 * P);
        ASSERT_TRUE(few.ok() && many.ok()) << few.status() << many.status();
        EXPECT_EQ(*few, *many) << "P " << P << " V " << V << " stage " << s;
        // At least the virtual micro-batches in flight; at most two groups of P per chunk.
        EXPECT_GE(*many, (P - s - 1) * 2 + (V - 1) * P + 1) << "P " << P << " V " << V << " stage " << s;
        EXPECT_LE(*many, 2 * P * V) << "P " << P << " V " << V << " stage " << s;
      }
  EXPECT_FALSE(InterleavedSlots(4, 0, 2, 6).ok());
  EXPECT_FALSE(InterleavedSlots(1, 0, 2, 4).ok());
}

// 3 TrainSteps of P = 2 stages x D = 2 data ranks (world rank d + 2p) of 2 chunks, 4 micro-batches a
// data rank, --overlap-grad-reduce with buckets of `bucket` elements (0: none): each rank's
// parameters after them, and the buckets its last step's backwards launched.
testing::OverlapRun TrainChunks(int64_t bucket, bool zero1) {
  const GPTConfig c = Config(4);
  const testing::Batches data(8 * 3, 16);
  const std::vector<ModelBatch> all = data.All();
  testing::OverlapRun out;
  std::mutex mu;
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    const int d = rank % 2, p = rank / 2;
    auto dp = world->Subgroup(std::vector<int>{2 * p, 2 * p + 1}, "data");
    auto pipe = world->Subgroup(std::vector<int>{d, d + 2}, "pipeline");
    ASSERT_TRUE(dp.ok() && pipe.ok()) << dp.status() << pipe.status();
    auto made = CpuGPTModel::Create(c, nullptr, false, Stage(c, 2, p, 2));
    ASSERT_TRUE(made.ok()) << made.status();
    CpuGPTModel& m = **made;
    ASSERT_TRUE(m.InitWeights(11).ok());
    if (zero1) {
      auto shard = ParamShard::Create(m.num_params(), 2, d);
      ASSERT_TRUE(shard.ok()) << shard.status();
      ASSERT_TRUE(m.ShardOptimizerState(*shard).ok());
    }
    // At P = 2 the embedding group is the pipeline's.
    ASSERT_NO_FATAL_FAILURE(
        testing::StepOverlapped(m, all, bucket, dp->get(), pipe->get(), pipe->get(), d, rank, &out, &mu));
  });
  return out;
}

TEST(InterleavedSchedule, OverlappedBucketsHaveTheBitsOfTheReductionAfterTheSchedule) {
  for (bool zero1 : {false, true}) {
    SCOPED_TRACE(zero1 ? "ZeRO-1" : "all-reduce");
    const testing::OverlapRun after = TrainChunks(0, zero1), overlapped = TrainChunks(3000, zero1);
    for (int rank = 0; rank < 4; ++rank) {
      ASSERT_FALSE(after.params[static_cast<size_t>(rank)].empty());
      EXPECT_EQ(overlapped.params[static_cast<size_t>(rank)], after.params[static_cast<size_t>(rank)])
          << "rank " << rank;
      // Each chunk's layers make buckets of their own, launched by the chunks' last backwards.
      EXPECT_GE(overlapped.launched[static_cast<size_t>(rank)], 2) << "rank " << rank;
      EXPECT_EQ(after.launched[static_cast<size_t>(rank)], 0) << "rank " << rank;
    }
  }
}

TEST(InterleavedSchedule, MicroBatchesNotAMultipleOfTheStagesAreRefused) {
  EXPECT_TRUE(CheckInterleavedMicroBatches(8, 4).ok());
  EXPECT_FALSE(CheckInterleavedMicroBatches(6, 4).ok());
  EXPECT_FALSE(CheckInterleavedMicroBatches(2, 4).ok());
  const GPTConfig c = Config(4);
  const testing::Batches data(3, 16);
  const std::vector<ModelBatch> mbs = data.All();
  const std::vector<double> scales(3, 1.0);
  testing::RunRanks(2, [&](Communicator* comm, int s) {
    auto made = CpuGPTModel::Create(c, nullptr, false, Stage(c, 2, s, 2));
    ASSERT_TRUE(made.ok()) << made.status();
    auto loss = ForwardBackwardPipelining(made->get(), comm, mbs, scales, 99);
    ASSERT_FALSE(loss.ok());
    EXPECT_NE(loss.status().message().find("--pipeline-model-parallel-size (2)"), std::string_view::npos)
        << loss.status();
  });
}

}  // namespace
}  // namespace ptk
