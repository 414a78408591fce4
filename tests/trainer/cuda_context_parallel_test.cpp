// The CUDA model's context parallelism, whole, on one GPU: C = 2 and 4 context ranks as threads of this process
// sharing the device, each its own CUDA model over its positions of every sample (ContextParallelPositions).
// NCCL cannot put two ranks on one GPU, so the context group here is gloo ranks whose device collectives are staged
// through the host (testing::StagedDeviceCollectives): the model's code path (the QKV all-gather, the key and value
// gradients' exchange, AddContextShares) is the one it takes over NCCL, only the transport differs. fp32 against
// the CUDA model at C = 1 on the whole samples, dropout on (GPT-3's line) and the Llama line (RoPE, grouped-query
// attention): the ranks' loss sums added within 1e-5 relative, their token counts exactly, their gradients added
// (what the data x context all-reduce does) within 1e-4 of the largest (cuda_model_test's fp32 bounds); also
// C = 2 x T = 2, with and without --sequence-parallel (the tensor group's collectives staged alike, each rank's
// slices gathered; sequence parallel's hidden dropout keyed by true position). bf16 and fp16 (cuDNN's pairs of chunks
// without attention dropout or query groups, else the attention in fp32 on widened rows) against C = 1 in the same
// precision, bf16's cuDNN pairs against the rows attention, and bf16 with attention dropout against fp32 (the same
// masks); fp16 overflowing reaches the summed gradients. gpu-labelled: exit 77 without a device.
#include <cuda_runtime.h>
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "tests/trainer/context_rank_rows.h"
#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;
using testing::MakeStagedGroup;
using testing::StagedGroup;

struct CpRun {
  double loss_sum = 0, tokens = 0;
  std::vector<float> grads;  // summed over the ranks
  bool described = true;     // every rank's Describe names its context rank
};

// One training pass (ZeroGrads, ForwardBackward with dropout's seed 99 and loss scale `scale`) over batch 0 in
// precision p at context size C and tensor size T (world rank r: tensor rank r % T, context rank r / T, Megatron's
// tp-cp order): the loss sums and token counts of one tensor rank per context rank added, each context rank's gradients
// gathered from its tensor ranks' slices (CopyFromShard), then added over the context ranks.
CpRun TrainPass(const GPTConfig& c, int C, int T = 1, Precision p = Precision::kFp32, double scale = 1.0 / 256,
                bool sp = false, bool rows_attention = false) {
  const Batches data(1, c.vocab_size);
  const ModelBatch whole = data.Get(0);
  const int64_t params = ParamLayout::Create(c)->num_params;
  std::vector<std::vector<float>> gathered(static_cast<size_t>(C), std::vector<float>(static_cast<size_t>(params)));
  CpRun out;
  std::mutex mu;
  auto body = [&](Communicator* world, int r) {
    const int tr = r % T, cr = r / T;
    std::vector<int> tensor_members, context_members;
    for (int i = 0; i < T; ++i) tensor_members.push_back(cr * T + i);
    for (int q = 0; q < C; ++q) context_members.push_back(tr + q * T);
    StagedGroup tensor, context;
    cuda::CudaModelOptions o;
    o.unfused.context_rows_attention = rows_attention;
    if (T > 1) {
      ASSERT_NO_FATAL_FAILURE(MakeStagedGroup(world, tensor_members, "tensor", &tensor));
      o.tensor = tensor.device.get();
      o.sequence_parallel = sp;
    }
    if (C > 1) {
      ASSERT_NO_FATAL_FAILURE(MakeStagedGroup(world, context_members, "context", &context));
      o.context = context.device.get();
    }
    std::unique_ptr<GPTModel> model = cuda_model_test::Cuda(c, p, /*deterministic=*/true, o);
    ASSERT_NE(model, nullptr);
    const testing::ContextRows rows(whole, C, cr);
    const ModelBatch& mine = rows.batch;
    ASSERT_TRUE(model->ZeroGrads().ok());
    auto loss = model->ForwardBackward(mine, scale, /*train=*/true, 99);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(model->SumNonTensorParallelGrads().ok());
    std::vector<float> g(static_cast<size_t>(model->num_params()));
    ASSERT_TRUE(model->ReadGrads(g).ok());
    std::lock_guard<std::mutex> lock(mu);
    if (tr == 0) {
      out.loss_sum += loss->loss_sum;
      out.tokens += loss->tokens;
    }
    CopyFromShard(model->layout(), g, gathered[static_cast<size_t>(cr)]);
    if (C > 1) out.described = out.described && model->Describe().find("context rank") != std::string::npos;
  };
  if (C * T == 1)
    body(nullptr, 0);
  else
    testing::RunRanks(C * T, body);
  out.grads.assign(static_cast<size_t>(params), 0.0f);
  for (const std::vector<float>& g : gathered)
    for (size_t i = 0; i < g.size(); ++i) out.grads[i] += g[i];
  return out;
}

// cp's loss sum within loss_tol relative of ref's, its token count exact, its gradients within grad_tol of ref's
// largest.
void ExpectClose(const CpRun& ref, const CpRun& cp, double loss_tol, double grad_tol, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(cp.described);
  EXPECT_EQ(cp.tokens, ref.tokens);
  EXPECT_NEAR(cp.loss_sum, ref.loss_sum, loss_tol * std::abs(ref.loss_sum));
  ASSERT_EQ(cp.grads.size(), ref.grads.size());
  double dmax = 0, gmax = 0;
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    gmax = std::max(gmax, static_cast<double>(std::abs(ref.grads[i])));
    dmax = std::max(dmax, static_cast<double>(std::abs(ref.grads[i] - cp.grads[i])));
  }
  EXPECT_LT(dmax, grad_tol * gmax) << "largest gradient difference " << dmax << " of " << gmax;
  std::printf("%s: loss sum %.9g vs %.9g; largest gradient difference %.3g of %.3g\n", what.c_str(), cp.loss_sum,
              ref.loss_sum, dmax, gmax);
}

