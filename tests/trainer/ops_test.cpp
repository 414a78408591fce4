// The CPU ops one by one: backward against central finite differences in double precision,
// float against double, and dropout masks that depend only on (seed, stream, index).
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/trainer/gradient_check.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/lr_schedule.h"
#include "trainer/parallel_layout.h"

namespace ptk {
namespace {

using testing::CheckElementwiseGradient;
using testing::CheckGradient;
using testing::Dot;
using testing::Random;

TEST(Ops, MatmulGradients) {
  const int64_t n = 5, ic = 7, oc = 4;
  auto x = Random(n * ic, 1), w = Random(oc * ic, 2), b = Random(oc, 3), r = Random(n * oc, 4);
  std::vector<double> out(n * oc);
  auto objective = [&] {
    cpu::MatmulForward(out.data(), x.data(), w.data(), b.data(), n, ic, oc);
    return Dot(out, r);
  };
  std::vector<double> dx(n * ic, 0), dw(oc * ic, 0), db(oc, 0);
  cpu::MatmulBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), n, ic, oc);
  CheckGradient(x, dx, objective, "dinp");
  CheckGradient(w, dw, objective, "dw");
  CheckGradient(b, db, objective, "dbias");
}

TEST(Ops, LayerNormGradients) {
  const int64_t n = 70, c = 9;  // more rows than one fixed block
  auto x = Random(n * c, 5), w = Random(c, 6), b = Random(c, 7), r = Random(n * c, 8);
  std::vector<double> out(n * c), mean(n), rstd(n);
  auto objective = [&] {
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c, 1e-5);
    return Dot(out, r);
  };
  objective();
  std::vector<double> dx(n * c, 0), dw(c, 0), db(c, 0);
  cpu::LayerNormBackward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(), rstd.data(), n, c);
  CheckGradient(x, dx, objective, "dinp");
  CheckGradient(w, dw, objective, "dw");
  CheckGradient(b, db, objective, "db");
}

TEST(Ops, EmbeddingGradients) {
  const int64_t n = 12, c = 70, v = 5, p = 6;
  std::vector<int32_t> tok(n), pos(n);
  for (int64_t i = 0; i < n; ++i) {
    tok[i] = static_cast<int32_t>((i * 7) % v);
    pos[i] = static_cast<int32_t>(i % p);
  }
  auto wte = Random(v * c, 9), wpe = Random(p * c, 10), r = Random(n * c, 11);
  std::vector<double> out(n * c);
  auto objective = [&] {
    cpu::EmbeddingForward(out.data(), tok.data(), pos.data(), wte.data(), wpe.data(), n, c);
    return Dot(out, r);
  };
  std::vector<double> dwte(v * c, 0), dwpe(p * c, 0);
  cpu::EmbeddingBackward(dwte.data(), dwpe.data(), r.data(), tok.data(), pos.data(), n, c);
  CheckGradient(wte, dwte, objective, "dwte");
  CheckGradient(wpe, dwpe, objective, "dwpe");
}

TEST(Ops, GeluGradientAndValues) {
  CheckElementwiseGradient(Random(50, 12, 2.0), 13, cpu::GeluForward<double>, cpu::GeluBackward<double>);
  double y;
  double one = 1.0;
  cpu::GeluForward(&y, &one, 1);
  EXPECT_NEAR(y, 0.8411919906082768, 1e-12);  // torch.nn.functional.gelu(1.0, approximate="tanh")
}

TEST(Ops, SoftmaxCrossEntropyGradients) {
  const int64_t n = 6, vp = 11;
  auto logits = Random(n * vp, 14, 3.0), dl = Random(n, 15);
  std::vector<int32_t> targets = {0, 3, 10, 5, 5, 7};
  std::vector<double> losses(n);
  auto objective = [&] {
    cpu::SoftmaxCrossEntropyForward(losses.data(), logits.data(), targets.data(), n, vp);
    return Dot(losses, dl);
  };
  objective();
  EXPECT_GT(losses[0], 0.0);
  std::vector<double> grad = logits;
  cpu::SoftmaxCrossEntropyBackward(grad.data(), targets.data(), dl.data(), n, vp);
  CheckGradient(logits, grad, objective, "dlogits");
}

