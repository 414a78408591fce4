// Pipeline parallelism on the CPU backend: a stage's layout is the whole model's tensors cut at
// the stage's layers (the same init bits, put back together by CopyFromShard, the last stage's
// copy of tied embeddings); SendRecv between gloo ranks (threads) in both directions at once, in
// order; Megatron's 1F1B schedule at P = 2 and 4 over 4 layers and 8 micro-batches, dropout on,
// gives one rank's loss and gradients bit for bit (the tied embeddings' two copies summed over the
// embedding group within float rounding of one rank's interleaved sum), with at most P - s
// micro-batches in flight on stage s; forward-only evaluation gives one rank's loss; each stage
// holds the parameters --dry-run counts for it; --overlap-grad-reduce over P = 2 x D = 2 reduces
// buckets during the last backward with the bits of the reduction after the schedule; tied
// embeddings at P = 2 x D = 2 get Megatron's finalize_model_grads order (the data-parallel sums,
// then the embedding group's), checked against that sum of each rank's own gradients. The stages'
// exchange buffers (GPTModel::StageBuffers) per slot, and the agreement on what crosses between
// stages, refused with both named when they differ; forward-only passes agree once per format.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "tests/trainer/forwarding_comm.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/grad_buckets.h"
#include "trainer/parallel_params.h"
#include "trainer/param_shard.h"
#include "trainer/pipeline_schedule.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::OneRank;
using testing::Reference;

GPTConfig Config(bool untied = false) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = 97;
  c.padded_vocab_size = 128;
  c.hidden_dropout = c.attention_dropout = 0.1;
  c.untie_embeddings_and_output_weights = untied;
  return c;
}

// Micro-batch k of 2 samples of 16 tokens.
struct Batches : testing::Batches {
  explicit Batches(int count) : testing::Batches(count, 16) {}
};

std::vector<PipelineStage> Stages(int P, int64_t layers = 4) {
  std::vector<int64_t> per(static_cast<size_t>(P), layers / P);
  std::vector<PipelineStage> v;
  for (int p = 0; p < P; ++p) v.push_back(StageOf(per, p));
  return v;
}

TEST(PipelineLayout, StagesCutTheWholeModelWithItsInitAndPutItBackTogether) {
  for (bool untied : {false, true})
    for (int P : {2, 4}) {
      const GPTConfig c = Config(untied);
      auto whole = ParamLayout::Create(c);
      ASSERT_TRUE(whole.ok()) << whole.status();
      std::vector<float> init(static_cast<size_t>(whole->num_params)), back(init.size(), -1.0f);
      whole->InitWeights(7, init);
      std::multiset<std::string> names;
      for (const PipelineStage& st : Stages(P)) {
        auto s = ParamLayout::Create(c, 1, 0, st);
        ASSERT_TRUE(s.ok()) << s.status();
        EXPECT_EQ(s->pre_process, st.rank == 0);
        EXPECT_EQ(s->post_process, st.rank == P - 1);
        EXPECT_EQ(s->layers.size(), 4u / static_cast<size_t>(P));
        for (const ParamInfo& p : s->infos)
          if (!p.embedding_copy) names.insert(p.name);
        // The last stage keeps a copy of tied embeddings, as its last tensor.
        const bool copy = st.rank == P - 1 && !untied;
        EXPECT_EQ(!s->infos.empty() && s->infos.back().embedding_copy, copy);
        EXPECT_EQ(s->norm_end(), copy ? s->infos.back().offset : s->num_params);
        std::vector<float> mine(static_cast<size_t>(s->num_params)), cut(mine.size());
        s->InitWeights(7, mine);
        CopyToShard(*s, init, cut);
        EXPECT_EQ(mine, cut) << "stage " << st.rank << " of " << P;
        CopyFromShard(*s, mine, back);
        // --overlap-grad-reduce's ranges: one per layer and two more, covering the stage.
        const std::vector<GradRange> order = BackwardReadyOrder(*s);
        ASSERT_EQ(order.size(), s->layers.size() + 2);
        int64_t covered = 0;
        for (const GradRange& r : order) covered += r.size();
        EXPECT_EQ(covered, s->num_params);
      }
      std::multiset<std::string> want;
      for (const ParamInfo& p : whole->infos) want.insert(p.name);
      EXPECT_EQ(names, want);
      EXPECT_EQ(back, init);
    }
  // Megatron's uneven first and last stages.
  auto s = ParamLayout::Create(Config(), 1, 0, StageOf({1, 3}, 1));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->first_layer, 1);
  EXPECT_EQ(s->layers.size(), 3u);
  EXPECT_FALSE(ParamLayout::Create(Config(), 1, 0, PipelineStage{2, 1, 3, 2}).ok());  // past the last layer
}

