// ptk-train's pipeline parallelism end to end, ranks as processes over loopback gloo: P = 2 and 4
// stages of a 4-layer model (and Megatron's uneven first stage), 8 micro-batches a step, dropout
// on, give the loss lines of one rank within 1e-6 relative over 20 iterations; T = 2 x P = 2 x
// data 2 (8 ranks) with ZeRO-1, and T = 2 x P = 2 with --sequence-parallel, within 1e-5; text
// samples and TensorBoard's scalars at P = 2 are one rank's, and --overlap-grad-reduce keeps the
// lines; middle stages open no data; checkpoints in Megatron's mp_rank_TT_PPP resume at the same P
// with the uninterrupted run's lines character for character and at P = 1 and 4 as the
// uninterrupted run, and ptk-convert exports them; kill -9 of a middle stage ends every rank
// non-zero within the timeout, and --load resumes its last checkpoint bit for bit; sizes that do
// not divide are refused on every rank.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "common/output_lock.h"
#include "tests/test_util.h"
#include "tests/trainer/test_ports.h"
#include "tests/trainer/train_cli_support.h"

namespace ptk {
namespace {

using ptk::testing::RunCmd;

// TensorBoard's scalars in DIR's event files, in order. The records' framing is TFRecord's; the Event and Summary
// messages are read from their wire format (Event: step = 2, summary = 5; Summary: value = 1; Value: tag = 1,
// simple_value = 2).
class ProtoReader {
 public:
  explicit ProtoReader(std::string_view s) : s_(s) {}
  bool Done() const { return at_ >= s_.size(); }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; at_ < s_.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(s_[at_++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  }
  // The next field: its number and wire type; a length-delimited or fixed one's bytes in `bytes`.
  std::pair<int, int> Next(std::string_view* bytes, uint64_t* varint) {
    const uint64_t key = Varint();
    const int type = static_cast<int>(key & 7);
    const size_t n = type == 2 ? static_cast<size_t>(Varint()) : type == 1 ? 8 : type == 5 ? 4 : 0;
    if (type == 0) *varint = Varint();
    *bytes = s_.substr(std::min(at_, s_.size()), n);
    at_ += n;
    return {static_cast<int>(key >> 3), type};
  }

 private:
  std::string_view s_;
  size_t at_ = 0;
};
struct Scalar {
  std::string key;  // tag@step
  float value;
};
std::vector<Scalar> EventScalars(const std::string& dir) {
  std::vector<Scalar> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) != 0) continue;
    const std::string file = ptk::testing::ReadFile(e.path());
    for (size_t pos = 0; pos + 12 <= file.size();) {
      uint64_t len = 0;
      std::memcpy(&len, file.data() + pos, 8);
      ProtoReader event(std::string_view(file).substr(pos + 12, len));
      pos += 16 + len;
      uint64_t step = 0, v = 0;
      std::string_view bytes;
      while (!event.Done()) {
        const auto [field, type] = event.Next(&bytes, &v);
        if (field == 2 && type == 0) step = v;
        if (field != 5 || type != 2) continue;
        ProtoReader summary(bytes);
        while (!summary.Done()) {
          std::string_view value_bytes;
          if (summary.Next(&value_bytes, &v).first != 1) continue;
          ProtoReader value(value_bytes);
          std::string tag;
          float x = 0;
          while (!value.Done()) {
            const auto [vf, vt] = value.Next(&bytes, &v);
            if (vf == 1 && vt == 2) tag = std::string(bytes);
            if (vf == 2 && vt == 5) std::memcpy(&x, bytes.data(), 4);
          }
          out.push_back({tag + "@" + std::to_string(step), x});
        }
      }
    }
  }
  return out;
}
using ptk::testing::ShellQuote;

class PipelineParallelCli : public testing::PipelineCliTest {};

