// ptk-train's standard output against Megatron-LM core_v0.16.1's for the same flags
// (tests/data/trainer/training_log_golden.txt, written by tests/support/gen_training_log_golden.py
// from Megatron's training_log, evaluate_and_print_results, print_datetime and pretrain): which
// lines come (a log line after the first iteration and every --log-interval, the evaluations every
// --eval-interval and at the end on the validation and test sets with their 'Evaluating' lines and
// 'evaluate' timer), and in them the iterations, consumed samples, learning rates, batch sizes, loss
// scale and counts, character for character; what depends on the model or the clock is masked alike.
// The same for a run resumed at its last iteration (pretrain's end only). Beside them, from the same golden:
// training_log alone over iterations an fp16 loss scaler skips (TrainingLogUnit.Fp16OverflowLinesAreMegatrons) and the
// learning-rate and weight-decay schedules of six flag sets, iteration by iteration
// (TrainingLogUnit.SchedulesAreMegatrons).
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/lr_schedule.h"
#include "trainer/train_options.h"
#include "trainer/train_step.h"
#include "trainer/training.h"
#include "trainer/training_log.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;

// A case of the golden: ptk-train's flags and Megatron's masked lines.
struct GoldenCase {
  std::string flags;
  std::vector<std::string> lines;
};

std::map<std::string, GoldenCase> ReadGolden() {
  std::ifstream in(testing::SourceDir() + "/tests/data/trainer/training_log_golden.txt");
  std::map<std::string, GoldenCase> cases;
  std::string line, name;
  while (std::getline(in, line)) {
    if (line.rfind("case ", 0) == 0) {
      name = line.substr(5);
    } else if (line.rfind("flags ", 0) == 0) {
      cases[name].flags = line.substr(6);
    } else if (line == "end" || line.rfind("unit ", 0) == 0) {
      name.clear();
    } else if (!name.empty()) {
      cases[name].lines.push_back(line);
    }
  }
  return cases;
}

// The lines of `out` the golden compares, masked as gen_training_log_golden.py's KEEP and MASKS (with
// `clock_only`, its first two: the timestamp and the elapsed time).
std::vector<std::string> Masked(const std::string& out, bool clock_only = false) {
  static const std::regex keep(R"(^( \[.*\] iteration |\[.*\] datetime: |training \.\.\.$| validation|-+$|Evaluating |)"
                               R"(INFO:megatron\.core\.timers:|    \S.*: \())");
  static const std::vector<std::pair<std::regex, std::string>> masks = {
      {std::regex(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})"), "<datetime>"},
      {std::regex(R"((elapsed time per iteration \(ms\): )[0-9.]+)"), "$1<ms>"},
      {std::regex(R"((throughput per GPU \(TFLOP/s/GPU\): )[0-9.]+)"), "$1<tflops>"},
      {std::regex(R"((lm loss: |grad norm: |lm loss value: |lm loss PPL: )[-+0-9.eEnaif]+)"), "$1<value>"},
      {std::regex(R"(: \([0-9.]+, [0-9.]+\)$)"), ": (<ms>, <ms>)"},
      {std::regex(R"(^-+$)"), "<dashes>"},
  };
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (!std::regex_search(line, keep)) continue;
    for (size_t m = 0; m < (clock_only ? 2 : masks.size()); ++m)
      line = std::regex_replace(line, masks[m].first, masks[m].second);
    lines.push_back(line);
  }
  return lines;
}

class TrainingLogGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 300, testing::kSmallVocabEod));
  }
  // ptk-train with the case's flags on the tests' tiny model; `data` its data flags.
  void ExpectMegatronsLines(const std::string& name, const std::string& data) {
    const std::map<std::string, GoldenCase> golden = ReadGolden();
    ASSERT_EQ(golden.count(name), 1u) << name;
    const GoldenCase& c = golden.at(name);
    const auto r = RunCmd(testing::Tool("ptk-train") +
                          " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                          " --max-position-embeddings 32 --threads 2 " +
                          testing::SmallVocabFlags() + " --data-cache-path " + ShellQuote(dir_ / "cache") + " " +
                          c.flags + " " + data + " 2>/dev/null");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<std::string> got = Masked(r.output);
    ASSERT_FALSE(c.lines.empty());
    for (size_t i = 0; i < std::max(got.size(), c.lines.size()); ++i)
      EXPECT_EQ(i < got.size() ? got[i] : "(no line)", i < c.lines.size() ? c.lines[i] : "(no line)")
          << "line " << i + 1 << " of the compared lines\n"
          << r.output;
  }
  testing::TempDir dir_;
  std::string prefix_;
};

