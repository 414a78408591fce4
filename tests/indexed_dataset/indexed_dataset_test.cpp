// IndexedDatasetBuilder / IndexedDataset: golden bytes, round trips, merge.
#include "indexed_dataset/indexed_dataset.h"

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "common/cli.h"
#include "common/hash.h"
#include "indexed_dataset/merge.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using ::ptk::testing::TempDir;

std::string Hex(const std::string& bytes) {
  static const char* h = "0123456789abcdef";
  std::string s;
  for (unsigned char c : bytes) {
    s += h[c >> 4];
    s += h[c & 15];
  }
  return s;
}

// The worked example of shared/reference/megatron-formats.md §1.1, produced there by running
// Megatron's preprocess_data.py (legacy GPT-2 tokenizer, --append-eod) on three documents.
TEST(IndexedDatasetBuilder, GoldenBytesOfMegatronExample) {
  TempDir dir;
  std::string prefix = dir / "ex";
  auto b = IndexedDatasetBuilder::Create(prefix, OptimalDType(50257));
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<int32_t> d1 = {15496, 995, 50256};
  std::vector<int32_t> d3 = {64, 27, 91, 437, 1659, 5239, 91, 29, 65, 50256};
  std::vector<int32_t> l1 = {3}, l3 = {10};
  ASSERT_TRUE((*b)->AddDocument(d1, l1).ok());
  ASSERT_TRUE((*b)->AddDocument({}, {}).ok());
  ASSERT_TRUE((*b)->AddDocument(d3, l3).ok());
  ASSERT_TRUE((*b)->Finalize().ok());

  std::string bin = testing::ReadFile(prefix + ".bin"), idx = testing::ReadFile(prefix + ".idx");
  EXPECT_EQ(bin.size(), 26u);
  EXPECT_EQ(idx.size(), 90u);
  EXPECT_EQ(Hex(idx),
            "4d4d49444944580000"
            "0100000000000000"
            "08"
            "0200000000000000"
            "0400000000000000"
            "03000000"
            "0a000000"
            "0000000000000000"
            "0600000000000000"
            "0000000000000000"
            "0100000000000000"
            "0100000000000000"
            "0200000000000000");
  std::string bin_sha = Sha256Hex(bin), idx_sha = Sha256Hex(idx);
  EXPECT_EQ(bin_sha.substr(0, 8), "9c76c4c3");
  EXPECT_EQ(bin_sha.substr(58), "3b6a65");
  EXPECT_EQ(idx_sha.substr(0, 8), "d2574478");
  EXPECT_EQ(idx_sha.substr(58), "5c27bc");
  EXPECT_EQ(testing::Leftovers(testing::Dirname(prefix)), "");

  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_documents(), 3);
  EXPECT_EQ((*ds)->num_sequences(), 2);
  EXPECT_EQ((*ds)->num_tokens(), 13);
  EXPECT_EQ((*ds)->document_length(1), 0);
  EXPECT_EQ((*ds)->document(2).ToVector(), std::vector<int64_t>(d3.begin(), d3.end()));
  EXPECT_TRUE((*ds)->Verify().ok());
}

struct Doc {
  std::vector<int32_t> tokens;
  std::vector<int32_t> lengths;
};

std::vector<Doc> RandomDocs(int n, int32_t max_id, uint32_t seed, int max_seqs = 3) {
  std::mt19937 rng(seed);
  std::vector<Doc> docs(n);
  for (auto& d : docs) {
    int seqs = static_cast<int>(rng() % (max_seqs + 1));  // 0 = empty document
    for (int s = 0; s < seqs; ++s) {
      int len = static_cast<int>(rng() % 50);
      d.lengths.push_back(len);
      for (int i = 0; i < len; ++i) d.tokens.push_back(static_cast<int32_t>(rng() % (max_id + 1)));
    }
  }
  return docs;
}

void WriteDocs(const std::string& prefix, DType dtype, const std::vector<Doc>& docs) {
  auto b = IndexedDatasetBuilder::Create(prefix, dtype);
  ASSERT_TRUE(b.ok()) << b.status();
  for (const auto& d : docs) ASSERT_TRUE((*b)->AddDocument(d.tokens, d.lengths).ok());
  ASSERT_TRUE((*b)->Finalize().ok());
}

