// ptk-extract and ptk-concat: byte-exact streaming decode (multi-frame), skip of complete outputs,
// damaged inputs, --drop-set, kill -9 and rerun; concat plans (balance, NeMo's 800-file grouping in
// C-locale order), newline safety, array-task chunks.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/status.h"
#include "dataprep/concat/concat.h"
#include "dataprep/input/byte_source.h"
#include "dataprep/input/input_list.h"
#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::TempDir;

std::string Jsonl(int n, int seed, const char* set = "RedPajamaC4") {
  std::mt19937 rng(seed);
  std::string s;
  for (int i = 0; i < n; ++i)
    s += fmt::format("{{\"text\": \"doc {} of {} with {} words\", \"meta\": {{\"redpajama_set_name\": \"{}\"}}}}\n", i,
                     seed, rng() % 1000, (i % 5 == 0) ? "RedPajamaBook" : set);
  return s;
}

TEST(Extract, DecodesZstXzAndPlainKeepingTheLayout) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in/chunk1");
  std::filesystem::create_directories(dir / "in/chunk2");
  std::string a = Jsonl(3000, 1), b = Jsonl(2000, 2), c = Jsonl(100, 3);
  // Two zstd frames, an xz stream, a second copy name in another chunk.
  testing::WriteFile(dir / "in/chunk1/x_0.jsonl.zst",
                     testing::ZstdCompress(a.substr(0, 50000)) + testing::ZstdCompress(a.substr(50000)));
  testing::WriteFile(dir / "in/chunk1/x_1.jsonl.xz", testing::XzCompress(b));
  testing::WriteFile(dir / "in/chunk2/x_0.jsonl.zst", testing::ZstdCompress(c));
  auto r = RunCmd(
      fmt::format("{} --quiet {} --output-dir {} --jobs 2", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/chunk1/x_0.jsonl"), a);
  EXPECT_EQ(testing::ReadFile(dir / "out/chunk1/x_1.jsonl"), b);
  EXPECT_EQ(testing::ReadFile(dir / "out/chunk2/x_0.jsonl"), c);
  // Rerun: everything already complete (verified against the sidecar).
  auto again =
      RunCmd(fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  ASSERT_EQ(again.exit_code, 0);
  EXPECT_NE(again.output.find("0 extracted, 3 already complete"), std::string::npos) << again.output;
  // A truncated output (a crash after rename would be caught the same way) is redone.
  testing::WriteFile(dir / "out/chunk1/x_1.jsonl", b.substr(0, 100));
  auto redo =
      RunCmd(fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_NE(redo.output.find("1 extracted, 2 already complete"), std::string::npos) << redo.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/chunk1/x_1.jsonl"), b);
  // --verify re-decodes and compares.
  auto ver = RunCmd(
      fmt::format("{} --quiet {} --output-dir {} --verify", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_EQ(ver.exit_code, 0) << ver.output;
}

TEST(Extract, ADirectoryWithNothingToExtractIsNamed) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "empty");
  auto r = RunCmd(fmt::format("{} --quiet {}", testing::Tool("ptk-extract"), dir / "empty"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir / "empty"), std::string::npos) << r.output;
  // ptk-concat said "no input files to concatenate", naming nothing.
  std::filesystem::create_directories(dir / "other");
  testing::WriteFile(dir / "other/notes.txt", "");
  for (const auto& [in, why] : {std::pair<std::string, std::string>{dir / "empty", "(empty)"},
                                {dir / "other", "(every file left out, listed above)"}}) {
    auto c = RunCmd(fmt::format("{} --quiet --input {} --output-dir {}", testing::Tool("ptk-concat"), in, dir / "c"));
    EXPECT_EQ(c.exit_code, 1) << c.output;
    EXPECT_NE(c.output.find("error: no input files to concatenate in " + in + " " + why), std::string::npos)
        << c.output;
  }
}

// No input at all is a usage error in the form docs/ptk-extract.md uses (a positional input): it said
// "--input is required".
TEST(Extract, NoInputSaysWhatToGiveInTheDocsForm) {
  for (const char* extra : {"", " --output-dir out --jobs 2"}) {
    auto r = RunCmd(testing::Tool("ptk-extract") + extra);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("usage error: no input given: name the files, globs or directories to extract "
                            "(ptk-extract raw --output-dir extracted)"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("--input is required"), std::string::npos) << r.output;
  }
}

TEST(Extract, DamagedInputsFailAloneWithOffsetAndNoOutput) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string good = Jsonl(2000, 4);
  std::string z = testing::ZstdCompress(good);
  testing::WriteFile(dir / "in/a_good.jsonl.zst", z);
  testing::WriteFile(dir / "in/b_trunc.jsonl.zst", z.substr(0, z.size() * 2 / 3));
  std::string flipped = z;
  flipped[z.size() / 2] ^= 0x40;
  testing::WriteFile(dir / "in/c_corrupt.jsonl.zst", flipped);
  std::string xz = testing::XzCompress(good);
  testing::WriteFile(dir / "in/d_trunc.jsonl.xz", xz.substr(0, xz.size() - 20));
  testing::WriteFile(dir / "in/e_good.jsonl.xz", xz);
  auto r = RunCmd(
      fmt::format("{} --quiet {} --output-dir {} --jobs 3", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("3 of 5 files failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("b_trunc.jsonl.zst: truncated zstd data"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("c_corrupt.jsonl.zst: corrupt zstd data near byte"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("d_trunc.jsonl.xz: truncated xz data"), std::string::npos) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/a_good.jsonl"), good);
  EXPECT_EQ(testing::ReadFile(dir / "out/e_good.jsonl"), good);
  for (const char* bad : {"b_trunc.jsonl", "c_corrupt.jsonl", "d_trunc.jsonl"}) {
    EXPECT_FALSE(testing::Exists(dir / ("out/" + std::string(bad)))) << bad;
  }
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// Formats go by content, but only among those the name allows: a .zst that holds gzip is decoded,
// one that holds random bytes or plain text is an error naming the file and its first bytes (it was
// copied as it was, exit 0), with no output and no doubled file name in the summary.
TEST(Extract, ANameSayingCompressedWithoutCompressedContentFails) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string good = Jsonl(50, 7);
  testing::WriteFile(dir / "in/a_gzip.jsonl.zst", testing::GzipCompress(good));
  testing::WriteFile(dir / "in/b_random.jsonl.zst", std::string("\x48\x94\x90\x8e\x01\x02\x03\x04", 8));
  testing::WriteFile(dir / "in/c_plain.jsonl.xz", good);
  auto r = RunCmd(fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("2 of 3 files failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(dir / "in/b_random.jsonl.zst: named .zst but it is not compressed data (it starts with "
                                "bytes 48 94 90 8e"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(dir / "in/c_plain.jsonl.xz: named .xz but it is not compressed data"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("failed: " + dir / "in/b_random.jsonl.zst: " + dir / "in/b_random.jsonl.zst"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/a_gzip.jsonl"), good);
  EXPECT_FALSE(testing::Exists(dir / "out/b_random.jsonl"));
  EXPECT_FALSE(testing::Exists(dir / "out/c_plain.jsonl"));
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// pzstd starts its files with a zstd skippable frame (magic 0x184D2A50): zstd data all the same.
// Such a file was taken for plain text and copied compressed as the .jsonl, exit 0.
TEST(Extract, ZstdStartingWithASkippableFrameIsDecoded) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string text = Jsonl(20, 8);
  const std::string skippable("\x50\x2a\x4d\x18\x04\x00\x00\x00\x24\x00\x00\x00", 12);
  testing::WriteFile(dir / "in/p.jsonl.zst", skippable + testing::ZstdCompress(text));
  auto r = RunCmd(fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/p.jsonl"), text);
}

TEST(Extract, DropSetShardsAndDeleteInput) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string all;
  for (int i = 0; i < 6; ++i) {
    std::string d = Jsonl(500, 10 + i);
    testing::WriteFile(dir / fmt::format("in/f_{}.jsonl.zst", i), testing::ZstdCompress(d));
  }
  int extracted = 0;
  for (int s = 0; s < 2; ++s) {
    auto r = RunCmd(fmt::format(
        "{} --quiet {} --output-dir {} --shard-index {} --num-shards 2 --drop-set RedPajamaBook --delete-input",
        testing::Tool("ptk-extract"), dir / "in", dir / "out", s));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    size_t at = r.output.find(" extracted");
    ASSERT_NE(at, std::string::npos);
    extracted += std::stoi(r.output.substr(r.output.rfind(' ', at - 1) + 1));
  }
  EXPECT_EQ(extracted, 6);  // shard 1 still finds its files although shard 0 deleted its inputs
  for (int i = 0; i < 6; ++i) {
    std::string out = testing::ReadFile(dir / fmt::format("out/f_{}.jsonl", i));
    EXPECT_EQ(out.find("RedPajamaBook"), std::string::npos);
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 400);  // every 5th of 500 dropped
    EXPECT_FALSE(testing::Exists(dir / fmt::format("in/f_{}.jsonl.zst", i)));
  }
  // Regression: a rerun of the finished job found no inputs and exited 1.
  auto rerun = RunCmd(fmt::format("{} --quiet {} --output-dir {} --drop-set RedPajamaBook --delete-input",
                                  testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_EQ(rerun.exit_code, 0) << rerun.output;
  EXPECT_NE(rerun.output.find("6 outputs already extracted"), std::string::npos) << rerun.output;
  // --verify without the sources checks each output against the checksum in its sidecar.
  std::filesystem::create_directories(dir / "in2");
  testing::WriteFile(dir / "in2/v.jsonl.zst", testing::ZstdCompress(Jsonl(300, 5)));
  const std::string extract_v =
      fmt::format("{} --quiet {} --output-dir {} --verify", testing::Tool("ptk-extract"), dir / "in2", dir / "out2");
  ASSERT_EQ(RunCmd(extract_v).exit_code, 0);
  std::string damaged = testing::ReadFile(dir / "out2/v.jsonl");
  damaged[100] = damaged[100] == 'x' ? 'y' : 'x';  // same size: only the checksum can tell
  testing::WriteFile(dir / "out2/v.jsonl", damaged);
  auto v = RunCmd(extract_v);
  EXPECT_EQ(v.exit_code, 0) << v.output;  // found, reported, extracted again
  EXPECT_NE(v.output.find("content checksum differs"), std::string::npos) << v.output;
  EXPECT_EQ(testing::ReadFile(dir / "out2/v.jsonl"), Jsonl(300, 5));
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// Regression: --verify checked only outputs whose input was still there. After --delete-input (the
// sidecar's checksum the only check left) an output damaged in place passed, exit 0 ("nothing to do"),
// and so did one whose input was removed while others remained, and one deleted beside its sidecar.
TEST(Extract, VerifyChecksOutputsWhoseInputIsGone) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 4; ++i)
    testing::WriteFile(dir / fmt::format("in/f_{}.jsonl.zst", i), testing::ZstdCompress(Jsonl(200, 60 + i)));
  const std::string tool =
      fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out");
  ASSERT_EQ(RunCmd(tool + " --delete-input").exit_code, 0);
  ASSERT_EQ(RunCmd(tool + " --delete-input --verify").exit_code, 0);  // all whole
  std::string f0 = testing::ReadFile(dir / "out/f_0.jsonl");
  f0[10] = f0[10] == 'x' ? 'y' : 'x';  // same size: only the checksum can tell
  testing::WriteFile(dir / "out/f_0.jsonl", f0);
  auto none_left = RunCmd(tool + " --delete-input --verify");
  EXPECT_EQ(none_left.exit_code, 1) << none_left.output;
  EXPECT_NE(none_left.output.find("out/f_0.jsonl: content checksum differs"), std::string::npos) << none_left.output;
  EXPECT_NE(none_left.output.find("f_0.jsonl.zst is gone"), std::string::npos) << none_left.output;
  EXPECT_EQ(RunCmd(tool + " --delete-input").exit_code, 0);  // without --verify: the quick check, as before
  // Another input still there: the run extracts it and still checks the outputs of those gone.
  testing::WriteFile(dir / "in/f_9.jsonl.zst", testing::ZstdCompress(Jsonl(100, 69)));
  ::unlink((dir / "out/f_1.jsonl").c_str());
  auto some_left = RunCmd(tool + " --verify");
  EXPECT_EQ(some_left.exit_code, 1) << some_left.output;
  EXPECT_NE(some_left.output.find("out/f_0.jsonl: content checksum differs"), std::string::npos) << some_left.output;
  EXPECT_NE(some_left.output.find("out/f_1.jsonl: missing"), std::string::npos) << some_left.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/f_9.jsonl"), Jsonl(100, 69));
  // Array tasks: each output is checked by one task, the one that owned its input.
  int reports = 0;
  for (int s = 0; s < 2; ++s) {
    auto r = RunCmd(fmt::format("{} --verify --shard-index {} --num-shards 2", tool, s));
    reports += r.output.find("out/f_0.jsonl: content checksum differs") != std::string::npos;
  }
  EXPECT_EQ(reports, 1);
  testing::WriteFile(dir / "out/f_0.jsonl", Jsonl(200, 60));
  testing::WriteFile(dir / "out/f_1.jsonl", Jsonl(200, 61));
  auto whole = RunCmd(tool + " --verify");
  EXPECT_EQ(whole.exit_code, 0) << whole.output;
}

// Regression: "a rerun of a finished --delete-input job is a no-op" held for a directory only: with the
// inputs named as a glob (the manual's 'raw/train/chunk1/*.zst') or as files, the rerun failed, exit 1
// ('pattern matches no file', 'no such file'). An argument that names nothing now is done when an
// output's sidecar records an input it names; one that no output records is still an error.
TEST(Extract, ARerunOfADeleteInputJobNamingItsInputsIsANoOp) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 2; ++i)
    testing::WriteFile(dir / fmt::format("in/g_{}.jsonl.zst", i), testing::ZstdCompress(Jsonl(50, 80 + i)));
  const std::string glob = fmt::format("'{}'", dir / "in/g_*.jsonl.zst");
  const std::string files = dir / "in/g_0.jsonl.zst" + " " + dir / "in/g_1.jsonl.zst";
  for (const std::string& args :
       {glob + " --output-dir " + dir / "out", files + " --output-dir " + dir / "out2", files}) {
    const std::string cmd = fmt::format("{} --quiet {} --delete-input", testing::Tool("ptk-extract"), args);
    for (int i = 0; i < 2; ++i)
      testing::WriteFile(dir / fmt::format("in/g_{}.jsonl.zst", i), testing::ZstdCompress(Jsonl(50, 80 + i)));
    ASSERT_EQ(RunCmd(cmd).exit_code, 0) << args;
    ASSERT_FALSE(testing::Exists(dir / "in/g_0.jsonl.zst"));
    auto again = RunCmd(cmd);
    EXPECT_EQ(again.exit_code, 0) << args << ": " << again.output;
  }
  auto never = RunCmd(fmt::format("{} --quiet '{}' --output-dir {} --delete-input", testing::Tool("ptk-extract"),
                                  dir / "in/h_*.jsonl.zst", dir / "out"));
  EXPECT_EQ(never.exit_code, 1) << never.output;
  EXPECT_NE(never.output.find("pattern matches no file"), std::string::npos) << never.output;
}

// ptk-extract overwrote an a.jsonl it did not write (zstd -d refuses). Now such a file is a
// failed input naming it, --force overwrites it, and ptk-extract's own outputs are still redone or
// skipped: those with a sidecar, and one a kill left between its publish and its sidecar (its
// pending record says it is ptk-extract's).
TEST(Extract, NeverOverwritesAFileItDidNotWrite) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(200, 31);
  testing::WriteFile(dir / "in/a.jsonl.zst", testing::ZstdCompress(a));
  testing::WriteFile(dir / "in/a.jsonl", "someone's own notes\n");
  const std::string extract = fmt::format("{} --quiet {}", testing::Tool("ptk-extract"), dir / "in/a.jsonl.zst");
  auto r = RunCmd(extract);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir / "in/a.jsonl" + " already exists and was not written by ptk-extract"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--force"), std::string::npos) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "in/a.jsonl"), "someone's own notes\n");
  auto forced = RunCmd(extract + " --force");
  ASSERT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_TRUE(testing::ReadFile(dir / "in/a.jsonl") == a);
  // Its own output: a rerun skips it; damaged (with its sidecar), it is redone without --force.
  auto again = RunCmd(extract);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("0 extracted, 1 already complete"), std::string::npos) << again.output;
  testing::WriteFile(dir / "in/a.jsonl", "half");
  auto redo = RunCmd(extract);
  ASSERT_EQ(redo.exit_code, 0) << redo.output;
  EXPECT_TRUE(testing::ReadFile(dir / "in/a.jsonl") == a);
  // Killed after the output was published but before its sidecar: the pending record stands for it.
  std::filesystem::remove(dir / "in/a.jsonl.ptk-done");
  testing::WriteFile(dir / "in/a.jsonl.ptk-extracting", fmt::format("{{\"source\": \"{}\"}}", dir / "in/a.jsonl.zst"));
  auto after_kill = RunCmd(extract);
  ASSERT_EQ(after_kill.exit_code, 0) << after_kill.output;
  EXPECT_NE(after_kill.output.find("1 extracted"), std::string::npos) << after_kill.output;
  EXPECT_FALSE(testing::Exists(dir / "in/a.jsonl.ptk-extracting"));
  EXPECT_TRUE(testing::Exists(dir / "in/a.jsonl.ptk-done"));
  // Neither a sidecar nor a pending record: not its own.
  std::filesystem::remove(dir / "in/a.jsonl.ptk-done");
  EXPECT_EQ(RunCmd(extract).exit_code, 1);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// A plain input named with --output-dir its own directory is its own output (`f.jsonl --output-dir
// .`): done in place, whatever the flags. It was rewritten from itself under --force, and with
// --delete-input then deleted: the data gone, exit 0.
TEST(Extract, APlainInputThatIsItsOwnOutputIsLeftAlone) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(50, 7);
  testing::WriteFile(dir / "in/a.jsonl", a);
  for (const char* flags : {"", "--force", "--force --delete-input", "--delete-input", "--verify --delete-input"}) {
    SCOPED_TRACE(flags);
    auto r = RunCmd(
        fmt::format("cd {} && {} --quiet a.jsonl --output-dir . {}", dir / "in", testing::Tool("ptk-extract"), flags));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    ASSERT_TRUE(testing::Exists(dir / "in/a.jsonl"));
    EXPECT_TRUE(testing::ReadFile(dir / "in/a.jsonl") == a);
  }
  // Reached through a link in another directory: the same file.
  std::filesystem::create_symlink(dir / "in/a.jsonl", dir / "link.jsonl");
  auto r = RunCmd(fmt::format("{} --quiet {} --output-dir {} --force --delete-input", testing::Tool("ptk-extract"),
                              dir / "link.jsonl", dir / "in"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testing::Exists(dir / "in/a.jsonl") && testing::ReadFile(dir / "in/a.jsonl") == a);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// An input that is its own output and is not plain text, or whose records were to be dropped, was
// "already complete", exit 0: the zstd data stayed compressed under its .jsonl name, the
// RedPajamaBook records stayed in. Both fail naming the file and what to do; the file is untouched.
TEST(Extract, AnInputThatIsItsOwnOutputIsNotCalledCompleteWhenItIsNot) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(50, 91), z = testing::ZstdCompress(a);
  testing::WriteFile(dir / "in/z.jsonl", z);
  testing::WriteFile(dir / "in/p.jsonl", a);
  auto r = RunCmd(fmt::format("{} --quiet {}", testing::Tool("ptk-extract"), dir / "in/z.jsonl"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir / "in/z.jsonl holds zstd data under a plain name, and its output would be itself: "
                                "rename it z.jsonl.zst (or give another output directory)"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "in/z.jsonl") == z);
  r = RunCmd(fmt::format("cd {} && {} --quiet p.jsonl --output-dir . --drop-set RedPajamaBook", dir / "in",
                         testing::Tool("ptk-extract")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("p.jsonl is its own output: records cannot be dropped from it in place"), std::string::npos)
      << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "in/p.jsonl") == a);
  // Renamed as told, it is extracted.
  std::filesystem::rename(dir / "in/z.jsonl", dir / "in/z.jsonl.zst");
  r = RunCmd(fmt::format("{} --quiet {}", testing::Tool("ptk-extract"), dir / "in/z.jsonl.zst"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "in/z.jsonl") == a);
}

// A directory where the output goes: --force tried to rename over it, failed, and left the pending
// record that made the next run take the directory for ptk-extract's own output. Refused by name,
// with or without --force, the directory untouched and nothing left beside it.
TEST(Extract, AnOutputThatIsADirectoryIsRefusedEvenWithForce) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in/a.jsonl");
  testing::WriteFile(dir / "in/a.jsonl/notes.txt", "mine");
  testing::WriteFile(dir / "in/a.jsonl.zst", testing::ZstdCompress(Jsonl(10, 81)));
  for (const char* flags : {"", " --force", " --force --delete-input"}) {
    auto r = RunCmd(fmt::format("{} --quiet {}{}", testing::Tool("ptk-extract"), dir / "in/a.jsonl.zst", flags));
    EXPECT_EQ(r.exit_code, 1) << flags << ": " << r.output;
    EXPECT_NE(r.output.find(dir / "in/a.jsonl is a directory: the output of " + dir / "in/a.jsonl.zst" +
                            " cannot be written there"),
              std::string::npos)
        << flags << ": " << r.output;
  }
  EXPECT_EQ(testing::ReadFile(dir / "in/a.jsonl/notes.txt"), "mine");
  EXPECT_TRUE(testing::Exists(dir / "in/a.jsonl.zst"));
  for (const auto& e : std::filesystem::directory_iterator(dir / "in"))
    EXPECT_EQ(e.path().filename().string().find(".ptk-"), std::string::npos) << e.path();
}

// --drop-set kept the first of duplicate keys; Python's json (and ptk-tokenize) keep the
// last, at every level.
TEST(Extract, DropSetTakesTheLastOfDuplicateKeys) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string keep1 =
      R"({"meta": {"redpajama_set_name": "RedPajamaBook", "redpajama_set_name": "RedPajamaC4"}, "text": "keep"})"
      "\n";
  const std::string drop1 =
      R"({"meta": {"redpajama_set_name": "RedPajamaC4", "redpajama_set_name": "RedPajamaBook"}, "text": "drop"})"
      "\n";
  const std::string keep2 =
      R"({"meta": {"redpajama_set_name": "RedPajamaBook"}, "meta": {"redpajama_set_name": "RedPajamaC4"}, "text": "k"})"
      "\n";
  const std::string drop2 =
      R"({"meta": {"redpajama_set_name": "RedPajamaC4"}, "meta": {"redpajama_set_name": "RedPajamaBook"}, "text": "d"})"
      "\n";
  const std::string keep3 = R"({"meta": {"redpajama_set_name": "RedPajamaBook", "redpajama_set_name": 7}})"
                            "\n";
  testing::WriteFile(dir / "in/a.jsonl.zst", testing::ZstdCompress(keep1 + drop1 + keep2 + drop2 + keep3));
  auto r = RunCmd(fmt::format("{} --quiet {} --output-dir {} --drop-set RedPajamaBook", testing::Tool("ptk-extract"),
                              dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/a.jsonl"), keep1 + keep2 + keep3);
}

// A record Python's json.loads reads (NeMo drops RedPajamaBook with it) but strict JSON does not:
// invalid UTF-8, a lone surrogate escape, NaN. Of a dropped set, such records were kept, and their
// text tokenized (ptk-tokenize repairs them). An escaped backslash before "u" is text, not an escape.
TEST(Extract, DropSetReadsRecordsAsPythonDoes) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string book = R"("meta": {"redpajama_set_name": "RedPajamaBook"})",
                    c4 = R"("meta": {"redpajama_set_name": "RedPajamaC4"})";
  const std::string drop = "{\"text\": \"bad \xff\xfe utf-8\", " + book + "}\n" +
                           R"({"text": "lone \ud800 surrogate", )" + book + "}\n" +
                           R"({"text": "x", "score": NaN, "neg": -Infinity, )" + book + "}\n";
  const std::string keep = "{\"text\": \"bad \xff utf-8\", " + c4 + "}\n" +
                           R"({"text": "pair \ud83d\ude00 and \\ud800 text", )" + c4 + "}\n" + "not json " + book +
                           "\n";
  testing::WriteFile(dir / "in/a.jsonl.zst", testing::ZstdCompress(drop + keep));
  auto r = RunCmd(fmt::format("{} {} --output-dir {} --drop-set RedPajamaBook", testing::Tool("ptk-extract"),
                              dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("3 records dropped"), std::string::npos) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/a.jsonl"), keep);
}

// A --drop-set name no record carries (a typo: RedPajamaBooks) dropped nothing without a word, exit 0,
// and the books went into training. Now a warning per such set names it and the records read; a name
// that matched says nothing. (A shard may lack a set: a warning, not a failure.)
TEST(Extract, ADropSetThatMatchesNothingIsNamed) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string book = R"({"text": "b", "meta": {"redpajama_set_name": "RedPajamaBook"}})"
                           "\n",
                    c4 = R"({"text": "c", "meta": {"redpajama_set_name": "RedPajamaC4"}})"
                         "\n";
  testing::WriteFile(dir / "in/a.jsonl.zst", testing::ZstdCompress(book + c4 + book));
  const std::string extract =
      fmt::format("{} --quiet {} --output-dir {} --drop-set RedPajamaBooks --drop-set RedPajamaC4",
                  testing::Tool("ptk-extract"), dir / "in", dir / "out");
  auto r = RunCmd(extract);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/a.jsonl"), book + book);
  EXPECT_NE(r.output.find("ptk-extract: warning: --drop-set RedPajamaBooks: no record of this set among the 3 "
                          "records read (meta.redpajama_set_name must equal it exactly: a misspelt name drops "
                          "nothing)\n"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("--drop-set RedPajamaC4:"), std::string::npos) << r.output;
  // A rerun that reads nothing (every output complete) says nothing of the sets.
  auto again = RunCmd(extract);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.output.find("no record of this set"), std::string::npos) << again.output;
}

// Records as ptk-tokenize reads them (Python's universal newlines, a BOM before a file's first): a
// dropped set's record after a bare '\r' (old Mac line ends) or first in a file with a UTF-8 BOM was
// kept, its line being no JSON to the filter, and then tokenized, since ptk-tokenize reads both.
TEST(Extract, DropSetSplitsRecordsAsTokenizeDoes) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string book = R"({"text": "b", "meta": {"redpajama_set_name": "RedPajamaBook"}})",
                    c4 = R"({"text": "c", "meta": {"redpajama_set_name": "RedPajamaC4"}})";
  testing::WriteFile(dir / "in/cr.jsonl.zst", testing::ZstdCompress(c4 + "\r" + book + "\r" + c4 + "\r\n" + book));
  testing::WriteFile(dir / "in/bom.jsonl.zst", testing::ZstdCompress("\xEF\xBB\xBF" + book + "\n" + c4 + "\n"));
  testing::WriteFile(dir / "in/bomkept.jsonl.zst", testing::ZstdCompress("\xEF\xBB\xBF" + c4 + "\r" + book));
  auto r = RunCmd(fmt::format("{} {} --output-dir {} --drop-set RedPajamaBook", testing::Tool("ptk-extract"),
                              dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("4 records dropped"), std::string::npos) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/cr.jsonl"), c4 + "\r" + c4 + "\r\n");
  EXPECT_EQ(testing::ReadFile(dir / "out/bom.jsonl"), c4 + "\n");
  EXPECT_EQ(testing::ReadFile(dir / "out/bomkept.jsonl"), "\xEF\xBB\xBF" + c4 + "\r");
  // What is left tokenizes to the kept records only.
  auto t = RunCmd(fmt::format("{} --quiet --strict --input {} {} {} --output-prefix {} && {} {}",
                              testing::Tool("ptk-tokenize"), dir / "out/cr.jsonl", dir / "out/bom.jsonl",
                              dir / "out/bomkept.jsonl", dir / "tok", testing::Tool("ptk-inspect"),
                              dir / "tok_text_document"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("documents:   4\n"), std::string::npos) << t.output;
}

// A rerun naming the same inputs otherwise (raw/x.zst, ./raw/x.zst, an absolute path, or from another
// directory) is up to date: ptk-extract's sidecar recorded the name as given, and ptk-concat's chunk
// digest the paths as the plan spelled them, so each extracted or built everything again (as
// ptk-tokenize and ptk-merge did before they compared inputs by their absolute, normal names).
TEST(Extract, ARerunWithTheInputsSpelledOtherwiseIsUpToDate) {
  TempDir dir;
  std::filesystem::create_directories(dir / "raw");
  testing::WriteFile(dir / "raw/x.jsonl.zst", testing::ZstdCompress(Jsonl(50, 3)));
  const std::string extract = testing::Tool("ptk-extract"), concat = testing::Tool("ptk-concat");
  auto first = RunCmd(fmt::format("cd {} && {} raw/x.jsonl.zst --output-dir out", dir.path(), extract));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (const std::string& again :
       {fmt::format("cd {} && {} ./raw/x.jsonl.zst --output-dir out", dir.path(), extract),
        fmt::format("cd {} && {} {} --output-dir {}", dir / "raw", extract, dir / "raw", dir / "out"),
        fmt::format("cd {} && {} x.jsonl.zst --output-dir ../out", dir / "raw", extract)}) {
    auto r = RunCmd(again);
    ASSERT_EQ(r.exit_code, 0) << again << r.output;
    EXPECT_NE(r.output.find("0 extracted, 1 already complete"), std::string::npos) << again << r.output;
  }
  auto built = RunCmd(fmt::format("cd {} && {} --input out --output-dir ch --chunks 1", dir.path(), concat));
  ASSERT_EQ(built.exit_code, 0) << built.output;
  for (const std::string& again :
       {fmt::format("cd {} && {} --input ./out/ --output-dir ch --chunks 1", dir.path(), concat),
        fmt::format("cd {} && {} --input . --output-dir ../ch --chunks 1", dir / "out", concat)}) {
    auto r = RunCmd(again);
    ASSERT_EQ(r.exit_code, 0) << again << r.output;
    EXPECT_NE(r.output.find("0 chunks built, 1 already complete"), std::string::npos) << again << r.output;
  }
}

TEST(Extract, KillNineThenRerunGivesIdenticalOutputs) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::vector<std::string> want;
  for (int i = 0; i < 8; ++i) {
    want.push_back(Jsonl(40000, 100 + i));
    testing::WriteFile(dir / fmt::format("in/g_{}.jsonl.xz", i), testing::XzCompress(want.back(), 0));
  }
  const std::string cmd =
      fmt::format("{} --quiet {} --output-dir {} --jobs 1", testing::Tool("ptk-extract"), dir / "in", dir / "out");
  ASSERT_EQ(RunCmd(cmd + " >/dev/null 2>&1 & echo $! > " + dir / "pid").exit_code, 0);
  // Killed once the second output is published (however long a loaded machine takes: up to 60 s),
  // and gone before the rerun starts.
  const pid_t pid = std::stoi(testing::ReadFile(dir / "pid"));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!testing::Exists(dir / "out/g_1.jsonl") && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(pid, SIGKILL);
  auto running = [pid] {  // not yet dead (a zombie that nobody reaps has stopped running)
    const std::string stat = testing::Exists("/proc/" + std::to_string(pid) + "/stat")
                                 ? testing::ReadFile("/proc/" + std::to_string(pid) + "/stat")
                                 : "";
    const size_t paren = stat.rfind(')');
    return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
  };
  while (running() && std::chrono::steady_clock::now() < until + std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto r = RunCmd(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(testing::ReadFile(dir / fmt::format("out/g_{}.jsonl", i)), want[i]) << i;
  EXPECT_EQ(r.output.find(" 0 already complete"), std::string::npos)
      << "nothing was kept from the killed run: " << r.output;
}

// Regression: a .gz padded with zero bytes after its last member (as tape and block writers leave
// it; gzip -d accepts it silently) failed, and garbage after an xz stream was called truncated data.
// Padding is read as gzip and xz read it; garbage fails alone, naming the file and its offset.
TEST(Extract, TrailingZerosAreReadAsTheToolsReadThemAndGarbageIsNamed) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(400, 41), b = Jsonl(300, 42);
  const std::string ga = testing::GzipCompress(a), xa = testing::XzCompress(a), za = testing::ZstdCompress(a);
  testing::WriteFile(dir / "in/a_padded.jsonl.gz", ga + testing::GzipCompress(b) + std::string(10240, '\0'));
  testing::WriteFile(dir / "in/b_padded.jsonl.xz",
                     xa + std::string(8, '\0') + testing::XzCompress(b) + std::string(4, '\0'));
  testing::WriteFile(dir / "in/c_garbage.jsonl.gz", ga + std::string(3, '\0') + "garbage!");
  testing::WriteFile(dir / "in/d_garbage.jsonl.xz", xa + "garbage!");
  testing::WriteFile(dir / "in/e_zeros.jsonl.zst", za + std::string(8, '\0'));
  auto r = RunCmd(fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("2 extracted, 0 already complete, 3 failed"), std::string::npos) << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "out/a_padded.jsonl") == a + b);
  EXPECT_TRUE(testing::ReadFile(dir / "out/b_padded.jsonl") == a + b);
  for (const std::string& m :
       {fmt::format("c_garbage.jsonl.gz: trailing garbage at byte {}, after the last complete gzip member",
                    ga.size() + 3),
        fmt::format("d_garbage.jsonl.xz: trailing garbage at byte {}, after the last complete xz stream", xa.size()),
        fmt::format("e_zeros.jsonl.zst: trailing garbage at byte {}, after the last complete zstd frame", za.size())})
    EXPECT_NE(r.output.find("failed: " + dir / "in/" + m + "\n"), std::string::npos) << m << "\n" << r.output;
  EXPECT_EQ(r.output.find("truncated"), std::string::npos) << r.output;
  for (const char* bad : {"c_garbage.jsonl", "d_garbage.jsonl", "e_zeros.jsonl"})
    EXPECT_FALSE(testing::Exists(dir / "out/" + bad)) << bad;
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// Interrupted (Ctrl-C, a scheduler's SIGTERM at its time limit), ptk-extract and ptk-concat left
// their partial output (OUT.ptk-tmp-*, as large as what was written so far) until a rerun; gzip
// and zstd remove theirs. Now each removes its temporaries and its lock files (OUT.ptk-lock, naming
// the dead run as the writer) and dies of the signal. Each run is
// stopped (SIGSTOP) while a temporary exists, signalled, then continued, so the signal always
// lands mid-write.
TEST(Extract, AnInterruptedRunRemovesItsPartialOutput) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string text;
  for (int i = 0; i < 2; ++i) text += Jsonl(200000, 500 + i);  // about 18 MB
  testing::WriteFile(dir / "in/big.jsonl.xz", testing::XzCompress(text, 0));
  auto count = [&](const std::string& out, const char* tag) {
    int n = 0;
    if (testing::Exists(out))
      for (const auto& e : std::filesystem::directory_iterator(out))
        n += e.path().filename().string().find(tag) != std::string::npos;
    return n;
  };
  auto temporaries = [&](const std::string& out) { return count(out, ".ptk-tmp"); };
  const std::pair<std::string, std::string> tools[] = {
      {fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "x"), dir / "x"},
      {fmt::format("{} --quiet --input {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"), dir / "in",
                   dir / "c"),
       dir / "c"},
  };
  // The runs must not inherit an ignored SIGINT (a background job's), which they keep ignoring.
  struct sigaction dfl {
  }, saved{};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, &saved);
  for (const auto& [cmd, out] : tools)
    for (int sig : {SIGINT, SIGTERM}) {
      SCOPED_TRACE(cmd + " " + strsignal(sig));
      bool landed = false;
      for (int attempt = 0; attempt < 10 && !landed; ++attempt) {
        std::filesystem::remove_all(out);
        const pid_t pid = testing::SpawnShell(cmd, dir / "log");
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (temporaries(out) == 0 && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        ::kill(pid, SIGSTOP);
        if (temporaries(out) == 0) {  // finished first (a fast machine): again
          ::kill(pid, SIGCONT);
          testing::WaitExit(pid);
          continue;
        }
        ::kill(pid, sig);
        ::kill(pid, SIGCONT);
        const int rc = testing::WaitExit(pid);
        if (rc == 0) continue;  // the temporary was the plan's or the last one, committed meanwhile
        landed = true;
        EXPECT_EQ(rc, 128 + sig) << testing::ReadFile(dir / "log");
        EXPECT_EQ(temporaries(out), 0) << testing::ReadFile(dir / "log");
        // Nor a lock file naming the dead run as the output's writer (OUT.ptk-lock was left).
        EXPECT_EQ(count(out, ".ptk-lock"), 0) << testing::ReadFile(dir / "log");
      }
      EXPECT_TRUE(landed) << "the run always finished before it could be interrupted";
    }
  // An ignored SIGINT stays ignored: the run completes.
  ::signal(SIGINT, SIG_IGN);
  std::filesystem::remove_all(dir / "x");
  const pid_t pid = testing::SpawnShell(tools[0].first, dir / "log");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (temporaries(dir / "x") == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  ::kill(pid, SIGINT);
  EXPECT_EQ(testing::WaitExit(pid), 0) << testing::ReadFile(dir / "log");
  EXPECT_TRUE(testing::ReadFile(dir / "x/big.jsonl") == text);
  ::sigaction(SIGINT, &saved, nullptr);
}

// ---------------------------------------------------------------- concat

TEST(ConcatPlan, BalancedChunksKeepOrderAndCoverEverything) {
  std::mt19937 rng(9);
  std::vector<ConcatInput> in;
  uint64_t total = 0;
  for (int i = 0; i < 1000; ++i) {
    uint64_t sz = 10000 + rng() % 30000;
    in.push_back({fmt::format("f{}", i), sz});
    total += sz;
  }
  auto plan = MakeConcatPlan(in, "out", {});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->chunks.size(), 72u);
  EXPECT_EQ(plan->chunks[0].name, "train_00.jsonl");
  EXPECT_EQ(plan->chunks[71].name, "train_71.jsonl");
  size_t next = 0;
  uint64_t mx = 0, mn = UINT64_MAX;
  for (const auto& c : plan->chunks) {
    for (const auto& f : c.inputs) EXPECT_EQ(f.path, in[next++].path);
    mx = std::max(mx, c.bytes);
    mn = std::min(mn, c.bytes);
  }
  EXPECT_EQ(next, in.size());
  // Within one file of the ideal share (40 KB files, ~278 KB per chunk).
  EXPECT_LE(mx, total / 72 + 40000);
  EXPECT_GE(mn, total / 72 - 40000);
  // Fewer inputs than chunks: one chunk each. Skewed sizes: no empty chunk.
  auto few = MakeConcatPlan({{"a", 5}, {"b", 1000000}, {"c", 5}}, "out", {});
  ASSERT_EQ(few->chunks.size(), 3u);
  ConcatPlanOptions three;
  three.chunks = 3;
  auto skew = MakeConcatPlan({{"a", 1000000}, {"b", 1}, {"c", 1}, {"d", 1}}, "out", three);
  ASSERT_EQ(skew->chunks.size(), 3u);
  for (const auto& c : skew->chunks) EXPECT_FALSE(c.inputs.empty());
}

