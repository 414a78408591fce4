// The CUDA model against the CPU model (gpu-labelled: exits 77 without a device). One step's loss
// and gradients, a 50-step loss curve, determinism, checkpoint state crossing backends, and errors
// that must be statuses, never crashes. Tolerances: fp32 (no TF32) is compared tightly, bf16/fp16
// loosely, stated per check below. The fused paths against their unfused oracles are in
// cuda_model_fused_test.cpp (the same binary).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

// fp32 with dropout: the same masks on both backends (the counter hash), so gradients agree to
// rounding (1e-5 on the loss, 1e-4 relative L2 per tensor).
TEST(CudaModel, Fp32StepMatchesTheCpuWithDropout) {
  ExpectOneStepMatches(SmallConfig(/*dropout=*/true), Precision::kFp32, 1e-5, 1e-4, "the GPT model");
}
// bf16/fp16: 8/11-bit mantissas in the products; attention dropout off (cuDNN's own mask there).
TEST(CudaModel, Bf16StepMatchesTheCpu) {
  ExpectOneStepMatches(SmallConfig(/*dropout=*/false), Precision::kBf16, 1e-2, 6e-2, "the GPT model");
}
// --disable-bf16-reduced-precision-matmul: every product planned with its split-K sums kept in fp32
// (not deterministic: --deterministic-mode allows no split-K at all), the same bounds.
TEST(CudaModel, Bf16StepWithoutBf16ReductionsMatchesTheCpu) {
  cuda::CudaModelOptions exact;
  exact.disable_bf16_reduced_precision_matmul = true;
  ExpectOneStepMatches(SmallConfig(/*dropout=*/false), Precision::kBf16, 1e-2, 6e-2,
                       "the GPT model, --disable-bf16-reduced-precision-matmul", exact, /*deterministic=*/false);
}
TEST(CudaModel, Fp16StepMatchesTheCpu) {
  ExpectOneStepMatches(SmallConfig(/*dropout=*/false), Precision::kFp16, 5e-3, 3e-2, "the GPT model");
}

// 50 steps: fp32 within 1e-3 relative of the CPU's curve at every step; bf16 within 3e-2; both
// learn (the last loss well below the first).
TEST(CudaModel, FiftyStepsFollowTheCpuCurve) {
  const GPTConfig c = SmallConfig(/*dropout=*/false);
  Batches data(10, c.vocab_size);
  const std::vector<double> ref = ExpectCurvesFollowTheCpu(c, data, 50, 1e-3, 3e-2, "");
  LossScaleConfig fp16;
  fp16.dynamic = true;
  fp16.scale = 65536;
  auto half = Cuda(c, Precision::kFp16);
  ASSERT_TRUE(half);
  const std::vector<double> got = Curve(half.get(), data, 50, fp16);
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_NEAR(got.back(), ref.back(), 5e-2 * ref.back());
}

// Two runs, same seed: the same bits (no reduction whose order varies) in every precision.
TEST(CudaModel, SameSeedSameBits) {
  const GPTConfig c = SmallConfig(/*dropout=*/true);
  Batches data(10, c.vocab_size);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    std::vector<float> first;
    for (int run = 0; run < 2; ++run) {
      auto gpu = Cuda(c, p, /*deterministic=*/true);
      ASSERT_TRUE(gpu);
      Curve(gpu.get(), data, 5);
      std::vector<float> params(static_cast<size_t>(gpu->num_params()));
      ASSERT_TRUE(gpu->ReadParams(params).ok());
      if (run == 0)
        first = params;
      else
        EXPECT_TRUE(first == params) << PrecisionName(p);
    }
  }
}

// The state a checkpoint holds crosses backends exactly: read from the GPU, written to the CPU
// model and back, the parameters and moments come back bit for bit, and the CPU continues the
// GPU's run (next step's loss within fp32 tolerance).
TEST(CudaModel, StateCrossesBackendsExactly) {
  const GPTConfig c = SmallConfig(/*dropout=*/false);
  Batches data(10, c.vocab_size);
  auto gpu = Cuda(c, Precision::kFp32);
  ASSERT_TRUE(gpu);
  Curve(gpu.get(), data, 3);
  const size_t n = static_cast<size_t>(gpu->num_params());
  std::vector<float> p(n), m(n), v(n);
  ASSERT_TRUE(gpu->ReadParams(p).ok());
  ASSERT_TRUE(gpu->ReadMoments(m, v).ok());
  auto cpu = Cpu(c);
  ASSERT_TRUE(cpu->WriteParams(p).ok());
  ASSERT_TRUE(cpu->WriteMoments(m, v).ok());
  auto back = Cuda(c, Precision::kBf16);
  ASSERT_TRUE(back);
  ASSERT_TRUE(back->WriteParams(p).ok());
  ASSERT_TRUE(back->WriteMoments(m, v).ok());
  std::vector<float> p2(n), m2(n), v2(n);
  ASSERT_TRUE(back->ReadParams(p2).ok());
  ASSERT_TRUE(back->ReadMoments(m2, v2).ok());
  EXPECT_TRUE(p == p2 && m == m2 && v == v2) << "the fp32 master state must survive a bf16 model";
  auto a = cpu->Forward(data.Get(4));
  auto b = gpu->Forward(data.Get(4));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->loss_sum, a->loss_sum, 1e-5 * a->loss_sum);
}

