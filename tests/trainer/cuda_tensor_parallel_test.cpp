// The CUDA model's tensor parallelism, whole, on one GPU: T = 2 and 4 tensor ranks as threads of
// this process sharing the device, each its own fp32 CUDA model over its slices. NCCL cannot put two
// ranks on one GPU, so the tensor group here is gloo ranks whose device collectives are staged
// through the host (testing::StagedDeviceCollectives: the stream drained, the buffer copied out,
// gloo's collective, copied back): the model's code path is the one it takes over NCCL, only the transport
// differs. Against the CUDA model at T = 1 (dropout on): each rank's first loss within 1e-5 relative
// (the four AdamW steps after it 1e-4), the
// gradients gathered from the slices within 1e-4 of the largest (cuda_model_test's fp32 bounds),
// the tensors every rank holds whole with the same gradient bits on every rank; text-sample logits
// gathered whole; a few AdamW steps follow one rank's losses. With --sequence-parallel (the norms,
// hidden dropout and residual stream on each rank's positions) the same against one rank and
// against T = 2 without it, GPT-3's line and the Llama line; its partial gradients' sum over the
// group is one device all-reduce with the bits of one per range. gpu-labelled: exit 77 without a
// device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "common/status.h"
#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/param_shard.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;
using cuda_model_test::SmallConfig;

using testing::StagedDeviceCollectives;

struct TpRun {
  std::vector<std::vector<double>> losses;  // [rank][step]
  std::vector<float> grads;                 // the first pass's, gathered into the whole layout
  std::vector<float> logits;                // Forward's, rank 0's (whole rows)
  bool whole_tensors_same_bits = true;
};

// `steps` training steps at tensor size T (T = 1: one CUDA model, no group), with
// --sequence-parallel when `sp`: the first pass's gradients, each step's loss.
TpRun Train(int T, int steps, const GPTConfig& c = SmallConfig(/*dropout=*/true), bool sp = false) {
  const Batches data(steps, c.vocab_size);
  auto whole = ParamLayout::Create(c);
  TpRun out;
  out.grads.assign(static_cast<size_t>(whole->num_params), 0.0f);
  out.losses.assign(static_cast<size_t>(T), {});
  std::vector<std::vector<float>> rank_grads(static_cast<size_t>(T));
  std::mutex mu;
  auto body = [&](Communicator* host, int rank) {
    StagedDeviceCollectives tensor(host);
    cuda::CudaModelOptions o;
    o.tensor = T > 1 ? &tensor : nullptr;
    o.sequence_parallel = sp;
    std::unique_ptr<GPTModel> model = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
    ASSERT_NE(model, nullptr);
    if (sp && T > 1) {
      EXPECT_NE(model->Describe().find("sequence parallel"), std::string::npos) << model->Describe();
    }
    std::vector<float> logits;
    auto fwd = model->Forward(data.Get(0), &logits);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    const SchedulerConfig schedule = cuda_model_test::Schedule();
    for (int k = 0; k < steps; ++k) {
      ASSERT_TRUE(model->ZeroGrads().ok());
      auto loss = model->ForwardBackward(data.Get(k), 1.0 / 256, /*train=*/true, 99);
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(model->SumNonTensorParallelGrads().ok());  // the training step's sum of the partial ones
      std::vector<float> g(static_cast<size_t>(model->num_params()));
      ASSERT_TRUE(model->ReadGrads(g).ok());
      {
        std::lock_guard<std::mutex> lock(mu);
        out.losses[static_cast<size_t>(rank)].push_back(loss->loss_sum / loss->tokens);
        if (k == 0) {
          rank_grads[static_cast<size_t>(rank)] = g;
          CopyFromShard(model->layout(), g, out.grads);
          if (rank == 0) out.logits = logits;
        }
      }
      AdamWParams a{schedule.max_lr, 0.9, 0.95, 1e-8, 0.1, k + 1};
      AdamWParams none = a;
      none.weight_decay = 0;
      ASSERT_TRUE(model->AdamWUpdate(AdamWGroups::Uniform(a, none)).ok());
    }
  };
  if (T == 1) {
    body(nullptr, 0);
  } else {
    testing::RunRanks(T, body);
  }
  auto layout0 = ParamLayout::Create(c, T, 0);
  for (const ParamInfo& p : layout0->infos)
    if (p.tensor_split_dim < 0)
      for (int r = 1; r < T; ++r)
        out.whole_tensors_same_bits =
            out.whole_tensors_same_bits &&
            std::memcmp(rank_grads[0].data() + p.offset, rank_grads[static_cast<size_t>(r)].data() + p.offset,
                        static_cast<size_t>(p.size) * sizeof(float)) == 0;
  return out;
}

