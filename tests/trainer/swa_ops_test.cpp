// The CPU attention's sliding window and softmax offset (AttentionShape::window, sink, dsink): each row's
// probabilities over its window only, summing with the sink's exp() to 1; the QKV and offset gradients against
// central differences in double (grouped-query attention, dropout on); the same bits for any thread count.
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gradient_check.h"
#include "trainer/counter_rng.h"
#include "trainer/cpu/ops_cpu.h"

namespace ptk {
namespace {

using testing::CheckGradient;
using testing::Dot;
using testing::Random;

constexpr int64_t kWindow = 2;

TEST(SwaOps, RowsAttendTheirWindowBesideTheSink) {
  AttentionShape s{1, 6, 2, 4, 1};
  const std::vector<float> sink = {0.7f, -1.5f};
  s.window = kWindow;
  s.sink = sink.data();
  const auto qkv = Random(s.b * s.t * s.qkv_width(), 3);
  std::vector<double> out(s.b * s.t * s.nh * s.hd), probs(s.b * s.nh * s.t * s.t);
  cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.0, 1, nullptr);
  // One group (the key and value after both query heads in a token's row): row i of head h is
  // exp(q.k_j / sqrt(hd)) / (exp(sink[h]) + sum over j in i-2..i of exp(q.k_j / sqrt(hd))), zero elsewhere.
  const int64_t w = s.qkv_width();
  for (int64_t h = 0; h < s.nh; ++h)
    for (int64_t i = 0; i < s.t; ++i) {
      std::vector<double> e(static_cast<size_t>(s.t), 0.0);
      double z = std::exp(static_cast<double>(sink[h]));
      for (int64_t j = std::max<int64_t>(0, i - kWindow); j <= i; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < s.hd; ++d) dot += qkv[i * w + h * s.hd + d] * qkv[j * w + 2 * s.hd + d];
        e[j] = std::exp(dot / std::sqrt(static_cast<double>(s.hd)));
        z += e[j];
      }
      for (int64_t j = 0; j < s.t; ++j) EXPECT_NEAR(probs[(h * s.t + i) * s.t + j], e[j] / z, 1e-12) << h << i << j;
    }
}

void CheckGradients(double p) {
  AttentionShape s{2, 7, 4, 3, 2};
  std::vector<float> sink = {0.3125f, -0.1875f, 1.125f, 0.0f};
  s.window = kWindow;
  const auto dout = Random(s.b * s.t * s.nh * s.hd, 5);
  auto qkv = Random(s.b * s.t * s.qkv_width(), 4);
  std::vector<uint64_t> streams;
  for (int64_t b = 0; b < s.b; ++b) streams.push_back(DropoutStream(static_cast<uint64_t>(b), 1, 3));
  std::vector<double> out(dout.size()), probs(s.b * s.nh * s.t * s.t);
  std::vector<double> sink_d(sink.begin(), sink.end());
  auto objective = [&] {
    for (size_t h = 0; h < sink.size(); ++h) sink[h] = static_cast<float>(sink_d[h]);
    AttentionShape f = s;
    f.sink = sink.data();
    cpu::AttentionForward(out.data(), probs.data(), qkv.data(), f, p, 9, streams.data());
    return Dot(out, dout);
  };
  objective();
  std::vector<double> dqkv(qkv.size());
  std::vector<float> dsink(sink.size(), 0.5f);  // added to
  AttentionShape b = s;
  b.sink = sink.data();
  b.dsink = dsink.data();
  cpu::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), probs.data(), b, p, 9, streams.data());
  CheckGradient(qkv, dqkv, objective, "dqkv");
  // The offsets are floats: central differences over them by 2^-10, exact in float from these values (multiples
  // of 2^-4), in double otherwise (truncation error about h^2: 1e-6).
  const double h = 1.0 / 1024;
  for (size_t k = 0; k < sink.size(); ++k) {
    const double keep = sink_d[k];
    sink_d[k] = keep + h;
    const double up = objective();
    sink_d[k] = keep - h;
    const double down = objective();
    sink_d[k] = keep;
    EXPECT_NEAR(dsink[k] - 0.5, (up - down) / (2 * h), 1e-5) << "dsink " << k;
  }
}

TEST(SwaOps, GradientsOfTheQkvAndTheOffsets) { CheckGradients(0.0); }
TEST(SwaOps, GradientsWithDropout) { CheckGradients(0.3); }

TEST(SwaOps, TheSameBitsForAnyThreadCount) {
  AttentionShape s{3, 40, 4, 8, 2};
  std::vector<float> sink = {0.1f, 0.2f, -0.3f, 0.4f};
  s.window = 5;
  s.sink = sink.data();
  const int64_t c = s.nh * s.hd;
  std::vector<float> qkv(s.b * s.t * s.qkv_width()), dout(s.b * s.t * c);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>(std::cos(0.11 * static_cast<double>(i)));
  std::vector<uint64_t> streams;
  for (int64_t b = 0; b < s.b; ++b) streams.push_back(DropoutStream(static_cast<uint64_t>(b), 1, 3));
  auto run = [&](int threads) {
    std::vector<float> out(s.b * s.t * c), probs(s.b * s.nh * s.t * s.t), dqkv(qkv.size()), dsink(4, 0.0f);
    AttentionShape b = s;
    b.dsink = dsink.data();
    tbb::task_arena(threads).execute([&] {
      cpu::AttentionForward(out.data(), probs.data(), qkv.data(), s, 0.1, 42, streams.data());
      cpu::AttentionBackward(dqkv.data(), dout.data(), qkv.data(), probs.data(), b, 0.1, 42, streams.data());
    });
    out.insert(out.end(), dqkv.begin(), dqkv.end());
    out.insert(out.end(), dsink.begin(), dsink.end());
    return out;
  };
  const std::vector<float> one = run(1);
  EXPECT_EQ(one, run(2));
  EXPECT_EQ(one, run(5));
}

}  // namespace
}  // namespace ptk
