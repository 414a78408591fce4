// ptk-convert --loader megatron on torch_dist checkpoints of Megatron's Llama line (RMSNorm, SwiGLU,
// grouped-query attention, RoPE, no biases, untied) that megatron-core 0.16.1 itself wrote
// (tests/data/torch_dist_llama/, tests/support/make_torch_dist_llama_fixture.py): trained at tensor size 2
// with the plain optimizer of a --bf16 run and with the distributed optimizer (dp_reshardable; and
// dp_zero_gather_scatter), and each resharded by megatron-core to tensor size 1; the distributed optimizer at tensor
// size 2 in fully_sharded_model_space (megatron-core 0.13.1's); a 4-layer run resharded by megatron-core into an
// interleaved one (pipeline size 2, two model chunks per stage: a grad buffer per chunk); and a tied model resharded
// into pipeline size 2 (the embedding on the first stage, the output layer's copy on the last) in dp_reshardable, at
// tensor size 1 and 2. Each
// converts to the fp32 weights and AdamW moments expected.json records (megatron-core's TP 1 optimizer after loading
// it) bit for bit, TP 2 to exactly TP 1's; ptk-train --load resumes one AdamW step from those moments; damaged or
// mismatched copies are refused in one line naming the file and the key.
#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/hash.h"
#include "interop/megatron.h"
#include "interop/torch_dist.h"
#include "tests/interop/megatron_dist_convert.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using testing::Convert;
using testing::ConvertAndLoad;
using testing::Converted;
using testing::HexOf;
using testing::ReadFile;
using testing::Replace;
using testing::TempDir;
using testing::WriteFile;

std::string Fixture(const std::string& name) { return testing::SourceDir() + "/tests/data/torch_dist_llama/" + name; }

class TorchDistLlama : public ::testing::TestWithParam<std::string> {
 protected:
  TempDir dir_;
};

// Every tensor's weight and moments against expected.json's SHA-256 (little-endian fp32, as the
// generator hashes them), the iteration and Adam's step.
TEST_P(TorchDistLlama, ConvertsToMegatronCoresValuesBitForBit) {
  const std::string name = GetParam();
  ::testing::internal::CaptureStderr();
  Converted c = ConvertAndLoad(Fixture(name), dir_ / "ptk");
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(c.layout.has_value());
  // megatron-core keeps a tied embedding's copy on the last stage (weight, fp32 param, moments) equal to
  // stage 0's: nothing warned.
  EXPECT_EQ(err.find("copy of the tied embedding"), std::string::npos) << err;
  simdjson::dom::parser parser;
  const simdjson::padded_string json = simdjson::padded_string(ReadFile(Fixture(name) + "/expected.json"));
  simdjson::dom::element exp = parser.parse(json);
  EXPECT_EQ(c.state.iteration, int64_t(exp["iteration"]));
  EXPECT_EQ(c.state.adam_step, int64_t(exp["adam_step"]));
  for (const std::string& note : c.summary.notes)  // read (the plain optimizer's state.common_step), not assumed
    EXPECT_EQ(note.find("record no Adam step"), std::string::npos) << note;
  const GPTConfig& g = c.summary.config;
  EXPECT_TRUE(g.swiglu && g.normalization == Normalization::kRMSNorm && g.rope() && !g.add_bias_linear &&
              g.query_groups() == 2);
  bool tied = false;  // expected.json's "tied": the output layer shares the embedding
  if (exp["tied"].get(tied) != simdjson::SUCCESS) tied = false;
  EXPECT_EQ(g.untie_embeddings_and_output_weights, !tied) << name;
  ASSERT_NO_FATAL_FAILURE(testing::ExpectTensorsAsRecorded(c, exp["tensors"], name, true));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TorchDistLlama,
                         ::testing::Values("plain_bf16_tp1", "plain_bf16_tp2", "distopt_tp1", "distopt_tp2",
                                           "distopt_tp2_dp_zero", "distopt_tp2_fs_model_space", "vpp_plain_bf16",
                                           "vpp_distopt", "tied_pp2_distopt", "tied_tp2_pp2_distopt"));

// The TP 2 checkpoint and megatron-core's TP 1 reshard of it: the same ptk checkpoint, every array equal
// (SwiGLU's gate and up halves and the query groups put back where a single rank holds them).
TEST(TorchDistLlamaTp, TensorSizeTwoEqualsItsTensorSizeOneReshard) {
  TempDir dir;
  for (const std::string kind : {"plain_bf16", "distopt"}) {
    Converted one = ConvertAndLoad(Fixture(kind + "_tp1"), dir / (kind + "1"));
    Converted two = ConvertAndLoad(Fixture(kind + "_tp2"), dir / (kind + "2"));
    ASSERT_FALSE(one.w.empty());
    EXPECT_EQ(one.w, two.w) << kind;
    EXPECT_EQ(one.m1, two.m1) << kind;
    EXPECT_EQ(one.m2, two.m2) << kind;
    EXPECT_EQ(one.state.adam_step, two.state.adam_step) << kind;
  }
}

