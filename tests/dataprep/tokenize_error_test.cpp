// ptk-tokenize on bad input: bad records are skipped with file:line warnings (or fail under
// --strict), invalid text is repaired and counted, damaged compressed input fails with no output,
// unsupported flags are usage errors. Never a crash or a hang.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>
#include <tuple>

#include "common/output_lock.h"
#include "dataprep/tokenize/json_record.h"
#include "dataprep/tokenize/tokenize_pipeline.h"
#include "indexed_dataset/indexed_dataset.h"
#include "tests/dataprep/compress_util.h"
#include "tests/test_util.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::TempDir;

std::string Tok(const std::string& args) { return testing::Tool("ptk-tokenize") + " --quiet " + args; }

std::vector<std::vector<int64_t>> Docs(const std::string& prefix) {
  auto ds = IndexedDataset::Open(prefix);
  EXPECT_TRUE(ds.ok()) << ds.status();
  std::vector<std::vector<int64_t>> out;
  if (!ds.ok()) return out;
  for (int64_t d = 0; d < (*ds)->num_documents(); ++d) out.push_back((*ds)->document(d).ToVector());
  return out;
}

TEST(TokenizeErrors, BadRecordsAreSkippedWithFileAndLine) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl",
                     "{\"text\": \"Hello world\"}\n"    // 1 ok
                     "not json\n"                       // 2 malformed
                     "\n"                               // 3 blank
                     "[1, 2]\n"                         // 4 not an object
                     "{\"other\": 1}\n"                 // 5 missing key
                     "{\"text\": 5}\n"                  // 6 not a string
                     "{\"text\": \"x\"} trailing\n"     // 7 trailing garbage
                     "{\"text\": \"unterminated\n"      // 8 malformed
                     "{\"text\": [\"a\", 1]}\n"         // 9 list with a non-string
                     "{\"text\": \"Hello world\"}\n");  // 10 ok
  // 7 of 9 records bad: over the default --max-bad-fraction (0.01), so the run fails and publishes
  // nothing; with a tolerance it skips them one by one.
  auto strict = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "out")));
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_NE(strict.output.find("7 of 9 records (77.78%) could not be read, more than --max-bad-fraction 0.01"),
            std::string::npos)
      << strict.output;
  EXPECT_FALSE(testing::Exists(dir / "out_text_document.idx"));
  auto r =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction 1", dir / "in.jsonl", dir / "out")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int line = 2; line <= 9; ++line)
    EXPECT_NE(r.output.find(fmt::format("in.jsonl:{}: skipped bad record", line)), std::string::npos)
        << line << r.output;
  EXPECT_NE(r.output.find("(malformed JSON): Extra data at column 15"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("skipped 8 bad records of 10 lines"), std::string::npos) << r.output;
  auto docs = Docs(dir / "out_text_document");
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], (std::vector<int64_t>{15496, 995}));
}

TEST(TokenizeErrors, StrictFailsOnFirstBadRecordAndWritesNothing) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{broken\n{\"text\": \"c\"}\n");
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --strict", dir / "in.jsonl", dir / "out")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("in.jsonl:3: bad record (malformed JSON)"), std::string::npos) << r.output;
  EXPECT_FALSE(testing::Exists(dir / "out_text_document.bin"));
  EXPECT_FALSE(testing::Exists(dir / "out_text_document.idx"));
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

TEST(TokenizeErrors, InvalidUtf8AndLoneSurrogatesAreReplacedAndCounted) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl",
                     "{\"text\": \"a\xff"
                     "b\"}\n"                              // invalid byte -> U+FFFD
                     "{\"text\": \"x\\ud800y\"}\n"         // lone high surrogate escape
                     "{\"text\": \"\\udc00\"}\n"           // lone low surrogate escape
                     "{\"text\": \"\\ud83d\\ude00\"}\n");  // a valid pair: an emoji
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "out")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("replaced 1 invalid UTF-8 sequences and 2 lone surrogate escapes"), std::string::npos)
      << r.output;
  auto docs = Docs(dir / "out_text_document");
  ASSERT_EQ(docs.size(), 4u);
  // "a\uFFFDb" as Hugging Face GPT2TokenizerFast encodes it: a, U+FFFD (one token), b
  EXPECT_EQ(docs[0], (std::vector<int64_t>{64, 4210, 65}));
  EXPECT_EQ(docs[3], (std::vector<int64_t>{47249, 222}));  // U+1F600
  auto s = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --strict", dir / "in.jsonl", dir / "strict")));
  EXPECT_EQ(s.exit_code, 1);
  EXPECT_NE(s.output.find("in.jsonl:1: invalid UTF-8"), std::string::npos) << s.output;
}

// Batches are recycled (their buffers reused): nothing of one batch may reach the next. Batches of
// about 64 KB (the smallest read), a bad record, a replaced byte and a long document in the first
// ones: the counts and the documents must equal one batch's, for one and two workers.
TEST(TokenizeErrors, RecycledBatchesCarryNothingOver) {
  TempDir dir;
  std::string in = "{\"text\": \"" + std::string(5000, 'x') + " long document\"}\n";
  in += "not json\n";
  in +=
      "{\"text\": \"a\xff"
      "b\"}\n";
  for (int i = 0; i < 8000; ++i)
    in += fmt::format("{{\"text\": \"doc {} \u00e9t\u00e9 {}\"}}\n", i, std::string(i % 7, 'y'));
  testing::WriteFile(dir / "in.jsonl", in);
  auto one =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction 1", dir / "in.jsonl", dir / "one")));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto want = Docs(dir / "one_text_document");
  ASSERT_EQ(want.size(), 8002u);
  for (const char* workers : {"1", "2"}) {
    const std::string prefix = (dir / "small") + workers;
    auto r =
        RunCmd(Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction 1 --batch-mb 0.00001 --workers {}",
                               dir / "in.jsonl", prefix, workers)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("skipped 1 bad records of 8003 lines"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("replaced 1 invalid UTF-8 sequences and 0 lone surrogate escapes"), std::string::npos)
        << r.output;
    EXPECT_EQ(Docs(prefix + "_text_document"), want) << workers;
  }
}

TEST(TokenizeErrors, BomCrlfAndMissingFinalNewline) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "\xEF\xBB\xBF{\"text\": \"Hello world\"}\r\n{\"text\": \"Hello world\"}");
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "out")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("bad record"), std::string::npos) << r.output;
  auto docs = Docs(dir / "out_text_document");
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], docs[1]);
}

// A UTF-8 BOM is read as Python's utf-8-sig codec reads it: dropped where it starts the file, and
// anywhere else a character, which before a record's JSON makes the record one json.loads refuses.
// Regression: such a record (a file joined with cat from files that each had a BOM) was skipped as
// "Expecting value at column 1", which named neither the BOM nor where it was.
TEST(TokenizeErrors, ABomInsideAFileIsABadRecordNamingItsByte) {
  TempDir dir;
  const std::string bom = "\xEF\xBB\xBF";
  const std::string a = "{\"text\": \"Hello world\"}\n";  // 24 bytes
  testing::WriteFile(dir / "in.jsonl", bom + a + a + bom + a + a);
  testing::WriteFile(dir / "in.jsonl.zst", testing::ZstdCompress(bom + a + a + bom + a + a));
  for (const char* in : {"in.jsonl", "in.jsonl.zst"}) {
    const std::string want = fmt::format(
        "{}:3: skipped bad record (malformed JSON): Unexpected UTF-8 BOM at byte 51: only one that starts a file is "
        "dropped (files joined with their BOMs? ptk-concat drops each input's)",
        dir / in);
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction 1", dir / in, dir / "out")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
    EXPECT_EQ(Docs(dir / "out_text_document").size(), 3u);
    auto strict = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --strict", dir / in, dir / "strict")));
    EXPECT_EQ(strict.exit_code, 1) << strict.output;
    EXPECT_NE(
        strict.output.find(fmt::format("{}:3: bad record (malformed JSON): Unexpected UTF-8 BOM at byte 51", dir / in)),
        std::string::npos)
        << strict.output;
  }
  // Two BOMs at the start: the second is the text's (utf-8-sig drops one).
  testing::WriteFile(dir / "two.jsonl", bom + bom + a + a);
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --strict", dir / "two.jsonl", dir / "two")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("two.jsonl:1: bad record (malformed JSON): Unexpected UTF-8 BOM at byte 3:"),
            std::string::npos)
      << r.output;
}

// Regression: Megatron reads with Python's universal newlines, where a bare "\r" ends a
// line too: 5 documents there, 3 in ptk before.
TEST(TokenizeErrors, BareCarriageReturnEndsALineAsInPython) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl",
                     "{\"text\": \"a\"}\r{\"text\": \"b\"}\n{\"text\": \"c\"}\r\n{\"text\": \"d\"}\r{\"text\": \"e\"}");
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "out")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(Docs(dir / "out_text_document").size(), 5u);
}

// Regression: each of these exited 0 with an empty dataset. Now: non-zero, nothing
// published, and the likely cause in the message.
TEST(TokenizeErrors, InputsThatYieldNoDocumentFailWithTheCause) {
  TempDir dir;
  struct Case {
    std::string name, data, extra, want;
  };
  std::string random(4096, '\0');
  for (size_t i = 0; i < random.size(); ++i) random[i] = static_cast<char>((i * 2654435761u) >> 13);
  const std::vector<Case> cases = {
      {"keys.jsonl", "{\"content\": \"x\", \"id\": 1}\n{\"content\": \"y\", \"id\": 2}\n", "",
       "no key \"text\": the first one has content, id"},
      {"array.json", "[{\"text\": \"a\"},\n {\"text\": \"b\"}]\n", "", "a JSON array, not JSON lines"},
      {"pretty.json", "{\n  \"text\": \"a\"\n}\n", "", "pretty-printed JSON"},
      // Plain text said only "Expecting value at column 1".
      {"plain.txt", "Once upon a time\nthere was a line\n", "",
       "it looks like plain text, not JSON lines: each line must be one JSON object holding the text under "
       "--json-keys ({\"text\": \"...\"})"},
      {"random.bin", random, "", "does not look like text"},
      {"empty.jsonl", "", "", "no document in it (empty file)"},
      // A file of a UTF-8 BOM only is empty as utf-8-sig reads it; it was called "1 blank line".
      {"bom.jsonl", "\xEF\xBB\xBF", "", "bom.jsonl: no document in it (empty file)"},
      {"bom.jsonl.zst", testing::ZstdCompress("\xEF\xBB\xBF"), "", "bom.jsonl.zst: no document in it (empty file)"},
      {"bomline.jsonl", "\xEF\xBB\xBF\n", "", "no document in it (1 blank line, nothing else)"},
      // A file of blank lines was reported as an empty file.
      {"blank.jsonl", "\n  \n\t\n", "", "no document in it (3 blank lines, nothing else)"},
      {"packed.jsonl.bz2", "BZh91AY&SY", "", "bzip2 data, which ptk does not read"},
  };
  for (const auto& c : cases) {
    testing::WriteFile(dir / c.name, c.data);
    const std::string out = dir / ("out_" + c.name);
    auto r =
        RunCmd(Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction 1 {}", dir / c.name, out, c.extra)));
    EXPECT_EQ(r.exit_code, 1) << c.name << ": " << r.output;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.name << ": " << r.output;
    EXPECT_FALSE(testing::Exists(out + "_text_document.idx")) << c.name;
    EXPECT_FALSE(testing::Exists(out + "_text_document.bin")) << c.name;
  }
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

// Regression: a .json.gz was parsed as JSON bytes. gzip is decoded (by its magic bytes,
// whatever the name says), concatenated members included, and matches the plain file.
TEST(TokenizeErrors, GzipInputsAreDecoded) {
  TempDir dir;
  const std::string a = "{\"text\": \"Hello world\"}\n{\"text\": \"second\"}\n", b = "{\"text\": \"third\"}\n";
  testing::WriteFile(dir / "plain.jsonl", a + b);
  testing::WriteFile(dir / "c4.json.gz", testing::GzipCompress(a) + testing::GzipCompress(b));
  testing::WriteFile(dir / "misnamed.jsonl", testing::GzipCompress(a + b));
  for (const char* in : {"plain.jsonl", "c4.json.gz", "misnamed.jsonl"}) {
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / in, dir / (std::string("o_") + in))));
    ASSERT_EQ(r.exit_code, 0) << in << ": " << r.output;
  }
  EXPECT_EQ(testing::ReadFile(dir / "o_c4.json.gz_text_document.bin"),
            testing::ReadFile(dir / "o_plain.jsonl_text_document.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "o_misnamed.jsonl_text_document.bin"),
            testing::ReadFile(dir / "o_plain.jsonl_text_document.bin"));
  // A truncated .gz is an error naming the file, never short data.
  const std::string gz = testing::GzipCompress(a + b);
  testing::WriteFile(dir / "cut.json.gz", gz.substr(0, gz.size() - 9));
  auto cut = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "cut.json.gz", dir / "o_cut")));
  EXPECT_EQ(cut.exit_code, 1) << cut.output;
  EXPECT_NE(cut.output.find("cut.json.gz: truncated gzip data"), std::string::npos) << cut.output;
}