TEST_F(PipelineParallelCli, TwoAndFourStagesGiveOneRanksLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u) << OneRank();
  EXPECT_LT(one.back().second, one.front().second);
  struct Case {
    int P;
    std::string extra;
  };
  for (const Case& c : {Case{2, ""}, Case{4, ""}, Case{2, "--decoder-first-pipeline-num-layers 1"}}) {
    const std::string what = "P=" + std::to_string(c.P) + (c.extra.empty() ? "" : " " + c.extra);
    SCOPED_TRACE(what);
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(c.P, Train(1, c.P, c.extra), one, 20, 1e-6, what, &out));
    EXPECT_NE(out.find("> initialized pipeline model parallel with size " + std::to_string(c.P)), std::string::npos)
        << out;
    // Megatron's line from each stage of the first data-parallel rank: the last stage's in its log.
    EXPECT_NE(Logs(c.P).find(" > number of parameters on (tensor, pipeline) model parallel rank (0, " +
                             std::to_string(c.P - 1) + "): "),
              std::string::npos)
        << Logs(c.P);
    // The validation loss at iterations 10 and 20, from the last stage.
    EXPECT_NE(out.find("validation loss at iteration 20 | lm loss value: "), std::string::npos) << out;
  }
}

TEST_F(PipelineParallelCli, TensorPipelineAndDataRanksGiveOneRanksLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(8, Train(2, 2, "--use-distributed-optimizer"), one, 20, 1e-5, "T=2 x P=2 x D=2, ZeRO-1", &out));
  // ptk's line in Megatron's rank order (tensor, context, data, pipeline), and Megatron's own line.
  EXPECT_NE(out.find("tensor parallel: 2 ranks x data parallel: 2 ranks x pipeline parallel: 2 stages"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("using world size: 8, data-parallel size: 2, context-parallel size: 1, hierarchical "
                     "context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2\n"),
            std::string::npos)
      << out;
}

// Sequence parallelism across stages: each stage sends its tensor rank's shard of the sequence
// (Megatron's (t / T, b, h) tensors), dropout on.
TEST_F(PipelineParallelCli, SequenceParallelStagesGiveOneRanksLosses) {
  const auto one = Losses(OneRank());
  ASSERT_EQ(one.size(), 20u);
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, 2, "--sequence-parallel"), one, 20, 1e-5, "T=2 x P=2 --sequence-parallel", &out));
  EXPECT_NE(out.find("tensor parallel: 2 ranks x data parallel: 1 ranks x pipeline parallel: 2 stages"),
            std::string::npos)
      << out;
}

// Megatron's --squared-relu, --apply-layernorm-1p and --init-method-xavier-uniform across stages and
// tensor ranks with --sequence-parallel: one rank's losses (each stage's norms read 1 + gamma, the
// init's bits are the whole model's whatever the layout).
TEST_F(PipelineParallelCli, MegatronMlpAndNormFlagsGiveOneRanksLosses) {
  const std::string flags = "--squared-relu --apply-layernorm-1p --init-method-xavier-uniform";
  const auto r = RunCmd(Train(1, 1, flags));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto one = Losses(r.output);
  ASSERT_EQ(one.size(), 20u) << r.output;
  EXPECT_NE(one, Losses(OneRank()));  // another model than the default's
  std::string out;
  ASSERT_NO_FATAL_FAILURE(RunGivingLosses(2, Train(1, 2, flags), one, 20, 1e-6, "P=2", &out));
  ASSERT_NO_FATAL_FAILURE(
      RunGivingLosses(4, Train(2, 2, flags + " --sequence-parallel"), one, 20, 1e-5, "T=2 x P=2 sp", &out));
}