// NeMo's concat.sh over SlimPajama's 59,166 extracted train files: bash's glob in the C locale,
// 800 files per chunk -> 74 chunks (shared/reference/seed-pipelines.md §2.5).
// Bad flags are usage errors where they are found; no inputs is not a usage error (MakeConcatPlan's
// caller no longer turns every kInvalidArgument into one).
TEST(ConcatPlan, OnlyBadFlagsAreUsageErrors) {
  auto opt = [](int64_t chunks, std::string pattern) {
    ConcatPlanOptions o;
    o.chunks = chunks;
    o.name_pattern = std::move(pattern);
    return o;
  };
  EXPECT_TRUE(IsUsageError(MakeConcatPlan({{"a", 1}}, "out", opt(0, "")).status()));
  EXPECT_TRUE(IsUsageError(MakeConcatPlan({{"a", 1}}, "out", opt(1, "a/{}")).status()));
  EXPECT_TRUE(IsUsageError(MakeConcatPlan({{"a", 1}, {"b", 1}}, "out", opt(2, "x")).status()));
  const absl::Status none = MakeConcatPlan({}, "out", {}).status();
  EXPECT_FALSE(none.ok());
  EXPECT_FALSE(IsUsageError(none)) << none;
}

TEST(ConcatPlan, ReproducesNemoGroupingOfSlimPajama) {
  const int last[10] = {5911, 5910, 5918, 5916, 5932, 5914, 5905, 5920, 5919, 5911};
  std::vector<std::string> names;
  for (int c = 1; c <= 10; ++c)
    for (int s = 0; s <= last[c - 1]; ++s) names.push_back(fmt::format("/d/example_train_chunk{}_shard{}.jsonl", c, s));
  ASSERT_EQ(names.size(), 59166u);
  SortPaths(&names, PathOrder::kBytes);
  std::vector<ConcatInput> in;
  for (const auto& n : names) in.push_back({n, 1});
  auto plan = MakeConcatPlan(in, "/d", {.files_per_chunk = 800, .name_pattern = "train_chunk_{}.jsonl"});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->chunks.size(), 74u);
  EXPECT_EQ(plan->chunks[73].name, "train_chunk_73.jsonl");
  EXPECT_EQ(plan->chunks[73].inputs.size(), 766u);
  EXPECT_EQ(plan->chunks[0].inputs.front().path, "/d/example_train_chunk10_shard0.jsonl");
  EXPECT_EQ(plan->chunks[0].inputs.back().path, "/d/example_train_chunk10_shard1717.jsonl");
  EXPECT_EQ(plan->chunks[6].inputs.front().path, "/d/example_train_chunk10_shard5318.jsonl");
  EXPECT_EQ(plan->chunks[6].inputs.back().path, "/d/example_train_chunk10_shard717.jsonl");
  EXPECT_EQ(plan->chunks[73].inputs.front().path, "/d/example_train_chunk9_shard5637.jsonl");
  EXPECT_EQ(plan->chunks[73].inputs.back().path, "/d/example_train_chunk9_shard999.jsonl");
  auto count = [&](int k, const std::string& chunk) {
    int n = 0;
    for (const auto& f : plan->chunks[k].inputs) n += f.path.find("_" + chunk + "_") != std::string::npos;
    return n;
  };
  // Chunks that straddle two sources.
  EXPECT_EQ(count(7, "chunk10"), 312);
  EXPECT_EQ(count(7, "chunk1"), 488);
  EXPECT_EQ(count(14, "chunk1"), 624);
  EXPECT_EQ(count(14, "chunk2"), 176);
  EXPECT_EQ(count(66, "chunk8"), 446);
  EXPECT_EQ(count(66, "chunk9"), 354);
}

