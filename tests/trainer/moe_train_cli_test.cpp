// ptk-train's mixture-of-experts layers end to end (--num-experts, CPU): the log line's
// load_balancing_loss, checkpoints under Megatron's expert names that resume bit for bit (the MoE flags
// taken by --use-checkpoint-args) and refuse other MoE flags as another model, ptk-convert's refusal,
// data parallelism (plain, --use-distributed-optimizer and --overlap-grad-reduce, ranks as processes
// over loopback gloo), pipeline stages (1F1B, interleaved, with data ranks), context ranks, --dry-run's
// parameter count against megatron-core's (the golden's tensors) and per stage, token dropping by capacity, and
// every feature and combination not implemented refused in one line naming it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/test_util.h"
#include "tests/trainer/golden_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

constexpr char kMoe[] =
    " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01"
    " --disable-bias-linear";

// The parameters of DIR's checkpoint of `iteration` (a 4-layer [1,0,1,1] model), the stages put together.
std::vector<float> FinalWeights(const std::string& dir, int64_t iteration) {
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.num_layers = 4;
  c.add_bias_linear = false;
  c.gelu_exact = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  c.moe_aux_loss_coeff = 0.01;
  c.moe_layer_pattern = {1, 0, 1, 1};
  auto layout = ParamLayout::Create(c);
  EXPECT_TRUE(layout.ok()) << layout.status();
  std::vector<float> p, m, v;
  TrainState st;
  const absl::Status s = LoadCheckpoint(dir, iteration, *layout, &p, &m, &v, &st);
  EXPECT_TRUE(s.ok()) << s;
  return p;
}

class MoeTrainCli : public testing::RanksTest {
 protected:
  MoeTrainCli() : RanksTest(testing::kSmallVocabEod) {}
  // 2 layers (`layers`; the second dense with --moe-layer-freq 2 where given); global batch 4 of micro-batches
  // of 1.
  std::string Train(const std::string& extra, int64_t iters = 6, int layers = 2) {
    return testing::Tool("ptk-train") + " --num-layers " + std::to_string(layers) +
           " --hidden-size 32 --num-attention-heads 4 --seq-length 32" + SmallRun(iters) + kMoe + " " + extra;
  }
  // The load_balancing_loss of each log line.
  static std::vector<double> Balancing(const std::string& out) {
    std::vector<double> v;
    const std::regex re(R"(\| lm loss: \S+ \| load_balancing_loss: (\S+) \|)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
    return v;
  }
  // One rank's run of the 4-layer [1,0,1,1] model (saved in dir_/one): the losses, load_balancing_loss and final
  // weights that each parallel layout's run must give.
  struct OneRank {
    std::vector<std::pair<int, double>> losses;
    std::vector<double> balancing;
    std::vector<float> weights;
  };
  static constexpr char kPattern[] = "--moe-layer-freq '[1,0,1,1]' --save ";
  void RunOneRank(OneRank* ref) {
    auto one = RunCmd(Train(kPattern + ShellQuote(dir_ / "one"), 6, 4));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    ref->losses = testing::LossesOf(one.output);
    ref->balancing = Balancing(one.output);
    ASSERT_EQ(ref->balancing.size(), 6u) << one.output;
    ref->weights = FinalWeights(dir_ / "one", 6);
  }
  // The run on `world` ranks with `flags` (saved in `save`) against one rank's: losses and load_balancing_loss
  // within 1e-5 (relative), final weights within 1e-5.
  void ExpectOneRanks(const OneRank& ref, int world, const std::string& save, const std::string& flags,
                      const std::string& what) {
    std::string out;
    ASSERT_NO_FATAL_FAILURE(
        RunGivingLosses(world, Train(kPattern + ShellQuote(save) + flags, 6, 4), ref.losses, 6, 1e-5, what, &out));
    const auto lb = Balancing(out);
    ASSERT_EQ(lb.size(), 6u) << out;
    for (size_t i = 0; i < lb.size(); ++i)
      EXPECT_NEAR(lb[i], ref.balancing[i], 1e-5 * ref.balancing[i]) << what << " " << i;
    const std::vector<float> w = FinalWeights(save, 6);
    ASSERT_EQ(w.size(), ref.weights.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, std::abs(double{w[i]} - ref.weights[i]));
    EXPECT_LT(worst, 1e-5) << what;
    std::printf("%s: largest difference of the final weights from one rank's: %.3g\n", what.c_str(), worst);
  }
};

TEST_F(MoeTrainCli, TrainsLogsTheLoadBalancingLossAndSavesMegatronsNames) {
  auto r = RunCmd(Train("--save " + ShellQuote(dir_ / "ck"), 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lb = Balancing(r.output);
  ASSERT_EQ(lb.size(), 4u) << r.output;
  for (double v : lb) EXPECT_TRUE(v >= 1.0 && v < 2.0) << v;  // 1 for an even split, up to E for one expert
  // The checkpoint holds the MoE layout's tensors (LoadCheckpoint checks every name and shape).
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.add_bias_linear = false;
  c.gelu_exact = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_NE(layout->Find("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"), nullptr);
  std::vector<float> p, m, v;
  TrainState st;
  EXPECT_TRUE(LoadCheckpoint(dir_ / "ck", 4, *layout, &p, &m, &v, &st).ok());
  // Another expert count is another model: its layout does not load.
  c.num_experts = 3;
  auto other = ParamLayout::Create(c);
  EXPECT_FALSE(LoadCheckpoint(dir_ / "ck", 4, *other, &p, &m, &v, &st).ok());
  // This GPT-2-style MoE model is no Mixtral (hf_mixtral_test.py exports the Llama line's): refused in one line,
  // nothing written. Megatron's layout maps its experts (megatron_moe_test checks the export itself).
  const std::string hf = dir_ / "export-hf";
  auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") +
                  " --save-dir " + ShellQuote(hf));
  EXPECT_EQ(e.exit_code, 1) << e.output;
  EXPECT_NE(e.output.find("this mixture-of-experts model (--num-experts 4) is not one Hugging Face's "
                          "MixtralForCausalLM computes: GELU experts without --swiglu"),
            std::string::npos)
      << e.output;
  EXPECT_FALSE(std::filesystem::exists(hf));
  const std::string mg = dir_ / "export-megatron";
  e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver megatron --load-dir " + ShellQuote(dir_ / "ck") +
             " --save-dir " + ShellQuote(mg));
  EXPECT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("4 experts of ffn 48 (top 2)"), std::string::npos) << e.output;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(mg) / "iter_0000004")) << e.output;
}

