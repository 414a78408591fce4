// ZeRO-1 (--use-distributed-optimizer) and the gradient reduction overlapped with backward
// (--overlap-grad-reduce) on the CPU model at 1, 2 and 3 gloo ranks (threads on loopback): every
// step's loss, gradient norm and parameters have the bits of the plain all-reduce after backward,
// and the shards' moments put together are the plain path's moments; a model smaller than the
// ranks' blocks leaves a rank with an empty shard and still trains the same; the shard arithmetic
// (padding, ranges, a bucket's pieces, tensors cut at shard boundaries).
#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gloo_ranks.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/param_shard.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

using testing::RunRanks;

GPTConfig Config(int64_t vocab) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 8;
  c.vocab_size = vocab - 3;
  c.padded_vocab_size = vocab;
  c.hidden_dropout = c.attention_dropout = 0.1;
  return c;
}

SchedulerConfig Schedule() {
  SchedulerConfig s;
  s.max_lr = 1e-2;
  s.min_lr = 1e-3;
  s.decay_style = "cosine";
  s.decay_steps = 100;
  s.start_wd = s.end_wd = 0.1;
  s.wd_incr_steps = 100;
  return s;
}

// Rank `rank`'s micro-batch `m` of step `step` (2 x 8 tokens).
struct Batch {
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask;
  std::vector<int64_t> keys;
  Batch(const GPTConfig& c, int rank, int step, int m) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t x = i * 37 + rank * 101 + step * 13 + m * 7;
      tokens.push_back(static_cast<int32_t>(x % c.vocab_size));
      labels.push_back(static_cast<int32_t>((x * 11 + 3) % c.vocab_size));
      positions.push_back(static_cast<int32_t>(i % 8));
      mask.push_back((x % 5) == 4 ? 0.0f : 1.0f);
    }
    keys = {1000 * step + 10 * rank + 2 * m, 1000 * step + 10 * rank + 2 * m + 1};
  }
  ModelBatch View() const { return {2, 8, tokens.data(), labels.data(), positions.data(), mask.data(), keys.data()}; }
};

struct Trace {
  std::vector<StepResult> steps;
  std::vector<std::vector<float>> params;  // after each step
  std::vector<float> exp_avg, exp_avg_sq;  // the whole buffer's, after the last step
};

constexpr int kSteps = 4;

