// GPTDataset / BlendedDataset against megatron-core's own code (goldens:
// tests/support/gen_gpt_dataset_goldens.py): identical indices, byte-identical .npy cache files with
// Megatron's names, identical samples; cache reuse and repair; numpy-compatible arithmetic.
#include <unistd.h>
#include <chrono>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <set>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/py_format.h"
#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/data_loader.h"
#include "indexed_dataset/numpy_random.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

namespace fs = std::filesystem;
using testing::Chdir;
using testing::TempDir;

const std::string kGolden = testing::SourceDir() + "/tests/data/gpt_dataset/";

struct Config {
  std::string name;
  std::vector<std::string> blend;
  std::array<std::vector<std::string>, 3> per_split;
  std::string split;
  int64_t seq;
  uint32_t seed;
  std::array<std::optional<int64_t>, 3> sizes;
  bool masks = false;
};

// Mirrors CONFIGS in tests/support/gen_gpt_dataset_goldens.py.
std::vector<Config> Configs() {
  using S = std::array<std::optional<int64_t>, 3>;
  std::vector<Config> c;
  c.push_back({"tiny_8", {"gpt_data/tiny"}, {}, "1,0,0", 4, 1234, S{8, std::nullopt, std::nullopt}});
  c.push_back({"tiny_epoch", {"gpt_data/tiny"}, {}, "1,0,0", 4, 1234, S{}});
  c.push_back({"single", {"gpt_data/A"}, {}, "90, 8, 2", 32, 1234, S{900, 60, 10}});
  c.push_back({"single_seed42", {"gpt_data/A"}, {}, "80,15,5", 17, 42, S{300, 40, 20}});
  c.push_back({"near_epoch", {"gpt_data/B"}, {}, "1,0,0", 16, 7, S{250, std::nullopt, std::nullopt}});
  c.push_back({"blend3",
               {"0.3", "gpt_data/A", "0.5", "gpt_data/B", "0.2", "gpt_data/C"},
               {},
               "98,2,0",
               16,
               1234,
               S{400, 20, 0}});
  c.push_back({"blend_unweighted", {"gpt_data/A", "gpt_data/C"}, {}, "90,10,0", 16, 1234, S{100, 10, 0}});
  Config ps{"per_split", {}, {}, "", 16, 1234, S{200, 30, std::nullopt}};
  ps.per_split[0] = {"1.0", "gpt_data/A", "1.0", "gpt_data/B"};
  ps.per_split[1] = {"1.0", "gpt_data/C"};
  c.push_back(ps);
  Config m{"masks", {"gpt_data/A"}, {}, "1,0,0", 64, 5, S{40, std::nullopt, std::nullopt}};
  m.masks = true;
  c.push_back(m);
  return c;
}

// A temporary directory holding a copy of the golden datasets (gpt_data/), and the working directory
// while it lives: the configs name their data and caches relative to it.
class GoldenDataDir {
 public:
  GoldenDataDir() { fs::copy(kGolden + "gpt_data", dir_ / "gpt_data", fs::copy_options::recursive); }
  std::string operator/(const std::string& name) const { return dir_ / name; }

 private:
  TempDir dir_;
  Chdir cd_{dir_.path()};
};

absl::StatusOr<std::array<std::shared_ptr<TopLevelDataset>, 3>> BuildConfig(const Config& c) {
  DataArgs a;
  a.data_path = c.blend;
  a.per_split_data_path = c.per_split;
  if (!c.split.empty()) a.split = c.split;
  a.sizes = c.sizes;
  GPTDatasetConfig g;
  g.random_seed = c.seed;
  g.sequence_length = c.seq;
  g.tokenizer = Gpt2TokenizerIdentifiers("gpt2-vocab.json", "gpt2-merges.txt");
  g.path_to_cache = c.name + "/cache";
  g.reset_position_ids = g.reset_attention_mask = g.eod_mask_loss = c.masks;
  return BuildGPTDatasets(a, g);
}

std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> s;
  if (!fs::exists(dir)) return s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

void CheckSamples(const Config& c, const std::array<std::shared_ptr<TopLevelDataset>, 3>& ds) {
  simdjson::dom::parser p;
  simdjson::dom::element root = p.load(kGolden + c.name + "/samples.json");
  const char* names[3] = {"train", "valid", "test"};
  for (int i = 0; i < 3; ++i) {
    simdjson::dom::element split = root["splits"][names[i]];
    if (split.is_null()) {
      EXPECT_EQ(ds[i], nullptr) << c.name << " " << names[i];
      continue;
    }
    ASSERT_NE(ds[i], nullptr) << c.name << " " << names[i];
    EXPECT_EQ(ds[i]->size(), int64_t(split["length"])) << c.name << " " << names[i];
    for (auto s : split["samples"].get_array()) {
      GPTSample got;
      int64_t idx = int64_t(s["index"]);
      ASSERT_TRUE(ds[i]->Get(idx, &got).ok());
      std::vector<int64_t> tokens, labels, pos;
      std::vector<float> mask;
      for (auto x : s["tokens"].get_array()) tokens.push_back(int64_t(x));
      for (auto x : s["labels"].get_array()) labels.push_back(int64_t(x));
      for (auto x : s["position_ids"].get_array()) pos.push_back(int64_t(x));
      for (auto x : s["loss_mask"].get_array()) mask.push_back(static_cast<float>(double(x)));
      EXPECT_EQ(got.tokens, tokens) << c.name << " " << names[i] << " sample " << idx;
      EXPECT_EQ(got.labels, labels) << c.name << " " << names[i] << " sample " << idx;
      EXPECT_EQ(got.position_ids, pos) << c.name << " " << names[i] << " sample " << idx;
      EXPECT_EQ(got.loss_mask, mask) << c.name << " " << names[i] << " sample " << idx;
      EXPECT_EQ(got.dataset_id, int64_t(s["dataset_id"])) << c.name << " " << names[i] << " sample " << idx;
    }
  }
}

TEST(GPTDatasetGolden, IndicesCacheFilesAndSamplesEqualMegatrons) {
  for (const Config& c : Configs()) {
    SCOPED_TRACE(c.name);
    GoldenDataDir dir;
    auto ds = BuildConfig(c);
    ASSERT_TRUE(ds.ok()) << ds.status();
    // Same cache files, same names (MD5 of the same description), same bytes.
    auto want = Files(kGolden + c.name + "/cache"), got = Files(c.name + "/cache");
    ASSERT_EQ(got, want);
    for (const auto& f : want)
      EXPECT_TRUE(testing::ReadFile(kGolden + c.name + "/cache/" + f) == testing::ReadFile(c.name + "/cache/" + f))
          << f;
    CheckSamples(c, *ds);
    // Built again: everything comes from the cache, nothing changes.
    auto again = BuildConfig(c);
    ASSERT_TRUE(again.ok());
    for (int i = 0; i < 3; ++i)
      if ((*again)[i]) {
        EXPECT_TRUE((*again)[i]->loaded_from_cache());
      }
    CheckSamples(c, *again);
  }
}

