// What may follow the data in a .gz, .xz or .zst file, judged as gzip, xz and zstd judge it:
// concatenated members/streams/frames, padding, trailing garbage, truncation, empty files. Each
// case's expected outcome is written down, and, where the format's command-line tool is installed
// (scripts/install-deps.sh installs xz-utils and zstd), the tool is run on the same bytes and must
// accept exactly the files ptk accepts, with the same output.
#include <random>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/status.h"
#include "dataprep/input/byte_source.h"
#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::TempDir;

struct Case {
  std::string name;  // file name: its extension is the format
  std::string bytes;
  std::string want;     // the decoded bytes, when accepted
  std::string message;  // a part of the error, when refused ("" = accepted)
};

// Everything `path` decodes to, or the error.
absl::StatusOr<std::string> DecodeAll(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(auto src, OpenByteSource(path));
  std::string out;
  std::vector<char> buf(1 << 16);
  while (true) {
    PTK_ASSIGN_OR_RETURN(size_t n, src->Read(buf.data(), buf.size()));
    if (n == 0) return out;
    out.append(buf.data(), n);
  }
}

std::string Text(int lines, int seed) {
  std::mt19937 rng(seed);
  std::string s;
  for (int i = 0; i < lines; ++i) s += fmt::format("{{\"text\": \"line {} of {}: {}\"}}\n", i, seed, rng());
  return s;
}

// Incompressible: a member or stream larger than the decoders' 128 KiB input buffer.
std::string Noise(size_t n, int seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>('a' + rng() % 26);
  return s;
}

std::string Zeros(size_t n) { return std::string(n, '\0'); }

// Decodes every case with ptk and, when the format's tool is installed, with the tool.
void Check(const std::vector<Case>& cases, const std::string& tool) {
  TempDir dir;
  const bool have_tool = RunCmd("command -v " + tool).exit_code == 0;
  if (!have_tool) std::fprintf(stderr, "note: %s is not installed; the expected outcomes only\n", tool.c_str());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir / c.name;
    testing::WriteFile(path, c.bytes);
    auto got = DecodeAll(path);
    if (c.message.empty()) {
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == c.want) << got->size() << " bytes, want " << c.want.size();
    } else {
      ASSERT_FALSE(got.ok()) << "accepted";
      EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
      const std::string msg(StatusMessage(got.status()));
      EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;  // names the file first
      EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;  // one line
    }
    if (!have_tool) continue;
    auto ref =
        RunCmd(fmt::format("{} -dc {} > {}", tool, testing::ShellQuote(path), testing::ShellQuote(path + ".ref")));
    EXPECT_EQ(ref.exit_code == 0, c.message.empty()) << tool << " exits " << ref.exit_code << ": " << ref.output;
    if (ref.exit_code == 0 && got.ok()) {
      EXPECT_TRUE(testing::ReadFile(path + ".ref") == *got) << tool << "'s output";
    }
  }
}

// Regression: zero padding after the last member (tape and block writers leave it; gzip -d ignores
// it silently) failed. Trailing garbage is still refused (gzip -d warns and exits 2), at its offset.
TEST(ByteSource, GzipAcceptsZeroPaddingAndNamesTrailingGarbage) {
  const std::string a = Text(300, 1), b = Text(200, 2), big = Noise(300000, 3);
  const std::string ga = testing::GzipCompress(a), gb = testing::GzipCompress(b), gbig = testing::GzipCompress(big);
  const auto at = [](size_t n) {
    return fmt::format("trailing garbage at byte {}, after the last complete gzip member", n);
  };
  Check(
      {
          {"members.gz", ga + gb + ga, a + b + a, ""},
          {"empty_member.gz", testing::GzipCompress("") + ga + Zeros(8), a, ""},
          {"padded.gz", ga + gb + Zeros(512), a + b, ""},
          {"padded_big.gz", gbig + Zeros(200000), big, ""},  // zeros across the 128 KiB input buffers
          {"one_zero.gz", ga + Zeros(1), a, ""},
          {"garbage.gz", ga + "garbage!", "", at(ga.size())},
          {"zeros_then_garbage.gz", ga + gb + Zeros(3) + "x", "", at(ga.size() + gb.size() + 3)},
          {"big_zeros_then_garbage.gz", gbig + Zeros(200000) + "junk", "", at(gbig.size() + 200000)},
          {"zeros_then_member.gz", ga + Zeros(4) + gb, "", at(ga.size() + 4)},
          {"one_byte.gz", ga + "x", "", at(ga.size())},
          {"bad_magic.gz", ga + std::string("\x1f\x00junkjunk", 10), "", at(ga.size())},
          {"half_magic.gz", ga + "\x1f", "", "truncated gzip data"},
          {"cut.gz", ga + gb.substr(0, gb.size() / 2), "", "truncated gzip data"},
          {"empty.gz", "", "", "empty file is not gzip data"},
      },
      "gzip");
}