// One rank's run; with `zero`, the moments of every rank are put together into the trace. A
// positive `bucket` reduces the gradients in buckets of that many elements during the last
// micro-batch's backward (--overlap-grad-reduce --ddp-bucket-size).
Trace TrainRun(const GPTConfig& config, Communicator* comm, bool zero, int64_t bucket = 0) {
  Trace t;
  auto model = CpuGPTModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  const int64_t n = (*model)->num_params();
  if (zero) {
    auto shard = ParamShard::Create(n, comm->size(), comm->rank());
    EXPECT_TRUE(shard.ok());
    EXPECT_TRUE((*model)->ShardOptimizerState(*shard).ok());
  }
  EXPECT_TRUE((*model)->InitWeights(7).ok());
  OptimizerConfig oc;
  oc.overlap_grad_reduce = bucket > 0;
  oc.ddp_bucket_size = bucket;
  TrainStep opt(model->get(), oc, Schedule(), comm);
  if (bucket > 0) {
    EXPECT_GT(opt.buckets().size(), 2u);
  }
  for (int step = 0; step < kSteps; ++step) {
    Batch b0(config, comm->rank(), step, 0), b1(config, comm->rank(), step, 1);
    auto r = opt.Step({b0.View(), b1.View()}, 4 * comm->size(), 99);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return t;
    t.steps.push_back(*r);
    t.params.emplace_back(static_cast<size_t>(n));
    EXPECT_TRUE((*model)->ReadParams(t.params.back()).ok());
  }
  const int64_t size = (*model)->moments_size(), begin = (*model)->moments_begin();
  std::vector<float> m(static_cast<size_t>(size)), v(static_cast<size_t>(size));
  EXPECT_TRUE((*model)->ReadMoments(m, v).ok());
  t.exp_avg.assign(static_cast<size_t>(n), 0.0f);
  t.exp_avg_sq.assign(static_cast<size_t>(n), 0.0f);
  std::copy(m.begin(), m.end(), t.exp_avg.begin() + begin);
  std::copy(v.begin(), v.end(), t.exp_avg_sq.begin() + begin);
  if (zero) {
    std::vector<int64_t> bytes = (*model)->shard()->Counts();
    for (int64_t& x : bytes) x *= 4;
    EXPECT_TRUE(comm->AllGather(t.exp_avg.data(), bytes).ok());
    EXPECT_TRUE(comm->AllGather(t.exp_avg_sq.data(), bytes).ok());
  }
  return t;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

void ExpectSame(const Trace& plain, const Trace& zero, const std::string& what) {
  ASSERT_EQ(plain.steps.size(), zero.steps.size()) << what;
  for (size_t s = 0; s < plain.steps.size(); ++s) {
    EXPECT_EQ(plain.steps[s].loss_sum, zero.steps[s].loss_sum) << what << " step " << s;
    EXPECT_EQ(plain.steps[s].grad_norm, zero.steps[s].grad_norm) << what << " step " << s;
    EXPECT_TRUE(SameBits(plain.params[s], zero.params[s])) << what << ": parameters differ after step " << s;
  }
  EXPECT_TRUE(SameBits(plain.exp_avg, zero.exp_avg)) << what << ": exp_avg";
  EXPECT_TRUE(SameBits(plain.exp_avg_sq, zero.exp_avg_sq)) << what << ": exp_avg_sq";
}

// Plain and ZeRO-1 runs at `world` gloo ranks, each also with the reduction overlapped with
// backward in buckets: every rank's trace has the plain run's bits.
void CompareAt(int world, const GPTConfig& config) {
  const size_t w = static_cast<size_t>(world);
  std::vector<Trace> plain(w), zero(w), plain_overlap(w), zero_overlap(w);
  constexpr int64_t kBucket = 5000;  // several buckets, cut across layers and shard boundaries
  auto run = [&](std::vector<Trace>* out, bool z, int64_t bucket) {
    RunRanks(world, [&](Communicator* comm, int rank) {
      (*out)[static_cast<size_t>(rank)] = TrainRun(config, comm, z, bucket);
    });
  };
  run(&plain, false, 0);
  run(&zero, true, 0);
  run(&plain_overlap, false, kBucket);
  run(&zero_overlap, true, kBucket);
  for (size_t r = 0; r < w; ++r) {
    ExpectSame(plain[r], zero[r], "rank " + std::to_string(r));
    ExpectSame(plain[r], plain_overlap[r], "rank " + std::to_string(r) + ", overlapped");
    ExpectSame(plain[r], zero_overlap[r], "rank " + std::to_string(r) + ", ZeRO-1 overlapped");
  }
  // The clipping was active (the test exercises the norm's bits through the update).
  EXPECT_GT(plain[0].steps[0].grad_norm, 1.0);
}

TEST(ZeroOptimizer, OneRankEqualsThePlainStep) {
  const GPTConfig c = Config(2000);
  auto comm = MakeLocalCommunicator();
  const Trace plain = TrainRun(c, comm.get(), false);
  ExpectSame(plain, TrainRun(c, comm.get(), true), "1 rank");
  ExpectSame(plain, TrainRun(c, comm.get(), false, 3000), "1 rank, overlapped");
  ExpectSame(plain, TrainRun(c, comm.get(), true, 3000), "1 rank, ZeRO-1 overlapped");
}

TEST(ZeroOptimizer, TwoRanksEqualThePlainAllReduce) { CompareAt(2, Config(2000)); }

TEST(ZeroOptimizer, ThreeRanksEqualThePlainAllReduce) {
  const GPTConfig c = Config(2000);
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok());
  // Three real shards, with boundaries inside tensors.
  auto shard = ParamShard::Create(layout->num_params, 3, 2);
  ASSERT_TRUE(shard.ok());
  ASSERT_GT(shard->size(), 0);
  CompareAt(3, c);
}

