// What the expert-parallel CLI tests share (ep_train_cli_test, ep_distopt_cli_test, ep_pipeline_cli_test,
// ep_context_cli_test, ep_tensor_cli_test): ptk-train of their MoE model (4 experts, top 2, global batch 4 of
// micro-batches of 1), a log line's field, two runs' logged values compared field by field, a run that must
// succeed, and the model's GPTConfig.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk::testing {

class EpCliTest : public RanksTest {
 protected:
  // `num_layers` MoE layers; `moe_extra` follows the MoE flags (e.g. " --moe-layer-freq '[1,0,1,1]'").
  explicit EpCliTest(int num_layers = 2, std::string moe_extra = "")
      : RanksTest(kSmallVocabEod), num_layers_(num_layers), moe_extra_(std::move(moe_extra)) {}
  // The tests' model of 4 experts (top 2); global batch 4 of micro-batches of 1; `extra` gives the sizes.
  std::string Train(const std::string& extra, int64_t iters = 6) {
    return Tool("ptk-train") + " --num-layers " + std::to_string(num_layers_) +
           " --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 " + SmallVocabFlags() +
           " --global-batch-size 4 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 1"
           " --weight-decay 0.1 --clip-grad 1.0 --split 98,2,0 --eval-interval 3 --eval-iters 1 --log-interval 1"
           " --log-num-zeros-in-grad --log-params-norm --threads 1 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache") + " --train-iters " +
           std::to_string(iters) +
           " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01" + moe_extra_ +
           " --disable-bias-linear " + extra;
  }
  // The value of `field` ("lm loss", "grad norm", "load_balancing_loss", ...) on each log line.
  static std::vector<double> Field(const std::string& out, const std::string& field) {
    std::vector<double> v;
    const std::regex re("iteration +\\d+/ +\\d+ .*\\| " + field + ": (\\S+) \\|");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
    return v;
  }
  // `got` against `want` field by field (lm loss, grad norm, load_balancing_loss, num zeros, params norm), 6 lines,
  // within `tolerance` relative; prints and returns the largest relative difference.
  static double ExpectSameFields(const std::string& want, const std::string& got, double tolerance,
                                 const std::string& what) {
    double worst = 0;
    for (const char* field : {"lm loss", "grad norm", "load_balancing_loss", "num zeros", "params norm"}) {
      const auto a = Field(want, field), b = Field(got, field);
      EXPECT_EQ(a.size(), 6u) << what << " " << field << "\n" << want;
      EXPECT_EQ(b.size(), a.size()) << what << " " << field << "\n" << got;
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        EXPECT_NEAR(b[i], a[i], tolerance * std::abs(a[i])) << what << " " << field << " line " << i;
        worst = std::max(worst, std::abs(b[i] - a[i]) / std::max(1.0, std::abs(a[i])));
      }
    }
    std::printf("%s: largest relative difference of the logged values %.3g\n", what.c_str(), worst);
    return worst;
  }
  // `world` ranks of `flags`, which must succeed; their output.
  std::string Run(int world, const std::string& flags) {
    auto r = Ranks(world, Train(flags));
    EXPECT_NE(r.output.find(AllZero(world)), std::string::npos) << flags << "\n" << r.output << Logs(world);
    return r.output;
  }
  // The GPTConfig of Train's model (2 layers).
  static GPTConfig Config() {
    GPTConfig c = TinyModel(1000, 1024);
    c.add_bias_linear = false;
    c.gelu_exact = true;
    c.num_experts = 4;
    c.moe_ffn_hidden_size = 48;
    c.moe_aux_loss_coeff = 0.01;
    return c;
  }

 private:
  int num_layers_;
  std::string moe_extra_;
};

}  // namespace ptk::testing
