// --overlap-grad-reduce's pieces: the order in which backward completes the gradient ranges
// (final LayerNorm and an untied output layer, layers from the last, embeddings), Megatron's
// buckets over them (--ddp-bucket-size), the tracker that says which buckets a finished range
// completes, the worker thread; and on the CPU model, that each bucket's reduction is called in
// that order while backward still runs (it starts before ForwardBackward returns, and backward does
// not wait for it), with the sum a reduction after backward gives.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/grad_buckets.h"

namespace ptk {
namespace {

GPTConfig Config(bool untied) {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 64;
  c.seq_length = c.max_position_embeddings = 8;
  c.vocab_size = 97;
  c.padded_vocab_size = 128;
  c.untie_embeddings_and_output_weights = untied;
  c.hidden_dropout = c.attention_dropout = 0.0;
  return c;
}

TEST(GradBuckets, BackwardCompletesTheHeadThenLayersFromTheLastThenTheEmbeddings) {
  for (bool untied : {false, true}) {
    auto layout = ParamLayout::Create(Config(untied));
    ASSERT_TRUE(layout.ok());
    const std::vector<GradRange> order = BackwardReadyOrder(*layout);
    ASSERT_EQ(order.size(), 5u);
    EXPECT_EQ(order[0], (GradRange{layout->lnf_w, layout->num_params}));
    if (untied) {
      EXPECT_EQ(layout->out_w, layout->lnf_b + 16);  // the untied output layer is in the first range
    }
    EXPECT_EQ(order[1].begin, layout->layers[2].ln1_w);
    EXPECT_EQ(order[2].begin, layout->layers[1].ln1_w);
    EXPECT_EQ(order[3].begin, layout->layers[0].ln1_w);
    EXPECT_EQ(order[4], (GradRange{layout->wte, layout->layers[0].ln1_w}));  // the tied output layer's too
    for (size_t i = 1; i < order.size(); ++i) EXPECT_EQ(order[i].end, order[i - 1].begin) << "contiguous, descending";
    EXPECT_EQ(order.back().begin, 0);
  }
}

TEST(GradBuckets, MegatronsBucketsGatherRangesUntilTheSize) {
  auto layout = ParamLayout::Create(Config(false));
  ASSERT_TRUE(layout.ok());
  const std::vector<GradRange> order = BackwardReadyOrder(*layout);
  // One element: a bucket per range. Everything: one bucket. Between: ranges gathered in order.
  EXPECT_EQ(MakeGradBuckets(*layout, 1), order);
  EXPECT_EQ(MakeGradBuckets(*layout, layout->num_params), (std::vector<GradRange>{{0, layout->num_params}}));
  const int64_t layer = order[1].size();
  const std::vector<GradRange> b = MakeGradBuckets(*layout, layer + 1);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (GradRange{order[1].begin, layout->num_params}));  // head + last layer
  EXPECT_EQ(b[1], (GradRange{order[3].begin, order[2].end}));        // the two first layers
  EXPECT_EQ(b[2], order[4]);                                         // the embeddings (>= the size alone)
  EXPECT_EQ(DefaultDdpBucketSize(8), 40000000);
  EXPECT_EQ(DefaultDdpBucketSize(64), 64000000);
}

TEST(GradBuckets, TrackerCompletesABucketWhenAllItsRangesAreDone) {
  BucketTracker t({{60, 100}, {20, 60}, {0, 20}});
  EXPECT_EQ(t.MarkReady(80, 100), std::vector<int>{});
  EXPECT_EQ(t.MarkReady(50, 80), std::vector<int>{0});
  EXPECT_EQ(t.MarkReady(20, 50), std::vector<int>{1});
  EXPECT_FALSE(t.AllDone());
  EXPECT_EQ(t.MarkReady(0, 20), std::vector<int>{2});
  EXPECT_TRUE(t.AllDone());
  EXPECT_EQ(t.MarkReady(0, 100), std::vector<int>{}) << "a bucket completes once";
}

TEST(GradBuckets, WorkerRunsInOrderAndReportsTheFirstError) {
  std::vector<int> ran;
  BucketWorker w([&](int b) {
    ran.push_back(b);
    return b == 2 ? absl::UnavailableError("bucket 2") : absl::OkStatus();
  });
  for (int b : {0, 1, 2, 3}) w.Enqueue(b);
  absl::Status st = w.Finish();
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2})) << "buckets after a failure are skipped";
  w.Enqueue(5);
  EXPECT_TRUE(w.Finish().ok());
}