// Evaluation's logits come back in fp32 and match the CPU's.
TEST(CudaModel, ForwardLogitsMatchTheCpu) {
  const GPTConfig c = SmallConfig(false);
  Batches data(1, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, Precision::kFp32);
  ASSERT_TRUE(gpu);
  std::vector<float> la, lb;
  ASSERT_TRUE(cpu->Forward(data.Get(0), &la).ok());
  ASSERT_TRUE(gpu->Forward(data.Get(0), &lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_LE(RelL2(lb.data(), la.data(), static_cast<int64_t>(la.size())), 1e-5);
}

// Bad input and impossible sizes are statuses, never a crash or a hang.
TEST(CudaModel, ErrorsAreStatuses) {
  const GPTConfig c = SmallConfig(false);
  Batches data(1, c.vocab_size);
  auto gpu = Cuda(c, Precision::kBf16);
  ASSERT_TRUE(gpu);
  std::vector<int32_t> bad = data.tokens[0];
  bad[5] = static_cast<int32_t>(c.padded_vocab_size);
  ModelBatch mb = data.Get(0);
  mb.tokens = bad.data();
  auto r = gpu->ForwardBackward(mb, 1.0, false, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("outside the vocabulary"), std::string::npos) << r.status();
  // The model is still usable after a refused batch.
  EXPECT_TRUE(gpu->ForwardBackward(data.Get(0), 1.0, false, 0).ok());
  // A plan far beyond the device's memory: ResourceExhausted naming the buffers, not a crash.
  GPTConfig huge = c;
  huge.seq_length = huge.max_position_embeddings = 4096;
  huge.num_layers = 48;
  auto oom = cuda::CreateCudaGPTModel(huge, Precision::kFp32, 0, false, 4096);
  ASSERT_FALSE(oom.ok());
  EXPECT_EQ(oom.status().code(), absl::StatusCode::kResourceExhausted) << oom.status();
  EXPECT_NE(std::string(oom.status().message()).find("attention probabilities"), std::string::npos) << oom.status();
  // A device that does not exist.
  auto missing = cuda::CreateCudaGPTModel(c, Precision::kFp32, 4096, false, 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(std::string(missing.status().message()).find("does not exist"), std::string::npos) << missing.status();
}

// A re-plan of a plan that fills most of the device (a larger micro-batch here; a pipeline stage's
// more slots the same): the old allocation counts as room for the new one, which therefore cannot be
// made beside it; the parameters and moments wait in host memory while the old one is freed (they
// were refused as out of memory before), come back bit for bit, and the pass gives the loss of a model
// planned for that batch at once. fp32 logits of 256 KiB a row fill the plans: 2 GiB at 128 x 64,
// with 1 GiB of the device left free beside the model.
TEST(CudaModel, ReplanThatFillsTheDeviceKeepsTheState) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.vocab_size = 60000;
  c.padded_vocab_size = 65536;
  const Batches small(1, c.vocab_size, 128, 64), large(1, c.vocab_size, 256, 64);
  double want = 0;
  {
    auto ref = cuda::CreateCudaGPTModel(c, Precision::kFp32, 0, /*deterministic=*/true, 256);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ASSERT_TRUE((*ref)->InitWeights(1234).ok());
    auto l = (*ref)->Forward(large.Get(0), nullptr);
    ASSERT_TRUE(l.ok()) << l.status();
    want = l->loss_sum;
  }
  auto gpu = cuda::CreateCudaGPTModel(c, Precision::kFp32, 0, /*deterministic=*/true, 128);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->InitWeights(1234).ok());
  ASSERT_TRUE((*gpu)->Forward(small.Get(0), nullptr).ok());
  const size_t np = static_cast<size_t>((*gpu)->num_params());
  std::vector<float> p(np), m(np), v(np), p2(np), m2(np), v2(np);
  for (size_t i = 0; i < np; ++i) {
    m[i] = 1e-3f * static_cast<float>(i % 1001);
    v[i] = 1e-6f * static_cast<float>(i % 997);
  }
  ASSERT_TRUE((*gpu)->WriteMoments(m, v).ok());
  ASSERT_TRUE((*gpu)->ReadParams(p).ok());
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  const size_t leave = size_t{1} << 30;
  ASSERT_GT(free_bytes, leave);
  void* blocker = nullptr;
  ASSERT_EQ(cudaMalloc(&blocker, free_bytes - leave), cudaSuccess);
  auto got = (*gpu)->Forward(large.Get(0), nullptr);
  ASSERT_EQ(cudaFree(blocker), cudaSuccess);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(got->loss_sum, want, 1e-5 * want);  // got's LM head ran in chunks, want's in one
  ASSERT_TRUE((*gpu)->ReadParams(p2).ok());
  ASSERT_TRUE((*gpu)->ReadMoments(m2, v2).ok());
  EXPECT_TRUE(p2 == p);
  EXPECT_TRUE(m2 == m);
  EXPECT_TRUE(v2 == v);
}

// The losses read once a step: ForwardBackwardDeferred over three micro-batches (no host
// synchronisation between them, the inputs through alternating pinned slots), then TakeLosses,
// against ForwardBackward's per-micro-batch sums added in order: the same loss and gradient bits
// (deterministic mode, fp32 and bf16, with dropout).
TEST(CudaModel, DeferredLossesMatchPerMicroBatchLossesBitwise) {
  const GPTConfig c = SmallConfig(/*dropout=*/true);
  Batches data(3, c.vocab_size);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    auto each = Cuda(c, p);
    auto deferred = Cuda(c, p);
    ASSERT_TRUE(each && deferred);
    ASSERT_TRUE(each->ZeroGrads().ok() && deferred->ZeroGrads().ok());
    double loss = 0, tokens = 0;
    for (int k = 0; k < 3; ++k) {
      auto s = each->ForwardBackward(data.Get(k), 1.0 / 600, /*train=*/true, 9);
      ASSERT_TRUE(s.ok()) << s.status();
      loss += s->loss_sum;
      tokens += s->tokens;
      ASSERT_TRUE(deferred->ForwardBackwardDeferred(data.Get(k), 1.0 / 600, /*train=*/true, 9).ok());
    }
    auto taken = deferred->TakeLosses();
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(taken->loss_sum, loss) << PrecisionName(p);
    EXPECT_EQ(taken->tokens, tokens) << PrecisionName(p);
    std::vector<float> ga(static_cast<size_t>(each->num_params())), gb(ga.size());
    ASSERT_TRUE(each->ReadGrads(ga).ok() && deferred->ReadGrads(gb).ok());
    EXPECT_EQ(ga, gb) << PrecisionName(p);
    EXPECT_EQ(deferred->TakeLosses()->tokens, 0.0);
  }
}