TEST(Concat, ChunksAreExactNewlineSafeAndResumable) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string expect_all;
  for (int i = 0; i < 10; ++i) {
    std::string d = Jsonl(200 + i, 50 + i);
    if (i == 3 || i == 7) d.pop_back();  // no final newline
    if (i == 5)
      testing::WriteFile(dir / fmt::format("in/part{}.jsonl.zst", i), testing::ZstdCompress(d));
    else
      testing::WriteFile(dir / fmt::format("in/part{}.jsonl", i), d);
    expect_all += d;
    if (d.back() != '\n') expect_all += '\n';
  }
  testing::WriteFile(dir / "in/part10.jsonl", "");
  auto r = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 3", testing::Tool("ptk-concat"),
                              dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 inputs lacked a final newline"), std::string::npos) << r.output;
  std::string joined;
  for (int k = 0; k < 3; ++k) joined += testing::ReadFile(dir / fmt::format("out/train_{:02d}.jsonl", k));
  EXPECT_EQ(joined, expect_all);  // natural order: part2 before part10, no record merged
  auto again = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 3", testing::Tool("ptk-concat"),
                                  dir / "in", dir / "out"));
  EXPECT_NE(again.output.find("0 chunks built, 3 already complete"), std::string::npos) << again.output;
  // --no-fsync: the same bytes (only the durability differs), and a later durable run keeps them.
  auto fast = RunCmd(fmt::format("{} --quiet --no-fsync --input {} --output-dir {} --chunks 3",
                                 testing::Tool("ptk-concat"), dir / "in", dir / "out2"));
  ASSERT_EQ(fast.exit_code, 0) << fast.output;
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(testing::ReadFile(dir / fmt::format("out2/train_{:02d}.jsonl", k)),
              testing::ReadFile(dir / fmt::format("out/train_{:02d}.jsonl", k)));
  auto durable = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 3", testing::Tool("ptk-concat"),
                                    dir / "in", dir / "out2"));
  EXPECT_NE(durable.output.find("0 chunks built, 3 already complete"), std::string::npos) << durable.output;
}

