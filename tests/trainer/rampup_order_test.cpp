// The samples ptk-train's iterations and evaluations take, against Megatron-LM's for the same flags
// (golden: tests/support/gen_rampup_order_golden.py, megatron-core 0.16.1's calculator, datasets
// and Megatron-LM's update_train_iters, get_train_valid_test_num_samples and sampler): the plan's
// iterations and batch sizes, the splits built for Megatron's num_samples (their cache names hash
// it), each iteration's and evaluation's micro-batches per data-parallel rank (validation and test)
// and each sample's tokens, with --train-iters and --train-samples, with and without
// --rampup-batch-size, validation, and a resume mid-ramp.
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "indexed_dataset/data_loader.h"
#include "tests/test_util.h"
#include "trainer/train_options.h"
#include "trainer/training_data.h"

namespace ptk {
namespace {

namespace fs = std::filesystem;
using testing::Chdir;

const std::string kGolden = testing::SourceDir() + "/tests/data/trainer/rampup_order.json";
const std::string kGptData = testing::SourceDir() + "/tests/data/gpt_dataset/gpt_data";

std::vector<int64_t> Ints(simdjson::dom::element e) {
  std::vector<int64_t> v;
  for (auto x : e.get_array()) v.push_back(int64_t(x));
  return v;
}

// The golden case's flags as ptk-train's options (the tiny model of no consequence here).
TrainOptions OptionsOf(simdjson::dom::element c, const std::string& cache) {
  TrainOptions o;
  o.model.num_layers = 1;
  o.model.hidden_size = 32;
  o.model.num_attention_heads = 2;
  o.model.ffn_hidden_size = 128;
  o.model.seq_length = o.model.max_position_embeddings = int64_t(c["seq"]);
  o.model.vocab_size = 50257;
  o.model.padded_vocab_size = 50304;
  o.schedule.max_lr = 1e-3;
  for (auto x : c["blend"].get_array()) o.data.data_path.emplace_back(std::string_view(x));
  o.data.split = std::string(std::string_view(c["split"]));
  o.data_cache_path = cache;
  o.micro_batch_size = int64_t(c["mbs"]);
  o.global_batch_size = int64_t(c["gbs"]);
  o.train_iters = int64_t(c["train_iters"]);
  o.train_samples = int64_t(c["train_samples"]);
  if (!c["rampup"].is_null()) o.rampup_batch_size = Ints(c["rampup"]);
  o.eval_interval = int64_t(c["eval_interval"]);
  o.eval_iters = int64_t(c["eval_iters"]);
  return o;
}

// A sample's fingerprint as the golden writes it: its first four tokens, the sum of its tokens and
// its last label.
std::vector<int64_t> Fingerprint(const MicroBatch& mb, int64_t b) {
  const int64_t S = mb.seq_length;
  std::vector<int64_t> f;
  int64_t sum = mb.labels[static_cast<size_t>(b * S + S - 1)];
  for (int64_t i = 0; i < S; ++i) {
    const int64_t t = mb.tokens[static_cast<size_t>(b * S + i)];
    if (i < 4) f.push_back(t);
    sum += t;
  }
  f.push_back(sum);
  return f;
}

// Each data-parallel rank's loader over a split from `consumed` samples, as ptk-train opens it.
struct RankLoaders {
  RankLoaders(const std::shared_ptr<TopLevelDataset>& split, int64_t consumed, int64_t mbs, int dp) {
    for (int r = 0; r < dp; ++r)
      loaders.push_back(
          std::make_unique<DataLoader>(split, PretrainingSampler(split->size(), consumed, mbs, r, dp), mbs));
  }
  std::vector<std::unique_ptr<DataLoader>> loaders;
};

// Draws `micro_batches` micro-batches of every rank and checks them against the golden's
// [micro-batch][rank] indices and `samples`' fingerprints.
void CheckDraw(RankLoaders* l, int64_t micro_batches, simdjson::dom::element want, simdjson::dom::element samples,
               const std::string& where) {
  ASSERT_EQ(int64_t(want.get_array().size()), micro_batches) << where;
  for (int64_t m = 0; m < micro_batches; ++m) {
    for (size_t r = 0; r < l->loaders.size(); ++r) {
      absl::StatusOr<std::unique_ptr<MicroBatch>> mb = l->loaders[r]->Next();
      ASSERT_TRUE(mb.ok()) << mb.status();
      ASSERT_NE(*mb, nullptr) << where << ": the data ran out";
      const std::vector<int64_t> indices = Ints(want.at(m).at(r));
      EXPECT_EQ((*mb)->indices, indices) << where << " micro-batch " << m << " rank " << r;
      for (size_t b = 0; b < indices.size(); ++b)
        EXPECT_EQ(Fingerprint(**mb, static_cast<int64_t>(b)), Ints(samples[std::to_string(indices[b])]))
            << where << " micro-batch " << m << " rank " << r << ": sample " << indices[b];
    }
  }
}

class RampupOrder : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    fs::copy(kGptData, dir_ / "gpt_data");
    root_ = parser_.load(kGolden);
  }
  testing::TempDir dir_;
  simdjson::dom::parser parser_;
  simdjson::dom::element root_;
};