// A resume record that is damaged (or from a run with other inputs or settings) is not believed:
// the run starts over, says so, and its output is the plain run's.
TEST(TokenizeErrors, ForeignOrDamagedResumeRecordMeansStartingOver) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"Hello world\"}\n{\"text\": \"again\"}\n");
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "ref"))).exit_code, 0);
  // A damaged record of this version, then one of version 2 (an older ptk's, the index inline)
  // and of version 1 (SHA-256 fingerprint).
  for (const auto& [record, says] :
       {std::pair<std::string, std::string>{"PTKRESUME3\n" + std::string(200, 'z'),
                                            "damaged (checksum); starting over"},
        {"PTKRESUME2\n" + std::string(200, 'z'), "not a ptk-tokenize resume record of this version; starting over"},
        {"PTKRESUME1\n" + std::string(64, 'a') + "\n" + std::string(200, 'z'),
         "not a ptk-tokenize resume record of this version; starting over"}}) {
    std::filesystem::remove(dir / "out_text_document.bin");
    std::filesystem::remove(dir / "out_text_document.idx");
    testing::WriteFile(dir / "out_text_document.ptk-resume", record);
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "out")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    EXPECT_EQ(testing::ReadFile(dir / "out_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
    EXPECT_FALSE(testing::Exists(dir / "out_text_document.ptk-resume"));
  }
}

// Each resume point wrote the whole index so far (4 bytes a sequence, 8 a document) into the
// record it rewrites: over a long run the bytes written grew with the square of its length (a
// point a minute over a day's run of a billion documents: 12 GB a point). Now a point appends the
// entries added since the last to the index log and rewrites a record of fixed size: counted here
// (the bytes the run wrote for its points, not a time), with a point after every batch.
TEST(TokenizeErrors, ResumePointsWriteWhatIsNewNotTheWholeIndexAgain) {
  TempDir dir;
  std::string docs;
  for (int i = 0; i < 20000; ++i) docs += fmt::format("{{\"text\": \"document {} of the run\"}}\n", i);
  testing::WriteFile(dir / "in.jsonl", docs);
  auto tok = Gpt2Tokenizer::LoadOrDefault("", "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  TokenizeOptions o;
  o.inputs = {dir / "in.jsonl"};
  o.append_eod = true;
  o.batch_bytes = 8192;  // a few hundred documents a batch: dozens of points
  o.progress = o.megatron_log = false;
  o.resume_interval_s = 1e-9;  // a point after every batch
  o.output_prefix = dir / "pointed";
  auto pointed = RunTokenize(o, **tok);
  ASSERT_TRUE(pointed.ok()) << pointed.status();
  o.resume_interval_s = 0;
  o.output_prefix = dir / "plain";
  auto plain = RunTokenize(o, **tok);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->resume_points, 0);
  EXPECT_EQ(testing::ReadFile(dir / "pointed_text_document.bin"), testing::ReadFile(dir / "plain_text_document.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "pointed_text_document.idx"), testing::ReadFile(dir / "plain_text_document.idx"));
  EXPECT_FALSE(testing::Exists(dir / "pointed_text_document.ptk-resume"));
  EXPECT_FALSE(testing::Exists(dir / "pointed_text_document.ptk-resume-index"));
  const int64_t points = pointed->resume_points;
  ASSERT_GE(points, 20);
  // The index once (20000 documents of one sequence: 12 bytes each) and, per point, a record and a
  // log chunk's header and checksum of a few hundred bytes; the whole index at every point would be
  // 12 x 20000 x points / 2.
  const uint64_t bound = 12 * 20000 + 8 + 1024 * static_cast<uint64_t>(points);
  EXPECT_LE(pointed->resume_bytes_written, bound) << points << " points";
  std::printf("%lld resume points wrote %llu bytes (at most %llu)\n", static_cast<long long>(points),
              static_cast<unsigned long long>(pointed->resume_bytes_written), static_cast<unsigned long long>(bound));
}

// A run killed after its outputs were complete, between its resume record's removal and its index
// log's (the DocumentSink's last act), left PREFIX.ptk-resume-index alone beside an up-to-date output:
// every rerun found the output up to date and left the log there (litter in k8s_local_run_test after
// a tokenize pod's kill). The rerun now removes it, under the output's lock; while another run holds
// the lock it stays.
TEST(TokenizeErrors, AnIndexLogLeftBesideACompleteOutputIsRemovedByTheRerun) {
  TempDir dir;
  std::string docs;
  for (int i = 0; i < 50; ++i) docs += fmt::format("{{\"text\": \"document {} of the run\"}}\n", i);
  testing::WriteFile(dir / "in.jsonl", docs);
  auto tok = Gpt2Tokenizer::LoadOrDefault("", "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  TokenizeOptions o;
  o.inputs = {dir / "in.jsonl"};
  o.append_eod = true;
  o.progress = o.megatron_log = false;
  o.output_prefix = dir / "out";
  auto first = RunTokenize(o, **tok);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string bin = testing::ReadFile(dir / "out_text_document.bin");
  const std::string log = dir / "out_text_document.ptk-resume-index";
  testing::WriteFile(log, "the index entries of a killed run");
  {
    auto held = OutputLock::Acquire(dir / "out_text_document");  // another run's, live
    ASSERT_TRUE(held.ok()) << held.status();
    auto busy = RunTokenize(o, **tok);
    ASSERT_TRUE(busy.ok()) << busy.status();
    EXPECT_TRUE(busy->up_to_date);
    EXPECT_TRUE(testing::Exists(log));
  }
  auto again = RunTokenize(o, **tok);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->up_to_date);
  EXPECT_FALSE(testing::Exists(log));
  EXPECT_FALSE(testing::Exists(dir / "out_text_document.ptk-resume"));
  EXPECT_EQ(testing::ReadFile(dir / "out_text_document.bin"), bin);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

TEST(TokenizeErrors, TruncatedOrCorruptCompressedInputFailsWithoutOutput) {
  TempDir dir;
  std::string data;
  for (int i = 0; i < 2000; ++i) data += fmt::format("{{\"text\": \"document number {} with some words\"}}\n", i);
  std::string z = testing::ZstdCompress(data);
  testing::WriteFile(dir / "trunc.jsonl.zst", z.substr(0, z.size() / 2));
  std::string xz = testing::XzCompress(data);
  testing::WriteFile(dir / "trunc.jsonl.xz", xz.substr(0, xz.size() - 30));
  std::string bad = z;
  bad[bad.size() / 2] ^= 0x5A;
  testing::WriteFile(dir / "corrupt.jsonl.zst", bad);
  testing::WriteFile(dir / "empty.jsonl.zst", "");
  testing::WriteFile(dir / "good.jsonl", data);
  for (const char* in : {"trunc.jsonl.zst", "trunc.jsonl.xz", "corrupt.jsonl.zst", "empty.jsonl.zst"}) {
    // The bad file comes second: the first file's documents must not survive either.
    const std::string out = dir / (std::string("out_") + in);
    auto r = RunCmd(Tok(fmt::format("--input {} {} --output-prefix {}", dir / "good.jsonl", dir / in, out)));
    EXPECT_EQ(r.exit_code, 1) << in << r.output;
    EXPECT_NE(r.output.find(std::string(in) + ": "), std::string::npos) << r.output;
    EXPECT_TRUE(r.output.find("truncated") != std::string::npos || r.output.find("corrupt") != std::string::npos ||
                r.output.find("empty file") != std::string::npos)
        << r.output;
    EXPECT_FALSE(testing::Exists(out + "_text_document.bin")) << in;
    EXPECT_FALSE(testing::Exists(out + "_text_document.idx")) << in;
    EXPECT_EQ(testing::Leftovers(testing::Dirname(out)), "") << in;
  }
}

// Regression: numbers that were not numbers gave "unexpected exception: std::bad_alloc"
// or a 300-digit range. Now: exit 2 and one short line naming the flag.
TEST(TokenizeErrors, BadNumbersAreShortUsageErrors) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"x\"}\n");
  for (const char* flag : {"--batch-mb nan", "--batch-mb inf", "--batch-mb -1", "--workers 0", "--workers abc",
                           "--max-bad-fraction nan", "--batch-mb 100000"}) {
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {} {}", dir / "in.jsonl", dir / "out", flag)));
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.output;
    EXPECT_NE(r.output.find(std::string(flag).substr(0, std::string(flag).find(' '))), std::string::npos)
        << flag << ": " << r.output;
    EXPECT_LT(r.output.size(), 300u) << flag << ": " << r.output;
    EXPECT_EQ(r.output.find("exception"), std::string::npos) << r.output;
  }
  auto slurm =
      RunCmd(fmt::format("SLURM_ARRAY_TASK_ID=abc SLURM_ARRAY_TASK_COUNT=2 {} --quiet --input {} --output-dir {}",
                         testing::Tool("ptk-extract"), dir / "in.jsonl", dir / "x"));
  EXPECT_EQ(slurm.exit_code, 2) << slurm.output;
  EXPECT_NE(slurm.output.find("SLURM_ARRAY_TASK_ID=\"abc\" is not an integer"), std::string::npos) << slurm.output;
}

TEST(TokenizeErrors, UsageErrors) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n");
  const std::string base = fmt::format("--input {} --output-prefix {} ", dir / "in.jsonl", dir / "out");
  for (const char* bad : {"--split-sentences", "--tokenizer-type BertWordPieceLowerCase", "--dataset-impl lazy",
                          "--workers 0", "--no-such-flag", "--vocab-file x.json", "--tokenizer-model m.model"}) {
    auto r = RunCmd(Tok(base + bad));
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("usage"), std::string::npos) << r.output;
  }
  auto missing = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "nope.jsonl", dir / "out")));
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("nope.jsonl"), std::string::npos);
  // An output directory that cannot be made (a file in its way; a missing one is created).
  auto baddir = RunCmd(Tok(fmt::format("--input {} --output-prefix {}/dir/out", dir / "in.jsonl", dir / "in.jsonl")));
  EXPECT_EQ(baddir.exit_code, 1);
  EXPECT_NE(baddir.output.find(dir / "in.jsonl is not a directory"), std::string::npos) << baddir.output;
}

// --tokenizer-special-tokens was refused whatever its values. megatron-core 0.16.1's GPT2BPETokenizer adds
// them to the Hugging Face GPT-2 tokenizer as special tokens: <|endoftext|> is one already (the same ids:
// the caller's list), any other changes ids (a new id, or a vocabulary token split out of words:
// tests/support/check_gpt2_special_tokens.py) and is refused naming it; the legacy tokenizer reads none.
void ExpectSpecialTokensAsMegatrons(const std::string& base, const TempDir& dir, const std::string& legacy) {
  for (const std::string token : {"<a>", "hello"}) {
    auto r = RunCmd(Tok(
        fmt::format("{} --tokenizer-special-tokens '<|endoftext|>' '{}' --output-prefix {}", base, token, dir / "s")));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--tokenizer-special-tokens " + token +
                            ": not supported: Megatron's GPT2BPETokenizer (the Hugging Face GPT-2 tokenizer) adds it "
                            "as a special token, which changes the ids"),
              std::string::npos)
        << r.output;
    EXPECT_FALSE(testing::Exists(dir / "s_text_document.bin"));
  }
  auto r = RunCmd(Tok(fmt::format("{} --legacy-tokenizer --tokenizer-special-tokens '<a>' hello --output-prefix {}",
                                  base, dir / "ls")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: --tokenizer-special-tokens <a> hello: ignored, as Megatron does with "
                          "GPT2BPETokenizer: <|endoftext|> is GPT-2's special token already, and the legacy "
                          "tokenizer (--legacy-tokenizer) reads none"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "ls_text_document.bin"), legacy);
}