// A UTF-8 BOM at an input's start (Windows tools write one), plain or compressed, in any chunk place:
// ptk-tokenize drops one that starts a file, but concatenated after another input it began a record,
// which ptk-tokenize skipped as malformed (1 of 2 records lost, over --max-bad-fraction). The chunk
// holds no BOM, and tokenizes to the documents the inputs do.
TEST(Concat, AUtf8BomStartingAnInputIsNotCopiedIntoTheChunk) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string bom = "\xEF\xBB\xBF";
  testing::WriteFile(dir / "in/a.jsonl", bom + "{\"text\": \"a\"}\n");
  testing::WriteFile(dir / "in/b.jsonl", bom + "{\"text\": \"b\"}");
  testing::WriteFile(dir / "in/c.jsonl.zst", testing::ZstdCompress(bom + "{\"text\": \"c\"}\n"));
  testing::WriteFile(dir / "in/d.jsonl", bom);
  testing::WriteFile(dir / "in/e.jsonl", "\xEF\xBB{\"text\": \"e\"}\n");  // not a BOM: copied as it is
  auto r = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"),
                              dir / "in", dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "out/train_00.jsonl"),
            "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \"c\"}\n\xEF\xBB{\"text\": \"e\"}\n");
  testing::WriteFile(dir / "in/e.jsonl", "{\"text\": \"e\"}\n");
  r = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"), dir / "in",
                         dir / "out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto t = RunCmd(fmt::format("{} --quiet --strict --input {} --output-prefix {}", testing::Tool("ptk-tokenize"),
                              dir / "out/train_00.jsonl", dir / "tok"));
  EXPECT_EQ(t.exit_code, 0) << t.output;
}