TEST(GPTDatasetGolden, MegatronsCacheIsReusedAndACorruptOneRebuilt) {
  GoldenDataDir dir;
  fs::create_directories(dir / "single");
  fs::copy(kGolden + "single/cache", dir / "single/cache", fs::copy_options::recursive);
  const Config c = Configs()[2];
  ASSERT_EQ(c.name, "single");
  auto ds = BuildConfig(c);
  ASSERT_TRUE(ds.ok());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*ds)[i]->loaded_from_cache()) << i;  // Megatron's own files
  // Damage one file: it is rebuilt (with a warning), identical to Megatron's again.
  std::string victim;
  for (const auto& f : Files("single/cache"))
    if (f.find("train-shuffle_index") != std::string::npos) victim = "single/cache/" + f;
  ASSERT_FALSE(victim.empty());
  std::string good = testing::ReadFile(victim);
  testing::WriteFile(victim, good.substr(0, good.size() - 4));
  auto rebuilt = BuildConfig(c);
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_FALSE((*rebuilt)[0]->loaded_from_cache());
  EXPECT_TRUE(testing::ReadFile(victim) == good);
}

// A blend's cache whose entries are damaged (a dataset id past the blend's datasets, a sample past a
// dataset's end) but whose .npy headers and sizes are whole: it was used, and the sample read
// datasets_[id] out of bounds (a crash) or failed mid-run. Every entry is checked, the cache rebuilt.
TEST(GPTDatasetGolden, ABlendCacheWithEntriesOutOfRangeIsRebuilt) {
  GoldenDataDir dir;
  const Config c = Configs()[5];
  ASSERT_EQ(c.name, "blend3");
  ASSERT_TRUE(BuildConfig(c).ok());
  for (const char* array : {"dataset_index.npy", "dataset_sample_index.npy"}) {
    SCOPED_TRACE(array);
    std::string victim;
    for (const auto& f : Files("blend3/cache"))
      if (f.find(std::string("BlendedDataset-train-") + array) != std::string::npos) victim = "blend3/cache/" + f;
    ASSERT_FALSE(victim.empty());
    const std::string good = testing::ReadFile(victim);
    std::string bad = good;
    bad[bad.size() - 1] = 0x7f;  // the last entry's high byte: 32639 (int16), or 2^63 - 2^56 + ... (int64)
    testing::WriteFile(victim, bad);
    auto ds = BuildConfig(c);
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_FALSE((*ds)[0]->loaded_from_cache());
    GPTSample last;
    EXPECT_TRUE((*ds)[0]->Get((*ds)[0]->size() - 1, &last).ok());
    CheckSamples(c, *ds);
    EXPECT_TRUE(testing::ReadFile(victim) == good);
  }
}

TEST(GPTDataset, EmptySplitWithRequestedSamplesIsAnErrorNotAHang) {
  GoldenDataDir dir;
  Config c{"empty", {"gpt_data/A"}, {}, "969, 30, 1", 16, 1234, {int64_t{100}, int64_t{10}, int64_t{10}}};
  auto ds = BuildConfig(c);  // 0.1% of 120 sequences is none: Megatron loops forever here
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(ds.status().message()).find("test split holds no tokens"), std::string::npos) << ds.status();
}

// A .bin longer than its .idx describes (here another dataset's .idx beside it: B's index, A's tokens):
// Megatron's reader reads it (each sequence at its pointer, the rest never looked at), so ptk reads it
// too, as it reads an .idx's trailing bytes, with a warning naming both files, the offset and the
// count (it was refused before). The samples are those of B's index over A's first bytes.
TEST(GPTDataset, ABinLongerThanItsIndexDescribesIsReadWithAWarning) {
  GoldenDataDir dir;
  fs::copy_file(dir / "gpt_data/A.bin", dir / "gpt_data/mixed.bin");
  fs::copy_file(dir / "gpt_data/B.idx", dir / "gpt_data/mixed.idx");
  auto b = IndexedDataset::Open("gpt_data/B");
  ASSERT_TRUE(b.ok()) << b.status();
  const uint64_t described = static_cast<uint64_t>((*b)->num_tokens()) * (*b)->itemsize();
  DataArgs a;
  a.data_path = {"gpt_data/mixed"};
  a.split = "1,0,0";
  a.sizes = {int64_t{10}, std::nullopt, std::nullopt};
  GPTDatasetConfig g;
  g.random_seed = 1234;
  g.sequence_length = 16;
  g.tokenizer = Gpt2TokenizerIdentifiers("gpt2-vocab.json", "gpt2-merges.txt");
  g.path_to_cache = "mixed/cache";
  std::vector<std::string> warnings;
  auto ds = BuildGPTDatasets(a, g, &warnings);
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0], fmt::format("gpt_data/mixed.bin: {} trailing bytes at offset {}, after the {} tokens "
                                     "gpt_data/mixed.idx describes, ignored as Megatron's reader ignores them (if "
                                     "that .idx is another dataset's, its documents are not these)",
                                     11164 - described, described, (*b)->num_tokens()));
  // Too short for its index is still refused, naming the sequence that runs past the end.
  fs::resize_file(dir / "gpt_data/mixed.bin", described - 2);
  auto short_bin = BuildGPTDatasets(a, g, &warnings);
  ASSERT_FALSE(short_bin.ok());
  EXPECT_EQ(short_bin.status().code(), absl::StatusCode::kDataLoss) << short_bin.status();
  EXPECT_NE(std::string(short_bin.status().message()).find("past the end of the"), std::string::npos)
      << short_bin.status();
}

// Rewrites the dataset PREFIX at its path with its documents changed by `edit` (their tokens, in order),
// as a tokenizer run writing it again would.
void RewriteDocuments(const std::string& prefix, const std::function<void(std::vector<std::vector<int32_t>>&)>& edit) {
  auto old = IndexedDataset::Open(prefix);
  ASSERT_TRUE(old.ok()) << old.status();
  auto b = IndexedDatasetBuilder::Create(prefix + "2", (*old)->dtype());
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::vector<int32_t>> docs(static_cast<size_t>((*old)->num_sequences()));
  for (size_t i = 0; i < docs.size(); ++i) {
    TokenSpan t = (*old)->sequence(static_cast<int64_t>(i));
    for (int64_t k = 0; k < t.size; ++k) docs[i].push_back(static_cast<int32_t>(t[k]));
  }
  edit(docs);
  if (::testing::Test::HasFatalFailure()) return;
  for (const auto& ids : docs) {
    ASSERT_TRUE((*b)->AddItem(ids).ok());
    (*b)->EndDocument();
  }
  ASSERT_TRUE((*b)->Finalize().ok());
  old->reset();
  for (const char* ext : {".bin", ".idx"}) fs::rename(prefix + "2" + ext, prefix + ext);
  fs::remove(prefix + "2.ptk-done");
}