TEST_F(MoeTrainCli, AStoppedRunResumesBitForBitAndOtherMoeFlagsAreAnotherModel) {
  std::vector<std::string> a, b;
  ASSERT_NO_FATAL_FAILURE(
      ExpectResumeBitForBit([&](const std::string& x) { return Train("--moe-layer-freq 2 " + x); }, &b, &a));
  EXPECT_NE(a[0].find("load_balancing_loss"), std::string::npos) << a[0];
  // --use-checkpoint-args takes the MoE flags from the checkpoint over the command line's (Megatron's force=True).
  auto taken =
      RunCmd(Train("--moe-layer-freq 1 --moe-router-topk 1 --moe-router-pre-softmax --use-checkpoint-args --load " +
                   ShellQuote(dir_ / "ck")));
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), b);
  for (const char* note : {"--use-checkpoint-args: --moe-router-topk 2 from the checkpoint",
                           "--use-checkpoint-args: --moe-router-pre-softmax off from the checkpoint",
                           "--use-checkpoint-args: --moe-layer-freq [1,0] from the checkpoint"})
    EXPECT_NE(taken.output.find(note), std::string::npos) << note << "\n" << taken.output;
  for (const char* other :
       {"--moe-layer-freq 1", "--moe-layer-freq 2 --moe-router-topk 1", "--moe-layer-freq 2 --moe-router-pre-softmax",
        "--moe-layer-freq 2 --moe-router-topk-scaling-factor 2",
        "--moe-layer-freq 2 --moe-router-num-groups 2 --moe-router-group-topk 1"}) {
    auto r = RunCmd(Train(std::string(other) + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(r.exit_code, 0) << other;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << other << "\n" << r.output;
  }
}

// The router's options end to end: the log line's z_loss before load_balancing_loss (Megatron's tracker order)
// with a plausible value, a bitwise resume, the routing's settings another model to a --load
// without them, and --use-checkpoint-args taking them (the scaling factor over the command line's, as Megatron's
// force=True; the groups where left out, given otherwise refused).
TEST_F(MoeTrainCli, TheRoutersOptionsTrainLogResumeAndAreTheCheckpointsModel) {
  const std::string router =
      " --moe-z-loss-coeff 0.01 --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 "
      "--moe-router-group-topk 1";
  auto whole = RunCmd(Train(router + " --save " + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  const std::regex line(R"(\| lm loss: \S+ \| z_loss: (\S+) \| load_balancing_loss: \S+ \|)");
  for (const std::string& l : a) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(l, m, line)) << l;
    const double z = std::strtod(m[1].str().c_str(), nullptr);
    EXPECT_TRUE(z > 1.0 && z < 3.0) << l;  // logsumexp^2 of 4 small logits: about log(4)^2 = 1.92
  }
  std::vector<std::string> resumed;
  ASSERT_NO_FATAL_FAILURE(
      ExpectStoppedRunResumes([&](const std::string& x) { return Train(router + " " + x); }, a, &resumed));
  // Without the routing's options (the z-loss is a training setting: it alone does not make another model).
  for (const char* other : {" --moe-z-loss-coeff 0.01", " --moe-z-loss-coeff 0.01 --moe-router-topk-scaling-factor 2.5",
                            " --moe-router-num-groups 2 --moe-router-group-topk 1"}) {
    auto r = RunCmd(Train(std::string(other) + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(r.exit_code, 0) << other;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << other << "\n" << r.output;
  }
  auto taken =
      RunCmd(Train(" --moe-z-loss-coeff 0.01 --moe-router-topk-scaling-factor 1.5 --use-checkpoint-args "
                   "--load " +
                   ShellQuote(dir_ / "ck")));
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), resumed);
  for (const char* note : {"--use-checkpoint-args: --moe-router-topk-scaling-factor 2.5 from the checkpoint",
                           "--moe-router-num-groups 2", "--moe-router-group-topk 1"})
    EXPECT_NE(taken.output.find(note), std::string::npos) << note << "\n" << taken.output;
  auto refused =
      RunCmd(Train(router + " --moe-router-group-topk 2 --use-checkpoint-args --load " + ShellQuote(dir_ / "ck")));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--use-checkpoint-args: --moe-router-group-topk 2 differs from the checkpoint's "
                                "--moe-router-group-topk 1"),
            std::string::npos)
      << refused.output;
}