// The model a stage builds holds what --dry-run counts for it (Megatron's parameter line).
TEST(PipelineLayout, StagesHoldWhatTheDryRunCounts) {
  for (bool untied : {false, true})
    for (int T : {1, 2})
      for (int P : {2, 4})
        for (int t = 0; t < T; ++t)
          for (const PipelineStage& st : Stages(P)) {
            const GPTConfig c = Config(untied);
            auto s = ParamLayout::Create(c, T, t, st);
            ASSERT_TRUE(s.ok()) << s.status();
            EXPECT_EQ(s->num_params, ParamsOnModelParallelRank(c, T, P, st.rank, st.num_layers))
                << "T=" << T << " P=" << P << " stage " << st.rank << (untied ? " untied" : " tied");
          }
}

TEST(PipelineComm, SendRecvBothWaysAtOnceInOrder) {
  testing::RunRanks(3, [](Communicator* comm, int r) {
    // Each rank sends two messages to the next and receives two from the previous, in one call
    // each, while its neighbours do the same (a ring: every rank sends before it receives).
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    for (int k = 0; k < 2; ++k) {
      std::vector<float> out(1000, static_cast<float>(10 * r + k)), in(1000, -1.0f);
      ASSERT_TRUE(comm->SendRecv(out.data(), 4000, next, in.data(), 4000, prev).ok());
      EXPECT_EQ(in, std::vector<float>(1000, static_cast<float>(10 * prev + k)));
    }
    // One-sided calls pair with the other side's.
    std::vector<float> v(10, static_cast<float>(r));
    if (r == 0) {
      ASSERT_TRUE(comm->SendRecv(v.data(), 40, 2, nullptr, 0, -1).ok());
    }
    if (r == 2) {
      ASSERT_TRUE(comm->SendRecv(nullptr, 0, -1, v.data(), 40, 0).ok());
      EXPECT_EQ(v, std::vector<float>(10, 0.0f));
    }
    EXPECT_FALSE(comm->SendRecv(v.data(), 40, r, nullptr, 0, -1).ok());  // not to itself
    // Nor to or from a rank that is not one (only -1 means none).
    EXPECT_FALSE(comm->SendRecv(v.data(), 40, -2, nullptr, 0, -1).ok());
    EXPECT_FALSE(comm->SendRecv(nullptr, 0, -1, v.data(), 40, 3).ok());
  });
  EXPECT_FALSE(MakeLocalCommunicator()->SendRecv(nullptr, 0, 0, nullptr, 0, -1).ok());
}

