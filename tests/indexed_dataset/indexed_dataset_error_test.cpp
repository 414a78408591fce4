// IndexedDataset on damaged files: every corruption gives kDataLoss naming the file and the field;
// nothing crashes or reads out of bounds (this binary also runs under AddressSanitizer in CI).
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "indexed_dataset/indexed_dataset.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using ::ptk::testing::TempDir;

class CorruptIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "d";
    auto b = IndexedDatasetBuilder::Create(prefix_, DType::kUInt16);
    ASSERT_TRUE(b.ok());
    std::vector<int32_t> t1 = {1, 2, 3, 4}, l1 = {3, 1}, t2 = {5, 6, 7}, l2 = {3};
    ASSERT_TRUE((*b)->AddDocument(t1, l1).ok());
    ASSERT_TRUE((*b)->AddDocument({}, {}).ok());
    ASSERT_TRUE((*b)->AddDocument(t2, l2).ok());
    ASSERT_TRUE((*b)->Finalize().ok());
    idx_ = testing::ReadFile(prefix_ + ".idx");
    bin_ = testing::ReadFile(prefix_ + ".bin");
    // S = 3 sequences, D = 4 document indices.
    ASSERT_EQ(idx_.size(), 34u + 12 * 3 + 8 * 4);
  }
  template <typename T>
  void Put(size_t off, T v) {
    std::memcpy(idx_.data() + off, &v, sizeof(T));
  }
  // Writes the (modified) files and expects Open to fail with kDataLoss mentioning `needle`.
  void ExpectDataLoss(const std::string& needle, const std::string& file_suffix = ".idx") {
    testing::WriteFile(prefix_ + ".idx", idx_);
    testing::WriteFile(prefix_ + ".bin", bin_);
    auto ds = IndexedDataset::Open(prefix_);
    ASSERT_FALSE(ds.ok()) << "corruption not detected (" << needle << ")";
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss) << ds.status();
    std::string msg(ds.status().message());
    EXPECT_NE(msg.find(prefix_ + file_suffix), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
  static constexpr size_t kLengths = 34, kPointers = 34 + 12, kDocIdx = 34 + 36;
  TempDir dir_;
  std::string prefix_, idx_, bin_;
};

TEST_F(CorruptIndexTest, ValidFileOpens) {
  auto ds = IndexedDataset::Open(prefix_);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE((*ds)->Verify().ok());
}

TEST_F(CorruptIndexTest, TruncatedIndex) {
  std::string full = idx_;
  for (size_t cut : {size_t{0}, size_t{5}, size_t{20}, size_t{33}}) {
    idx_ = full.substr(0, cut);
    ExpectDataLoss("shorter than the 34-byte header");
  }
  for (size_t cut : {size_t{34}, size_t{60}, full.size() - 1}) {
    idx_ = full.substr(0, cut);
    ExpectDataLoss("truncated or corrupt");
  }
}

// An index opened with the other modality says so, each way (a single-modal one opened as
// multimodal was "truncated or corrupt", as ptk-merge --multimodal reported it).
TEST_F(CorruptIndexTest, TheOtherModalityIsNamed) {
  auto as_multi = IndexedDataset::Open(prefix_, /*multimodal=*/true);
  ASSERT_FALSE(as_multi.ok());
  EXPECT_NE(as_multi.status().message().find("no modes array: not a multimodal index"), std::string::npos)
      << as_multi.status();
  // A multimodal index opened as single-modal is read as Megatron reads it, its modes trailing bytes,
  // and the warning about them says what they may be.
  idx_ += std::string(3, '\0');  // a modes byte for each of the 3 sequences
  testing::WriteFile(prefix_ + ".idx", idx_);
  auto as_single = IndexedDataset::Open(prefix_);
  ASSERT_TRUE(as_single.ok()) << as_single.status();
  EXPECT_NE((*as_single)->IdxTrailingBytesWarning().find("a multimodal index's modes? open it as multimodal"),
            std::string::npos)
      << (*as_single)->IdxTrailingBytesWarning();
  auto as_multi_now = IndexedDataset::Open(prefix_, /*multimodal=*/true);
  ASSERT_TRUE(as_multi_now.ok());
  EXPECT_EQ((*as_multi_now)->IdxTrailingBytesWarning(), "");
}