TEST(Ops, FusedSoftmaxCrossEntropyEqualsForwardThenBackward) {
  const int64_t n = 7, vp = 13;
  auto logits = Random(n * vp, 22, 3.0), dl = Random(n, 23);
  std::vector<int32_t> targets = {0, 12, 3, 3, 5, 9, 1};
  std::vector<double> want_loss(n), got_loss(n), want_grad = logits, got_grad = logits;
  cpu::SoftmaxCrossEntropyForward(want_loss.data(), logits.data(), targets.data(), n, vp);
  cpu::SoftmaxCrossEntropyBackward(want_grad.data(), targets.data(), dl.data(), n, vp);
  cpu::SoftmaxCrossEntropyFused(got_grad.data(), got_loss.data(), targets.data(), dl.data(), n, vp);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(got_loss[i], want_loss[i], 1e-12);
  for (int64_t i = 0; i < n * vp; ++i) EXPECT_NEAR(got_grad[i], want_grad[i], 1e-12);
}

TEST(Ops, FusedSoftmaxCrossEntropyFloatPathMatchesDouble) {
  // The float path uses a vectorised exp (16 lanes, run-time ISA dispatch); libm's exp in double
  // is the reference. Rows longer than the lanes and with a tail, and logits far below the max.
  const int64_t n = 9, vp = 50304 + 7;
  auto logits = Random(n * vp, 24, 4.0), dl = Random(n, 25);
  for (int64_t i = 0; i < vp; i += 97) logits[i] -= 120.0;  // exp underflows to (almost) 0
  for (double& x : logits) x = static_cast<float>(x);       // both sides start from float inputs
  std::vector<int32_t> targets = {0, 1, 50303, 17, 4000, 9, 50310, 3, 12345};
  std::vector<double> want_loss(n), want_grad = logits;
  cpu::SoftmaxCrossEntropyFused(want_grad.data(), want_loss.data(), targets.data(), dl.data(), n, vp);
  std::vector<float> f(logits.begin(), logits.end()), got_loss(n), fdl(dl.begin(), dl.end());
  cpu::SoftmaxCrossEntropyFused(f.data(), got_loss.data(), targets.data(), fdl.data(), n, vp);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(got_loss[i], want_loss[i], 2e-6 * std::abs(want_loss[i])) << i;
  double num = 0, den = 0;
  for (int64_t i = 0; i < n * vp; ++i) {
    num += (f[i] - want_grad[i]) * (f[i] - want_grad[i]);
    den += want_grad[i] * want_grad[i];
  }
  EXPECT_LE(std::sqrt(num / den), 2e-6);  // float storage itself costs ~1.1e-6 here (libm's expf: 1.13e-6)
}

void CheckAttention(double p) {
  const AttentionShape s{2, 5, 3, 4};
  const int64_t c = s.nh * s.hd;
  auto qkv = Random(s.b * s.t * 3 * c, 16), r = Random(s.b * s.t * c, 17);
  std::vector<uint64_t> streams = {DropoutStream(11, 0, 3), DropoutStream(12, 0, 3)};
  std::vector<double> out(s.b * s.t * c), probs(s.b * s.nh * s.t * s.t);
  auto objective = [&] {
    cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, p, 42, streams.data());
    return Dot(out, r);
  };
  objective();
  // Causal: every probability row sums to one over j <= i and is zero above the diagonal.
  for (int64_t bh = 0; bh < s.b * s.nh; ++bh)
    for (int64_t i = 0; i < s.t; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < s.t; ++j) {
        double v = probs[(bh * s.t + i) * s.t + j];
        if (j > i) {
          EXPECT_EQ(v, 0.0);
        }
        sum += v;
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
    }
  std::vector<double> dqkv(qkv.size());
  cpu::AttentionBackward(dqkv.data(), r.data(), qkv.data(), probs.data(), s, p, 42, streams.data());
  CheckGradient(qkv, dqkv, objective, "dqkv");
}