// The exchange buffers a stage hands the schedule (GPTModel::StageBuffers' host default, the CPU
// backend's): the previous stage's output lands in a buffer per slot, the output and the gradients
// in one each; none where the stage has no such neighbour; fp32 host memory whatever the
// communicator offers; slots taken in order; a pass over a slot whose buffers were never handed
// out is refused.
TEST(PipelineExchange, StageBuffersPerSlot) {
  const GPTConfig c = Config();
  const Batches data(2);
  const ModelBatch mb = data.Get(0);
  const int64_t nc = 2 * 16 * 32;
  const std::vector<PipelineStage> stages = Stages(4);
  auto first = CpuGPTModel::Create(c, nullptr, false, stages[0]);
  auto middle = CpuGPTModel::Create(c, nullptr, false, stages[1]);
  auto last = CpuGPTModel::Create(c, nullptr, false, stages[3]);
  ASSERT_TRUE(first.ok() && middle.ok() && last.ok());
  auto f0 = (*first)->StageBuffers(mb, 0, /*device_memory=*/true);
  ASSERT_TRUE(f0.ok()) << f0.status();
  EXPECT_EQ(f0->input, nullptr);
  EXPECT_EQ(f0->input_grad, nullptr);
  EXPECT_NE(f0->output, nullptr);
  EXPECT_NE(f0->output_grad, nullptr);
  EXPECT_EQ(f0->elements, nc);
  EXPECT_EQ(f0->wire, Precision::kFp32);
  EXPECT_EQ(f0->stream, nullptr);  // host memory, though the communicator would take device memory
  EXPECT_EQ(f0->bytes(), nc * 4);
  auto l0 = (*last)->StageBuffers(mb, 0, false);
  ASSERT_TRUE(l0.ok()) << l0.status();
  EXPECT_NE(l0->input, nullptr);
  EXPECT_NE(l0->input_grad, nullptr);
  EXPECT_EQ(l0->output, nullptr);
  EXPECT_EQ(l0->output_grad, nullptr);
  auto m0 = (*middle)->StageBuffers(mb, 0, false);
  auto m1 = (*middle)->StageBuffers(mb, 1, false);
  ASSERT_TRUE(m0.ok() && m1.ok());
  EXPECT_NE(m0->input, m1->input);  // each slot's input its own
  EXPECT_EQ(m0->output, m1->output);
  for (const void* p : {m0->input, m0->output, m0->output_grad, m0->input_grad}) EXPECT_NE(p, nullptr);
  auto gap = (*middle)->StageBuffers(mb, 3, false);
  EXPECT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("slots are taken in order"), std::string_view::npos) << gap.status();
  auto none = (*middle)->StageForwardExchanged(mb, 2, 1.0, true, 99);
  EXPECT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("StageBuffers first"), std::string_view::npos) << none.status();
  // Through the buffers, a stage's pass is the one StageForward makes from the same input.
  ASSERT_TRUE((*middle)->InitWeights(11).ok());
  std::vector<float> in(static_cast<size_t>(nc)), want(in.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 17) * 0.05f - 0.4f;
  std::copy(in.begin(), in.end(), static_cast<float*>(m1->input));
  ASSERT_TRUE((*middle)->StageForwardExchanged(mb, 1, std::nullopt, false, 0).ok());
  const std::vector<float> got(static_cast<const float*>(m1->output), static_cast<const float*>(m1->output) + nc);
  ASSERT_TRUE((*middle)->StageForward(mb, 0, in, want, std::nullopt, false, 0).ok());
  EXPECT_EQ(got, want);
  auto whole = CpuGPTModel::Create(c);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE((*whole)->StageBuffers(mb, 0, false).ok());  // not a pipeline stage
}

// An exchange description of `elements` values of type `wire` (host memory).
StageExchange Format(Precision wire, int64_t elements) {
  StageExchange e;
  e.wire = wire;
  e.elements = elements;
  return e;
}

// Each stage tells its neighbours what it sends and receives; one that differs (another wire
// type, another size) is refused on both sides of the boundary, the message naming both stages
// and both exchanges.
TEST(PipelineExchange, StagesAgreeOnTheirExchange) {
  testing::RunRanks(3, [&](Communicator* comm, int r) {
    EXPECT_TRUE(CheckStageExchangeAgreement(comm, Format(Precision::kBf16, 1024)).ok());
    // Stage 2 exchanges fp32: stages 1 and 2 refuse, stage 0 (which meets only stage 1) does not.
    const absl::Status wire =
        CheckStageExchangeAgreement(comm, Format(r == 2 ? Precision::kFp32 : Precision::kBf16, 1024));
    if (r == 0) {
      EXPECT_TRUE(wire.ok()) << wire;
    } else {
      EXPECT_EQ(wire.code(), absl::StatusCode::kFailedPrecondition) << wire;
      const std::string msg(wire.message());
      EXPECT_NE(msg.find("stages 1 and 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fp32 activations of 1024 elements"), std::string::npos) << msg;
      EXPECT_NE(msg.find("bf16 activations of 1024 elements"), std::string::npos) << msg;
    }
    // Stage 0 exchanges fewer elements: stages 0 and 1 refuse.
    const absl::Status size = CheckStageExchangeAgreement(comm, Format(Precision::kFp32, r == 0 ? 512 : 1024));
    EXPECT_EQ(size.ok(), r == 2) << size;
    if (r < 2) {
      EXPECT_NE(size.message().find("stages 0 and 1"), std::string_view::npos) << size;
    }
  });
}