// Regression: empty inputs only made empty chunks (exit 0), which ptk-tokenize then refused ("no
// document in it (empty file)"); an empty input could make one beside others too (a chunk holds one
// file at least, and it could be an empty one). No chunk is empty now: inputs that are all empty are an
// error naming them, nothing written; empty inputs go with non-empty neighbours; NeMo's
// --files-per-chunk grouping is kept, so a group of empty files only is refused; inputs that hold
// nothing once decompressed (or a BOM only) fail their chunk, nothing published.
TEST(Concat, NoChunkIsAnEmptyFile) {
  TempDir dir;
  const std::string concat = testing::Tool("ptk-concat") + " --quiet";
  std::filesystem::create_directories(dir / "empty");
  testing::WriteFile(dir / "empty/a.jsonl", "");
  testing::WriteFile(dir / "empty/b.jsonl", "");
  auto none = RunCmd(fmt::format("{} --input {} --output-dir {}", concat, dir / "empty", dir / "out0"));
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_NE(none.output.find(fmt::format("no data to concatenate: the 2 inputs {} and {} are all empty (0 bytes), and "
                                         "ptk-tokenize refuses an empty chunk",
                                         dir / "empty/a.jsonl", dir / "empty/b.jsonl")),
            std::string::npos)
      << none.output;
  EXPECT_FALSE(testing::Exists(dir / "out0"));

  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(20, 1), b = Jsonl(20, 2), c = Jsonl(20, 3);
  const std::vector<std::pair<std::string, std::string>> files = {{"f1.jsonl", a},  {"f2.jsonl", b}, {"f3.jsonl", ""},
                                                                  {"f4.jsonl", ""}, {"f5.jsonl", c}, {"f6.jsonl", ""}};
  for (const auto& [name, data] : files) testing::WriteFile(dir / ("in/" + name), data);
  for (const int chunks : {3, 4, 72}) {
    const std::string out = dir / fmt::format("out{}", chunks);
    auto r = RunCmd(
        fmt::format("{} --input {} --output-dir {} --chunks {}", testing::Tool("ptk-concat"), dir / "in", out, chunks));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("plan: 6 files -> 3 chunks in {}{}", out,
                                        chunks == 3 ? ";"
                                                    : fmt::format(" (not --chunks {}: a chunk holds one "
                                                                  "non-empty file at least)",
                                                                  chunks))),
              std::string::npos)
        << r.output;
    std::string all;
    for (int k = 0; k < 3; ++k) {
      const std::string chunk = testing::ReadFile(out + fmt::format("/train_{:02d}.jsonl", k));
      EXPECT_FALSE(chunk.empty()) << chunks << " " << k;
      all += chunk;
    }
    EXPECT_EQ(all, a + b + c);
    EXPECT_FALSE(testing::Exists(out + "/train_03.jsonl"));
  }
  auto grouped =
      RunCmd(fmt::format("{} --input {} --output-dir {} --files-per-chunk 2", concat, dir / "in", dir / "g"));
  EXPECT_EQ(grouped.exit_code, 1) << grouped.output;
  EXPECT_NE(grouped.output.find(fmt::format("chunk 1 (train_01.jsonl) would be an empty file, which ptk-tokenize "
                                            "refuses: the 2 inputs {} and {} are all empty (0 bytes)",
                                            dir / "in/f3.jsonl", dir / "in/f4.jsonl")),
            std::string::npos)
      << grouped.output;
  EXPECT_FALSE(testing::Exists(dir / "g/concat-plan.json"));

  std::filesystem::create_directories(dir / "hollow");
  testing::WriteFile(dir / "hollow/z.jsonl.zst", testing::ZstdCompress(""));
  testing::WriteFile(dir / "hollow/bom.jsonl", "\xEF\xBB\xBF");
  auto hollow = RunCmd(fmt::format("{} --input {} --output-dir {}", concat, dir / "hollow", dir / "h"));
  EXPECT_EQ(hollow.exit_code, 1) << hollow.output;
  // Regression: the message read "{} is empty once decompressed (or hold only a UTF-8 BOM)", a plain
  // file holding a BOM called empty once decompressed, and the verb not agreeing with one input.
  for (const auto& [k, name] : {std::pair{0, "bom.jsonl"}, std::pair{1, "z.jsonl.zst"}})
    EXPECT_NE(hollow.output.find(fmt::format("{}: chunk {} would be an empty file, which ptk-tokenize refuses: {} is "
                                             "empty once read (decompressed, a UTF-8 BOM that starts it dropped); "
                                             "nothing written",
                                             dir / fmt::format("h/train_{:02d}.jsonl", k), k,
                                             dir / (std::string("hollow/") + name))),
              std::string::npos)
        << hollow.output;
  EXPECT_FALSE(testing::Exists(dir / "h/train_00.jsonl"));
  EXPECT_FALSE(testing::Exists(dir / "h/train_01.jsonl"));
}

// An input that changed after its chunk was built: the rerun said "already complete", exit 0, and kept
// the chunk built from the old bytes, while a chunk not yet built refused the same change. Both refuse
// now, naming the input and both sizes; an input removed after its chunk was built changes nothing.
TEST(Concat, AnInputChangedAfterItsChunkWasBuiltIsRefusedNotSkipped) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(30, 1), b = Jsonl(30, 2);
  testing::WriteFile(dir / "in/a.jsonl", a);
  testing::WriteFile(dir / "in/b.jsonl", b);
  const std::string concat = testing::Tool("ptk-concat");
  ASSERT_EQ(
      RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 2", concat, dir / "in", dir / "c")).exit_code, 0);
  const std::string run = fmt::format("{} run --quiet --plan {}", concat, dir / "c/concat-plan.json");
  auto first = RunCmd(run);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  testing::WriteFile(dir / "in/a.jsonl", a + Jsonl(1, 9));
  const size_t grown = a.size() + Jsonl(1, 9).size();
  auto again = RunCmd(run);
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find(fmt::format("{}: is {} bytes but the plan recorded {}, and chunk 0 (train_00.jsonl) "
                                          "was built from those {}; the inputs changed since the plan was made",
                                          dir / "in/a.jsonl", grown, a.size(), a.size())),
            std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("0 chunks built, 1 already complete, 1 failed"), std::string::npos) << again.output;
  EXPECT_EQ(testing::ReadFile(dir / "c/train_00.jsonl"), a);
  // Put back as it was: complete again. Removed after its chunk was built: still complete.
  testing::WriteFile(dir / "in/a.jsonl", a);
  std::filesystem::remove(dir / "in/b.jsonl");
  auto back = RunCmd(run);
  EXPECT_EQ(back.exit_code, 0) << back.output;
  EXPECT_NE(back.output.find("0 chunks built, 2 already complete"), std::string::npos) << back.output;
}

// A plan made with relative paths (`cd data && ptk-concat plan --input in --output-dir out`) and run
// by a task started in another directory reads the plan's files and writes its chunks where the
// plan says. It read `in/...` and wrote `out/...` below the task's directory: an error, or, where a
// file of the same name and size was there, a chunk of other data, exit 0.
// The tool's flags belong to its one-process form: before a subcommand they were ignored, exit 0
// (`--no-fsync run` fsynced, `--jobs 8 run` built one chunk at a time).
TEST(Concat, TheToolsFlagsBeforeASubcommandAreUsageErrors) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  testing::WriteFile(dir / "in/a.jsonl", Jsonl(10, 1));
  const std::string concat = testing::Tool("ptk-concat");
  ASSERT_EQ(
      RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 1", concat, dir / "in", dir / "c")).exit_code, 0);
  const std::string plan = dir / "c/concat-plan.json";
  const std::pair<std::string, std::string> cases[] = {
      {"--no-fsync run --plan " + plan,
       "--no-fsync before `run` is the one-process form's flag, which `run` ignores: give it after `run`"},
      {"--jobs 2 run --plan " + plan, "--jobs before `run`"},
      {"--input " + dir / "in" + " run --plan " + plan, "--input does not go with `run` (it reads the plan)"},
      {"--quiet list --plan " + plan, "--quiet does not go with `list`"},
      {"--plan " + plan + " list --plan " + plan, "--plan before `list`"},
      // Said before the subcommand's own required flags: "--output-dir is required", given before `plan`.
      {"--output-dir " + dir / "c" + " plan --input " + dir / "in", "--output-dir before `plan`"},
      // A misspelt subcommand was read as an input file: "pln: no such file".
      {"pln --input " + dir / "in" + " --output-dir " + dir / "c",
       "pln: no such file or subcommand; did you mean the subcommand `plan`?"},
      // A flag of another command was called a word "given without a flag": "--chunk-index was given
      // without a flag", "--input x were given without a flag".
      {"--chunk-index 0 --input " + dir / "in",
       "--chunk-index is not a flag of `ptk-concat`, but of `ptk-concat run`: give it after `run`"},
      {"run --input " + dir / "in" + " --plan " + plan,
       "--input is not a flag of `ptk-concat run`, but of `ptk-concat` without a subcommand and `ptk-concat plan`"},
      {"list --plan " + plan + " --chunk-index 0",
       "--chunk-index is not a flag of `ptk-concat list`, but of `ptk-concat run`: give it after `run`"},
      // The nearest subcommand, not the first within two edits (`pun` was taken for `plan`).
      {"pun --plan " + plan, "pun: no such file or subcommand; did you mean the subcommand `run`?"},
  };
  for (const auto& [args, message] : cases) {
    auto r = RunCmd(concat + " " + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("usage error: " + message), std::string::npos) << args << "\n" << r.output;
  }
  EXPECT_FALSE(testing::Exists(dir / "c/train_00.jsonl"));
  // An empty --output-dir wrote concat-plan.json into the current directory, then failed (exit 1).
  testing::TempDir here;
  for (const char* mode : {"plan ", ""}) {
    auto empty = RunCmd("cd " + here.path() + " && " + concat + " " + mode + "--input " + dir / "in" +
                        " --output-dir '' --chunks 1");
    EXPECT_EQ(empty.exit_code, 2) << mode << "\n" << empty.output;
    EXPECT_NE(
        empty.output.find(*mode ? "usage error: --output-dir is empty" : "usage error: give --input and --output-dir"),
        std::string::npos)
        << empty.output;
    EXPECT_TRUE(std::filesystem::is_empty(here.path())) << mode;
  }
  auto ok = RunCmd(concat + " run --plan " + plan + " --no-fsync --jobs 2 --quiet");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(testing::Exists(dir / "c/train_00.jsonl"));
}

