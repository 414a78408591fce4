// What the mixture of experts' tensor and context ranks' CLI tests share (moe_tp_train_cli_test,
// moe_cp_train_cli_test): a log line's entry, and the router's features (the z-loss, the balancing loss types, the
// expert bias, a capacity) trained by 2 ranks against one rank.
#pragma once

#include <cmath>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk::testing {

class MoeRanksCliTest : public RanksTest {
 protected:
  MoeRanksCliTest() : RanksTest(kSmallVocabEod) {}
  // ptk-train of the tests' MoE model at `ranks` ranks of the kind under test, `extra` appended.
  virtual std::string Train(int ranks, const std::string& extra, int64_t iters = 6) = 0;
  // The `name` entry of each log line.
  static std::vector<double> Entry(const std::string& out, const std::string& name) {
    std::vector<double> v;
    const std::regex re("\\| " + name + R"(: (\S+) \|)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(std::stod((*it)[1].str()));
    return v;
  }
  // Each of `entries` of the 6 log lines of `out` within 1e-5 relative of `one`'s. Call under ASSERT_NO_FATAL_FAILURE.
  static void ExpectEntriesNear(const std::string& one, const std::string& out,
                                const std::vector<std::string>& entries) {
    for (const std::string& entry : entries) {
      const auto b1 = Entry(one, entry), b2 = Entry(out, entry);
      ASSERT_EQ(b1.size(), 6u) << entry << "\n" << one;
      ASSERT_EQ(b2.size(), 6u) << entry << "\n" << out;
      for (size_t i = 0; i < b1.size(); ++i) EXPECT_NEAR(b2[i], b1[i], 1e-5 * b1[i]) << entry << " line " << i;
    }
  }
  // The z-loss, the seq_aux_loss and global_aux_loss types, the expert bias and a capacity no rank's tokens exceed:
  // 2 ranks (`kind`, "T" or "C") give one rank's lm losses and balancing losses within 1e-5; the z_loss logged is the
  // last rank's own tokens' mean (`own`: "tensor" or "context"), so not one rank's. With --calculate-per-token-loss
  // 2 ranks train as one with twice the coefficients. Call under ASSERT_NO_FATAL_FAILURE.
  void ExpectRouterFeaturesTrainAsOneRank(const std::string& kind, const std::string& own) {
    const std::vector<std::tuple<std::string, std::string, std::vector<std::string>>> models = {
        {"z-loss", "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.01", {"load_balancing_loss"}},
        {"seq_aux_loss and global_aux_loss",
         "--swiglu --moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
         "--moe-aux-loss-coeff 0.01 0.02 0.03",
         {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"}},
        {"expert bias",
         "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
         "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01",
         {"seq_load_balancing_loss"}},
        {"capacity over every rank's tokens",
         "--moe-expert-capacity-factor 4 --moe-pad-expert-input-to-capacity --moe-aux-loss-coeff 0.01",
         {"load_balancing_loss"}},
    };
    for (const auto& [what, flags, entries] : models) {
      SCOPED_TRACE(what);
      auto one = RunCmd(Train(1, flags));
      ASSERT_EQ(one.exit_code, 0) << one.output;
      const auto ref = Losses(one.output);
      ASSERT_EQ(ref.size(), 6u) << one.output;
      std::string out;
      ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(2, flags), ref, 6, 1e-5, what + " " + kind + "=2", &out));
      ASSERT_NO_FATAL_FAILURE(ExpectEntriesNear(one.output, out, entries));
      if (what != "z-loss") continue;
      const auto z1 = Entry(one.output, "z_loss"), z2 = Entry(out, "z_loss");
      ASSERT_EQ(z2.size(), 6u) << out;
      for (size_t i = 0; i < z2.size(); ++i) {
        EXPECT_GT(z2[i], 0.0);
        EXPECT_GT(std::abs(z2[i] - z1[i]), 1e-5 * z1[i])
            << "line " << i << ": the last " << own << " rank's tokens' own";
      }
    }
    const std::string per_token_flags =
        " --calculate-per-token-loss --moe-router-load-balancing-type aux_loss seq_aux_loss";
    auto one = RunCmd(Train(1, "--moe-z-loss-coeff 0.01 --moe-aux-loss-coeff 0.01 0.01" + per_token_flags));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    std::string out;
    ASSERT_NO_FATAL_FAILURE(
        RunGivingLosses(2, Train(2, "--moe-z-loss-coeff 0.02 --moe-aux-loss-coeff 0.02 0.02" + per_token_flags),
                        Losses(one.output), 6, 1e-5, "per-token " + kind + "=2, coefficients x 2", &out));
    auto same = RunCmd(Train(1, "--moe-z-loss-coeff 0.02 --moe-aux-loss-coeff 0.02 0.02" + per_token_flags));
    ASSERT_EQ(same.exit_code, 0) << same.output;
    EXPECT_GT(Worst(Losses(same.output), Losses(one.output)), 1e-5);  // the coefficients do move the losses
  }
};

}  // namespace ptk::testing