void ExpectFollowsOneRank(const GPTConfig& c, const std::string& name, Precision p = Precision::kFp32) {
  const bool fp32 = p == Precision::kFp32;
  const CpRun one = TrainPass(c, 1, 1, p);
  struct Split {
    int C, T;
    bool sp;
  };
  for (const Split& k : {Split{2, 1, false}, Split{4, 1, false}, Split{2, 2, false}, Split{2, 2, true}})
    ExpectClose(one, TrainPass(c, k.C, k.T, p, 1.0 / 256, k.sp), fp32 ? 1e-5 : 1e-2, fp32 ? 1e-4 : 6e-2,
                fmt::format("{} {} C={} T={}{}", name, PrecisionName(p), k.C, k.T, k.sp ? " sequence-parallel" : ""));
}

TEST(CudaContextParallel, RanksOnOneGpuAddUpToOneRank) {
  ExpectFollowsOneRank(cuda_model_test::SmallConfig(/*dropout=*/true), "GPT, dropout");
  ExpectFollowsOneRank(cuda_model_test::LlamaConfig(), "Llama");
}

// bf16 / fp16 (context parallelism's attention: cuDNN's pairs of chunks for GPT without attention dropout, the fp32
// rows attention on widened rows for Llama's query groups; the rest in the activation type, as C = 1 has it) against
// C = 1 in the same precision within cuda_model_test's bf16 bounds against the CPU (loss 1e-2, gradients 6e-2 of the
// largest): hidden dropout on (keyed by true position, as at C = 1) but no attention dropout, whose masks at C = 1
// are cuDNN's; with attention dropout (the rows attention) bf16 C = 2 against fp32 C = 1, whose masks it shares.
TEST(CudaContextParallel, HalfPrecisionRanksFollowOneRank) {
  GPTConfig hidden_dropout = cuda_model_test::SmallConfig(/*dropout=*/true);
  hidden_dropout.attention_dropout = 0;
  for (const Precision p : {Precision::kBf16, Precision::kFp16}) {
    ExpectFollowsOneRank(hidden_dropout, "GPT, hidden dropout", p);
    ExpectFollowsOneRank(cuda_model_test::LlamaConfig(), "Llama", p);
  }
  const GPTConfig dropout = cuda_model_test::SmallConfig(/*dropout=*/true);
  ExpectClose(TrainPass(dropout, 1), TrainPass(dropout, 2, 1, Precision::kBf16), 1e-2, 6e-2,
              "GPT, dropout, bf16 C=2 vs fp32 C=1");
}

// bf16 C = 2 without attention dropout (hidden dropout on) through cuDNN's pairs of chunks (ContextFlash: the
// partials merged by their log-sum-exps in fp32, the output rounded once, backward with the kept output and
// log-sum-exps) against the same split through the fp32 rows attention (CudaModelOptions::unfused's oracle): the
// same positions and masks, only the attention's arithmetic differs (bf16 operands and cuDNN's accumulation against
// fp32 products of the rounded rows), loss sums within 1e-3 relative, gradients within 3e-2 of the largest; and
// against C = 1 in bf16 (cuDNN's one-GPU attention) within the bf16 bounds above (1e-2, 6e-2). Also recomputed
// attention (--recompute-activations: the pairs' output and log-sum-exps are kept, not recomputed) against the rows
// attention recomputing its probabilities.
TEST(CudaContextParallel, CudnnPairsFollowTheRowsAttention) {
  GPTConfig c = cuda_model_test::SmallConfig(/*dropout=*/true);
  c.attention_dropout = 0;
  for (const bool recompute : {false, true}) {
    c.recompute_activations = recompute;
    const std::string name = recompute ? "GPT, recompute" : "GPT";
    const CpRun pairs = TrainPass(c, 2, 1, Precision::kBf16);
    const CpRun rows = TrainPass(c, 2, 1, Precision::kBf16, 1.0 / 256, false, /*rows_attention=*/true);
    ExpectClose(rows, pairs, 1e-3, 3e-2, name + ": bf16 C=2 cuDNN pairs vs rows attention");
    ExpectClose(TrainPass(c, 1, 1, Precision::kBf16), pairs, 1e-2, 6e-2, name + ": bf16 C=2 cuDNN pairs vs C=1");
  }
}

// fp16 at a loss scale its gradients overflow at: the passes succeed and the gradients summed over the context
// ranks (what the step's data x context all-reduce gives every rank) are not all finite, so every rank's step
// sees the overflow (found_inf) and skips.
TEST(CudaContextParallel, Fp16OverflowReachesTheSummedGradients) {
  const CpRun r = TrainPass(cuda_model_test::SmallConfig(/*dropout=*/false), 2, 1, Precision::kFp16, 1e9);
  EXPECT_TRUE(std::isfinite(r.loss_sum));
  EXPECT_FALSE(std::all_of(r.grads.begin(), r.grads.end(), [](float g) { return std::isfinite(g); }));
}

}  // namespace
}  // namespace ptk