// Shared experts (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate) end to end: a bitwise resume,
// Megatron's names in the checkpoint, the shared experts another model to a --load without them or of another
// width, --use-checkpoint-args taking them, --moe-shared-expert-overlap (alltoall) the same run with a note, expert
// ranks (the shared experts replicated) and data ranks giving one rank's losses, ptk-convert's Megatron round trip
// and its HF refusal.
TEST_F(MoeTrainCli, SharedExpertsTrainResumeBitForBitAndAreTheCheckpointsModel) {
  const std::string shared = " --moe-shared-expert-intermediate-size 24 --moe-shared-expert-gate ";
  auto whole = RunCmd(Train(shared + "--save " + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  auto plain = RunCmd(Train(""));  // the shared experts change the losses
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(testing::LogLinesWithoutTimes(plain.output), a);
  std::vector<std::string> resumed;
  ASSERT_NO_FATAL_FAILURE(
      ExpectStoppedRunResumes([&](const std::string& x) { return Train(shared + x); }, a, &resumed));
  GPTConfig c = testing::TinyModel(1000, 1024);
  c.add_bias_linear = false;
  c.gelu_exact = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  c.moe_shared_expert_intermediate_size = 24;
  c.moe_shared_expert_gate = true;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const char* name :
       {"decoder.layers.1.mlp.shared_experts.gate_weight", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"})
    ASSERT_NE(layout->Find(name), nullptr) << name;
  std::vector<float> p, m, v;
  TrainState st;
  EXPECT_TRUE(LoadCheckpoint(dir_ / "ck", 3, *layout, &p, &m, &v, &st).ok());
  for (const char* other : {"", " --moe-shared-expert-intermediate-size 24",
                            " --moe-shared-expert-intermediate-size 16 "
                            "--moe-shared-expert-gate"}) {
    auto r = RunCmd(Train(std::string(other) + " --load " + ShellQuote(dir_ / "ck")));
    EXPECT_NE(r.exit_code, 0) << other;
    EXPECT_NE(r.output.find("the checkpoint is of another model"), std::string::npos) << other << "\n" << r.output;
  }
  auto taken = RunCmd(Train("--use-checkpoint-args --load " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(taken.output), resumed);
  auto overlap = RunCmd(Train(shared + "--moe-token-dispatcher-type alltoall --moe-shared-expert-overlap"));
  ASSERT_EQ(overlap.exit_code, 0) << overlap.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(overlap.output), a);
  EXPECT_NE(overlap.output.find("note: --moe-shared-expert-overlap: accepted"), std::string::npos) << overlap.output;
  // Two data ranks, and two expert ranks (each two experts, the shared experts on both): one rank's losses.
  const auto ref = testing::LossesOf(whole.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(shared), ref, 6, 1e-5, "2 data ranks", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train(shared + "--expert-model-parallel-size 2"), ref, 6, 1e-5, "2 expert ranks", &out));
  // ptk-convert: Megatron's SharedExpertMLP written and read back (the flags to train on named); the HF saver tries
  // Qwen2-MoE (the one HF class with shared experts) and names what this GELU/LayerNorm/learned-position model
  // lacks: refused in one line.
  const std::string mg = dir_ / "export-megatron";
  auto to_mg = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver megatron --load-dir " +
                      ShellQuote(dir_ / "ck") + " --save-dir " + ShellQuote(mg));
  ASSERT_EQ(to_mg.exit_code, 0) << to_mg.output;
  auto from_mg = RunCmd(testing::Tool("ptk-convert") + " --loader megatron --saver ptk --load-dir " + ShellQuote(mg) +
                        " --save-dir " + ShellQuote(dir_ / "back"));
  ASSERT_EQ(from_mg.exit_code, 0) << from_mg.output;
  EXPECT_NE(from_mg.output.find(" --moe-shared-expert-intermediate-size 24 --moe-shared-expert-gate"),
            std::string::npos)
      << from_mg.output;
  const std::string to = dir_ / "export-hf";
  auto e = RunCmd(testing::Tool("ptk-convert") + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") +
                  " --save-dir " + ShellQuote(to));
  EXPECT_EQ(e.exit_code, 1) << e.output;
  EXPECT_NE(e.output.find("is not one Hugging Face's Qwen2MoeForCausalLM computes: GELU MLPs without --swiglu"),
            std::string::npos)
      << e.output;
  EXPECT_FALSE(std::filesystem::exists(to));
}

// The expert bias (sigmoid scores) and all three load-balancing types: the log line's entries in Megatron's
// tracker order with plausible values, the biases in the checkpoint under Megatron's names, moved by multiples of the
// rate, a stopped run resumed bit for bit (the bias included), a --load without the flag refused, and two data
// ranks, and two expert ranks, training as one rank does with the bias and seq_aux_loss (global_aux_loss's
// running counts over the micro-batches differ with the ranks' share of them, as Megatron's).
TEST_F(MoeTrainCli, TheExpertBiasAndTheBalancingTypesTrainLogAndResume) {
  const std::string bias =
      " --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
      "--moe-router-bias-update-rate 0.01";
  const std::string all = bias +
                          " --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss"
                          " --moe-aux-loss-coeff 0.01 0.01 0.01";
  auto whole = RunCmd(Train(all + " --save " + ShellQuote(dir_ / "full")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto a = testing::LogLinesWithoutTimes(whole.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  const std::regex line(R"(\| lm loss: \S+ \| load_balancing_loss: (\S+) \| seq_load_balancing_loss: (\S+) \| )"
                        R"(global_load_balancing_loss: (\S+) \|)");
  for (const std::string& l : a) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(l, m, line)) << l;
    for (int i = 1; i <= 3; ++i) {
      const double v = std::strtod(m[i].str().c_str(), nullptr);
      EXPECT_TRUE(v >= 1.0 && v < 4.0) << l;  // 1 for an even split, up to E for one expert
    }
  }
  auto header = [](const std::string& dir) {
    auto text = ReadCheckpointHeaderText(CheckpointFile(dir, 6));
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : std::string();
  };
  const std::string saved = header(dir_ / "full");
  simdjson::dom::parser parser;
  simdjson::dom::element h;
  ASSERT_FALSE(parser.parse(saved).get(h));
  std::vector<std::string> names;
  double moved = 0;
  for (auto b : h["buffers"].get_array()) {
    names.emplace_back(b["name"].get_string().value());
    for (auto v : b["values"].get_array()) {
      const double x = v.get_double().value();
      EXPECT_NEAR(x / 0.01, std::round(x / 0.01), 1e-4) << x;
      moved = std::max(moved, std::abs(x));
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"decoder.layers.0.mlp.router.expert_bias",
                                             "decoder.layers.1.mlp.router.expert_bias"}));
  EXPECT_GT(moved, 0.0);
  auto first = RunCmd(Train(all + " --exit-interval 3 --save " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto resumed = RunCmd(Train(all + " --load " + ShellQuote(dir_ / "ck") + " --save " + ShellQuote(dir_ / "ck")));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(testing::LogLinesWithoutTimes(resumed.output), std::vector<std::string>(a.begin() + 3, a.end()));
  simdjson::dom::parser parser2;
  simdjson::dom::element h2;
  ASSERT_FALSE(parser2.parse(header(dir_ / "ck")).get(h2));
  EXPECT_EQ(simdjson::minify(h2["buffers"]), simdjson::minify(h["buffers"]));
  auto without = RunCmd(Train(" --moe-router-score-function sigmoid --load " + ShellQuote(dir_ / "ck")));
  EXPECT_NE(without.exit_code, 0) << without.output;
  EXPECT_NE(without.output.find("decoder.layers.0.mlp.router.expert_bias"), std::string::npos) << without.output;
  // ptk-convert carries the expert biases to Megatron (mlp.router.expert_bias) and back, with the flags; HF's
  // classes route without one: refused saying so, nothing written.
  const std::string mg = dir_ / "export-megatron", back = dir_ / "back", hf = dir_ / "export-hf";
  const std::string convert = testing::Tool("ptk-convert");
  auto e = RunCmd(convert + " --loader ptk --saver megatron --load-dir " + ShellQuote(dir_ / "full") + " --save-dir " +
                  ShellQuote(mg));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  auto imported = RunCmd(convert + " --loader megatron --saver ptk --load-dir " + ShellQuote(mg) + " --save-dir " +
                         ShellQuote(back));
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  EXPECT_NE(imported.output.find(" --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01"),
            std::string::npos)
      << imported.output;
  simdjson::dom::parser parser3;
  simdjson::dom::element h3;
  ASSERT_FALSE(parser3.parse(header(back)).get(h3));
  EXPECT_EQ(simdjson::minify(h3["buffers"]), simdjson::minify(h["buffers"]));
  auto to_hf = RunCmd(convert + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "full") + " --save-dir " +
                      ShellQuote(hf));
  EXPECT_NE(to_hf.exit_code, 0) << to_hf.output;
  EXPECT_NE(to_hf.output.find("route without an expert bias"), std::string::npos) << to_hf.output;
  EXPECT_FALSE(std::filesystem::exists(hf));
  // Data and expert ranks: the token counts summed over the data group, the biases and losses one rank's.
  const std::string seq = bias + " --moe-router-load-balancing-type seq_aux_loss";
  auto one = RunCmd(Train(seq));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_NE(one.output.find(" seq_load_balancing_loss: "), std::string::npos) << one.output;
  const auto ref = testing::LossesOf(one.output);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(seq), ref, 6, 1e-5, "2 data ranks", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train(seq + " --expert-model-parallel-size 2"), ref, 6, 1e-5, "2 expert ranks", &out));
}