// Text samples through the stages (each token's forward pipelined, the last stage's pick broadcast
// back) and TensorBoard's event files (the last stage's first data rank writes them): with untied
// output weights the stages train with one rank's bits, so the samples (greedy and at a
// temperature) and every scalar of the event files are one rank's exactly. --overlap-grad-reduce
// (small buckets) and ZeRO-1 over 2 data ranks keep the lines of the reduction after the schedule.
TEST_F(PipelineParallelCli, SamplesTensorBoardAndOverlapAcrossStagesAreOneRanks) {
  const std::string common = "--untie-embeddings-and-output-weights --sample-interval 10 --sample-length 6 ";
  auto samples = [](const std::string& out) {
    std::vector<std::string> v;
    const std::regex re(R"( sample at iteration +\d+ \(.*)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
      v.push_back(it->str());
    return v;
  };
  for (const std::string temp : {"", "--sample-temperature 0.8 "}) {
    SCOPED_TRACE(temp);
    const std::string tb1 = dir_ / "tb1", tb2 = dir_ / "tb2";
    std::filesystem::remove_all(tb1);
    std::filesystem::remove_all(tb2);
    auto one = RunCmd(Train(1, 1, common + temp + "--tensorboard-dir " + ShellQuote(tb1)));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    auto two = Ranks(2, Train(1, 2, common + temp + "--tensorboard-dir " + ShellQuote(tb2)));
    ASSERT_NE(two.output.find(AllZero(2)), std::string::npos) << two.output << Logs(2);
    const auto want = samples(one.output);
    ASSERT_EQ(want.size(), 2u) << one.output;
    EXPECT_EQ(samples(two.output), want) << two.output;
    // The last stage wrote the events (its log names them), and only it.
    EXPECT_NE(Logs(2).find("TensorBoard events: " + tb2), std::string::npos) << Logs(2);
    const std::string first = ptk::testing::ReadFile(RankLog(0));
    EXPECT_EQ(first.find("TensorBoard events: "), std::string::npos) << first;
    // The same scalars, tag, step and value (the grad norm's sum of squares is added stage by stage:
    // within 1e-6 relative).
    const auto want_scalars = EventScalars(tb1), got_scalars = EventScalars(tb2);
    EXPECT_GE(want_scalars.size(), 20u * 6);
    ASSERT_EQ(got_scalars.size(), want_scalars.size());
    int differ = 0;
    for (size_t i = 0; i < want_scalars.size(); ++i) {
      EXPECT_EQ(got_scalars[i].key, want_scalars[i].key);
      EXPECT_LE(std::abs(got_scalars[i].value - want_scalars[i].value), 1e-6 * std::abs(want_scalars[i].value))
          << want_scalars[i].key;
      differ += got_scalars[i].value != want_scalars[i].value;
    }
    std::printf("P=2 %s: %zu TensorBoard scalars, %d not bit for bit one rank's\n", temp.c_str(), want_scalars.size(),
                differ);
  }
  auto plain = Ranks(4, Train(1, 2, "--use-distributed-optimizer", 10));
  ASSERT_NE(plain.output.find(AllZero(4)), std::string::npos) << plain.output << Logs(4);
  auto overlapped =
      Ranks(4, Train(1, 2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000", 10));
  ASSERT_NE(overlapped.output.find(AllZero(4)), std::string::npos) << overlapped.output << Logs(4);
  EXPECT_NE(overlapped.output.find("reduced as backward completes them"), std::string::npos) << overlapped.output;
  ASSERT_EQ(Lines(plain.output).size(), 10u) << plain.output;
  EXPECT_EQ(Lines(overlapped.output), Lines(plain.output));
}

// --log-world-size-to-tensorboard logs Megatron's args.world_size, every rank of the run: 4 here (2 stages x 2
// data ranks); it logged the data ranks (2).
TEST_F(PipelineParallelCli, WorldSizeScalarCountsEveryRank) {
  const std::string tb = dir_ / "tb";
  auto r = Ranks(4, Train(1, 2, "--log-world-size-to-tensorboard --tensorboard-dir " + ShellQuote(tb), 4));
  ASSERT_NE(r.output.find(AllZero(4)), std::string::npos) << r.output << Logs(4);
  int seen = 0;
  for (const Scalar& s : EventScalars(tb))
    if (s.key.rfind("world-size@", 0) == 0) {
      EXPECT_EQ(s.value, 4.0f) << s.key;
      ++seen;
    }
  EXPECT_EQ(seen, 4);
}

// Over stages, the last stage's writer (Megatron's last rank) writes both the event files and
// --metrics-file: the metrics.jsonl that defaults to --tensorboard-dir goes with the events, into a
// fresh run's run-2 beside another run's event files, and stays there when the run resumes. Before,
// rank 0 kept writing it in the directory itself, into the other run's metrics.
TEST_F(PipelineParallelCli, MetricsGoWithTheEventsOfTheLastStage) {
  const std::string tb = dir_ / "tb", ck = ShellQuote(dir_ / "ck");
  std::filesystem::create_directories(tb);
  ptk::testing::WriteFile(tb + "/events.out.tfevents.1.other.1.0", "");  // another run's
  ptk::testing::WriteFile(tb + "/metrics.jsonl", "{\"iteration\": 1}\n");
  const std::string flags = "--tensorboard-dir " + ShellQuote(tb) + " --save " + ck + " --load " + ck;
  auto fresh = Ranks(2, Train(1, 2, flags + " --exit-interval 2", 4));
  ASSERT_NE(fresh.output.find(AllZero(2)), std::string::npos) << fresh.output << Logs(2);
  EXPECT_NE(Logs(2).find("writes its own in " + tb + "/run-2"), std::string::npos) << Logs(2);
  auto resumed = Ranks(2, Train(1, 2, flags, 4));
  ASSERT_NE(resumed.output.find(AllZero(2)), std::string::npos) << resumed.output << Logs(2);
  EXPECT_NE(Logs(2).find("TensorBoard events: " + tb + "/run-2/events.out.tfevents."), std::string::npos) << Logs(2);
  EXPECT_EQ(ptk::testing::ReadFile(tb + "/metrics.jsonl"), "{\"iteration\": 1}\n");
  const std::string lines = ptk::testing::ReadFile(tb + "/run-2/metrics.jsonl");
  // Iterations 1 to 4, then the evaluation after the last (its record keyed "lm_loss_validation").
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 4 + 1) << lines;
  EXPECT_NE(lines.find("{\"iteration\": 4, \"consumed_samples\": 32, \"lm_loss\": "), std::string::npos) << lines;
  EXPECT_NE(lines.find("{\"iteration\": 4, \"consumed_samples\": 32, \"lm_loss_validation\": "), std::string::npos)
      << lines;
}

// A start refused on the last stage (the writer of --metrics-file, held here by another run) is
// refused on every rank: rank 0, which made and locked --save at start-up, removes it again
// instead of leaving it behind empty.
TEST_F(PipelineParallelCli, AStartRefusedOnTheLastStageLeavesNoSave) {
  const std::string held = dir_ / "held.jsonl", ck = dir_ / "ck";
  auto lock = OutputLock::Acquire(held);  // another run writing there
  ASSERT_TRUE(lock.ok()) << lock.status();
  auto r = Ranks(2, Train(1, 2, "--metrics-file " + ShellQuote(held) + " --save " + ShellQuote(ck), 4));
  EXPECT_EQ(r.output.find(AllZero(2)), std::string::npos) << r.output << Logs(2);
  EXPECT_NE(Logs(2).find("--metrics-file " + held), std::string::npos) << Logs(2);
  EXPECT_FALSE(ptk::testing::Exists(ck));
}

TEST_F(PipelineParallelCli, CheckpointsResumeAtTheSameAndOtherPipelineSizes) {
  const auto train = [&](const std::string& extra) { return Train(1, 2, extra); };
  ASSERT_NO_FATAL_FAILURE(
      StopAndResumeAtTheSameSize(2, train, "[ t 1/1, p 1/2 ]", {"mp_rank_00_000", "mp_rank_00_001"}, "mp_rank_00"));
  // ptk-convert reads the stages put together (as any other layout): iteration 10's, copied.
  auto hf =
      RunCmd(ptk::testing::Tool("ptk-convert") + " --loader ptk --saver hf --load-dir " + ShellQuote(dir_ / "ck1") +
             " --save-dir " + ShellQuote(dir_ / "hf") + " " + testing::SmallVocabFlags());
  EXPECT_EQ(hf.exit_code, 0) << hf.output;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "hf/model.safetensors")) << hf.output;
  // Another pipeline size: the stages put together and cut anew; one rank's losses within 1e-6.
  const auto one = Losses(OneRank());
  for (int P : {1, 4}) {
    const std::string dst = dir_ / ("ck" + std::to_string(P)),
                      what = "P=2 checkpoint resumed at P=" + std::to_string(P);
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunGivingLosses(P, Train(1, P, "--load " + ShellQuote(dst) + " --save " + ShellQuote(dst)),
                                            one, 10, 1e-6, what, &out));
    EXPECT_NE(out.find("saved with --pipeline-model-parallel-size 2)"), std::string::npos) << out;
    EXPECT_EQ(Losses(out).front().first, 11);
  }
}