TEST(ZeroOptimizer, RanksWithEmptyShardsStillTrainTheSame) {
  const GPTConfig c = Config(128);  // fewer parameters than two blocks: rank 2 owns nothing
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok());
  auto shard = ParamShard::Create(layout->num_params, 3, 2);
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ(shard->size(), 0);
  CompareAt(3, c);
}

TEST(ParamShard, RangesPaddingAndPieces) {
  auto s = ParamShard::Create(90000, 3, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->padded_size, 3 * 2 * ParamShard::kAlignment);  // 49152 < 90000 <= 98304
  EXPECT_EQ(s->shard_size, 2 * ParamShard::kAlignment);
  EXPECT_EQ(s->begin(), 32768);
  EXPECT_EQ(s->end(), 65536);
  EXPECT_EQ(s->end(2), 90000);
  EXPECT_EQ(s->Counts(), (std::vector<int64_t>{32768, 32768, 90000 - 65536}));
  EXPECT_EQ(s->CountsIn(30000, 70000), (std::vector<int64_t>{2768, 32768, 70000 - 65536}));
  EXPECT_EQ(s->CountsIn(40000, 40000), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_FALSE(ParamShard::Create(10, 2, 2).ok());
  EXPECT_FALSE(ParamShard::Create(10, 0, 0).ok());
  auto empty = ParamShard::Create(0, 2, 1);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 0);

  auto layout = ParamLayout::Create(Config(2000));
  ASSERT_TRUE(layout.ok());
  // Pieces cover [begin, end) exactly, in order, cut at the tensors' edges, with their decay group.
  const int64_t a = 1000, b = 70000;
  int64_t at = a;
  for (const ParamPiece& p : PiecesIn(*layout, a, b)) {
    EXPECT_EQ(p.offset, at);
    at += p.size;
    bool found = false;
    for (const ParamInfo& info : layout->infos)
      if (p.offset >= info.offset && p.offset < info.offset + info.size) {
        EXPECT_LE(p.offset + p.size, info.offset + info.size);
        EXPECT_EQ(p.no_weight_decay, info.no_weight_decay);
        found = true;
      }
    EXPECT_TRUE(found);
  }
  EXPECT_EQ(at, b);
}

TEST(ZeroOptimizer, ShardingIsOnceAndSizesAreChecked) {
  auto model = CpuGPTModel::Create(Config(128));
  ASSERT_TRUE(model.ok());
  auto other = ParamShard::Create(12345, 1, 0);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->ShardOptimizerState(*other)));
  auto shard = ParamShard::Create((*model)->num_params(), 1, 0);
  ASSERT_TRUE((*model)->ShardOptimizerState(*shard).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*model)->ShardOptimizerState(*shard)));
  std::vector<float> small(10);
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->ReadMoments(small, small)));
  std::vector<double> partials;
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->GradSumSquaresPartials(1, 5, &partials)));
}

// What a rank contributes when a checkpoint gathers the weights: its shard's range of them.
TEST(ZeroOptimizer, ReadOwnedParamsIsTheShardsRange) {
  auto model = CpuGPTModel::Create(Config(128));
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE((*model)->InitWeights(9).ok());
  const int64_t n = (*model)->num_params();
  std::vector<float> all(static_cast<size_t>(n)), owned(static_cast<size_t>(n));
  ASSERT_TRUE((*model)->ReadParams(all).ok());
  ASSERT_TRUE((*model)->ReadOwnedParams(owned).ok());  // unsharded: all of them
  EXPECT_EQ(owned, all);
  auto shard = ParamShard::Create(n, 3, 1);
  ASSERT_TRUE(shard.ok());
  ASSERT_TRUE((*model)->ShardOptimizerState(*shard).ok());
  ASSERT_GT(shard->size(), 0);
  std::vector<float> mine(static_cast<size_t>(shard->size()));
  ASSERT_TRUE((*model)->ReadOwnedParams(mine).ok());
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + shard->begin()));
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->ReadOwnedParams(all)));
}

}  // namespace
}  // namespace ptk