void ExpectDocs(const IndexedDataset& ds, const std::vector<Doc>& docs) {
  ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(docs.size()));
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int64_t> want(docs[d].tokens.begin(), docs[d].tokens.end());
    ASSERT_EQ(ds.document(static_cast<int64_t>(d)).ToVector(), want) << "document " << d;
    int64_t first = ds.document_index(static_cast<int64_t>(d));
    ASSERT_EQ(ds.document_num_sequences(static_cast<int64_t>(d)), static_cast<int64_t>(docs[d].lengths.size()));
    for (size_t s = 0; s < docs[d].lengths.size(); ++s)
      ASSERT_EQ(ds.sequence_length(first + static_cast<int64_t>(s)), docs[d].lengths[s]);
  }
}

TEST(IndexedDataset, RoundTripUInt16) {
  TempDir dir;
  auto docs = RandomDocs(500, 50256, 1);
  WriteDocs(dir / "u16", DType::kUInt16, docs);
  auto ds = IndexedDataset::Open(dir / "u16");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->dtype(), DType::kUInt16);
  ExpectDocs(**ds, docs);
  EXPECT_TRUE((*ds)->Verify().ok());
}

TEST(IndexedDataset, RoundTripInt32LargeVocab) {
  TempDir dir;
  auto docs = RandomDocs(500, 200000, 2);
  EXPECT_EQ(OptimalDType(65500), DType::kInt32);
  EXPECT_EQ(OptimalDType(65499), DType::kUInt16);
  WriteDocs(dir / "i32", OptimalDType(200001), docs);
  auto ds = IndexedDataset::Open(dir / "i32");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->dtype(), DType::kInt32);
  ExpectDocs(**ds, docs);
  auto span = (*ds)->sequence(0);
  EXPECT_EQ(span.As<int32_t>().size(), static_cast<size_t>(span.size));
}

TEST(IndexedDataset, OnlyEmptyDocumentsAndEmptyDataset) {
  TempDir dir;
  WriteDocs(dir / "empty", DType::kUInt16, {});
  auto ds = IndexedDataset::Open(dir / "empty");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_documents(), 0);
  EXPECT_EQ((*ds)->num_tokens(), 0);
  EXPECT_EQ(testing::ReadFile(dir / "empty.idx").size(), 34u + 8u);

  WriteDocs(dir / "blank", DType::kUInt16, std::vector<Doc>(5));
  auto ds2 = IndexedDataset::Open(dir / "blank");
  ASSERT_TRUE(ds2.ok()) << ds2.status();
  EXPECT_EQ((*ds2)->num_documents(), 5);
  EXPECT_EQ((*ds2)->num_sequences(), 0);
  EXPECT_EQ((*ds2)->document(4).size, 0);
}