// Megatron's _IndexReader reads each array of the .idx by its count and ignores what follows; ptk
// refused such a file ("file is N bytes but ... need M (truncated or corrupt)"). Now it reads it as
// Megatron does, and the warning names the file, the offset and the count. A file Megatron's
// preprocess_data.py wrote, with 5 bytes appended.
TEST(TrailingIndexBytes, AreIgnoredAsMegatronsReaderIgnoresThem) {
  TempDir dir;
  const std::string real = testing::SourceDir() + "/tests/data/megatron_preprocess/eod_text_document";
  const std::string prefix = dir / "eod_text_document";
  const std::string idx = testing::ReadFile(real + ".idx");
  testing::WriteFile(prefix + ".bin", testing::ReadFile(real + ".bin"));
  testing::WriteFile(prefix + ".idx", idx + "\x01\x02\x03\x04\x05");
  auto want = IndexedDataset::Open(real);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ((*want)->idx_trailing_bytes(), 0u);
  EXPECT_EQ((*want)->IdxTrailingBytesWarning(), "");
  auto got = IndexedDataset::Open(prefix);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)->Verify().ok());
  EXPECT_EQ((*got)->idx_trailing_bytes(), 5u);
  EXPECT_EQ((*got)->IdxTrailingBytesWarning(),
            fmt::format("{}.idx: 5 trailing bytes at offset {}, after the document index, ignored as Megatron's reader "
                        "ignores them",
                        prefix, idx.size()));
  ASSERT_EQ((*got)->num_documents(), (*want)->num_documents());
  ASSERT_EQ((*got)->num_sequences(), (*want)->num_sequences());
  EXPECT_EQ((*got)->num_tokens(), (*want)->num_tokens());
  for (int64_t d = 0; d < (*want)->num_documents(); ++d)
    EXPECT_EQ((*got)->document(d).ToVector(), (*want)->document(d).ToVector()) << "document " << d;
  // Still refused: a file shorter than its counts need, and counts the arrays contradict.
  testing::WriteFile(prefix + ".idx", idx.substr(0, idx.size() - 1));
  EXPECT_EQ(IndexedDataset::Open(prefix).status().code(), absl::StatusCode::kDataLoss);
  std::string fewer = idx;
  const uint64_t sequences = static_cast<uint64_t>((*want)->num_sequences()) - 1;
  std::memcpy(fewer.data() + 18, &sequences, 8);  // one sequence fewer: the arrays after it shift
  testing::WriteFile(prefix + ".idx", fewer);
  auto shifted = IndexedDataset::Open(prefix);
  EXPECT_EQ(shifted.status().code(), absl::StatusCode::kDataLoss) << shifted.status();
}

TEST_F(CorruptIndexTest, TruncatedBin) {
  bin_ = bin_.substr(0, bin_.size() - 2);
  ExpectDataLoss("past the end", ".bin");
}

// Bytes after the .bin's last sequence: read past, as Megatron's reader does, with a warning; only
// Verify (a writer's strict check) refuses them.
TEST_F(CorruptIndexTest, TrailingBytesInBinAreReadWithAWarning) {
  const size_t described = bin_.size();
  bin_ += "xx";
  testing::WriteFile(prefix_ + ".bin", bin_);
  auto ds = IndexedDataset::Open(prefix_);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->bin_trailing_bytes(), 2u);
  EXPECT_EQ((*ds)->BinTrailingBytesWarning(),
            fmt::format("{}.bin: 2 trailing bytes at offset {}, after the {} tokens {}.idx describes, ignored as "
                        "Megatron's reader ignores them (if that .idx is another dataset's, its documents are not "
                        "these)",
                        prefix_, described, (*ds)->num_tokens(), prefix_));
  absl::Status st = (*ds)->Verify();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(std::string(st.message()).find("trailing"), std::string::npos);
}

TEST_F(CorruptIndexTest, BadMagic) {
  idx_[0] = 'X';
  ExpectDataLoss("bad magic");
  idx_ = "TNTIDX\0\0" + idx_.substr(8);
  ExpectDataLoss("bad magic");
}

TEST_F(CorruptIndexTest, BadVersion) {
  Put<uint64_t>(9, 2);
  ExpectDataLoss("unsupported version 2");
}

TEST_F(CorruptIndexTest, BadDtypeCode) {
  for (uint8_t code : {uint8_t{0}, uint8_t{9}, uint8_t{255}}) {
    idx_[17] = static_cast<char>(code);
    ExpectDataLoss("unknown dtype code " + std::to_string(code));
  }
}