// One training run's results with the step's grad norms.
std::vector<StepResult> Steps(GPTModel* model, const Batches& data, int steps) {
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model, OptimizerConfig{0.9, 0.95, 1e-8, 1.0}, Schedule(), comm.get());
  std::vector<StepResult> out;
  for (int i = 0; i < steps; ++i) {
    auto r = opt.Step({data.Get(i)}, data.b, 7);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    out.push_back(*r);
  }
  return out;
}

// GPT-2 small's shape (12 layers, hidden 768, 12 heads, vocabulary 50257 padded to 50304, 1024
// tokens, a 2x1024 micro-batch: the LM head over 50304 columns, cuDNN's attention at head
// dimension 64): 5 iterations in bf16 against fp32 from the same weights. Each iteration's loss
// within 1e-2 relative, its grad norm within 5e-2 relative (bf16's 8-bit mantissa in every
// product and activation); no iteration skipped.
TEST(CudaModel, Gpt2SmallBf16FollowsFp32ForFiveIterations) {
  GPTConfig c;
  c.num_layers = 12;
  c.hidden_size = 768;
  c.num_attention_heads = 12;
  c.ffn_hidden_size = 3072;
  c.seq_length = c.max_position_embeddings = 1024;
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  c.hidden_dropout = c.attention_dropout = 0.0;
  Batches data(5, c.vocab_size, /*b=*/2, /*t=*/1024);
  auto fp32 = Cuda(c, Precision::kFp32);
  auto bf16 = Cuda(c, Precision::kBf16);
  ASSERT_TRUE(fp32 && bf16);
  const std::vector<StepResult> ref = Steps(fp32.get(), data, 5);
  const std::vector<StepResult> got = Steps(bf16.get(), data, 5);
  ASSERT_EQ(ref.size(), 5u);
  ASSERT_EQ(got.size(), 5u);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_FALSE(ref[i].skipped || got[i].skipped) << "iteration " << i + 1;
    EXPECT_NEAR(got[i].lm_loss(), ref[i].lm_loss(), 1e-2 * ref[i].lm_loss()) << "iteration " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, ref[i].grad_norm, 5e-2 * ref[i].grad_norm) << "iteration " << i + 1;
  }
}

