// ptk-train's ranks when one of them fails on its own after they met (its datasets, a checkpoint
// only it reads, a refused ramp): that rank exits with its one line, and every other rank exits at
// once with one line naming it and its reason (ReportRankFailure through the rendezvous),
// instead of "rank 0 (which serves the rendezvous) does not answer" or "rank 3 exited" without why.
// Each rank runs under `timeout 120`: a rank that waited would exit 124, which fails the test.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

class StartupFailureCli : public ::testing::Test {
 protected:
  // DIR/good holds the dataset; DIR/bad the same .bin with its .idx cut short. Ranks run in one or
  // the other and name the data relatively, so that only some of them open the bad one.
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "good");
    std::filesystem::create_directories(dir_ / "bad");
    ASSERT_NO_FATAL_FAILURE(
        testing::WriteLearnableDataset(dir_ / "good/data_text_document", 300, testing::kSmallVocabEod));
    std::filesystem::copy_file(dir_ / "good/data_text_document.bin", dir_ / "bad/data_text_document.bin");
    const std::string idx = testing::ReadFile(dir_ / "good/data_text_document.idx");
    testing::WriteFile(dir_ / "bad/data_text_document.idx", idx.substr(0, 100));
    const std::string host = testing::ReadFile("/proc/sys/kernel/hostname");
    host_ = host.substr(0, host.find('\n'));
  }
  // A tiny model over P stages (4 layers), global batch 8 of micro-batches of 2, data named relatively.
  std::string Train(int P, const std::string& extra) const {
    return testing::Tool("ptk-train") +
           " --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 8 --lr 1e-3 --split 98,2,0 --eval-interval 2 --eval-iters 1 --log-interval 1"
           " --threads 1 --make-vocab-size-divisible-by 512 --data-path data_text_document --data-cache-path cache"
           " --pipeline-model-parallel-size " +
           std::to_string(P) + " " + extra;
  }
  struct Rank {
    int rc = -1;
    std::string log;
  };
  // One rank of `cmd` per entry of `dirs` (rank r in DIR/dirs[r]), started together.
  std::vector<Rank> Ranks(const std::vector<std::string>& dirs, const std::string& cmd) {
    const int world = static_cast<int>(dirs.size());
    std::string script = "export WORLD_SIZE=" + std::to_string(world) +
                         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(testing::FreeTestPort()) + "; ";
    for (int r = 0; r < world; ++r)
      script += "(cd " + ShellQuote(dir_ / dirs[static_cast<size_t>(r)]) + " && RANK=" + std::to_string(r) +
                " timeout 120 " + cmd + ") > " + ShellQuote(Log(r)) + " 2>&1 & p" + std::to_string(r) + "=$!; ";
    for (int r = 0; r < world; ++r) script += "wait $p" + std::to_string(r) + "; echo rc" + std::to_string(r) + "=$?; ";
    const auto out = RunCmd("bash -c " + ShellQuote(script));
    std::vector<Rank> ranks(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      std::smatch m;
      const std::regex re("rc" + std::to_string(r) + "=(\\d+)");
      if (std::regex_search(out.output, m, re)) ranks[static_cast<size_t>(r)].rc = std::stoi(m[1]);
      ranks[static_cast<size_t>(r)].log = testing::ReadFile(Log(r));
    }
    return ranks;
  }
  std::string Log(int rank) const { return dir_ / ("r" + std::to_string(rank) + ".log"); }
  // The lines of `out` that start with "ptk-train: error: " or "ptk-train: usage error: ", without that.
  static std::vector<std::string> Errors(const std::string& out) {
    std::vector<std::string> v;
    for (size_t at = 0; at < out.size();) {
      const size_t end = std::min(out.find('\n', at), out.size());
      const std::string line = out.substr(at, end - at);
      for (const char* p : {"ptk-train: error: ", "ptk-train: usage error: "})
        if (line.rfind(p, 0) == 0) v.push_back(line.substr(std::string(p).size()));
      at = end + 1;
    }
    return v;
  }
  static std::string All(const std::vector<Rank>& ranks) {
    std::string s;
    for (size_t r = 0; r < ranks.size(); ++r)
      s += "--- rank " + std::to_string(r) + " rc=" + std::to_string(ranks[r].rc) + "\n" + ranks[r].log;
    return s;
  }

  testing::TempDir dir_;
  std::string host_;
};

