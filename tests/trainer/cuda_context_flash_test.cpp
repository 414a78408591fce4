// The groundwork of a fused context-parallel attention (trainer/cuda/context_flash.h), on the CPU: every rank's
// pairs of chunks cover each sample's causal chunk triangle once, at the query rows of its
// ContextParallelPositions; a pair's key/value offset in the all-gathered pieces is context_rows.h's mapping;
// the pairs' partial outputs merged in order are the direct causal softmax's output and log-sum-exp; and the
// pairs' gradients with the final output and log-sum-exp sum to the direct softmax's dQ, dK, dV.
#include "trainer/cuda/context_flash.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "trainer/cuda/context_rows.h"
#include "trainer/parallel_layout.h"

namespace ptk::cuda::context_detail {
namespace {

TEST(CudaContextFlash, PairsCoverEachSamplesCausalChunksOnce) {
  for (const int C : {1, 2, 3, 4}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t chunk = 3, S = 2 * C * chunk;
    std::vector<int> hits(static_cast<size_t>(4 * C * C), 0);
    for (int r = 0; r < C; ++r) {
      const std::vector<FlashPair> pairs = ContextFlashPairs(C, r);
      EXPECT_EQ(pairs.front(), (FlashPair{0, r, 0, r == 0, true}));
      ASSERT_EQ(pairs.size(), static_cast<size_t>(2 * C + 1)) << "rank " << r;
      const std::vector<int64_t> pos = ContextParallelPositions(S, C, r);
      for (size_t k = 0; k < pairs.size(); ++k) {
        const FlashPair& p = pairs[k];
        EXPECT_EQ(pos[static_cast<size_t>(p.half * chunk)], p.q_chunk * chunk) << "rank " << r << " pair " << k;
        EXPECT_EQ(ChunkOwner(p.q_chunk, C), r);
        EXPECT_EQ(ChunkHalf(p.q_chunk, C), p.half);
        EXPECT_LE(p.kv_chunk, p.q_chunk);
        EXPECT_EQ(p.causal, p.kv_chunk == p.q_chunk);
        EXPECT_EQ(p.first, p.kv_chunk == 0);
        if (k > 0 && !p.first) {
          EXPECT_EQ(pairs[k - 1].kv_chunk, p.kv_chunk - 1) << "merge order j = 0, 1, ...";
        }
        ++hits[static_cast<size_t>(p.q_chunk * 2 * C + p.kv_chunk)];
      }
    }
    for (int i = 0; i < 2 * C; ++i)
      for (int j = 0; j < 2 * C; ++j)
        EXPECT_EQ(hits[static_cast<size_t>(i * 2 * C + j)], j <= i ? 1 : 0) << "chunks " << i << ", " << j;
  }
}

TEST(CudaContextFlash, KvOffsetIsTheGatheredRowsOfTheChunk) {
  for (const int C : {1, 2, 3, 4}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t b = 3, chunk = 2, t = 2 * chunk, w = 5, S = C * t;
    const std::vector<int64_t> table = ContextParallelPositionTable(S, C);
    for (int j = 0; j < 2 * C; ++j)
      for (int64_t s = 0; s < b; ++s)
        for (int64_t k = 0; k < chunk; ++k)
          for (int64_t col = 0; col < w; ++col) {
            const int64_t e = PairKvOffset(j, b, t, w, C) + s * t * w + k * w + col;
            ASSERT_EQ(WholeIndex(e, b, t, w, C, table.data()), (s * S + j * chunk + k) * w + col)
                << "chunk " << j << " sample " << s << " row " << k << " column " << col;
          }
    EXPECT_EQ(PairRowOffset(0, t, w), 0);
    EXPECT_EQ(PairRowOffset(1, t, w), chunk * w);
  }
}

// The column of head h's query (part 0), key (1) or value (2) element d in a qkv row: Megatron's (nh, 3, hd), or
// heads first with query groups (nh query heads, ng key heads, ng value heads).
int64_t QkvColumn(const FlashPairShape& s, int part, int64_t h, int64_t d) {
  if (s.ng == s.nh) return (h * 3 + part) * s.hd + d;
  return (part == 0 ? h * s.hd : (s.nh + (part - 1) * s.ng + h) * s.hd) + d;
}

// Every element of every pair's views: q, k, v land on the whole samples' rows of the query and key/value chunks
// (context_rows.h's mapping of the gathered pieces), out on this rank's rows of the query chunk, the partial and
// stats buffers are each covered once, half h's stats follow half 0's.
TEST(CudaContextFlash, PairViewsAreTheChunksRows) {
  for (const int C : {1, 2, 3})
    for (const int64_t ng : {3, 1}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " ng=" + std::to_string(ng));
      const FlashPairShape s{2, 4, 3, ng, 2, C};
      const int64_t chunk = s.t / 2, S = C * s.t, w = (s.nh + 2 * s.ng) * s.hd, c = s.nh * s.hd;
      const std::vector<int64_t> table = ContextParallelPositionTable(S, C);
      for (int r = 0; r < C; ++r)
        for (const FlashPair& p : ContextFlashPairs(C, r)) {
          const FlashPairViews v = ContextFlashViews(s, p);
          std::vector<int> part_out(static_cast<size_t>(s.b * chunk * c)),
              part_kv(static_cast<size_t>(s.b * chunk * ng * s.hd)),
              part_stats(static_cast<size_t>(s.b * s.nh * chunk));
          for (int64_t b = 0; b < s.b; ++b)
            for (int64_t k = 0; k < chunk; ++k)
              for (int64_t h = 0; h < s.nh; ++h) {
                const int64_t g = h / (s.nh / s.ng);
                for (int64_t d = 0; d < s.hd; ++d) {
                  const int64_t q_row = (b * S + p.q_chunk * chunk + k) * w,
                                kv_row = (b * S + p.kv_chunk * chunk + k) * w;
                  ASSERT_EQ(WholeIndex(v.q.At(b, h, k, d), s.b, s.t, w, C, table.data()),
                            q_row + QkvColumn(s, 0, h, d));
                  ASSERT_EQ(WholeIndex(v.k.At(b, g, k, d), s.b, s.t, w, C, table.data()),
                            kv_row + QkvColumn(s, 1, g, d));
                  ASSERT_EQ(WholeIndex(v.v.At(b, g, k, d), s.b, s.t, w, C, table.data()),
                            kv_row + QkvColumn(s, 2, g, d));
                  ASSERT_GE(v.q.At(b, h, k, d), r * s.b * s.t * w) << "the query chunk is this rank's piece";
                  ASSERT_LT(v.q.At(b, h, k, d), (r + 1) * s.b * s.t * w);
                  EXPECT_EQ(v.own_q.At(b, h, k, d), v.q.At(b, h, k, d) - r * s.b * s.t * w);
                  EXPECT_EQ(v.out.At(b, h, k, d), (b * s.t + p.half * chunk + k) * c + h * s.hd + d);
                  ++part_out[static_cast<size_t>(v.part_out.At(b, h, k, d))];
                  if (h == g * (s.nh / s.ng)) ++part_kv[static_cast<size_t>(v.part_kv.At(b, g, k, d))];
                }
                ++part_stats[static_cast<size_t>(v.part_stats.At(b, h, k, 0))];
                EXPECT_EQ(v.stats.At(b, h, k, 0), ((p.half * s.b + b) * s.nh + h) * chunk + k);
              }
          for (const std::vector<int>* hits : {&part_out, &part_kv, &part_stats})
            for (const int n : *hits) ASSERT_EQ(n, 1);
        }
    }
}

TEST(CudaContextFlash, MergeOfNoKeysKeepsTheOther) {
  EXPECT_EQ(MergedLse(-INFINITY, 1.5f), 1.5f);
  EXPECT_EQ(MergedLse(1.5f, -INFINITY), 1.5f);
  EXPECT_EQ(MergedLse(-INFINITY, -INFINITY), -INFINITY);
  EXPECT_FLOAT_EQ(MergedLse(0.0f, 0.0f), std::log(2.0f));
  EXPECT_EQ(MergedOutput(NAN, -INFINITY, 2.5f, 0.25f), 2.5f);  // the empty running output is dropped
  EXPECT_EQ(MergedOutput(2.5f, 0.25f, NAN, -INFINITY), 2.5f);
  EXPECT_FLOAT_EQ(MergedOutput(1.0f, 0.0f, 3.0f, 0.0f), 2.0f);
}

// One head of whole samples (b, S) of q, k, v (hd each), the direct causal softmax in double, and the
// context-parallel ranks' pair-by-pair forward (merged in fp32) and backward.
struct Problem {
  int C;
  int64_t b, chunk, S, hd;
  double scale;
  std::vector<float> q, k, v, dout;  // (b, S, hd)
  float at(const std::vector<float>& x, int64_t s, int64_t row, int64_t d) const {
    return x[static_cast<size_t>((s * S + row) * hd + d)];
  }
};

Problem MakeProblem(int C, uint32_t seed) {
  Problem p{C, 2, 3, 0, 4, 0.0, {}, {}, {}, {}};
  p.S = 2 * C * p.chunk;
  p.scale = 1.0 / std::sqrt(static_cast<double>(p.hd));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  for (std::vector<float>* x : {&p.q, &p.k, &p.v, &p.dout}) {
    x->resize(static_cast<size_t>(p.b * p.S * p.hd));
    for (float& e : *x) e = dist(rng);
  }
  return p;
}

double Score(const Problem& p, int64_t s, int64_t i, int64_t j) {
  double acc = 0;
  for (int64_t d = 0; d < p.hd; ++d) acc += static_cast<double>(p.at(p.q, s, i, d)) * p.at(p.k, s, j, d);
  return acc * p.scale;
}

// The direct causal softmax of row (s, i): its log-sum-exp, output (hd) and probabilities (i + 1).
double DirectRow(const Problem& p, int64_t s, int64_t i, std::vector<double>* out, std::vector<double>* probs) {
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j <= i; ++j) m = std::fmax(m, Score(p, s, i, j));
  for (int64_t j = 0; j <= i; ++j) sum += std::exp(Score(p, s, i, j) - m);
  const double lse = m + std::log(sum);
  out->assign(static_cast<size_t>(p.hd), 0.0);
  probs->assign(static_cast<size_t>(i + 1), 0.0);
  for (int64_t j = 0; j <= i; ++j) {
    (*probs)[static_cast<size_t>(j)] = std::exp(Score(p, s, i, j) - lse);
    for (int64_t d = 0; d < p.hd; ++d)
      (*out)[static_cast<size_t>(d)] += (*probs)[static_cast<size_t>(j)] * p.at(p.v, s, j, d);
  }
  return lse;
}

