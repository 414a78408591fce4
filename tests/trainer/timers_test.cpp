// Megatron's timers: the names of each level in training_log's order, no timer (and no device
// synchronisation) above the run's level, the start/stop synchronisation of the ones made, the
// barrier before each level-1 start (Megatron's barrier_with_L1_time), the text of
// each --timing-log-option to the character, the TensorBoard scalars, and the all-gather over gloo ranks.
#include "trainer/timers.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/trainer/gloo_ranks.h"

namespace ptk {
namespace {

TEST(Timers, NamesOfEachLevelInMegatronsOrder) {
  EXPECT_TRUE(Timers::NamesToLog(0).empty());
  const std::vector<std::string> one = Timers::NamesToLog(1);
  ASSERT_EQ(one.size(), 12u);
  EXPECT_EQ(one.front(), "forward-backward");
  EXPECT_EQ(one[3], "all-grads-sync");
  EXPECT_EQ(one.back(), "optimizer");
  const std::vector<std::string> two = Timers::NamesToLog(2);
  ASSERT_EQ(two.size(), 24u);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), two.begin()));  // level 1's first, then level 2's
  EXPECT_EQ(two[12], "batch-generator");
  EXPECT_EQ(two[15], "forward-recv");
  EXPECT_EQ(two.back(), "forward-backward-send-forward-backward-recv");
}

TEST(Timers, AboveTheLevelNothingIsMadeNorSynchronised) {
  int syncs = 0;
  auto sync = [&syncs] {
    ++syncs;
    return absl::OkStatus();
  };
  Timers zero(0, TimingLogOption::kMinMax, sync);
  ASSERT_TRUE(zero.Start("forward-backward", 1).ok());
  ASSERT_TRUE(zero.Stop("forward-backward").ok());
  EXPECT_FALSE(zero.Has("forward-backward"));
  EXPECT_EQ(syncs, 0);
  Timers one(1, TimingLogOption::kMinMax, sync);
  ASSERT_TRUE(one.Start("forward-compute", 2).ok());
  ASSERT_TRUE(one.Stop("forward-compute").ok());
  EXPECT_FALSE(one.Has("forward-compute"));
  EXPECT_EQ(syncs, 0);
  ASSERT_TRUE(one.Start("optimizer", 1).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(one.Stop("optimizer").ok());
  EXPECT_EQ(syncs, 2);  // before the clock at start and at stop, as Megatron's cuda.synchronize
  EXPECT_TRUE(one.Has("optimizer"));
  EXPECT_GE(one.Elapsed("optimizer"), 0.002);
  one.Reset();
  EXPECT_EQ(one.Elapsed("optimizer"), 0.0);
}

TEST(Timers, ASynchronisationErrorIsReturned) {
  Timers t(2, TimingLogOption::kMinMax, [] { return absl::InternalError("cudaStreamSynchronize failed"); });
  EXPECT_EQ(t.Start("forward-compute", 2).message(), "cudaStreamSynchronize failed");
}

TEST(Timers, MegatronsTextForEachOption) {
  const std::vector<std::string> names = {"forward-backward", "all-grads-sync", "forward-recv"};
  // Seconds over two iterations, [rank][name]: forward-recv timed by rank 1 only, all-grads-sync by none.
  const std::vector<std::vector<double>> times = {{0.5, 0.0, 0.0}, {0.25, 0.0, 0.125}};
  EXPECT_EQ(*FormatTimers(names, times, TimingLogOption::kMinMax, 2.0),
            "(min, max) time across ranks (ms):\n"
            "    forward-backward ...............................: (125.00, 250.00)\n"
            "    forward-recv ...................................: (62.50, 62.50)");
  EXPECT_EQ(*FormatTimers(names, times, TimingLogOption::kMax, 2.0),
            "max time across ranks (ms):\n"
            "    forward-backward ...............................: 250.00\n"
            "    forward-recv ...................................: 62.50");
  EXPECT_EQ(*FormatTimers(names, times, TimingLogOption::kAll, 2.0),
            "times across ranks (ms):\n"
            "  forward-backward:\n"
            "     rank  0: 250.00\n"
            "     rank  1: 125.00\n"
            "  forward-recv:\n"
            "     rank  1: 62.50");
  EXPECT_FALSE(FormatTimers(names, {{0, 0, 0}, {0, 0, 0}}, TimingLogOption::kMinMax, 1.0).has_value());
  EXPECT_FALSE(FormatTimers(names, {{0, 0, 0}}, TimingLogOption::kAll, 1.0).has_value());
  const auto scalars = TimerScalars(names, times, 2.0);  // the slowest rank's seconds per iteration
  ASSERT_EQ(scalars.size(), 2u);
  EXPECT_EQ(scalars[0].first, "forward-backward-time");
  EXPECT_EQ(scalars[0].second, 0.25);
  EXPECT_EQ(scalars[1].first, "forward-recv-time");
  EXPECT_EQ(scalars[1].second, 0.0625);
  EXPECT_EQ(ParseTimingLogOption("minmax"), TimingLogOption::kMinMax);
  EXPECT_EQ(ParseTimingLogOption("max"), TimingLogOption::kMax);
  EXPECT_EQ(ParseTimingLogOption("all"), TimingLogOption::kAll);
  EXPECT_FALSE(ParseTimingLogOption("min").has_value());
}

// Megatron's barrier_with_L1_time: each start of a level-1 timer that is made waits at the barrier
// first, then synchronises the device; level-2 timers, stops, timers above the level and a run at
// level 0 never call it; without the barrier (--no-barrier-with-level-1-timing) only the
// synchronisations remain; a failed barrier is returned.
TEST(Timers, LevelOneStartsWaitAtTheBarrierFirst) {
  std::string calls;
  auto sync = [&calls] {
    calls += 's';
    return absl::OkStatus();
  };
  auto barrier = [&calls] {
    calls += 'B';
    return absl::OkStatus();
  };
  auto run = [](Timers& t) {
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(t.Start("forward-backward", 1).ok());
      EXPECT_TRUE(t.Start("forward-compute", 2).ok());
      EXPECT_TRUE(t.Stop("forward-compute").ok());
      EXPECT_TRUE(t.Stop("forward-backward").ok());
      EXPECT_TRUE(t.Start("optimizer", 1).ok());
      EXPECT_TRUE(t.Stop("optimizer").ok());
    }
  };
  Timers zero(0, TimingLogOption::kMinMax, sync, barrier);
  run(zero);
  EXPECT_EQ(calls, "");
  Timers one(1, TimingLogOption::kMinMax, sync, barrier);
  run(one);
  EXPECT_EQ(calls, "BssBssBssBss");
  calls.clear();
  Timers two(2, TimingLogOption::kMinMax, sync, barrier);
  run(two);
  EXPECT_EQ(calls, "BssssBssBssssBss");
  calls.clear();
  Timers unbarred(2, TimingLogOption::kMinMax, sync);
  run(unbarred);
  EXPECT_EQ(calls, "ssssssssssss");
  Timers failing(1, TimingLogOption::kMinMax, sync, [] { return absl::UnavailableError("gloo barrier timed out"); });
  EXPECT_EQ(failing.Start("optimizer", 1).message(), "gloo barrier timed out");
  EXPECT_TRUE(failing.Start("forward-compute", 2).ok());
}