TEST(Ops, AttentionGradients) { CheckAttention(0.0); }
TEST(Ops, AttentionGradientsWithDropout) { CheckAttention(0.3); }

TEST(Ops, DropoutGradientAndRate) {
  const int64_t n = 200000;
  std::vector<double> x(n, 1.0);
  cpu::Dropout(x.data(), n, 0.1, 7, DropoutStream(3, 1, 2));
  int64_t kept = 0;
  for (double v : x) {
    EXPECT_TRUE(v == 0.0 || std::abs(v - 1.0 / 0.9) < 1e-12);
    kept += v != 0.0;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.9, 0.005);
  // Linear in its input, so backward is the same op.
  auto y = Random(64, 18), r = Random(64, 19);
  std::vector<double> d = r;
  cpu::Dropout(d.data(), 64, 0.5, 1, 2);
  std::vector<double> tmp;
  auto objective = [&] {
    tmp = y;
    cpu::Dropout(tmp.data(), 64, 0.5, 1, 2);
    return Dot(tmp, r);
  };
  CheckGradient(y, d, objective, "dropout");
}

TEST(Ops, DropoutMaskIndependentOfThreads) {
  const int64_t n = 1 << 16;
  std::vector<float> one(n, 1.0f), two(n, 1.0f);
  tbb::task_arena(1).execute([&] { cpu::Dropout(one.data(), n, 0.25, 99, 5); });
  tbb::task_arena(2).execute([&] { cpu::Dropout(two.data(), n, 0.25, 99, 5); });
  EXPECT_EQ(one, two);
  std::vector<float> other(n, 1.0f);
  cpu::Dropout(other.data(), n, 0.25, 100, 5);
  EXPECT_NE(one, other);  // another seed, another mask
}

TEST(Ops, LayerNormWeightGradientIndependentOfThreads) {
  const int64_t n = 1000, c = 33;
  std::vector<float> x(n * c), dy(n * c), w(c, 1.3f), mean(n), rstd(n), out(n * c);
  auto rx = Random(n * c, 20), rd = Random(n * c, 21);
  for (int64_t i = 0; i < n * c; ++i) {
    x[i] = static_cast<float>(rx[i]);
    dy[i] = static_cast<float>(rd[i]);
  }
  std::vector<float> b(c, 0.1f);
  cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c, 1e-5);
  auto run = [&](int threads) {
    std::vector<float> dx(n * c, 0), dw(c, 0), db(c, 0);
    tbb::task_arena(threads).execute([&] {
      cpu::LayerNormBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                             n, c);
    });
    dx.insert(dx.end(), dw.begin(), dw.end());
    dx.insert(dx.end(), db.begin(), db.end());
    return dx;
  };
  EXPECT_EQ(run(1), run(2));
}

// The heads (backward: the query groups) run on several threads; each is one thread's whole, so
// the outputs and gradients are the same bits at any thread count, with grouped-query heads adding
// to one key and value gradient, dropout, and sequences longer than a GEMM tile (256 rows).
TEST(Ops, AttentionIndependentOfThreads) {
  for (const AttentionShape& s : {AttentionShape{3, 300, 4, 8, 2}, AttentionShape{2, 17, 6, 4}}) {
    const int64_t c = s.nh * s.hd;
    auto rq = Random(s.b * s.t * s.qkv_width(), 30), rd = Random(s.b * s.t * c, 31);
    std::vector<float> qkv(rq.begin(), rq.end()), dout(rd.begin(), rd.end());
    std::vector<uint64_t> streams;
    for (int64_t b = 0; b < s.b; ++b) streams.push_back(DropoutStream(static_cast<uint64_t>(b), 1, 3));
    auto run = [&](int threads) {
      std::vector<float> out(s.b * s.t * c), probs(s.b * s.nh * s.t * s.t), dqkv(qkv.size());
      tbb::task_arena(threads).execute([&] {
        cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.1, 42, streams.data());
        cpu::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), probs.data(), s, 0.1, 42, streams.data());
      });
      out.insert(out.end(), dqkv.begin(), dqkv.end());
      return out;
    };
    const std::vector<float> one = run(1);
    EXPECT_EQ(one, run(2)) << s.t;
    EXPECT_EQ(one, run(5)) << s.t;
  }
}