// The Azure GPT-3 tutorial's flags (04-gpt175B.sh) scaled down: --train-iters, cosine with
// --lr-warmup-fraction and --lr-decay-iters, separate train/valid/test data paths. Before: no line
// after iteration 1, seconds without microseconds, a throughput field without --log-throughput, no
// 'evaluate' timer, and 'the end of training for val data' for Megatron's 'iteration 12 on
// validation set' without its 'Evaluating' lines.
TEST_F(TrainingLogGolden, AzureTutorialRunPrintsMegatronsLines) {
  const std::string p = "1.0 " + ShellQuote(prefix_);
  ExpectMegatronsLines("azure_gpt3", "--train-data-path " + p + " --valid-data-path " + p + " --test-data-path " + p);
}

// azure_gpt3's run resumed from its checkpoint of its last iteration: as Megatron's, no iteration and pretrain's
// end (the validation and test evaluations, 'iteration 12 on validation set'). ptk printed none of these lines.
TEST_F(TrainingLogGolden, AFinishedRunResumedPrintsMegatronsEnd) {
  const std::string p = "1.0 " + ShellQuote(prefix_), ck = ShellQuote(dir_ / "ck");
  const std::string data = "--train-data-path " + p + " --valid-data-path " + p + " --test-data-path " + p;
  const std::map<std::string, GoldenCase> golden = ReadGolden();
  ASSERT_EQ(golden.count("azure_gpt3_finished"), 1u);
  const auto first = RunCmd(testing::Tool("ptk-train") +
                            " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
                            " --max-position-embeddings 32 --threads 2 " +
                            testing::SmallVocabFlags() + " --data-cache-path " + ShellQuote(dir_ / "cache") + " " +
                            golden.at("azure_gpt3_finished").flags + " " + data + " --save " + ck + " 2>&1");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ExpectMegatronsLines("azure_gpt3_finished", data + " --load " + ck + " --save " + ck + " --save-interval 4");
}

// --train-samples with a batch-size ramp, WSD in samples, --log-throughput; no test split.
TEST_F(TrainingLogGolden, SampleBasedWsdRampupRunPrintsMegatronsLines) {
  ExpectMegatronsLines("samples_wsd_rampup", "--data-path " + ShellQuote(prefix_) + " --split 9,1,0");
}

