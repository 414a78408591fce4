// The CUDA model's context parallelism, whole, on one GPU: C = 2 and 4 context ranks as threads of this process
// sharing the device, each its own fp32 CUDA model over its positions of every sample (ContextParallelPositions).
// NCCL cannot put two ranks on one GPU, so the context group here is gloo ranks whose device collectives are staged
// through the host (testing::StagedDeviceCollectives): the model's code path (the QKV all-gather, the key and value
// gradients' exchange, AddContextShares) is the one it takes over NCCL, only the transport differs. Against the CUDA
// model at C = 1 on the whole samples, dropout on (GPT-3's line) and the Llama line (RoPE, grouped-query attention):
// the ranks' loss sums added within 1e-5 relative, their token counts exactly, their gradients added (what the
// data x context all-reduce does) within 1e-4 of the largest (cuda_model_test's fp32 bounds); also C = 2 x T = 2
// (the tensor group's collectives staged alike, each rank's slices gathered). bf16 is refused.
// gpu-labelled: exit 77 without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "tests/trainer/cuda_model_test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/staged_device_comm.h"
#include "trainer/parallel_layout.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using cuda_model_test::Batches;
using testing::StagedDeviceCollectives;

struct CpRun {
  double loss_sum = 0, tokens = 0;
  std::vector<float> grads;  // summed over the ranks
  bool described = true;     // every rank's Describe names its context rank
};

// Rows `pos` of each of the b samples of x (b, t).
template <typename V>
std::vector<V> Rows(const V* x, int64_t b, int64_t t, const std::vector<int64_t>& pos) {
  std::vector<V> out;
  for (int64_t s = 0; s < b; ++s)
    for (const int64_t p : pos) out.push_back(x[s * t + p]);
  return out;
}

// A subgroup of the world and its device collectives staged through the host.
struct StagedGroup {
  std::unique_ptr<Communicator> group;
  std::unique_ptr<StagedDeviceCollectives> collectives;
};

void Stage(Communicator* world, const std::vector<int>& members, const std::string& name, StagedGroup* out) {
  auto g = world->Subgroup(members, name);
  ASSERT_TRUE(g.ok()) << g.status();
  out->group = std::move(*g);
  out->collectives = std::make_unique<StagedDeviceCollectives>(out->group.get());
}

// One training pass (ZeroGrads, ForwardBackward with dropout's seed 99) over batch 0 at context size C and tensor
// size T (world rank r: tensor rank r % T, context rank r / T, Megatron's tp-cp order): the loss sums and token
// counts of one tensor rank per context rank added, each context rank's gradients gathered from its tensor
// ranks' slices (CopyFromShard), then added over the context ranks.
CpRun Run(const GPTConfig& c, int C, int T = 1) {
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
    if (T > 1) {
      ASSERT_NO_FATAL_FAILURE(Stage(world, tensor_members, "tensor", &tensor));
      o.tensor = tensor.collectives.get();
    }
    if (C > 1) {
      ASSERT_NO_FATAL_FAILURE(Stage(world, context_members, "context", &context));
      o.context = context.collectives.get();
    }
    std::unique_ptr<GPTModel> model = cuda_model_test::Cuda(c, Precision::kFp32, /*deterministic=*/true, o);
    ASSERT_NE(model, nullptr);
    const std::vector<int64_t> pos = ContextParallelPositions(whole.t, C, cr);
    const int64_t t = whole.t / C;
    const std::vector<int32_t> tokens = Rows(whole.tokens, whole.b, whole.t, pos),
                               labels = Rows(whole.labels, whole.b, whole.t, pos),
                               positions = Rows(whole.position_ids, whole.b, whole.t, pos);
    const std::vector<float> mask = Rows(whole.loss_mask, whole.b, whole.t, pos);
    const ModelBatch mine{whole.b, t, tokens.data(), labels.data(), positions.data(), mask.data(), whole.sample_keys};
    ASSERT_TRUE(model->ZeroGrads().ok());
    auto loss = model->ForwardBackward(mine, 1.0 / 256, /*train=*/true, 99);
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

void ExpectFollowsOneRank(const GPTConfig& c, const std::string& name) {
  const CpRun one = Run(c, 1);
  for (const auto& [C, T] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE(name + " C=" + std::to_string(C) + " T=" + std::to_string(T));
    const CpRun cp = Run(c, C, T);
    EXPECT_TRUE(cp.described);
    EXPECT_EQ(cp.tokens, one.tokens);
    EXPECT_NEAR(cp.loss_sum, one.loss_sum, 1e-5 * std::abs(one.loss_sum));
    ASSERT_EQ(cp.grads.size(), one.grads.size());
    double dmax = 0, gmax = 0;
    for (size_t i = 0; i < one.grads.size(); ++i) {
      gmax = std::max(gmax, static_cast<double>(std::abs(one.grads[i])));
      dmax = std::max(dmax, static_cast<double>(std::abs(one.grads[i] - cp.grads[i])));
    }
    EXPECT_LT(dmax, 1e-4 * gmax) << "largest gradient difference " << dmax << " of " << gmax;
    std::printf("%s C=%d T=%d: loss sum %.9g vs %.9g; largest gradient difference %.3g of %.3g\n", name.c_str(), C, T,
                cp.loss_sum, one.loss_sum, dmax, gmax);
  }
}

TEST(CudaContextParallel, RanksOnOneGpuAddUpToOneRank) {
  ExpectFollowsOneRank(cuda_model_test::SmallConfig(/*dropout=*/true), "GPT, dropout");
  ExpectFollowsOneRank(cuda_model_test::LlamaConfig(), "Llama");
}

TEST(CudaContextParallel, HalfPrecisionIsRefused) {
  const GPTConfig c = cuda_model_test::SmallConfig(/*dropout=*/false);
  testing::RunRanks(2, [&](Communicator* host, int) {
    StagedDeviceCollectives context(host);
    cuda::CudaModelOptions o;
    o.context = &context;
    auto m = cuda::CreateCudaGPTModel(c, Precision::kBf16, 0, true, 4, false, o);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("context parallelism on the CUDA backend runs in fp32 only"), std::string::npos)
        << m.status();
  });
}

}  // namespace
}  // namespace ptk