TEST_F(MoeTrainCli, DataParallelRanksTrainAsOneRankDoes) {
  auto one = RunCmd(Train(""));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ref = testing::LossesOf(one.output);
  const auto ref_lb = Balancing(one.output);
  ASSERT_EQ(ref_lb.size(), 6u);
  std::string plain, zero;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(""), ref, 6, 1e-5, "2 ranks", &plain));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(2, Train("--use-distributed-optimizer"), ref, 6, 1e-5, "2 ranks, distributed optimizer", &zero));
  // The load-balancing loss: each rank's micro-batches' mean, averaged over the ranks (Megatron's).
  for (const std::string* out : {&plain, &zero}) {
    const auto lb = Balancing(*out);
    ASSERT_EQ(lb.size(), 6u) << *out;
    for (size_t i = 0; i < lb.size(); ++i) EXPECT_NEAR(lb[i], ref_lb[i], 1e-5 * ref_lb[i]) << i;
  }
  EXPECT_EQ(testing::LogLinesWithoutTimes(plain), testing::LogLinesWithoutTimes(zero));
  // --overlap-grad-reduce's buckets (small ones: several per MoE layer) reduce the same sums.
  std::string overlap;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train("--overlap-grad-reduce --ddp-bucket-size 5000"), ref, 6, 1e-5,
                                          "2 ranks, overlapped reduction", &overlap));
  EXPECT_EQ(testing::LogLinesWithoutTimes(plain), testing::LogLinesWithoutTimes(overlap));
}