// A pair's partial for the row at whole position i: the softmax over key chunk j's keys (causal: those <= i)
// alone, in fp32 as cuDNN's output, and its log-sum-exp (-inf for no key).
float PartialRow(const Problem& p, int64_t s, int64_t i, const FlashPair& pair, std::vector<float>* out) {
  const int64_t j0 = pair.kv_chunk * p.chunk, j1 = pair.causal ? i + 1 : j0 + p.chunk;
  double m = -INFINITY, sum = 0;
  for (int64_t j = j0; j < j1; ++j) m = std::fmax(m, Score(p, s, i, j));
  for (int64_t j = j0; j < j1; ++j) sum += std::exp(Score(p, s, i, j) - m);
  out->assign(static_cast<size_t>(p.hd), 0.0f);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t d = 0; d < p.hd; ++d)
      (*out)[static_cast<size_t>(d)] += static_cast<float>(std::exp(Score(p, s, i, j) - m) / sum * p.at(p.v, s, j, d));
  return static_cast<float>(m + std::log(sum));
}

TEST(CudaContextFlash, MergedPairsAreTheCausalSoftmax) {
  for (const int C : {1, 2, 3}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const Problem p = MakeProblem(C, 7u + static_cast<uint32_t>(C));
    std::vector<double> want, probs;
    std::vector<float> part;
    for (int r = 0; r < C; ++r)
      for (int64_t s = 0; s < p.b; ++s)
        for (int half = 0; half < 2; ++half)
          for (int64_t row = 0; row < p.chunk; ++row) {
            std::vector<float> acc(static_cast<size_t>(p.hd), 0.0f);
            float lse = -INFINITY;
            for (const FlashPair& pair : ContextFlashPairs(C, r)) {
              if (pair.half != half) continue;
              const int64_t i = pair.q_chunk * p.chunk + row;
              const float l = PartialRow(p, s, i, pair, &part);
              for (int64_t d = 0; d < p.hd; ++d) {
                float& o = acc[static_cast<size_t>(d)];
                o = pair.first ? part[static_cast<size_t>(d)] : MergedOutput(o, lse, part[static_cast<size_t>(d)], l);
              }
              lse = pair.first ? l : MergedLse(lse, l);
            }
            const int64_t i = ContextParallelPositions(p.S, C, r)[static_cast<size_t>(half * p.chunk + row)];
            const double direct = DirectRow(p, s, i, &want, &probs);
            EXPECT_NEAR(lse, direct, 1e-5) << "rank " << r << " sample " << s << " position " << i;
            for (int64_t d = 0; d < p.hd; ++d)
              EXPECT_NEAR(acc[static_cast<size_t>(d)], want[static_cast<size_t>(d)], 1e-5)
                  << "rank " << r << " sample " << s << " position " << i << " channel " << d;
          }
  }
}