// A communicator of rank 0 of 2 that adds nothing: it records each all-reduce (offset in the
// gradient buffer, length, when), and its first call holds the worker for `hold`.
class RecordingComm : public Communicator {
 public:
  // The first reduction holds until Release() (or `hold` passes): a backward that overlaps its
  // reductions returns while the first one is still held; one that waits for them cannot.
  RecordingComm(const float* base, std::chrono::milliseconds hold) : base_(base), hold_(hold) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view backend() const override { return "recording"; }
  absl::Status AllReduceSum(float* data, int64_t n) override {
    std::unique_lock<std::mutex> lock(mu);
    if (calls.empty()) {
      first_started = true;
      started_cv.notify_all();
      held_until_released = cv.wait_for(lock, hold_, [this] { return released; });
    }
    calls.push_back({data - base_, data - base_ + n});
    return absl::OkStatus();
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }
  absl::Status AllReduceSum(double*, int64_t) override { return absl::OkStatus(); }
  absl::Status ReduceScatterSum(float*, std::span<const int64_t>) override { return absl::OkStatus(); }
  absl::Status AllGather(void*, std::span<const int64_t>) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, int64_t, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }

  std::mutex mu;
  std::condition_variable cv, started_cv;
  std::vector<GradRange> calls;
  bool first_started = false;        // the first bucket's reduction began
  bool released = false;             // the test let it go
  bool held_until_released = false;  // it was still held when the test let it go

 private:
  const float* base_;
  std::chrono::milliseconds hold_;
};

struct Batch {
  int64_t b, t;
  std::vector<int32_t> tokens, labels, positions;
  std::vector<float> mask;
  explicit Batch(int64_t b_ = 2, int64_t t_ = 8) : b(b_), t(t_) {
    for (int64_t i = 0; i < b * t; ++i) {
      tokens.push_back(static_cast<int32_t>((i * 37 + 5) % 97));
      labels.push_back(static_cast<int32_t>((i * 11 + 3) % 97));
      positions.push_back(static_cast<int32_t>(i % t));
      mask.push_back(1.0f);
    }
  }
  ModelBatch View() const { return {b, t, tokens.data(), labels.data(), positions.data(), mask.data(), nullptr}; }
};

TEST(GradBuckets, CpuBackwardReducesEachBucketInOrderWhileItRuns) {
  for (bool untied : {false, true}) {
    // Layers wide enough that backward below the head takes far longer than a thread's wake-up.
    GPTConfig c = Config(untied);
    c.hidden_size = 256;
    c.ffn_hidden_size = 1024;
    c.seq_length = c.max_position_embeddings = 64;
    auto model = CpuGPTModel::Create(c);
    ASSERT_TRUE(model.ok());
    ASSERT_TRUE((*model)->InitWeights(3).ok());
    const std::vector<GradRange> buckets = MakeGradBuckets((*model)->layout(), 1);
    // Held for up to 120 s: a backward that waited for the reduction would return only then.
    RecordingComm comm((*model)->grads(), std::chrono::seconds(120));
    Batch batch(4, 64);
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    ASSERT_TRUE((*model)->StartGradReduction(&comm, buckets).ok());
    auto fb = (*model)->ForwardBackward(batch.View(), 1.0, /*train=*/true, 1);
    // Backward handed the first bucket over before FinishGradReduction: it starts without it.
    bool started_without_finish;
    {
      std::unique_lock<std::mutex> lock(comm.mu);
      started_without_finish =
          comm.started_cv.wait_for(lock, std::chrono::seconds(120), [&] { return comm.first_started; });
    }
    comm.Release();
    ASSERT_TRUE(fb.ok()) << fb.status();
    ASSERT_TRUE((*model)->FinishGradReduction().ok());
    ASSERT_EQ(comm.calls, buckets) << "each bucket once, in backward order";
    // The first bucket's reduction started before Finish, and backward went on without it.
    EXPECT_TRUE(started_without_finish);
    EXPECT_TRUE(comm.held_until_released) << "backward waited for the first bucket's reduction";
  }
}