TEST(Concat, APlanMeansTheSameFilesFromAnyDirectory) {
  TempDir dir;
  std::filesystem::create_directories(dir / "data/in");
  std::filesystem::create_directories(dir / "elsewhere/in");
  const std::string a = Jsonl(40, 3), decoy = std::string(a.size() - 1, 'x') + "\n";  // same size, other bytes
  testing::WriteFile(dir / "data/in/a.jsonl", a);
  testing::WriteFile(dir / "elsewhere/in/a.jsonl", decoy);
  const std::string concat = testing::Tool("ptk-concat");
  auto plan = RunCmd(fmt::format("cd {} && {} plan --input in --output-dir out --chunks 1", dir / "data", concat));
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const std::string plan_file = dir / "data/out/concat-plan.json";
  auto run = RunCmd(fmt::format("cd {} && {} run --quiet --plan {}", dir / "elsewhere", concat, plan_file));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(testing::ReadFile(dir / "data/out/train_00.jsonl") == a);
  EXPECT_FALSE(testing::Exists(dir / "elsewhere/out"));
  auto list = RunCmd(fmt::format("cd {} && {} list --plan {}", dir / "elsewhere", concat, plan_file));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  EXPECT_EQ(list.output, dir / "data/out/train_00.jsonl" + "\n");
  // Where it was made, the same chunk: complete, not built again.
  auto again = RunCmd(fmt::format("cd {} && {} run --plan out/concat-plan.json", dir / "data", concat));
  EXPECT_NE(again.output.find("0 chunks built, 1 already complete"), std::string::npos) << again.output;
}

TEST(Concat, PlanThenOneArrayTaskPerChunk) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 12; ++i) testing::WriteFile(dir / fmt::format("in/s{}.jsonl", i), Jsonl(100, 200 + i));
  auto plan = RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 4", testing::Tool("ptk-concat"),
                                 dir / "in", dir / "out"));
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  ASSERT_TRUE(testing::Exists(dir / "out/concat-plan.json"));
  EXPECT_NE(plan.output.find("plan: 12 files -> 4 chunks in "), std::string::npos) << plan.output;
  EXPECT_EQ(plan.output.find("not --chunks"), std::string::npos) << plan.output;
  // More chunks asked than there are files (the default 72 over a small set): one file a chunk, and the
  // plan line says so (`run --chunk-index` past the last chunk is a usage error; array tasks past it build nothing).
  auto few = RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 72", testing::Tool("ptk-concat"),
                                dir / "in", dir / "few"));
  ASSERT_EQ(few.exit_code, 0) << few.output;
  EXPECT_NE(few.output.find("plan: 12 files -> 12 chunks in " + (dir / "few") +
                            " (not --chunks 72: a chunk holds one non-empty file at least)"),
            std::string::npos)
      << few.output;
  for (int k = 3; k >= 0; --k) {  // any order, as array tasks run
    auto r = RunCmd(fmt::format("SLURM_ARRAY_TASK_ID={} SLURM_ARRAY_TASK_COUNT=4 {} run --quiet --plan {}", k,
                                testing::Tool("ptk-concat"), dir / "out/concat-plan.json"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("1 chunks built"), std::string::npos) << r.output;
  }
  // Regression: a chunk the plan does not have was exit 1 in three lines (the error, "0 chunks built, ... 1
  // failed", "1 of 1 chunks failed"); it is the flag's usage error, one line naming the plan's range.
  auto past = RunCmd(fmt::format("{} run --quiet --plan {} --chunk-index 4", testing::Tool("ptk-concat"),
                                 dir / "out/concat-plan.json"));
  EXPECT_EQ(past.exit_code, 2) << past.output;
  EXPECT_NE(past.output.find("usage error: --chunk-index 4: the plan " + (dir / "out/concat-plan.json") +
                             " has 4 chunk(s), 0 to 3 (ptk-concat list --plan "),
            std::string::npos)
      << past.output;
  EXPECT_EQ(past.output.find("chunks built"), std::string::npos) << past.output;
  std::string joined, want;
  for (int k = 0; k < 4; ++k) joined += testing::ReadFile(dir / fmt::format("out/train_{:02d}.jsonl", k));
  for (int i = 0; i < 12; ++i) want += Jsonl(100, 200 + i);
  EXPECT_EQ(joined, want);
  // A changed input is refused rather than silently mixed in.
  testing::WriteFile(dir / "in/s0.jsonl", "{}\n");
  ::unlink((dir / "out/train_00.jsonl").c_str());
  auto stale = RunCmd(fmt::format("{} run --quiet --plan {} --chunk-index 0", testing::Tool("ptk-concat"),
                                  dir / "out/concat-plan.json"));
  EXPECT_EQ(stale.exit_code, 1);
  EXPECT_NE(stale.output.find("changed since the plan"), std::string::npos) << stale.output;
  auto usage = RunCmd(fmt::format("{} --input {} --output-dir {} --name-pattern 'bad_{{:q}}'",
                                  testing::Tool("ptk-concat"), dir / "in", dir / "o2"));
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
  // Regression: one name for every chunk wrote them all to one file and said success.
  auto same = RunCmd(fmt::format("{} --input {} --output-dir {} --chunks 3 --name-pattern same.jsonl",
                                 testing::Tool("ptk-concat"), dir / "in", dir / "o3"));
  EXPECT_EQ(same.exit_code, 2) << same.output;
  EXPECT_NE(same.output.find("the same name"), std::string::npos) << same.output;
  // ... and a width of a billion asked for gigabytes.
  auto wide = RunCmd(fmt::format("{} --input {} --output-dir {} --name-pattern '{{:>1000000000}}'",
                                 testing::Tool("ptk-concat"), dir / "in", dir / "o4"));
  EXPECT_EQ(wide.exit_code, 2) << wide.output;
  // Regression: chunk names that no later stage reads were built, exit 0: a compression suffix on the plain
  // text a chunk holds (ptk-tokenize then refused every chunk: 'named .zst but it is not compressed data'),
  // and ptk's own bookkeeping names or a hidden name (every directory walk leaves those out without a word).
  for (const char* bad : {"c_{}.jsonl.zst", "c_{}.jsonl.gz", "c_{}.xz", "c_{}.zstd", "c_{}.jsonl.ptk-done",
                          ".ptk-tmp-{}", "c{}.ptk-lock", ".c_{}.jsonl"}) {
    auto r = RunCmd(fmt::format("{} --input {} --output-dir {} --chunks 2 --name-pattern '{}'",
                                testing::Tool("ptk-concat"), dir / "in", dir / "o5", bad));
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("--name-pattern"), std::string::npos) << bad << ": " << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir / "o5/c_0.jsonl.zst")) << bad;
  }
  auto fine = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 2 --name-pattern 'c_{{}}.ptk-v2.json'",
                                 testing::Tool("ptk-concat"), dir / "in", dir / "o6"));
  EXPECT_EQ(fine.exit_code, 0) << fine.output;
}

// Regression: a plan over a directory that holds another plan's output (in/c2, made from in/) took
// that plan's chunks and its concat-plan.json as inputs: every record twice, the plan's JSON as
// records, exit 0. They are left out, named; a plan over the chunks themselves (in/c2: fewer, larger
// chunks) still takes them, but not the plan file.
TEST(Concat, AnotherPlansChunksOfTheSameInputsAreLeftOut) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string all;
  for (int i = 0; i < 6; ++i) {
    testing::WriteFile(dir / fmt::format("in/s{}.jsonl", i), Jsonl(40, 700 + i));
    all += Jsonl(40, 700 + i);
  }
  auto concat = [&](const std::string& in, const std::string& out, int chunks) {
    return RunCmd(fmt::format("{} --input {} --output-dir {} --chunks {}", testing::Tool("ptk-concat"), dir / in,
                              dir / out, chunks));
  };
  auto joined = [&](const std::string& out, int chunks) {
    std::string s;
    for (int k = 0; k < chunks; ++k) s += testing::ReadFile(dir / fmt::format("{}/train_{:02d}.jsonl", out, k));
    return s;
  };
  ASSERT_EQ(concat("in", "in/c2", 2).exit_code, 0);
  auto second = concat("in", "in/c3", 3);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(joined("in/c3", 3), all) << second.output;
  for (const char* left : {"in/c2/concat-plan.json: ", "in/c2/train_00.jsonl: ", "in/c2/train_01.jsonl: "})
    EXPECT_NE(second.output.find(fmt::format("left out {}", dir / left)), std::string::npos) << left << second.output;
  auto rechunk = concat("in/c2", "one", 1);
  ASSERT_EQ(rechunk.exit_code, 0) << rechunk.output;
  EXPECT_EQ(joined("one", 1), all) << rechunk.output;
}

// Regression: a 2-chunk plan into a directory holding a 4-chunk run kept train_02 and
// train_03, and every later stage took them for this plan's data.
TEST(Concat, APlanOwnsItsDirectory) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 8; ++i) testing::WriteFile(dir / fmt::format("in/s{}.jsonl", i), Jsonl(50, 300 + i));
  auto four = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 4", testing::Tool("ptk-concat"),
                                 dir / "in", dir / "out"));
  ASSERT_EQ(four.exit_code, 0) << four.output;
  testing::WriteFile(dir / "out/notes.txt", "the user's own file");
  auto two = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 2", testing::Tool("ptk-concat"),
                                dir / "in", dir / "out"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("removed 2 chunks of an earlier plan"), std::string::npos) << two.output;
  EXPECT_TRUE(testing::Exists(dir / "out/train_01.jsonl"));
  EXPECT_FALSE(testing::Exists(dir / "out/train_02.jsonl"));
  EXPECT_FALSE(testing::Exists(dir / "out/train_03.jsonl.ptk-done"));
  EXPECT_TRUE(testing::Exists(dir / "out/notes.txt"));  // not ptk's: left alone
  std::string all, want;
  for (int k = 0; k < 2; ++k) all += testing::ReadFile(dir / fmt::format("out/train_{:02d}.jsonl", k));
  for (int i = 0; i < 8; ++i) want += Jsonl(50, 300 + i);
  EXPECT_EQ(all, want);
}

// --plan naming a file that is not a plan: an input (in/s0.jsonl) was replaced by the plan (the user's data lost,
// "plan: 3 files", exit 0); a chunk of the plan (out/train_00.jsonl) was replaced by `run --chunk-index 0`, the
// other array tasks then failing on "not a ptk-concat plan". Both are usage errors before anything is written;
// an earlier plan at that path is still replaced.
TEST(Concat, APlanNeverReplacesAnInputOrAChunk) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 4; ++i) testing::WriteFile(dir / fmt::format("in/s{}.jsonl", i), Jsonl(20, 500 + i));
  const std::string concat = testing::Tool("ptk-concat");
  auto plan = [&](const std::string& where, const std::string& more = "") {
    return RunCmd(fmt::format("{} plan --input {} --output-dir {} --chunks 2 --plan {}{}", concat, dir / "in",
                              dir / "out", where, more));
  };
  auto input = plan(dir / "in/s0.jsonl");
  EXPECT_EQ(input.exit_code, 2) << input.output;
  EXPECT_NE(input.output.find("usage error: --plan " + dir / "in/s0.jsonl" + " exists and is not a ptk-concat plan"),
            std::string::npos)
      << input.output;
  EXPECT_EQ(testing::ReadFile(dir / "in/s0.jsonl"), Jsonl(20, 500));
  for (const char* name : {"train_00.jsonl", "train_01.jsonl.ptk-done"}) {
    auto chunk = plan(dir / "out" + "/" + name);
    EXPECT_EQ(chunk.exit_code, 2) << chunk.output;
    EXPECT_NE(chunk.output.find("usage error: --plan " + dir / "out" + "/" + name + " is chunk "), std::string::npos)
        << chunk.output;
  }
  auto pattern = plan(dir / "out/concat-plan.json", " --name-pattern concat-plan.json --chunks 1");
  EXPECT_EQ(pattern.exit_code, 2) << pattern.output;
  EXPECT_FALSE(testing::Exists(dir / "out/concat-plan.json"));
  // Its own path, again with other settings: replaced.
  ASSERT_EQ(plan(dir / "p.json").exit_code, 0);
  auto again = plan(dir / "p.json", " --chunks 1");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(testing::ReadFile(dir / "p.json").find("train_00.jsonl"), std::string::npos);
  EXPECT_EQ(testing::ReadFile(dir / "p.json").find("train_01.jsonl"), std::string::npos);
}