// Megatron's preprocess_data.py takes every tokenizer's flags and its GPT2BPETokenizer reads few.
// Regression: --vocab-size was refused and the others were unknown flags, where Megatron runs the line
// and writes what it writes without them. Now each is accepted with a warning and changes no byte;
// those that change Megatron's output are refused with the reason, and --legacy-tokenizer (<|endoftext|>
// in the text as ordinary tokens) is --endoftext-as-text.
TEST(TokenizeErrors, TokenizerFlagsMegatronIgnoresForGpt2AreNotedNotRefused) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"Hello world <|endoftext|> again\"}\n");
  const std::string base = fmt::format("--input {} --append-eod --tokenizer-type GPT2BPETokenizer", dir / "in.jsonl");
  auto plain = RunCmd(Tok(fmt::format("{} --output-prefix {}", base, dir / "plain")));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::string want = testing::ReadFile(dir / "plain_text_document.bin");
  const std::vector<std::pair<std::string, std::string>> ignored = {
      {"--vocab-size 50257", "--vocab-size 50257: ignored, as Megatron does with GPT2BPETokenizer: the vocab file"},
      {"--padded-vocab-size=50304", "--padded-vocab-size 50304: ignored"},
      {"--vocab-extra-ids 100", "--vocab-extra-ids 100: ignored"},
      {"--tokenizer-hf-use-fast", "--tokenizer-hf-use-fast: ignored"},
      {"--tokenizer-hf-include-special-tokens", "--tokenizer-hf-include-special-tokens: ignored"},
      {"--trust-remote-code", "--trust-remote-code: ignored"},
      {"--tiktoken-pattern v2", "--tiktoken-pattern v2: ignored"},
      {"--tiktoken-num-special-tokens 1000", "--tiktoken-num-special-tokens 1000: ignored"},
      {"--tiktoken-special-tokens '<unk>' '<s>'", "--tiktoken-special-tokens <unk> <s>: ignored"},
      {"--tokenizer-sentencepiece-legacy", "--tokenizer-sentencepiece-legacy: ignored"},
      {"--tokenizer-model m.model", "--tokenizer-model m.model: ignored, as Megatron does with GPT2BPETokenizer"},
      {"--tokenizer-special-tokens '<|endoftext|>'", "--tokenizer-special-tokens <|endoftext|>: ignored"},
      {"--tokenizer-special-tokens '<|endoftext|>' '<|endoftext|>'",
       "--tokenizer-special-tokens <|endoftext|> <|endoftext|>: ignored"},
  };
  int i = 0;
  for (const auto& [flags, note] : ignored) {
    const std::string prefix = dir / fmt::format("i{}", i++);
    auto r = RunCmd(Tok(fmt::format("{} {} --output-prefix {}", base, flags, prefix)));
    ASSERT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("warning: " + note), std::string::npos) << flags << "\n" << r.output;
    EXPECT_EQ(testing::ReadFile(prefix + "_text_document.bin"), want) << flags;
  }
  for (const char* refused : {"--tokenizer-metadata meta.json"}) {
    auto r = RunCmd(Tok(fmt::format("{} {} --output-prefix {}", base, refused, dir / "r")));
    EXPECT_EQ(r.exit_code, 2) << refused << "\n" << r.output;
    EXPECT_NE(r.output.find(std::string(refused).substr(0, std::string(refused).find(' ')) + " is not supported: "),
              std::string::npos)
        << r.output;
  }
  auto legacy = RunCmd(Tok(fmt::format("{} --legacy-tokenizer --output-prefix {}", base, dir / "legacy")));
  auto as_text = RunCmd(Tok(fmt::format("{} --endoftext-as-text --output-prefix {}", base, dir / "as_text")));
  ASSERT_EQ(legacy.exit_code, 0) << legacy.output;
  ASSERT_EQ(as_text.exit_code, 0) << as_text.output;
  EXPECT_EQ(testing::ReadFile(dir / "legacy_text_document.bin"), testing::ReadFile(dir / "as_text_text_document.bin"));
  EXPECT_NE(testing::ReadFile(dir / "legacy_text_document.bin"), want);
  ExpectSpecialTokensAsMegatrons(base, dir, testing::ReadFile(dir / "legacy_text_document.bin"));
}

// The ignored flags' values are typed as Megatron's argparse types them: --vocab-size abc was accepted
// and ignored, where preprocess_data.py stops at "argument --vocab-size: invalid int value: 'abc'"
// (type=int: Python's int(), which takes whitespace around, a sign and '_' between digits). Refused
// before anything is written; a str flag takes any text.
TEST(TokenizeErrors, IgnoredMegatronFlagsTakeOnlyWhatItsArgparseTakes) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"Hello world\"}\n");
  const std::string base = fmt::format("--input {} --tokenizer-type GPT2BPETokenizer", dir / "in.jsonl");
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--vocab-size abc", "argument --vocab-size: invalid int value: 'abc'"},
      {"--padded-vocab-size=50304.0", "argument --padded-vocab-size: invalid int value: '50304.0'"},
      {"--vocab-extra-ids 1e3", "argument --vocab-extra-ids: invalid int value: '1e3'"},
      {"--tiktoken-num-special-tokens 1__000", "argument --tiktoken-num-special-tokens: invalid int value: '1__000'"},
      {"--vocab-size 0x10", "argument --vocab-size: invalid int value: '0x10'"},
      {"--vocab-size \"it's\"", "argument --vocab-size: invalid int value: \"it's\""},
      {"--vocab-size ''", "argument --vocab-size: invalid int value: ''"},
  };
  for (const auto& [flags, message] : refused) {
    auto r = RunCmd(Tok(fmt::format("{} {} --output-prefix {}", base, flags, dir / "r")));
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("ptk-tokenize: usage error: " + message +
                            " (the flag is ignored, as Megatron does with GPT2BPETokenizer, but its argparse takes "
                            "only an int)"),
              std::string::npos)
        << flags << "\n"
        << r.output;
    EXPECT_FALSE(testing::Exists(dir / "r_text_document.bin")) << flags;
  }
  const std::vector<std::pair<std::string, std::string>> taken = {
      {"--vocab-size ' 50_257 '", "--vocab-size  50_257 : ignored"},
      {"--vocab-extra-ids=+0", "--vocab-extra-ids +0: ignored"},
      {"--tiktoken-num-special-tokens 0100", "--tiktoken-num-special-tokens 0100: ignored"},
      {"--tiktoken-pattern 1.5", "--tiktoken-pattern 1.5: ignored"},
  };
  int i = 0;
  for (const auto& [flags, note] : taken) {
    auto r = RunCmd(Tok(fmt::format("{} {} --output-prefix {}", base, flags, dir / fmt::format("t{}", i++))));
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("warning: " + note), std::string::npos) << flags << "\n" << r.output;
  }
}

// Argparse's forms, as the tutorials write them. Neuron's line passes --vocab and --merge
// (prefixes of --vocab-file and --merge-file); --flag=value works; a typo gets the closest flag; an
// ambiguous prefix lists the candidates.
TEST(TokenizeErrors, ArgparseFormsAsTheTutorialsWriteThem) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"Hello world\"}\n");
  const std::string vocab = testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json";
  const std::string merges = testing::SourceDir() + "/tokenizer/data/gpt2-merges.txt";
  auto neuron =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --vocab {} --merge {} --dataset-impl mmap "
                             "--tokenizer-type GPT2BPETokenizer --workers 2 --append-eod",
                             dir / "in.jsonl", dir / "n", vocab, merges)));
  ASSERT_EQ(neuron.exit_code, 0) << neuron.output;
  auto eq =
      RunCmd(Tok(fmt::format("--input={} --output-prefix={} --json-keys=text --append", dir / "in.jsonl", dir / "e")));
  ASSERT_EQ(eq.exit_code, 0) << eq.output;
  EXPECT_EQ(testing::ReadFile(dir / "e_text_document.bin"), testing::ReadFile(dir / "n_text_document.bin"));
  // Regression: NeMo's launcher (the Azure tutorial's preprocess stage, seed-pipelines.md 2.6) forwards
  // --tokenizer-model=None with its GPT-2 BPE tokenizer, which reads no model; it was refused as a SentencePiece
  // model. Its line (less --apply-ftfy, refused with the reason) runs, and a real model without a
  // --tokenizer-type is still refused (Megatron has no default type: a SentencePiece/tiktoken run meant).
  auto nemo =
      RunCmd(Tok(fmt::format("--input={} --output-prefix={} --dataset-impl=mmap --tokenizer-library=megatron "
                             "--tokenizer-type=GPT2BPETokenizer --vocab={} --merge-file={} --append-eod "
                             "--tokenizer-model=None --log-interval=2000 --workers=1",
                             dir / "in.jsonl", dir / "nemo", vocab, merges)));
  ASSERT_EQ(nemo.exit_code, 0) << nemo.output;
  EXPECT_EQ(testing::ReadFile(dir / "nemo_text_document.bin"), testing::ReadFile(dir / "n_text_document.bin"));
  auto model =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --tokenizer-model m.model", dir / "in.jsonl", dir / "m")));
  EXPECT_EQ(model.exit_code, 2) << model.output;
  EXPECT_NE(model.output.find("--tokenizer-model m.model is not supported: SentencePiece/tiktoken models"),
            std::string::npos)
      << model.output;
  auto typo = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --apend-eod", dir / "in.jsonl", dir / "t")));
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_NE(typo.output.find("unknown flag --apend-eod; did you mean --append-eod?"), std::string::npos) << typo.output;
  auto amb = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --m x", dir / "in.jsonl", dir / "t")));
  EXPECT_EQ(amb.exit_code, 2);
  EXPECT_NE(amb.output.find("ambiguous option --m could match --max-bad-fraction, --merge-file"), std::string::npos)
      << amb.output;
}