// Pipeline stages (ranks as processes over loopback gloo), each holding its layers' experts: P = 2 (stage 0 one
// MoE layer, stage 1 two), P = 2 interleaved (layers 0 and 2 on stage 0), P = 2 of 1 and 3 layers (stage 0 one
// MoE layer alone) and P = 2 x D = 2 give one rank's losses, its load_balancing_loss (the stages' MoE layers
// summed, as Megatron's track_moe_metrics over the pipeline group) and its final weights; a stopped P = 2 run
// resumes bit for bit, and on one rank.
TEST_F(MoeTrainCli, PipelineStagesTrainAsOneRankDoes) {
  const std::string moe = kPattern;
  OneRank one;
  ASSERT_NO_FATAL_FAILURE(RunOneRank(&one));
  const auto& ref = one.losses;
  struct Case {
    int world;
    const char *flags, *what;
  };
  int run = 0;
  for (const Case& c :
       {Case{2, "", "P=2"}, Case{2, " --num-layers-per-virtual-pipeline-stage 1", "P=2 interleaved"},
        Case{2, " --decoder-first-pipeline-num-layers 1", "P=2 uneven (1 and 3 layers)"}, Case{4, "", "P=2 x D=2"}})
    ASSERT_NO_FATAL_FAILURE(ExpectOneRanks(one, c.world, dir_ / ("ck" + std::to_string(run++)),
                                           std::string(" --pipeline-model-parallel-size 2") + c.flags, c.what));
  // Stopped at iteration 3 and resumed at P = 2: the uninterrupted P = 2 run's last lines, character for character.
  const std::string pp = " --pipeline-model-parallel-size 2";
  auto whole = Ranks(2, Train(moe + ShellQuote(dir_ / "whole") + pp, 6, 4));
  ASSERT_NE(whole.output.find(AllZero(2)), std::string::npos) << whole.output;
  auto first = Ranks(2, Train(moe + ShellQuote(dir_ / "stop") + pp + " --exit-interval 3", 6, 4));
  ASSERT_NE(first.output.find(AllZero(2)), std::string::npos) << first.output;
  std::filesystem::copy(dir_ / "stop", dir_ / "stop1", std::filesystem::copy_options::recursive);
  auto resumed = Ranks(2, Train(moe + ShellQuote(dir_ / "stop") + pp + " --load " + ShellQuote(dir_ / "stop"), 6, 4));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output;
  const auto a = Lines(whole.output), b = Lines(resumed.output);
  ASSERT_EQ(a.size(), 6u) << whole.output;
  EXPECT_EQ(b, std::vector<std::string>(a.begin() + 3, a.end()));
  // The P = 2 checkpoint resumed on one rank (the stages put together): one rank's losses.
  auto one_rank = RunCmd(Train(moe + ShellQuote(dir_ / "stop1") + " --load " + ShellQuote(dir_ / "stop1"), 6, 4));
  ASSERT_EQ(one_rank.exit_code, 0) << one_rank.output;
  EXPECT_NE(one_rank.output.find("saved with --pipeline-model-parallel-size 2)"), std::string::npos) << one_rank.output;
  ASSERT_EQ(Losses(one_rank.output).size(), 3u) << one_rank.output;
  EXPECT_LT(Worst(Losses(one_rank.output), ref), 1e-5);
  // One file per stage (Megatron's mp_rank_00_PPP).
  EXPECT_TRUE(std::filesystem::exists(dir_ / "stop/iter_0000006/mp_rank_00_001"));
}