// Three gloo ranks: each its own timers; the gather gives every rank every rank's row, zeros where
// a rank never made the timer, and resets them.
TEST(Timers, GatherGivesEveryRankEveryRanksTimes) {
  const std::vector<std::string> names = {"forward-send", "forward-recv", "optimizer"};
  std::vector<std::vector<std::vector<double>>> got(3);
  testing::RunRanks(3, [&](Communicator* comm, int r) {
    Timers t(2);
    const char* p2p = r == 0 ? "forward-send" : "forward-recv";
    ASSERT_TRUE(t.Start(p2p, 2).ok());
    ASSERT_TRUE(t.Start("optimizer", 1).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ASSERT_TRUE(t.Stop(p2p).ok());
    ASSERT_TRUE(t.Stop("optimizer").ok());
    auto all = t.GatherElapsed(names, comm, /*reset=*/true);
    ASSERT_TRUE(all.ok()) << all.status();
    got[static_cast<size_t>(r)] = *all;
    EXPECT_EQ(t.Elapsed("optimizer"), 0.0);  // reset
  });
  for (int me = 0; me < 3; ++me) {
    SCOPED_TRACE("rank " + std::to_string(me));
    const auto& all = got[static_cast<size_t>(me)];
    ASSERT_EQ(all.size(), 3u);
    for (int r = 0; r < 3; ++r) {
      const auto& row = all[static_cast<size_t>(r)];
      ASSERT_EQ(row.size(), 3u);
      EXPECT_EQ(row[0] > 0, r == 0);
      EXPECT_EQ(row[1] > 0, r != 0);
      EXPECT_GE(row[2], 0.002);
      EXPECT_EQ(row, got[static_cast<size_t>(r)][static_cast<size_t>(r)]);  // the same numbers everywhere
    }
  }
}

}  // namespace
}  // namespace ptk