// What a newcomer types. A long flag with one dash gets the flag meant
// (was "--input is required" and "arguments were not expected: 2 -workers"); an output prefix that
// is a directory is refused (was outdir/_text_document.bin, a hidden file); a missing vocab file
// names --vocab-file and the built-in files; every tool has --version.
TEST(TokenizeErrors, NewcomerMistakesAreNamed) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"Hello world\"}\n");
  std::filesystem::create_directories(dir / "outdir");
  auto input = RunCmd(Tok(fmt::format("-input {} --output-prefix {}", dir / "in.jsonl", dir / "o")));
  EXPECT_EQ(input.exit_code, 2) << input.output;
  EXPECT_NE(input.output.find("unknown flag -input; did you mean --input?"), std::string::npos) << input.output;
  auto workers = RunCmd(Tok(fmt::format("--input {} --output-prefix {} -workers 2", dir / "in.jsonl", dir / "o")));
  EXPECT_EQ(workers.exit_code, 2) << workers.output;
  EXPECT_NE(workers.output.find("unknown flag -workers; did you mean --workers?"), std::string::npos) << workers.output;
  auto eq = RunCmd(Tok(fmt::format("-input={} --output-prefix {}", dir / "in.jsonl", dir / "o")));
  EXPECT_NE(eq.output.find("unknown flag -input; did you mean --input?"), std::string::npos) << eq.output;
  auto other = RunCmd(Tok(fmt::format("--input {} --output-prefix {} -zzzzqq", dir / "in.jsonl", dir / "o")));
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("unknown flag -zzzzqq (ptk's flags are long ones, with two dashes)"), std::string::npos)
      << other.output;
  // Values that begin with a dash stay values: stdin, a negative number.
  auto stdin_run =
      RunCmd(fmt::format("printf '{{\"text\": \"x\"}}\\n' | {}", Tok("--input - --output-prefix " + dir / "s")));
  EXPECT_EQ(stdin_run.exit_code, 0) << stdin_run.output;
  auto negative = RunCmd(Tok(fmt::format("--input {} --output-prefix {} --batch-mb -1", dir / "in.jsonl", dir / "o")));
  EXPECT_EQ(negative.exit_code, 2) << negative.output;
  EXPECT_NE(negative.output.find("--batch-mb"), std::string::npos) << negative.output;
  EXPECT_EQ(negative.output.find("unknown flag"), std::string::npos) << negative.output;
  EXPECT_FALSE(testing::Exists(dir / "o_text_document.bin"));

  for (const std::string& prefix : {dir / "outdir/", dir / "outdir//", dir / "outdir/."}) {
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", prefix)));
    EXPECT_EQ(r.exit_code, 2) << prefix << ": " << r.output;
    EXPECT_NE(r.output.find("--output-prefix " + prefix + " names a directory, not a prefix"), std::string::npos)
        << r.output;
    if (prefix.back() == '/') {
      EXPECT_NE(r.output.find("e.g. --output-prefix " + dir / "outdir/NAME (writes " + dir / "outdir/NAME" +
                              "_text_document.bin)"),
                std::string::npos)
          << r.output;
    }
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir / "outdir"));
  auto merge = RunCmd(testing::Tool("ptk-merge") + " --inputs " + dir / "s_text_document" + " --output-prefix " +
                      dir / "outdir/");
  EXPECT_EQ(merge.exit_code, 2) << merge.output;
  EXPECT_NE(merge.output.find("(writes " + dir / "outdir/NAME.bin)"), std::string::npos) << merge.output;
  EXPECT_TRUE(std::filesystem::is_empty(dir / "outdir"));

  auto vocab =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --vocab-file gpt2-vocab.json --merge-file "
                             "gpt2-merges.txt",
                             dir / "in.jsonl", dir / "o")));
  EXPECT_EQ(vocab.exit_code, 1) << vocab.output;
  EXPECT_NE(vocab.output.find("--vocab-file gpt2-vocab.json: no such file; ptk has GPT-2's vocab.json and "
                              "merges.txt built in: leave out --vocab-file and --merge-file to use them"),
            std::string::npos)
      << vocab.output;
  const std::string real_vocab = testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json";
  auto merges = RunCmd(testing::Tool("ptk-inspect") + " " + dir / "s_text_document" + " --doc 0 --vocab-file " +
                       real_vocab + " --merge-file " + dir.path());
  EXPECT_EQ(merges.exit_code, 1) << merges.output;
  EXPECT_NE(merges.output.find("--merge-file " + dir.path() + ": is a directory; ptk has GPT-2's"), std::string::npos)
      << merges.output;

  // A dataset's name for the prefix: Megatron's doubled name, said.
  auto doubled = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", dir / "d_text_document")));
  EXPECT_EQ(doubled.exit_code, 0) << doubled.output;
  EXPECT_NE(doubled.output.find("warning: --output-prefix " + dir / "d_text_document" +
                                " ends in _text_document, which ptk-tokenize (as Megatron) appends itself: the output "
                                "is " +
                                dir / "d_text_document_text_document; give --output-prefix " + dir / "d"),
            std::string::npos)
      << doubled.output;
  // Other tools' file flags: the flag named; a plan's directory for its plan file.
  std::filesystem::create_directories(dir / "chunks");
  testing::WriteFile(dir / "chunks/concat-plan.json", "{}");
  const auto concat_run = [&](const std::string& args, const std::string& want) {
    auto r = RunCmd(testing::Tool("ptk-concat") + " run --plan " + args);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
  };
  const std::string& d = dir.path();
  concat_run(d + "/chunks",
             fmt::format("--plan {0}/chunks: is a directory; did you mean --plan {0}/chunks/concat-plan.json?", d));
  // `run` before `plan` (the steps in the wrong order): said "no such file" only; now what writes it.
  concat_run(d + "/later/concat-plan.json --chunk-index 0",
             fmt::format("--plan {0}/later/concat-plan.json: no such file; write it first: ptk-concat plan --input DIR "
                         "--output-dir {0}/later",
                         d));
  concat_run(d + "/my-plan.json", fmt::format("--plan {0}/my-plan.json: no such file; write it first: ptk-concat plan "
                                              "--input DIR --output-dir DIR --plan {0}/my-plan.json",
                                              d));
  auto urls = RunCmd(testing::Tool("ptk-download") + " --url-list " + dir / "urls.txt --local-dir " + dir / "dl");
  EXPECT_EQ(urls.exit_code, 1) << urls.output;
  EXPECT_NE(urls.output.find("--url-list " + dir / "urls.txt: no such file"), std::string::npos) << urls.output;

  auto version = RunCmd(testing::Tool("ptk-tokenize") + " --version");
  EXPECT_EQ(version.exit_code, 0) << version.output;
  EXPECT_EQ(version.output.rfind("ptk-tokenize (ptk ", 0), 0u) << version.output;
}

// An output prefix whose directory is a file (or lies below one) was reported as a directory that
// "does not exist"; ptk-merge said "is not a directory or does not exist". Each now says which, naming the flag.
// A directory that does not exist is created.
TEST(TokenizeErrors, AnOutputDirectoryThatIsAFileIsNamed) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n");
  testing::WriteFile(dir / "file", "x");
  ASSERT_EQ(RunCmd(Tok("--input " + dir / "in.jsonl --output-prefix " + dir / "ds")).exit_code, 0);
  struct Case {
    std::string prefix, expected;
  } cases[] = {
      {dir / "file/o", "--output-prefix " + dir / "file/o: " + dir / "file is not a directory"},
      {dir / "file/sub/o", "--output-prefix " + dir / "file/sub/o: " + dir / "file is not a directory"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.prefix);
    auto tok = RunCmd(Tok("--input " + dir / "in.jsonl --output-prefix " + c.prefix));
    EXPECT_EQ(tok.exit_code, 1) << tok.output;
    EXPECT_NE(tok.output.find(c.expected), std::string::npos) << tok.output;
    auto merge =
        RunCmd(testing::Tool("ptk-merge") + " --inputs " + dir / "ds_text_document --output-prefix " + c.prefix);
    EXPECT_EQ(merge.exit_code, 1) << merge.output;
    EXPECT_NE(merge.output.find(c.expected), std::string::npos) << merge.output;
  }
  // A missing output directory is created at start-up (as ptk-extract's and ptk-concat's --output-dir),
  // not left to fail once everything was tokenized; a missing input still fails first, creating nothing.
  auto none = RunCmd(Tok("--input " + dir / "missing.jsonl --output-prefix " + dir / "never/o"));
  EXPECT_NE(none.exit_code, 0) << none.output;
  EXPECT_FALSE(testing::Exists(dir / "never")) << none.output;
  auto tok = RunCmd(Tok("--input " + dir / "in.jsonl --output-prefix " + dir / "nodir/sub/o"));
  EXPECT_EQ(tok.exit_code, 0) << tok.output;
  EXPECT_TRUE(testing::Exists(dir / "nodir/sub/o_text_document.idx")) << tok.output;
  auto merged = RunCmd(testing::Tool("ptk-merge") + " --inputs " + dir / "ds_text_document --output-prefix " +
                       dir / "mdir/sub/m");
  EXPECT_EQ(merged.exit_code, 0) << merged.output;
  EXPECT_TRUE(testing::Exists(dir / "mdir/sub/m.idx")) << merged.output;
  auto merge = RunCmd(testing::Tool("ptk-merge") + " --input " + dir / "file --output-prefix " + dir / "m");
  EXPECT_EQ(merge.exit_code, 1) << merge.output;
  EXPECT_NE(merge.output.find("--input " + dir / "file: is not a directory"), std::string::npos) << merge.output;
}

// A rerun whose inputs and settings every output's sidecar records leaves the
// outputs alone and says so (the main job's rerun rewrote five datasets); anything that changes
// the bytes (an input, a flag, a damaged output) or --force tokenizes again; stdin never compares.
TEST(TokenizeErrors, RerunWithTheSameInputsAndSettingsIsSkipped) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"Hello world\", \"title\": \"A\"}\n");
  testing::WriteFile(dir / "b.jsonl",
                     "{\"text\": \"Second\", \"title\": \"B\"}\n{\"text\": \"Third\", \"title\": \"C\"}\n");
  const std::string out = dir / "out";
  const std::string bin = out + "_text_document.bin", title_bin = out + "_title_document.bin";
  auto run = [&](const std::string& extra) {
    return RunCmd(Tok(fmt::format("--input {} {} --output-prefix {} --json-keys text title {}", dir / "a.jsonl",
                                  dir / "b.jsonl", out, extra)));
  };
  // The files' identity and modification time: rewritten files are new files (rename).
  auto stamp = [](const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::string("missing");
    return fmt::format("{}:{}.{}", st.st_ino, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  };
  auto stamps = [&] {
    std::string s;
    for (const char* k : {"text", "title"})
      for (const char* ext : {".bin", ".idx", ".ptk-done"}) s += stamp(out + "_" + k + "_document" + ext) + " ";
    return s;
  };
  auto first = run("--append-eod");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string before = stamps(), bytes = testing::ReadFile(bin);
  auto again = run("--append-eod --workers 1");  // the worker count does not change the bytes
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find(out + "_text_document: up to date, not rewritten: its .ptk-done sidecar records these "
                                    "inputs and settings (--force tokenizes again)"),
            std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find(out + "_title_document: up to date"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("done: nothing to do (3 documents, "), std::string::npos) << again.output;
  EXPECT_EQ(stamps(), before);

  // Another setting, a changed input, --force, a damaged output: tokenized again.
  for (const std::string change : {"eod", "input", "force", "damage", "partitions"}) {
    SCOPED_TRACE(change);
    std::string extra = "--append-eod";
    if (change == "eod") extra = "";
    if (change == "force") extra += " --force";
    if (change == "partitions") extra += " --partitions 2";
    if (change == "input") {
      struct timespec times[2] = {{0, UTIME_OMIT}, {1000000000, 0}};
      ASSERT_EQ(::utimensat(AT_FDCWD, (dir / "b.jsonl").c_str(), times, 0), 0);
    }
    if (change == "damage") std::filesystem::resize_file(title_bin, 1);
    const std::string was = stamps();
    auto r = run(extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("up to date"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("wrote " + bin), std::string::npos) << r.output;
    EXPECT_NE(stamps(), was);
    if (change != "eod" && change != "partitions") {  // round-robin partitions reorder the documents
      EXPECT_EQ(testing::ReadFile(bin), bytes);
    }
    // ... and the run after it is skipped again (round-robin partitions record it too).
    auto same = run(extra == "--append-eod --force" ? "--append-eod" : extra);
    EXPECT_NE(same.output.find("up to date"), std::string::npos) << same.output;
  }
  // Standard input cannot be compared with a sidecar: always tokenized.
  for (int i = 0; i < 2; ++i) {
    auto r = RunCmd(fmt::format("cat {} | {}", dir / "a.jsonl", Tok("--input - --output-prefix " + dir / "s")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("up to date"), std::string::npos) << r.output;
  }
}

// --force says it tokenizes again only where an output is there to redo: a first run with --force said
// "--force: tokenizing again" with nothing there. One output of two there (a key added): that one named.
TEST(TokenizeErrors, ForceSaysTokenizingAgainOnlyWhenThereIsSomethingToRedo) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"Hello world\", \"title\": \"A\"}\n");
  const std::string out = dir / "out";
  auto run = [&](const std::string& keys) {
    return RunCmd(Tok(fmt::format("--input {} --output-prefix {} --json-keys {} --force", dir / "a.jsonl", out, keys)));
  };
  auto first = run("text");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(first.output.find("tokenizing again"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("wrote " + out + "_text_document"), std::string::npos) << first.output;
  auto second = run("text title");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("--force: tokenizing again (" + out +
                               "_text_document), whatever the outputs' .ptk-done sidecars record"),
            std::string::npos)
      << second.output;
}

// --max-bad-fraction does not change the bytes: a rerun with only another one, which the output
// meets, is up to date (it tokenized everything again); one the output does not meet tokenizes
// again and fails as a first run would, leaving the output as it was.
// A killed run leaves PREFIX_<its first key>_document.ptk-resume (and -index) beside that output. A
// rerun whose first key is another (--json-keys title text after text title), or that keeps no
// resume record (--resume-interval 0, round-robin --partitions), left it there, and with it the
// output was never up to date: every rerun tokenized again, saying nothing. The records here stand
// for a killed run's (their content is never read: they are not the rerun's own).
TEST(TokenizeErrors, AKilledRunsResumeRecordOfOtherSettingsIsRemovedByTheRunThatReplacesIt) {
  for (const std::string extra : {"--json-keys title text", "--json-keys text title --resume-interval 0",
                                  "--json-keys text title --partitions 2"}) {
    SCOPED_TRACE(extra);
    TempDir dir;
    testing::WriteFile(dir / "a.jsonl",
                       "{\"text\": \"Hello world\", \"title\": \"A\"}\n{\"text\": \"B\", \"title\": \"B\"}\n");
    const std::string out = dir / "out", record = out + "_text_document.ptk-resume";
    testing::WriteFile(record, "left by a killed run\n");
    testing::WriteFile(record + "-index", "");
    const std::string run = Tok(fmt::format("--input {} --output-prefix {} {}", dir / "a.jsonl", out, extra));
    auto first = RunCmd(run);
    ASSERT_EQ(first.exit_code, 0) << first.output;
    EXPECT_FALSE(testing::Exists(record)) << first.output;
    EXPECT_FALSE(testing::Exists(record + "-index"));
    auto again = RunCmd(run);
    ASSERT_EQ(again.exit_code, 0) << again.output;
    EXPECT_NE(again.output.find("done: nothing to do (2 documents"), std::string::npos) << again.output;
  }
}

