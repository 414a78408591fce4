// The validation datasets of --multiple-validation-sets and --full-validation against megatron-core's
// BlendedMegatronDatasetBuilder (golden: tests/support/gen_validation_sets_golden.py): one dataset per
// --valid-data-path prefix (one epoch each with full validation, Megatron's num_samples None), or their
// exhaustive blend without multiple sets; the same class, length and samples by index.
#include <array>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

namespace fs = std::filesystem;
const std::string kGolden = testing::SourceDir() + "/tests/data/gpt_dataset/";

TEST(ValidationSetsGolden, EachPrefixIsItsOwnSetAsMegatronsBuilderMakesIt) {
  testing::TempDir dir;
  fs::copy(kGolden + "gpt_data", dir / "gpt_data", fs::copy_options::recursive);
  testing::Chdir cd(dir.path());
  simdjson::dom::parser p;
  simdjson::dom::element root = p.load(kGolden + "validation_sets.json");
  int configs = 0;
  for (auto [name, c] : root["configs"].get_object()) {
    SCOPED_TRACE(std::string(name));
    ++configs;
    DataArgs args;
    args.per_split_data_path = {
        std::vector<std::string>{"gpt_data/A"}, std::vector<std::string>{"gpt_data/B", "gpt_data/C"}, {}};
    args.sizes = {int64_t{40}, std::nullopt, std::nullopt};
    if (!c["sizes"].at(1).is_null()) args.sizes[1] = int64_t(c["sizes"].at(1));
    args.multiple_validation_sets = bool(c["multiple_validation_sets"]);
    GPTDatasetConfig cfg;
    cfg.random_seed = static_cast<uint32_t>(int64_t(root["random_seed"]));
    cfg.sequence_length = int64_t(root["sequence_length"]);
    std::vector<std::shared_ptr<TopLevelDataset>> sets;
    auto built = BuildGPTDatasets(args, cfg, nullptr, &sets);
    ASSERT_TRUE(built.ok()) << built.status();
    simdjson::dom::array golden = c["sets"].get_array();
    ASSERT_EQ(sets.size(), golden.size());
    EXPECT_EQ((*built)[1], sets[0]);  // the validation split is the first set
    size_t k = 0;
    for (simdjson::dom::element g : golden) {
      const std::shared_ptr<TopLevelDataset>& ds = sets[k++];
      EXPECT_EQ(ds->size(), int64_t(g["length"]));
      const std::string cls = "\"class\": \"" + std::string(std::string_view(g["class"])) + "\"";
      EXPECT_NE(ds->description().find(cls), std::string::npos) << ds->description();
      int samples = 0;
      for (auto [index, tokens] : g["samples"].get_object()) {
        std::vector<int64_t> want, got(static_cast<size_t>(cfg.sequence_length + 1));
        for (auto t : tokens.get_array()) want.push_back(int64_t(t));
        int64_t id = 0;
        ASSERT_TRUE(ds->Text(std::stoll(std::string(index)), got.data(), &id).ok());
        EXPECT_EQ(got, want) << "set " << k - 1 << " sample " << index;
        ++samples;
      }
      EXPECT_GE(samples, 4);
    }
  }
  EXPECT_EQ(configs, 3);
}

}  // namespace
}  // namespace ptk