// A real communicator underneath, its point-to-point calls counted.
class CountingCommunicator final : public testing::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  absl::Status SendRecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                        int src) override {
    ++send_recvs;
    return ForwardingCommunicator::SendRecv(send, send_bytes, dst, recv, recv_bytes, src);
  }
  int send_recvs = 0;
};

// Forward-only passes (evaluation's micro-batches, a sample's tokens) with a StageExchangeAgreement
// agree on each exchange format once: many calls of one shape cost a stage one agreement (its two
// messages), not one per call, with the same losses; a new shape is agreed once more, the first
// one not again. Without it every call agrees.
TEST(PipelineExchange, ForwardPassesAgreeOncePerFormat) {
  GPTConfig c = Config();
  c.num_layers = 3;
  constexpr int P = 3, kCalls = 5;
  const std::vector<PipelineStage> stages = Stages(P, 3);
  const Batches t16(1);
  const testing::Batches t8(1, 8);
  testing::RunRanks(P, [&](Communicator* comm, int s) {
    auto m = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(s)]);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE((*m)->InitWeights(11).ok());
    const int links = (s > 0 ? 1 : 0) + (s + 1 < P ? 1 : 0);  // activation messages per pass
    CountingCommunicator each_call(comm), once(comm);
    StageExchangeAgreement agreed;
    std::vector<double> plain, kept;
    for (int i = 0; i < kCalls; ++i) {
      auto l = ForwardPipelining(m->get(), &each_call, t16.Get(0));
      ASSERT_TRUE(l.ok()) << l.status();
      plain.push_back(l->loss_sum);
      auto k = ForwardPipelining(m->get(), &once, t16.Get(0), nullptr, &agreed);
      ASSERT_TRUE(k.ok()) << k.status();
      kept.push_back(k->loss_sum);
    }
    EXPECT_EQ(each_call.send_recvs, kCalls * (2 + links));
    EXPECT_EQ(once.send_recvs, 2 + kCalls * links);
    EXPECT_EQ(kept, plain);
    if (s == P - 1) {
      EXPECT_GT(kept[0], 0.0);
    }
    for (const ModelBatch& mb : {t8.Get(0), t8.Get(0), t16.Get(0)})
      ASSERT_TRUE(ForwardPipelining(m->get(), &once, mb, nullptr, &agreed).ok());
    EXPECT_EQ(once.send_recvs, 2 + kCalls * links + 2 + 3 * links);
  });
}

// Through a StageExchangeAgreement a format met for the first time is still checked with the
// neighbours, and a mismatch refused on both sides of the boundary; one agreed before costs nothing.
TEST(PipelineExchange, AnAgreementStillRefusesANewMismatch) {
  testing::RunRanks(3, [&](Communicator* comm, int r) {
    CountingCommunicator counted(comm);
    StageExchangeAgreement agreed;
    EXPECT_TRUE(agreed.Check(&counted, Format(Precision::kBf16, 1024)).ok());
    EXPECT_TRUE(agreed.Check(&counted, Format(Precision::kBf16, 1024)).ok());
    EXPECT_EQ(counted.send_recvs, 2);
    // Another shape, stage 2 at another precision: stages 1 and 2 refuse, naming both.
    const absl::Status wire = agreed.Check(&counted, Format(r == 2 ? Precision::kFp32 : Precision::kBf16, 2048));
    EXPECT_EQ(counted.send_recvs, 4);
    EXPECT_EQ(wire.ok(), r == 0) << wire;
    if (r > 0) {
      EXPECT_EQ(wire.code(), absl::StatusCode::kFailedPrecondition) << wire;
      EXPECT_NE(wire.message().find("stages 1 and 2"), std::string_view::npos) << wire;
      EXPECT_NE(wire.message().find("fp32 activations of 2048 elements"), std::string_view::npos) << wire;
    }
  });
}

