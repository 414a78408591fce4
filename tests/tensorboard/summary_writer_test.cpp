// TensorBoard event files: CRC-32C and TFRecord framing against their published values, the file's
// name and first record, scalars written only at Flush, a new file per writer, a full disk.
#include "tensorboard/summary_writer.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk {
namespace {

uint32_t Le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
uint64_t Le64(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

// The records of an event file, each checked against its two CRCs.
std::vector<std::string> Records(const std::string& file) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < file.size()) {
    EXPECT_LE(pos + 12, file.size());
    if (pos + 12 > file.size()) break;
    const uint64_t len = Le64(file, pos);
    EXPECT_EQ(Le32(file, pos + 8), MaskedCrc32c(file.substr(pos, 8)));
    EXPECT_LE(pos + 16 + len, file.size());
    if (pos + 16 + len > file.size()) break;
    std::string data = file.substr(pos + 12, len);
    EXPECT_EQ(Le32(file, pos + 12 + len), MaskedCrc32c(data));
    out.push_back(data);
    pos += 16 + len;
  }
  return out;
}

std::vector<std::string> EventFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Crc32c, PublishedCheckValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);              // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);    // RFC 3720 B.4: 32 bytes of zeros
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);  // ... of 0xff
  EXPECT_EQ(Crc32c("56789", Crc32c("1234")), 0xE3069283u);  // continued
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32c, MaskAndFrameAsTensorFlow) {
  const uint32_t crc = Crc32c("abc");
  EXPECT_EQ(MaskedCrc32c("abc"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  const std::string rec = FrameRecord("abc");
  ASSERT_EQ(rec.size(), 3u + 16u);
  EXPECT_EQ(Le64(rec, 0), 3u);
  EXPECT_EQ(Le32(rec, 8), MaskedCrc32c(rec.substr(0, 8)));
  EXPECT_EQ(rec.substr(12, 3), "abc");
  EXPECT_EQ(Le32(rec, 15), MaskedCrc32c("abc"));
}

TEST(SummaryWriter, FileNameFirstRecordAndScalars) {
  ptk::testing::TempDir dir;
  SummaryWriterOptions o;
  o.host = "node7";
  o.wall_time = 1700000000.25;
  auto w = SummaryWriter::Create(dir / "tb", o);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string name = std::filesystem::path((*w)->path()).filename().string();
  EXPECT_TRUE(std::regex_match(name, std::regex(R"(events\.out\.tfevents\.1700000000\.node7\.\d+\.0)"))) << name;
  // The file-version record is on disk at once; scalars only after Flush.
  std::vector<std::string> recs = Records(ptk::testing::ReadFile((*w)->path()));
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_NE(recs[0].find("brain.Event:2"), std::string::npos);
  (*w)->AddScalar("lm loss", 7.5, 3, 1700000001.0);
  (*w)->AddScalar("learning-rate", 0.0, 3, 1700000001.0);
  EXPECT_EQ(Records(ptk::testing::ReadFile((*w)->path())).size(), 1u);
  ASSERT_TRUE((*w)->Flush().ok());
  recs = Records(ptk::testing::ReadFile((*w)->path()));
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_NE(recs[1].find("lm loss"), std::string::npos);
  // A value of 0 is written (field 2, fixed32: tag byte 0x15, then four zero bytes).
  EXPECT_NE(recs[2].find(std::string("\x15\0\0\0\0", 5)), std::string::npos);
  ASSERT_TRUE((*w)->Close().ok());
  ASSERT_TRUE((*w)->Close().ok());
  // A second writer in the same second (a resume) gets a file of its own.
  auto w2 = SummaryWriter::Create(dir / "tb", o);
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_NE((*w2)->path(), (*w)->path());
  EXPECT_EQ(EventFiles(dir / "tb").size(), 2u);
}

// A file-size limit makes writes fail with EFBIG, the path a full disk's ENOSPC takes.
TEST(SummaryWriter, FullDiskIsResourceExhausted) {
  ptk::testing::TempDir dir;
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    auto w = SummaryWriter::Create(dir / "tb");
    if (!w.ok()) _exit(10);
    rlimit lim{4096, 4096};
    setrlimit(RLIMIT_FSIZE, &lim);
    for (int i = 0; i < 1000; ++i) (*w)->AddScalar("lm loss", i, i);
    absl::Status st = (*w)->Flush();
    if (st.ok()) _exit(11);
    if (!absl::IsResourceExhausted(st)) _exit(12);
    if (st.message().find("events.out.tfevents.") == absl::string_view::npos) _exit(13);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(SummaryWriter, UnwritableDirectoryIsAnError) {
  ptk::testing::TempDir dir;
  ptk::testing::WriteFile(dir / "file", "x");
  auto w = SummaryWriter::Create(dir / "file");
  EXPECT_FALSE(w.ok());
}

}  // namespace
}  // namespace ptk