// Only the first stage's (rank 0, which serves the rendezvous) or only the last stage's .idx is
// corrupt: that rank says so and exits 1; the three others exit 1 naming it and its error (rank 0's
// said "rank 0 (which serves the rendezvous) does not answer: it exited or hangs"; the last stage's
// "rank 3 (host H) exited", neither why). The --save rank 0 took for the run is removed again.
TEST_F(StartupFailureCli, DatasetsFailingOnOneStageEndEveryStageNamingIt) {
  for (int victim : {0, 3}) {
    SCOPED_TRACE("rank " + std::to_string(victim) + "'s data is corrupt");
    const std::string ck = dir_ / ("ck" + std::to_string(victim));
    std::vector<std::string> dirs(4, "good");
    dirs[static_cast<size_t>(victim)] = "bad";
    const auto ranks = Ranks(dirs, Train(4, "--train-iters 4 --save " + ShellQuote(ck)));
    const std::vector<std::string> own = Errors(ranks[static_cast<size_t>(victim)].log);
    ASSERT_EQ(own.size(), 1u) << All(ranks);
    EXPECT_EQ(own[0].rfind("data_text_document.idx: ", 0), 0u) << All(ranks);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(ranks[static_cast<size_t>(r)].rc, 1) << "rank " << r << "\n" << All(ranks);
      if (r == victim) continue;
      const std::vector<std::string> errors = Errors(ranks[static_cast<size_t>(r)].log);
      ASSERT_EQ(errors.size(), 1u) << "rank " << r << "\n" << All(ranks);
      EXPECT_NE(errors[0].find("rank " + std::to_string(victim) + " (host " + host_ + ") stopped: " + own[0]),
                std::string::npos)
          << "rank " << r << "\n"
          << All(ranks);
    }
    EXPECT_FALSE(std::filesystem::exists(ck)) << All(ranks);
  }
}

// A --rampup-batch-size whose last iteration runs past the training split is refused by the stages
// that build it (the first and the last, exit 2); the middle stages, which build none, exit 2 too
// naming one of them and the refusal (they said "rank 0 ... does not answer", exit 1).
TEST_F(StartupFailureCli, ARampRefusedByTheDataStagesEndsTheMiddleStagesNamingIt) {
  for (const char* f : {"tiny.bin", "tiny.idx"})
    std::filesystem::copy_file(testing::SourceDir() + "/tests/data/gpt_dataset/gpt_data/" + f,
                               dir_ / ("good/" + std::string(f)));
  const auto ranks =
      Ranks({"good", "good", "good", "good"},
            testing::Tool("ptk-train") +
                " --num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 4 --max-position-embeddings 4"
                " --micro-batch-size 2 --global-batch-size 8 --rampup-batch-size 2 2 16 --lr 1e-3 --data-path tiny"
                " --split 1,0,0 --eval-iters 0 --log-interval 1 --threads 1 --data-cache-path cache"
                " --train-samples 14 --pipeline-model-parallel-size 4");
  const std::string refusal = "--train-samples 14: the training split is built for 14 samples";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ranks[static_cast<size_t>(r)].rc, 2) << "rank " << r << "\n" << All(ranks);
    const std::vector<std::string> errors = Errors(ranks[static_cast<size_t>(r)].log);
    ASSERT_EQ(errors.size(), 1u) << "rank " << r << "\n" << All(ranks);
    EXPECT_NE(errors[0].find(refusal), std::string::npos) << "rank " << r << "\n" << All(ranks);
    if (r == 1 || r == 2) {
      EXPECT_TRUE(std::regex_search(errors[0], std::regex("rank [03] \\(host [^)]*\\) stopped: --train-samples 14")))
          << "rank " << r << "\n"
          << All(ranks);
    }
  }
}