TEST(IndexedDataset, AddItemEndDocumentEqualsAddDocument) {
  TempDir dir;
  auto docs = RandomDocs(100, 1000, 3);
  WriteDocs(dir / "a", DType::kUInt16, docs);
  auto b = IndexedDatasetBuilder::Create(dir / "b", DType::kUInt16);
  ASSERT_TRUE(b.ok());
  for (const auto& d : docs) {
    size_t off = 0;
    for (int32_t len : d.lengths) {
      ASSERT_TRUE((*b)->AddItem(std::span<const int32_t>(d.tokens.data() + off, len)).ok());
      off += len;
    }
    (*b)->EndDocument();
  }
  ASSERT_TRUE((*b)->Finalize().ok());
  EXPECT_EQ(testing::ReadFile(dir / "a.bin"), testing::ReadFile(dir / "b.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "a.idx"), testing::ReadFile(dir / "b.idx"));
}

TEST(IndexedDataset, MillionDocuments) {
  TempDir dir;
  {
    auto b = IndexedDatasetBuilder::Create(dir / "m", DType::kUInt16);
    ASSERT_TRUE(b.ok());
    std::vector<int32_t> toks;
    for (int d = 0; d < 1000000; ++d) {
      toks.assign(static_cast<size_t>(d % 7), static_cast<int32_t>(d % 50257));
      int32_t len = static_cast<int32_t>(toks.size());
      std::vector<int32_t> lens;
      if (len > 0) lens.push_back(len);
      ASSERT_TRUE((*b)->AddDocument(toks, lens).ok());
    }
    ASSERT_TRUE((*b)->Finalize().ok());
  }
  auto ds = IndexedDataset::Open(dir / "m");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_documents(), 1000000);
  int64_t total = 0;
  for (int d = 0; d < 1000000; ++d) total += d % 7;
  EXPECT_EQ((*ds)->num_tokens(), total);
  for (int64_t d : {0, 1, 6, 999999, 123457}) {
    auto doc = (*ds)->document(d);
    ASSERT_EQ(doc.size, d % 7);
    for (int64_t i = 0; i < doc.size; ++i) EXPECT_EQ(doc[i], d % 50257);
  }
}

TEST(IndexedDataset, GetSlicesLikeMegatron) {
  TempDir dir;
  std::vector<Doc> docs = {{{1, 2, 3, 4, 5}, {5}}, {{6, 7}, {1, 1}}};
  WriteDocs(dir / "g", DType::kUInt16, docs);
  auto ds = IndexedDataset::Open(dir / "g");
  ASSERT_TRUE(ds.ok());
  auto s = (*ds)->Get(0, 1, 3);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->ToVector(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ((*ds)->Get(0, 2)->ToVector(), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_FALSE((*ds)->Get(0, 3, 3).ok());
  EXPECT_FALSE((*ds)->Get(3).ok());
  EXPECT_EQ((*ds)->sequence(2).ToVector(), (std::vector<int64_t>{7}));
}

TEST(MergeDatasets, SortedDirectoryAndExplicitOrder) {
  TempDir dir;
  ASSERT_EQ(::mkdir((dir / "parts").c_str(), 0755), 0);
  std::vector<std::vector<Doc>> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(RandomDocs(50 + i, 50000, 10 + i));
  // Written in the order 2, 0, 3, 1 under names that sort 0..3.
  for (int i : {2, 0, 3, 1}) WriteDocs(dir / ("parts/p" + std::to_string(i)), DType::kUInt16, parts[i]);
  auto prefixes = FindPrefixesInDir(dir / "parts");
  ASSERT_TRUE(prefixes.ok()) << prefixes.status();
  ASSERT_EQ(prefixes->size(), 4u);
  EXPECT_EQ((*prefixes)[0], dir / "parts/p0");
  auto st = MergeDatasets(*prefixes, dir / "merged");
  ASSERT_TRUE(st.ok()) << st.status();

  std::vector<Doc> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  auto ds = IndexedDataset::Open(dir / "merged");
  ASSERT_TRUE(ds.ok()) << ds.status();
  ExpectDocs(**ds, all);
  // Identical to writing everything with one builder.
  WriteDocs(dir / "single", DType::kUInt16, all);
  EXPECT_EQ(testing::ReadFile(dir / "merged.bin"), testing::ReadFile(dir / "single.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "merged.idx"), testing::ReadFile(dir / "single.idx"));

  auto st2 = MergeDatasets({dir / "parts/p3", dir / "parts/p1"}, dir / "explicit");
  ASSERT_TRUE(st2.ok());
  std::vector<Doc> want = parts[3];
  want.insert(want.end(), parts[1].begin(), parts[1].end());
  auto ds2 = IndexedDataset::Open(dir / "explicit");
  ASSERT_TRUE(ds2.ok());
  ExpectDocs(**ds2, want);
}

// A merge into its own input directory: its earlier output there is never an input (else a rerun
// spelled otherwise, ./parts/m for parts/m, merged m into itself, every document twice), and an
// input that is the output, however spelled, is refused.
TEST(MergeDatasets, TheOutputIsNeverAnInputHoweverSpelled) {
  TempDir dir;
  ASSERT_EQ(::mkdir((dir / "parts").c_str(), 0755), 0);
  WriteDocs(dir / "parts/a", DType::kUInt16, RandomDocs(3, 100, 1));
  WriteDocs(dir / "parts/b", DType::kUInt16, RandomDocs(4, 100, 2));
  auto first = FindPrefixesInDir(dir / "parts", dir / "parts/m");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(MergeDatasets(*first, dir / "parts/m").ok());
  for (const std::string& spelled : {dir / "parts/m", dir / "parts/./m", dir / "parts/../parts/m"}) {
    auto again = FindPrefixesInDir(dir / "parts", spelled);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *first) << spelled;
  }
  // Without the output named, it is a pair of the directory like any other.
  EXPECT_EQ(FindPrefixesInDir(dir / "parts")->size(), 3u);
  auto self = MergeDatasets({dir / "parts/a", dir / "parts/m"}, dir / "parts/./m");
  EXPECT_EQ(self.status().code(), absl::StatusCode::kInvalidArgument) << self.status();
  EXPECT_NE(self.status().message().find("is also an input"), absl::string_view::npos) << self.status();
  auto ds = IndexedDataset::Open(dir / "parts/m");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_documents(), 7);
}

// A merge of a merge of a merge: each level the same bytes as one builder writing all its documents
// (what Megatron's add_index gives; megatron_compat_test compares with it). Two inputs holding one
// dataset at any depth are refused (before, only a merge beside one of its own direct inputs was: a
// merge of a merge beside a leaf, or two merges sharing a leaf, put its documents in twice, exit 0).
TEST(MergeDatasets, MergesOfMergesAndOverlapAtAnyDepth) {
  TempDir dir;
  std::vector<std::vector<Doc>> parts;
  for (int i = 0; i < 4; ++i) {
    parts.push_back(RandomDocs(20 + i, 50000, 70 + i));
    WriteDocs(dir / ("p" + std::to_string(i)), DType::kUInt16, parts[i]);
  }
  auto merge = [&](const std::vector<std::string>& in, const std::string& out) {
    ASSERT_TRUE(CheckNoInputHoldsAnother(in).ok()) << out;
    auto src = MergeSource(in, false);
    ASSERT_TRUE(src.ok()) << src.status();
    auto st = MergeDatasets(in, out, false, *src);
    ASSERT_TRUE(st.ok()) << st.status();
  };
  ASSERT_NO_FATAL_FAILURE(merge({dir / "p0", dir / "p1"}, dir / "m1"));
  ASSERT_NO_FATAL_FAILURE(merge({dir / "m1", dir / "p2"}, dir / "m2"));
  ASSERT_NO_FATAL_FAILURE(merge({dir / "p3", dir / "m2"}, dir / "m3"));
  std::vector<Doc> all = parts[3];
  for (int i = 0; i < 3; ++i) all.insert(all.end(), parts[i].begin(), parts[i].end());
  WriteDocs(dir / "single", DType::kUInt16, all);
  EXPECT_EQ(testing::ReadFile(dir / "m3.bin"), testing::ReadFile(dir / "single.bin"));
  EXPECT_EQ(testing::ReadFile(dir / "m3.idx"), testing::ReadFile(dir / "single.idx"));

  ASSERT_NO_FATAL_FAILURE(merge({dir / "p1", dir / "p2"}, dir / "n1"));
  auto refused = [&](const std::vector<std::string>& in) {
    absl::Status st = CheckNoInputHoldsAnother(in);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    return std::string(st.message());
  };
  EXPECT_EQ(refused({dir / "p0", dir / "m3"}),
            dir / "m3 is a merge of " + dir / "p0 (through " + dir / "m1" +
                "), which is also an input: merging both would put its documents in twice; give one of them");
  EXPECT_EQ(refused({dir / "m1", dir / "n1"}), dir / "m1 and " + dir / "n1 both hold " + dir / "p1" +
                                                   ": merging both would put its documents in twice; give one of them");
  ASSERT_NO_FATAL_FAILURE(merge({dir / "p0", dir / "single"}, dir / "n0"));
  EXPECT_EQ(refused({dir / "n0", dir / "m2"}),
            dir / "n0 and " + dir / "m2 both hold " + dir / "p0 (through " + dir / "m1" +
                "): merging both would put its documents in twice; give one of them");
  EXPECT_TRUE(CheckNoInputHoldsAnother({dir / "m3", dir / "single"}).ok());
  EXPECT_TRUE(CheckNoInputHoldsAnother({dir / "m1", dir / "p2", dir / "p3"}).ok());
  // The merges between deleted: m3's record still says it holds p0.
  for (const char* gone : {"m1", "m2"})
    for (const char* ext : {".bin", ".idx", ".ptk-done"}) std::filesystem::remove(dir / (std::string(gone) + ext));
  EXPECT_EQ(refused({dir / "p0", dir / "m3"}),
            dir / "m3 is a merge of " + dir / "p0, which is also an input: merging both would put its documents in " +
                "twice; give one of them");
}

// A .bin with bytes after what its index describes (read with a warning, as Megatron reads it): the
// merge copies the described bytes only and says so (Megatron's add_index copies the rest too, which
// moves every later input's tokens off their pointers).
TEST(MergeDatasets, ABinsTrailingBytesAreLeftOut) {
  TempDir dir;
  auto a = RandomDocs(5, 50000, 81), b = RandomDocs(6, 50000, 82);
  WriteDocs(dir / "a", DType::kUInt16, a);
  WriteDocs(dir / "b", DType::kUInt16, b);
  testing::WriteFile(dir / "a.bin", testing::ReadFile(dir / "a.bin") + "xyz");
  auto st = MergeDatasets({dir / "a", dir / "b"}, dir / "m");
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->warnings.size(), 1u);
  EXPECT_NE(st->warnings[0].find(dir / "a.bin: 3 trailing bytes at offset"), std::string::npos) << st->warnings[0];
  EXPECT_NE(st->warnings[0].find("; left out of the merge"), std::string::npos) << st->warnings[0];
  auto ds = IndexedDataset::Open(dir / "m");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE((*ds)->Verify().ok());
  a.insert(a.end(), b.begin(), b.end());
  ExpectDocs(**ds, a);
}

TEST(MergeDatasets, DtypeMismatchAndMissingPairAreErrors) {
  TempDir dir;
  ASSERT_EQ(::mkdir((dir / "parts").c_str(), 0755), 0);
  WriteDocs(dir / "parts/a", DType::kUInt16, RandomDocs(3, 100, 1));
  WriteDocs(dir / "parts/b", DType::kInt32, RandomDocs(3, 100, 2));
  auto st = MergeDatasets({dir / "parts/a", dir / "parts/b"}, dir / "out");
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.status().message()).find("dtype"), std::string::npos);
  testing::WriteFile(dir / "parts/c.bin", "");
  auto pr = FindPrefixesInDir(dir / "parts");
  EXPECT_FALSE(pr.ok());
  EXPECT_NE(std::string(pr.status().message()).find(".idx file not provided"), std::string::npos);
}