// Checks that the first `splits` splits of `stale` (config c built again after its data was rewritten)
// were rebuilt, not read from the former cache, into the samples of c built from nothing.
void ExpectRebuiltAsNew(const Config& c, const std::array<std::shared_ptr<TopLevelDataset>, 3>& stale, int splits) {
  Config fresh_config = c;
  fresh_config.name = "fresh";
  auto fresh = BuildConfig(fresh_config);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (int i = 0; i < splits; ++i) {
    SCOPED_TRACE(i);
    ASSERT_NE(stale[i], nullptr);
    EXPECT_FALSE(stale[i]->loaded_from_cache());
    ASSERT_EQ(stale[i]->size(), (*fresh)[i]->size());
    for (int64_t k = 0; k < (*fresh)[i]->size(); ++k) {
      GPTSample got, want;
      ASSERT_TRUE(stale[i]->Get(k, &got).ok()) << k;
      ASSERT_TRUE((*fresh)[i]->Get(k, &want).ok()) << k;
      ASSERT_EQ(got.tokens, want.tokens) << k;
    }
  }
}

// A dataset rewritten at its path (tokenized again without --append-eod: the same documents, each a
// token shorter) kept finding its former index cache, whose description names only the path: the
// training split's document ids were all in range, so the cache was used, and its rows pointed past
// the new documents' ends (ptk-train: "tokens [0, 17) outside sequence 4 of length 16"; with other
// contents, samples silently cut where the old documents were). The cache's lengths and rows are
// checked against the dataset as it is now, and the stale cache rebuilt.
TEST(GPTDataset, TheCacheOfADatasetRewrittenAtItsPathIsRebuilt) {
  GoldenDataDir dir;
  const Config c = Configs()[2];
  ASSERT_EQ(c.name, "single");
  ASSERT_TRUE(BuildConfig(c).ok());
  ASSERT_NO_FATAL_FAILURE(RewriteDocuments("gpt_data/A", [](std::vector<std::vector<int32_t>>& docs) {
    for (auto& ids : docs)
      if (ids.size() > 1) ids.pop_back();  // each a token shorter, a one-token document kept
  }));
  auto stale = BuildConfig(c);
  ASSERT_TRUE(stale.ok()) << stale.status();
  ASSERT_NO_FATAL_FAILURE(ExpectRebuiltAsNew(c, *stale, 3));
  // The rebuilt cache is the dataset's now: read back as it is.
  auto again = BuildConfig(c);
  ASSERT_TRUE(again.ok());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*again)[i]->loaded_from_cache()) << i;
}

// A dataset rewritten at its path with as many documents and tokens as before, one token moved from
// a document to the next: the cache's counts, its first and last rows and the middle one all still
// fit, so the stale cache was used; the rows between spanned the old documents (ptk-train: "sample 20
// is longer than 33 tokens" mid-run; samples that came out shorter were padded silently). Every row is
// checked against the dataset as it is now, and the stale cache rebuilt.
// Rewrites the dataset PREFIX with its last-but-one token of document n/3 moved to the front of the
// next document: as many documents and tokens, other samples.
void MoveATokenBetweenDocuments(const std::string& prefix) {
  RewriteDocuments(prefix, [](std::vector<std::vector<int32_t>>& docs) {
    const size_t j = docs.size() / 3;
    auto& from = docs[j];
    ASSERT_GT(from.size(), 1u);
    docs[j + 1].insert(docs[j + 1].begin(), from.back());
    from.pop_back();
  });
}

TEST(GPTDataset, TheCacheOfADatasetWhoseDocumentsChangedLengthIsRebuilt) {
  GoldenDataDir dir;
  const Config c = Configs()[2];
  ASSERT_EQ(c.name, "single");
  ASSERT_TRUE(BuildConfig(c).ok());
  ASSERT_NO_FATAL_FAILURE(MoveATokenBetweenDocuments("gpt_data/A"));
  auto stale = BuildConfig(c);
  ASSERT_TRUE(stale.ok()) << stale.status();
  ASSERT_NO_FATAL_FAILURE(ExpectRebuiltAsNew(c, *stale, 1));
}

// Every row is checked only when the data is at least as new as the cache (a whole check costs about a
// build at every start): the same rewrite with the data's times set back before the cache's passes the
// spot checks and the cache is used, as documented.
TEST(GPTDataset, OnlyDataNewerThanItsCacheIsCheckedRowByRow) {
  GoldenDataDir dir;
  const Config c = Configs()[2];
  ASSERT_TRUE(BuildConfig(c).ok());
  const auto before = fs::last_write_time("gpt_data/A.idx") - std::chrono::hours(1);
  ASSERT_NO_FATAL_FAILURE(MoveATokenBetweenDocuments("gpt_data/A"));
  for (const char* ext : {".bin", ".idx"}) fs::last_write_time(std::string("gpt_data/A") + ext, before);
  auto reused = BuildConfig(c);
  ASSERT_TRUE(reused.ok()) << reused.status();
  ASSERT_NE((*reused)[0], nullptr);
  EXPECT_TRUE((*reused)[0]->loaded_from_cache());
  fs::last_write_time("gpt_data/A.idx", fs::file_time_type::clock::now());
  auto checked = BuildConfig(c);
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_FALSE((*checked)[0]->loaded_from_cache());
}

// Per epoch every token of the split is covered exactly once, and consecutive samples share their
// boundary token (seq_length + 1 tokens per sample).
TEST(GPTDataset, SamplesTileTheEpochs) {
  GoldenDataDir dir;
  auto low = IndexedDataset::Open("gpt_data/A");
  ASSERT_TRUE(low.ok());
  std::shared_ptr<IndexedDataset> sp(std::move(*low));
  GPTDatasetConfig g;
  g.sequence_length = 13;
  g.tokenizer = Gpt2TokenizerIdentifiers("v", "m");
  g.write_cache = false;
  g.path_to_cache = "nocache";
  auto ds = GPTDataset::Build(sp, "gpt_data/A", 0, sp->num_sequences(), 1500, Split::kTrain, g);
  ASSERT_TRUE(ds.ok()) << ds.status();
  const auto& d = (*ds)->document_index();
  const auto& s = (*ds)->sample_index();
  // Document index: every sequence once per epoch (epochs are shuffled together, so count over
  // the whole index); the last epoch, shuffled on its own here, holds each exactly once.
  const int64_t n = sp->num_sequences(), epochs = (*ds)->num_epochs();
  ASSERT_GT(epochs, 2);
  ASSERT_EQ(d.size(), n * epochs);
  std::vector<int> seen(static_cast<size_t>(n), 0), last(static_cast<size_t>(n), 0);
  for (int64_t k = 0; k < d.size(); ++k) ++seen[static_cast<size_t>(d.at(k))];
  for (int x : seen) ASSERT_EQ(x, epochs);
  for (int64_t k = (epochs - 1) * n; k < d.size(); ++k) ++last[static_cast<size_t>(d.at(k))];
  for (int x : last) ASSERT_EQ(x, 1);
  // Unshuffled walk: sample k ends where sample k+1 starts, one token of overlap.
  std::vector<int64_t> flat;
  for (int64_t k = 0; k < d.size(); ++k) {
    auto doc = sp->sequence(d.at(k));
    for (int64_t i = 0; i < doc.size; ++i) flat.push_back(doc[i]);
  }
  for (int64_t k = 0; k + 1 < s.shape()[0]; ++k) {
    // position of row k in the flat stream
    auto pos = [&](int64_t row) {
      int64_t p = 0;
      for (int64_t q = 0; q < s.at(2 * row); ++q) p += sp->sequence_length(d.at(q));
      return p + s.at(2 * row + 1);
    };
    ASSERT_EQ(pos(k + 1) - pos(k), 13) << "row " << k;
    if (k > 50) break;  // the quadratic position walk is enough on a prefix
  }
}