TEST_F(CorruptIndexTest, AbsurdCountsDoNotOverflow) {
  Put<uint64_t>(18, ~uint64_t{0});
  ExpectDataLoss("sequence_count=");
  SetUp();
  Put<uint64_t>(26, uint64_t{1} << 62);
  ExpectDataLoss("document_count=");
}

TEST_F(CorruptIndexTest, LengthPastEndOfBin) {
  Put<int32_t>(kLengths + 4 * 2, 1000);  // last sequence claims 1000 tokens
  ExpectDataLoss("past the end", ".bin");
}

TEST_F(CorruptIndexTest, NegativeLength) {
  Put<int32_t>(kLengths + 4 * 1, -5);
  ExpectDataLoss("sequence_lengths[1] = -5 is negative");
}

TEST_F(CorruptIndexTest, PointerInconsistentWithLengths) {
  Put<int64_t>(kPointers + 8 * 2, 2);
  ExpectDataLoss("sequence_pointers[2] = 2");
  SetUp();
  Put<int64_t>(kPointers + 8 * 1, int64_t{1} << 60);
  ExpectDataLoss("sequence_pointers[1]");
}

TEST_F(CorruptIndexTest, DocumentIndicesOutOfOrder) {
  // document_indices = [0, 2, 2, 3] -> [0, 2, 1, 3]
  Put<int64_t>(kDocIdx + 8 * 2, 1);
  ExpectDataLoss("must not decrease");
}

TEST_F(CorruptIndexTest, DocumentIndicesBounds) {
  Put<int64_t>(kDocIdx, 1);
  ExpectDataLoss("document_indices[0] = 1 (must be 0)");
  SetUp();
  Put<int64_t>(kDocIdx + 8 * 3, 2);
  ExpectDataLoss("last document index is 2 but sequence_count is 3");
  SetUp();
  Put<int64_t>(kDocIdx + 8 * 2, 99);
  ExpectDataLoss("exceeds sequence_count");
}

TEST_F(CorruptIndexTest, MissingFiles) {
  ::unlink((prefix_ + ".bin").c_str());
  auto ds = IndexedDataset::Open(prefix_);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(ds.status().message()).find(".bin"), std::string::npos);
}

// Random damage: Open either rejects the file or every access it then allows stays in bounds.
TEST_F(CorruptIndexTest, RandomByteFlipsNeverCrash) {
  std::mt19937 rng(12345);
  const std::string good = idx_;
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    idx_ = good;
    int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) idx_[rng() % idx_.size()] = static_cast<char>(rng());
    if (rng() % 10 == 0) idx_.resize(rng() % idx_.size());
    testing::WriteFile(prefix_ + ".idx", idx_);
    auto ds = IndexedDataset::Open(prefix_);
    if (!ds.ok()) {
      ++rejected;
      ASSERT_TRUE(ds.status().code() == absl::StatusCode::kDataLoss) << ds.status();
      continue;
    }
    int64_t sum = 0;
    for (int64_t d = 0; d < (*ds)->num_documents(); ++d) {
      TokenSpan s = (*ds)->document(d);
      for (int64_t i = 0; i < s.size; ++i) sum += s[i];
    }
    for (int64_t i = 0; i < (*ds)->num_sequences(); ++i) sum += (*ds)->sequence(i).size;
    (void)sum;
  }
  EXPECT_GT(rejected, 2000);
}

