// Sharded Hugging Face weights: --max-shard-size read as save_pretrained reads it, the tensors assigned to
// shards as huggingface_hub assigns them, the index written and read back, and every way a sharded
// directory can disagree with its index refused naming the file and the tensor (hf_transformers_test.py
// checks the files against transformers' own save_pretrained and from_pretrained).
#include "interop/hf_shards.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "interop/hf_gpt2.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using hf_detail::AssignShards;
using hf_detail::IsShardFileName;
using hf_detail::ParseMaxShardSize;
using hf_detail::ShardFileName;
using hf_detail::ShardIndexJson;
using ptk::testing::ReadFile;
using ptk::testing::RunCmd;
using ptk::testing::ShellQuote;
using ptk::testing::WriteFile;

TEST(MaxShardSize, ReadAsSavePretrainedReadsIt) {
  // huggingface_hub 0.24's parse_size_to_int: decimal units in any case, a fraction truncated to bytes.
  const std::vector<std::pair<std::string, uint64_t>> good = {
      {"5GB", 5'000'000'000},      {"500MB", 500'000'000}, {"100KB", 100'000},         {"100kb", 100'000},
      {" 1.5 GB ", 1'500'000'000}, {"1.1MB", 1'100'000},   {"2TB", 2'000'000'000'000}, {"0.0015KB", 1},
      {"1e3KB", 1'000'000},        {"1000", 1000}};
  for (const auto& [text, bytes] : good) {
    auto r = ParseMaxShardSize(text);
    ASSERT_TRUE(r.ok()) << text << ": " << r.status();
    EXPECT_EQ(*r, bytes) << text;
  }
  for (const char* bad : {"1GiB", "5G", "GB", "0KB", "-1KB", "0", "x5MB", "0x10KB", "inf GB", "", "5 GB!"}) {
    auto r = ParseMaxShardSize(bad);
    ASSERT_FALSE(r.ok()) << bad << " read as " << *r;
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(r.status().message().find("--max-shard-size"), absl::string_view::npos) << r.status();
  }
  EXPECT_NE(ParseMaxShardSize("1GiB").status().message().find("binary units"), absl::string_view::npos);
}

TEST(AssignShards, AsSplitTorchStateDictIntoShards) {
  // In order, a new shard when the next tensor would pass the limit; exactly the limit fits.
  EXPECT_EQ(AssignShards({10, 10, 10}, 25), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(AssignShards({10, 10, 10}, 20), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(AssignShards({10, 10}, 100), (std::vector<int>{0, 0}));
  // A tensor over the limit is alone, numbered when met: before the shard still filling (what
  // huggingface_hub 0.24.6 gives for these sizes).
  EXPECT_EQ(AssignShards({5, 30, 5, 5, 40, 12}, 20), (std::vector<int>{2, 0, 2, 2, 1, 3}));
  EXPECT_EQ(AssignShards({30, 5}, 20), (std::vector<int>{0, 1}));
  EXPECT_EQ(AssignShards({}, 20), (std::vector<int>{}));
}

TEST(ShardIndex, NamesAndJsonAsSavePretrainedWritesThem) {
  EXPECT_EQ(ShardFileName(1, 5), "model-00002-of-00005.safetensors");
  EXPECT_TRUE(IsShardFileName("model-00002-of-00005.safetensors"));
  for (const char* n : {"model.safetensors", "model-0002-of-00005.safetensors", "model-00002-of-00005.safetensor",
                        "pytorch_model-00002-of-00005.bin", "model-0000a-of-00005.safetensors"})
    EXPECT_FALSE(IsShardFileName(n)) << n;
  // json.dumps(index, indent=2, sort_keys=True) + "\n".
  EXPECT_EQ(
      ShardIndexJson(
          {{"b.weight", "model-00002-of-00002.safetensors"}, {"a.weight", "model-00001-of-00002.safetensors"}}, 48),
      "{\n  \"metadata\": {\n    \"total_size\": 48\n  },\n  \"weight_map\": {\n    \"a.weight\": "
      "\"model-00001-of-00002.safetensors\",\n    \"b.weight\": \"model-00002-of-00002.safetensors\"\n  }\n}\n");
}

// A small GPT-2 model exported whole and sharded.
class HfShards : public ptk::testing::HfConvertFixture {
 protected:
  void SetUp() override { SaveSmallUntiedGpt2(dir_ / "ck"); }
  absl::StatusOr<ConvertSummary> Export(const std::string& to, const std::string& max_shard_size) {
    ConvertOptions o = Opts("ptk", "hf", dir_ / "ck", to);
    o.max_shard_size = max_shard_size;
    return ExportToHf(o);
  }
  // The import's error message ("" when it succeeds).
  std::string ImportError(const std::string& from) {
    auto r = ImportFromHf(Opts("hf", "ptk", from, dir_ / ("in" + std::to_string(imports_++))));
    return r.ok() ? std::string() : std::string(r.status().message());
  }
  std::vector<float> Imported(const std::string& from) {
    const std::string to = dir_ / ("in" + std::to_string(imports_++));
    auto r = ImportFromHf(Opts("hf", "ptk", from, to));
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<float> params, m, v;
    TrainState st;
    EXPECT_TRUE(LoadCheckpoint(to, 0, layout_, &params, &m, &v, &st).ok());
    return params;
  }
  // The shards of `dir`: tensor -> file, from the files themselves; the total of their bytes.
  std::map<std::string, std::string> ShardMap(const std::string& dir, uint64_t* total) {
    std::map<std::string, std::string> map;
    *total = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (!IsShardFileName(name)) continue;
      auto f = SafetensorsFile::Open(e.path().string());
      EXPECT_TRUE(f.ok()) << f.status();
      for (const SafetensorsTensor& t : (*f)->tensors()) {
        map[t.name] = name;
        *total += t.end - t.begin;
      }
    }
    return map;
  }
  std::string Entries(const std::string& dir) {
    std::set<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) names.insert(e.path().filename().string());
    std::string out;
    for (const std::string& n : names) out += n + " ";
    return out;
  }
  std::string Sharded(const std::string& name) {
    const std::string d = dir_ / name;
    auto r = Export(d, "1KB");
    EXPECT_TRUE(r.ok()) << r.status();
    return d;
  }

  int imports_ = 0;
};

TEST_F(HfShards, ExportShardsAsSavePretrainedAndImportsBitForBit) {
  ASSERT_TRUE(Export(dir_ / "whole", "5GB").ok());
  EXPECT_EQ(Entries(dir_ / "whole"),
            "config.json generation_config.json merges.txt model.safetensors tokenizer_config.json vocab.json ");
  const std::string hf = Sharded("hf");
  // Every tensor whole, in its shard in state_dict order; the embedding (1.6 MB) alone in the first.
  std::vector<uint64_t> sizes;
  auto whole = SafetensorsFile::Open(dir_ / "whole/model.safetensors");
  ASSERT_TRUE(whole.ok());
  std::vector<std::string> names;
  for (const SafetensorsTensor& t : (*whole)->tensors()) {
    names.push_back(t.name);
    sizes.push_back(t.end - t.begin);
  }
  const std::vector<int> shard = AssignShards(sizes, 1000);
  const int n = 1 + *std::max_element(shard.begin(), shard.end());
  ASSERT_GT(n, 5);
  uint64_t total = 0;
  const std::map<std::string, std::string> map = ShardMap(hf, &total);
  ASSERT_EQ(map.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(map.at(names[i]), ShardFileName(shard[i], n)) << names[i];
  EXPECT_EQ(map.at("transformer.wte.weight"), ShardFileName(0, n));
  EXPECT_EQ(ReadFile(hf + "/model.safetensors.index.json"), ShardIndexJson(map, total));
  EXPECT_FALSE(std::filesystem::exists(hf + "/model.safetensors"));
  for (int k = 0; k < n; ++k) {
    auto f = SafetensorsFile::Open(hf + "/" + ShardFileName(k, n));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->metadata().at("format"), "pt");
    uint64_t bytes = 0;
    for (const SafetensorsTensor& t : (*f)->tensors()) bytes += t.end - t.begin;
    EXPECT_TRUE(bytes <= 1000 || (*f)->tensors().size() == 1) << k;
  }
  // Imported: the same checkpoint as the whole file's, bit for bit.
  const std::vector<float> a = Imported(dir_ / "whole"), b = Imported(hf);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a == b);
  // Re-exported over itself with fewer shards (the embedding and the output layer alone, the rest in
  // one), then whole: no shard of the earlier export is left.
  ASSERT_TRUE(Export(hf, "1MB").ok());
  EXPECT_EQ(Entries(hf),
            "config.json generation_config.json merges.txt model-00001-of-00003.safetensors "
            "model-00002-of-00003.safetensors model-00003-of-00003.safetensors model.safetensors.index.json "
            "tokenizer_config.json vocab.json ");
  EXPECT_TRUE(Imported(hf) == a);
  ASSERT_TRUE(Export(hf, "5GB").ok());
  EXPECT_EQ(Entries(hf), Entries(dir_ / "whole"));
  EXPECT_EQ(ReadFile(hf + "/model.safetensors"), ReadFile(dir_ / "whole/model.safetensors"));
}

TEST_F(HfShards, AShardedDirectoryThatDisagreesWithItsIndexIsRefused) {
  uint64_t total = 0;
  std::string d = Sharded("dup");
  std::map<std::string, std::string> map = ShardMap(d, &total);
  const std::string n = std::to_string(map.size());
  const std::string index = "/model.safetensors.index.json";
  // A tensor named twice in weight_map.
  std::string text = ReadFile(d + index);
  const size_t at = text.find("    \"transformer.ln_f.bias\"");
  const std::string line = text.substr(at, text.find('\n', at) + 1 - at);
  WriteFile(d + index, text.insert(at, line));
  EXPECT_NE(ImportError(d).find("tensor transformer.ln_f.bias is named twice in weight_map"), std::string::npos)
      << ImportError(d);
  // A name of the index missing from its file.
  d = Sharded("absent");
  map = ShardMap(d, &total);
  map["transformer.h.0.ln_1.extra"] = map.at("transformer.wpe.weight");
  WriteFile(d + index, ShardIndexJson(map, total));
  EXPECT_NE(ImportError(d).find(map.at("transformer.wpe.weight") +
                                ": tensor transformer.h.0.ln_1.extra: missing (model.safetensors.index.json places "
                                "it in this file)"),
            std::string::npos)
      << ImportError(d);
  // A file missing.
  d = Sharded("nofile");
  map = ShardMap(d, &total);
  std::remove((d + "/" + map.at("transformer.ln_f.weight")).c_str());
  EXPECT_NE(ImportError(d).find(map.at("transformer.ln_f.weight") + ": missing (model.safetensors.index.json places"),
            std::string::npos)
      << ImportError(d);
  // A tensor of a shard that the index does not name.
  d = Sharded("unnamed");
  map = ShardMap(d, &total);
  const std::string fc = map.at("transformer.h.1.mlp.c_fc.bias");
  map.erase("transformer.h.1.mlp.c_fc.bias");
  WriteFile(d + index, ShardIndexJson(map, total - 24 * 4));
  EXPECT_NE(ImportError(d).find(fc + ": tensor transformer.h.1.mlp.c_fc.bias: not in model.safetensors.index.json"),
            std::string::npos)
      << ImportError(d);
  // A tensor in two files: the one the index does not place it in is refused.
  d = Sharded("twice");
  map = ShardMap(d, &total);
  const std::string other = map.at("transformer.ln_f.bias");
  ASSERT_NE(map.at("transformer.wpe.weight"), other);
  {
    auto f = SafetensorsFile::Open(d + "/" + other);
    ASSERT_TRUE(f.ok());
    std::vector<std::vector<float>> data;
    std::vector<SafetensorsEntry> entries;
    for (const SafetensorsTensor& t : (*f)->tensors()) data.push_back(*(*f)->ReadFloat(t));
    size_t i = 0;
    for (const SafetensorsTensor& t : (*f)->tensors()) entries.push_back({t.name, t.shape, data[i++]});
    const std::vector<float> copy(16 * 8, 1.0f);
    entries.push_back({"transformer.wpe.weight", {16, 8}, copy});
    f->reset();
    ASSERT_TRUE(WriteSafetensors(d + "/" + other, entries, {{"format", "pt"}}).ok());
  }
  EXPECT_NE(ImportError(d).find(other + ": tensor transformer.wpe.weight: model.safetensors.index.json places it in " +
                                map.at("transformer.wpe.weight")),
            std::string::npos)
      << ImportError(d);
  // total_size disagreeing with the tensors' bytes.
  d = Sharded("total");
  map = ShardMap(d, &total);
  WriteFile(d + index, ShardIndexJson(map, total + 4));
  EXPECT_NE(ImportError(d).find("metadata.total_size " + std::to_string(total + 4) + ", but the " + n +
                                " tensors of its shards hold " + std::to_string(total) + " bytes"),
            std::string::npos)
      << ImportError(d);
  // A file outside the directory.
  d = Sharded("outside");
  map = ShardMap(d, &total);
  map["transformer.wpe.weight"] = "../hf/model-00001-of-00002.safetensors";
  WriteFile(d + index, ShardIndexJson(map, total));
  EXPECT_NE(ImportError(d).find("is not a file of the index's directory"), std::string::npos) << ImportError(d);
  // A refusal of the weights names the shard that holds the tensor.
  d = Sharded("config");
  map = ShardMap(d, &total);
  WriteFile(d + "/config.json",
            std::regex_replace(ReadFile(d + "/config.json"), std::regex("\"n_inner\": 24"), "\"n_inner\": 32"));
  EXPECT_NE(
      ImportError(d).find(map.at("transformer.h.0.mlp.c_fc.weight") +
                          ": tensor transformer.h.0.mlp.c_fc.weight: shape [8, 24], config.json asks for [8, 32]"),
      std::string::npos)
      << ImportError(d);
}

// As from_pretrained: model.safetensors first; an index beside it is not read (a note says so).
TEST_F(HfShards, ModelSafetensorsBesideAnIndexIsWhatIsRead) {
  const std::string d = Sharded("both");
  ASSERT_TRUE(Export(dir_ / "whole", "5GB").ok());
  std::filesystem::copy_file(dir_ / "whole/model.safetensors", d + "/model.safetensors");
  uint64_t total = 0;
  const auto map = ShardMap(d, &total);
  std::remove((d + "/" + map.begin()->second).c_str());  // the index names a file that is gone
  auto r = ImportFromHf(Opts("hf", "ptk", d, dir_ / "in"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->source, d + "/model.safetensors");
  bool noted = false;
  for (const std::string& note : r->notes)
    noted |= note.find("model.safetensors.index.json is not read") != std::string::npos;
  EXPECT_TRUE(noted);
}

// The shards are published with the rest, whole: a failure at any shard or at the index leaves the
// earlier export (whole or sharded) as it was, and nothing beside it.
TEST_F(HfShards, AFailedShardedExportLeavesTheEarlierExportWhole) {
  const std::string hf = dir_ / "hf";
  auto files = [&]() {
    std::string all;
    for (const std::string& name : {std::string("config.json"), std::string("model.safetensors"),
                                    std::string("model.safetensors.index.json"), ShardFileName(2, 3)})
      all += std::filesystem::exists(hf + "/" + name) ? name + ":" + ReadFile(hf + "/" + name) + ";" : "";
    return Entries(hf) + all;
  };
  ASSERT_TRUE(Export(hf, "5GB").ok());
  for (const char* size : {"1KB", "1MB"}) {
    for (const std::string at : {"write model-00003-of-", "write model.safetensors.index.json", "write config.json"}) {
      SCOPED_TRACE(std::string(size) + " failed at " + at);
      const std::string before = files();
      std::vector<std::string> steps;
      SetExportStepHookForTesting([&](std::string_view step) -> absl::Status {
        steps.emplace_back(step);
        if (step.rfind(at, 0) == 0) return absl::ResourceExhaustedError("No space left on device");
        return absl::OkStatus();
      });
      auto r = Export(hf, size);
      SetExportStepHookForTesting(nullptr);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(files(), before);
      EXPECT_EQ(ptk::testing::Leftovers(dir_.path()), "");
      EXPECT_EQ(steps.front(), "write model-00001-of-" + steps.front().substr(21)) << steps.front();
    }
    ASSERT_TRUE(Export(hf, size).ok());  // the next case starts from this one's shards
  }
}

TEST_F(HfShards, MaxShardSizeIsAUsageErrorOutsideAnExport) {
  const std::string tool = ptk::testing::Tool("ptk-convert");
  auto bad = RunCmd(tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") + " --save-dir " +
                    ShellQuote(dir_ / "hf") + " --max-shard-size 1GiB");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--max-shard-size \"1GiB\": binary units"), std::string::npos) << bad.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
  auto other = RunCmd(tool + " --loader hf --saver ptk --load-dir " + ShellQuote(dir_ / "hf") + " --save-dir " +
                      ShellQuote(dir_ / "in") + " --max-shard-size 5GB");
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("only a Hugging Face export"), std::string::npos) << other.output;
  auto ok = RunCmd(tool + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck") + " --save-dir " +
                   ShellQuote(dir_ / "hf") + " --max-shard-size 100KB");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "hf/model.safetensors.index.json"));
}

}  // namespace
}  // namespace ptk