// Megatron's training_log over iterations an fp16 loss scaler skips (the golden's 'unit fp16_overflow':
// its losses, overflows and norms given), against LogInterval, LossScaler and FormatLogLine as
// ptk-train's loop uses them: the averages over the iterations that advanced (the first line resets
// nothing), the skipped and nan counts, no grad norm (nor lm loss) where Megatron has none, the loss
// scale after each step's update. Before, ptk printed 'grad norm: inf' and the scale of the step.
TEST(TrainingLogUnit, Fp16OverflowLinesAreMegatrons) {
  std::ifstream in(testing::SourceDir() + "/tests/data/trainer/training_log_golden.txt");
  std::string line;
  while (std::getline(in, line) && line != "unit fp16_overflow") {
  }
  ASSERT_TRUE(std::getline(in, line));
  std::istringstream run(line);
  std::string word;
  int64_t train_iters = 0, gbs = 0, log_interval = 0;
  double lr = 0;
  LossScaleConfig ls;
  ls.dynamic = true;
  ASSERT_TRUE(run >> word >> train_iters >> gbs >> log_interval >> lr >> ls.scale >> ls.min_scale >> ls.window >>
              ls.hysteresis)
      << line;
  LossScaler scaler(ls);
  LogInterval interval(log_interval);
  interval.Start();
  std::vector<std::string> got, want;
  while (std::getline(in, line) && line != "end") {
    if (line.rfind("step ", 0) != 0) {
      want.push_back(line);
      continue;
    }
    std::istringstream step(line.substr(5));
    int64_t it = 0;
    int found_inf = 0;
    std::string loss, norm;
    ASSERT_TRUE(step >> it >> loss >> found_inf >> norm) << line;
    StepResult r;
    r.tokens = 32;
    r.loss_sum = std::strtod(loss.c_str(), nullptr) * r.tokens;
    r.skipped = found_inf != 0;
    r.overflow = r.skipped && std::isfinite(r.loss_sum);
    r.grad_norm = norm == "-" ? std::numeric_limits<double>::infinity() : std::strtod(norm.c_str(), nullptr);
    scaler.Update(r.skipped);
    r.next_loss_scale = scaler.scale();
    interval.Add(r);
    if (!interval.Due(it)) continue;
    LogLineFields f;  // as Trainer::Log fills it (training.cpp)
    f.iteration = it;
    f.train_iters = train_iters;
    f.consumed_samples = it * gbs;
    f.global_batch_size = gbs;
    interval.Fill(r, 0.0, 1, /*throughput=*/false, &f);
    f.learning_rate = lr;
    const std::vector<std::string> masked = Masked(FormatLogLine(f, Timestamp()), /*clock_only=*/true);
    ASSERT_EQ(masked.size(), 1u);
    got.push_back(masked[0]);
    interval.Logged(it);
  }
  EXPECT_EQ(got, want);
}