// Largest absolute difference of two vectors (gradients, logits), and the largest magnitude of the first.
std::pair<double, double> MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double gmax = 0, dmax = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    gmax = std::max(gmax, static_cast<double>(std::abs(a[i])));
    dmax = std::max(dmax, static_cast<double>(std::abs(a[i] - b[i])));
  }
  return {dmax, gmax};
}

// `tp` (T ranks, `steps` steps) against one rank's run `one`: the whole tensors' gradients the same
// bits on every rank, every gradient within 1e-4 of the largest, and each rank's losses, the first
// pass's within 1e-5 relative, the steps after it 1e-4.
void ExpectFollowsOneRank(const TpRun& tp, const TpRun& one, int T, int steps) {
  EXPECT_TRUE(tp.whole_tensors_same_bits);
  ASSERT_EQ(tp.grads.size(), one.grads.size());
  const auto [dmax, gmax] = MaxDiff(one.grads, tp.grads);
  EXPECT_LT(dmax, 1e-4 * gmax) << "largest gradient difference " << dmax << " of " << gmax;
  for (int r = 0; r < T; ++r) {
    ASSERT_EQ(tp.losses[static_cast<size_t>(r)].size(), static_cast<size_t>(steps));
    for (int k = 0; k < steps; ++k)
      EXPECT_NEAR(tp.losses[static_cast<size_t>(r)][k], one.losses[0][k], (k ? 1e-4 : 1e-5) * one.losses[0][k])
          << "rank " << r << " step " << k;
  }
  std::printf("T=%d: loss %.9g vs %.9g; largest gradient difference %.3g of %.3g\n", T, tp.losses[0][0],
              one.losses[0][0], dmax, gmax);
}

TEST(CudaTensorParallel, RanksOnOneGpuFollowOneRank) {
  const int steps = 5;
  const TpRun one = Train(1, steps);
  ASSERT_EQ(one.losses[0].size(), static_cast<size_t>(steps));
  for (int T : {2, 4}) {
    SCOPED_TRACE(fmt::format("T={}", T));
    const TpRun tp = Train(T, steps);
    ExpectFollowsOneRank(tp, one, T, steps);
    ASSERT_EQ(tp.logits.size(), one.logits.size());
    EXPECT_LT(MaxDiff(one.logits, tp.logits).first, 1e-4) << "gathered logits";
  }
}

// The Llama line at T = 2: each rank one of the two query groups (its two query heads), its gate and
// up rows of SwiGLU's fc1, its vocabulary slices of the untied embedding and output layer; RMSNorm
// and RoPE on every rank. Against one rank: the first pass's loss within 1e-5, its gradients 1e-4 of
// the largest, the whole tensors (the norms) the same bits on both ranks.
TEST(CudaTensorParallel, LlamaRanksFollowOneRank) {
  const int steps = 3;
  const GPTConfig c = cuda_model_test::LlamaConfig();
  const TpRun one = Train(1, steps, c), tp = Train(2, steps, c);
  ASSERT_EQ(one.losses[0].size(), static_cast<size_t>(steps));
  ExpectFollowsOneRank(tp, one, 2, steps);
}

