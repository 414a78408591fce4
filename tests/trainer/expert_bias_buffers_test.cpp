// LoadExpertBiases: the CPU and CUDA models' load of the expert biases a checkpoint holds.
#include "trainer/expert_bias_buffers.h"

#include <map>

#include <gtest/gtest.h>

namespace ptk {
namespace {

// Layers 0 and 2 route with a bias (named as the checkpoint names it), layer 1 is dense.
std::string Name(int64_t l) { return l == 1 ? "" : "decoder.layers." + std::to_string(l) + ".mlp.router.expert_bias"; }

TEST(LoadExpertBiases, HandsEachLayerItsBuffer) {
  const ModelBuffers in = {{Name(2), {3, 4}}, {Name(0), {1, 2}}};
  std::map<int64_t, std::vector<float>> got;
  const absl::Status s = LoadExpertBiases(in, 3, 2, Name, [&](int64_t l, const std::vector<float>& v) { got[l] = v; });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(got, (std::map<int64_t, std::vector<float>>{{0, {1, 2}}, {2, {3, 4}}}));
}

TEST(LoadExpertBiases, RefusesAMissingAWrongSizedAndAnUntakenBuffer) {
  const auto set = [](int64_t, const std::vector<float>&) {};
  const absl::Status missing = LoadExpertBiases({{Name(0), {1, 2}}}, 3, 2, Name, set);
  EXPECT_NE(missing.message().find("the checkpoint holds no decoder.layers.2.mlp.router.expert_bias"),
            std::string::npos)
      << missing;
  const absl::Status size = LoadExpertBiases({{Name(0), {1, 2, 3}}, {Name(2), {1, 2}}}, 3, 2, Name, set);
  EXPECT_NE(size.message().find("decoder.layers.0.mlp.router.expert_bias has 3 values for --num-experts 2"),
            std::string::npos)
      << size;
  const absl::Status extra = LoadExpertBiases(
      {{Name(0), {1, 2}}}, 3, 2, [](int64_t) { return std::string(); }, set);
  EXPECT_NE(extra.message().find("holds 1 buffer(s) this model has none of (the first: "
                                 "decoder.layers.0.mlp.router.expert_bias"),
            std::string::npos)
      << extra;
  EXPECT_TRUE(LoadExpertBiases(
                  {}, 3, 2, [](int64_t) { return std::string(); }, set)
                  .ok());
}

}  // namespace
}  // namespace ptk
