// ptk-train's evaluation (trainer/evaluation.h) against a hand computation: --full-validation's extent is
// every sample of one epoch of the validation split that Megatron's pretraining sampler gives (the last
// incomplete batch of micro-batches dropped), and Evaluate's loss over it is the mean per token of the
// model's forward over exactly those samples, each built by hand from the dataset's tokens; --eval-iters'
// extent reads its global batches; the evaluation modes' refusals.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "indexed_dataset/data_loader.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/comm.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/evaluation.h"
#include "trainer/train_options.h"

namespace ptk {
namespace {

TEST(FullValidationExtent, EverySampleTheSamplerGivesOnce) {
  TrainPlan plan;
  plan.micro_batch_size = 2;
  plan.data_parallel_size = 3;
  plan.global_batch_size = 12;  // 2 micro-batches per rank
  plan.micro_batches = 2;
  // 41 samples: 6 micro-batches of 2 on 3 ranks (36 samples), the last 5 dropped as Megatron's sampler drops
  // them; 3 iterations of the global batch of 12.
  EvaluationExtent e = FullValidationExtent(41, 3, plan);
  EXPECT_EQ(e.micro_batches, 6);
  EXPECT_EQ(e.iterations, 3);
  EXPECT_EQ(e.samples, 36);
  // 47 samples: 7 micro-batches per rank, the last iteration of one.
  e = FullValidationExtent(47, 3, plan);
  EXPECT_EQ(e.micro_batches, 7);
  EXPECT_EQ(e.iterations, 4);
  EXPECT_EQ(e.samples, 42);
  e = EvalItersExtent(5, plan);
  EXPECT_EQ(e.micro_batches, 10);
  EXPECT_EQ(e.iterations, 5);
  EXPECT_EQ(e.samples, 60);
}

// A forward over one sample built by hand from the dataset's tokens: tokens [0, S), labels [1, S], positions
// 0..S-1, every token counted.
LossSum ForwardOne(GPTModel* model, const TopLevelDataset& ds, int64_t idx, int64_t seq) {
  std::vector<int64_t> text(static_cast<size_t>(seq + 1));
  int64_t id = 0;
  EXPECT_TRUE(ds.Text(idx, text.data(), &id).ok());
  std::vector<int32_t> tokens, labels, positions;
  for (int64_t i = 0; i < seq; ++i) {
    tokens.push_back(static_cast<int32_t>(text[static_cast<size_t>(i)]));
    labels.push_back(static_cast<int32_t>(text[static_cast<size_t>(i + 1)]));
    positions.push_back(static_cast<int32_t>(i));
  }
  std::vector<float> mask(static_cast<size_t>(seq), 1.0f);
  std::vector<int64_t> keys = {idx};
  auto loss =
      model->Forward(ModelBatch{1, seq, tokens.data(), labels.data(), positions.data(), mask.data(), keys.data()});
  EXPECT_TRUE(loss.ok()) << loss.status();
  return loss.ok() ? *loss : LossSum{};
}

TEST(Evaluate, FullValidationIsTheMeanOverEverySampleOfTheEpoch) {
  testing::TempDir dir;
  const std::string prefix = dir / "docs";
  ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix, 120, testing::kSmallVocabEod));
  const int64_t seq = 16;
  GPTDatasetConfig cfg;
  cfg.random_seed = 1234;
  cfg.sequence_length = seq;
  cfg.eod = testing::kSmallVocabEod;
  DataArgs args;
  args.data_path = {prefix};
  args.split = "80,20,0";
  args.sizes = {int64_t{10}, std::nullopt, int64_t{0}};  // the validation split: one epoch (Megatron's None)
  auto sets = BuildGPTDatasets(args, cfg);
  ASSERT_TRUE(sets.ok()) << sets.status();
  const std::shared_ptr<TopLevelDataset> valid = (*sets)[1];
  ASSERT_TRUE(valid);
  ASSERT_GT(valid->size(), 20);