// --qk-layernorm at T = 2 (RMSNorm, and LayerNorm with biases), with and without
// --sequence-parallel: each rank normalises its query groups' heads with the whole norms, whose
// gradients (each rank's heads' share) the step sums over the group (SumNonTensorParallelGrads):
// against one rank the first loss within 1e-5, the gradients within 1e-4 of the largest, and the
// norms' gradients the same bits on both ranks.
TEST(CudaTensorParallel, QKLayerNormRanksFollowOneRank) {
  const int steps = 3;
  for (bool layernorm : {false, true}) {
    const GPTConfig c = cuda_model_test::Qwen3Config(layernorm);
    const TpRun one = Train(1, steps, c);
    ASSERT_EQ(one.losses[0].size(), static_cast<size_t>(steps));
    for (bool sp : {false, true}) {
      SCOPED_TRACE(fmt::format("{}{}", layernorm ? "LayerNorm" : "RMSNorm", sp ? ", sequence parallel" : ""));
      const TpRun tp = Train(2, steps, c, sp);
      ExpectFollowsOneRank(tp, one, 2, steps);
      // The query and key norms' gradients: each rank had only its heads' share before the sum.
      auto layout = ParamLayout::Create(c);
      for (const ParamInfo& p : layout->infos) {
        if (p.name.find("q_layernorm") == std::string::npos && p.name.find("k_layernorm") == std::string::npos)
          continue;
        EXPECT_LE(cuda_model_test::RelL2(tp.grads.data() + p.offset, one.grads.data() + p.offset, p.size), 1e-4)
            << p.name;
      }
    }
  }
}

// --sequence-parallel at T = 2 (and 4 for GPT-3's line), dropout on: each rank keeps its positions
// of the residual stream, its norms' and dropout's rows; the hidden-dropout masks are those of one
// rank, so the losses and gradients follow one rank's (and T = 2's without sequence parallelism)
// within the bounds above, and the norms' gradients, summed over the group, have the same bits on
// every rank. The gathered logits of evaluation match too.
TEST(CudaTensorParallel, SequenceParallelFollowsOneRankAndTensorParallel) {
  const int steps = 4;
  struct Line {
    const char* name;
    GPTConfig config;
    std::vector<int> sizes;
  };
  for (const Line& line :
       {Line{"gpt", SmallConfig(/*dropout=*/true), {2, 4}}, Line{"llama", cuda_model_test::LlamaConfig(), {2}}}) {
    const TpRun one = Train(1, steps, line.config);
    ASSERT_EQ(one.losses[0].size(), static_cast<size_t>(steps));
    for (int T : line.sizes) {
      SCOPED_TRACE(fmt::format("{} T={}", line.name, T));
      const TpRun tp = Train(T, steps, line.config), sp = Train(T, steps, line.config, /*sp=*/true);
      EXPECT_TRUE(sp.whole_tensors_same_bits);
      const auto [d1, g1] = MaxDiff(one.grads, sp.grads);
      EXPECT_LT(d1, 1e-4 * g1) << "against one rank: largest gradient difference " << d1 << " of " << g1;
      const auto [d2, g2] = MaxDiff(tp.grads, sp.grads);
      EXPECT_LT(d2, 1e-4 * g2) << "against T ranks without --sequence-parallel: " << d2 << " of " << g2;
      for (int r = 0; r < T; ++r) {
        ASSERT_EQ(sp.losses[static_cast<size_t>(r)].size(), static_cast<size_t>(steps));
        for (int k = 0; k < steps; ++k) {
          EXPECT_NEAR(sp.losses[static_cast<size_t>(r)][k], one.losses[0][k], (k ? 1e-4 : 1e-5) * one.losses[0][k])
              << "rank " << r << " step " << k;
          EXPECT_NEAR(sp.losses[static_cast<size_t>(r)][k], tp.losses[0][k], (k ? 1e-4 : 1e-5) * tp.losses[0][k])
              << "rank " << r << " step " << k;
        }
      }
      ASSERT_EQ(sp.logits.size(), one.logits.size());
      EXPECT_LT(MaxDiff(one.logits, sp.logits).first, 1e-4) << "gathered logits";
      std::printf("%s T=%d sequence-parallel: loss %.9g vs %.9g (one rank); gradient difference %.3g of %.3g\n",
                  line.name, T, sp.losses[0][0], one.losses[0][0], d1, g1);
    }
  }
}