// Context ranks (each a part of every sequence; the router per token, the load-balancing loss's expert counts and
// token count the whole sequence's, as Megatron's over the tensor x context group): C = 2, C = 2 x D = 2,
// C = 2 x P = 2 give one rank's losses, load_balancing_loss and final weights.
TEST_F(MoeTrainCli, ContextRanksTrainAsOneRankDoes) {
  OneRank one;
  ASSERT_NO_FATAL_FAILURE(RunOneRank(&one));
  struct Case {
    int world;
    const char *flags, *what;
  };
  int run = 0;
  for (const Case& c :
       {Case{2, "", "C=2"}, Case{4, "", "C=2 x D=2"}, Case{4, " --pipeline-model-parallel-size 2", "C=2 x P=2"}})
    ASSERT_NO_FATAL_FAILURE(ExpectOneRanks(one, c.world, dir_ / ("cp" + std::to_string(run++)),
                                           std::string(" --context-parallel-size 2") + c.flags, c.what));
}

// megatron-core's parameter count of tests/data/trainer/moe_gelu's model (its golden's tensors).
TEST_F(MoeTrainCli, DryRunCountsParametersAsMegatron) {
  const int64_t megatron = testing::MegatronParamCount("moe_gelu");
  const std::string cmd = "WORLD_SIZE=2 " + testing::DryRunOf(3) +
                          " --disable-bias-linear --num-experts 4 --moe-ffn-hidden-size 12 --moe-layer-freq '[1,0,1]'";
  ASSERT_NO_FATAL_FAILURE(testing::ExpectDryRunCount(cmd, megatron));
  // Two stages (layers 0-1 and 2): each counts its own layers' experts. Stage 0: the embeddings (40 x 16 + 8 x 16),
  // MoE layer 0 (two LayerNorms 64, QKV 768, projection 256, router 4 x 16, experts 4 x 2 x 12 x 16) and dense
  // layer 1 (64 + 768 + 256 + fc1 and fc2 2 x 24 x 16): 768 + 2688 + 1856.
  auto pp = RunCmd(cmd + " --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2");
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  EXPECT_NE(pp.output.find("model parallel rank (0, 0): 5312\n"), std::string::npos) << pp.output;
  EXPECT_NE(pp.output.find("model parallel rank (0, 1): " + std::to_string(megatron - 5312) + "\n"), std::string::npos)
      << pp.output;
  // moe_shared's model (moe_gelu's with shared experts of width 20 on its two MoE layers): megatron-core's count.
  const int64_t with_shared = testing::MegatronParamCount("moe_shared");
  EXPECT_EQ(with_shared, megatron + 2 * 2 * 20 * 16);
  auto sh = RunCmd(cmd + " --moe-shared-expert-intermediate-size 20");
  ASSERT_EQ(sh.exit_code, 0) << sh.output;
  EXPECT_NE(sh.output.find("model: " + std::to_string(with_shared) + " parameters"), std::string::npos)
      << with_shared << "\n"
      << sh.output;
}

// Token dropping end to end: each policy trains (its losses not the dropless run's, nor the other policy's),
// padding to capacity changes nothing, a stopped run resumes bit for bit, and the flags without a capacity
// factor are noted as changing nothing (as Megatron).
TEST_F(MoeTrainCli, TokenDroppingTrainsResumesAndPaddingChangesNothing) {
  const std::string probs = " --moe-expert-capacity-factor 0.5", position = probs + " --moe-token-drop-policy position";
  auto dropless = RunCmd(Train("", 3));
  auto by_probs = RunCmd(Train(probs, 3));
  auto by_position = RunCmd(Train(position + " --save " + ShellQuote(dir_ / "full")));
  auto padded = RunCmd(Train(probs + " --moe-pad-expert-input-to-capacity", 3));
  for (const auto* r : {&dropless, &by_probs, &by_position, &padded}) ASSERT_EQ(r->exit_code, 0) << r->output;
  const auto l0 = testing::LossesOf(dropless.output), l1 = testing::LossesOf(by_probs.output),
             l2 = testing::LossesOf(by_position.output);
  ASSERT_EQ(l0.size(), 3u) << dropless.output;
  ASSERT_EQ(l1.size(), 3u) << by_probs.output;
  ASSERT_EQ(l2.size(), 6u) << by_position.output;
  EXPECT_NE(l0[0].second, l1[0].second);  // the first step's forward already drops
  EXPECT_NE(l1[0].second, l2[0].second);
  EXPECT_NE(l0[0].second, l2[0].second);
  EXPECT_EQ(testing::LogLinesWithoutTimes(padded.output), testing::LogLinesWithoutTimes(by_probs.output));
  EXPECT_NE(padded.output.find("note: --moe-pad-expert-input-to-capacity: accepted, layout only"), std::string::npos)
      << padded.output;
  const auto a = testing::LogLinesWithoutTimes(by_position.output);
  ASSERT_NO_FATAL_FAILURE(ExpectStoppedRunResumes([&](const std::string& x) { return Train(position + " " + x); }, a));
  auto noted = RunCmd(Train(" --moe-token-drop-policy position", 3));
  ASSERT_EQ(noted.exit_code, 0) << noted.output;
  EXPECT_NE(noted.output.find("note: --moe-token-drop-policy position: accepted, no effect without "
                              "--moe-expert-capacity-factor"),
            std::string::npos)
      << noted.output;
  EXPECT_EQ(testing::LossesOf(noted.output), l0);
  auto negative = RunCmd(Train(" --moe-expert-capacity-factor -1", 3));
  ASSERT_EQ(negative.exit_code, 0) << negative.output;
  EXPECT_NE(negative.output.find("note: --moe-expert-capacity-factor -1: below 0, no capacity"), std::string::npos)
      << negative.output;
  EXPECT_EQ(testing::LossesOf(negative.output), l0);
}