// Context parallelism's attention: the queries of some positions (a context rank's: Megatron's
// chunks r and 2C - 1 - r) over the whole samples give AttentionForward's rows of those positions,
// probabilities and dropout masks included, and backward the whole attention's gradient of an output
// gradient that is zero at the other positions: the rows' query gradients, the keys' and values'
// gradients of every position (in double, with dropout and grouped-query attention).
TEST(Ops, AttentionRowsAreTheWholeAttentionsRows) {
  const AttentionShape s{2, 16, 4, 8, 2};
  const int64_t c = s.nh * s.hd, w = s.qkv_width();
  const std::vector<int64_t> qpos = {4, 5, 6, 7, 8, 9, 10, 11};  // rank 1 of C = 2: chunks 1 and 2 of 4
  const int64_t tq = static_cast<int64_t>(qpos.size());
  const auto qkv = Random(s.b * s.t * w, 40), dout = Random(s.b * tq * c, 41);
  std::vector<uint64_t> streams;
  for (int64_t b = 0; b < s.b; ++b) streams.push_back(DropoutStream(static_cast<uint64_t>(b), 1, 3));
  std::vector<double> out(s.b * s.t * c), probs(s.b * s.nh * s.t * s.t), dqkv(qkv.size()), dwhole(out.size(), 0.0);
  cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.2, 42, streams.data());
  std::vector<double> q_rows(s.b * tq * w), out_rows(s.b * tq * c), probs_rows(s.b * s.nh * tq * s.t);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < tq; ++i) {
      std::copy_n(qkv.begin() + (b * s.t + qpos[i]) * w, w, q_rows.begin() + (b * tq + i) * w);
      std::copy_n(dout.begin() + (b * tq + i) * c, c, dwhole.begin() + (b * s.t + qpos[i]) * c);
    }
  cpu::AttentionRowsForward(out_rows.data(), probs_rows.data(), q_rows.data(), qkv.data(), qpos.data(), tq, s, 0.2, 42,
                            streams.data());
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < tq; ++i) {
      for (int64_t j = 0; j < c; ++j)
        EXPECT_NEAR(out_rows[(b * tq + i) * c + j], out[(b * s.t + qpos[i]) * c + j], 1e-12);
      for (int64_t h = 0; h < s.nh; ++h)
        for (int64_t j = 0; j < s.t; ++j)
          EXPECT_NEAR(probs_rows[((b * s.nh + h) * tq + i) * s.t + j],
                      probs[((b * s.nh + h) * s.t + qpos[i]) * s.t + j], 1e-12);
    }
  cpu::AttentionBackward(dqkv.data(), dwhole.data(), qkv.data(), probs.data(), s, 0.2, 42, streams.data());
  std::vector<double> dq_rows(q_rows.size(), 0.0), dkv(qkv.size(), 0.0);
  cpu::AttentionRowsBackward(dq_rows.data(), dkv.data(), dout.data(), q_rows.data(), qkv.data(), probs_rows.data(),
                             qpos.data(), tq, s, 0.2, 42, streams.data());
  const int64_t per_group = s.nh / s.groups();
  double largest = 0;
  for (double v : dqkv) largest = std::max(largest, std::abs(v));
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t col = 0; col < w; ++col) {
      const bool query = col / s.hd % (per_group + 2) < per_group;
      for (int64_t i = 0; i < tq && query; ++i)
        EXPECT_NEAR(dq_rows[(b * tq + i) * w + col], dqkv[(b * s.t + qpos[i]) * w + col], 1e-12 * largest);
      for (int64_t pos = 0; pos < s.t && !query; ++pos)
        EXPECT_NEAR(dkv[(b * s.t + pos) * w + col], dqkv[(b * s.t + pos) * w + col], 1e-12 * largest);
      for (int64_t pos = 0; pos < s.t && query; ++pos) EXPECT_EQ(dkv[(b * s.t + pos) * w + col], 0.0);
    }
  EXPECT_GT(largest, 0.0);
}