// A checkpoint that only some ranks can read (rank 1's copy of the file cut short): rank 1 names
// the file and exits 1; rank 0 exits 1 naming rank 1 and that error (it said "rank 1 (host H)
// exited", not why).
TEST_F(StartupFailureCli, ACheckpointOnlySomeRanksCanReadEndsEveryRankNamingIt) {
  const std::string cmd = Train(2, "--train-iters 4 --eval-iters 0 --save ck --load ck");
  const auto saved = Ranks({"good", "good"}, cmd + " --exit-interval 2");
  for (const Rank& r : saved) ASSERT_EQ(r.rc, 0) << All(saved);
  std::filesystem::copy(dir_ / "good/ck", dir_ / "bad/ck", std::filesystem::copy_options::recursive);
  std::filesystem::copy(dir_ / "good/data_text_document.idx", dir_ / "bad/data_text_document.idx",
                        std::filesystem::copy_options::overwrite_existing);
  const std::string file = dir_ / "bad/ck/iter_0000002/mp_rank_00_001/model_optim_rng.ptk";
  ASSERT_TRUE(std::filesystem::exists(file)) << All(saved);
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  const auto ranks = Ranks({"good", "bad"}, cmd);
  const std::vector<std::string> own = Errors(ranks[1].log), other = Errors(ranks[0].log);
  EXPECT_EQ(ranks[0].rc, 1) << All(ranks);
  EXPECT_EQ(ranks[1].rc, 1) << All(ranks);
  ASSERT_EQ(own.size(), 1u) << All(ranks);
  EXPECT_NE(own[0].find("model_optim_rng.ptk"), std::string::npos) << All(ranks);
  ASSERT_EQ(other.size(), 1u) << All(ranks);
  EXPECT_NE(other[0].find("rank 1 (host " + host_ + ") stopped: " + own[0]), std::string::npos) << All(ranks);
}

// A rank still busy with its own start-up when another rank fails: both are given a blend of the
// dataset listed 1000 times and 8 M training samples, whose blending indices take rank 0 seconds to
// build (its dataset is whole); rank 1's .idx is cut short, so it stops at once. Rank 1 names its
// file and exits 1; rank 0 exits 1 a second or two later, before its indices are built, naming rank
// 1, its error and what rank 0 was doing, leaving no --save it made. Before, rank 0 built them all
// and heard of it only at its next collective ("rank 0 (host H): barrier failed: rank 1 ...").
TEST_F(StartupFailureCli, ARankStillBuildingItsDatasetsStopsWhenAnotherFails) {
  std::string blend;
  for (int i = 0; i < 1000; ++i) blend += " 1 data_text_document";
  const std::string ck = dir_ / "ck";
  const auto ranks = Ranks({"good", "bad"}, Train(2, "--data-path" + blend +
                                                         " --split 100,0,0 --eval-iters 0 --train-iters 1000000 "
                                                         "--save " +
                                                         ShellQuote(ck)));
  const std::vector<std::string> own = Errors(ranks[1].log), other = Errors(ranks[0].log);
  EXPECT_EQ(ranks[1].rc, 1) << All(ranks);
  EXPECT_EQ(ranks[0].rc, 1) << All(ranks);
  ASSERT_EQ(own.size(), 1u) << All(ranks);
  EXPECT_EQ(own[0].rfind("data_text_document.idx: ", 0), 0u) << All(ranks);
  ASSERT_EQ(other.size(), 1u) << All(ranks);
  EXPECT_EQ(other[0], "rank 0 (host " + host_ + "): building the datasets stopped: rank 1 (host " + host_ +
                          ") stopped: " + own[0])
      << All(ranks);
  EXPECT_FALSE(std::filesystem::exists(ck)) << All(ranks);
}