// Gradients of the whole samples, (b, S, hd) each.
struct Grads {
  std::vector<double> dq, dk, dv;
  explicit Grads(const Problem& p) : dq(static_cast<size_t>(p.b * p.S * p.hd)), dk(dq.size()), dv(dq.size()) {}
};

// Row (s, i)'s gradient over keys [j0, j1) from the final log-sum-exp and D = rowsum(dO O) (the whole softmax's
// backward restricted to the keys: one pair's, or with [0, i + 1) the direct one).
void RowBackward(const Problem& p, int64_t s, int64_t i, int64_t j0, int64_t j1, double lse, double D, Grads* g) {
  const auto at = [&](int64_t row, int64_t d) { return static_cast<size_t>((s * p.S + row) * p.hd + d); };
  for (int64_t j = j0; j < j1; ++j) {
    const double P = std::exp(Score(p, s, i, j) - lse);
    double dP = 0;
    for (int64_t d = 0; d < p.hd; ++d) {
      dP += static_cast<double>(p.at(p.dout, s, i, d)) * p.at(p.v, s, j, d);
      g->dv[at(j, d)] += P * p.at(p.dout, s, i, d);
    }
    const double dS = P * (dP - D) * p.scale;
    for (int64_t d = 0; d < p.hd; ++d) {
      g->dq[at(i, d)] += dS * p.at(p.k, s, j, d);
      g->dk[at(j, d)] += dS * p.at(p.q, s, i, d);
    }
  }
}