TEST_F(MoeTrainCli, WhatIsNotImplementedIsRefusedInOneLineNamingIt) {
  const std::string base = testing::MockRunOf(3);
  const std::string moe = " --num-experts 4 --disable-bias-linear";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --num-experts 4", "usage error: --num-experts without --disable-bias-linear"},
      {moe + " --moe-router-score-function tanh", "usage error: --moe-router-score-function tanh: softmax or sigmoid"},
      {moe + " --moe-router-enable-expert-bias",
       "usage error: --moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"},
      {moe + " --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01",
       "usage error: --moe-router-load-balancing-type / --moe-aux-loss-coeff: 2 types need as many coefficients"},
      {moe + " --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 0.02",
       "usage error: --moe-router-load-balancing-type / --moe-aux-loss-coeff: 2 coefficients for one type"},
      {moe + " --moe-router-load-balancing-type aux_loss aux_loss --moe-aux-loss-coeff 0.1 0.1",
       "usage error: --moe-router-load-balancing-type: aux_loss given twice"},
      {moe + " --moe-router-bias-update-rate -1", "--moe-router-bias-update-rate"},
      {moe + " --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 --dry-run "
             "--pipeline-model-parallel-size 3",
       "usage error: --moe-router-load-balancing-type seq_aux_loss with --pipeline-model-parallel-size 3: ptk has not"},
      {moe + " --moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type sinkhorn: not"},
      {moe + " --moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap",
       "usage error: --moe-shared-expert-overlap with --moe-token-dispatcher-type allgather (the default): Megatron's "
       "overlap works only with the alltoall dispatcher"},
      {moe + " --moe-shared-expert-intermediate-size 0", "--moe-shared-expert-intermediate-size"},
      {moe + " --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate --moe-router-load-balancing-type "
             "seq_aux_loss global_aux_loss --moe-aux-loss-coeff 0.01 0.01 --device cuda",
       "usage error: --num-experts 4 with --moe-router-load-balancing-type global_aux_loss on --device cuda"},
      {moe + " --moe-pad-expert-input-to-capacity",
       "usage error: --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"},
      {moe + " --moe-expert-capacity-factor -1 --moe-pad-expert-input-to-capacity",
       "usage error: --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"},
      {moe + " --moe-expert-capacity-factor 1 --moe-token-drop-policy random",
       "usage error: --moe-token-drop-policy random: probs or position"},
      {moe + " --moe-expert-capacity-factor many", "--moe-expert-capacity-factor"},
      {moe + " --moe-expert-capacity-factor nan", "--moe-expert-capacity-factor"},
      {moe + " --moe-expert-capacity-factor 1 --device cuda",
       "usage error: --num-experts 4 with --moe-expert-capacity-factor 1 (token dropping) on --device cuda"},
      {moe + " --moe-router-group-topk 2",
       "usage error: --moe-router-group-topk 2 needs --moe-router-num-groups (as Megatron's TransformerConfig)"},
      {moe + " --moe-router-num-groups 3 --moe-router-group-topk 1",
       "usage error: --moe-router-num-groups 3 does not divide --num-experts 4"},
      {moe + " --moe-router-num-groups 2 --moe-router-group-topk 3",
       "usage error: --moe-router-group-topk 3 is more than --moe-router-num-groups 2"},
      {moe + " --moe-router-num-groups 4 --moe-router-group-topk 1",
       "usage error: --moe-router-group-topk 1 with --moe-router-topk 2 and 4 groups of 1 experts:"},
      {moe + " --moe-router-topk 1 --moe-router-num-groups 2 --moe-router-group-topk 2",
       "usage error: --moe-router-group-topk 2 with --moe-router-topk 1 and 2 groups of 2 experts:"},
      {moe + " --moe-router-group-topk 0", "--moe-router-group-topk"},
      {moe + " --moe-z-loss-coeff -1", "--moe-z-loss-coeff"},
      {moe + " --moe-router-topk-scaling-factor nan", "--moe-router-topk-scaling-factor"},
      {" --num-experts 128 --disable-bias-linear --moe-router-num-groups 128 --moe-router-group-topk 2 --device cuda",
       "usage error: --num-experts 128 with --moe-router-num-groups 128 (the CUDA router takes at most 64 groups) on "
       "--device cuda"},
      {moe + " --moe-token-dispatcher-type flex", "usage error: --moe-token-dispatcher-type flex:"},
      {moe + " --moe-router-dtype fp64", "usage error: --moe-router-dtype fp64: ptk's router computes in fp32"},
      {moe + " --moe-router-topk 5", "usage error: --moe-router-topk 5 is more than --num-experts 4"},
      {moe + " --moe-layer-freq '[1,0]'", "usage error: --moe-layer-freq [1,0]: 2 entries for --num-layers 3"},
      {moe + " --moe-layer-freq '[1,2,1]'", "usage error: --moe-layer-freq [1,2,1]: entry 2"},
      {moe + " --moe-layer-freq '__import__(\"os\")'",
       "usage error: --moe-layer-freq __import__(\"os\"): a "
       "positive count"},
      {moe + " --moe-layer-freq '[0]*3'", "usage error: --moe-layer-freq [0]*3: no layer is MoE"},
      {moe + " --tensor-model-parallel-size 2",
       "usage error: --num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"},
      {moe + " --dry-run --bf16 --tensor-model-parallel-size 2 --sequence-parallel",
       "usage error: --num-experts 4 with --tensor-model-parallel-size 2 on --device cuda (or --bf16 / --fp16: the "
       "CUDA backend's): its mixture-of-experts layers are dropless and data-parallel only"},
      {moe + " --dry-run --device cuda --pipeline-model-parallel-size 3",
       "usage error: --num-experts 4 with --pipeline-model-parallel-size 3 on --device cuda"},
      {moe + " --dry-run --device cuda --context-parallel-size 2",
       "usage error: --num-experts 4 with --context-parallel-size 2 on --device cuda"},
      {moe + " --dry-run --bf16 --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0.01",
       "usage error: --num-experts 4 with --moe-router-load-balancing-type global_aux_loss on --device cuda"},
      {moe + " --dry-run --tensor-model-parallel-size 2",
       "--num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel"},
  };
  testing::ExpectUsageErrors(base, cases);
  // The CUDA backend's dropless, data-parallel MoE (aux_loss, z-loss, scaling, pre-softmax, sigmoid; shared experts,
  // group-limited routing, seq_aux_loss, the expert bias) is planned.
  for (const char* cuda :
       {" --dry-run --bf16",
        " --dry-run --device cuda --moe-router-score-function sigmoid "
        "--moe-z-loss-coeff 0.01 --moe-router-topk-scaling-factor 2",
        " --dry-run --bf16 --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate "
        "--moe-router-score-function sigmoid --moe-router-num-groups 2 --moe-router-group-topk 1 "
        "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.01",
        " --dry-run --device cuda --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-load-balancing-type none"}) {
    auto planned = RunCmd(base + moe + cuda);
    EXPECT_EQ(planned.exit_code, 0) << cuda << "\n" << planned.output;
  }
  // Speed-only flags are accepted with a note, and --moe-* without --num-experts changes nothing (as Megatron).
  auto r = RunCmd(base + moe + " --moe-grouped-gemm --moe-permute-fusion --moe-token-dispatcher-type alltoall" +
                  " --moe-router-dtype fp32" +
                  " --moe-router-load-balancing-type none --moe-aux-loss-coeff 0.1 --train-iters 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --moe-grouped-gemm: accepted, speed only"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --moe-router-dtype fp32: accepted"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --moe-aux-loss-coeff: accepted, no effect with --moe-router-load-balancing-type "
                          "none"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("load_balancing_loss"), std::string::npos) << r.output;  // none logged without the loss
  // A zero z-loss coefficient or scaling factor, and groups without a group top-k, are noted as changing nothing.
  auto zero =
      RunCmd(base + moe +
             " --moe-z-loss-coeff 0 --moe-router-topk-scaling-factor 0 --moe-router-num-groups 2 --train-iters 1");
  EXPECT_EQ(zero.exit_code, 0) << zero.output;
  for (const char* note : {"note: --moe-z-loss-coeff 0: no z-loss",
                           "note: --moe-router-topk-scaling-factor 0: no "
                           "scaling",
                           "note: --moe-router-num-groups 2: accepted, no effect without --moe-router-group-topk"})
    EXPECT_NE(zero.output.find(note), std::string::npos) << note << "\n" << zero.output;
  EXPECT_EQ(zero.output.find(" z_loss: "), std::string::npos) << zero.output;  // no log entry
  auto dense = RunCmd(base + " --moe-router-topk 1 --train-iters 1");
  EXPECT_EQ(dense.exit_code, 0) << dense.output;
  EXPECT_NE(dense.output.find("note: --moe-* flags: accepted, no effect without --num-experts"), std::string::npos)
      << dense.output;
}

}  // namespace
}  // namespace ptk
