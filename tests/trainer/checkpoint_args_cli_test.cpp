// ptk-train --use-checkpoint-args over every model setting a checkpoint records: a Llama-line run
// (RMSNorm, RoPE with Llama 3's scaling, SwiGLU, grouped-query attention, untied, bias-free,
// qk-layernorm) and a GPT-3 one resumed from a command line without the model's flags go on bit for
// bit as a resume with the full command line; Megatron's precedence for a flag given otherwise
// (the checkpoint's for those it forces, a refusal for the others).
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

constexpr char kShape[] = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 ";
constexpr char kLlama[] =
    "--max-position-embeddings 64 --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
    "--rotary-base 500000 --rotary-percent 0.5 --use-rope-scaling --rope-scaling-factor 32 --rotary-interleaved "
    "--swiglu --ffn-hidden-size 48 --group-query-attention --num-query-groups 2 --kv-channels 16 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --qk-layernorm --hidden-dropout 0 "
    "--attention-dropout 0.05 ";

class CheckpointArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 400, testing::kSmallVocabEod));
  }
  // Everything but the model's flags: data, batch, optimizer, iterations.
  std::string Rest() const {
    return testing::Tool("ptk-train") + " " + testing::SmallVocabFlags() +
           " --micro-batch-size 2 --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine"
           " --weight-decay 0.1 --adam-beta2 0.95 --split 98,2,0 --eval-iters 0 --threads 2 --log-interval 1"
           " --train-iters 8 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " ";
  }
  // Saves iteration 4 of `model` in DIR/s, then resumes it to 8 with the full command line and with
  // only --use-checkpoint-args: the same log lines, and the second's output.
  std::string ResumeBothWays(const std::string& model) {
    auto first = RunCmd(Rest() + model + "--exit-interval 4 --save " + ShellQuote(dir_ / "s"));
    EXPECT_EQ(first.exit_code, 0) << first.output;
    auto full = RunCmd(Rest() + model + "--load " + ShellQuote(dir_ / "s") + " --save " + ShellQuote(dir_ / "a"));
    EXPECT_EQ(full.exit_code, 0) << full.output;
    auto taken =
        RunCmd(Rest() + "--use-checkpoint-args --load " + ShellQuote(dir_ / "s") + " --save " + ShellQuote(dir_ / "b"));
    EXPECT_EQ(taken.exit_code, 0) << taken.output;
    const auto want = testing::LogLinesWithoutTimes(full.output);
    EXPECT_EQ(want.size(), 4u) << full.output;
    EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), want) << taken.output;
    return taken.output;
  }
  // The model of the hand-written older checkpoints: 2 layers, hidden 32, 1000 tokens padded to 1024.
  static GPTConfig OlderModel() { return testing::TinyModel(1000, 1024); }
  TempDir dir_;
  std::string prefix_;
};

TEST_F(CheckpointArgs, LlamaLineResumesBitForBitFromTheCheckpointsFlags) {
  const std::string out = ResumeBothWays(std::string(kShape) + kLlama);
  for (const char* taken :
       {"--num-layers 2", "--normalization RMSNorm", "--layernorm-epsilon 1e-06", "--position-embedding-type rope",
        "--rotary-base 500000", "--rotary-percent 0.5", "--use-rope-scaling on", "--rope-scaling-factor 32",
        "--rotary-interleaved on", "--swiglu on", "--ffn-hidden-size 48", "--num-query-groups 2", "--kv-channels 16",
        "--untie-embeddings-and-output-weights on", "--disable-bias-linear on", "--qk-layernorm on",
        "--hidden-dropout 0", "--attention-dropout 0.05"})
    EXPECT_NE(out.find(taken), std::string::npos) << taken << "\n" << out;
  EXPECT_NE(out.find("note: --use-checkpoint-args: from the checkpoint of iteration 4: --num-layers 2, "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("loaded checkpoint"), std::string::npos) << out;
}

TEST_F(CheckpointArgs, Gpt3LineResumesBitForBitFromTheCheckpointsFlags) {
  const std::string out = ResumeBothWays(kShape);
  for (const char* taken :
       {"--hidden-size 32", "--normalization LayerNorm", "--position-embedding-type learned_absolute", "--swiglu off",
        "--num-query-groups 4", "--disable-bias-linear off", "--kv-channels 8"})
    EXPECT_NE(out.find(taken), std::string::npos) << taken << "\n" << out;
}

// Megatron's precedence: a flag load_args_from_checkpoint forces (here --normalization and the query
// groups) is the checkpoint's over the command line's, with a note; any other given otherwise than
// the checkpoint has it (--kv-channels, --rotary-base, --rope-scaling-factor) is refused.
// --ckpt-step N (Megatron's): resume from iteration N's checkpoint, not the one the tracker names (a
// run taken back past a loss spike), with or without --use-checkpoint-args; an iteration with no
// checkpoint, or a --load without one, is refused naming the flag. ptk refused the flag as unknown.
TEST_F(CheckpointArgs, CkptStepResumesFromTheGivenIteration) {
  const std::string s = ShellQuote(dir_ / "s");
  auto whole = RunCmd(Rest() + kShape + "--save-interval 2 --save " + s);  // iterations 2, 4, 6, 8; the tracker 8
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto lines = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(lines.size(), 8u) << whole.output;
  auto back = RunCmd(Rest() + kShape + "--load " + s + " --ckpt-step 4");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  EXPECT_NE(back.output.find("at iteration 4 "), std::string::npos) << back.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(back.output), std::vector<std::string>(lines.begin() + 4, lines.end()));
  auto taken = RunCmd(Rest() + "--use-checkpoint-args --load " + s + " --ckpt-step 6");
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_NE(taken.output.find("from the checkpoint of iteration 6"), std::string::npos) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), std::vector<std::string>(lines.begin() + 6, lines.end()));
  auto missing = RunCmd(Rest() + kShape + "--load " + s + " --ckpt-step 5");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("--ckpt-step 5: "), std::string::npos) << missing.output;
  EXPECT_NE(missing.output.find("iter_0000005"), std::string::npos) << missing.output;
  auto none = RunCmd(Rest() + kShape + "--load " + ShellQuote(dir_ / "none") + " --ckpt-step 4");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("--ckpt-step 4: no checkpoint in"), std::string::npos) << none.output;
}