// Gemm's tiles: GemmTiles computes those its filter accepts with Gemm's bits and leaves the others.
TEST(Ops, GemmTilesAreGemmsTilesBitForBit) {
  const int64_t m = 600, n = 2500, k = 24;  // 3 x 3 tiles, the last row and column partial
  auto floats = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const auto a = floats(Random(m * k, 60)), b = floats(Random(n * k, 61));
  std::vector<float> whole(m * n), some(m * n, 7.0f);
  cpu::Gemm<float>(false, true, m, n, k, 0.5f, a.data(), k, b.data(), k, 0.0f, whole.data(), n);
  cpu::GemmTiles<float>(false, true, m, n, k, 0.5f, a.data(), k, b.data(), k, 0.0f, some.data(), n,
                        [](int64_t row0, int64_t, int64_t col0, int64_t) { return row0 + 1 >= col0 / 4; });
  int64_t skipped = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const bool needed = i / 256 * 256 + 1 >= j / 1024 * 1024 / 4;
      const float want = needed ? whole[i * n + j] : 7.0f;
      skipped += needed ? 0 : 1;
      ASSERT_EQ(std::memcmp(&some[i * n + j], &want, sizeof(float)), 0) << i << " " << j;
    }
  EXPECT_EQ(skipped, 256 * (2500 - 1024) + 256 * (2500 - 2048));  // tiles (0, 1), (0, 2), (1, 2)
}

// The causal attention leaves out Gemm's tiles of keys after every row of the tile (a context rank's
// first chunk over the later chunks' keys; the top right of a whole sample's mask) with the same bits
// as computing them: forward's outputs and probabilities, backward's query, key and value gradients
// (fp32, as trained), for every rank of C = 1, 2 and 4, with and without dropout and grouped-query
// attention, on sequences of 1 to 4 column tiles, the last one partial.
TEST(Ops, AttentionRowsSkipTheMaskedKeysWithTheSameBits) {
  for (const AttentionShape& s :
       {AttentionShape{2, 32, 4, 8, 4}, AttentionShape{1, 2048, 2, 16, 2}, AttentionShape{1, 3584, 1, 8, 1}})
    for (int C : {1, 2, 4})
      for (int rank = 0; rank < C; ++rank)
        for (double p : {0.0, 0.1}) {
          SCOPED_TRACE(::testing::Message() << "t " << s.t << " C " << C << " rank " << rank << " p " << p);
          const std::vector<int64_t> qpos = ContextParallelPositions(s.t, C, rank);
          const int64_t tq = static_cast<int64_t>(qpos.size()), c = s.nh * s.hd, w = s.qkv_width();
          auto floats = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
          const auto kv = floats(Random(s.b * s.t * w, 50)), q_rows = floats(Random(s.b * tq * w, 51));
          const auto dout = floats(Random(s.b * tq * c, 52));
          std::vector<uint64_t> streams;
          for (int64_t b = 0; b < s.b; ++b) streams.push_back(DropoutStream(static_cast<uint64_t>(b), 1, 3));
          struct Result {
            std::vector<float> out, probs, dq, dkv;
          };
          auto run = [&](cpu::MaskedKeys keys) {
            // What the op leaves alone stays 7: the same in both.
            Result r{std::vector<float>(s.b * tq * c), std::vector<float>(s.b * s.nh * tq * s.t, 7.0f),
                     std::vector<float>(q_rows.size(), 7.0f), std::vector<float>(kv.size(), 7.0f)};
            cpu::AttentionRowsForward(r.out.data(), r.probs.data(), q_rows.data(), kv.data(), qpos.data(), tq, s, p, 42,
                                      streams.data(), keys);
            cpu::AttentionRowsBackward(r.dq.data(), r.dkv.data(), dout.data(), q_rows.data(), kv.data(), r.probs.data(),
                                       qpos.data(), tq, s, p, 42, streams.data(), keys);
            return r;
          };
          const Result skip = run(cpu::MaskedKeys::kSkip), every = run(cpu::MaskedKeys::kCompute);
          auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
          };
          EXPECT_TRUE(same_bits(skip.out, every.out));
          EXPECT_TRUE(same_bits(skip.probs, every.probs));
          EXPECT_TRUE(same_bits(skip.dq, every.dq));
          EXPECT_TRUE(same_bits(skip.dkv, every.dkv));
        }
}