TEST(CudaContextFlash, PairGradientsWithTheFinalStatsSumToTheSoftmaxGradient) {
  for (const int C : {1, 2, 3}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const Problem p = MakeProblem(C, 31u + static_cast<uint32_t>(C));
    Grads direct(p), pairs(p);
    std::vector<double> out, probs;
    for (int64_t s = 0; s < p.b; ++s)
      for (int64_t i = 0; i < p.S; ++i) {
        const double lse = DirectRow(p, s, i, &out, &probs);
        double D = 0;
        for (int64_t d = 0; d < p.hd; ++d) D += out[static_cast<size_t>(d)] * p.at(p.dout, s, i, d);
        RowBackward(p, s, i, 0, i + 1, lse, D, &direct);
        for (int r = 0; r < C; ++r)
          for (const FlashPair& pair : ContextFlashPairs(C, r)) {
            if (i / p.chunk != pair.q_chunk) continue;
            const int64_t j0 = pair.kv_chunk * p.chunk;
            RowBackward(p, s, i, j0, pair.causal ? i + 1 : j0 + p.chunk, lse, D, &pairs);
          }
      }
    for (size_t e = 0; e < direct.dq.size(); ++e) {
      EXPECT_NEAR(pairs.dq[e], direct.dq[e], 1e-9) << "dq element " << e;
      EXPECT_NEAR(pairs.dk[e], direct.dk[e], 1e-9) << "dk element " << e;
      EXPECT_NEAR(pairs.dv[e], direct.dv[e], 1e-9) << "dv element " << e;
    }
  }
}

}  // namespace
}  // namespace ptk::cuda::context_detail