// Only the first and last stage read the data (tokens; labels and loss mask): stages 1 and 2 of 4
// run in a directory where the relative --data-path and --data-cache-path name nothing, and the
// run gives one rank's losses (the middle stages' dropout keyed by the first stage's samples).
TEST_F(PipelineParallelCli, MiddleStagesOpenNoDataFile) {
  std::string cmd = Train(1, 4, "");
  for (const auto& [abs, rel] : {std::pair<std::string, std::string>{ShellQuote(prefix_), "data_text_document"},
                                 std::pair<std::string, std::string>{ShellQuote(dir_ / "cache"), "cache"}}) {
    const size_t at = cmd.find(abs);
    ASSERT_NE(at, std::string::npos) << cmd;
    cmd.replace(at, abs.size(), rel);
  }
  const std::string middle = dir_ / "middle";
  std::filesystem::create_directories(middle);
  std::string script =
      "export WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(testing::FreeTestPort()) + "; pids=; ";
  for (int rank : {1, 2, 3})
    script += "(cd " + ShellQuote(rank == 3 ? dir_.path() : middle) + " && RANK=" + std::to_string(rank) +
              " timeout 300 " + cmd + ") > " + ShellQuote(RankLog(rank)) + " 2>&1 & pids=\"$pids $!\"; ";
  script += "cd " + ShellQuote(dir_.path()) + " && RANK=0 timeout 300 " + cmd +
            "; rcs=$?; for p in $pids; do wait $p; rcs=\"$rcs $?\"; done; cat " + ShellQuote(RankLog(3)) +
            "; echo rc=$rcs";  // rank 0's output, then the last rank's (its log lines)
  auto r = RunCmd("bash -c " + ShellQuote(script));
  ASSERT_NE(r.output.find(AllZero(4)), std::string::npos) << r.output << Logs(4);
  EXPECT_TRUE(std::filesystem::is_empty(middle));  // no cache made there either
  const auto pp = Losses(r.output);
  ASSERT_EQ(pp.size(), 20u) << r.output;
  EXPECT_LT(Worst(pp, Losses(OneRank())), 1e-6);
}