TEST_F(CheckpointArgs, GivenFlagsFollowMegatronsPrecedence) {
  const std::string model = std::string(kShape) + kLlama;
  auto first = RunCmd(Rest() + model + "--exit-interval 4 --save " + ShellQuote(dir_ / "s"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto full = RunCmd(Rest() + model + "--load " + ShellQuote(dir_ / "s"));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const std::string load = "--use-checkpoint-args --load " + ShellQuote(dir_ / "s") + " ";
  auto forced = RunCmd(Rest() + load + "--normalization LayerNorm --group-query-attention --num-query-groups 4");
  ASSERT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_NE(forced.output.find("note: --use-checkpoint-args: --normalization RMSNorm from the checkpoint of iteration "
                               "4, in place of the command line's LayerNorm"),
            std::string::npos)
      << forced.output;
  EXPECT_NE(forced.output.find("--num-query-groups 2 from the checkpoint of iteration 4, in place of the command "
                               "line's 4"),
            std::string::npos)
      << forced.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(forced.output), testing::LogLinesWithoutTimes(full.output));
  auto same = RunCmd(Rest() + load + "--swiglu --kv-channels 16 --norm-epsilon 0.000001");  // as saved: fine
  EXPECT_EQ(same.exit_code, 0) << same.output;
  auto kv = RunCmd(Rest() + load + "--kv-channels 8");
  EXPECT_EQ(kv.exit_code, 2) << kv.output;
  EXPECT_NE(kv.output.find("--use-checkpoint-args: --kv-channels 8 differs from the checkpoint's --kv-channels 16 "
                           "(iteration 4 in "),
            std::string::npos)
      << kv.output;
  auto base = RunCmd(Rest() + load + "--rotary-base 10000");  // Megatron does not force it
  EXPECT_EQ(base.exit_code, 2) << base.output;
  EXPECT_NE(base.output.find("--rotary-base 10000 differs from the checkpoint's --rotary-base 500000"),
            std::string::npos)
      << base.output;
  auto factor = RunCmd(Rest() + load + "--rope-scaling-factor 8");
  EXPECT_EQ(factor.exit_code, 2) << factor.output;
  EXPECT_NE(factor.output.find("--rope-scaling-factor 8 differs from the checkpoint's --rope-scaling-factor 32"),
            std::string::npos)
      << factor.output;
}

// The exact GELU of Megatron's unfused GELU MLP. Megatron's load_args_from_checkpoint takes add_bias_linear
// (forced) and not bias_gelu_fusion: a bias-free GELU checkpoint resumes from its flags alone, the exact GELU
// following from the biases; a --no-bias-gelu-fusion one needs the flag again, and without it the tanh GELU
// is another model than the checkpoint's, refused naming bias_gelu_fusion.
TEST_F(CheckpointArgs, TheExactGeluFollowsMegatronsArguments) {
  const std::string out = ResumeBothWays(std::string(kShape) + "--disable-bias-linear ");
  EXPECT_NE(out.find("--disable-bias-linear on"), std::string::npos) << out;
  // The checkpoint the resume saved is the exact GELU's (its model and its settings say so).
  const std::string saved = testing::ReadFile(dir_ / "b/iter_0000008/mp_rank_00/model_optim_rng.ptk");
  EXPECT_NE(saved.find("\"add_bias_linear\": false, \"add_qkv_bias\": false, \"bias_gelu_fusion\": false}"),
            std::string::npos);
  EXPECT_NE(saved.find("[\"--no-bias-gelu-fusion\", \"on (the exact erf GELU)\"]"), std::string::npos);
  const std::string model = std::string(kShape) + "--no-bias-gelu-fusion ";
  auto first = RunCmd(Rest() + model + "--exit-interval 4 --save " + ShellQuote(dir_ / "u"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto full = RunCmd(Rest() + model + "--load " + ShellQuote(dir_ / "u"));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const std::string load = "--use-checkpoint-args --load " + ShellQuote(dir_ / "u") + " ";
  auto again = RunCmd(Rest() + load + "--no-bias-gelu-fusion");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(again.output), testing::LogLinesWithoutTimes(full.output));
  auto tanh = RunCmd(Rest() + load);
  EXPECT_NE(tanh.exit_code, 0) << tanh.output;
  EXPECT_NE(tanh.output.find("bias_gelu_fusion (false: the exact erf GELU, --no-bias-gelu-fusion) false (this run: "
                             "the default)"),
            std::string::npos)
      << tanh.output;
}

// A checkpoint of an older ptk, which recorded only GPT-3's settings: the Llama line's are its
// defaults (a note names them), and a required flag it does not record is refused.
TEST_F(CheckpointArgs, SettingsAnOlderCheckpointDoesNotRecordAreTheirDefaults) {
  GPTConfig c = OlderModel();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<float> p(static_cast<size_t>(layout->num_params), 0.01f);
  TrainState s;
  s.iteration = 4;
  s.consumed_train_samples = 16;
  s.settings = {{"--num-layers", "2"},      {"--hidden-size", "32"},  {"--num-attention-heads", "4"},
                {"--seq-length", "32"},     {"--vocab-size", "1000"}, {"--ffn-hidden-size", "128"},
                {"--hidden-dropout", "0.1"}};
  ASSERT_TRUE(SaveCheckpoint(dir_ / "old", *layout, p, p, p, s, "").ok());
  auto r = RunCmd(Rest() + "--dry-run --use-checkpoint-args --load " + ShellQuote(dir_ / "old"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--use-checkpoint-args: from the checkpoint of iteration 4: --num-layers 2, --hidden-size "
                          "32, --num-attention-heads 4, --ffn-hidden-size 128, --seq-length 32, --vocab-size 1000, "
                          "--hidden-dropout 0.1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--use-checkpoint-args: the checkpoint of iteration 4 does not record "
                          "--max-position-embeddings, --layernorm-epsilon, "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(", --swiglu, --num-query-groups, --kv-channels, "), std::string::npos) << r.output;
  s.settings.erase(s.settings.begin() + 3);  // no --seq-length
  s.iteration = 6;
  ASSERT_TRUE(SaveCheckpoint(dir_ / "old", *layout, p, p, p, s, "").ok());
  auto missing = RunCmd(Rest() + "--dry-run --use-checkpoint-args --load " + ShellQuote(dir_ / "old"));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("--use-checkpoint-args: the checkpoint of iteration 6 in "), std::string::npos)
      << missing.output;
  EXPECT_NE(missing.output.find(" does not record --seq-length: give it"), std::string::npos) << missing.output;
}

// Megatron's load_args_from_checkpoint takes padded_vocab_size, never make_vocab_size_divisible_by (its
// check_checkpoint_args, given a vocabulary file and no --finetune, refuses another one) nor the init
// flags. A run padded to a multiple of 100 (1000 tokens: 1000) resumes with the checkpoint's padding: the
// default divisor (128, which pads to 1024) is refused naming both, accepted under --finetune (the
// checkpoint's 1000 rows load: they were refused as another model); the init flags stay the command line's.
TEST_F(CheckpointArgs, ThePaddedVocabularyIsTheCheckpointsAndItsDivisorIsCompared) {
  const std::string model = std::string(kShape) + "--make-vocab-size-divisible-by 100 ";
  auto first = RunCmd(Rest() + model + "--exit-interval 4 --save " + ShellQuote(dir_ / "s"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto full = RunCmd(Rest() + model + "--load " + ShellQuote(dir_ / "s"));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const std::string load = "--use-checkpoint-args --load " + ShellQuote(dir_ / "s") + " ";
  auto other = RunCmd(Rest() + load);
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("usage error: --use-checkpoint-args: --make-vocab-size-divisible-by 128 differs from "
                              "the checkpoint of iteration 4 in " +
                              (dir_ / "s") +
                              "'s 100, which padded the vocabulary to 1000: give --make-vocab-size-divisible-by 100 "
                              "(Megatron's check_checkpoint_args refuses it too)"),
            std::string::npos)
      << other.output;
  auto same = RunCmd(Rest() + load + "--make-vocab-size-divisible-by 100 --init-method-std 0.01");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find(", --vocab-size 1000, "), std::string::npos) << same.output;
  EXPECT_NE(same.output.find(", padded vocabulary 1000"), std::string::npos) << same.output;
  EXPECT_NE(same.output.find("note: --use-checkpoint-args: --init-method-std 0.01 is the command line's, not the "
                             "checkpoint's 0.02 (Megatron does not take the init flags"),
            std::string::npos)
      << same.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(same.output), testing::LogLinesWithoutTimes(full.output));
  auto finetune = RunCmd(Rest() + load + "--finetune --train-iters 1");
  EXPECT_EQ(finetune.exit_code, 0) << finetune.output;
  EXPECT_NE(finetune.output.find("--finetune: loaded the weights of iteration 4"), std::string::npos)
      << finetune.output;
}

// Recorded values the vocabulary contradicts, each refused naming the checkpoint and both values: a
// padded vocabulary that no padding of the vocabulary by the divisor gives (an older ptk's checkpoint,
// which records no divisor), one below the vocabulary file's size, and a --vocab-size other than the file's.
TEST_F(CheckpointArgs, ARecordedVocabularyTheVocabularyContradictsIsRefused) {
  GPTConfig c = OlderModel();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> p(static_cast<size_t>(layout->num_params), 0.01f);
  TrainState s;
  s.iteration = 4;
  s.consumed_train_samples = 16;
  s.settings = {{"--num-layers", "2"},          {"--hidden-size", "32"},
                {"--num-attention-heads", "4"}, {"--seq-length", "32"},
                {"--vocab-size", "1000"},       {"--ffn-hidden-size", "128"},
                {"--hidden-dropout", "0.1"},    {"--make-vocab-size-divisible-by (padded vocabulary)", "1024"}};
  ASSERT_TRUE(SaveCheckpoint(dir_ / "old", *layout, p, p, p, s, "").ok());
  const std::string load = "--use-checkpoint-args --load " + ShellQuote(dir_ / "old") + " ";
  auto reached = RunCmd(Rest() + "--dry-run " + load);  // 1000 tokens padded to a multiple of 128
  EXPECT_EQ(reached.exit_code, 0) << reached.output;
  auto unreached = RunCmd(Rest() + "--dry-run " + load + "--make-vocab-size-divisible-by 100");
  EXPECT_EQ(unreached.exit_code, 2) << unreached.output;
  EXPECT_NE(unreached.output.find("--use-checkpoint-args: the checkpoint of iteration 4 in " + (dir_ / "old") +
                                  " has a padded vocabulary of 1024, which padding the 1000 tokens to a multiple of "
                                  "--make-vocab-size-divisible-by 100 times a tensor-parallel size does not give: it "
                                  "was trained on another vocabulary, or with another --make-vocab-size-divisible-by "
                                  "(give that one)"),
            std::string::npos)
      << unreached.output;
  // A vocabulary file of 30 tokens, where the checkpoint records --vocab-size 1000.
  std::string small = "{";
  for (int i = 0; i < 30; ++i) small += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":" + std::to_string(i);
  testing::WriteFile(dir_ / "small.json", small + "}");
  auto file = RunCmd(Rest() + load + "--vocab-file " + ShellQuote(dir_ / "small.json"));
  EXPECT_EQ(file.exit_code, 2) << file.output;
  EXPECT_NE(file.output.find("--use-checkpoint-args: --vocab-file " + (dir_ / "small.json") +
                             " has 30 tokens, and the checkpoint of iteration 4 in " + (dir_ / "old") +
                             " was trained on --vocab-size 1000: give the vocabulary it was trained with"),
            std::string::npos)
      << file.output;
  // No --vocab-size recorded: the file's 1000 tokens, more than the 960 rows the checkpoint's model has.
  c.vocab_size = 900;
  c.padded_vocab_size = 960;
  layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  p.assign(static_cast<size_t>(layout->num_params), 0.01f);
  s.iteration = 6;
  s.settings.erase(s.settings.begin() + 4);
  s.settings.back().second = "960";
  ASSERT_TRUE(SaveCheckpoint(dir_ / "old", *layout, p, p, p, s, "").ok());
  auto fewer = RunCmd(Rest() + "--dry-run " + load);
  EXPECT_EQ(fewer.exit_code, 2) << fewer.output;
  EXPECT_NE(fewer.output.find("--use-checkpoint-args: the checkpoint of iteration 6 in " + (dir_ / "old") +
                              " has a padded vocabulary of 960, less than the 1000 tokens of --vocab-file "),
            std::string::npos)
      << fewer.output;
}

}  // namespace
}  // namespace ptk