TEST(Ops, AdamWMatchesTorchFormula) {
  // One element by hand: torch.optim.AdamW(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
  // two steps with gradients 0.5 then -0.25 from p = 1.0.
  double p = 1.0, m = 0, v = 0;
  double g1 = 0.5, g2 = -0.25;
  cpu::AdamW(&p, &g1, &m, &v, 1, AdamWParams{0.1, 0.9, 0.95, 1e-8, 0.1, 1});
  cpu::AdamW(&p, &g2, &m, &v, 1, AdamWParams{0.1, 0.9, 0.95, 1e-8, 0.1, 2});
  // Reference computed with torch 1.13: p after two steps.
  double want = 1.0 * (1 - 0.01);
  want -= 0.1 * (0.05 / 0.1) / (std::sqrt(0.05 * 0.25 / 0.05) + 1e-8);
  want *= (1 - 0.01);
  double m2 = 0.9 * 0.05 + 0.1 * -0.25, v2 = 0.95 * (0.05 * 0.25) + 0.05 * 0.0625;
  want -= 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.9025)) + 1e-8);
  EXPECT_NEAR(p, want, 1e-12);
}

TEST(Schedule, MegatronFormulas) {
  SchedulerConfig c;
  c.max_lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 100;
  c.decay_steps = 1000;
  c.decay_style = "cosine";
  ASSERT_TRUE(c.Validate().ok());
  OptimizerParamScheduler s(c);
  EXPECT_EQ(s.lr(), 0.0);  // Megatron's first iteration with warm-up runs at --lr-warmup-init
  s.set_num_steps(50);
  EXPECT_NEAR(s.lr(), 5e-4, 1e-15);
  s.set_num_steps(550);
  EXPECT_NEAR(s.lr(), 1e-4 + 0.5 * 9e-4, 1e-15);  // half way: cos(pi/2) = 0
  s.set_num_steps(1001);
  EXPECT_EQ(s.lr(), 1e-4);
  c.decay_style = "linear";
  OptimizerParamScheduler lin(c);
  lin.set_num_steps(325);
  EXPECT_NEAR(lin.lr(), 1e-4 + 0.75 * 9e-4, 1e-15);
  c.decay_style = "inverse-square-root";
  OptimizerParamScheduler isr(c);
  isr.set_num_steps(400);
  EXPECT_NEAR(isr.lr(), 1e-3 * 10.0 / 20.0, 1e-15);
  c.decay_style = "WSD";
  c.wsd_decay_steps = 200;
  c.wsd_decay_style = "linear";
  OptimizerParamScheduler wsd(c);
  wsd.set_num_steps(700);
  EXPECT_EQ(wsd.lr(), 1e-3);  // stable phase
  wsd.set_num_steps(900);
  EXPECT_NEAR(wsd.lr(), 1e-4 + 0.5 * 9e-4, 1e-15);
  c.decay_style = "constant";
  OptimizerParamScheduler cst(c);
  cst.set_num_steps(5000);
  EXPECT_EQ(cst.lr(), 1e-3);
  c.decay_style = "cosine";
  c.warmup_steps = 1000;
  EXPECT_FALSE(c.Validate().ok());
  c.warmup_steps = 10;
  c.decay_style = "exotic";
  EXPECT_FALSE(c.Validate().ok());
}

