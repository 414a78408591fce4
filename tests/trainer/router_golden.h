// What the MoE router's parallel goldens share (moe_tp_router_golden_test, moe_cp_router_golden_test): their text
// (tests/data/trainer/moe_{tp,cp}_router_golden.txt, written by tests/support/gen_moe_{tp,cp}_router_golden.py) read
// into cases, and a comparison that keeps the largest difference.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk::testing {

// One case of a router golden: its shared tensors and, per "<size> <rank>", the rank's.
struct RouterGoldenCase {
  std::map<std::string, std::vector<double>> shared;
  std::map<std::string, std::map<std::string, std::vector<double>>> ranks;
};

// tests/data/trainer/FILE's cases by name: lines "case NAME", "<group> SIZE rank R" (group "tensor" or "context")
// opening a rank's tensors, and "KEY values...".
inline std::map<std::string, RouterGoldenCase> ReadRouterGolden(const std::string& file, const std::string& group) {
  std::istringstream in(ReadFile(SourceDir() + "/tests/data/trainer/" + file));
  std::map<std::string, RouterGoldenCase> cases;
  std::string line, name, rank;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == "case") {
      words >> name;
      rank.clear();
      continue;
    }
    if (key == group) {
      std::string size, word, r;
      words >> size >> word >> r;
      rank = size + " " + r;
      continue;
    }
    std::vector<double> v;
    for (double x; words >> x;) v.push_back(x);
    (rank.empty() ? cases[name].shared[key] : cases[name].ranks[rank][key]) = v;
  }
  return cases;
}

// `got` within `tolerance` of Megatron's `want`; *worst keeps the largest difference seen.
inline ::testing::AssertionResult NearMegatron(double got, double want, double tolerance, double* worst) {
  *worst = std::max(*worst, std::abs(got - want));
  if (std::abs(got - want) <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << got << " vs Megatron's " << want << " (tolerance " << tolerance << ")";
}

}  // namespace ptk::testing