TEST_P(RampupOrder, SamplesAreMegatrons) {
  simdjson::dom::element g = root_[GetParam()], c = g["case"];
  Chdir in(dir_.path());  // the golden's data paths are relative, as its cache names
  const TrainOptions o = OptionsOf(c, "cache");
  const int dp = static_cast<int>(int64_t(c["dp"]));
  absl::StatusOr<TrainPlan> plan = PlanTraining(o, dp);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->train_iters, int64_t(g["train_iters"]));
  const std::vector<int64_t> num_samples = Ints(g["num_samples"]);
  EXPECT_EQ(plan->train_split_samples, num_samples[0]);

  absl::StatusOr<TrainingSplits> splits = BuildTrainingDatasets(o, *plan);
  if (int64_t runs_out = int64_t(g["runs_out_at_iteration"]); runs_out > 0) {
    // Megatron's loader runs out mid-run; ptk refuses before the first iteration, naming where.
    ASSERT_FALSE(splits.ok());
    EXPECT_NE(splits.status().message().find(fmt::format("the data would run out at iteration {}", runs_out)),
              std::string::npos)
        << splits.status();
    return;
  }
  ASSERT_TRUE(splits.ok()) << splits.status();
  // The cache names hash each dataset's description, num_samples included: the splits are Megatron's.
  std::set<std::string> want_files, got_files;
  for (auto f : g["cache_files"].get_array()) want_files.insert(std::string(std::string_view(f)));
  for (const auto& e : fs::directory_iterator("cache")) got_files.insert(e.path().filename().string());
  EXPECT_EQ(got_files, want_files);
  EXPECT_EQ(splits->train->size(), int64_t(g["lengths"].at(0)));

  const int64_t mbs = plan->micro_batch_size, resume_at = int64_t(c["resume_at"]);
  TrainState state;
  auto train = std::make_unique<RankLoaders>(splits->train, 0, mbs, dp);
  std::unique_ptr<RankLoaders> valid;
  if (splits->valid) valid = std::make_unique<RankLoaders>(splits->valid, 0, mbs, dp);
  auto evaluations = g["evaluations"].get_array();
  size_t next_eval = 0;
  auto evaluate = [&](int64_t at) {
    ASSERT_LT(next_eval, evaluations.size()) << "an evaluation after iteration " << at << " Megatron does not run";
    simdjson::dom::element e = evaluations.at(next_eval++);
    EXPECT_EQ(int64_t(e["after_iteration"]), at);
    for (auto batch : e["batches"].get_array()) {
      CheckDraw(valid.get(), plan->micro_batches, batch, g["valid_samples"], fmt::format("evaluation after {}", at));
      state.consumed_valid_samples += plan->global_batch_size;
    }
  };
  for (auto it : g["iterations"].get_array()) {
    if (state.iteration == resume_at && resume_at > 0) {  // a new process from the checkpoint's counts
      train = std::make_unique<RankLoaders>(splits->train, state.consumed_train_samples, mbs, dp);
      if (splits->valid) valid = std::make_unique<RankLoaders>(splits->valid, state.consumed_valid_samples, mbs, dp);
    }
    const std::string where = fmt::format("iteration {}", state.iteration + 1);
    ASSERT_EQ(int64_t(it["consumed_before"]), state.consumed_train_samples) << where;
    const int64_t gbs = plan->GlobalBatchSizeAt(state.consumed_train_samples);
    EXPECT_EQ(gbs, int64_t(it["global_batch_size"])) << where;
    CheckDraw(train.get(), plan->MicroBatchesAt(state.consumed_train_samples), it["batches"], g["train_samples"],
              where);
    state.consumed_train_samples += gbs;
    ++state.iteration;
    if (valid && state.iteration % o.eval_interval == 0) evaluate(state.iteration);
  }
  EXPECT_EQ(state.iteration, plan->train_iters);
  EXPECT_EQ(state.consumed_train_samples, plan->train_samples);
  if (valid) evaluate(state.iteration);  // the evaluation at the end of training
  EXPECT_EQ(next_eval, evaluations.size());
  // And on the test split, from its start (ptk-train's Finish).
  auto test_batches = g["test_batches"].get_array();
  ASSERT_EQ(splits->test != nullptr, test_batches.size() > 0);
  if (!splits->test) return;
  RankLoaders test(splits->test, 0, mbs, dp);
  for (auto batch : test_batches) CheckDraw(&test, plan->micro_batches, batch, g["test_samples"], "test");
}

INSTANTIATE_TEST_SUITE_P(Golden, RampupOrder,
                         ::testing::Values("tiny_ramp", "tiny_ramp_resume", "blend_ramp_eval", "tiny_samples",
                                           "blend_iters_eval", "tiny_ramp_short"));

}  // namespace
}  // namespace ptk