TEST(TokenizeErrors, AnotherMaxBadFractionTheOutputMeetsIsUpToDate) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\nnot json\n\n{\"text\": \"c\"}\n");
  const std::string out = dir / "out", doc = out + "_text_document";
  auto run = [&](const std::string& max_bad) {
    return RunCmd(
        Tok(fmt::format("--input {} --output-prefix {} --max-bad-fraction {}", dir / "in.jsonl", out, max_bad)));
  };
  auto stamps = [&] {
    std::string s;
    for (const char* ext : {".bin", ".idx", ".ptk-done"}) {
      struct stat st {};
      EXPECT_EQ(::stat((doc + ext).c_str(), &st), 0) << ext;
      s += fmt::format("{}:{}.{} ", st.st_ino, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    }
    return s;
  };
  auto first = run("0.5");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string before = stamps();
  for (const char* meets : {"0.25", "1", "0.5"}) {  // 1 of 4 non-blank records bad: 0.25 is met
    SCOPED_TRACE(meets);
    auto r = run(meets);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(doc + ": up to date, not rewritten"), std::string::npos) << r.output;
    EXPECT_EQ(stamps(), before);
  }
  auto stricter = run("0.1");
  EXPECT_EQ(stricter.exit_code, 1) << stricter.output;
  EXPECT_NE(stricter.output.find(doc + ": tokenizing again: 1 of its 4 records could not be read, more than "
                                       "--max-bad-fraction 0.1"),
            std::string::npos)
      << stricter.output;
  EXPECT_NE(stricter.output.find("1 of 4 records (25.00%) could not be read, more than --max-bad-fraction 0.1"),
            std::string::npos)
      << stricter.output;
  EXPECT_EQ(stamps(), before);
  EXPECT_EQ(Docs(doc).size(), 3u);
}

// --strict changes no byte of an output: a run over clean inputs writes the same with or without
// it, so toggling it between runs leaves a published output as it is. An output made without it
// that skipped a line (a blank one too) or replaced a character is not what --strict would make:
// a --strict rerun tokenizes again and fails as a first run would, the output left as it was.
TEST(TokenizeErrors, StrictChangesNoByteSoTogglingItRedoesNothing) {
  TempDir dir;
  testing::WriteFile(dir / "clean.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  testing::WriteFile(dir / "blank.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n");
  auto stamps = [](const std::string& doc) {
    std::string s;
    for (const char* ext : {".bin", ".idx", ".ptk-done"}) {
      struct stat st {};
      EXPECT_EQ(::stat((doc + ext).c_str(), &st), 0) << doc << ext;
      s += fmt::format("{}:{}.{} ", st.st_ino, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    }
    return s;
  };
  for (const char* first : {"", "--strict"}) {
    SCOPED_TRACE(first);
    const std::string out = dir / (std::string("clean") + first), doc = out + "_text_document";
    auto run = [&](const std::string& extra) {
      return RunCmd(Tok(fmt::format("--input {} --output-prefix {} {}", dir / "clean.jsonl", out, extra)));
    };
    ASSERT_EQ(run(first).exit_code, 0);
    const std::string before = stamps(doc);
    for (const char* extra : {"--strict", "", "--strict"}) {
      auto r = run(extra);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find(doc + ": up to date, not rewritten"), std::string::npos) << extra << r.output;
      EXPECT_EQ(stamps(doc), before) << extra;
    }
  }
  const std::string out = dir / "blank", doc = out + "_text_document";
  auto run = [&](const std::string& extra) {
    return RunCmd(Tok(fmt::format("--input {} --output-prefix {} {}", dir / "blank.jsonl", out, extra)));
  };
  ASSERT_EQ(run("").exit_code, 0);
  const std::string before = stamps(doc);
  auto strict = run("--strict");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_NE(strict.output.find(doc + ": tokenizing again: --strict, and lines were skipped"), std::string::npos)
      << strict.output;
  EXPECT_NE(strict.output.find(dir / "blank.jsonl:2: bad record"), std::string::npos) << strict.output;
  EXPECT_EQ(stamps(doc), before);
  auto again = run("");
  EXPECT_NE(again.output.find(doc + ": up to date, not rewritten"), std::string::npos) << again.output;
  EXPECT_EQ(stamps(doc), before);
}

// Standard input named twice: the second was read as an empty file ("-: no document in it").
TEST(TokenizeErrors, StandardInputTwiceIsAUsageError) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"a\"}\n");
  auto r = RunCmd(fmt::format("cat {} | {}", dir / "a.jsonl", Tok("--input - - --output-prefix " + dir / "s")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("usage error: - (standard input) is given twice"), std::string::npos) << r.output;
  EXPECT_FALSE(testing::Exists(dir / "s_text_document.bin"));
}

// A key names its dataset, PREFIX_KEY_document: an empty key, or one with a '/' (which would write
// elsewhere, or fail with "cannot create lock file ...: No such file or directory"), is refused.
TEST(TokenizeErrors, AKeyThatCannotNameADatasetIsAUsageError) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"a\", \"\": \"b\", \"x/y\": \"c\"}\n");
  for (const std::string key : {"''", "x/y", "../t"}) {
    auto r =
        RunCmd(Tok(fmt::format("--input {} --output-prefix {} --json-keys text {}", dir / "a.jsonl", dir / "o", key)));
    EXPECT_EQ(r.exit_code, 2) << key << r.output;
    EXPECT_NE(r.output.find("usage error: --json-keys"), std::string::npos) << key << r.output;
    EXPECT_FALSE(testing::Exists(dir / "o_text_document.bin")) << key;
  }
}

// --files-filter with no --input directory filtered nothing and said nothing.
TEST(TokenizeErrors, FilesFilterWithoutADirectoryIsAUsageError) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"a\"}\n");
  auto r =
      RunCmd(Tok(fmt::format("--input {} --files-filter '*.json' --output-prefix {}", dir / "a.jsonl", dir / "o")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("usage error: --files-filter \"*.json\" selects files below an --input directory"),
            std::string::npos)
      << r.output;
  auto ok = RunCmd(Tok(fmt::format("--input {} --files-filter '*.jsonl' --output-prefix {}", dir.path(), dir / "o")));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// One dataset named twice, however spelled, or linked twice into --input DIR, was merged twice:
// its documents duplicated, exit 0.
TEST(TokenizeErrors, MergeOfOneDatasetTwiceIsRefused) {
  testing::TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"First\"}\n");
  std::filesystem::create_directories(dir / "p");
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "a.jsonl", dir / "p/a"))).exit_code, 0);
  const std::string merge = testing::Tool("ptk-merge");
  auto twice = RunCmd(fmt::format("{} --inputs {} {}.bin --output-prefix {}", merge, dir / "p/a_text_document",
                                  dir / "p/../p/a_text_document", dir / "m"));
  EXPECT_EQ(twice.exit_code, 2) << twice.output;
  EXPECT_NE(twice.output.find("are the same dataset"), std::string::npos) << twice.output;
  for (const char* ext : {".bin", ".idx"})
    std::filesystem::create_symlink("a_text_document" + std::string(ext),
                                    dir / ("p/b_text_document" + std::string(ext)));
  auto linked = RunCmd(fmt::format("{} --input {} --output-prefix {}", merge, dir / "p", dir / "m"));
  EXPECT_EQ(linked.exit_code, 1) << linked.output;
  EXPECT_NE(linked.output.find(dir / "p/a_text_document and " + dir / "p/b_text_document are the same dataset"),
            std::string::npos)
      << linked.output;
  EXPECT_FALSE(testing::Exists(dir / "m.bin"));
}

// --inputs naming the output itself, however spelled, was "error: output prefix X is also an input",
// exit 1: a usage error (exit 2) naming both flags, the input left as it was.
TEST(TokenizeErrors, MergeIntoOneOfItsInputsIsAUsageError) {
  testing::TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"First\"}\n");
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "a.jsonl", dir / "a"))).exit_code, 0);
  const std::string a = dir / "a_text_document", bytes = testing::ReadFile(a + ".bin");
  for (const std::string& out : {a, dir / "./a_text_document"}) {
    auto r = RunCmd(fmt::format("{} --inputs {} --output-prefix {}", testing::Tool("ptk-merge"), a, out));
    EXPECT_EQ(r.exit_code, 2) << out << "\n" << r.output;
    EXPECT_NE(r.output.find(
                  fmt::format("usage error: --output-prefix {} is --inputs {} (the same dataset, {}.idx)", out, a, a)),
              std::string::npos)
        << r.output;
    EXPECT_EQ(testing::ReadFile(a + ".bin"), bytes);
  }
}

TEST(TokenizeErrors, MergeRerunWithTheSameInputsIsSkipped) {
  testing::TempDir dir;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"First\"}\n{\"text\": \"Second\"}\n");
  testing::WriteFile(dir / "b.jsonl", "{\"text\": \"Third\"}\n");
  for (const char* p : {"a", "b"})
    ASSERT_EQ(
        RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / (std::string(p) + ".jsonl"), dir / p))).exit_code,
        0);
  const std::string a = dir / "a_text_document", b = dir / "b_text_document", out = dir / "m";
  auto merge = [&](const std::string& inputs, const std::string& extra) {
    return RunCmd(testing::Tool("ptk-merge") + " --inputs " + inputs + " --output-prefix " + out + " " + extra);
  };
  auto stamp = [&] {
    std::string s;
    for (const char* ext : {".bin", ".idx", ".ptk-done"}) {
      struct stat st {};
      s += ::stat((out + ext).c_str(), &st) != 0
               ? std::string("missing ")
               : fmt::format("{}:{}.{} ", st.st_ino, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    }
    return s;
  };
  auto first = merge(a + " " + b, "");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("merged 2 datasets into " + out + ": 3 documents"), std::string::npos) << first.output;
  const std::string before = stamp(), bytes = testing::ReadFile(out + ".bin");
  auto again = merge(a + " " + b, "");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find(out + ": up to date, not rewritten: its .ptk-done sidecar records these 2 inputs and "
                                    "settings (--force merges again)"),
            std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("done: nothing to do (3 documents, "), std::string::npos) << again.output;
  EXPECT_EQ(stamp(), before);
  // Another order, --force, a changed input, a damaged output: merged again, and the rerun skipped.
  for (const std::string change : {"order", "force", "input", "damage"}) {
    SCOPED_TRACE(change);
    std::string inputs = a + " " + b, extra;
    if (change == "order") inputs = b + " " + a;
    if (change == "force") extra = "--force";
    if (change == "input") {
      struct timespec times[2] = {{0, UTIME_OMIT}, {1000000000, 0}};
      ASSERT_EQ(::utimensat(AT_FDCWD, (b + ".idx").c_str(), times, 0), 0);
    }
    if (change == "damage") std::filesystem::resize_file(out + ".bin", 1);
    const std::string was = stamp();
    auto r = merge(inputs, extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("up to date"), std::string::npos) << r.output;
    EXPECT_NE(stamp(), was);
    if (change != "order") {
      EXPECT_EQ(testing::ReadFile(out + ".bin"), bytes);
    }
    auto same = merge(inputs, "");
    EXPECT_NE(same.output.find("up to date"), std::string::npos) << same.output;
  }
  // A missing input is named, not skipped over.
  auto gone = merge(a + " " + dir / "nope", "");
  EXPECT_EQ(gone.exit_code, 1) << gone.output;
  EXPECT_NE(gone.output.find(dir / "nope.bin"), std::string::npos) << gone.output;
}

// dir/parts/p1_text_document and p2_text_document: dir/a.jsonl's two documents tokenized twice by ptk-tokenize,
// the inputs of the merge tests below, made in the order `order` names them.
void TokenizeTwoParts(const TempDir& dir, std::initializer_list<const char*> order = {"p1", "p2"}) {
  std::filesystem::create_directories(dir / "parts");
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"First\"}\n{\"text\": \"Second\"}\n");
  for (const char* p : order)
    ASSERT_EQ(
        RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "a.jsonl", dir / ("parts/" + std::string(p)))))
            .exit_code,
        0);
}