// The worst relative misfit of ptk-train's step from (w0, m0, v0) to (w1, m1, v1) against torch AdamW's at
// Adam step `step` (lr 3e-3, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 on matrices, as the fixtures
// trained), for the gradient m1 implies; with `zero` the saved moments taken as zero instead.
double AdamWMisfit(const ParamLayout& layout, const Converted& a, const Converted& b, int64_t step, bool zero) {
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  double worst = 0;
  for (const ParamInfo& p : layout.infos) {
    const double decay = p.shape.size() > 1 ? wd : 0.0;  // Megatron's and ptk's: no decay on norms
    double scale = 1e-30;
    for (int64_t i = p.offset; i < p.offset + p.size; ++i) scale = std::max(scale, std::fabs(double(b.m2[i])));
    for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
      const double m0 = zero ? 0 : a.m1[i], v0 = zero ? 0 : a.m2[i];
      const double g = (b.m1[i] - b1 * m0) / (1 - b1);
      const double v_err = std::fabs(b2 * v0 + (1 - b2) * g * g - b.m2[i]) / scale;
      const double want = a.w[i] * (1 - lr * decay) - lr * (b.m1[i] / (1 - std::pow(b1, step))) /
                                                          (std::sqrt(b.m2[i] / (1 - std::pow(b2, step))) + eps);
      worst = std::max({worst, v_err, zero ? 0.0 : std::fabs(want - b.w[i]) / lr});
    }
  }
  return worst;
}