TEST(GradBuckets, OverlappedSumEqualsTheSumAfterBackward) {
  // A communicator that doubles what it is given stands for the sum of two equal ranks.
  class Doubling : public RecordingComm {
   public:
    using RecordingComm::RecordingComm;
    absl::Status AllReduceSum(float* data, int64_t n) override {
      for (int64_t i = 0; i < n; ++i) data[i] += data[i];
      return absl::OkStatus();
    }
  };
  Batch batch;
  std::vector<float> after, overlapped;
  for (bool overlap : {false, true}) {
    auto model = CpuGPTModel::Create(Config(false));
    ASSERT_TRUE(model.ok());
    ASSERT_TRUE((*model)->InitWeights(3).ok());
    Doubling comm((*model)->grads(), std::chrono::milliseconds(0));
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    ASSERT_TRUE((*model)->ForwardBackward(batch.View(), 0.5, true, 1).ok());  // an earlier micro-batch
    if (overlap) {
      ASSERT_TRUE((*model)->StartGradReduction(&comm, MakeGradBuckets((*model)->layout(), 700)).ok());
    }
    ASSERT_TRUE((*model)->ForwardBackward(batch.View(), 1.0, true, 1).ok());
    if (overlap) {
      ASSERT_TRUE((*model)->FinishGradReduction().ok());
    } else {
      ASSERT_TRUE((*model)->AllReduceGrads(&comm).ok());
    }
    std::vector<float>& g = overlap ? overlapped : after;
    g.resize(static_cast<size_t>((*model)->num_params()));
    ASSERT_TRUE((*model)->ReadGrads(g).ok());
  }
  EXPECT_EQ(std::memcmp(after.data(), overlapped.data(), after.size() * 4), 0);
}

TEST(GradBuckets, BucketsMustTileTheBufferAndFinishNeedsAStart) {
  auto model = CpuGPTModel::Create(Config(false));
  ASSERT_TRUE(model.ok());
  auto comm = MakeLocalCommunicator();
  const int64_t n = (*model)->num_params();
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->StartGradReduction(comm.get(), {{0, n - 1}})));
  EXPECT_TRUE(absl::IsInvalidArgument((*model)->StartGradReduction(comm.get(), {{0, 10}, {10, n}})));
  EXPECT_TRUE(absl::IsFailedPrecondition((*model)->FinishGradReduction()));
  ASSERT_TRUE((*model)->StartGradReduction(comm.get(), {{0, n}}).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*model)->StartGradReduction(comm.get(), {{0, n}})));
  // Finished without a backward: said so, and disarmed.
  EXPECT_TRUE(absl::IsInternal((*model)->FinishGradReduction()));
  EXPECT_TRUE(absl::IsFailedPrecondition((*model)->FinishGradReduction()));
}

// Without sequence parallelism the tensor group sums the gradients each rank holds its heads' share of: with
// --qk-layernorm the query and key norms, the multi-token prediction depths' as the decoder's (each rank's share,
// one rank's sum of all heads otherwise).
TEST(GradBuckets, TheTensorGroupSumsTheDepthsQueryAndKeyNormsToo) {
  GPTConfig c = Config(false);
  c.qk_layernorm = true;
  c.mtp_num_layers = 2;
  auto layout = ParamLayout::Create(c, /*tensor_size=*/2, 0);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<GradRange> ranges = NonTensorParallelGradRanges(*layout, false);
  auto summed = [&](int64_t at) {
    for (const GradRange& r : ranges)
      if (r.begin <= at && at < r.end) return true;
    return false;
  };
  EXPECT_TRUE(summed(layout->layers[2].q_norm_w));
  for (const MtpLayerParams& mp : layout->mtp) {
    EXPECT_TRUE(summed(mp.layer.q_norm_w));
    EXPECT_TRUE(summed(mp.layer.k_norm_w));
    EXPECT_FALSE(summed(mp.eh_proj));
    EXPECT_FALSE(summed(mp.enorm_w));  // whole on every rank, the same gradient on each without the sum
  }
}

}  // namespace
}  // namespace ptk