TEST(PretrainingSampler, MegatronIndexFormulaAndResume) {
  // GBS = mbs * dp * num_microbatches = 2 * 3 * 4 = 24; rank 1.
  const int64_t mbs = 2, dp = 3, nmb = 4, gbs = mbs * dp * nmb;
  PretrainingSampler s(200, 0, mbs, 1, dp);
  std::vector<int64_t> idx;
  for (int64_t it = 0; it < 3; ++it)
    for (int64_t m = 0; m < nmb; ++m) {
      ASSERT_TRUE(s.Next(&idx));
      EXPECT_EQ(idx, (std::vector<int64_t>{it * gbs + m * mbs * dp + 1 * mbs, it * gbs + m * mbs * dp + 1 * mbs + 1}));
    }
  // Resuming from consumed samples continues exactly where a longer run would be.
  PretrainingSampler resumed(200, 3 * gbs, mbs, 1, dp);
  ASSERT_TRUE(s.Next(&idx));
  std::vector<int64_t> idx2;
  ASSERT_TRUE(resumed.Next(&idx2));
  EXPECT_EQ(idx, idx2);
  // An incomplete last group is dropped: 200 = 33 groups of 6 + 2.
  PretrainingSampler tail(200, 0, mbs, 0, dp);
  int groups = 0;
  while (tail.Next(&idx)) ++groups;
  EXPECT_EQ(groups, 33);
}

TEST(DataLoader, PrefetchedBatchesEqualDirectSamples) {
  GoldenDataDir dir;
  auto ds = BuildConfig(Configs()[8]);  // "masks": eod_mask_loss and reset_position_ids on
  ASSERT_TRUE(ds.ok());
  std::shared_ptr<TopLevelDataset> train = (*ds)[0];
  DataLoader loader(train, PretrainingSampler(train->size(), 4, 2, 0, 1), 2, 3);
  int batches = 0;
  while (true) {
    auto b = loader.Next();
    ASSERT_TRUE(b.ok());
    if (!*b) break;
    for (int64_t r = 0; r < 2; ++r) {
      GPTSample want;
      ASSERT_TRUE(train->Get((*b)->indices[r], &want).ok());
      for (int64_t t = 0; t < train->config().sequence_length; ++t) {
        size_t k = static_cast<size_t>(r * train->config().sequence_length + t);
        ASSERT_EQ((*b)->tokens[k], want.tokens[t]);
        ASSERT_EQ((*b)->labels[k], want.labels[t]);
        ASSERT_EQ((*b)->position_ids[k], want.position_ids[t]);
        ASSERT_EQ((*b)->loss_mask[k], want.loss_mask[t]);
      }
    }
    EXPECT_EQ((*b)->indices[0], 4 + 2 * batches);
    ++batches;
  }
  EXPECT_EQ(batches, (train->size() - 4) / 2);
}

// An .idx with bytes after its document index: Megatron's reader ignores them, ptk refused the file.
// ptk-inspect now reads it, warns naming the file, the offset and the count, and --verify says so.
TEST(InspectTrailingIndexBytes, AreReportedAndIgnored) {
  testing::TempDir dir;
  const std::string real = testing::SourceDir() + "/tests/data/megatron_preprocess/eod_text_document";
  const std::string prefix = dir / "eod_text_document", idx = testing::ReadFile(real + ".idx");
  testing::WriteFile(prefix + ".bin", testing::ReadFile(real + ".bin"));
  testing::WriteFile(prefix + ".idx", idx + std::string(5, '\0'));
  const std::string warning = fmt::format(
      "ptk-inspect: warning: {}.idx: 5 trailing bytes at offset {}, after the document index, ignored as Megatron's "
      "reader ignores them\n",
      prefix, idx.size());
  auto verify = testing::RunCmd(testing::Tool("ptk-inspect") + " " + testing::ShellQuote(prefix) + " --verify");
  ASSERT_EQ(verify.exit_code, 0) << verify.output;
  EXPECT_NE(verify.output.find(warning), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find("index and data consistent (the index's 5 trailing bytes ignored)"), std::string::npos)
      << verify.output;
  auto sample = testing::RunCmd(testing::Tool("ptk-inspect") + " --data-path " + testing::ShellQuote(prefix) +
                                " --sample 0 --split 1,0,0 --seq-length 4 --train-samples 8 --format ids" +
                                " --data-cache-path " + testing::ShellQuote(dir / "cache"));
  ASSERT_EQ(sample.exit_code, 0) << sample.output;
  EXPECT_NE(sample.output.find(warning), std::string::npos) << sample.output;
}

// A .bin with bytes after the sequences its .idx describes: Megatron's reader reads it; ptk refused it
// (--verify and --sample: "the two files are not one dataset's"). Now read, with one warning naming the
// .bin, the offset, the count and the .idx; --verify says so. A .bin too short stays refused, exit 1.
TEST(InspectTrailingBinBytes, AreReportedAndIgnored) {
  testing::TempDir dir;
  const std::string real = testing::SourceDir() + "/tests/data/megatron_preprocess/eod_text_document";
  const std::string prefix = dir / "eod_text_document", bin = testing::ReadFile(real + ".bin");
  testing::WriteFile(prefix + ".idx", testing::ReadFile(real + ".idx"));
  testing::WriteFile(prefix + ".bin", bin + "abcd");
  const std::string warning =
      fmt::format("ptk-inspect: warning: {}.bin: 4 trailing bytes at offset {}, after the ", prefix, bin.size());
  auto verify = testing::RunCmd(testing::Tool("ptk-inspect") + " " + testing::ShellQuote(prefix) + " --verify");
  ASSERT_EQ(verify.exit_code, 0) << verify.output;
  EXPECT_NE(verify.output.find(warning), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find("index and data consistent (the data's 4 trailing bytes ignored)"), std::string::npos)
      << verify.output;
  const std::string sample_cmd = testing::Tool("ptk-inspect") + " --data-path " + testing::ShellQuote(prefix) +
                                 " --sample 0 --split 1,0,0 --seq-length 4 --train-samples 8 --format ids" +
                                 " --data-cache-path " + testing::ShellQuote(dir / "cache");
  auto sample = testing::RunCmd(sample_cmd);
  ASSERT_EQ(sample.exit_code, 0) << sample.output;
  EXPECT_NE(sample.output.find(warning), std::string::npos) << sample.output;
  testing::WriteFile(prefix + ".bin", bin.substr(0, bin.size() - 2));
  auto short_bin = testing::RunCmd(testing::Tool("ptk-inspect") + " " + testing::ShellQuote(prefix) + " --verify");
  EXPECT_EQ(short_bin.exit_code, 1) << short_bin.output;
  EXPECT_NE(short_bin.output.find(prefix + ".bin: sequence "), std::string::npos) << short_bin.output;
  EXPECT_NE(short_bin.output.find("past the end of the"), std::string::npos) << short_bin.output;
}