// Megatron's OptimizerParamScheduler.load_state_dict. The checkpoint's settings
// against the command line's: a difference stops the resume, naming it and the two flags;
// --override-opt_param-scheduler takes the command line's, --use-checkpoint-opt_param-scheduler the
// checkpoint's. Settings the style in use ignores are not compared.
TEST(Schedule, ResumeComparesTheCheckpointsSettingsAsMegatron) {
  SchedulerConfig saved;
  saved.max_lr = 1e-3;
  saved.min_lr = 1e-4;
  saved.decay_steps = 20 * 8;  // --train-iters 20, global batch 8
  saved.decay_style = "cosine";
  saved.wd_incr_steps = 20 * 8;
  SchedulerConfig here = saved;
  std::vector<std::string> notes;
  auto same = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kCheck, 20, 8, &notes);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(notes.empty());
  // --train-iters 40: a longer decay, and a longer weight-decay increment, which Megatron 0.16.1 compares
  // too (its load_state_dict checks every saved setting, whatever the styles: scheduler_resume_test's golden).
  here.decay_steps = here.wd_incr_steps = 40 * 8;
  auto stop = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kCheck, 20, 8, &notes);
  ASSERT_FALSE(stop.ok());
  const std::string msg(stop.status().message());
  EXPECT_TRUE(ptk::IsUsageError(stop.status())) << msg;
  for (const char* part : {"checkpoint of iteration 20", "decay length (--lr-decay-iters or --lr-decay-samples",
                           "40 iterations (320 samples) here, 20 iterations (160 samples) in the checkpoint",
                           "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"})
    EXPECT_NE(msg.find(part), std::string::npos) << part << "\n" << msg;
  EXPECT_NE(msg.find("weight-decay increment length"), std::string::npos) << msg;
  EXPECT_EQ(CompareSchedulers(here, saved, 8).size(), 2u);
  auto kept = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kUseCheckpoint, 20, 8, &notes);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->decay_steps, 160);
  EXPECT_EQ(kept->wd_incr_steps, 160);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("the checkpoint's schedule: decay length 20 iterations (160 samples) (this command line: "
                          "40 iterations (320 samples))"),
            std::string::npos)
      << notes[0];
  auto replaced = ResolveResumedScheduler(here, saved, SchedulerOnLoad::kOverride, 20, 8, &notes);
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(replaced->decay_steps, 320);
  // The numbers: iteration 21 of the resumed run (step 20 x 8 samples done, 21 after).
  OptimizerParamScheduler s(*kept);
  s.set_num_steps(21 * 8);
  EXPECT_EQ(s.lr(), 1e-4);  // past the checkpoint's decay: the minimum
  s.set_config(*replaced);
  EXPECT_GT(s.lr(), 4e-4);  // the command line's longer cosine
  // Each of Megatron's settings is compared; the increment too, used or not.
  for (int k = 0; k < 8; ++k) {
    SchedulerConfig h = saved;
    if (k == 0) h.max_lr = 2e-3;
    if (k == 1) h.min_lr = 0;
    if (k == 2) h.warmup_steps = 8;
    if (k == 3) h.decay_style = "linear";
    if (k == 4) h.end_wd = h.start_wd = 0.1;
    if (k == 5) h.wd_incr_style = "linear";
    if (k == 6) {
      h.wd_incr_style = saved.wd_incr_style = "cosine";
      h.wd_incr_steps = 99;
    }
    if (k == 7) {
      h.warmup_steps = saved.warmup_steps = 8;
      h.init_lr = 1e-5;
    }
    EXPECT_EQ(CompareSchedulers(h, saved, 8).size(), k == 4 ? 2u : 1u) << k;  // 4: the start and the end
    saved.wd_incr_style = "constant";
  }
  // Under a constant rate the minimum and the decay length are not used, but Megatron compares them all the same.
  SchedulerConfig cst = saved;
  cst.decay_style = "constant";
  SchedulerConfig cst2 = cst;
  cst2.min_lr = 0;
  cst2.decay_steps = 999;
  EXPECT_EQ(CompareSchedulers(cst2, cst, 8).size(), 2u);
}

}  // namespace
}  // namespace ptk
