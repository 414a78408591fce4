// Megatron's rank order and process groups against megatron-core's own RankGenerator (golden from
// tests/support/gen_parallel_layout_golden.py), the refusals, and the vocabulary padded for T.
#include "trainer/parallel_layout.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::ReadFile;
using testing::SourceDir;

std::vector<std::vector<int>> ParseGroups(const std::string& text) {
  std::vector<std::vector<int>> groups;
  std::istringstream all(text);
  std::string g, r;
  while (std::getline(all, g, ';')) {
    std::istringstream one(g);
    std::vector<int> ranks;
    while (std::getline(one, r, ',')) ranks.push_back(std::stoi(r));
    groups.push_back(ranks);
  }
  return groups;
}

const std::map<std::string, ParallelGroup> kKinds = {{"tensor", ParallelGroup::kTensor},
                                                     {"data", ParallelGroup::kData},
                                                     {"pipeline", ParallelGroup::kPipeline},
                                                     {"embedding", ParallelGroup::kEmbedding},
                                                     {"model", ParallelGroup::kModel},
                                                     {"context", ParallelGroup::kContext},
                                                     {"data-context", ParallelGroup::kDataContext},
                                                     {"expert", ParallelGroup::kExpert},
                                                     {"expert-data", ParallelGroup::kExpertData}};

// Every group of `kind` in `layout` is Megatron's `text` (GroupAt, Groups and each rank's Group).
void ExpectGroups(const ParallelLayout& layout, ParallelGroup kind, const std::string& text) {
  const auto want = ParseGroups(text);
  EXPECT_EQ(layout.Groups(kind), want);
  ASSERT_EQ(layout.NumGroups(kind), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(layout.GroupAt(kind, static_cast<int64_t>(i)), want[i]);
  // Each rank's own group is the one Megatron puts it in (none for a middle stage's embedding).
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    std::vector<int> mine;
    for (const auto& g : want)
      if (std::find(g.begin(), g.end(), rank) != g.end()) mine = g;
    std::sort(mine.begin(), mine.end());
    ASSERT_EQ(layout.Group(kind, rank), mine) << "rank " << rank;
  }
}

// A rank's coordinate along `kind` is its index in its group of that kind (Megatron's get_tensor_model_parallel_rank,
// get_context_parallel_rank, get_data_parallel_rank, get_pipeline_model_parallel_rank: the rank's place in the
// group's list), checked for every rank of every group in `text`.
void ExpectCoordinates(const ParallelLayout& layout, const std::string& kind, const std::string& text) {
  int RankCoords::*field = nullptr;
  if (kind == "tensor") field = &RankCoords::tensor;
  if (kind == "context") field = &RankCoords::context;
  if (kind == "data") field = &RankCoords::data;
  if (kind == "pipeline") field = &RankCoords::pipeline;
  if (field == nullptr) return;
  for (const std::vector<int>& g : ParseGroups(text))
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_EQ(layout.Coords(g[i]).*field, static_cast<int>(i)) << kind << " coordinate of rank " << g[i];
}

// tests/support/gen_context_parallel_goldens.py: megatron-core's RankGenerator with a context size (every
// combination of tensor, context, data and pipeline ranks above 1 among them), and get_batch_on_this_cp_rank's
// positions on each context rank.
TEST(ParallelLayout, ContextParallelGroupsAreMegatronCoresRankGenerators) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/context_parallel_goldens.txt"));
  std::string line, tag;
  int layouts = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    fields >> tag;
    if (tag != "layout") continue;
    int world = 0, tensor = 0, pipeline = 0, context = 0;
    std::string kind_name, text;
    fields >> world >> tensor >> pipeline >> context >> kind_name >> text;
    SCOPED_TRACE(line.substr(0, 80));
    ASSERT_TRUE(kKinds.count(kind_name));
    auto layout = ParallelLayout::Create(world, tensor, pipeline, context);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->context_size(), context);
    EXPECT_EQ(layout->data_size(), world / (tensor * pipeline * context));
    ASSERT_NO_FATAL_FAILURE(ExpectGroups(*layout, kKinds.at(kind_name), text));
    ExpectCoordinates(*layout, kind_name, text);
    for (int r = 0; r < world; ++r) EXPECT_EQ(layout->Rank(layout->Coords(r)), r);
    ++layouts;
  }
  EXPECT_EQ(layouts, 12 * 7);
}