// Regression: an output directory inside the input directory, spelled differently on a
// rerun, made the previous chunks and the plan inputs (output doubled, exit 0).
TEST(Concat, OutputInsideInputIsExcludedHoweverItIsSpelled) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  for (int i = 0; i < 4; ++i) testing::WriteFile(dir / fmt::format("in/s{}.jsonl", i), Jsonl(40, 400 + i));
  std::string want;
  for (int i = 0; i < 4; ++i) want += Jsonl(40, 400 + i);
  for (const std::string& out : std::vector<std::string>{"c", "c/", "./c", "../in/c", dir / "in/c"}) {
    auto r = RunCmd(fmt::format("cd {} && {} --quiet --input . --output-dir {} --chunks 2", dir / "in",
                                testing::Tool("ptk-concat"), out));
    ASSERT_EQ(r.exit_code, 0) << out << ": " << r.output;
    std::string all;
    for (int k = 0; k < 2; ++k) all += testing::ReadFile(dir / fmt::format("in/c/train_{:02d}.jsonl", k));
    EXPECT_EQ(all, want) << "--output-dir " << out;
  }
}

// A full disk is exit 3 in every tool (extract and concat said 1), the message names the
// file, nothing half-written is published and a rerun with space finishes the job. `ulimit -f`
// (KiB) makes writes past it fail with EFBIG, the same path as ENOSPC.
// A directory with a link back up (sub/up -> ..) made concat write 41 copies of every line
// and extract 41 outputs (two links: until killed); a FIFO made an empty chunk (exit 0) or hung
// extract; in/f0.jsonl and in/./f0.jsonl were both taken; .JSONL, .bz2 and extension-less files
// were left out without a word. Now each file is taken once (device and inode), a FIFO named as an
// input is refused by name, and every file a directory leaves out is reported with the reason.
TEST(Concat, EachFileOnceFifosRefusedAndLeftOutFilesReported) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in/sub");
  std::filesystem::create_directories(dir / "in/sub2");
  const std::string a = Jsonl(300, 21);
  testing::WriteFile(dir / "in/f0.jsonl", a);
  testing::WriteFile(dir / "in/g.jsonl.zst", testing::ZstdCompress(a));
  std::filesystem::create_symlink("..", dir / "in/sub/up");
  std::filesystem::create_symlink("..", dir / "in/sub2/up2");
  ASSERT_EQ(::mkfifo((dir / "in/pipe.jsonl").c_str(), 0644), 0);
  testing::WriteFile(dir / "in/UPPER.JSONL", a);
  testing::WriteFile(dir / "in/b.jsonl.bz2", "BZh9");
  testing::WriteFile(dir / "in/wiki_00", a);
  testing::WriteFile(dir / "in/f0.jsonl.ptk-done", "{}");  // ptk's own: left out without a word
  auto c = RunCmd(fmt::format("timeout 60 {} --quiet --input {} --output-dir {} --chunks 1",
                              testing::Tool("ptk-concat"), dir / "in", dir / "c"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_TRUE(testing::ReadFile(dir / "c/train_00.jsonl") == a + a) << "each file once";
  for (const char* left : {"in/pipe.jsonl: a FIFO", "in/UPPER.JSONL: its extension is not in lower case",
                           "in/b.jsonl.bz2: bzip2 is not a format", "in/wiki_00: no extension"})
    EXPECT_NE(c.output.find("left out " + dir / left), std::string::npos) << left << ": " << c.output;
  EXPECT_EQ(c.output.find("ptk-done"), std::string::npos) << c.output;
  // One file, two spellings.
  auto twice = RunCmd(fmt::format("{} --quiet --input {} {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"),
                                  dir / "in/f0.jsonl", dir / "in/./f0.jsonl", dir / "c2"));
  ASSERT_EQ(twice.exit_code, 0) << twice.output;
  EXPECT_TRUE(testing::ReadFile(dir / "c2/train_00.jsonl") == a);
  // A FIFO named as input: refused by name, no chunk.
  auto fifo = RunCmd(fmt::format("timeout 60 {} --quiet --input {} --output-dir {}", testing::Tool("ptk-concat"),
                                 dir / "in/pipe.jsonl", dir / "c3"));
  EXPECT_EQ(fifo.exit_code, 1) << fifo.output;
  EXPECT_NE(fifo.output.find(dir / "in/pipe.jsonl" + " is a FIFO"), std::string::npos) << fifo.output;
  EXPECT_FALSE(testing::Exists(dir / "c3/train_00.jsonl"));

  // ptk-extract: one output per file, the left-out files said, a FIFO refused.
  auto e = RunCmd(
      fmt::format("timeout 60 {} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "x"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("1 extracted"), std::string::npos) << e.output;
  EXPECT_TRUE(testing::ReadFile(dir / "x/g.jsonl") == a);
  size_t outputs = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir / "x")) outputs += f.is_regular_file();
  EXPECT_EQ(outputs, 2u) << "g.jsonl and its sidecar only";
  for (const char* left : {"in/pipe.jsonl: a FIFO", "in/b.jsonl.bz2: bzip2 is not a format", "in/wiki_00: no extension",
                           "in/f0.jsonl: extension .jsonl"})
    EXPECT_NE(e.output.find("left out " + dir / left), std::string::npos) << left << ": " << e.output;
  ASSERT_EQ(::mkfifo((dir / "pipe.jsonl.zst").c_str(), 0644), 0);
  auto efifo = RunCmd(fmt::format("timeout 60 {} --quiet {} --output-dir {}", testing::Tool("ptk-extract"),
                                  dir / "pipe.jsonl.zst", dir / "x2"));
  EXPECT_EQ(efifo.exit_code, 1) << efifo.output;
  EXPECT_NE(efifo.output.find(dir / "pipe.jsonl.zst" + " is a FIFO"), std::string::npos) << efifo.output;
}

// A directory walk of ptk-concat left out .json.zst, .json.xz and .zstd inputs ("left out
// in/b.json.zst: extension .zst"), which ptk-extract takes and ptk-concat reads when named. Now it
// takes .jsonl and .json in every compression ptk-extract takes.
TEST(Concat, DirectoryTakesEveryCompressionExtractTakes) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(20, 31), b = Jsonl(20, 32), c = Jsonl(20, 33), d = Jsonl(20, 34);
  testing::WriteFile(dir / "in/a.json.zst", testing::ZstdCompress(a));
  testing::WriteFile(dir / "in/b.json.xz", testing::XzCompress(b));
  testing::WriteFile(dir / "in/c.jsonl.zstd", testing::ZstdCompress(c));
  testing::WriteFile(dir / "in/d.json.zstd", testing::ZstdCompress(d));
  auto r = RunCmd(fmt::format("timeout 60 {} --quiet --input {} --output-dir {} --chunks 1",
                              testing::Tool("ptk-concat"), dir / "in", dir / "c"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("left out"), std::string::npos) << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "c/train_00.jsonl") == a + b + c + d) << r.output;
  // What ptk-extract takes from that directory, ptk-concat takes too.
  auto e = RunCmd(
      fmt::format("timeout 60 {} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "x"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("4 extracted"), std::string::npos) << e.output;
}

// The directory walks of ptk-extract, ptk-concat and ptk-tokenize left out, without a word, every
// name with ".ptk-" in it, a user's x.ptk-v2.jsonl too. Now only the names ptk writes are its own.
TEST(InputList, OnlyPtksOwnNamesAreSkipped) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in/.ptk-download");
  for (const char* own : {"f.jsonl.ptk-done", "f.jsonl.ptk-lock", "f.jsonl.ptk-tmp-12-0a1b2c3d",
                          "f.jsonl.ptk-done.ptk-tmp-12-0a1b2c3d", "f.jsonl.ptk-extracting", "p.ptk-resume",
                          "p.ptk-resume-index", "p.ptk-inorder.bin", ".ptk-download/state.json"})
    testing::WriteFile(dir / (std::string("in/") + own), "{}");
  for (const char* mine : {"x.ptk-v2.jsonl", "y.ptk-v2.jsonl.zst", "z.ptk-donewith.jsonl"})
    testing::WriteFile(dir / (std::string("in/") + mine), "{}\n");
  std::vector<LeftOutFile> left_out;
  auto concat = CollectInputs({dir / "in"}, JsonInputSuffixes(), PathOrder::kNatural, &left_out);
  ASSERT_TRUE(concat.ok()) << concat.status();
  EXPECT_EQ(*concat, (std::vector<std::string>{dir / "in/x.ptk-v2.jsonl", dir / "in/y.ptk-v2.jsonl.zst",
                                               dir / "in/z.ptk-donewith.jsonl"}));
  EXPECT_TRUE(left_out.empty()) << left_out[0].path;
  auto extract = CollectInputs({dir / "in"}, CompressedSuffixes(), PathOrder::kNatural);
  ASSERT_TRUE(extract.ok()) << extract.status();
  EXPECT_EQ(*extract, std::vector<std::string>{dir / "in/y.ptk-v2.jsonl.zst"});
  auto tokenize = ExpandTokenizeInputs({dir / "in"}, "");
  ASSERT_TRUE(tokenize.ok()) << tokenize.status();
  EXPECT_EQ(*tokenize, *concat);
}

