// ptk-tokenize against Megatron-LM's own tools/preprocess_data.py: byte-identical .bin/.idx for the
// same flags (goldens: tests/support/gen_megatron_preprocess_golden.py), for any --workers and batch size.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::TempDir;

const std::string kData = testing::SourceDir() + "/tests/data/megatron_preprocess/";

void ExpectSameFiles(const std::string& got_prefix, const std::string& want_prefix) {
  for (const char* ext : {".bin", ".idx"}) {
    std::string got = testing::ReadFile(got_prefix + ext), want = testing::ReadFile(want_prefix + ext);
    ASSERT_FALSE(want.empty()) << want_prefix << ext;
    ASSERT_EQ(got.size(), want.size()) << got_prefix << ext;
    ASSERT_TRUE(got == want) << got_prefix << ext << " differs from Megatron's " << want_prefix << ext;
  }
}

std::string Tokenize(const std::string& args) { return testing::Tool("ptk-tokenize") + " --quiet " + args; }

struct Config {
  const char* name;
  const char* flags;
  const char* key;
};

TEST(TokenizeGolden, ByteIdenticalToMegatronForEveryConfigAndWorkerCount) {
  const Config configs[] = {
      {"eod", "--append-eod", "text"},
      {"noeod", "", "text"},
      {"rr3", "--append-eod --partitions 3", "text"},
      {"seq2", "--append-eod --partitions 2 --keep-sequential-samples", "text"},
      {"title", "--json-keys title --append-eod", "title"},
  };
  TempDir dir;
  for (const auto& c : configs) {
    for (const char* workers : {"1", "2", "8"}) {
      for (const char* batch : {"1", "0.001"}) {
        std::string prefix = dir / (std::string(c.name) + "_w" + workers);
        auto r = RunCmd(Tokenize(fmt::format("--input {}corpus.jsonl --output-prefix {} {} --workers {} --batch-mb {}",
                                             kData, prefix, c.flags, workers, batch)));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        ExpectSameFiles(prefix + "_" + c.key + "_document", kData + c.name + "_" + c.key + "_document");
      }
    }
  }
  // Round-robin partitions leave no part or staging files behind.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().string().find("ptk-part"), std::string::npos) << e.path();
    EXPECT_EQ(e.path().string().find("ptk-inorder"), std::string::npos) << e.path();
  }
}

// A UTF-8 BOM that starts a file (Windows tools write one) is the encoding's, not text: dropped, as
// Python's utf-8-sig codec drops it, so the output is Megatron's on the same file without it (whose
// json.loads refuses the line that starts with it). Each file's own BOM: a corpus split in two files
// that both start with one, compressed, piped in, or partitioned, gives the same bytes.
TEST(TokenizeGolden, ABomStartingAFileGivesMegatronsBytesWithoutIt) {
  TempDir dir;
  const std::string bom = "\xEF\xBB\xBF";
  const std::string corpus = testing::ReadFile(kData + "corpus.jsonl");
  const size_t cut = corpus.find('\n', corpus.size() / 2) + 1;
  testing::WriteFile(dir / "c.jsonl", bom + corpus);
  testing::WriteFile(dir / "part1.jsonl", bom + corpus.substr(0, cut));
  testing::WriteFile(dir / "part2.jsonl.zst", testing::ZstdCompress(bom + corpus.substr(cut)));
  const std::vector<std::tuple<std::string, std::string, std::string>> runs = {
      {fmt::format("--input {} --append-eod --strict", dir / "c.jsonl"), "", "eod"},
      {fmt::format("--input {} {} --append-eod --strict", dir / "part1.jsonl", dir / "part2.jsonl.zst"), "", "eod"},
      {"--input - --append-eod --strict", fmt::format("cat {} | ", dir / "c.jsonl"), "eod"},
      {fmt::format("--input {} --append-eod --partitions 3 --strict", dir / "c.jsonl"), "", "rr3"},
  };
  int i = 0;
  for (const auto& [flags, pipe, golden] : runs) {
    const std::string prefix = dir / fmt::format("out{}", i++);
    auto r = RunCmd(pipe + Tokenize(fmt::format("{} --output-prefix {}", flags, prefix)));
    ASSERT_EQ(r.exit_code, 0) << flags << r.output;
    ExpectSameFiles(prefix + "_text_document", kData + golden + "_text_document");
  }
}