// The schedule checks the agreement before any activation moves: stages whose micro-batches differ
// in shape are refused on both, naming both, instead of exchanging messages of different sizes.
TEST(PipelineSchedule, StagesThatExchangeDifferentActivationsAreRefused) {
  const GPTConfig c = Config();
  const Batches t16(2);
  const testing::Batches t8(2, 8);
  const std::vector<PipelineStage> stages = Stages(2);
  testing::RunRanks(2, [&](Communicator* comm, int s) {
    auto m = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(s)]);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE((*m)->InitWeights(11).ok());
    const std::vector<double> scales = {0.5, 0.5};
    auto loss = ForwardBackwardPipelining(m->get(), comm, s == 0 ? t16.All() : t8.All(), scales, 99);
    ASSERT_FALSE(loss.ok());
    EXPECT_EQ(loss.status().code(), absl::StatusCode::kFailedPrecondition) << loss.status();
    EXPECT_NE(loss.status().message().find("stages 0 and 1"), std::string_view::npos) << loss.status();
    EXPECT_NE(loss.status().message().find("of 1024 elements"), std::string_view::npos) << loss.status();
    EXPECT_NE(loss.status().message().find("of 512 elements"), std::string_view::npos) << loss.status();
  });
}

// The last stage keeps its losses until the schedule ends (StageForwardExchanged's defer_loss, then
// TakeLosses); a schedule that fails part-way (here its second micro-batch is of another shape, after
// the first one's forward and backward) drops those it kept: the next schedule's loss is the one a
// fresh stage gives.
TEST(PipelineSchedule, AFailedScheduleLeavesNoLossBehind) {
  const GPTConfig c = Config();
  const Batches t16(2);
  const testing::Batches t8(1, 8);
  const std::vector<ModelBatch> good = t16.All(), bad = {t16.Get(0), t8.Get(0)};
  const std::vector<double> scales = {0.5, 0.5};
  const std::vector<PipelineStage> stages = Stages(2);
  std::vector<double> after(2), fresh(2);
  std::mutex mu;
  for (bool fail_first : {true, false})
    testing::RunRanks(2, [&](Communicator* comm, int s) {
      auto m = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(s)]);
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_TRUE((*m)->InitWeights(11).ok());
      if (fail_first) {
        auto failed = ForwardBackwardPipelining(m->get(), comm, bad, scales, 99);
        EXPECT_FALSE(failed.ok());
        EXPECT_NE(failed.status().message().find("different shapes"), std::string_view::npos) << failed.status();
      }
      auto loss = ForwardBackwardPipelining(m->get(), comm, good, scales, 99);
      ASSERT_TRUE(loss.ok()) << loss.status();
      std::lock_guard<std::mutex> lock(mu);
      (fail_first ? after : fresh)[static_cast<size_t>(s)] = loss->loss_sum;
    });
  EXPECT_GT(fresh[1], 0.0);
  EXPECT_EQ(after, fresh);
}

void CheckPipelineGivesOneRank(int P, bool untied) {
  const GPTConfig c = Config(untied);
  const Batches data(8);
  const std::vector<ModelBatch> mbs = data.All();
  std::vector<double> scales;
  for (size_t k = 0; k < mbs.size(); ++k) scales.push_back(1.0 / (27.0 * 8.0) * (1.0 + 0.01 * static_cast<double>(k)));
  const Reference ref = OneRank(c, mbs, scales);
  const std::vector<PipelineStage> stages = Stages(P);
  std::mutex mu;
  testing::RunRanks(P, [&](Communicator* comm, int s) {
    auto made = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(s)]);
    ASSERT_TRUE(made.ok()) << made.status();
    CpuGPTModel& m = **made;
    ASSERT_TRUE(m.InitWeights(11).ok());
    ASSERT_TRUE(m.ZeroGrads().ok());
    PipelineStats stats;
    auto loss = ForwardBackwardPipelining(&m, comm, mbs, scales, 99, &stats);
    ASSERT_TRUE(loss.ok()) << loss.status();
    // The embedding group: the first and the last stage.
    std::unique_ptr<Communicator> emb;
    if (!untied && (s == 0 || s == P - 1)) {
      const std::vector<int> members = {0, P - 1};
      auto g = comm->Subgroup(members, "embedding");
      ASSERT_TRUE(g.ok()) << g.status();
      emb = *std::move(g);
      const ParamLayout& lay = m.layout();
      ASSERT_TRUE(m.AllReduceGradRange(emb.get(), s == 0 ? lay.wte : lay.out_w, 128 * 32).ok());
    }
    auto eval = ForwardPipelining(&m, comm, mbs[0]);
    ASSERT_TRUE(eval.ok()) << eval.status();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(stats.max_in_flight, P - s) << "stage " << s;
    EXPECT_EQ(m.activation_slots(), P - s);
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
      const bool tied_embedding = !untied && p.name == "embedding.word_embeddings.weight";
      double worst = 0, scale = 0;
      int64_t differ = 0;
      for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(mine[i]) - want[i]));
        scale = std::max(scale, std::abs(static_cast<double>(want[i])));
        differ += mine[i] != want[i];
      }
      if (tied_embedding)  // one rank adds the two uses micro-batch by micro-batch
        EXPECT_LE(worst, 1e-5 * scale) << p.name << " on stage " << s;
      else
        EXPECT_EQ(differ, 0) << p.name << " on stage " << s << ": " << differ << " elements differ (worst " << worst
                             << ")";
    }
  });
}