// A path where a prefix belongs (PREFIX.bin), or a prefix without its
// _text_document, gets the name meant from Open itself, so every --data-path and --inputs has it
// (was a bare "cannot open my.idx").
TEST(OpenMissingDataset, SuggestsThePrefixMeant) {
  TempDir dir;
  const std::string prefix = dir / "my_text_document";
  auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
  ASSERT_TRUE(b.ok());
  std::vector<int32_t> t = {1, 2}, l = {2};
  ASSERT_TRUE((*b)->AddDocument(t, l).ok());
  ASSERT_TRUE((*b)->Finalize().ok());
  for (const auto& [given, expect] : std::vector<std::pair<std::string, std::string>>{
           {dir / "my",
            "ptk-tokenize and Megatron name their outputs PREFIX_{key}_document: did you mean " + prefix + "?"},
           {prefix + ".bin", "a dataset is named by its prefix, without .bin or .idx: did you mean " + prefix + "?"},
           {prefix + ".idx", "did you mean " + prefix + "?"},
           {dir / "other", "no dataset here (neither " + dir / "other.idx nor " + dir / "other.bin exists)"}}) {
    auto ds = IndexedDataset::Open(given);
    ASSERT_FALSE(ds.ok()) << given;
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound) << ds.status();
    EXPECT_NE(ds.status().message().find(expect), std::string::npos) << ds.status();
  }
  // The directory the datasets are in (--data-path preprocessed): said "neither preprocessed.idx nor
  // preprocessed.bin exists"; now the datasets it holds, by the prefixes to give.
  for (const std::string& given : {dir.path(), dir.path() + "/"}) {
    auto in_dir = IndexedDataset::Open(given);
    ASSERT_FALSE(in_dir.ok()) << given;
    EXPECT_NE(in_dir.status().message().find(given +
                                             ": no dataset here: a directory; a dataset is named by its prefix "
                                             "(PREFIX.bin and PREFIX.idx): it holds " +
                                             prefix),
              std::string::npos)
        << in_dir.status();
  }
  // A training checkpoint where a dataset belongs (ptk-inspect CKPT, --data-path CKPT) is named as one.
  std::filesystem::create_directories(dir / "ck/iter_0000002/mp_rank_00");
  testing::WriteFile(dir / "ck/latest_checkpointed_iteration.txt", "2");
  testing::WriteFile(dir / "ck/iter_0000002/mp_rank_00/model_optim_rng.ptk", "PTKCKPT1");
  for (const std::string& given :
       {dir / "ck", dir / "ck/iter_0000002", dir / "ck/iter_0000002/mp_rank_00/model_optim_rng.ptk"}) {
    auto ds = IndexedDataset::Open(given);
    ASSERT_FALSE(ds.ok()) << given;
    EXPECT_NE(ds.status().message().find(given + ": no dataset here: it is a training checkpoint"), std::string::npos)
        << ds.status();
  }
  // A weight where a prefix belongs (an odd list read as prefixes only) says so.
  auto weight = IndexedDataset::Open("0.5");
  ASSERT_FALSE(weight.ok());
  EXPECT_NE(weight.status().message().find("0.5: no dataset here: a number where a dataset prefix belongs"),
            std::string::npos)
      << weight.status();
  // ptk-inspect's form takes PREFIX.bin and PREFIX.idx for PREFIX.
  auto inspect = ResolveDatasetPrefix(prefix + ".bin");
  ASSERT_TRUE(inspect.ok()) << inspect.status();
  EXPECT_EQ(*inspect, prefix);
  EXPECT_TRUE(IndexedDataset::Open(prefix).ok());
}

// What a newcomer gives first where a dataset belongs: a misspelt prefix, the jsonl itself, a wrong
// directory. Each said only "neither X.idx nor X.bin exists"; now what to give instead.
TEST(OpenMissingDataset, ATypoAJsonlOrAMissingDirectorySaysWhatToGive) {
  TempDir dir;
  const std::string prefix = dir / "train_00_text_document";
  auto b = IndexedDatasetBuilder::Create(prefix, DType::kUInt16);
  ASSERT_TRUE(b.ok());
  std::vector<int32_t> t = {1, 2}, l = {2};
  ASSERT_TRUE((*b)->AddDocument(t, l).ok());
  ASSERT_TRUE((*b)->Finalize().ok());
  testing::WriteFile(dir / "my.jsonl", "{\"text\": \"hello\"}\n");
  for (const auto& [given, expect] : std::vector<std::pair<std::string, std::string>>{
           {dir / "train_00_text_documnt", "exists); did you mean " + prefix + "?"},
           {dir / "trian_00_text_document", "exists); did you mean " + prefix + "?"},
           {dir / "my.jsonl",
            dir / "my.jsonl" +
                ": no dataset here: a file, not a dataset (a PREFIX.bin and PREFIX.idx pair, named by "
                "PREFIX); tokenize it first: ptk-tokenize --input " +
                dir / "my.jsonl" + " --output-prefix NAME writes the dataset NAME_text_document"},
           {dir / "prep/train_00_text_document", "exists); there is no directory " + dir / "prep"}}) {
    auto ds = IndexedDataset::Open(given);
    ASSERT_FALSE(ds.ok()) << given;
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound) << ds.status();
    EXPECT_NE(ds.status().message().find(expect), std::string::npos) << ds.status();
    EXPECT_EQ(ds.status().message().find('\n'), std::string::npos) << ds.status();
  }
  // A name no dataset there is near gets no guess.
  auto far = IndexedDataset::Open(dir / "validation_text_document");
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.status().message().find("did you mean"), std::string::npos) << far.status();
}

}  // namespace
}  // namespace ptk