TEST(IndexedDatasetBuilder, AbortLeavesNothingAndRerunOverwrites) {
  TempDir dir;
  std::string prefix = dir / "x";
  WriteDocs(prefix, DType::kUInt16, RandomDocs(10, 100, 5));
  std::string old_idx = testing::ReadFile(prefix + ".idx");
  {
    auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
    ASSERT_TRUE(b.ok());
    std::vector<int32_t> t = {1, 2, 3}, l = {3};
    ASSERT_TRUE((*b)->AddDocument(t, l).ok());
    // Destroyed without Finalize: the old dataset stays intact, no temporaries remain.
  }
  EXPECT_EQ(testing::ReadFile(prefix + ".idx"), old_idx);
  EXPECT_EQ(testing::Leftovers(testing::Dirname(prefix)), "");
  EXPECT_TRUE(IndexedDataset::Open(prefix).ok());
  auto docs = RandomDocs(20, 100, 6);
  WriteDocs(prefix, DType::kUInt16, docs);
  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok());
  ExpectDocs(**ds, docs);
}

TEST(IndexedDatasetBuilder, RejectsInconsistentLengths) {
  TempDir dir;
  auto b = IndexedDatasetBuilder::Create(dir / "x", DType::kUInt16);
  ASSERT_TRUE(b.ok());
  std::vector<int32_t> t = {1, 2, 3}, l = {2};
  EXPECT_EQ((*b)->AddDocument(t, l).code(), absl::StatusCode::kInvalidArgument);
}