// Per-sample gradients of sample r: the micro-batch's loss mask keeps sample r's tokens only (no
// other sample contributes to any gradient).
std::vector<float> SampleGrads(GPTModel* m, const ModelBatch& mb, uint64_t seed) {
  std::vector<float> g(static_cast<size_t>(m->num_params()));
  EXPECT_TRUE(m->ZeroGrads().ok());
  auto r = m->ForwardBackward(mb, 1.0 / 64, /*train=*/true, seed);
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(m->ReadGrads(g).ok());
  return g;
}

// Dropout masks depend on (seed, sample, layer, site) alone in bf16/fp16 too: cuDNN's attention
// dropout runs one sample per call with the sample's key. Each sample's gradients of every
// layer's QKV weight (where the attention mask acts first: dV is the dropped probabilities times
// dY) at micro-batch size 4 (the others masked out of the loss) equal its gradients at micro-batch
// size 1, within bf16/fp16 rounding of products of another shape (relative L2 3e-2); another
// sample's key (another mask) moves them by more than 0.2, so the check tells masks apart.
// Attention dropout 0.5 and no hidden dropout: the masks checked are cuDNN's.
TEST(CudaModel, HalfPrecisionDropoutMasksDependOnTheSampleAlone) {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.attention_dropout = 0.5;
  Batches data(1, c.vocab_size);
  const int64_t t = data.t;
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    auto gpu = Cuda(c, p);
    ASSERT_TRUE(gpu);
    for (int64_t r = 0; r < data.b; ++r) {
      std::vector<float> only_r(data.mask.size(), 0.0f);
      for (int64_t j = 0; j < t; ++j)
        only_r[static_cast<size_t>(r * t + j)] = data.mask[static_cast<size_t>(r * t + j)];
      ModelBatch four = data.Get(0);
      four.loss_mask = only_r.data();
      const std::vector<float> g4 = SampleGrads(gpu.get(), four, 99);
      const size_t off = static_cast<size_t>(r * t);
      const int64_t* key = data.keys[0].data() + r;
      ModelBatch one{1,
                     t,
                     data.tokens[0].data() + off,
                     data.labels[0].data() + off,
                     data.positions.data(),
                     data.mask.data() + off,
                     key};
      const std::vector<float> g1 = SampleGrads(gpu.get(), one, 99);
      const int64_t other = data.keys[0][static_cast<size_t>((r + 1) % data.b)] + 1000;
      one.sample_keys = &other;
      const std::vector<float> g_other = SampleGrads(gpu.get(), one, 99);
      for (const ParamInfo& info : gpu->params_info()) {
        if (info.name.find("linear_qkv.weight") == std::string::npos) continue;
        EXPECT_LE(RelL2(g1.data() + info.offset, g4.data() + info.offset, info.size), 3e-2)
            << info.name << ", sample " << r << " " << PrecisionName(p);
        EXPECT_GT(RelL2(g_other.data() + info.offset, g4.data() + info.offset, info.size), 0.2)
            << info.name << ", sample " << r << " " << PrecisionName(p);
      }
    }
  }
}

