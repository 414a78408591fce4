// ptk-convert's progress (it printed nothing until done: an 8B model was minutes of silence): on a
// terminal a line per tensor (or rank) done, with the tensors and bytes done of the total, the rate and
// the ETA, as ptk-merge's; the same for a ptk checkpoint read and checksummed or written (its files and
// bytes) and a Megatron torch checkpoint's shards opened (they were said, from 1 GiB, but not counted); nothing with
// --quiet, nor between periodic lines when stderr is not a terminal; the files written the same with and without it.
// PTK_PROGRESS_INTERVAL is longer than the run, so every line seen is the one drawn as a tensor is done (no periodic
// redraw). The terminal is script(1)'s pseudo-terminal.
#include <unistd.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/human_format.h"
#include "interop/safetensors.h"
#include "interop/torch_dist.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;

// The lines a terminal showed: the status line's redraws (carriage return, erase to the end) as lines.
std::vector<std::string> TerminalLines(const std::string& out) {
  std::string s = std::regex_replace(out, std::regex("\x1b\\[[0-9;]*[A-Za-z]"), "");
  std::vector<std::string> lines;
  std::string cur;
  for (char ch : s) {
    if (ch == '\r' || ch == '\n') {
      if (!cur.empty()) lines.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) lines.push_back(cur);
  return lines;
}

struct ProgressLine {
  uint64_t done = 0, total = 0;
  std::string unit, bytes, bytes_total;
};

// The "convert: ..." progress lines of `out` counting `unit` (any, when empty), parsed; a line that starts so
// and does not parse fails.
std::vector<ProgressLine> ProgressLines(const std::string& out, const std::string& unit = "") {
  static const std::regex kLine(
      R"(convert: (\d+)/(\d+) (tensors|ranks|files|shards)(?:, ([^,/]+?)(?: / ([^,]+))?)?, [0-9.]+ )"
      R"((?:MB|tensors|ranks|files|shards)/s, (?:ETA [^,]+, )?elapsed .+)");
  std::vector<ProgressLine> r;
  for (const std::string& l : TerminalLines(out)) {
    // The status line's, not the log lines' ("... convert: writing ..." and the summary).
    if (l.rfind("convert: ", 0) != 0) continue;
    std::smatch m;
    EXPECT_TRUE(std::regex_match(l, m, kLine)) << l;
    if (m.empty() || (!unit.empty() && m[3] != unit)) continue;
    r.push_back({std::stoull(m[1]), std::stoull(m[2]), m[3], m[4], m[5]});
  }
  return r;
}

// A ptk checkpoint's `files` read and checksummed, or written, counted: every line of their total and of
// `bytes` in all, the last one all of them done. Call under ASSERT_NO_FATAL_FAILURE.
void ExpectFiles(const std::vector<ProgressLine>& lines, uint64_t files, uint64_t bytes, const std::string& out) {
  ASSERT_FALSE(lines.empty()) << out;
  for (const ProgressLine& l : lines) {
    EXPECT_EQ(l.total, files) << out;
    EXPECT_EQ(l.bytes_total, HumanBytes(static_cast<double>(bytes))) << out;
  }
  EXPECT_EQ(lines.back().done, files) << out;
  EXPECT_EQ(lines.back().bytes, HumanBytes(static_cast<double>(bytes))) << out;
}

// The bytes of the arrays (weights, two moments) of the ptk checkpoint in `dir`: what writing it counts.
uint64_t ArrayBytes(const std::string& dir) {
  auto ck = LoadPtkCheckpoint(dir, 0, false, /*with_optimizer=*/true);
  EXPECT_TRUE(ck.ok()) << ck.status();
  return ck.ok() ? 3 * ck->params.size() * sizeof(float) : 0;
}

// Every file under `dir` by its relative path, with its contents.
std::map<std::string, std::string> Files(const std::filesystem::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[std::filesystem::relative(e.path(), dir).string()] = ReadFile(e.path());
  return files;
}

class ConvertProgress : public ptk::testing::HfConvertFixture {
 protected:
  void SetUp() override {
    if (RunCmd("command -v script").exit_code != 0) GTEST_SKIP() << "no script(1)";
    SaveSmallUntiedGpt2(dir_ / "ck");
  }
  // ptk-convert with `flags`, its stderr on a terminal (script(1)) or, `tty` false, a pipe.
  ptk::testing::CommandResult Convert(const std::string& flags, bool tty = true) {
    const std::string cmd = ptk::testing::Tool("ptk-convert") + " " + flags;
    auto r = RunCmd("PTK_PROGRESS_INTERVAL=3600 " +
                    (tty ? "script -qfec " + ShellQuote(cmd) + " /dev/null" : cmd + " </dev/null"));
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("converted "), std::string::npos) << r.output;
    return r;
  }
  std::string Dirs(const std::string& loader, const std::string& saver, const std::string& from,
                   const std::string& to) {
    return "--loader " + loader + " --saver " + saver + " --load-dir " + ShellQuote(dir_ / from) + " --save-dir " +
           ShellQuote(dir_ / to);
  }
};