// Regression: two writers of one prefix both wrote PREFIX.bin.ptk-tmp; the second is
// now refused at once, naming the first, and the first's output is untouched.
TEST(IndexedDatasetBuilder, SecondWriterOfAPrefixIsRefused) {
  TempDir dir;
  const std::string prefix = dir / "d";
  auto a = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<int32_t> t = {1, 2, 3}, l = {3};
  ASSERT_TRUE((*a)->AddDocument(t, l).ok());
  auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(IsOutputBusy(b.status())) << b.status();
  EXPECT_NE(std::string(b.status().message()).find("pid"), std::string::npos) << b.status();
  ASSERT_TRUE((*a)->Finalize().ok());
  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ((*ds)->num_tokens(), 3);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
  auto c = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);  // free again once finalized
  EXPECT_TRUE(c.ok()) << c.status();
}

// Regression: Finalize handed its temporaries to the publish journal only after writing it, so a
// signal's cleanup (ptk-merge's, cli::RemoveTemporariesOnSignals) between the two removed files the
// journal names and the dataset could not be completed. A child killed there (its cleanup run, as a
// SIGTERM runs it) leaves the journal and every file it names: the next reader completes it.
TEST(IndexedDatasetBuilder, SignalCleanupAfterTheJournalKeepsWhatItNames) {
  TempDir dir;
  const std::string prefix = dir / "d";
  const pid_t child = ::fork();
  if (child == 0) {
    SetPublishHookForTesting([] {
      RemoveLiveTemporaries();
      ::_exit(43);
    });
    auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
    std::vector<int32_t> t = {1, 2, 3, 4, 5}, l = {2, 3};
    if (!b.ok() || !(*b)->AddDocument(t, l).ok()) ::_exit(1);
    (void)(*b)->Finalize();
    ::_exit(2);  // the hook did not run
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 43) << status;
  ASSERT_TRUE(testing::Exists(PublishJournalPath(prefix)));
  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_tokens(), 5);
  EXPECT_FALSE(testing::Exists(PublishJournalPath(prefix)));
}