TEST(ContextParallelPositions, AreMegatronsGetBatchOnThisCpRank) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/context_parallel_goldens.txt"));
  std::string line, tag;
  int splits = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    fields >> tag;
    if (tag != "split") continue;
    int64_t seq = 0;
    int context = 0, rank = 0;
    std::string text;
    fields >> seq >> context >> rank >> text;
    SCOPED_TRACE(line);
    const auto want = ParseGroups(text);
    ASSERT_EQ(want.size(), 1u);
    const std::vector<int64_t> got = ContextParallelPositions(seq, context, rank);
    EXPECT_EQ(got, std::vector<int64_t>(want[0].begin(), want[0].end()));
    ++splits;
  }
  EXPECT_EQ(splits, 2 + 2 + 2 + 4 + 3 + 8);
  // One context rank keeps the whole sequence in order.
  EXPECT_EQ(ContextParallelPositions(4, 1, 0), (std::vector<int64_t>{0, 1, 2, 3}));
}

// The CUDA backend's table of every rank's positions: rank by rank, each a permutation's part, every
// position once (the rows the all-gather brings are put where the table says).
TEST(ContextParallelPositions, TableIsEveryRanksPositionsInRankOrder) {
  EXPECT_EQ(ContextParallelPositionTable(8, 2), (std::vector<int64_t>{0, 1, 6, 7, 2, 3, 4, 5}));
  EXPECT_EQ(ContextParallelPositionTable(4, 1), (std::vector<int64_t>{0, 1, 2, 3}));
  for (const int context : {2, 3, 4}) {
    const std::vector<int64_t> table = ContextParallelPositionTable(12 * context, context);
    ASSERT_EQ(table.size(), static_cast<size_t>(12 * context));
    std::vector<int> seen(table.size(), 0);
    for (const int64_t p : table) ++seen[static_cast<size_t>(p)];
    EXPECT_EQ(seen, std::vector<int>(table.size(), 1));
    for (int r = 0; r < context; ++r)
      EXPECT_EQ(std::vector<int64_t>(table.begin() + r * 12, table.begin() + (r + 1) * 12),
                ContextParallelPositions(12 * context, context, r));
  }
}

TEST(ParallelLayout, GroupsAreMegatronCoresRankGenerators) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/parallel_layout_groups.txt"));
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int world = 0, tensor = 0, pipeline = 0;
    std::string kind_name, text;
    fields >> world >> tensor >> pipeline >> kind_name >> text;
    SCOPED_TRACE(line.substr(0, 80));
    ASSERT_TRUE(kKinds.count(kind_name));
    const ParallelGroup kind = kKinds.at(kind_name);
    auto layout = ParallelLayout::Create(world, tensor, pipeline);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const auto want = ParseGroups(text);
    EXPECT_EQ(layout->Groups(kind), want);
    ASSERT_EQ(layout->NumGroups(kind), static_cast<int64_t>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(layout->GroupAt(kind, static_cast<int64_t>(i)), want[i]);
    // Each rank's own group is the one Megatron puts it in (none for a middle stage's embedding).
    for (int rank = 0; rank < world; ++rank) {
      std::vector<int> mine;
      for (const auto& g : want)
        if (std::find(g.begin(), g.end(), rank) != g.end()) mine = g;
      std::sort(mine.begin(), mine.end());
      ASSERT_EQ(layout->Group(kind, rank), mine) << "rank " << rank;
    }
    ++lines;
  }
  EXPECT_EQ(lines, 11 * 5);
}