// ptk-merge --input DIR with its output in DIR: a rerun finds its own output there and leaves it out,
// however the output is spelled: up to date, not merged into itself.
TEST(TokenizeErrors, MergeIntoItsInputDirectoryRerunsAsUpToDate) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(TokenizeTwoParts(dir));
  auto merge = [&](const std::string& out) {
    return RunCmd(testing::Tool("ptk-merge") + " --input " + dir / "parts" + " --output-prefix " + out);
  };
  auto first = merge(dir / "parts/m");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("merged 2 datasets"), std::string::npos) << first.output;
  const std::string bytes = testing::ReadFile(dir / "parts/m.bin");
  for (const std::string& out : {dir / "parts/m", dir / "parts/./m"}) {
    auto again = merge(out);
    EXPECT_EQ(again.exit_code, 0) << again.output;
    EXPECT_NE(again.output.find("up to date, not rewritten"), std::string::npos) << again.output;
    EXPECT_EQ(testing::ReadFile(dir / "parts/m.bin"), bytes);
  }
  // The output named as one of the inputs (p1, which ptk-tokenize wrote) was left out and replaced by
  // the merge of the others, exit 0: refused, exit 1, p1 as it was.
  const std::string p1 = testing::ReadFile(dir / "parts/p1_text_document.bin");
  auto over = merge(dir / "parts/p1_text_document");
  EXPECT_EQ(over.exit_code, 1) << over.output;
  EXPECT_NE(over.output.find("that no merge wrote (its p1_text_document.ptk-done records ptk-tokenize)"),
            std::string::npos)
      << over.output;
  EXPECT_EQ(testing::ReadFile(dir / "parts/p1_text_document.bin"), p1);
  // Without a sidecar (Megatron's pair), too.
  std::filesystem::remove(dir / "parts/p1_text_document.ptk-done");
  auto bare = merge(dir / "parts/p1_text_document");
  EXPECT_EQ(bare.exit_code, 1) << bare.output;
  EXPECT_NE(bare.output.find("no p1_text_document.ptk-done beside it"), std::string::npos) << bare.output;
  EXPECT_EQ(testing::ReadFile(dir / "parts/p1_text_document.bin"), p1);
}

// Regression: ptk-tokenize --input CHUNKS/ (a ptk-concat output directory) took its concat-plan.json
// for data: read first (natural order) but judged at the end, after every chunk was tokenized, it failed
// the run ('no document could be read ... its records have no key "text"'), nothing published. A plan
// is ptk's own file, left out as its sidecars are.
TEST(TokenizeErrors, AConcatPlanBelowAnInputDirectoryIsNoInput) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "in");
  testing::WriteFile(dir / "in/a.jsonl", "{\"text\": \"First\"}\n{\"text\": \"Second\"}\n");
  testing::WriteFile(dir / "in/b.jsonl", "{\"text\": \"Third\"}\n");
  ASSERT_EQ(RunCmd(fmt::format("{} --quiet --input {} --output-dir {} --chunks 2", testing::Tool("ptk-concat"),
                               dir / "in", dir / "chunks"))
                .exit_code,
            0);
  ASSERT_TRUE(testing::Exists(dir / "chunks/concat-plan.json"));
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "chunks", dir / "all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto one =
      RunCmd(Tok(fmt::format("--input {} {} --output-prefix {}", dir / "in/a.jsonl", dir / "in/b.jsonl", dir / "ref")));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(testing::ReadFile(dir / "all_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "all_text_document.idx"), testing::ReadFile(dir / "ref_text_document.idx"));
}

// Regression: a dataset pair below an --input directory whose prefix does not end in _document (a ptk-merge
// output, merged.bin/.idx) was read as text: judged at the end, after the real inputs were tokenized, it
// failed the run ('merged.bin: no document could be read ... binary data'). A .bin beside its .idx is a
// dataset, left out as PREFIX_text_document's are; a lone data.bin is still an input.
TEST(TokenizeErrors, ADatasetPairOfAnyNameBelowAnInputDirectoryIsNoInput) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "in");
  testing::WriteFile(dir / "in/a.jsonl", "{\"text\": \"First\"}\n{\"text\": \"Second\"}\n");
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in/a.jsonl", dir / "ref"))).exit_code, 0);
  ASSERT_EQ(RunCmd(fmt::format("{} --inputs {} --output-prefix {}", testing::Tool("ptk-merge"),
                               dir / "ref_text_document", dir / "in/merged"))
                .exit_code,
            0);
  auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in", dir / "all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "all_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
  std::filesystem::remove(dir / "in/merged.idx");
  auto lone = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in", dir / "lone")));
  EXPECT_EQ(lone.exit_code, 1) << lone.output;
  EXPECT_NE(lone.output.find("merged.bin"), std::string::npos) << lone.output;
}

// Regression: an input that yields no document (empty, or binary data) failed the run only at its end,
// after every later input was tokenized (hours of a Slurm job, then nothing published). It fails once that
// input is read: an endless standard input after it shows it (before, only timeout's guard ended the run).
TEST(TokenizeErrors, AnInputWithoutADocumentFailsOnceItIsRead) {
  testing::TempDir dir;
  testing::WriteFile(dir / "empty.jsonl", "");
  testing::WriteFile(dir / "binary.dat", std::string("\x01\x02\x00\x03\n\x7f\x00\n", 8));
  for (const char* first : {"empty.jsonl", "binary.dat"}) {
    auto r = RunCmd(fmt::format("yes '{{\"text\": \"endless\"}}' | timeout 30 {}",
                                Tok(fmt::format("--input {} - --output-prefix {}", dir / first, dir / "out"))));
    EXPECT_EQ(r.exit_code, 1) << first << ": " << r.output;
    EXPECT_NE(r.output.find(dir / first + ": no document"), std::string::npos) << r.output;
    EXPECT_FALSE(testing::Exists(dir / "out_text_document.bin"));
  }
}

// Regression: a merge into its input directory (parts/m, supported) was then taken as an input by the
// next merge of that directory, beside the datasets it holds: every document twice, exit 0. A dataset a
// merge made from other inputs of this merge is refused, naming both (--inputs: a usage error).
TEST(TokenizeErrors, AMergeOfInputsIsNotMergedAgainBesideThem) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(TokenizeTwoParts(dir));
  const std::string merge = testing::Tool("ptk-merge");
  ASSERT_EQ(RunCmd(merge + " --input " + dir / "parts" + " --output-prefix " + dir / "parts/m").exit_code, 0);
  auto all = RunCmd(merge + " --input " + dir / "parts" + " --output-prefix " + dir / "all");
  EXPECT_EQ(all.exit_code, 1) << all.output;
  EXPECT_NE(all.output.find(dir / "parts/m is a merge of " + dir / "parts/p1_text_document"), std::string::npos)
      << all.output;
  EXPECT_FALSE(testing::Exists(dir / "all.bin"));
  auto listed =
      RunCmd(merge + " --inputs " + dir / "parts/p2_text_document " + dir / "parts/m --output-prefix " + dir / "all");
  EXPECT_EQ(listed.exit_code, 2) << listed.output;
  EXPECT_NE(listed.output.find(dir / "parts/m is a merge of " + dir / "parts/p2_text_document"), std::string::npos)
      << listed.output;
  // Alone, or beside other datasets, a merge is an input like any other.
  auto copy = RunCmd(merge + " --inputs " + dir / "parts/m --output-prefix " + dir / "copy");
  EXPECT_EQ(copy.exit_code, 0) << copy.output;
  EXPECT_EQ(testing::ReadFile(dir / "copy.bin"), testing::ReadFile(dir / "parts/m.bin"));
}

// The input a merge is named against is the first its record lists, not the one whose .idx has the
// lowest inode: p2 made before p1 (so, on most filesystems, the lower inode) named p2, so that the
// message changed with the order files were made (AMergeOfInputsIsNotMergedAgainBesideThem flaked).
TEST(TokenizeErrors, AMergeIsNamedAgainstItsFirstRecordedInput) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(TokenizeTwoParts(dir, {"p2", "p1"}));
  const std::string merge = testing::Tool("ptk-merge");
  ASSERT_EQ(RunCmd(merge + " --input " + dir / "parts" + " --output-prefix " + dir / "parts/m").exit_code, 0);
  for (int i = 0; i < 3; ++i) {  // the same answer every time
    auto all = RunCmd(merge + " --input " + dir / "parts" + " --output-prefix " + dir / "all");
    EXPECT_EQ(all.exit_code, 1) << all.output;
    EXPECT_NE(all.output.find(dir / "parts/m is a merge of " + dir / "parts/p1_text_document,"), std::string::npos)
        << all.output;
  }
}

// A rerun with the same inputs spelled otherwise (a.jsonl, ./a.jsonl, its absolute name, from another
// directory) tokenized and merged again: the fingerprint held the names as typed. Now up to date, and a
// changed input is still seen.
TEST(TokenizeErrors, ARerunWithTheInputsSpelledOtherwiseIsUpToDate) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "sub");
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"First\"}\n{\"text\": \"Second\"}\n");
  const std::string in = "cd " + testing::ShellQuote(dir.path()) + " && ";
  auto tok = [&](const std::string& where, const std::string& input, const std::string& out) {
    return RunCmd(where + testing::Tool("ptk-tokenize") + " --input " + input + " --output-prefix " + out);
  };
  ASSERT_EQ(tok(in, "a.jsonl", "o").exit_code, 0);
  for (const auto& [where, input, out] : {std::tuple<std::string, std::string, std::string>{in, "./a.jsonl", "./o"},
                                          {in, dir / "a.jsonl", dir / "o"},
                                          {"cd " + testing::ShellQuote(dir / "sub") + " && ", "../a.jsonl", "../o"}}) {
    auto again = tok(where, input, out);
    EXPECT_EQ(again.exit_code, 0) << again.output;
    EXPECT_NE(again.output.find("up to date, not rewritten"), std::string::npos) << input << "\n" << again.output;
  }
  auto merge = [&](const std::string& where, const std::string& input) {
    return RunCmd(where + testing::Tool("ptk-merge") + " --inputs " + input + " --output-prefix " + dir / "m");
  };
  ASSERT_EQ(merge(in, "o_text_document").exit_code, 0);
  auto merged_again = merge("", dir / "o_text_document");
  EXPECT_NE(merged_again.output.find("up to date, not rewritten"), std::string::npos) << merged_again.output;
  testing::WriteFile(dir / "a.jsonl", "{\"text\": \"Other\"}\n");
  auto changed = tok("", dir / "a.jsonl", dir / "o");
  EXPECT_EQ(changed.output.find("up to date"), std::string::npos) << changed.output;
}