// kill -9 of stage 1 of 4 while it trains: every other stage ends with exit 1 within the
// distributed timeout; the last checkpoint resumes with the lines of a run never killed. The killed
// run cannot end by itself (100000 iterations, the learning rate decayed over the first 1000), and the
// run never killed is made after it, to 5 iterations past the checkpoint the kill left: the kill used
// to have to land before the checkpoint of iteration 10 (5 iterations after the tracker named 5),
// however late the polling shell was scheduled.
TEST_F(PipelineParallelCli, AKilledMiddleStageEndsEveryRankAndTheRunResumes) {
  const std::string ck = dir_ / "ck";
  const std::string flags = "--distributed-timeout-minutes 0.2 --eval-iters 0 --lr-decay-iters 1000";
  const std::string cmd = Train(1, 4, flags + " --save " + ShellQuote(ck) + " --save-interval 5", 100000);
  const std::string port = std::to_string(testing::FreeTestPort());
  std::string script = "export WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; ";
  for (int rank : {0, 1, 2, 3})
    script += "RANK=" + std::to_string(rank) + " " + cmd + " > " +
              ShellQuote(dir_ / ("k" + std::to_string(rank) + ".log")) + " 2>&1 & p" + std::to_string(rank) + "=$!; ";
  // Killed once the tracker names a checkpoint (of iteration 5 or later; polled with shell builtins;
  // the directory alone was there before the tracker named it).
  const std::string tracker = ShellQuote(ck + "/latest_checkpointed_iteration.txt");
  script += "end=$((SECONDS + 120)); until [ -f " + tracker + " ] && { read -r i < " + tracker +
            "; [ \"${i:-0}\" -ge 5 ]; } || [ $SECONDS -ge $end ]; do :; done; kill -9 $p1; start=$SECONDS; wait $p0; "
            "r0=$?; wait $p2; r2=$?; wait $p3; "
            "r3=$?; wait $p1; echo rc=$r0,$r2,$r3 after=$((SECONDS-start))";
  auto r = RunCmd("bash -c " + ShellQuote(script));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("rc=(\\d+),(\\d+),(\\d+) after=(\\d+)"))) << r.output;
  for (int k : {1, 2, 3}) EXPECT_EQ(m[k], "1") << r.output;
  EXPECT_LE(std::stoi(m[4]), 30) << r.output;
  for (int rank : {0, 2}) {  // the victim's neighbours name the failed exchange
    const std::string log = ptk::testing::ReadFile(dir_ / ("k" + std::to_string(rank) + ".log"));
    EXPECT_NE(log.find("failed (a rank died or the network failed)"), std::string::npos) << rank << "\n" << log;
  }
  // The checkpoint the tracker names, resumed: the never-killed run's lines from there.
  const std::string latest = ptk::testing::ReadFile(ck + "/latest_checkpointed_iteration.txt");
  const int from = std::atoi(latest.c_str());
  ASSERT_GE(from, 5) << latest;
  const int end = from + 5;
  std::printf("stage 1 killed after iteration %d's checkpoint; resumed to %d\n", from, end);
  const std::string until = " --exit-interval " + std::to_string(end);
  auto ref = Ranks(4, Train(1, 4, flags + until, 100000));
  ASSERT_NE(ref.output.find(AllZero(4)), std::string::npos) << ref.output << Logs(4);
  auto resumed = Ranks(4, Train(1, 4, flags + until + " --load " + ShellQuote(ck), 100000));
  ASSERT_NE(resumed.output.find(AllZero(4)), std::string::npos) << resumed.output << Logs(4);
  const auto whole = Lines(ref.output), again = Lines(resumed.output);
  ASSERT_EQ(whole.size(), static_cast<size_t>(end)) << ref.output;
  ASSERT_EQ(again.size(), 5u) << resumed.output;
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i], whole[static_cast<size_t>(from) + i]);
}