// Expert parallelism's groups (tensor and context size 1) against megatron-core's expert rank generator
// (gen_parallel_layout_golden.py --expert): its "ep" and expert "dp" groups, in its order, and each rank's.
TEST(ParallelLayout, ExpertGroupsAreMegatronCoresExpertRankGenerator) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/parallel_layout_expert_groups.txt"));
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int world = 0, pipeline = 0, expert = 0;
    std::string kind_name;
    fields >> world >> pipeline >> expert >> kind_name;
    SCOPED_TRACE(line.substr(0, 80));
    ASSERT_TRUE(kKinds.count(kind_name));
    auto layout = ParallelLayout::Create(world, 1, pipeline, 1, expert);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->expert_size(), expert);
    std::string text;
    fields >> text;
    ASSERT_NO_FATAL_FAILURE(ExpectGroups(*layout, kKinds.at(kind_name), text));
    ++lines;
  }
  EXPECT_EQ(lines, 7 * 2);
  // The expert size divides the data × context ranks: usage errors naming the flags.
  for (const auto& [s, want] : std::vector<std::pair<absl::Status, std::string>>{
           {ParallelLayout::Create(4, 1, 1, 1, 3).status(), "--expert-model-parallel-size 3: the data-parallel size 4"},
           {ParallelLayout::Create(6, 1, 1, 2, 4).status(),
            "--expert-model-parallel-size 4: the data × context parallel size 3 × 2"},
           {ParallelLayout::Create(8, 1, 1, 1, 0).status(),
            "--expert-model-parallel-size must be at least 1, not 0"}}) {
    EXPECT_TRUE(IsUsageError(s)) << s;
    EXPECT_NE(StatusMessage(s).find(want), std::string_view::npos) << s;
  }
}

// Expert parallelism with context and tensor ranks against megatron-core's expert rank generator
// (gen_parallel_layout_golden.py --expert-context): the expert ranks come from the data × context ranks of a stage
// and tensor rank, so E may exceed the data ranks (E = C, D = 1: the context ranks are the expert group); its tensor
// size is the tensor size (Megatron's default --expert-tensor-parallel-size).
TEST(ParallelLayout, ExpertGroupsWithContextAndTensorRanksAreMegatronCoresExpertRankGenerator) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/parallel_layout_expert_context_groups.txt"));
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int world = 0, tensor = 0, context = 0, pipeline = 0, expert = 0;
    std::string kind_name, text;
    fields >> world >> tensor >> context >> pipeline >> expert >> kind_name >> text;
    SCOPED_TRACE(line.substr(0, 80));
    ASSERT_TRUE(kKinds.count(kind_name));
    auto layout = ParallelLayout::Create(world, tensor, pipeline, context, expert);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->context_size(), context);
    ASSERT_NO_FATAL_FAILURE(ExpectGroups(*layout, kKinds.at(kind_name), text));
    ++lines;
  }
  EXPECT_EQ(lines, 18 * 2);
}

TEST(ParallelLayout, CoordinatesPutTensorRanksAdjacentThenDataThenPipeline) {
  auto layout = ParallelLayout::Create(16, 2, 4);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->data_size(), 2);
  EXPECT_EQ(layout->Coords(0), (RankCoords{0, 0, 0}));
  EXPECT_EQ(layout->Coords(1), (RankCoords{1, 0, 0}));
  EXPECT_EQ(layout->Coords(2), (RankCoords{0, 1, 0}));
  EXPECT_EQ(layout->Coords(4), (RankCoords{0, 0, 1}));
  EXPECT_EQ(layout->Coords(15), (RankCoords{1, 1, 3}));
  for (int r = 0; r < 16; ++r) EXPECT_EQ(layout->Rank(layout->Coords(r)), r);
  EXPECT_TRUE(layout->IsFirstStage(3));
  EXPECT_TRUE(layout->IsLastStage(12));
  EXPECT_EQ(layout->Group(ParallelGroup::kEmbedding, 5), std::vector<int>{});  // a middle stage
  EXPECT_EQ(layout->Group(ParallelGroup::kEmbedding, 13), (std::vector<int>{1, 13}));
  // The 175B example: T=8, P=16 on 1024 GPUs gives D=8.
  auto big = ParallelLayout::Create(1024, 8, 16);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->data_size(), 8);
  EXPECT_EQ(big->Group(ParallelGroup::kData, 9), (std::vector<int>{1, 9, 17, 25, 33, 41, 49, 57}));
  EXPECT_EQ(big->NumGroups(ParallelGroup::kTensor), 128);
  EXPECT_EQ(big->NumGroups(ParallelGroup::kPipeline), 64);
}

