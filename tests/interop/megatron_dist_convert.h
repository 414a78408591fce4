// What the torch_dist conversion tests share (megatron_dist_llama_test, megatron_dist_moe_test): ptk-convert
// --loader megatron of a checkpoint directory, converted and read back; the SHA-256 of fp32 values as the
// fixtures' generators hash them; a damaged copy of a fixture refused; a file's bytes replaced.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
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