// PTK_CUDA_SYNC_OPS=1 (sync_ops) synchronises after every op and changes no result: one step's
// loss and gradients bit for bit against the model without it. --ptk-profile-ops' report ends with
// the count of cuBLASLt fallbacks (the line the bench parses).
TEST(CudaModel, SyncOpsChangesNothingAndTheProfileCountsFallbacks) {
  const GPTConfig c = SmallConfig(/*dropout=*/true);
  Batches data(1, c.vocab_size);
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    cuda::CudaModelOptions sync;
    sync.sync_ops = true;
    auto plain = Cuda(c, p);
    auto synced = Cuda(c, p, true, sync, /*profile=*/true);
    ASSERT_TRUE(plain && synced);
    std::vector<std::vector<float>> grads;
    std::vector<double> losses;
    for (GPTModel* m : {plain.get(), synced.get()}) {
      ASSERT_TRUE(m->ZeroGrads().ok());
      auto r = m->ForwardBackward(data.Get(0), 1.0 / 200, true, 3);
      ASSERT_TRUE(r.ok()) << r.status();
      losses.push_back(r->loss_sum);
      grads.emplace_back(static_cast<size_t>(m->num_params()));
      ASSERT_TRUE(m->ReadGrads(grads.back()).ok());
    }
    EXPECT_EQ(losses[0], losses[1]) << PrecisionName(p);
    EXPECT_TRUE(grads[0] == grads[1]) << PrecisionName(p);
    // The profile needs an update to report.
    const AdamWParams a{1e-3, 0.9, 0.95, 1e-8, 0.1, 1};
    ASSERT_TRUE(synced->AdamWUpdate(AdamWGroups::Uniform(a, a)).ok());
    const std::string report = synced->ProfileReport();
    EXPECT_NE(report.find("cuBLASLt fallbacks: "), std::string::npos) << report;
    std::printf("%s", report.c_str());
  }
}

// --ptk-profile-ops splits out the optimizer (one AdamW launch, the scale folded in) and the copies
// (the micro-batch's inputs to the device, its losses to the host) even where no dropout copies the
// residual gradient.
TEST(CudaModel, ProfileReportsTheOptimizerAndTheCopies) {
  const GPTConfig c = SmallConfig(/*dropout=*/false);
  Batches data(1, c.vocab_size);
  auto m = Cuda(c, Precision::kBf16, true, {}, /*profile=*/true);
  ASSERT_TRUE(m && m->ZeroGrads().ok());
  ASSERT_TRUE(m->ForwardBackwardDeferred(data.Get(0), 1.0 / 200, true, 3).ok());
  ASSERT_TRUE(m->TakeLosses().ok());
  const AdamWParams a{1e-3, 0.9, 0.95, 1e-8, 0.1, 1};
  ASSERT_TRUE(m->ScaledAdamWUpdate(0.5, AdamWGroups::Uniform(a, a)).ok());
  const std::string report = m->ProfileReport();
  EXPECT_NE(report.find("  adamw "), std::string::npos) << report;
  EXPECT_NE(report.find("  copies "), std::string::npos) << report;
}

// Megatron's parameter groups on the CUDA path (the multi-tensor AdamW's table and its four coefficient
// sets): five steps with --decoupled-lr, --decoupled-min-lr and --apply-wd-to-qk-layernorm on a model with
// query and key norms give the CPU model's weights (fp32: 1e-4 relative L2 per tensor), and the word
// embeddings are far from a run without the groups (the groups were applied, not ignored on both).
TEST(CudaModel, ParamGroupsFollowTheCpu) {
  const GPTConfig c = Qwen3Config(/*layernorm=*/true);
  Batches data(10, c.vocab_size);
  SchedulerConfig groups = Schedule();
  groups.decoupled_lr = 1e-2;
  groups.decoupled_min_lr = 1e-3;
  OptimizerConfig o{0.9, 0.95, 1e-8, 1.0};
  o.apply_wd_to_qk_layernorm = true;
  auto train = [&](GPTModel* m, const SchedulerConfig& s) {
    auto comm = MakeLocalCommunicator();
    TrainStep step(m, o, s, comm.get());
    for (int i = 0; i < 5; ++i) {
      auto r = step.Step({data.Get(i)}, data.b, 7);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  };
  auto cpu = Cpu(c), plain = Cpu(c);
  auto gpu = Cuda(c, Precision::kFp32);
  ASSERT_TRUE(gpu);
  ASSERT_NO_FATAL_FAILURE(train(cpu.get(), groups));
  ASSERT_NO_FATAL_FAILURE(train(gpu.get(), groups));
  ASSERT_NO_FATAL_FAILURE(train(plain.get(), Schedule()));
  std::vector<float> a(static_cast<size_t>(cpu->num_params())), b(a.size()), p(a.size());
  ASSERT_TRUE(cpu->ReadParams(a).ok());
  ASSERT_TRUE(gpu->ReadParams(b).ok());
  ASSERT_TRUE(plain->ReadParams(p).ok());
  for (const ParamInfo& info : cpu->params_info()) {
    EXPECT_LE(RelL2(b.data() + info.offset, a.data() + info.offset, info.size), 1e-4) << info.name;
    if (info.decoupled_lr) {
      EXPECT_GT(RelL2(p.data() + info.offset, a.data() + info.offset, info.size), 1e-2) << info.name;
    }
  }
}

}  // namespace
}  // namespace ptk
