// Megatron's --microbatch-group-size-per-virtual-pipeline-stage in ptk's interleaved schedule: every
// rank's forwards and backwards, (micro-batch, chunk) by (micro-batch, chunk), are megatron-core's
// (tests/data/trainer/megatron_vp_schedule.txt, written by tests/support/dump_megatron_vp_schedule.py
// from megatron-core's schedule table and warm-up count) for groups of P and of other sizes; the
// default group is P; and the group sizes Megatron refuses are refused with its two checks' terms.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "trainer/pipeline_schedule.h"

namespace ptk {
namespace {

using testing::ReadFile;
using testing::SourceDir;

std::string Passes(const std::vector<InterleavedPass>& order) {
  std::string s;
  for (const InterleavedPass& p : order)
    s += fmt::format("{}{}{}.{}", s.empty() ? "" : " ", p.forward ? 'F' : 'B', p.micro_batch, p.chunk);
  return s;
}

TEST(MicroBatchGroups, EveryRanksPassesAreMegatronCores) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/megatron_vp_schedule.txt"));
  std::string line;
  int cases = 0, other_groups = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    int P = 0, V = 0, M = 0, N = 0, rank = 0, warmup = 0;
    ASSERT_TRUE(fields >> P >> V >> M >> N >> rank >> warmup) << line;
    std::string want;
    std::getline(fields, want);
    want.erase(0, want.find_first_not_of(' '));
    SCOPED_TRACE(fmt::format("P {} V {} M {} N {} rank {}", P, V, M, N, rank));
    ASSERT_TRUE(CheckInterleavedMicroBatches(M, P, N).ok()) << CheckInterleavedMicroBatches(M, P, N);
    auto order = InterleavedOrder(P, rank, V, M, N);
    ASSERT_TRUE(order.ok()) << order.status();
    EXPECT_EQ(Passes(*order), want);
    // The warm-up: the forwards before the first backward.
    int forwards = 0;
    while (forwards < static_cast<int>(order->size()) && (*order)[static_cast<size_t>(forwards)].forward) ++forwards;
    EXPECT_EQ(forwards, warmup == M * V ? M * V : warmup + 1);
    if (N == P) {  // Megatron's default group
      auto by_default = InterleavedOrder(P, rank, V, M);
      ASSERT_TRUE(by_default.ok()) << by_default.status();
      EXPECT_EQ(*by_default, *order);
    } else {
      ++other_groups;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 69);
  EXPECT_GT(other_groups, 30);
}

// Megatron-core's checks, in its order: N within [P, M], then the last group (M mod N) empty or of at
// least P micro-batches. Without N, M a multiple of P (its default N = P).
TEST(MicroBatchGroups, GroupsMegatronRefusesAreRefused) {
  struct Case {
    int M, P, N;
    const char* says;  // "" when accepted
  };
  for (const Case& c : {
           Case{8, 4, 0, ""},
           Case{6, 4, 0, "must be a multiple of it"},
           Case{2, 4, 0, "must be a multiple of it"},
           Case{8, 4, 4, ""},
           Case{8, 4, 8, ""},
           Case{9, 4, 5, ""},  // not a multiple of P: Megatron runs it in groups of 5 and 4
           Case{5, 2, 3, ""},
           Case{8, 2, 3, ""},
           Case{8, 4, 3, "[PP=4, M=8]"},
           Case{8, 4, 9, "[PP=4, M=8]"},
           Case{2, 4, 4, "[PP=4, M=2]"},
           Case{8, 4, 5, "holds 3 (M mod N), fewer than the pipeline size 4"},
           Case{7, 2, 3, "holds 1 (M mod N), fewer than the pipeline size 2"},
           Case{12, 4, 5, "holds 2 (M mod N)"},
       }) {
    SCOPED_TRACE(fmt::format("M {} P {} N {}", c.M, c.P, c.N));
    const absl::Status st = CheckInterleavedMicroBatches(c.M, c.P, c.N);
    if (*c.says == '\0') {
      EXPECT_TRUE(st.ok()) << st;
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(c.says), std::string_view::npos) << st;
    if (c.N > 0) {
      EXPECT_NE(st.message().find(fmt::format("--microbatch-group-size-per-virtual-pipeline-stage {}", c.N)),
                std::string_view::npos)
          << st;
    }
    EXPECT_FALSE(InterleavedOrder(c.P, 0, 2, c.M, c.N).ok());
    EXPECT_FALSE(InterleavedSlots(c.P, 0, 2, c.M, c.N).ok());
  }
}

// A larger group holds more virtual micro-batches in the warm-up, (V - 1) x N of them: the slots
// a backend reserves up front grow with N, never past what one group per chunk plus the pipeline's
// depth need, and never with the micro-batches of the step.
TEST(MicroBatchGroups, SlotsFollowTheGroupNotTheStep) {
  for (int P : {2, 4})
    for (int V : {2, 3})
      for (int N : {P, P + 1, 2 * P})
        for (int s = 0; s < P; ++s) {
          SCOPED_TRACE(fmt::format("P {} V {} N {} stage {}", P, V, N, s));
          auto few = InterleavedSlots(P, s, V, 4 * N, N), many = InterleavedSlots(P, s, V, 16 * N, N);
          ASSERT_TRUE(few.ok() && many.ok()) << few.status() << many.status();
          EXPECT_EQ(*few, *many);
          EXPECT_GE(*many, (P - s - 1) * 2 + (V - 1) * N + 1);
          EXPECT_LE(*many, 2 * N * V);
        }
}

}  // namespace
}  // namespace ptk