TEST(InspectSample, PrintsMegatronsSample) {
  const std::string cmd = "cd " + kGolden + " && " + testing::Tool("ptk-inspect") +
                          " gpt_data/tiny --sample 0 --split 1,0,0 --seq-length 4 --train-samples 8 --format ids";
  auto r = testing::RunCmd(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokens: 4 5 6 7"), std::string::npos) << r.output;
  auto bad = testing::RunCmd("cd " + kGolden + " && " + testing::Tool("ptk-inspect") + " gpt_data/tiny --sample 0");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
}

// --write-cache whose cache could not be saved (a directory it cannot create, a full disk) printed a
// warning and the sample, exit 0: the one thing asked was not done. Exit 1 naming the directory, 3 on a
// full disk; a cache that can be saved is (four files), and a read of it is still exit 0.
TEST(InspectSample, WriteCacheThatCannotBeSavedFails) {
  testing::TempDir dir;
  testing::WriteFile(dir / "file", "x");
  const std::string cmd = "cd " + kGolden + " && " + testing::Tool("ptk-inspect") +
                          " --data-path gpt_data/tiny --sample 0 --split 1,0,0 --seq-length 4 --train-samples 8 "
                          "--format ids --write-cache --data-cache-path ";
  auto blocked = testing::RunCmd(cmd + testing::ShellQuote(dir / "file/cache"));
  EXPECT_EQ(blocked.exit_code, 1) << blocked.output;
  EXPECT_NE(blocked.output.find(dir / "file/cache: cannot save the GPTDataset index cache there"), std::string::npos)
      << blocked.output;
  auto full = testing::RunCmd("trap \"\" XFSZ; ulimit -f 0; " + cmd + testing::ShellQuote(dir / "full"));
  EXPECT_EQ(full.exit_code, 3) << full.output;
  EXPECT_NE(full.output.find(dir / "full: cannot save the GPTDataset index cache there"), std::string::npos)
      << full.output;
  auto saved = testing::RunCmd(cmd + testing::ShellQuote(dir / "ok"));
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "ok"), std::filesystem::directory_iterator()), 4);
  auto read = testing::RunCmd(cmd.substr(0, cmd.find(" --write-cache")) + " --data-cache-path " +
                              testing::ShellQuote(dir / "file/cache"));
  EXPECT_EQ(read.exit_code, 0) << read.output;
}