// A changed tokenizer is never missed, whatever its files' sizes and times: two ids swapped in
// vocab.json, or two merges swapped in merges.txt (a later rank for a first merge), each with the
// file's size and modification time kept (touch -r), make the rerun tokenize again, saying in one
// line which file changed, and the output equals a fresh run's. ptk-merge over the retokenized
// input (its .bin/.idx given back their old times) merges again: the input's sidecar changed.
TEST(TokenizeErrors, ATokenizerFileChangeIsNeverMissedByARerun) {
  TempDir dir;
  testing::WriteFile(dir / "a.jsonl",
                     "{\"text\": \"the cat of the hat and the end of the day\"}\n{\"text\": \"out of the blue\"}\n");
  const std::string vocab = dir / "vocab.json", merges = dir / "merges.txt", out = dir / "out";
  testing::WriteFile(vocab, std::string(Gpt2Tokenizer::DefaultVocabJson()));
  testing::WriteFile(merges, std::string(Gpt2Tokenizer::DefaultMergesTxt()));
  auto run = [&](const std::string& prefix) {
    return RunCmd(Tok(fmt::format("--input {} --output-prefix {} --vocab-file {} --merge-file {} --append-eod",
                                  dir / "a.jsonl", prefix, vocab, merges)));
  };
  // Rewrites `path` with `text` (the same size), then gives it back its modification time.
  auto rewrite_keeping_time = [](const std::string& path, const std::string& text) {
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    ASSERT_EQ(text.size(), static_cast<size_t>(st.st_size));
    testing::WriteFile(path, text);
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  };
  auto first = run(out);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string doc = out + "_text_document";
  const auto original = Docs(doc);
  ASSERT_NE(run(out).output.find("up to date"), std::string::npos);
  const std::string m = dir / "m";
  auto merge = [&] { return RunCmd(testing::Tool("ptk-merge") + " --inputs " + doc + " --output-prefix " + m); };
  ASSERT_EQ(merge().exit_code, 0);
  ASSERT_NE(merge().output.find("up to date"), std::string::npos);

  struct Change {
    const char* what;
    std::string path;
    std::function<std::string(std::string)> edit;
    const char* named;
  };
  const Change changes[] = {
      {"vocab ids of ' the' and ' of' swapped", vocab,
       [](std::string t) {
         const std::string the = "\"\\u0120the\": 262,", of = "\"\\u0120of\": 286,";
         const size_t a = t.find(the), b = t.find(of);
         EXPECT_NE(a, std::string::npos);
         EXPECT_NE(b, std::string::npos);
         if (a == std::string::npos || b == std::string::npos) return t;
         t.replace(a, the.size(), "\"\\u0120the\": 286,");
         t.replace(b, of.size(), "\"\\u0120of\": 262,");
         return t;
       },
       "the vocabulary file's content (--vocab-file)"},
      {"first merge moved to a later rank", merges,
       [](std::string t) {
         std::vector<std::string> lines;
         for (size_t pos = 0; pos < t.size();) {
           const size_t nl = t.find('\n', pos);
           lines.push_back(t.substr(pos, nl - pos));
           pos = nl == std::string::npos ? t.size() : nl + 1;
         }
         // Line 1 is "\u0120 t" (line 0 is #version): swap it with the last merge of its length.
         for (size_t i = lines.size() - 1; i > 1; --i)
           if (lines[i].size() == lines[1].size() && lines[i] != lines[1]) {
             std::swap(lines[1], lines[i]);
             break;
           }
         std::string back;
         for (size_t i = 0; i < lines.size(); ++i)
           back += lines[i] + (i + 1 < lines.size() || t.back() == '\n' ? "\n" : "");
         return back.substr(0, t.size());
       },
       "the merges file's content (--merge-file)"},
  };
  for (const Change& c : changes) {
    SCOPED_TRACE(c.what);
    const auto before = Docs(doc);
    struct stat bin_st {
    }, idx_st{};
    ASSERT_EQ(::stat((doc + ".bin").c_str(), &bin_st), 0);
    ASSERT_EQ(::stat((doc + ".idx").c_str(), &idx_st), 0);
    rewrite_keeping_time(c.path, c.edit(testing::ReadFile(c.path)));
    auto r = run(out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("up to date"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(doc + ": tokenizing again: changed since it was made: " + c.named), std::string::npos)
        << r.output;
    const std::string fresh = dir / ("fresh" + std::to_string(&c - changes));
    ASSERT_EQ(run(fresh).exit_code, 0);
    EXPECT_EQ(Docs(doc), Docs(fresh + "_text_document"));
    EXPECT_NE(Docs(doc), before) << "the change does not change the ids: the test proves nothing";
    EXPECT_NE(run(out).output.find("up to date"), std::string::npos);
    // ptk-merge: the input's .bin and .idx given back their size and times; its sidecar differs.
    struct timespec bin_times[2] = {bin_st.st_atim, bin_st.st_mtim}, idx_times[2] = {idx_st.st_atim, idx_st.st_mtim};
    ASSERT_EQ(::utimensat(AT_FDCWD, (doc + ".bin").c_str(), bin_times, 0), 0);
    ASSERT_EQ(::utimensat(AT_FDCWD, (doc + ".idx").c_str(), idx_times, 0), 0);
    auto mr = merge();
    ASSERT_EQ(mr.exit_code, 0) << mr.output;
    EXPECT_EQ(mr.output.find("up to date"), std::string::npos) << mr.output;
    EXPECT_EQ(Docs(m), Docs(doc));
  }
  EXPECT_NE(Docs(doc), original);
}

// What a terminal shows for `out`: \r returns to the start of the line, ESC[K erases to its end,
// \n ends it; other bytes overwrite. The lines, the last one unfinished.
std::vector<std::string> Screen(const std::string& out) {
  std::vector<std::string> lines(1);
  size_t col = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    std::string& line = lines.back();
    if (out[i] == '\r') {
      col = 0;
    } else if (out[i] == '\n') {
      lines.emplace_back();
      col = 0;
    } else if (out.compare(i, 3, "\033[K") == 0) {
      line.resize(std::min(line.size(), col));
      i += 2;
    } else {
      if (col < line.size())
        line[col] = out[i];
      else
        line += out[i];
      ++col;
    }
  }
  return lines;
}

// On a terminal the rate/ETA line is redrawn in place; Megatron's "Processed N
// documents" and "Opening FILE" lines (and warnings) now take it away and draw it again below them
// (were "...ETA 0.2s, elapsed 0.3sProcessed 3000 documents").
TEST(TokenizeErrors, ProgressLineAndLogLinesDoNotRunTogetherOnATerminal) {
  if (RunCmd("script -qfec true /dev/null").exit_code != 0) GTEST_SKIP() << "no script(1) for a terminal";
  TempDir dir;
  std::string docs;
  for (int i = 0; i < 20000; ++i) docs += fmt::format("{{\"text\": \"document {} of a terminal test\"}}\n", i);
  testing::WriteFile(dir / "a.jsonl", docs);
  testing::WriteFile(dir / "b.jsonl", docs + "not json\n");
  const std::string cmd = fmt::format(
      "{} --input {} {} --output-prefix {} --workers 1 --log-interval 500 --batch-mb 0.05 --max-bad-fraction 1",
      testing::Tool("ptk-tokenize"), dir / "a.jsonl", dir / "b.jsonl", dir / "out");
  // A status line every millisecond: many chances to collide.
  auto r = RunCmd("PTK_PROGRESS_INTERVAL=0.001 script -qfec " + testing::ShellQuote(cmd) + " /dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_NE(r.output.find("\r\033[Ktokenize: "), std::string::npos) << "no status line drawn: " << r.output;
  int processed = 0;
  for (const std::string& line : Screen(r.output)) {
    for (const char* start : {"Processed ", "Opening ", "ptk-tokenize: "}) {
      const size_t at = line.find(start);
      if (at == std::string::npos) continue;
      EXPECT_EQ(at, 0u) << "a line ran into another on the screen: " << line;
      processed += std::string(start) == "Processed ";
    }
  }
  EXPECT_EQ(processed, 80);
}

// A GPTDataset sample starts and ends at token boundaries, and byte-level BPE
// tokens split characters: ptk-inspect --sample leaves out the bytes of the characters cut at its
// edges and says so (the main job printed "\ufffd\ufffd..." at the start of sample 0).
TEST(TokenizeErrors, InspectSampleTextIsNotCutInsideACharacter) {
  TempDir dir;
  auto tok = Gpt2Tokenizer::LoadDefault();
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::map<unsigned char, int32_t> byte_token;
  for (int32_t id = 0; id < 256; ++id) byte_token[static_cast<unsigned char>((*tok)->TokenBytes(id)[0])] = id;
  // The last byte of "\u00e9", "abc", then the first two bytes of a three-byte character (the
  // sample's text is its 5 input tokens: the sixth is only a label).
  std::vector<int32_t> doc = {byte_token[0xA9], byte_token['a'],  byte_token['b'],
                              byte_token['c'],  byte_token[0xE0], byte_token[0xAA]};
  std::vector<int32_t> lengths = {static_cast<int32_t>(doc.size())};
  auto b = IndexedDatasetBuilder::Create(dir / "d_text_document", DType::kUInt16);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->AddDocument(doc, lengths).ok());
  ASSERT_TRUE((*b)->Finalize().ok());
  auto r = RunCmd(testing::Tool("ptk-inspect") + " " + dir / "d_text_document" +
                  " --sample 0 --seq-length 5 --split 1,0,0 --train-samples 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("text:\nabc\n(not shown: 1 byte(s) of the character the sample starts inside, 1 of the "
                          "one it ends inside"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("\xEF\xBF\xBD"), std::string::npos) << r.output;  // no U+FFFD
}

// --input takes a directory (as NeMo's --preproc-folder does); WikiExtractor's
// extension-less wiki_00 files are inputs; NeMo's flags are honoured or refused with a reason;
// ptk-inspect takes PREFIX, PREFIX.bin or PREFIX.idx and hints at _text_document.
TEST(TokenizeErrors, DirectoriesNemoFlagsAndInspectForms) {
  TempDir dir;
  std::filesystem::create_directories(dir / "wiki/AA");
  std::filesystem::create_directories(dir / "wiki/AB");
  testing::WriteFile(dir / "wiki/AA/wiki_00", "{\"text\": \"first\"}\n");
  testing::WriteFile(dir / "wiki/AA/wiki_01", "{\"text\": \"second\"}\n");
  testing::WriteFile(dir / "wiki/AB/wiki_00", "{\"text\": \"third\"}\n");
  testing::WriteFile(dir / "wiki/AB/notes.json", "{\"text\": \"fourth\"}\n");
  testing::WriteFile(dir / "wiki/.hidden", "not an input");
  testing::WriteFile(dir / "wiki/AA/wiki_00.ptk-done", "not an input");
  testing::WriteFile(dir / "all.jsonl",
                     // natural order of the paths below wiki/: AA/wiki_00, AA/wiki_01, AB/notes.json, AB/wiki_00
                     "{\"text\": \"first\"}\n{\"text\": \"second\"}\n{\"text\": \"fourth\"}\n{\"text\": \"third\"}\n");
  testing::WriteFile(dir / "json.jsonl", "{\"text\": \"fourth\"}\n");
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "all.jsonl", dir / "ref"))).exit_code, 0);
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "json.jsonl", dir / "ref1"))).exit_code, 0);
  auto d = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "wiki", dir / "d")));
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_EQ(testing::ReadFile(dir / "d_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
  auto nemo = RunCmd(Tok(fmt::format("--input {} --preproc-folder --tokenizer-library megatron --output-prefix {}",
                                     dir / "wiki", dir / "n")));
  ASSERT_EQ(nemo.exit_code, 0) << nemo.output;  // NeMo's default filter **/*.json*: notes.json only
  EXPECT_EQ(testing::ReadFile(dir / "n_text_document.bin"), testing::ReadFile(dir / "ref1_text_document.bin"));
  for (const char* refused :
       {"--apply-ftfy", "--tokenizer-library sentencepiece", "--need-pad-id", "--retrieval-db x", "--chunk_size 64"}) {
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {} {}", dir / "wiki", dir / "x", refused)));
    EXPECT_EQ(r.exit_code, 2) << refused << ": " << r.output;
    EXPECT_NE(r.output.find("not supported"), std::string::npos) << refused << ": " << r.output;
    EXPECT_NE(r.output.find(std::string(refused).substr(0, std::string(refused).find(' '))), std::string::npos)
        << r.output;
  }
  const std::string inspect = testing::Tool("ptk-inspect") + " --verify ";
  for (const char* form : {"ref_text_document", "ref_text_document.bin", "ref_text_document.idx"}) {
    auto r = RunCmd(inspect + dir / form);
    EXPECT_EQ(r.exit_code, 0) << form << ": " << r.output;
  }
  auto hint = RunCmd(inspect + dir / "ref");
  EXPECT_EQ(hint.exit_code, 1) << hint.output;
  EXPECT_NE(hint.output.find("did you mean " + dir / "ref_text_document"), std::string::npos) << hint.output;
}

// Regression: a directory with a link back up (sub/up -> ..) made 41 copies of every document (two
// such links: a run until killed); a FIFO lost a record or hung. Files are now identified by device
// and inode: read once however they are reached; a FIFO named as input is refused by name (stdin is
// -), one below a directory is left out with a warning.
TEST(TokenizeErrors, EachFileIsReadOnceAndFifosAreRefused) {
  TempDir dir;
  std::filesystem::create_directories(dir / "in/sub");
  std::filesystem::create_directories(dir / "in/sub2");
  std::string docs;
  for (int i = 0; i < 200; ++i) docs += fmt::format("{{\"text\": \"document {}\"}}\n", i);
  testing::WriteFile(dir / "in/f0.jsonl", docs);
  testing::WriteFile(dir / "ref.jsonl", docs);
  std::filesystem::create_symlink("..", dir / "in/sub/up");
  std::filesystem::create_symlink("..", dir / "in/sub2/up2");
  std::filesystem::create_symlink("f0.jsonl", dir / "in/link.jsonl");
  ASSERT_EQ(::mkfifo((dir / "in/pipe.jsonl").c_str(), 0644), 0);
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "ref.jsonl", dir / "ref"))).exit_code, 0);
  auto r = RunCmd("timeout 60 " + Tok(fmt::format("--input {} --output-prefix {}", dir / "in", dir / "d")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(Docs(dir / "d_text_document").size(), 200u) << r.output;
  EXPECT_EQ(testing::ReadFile(dir / "d_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
  EXPECT_NE(r.output.find("left out " + dir / "in/pipe.jsonl" + ": a FIFO"), std::string::npos) << r.output;
  // One file, two spellings: read once.
  auto twice = RunCmd(
      Tok(fmt::format("--input {} {} --output-prefix {}", dir / "in/f0.jsonl", dir / "in/./f0.jsonl", dir / "t")));
  ASSERT_EQ(twice.exit_code, 0) << twice.output;
  EXPECT_EQ(Docs(dir / "t_text_document").size(), 200u);
  EXPECT_NE(twice.output.find("is the same file as"), std::string::npos) << twice.output;
  // A FIFO named as input: refused by name, nothing written, no hang.
  auto fifo =
      RunCmd("timeout 60 " + Tok(fmt::format("--input {} --output-prefix {}", dir / "in/pipe.jsonl", dir / "p")));
  EXPECT_EQ(fifo.exit_code, 1) << fifo.output;
  EXPECT_NE(fifo.output.find(dir / "in/pipe.jsonl" + " is a FIFO, not a regular file"), std::string::npos)
      << fifo.output;
  EXPECT_FALSE(testing::Exists(dir / "p_text_document.bin"));
  // stdin stays an input.
  auto in = RunCmd(Tok(fmt::format("--input - --output-prefix {} < {}", dir / "s", dir / "ref.jsonl")));
  ASSERT_EQ(in.exit_code, 0) << in.output;
  EXPECT_EQ(testing::ReadFile(dir / "s_text_document.bin"), testing::ReadFile(dir / "ref_text_document.bin"));
}

// Regression: --json-keys text text was reported as blocked by another run's lock (its own); a publish
// over a directory left *.ptk-tmp-* files and a .ptk-publish journal behind.
TEST(TokenizeErrors, DuplicateKeysAndADirectoryInTheOutputsPlace) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  auto dup =
      RunCmd(Tok(fmt::format("--input {} --output-prefix {} --json-keys text text", dir / "in.jsonl", dir / "d")));
  EXPECT_EQ(dup.exit_code, 2) << dup.output;
  EXPECT_NE(dup.output.find("--json-keys names \"text\" twice"), std::string::npos) << dup.output;
  EXPECT_EQ(dup.output.find("another run"), std::string::npos) << dup.output;
  for (const char* blocked : {"p_text_document.bin", "p_text_document.idx"}) {
    TempDir out;
    std::filesystem::create_directories(out / blocked);
    auto r = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "in.jsonl", out / "p")));
    EXPECT_EQ(r.exit_code, 1) << blocked << ": " << r.output;
    EXPECT_NE(r.output.find("a directory is in its place"), std::string::npos) << blocked << ": " << r.output;
    EXPECT_EQ(testing::Leftovers(out.path()), "") << blocked;
    size_t entries = 0;
    for (const auto& e : std::filesystem::directory_iterator(out.path())) entries += e.exists();
    EXPECT_EQ(entries, 1u) << blocked << ": only the directory is left";
  }
}