TEST(PipelineSchedule, TwoStagesGiveOneRanksLossAndGradients) { CheckPipelineGivesOneRank(2, false); }
TEST(PipelineSchedule, FourStagesGiveOneRanksLossAndGradients) { CheckPipelineGivesOneRank(4, false); }
TEST(PipelineSchedule, UntiedOutputLayer) { CheckPipelineGivesOneRank(2, true); }

// Rank `rank` of P = 2 stages x D = 2 data ranks (world rank d + 2p, Megatron's order): its pipeline
// and data groups, the embedding group of the first and last stage when tied (the pipeline group
// itself at P = 2), and its stage's model from seed 5, its optimizer state ZeRO-1-sharded when asked.
struct StageRank {
  int d = 0, p = 0;
  std::unique_ptr<Communicator> pipe, dp, emb;
  std::unique_ptr<CpuGPTModel> model;
  std::pair<int64_t, int64_t> owned;  // the parameters this rank updates: its shard, or all
};
void MakeStageRank(Communicator* world, int rank, const GPTConfig& c, const std::vector<PipelineStage>& stages,
                   bool tied, bool zero1, StageRank* r) {
  r->d = rank % 2, r->p = rank / 2;
  const std::vector<int> pm = {r->d, r->d + 2}, dm = {2 * r->p, 2 * r->p + 1};
  auto pipe = world->Subgroup(pm, "pipeline" + std::to_string(r->d));
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  r->pipe = *std::move(pipe);
  auto dp = world->Subgroup(dm, "data" + std::to_string(r->p));
  ASSERT_TRUE(dp.ok()) << dp.status();
  r->dp = *std::move(dp);
  if (tied) {
    auto e = world->Subgroup(pm, "embedding" + std::to_string(r->d));
    ASSERT_TRUE(e.ok()) << e.status();
    r->emb = *std::move(e);
  }
  auto model = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(r->p)]);
  ASSERT_TRUE(model.ok()) << model.status();
  r->model = *std::move(model);
  ASSERT_TRUE(r->model->InitWeights(5).ok());
  r->owned = {0, r->model->num_params()};
  if (zero1) {
    auto shard = ParamShard::Create(r->model->num_params(), 2, r->d);
    ASSERT_TRUE(shard.ok());
    ASSERT_TRUE(r->model->ShardOptimizerState(*shard).ok());
    r->owned = {shard->begin(), shard->end()};
  }
}

// 3 steps of P = 2 stages x D = 2 data ranks (world rank d + 2p, Megatron's order), 8 micro-batches a
// step (4 per data rank), ZeRO-1 when asked, --overlap-grad-reduce with buckets of `bucket` elements
// (0: none): each rank's parameters after the steps, and the buckets its last backwards launched.
testing::OverlapRun TrainStages(bool zero1, int64_t bucket, bool untied) {
  const GPTConfig c = Config(untied);
  const Batches data(8 * 3);
  testing::OverlapRun out;
  std::mutex mu;
  const std::vector<PipelineStage> stages = Stages(2);
  const std::vector<ModelBatch> all = data.All();
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    StageRank sr;
    ASSERT_NO_FATAL_FAILURE(MakeStageRank(world, rank, c, stages, !untied, zero1, &sr));
    ASSERT_NO_FATAL_FAILURE(testing::StepOverlapped(*sr.model, all, bucket, sr.dp.get(), sr.pipe.get(), sr.emb.get(),
                                                    sr.d, rank, &out, &mu));
  });
  return out;
}

