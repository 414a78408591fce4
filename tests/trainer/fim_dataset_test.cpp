// --fim-data against Megatron-LM's own GPTFIMDataset (tests/support/gen_fim_golden.py): numpy's binomial and
// randint draws, the first samples of each flag set token for token, the plain GPT samples when FIM is off, the
// flags' bad values (MakeFimConfig's usage errors) and ptk-train's exit 2 for them.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/numpy_random.h"
#include "tests/test_util.h"
#include "trainer/fim_codec.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;

const std::string kGolden = testing::SourceDir() + "/tests/data/fim/";

// GPT-2's vocab.json with the four FIM tokens at 50257..50260, as gen_fim_golden.py's fim_vocab writes it.
std::string WriteFimVocab(const TempDir& dir) {
  std::string json = testing::ReadFile(testing::SourceDir() + "/tokenizer/data/gpt2-vocab.json");
  const size_t end = json.rfind('}');
  json = json.substr(0, end) +
         ", \"<fim_prefix>\": 50257, \"<fim_middle>\": 50258, \"<fim_suffix>\": 50259, \"<fim_pad>\": 50260}";
  testing::WriteFile(dir / "fim-vocab.json", json);
  return dir / "fim-vocab.json";
}
std::string Merges() { return testing::SourceDir() + "/tokenizer/data/gpt2-merges.txt"; }

std::vector<std::vector<int64_t>> Texts(simdjson::dom::element rec) {
  std::vector<std::vector<int64_t>> out;
  for (auto t : rec["texts"].get_array()) {
    out.emplace_back();
    for (auto x : t.get_array()) out.back().push_back(int64_t(x));
  }
  return out;
}

// The training split of the golden's dataset (split 1,0,0, its samples), with `fim` or without.
std::shared_ptr<TopLevelDataset> Train(const TempDir& dir, simdjson::dom::element root,
                                       std::shared_ptr<const FimConfig> fim) {
  DataArgs a;
  a.data_path = {kGolden + "doc"};
  a.split = "1,0,0";
  a.sizes = {int64_t(root["num_samples"]), std::nullopt, std::nullopt};
  GPTDatasetConfig g;
  g.random_seed = static_cast<uint32_t>(int64_t(root["seed"]));
  g.sequence_length = int64_t(root["seq_length"]);
  g.split = a.split;
  g.path_to_cache = dir / "cache";
  g.fim = std::move(fim);
  auto ds = BuildGPTDatasets(a, g);
  EXPECT_TRUE(ds.ok()) << ds.status();
  return ds.ok() ? (*ds)[0] : nullptr;
}

FimOptions OptionsOf(simdjson::dom::object flags) {
  FimOptions o;
  o.enabled = true;
  for (auto [key, value] : flags) {
    if (key == "fim_rate") o.rate = double(value);
    if (key == "fim_spm_rate") o.spm_rate = double(value);
    if (key == "fim_fragment_rate") o.fragment_rate = double(value);
    if (key == "fim_split_sample") o.split_sample = std::string(std::string_view(value));
    if (key == "fim_no_prefix") o.no_prefix = std::string(std::string_view(value));
  }
  return o;
}

TEST(FimRandom, BinomialAndRandintDrawAsNumpysLegacyRandomState) {
  simdjson::dom::parser p;
  simdjson::dom::element root = p.load(kGolden + "samples.json");
  NumpyRandomState rng(7);
  int k = 0;
  for (auto d : root["rng"].get_array()) {
    simdjson::dom::array a = d.get_array();
    if (std::string_view(a.at(0)) == "b") {
      EXPECT_EQ(rng.Binomial(1, double(a.at(1))), int64_t(a.at(2))) << "draw " << k;
    } else {
      const uint64_t n = uint64_t(a.at(1));
      std::vector<int64_t> want;
      for (auto x : a.at(2).get_array()) want.push_back(int64_t(x));
      std::vector<int64_t> got = {static_cast<int64_t>(rng.RandomInterval(n)),
                                  static_cast<int64_t>(rng.RandomInterval(n))};
      EXPECT_EQ(got, want) << "draw " << k << " randint(0, " << n << " + 1)";
    }
    ++k;
  }
  EXPECT_EQ(k, 400);
}

