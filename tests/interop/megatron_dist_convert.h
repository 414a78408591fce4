// What the torch_dist conversion tests share (megatron_dist_llama_test, megatron_dist_moe_test): ptk-convert
// --loader megatron of a checkpoint directory, converted and read back; the SHA-256 of fp32 values as the
// fixtures' generators hash them; every tensor against expected.json's; a damaged copy of a fixture refused; a file's
// bytes replaced.
#pragma once

#include <simdjson.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/hash.h"
#include "interop/megatron.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/param_layout.h"

namespace ptk::testing {

struct Converted {
  ConvertSummary summary;
  std::optional<ParamLayout> layout;
  std::vector<float> w, m1, m2;
  TrainState state;
};

// ptk-convert --loader megatron --saver ptk of `load` into `save`.
inline absl::StatusOr<ConvertSummary> Convert(const std::string& load, const std::string& save) {
  ConvertOptions o;
  o.loader = "megatron";
  o.saver = "ptk";
  o.load_dir = load;
  o.save_dir = save;
  return ImportFromMegatron(o);
}

// `load` converted into `save` and read back.
inline Converted ConvertAndLoad(const std::string& load, const std::string& save) {
  Converted c;
  auto s = Convert(load, save);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return c;
  c.summary = *s;
  auto layout = ParamLayout::Create(s->config);
  EXPECT_TRUE(layout.ok()) << layout.status();
  c.layout = *layout;
  const absl::Status st = LoadCheckpoint(save, s->iteration, *c.layout, &c.w, &c.m1, &c.m2, &c.state);
  EXPECT_TRUE(st.ok()) << st;
  return c;
}

// The SHA-256 of `n` fp32 values, little-endian.
inline std::string HexOf(const float* v, int64_t n) {
  return Sha256Hex(std::string_view(reinterpret_cast<const char*>(v), static_cast<size_t>(n) * sizeof(float)));
}

// Every tensor of `c`'s layout against `tensors` (expected.json's, of fixture `name`): its weight's and moments'
// shapes and SHA-256; with `moments` false, the moments zero.
inline void ExpectTensorsAsRecorded(const Converted& c, simdjson::dom::object tensors, const std::string& name,
                                    bool moments) {
  EXPECT_EQ(tensors.size(), c.layout->infos.size());
  int compared = 0;
  for (const ParamInfo& p : c.layout->infos) {
    simdjson::dom::element e;
    ASSERT_EQ(tensors[p.name].get(e), simdjson::SUCCESS) << p.name << " not in expected.json";
    for (auto [which, v] : {std::pair{"weight", &c.w}, {"exp_avg", &c.m1}, {"exp_avg_sq", &c.m2}}) {
      if (!moments && v != &c.w) {
        EXPECT_TRUE(std::all_of(v->begin() + p.offset, v->begin() + p.offset + p.size, [](float x) { return x == 0; }));
        ++compared;
        continue;
      }
      std::vector<int64_t> shape;
      for (int64_t d : e[which]["shape"].get_array()) shape.push_back(d);
      EXPECT_EQ(shape, p.shape) << p.name;
      EXPECT_EQ(HexOf(v->data() + p.offset, p.size), std::string(std::string_view(e[which]["sha256"])))
          << name << ": " << which << " of " << p.name << " (first " << (*v)[p.offset] << ", want "
          << double(e[which]["first"].at(0)) << ")";
      ++compared;
    }
  }
  EXPECT_EQ(compared, 3 * static_cast<int>(c.layout->infos.size()));
}

// A copy of the checkpoint directory `fixture` (its iteration directory `iter` passed to `damage`) converted:
// refused in one line holding each of `needles`, nothing written.
inline void ExpectConvertRefused(const std::string& fixture, const std::string& iter,
                                 const std::function<void(const std::string&)>& damage,
                                 const std::vector<std::string>& needles) {
  TempDir dir;
  const std::string copy = dir / "ck";
  std::filesystem::copy(fixture, copy, std::filesystem::copy_options::recursive);
  damage(copy + "/" + iter);
  auto s = Convert(copy, dir / "ptk");
  ASSERT_FALSE(s.ok()) << fixture;
  const std::string msg(s.status().message());
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no '" << n << "' in: " << msg;
  EXPECT_FALSE(Exists(dir / "ptk/latest_checkpointed_iteration.txt")) << msg;
}

// Every `from` in `file` replaced by `to` (the same size); `from` must be there.
inline void Replace(const std::string& file, const std::string& from, const std::string& to) {
  std::string data = ReadFile(file);
  ASSERT_EQ(from.size(), to.size());
  size_t at = data.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in " << file;
  for (; at != std::string::npos; at = data.find(from, at)) data.replace(at, from.size(), to);
  WriteFile(file, data);
}

}  // namespace ptk::testing
