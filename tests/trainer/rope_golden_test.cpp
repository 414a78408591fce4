// The CPU rotary op against megatron-core 0.16.1's own RotaryEmbedding and apply_rotary_pos_emb
// (tests/data/trainer/rope_golden.json, written by tests/support/gen_rope_golden.py): the inverse
// frequencies, the rotated queries and keys and the gradient through them, for the default layout,
// --rotary-interleaved (a partial rotary too), --rotary-seq-len-interpolation-factor and
// --use-rope-scaling with --rope-scaling-factor 8 and 32, alone and together.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "tests/test_util.h"
#include "trainer/cpu/ops_cpu.h"
#include "trainer/op_math.h"

namespace ptk {
namespace {

std::vector<double> Doubles(simdjson::dom::element c, const char* key) {
  std::vector<double> out;
  simdjson::dom::array values;
  EXPECT_FALSE(c[key].get(values)) << key;
  for (simdjson::dom::element v : values) out.push_back(v.get_double().value());
  return out;
}

// Megatron's x (s, b, h, d) as a fused QKV (b, s, per head group [query, key, value]): the same head
// as query and key (both rotated), and as value (left as it was).
std::vector<double> AsQkv(const std::vector<double>& x, const AttentionShape& s) {
  std::vector<double> qkv(static_cast<size_t>(s.b * s.t * s.qkv_width()));
  for (int64_t p = 0; p < s.t; ++p)
    for (int64_t b = 0; b < s.b; ++b)
      for (int64_t h = 0; h < s.nh; ++h)
        for (int64_t slot = 0; slot < 3; ++slot)
          for (int64_t j = 0; j < s.hd; ++j)
            qkv[static_cast<size_t>((b * s.t + p) * s.qkv_width() + (h * 3 + slot) * s.hd + j)] =
                x[static_cast<size_t>(((p * s.b + b) * s.nh + h) * s.hd + j)];
  return qkv;
}

// The query and key slots against `want` (s, b, h, d), the value slot against `unchanged`.
void ExpectQkv(const std::vector<double>& qkv, const std::vector<double>& want, const std::vector<double>& unchanged,
               const AttentionShape& s, const std::string& what) {
  int bad = 0;
  for (int64_t p = 0; p < s.t; ++p)
    for (int64_t b = 0; b < s.b; ++b)
      for (int64_t h = 0; h < s.nh; ++h)
        for (int64_t slot = 0; slot < 3; ++slot)
          for (int64_t j = 0; j < s.hd; ++j) {
            const size_t m = static_cast<size_t>(((p * s.b + b) * s.nh + h) * s.hd + j);
            const double got = qkv[static_cast<size_t>((b * s.t + p) * s.qkv_width() + (h * 3 + slot) * s.hd + j)];
            const double expected = slot < 2 ? want[m] : unchanged[m];
            if (std::abs(got - expected) > 2e-6 * (1 + std::abs(expected)) && ++bad <= 5)
              ADD_FAILURE() << what << " pos " << p << " batch " << b << " head " << h << " slot " << slot << " ch "
                            << j << ": " << got << " vs megatron-core's " << expected;
          }
}

TEST(RopeGolden, CpuOpIsMegatronCores) {
  simdjson::dom::parser parser;
  const simdjson::dom::element g = parser.load(testing::SourceDir() + "/tests/data/trainer/rope_golden.json");
  std::string_view generator;
  ASSERT_FALSE(g["generator"].get(generator));
  EXPECT_TRUE(testing::Exists(testing::SourceDir() + "/" + std::string(generator))) << generator;
  int cases = 0;
  simdjson::dom::array all;
  ASSERT_FALSE(g["cases"].get(all));
  for (simdjson::dom::element c : all) {
    const std::string name(c["name"].get_string().value());
    const int64_t d = c["kv_channels"].get_int64().value();
    const int64_t rd = static_cast<int64_t>(static_cast<double>(d) * c["rotary_percent"].get_double().value());
    RopeSettings rs;
    rs.base = c["rotary_base"].get_double().value();
    rs.llama3_factor = c["use_rope_scaling"].get_bool().value() ? c["rope_scaling_factor"].get_double().value() : 0;
    rs.interpolation = c["rotary_seq_len_interpolation_factor"].get_double().value();
    rs.interleaved = c["rotary_interleaved"].get_bool().value();
    const AttentionShape s{c["batch"].get_int64().value(), c["seq"].get_int64().value(), c["heads"].get_int64().value(),
                           d, c["heads"].get_int64().value()};
    const std::vector<double> inv = Doubles(c, "inv_freq");
    ASSERT_EQ(static_cast<int64_t>(inv.size()), rd / 2) << name;
    for (int64_t i = 0; i < rd / 2; ++i)
      EXPECT_NEAR(RopeInverseFrequency(i, rd, rs.base, rs.llama3_factor), inv[static_cast<size_t>(i)],
                  2e-6 * inv[static_cast<size_t>(i)])
          << name << " pair " << i;
    std::vector<float> cos(static_cast<size_t>(s.t * rd / 2)), sin(cos.size());
    cpu::RopeTables(cos.data(), sin.data(), s.t, rd, rs);
    const std::vector<double> x = Doubles(c, "x"), r = Doubles(c, "r");
    std::vector<double> qkv = AsQkv(x, s);
    cpu::RopeForward(qkv.data(), cos.data(), sin.data(), s, rd, rs.interleaved);
    ExpectQkv(qkv, Doubles(c, "y"), x, s, name + " forward");
    std::vector<double> dqkv = AsQkv(r, s);
    cpu::RopeBackward(dqkv.data(), cos.data(), sin.data(), s, rd, rs.interleaved);
    ExpectQkv(dqkv, Doubles(c, "dx"), r, s, name + " backward");
    ++cases;
  }
  EXPECT_EQ(cases, 8);
}

}  // namespace
}  // namespace ptk