// Regression: garbage after an xz stream was reported as truncated data. Stream padding (zero
// bytes, a multiple of four) is valid between and after streams, as xz reads it; other padding is
// corrupt, as xz says.
TEST(ByteSource, XzReadsStreamPaddingAndNamesTrailingGarbage) {
  const std::string a = Text(300, 4), b = Text(200, 5), big = Noise(300000, 6);
  const std::string xa = testing::XzCompress(a), xb = testing::XzCompress(b), xbig = testing::XzCompress(big, 0);
  const auto at = [](size_t n) {
    return fmt::format("trailing garbage at byte {}, after the last complete xz stream", n);
  };
  Check(
      {
          {"streams.xz", xa + xb + xa, a + b + a, ""},
          {"empty_stream.xz", testing::XzCompress("") + Zeros(4) + xa, a, ""},
          {"padded.xz", xa + Zeros(4) + xb + Zeros(8), a + b, ""},
          {"padded_big.xz", xbig + Zeros(200000) + xa, big + a, ""},  // padding across the input buffers
          {"garbage.xz", xa + "garbage!", "", at(xa.size())},
          {"long_garbage.xz", xa + xb + std::string(100, 'g'), "", at(xa.size() + xb.size())},
          {"padding_then_garbage.xz", xa + Zeros(4) + "garb", "", at(xa.size() + 4)},
          {"padding_3.xz", xa + Zeros(3), "",
           fmt::format("3 zero bytes after the xz stream that ends at byte {}: "
                       "stream padding must be a multiple of 4 bytes",
                       xa.size())},
          {"padding_5_then_stream.xz", xa + Zeros(5) + xb, "", "stream padding must be a multiple of 4 bytes"},
          {"not_a_stream.xz", xa + std::string("\xfd\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", 12), "",
           at(xa.size())},
          {"half_header.xz",
           xa + std::string("\xfd"
                            "7zXZ",
                            5),
           "", "truncated xz data"},
          {"cut.xz", xa + xb.substr(0, xb.size() - 10), "", "truncated xz data"},
          {"empty.xz", "", "", "empty file is not xz data"},
      },
      "xz");
}

// zstd -d takes frames and skippable frames one after another and nothing else: zero bytes after
// the last frame are refused too. Three trailing bytes were "truncated" data; they are garbage.
TEST(ByteSource, ZstdReadsFramesAndNamesTrailingGarbage) {
  const std::string a = Text(300, 7), b = Text(200, 8), big = Noise(300000, 9);
  const std::string za = testing::ZstdCompress(a), zb = testing::ZstdCompress(b), zbig = testing::ZstdCompress(big);
  const std::string skippable("\x5e\x2a\x4d\x18\x04\x00\x00\x00wxyz", 12);
  const auto at = [](size_t n) {
    return fmt::format("trailing garbage at byte {}, after the last complete zstd frame", n);
  };
  Check(
      {
          {"frames.zst", za + skippable + zb + za, a + b + a, ""},
          {"frames_big.zst", zbig + za, big + a, ""},
          {"only_skippable.zst", skippable, "", ""},
          {"cut_skippable.zst", skippable.substr(0, 10), "", "truncated zstd data"},
          {"empty_frame.zst", testing::ZstdCompress("") + za, a, ""},
          {"garbage.zst", za + "garbage!", "", at(za.size())},
          {"zeros.zst", za + zb + Zeros(8), "", at(za.size() + zb.size())},
          {"three_zeros.zst", za + Zeros(3), "", at(za.size())},
          {"big_then_garbage.zst", zbig + std::string(100, 'g'), "", at(zbig.size())},
          {"half_magic.zst", za + "\x28\xb5", "", "truncated zstd data"},
          {"cut.zst", za + zb.substr(0, zb.size() - 3), "", "truncated zstd data"},
          {"empty.zst", "", "", "empty file is not a zstd stream"},
      },
      "zstd");
}

}  // namespace
}  // namespace ptk