// Ids GPT-2's vocabulary does not hold (a dataset of another tokenizer) decoded to nothing: the text
// read as whole, exit 0. A note now counts them and names the first.
TEST(InspectSample, IdsTheTokenizerLacksAreCountedNotDroppedSilently) {
  testing::TempDir dir;
  {
    auto b = IndexedDatasetBuilder::Create(dir / "w_text_document", DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::vector<int32_t> ids = {60000, 464, 65535, 50256};
    ASSERT_TRUE((*b)->AddItem(ids).ok());
    (*b)->EndDocument();
    ASSERT_TRUE((*b)->Finalize().ok());
  }
  auto r = testing::RunCmd(testing::Tool("ptk-inspect") + " " + dir / "w_text_document" + " --doc 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ids: 60000 464 65535 50256"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(not shown: 2 id(s) the tokenizer's 50257 entries do not hold, the first 60000"),
            std::string::npos)
      << r.output;
  auto sample = testing::RunCmd(testing::Tool("ptk-inspect") + " --data-path " + dir / "w_text_document" +
                                " --sample 0 --split 1,0,0 --seq-length 2 --train-samples 1 --format text");
  EXPECT_EQ(sample.exit_code, 0) << sample.output;
  EXPECT_NE(sample.output.find("(not shown: 1 id(s) the tokenizer's 50257 entries do not hold"), std::string::npos)
      << sample.output;
  auto fine = testing::RunCmd("cd " + kGolden + " && " + testing::Tool("ptk-inspect") + " gpt_data/tiny --doc 0");
  EXPECT_EQ(fine.output.find("not shown"), std::string::npos) << fine.output;
}

// A document holding U+0000 (JSON's "\u0000", GPT-2's byte token 188) printed its text up to that byte only
// (fputs of a C string): "x" for "x\0y", the rest and the line's end dropped, exit 0. --sample too.
TEST(InspectSample, TextAfterANulByteIsPrinted) {
  testing::TempDir dir;
  {
    auto b = IndexedDatasetBuilder::Create(dir / "nul_text_document", DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::vector<int32_t> ids = {87, 188, 88, 50256};  // "x", "\0", "y", <|endoftext|>
    ASSERT_TRUE((*b)->AddItem(ids).ok());
    (*b)->EndDocument();
    ASSERT_TRUE((*b)->Finalize().ok());
  }
  const std::string want = std::string("text:\nx") + '\0' + "y<|endoftext|>\n";
  auto doc = testing::RunCmd(testing::Tool("ptk-inspect") + " " + dir / "nul_text_document" + " --doc 0 --format text");
  EXPECT_EQ(doc.exit_code, 0) << doc.output;
  EXPECT_NE(doc.output.find(want), std::string::npos) << doc.output;
  auto sample = testing::RunCmd(testing::Tool("ptk-inspect") + " --data-path " + dir / "nul_text_document" +
                                " --sample 0 --split 1,0,0 --seq-length 3 --train-samples 1 --format text");
  EXPECT_EQ(sample.exit_code, 0) << sample.output;
  EXPECT_NE(sample.output.find(std::string("text:\nx") + '\0' + "y\n"), std::string::npos) << sample.output;
}

// --eod-mask-loss and --reset-position-ids look for --vocab-file's <|endoftext|> (Megatron's
// tokenizer.eod; 999 in GPT-2's first 1000 tokens): it was always GPT-2's 50256, so with this
// vocabulary the mask masked nothing ("loss_mask zeros: 0"), with --format text and ids alike.
TEST(InspectSample, TheEodMaskLooksForTheVocabularysEndOfText) {
  testing::TempDir dir;
  {
    auto b = IndexedDatasetBuilder::Create(dir / "v_text_document", DType::kUInt16);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::vector<int32_t> ids = {10, 999, 11, 12, 999, 13, 999, 14, 50256};
    ASSERT_TRUE((*b)->AddItem(ids).ok());
    (*b)->EndDocument();
    ASSERT_TRUE((*b)->Finalize().ok());
  }
  const std::string data = testing::SourceDir() + "/tests/data/trainer/gpt2-1000-";
  const std::string cmd = testing::Tool("ptk-inspect") + " --data-path " + dir / "v_text_document" +
                          " --sample 0 --split 1,0,0 --seq-length 8 --train-samples 1 --eod-mask-loss --vocab-file " +
                          data + "vocab.json --merge-file " + data + "merges.txt --format ";
  for (const char* format : {"ids", "both"}) {
    auto r = testing::RunCmd(cmd + format);
    EXPECT_EQ(r.exit_code, 0) << format << "\n" << r.output;
    EXPECT_NE(r.output.find("tokens: 10 999 11 12 999 13 999 14\n"), std::string::npos) << format << "\n" << r.output;
    EXPECT_NE(r.output.find("loss_mask zeros: 3\n"), std::string::npos) << format << "\n" << r.output;
  }
  // GPT-2's own files (the built-in ones): 50256, which the sample's 8 tokens do not hold.
  auto gpt2 =
      testing::RunCmd(testing::Tool("ptk-inspect") + " --data-path " + dir / "v_text_document" +
                      " --sample 0 --split 1,0,0 --seq-length 8 --train-samples 1 --eod-mask-loss --format ids");
  EXPECT_EQ(gpt2.exit_code, 0) << gpt2.output;
  EXPECT_NE(gpt2.output.find("loss_mask zeros: 0\n"), std::string::npos) << gpt2.output;
}

// A flag that this combination would ignore is a usage error naming it: --stats beside --doc,
// --verify beside --sample, a --sample flag without --sample printed or checked nothing, exit 0.
TEST(InspectSample, FlagsThatWouldBeIgnoredAreUsageErrors) {
  const std::string inspect = "cd " + kGolden + " && " + testing::Tool("ptk-inspect") + " ";
  const std::pair<std::string, std::string> cases[] = {
      {"gpt_data/tiny --doc 0 --stats", "--stats prints the histogram with the summary, --doc one document"},
      {"gpt_data/tiny --sample 0 --seq-length 4 --verify", "--verify inspects the dataset PREFIX; --sample prints"},
      {"gpt_data/tiny --sample 0 --seq-length 4 --stats", "--stats inspects the dataset PREFIX"},
      {"gpt_data/tiny --seq-length 4", "--seq-length goes with --sample I, which is not given"},
      {"gpt_data/tiny --verify --split 1,0,0", "--split goes with --sample I"},
      {"gpt_data/tiny --format ids", "--format says what --doc or --sample prints; neither is given"},
      {"gpt_data/tiny --verify --vocab-file /nonexistent.json",
       "--vocab-file decodes the text --doc or --sample prints; neither is given"},
      {"gpt_data/tiny --stats --merge-file m.txt",
       "--merge-file decodes the text --doc or --sample prints; neither is given"},
      {"gpt_data/tiny --doc 0 --format ids --vocab-file v.json",
       "--vocab-file decodes the text --doc or --sample prints; --format ids prints none"},
      {"gpt_data/tiny --sample 0 --seq-length 4 --data-path gpt_data/tiny",
       "--sample reads the datasets of --data-path and ignores PREFIX gpt_data/tiny"},
  };
  for (const auto& [args, message] : cases) {
    auto r = testing::RunCmd(inspect + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("usage error: " + message), std::string::npos) << args << "\n" << r.output;
  }
  for (const char* ok : {"gpt_data/tiny --verify --stats", "gpt_data/tiny --verify --doc 0 --format ids"}) {
    auto r = testing::RunCmd(inspect + ok);
    EXPECT_EQ(r.exit_code, 0) << ok << "\n" << r.output;
  }
}

// More samples than an int32 document index (Megatron's) or an int64 token count can hold: exit 1
// naming the dataset, the split and the count (it was exit 3, a full disk, with "document index
// larger than int32"; the int64 product overflowed).
TEST(InspectSample, TooManySamplesIsNamedNotADiskFull) {
  const std::string inspect = "cd " + kGolden + " && " + testing::Tool("ptk-inspect") +
                              " gpt_data/tiny --sample 0 --split 1,0,0 --seq-length 4 --format ids --train-samples ";
  auto r = testing::RunCmd(inspect + "100000000000");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("gpt_data/tiny: the train split's 100000000000 samples need "), std::string::npos)
      << r.output;
  r = testing::RunCmd(inspect + "9223372036854775807");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("gpt_data/tiny: 9223372036854775807 samples of 4 tokens asked of the train split"),
            std::string::npos)
      << r.output;
}

TEST(NumpyCompat, ShuffleSumAndRound) {
  auto shuffled = [](uint32_t seed, int n) {
    std::vector<int32_t> a(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) a[i] = i;
    NumpyRandomState r(seed);
    r.Shuffle(a.data(), a.size());
    return a;
  };
  // numpy.random.RandomState(seed).shuffle(numpy.arange(n)) with numpy 1.24
  EXPECT_EQ(shuffled(1234, 10), (std::vector<int32_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
  EXPECT_EQ(shuffled(42, 17), (std::vector<int32_t>{0, 1, 5, 15, 11, 14, 8, 13, 2, 9, 16, 4, 7, 10, 12, 3, 6}));
  EXPECT_EQ(shuffled(0, 5), (std::vector<int32_t>{2, 0, 1, 3, 4}));
  std::vector<double> w;
  for (int i = 1; i < 200; ++i) w.push_back(0.1 * i);
  EXPECT_EQ(py::FloatRepr(py::NumpySum(w.data(), w.size())), "1990.0");  // Python's sum() gives 1990.0000000000002
  w.clear();
  for (int i = 1; i < 300; ++i) w.push_back(0.1 * i + 1e-7 * i * i);
  EXPECT_EQ(py::FloatRepr(py::NumpySum(w.data(), w.size())), "4485.895505");
  EXPECT_EQ(py::RoundHalfEven(2.5), 2);
  EXPECT_EQ(py::RoundHalfEven(3.5), 4);
  EXPECT_EQ(py::FloatRepr(1.0), "1.0");
  EXPECT_EQ(py::FloatRepr(1e-05), "1e-05");
  auto split = ParseAndNormalizeSplit("969, 30, 1");
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(MakeSplitMatrix(*split).ToJson().Dumps(0),
            "[\n[\n0,\n0.969\n],\n[\n0.969,\n0.999\n],\n[\n0.999,\n1.0\n]\n]");
  EXPECT_FALSE(ParseAndNormalizeSplit("0,0,0").ok());
}

// --split is read as Megatron reads it (every run of digits and dots a number, anything else a
// separator), but a number Python's float() refuses, or a minus sign that the regex would drop, is
// a usage error: "98.2.0" was read as 98.2 (train on everything), "-1,2,0" as 1,2,0.
TEST(GPTDataset, SplitPartsAreWholeNumbersAndNotNegative) {
  for (const char* ok : {"98,2,0", "98 2 0", "98-2-0", "98/2/0", "0.98, .02, 0.", "1e5"}) {
    auto s = ParseAndNormalizeSplit(ok);
    EXPECT_TRUE(s.ok()) << ok << ": " << s.status();
  }
  EXPECT_EQ((*ParseAndNormalizeSplit("98-2-0"))[1], (*ParseAndNormalizeSplit("98,2,0"))[1]);
  for (const char* bad : {"98.2.0", "1.2.3,1,0", ".", "-1,2,0", "1,-2,0", "1, -.5"}) {
    auto s = ParseAndNormalizeSplit(bad);
    EXPECT_TRUE(IsUsageError(s.status())) << bad << ": " << (s.ok() ? "accepted" : s.status().ToString());
  }
}

}  // namespace
}  // namespace ptk

namespace ptk {
namespace {
// The block-wise, branch-free draws and the prefetching shuffle give numpy's results: the same as
// one random_interval at a time, across powers of two and many generator refills.
class NumpyCompatPaths : public ::testing::TestWithParam<bool> {
 protected:
  // Param: whether the AVX-512 paths may run (where the CPU has them); the portable paths always
  // run with false.
  void SetUp() override {
#if defined(__x86_64__)
    saved_ = numpy_random_detail::Avx512Enabled();
    numpy_random_detail::Avx512Enabled() = GetParam() && saved_;
#endif
  }
  void TearDown() override {
#if defined(__x86_64__)
    numpy_random_detail::Avx512Enabled() = saved_;
#endif
  }
  bool saved_ = false;
};
INSTANTIATE_TEST_SUITE_P(Simd, NumpyCompatPaths, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Detected" : "Portable"; });

TEST_P(NumpyCompatPaths, GeneratorEqualsTheStandardOne) {
  for (uint32_t seed : {0u, 1u, 42u, 1234u, 4294967295u}) {
    Mt19937 a(seed);
    std::mt19937 b(seed);
    for (int i = 0; i < 5000; ++i) ASSERT_EQ(a(), b()) << "seed " << seed << " draw " << i;
  }
}

TEST_P(NumpyCompatPaths, BlockDrawsEqualOneByOne) {
  for (uint64_t hi :
       {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1000}, uint64_t{4096}, uint64_t{65537}, uint64_t{300000}}) {
    for (uint64_t lo : {uint64_t{1}, hi / 2 + 1, hi}) {
      NumpyRandomState a(99), b(99);
      std::vector<uint32_t> block(static_cast<size_t>(hi - lo + 1));  // 32-bit draws: the vector path
      a.DrawDescending(hi, lo, block.data());
      for (uint64_t i = hi; i >= lo; --i)
        ASSERT_EQ(block[static_cast<size_t>(hi - i)], b.RandomInterval(i)) << hi << " " << lo << " " << i;
      EXPECT_EQ(a.RandomInterval(12345), b.RandomInterval(12345));  // the generators stay in step
    }
  }
  // Bounds at the top of the 32-bit range (fewer than 16 draws left right below 2^32), and across
  // it (64-bit draws first).
  for (auto [hi, lo] : {std::pair<uint64_t, uint64_t>{0xFFFFFFFFull, 0xFFFFFFF8ull},
                        {0xFFFFFFFFull, 0xFFFFFFE0ull},
                        {0x100000003ull, 0xFFFFFFF0ull}}) {
    NumpyRandomState a(5), b(5);
    std::vector<uint64_t> wide(static_cast<size_t>(hi - lo + 1));
    a.DrawDescending(hi, lo, wide.data());
    for (uint64_t i = hi; i >= lo; --i)
      ASSERT_EQ(wide[static_cast<size_t>(hi - i)], b.RandomInterval(i)) << hi << " " << i;
    if (hi <= 0xFFFFFFFFull) {
      NumpyRandomState c(5);
      std::vector<uint32_t> narrow(static_cast<size_t>(hi - lo + 1) + 16, 0xABCDEF01u);
      c.DrawDescending(hi, lo, narrow.data());
      for (size_t k = 0; k < wide.size(); ++k) ASSERT_EQ(narrow[k], wide[k]) << hi << " " << k;
      for (size_t k = wide.size(); k < narrow.size(); ++k) ASSERT_EQ(narrow[k], 0xABCDEF01u) << "wrote past the draws";
    }
  }
  const size_t n = 1 << 20;
  std::vector<uint32_t> fast(n), slow(n);
  for (size_t i = 0; i < n; ++i) fast[i] = slow[i] = static_cast<uint32_t>(i);
  NumpyRandomState a(1234), b(1234);
  a.Shuffle(fast.data(), n);
  for (size_t i = n - 1; i >= 1; --i) std::swap(slow[i], slow[static_cast<size_t>(b.RandomInterval(i))]);
  EXPECT_EQ(fast, slow);
}

// Splits large enough for the two-thread build (drawing thread, ring, block-wise sample rows)
// against a straightforward build: one swap at a time as numpy's shuffle does, and helpers.cpp's
// build_sample_idx walk. Lengths include empty documents and documents longer than a sample.
TEST(GPTDataset, LargeSplitsEqualAStraightforwardBuild) {
  TempDir dir;
  Chdir cd(dir.path());
  const int64_t n = 400000;
  std::mt19937 gen(7);
  std::vector<int32_t> lens(static_cast<size_t>(n));
  for (auto& l : lens) {
    const uint32_t r = gen() % 100;
    l = r < 3 ? 0 : r < 10 ? static_cast<int32_t>(20 + gen() % 200) : static_cast<int32_t>(1 + gen() % 24);
  }
  {
    // A Megatron .idx (uint16 tokens) and a sparse .bin of the size it describes.
    std::string idx("MMIDIDX\0\0", 9);
    auto put = [&](uint64_t v, int bytes) {
      idx.append(reinterpret_cast<const char*>(&v), static_cast<size_t>(bytes));
    };
    put(1, 8);
    put(8, 1);
    put(static_cast<uint64_t>(n), 8);
    put(static_cast<uint64_t>(n + 1), 8);
    for (int32_t l : lens) put(static_cast<uint32_t>(l), 4);
    int64_t ptr = 0;
    for (int32_t l : lens) {
      put(static_cast<uint64_t>(ptr), 8);
      ptr += 2 * l;
    }
    for (int64_t i = 0; i <= n; ++i) put(static_cast<uint64_t>(i), 8);
    ASSERT_TRUE(WriteFileAtomic("big.idx", idx).ok());
    ASSERT_TRUE(WriteFileAtomic("big.bin", "").ok());
    fs::resize_file("big.bin", static_cast<uintmax_t>(ptr));
  }
  auto low = IndexedDataset::Open("big");
  ASSERT_TRUE(low.ok()) << low.status();
  std::shared_ptr<IndexedDataset> sp(std::move(*low));

  struct Case {
    int64_t beg, end, samples, seq;
    Split split;
    bool add_extra, drop_last;
  };
  int64_t tokens = 0;
  for (int32_t l : lens) tokens += l;
  const int64_t per_epoch = (tokens - 1) / 16;
  const std::vector<Case> cases = {
      {0, n, per_epoch * 2 + per_epoch / 4, 16, Split::kTrain, true, true},       // separate last epoch
      {0, n, per_epoch * 2 + per_epoch * 9 / 10, 16, Split::kTrain, true, true},  // last epoch shuffled with the rest
      {1000, n - 5, per_epoch / 2, 7, Split::kValid, true, false},                // partial last validation sample
      {0, n, per_epoch, 16, Split::kTrain, false, true},                          // no extra token
  };
  int index = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(index++);
    GPTDatasetConfig g;
    g.sequence_length = c.seq;
    g.random_seed = 4321;
    g.tokenizer = Gpt2TokenizerIdentifiers("v", "m");
    g.write_cache = false;
    g.path_to_cache = "nocache";
    g.add_extra_token_to_sequence = c.add_extra;
    g.drop_last_partial_validation_sequence = c.drop_last;
    auto ds = GPTDataset::Build(sp, "big", c.beg, c.end, c.samples, c.split, g);
    ASSERT_TRUE(ds.ok()) << ds.status();
    const IndexArray& d = (*ds)->document_index();
    const IndexArray& si = (*ds)->sample_index();
    const IndexArray& sh = (*ds)->shuffle_index();

    // The straightforward build, as Megatron's _build_document_sample_shuffle_indices does it.
    const int64_t ndocs = c.end - c.beg, add = c.add_extra ? 1 : 0;
    int64_t tpe = 0;
    for (int64_t i = c.beg; i < c.end; ++i) tpe += lens[static_cast<size_t>(i)];
    const int64_t epochs = std::max<int64_t>(1, (c.samples * c.seq + add + tpe - 1) / tpe);
    ASSERT_EQ((*ds)->num_epochs(), epochs);
    bool separate = false;
    int64_t sans = 0;
    if (epochs > 1) {
      sans = ((epochs - 1) * tpe - add) / c.seq;
      separate = c.samples - sans < static_cast<int64_t>(0.8 * static_cast<double>((tpe - add) / c.seq));
    }
    NumpyRandomState rng(4321);
    auto shuffle = [&](auto* x, int64_t m) {
      for (int64_t i = m - 1; i >= 1; --i)
        std::swap(x[i], x[static_cast<size_t>(rng.RandomInterval(static_cast<uint64_t>(i)))]);
    };
    std::vector<int32_t> doc;
    for (int64_t e = 0; e < epochs; ++e)
      for (int64_t i = c.beg; i < c.end; ++i) doc.push_back(static_cast<int32_t>(i));
    const int64_t nd = static_cast<int64_t>(doc.size());
    if (separate) {
      shuffle(doc.data(), ndocs * (epochs - 1));
      shuffle(doc.data() + ndocs * (epochs - 1), ndocs);
    } else {
      shuffle(doc.data(), nd);
    }
    ASSERT_EQ(d.size(), nd);
    for (int64_t k = 0; k < nd; ++k) ASSERT_EQ(d.at(k), doc[static_cast<size_t>(k)]) << "document_index[" << k << "]";
    int64_t ns =
        c.drop_last
            ? (epochs * tpe - add) / c.seq
            : static_cast<int64_t>(std::ceil(static_cast<float>(epochs * tpe - add) / static_cast<float>(c.seq)));
    std::vector<int64_t> rows = {0, 0};
    int64_t di = 0, off = 0;
    for (int64_t s = 1; s <= ns; ++s) {
      int64_t remaining = c.seq + add;
      while (remaining != 0) {
        const int64_t dlen = lens[static_cast<size_t>(doc[static_cast<size_t>(di)])] - off;
        remaining -= dlen;
        if (remaining <= 0) {
          off += remaining + dlen - add;
          remaining = 0;
        } else {
          if (di == nd - 1) {
            off = lens[static_cast<size_t>(doc[static_cast<size_t>(di)])] - add;
            break;
          }
          ++di;
          off = 0;
        }
      }
      rows.push_back(di);
      rows.push_back(off);
    }
    ASSERT_EQ(si.size(), static_cast<int64_t>(rows.size()));
    for (size_t r = 0; r < rows.size(); ++r)
      ASSERT_EQ(si.at(static_cast<int64_t>(r)), rows[r]) << "sample_index[" << r / 2 << "]";
    std::vector<uint32_t> shuf(static_cast<size_t>(ns));
    for (int64_t i = 0; i < ns; ++i) shuf[static_cast<size_t>(i)] = static_cast<uint32_t>(i);
    const int64_t first = separate ? sans : ns;
    shuffle(shuf.data(), first);
    if (first < ns) shuffle(shuf.data() + first, ns - first);
    ASSERT_EQ(sh.size(), ns);
    for (int64_t i = 0; i < ns; ++i) ASSERT_EQ(sh.at(i), shuf[static_cast<size_t>(i)]) << "shuffle_index[" << i << "]";
  }
}

// Megatron's --data-path: weights and prefixes, or prefixes alone; a number is the whole string.
TEST(ParseBlend, WeightsArePrefixedNumbersAndBadWeightsAreUsageErrors) {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;
  ASSERT_TRUE(ParseBlend({"0.3", "a", " +0.7", " b "}, &prefixes, &weights).ok());
  EXPECT_EQ(prefixes, (std::vector<std::string>{"a", "b"}));
  ASSERT_TRUE(weights.has_value());
  EXPECT_EQ(*weights, (std::vector<double>{0.3, 0.7}));
  // Not numbers (a trailing letter, out of double's range): every entry is a prefix.
  for (const char* not_a_number : {"1x", "1e999", "", "+-1", "0x1p3"}) {
    ASSERT_TRUE(ParseBlend({not_a_number, "a"}, &prefixes, &weights).ok()) << not_a_number;
    EXPECT_FALSE(weights.has_value()) << not_a_number;
    EXPECT_EQ(prefixes.size(), 2u) << not_a_number;
  }
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"-1", "a", "1", "b"}, {"inf", "a"}, {"nan", "a"}, {"0", "a", "0", "b"}}) {
    absl::Status st = ParseBlend(bad, &prefixes, &weights);
    EXPECT_TRUE(IsUsageError(st)) << bad[0] << ": " << st;
  }
  // A zero weight beside others (Megatron's BlendedDataset asserts weights > 0) names its dataset.
  absl::Status zero = ParseBlend({"1", "a", "0", "b"}, &prefixes, &weights);
  EXPECT_TRUE(IsUsageError(zero)) << zero;
  EXPECT_NE(std::string(zero.message()).find("data path weight \"0\" (of b) is 0"), std::string::npos) << zero;
  const absl::Status mixed = ParseBlend({"1", "a", "b", "c"}, &prefixes, &weights);
  EXPECT_TRUE(absl::IsInvalidArgument(mixed)) << mixed;
}

}  // namespace
}  // namespace ptk