// An input that is one of the run's outputs (named like one, or reached by a glob over the output's
// directory) is refused before anything is written: it was read while its replacement was written,
// and lost (exit 0).
TEST(TokenizeErrors, AnInputThatIsAnOutputIsRefused) {
  TempDir dir;
  const std::string jsonl = "{\"text\": \"a\"}\n{\"text\": \"b\"}\n";
  testing::WriteFile(dir / "x_text_document.bin", jsonl);  // JSON lines under an output's name
  auto named = RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "x_text_document.bin", dir / "x")));
  EXPECT_EQ(named.exit_code, 1) << named.output;
  EXPECT_NE(named.output.find("is the output " + dir / "x_text_document.bin" + " of this run"), std::string::npos)
      << named.output;
  EXPECT_EQ(testing::ReadFile(dir / "x_text_document.bin"), jsonl);
  EXPECT_FALSE(testing::Exists(dir / "x_text_document.idx"));
  std::filesystem::create_directories(dir / "d");
  testing::WriteFile(dir / "d/in.jsonl", jsonl);
  ASSERT_EQ(RunCmd(Tok(fmt::format("--input {} --output-prefix {}", dir / "d/in.jsonl", dir / "d/o"))).exit_code, 0);
  const std::string bin = testing::ReadFile(dir / "d/o_text_document.bin");
  auto glob = RunCmd(Tok(fmt::format("--input '{}/*' --output-prefix {}", dir / "d", dir / "d/o")));
  EXPECT_EQ(glob.exit_code, 1) << glob.output;
  EXPECT_NE(glob.output.find("is the output"), std::string::npos) << glob.output;
  EXPECT_EQ(testing::ReadFile(dir / "d/o_text_document.bin"), bin);
}

TEST(TokenizeErrors, HundredMegabyteDocument) {
  TempDir dir;
  {
    std::ofstream f(dir / "big.jsonl", std::ios::binary);
    f << "{\"text\": \"";
    std::string chunk;
    for (int i = 0; i < 1000; ++i) chunk += "word" + std::to_string(i % 97) + " ";
    size_t written = 0;
    while (written < (100u << 20)) {
      f << chunk;
      written += chunk.size();
    }
    f << "\"}\n{\"text\": \"after\"}\n";
  }
  auto r = RunCmd(
      Tok(fmt::format("--input {} --output-prefix {} --append-eod --workers 2", dir / "big.jsonl", dir / "out")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ds = IndexedDataset::Open(dir / "out_text_document");
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ((*ds)->num_documents(), 2);
  EXPECT_GT((*ds)->document_length(0), 20000000);
  EXPECT_EQ((*ds)->document(1).ToVector(), (std::vector<int64_t>{8499, 50256}));
}

// The record parser alone: Python json.loads semantics on what simdjson rejects.
TEST(JsonRecordParser, PythonCompatibleSlowPath) {
  JsonRecordParser p({"text"});
  // json.loads('\ufeff{"text": "a"}') and json.loads('\ufeff'): "Unexpected UTF-8 BOM", whatever follows.
  for (const char* bom_line : {"\xEF\xBB\xBF{\"text\": \"a\"}", "\xEF\xBB\xBF", "\xEF\xBB\xBF  "}) {
    auto r = p.Parse(bom_line, false);
    EXPECT_EQ(r.status, RecordStatus::kMalformed) << bom_line;
    EXPECT_EQ(r.message, "Unexpected UTF-8 BOM") << bom_line;
  }
  auto parse = [&](const std::string& s) { return p.Parse(s, false); };
  EXPECT_EQ(parse("{\"text\": \"a\", \"n\": NaN, \"i\": -Infinity}").status, RecordStatus::kOk);
  EXPECT_EQ(parse("{\"text\": \"a\", \"big\": 123456789012345678901234567890}").status, RecordStatus::kOk);
  auto dup = parse("{\"text\": \"first\", \"text\": \"second\"}");
  ASSERT_EQ(dup.status, RecordStatus::kOk);
  EXPECT_EQ(p.fields()[0][0], "second");
  EXPECT_EQ(parse("{\"text\": \"a\x01\"}").status, RecordStatus::kMalformed);  // raw control character
  EXPECT_EQ(parse("{\"text\": \"a\",}").status, RecordStatus::kMalformed);     // trailing comma
  EXPECT_EQ(parse("{\"text\": 01}").status, RecordStatus::kMalformed);
  EXPECT_EQ(parse("{\"text\": \"\\x\"}").status, RecordStatus::kMalformed);  // invalid escape
  EXPECT_EQ(parse("  ").status, RecordStatus::kBlank);
  EXPECT_EQ(parse("\"just a string\"").status, RecordStatus::kNotObject);
  std::string deep(5000, '[');
  EXPECT_EQ(parse("{\"x\": " + deep).status, RecordStatus::kMalformed);  // no stack overflow
  auto sur = parse("{\"text\": \"\\ud800\\ud800\\udc00\"}");
  ASSERT_EQ(sur.status, RecordStatus::kOk);
  EXPECT_EQ(sur.lone_surrogates, 1u);
  EXPECT_EQ(p.fields()[0][0], "\xEF\xBF\xBD\xF0\x90\x80\x80");
  auto list = parse("{\"text\": [\"one\", \"two\"]}");
  ASSERT_EQ(list.status, RecordStatus::kOk);
  EXPECT_EQ(p.fields()[0].size(), 2u);
}

// The library words its refusals by setting, not by flag (only ptk-tokenize's main knows the flags),
// and refuses before it reads an input or writes an output.
TEST(TokenizeErrors, TheLibraryNamesTheSettingNotAFlag) {
  TempDir dir;
  testing::WriteFile(dir / "in.jsonl", "{\"text\": \"a\"}\n");
  auto tok = Gpt2Tokenizer::LoadDefault();
  ASSERT_TRUE(tok.ok()) << tok.status();
  TokenizeOptions opt;
  opt.inputs = {dir / "in.jsonl"};
  opt.output_prefix = dir / "out";
  opt.partitions = 0;
  auto zero = RunTokenize(opt, **tok);
  ASSERT_FALSE(zero.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(zero.status())) << zero.status();
  EXPECT_EQ(zero.status().message(), "partitions 0: the round-robin partition count must be at least 1");
  opt.partitions = 1;
  opt.json_keys.clear();
  auto no_keys = RunTokenize(opt, **tok);
  ASSERT_FALSE(no_keys.ok());
  EXPECT_EQ(no_keys.status().message(), "no JSON keys: json_keys names no key to tokenize");
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
  EXPECT_FALSE(testing::Exists(dir / "out_text_document.bin"));
}

// Interrupted (Ctrl-C, a scheduler's SIGTERM), ptk-merge left its partial output (OUT.bin.ptk-tmp-*, as
// large as what was merged so far) and OUT.ptk-lock naming the dead run. Now it removes them and dies of
// the signal (its temporaries are handed to the publish journal before the journal is written, so the
// cleanup never removes what a journal names); a rerun completes the merge and leaves nothing else.
// The run is stopped (SIGSTOP) while its temporary exists, signalled, then continued.
TEST(TokenizeErrors, AnInterruptedMergeRemovesItsPartialOutput) {
  TempDir dir;
  std::string inputs;
  std::vector<int32_t> tokens(1 << 22), lengths = {1 << 22};
  for (int i = 0; i < 8; ++i) {
    for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = static_cast<int32_t>((k * 7 + i) % 50000);
    const std::string prefix = dir / fmt::format("in{}", i);
    auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE((*b)->AddDocument(tokens, lengths).ok());
    ASSERT_TRUE((*b)->Finalize().ok());
    inputs += " " + prefix;
  }
  std::filesystem::create_directories(dir / "out");
  const std::string out = dir / "out",
                    cmd = testing::Tool("ptk-merge") + " --inputs" + inputs + " --output-prefix " + out + "/m";
  auto count = [&](const char* tag) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(out))
      n += e.path().filename().string().find(tag) != std::string::npos;
    return n;
  };
  struct sigaction dfl {
  }, saved{};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, &saved);  // not inherited as ignored (a background job's)
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(strsignal(sig));
    bool landed = false;
    for (int attempt = 0; attempt < 10 && !landed; ++attempt) {
      std::filesystem::remove_all(out);
      std::filesystem::create_directories(out);
      const pid_t pid = testing::SpawnShell(cmd, dir / "log");
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (count(".ptk-tmp") == 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      ::kill(pid, SIGSTOP);
      const bool mid_write = count(".ptk-tmp") > 0 && count(".ptk-publish") == 0;
      ::kill(pid, sig);
      ::kill(pid, SIGCONT);
      const int rc = testing::WaitExit(pid);
      if (!mid_write || rc == 0) continue;  // finished first (a fast machine): again
      landed = true;
      EXPECT_EQ(rc, 128 + sig) << testing::ReadFile(dir / "log");
      EXPECT_EQ(count(".ptk-tmp"), 0) << testing::ReadFile(dir / "log");
      EXPECT_EQ(count(".ptk-lock"), 0) << testing::ReadFile(dir / "log");
    }
    EXPECT_TRUE(landed) << "the merge always finished before it could be interrupted";
    auto rerun = RunCmd(cmd);
    ASSERT_EQ(rerun.exit_code, 0) << rerun.output;
    auto ds = IndexedDataset::Open(out + "/m");
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ((*ds)->num_tokens(), 8 << 22);
    EXPECT_EQ(testing::Leftovers(out), "");
  }
  ::sigaction(SIGINT, &saved, nullptr);
}

}  // namespace
}  // namespace ptk