// One file listed twice would be concatenated twice: training data silently duplicated. A plan
// (edited by hand, or written by another tool) that lists a path twice however spelled, or one file
// under two names (a hard link), names two chunks alike or one outside its directory, is refused
// naming both places; `list` refuses an item twice (`--with V --with V/`, or a chunk), which two
// array tasks would tokenize to one output. Each ran and duplicated (or lost) data, exit 0.
TEST(Concat, AFileListedTwiceIsRefusedNamingBothPlaces) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::filesystem::create_directories(dir / "valid");
  const std::string a = Jsonl(30, 61), b = Jsonl(20, 62);
  testing::WriteFile(dir / "in/a.jsonl", a);
  testing::WriteFile(dir / "in/b.jsonl", b);
  ASSERT_EQ(::link((dir / "in/a.jsonl").c_str(), (dir / "in/hard.jsonl").c_str()), 0);
  const std::string concat = testing::Tool("ptk-concat");
  auto write_plan = [&](const std::string& name, const std::string& chunks) {
    testing::WriteFile(dir / name,
                       fmt::format(R"({{"version": 1, "output_dir": "{}", "base_dir": "{}", "chunks": [{}]}})",
                                   dir / "out", dir.path(), chunks));
    return dir / name;
  };
  auto chunk = [](const std::string& name, const std::vector<std::pair<std::string, size_t>>& inputs) {
    std::string in;
    for (const auto& [p, n] : inputs)
      in += fmt::format(R"({}{{"path": "{}", "size": {}}})", in.empty() ? "" : ", ", p, n);
    return fmt::format(R"({{"name": "{}", "bytes": 0, "inputs": [{}]}})", name, in);
  };
  const std::pair<std::string, std::string> plans[] = {
      {chunk("t0.jsonl", {{"in/a.jsonl", a.size()}}) + ", " +
           chunk("t1.jsonl", {{"in/b.jsonl", b.size()}, {dir / "in/./a.jsonl", a.size()}}),
       "the plan lists " + dir / "in/./a.jsonl" + " twice (chunk 0 input 0: in/a.jsonl; chunk 1 input 1: " +
           dir / "in/./a.jsonl" + "): it would be concatenated twice"},
      {chunk("t0.jsonl", {{"in/a.jsonl", a.size()}}) + ", " + chunk("t0.jsonl", {{"in/b.jsonl", b.size()}}),
       R"(chunks 0 and 1 are both named "t0.jsonl")"},
      {chunk("../t0.jsonl", {{"in/a.jsonl", a.size()}}), R"(chunk 0 is named "../t0.jsonl", which is no file name)"},
  };
  for (const auto& [chunks, message] : plans) {
    const std::string plan = write_plan("p.json", chunks);
    for (const char* sub : {"run --quiet", "list"}) {
      auto r = RunCmd(fmt::format("{} {} --plan {}", concat, sub, plan));
      EXPECT_EQ(r.exit_code, 1) << sub << ": " << r.output;
      EXPECT_NE(r.output.find(plan + ": " + message), std::string::npos) << sub << ": " << r.output;
    }
    EXPECT_FALSE(testing::Exists(dir / "out")) << message;
    EXPECT_FALSE(testing::Exists(dir / "t0.jsonl")) << message;
  }
  // One file by two names in one chunk: found when the chunk is built, nothing written.
  const std::string linked = write_plan(
      "l.json", chunk("t0.jsonl", {{"in/a.jsonl", a.size()}, {"in/b.jsonl", b.size()}, {"in/hard.jsonl", a.size()}}));
  auto r = RunCmd(fmt::format("{} run --quiet --plan {}", concat, linked));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir / "in/hard.jsonl" + ": the same file as " + dir / "in/a.jsonl" +
                          ", which chunk 0 also lists: it would be concatenated twice"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(testing::Exists(dir / "out/t0.jsonl"));
  // A directory where the plan names a file.
  const std::string with_dir = write_plan("d.json", chunk("t0.jsonl", {{"valid", 4096}}));
  r = RunCmd(fmt::format("{} run --quiet --plan {}", concat, with_dir));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir / "valid is a directory, not a regular file"), std::string::npos) << r.output;

  // `list`: each item once.
  ASSERT_EQ(RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 2", concat,
                               dir / "in/a.jsonl " + dir / "in/b.jsonl", dir / "c"))
                .exit_code,
            0);
  const std::string list = fmt::format("{} list --plan {}", concat, dir / "c/concat-plan.json");
  const std::pair<std::string, std::string> lists[] = {
      {"--with " + dir / "valid" + " --with " + dir / "valid", "--with " + dir / "valid" + " is given twice"},
      {"--with " + dir / "valid" + " --with " + dir / "./valid/",
       "--with " + dir / "./valid/" + " is --with " + dir / "valid" + " again"},
      {"--with " + dir / "c/train_01.jsonl",
       "--with " + dir / "c/train_01.jsonl" + " is the plan's chunk 1 (" + dir / "c/train_01.jsonl" + ") again"},
  };
  for (const auto& [args, message] : lists) {
    auto l = RunCmd(list + " " + args);
    EXPECT_EQ(l.exit_code, 2) << args << "\n" << l.output;
    EXPECT_NE(l.output.find("usage error: " + message), std::string::npos) << args << "\n" << l.output;
  }
  auto ok = RunCmd(list + " --with " + dir / "valid");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(ok.output, dir / "c/train_00.jsonl\n" + dir / "c/train_01.jsonl\n" + dir / "valid\n");
  // The library's own plan-maker refuses a path twice too.
  const absl::Status twice = MakeConcatPlan({{"in/a.jsonl", 1}, {"in//a.jsonl", 1}}, "out", {}).status();
  EXPECT_NE(std::string(twice.message()).find("the inputs name in//a.jsonl twice"), std::string::npos) << twice;
}

// Inputs copied as they are went into the chunk whatever they held: random bytes named .zst (a
// damaged download) and bzip2 data named .jsonl were concatenated into the training data, exit 0.
// Now they fail the chunk as ptk-extract fails them, before anything is written; data in another
// format than its name says is decoded by its content, and damage after the data is named.
TEST(Concat, InputsThatAreNotWhatTheyClaimAreRefusedOrDecoded) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  const std::string a = Jsonl(30, 71), b = Jsonl(20, 72);
  testing::WriteFile(dir / "in/a.jsonl", testing::XzCompress(a));        // xz, named plain: decoded
  testing::WriteFile(dir / "in/b.jsonl.zst", testing::GzipCompress(b));  // gzip, named .zst: decoded
  testing::WriteFile(dir / "in/c.jsonl.zst", std::string("\x48\x94\x90\x8e\x01\x02\x03\x04", 8));
  testing::WriteFile(dir / "in/d.jsonl", "BZh91AY&SY");
  const std::string z = testing::ZstdCompress(b);
  testing::WriteFile(dir / "in/e.jsonl.zst", z + "garbage!");
  auto r = RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 5", testing::Tool("ptk-concat"),
                              dir / "in", dir / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("2 chunks built, 0 already complete, 3 failed"), std::string::npos) << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "out/train_00.jsonl") == a);
  EXPECT_TRUE(testing::ReadFile(dir / "out/train_01.jsonl") == b);
  for (const std::string& m :
       {"chunk 2: " +
            dir / "in/c.jsonl.zst: named .zst but it is not compressed data (it starts with bytes 48 94 90 8e",
        "chunk 3: " + dir / "in/d.jsonl: bzip2 data, which ptk does not read",
        fmt::format("chunk 4: {}: trailing garbage at byte {}, after the last complete zstd frame",
                    dir / "in/e.jsonl.zst", z.size())})
    EXPECT_NE(r.output.find(m), std::string::npos) << m << "\n" << r.output;
  for (int k = 2; k < 5; ++k) EXPECT_FALSE(testing::Exists(dir / fmt::format("out/train_{:02d}.jsonl", k))) << k;
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// A real full disk (a 600 KiB tmpfs in a user namespace; skipped where none can be made), filled
// so that the output is published but its sidecar is not: the rerun, with room for one more copy of
// the output but not two, failed again (exit 3) because the unverified output stayed while its
// replacement was written. It is now removed first; the rerun completes with the same bytes.
TEST(DiskFull, ARerunAfterAPublishWithoutSidecarNeedsRoomForOneCopy) {
  if (RunCmd("unshare -rm true").exit_code != 0) GTEST_SKIP() << "no user namespace in which to mount a tmpfs";
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::filesystem::create_directories(dir / "mnt");
  std::string text;  // 100 lines of 4096 bytes: 100 pages of 4 KiB
  for (int i = 0; i < 100; ++i) text += fmt::format("{{\"text\": \"{:04d}{}\"}}\n", i, std::string(4096 - 17, 'x'));
  ASSERT_EQ(text.size(), 409600u);
  testing::WriteFile(dir / "in/a.jsonl.gz", testing::GzipCompress(text));
  testing::WriteFile(dir / "want.jsonl", text);
  // Fills the tmpfs so that a run publishes the output but not its sidecar, then frees the filler
  // and reruns: ARGS mount, command, output, wanted bytes.
  testing::WriteFile(dir / "full.sh", R"(set -u
mnt=$1 cmd=$2 out=$3 want=$4
mount -t tmpfs -o size=600k tmpfs "$mnt" || exit 77
page=$(getconf PAGESIZE)
need=$(( ($(stat -c %s "$want") + page - 1) / page * page ))
state=none
for extra in 0 1 2 3 4 5 6 7 8; do
  find "$mnt" -mindepth 1 -delete
  avail=$(( $(stat -f -c '%a*%S' "$mnt") ))
  head -c $((avail - need - extra * page)) /dev/zero > "$mnt/fill"
  sh -c "$cmd" >/dev/null 2>&1
  if [ -f "$out" ] && [ ! -f "$out.ptk-done" ]; then state=published-without-sidecar; break; fi
done
echo "state: $state"
rm -f "$mnt/fill"
sh -c "$cmd"; echo "rerun exit: $?"
cmp "$out" "$want" && echo "rerun output: identical"
[ -f "$out.ptk-done" ] && echo "sidecar: written"
)");
  const std::pair<std::string, std::string> runs[] = {
      {fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "mnt/x"),
       dir / "mnt/x/a.jsonl"},
      {fmt::format("{} --quiet --input {} --output-dir {} --chunks 1", testing::Tool("ptk-concat"), dir / "want.jsonl",
                   dir / "mnt/c"),
       dir / "mnt/c/train_00.jsonl"},
  };
  for (const auto& [cmd, out] : runs) {
    auto r = RunCmd(fmt::format("unshare -rm sh {} {} {} {} {}", dir / "full.sh", dir / "mnt", testing::ShellQuote(cmd),
                                out, dir / "want.jsonl"));
    if (r.exit_code == 77) GTEST_SKIP() << "tmpfs cannot be mounted here: " << r.output;
    EXPECT_NE(r.output.find("state: published-without-sidecar"), std::string::npos) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("rerun exit: 0\n"), std::string::npos) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("rerun output: identical"), std::string::npos) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("sidecar: written"), std::string::npos) << cmd << "\n" << r.output;
  }
}

TEST(DiskFull, ExtractConcatTokenizeExitThreeAndRecover) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in");
  std::string text;
  for (int i = 0; i < 6; ++i) text += Jsonl(3000, 900 + i);
  testing::WriteFile(dir / "in/big.jsonl.gz", testing::GzipCompress(text));
  const std::string extract =
      fmt::format("{} --quiet {} --output-dir {}", testing::Tool("ptk-extract"), dir / "in", dir / "x");
  auto full = RunCmd("ulimit -f 200; " + extract);
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find("big.jsonl"), std::string::npos) << full.output;
  EXPECT_FALSE(testing::Exists(dir / "x/big.jsonl"));
  auto ok = RunCmd(extract);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(testing::ReadFile(dir / "x/big.jsonl"), text);  // .gz decoded, not copied

  const std::string concat = fmt::format("{} --quiet --input {} --output-dir {} --chunks 1",
                                         testing::Tool("ptk-concat"), dir / "x", dir / "c");
  full = RunCmd("ulimit -f 200; " + concat);
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find("train_00.jsonl"), std::string::npos) << full.output;
  EXPECT_FALSE(testing::Exists(dir / "c/train_00.jsonl"));
  ok = RunCmd(concat);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(testing::ReadFile(dir / "c/train_00.jsonl"), text);

  const std::string tok = fmt::format("{} --quiet --input {} --output-prefix {}", testing::Tool("ptk-tokenize"),
                                      dir / "c/train_00.jsonl", dir / "t");
  full = RunCmd("ulimit -f 100; " + tok);
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find("t_text_document."), std::string::npos) << full.output;
  EXPECT_FALSE(testing::Exists(dir / "t_text_document.bin"));
  EXPECT_FALSE(testing::Exists(dir / "t_text_document.idx"));
  ok = RunCmd(tok);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
  // Round-robin partitions: written in input order to a temporary, then in partition order; neither
  // is left behind or published half-written.
  full = RunCmd("ulimit -f 100; " + tok + " --partitions 3 --output-prefix " + dir / "rr");
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_FALSE(testing::Exists(dir / "rr_text_document.bin"));
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().rfind("rr_", 0), std::string::npos) << e.path();
}

}  // namespace
}  // namespace ptk
