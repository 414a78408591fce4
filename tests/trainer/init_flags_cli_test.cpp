// ptk-train's initialization flags against megatron-core 0.16.1's: --embedding-init-method-std draws the word and
// position embeddings from its normal (the init ParamLayout gives, on one rank and on two data ranks);
// --no-initialization (perform_initialization off) skips the draw where the checkpoint writes every weight, and is
// refused where none does (Megatron would train from uninitialised memory); --data-parallel-random-init ends, as
// Megatron's broadcast from data rank 0 makes it, with the weights of a run without it.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

class InitFlagsCli : public testing::RanksTest {
 protected:
  InitFlagsCli() : RanksTest(testing::kSmallVocabEod) {}
  // Global batch 4 of micro-batches of 1; dropout on.
  std::string Train(const std::string& extra, int64_t iters = 4) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --split 98,2,0 --eval-iters 0 --log-interval 1 --threads 1 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) + " " + extra;
  }
  testing::SavedCheckpoint Load(const std::string& dir, int64_t iteration) {
    return testing::LoadTinyCheckpoint(dir, iteration, 1000, 1024);
  }
  void ExpectOk(int world, const testing::CommandResult& r) {
    if (world == 1) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
    } else {
      EXPECT_NE(r.output.find(AllZero(world)), std::string::npos) << r.output << Logs(world);
    }
  }
};

TEST_F(InitFlagsCli, EmbeddingInitMethodStdDrawsTheEmbeddings) {
  // --lr 0: the checkpoint after one step holds the initial weights, which are ParamLayout's init of the model with
  // the embeddings' std (the trainer's, whatever the backend: it draws on the host and copies).
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.embedding_init_method_std = 0.25;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> expected(static_cast<size_t>(layout->num_params));
  layout->InitWeights(1234, expected);
  const std::string still = "--lr 0 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style constant ";
  for (int world : {1, 2}) {
    const std::string save = dir_ / ("emb" + std::to_string(world));
    const std::string cmd = Train(still + "--embedding-init-method-std 0.25 --save " + ShellQuote(save), 1);
    auto r = world == 1 ? RunCmd(cmd) : Ranks(world, cmd);
    ASSERT_NO_FATAL_FAILURE(ExpectOk(world, r));
    EXPECT_TRUE(Load(save, 1).params == expected) << world << " rank(s): not the init of std 0.25 embeddings";
  }
  auto bad = RunCmd(Train("--embedding-init-method-std 0", 1));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--embedding-init-method-std"), std::string::npos) << bad.output;
}

TEST_F(InitFlagsCli, NoInitializationNeedsACheckpoint) {
  const std::string ck = dir_ / "ck", again = dir_ / "again";
  auto first = RunCmd(Train("--exit-interval 2 --save " + ShellQuote(ck)));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(RunCmd("cp -r " + ShellQuote(ck) + " " + ShellQuote(again)).exit_code, 0);
  // The weights come from the checkpoint either way: the same iterations, bit for bit.
  auto with = RunCmd(Train("--no-initialization --load " + ShellQuote(ck) + " --save " + ShellQuote(ck)));
  ASSERT_EQ(with.exit_code, 0) << with.output;
  auto without = RunCmd(Train("--load " + ShellQuote(again) + " --save " + ShellQuote(again)));
  ASSERT_EQ(without.exit_code, 0) << without.output;
  EXPECT_EQ(Lines(with.output).size(), 2u) << with.output;
  EXPECT_EQ(Lines(with.output), Lines(without.output));
  EXPECT_TRUE(Load(ck, 4).params == Load(again, 4).params);
  // Nothing to load: refused (exit 2), with no --load and with a --load that holds no checkpoint.
  auto none = RunCmd(Train("--no-initialization"));
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("usage error: --no-initialization without --load (or --pretrained-checkpoint): no "
                             "weights to start from"),
            std::string::npos)
      << none.output;
  auto empty = RunCmd(
      Train("--no-initialization --load " + ShellQuote(dir_ / "empty") + " --save " + ShellQuote(dir_ / "empty")));
  EXPECT_EQ(empty.exit_code, 2) << empty.output;
  EXPECT_NE(empty.output.find("usage error: --no-initialization: --load "), std::string::npos) << empty.output;
  EXPECT_NE(empty.output.find("no weights to start from"), std::string::npos) << empty.output;
}

TEST_F(InitFlagsCli, DataParallelRandomInitEndsWithTheWeightsOfARunWithoutIt) {
  auto plain = Ranks(2, Train("--save " + ShellQuote(dir_ / "plain")));
  ASSERT_NO_FATAL_FAILURE(ExpectOk(2, plain));
  auto random = Ranks(2, Train("--data-parallel-random-init --save " + ShellQuote(dir_ / "random")));
  ASSERT_NO_FATAL_FAILURE(ExpectOk(2, random));
  EXPECT_NE(random.output.find("--data-parallel-random-init: accepted"), std::string::npos) << random.output;
  EXPECT_EQ(Lines(plain.output).size(), 4u) << plain.output;
  EXPECT_EQ(Lines(random.output), Lines(plain.output));
  EXPECT_TRUE(Load(dir_ / "random", 4).params == Load(dir_ / "plain", 4).params);
}

}  // namespace
}  // namespace ptk