// Regression: Finalize released its temporaries before writing the publish journal, so a signal between
// the two found them neither tracked nor named by a journal: ptk-merge's cleanup (cli::RemoveTemporariesOnSignals,
// on its own thread) removed nothing and the process died leaving them for the next run. A merging child
// is sent SIGTERM at that point of the handover, its cleanup thread having taken the signal before the
// child goes on: it dies of the signal, and what it leaves is a dataset the next reader opens whole (a
// journal completed), with no temporary left over.
TEST(IndexedDatasetBuilder, ASignalDuringTheHandoverToTheJournalLeavesNoUntrackedTemporaries) {
  TempDir dir;
  const std::string in = dir / "in", out = dir / "out";
  WriteDocs(in, DType::kUInt16, RandomDocs(20, 1000, 4));
  const pid_t child = ::fork();
  if (child == 0) {
    std::signal(SIGTERM, SIG_DFL);      // whatever the test runner left
    cli::RemoveTemporariesOnSignals();  // as ptk-merge's main
    SetHandoverHookForTesting([] {
      ::kill(::getpid(), SIGTERM);
      sigset_t pending;
      do {  // until the cleanup thread has taken it from sigwait
        ::sched_yield();
        ::sigpending(&pending);
      } while (sigismember(&pending, SIGTERM));
    });
    (void)MergeDatasets({in}, out);
    for (;;) ::pause();  // the signal's end comes from the cleanup thread
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  auto ds = IndexedDataset::Open(out);
  ASSERT_TRUE(ds.ok()) << ds.status() << "\n" << testing::Leftovers(dir.path());
  EXPECT_EQ((*ds)->num_documents(), 20);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

TEST(IndexedDatasetBuilder, SidecarChecksumsCatchLaterDamage) {
  TempDir dir;
  const std::string prefix = dir / "d";
  WriteDocs(prefix, DType::kUInt16, RandomDocs(50, 100, 9));
  ASSERT_TRUE(testing::Exists(prefix + ".ptk-done"));
  {
    auto ds = IndexedDataset::Open(prefix);
    ASSERT_TRUE(ds.ok());
    auto ok = (*ds)->VerifyChecksums();
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_TRUE(*ok);
  }
  // Zero two tokens in the middle of the .bin: sizes and structure stay valid, the checksum does not.
  std::string bin = testing::ReadFile(prefix + ".bin");
  bin[bin.size() / 2] = 0;
  bin[bin.size() / 2 + 1] = 0;
  testing::WriteFile(prefix + ".bin", bin);
  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok());
  EXPECT_TRUE((*ds)->Verify().ok());
  auto bad = (*ds)->VerifyChecksums();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(std::string(bad.status().message()).find(prefix + ".bin"), std::string::npos) << bad.status();
  // Without a sidecar (a pair Megatron wrote) there is nothing to check.
  std::filesystem::remove(prefix + ".ptk-done");
  auto none = (*ds)->VerifyChecksums();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
}

// The sidecar's .bin checksum is computed as the bytes are written (no re-read at Finalize); it must
// still equal the file's whichever way its bytes arrived: as int32 or converted, appended from other
// files (AddIndex), or kept from a killed writer's temporary (Resume).
TEST(IndexedDatasetBuilder, SidecarChecksumMatchesTheFileWhateverWroteIt) {
  TempDir dir;
  auto verified = [](const std::string& prefix) {
    auto ds = IndexedDataset::Open(prefix);
    if (!ds.ok()) return ::testing::AssertionFailure() << ds.status();
    auto ok = (*ds)->VerifyChecksums();
    if (!ok.ok()) return ::testing::AssertionFailure() << ok.status();
    if (!*ok) return ::testing::AssertionFailure() << prefix << ": no sidecar";
    return ::testing::AssertionSuccess();
  };
  const auto docs = RandomDocs(40, 60000, 3), more = RandomDocs(30, 60000, 4);
  WriteDocs(dir / "i32", DType::kInt32, docs);
  EXPECT_TRUE(verified(dir / "i32"));
  WriteDocs(dir / "u16", DType::kUInt16, docs);
  EXPECT_TRUE(verified(dir / "u16"));
  {  // sequences one by one
    auto b = IndexedDatasetBuilder::Create(dir / "items", DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    for (const auto& d : docs) {
      size_t at = 0;
      for (int32_t len : d.lengths) {
        ASSERT_TRUE((*b)->AddItem(std::span<const int32_t>(d.tokens).subspan(at, len)).ok());
        at += len;
      }
      (*b)->EndDocument();
    }
    ASSERT_TRUE((*b)->Finalize().ok());
    EXPECT_TRUE(verified(dir / "items"));
  }
  // Appended from other files.
  WriteDocs(dir / "more", DType::kUInt16, more);
  ASSERT_TRUE(MergeDatasets({dir / "u16", dir / "more"}, dir / "merged").ok());
  EXPECT_TRUE(verified(dir / "merged"));
  // Resumed from a checkpoint: the writer "killed" (its temporary restored after it cleaned up).
  {
    auto b = IndexedDatasetBuilder::Create(dir / "resumed", DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    for (const auto& d : docs) ASSERT_TRUE((*b)->AddDocument(d.tokens, d.lengths).ok());
    auto cp = (*b)->Checkpoint();
    ASSERT_TRUE(cp.ok()) << cp.status();
    const std::string kept = testing::ReadFile(cp->bin_tmp);
    b->reset();
    testing::WriteFile(cp->bin_tmp, kept + "bytes written after the checkpoint");
    auto r = IndexedDatasetBuilder::Resume(dir / "resumed", DType::kUInt16, *cp);
    ASSERT_TRUE(r.ok()) << r.status();
    for (const auto& d : more) ASSERT_TRUE((*r)->AddDocument(d.tokens, d.lengths).ok());
    ASSERT_TRUE((*r)->Finalize().ok());
    EXPECT_TRUE(verified(dir / "resumed"));
    EXPECT_EQ(testing::ReadFile(dir / "resumed.bin"), testing::ReadFile(dir / "merged.bin"));
  }
}

// A writer killed between its renames leaves the publish journal; the next reader completes it, so
// nobody sees a new .bin beside an old .idx.
TEST(IndexedDatasetBuilder, InterruptedPublishIsCompletedByTheNextReader) {
  TempDir dir;
  const std::string prefix = dir / "d";
  auto old_docs = RandomDocs(5, 100, 1), new_docs = RandomDocs(7, 100, 2);
  WriteDocs(prefix, DType::kUInt16, new_docs);
  for (const char* ext : {".bin", ".idx", ".ptk-done"}) std::filesystem::rename(prefix + ext, prefix + ext + ".new");
  WriteDocs(prefix, DType::kUInt16, old_docs);
  // State after a kill that renamed the .bin only.
  std::filesystem::rename(prefix + ".bin.new", prefix + ".bin");
  testing::WriteFile(prefix + ".ptk-publish",
                     "ptk-publish v1\nd.bin.new\td.bin\nd.idx.new\td.idx\nd.ptk-done.new\td.ptk-done\n");
  auto ds = IndexedDataset::Open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_documents(), 7);
  EXPECT_TRUE((*ds)->Verify().ok());
  auto sums = (*ds)->VerifyChecksums();
  ASSERT_TRUE(sums.ok()) << sums.status();
  EXPECT_TRUE(*sums);
  EXPECT_EQ(testing::Leftovers(dir.path()), "");
}

}  // namespace
}  // namespace ptk