// --overlap-grad-reduce over stages: each stage's data-parallel buckets are reduced while the last
// micro-batch's backward goes on (the tied embedding copies too, summed by the embedding group
// after the wait), with the bits of the reduction after the schedule, with and without ZeRO-1.
TEST(PipelineSchedule, OverlappedBucketReductionHasTheBitsOfTheReductionAfterTheSchedule) {
  for (bool untied : {false, true})
    for (bool zero1 : {false, true}) {
      SCOPED_TRACE(std::string(untied ? "untied" : "tied") + (zero1 ? ", ZeRO-1" : ""));
      const testing::OverlapRun after = TrainStages(zero1, 0, untied), overlapped = TrainStages(zero1, 3000, untied);
      for (int rank = 0; rank < 4; ++rank) {
        const auto& a = after.params[static_cast<size_t>(rank)];
        const auto& b = overlapped.params[static_cast<size_t>(rank)];
        ASSERT_EQ(a.size(), b.size());
        ASSERT_FALSE(a.empty());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "rank " << rank;
        // Each stage's layers make buckets of their own, launched during backward.
        EXPECT_GE(overlapped.launched[static_cast<size_t>(rank)], 2) << "rank " << rank;
        EXPECT_EQ(after.launched[static_cast<size_t>(rank)], 0) << "rank " << rank;
      }
    }
}

// P = 2 stages x D = 2 data ranks (world rank d + 2p) of tied embeddings: the gradients TrainStep
// leaves after one step's ComputeGradients, against an oracle of Megatron's finalize_model_grads
// order built here from each rank's own gradients (its pipeline's backward alone, scaled as
// Megatron scales the loss: the micro-batch's token mean / micro-batches / D): first the
// data-parallel sum of every gradient (finish_grad_sync; gloo adds in rank order), then the
// embedding group's sum of the two stages' copies of the word embeddings
// (_allreduce_word_embedding_grads): (a0 + a1) + (b0 + b1) for stage copies a, b and data ranks
// 0, 1, where summing the copies first gives (a0 + b0) + (a1 + b1). Plain, --overlap-grad-reduce,
// and ZeRO-1 (the shard each rank updates) with either.
std::vector<std::vector<float>> LocalStageGrads(const GPTConfig& c, const std::vector<ModelBatch>& all) {
  std::vector<std::vector<float>> out(4);
  std::mutex mu;
  const std::vector<PipelineStage> stages = Stages(2);
  testing::RunRanks(4, [&](Communicator* world, int rank) {
    const int d = rank % 2, p = rank / 2;
    const std::vector<int> pm = {d, d + 2};
    auto pipe = world->Subgroup(pm, "pipeline" + std::to_string(d));
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    auto model = CpuGPTModel::Create(c, nullptr, false, stages[static_cast<size_t>(p)]);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(5).ok());
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    const std::vector<ModelBatch> mine(all.begin() + 4 * d, all.begin() + 4 * d + 4);
    std::vector<double> scales;
    for (const ModelBatch& mb : mine) {
      double tokens = 0;
      for (int64_t i = 0; i < mb.b * mb.t; ++i) tokens += mb.loss_mask[i];
      scales.push_back(1.0 / (tokens * 4.0 * 2.0));
    }
    auto loss = ForwardBackwardPipelining(model->get(), pipe->get(), mine, scales, 99);
    ASSERT_TRUE(loss.ok()) << loss.status();
    std::vector<float> g(static_cast<size_t>((*model)->num_params()));
    ASSERT_TRUE((*model)->ReadGrads(g).ok());
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(rank)] = std::move(g);
  });
  return out;
}