TEST_F(PipelineParallelCli, SizesThatDoNotDivideAreRefusedOnEveryRank) {
  struct Case {
    int world, P;
    std::string says;
  };
  for (const Case& c : {Case{3, 2, "is not divisible by"},
                        Case{3, 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"}}) {
    auto r = Ranks(c.world, Train(1, c.P, "", 2));
    EXPECT_NE(r.output.find("rc=2 2 2"), std::string::npos) << r.output << Logs(c.world);
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
    for (int rank = 1; rank < c.world; ++rank) {
      const std::string log = ptk::testing::ReadFile(RankLog(rank));
      EXPECT_NE(log.find(c.says), std::string::npos) << "rank " << rank << "\n" << log;
    }
  }
  // Stages on CUDA are not refused, with or without --sequence-parallel (their exchange is then
  // each tensor rank's positions): this one-rank run fails for what it lacks here (a device, or
  // ranks for its stages), never for the backend.
  auto cuda = RunCmd(Train(2, 2, "--device cuda --sequence-parallel", 2));
  EXPECT_NE(cuda.exit_code, 0) << cuda.output;
  EXPECT_EQ(cuda.output.find("runs on the CPU backend only"), std::string::npos) << cuda.output;
  auto stages = RunCmd(Train(1, 2, "--device cuda", 2));
  EXPECT_NE(stages.exit_code, 0) << stages.output;
  EXPECT_EQ(stages.output.find("runs on the CPU backend only"), std::string::npos) << stages.output;
}

}  // namespace
}  // namespace ptk
