// safetensors as ptk writes and reads it: the layout (8-byte length, JSON header padded to 8
// bytes, data in order), a round trip, F16/BF16 widening, and every kind of damage refused with
// the file and the tensor named.
#include "interop/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::TempDir;
using ptk::testing::WriteFile;

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
// A file from a header and data, as the format lays them out.
std::string Make(const std::string& header, const std::string& data) { return Le64(header.size()) + header + data; }

std::string OpenError(const std::string& path) {
  auto f = SafetensorsFile::Open(path);
  EXPECT_FALSE(f.ok());
  if (f.ok()) return "";
  EXPECT_TRUE(absl::IsDataLoss(f.status())) << f.status();
  return std::string(f.status().message());
}

TEST(Safetensors, WritesTheLayoutAndReadsItBack) {
  TempDir dir;
  const std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {-0.5f};
  const std::string path = dir / "m.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"x.weight", {2, 3}, a}, {"y", {1}, b}}, {{"format", "pt"}}).ok());
  const std::string bytes = ReadFile(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u) << "the data starts 8-byte aligned";
  EXPECT_EQ(bytes.substr(8, n).find(R"("__metadata__":{"format":"pt"})"), 1u);
  EXPECT_NE(bytes.find(R"("x.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})"), std::string::npos);
  EXPECT_EQ(bytes.size(), 8 + n + 28);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), 2u);
  const SafetensorsTensor* x = (*f)->Find("x.weight");
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(*(*f)->ReadFloat(*x), a);
  EXPECT_EQ(*(*f)->ReadFloat(*(*f)->Find("y")), b);
  EXPECT_EQ((*f)->Find("z"), nullptr);
}

TEST(Safetensors, WidensHalfAndBfloat16Exactly) {
  TempDir dir;
  // F16: 1.0 (0x3c00), -2.5 (0xc100), the smallest subnormal (0x0001), inf (0x7c00);
  // BF16: 1.0 (0x3f80), -3.0 (0xc040).
  const std::string f16("\x00\x3c\x00\xc1\x01\x00\x00\x7c", 8), bf16("\x80\x3f\x40\xc0", 4);
  const std::string header =
      R"({"h":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}})";
  WriteFile(dir / "h.safetensors", Make(header, f16 + bf16));
  auto f = SafetensorsFile::Open(dir / "h.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  const std::vector<float> h = *(*f)->ReadFloat(*(*f)->Find("h"));
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.5f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(h[3]));
  EXPECT_EQ(*(*f)->ReadFloat(*(*f)->Find("b")), (std::vector<float>{1.0f, -3.0f}));
}

TEST(Safetensors, DamageIsRefusedNamingTheTensor) {
  TempDir dir;
  const std::string p = dir / "bad.safetensors";
  const std::string four(16, '\0');
  auto with = [&](const std::string& header, const std::string& data) {
    WriteFile(p, Make(header, data));
    return OpenError(p);
  };
  WriteFile(p, "abc");
  EXPECT_NE(OpenError(p).find("shorter than the 8-byte header length"), std::string::npos);
  WriteFile(p, Le64(1000) + "{}");
  EXPECT_NE(OpenError(p).find("the header length 1000 runs past the end"), std::string::npos);
  EXPECT_NE(with("[1, 2]", "").find("not a JSON object"), std::string::npos);
  EXPECT_NE(
      with(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          std::string(12, '\0'))
          .find("tensor b starts at byte 4 of the data, where the previous tensor's bytes still are"),
      std::string::npos);
  EXPECT_NE(
      with(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
          std::string(12, '\0'))
          .find("tensor b starts at byte 8 of the data, where 4 is expected (a hole)"),
      std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'))
                .find("tensor a: 8 bytes for 3 elements of F32"),
            std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(12, '\0'))
                .find("tensor a: data_offsets outside the data section of 12 bytes"),
            std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(12, '\0'))
                .find("the tensors cover 8 of the 12 data bytes"),
            std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0'))
                .find("tensor a: unknown dtype Q4"),
            std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, '\0'))
                .find("tensor a: the shape holds something other than a dimension"),
            std::string::npos);
  EXPECT_NE(
      with(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          std::string(8, '\0'))
          .find("tensor a is named twice"),
      std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[1]}})", four).find("tensor a: its entry needs dtype, shape and"),
            std::string::npos);
  // A field given twice in an entry: the reference (serde) refuses it; the first would be taken.
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"I32"}})", std::string(4, '\0'))
                .find("tensor a: its entry gives dtype twice"),
            std::string::npos);
  EXPECT_NE(with(R"({"a":{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'))
                .find("tensor a: its entry gives shape twice"),
            std::string::npos);
  // A valid file cut short by a byte.
  ASSERT_TRUE(WriteSafetensors(p, {{"w", {4}, std::vector<float>{1, 2, 3, 4}}}, {}).ok());
  std::string whole = ReadFile(p);
  WriteFile(p, whole.substr(0, whole.size() - 1));
  EXPECT_NE(OpenError(p).find("tensor w: data_offsets outside the data section"), std::string::npos);
  EXPECT_NE(OpenError(p).find(p), std::string::npos) << "the file is named";
}

TEST(Safetensors, OtherDtypesAreReadAsBytesButNotAsWeights) {
  TempDir dir;
  WriteFile(dir / "i.safetensors", Make(R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", Le64(7)));
  auto f = SafetensorsFile::Open(dir / "i.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Bytes(*(*f)->Find("ids")).size(), 8u);
  auto w = (*f)->ReadFloat(*(*f)->Find("ids"));
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("tensor ids is I64"), absl::string_view::npos);
}

}  // namespace
}  // namespace ptk