// The same long start-up, and rank 1 killed (kill -9: nothing reported) once rank 0 builds its
// datasets: rank 0 exits 1 a second or two later naming it as exited, before its indices are built,
// leaving no --save it made (it built them all first, then said "barrier failed ...; rank 1 exited").
// Rank 1 runs without `timeout`, so that the kill reaches ptk-train itself.
TEST_F(StartupFailureCli, ARankStillBuildingItsDatasetsStopsWhenAnotherIsKilled) {
  std::string blend;
  for (int i = 0; i < 1000; ++i) blend += " 1 data_text_document";
  const std::string ck = dir_ / "ck";
  const std::string cmd = Train(
      2, "--data-path" + blend + " --split 100,0,0 --eval-iters 0 --train-iters 1000000 --save " + ShellQuote(ck));
  const std::string good = ShellQuote(dir_ / "good");
  const std::string script =
      "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(testing::FreeTestPort()) + "; cd " +
      good + "; RANK=0 timeout 120 " + cmd + " > " + ShellQuote(Log(0)) + " 2>&1 & p0=$!; RANK=1 " + cmd + " > " +
      ShellQuote(Log(1)) + " 2>&1 & p1=$!; end=$((SECONDS + 100)); until grep -q 'building the datasets' " +
      ShellQuote(Log(0)) +
      " || [ $SECONDS -ge $end ]; do sleep 0.05; done; kill -9 $p1; wait $p0; echo rc0=$?; wait $p1";
  const auto out = RunCmd("bash -c " + ShellQuote(script));
  const std::string log = testing::ReadFile(Log(0));
  EXPECT_NE(out.output.find("rc0=1"), std::string::npos) << out.output << log;
  const std::vector<std::string> errors = Errors(log);
  ASSERT_EQ(errors.size(), 1u) << log;
  EXPECT_EQ(errors[0], "rank 0 (host " + host_ + "): building the datasets stopped: rank 1 (host " + host_ +
                           ") exited (its connection to the rendezvous closed: killed, crashed or stopped early)")
      << log;
  EXPECT_FALSE(std::filesystem::exists(ck)) << log;
}

// Rank 0 (which serves the rendezvous) killed while rank 1 still starts: rank 1 stops within a second
// or so, exit 1, naming rank 0 as exited and the phase it was in. Before, rank 0's closed store read as
// nothing to report, and rank 1 went on with its start-up until its next collective.
TEST_F(StartupFailureCli, ARankStillStartingStopsWhenRankZeroIsKilled) {
  std::string blend;
  for (int i = 0; i < 1000; ++i) blend += " 1 data_text_document";
  const std::string cmd =
      Train(2, "--data-path" + blend + " --split 100,0,0 --eval-iters 0 --train-iters 1000000 --save " +
                   ShellQuote(dir_ / "ck"));
  const std::string good = ShellQuote(dir_ / "good");
  const std::string script =
      "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(testing::FreeTestPort()) + "; cd " +
      good + "; RANK=0 " + cmd + " > " + ShellQuote(Log(0)) + " 2>&1 & p0=$!; RANK=1 timeout 120 " + cmd + " > " +
      ShellQuote(Log(1)) + " 2>&1 & p1=$!; end=$((SECONDS + 100)); until grep -q 'building the datasets' " +
      ShellQuote(Log(0)) +
      " || [ $SECONDS -ge $end ]; do sleep 0.05; done; kill -9 $p0; wait $p1; echo rc1=$?; wait $p0";
  const auto out = RunCmd("bash -c " + ShellQuote(script));
  const std::string log = testing::ReadFile(Log(1));
  EXPECT_NE(out.output.find("rc1=1"), std::string::npos) << out.output << log;
  const std::vector<std::string> errors = Errors(log);
  ASSERT_EQ(errors.size(), 1u) << log;
  const std::string who = "rank 1 (host " + host_ + "): ";
  const std::string why =
      " stopped: rank 0 (which serves the rendezvous) exited (its connection closed: killed, crashed or stopped early)";
  EXPECT_EQ(errors[0].rfind(who, 0), 0u) << log;
  ASSERT_GT(errors[0].size(), why.size()) << log;
  EXPECT_EQ(errors[0].substr(errors[0].size() - why.size()), why) << log;
}

}  // namespace
}  // namespace ptk