// Round-robin order is line g in partition g mod P (blank and bad lines counted, as Megatron's
// partition files get every line), the partitions concatenated: the same bytes as the documents
// tokenized in that order. A partition count far above the number of lines is the input order, and
// costs no file per partition: 100000 partitions run with 256 file descriptors.
TEST(TokenizeGolden, RoundRobinOrderForAnyPartitionCount) {
  TempDir dir;
  const std::string d[] = {R"({"text":"zero"})", R"({"text":"two"})", R"({"text":"three"})", R"({"text":"four"})"};
  testing::WriteFile(dir / "in.jsonl", d[0] + "\n\n" + d[1] + "\n" + d[2] + "\n" + d[3] + "\n");
  testing::WriteFile(dir / "rr2.jsonl", d[0] + "\n" + d[1] + "\n" + d[3] + "\n" + d[2] + "\n");
  testing::WriteFile(dir / "seq.jsonl", d[0] + "\n" + d[1] + "\n" + d[2] + "\n" + d[3] + "\n");
  auto run = [&](const std::string& in, const std::string& out, const std::string& flags) {
    auto r =
        RunCmd("ulimit -n 256 && " + Tokenize(fmt::format("--input {} --output-prefix {} --append-eod --workers 2 {}",
                                                          dir / in, dir / out, flags)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  };
  run("rr2.jsonl", "want_rr2", "");
  run("in.jsonl", "rr2", "--partitions 2");
  ExpectSameFiles(dir / "rr2_text_document", dir / "want_rr2_text_document");
  run("seq.jsonl", "want_seq", "");
  run("in.jsonl", "many", "--partitions 100000");
  ExpectSameFiles(dir / "many_text_document", dir / "want_seq_text_document");
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().string().find("ptk-inorder"), std::string::npos) << e.path();
}

TEST(TokenizeGolden, SeveralKeysGiveOneDatasetPerKey) {
  TempDir dir;
  auto r = RunCmd(Tokenize(fmt::format("--input {}corpus.jsonl --output-prefix {} --json-keys text title --append-eod",
                                       kData, dir / "multi")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameFiles(dir / "multi_text_document", kData + "eod_text_document");
  ExpectSameFiles(dir / "multi_title_document", kData + "title_title_document");
}

TEST(TokenizeGolden, CompressedInputsAndStdinGiveTheSameBytes) {
  TempDir dir;
  std::string corpus = testing::ReadFile(kData + "corpus.jsonl");
  // Two zstd frames back to back, cut in the middle of a line: multi-frame streaming.
  std::string z = testing::ZstdCompress(corpus.substr(0, 40000)) + testing::ZstdCompress(corpus.substr(40000));
  testing::WriteFile(dir / "c.jsonl.zst", z);
  testing::WriteFile(dir / "c.jsonl.xz", testing::XzCompress(corpus));
  for (const char* in : {"c.jsonl.zst", "c.jsonl.xz"}) {
    auto r = RunCmd(Tokenize(
        fmt::format("--input {} --output-prefix {} --append-eod", dir / in, dir / (std::string(in) + "_out"))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ExpectSameFiles(dir / (std::string(in) + "_out_text_document"), kData + "eod_text_document");
  }
  auto r = RunCmd(fmt::format("cat {}corpus.jsonl | {}", kData,
                              Tokenize(fmt::format("--input - --output-prefix {} --append-eod", dir / "stdin"))));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameFiles(dir / "stdin_text_document", kData + "eod_text_document");
  // Standard input's format is told by its content too: compressed bytes piped in were read as text
  // (every line a bad record, exit 1).
  testing::WriteFile(dir / "c.jsonl.gz", testing::GzipCompress(corpus));
  for (const char* in : {"c.jsonl.zst", "c.jsonl.xz", "c.jsonl.gz"}) {
    const std::string out = dir / (std::string("stdin_") + in);
    auto piped = RunCmd(
        fmt::format("cat {} | {}", dir / in, Tokenize(fmt::format("--input - --output-prefix {} --append-eod", out))));
    ASSERT_EQ(piped.exit_code, 0) << in << piped.output;
    ExpectSameFiles(out + "_text_document", kData + "eod_text_document");
  }
}

TEST(TokenizeGolden, SplitInputsAndGlobsConcatenateInOrder) {
  TempDir dir;
  std::string corpus = testing::ReadFile(kData + "corpus.jsonl");
  // Split at line boundaries into part1..part12 (a glob sorts them naturally: 2 before 10).
  std::vector<std::string> lines;
  for (size_t pos = 0; pos < corpus.size();) {
    size_t e = corpus.find('\n', pos);
    lines.push_back(corpus.substr(pos, e + 1 - pos));
    pos = e + 1;
  }
  const int parts = 12;
  size_t per = (lines.size() + parts - 1) / parts;
  for (int p = 0; p < parts; ++p) {
    std::string s;
    for (size_t i = p * per; i < std::min(lines.size(), (p + 1) * per); ++i) s += lines[i];
    if (p == 5 && !s.empty()) s.pop_back();  // a file without a final newline
    testing::WriteFile(dir / fmt::format("part{}.jsonl", p + 1), s);
  }
  auto r =
      RunCmd(Tokenize(fmt::format("--input '{}' --output-prefix {} --append-eod", dir / "part*.jsonl", dir / "glob")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameFiles(dir / "glob_text_document", kData + "eod_text_document");
}

TEST(TokenizeGolden, MegatronShapedProgressLine) {
  TempDir dir;
  auto r = RunCmd(testing::Tool("ptk-tokenize") +
                  fmt::format(" --input {}corpus.jsonl --output-prefix {} --log-interval 100", kData, dir / "log"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Processing data with"), std::string::npos);
  EXPECT_NE(r.output.find("Processed 100 documents ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" docs/s, "), std::string::npos);
  EXPECT_NE(r.output.find(" MB/s)."), std::string::npos);
  EXPECT_NE(r.output.find("done: 262 documents"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace ptk