// SumNonTensorParallelGrads on the CUDA model gathers the ranges on the stream into the planned
// buffer, makes one device all-reduce of it over the tensor group, and scatters it back: at T = 2
// and 4 (fp32; bf16 at T = 2) one AllReduceSumDevice per sum, of every sequence-parallel gradient,
// and the gradients' bits those of one AllReduceGradRange per range (the staged gloo sum adds each
// element in rank order wherever it lies), every parameter's, on each of two passes (the buffer
// reused). The same bits through a host communicator (AllReduceGradRanges' host path: the gathered
// buffer down, gloo's sum, up again).
TEST(CudaTensorParallel, SequenceParallelSumIsOneDeviceAllReduceWithEachRangesBits) {
  const GPTConfig c = SmallConfig(/*dropout=*/true);
  const Batches data(2, c.vocab_size);
  for (const auto& size_precision :
       {std::pair{2, Precision::kFp32}, std::pair{4, Precision::kFp32}, std::pair{2, Precision::kBf16}}) {
    const int T = size_precision.first;
    const Precision precision = size_precision.second;
    SCOPED_TRACE(fmt::format("T={} {}", T, PrecisionName(precision)));
    testing::RunRanks(T, [&](Communicator* host, int rank) {
      StagedDeviceCollectives tensor(host);
      cuda::CudaModelOptions o;
      o.tensor = &tensor;
      o.sequence_parallel = true;
      std::unique_ptr<GPTModel> model = cuda_model_test::Cuda(c, precision, /*deterministic=*/true, o);
      ASSERT_NE(model, nullptr);
      const std::vector<GradRange> ranges = SequenceParallelGradRanges(model->layout());
      ASSERT_GT(ranges.size(), 2u);
      int64_t total = 0;
      for (const GradRange& g : ranges) total += g.size();
      const size_t n = static_cast<size_t>(model->num_params());
      for (int k = 0; k < 2; ++k)
        for (bool through_host : {false, true}) {
          SCOPED_TRACE(fmt::format("pass {}{}", k, through_host ? ", host communicator" : ""));
          Communicator* comm = through_host ? host : static_cast<Communicator*>(&tensor);
          std::vector<float> partial(n), per_range(n), again(n), coalesced(n);
          ASSERT_TRUE(model->ZeroGrads().ok());
          ASSERT_TRUE(model->ForwardBackward(data.Get(k), 1.0 / 256, /*train=*/true, 99).ok());
          ASSERT_TRUE(model->ReadGrads(partial).ok());
          for (const GradRange& g : ranges) ASSERT_TRUE(model->AllReduceGradRange(comm, g.begin, g.size()).ok());
          ASSERT_TRUE(model->ReadGrads(per_range).ok());
          ASSERT_TRUE(model->ZeroGrads().ok());
          ASSERT_TRUE(model->ForwardBackward(data.Get(k), 1.0 / 256, /*train=*/true, 99).ok());
          ASSERT_TRUE(model->ReadGrads(again).ok());
          ASSERT_EQ(std::memcmp(again.data(), partial.data(), n * sizeof(float)), 0) << "rank " << rank;
          const size_t before = tensor.device_all_reduces().size();
          if (through_host) {
            ASSERT_TRUE(model->AllReduceGradRanges(host, ranges).ok());
            EXPECT_EQ(tensor.device_all_reduces().size(), before);
          } else {
            ASSERT_TRUE(model->SumNonTensorParallelGrads().ok());
            EXPECT_EQ(std::vector<int64_t>(tensor.device_all_reduces().begin() + static_cast<std::ptrdiff_t>(before),
                                           tensor.device_all_reduces().end()),
                      std::vector<int64_t>{total})
                << "rank " << rank;
          }
          ASSERT_TRUE(model->ReadGrads(coalesced).ok());
          EXPECT_EQ(std::memcmp(coalesced.data(), per_range.data(), n * sizeof(float)), 0) << "rank " << rank;
          EXPECT_NE(std::memcmp(coalesced.data(), partial.data(), n * sizeof(float)), 0) << "rank " << rank;
        }
    });
  }
}

// A sequence length the group does not divide is refused when the model is made, naming the flag.
TEST(CudaTensorParallel, SequenceParallelNeedsTheSequenceToDivide) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.seq_length = c.max_position_embeddings = 63;
  std::vector<std::string> errors(2);
  testing::RunRanks(2, [&](Communicator* host, int rank) {
    StagedDeviceCollectives tensor(host);
    cuda::CudaModelOptions o;
    o.tensor = &tensor;
    o.sequence_parallel = true;
    auto m = cuda::CreateCudaGPTModel(c, Precision::kFp32, 0, true, 2, false, o);
    errors[static_cast<size_t>(rank)] = m.ok() ? "" : std::string(m.status().message());
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("--sequence-parallel: --seq-length 63 is not divisible"), std::string::npos) << e;
}

}  // namespace
}  // namespace ptk