TEST(FimDatasetGolden, SamplesEqualMegatronsGPTFIMDatasetForEachFlagSet) {
  TempDir dir;
  const std::string vocab = WriteFimVocab(dir);
  simdjson::dom::parser p;
  simdjson::dom::element root = p.load(kGolden + "samples.json");
  int configs = 0;
  for (auto [name, rec] : root["configs"].get_object()) {
    SCOPED_TRACE(std::string(name));
    auto fim = MakeFimConfig(OptionsOf(rec["flags"].get_object()), vocab, Merges());
    ASSERT_TRUE(fim.ok()) << fim.status();
    auto ds = Train(dir, root, *fim);
    ASSERT_NE(ds, nullptr);
    EXPECT_EQ(ds->size(), int64_t(rec["length"]));
    EXPECT_NE(ds->description().find("\"class\": \"GPTFIMDataset\""), std::string::npos) << ds->description();
    const auto want = Texts(rec);
    std::vector<int64_t> text(static_cast<size_t>(int64_t(root["seq_length"]) + 1));
    for (size_t i = 0; i < want.size(); ++i) {  // in order: the dataset's RNG draws as samples are read
      ASSERT_TRUE(ds->Text(static_cast<int64_t>(i), text.data(), nullptr).ok());
      EXPECT_EQ(text, want[i]) << "sample " << i;
    }
    ++configs;
  }
  EXPECT_EQ(configs, 5);
}

TEST(FimDatasetGolden, WithoutFimDataTheSamplesAreMegatronsGPTDatasets) {
  TempDir dir;
  simdjson::dom::parser p;
  simdjson::dom::element root = p.load(kGolden + "samples.json");
  auto ds = Train(dir, root, nullptr);
  ASSERT_NE(ds, nullptr);
  EXPECT_NE(ds->description().find("\"class\": \"GPTDataset\""), std::string::npos);
  const auto want = Texts(root["plain"]);
  std::vector<int64_t> text(want[0].size());
  for (size_t i = want.size(); i-- > 0;) {  // any order: no RNG
    ASSERT_TRUE(ds->Text(static_cast<int64_t>(i), text.data(), nullptr).ok());
    EXPECT_EQ(text, want[i]) << "sample " << i;
  }
}

TEST(FimConfig, BadValuesAreUsageErrorsNamingTheFlag) {
  TempDir dir;
  const std::string vocab = WriteFimVocab(dir);
  auto expect_usage = [&](FimOptions o, const std::string& vocab_file, const std::string& words) {
    auto c = MakeFimConfig(o, vocab_file, vocab_file.empty() ? "" : Merges());
    ASSERT_FALSE(c.ok()) << words;
    EXPECT_TRUE(IsUsageError(c.status())) << c.status();
    EXPECT_NE(c.status().message().find(words), std::string::npos) << c.status();
  };
  FimOptions o;
  o.enabled = true;
  auto with = [&](auto f) {
    FimOptions x = o;
    f(&x);
    return x;
  };
  expect_usage(with([](FimOptions* x) { x->rate = 1.5; }), vocab, "--fim-rate 1.5");
  expect_usage(with([](FimOptions* x) { x->spm_rate = -0.1; }), vocab, "--fim-spm-rate -0.1");
  expect_usage(with([](FimOptions* x) { x->fragment_rate = 2; }), vocab, "--fim-fragment-rate 2");
  expect_usage(with([](FimOptions* x) { x->split_sample = "Ċ"; }), vocab, "needs --fim-fragment-rate");
  // GPT-2's own vocabulary has no <fim_prefix>: Megatron would take <|endoftext|> for it.
  expect_usage(o, "", "--fim-prefix-token \"<fim_prefix>\": not a token of ptk's built-in GPT-2 vocab.json");
  expect_usage(with([](FimOptions* x) { x->pad_token = "<pad>"; }), vocab, "--fim-pad-token \"<pad>\"");
  expect_usage(with([](FimOptions* x) {
                 x->split_sample = "\n";  // vocab.json spells it Ċ
                 x->fragment_rate = 0.5;
               }),
               vocab, "--fim-split-sample");
  // Tokens of GPT-2's vocabulary as vocab.json spells them are fine.
  auto ok = MakeFimConfig(with([](FimOptions* x) {
                            x->prefix_token = x->middle_token = x->suffix_token = x->pad_token = "Ġ<";
                            x->split_sample = "Ċ";
                            x->fragment_rate = 0.5;
                          }),
                          "", "");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->split_sample, 198);
  EXPECT_EQ((*ok)->eod, 50256);
}