TEST(PipelineSchedule, TiedEmbeddingGradientsAreSummedAfterTheDataParallelReduction) {
  const GPTConfig c = Config();
  const Batches data(8);
  const std::vector<ModelBatch> all = data.All();
  const std::vector<std::vector<float>> local = LocalStageGrads(c, all);
  for (const auto& g : local) ASSERT_FALSE(g.empty());
  const std::vector<PipelineStage> stages = Stages(2);
  std::vector<int64_t> tied_at(2);  // each stage's copy
  for (int p = 0; p < 2; ++p) {
    auto lay = ParamLayout::Create(c, 1, 0, stages[static_cast<size_t>(p)]);
    ASSERT_TRUE(lay.ok()) << lay.status();
    tied_at[static_cast<size_t>(p)] = p == 0 ? lay->wte : lay->out_w;
  }
  const int64_t tied_n = c.padded_vocab_size * c.hidden_size;
  // Megatron's order; rank r = d + 2p holds local[r].
  std::vector<std::vector<float>> want(4);
  for (int rank = 0; rank < 4; ++rank) {
    const size_t p = static_cast<size_t>(rank / 2);
    const auto &a0 = local[2 * p], &a1 = local[2 * p + 1];
    std::vector<float>& w = want[static_cast<size_t>(rank)];
    w.resize(a0.size());
    for (size_t i = 0; i < a0.size(); ++i) w[i] = a0[i] + a1[i];
    for (int64_t i = 0; i < tied_n; ++i) {
      const size_t e0 = static_cast<size_t>(tied_at[0] + i), e1 = static_cast<size_t>(tied_at[1] + i);
      const float first = local[0][e0] + local[1][e0], last = local[2][e1] + local[3][e1];
      w[static_cast<size_t>(tied_at[p] + i)] = first + last;
    }
  }
  int64_t old_order_differs = 0;  // that the two orders differ here at all
  for (int64_t i = 0; i < tied_n; ++i) {
    const size_t e0 = static_cast<size_t>(tied_at[0] + i), e1 = static_cast<size_t>(tied_at[1] + i);
    old_order_differs += (local[0][e0] + local[2][e1]) + (local[1][e0] + local[3][e1]) != want[0][e0];
  }
  EXPECT_GT(old_order_differs, 0);
  for (bool zero1 : {false, true})
    for (int64_t bucket : {int64_t{0}, int64_t{3000}}) {
      SCOPED_TRACE(std::string(zero1 ? "ZeRO-1" : "all-reduce") + (bucket ? ", overlapped buckets" : ""));
      std::vector<std::vector<float>> got(4);
      std::vector<std::pair<int64_t, int64_t>> checked(4);
      std::mutex mu;
      testing::RunRanks(4, [&](Communicator* world, int rank) {
        StageRank sr;
        ASSERT_NO_FATAL_FAILURE(MakeStageRank(world, rank, c, stages, true, zero1, &sr));
        OptimizerConfig oc;
        oc.overlap_grad_reduce = bucket > 0;
        oc.ddp_bucket_size = bucket;
        TrainStep step(sr.model.get(), oc, SchedulerConfig{}, sr.dp.get());
        step.set_pipeline(sr.pipe.get(), sr.emb.get());
        const std::vector<ModelBatch> mine(all.begin() + 4 * sr.d, all.begin() + 4 * sr.d + 4);
        auto r = step.ComputeGradients(mine, 99);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<float> g(static_cast<size_t>(sr.model->num_params()));
        ASSERT_TRUE(sr.model->ReadGrads(g).ok());
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(rank)] = std::move(g);
        checked[static_cast<size_t>(rank)] = sr.owned;
      });
      int64_t tied_checked = 0;
      for (int rank = 0; rank < 4; ++rank) {
        const auto& g = got[static_cast<size_t>(rank)];
        const auto& w = want[static_cast<size_t>(rank)];
        ASSERT_EQ(g.size(), w.size()) << "rank " << rank;
        const auto [begin, end] = checked[static_cast<size_t>(rank)];
        const int64_t at = tied_at[static_cast<size_t>(rank / 2)];
        int64_t differ = 0, tied_differ = 0;
        for (int64_t i = begin; i < end; ++i) {
          const bool tied = i >= at && i < at + tied_n;
          tied_checked += tied;
          if (std::memcmp(&g[static_cast<size_t>(i)], &w[static_cast<size_t>(i)], sizeof(float)) == 0) continue;
          ++differ;
          tied_differ += tied;
        }
        EXPECT_EQ(differ, 0) << "rank " << rank << ": " << differ << " gradients differ from Megatron's order, "
                             << tied_differ << " of them the tied embeddings'";
      }
      EXPECT_GE(tied_checked, 2 * tied_n);  // both stages' copies, on some data rank
    }
}

}  // namespace
}  // namespace ptk