TEST(ParallelLayout, RefusesWhatDoesNotDivideAsUsageErrors) {
  auto s = ParallelLayout::Create(12, 8, 1).status();
  EXPECT_TRUE(IsUsageError(s));
  EXPECT_EQ(StatusMessage(s), "the world size 12 is not divisible by tensor × pipeline model parallel size 8 × 1 = 8");
  s = ParallelLayout::Create(16, 2, 3).status();
  EXPECT_NE(StatusMessage(s).find("2 × 3 = 6"), std::string_view::npos) << s;
  EXPECT_TRUE(IsUsageError(ParallelLayout::Create(0, 1, 1).status()));
  EXPECT_TRUE(IsUsageError(ParallelLayout::Create(8, 0, 1).status()));
  EXPECT_TRUE(IsUsageError(ParallelLayout::Create(8, 1, -1).status()));
  s = ParallelLayout::Create(6, 1, 1, 4).status();
  EXPECT_EQ(StatusMessage(s),
            "the world size 6 is not divisible by tensor × pipeline model parallel × context parallel size 1 × 1 × 4 = "
            "4");
  EXPECT_TRUE(IsUsageError(ParallelLayout::Create(8, 1, 1, 0).status()));
  s = ParallelLayout::Create(6, 1, 1, 1, 4).status();
  EXPECT_NE(StatusMessage(s).find("--expert-model-parallel-size 4"), std::string_view::npos) << s;
  EXPECT_TRUE(ParallelLayout::Create(1, 1, 1).ok());
}

TEST(TensorParallelVocabSize, PadsToTheDivisorTimesTensorSizeAsMegatron) {
  EXPECT_EQ(*TensorParallelVocabSize(50257, 128, 1), 50304);
  EXPECT_EQ(*TensorParallelVocabSize(50257, 128, 2), 50432);
  EXPECT_EQ(*TensorParallelVocabSize(50257, 128, 8), 51200);
  EXPECT_EQ(*TensorParallelVocabSize(51200, 128, 8), 51200);  // already a multiple: unchanged
  EXPECT_EQ(*TensorParallelVocabSize(7, 1, 4), 8);
  EXPECT_EQ(*TensorParallelVocabSize(8, 1, 1), 8);
  EXPECT_TRUE(IsUsageError(TensorParallelVocabSize(0, 128, 1).status()));
  EXPECT_TRUE(IsUsageError(TensorParallelVocabSize(100, 0, 1).status()));
  EXPECT_TRUE(IsUsageError(TensorParallelVocabSize(100, 128, 0).status()));
  // The EKS tutorial's log line, Megatron's format to the byte.
  EXPECT_EQ(PaddedVocabLine(50257, 51200), " > padded vocab (size: 50257) with 943 dummy tokens (new size: 51200)");
}

// Megatron-LM 0.16.1's line of the sizes (megatron/training/arguments.py validate_args), to the byte; ptk printed
// only its own line, which ordered them tensor x context x pipeline x data.
TEST(WorldSizeLine, IsMegatronsStartUpLine) {
  EXPECT_EQ(WorldSizeLine(*ParallelLayout::Create(16, 2, 2, 2)),
            "using world size: 16, data-parallel size: 2, context-parallel size: 2, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2");
  EXPECT_EQ(WorldSizeLine(*ParallelLayout::Create(1, 1, 1)),
            "using world size: 1, data-parallel size: 1, context-parallel size: 1, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel size: 1");
  EXPECT_EQ(WorldSizeLine(*ParallelLayout::Create(24, 4, 3)),
            "using world size: 24, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 4, pipeline-model-parallel size: 3");
}

}  // namespace
}  // namespace ptk