// ptk-train: the flags are no longer refused as unimplemented; their bad values and combinations exit 2 with one line.
TEST(FimTrainCli, BadFimFlagsExitTwo) {
  TempDir dir;
  const std::string vocab = WriteFimVocab(dir);
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --train-iters 2 --threads 1"
                           " --split 1,0,0 --data-path " +
                           ShellQuote(kGolden + "doc") + " --data-cache-path " + ShellQuote(dir / "cache") +
                           " --vocab-file " + ShellQuote(vocab) + " --merge-file " + ShellQuote(Merges()) +
                           " --fim-data";
  struct Case {
    std::string flags, words;
  };
  for (const Case& c : std::vector<Case>{
           {"--num-workers 0 --fim-rate 1.5", "--fim-rate"},
           {"--num-workers 0 --fim-spm-rate nan", "--fim-spm-rate"},
           {"--num-workers 0 --fim-split-sample Ċ", "needs --fim-fragment-rate"},
           {"--num-workers 0 --fim-middle-token '<mid>'", "--fim-middle-token \"<mid>\": not a token of"},
           {"", "--fim-data needs --num-workers 0 (given: none, Megatron's default 2)"},
           {"--num-workers 2", "--fim-data needs --num-workers 0 (given: 2)"},
       }) {
    auto r = RunCmd(base + " " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << c.flags << "\n" << r.output;
  }
  auto r = RunCmd(testing::Tool("ptk-train") +
                  " --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32"
                  " --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --train-iters 2 --mock-data --fim-data"
                  " --num-workers 0");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--fim-data with --mock-data"), std::string::npos) << r.output;
}

// A run with --fim-data trains on the FIM samples: its losses differ from the same run's without.
TEST(FimTrainCli, ARunWithFimDataTrainsOnOtherSamples) {
  TempDir dir;
  const std::string vocab = WriteFimVocab(dir);
  const std::string base = testing::Tool("ptk-train") +
                           " --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 96"
                           " --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 2 --threads 1"
                           " --log-interval 1 --num-workers 0 --split 1,0,0 --data-path " +
                           ShellQuote(kGolden + "doc") + " --data-cache-path " + ShellQuote(dir / "cache") +
                           " --vocab-file " + ShellQuote(vocab) + " --merge-file " + ShellQuote(Merges());
  auto loss = [](const std::string& out) {
    const size_t at = out.find("lm loss: ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('|', at) - at);
  };
  auto plain = RunCmd(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto fim = RunCmd(base + " --fim-data --fim-rate 1 --fim-spm-rate 0.5");
  ASSERT_EQ(fim.exit_code, 0) << fim.output;
  ASSERT_FALSE(loss(plain.output).empty()) << plain.output;
  EXPECT_NE(loss(plain.output), loss(fim.output)) << fim.output;
  std::string names;  // the index cache of Megatron's GPTFIMDataset, beside the plain run's GPTDataset's
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir / "cache"))
    names += e.path().filename().string() + "\n";
  EXPECT_NE(names.find("-GPTFIMDataset-train-"), std::string::npos) << names;
  EXPECT_NE(names.find("-GPTDataset-train-"), std::string::npos) << names;
}

}  // namespace
}  // namespace ptk