// ptk-train --load of each converted checkpoint takes one AdamW step from the converted moments and Adam
// step: its new weights and moments fit AdamW's update, which zero moments would not.
TEST(TorchDistLlamaTp, PtkTrainResumesOneAdamWStepFromTheMoments) {
  TempDir dir;
  for (const std::string name :
       {"distopt_tp2", "plain_bf16_tp2", "vpp_distopt", "distopt_tp2_fs_model_space", "tied_tp2_pp2_distopt"}) {
    const std::string ptk = dir / (name + "-ptk"), out = dir / (name + "-resumed");
    Converted a = ConvertAndLoad(Fixture(name), ptk);
    ASSERT_TRUE(a.layout.has_value());
    const std::string cmd = testing::Tool("ptk-train") + " " + a.summary.train_flags +
                            " --micro-batch-size 2 --global-batch-size 2 --train-iters 4 --lr 3e-3 --min-lr 3e-3"
                            " --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95"
                            " --adam-eps 1e-8 --mock-data --eval-iters 0 --log-interval 1 --threads 1"
                            " --use-checkpoint-opt_param-scheduler --load " +
                            testing::ShellQuote(ptk) + " --save " + testing::ShellQuote(out);
    const testing::CommandResult r = testing::RunCmd(cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    Converted b;
    b.layout = a.layout;
    const absl::Status st = LoadCheckpoint(out, 4, *b.layout, &b.w, &b.m1, &b.m2, &b.state);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(b.state.iteration, 4);
    EXPECT_EQ(b.state.adam_step, a.state.adam_step + 1);
    const double fit = AdamWMisfit(*a.layout, a, b, a.state.adam_step + 1, false);
    const double if_zero = AdamWMisfit(*a.layout, a, b, a.state.adam_step + 1, true);
    std::printf("%s: resumed one step, worst relative misfit %.2e (against zero moments %.2e)\n", name.c_str(), fit,
                if_zero);
    EXPECT_LT(fit, 1e-3) << name;
    EXPECT_GT(if_zero, 1e-2) << name;
  }
}

// ptk-train --use-checkpoint-args on a converted Megatron checkpoint follows Megatron's
// load_args_from_checkpoint: args.padded_vocab_size is taken (30 tokens padded by args'
// make_vocab_size_divisible_by 8: 32 rows; the default divisor 128 gave 128 and the load was refused),
// the divisor is not (with a vocabulary file, check_checkpoint_args refuses another one), nor
// args.init_method_std (a note where the command line's differs).
TEST(TorchDistLlamaTp, UseCheckpointArgsTakesThePaddedVocabularyAsMegatronDoes) {
  TempDir dir;
  const std::string ptk = dir / "ptk";
  Converted a = ConvertAndLoad(Fixture("plain_bf16_tp2"), ptk);
  ASSERT_TRUE(a.layout.has_value());
  EXPECT_EQ(a.layout->config.padded_vocab_size, 32);
  auto settings = ReadCheckpointSettings(ptk, 3);
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_NE(std::find(settings->begin(), settings->end(),
                      std::pair<std::string, std::string>("--make-vocab-size-divisible-by", "8")),
            settings->end());
  const std::string base =
      testing::Tool("ptk-train") +
      " --use-checkpoint-args --use-checkpoint-opt_param-scheduler --micro-batch-size 2 --global-batch-size 2"
      " --train-iters 4 --lr 3e-3"
      " --mock-data --eval-iters 0 --log-interval 1 --threads 1 --load " +
      testing::ShellQuote(ptk) + " ";
  const testing::CommandResult r =
      testing::RunCmd(base + "--init-method-std 0.01 --save " + testing::ShellQuote(dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(", --vocab-size 30, "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", padded vocabulary 32\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--use-checkpoint-args: --init-method-std 0.01 is the command line's, not the checkpoint's "
                          "0.02 (Megatron does not take the init flags"),
            std::string::npos)
      << r.output;
  Converted b;
  b.layout = a.layout;
  const absl::Status st = LoadCheckpoint(dir / "out", 4, *b.layout, &b.w, &b.m1, &b.m2, &b.state);
  EXPECT_TRUE(st.ok()) << st;
  // A vocabulary file of the checkpoint's 30 tokens: the divisor is compared, as check_checkpoint_args does.
  std::string vocab = "{";
  for (int i = 0; i < 30; ++i) vocab += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":" + std::to_string(i);
  WriteFile(dir / "vocab.json", vocab + "}");
  WriteFile(dir / "merges.txt", "#version: 0.2\n");
  const std::string files = "--vocab-file " + testing::ShellQuote(dir / "vocab.json") + " --merge-file " +
                            testing::ShellQuote(dir / "merges.txt");
  const testing::CommandResult other = testing::RunCmd(base + files);
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("--use-checkpoint-args: --make-vocab-size-divisible-by 128 differs from the checkpoint "
                              "of iteration 3 in " +
                              ptk + "'s 8, which padded the vocabulary to 32: give --make-vocab-size-divisible-by 8"),
            std::string::npos)
      << other.output;
  const testing::CommandResult same = testing::RunCmd(base + files + " --make-vocab-size-divisible-by 8");
  EXPECT_EQ(same.exit_code, 0) << same.output;
}

// A copy of fixture `name` (its iteration directory passed to `damage`) converted: refused in one line
// holding each of `needles`, nothing written.
void ExpectRefused(const std::string& name, const std::function<void(const std::string&)>& damage,
                   const std::vector<std::string>& needles) {
  testing::ExpectConvertRefused(Fixture(name), "iter_0000003", damage, needles);
}

// A torch_dist release checkpoint (the tracker says "release") is Megatron's iteration 0 without optimizer
// state or scheduler (its load_checkpoint); the import took common.pt's iteration (3) and the moments.
// Nothing asks ptk-train for --no-load-optim: Megatron's load of a release skips the optimizer anyway.
TEST(TorchDistLlamaTp, AReleaseIsImportedAtIterationZeroWithoutTheOptimizer) {
  TempDir dir;
  std::filesystem::create_directories(dir / "meg");
  std::filesystem::copy(Fixture("distopt_tp1") + "/iter_0000003", dir / "meg/release",
                        std::filesystem::copy_options::recursive);
  WriteFile(dir / "meg/latest_checkpointed_iteration.txt", "release");
  Converted c = ConvertAndLoad(dir / "meg", dir / "ptk");
  EXPECT_EQ(c.summary.iteration, 0);
  EXPECT_EQ(c.state.iteration, 0);
  EXPECT_EQ(c.state.adam_step, 0);
  EXPECT_FALSE(c.state.scheduler.has_value());
  EXPECT_EQ(c.state.scheduler_num_steps, 0);
  EXPECT_FALSE(c.m1.empty());
  EXPECT_TRUE(std::all_of(c.m1.begin(), c.m1.end(), [](float x) { return x == 0.0f; }));
  EXPECT_TRUE(std::all_of(c.m2.begin(), c.m2.end(), [](float x) { return x == 0.0f; }));
  for (const auto& [flag, value] : c.state.settings) EXPECT_NE(flag, kOptimizerStateSetting);
}

TEST(TorchDistLlamaRefused, AFlippedByteInLinearFc1NamesTheFileOffsetAndKey) {
  ExpectRefused("plain_bf16_tp2",
                [](const std::string& d) {
                  auto ck = torchdist::DistCheckpoint::Open(d);
                  ASSERT_TRUE(ck.ok()) << ck.status();
                  const torchdist::Chunk& c = (*ck)->tensors().at("decoder.layers.mlp.linear_fc1.weight").chunks.back();
                  std::string data = ReadFile(d + "/" + c.file);
                  data[c.offset + c.length / 2] ^= 0x40;  // inside the chunk's stored tensor
                  WriteFile(d + "/" + c.file, data);
                },
                {".distcp: byte ", "decoder.layers.mlp.linear_fc1.weight"});
}

TEST(TorchDistLlamaRefused, ATruncatedDataFileNamesIt) {
  ExpectRefused("distopt_tp2", [](const std::string& d) { std::filesystem::resize_file(d + "/__1_1.distcp", 1000); },
                {"__1_1.distcp", "byte "});
}

TEST(TorchDistLlamaRefused, ATensorRanksGradBufferMissingIsNamed) {
  // dp_group_idx_1 (tensor rank 1's buckets) renamed to a rank the args do not have: rank 1 missing.
  ExpectRefused(
      "distopt_tp2",
      [](const std::string& d) { Replace(d + "/.metadata", "dp_group_idx_1.gbuf_idx_0", "dp_group_idx_7.gbuf_idx_0"); },
      {".metadata", "optimizer.distributed.dp_group_idx_7", "model-parallel rank 7", "2 tensor x 1 pipeline ranks",
       "\"dp_reshardable\""});
}

TEST(TorchDistLlamaRefused, APipelineRanksGradBufferMissingIsNamed) {
  // The tied model's last stage (dp_group_idx_1: the output layer's copy of the embedding beside its layer) renamed
  // to a rank the args do not have.
  ExpectRefused(
      "tied_pp2_distopt",
      [](const std::string& d) { Replace(d + "/.metadata", "dp_group_idx_1.gbuf_idx_0", "dp_group_idx_5.gbuf_idx_0"); },
      {".metadata", "optimizer.distributed.dp_group_idx_5", "model-parallel rank 5", "1 tensor x 2 pipeline ranks"});
}

TEST(TorchDistLlamaRefused, AModelChunksGradBufferMissingIsNamed) {
  // Pipeline rank 1's second chunk's buffer (dp_group_idx_1.gbuf_idx_1) renamed to a chunk the args do not have.
  ExpectRefused(
      "vpp_distopt",
      [](const std::string& d) { Replace(d + "/.metadata", "dp_group_idx_1.gbuf_idx_1", "dp_group_idx_1.gbuf_idx_7"); },
      {".metadata", "optimizer.distributed.dp_group_idx_1.gbuf_idx_7", "grad buffer 7 of model-parallel rank 1",
       "the args give each rank 2"});
  // The args of the 2-layer run beside the 4 layers' tensors: the stacked keys' shape says so.
  ExpectRefused("vpp_distopt",
                [](const std::string& d) {
                  std::filesystem::copy_file(Fixture("distopt_tp1") + "/iter_0000003/common.pt", d + "/common.pt",
                                             std::filesystem::copy_options::overwrite_existing);
                },
                {".metadata", "decoder.layers", "shape [4, "});
}

TEST(TorchDistLlamaRefused, ArgsOfAnotherModelNameTheKey) {
  // common.pt of a GPT-3 run (LayerNorm, GELU, biases, ffn 64) beside the Llama line's tensors.
  ExpectRefused("plain_bf16_tp1",
                [](const std::string& d) {
                  std::filesystem::copy_file(testing::SourceDir() +
                                                 "/tests/data/torch_dist_distopt/fully_reshardable/"
                                                 "iter_0000003/common.pt",
                                             d + "/common.pt", std::filesystem::copy_options::overwrite_existing);
                },
                {".metadata", "decoder.layers.mlp.linear_fc1.weight", "shape [2, 48, 16]", "--ffn-hidden-size 64"});
}

TEST(TorchDistLlamaRefused, MegatronCoresSingletonLocalShardsLayoutIsNamed) {
  // A key per layer (what megatron-core's metadata singleton_local_shards asks for, and Megatron-LM does not).
  ExpectRefused("plain_bf16_tp1",
                [](const std::string& d) {
                  Replace(d + "/.metadata", "decoder.layers.mlp.linear_fc2.weight",
                          "decoder.layers.0.p.linear_fc2.weight");
                },
                {".metadata", "decoder.layers.0.p.linear_fc2.weight", "singleton_local_shards"});
}

}  // namespace
}  // namespace ptk
