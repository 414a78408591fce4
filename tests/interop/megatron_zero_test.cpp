// A ptk-train run of ZeRO-1 (--use-distributed-optimizer: one contiguous shard of the flat parameter buffer per
// data-parallel rank, padded to ranks x 16384 elements) against Megatron's distributed optimizer, which shards each
// grad-buffer bucket instead: the partitions never reach a file. ptk's checkpoint holds the whole tensors (the
// shards gathered), ptk-convert lays them out in megatron-core's grad buffers and buckets (distrib_optim.pt), and
// the import gathers them back: a checkpoint saved by 2 ZeRO-1 ranks with overlapped bucketed reduction goes to
// Megatron's distributed optimizer (its own buckets, at tensor size 2 x pipeline size 2) and back bit for bit,
// weights, both moments, Adam's step, the iteration and the samples consumed.
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using testing::ShellQuote;

class ZeroToMegatron : public testing::RanksTest {
 protected:
  ZeroToMegatron() : RanksTest(testing::kSmallVocabEod) {}
  // dp_train_cli_test's run: the tiny model of LoadTinyCheckpoint, GPT-2's tokenizer cut to 1000 tokens.
  std::string Train(const std::string& extra) {
    return testing::Tool("ptk-train") +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " +
           testing::SmallVocabFlags() +
           " --global-batch-size 6 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1"
           " --threads 1 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters 4 " + extra;
  }
  static ConvertOptions Opts(const std::string& loader, const std::string& saver, const std::string& from,
                             const std::string& to) {
    return testing::ConvertOpts(loader, saver, from, to);
  }
};

TEST_F(ZeroToMegatron, TwoRanksZeroOneCheckpointToMegatronsBucketsAndBackIsBitForBit) {
  const std::string zero = dir_ / "zero", meg = dir_ / "meg", back = dir_ / "back";
  // Buckets of 5000 elements on ptk's side (ZeRO-1's pieces of them), of 3000 on Megatron's: neither partition is
  // the other's.
  auto r = Ranks(
      2, Train("--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 5000 --save " + ShellQuote(zero)));
  ASSERT_NE(r.output.find(AllZero(2)), std::string::npos) << r.output << "\n" << testing::ReadFile(RankLog(1));
  ASSERT_NE(r.output.find("distributed optimizer: each of 2 ranks keeps"), std::string::npos) << r.output;
  const testing::SavedCheckpoint a = testing::LoadTinyCheckpoint(zero, 4, 1000, 1024);

  ConvertOptions o = Opts("ptk", "megatron", zero, meg);
  o.target_tensor_parallel_size = 2;
  o.target_pipeline_parallel_size = 2;
  o.target_use_distributed_optimizer = true;
  o.target_ddp_bucket_size = 3000;
  auto s = ExportToMegatron(o);
  ASSERT_TRUE(s.ok()) << s.status();
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t p = 0; p < 2; ++p)
      EXPECT_TRUE(std::filesystem::exists(meg + "/iter_0000004/" + megatron::RankDir(t, p, 2) + "/distrib_optim.pt"));
  auto i = ImportFromMegatron(Opts("megatron", "ptk", meg, back));
  ASSERT_TRUE(i.ok()) << i.status();
  bool from_distrib = false;
  for (const std::string& note : i->notes) from_distrib |= note.find("distrib_optim.pt") != std::string::npos;
  EXPECT_TRUE(from_distrib) << "the moments were not read from distrib_optim.pt";

  const testing::SavedCheckpoint b = testing::LoadTinyCheckpoint(back, 4, 1000, 1024);
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_TRUE(a.params == b.params) << "weights differ";
  EXPECT_TRUE(a.m == b.m) << "exp_avg differs";
  EXPECT_TRUE(a.v == b.v) << "exp_avg_sq differs";
  EXPECT_EQ(a.state.adam_step, b.state.adam_step);
  EXPECT_EQ(a.state.iteration, b.state.iteration);
  EXPECT_EQ(a.state.consumed_train_samples, b.state.consumed_train_samples);
  bool moved = false;  // trained: moments that are not all zero
  for (float x : a.v) moved |= x != 0.0f;
  EXPECT_TRUE(moved);
}

}  // namespace
}  // namespace ptk