// A line per tensor, 1/N to N/N, with the bytes of all N as the total: the tensors of every shard.
void ExpectEveryTensor(const std::vector<ProgressLine>& lines, uint64_t n, uint64_t bytes, const std::string& out) {
  ASSERT_EQ(lines.size(), n) << out;
  for (uint64_t k = 0; k < n; ++k) {
    EXPECT_EQ(lines[k].done, k + 1) << out;
    EXPECT_EQ(lines[k].total, n) << out;
    EXPECT_EQ(lines[k].unit, "tensors");
    EXPECT_EQ(lines[k].bytes_total, HumanBytes(static_cast<double>(bytes))) << out;
  }
  EXPECT_EQ(lines.back().bytes, HumanBytes(static_cast<double>(bytes))) << out;
}

TEST_F(ConvertProgress, HfExportAndImportSayEachTensorWithTheTotals) {
  const std::string shards = " --max-shard-size 1MB";
  auto tty = Convert(Dirs("ptk", "hf", "ck", "hf") + shards);
  // The tensors of every shard the export wrote, and their bytes.
  uint64_t n = 0, bytes = 0;
  for (const auto& [name, contents] : Files(dir_ / "hf")) {
    if (name.find(".safetensors") == std::string::npos || name.find(".json") != std::string::npos) continue;
    auto f = SafetensorsFile::Open(dir_ / "hf" + "/" + name);
    ASSERT_TRUE(f.ok()) << f.status();
    for (const SafetensorsTensor& t : (*f)->tensors()) {
      ++n;
      bytes += t.end - t.begin;
    }
  }
  ASSERT_GT(n, 20u);
  ASSERT_TRUE(std::filesystem::exists(dir_ / "hf/model.safetensors.index.json"));  // shards
  ExpectEveryTensor(ProgressLines(tty.output, "tensors"), n, bytes, tty.output);
  // Before them, the ptk checkpoint read and checksummed: its one file and its bytes.
  const std::string ck_file = CheckpointFile(dir_ / "ck", 3);
  const uint64_t ck_bytes = std::filesystem::file_size(ck_file);
  ASSERT_NO_FATAL_FAILURE(ExpectFiles(ProgressLines(tty.output, "files"), 1, ck_bytes, tty.output));
  // --quiet on a terminal, and the default on a pipe: no progress line, the same files.
  auto quiet = Convert(Dirs("ptk", "hf", "ck", "hf-quiet") + shards + " --quiet");
  EXPECT_TRUE(ProgressLines(quiet.output).empty()) << quiet.output;
  auto pipe = Convert(Dirs("ptk", "hf", "ck", "hf-pipe") + shards, /*tty=*/false);
  EXPECT_TRUE(ProgressLines(pipe.output).empty()) << pipe.output;
  EXPECT_EQ(Files(dir_ / "hf-quiet"), Files(dir_ / "hf"));
  EXPECT_EQ(Files(dir_ / "hf-pipe"), Files(dir_ / "hf"));

  // Back: each tensor read, of the same totals; then the checkpoint written (the weights and two moments).
  auto in = Convert(Dirs("hf", "ptk", "hf", "in"));
  ExpectEveryTensor(ProgressLines(in.output, "tensors"), n, bytes, in.output);
  ASSERT_NO_FATAL_FAILURE(ExpectFiles(ProgressLines(in.output, "files"), 1, ArrayBytes(dir_ / "in"), in.output));
  auto in_quiet = Convert(Dirs("hf", "ptk", "hf", "in-quiet") + " --quiet");
  EXPECT_TRUE(ProgressLines(in_quiet.output).empty()) << in_quiet.output;
  // The same checkpoint (its header records the command line, --quiet and --save-dir too).
  std::vector<float> p[2], m[2], v[2];
  TrainState st[2];
  for (int k = 0; k < 2; ++k)
    ASSERT_TRUE(LoadCheckpoint(dir_ / (k ? "in-quiet" : "in"), 0, layout_, &p[k], &m[k], &v[k], &st[k]).ok());
  EXPECT_EQ(p[0], p[1]);
  EXPECT_EQ(m[0], m[1]);
  EXPECT_EQ(v[0], v[1]);
}