// Megatron stops its 'interval-time' timer around evaluations and checkpoint saves: the log line's
// elapsed time per iteration is the iterations' own. ptk counted an evaluation (and a save) into the
// next line's time. On a made-up clock: iterations of 1 s, an evaluation of 5 s and a save of 1 s
// (paused twice over, nested) between the lines of iterations 2 and 4.
TEST(TrainingLogUnit, EvaluationsAndSavesAreNoIterationsTime) {
  using Clock = LogInterval::Clock;
  auto at = [](double s) {
    return Clock::time_point() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  LogInterval interval(2);
  interval.Start(at(0));
  StepResult r;
  r.tokens = 1;
  r.loss_sum = 5;
  LogLineFields f;
  interval.Add(r);
  interval.Fill(r, 0, 1, false, &f, at(1));
  EXPECT_DOUBLE_EQ(f.elapsed_ms, 1000.0);
  interval.Logged(1, at(1));  // the first iteration's line: nothing starts over
  interval.Add(r);
  interval.Fill(r, 0, 1, false, &f, at(2));
  EXPECT_DOUBLE_EQ(f.elapsed_ms, 1000.0);
  interval.Logged(2, at(2));
  interval.Pause(at(2));  // the evaluation after iteration 2's line
  interval.Resume(at(7));
  interval.Pause(at(7));  // a save, paused twice over
  interval.Pause(at(7.5));
  interval.Resume(at(7.75));
  interval.Resume(at(8));
  interval.Add(r);
  interval.Add(r);
  interval.Fill(r, 0, 1, false, &f, at(10));
  EXPECT_DOUBLE_EQ(f.elapsed_ms, 1000.0);
}

// The golden's 'set' line of a schedule case as ptk-train's options (the flags' fields; '-': not given).
TrainOptions ScheduleCase(const std::map<std::string, std::string>& v) {
  auto given = [&](const char* k) { return v.at(k) != "-"; };
  auto num = [&](const char* k) { return given(k) ? std::strtod(v.at(k).c_str(), nullptr) : 0.0; };
  auto count = [&](const char* k) { return static_cast<int64_t>(num(k)); };
  TrainOptions o;
  o.model.num_layers = 1;
  o.model.hidden_size = 32;
  o.model.num_attention_heads = 2;
  o.model.ffn_hidden_size = 128;
  o.model.seq_length = o.model.max_position_embeddings = 16;
  o.model.vocab_size = 100;
  o.model.padded_vocab_size = 128;
  o.mock_data = true;
  o.micro_batch_size = 1;
  o.global_batch_size = count("gbs");
  o.train_iters = count("train_iters");
  o.train_samples = count("train_samples");
  if (given("rampup")) {
    std::istringstream r(v.at("rampup"));
    for (std::string x; std::getline(r, x, ',');) o.rampup_batch_size.push_back(std::stoll(x));
  }
  o.schedule.max_lr = num("lr");
  o.schedule.min_lr = num("min_lr");
  o.schedule.init_lr = num("init");
  o.schedule.decay_style = v.at("style");
  o.schedule.wsd_decay_style = v.at("wsd_style");
  o.schedule.wd_incr_style = v.at("wd_style");
  ScheduleOptions& s = o.schedule_options;
  if (given("fraction")) s.lr_warmup_fraction = num("fraction");
  s.lr_warmup_iters = count("warmup_iters");
  s.lr_warmup_samples = count("warmup_samples");
  s.lr_decay_iters = count("decay_iters");
  s.lr_decay_samples = count("decay_samples");
  s.lr_wsd_decay_iters = count("wsd_iters");
  s.lr_wsd_decay_samples = count("wsd_samples");
  if (o.schedule.wd_incr_style == "constant") {  // --weight-decay (Megatron sets both ends to it)
    s.weight_decay = num("start_wd");
  } else {
    s.start_weight_decay = num("start_wd");
    s.end_weight_decay = num("end_wd");
  }
  return o;
}

// The learning rate and weight decay of every iteration, from the flags of the Azure tutorial's
// cosine with --lr-warmup-fraction, linear from --lr-warmup-init, inverse square root, WSD by
// iterations, cosine over --lr-decay-samples under a batch-size ramp, and constant after a warm-up
// fraction, with constant, linear and cosine weight-decay increments: PlanTraining's schedule
// stepped by each iteration's batch against Megatron's get_optimizer_param_scheduler and
// megatron-core's OptimizerParamScheduler stepped as train_step steps it, value for value.
TEST(TrainingLogUnit, SchedulesAreMegatrons) {
  std::ifstream in(testing::SourceDir() + "/tests/data/trainer/training_log_golden.txt");
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("schedule ", 0) != 0) continue;
    const std::string name = line.substr(9);
    ++cases;
    ASSERT_TRUE(std::getline(in, line) && line.rfind("set ", 0) == 0) << name;
    std::map<std::string, std::string> v;
    std::istringstream set(line.substr(4));
    for (std::string kv; set >> kv;) v[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    const absl::StatusOr<TrainPlan> plan = PlanTraining(ScheduleCase(v), 1);
    ASSERT_TRUE(plan.ok()) << name << ": " << plan.status();
    OptimizerParamScheduler sched(plan->schedule);
    int64_t consumed = 0, iterations = 0;
    while (std::getline(in, line) && line != "end") {
      std::istringstream row(line);
      int64_t it = 0, before = 0, gbs = 0;
      std::string lr, wd;
      ASSERT_TRUE(row >> it >> before >> gbs >> lr >> wd) << line;
      EXPECT_EQ(consumed, before) << name << " iteration " << it;
      EXPECT_EQ(plan->GlobalBatchSizeAt(consumed), gbs) << name << " iteration " << it;
      sched.Step(plan->GlobalBatchSizeAt(consumed));
      consumed += plan->GlobalBatchSizeAt(consumed);
      EXPECT_DOUBLE_EQ(sched.lr(), std::strtod(lr.c_str(), nullptr)) << name << " iteration " << it;
      EXPECT_DOUBLE_EQ(sched.weight_decay(), std::strtod(wd.c_str(), nullptr)) << name << " iteration " << it;
      iterations = it;
    }
    EXPECT_EQ(plan->train_iters, iterations) << name;
  }
  EXPECT_EQ(cases, 6);
}

}  // namespace
}  // namespace ptk