  const GPTConfig c = testing::SmallGpt(2, 16, 2, seq, 1000, 1024);
  auto model = CpuGPTModel::Create(c);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->InitWeights(5).ok());
  TrainPlan plan;
  plan.micro_batch_size = 3;
  plan.data_parallel_size = 1;
  plan.global_batch_size = 6;
  plan.micro_batches = 2;
  const EvaluationExtent extent = FullValidationExtent(valid->size(), 1, plan);
  ASSERT_EQ(extent.samples, valid->size() / 3 * 3);

  // By hand: samples 0 .. extent.samples - 1 of the split, in the sampler's order, each once.
  double loss_sum = 0, tokens = 0;
  for (int64_t i = 0; i < extent.samples; ++i) {
    const LossSum s = ForwardOne(model->get(), *valid, i, seq);
    loss_sum += s.loss_sum;
    tokens += s.tokens;
  }
  ASSERT_EQ(tokens, static_cast<double>(extent.samples * seq));

  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  EvaluationPass pass{model->get(), comm.get(), comm.get(), nullptr, nullptr, nullptr, {}, nullptr};
  std::vector<std::string> verbose;
  pass.verbose = [&](const std::string& line) { verbose.push_back(line); };
  TrainOptions o;
  DataLoader loader(valid, PretrainingSampler(valid->size(), 0, 3, 0, 1), 3);
  int64_t consumed = 0;
  auto loss = Evaluate(pass, o, extent, &loader, "full", &consumed);
  ASSERT_TRUE(loss.ok()) << loss.status();
  ASSERT_TRUE(loss->has_value());
  EXPECT_NEAR(**loss, loss_sum / tokens, 1e-6 * loss_sum / tokens);
  EXPECT_EQ(consumed, extent.samples);
  ASSERT_FALSE(verbose.empty());
  EXPECT_EQ(verbose[0], "Evaluating on " + std::to_string(extent.samples) + " samples");
  EXPECT_EQ(verbose.back(),
            "Evaluating iter " + std::to_string(extent.iterations) + "/" + std::to_string(extent.iterations));
  // Every sample read: the loader holds nothing more of the epoch's whole micro-batches.
  auto rest = loader.Next();
  ASSERT_TRUE(rest.ok());
  EXPECT_FALSE(*rest);

  // --eval-iters 2: the first 2 global batches only (12 samples).
  DataLoader again(valid, PretrainingSampler(valid->size(), 0, 3, 0, 1), 3);
  double first_sum = 0, first_tokens = 0;
  for (int64_t i = 0; i < 12; ++i) {
    const LossSum s = ForwardOne(model->get(), *valid, i, seq);
    first_sum += s.loss_sum;
    first_tokens += s.tokens;
  }
  auto two = Evaluate(pass, o, EvalItersExtent(2, plan), &again, "two", nullptr);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NEAR(**two, first_sum / first_tokens, 1e-6 * first_sum / first_tokens);
}

TEST(CheckEvaluationModes, RefusesWhatMegatronCannotEvaluate) {
  TrainOptions o;
  o.data.data_path = {"a"};
  o.data.split = "98,2,0";
  EXPECT_TRUE(CheckEvaluationModes(o).ok());
  auto refused = [](const TrainOptions& t, const std::string& words) {
    const absl::Status st = CheckEvaluationModes(t);
    EXPECT_TRUE(IsUsageError(st)) << st;
    EXPECT_NE(std::string(st.message()).find(words), std::string::npos) << st;
  };
  TrainOptions m = o;
  m.multiple_validation_sets = true;
  refused(m, "--multiple-validation-sets currently requires --full-validation");
  m.full_validation = true;
  EXPECT_TRUE(CheckEvaluationModes(m).ok());
  m.full_validation = false;
  m.skip_train = true;
  EXPECT_TRUE(CheckEvaluationModes(m).ok());

  TrainOptions s = o;
  s.skip_train = true;
  s.eval_iters = 0;
  refused(s, "--skip-train --eval-iters 0: nothing would be evaluated");
  s.full_validation = true;
  EXPECT_TRUE(CheckEvaluationModes(s).ok());
  s.data.split = "100,0,0";
  refused(s, "--skip-train: the run has no validation data");

  TrainOptions w = o;
  w.full_validation = true;
  w.data.data_path = {"0.3", "a", "0.7", "b"};
  refused(w, "give --data-path its prefixes without weights");
  TrainOptions v;
  v.data.per_split_data_path = {std::vector<std::string>{"t"}, std::vector<std::string>{"1", "a", "2", "b"}, {}};
  v.multiple_validation_sets = true;
  v.full_validation = true;
  refused(v, "--multiple-validation-sets: give --valid-data-path its prefixes without weights");
  TrainOptions mock;
  mock.mock_data = true;
  mock.full_validation = true;
  refused(mock, "--mock-data");
}

}  // namespace
}  // namespace ptk