TEST_F(ConvertProgress, MegatronExportSaysEachRankAndTheImportEachTensor) {
  const std::string split = " --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2";
  auto tty = Convert(Dirs("ptk", "megatron", "ck", "meg") + split);
  ASSERT_NO_FATAL_FAILURE(ExpectFiles(ProgressLines(tty.output, "files"), 1,
                                      std::filesystem::file_size(CheckpointFile(dir_ / "ck", 3)), tty.output));
  const auto lines = ProgressLines(tty.output, "ranks");
  ASSERT_EQ(lines.size(), 4u) << tty.output;
  for (uint64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(lines[k].done, k + 1) << tty.output;
    EXPECT_EQ(lines[k].total, 4u) << tty.output;
    EXPECT_EQ(lines[k].unit, "ranks");
  }
  uint64_t bytes = 0;
  for (const auto& [name, contents] : Files(dir_ / "meg"))
    if (name.find(".pt") != std::string::npos) bytes += contents.size();
  EXPECT_EQ(lines.back().bytes, HumanBytes(static_cast<double>(bytes))) << tty.output;
  auto quiet = Convert(Dirs("ptk", "megatron", "ck", "meg-quiet") + split + " --quiet");
  EXPECT_TRUE(ProgressLines(quiet.output).empty()) << quiet.output;
  EXPECT_EQ(Files(dir_ / "meg-quiet"), Files(dir_ / "meg"));

  // Back: a line per shard opened, then per parameter gathered from the four ranks, then the checkpoint written.
  auto in = Convert(Dirs("megatron", "ptk", "meg", "in"));
  const auto opened = ProgressLines(in.output, "shards");
  ASSERT_EQ(opened.size(), 4u) << in.output;
  for (uint64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(opened[k].done, k + 1) << in.output;
    EXPECT_EQ(opened[k].total, 4u) << in.output;
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFiles(ProgressLines(in.output, "files"), 1, ArrayBytes(dir_ / "in"), in.output));
  const auto back = ProgressLines(in.output, "tensors");
  ASSERT_FALSE(back.empty()) << in.output;
  for (size_t k = 0; k < back.size(); ++k) {
    EXPECT_EQ(back[k].done, k + 1) << in.output;
    EXPECT_EQ(back[k].total, back.size()) << in.output;
  }
  auto in_quiet = Convert(Dirs("megatron", "ptk", "meg", "in-quiet") + " --quiet");
  EXPECT_TRUE(ProgressLines(in_quiet.output).empty()) << in_quiet.output;
}

// torch_dist (megatron-core's checkpoints of tests/data/torch_dist_llama/): a line per tensor read, of the
// checkpoint's tensors and stored bytes; with the distributed optimizer's grad buffers and without.
TEST_F(ConvertProgress, TorchDistImportSaysEachTensor) {
  for (const std::string name : {"plain_bf16_tp2", "distopt_tp2"}) {
    const std::string fixture = ptk::testing::SourceDir() + "/tests/data/torch_dist_llama/" + name;
    auto ck = torchdist::DistCheckpoint::Open(fixture + "/iter_0000003");
    ASSERT_TRUE(ck.ok()) << ck.status();
    const std::string flags = "--loader megatron --saver ptk --load-dir " + ShellQuote(fixture) + " --save-dir ";
    auto tty = Convert(flags + ShellQuote(dir_ / (name + "-in")));
    ExpectEveryTensor(ProgressLines(tty.output, "tensors"), (*ck)->tensors().size(), (*ck)->TensorBytes(), tty.output);
    auto quiet = Convert(flags + ShellQuote(dir_ / (name + "-quiet")) + " --quiet");
    EXPECT_TRUE(ProgressLines(quiet.output).empty()) << quiet.output;
    auto a = LoadPtkCheckpoint(dir_ / (name + "-in"), 0, false, /*with_optimizer=*/true);
    auto b = LoadPtkCheckpoint(dir_ / (name + "-quiet"), 0, false, /*with_optimizer=*/true);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    ASSERT_NO_FATAL_FAILURE(
        ExpectFiles(ProgressLines(tty.output, "files"), 1, ArrayBytes(dir_ / (name + "-in")), tty.output));
    EXPECT_EQ(a->params, b->params);
    EXPECT_EQ(a->m1, b->m1);
    EXPECT_EQ(a->m2, b->m2);
  }
}

}  // namespace
}  // namespace ptk
