// Tensor parallelism on the CPU backend (Megatron's partition: column-parallel QKV and fc1,
// row-parallel proj and fc2, vocabulary-parallel embedding and cross-entropy) over gloo ranks as
// threads: T = 2 and 4 give one rank's loss and gradients (gathered from the slices), dropout on;
// the tensors every tensor rank holds whole get the same gradient bits on every rank; 20 training
// steps at T = 2, 4 and T = 2 x data 2 with ZeRO-1 follow one rank's losses within 1e-5; the same
// with sequence parallelism, which keeps only its rows of the sequence-parallel region; its partial
// gradients are summed over the tensor group after the data-parallel reduction, bit for bit
// Megatron's order, in one all-reduce of them all (the bits of a sum per range), timed as Megatron's
// non-tensor-parallel-grads-all-reduce.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tests/trainer/forwarding_comm.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/param_shard.h"
#include "trainer/timers.h"
#include "trainer/train_step.h"

namespace ptk {
namespace {

GPTConfig Config() {
  GPTConfig c = testing::SmallGpt(2, 64, 4, 32, 97, 128);
  c.hidden_dropout = c.attention_dropout = 0.1;
  return c;
}

// Micro-batch k of 2 samples of 32 tokens.
struct Batches : testing::Batches {
  explicit Batches(int count) : testing::Batches(count, 32) {}
};

SchedulerConfig Schedule() {
  SchedulerConfig s;
  s.max_lr = 3e-3;
  s.min_lr = 3e-4;
  s.decay_style = "cosine";
  s.decay_steps = 20 * 4;
  s.warmup_steps = 2 * 4;
  s.start_wd = s.end_wd = 0.1;
  s.wd_incr_steps = 80;
  return s;
}

double Rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// One forward-backward at tensor size T (T ranks as threads): the loss of each rank and the
// gradients gathered into the whole model's layout.
struct Pass {
  std::vector<double> losses;
  std::vector<float> grads;
  bool whole_tensors_same_bits = true;
};
Pass OnePass(int T, bool sp = false, const GPTConfig& c = Config()) {
  Pass out;
  const Batches data(1);
  auto whole = ParamLayout::Create(c);
  out.grads.assign(static_cast<size_t>(whole->num_params), 0.0f);
  out.losses.assign(static_cast<size_t>(T), 0.0);
  std::vector<std::vector<float>> rank_grads(static_cast<size_t>(T));
  std::mutex mu;
  auto body = [&](Communicator* tensor, int rank) {
    auto model = CpuGPTModel::Create(c, tensor, sp);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(1234).ok());
    auto loss = (*model)->ForwardBackward(data.Get(0), 1.0, /*train=*/true, 99);
    ASSERT_TRUE(loss.ok()) << loss.status();
    // Sequence parallelism leaves the norms' and row-parallel biases' gradients partial: the
    // training step sums them over the tensor group (after the data-parallel reduction).
    ASSERT_TRUE((*model)->SumNonTensorParallelGrads().ok());
    std::lock_guard<std::mutex> lock(mu);
    out.losses[static_cast<size_t>(rank)] = loss->loss_sum / loss->tokens;
    const float* g = (*model)->grads();
    rank_grads[static_cast<size_t>(rank)].assign(g, g + (*model)->num_params());
    CopyFromShard((*model)->layout(), rank_grads[static_cast<size_t>(rank)], out.grads);
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

TEST(TensorParallel, ShardsOfTheInitAreTheWholeInitsSlices) {
  const GPTConfig c = Config();
  auto whole = ParamLayout::Create(c);
  std::vector<float> w(static_cast<size_t>(whole->num_params)), back(w.size(), 0.0f);
  whole->InitWeights(5, w);
  for (int T : {2, 4}) {
    std::fill(back.begin(), back.end(), 0.0f);
    for (int t = 0; t < T; ++t) {
      auto shard = ParamLayout::Create(c, T, t);
      ASSERT_TRUE(shard.ok()) << shard.status();
      std::vector<float> s(static_cast<size_t>(shard->num_params)), cut(s.size());
      shard->InitWeights(5, s);
      CopyToShard(*shard, w, cut);
      EXPECT_EQ(s, cut) << "T=" << T << " rank " << t;
      CopyFromShard(*shard, s, back);
    }
    EXPECT_EQ(back, w) << "T=" << T;
  }
  EXPECT_FALSE(ParamLayout::Create(c, 3, 0).ok());  // 4 heads
}

TEST(TensorParallel, ForwardBackwardMatchesOneRank) {
  const Pass one = OnePass(1);
  for (const auto& [T, sp] : {std::pair{2, false}, std::pair{4, false}, std::pair{2, true}, std::pair{4, true}}) {
    const Pass tp = OnePass(T, sp);
    EXPECT_TRUE(tp.whole_tensors_same_bits) << "T=" << T << " sp=" << sp;
    double gmax = 0, dmax = 0;
    for (size_t i = 0; i < one.grads.size(); ++i) {
      gmax = std::max(gmax, static_cast<double>(std::abs(one.grads[i])));
      dmax = std::max(dmax, static_cast<double>(std::abs(one.grads[i] - tp.grads[i])));
    }
    for (int r = 0; r < T; ++r) {
      EXPECT_LT(Rel(tp.losses[static_cast<size_t>(r)], one.losses[0]), 1e-6) << "T=" << T << " rank " << r;
      EXPECT_EQ(tp.losses[static_cast<size_t>(r)], tp.losses[0]);
    }
    EXPECT_LT(dmax, 1e-5 * gmax) << "T=" << T << " sp=" << sp << ": largest gradient difference " << dmax << " of "
                                 << gmax;
    std::printf("T=%d%s: loss %.9g vs %.9g; largest gradient difference %.3g of %.3g\n", T,
                sp ? " sequence-parallel" : "", tp.losses[0], one.losses[0], dmax, gmax);
  }
}

// --qk-layernorm (Megatron's, with the run's norm: LayerNorm, and RMSNorm in a Qwen3-shaped model
// with RoPE, SwiGLU and query groups): each tensor rank normalises its heads with the whole query
// and key norms, so each rank's gradient of them is its heads' share; the sum over the tensor group
// (Megatron's finalize_model_grads, with or without sequence parallelism) gives one rank's
// gradients, the same bits on every rank. Without that sum the norms' gradients differ from one
// rank's.
GPTConfig QkConfig(bool qwen3) {
  GPTConfig c = Config();
  c.qk_layernorm = true;
  if (qwen3) {
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding = PositionEmbedding::kRope;
    c.swiglu = true;
    c.num_query_groups = 2;
    c.kv_channels = 8;  // head dimension 8, not hidden / heads
    c.add_bias_linear = false;
    c.untie_embeddings_and_output_weights = true;
  }
  return c;
}

TEST(TensorParallel, QKLayerNormForwardBackwardMatchesOneRank) {
  for (bool qwen3 : {false, true}) {
    const GPTConfig c = QkConfig(qwen3);
    const Pass one = OnePass(1, false, c);
    for (const auto& [T, sp] : {std::pair{2, false}, std::pair{2, true}}) {
      const Pass tp = OnePass(T, sp, c);
      EXPECT_TRUE(tp.whole_tensors_same_bits) << "T=" << T << " sp=" << sp;
      auto whole = ParamLayout::Create(c);
      double gmax = 0, dmax = 0, qk_max = 0;
      for (const ParamInfo& p : whole->infos)
        for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
          const double d = std::abs(one.grads[static_cast<size_t>(i)] - tp.grads[static_cast<size_t>(i)]);
          gmax = std::max(gmax, static_cast<double>(std::abs(one.grads[static_cast<size_t>(i)])));
          dmax = std::max(dmax, d);
          if (p.name.find("_layernorm.") != std::string::npos && p.name.find("self_attention") != std::string::npos)
            qk_max = std::max(qk_max, static_cast<double>(std::abs(one.grads[static_cast<size_t>(i)])));
        }
      EXPECT_GT(qk_max, 0.0);
      EXPECT_LT(Rel(tp.losses[0], one.losses[0]), 1e-6) << "T=" << T;
      EXPECT_LT(dmax, 1e-5 * gmax) << (qwen3 ? "Qwen3-shaped" : "GPT") << " T=" << T << " sp=" << sp
                                   << ": largest gradient difference " << dmax << " of " << gmax;
    }
  }
}

// The CPU model's gradient of the query and key norms (weights and biases) against the loss's
// directional derivative along it (central differences of the fp32 loss), for both norms: the op
// wired between the QKV product and RoPE, forward and backward.
TEST(TensorParallel, QKLayerNormGradientIsTheLossesDerivative) {
  const Batches data(1);
  for (bool qwen3 : {false, true}) {
    const GPTConfig c = QkConfig(qwen3);
    auto model = CpuGPTModel::Create(c, nullptr, false);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(1234).ok());
    std::vector<float> w(static_cast<size_t>((*model)->num_params())), g(w.size(), 0.0f);
    ASSERT_TRUE((*model)->ReadParams(w).ok());
    // Norm weights away from 1 and biases away from 0, so every term matters.
    std::vector<double> dir(w.size(), 0.0);
    int64_t count = 0;
    for (const ParamInfo& p : (*model)->params_info()) {
      if (p.name.find("self_attention.q_layernorm") == std::string::npos &&
          p.name.find("self_attention.k_layernorm") == std::string::npos)
        continue;
      for (int64_t i = 0; i < p.size; ++i) w[static_cast<size_t>(p.offset + i)] += 0.3f * std::sin(1.0f + i + p.offset);
      count += p.size;
    }
    EXPECT_EQ(count, 2 * 2 * (qwen3 ? 8 : 16) * (qwen3 ? 1 : 2));  // layers x (q, k) x head dim x (weight, bias)
    ASSERT_TRUE((*model)->WriteParams(w).ok());
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    ASSERT_TRUE((*model)->ForwardBackward(data.Get(0), 1.0, /*train=*/false, 1).ok());
    ASSERT_TRUE((*model)->ReadGrads(g).ok());
    double norm = 0;
    for (const ParamInfo& p : (*model)->params_info())
      if (p.name.find("q_layernorm") != std::string::npos || p.name.find("k_layernorm") != std::string::npos)
        for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
          dir[static_cast<size_t>(i)] = g[static_cast<size_t>(i)];
          norm += dir[static_cast<size_t>(i)] * dir[static_cast<size_t>(i)];
        }
    norm = std::sqrt(norm);
    ASSERT_GT(norm, 0.0);
    auto loss_at = [&](double h) {
      std::vector<float> x = w;
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(w[i] + h * dir[i] / norm);
      EXPECT_TRUE((*model)->WriteParams(x).ok());
      auto l = (*model)->Forward(data.Get(0));
      EXPECT_TRUE(l.ok()) << l.status();
      return l->loss_sum;
    };
    const double h = 1e-2, numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
    EXPECT_NEAR(numeric, norm, 2e-3 * norm) << (qwen3 ? "RMSNorm" : "LayerNorm");
    std::printf("%s: |dL/dqk| %.6g, central difference %.6g\n", qwen3 ? "RMSNorm" : "LayerNorm", norm, numeric);
  }
}

// Megatron's --squared-relu, --apply-layernorm-1p (every norm, the query and key norms too) and
// --init-method-xavier-uniform: T = 2 with and without --sequence-parallel (the rows' norm backward
// takes the offset too) against one rank, in a GPT model (LayerNorm) and a Qwen3-shaped one (RMSNorm,
// SwiGLU: no squared ReLU); then the whole model's gradient against the loss's central difference
// along it, norms moved off their initial 0.
GPTConfig MlpFlagsConfig(bool qwen3) {
  GPTConfig c = QkConfig(qwen3);
  c.squared_relu = !qwen3;
  c.apply_layernorm_1p = true;
  c.init_method_xavier_uniform = true;
  return c;
}

// `c` at T = 2 with and without --sequence-parallel against one rank: the whole tensors the same
// bits, the loss within 1e-6 and every gradient within 1e-5 of the largest.
void ExpectTwoRanksMatchOne(const GPTConfig& c, const std::string& what) {
  const Pass one = OnePass(1, false, c);
  for (const auto& [T, sp] : {std::pair{2, false}, std::pair{2, true}}) {
    const Pass tp = OnePass(T, sp, c);
    EXPECT_TRUE(tp.whole_tensors_same_bits) << what << " T=" << T << " sp=" << sp;
    double gmax = 0, dmax = 0;
    for (size_t i = 0; i < one.grads.size(); ++i) {
      gmax = std::max(gmax, static_cast<double>(std::abs(one.grads[i])));
      dmax = std::max(dmax, static_cast<double>(std::abs(one.grads[i] - tp.grads[i])));
    }
    EXPECT_LT(Rel(tp.losses[0], one.losses[0]), 1e-6) << what << " T=" << T << " sp=" << sp;
    EXPECT_LT(dmax, 1e-5 * gmax) << what << " T=" << T << " sp=" << sp << ": largest gradient difference " << dmax
                                 << " of " << gmax;
  }
}

TEST(TensorParallel, MegatronMlpAndNormFlagsMatchOneRank) {
  for (bool qwen3 : {false, true}) ExpectTwoRanksMatchOne(MlpFlagsConfig(qwen3), qwen3 ? "Qwen3-shaped" : "GPT");
}

// The exact erf GELU of Megatron's unfused GELU MLP (--no-bias-gelu-fusion), with biases and without
// (--disable-bias-linear): T = 2 with and without --sequence-parallel against one rank.
TEST(TensorParallel, ExactGeluMatchesOneRank) {
  for (bool bias : {true, false}) {
    GPTConfig c = QkConfig(false);
    c.gelu_exact = true;
    c.add_bias_linear = bias;
    ExpectTwoRanksMatchOne(c, bias ? "exact GELU, biases" : "exact GELU, no biases");
  }
}

TEST(TensorParallel, MegatronMlpAndNormFlagsGradientIsTheLossesDerivative) {
  const Batches data(1);
  for (bool qwen3 : {false, true}) {
    const GPTConfig c = MlpFlagsConfig(qwen3);
    auto model = CpuGPTModel::Create(c, nullptr, false);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(1234).ok());
    std::vector<float> w(static_cast<size_t>((*model)->num_params())), g(w.size(), 0.0f);
    ASSERT_TRUE((*model)->ReadParams(w).ok());
    for (const ParamInfo& p : (*model)->params_info())
      if (p.name.find("layernorm") != std::string::npos)
        for (int64_t i = 0; i < p.size; ++i)
          w[static_cast<size_t>(p.offset + i)] += 0.3f * std::sin(1.0f + i + p.offset);
    ASSERT_TRUE((*model)->WriteParams(w).ok());
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    ASSERT_TRUE((*model)->ForwardBackward(data.Get(0), 1.0, /*train=*/false, 1).ok());
    ASSERT_TRUE((*model)->ReadGrads(g).ok());
    double norm = 0;
    for (float v : g) norm += static_cast<double>(v) * v;
    norm = std::sqrt(norm);
    ASSERT_GT(norm, 0.0);
    auto loss_at = [&](double h) {
      std::vector<float> x = w;
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(w[i] + h * g[i] / norm);
      EXPECT_TRUE((*model)->WriteParams(x).ok());
      auto l = (*model)->Forward(data.Get(0));
      EXPECT_TRUE(l.ok()) << l.status();
      return l->loss_sum;
    };
    const double h = 1e-2, numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
    EXPECT_NEAR(numeric, norm, 2e-3 * norm) << (qwen3 ? "RMSNorm" : "LayerNorm, squared ReLU");
  }
}

// Sequence parallelism keeps 1/T of its region per layer: the layer's input and its middle on the
// residual stream, the two LayerNorms' outputs and their statistics (mean and rstd) hold b x t/T
// rows instead of b x t; the transient buffers it adds take less than that saves.
TEST(TensorParallel, SequenceParallelLayersKeepTheirRanksRowsOnly) {
  const Batches data(1);
  auto floats = [&](int T, bool sp, int64_t layers) {
    GPTConfig c = Config();
    c.num_layers = layers;
    std::vector<int64_t> out(static_cast<size_t>(T), 0);
    testing::RunRanks(T, [&](Communicator* tensor, int rank) {
      auto model = CpuGPTModel::Create(c, tensor, sp);
      ASSERT_TRUE(model.ok()) << model.status();
      ASSERT_TRUE((*model)->InitWeights(1234).ok());
      ASSERT_TRUE((*model)->ForwardBackward(data.Get(0), 1.0, /*train=*/true, 99).ok());
      out[static_cast<size_t>(rank)] = (*model)->ActivationFloats();
    });
    for (int r = 1; r < T; ++r) EXPECT_EQ(out[static_cast<size_t>(r)], out[0]) << "rank " << r;
    return out[0];
  };
  const int64_t n = 2 * 32, c = Config().hidden_size;  // the batch's tokens, the hidden size
  for (int T : {2, 4}) {
    const int64_t plain_layer = floats(T, false, 3) - floats(T, false, 2);
    const int64_t sp_layer = floats(T, true, 3) - floats(T, true, 2);
    EXPECT_EQ(plain_layer - sp_layer, (4 * n * c + 4 * n) * (T - 1) / T) << "T=" << T;
    EXPECT_LT(floats(T, true, 2), floats(T, false, 2)) << "T=" << T;
    std::printf("T=%d: activation floats per layer %lld, %lld with sequence parallelism\n", T,
                static_cast<long long>(plain_layer), static_cast<long long>(sp_layer));
  }
}

// 20 steps of 2 micro-batches per iteration (global batch 4 samples) at tensor size T and data
// size D (world T x D; Megatron's order: tensor ranks adjacent), ZeRO-1 over each data group when
// asked: each step's lm loss on world rank 0.
std::vector<double> Train(int T, int D, bool zero1, bool sp = false, const GPTConfig& c = Config()) {
  const Batches data(2 * 20);
  std::vector<double> losses;
  std::mutex mu;
  auto body = [&](Communicator* world, int rank) {
    std::unique_ptr<Communicator> tensor, dp;
    if (world) {
      std::vector<int> tm, dm;
      for (int t = 0; t < T; ++t) tm.push_back(rank / T * T + t);
      for (int d = 0; d < D; ++d) dm.push_back(rank % T + d * T);
      auto ts = world->Subgroup(tm, "tensor");
      ASSERT_TRUE(ts.ok()) << ts.status();
      auto ds = world->Subgroup(dm, "data");
      ASSERT_TRUE(ds.ok()) << ds.status();
      tensor = std::move(*ts);
      dp = std::move(*ds);
    } else {
      dp = MakeLocalCommunicator();
    }
    auto model = CpuGPTModel::Create(c, tensor.get(), sp);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(1234).ok());
    if (zero1) {
      auto shard = ParamShard::Create((*model)->num_params(), dp->size(), dp->rank());
      ASSERT_TRUE(shard.ok());
      ASSERT_TRUE((*model)->ShardOptimizerState(*shard).ok());
    }
    TrainStep step(model->get(), OptimizerConfig{}, Schedule(), dp.get());
    const int per_rank = 2 / D;
    for (int it = 0; it < 20; ++it) {
      std::vector<ModelBatch> mbs;
      for (int k = 0; k < per_rank; ++k)
        mbs.push_back(data.Get(static_cast<size_t>(2 * it + dp->rank() * per_rank + k)));
      auto r = step.Step(mbs, 4, 77);
      ASSERT_TRUE(r.ok()) << r.status();
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        losses.push_back(r->lm_loss());
      }
    }
  };
  if (T * D == 1)
    body(nullptr, 0);
  else
    testing::RunRanks(T * D, body);
  return losses;
}

TEST(TensorParallel, TwentyStepsFollowOneRanksLosses) {
  const std::vector<double> one = Train(1, 1, false);
  ASSERT_EQ(one.size(), 20u);
  struct Case {
    int T, D;
    bool zero1, sp;
  };
  for (const Case& k : {Case{2, 1, false, false}, Case{4, 1, false, false}, Case{2, 2, true, false},
                        Case{2, 1, false, true}, Case{4, 1, false, true}, Case{2, 2, true, true}}) {
    const std::vector<double> tp = Train(k.T, k.D, k.zero1, k.sp);
    ASSERT_EQ(tp.size(), 20u);
    double worst = 0;
    for (size_t i = 0; i < 20; ++i) worst = std::max(worst, Rel(tp[i], one[i]));
    EXPECT_LT(worst, 1e-5) << "T=" << k.T << " D=" << k.D << " sp=" << k.sp;
    std::printf("T=%d D=%d%s%s: losses %.7f .. %.7f, largest relative difference from one rank %.3g\n", k.T, k.D,
                k.zero1 ? " ZeRO-1" : "", k.sp ? " sequence-parallel" : "", tp.front(), tp.back(), worst);
  }
  EXPECT_LT(one.back(), one.front());
}

// --qk-layernorm over 20 steps: T = 2 x D = 2 with ZeRO-1, and T = 2 with sequence parallelism,
// follow one rank's losses (the norms' gradients summed over the tensor group every step).
TEST(TensorParallel, QKLayerNormTwentyStepsFollowOneRanksLosses) {
  const GPTConfig c = QkConfig(/*qwen3=*/true);
  const std::vector<double> one = Train(1, 1, false, false, c);
  ASSERT_EQ(one.size(), 20u);
  for (const auto& [D, sp] : {std::pair{2, false}, std::pair{1, true}}) {
    const std::vector<double> tp = Train(2, D, D > 1, sp, c);
    ASSERT_EQ(tp.size(), 20u);
    double worst = 0;
    for (size_t i = 0; i < 20; ++i) worst = std::max(worst, Rel(tp[i], one[i]));
    EXPECT_LT(worst, 1e-5) << "D=" << D << " sp=" << sp;
  }
  EXPECT_LT(one.back(), one.front());
}

// --sequence-parallel's partial gradients (the norms' and the row-parallel biases', each tensor
// rank's positions' share) in Megatron's order at T = 2 x D = 2 over 4 micro-batches: each rank
// accumulates its own partials over its micro-batches, the data-parallel reduction sums them, and
// only then does the tensor group sum them (finalize_model_grads'
// _allreduce_non_tensor_model_parallel_grads), so such a gradient is (a0 + a1) + (b0 + b1) of
// tensor ranks a, b and data ranks 0, 1; every other gradient is its data-parallel sum. The step
// gives these bits exactly, with the plain all-reduce, overlapped buckets and ZeRO-1; the order
// ptk had (each micro-batch's partials summed over the tensor group inside backward) differs here.
TEST(TensorParallel, SequenceParallelGradientsAreSummedAfterTheDataParallelReduction) {
  const GPTConfig c = Config();
  const Batches data(8);
  const std::vector<ModelBatch> all = data.All();
  constexpr int T = 2, D = 2, M = 4;
  // The step's loss-gradient scale of a micro-batch (TrainStep's: 1 / (tokens x M x D)).
  auto scale_of = [&](const ModelBatch& mb) {
    double tokens = 0;
    for (int64_t i = 0; i < mb.b * mb.t; ++i) tokens += mb.loss_mask[i];
    return 1.0 / (tokens * M * D);
  };
  // Rank r = t + 2d (tensor rank t, data rank d) runs micro-batches [4d, 4d + 4).
  auto groups = [&](Communicator* world, int rank, std::unique_ptr<Communicator>* tensor,
                    std::unique_ptr<Communicator>* dp) {
    const int t = rank % T, d = rank / T;
    const std::vector<int> tm = {T * d, T * d + 1}, dm = {t, t + T};
    auto ts = world->Subgroup(tm, "tensor" + std::to_string(d));
    ASSERT_TRUE(ts.ok()) << ts.status();
    *tensor = std::move(*ts);
    if (!dp) return;
    auto ds = world->Subgroup(dm, "data" + std::to_string(t));
    ASSERT_TRUE(ds.ok()) << ds.status();
    *dp = std::move(*ds);
  };
  // Each rank's gradients of each micro-batch alone, and accumulated over its micro-batches.
  std::vector<std::vector<std::vector<float>>> per_mb(T * D);
  std::vector<std::vector<float>> acc(T * D);
  std::mutex mu;
  testing::RunRanks(T * D, [&](Communicator* world, int rank) {
    std::unique_ptr<Communicator> tensor;
    groups(world, rank, &tensor, nullptr);
    auto model = CpuGPTModel::Create(c, tensor.get(), /*sequence_parallel=*/true);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->InitWeights(1234).ok());
    const int d = rank / T;
    std::vector<std::vector<float>> mine;
    std::vector<float> g(static_cast<size_t>((*model)->num_params()));
    for (int k = 0; k < M; ++k) {
      const ModelBatch& mb = all[static_cast<size_t>(M * d + k)];
      ASSERT_TRUE((*model)->ZeroGrads().ok());
      ASSERT_TRUE((*model)->ForwardBackward(mb, scale_of(mb), /*train=*/true, 99).ok());
      ASSERT_TRUE((*model)->ReadGrads(g).ok());
      mine.push_back(g);
    }
    ASSERT_TRUE((*model)->ZeroGrads().ok());
    for (int k = 0; k < M; ++k) {
      const ModelBatch& mb = all[static_cast<size_t>(M * d + k)];
      ASSERT_TRUE((*model)->ForwardBackward(mb, scale_of(mb), /*train=*/true, 99).ok());
    }
    ASSERT_TRUE((*model)->ReadGrads(g).ok());
    std::lock_guard<std::mutex> lock(mu);
    per_mb[static_cast<size_t>(rank)] = std::move(mine);
    acc[static_cast<size_t>(rank)] = g;
  });
  auto layout = ParamLayout::Create(c, T, 0);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<GradRange> ranges = SequenceParallelGradRanges(*layout);
  // Exactly Megatron's `sequence_parallel` parameters: the norms and the row-parallel biases.
  std::vector<std::string> names;
  for (const ParamInfo& p : layout->infos)
    for (const GradRange& g : ranges)
      if (p.offset >= g.begin && p.offset < g.end) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias",
                       "decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.pre_mlp_layernorm.weight",
                       "decoder.layers.0.pre_mlp_layernorm.bias", "decoder.layers.0.mlp.linear_fc2.bias",
                       "decoder.layers.1.input_layernorm.weight", "decoder.layers.1.input_layernorm.bias",
                       "decoder.layers.1.self_attention.linear_proj.bias", "decoder.layers.1.pre_mlp_layernorm.weight",
                       "decoder.layers.1.pre_mlp_layernorm.bias", "decoder.layers.1.mlp.linear_fc2.bias",
                       "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"}));
  auto in_sp = [&](int64_t i) {
    for (const GradRange& g : ranges)
      if (i >= g.begin && i < g.end) return true;
    return false;
  };
  const size_t n = acc[0].size();
  int64_t sp_elements = 0, partial = 0, old_order_differs = 0;
  std::vector<std::vector<float>> want(T * D);
  for (int rank = 0; rank < T * D; ++rank) want[static_cast<size_t>(rank)].resize(n);
  for (size_t i = 0; i < n; ++i) {
    // acc[t + 2d]: tensor rank t's accumulation on data rank d.
    const float dp0 = acc[0][i] + acc[2][i], dp1 = acc[1][i] + acc[3][i];
    if (!in_sp(static_cast<int64_t>(i))) {
      want[0][i] = want[2][i] = dp0;
      want[1][i] = want[3][i] = dp1;
      continue;
    }
    ++sp_elements;
    partial += acc[0][i] != acc[1][i];  // the model leaves each tensor rank its positions' share
    for (auto& w : want) w[i] = dp0 + dp1;
    // The micro-batches' accumulation is the model's (each added to the gradient as Megatron adds
    // it to main_grad)...
    for (int rank = 0; rank < T * D; ++rank) {
      float s = 0.0f;
      for (int k = 0; k < M; ++k) s += per_mb[static_cast<size_t>(rank)][static_cast<size_t>(k)][i];
      ASSERT_EQ(std::memcmp(&s, &acc[static_cast<size_t>(rank)][i], sizeof(float)), 0) << "rank " << rank << " " << i;
    }
    // ...and ptk's former order summed each micro-batch's partials over the tensor group first.
    float old[D] = {0.0f, 0.0f};
    for (int d = 0; d < D; ++d)
      for (int k = 0; k < M; ++k)
        old[d] += per_mb[static_cast<size_t>(T * d)][static_cast<size_t>(k)][i] +
                  per_mb[static_cast<size_t>(T * d + 1)][static_cast<size_t>(k)][i];
    old_order_differs += old[0] + old[1] != want[0][i];
  }
  EXPECT_GT(sp_elements, 0);
  EXPECT_EQ(partial, sp_elements) << "backward left " << sp_elements - partial
                                  << " sequence-parallel gradients summed over the tensor group";
  EXPECT_GT(old_order_differs, 0);
  std::printf("%lld sequence-parallel gradients, %lld of them with other bits in the former order\n",
              static_cast<long long>(sp_elements), static_cast<long long>(old_order_differs));
  for (bool zero1 : {false, true})
    for (int64_t bucket : {int64_t{0}, int64_t{3000}}) {
      SCOPED_TRACE(std::string(zero1 ? "ZeRO-1" : "all-reduce") + (bucket ? ", overlapped buckets" : ""));
      std::vector<std::vector<float>> got(T * D);
      std::vector<std::pair<int64_t, int64_t>> checked(T * D);
      testing::RunRanks(T * D, [&](Communicator* world, int rank) {
        std::unique_ptr<Communicator> tensor, dp;
        groups(world, rank, &tensor, &dp);
        auto model = CpuGPTModel::Create(c, tensor.get(), /*sequence_parallel=*/true);
        ASSERT_TRUE(model.ok()) << model.status();
        ASSERT_TRUE((*model)->InitWeights(1234).ok());
        std::pair<int64_t, int64_t> range = {0, (*model)->num_params()};
        if (zero1) {
          auto shard = ParamShard::Create((*model)->num_params(), D, dp->rank());
          ASSERT_TRUE(shard.ok());
          ASSERT_TRUE((*model)->ShardOptimizerState(*shard).ok());
          range = {shard->begin(), shard->end()};
        }
        OptimizerConfig oc;
        oc.overlap_grad_reduce = bucket > 0;
        oc.ddp_bucket_size = bucket;
        TrainStep step(model->get(), oc, SchedulerConfig{}, dp.get());
        const int d = rank / T;
        const std::vector<ModelBatch> mine(all.begin() + M * d, all.begin() + M * d + M);
        auto r = step.ComputeGradients(mine, 99);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<float> g(static_cast<size_t>((*model)->num_params()));
        ASSERT_TRUE((*model)->ReadGrads(g).ok());
        std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(rank)] = std::move(g);
        checked[static_cast<size_t>(rank)] = range;
      });
      for (int rank = 0; rank < T * D; ++rank) {
        const auto& g = got[static_cast<size_t>(rank)];
        const auto& w = want[static_cast<size_t>(rank)];
        ASSERT_EQ(g.size(), w.size()) << "rank " << rank;
        const auto [begin, end] = checked[static_cast<size_t>(rank)];
        int64_t differ = 0, sp_differ = 0;
        for (int64_t i = begin; i < end; ++i) {
          if (std::memcmp(&g[static_cast<size_t>(i)], &w[static_cast<size_t>(i)], sizeof(float)) == 0) continue;
          ++differ;
          sp_differ += in_sp(i);
        }
        EXPECT_EQ(differ, 0) << "rank " << rank << ": " << differ << " gradients differ from Megatron's order, "
                             << sp_differ << " of them sequence-parallel ones";
      }
    }
}

// A real communicator underneath, its float all-reduces counted with their lengths.
class CountingCommunicator final : public testing::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  absl::Status AllReduceSum(float* data, int64_t n) override {
    lengths.push_back(n);
    return ForwardingCommunicator::AllReduceSum(data, n);
  }
  std::vector<int64_t> lengths;
};

// SumNonTensorParallelGrads gathers the ranges into one buffer, makes one all-reduce of it over the
// tensor group, and scatters it back: at T = 2 and 4 (gloo, which adds each element in rank order
// wherever it lies in the buffer) the gradients' bits are those of one all-reduce per range, for
// every parameter (the others untouched), on each of a few calls (the buffer reused).
TEST(TensorParallel, SequenceParallelSumIsOneAllReduceWithEachRangesBits) {
  const GPTConfig c = Config();
  const Batches data(3);
  for (int T : {2, 4}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    testing::RunRanks(T, [&](Communicator* tensor, int rank) {
      CountingCommunicator counted(tensor);
      auto model = CpuGPTModel::Create(c, &counted, /*sequence_parallel=*/true);
      ASSERT_TRUE(model.ok()) << model.status();
      ASSERT_TRUE((*model)->InitWeights(1234).ok());
      const std::vector<GradRange> ranges = SequenceParallelGradRanges((*model)->layout());
      ASSERT_GT(ranges.size(), 4u);
      int64_t total = 0;
      for (const GradRange& g : ranges) total += g.size();
      const size_t n = static_cast<size_t>((*model)->num_params());
      for (int k = 0; k < 3; ++k) {
        // The same partial gradients twice (the pass is deterministic), summed both ways.
        std::vector<float> partial(n), per_range(n), again(n), coalesced(n);
        ASSERT_TRUE((*model)->ZeroGrads().ok());
        ASSERT_TRUE((*model)->ForwardBackward(data.Get(static_cast<size_t>(k)), 1.0, true, 99).ok());
        ASSERT_TRUE((*model)->ReadGrads(partial).ok());
        for (const GradRange& g : ranges) ASSERT_TRUE((*model)->AllReduceGradRange(&counted, g.begin, g.size()).ok());
        ASSERT_TRUE((*model)->ReadGrads(per_range).ok());
        ASSERT_TRUE((*model)->ZeroGrads().ok());
        ASSERT_TRUE((*model)->ForwardBackward(data.Get(static_cast<size_t>(k)), 1.0, true, 99).ok());
        ASSERT_TRUE((*model)->ReadGrads(again).ok());
        ASSERT_EQ(std::memcmp(again.data(), partial.data(), n * sizeof(float)), 0) << "rank " << rank;
        counted.lengths.clear();
        ASSERT_TRUE((*model)->SumNonTensorParallelGrads().ok());
        EXPECT_EQ(counted.lengths, std::vector<int64_t>{total}) << "rank " << rank;
        ASSERT_TRUE((*model)->ReadGrads(coalesced).ok());
        EXPECT_EQ(std::memcmp(coalesced.data(), per_range.data(), n * sizeof(float)), 0) << "rank " << rank;
        EXPECT_NE(std::memcmp(coalesced.data(), partial.data(), n * sizeof(float)), 0) << "rank " << rank;
      }
    });
  }
  // A range outside the parameters is refused, naming it.
  auto model = CpuGPTModel::Create(c, nullptr);
  ASSERT_TRUE(model.ok());
  const std::vector<GradRange> bad = {{0, 4}, {(*model)->num_params() - 2, (*model)->num_params() + 1}};
  auto local = MakeLocalCommunicator();
  const absl::Status st = (*model)->AllReduceGradRanges(local.get(), bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("AllReduceGradRanges: ["), std::string::npos) << st;
}

// A training step at T = 2 and 4 with --sequence-parallel makes one all-reduce over the tensor group
// more than its micro-batches' passes (the sum of every sequence-parallel gradient at once, where it
// made one per range), timed as non-tensor-parallel-grads-all-reduce at level 1 after a barrier;
// without sequence parallelism no such timer starts.
TEST(TensorParallel, SequenceParallelStepSumsInOneTimedAllReduce) {
  const GPTConfig c = Config();
  const Batches data(2);
  const std::vector<ModelBatch> mbs = data.All();
  std::map<std::pair<int, bool>, std::vector<int>> barriers;  // [T, sp]: each rank's
  std::mutex mu;
  for (int T : {2, 4})
    for (bool sp : {true, false}) {
      SCOPED_TRACE("T=" + std::to_string(T) + (sp ? " sequence-parallel" : ""));
      barriers[std::make_pair(T, sp)].assign(static_cast<size_t>(T), 0);
      testing::RunRanks(T, [&](Communicator* tensor, int rank) {
        CountingCommunicator counted(tensor);
        auto model = CpuGPTModel::Create(c, &counted, sp);
        ASSERT_TRUE(model.ok()) << model.status();
        ASSERT_TRUE((*model)->InitWeights(1234).ok());
        int64_t total = 0;
        for (const GradRange& g : SequenceParallelGradRanges((*model)->layout())) total += g.size();
        // The passes alone (TrainStep's seeds do not change the number of collectives).
        ASSERT_TRUE((*model)->ZeroGrads().ok());
        for (const ModelBatch& mb : mbs) ASSERT_TRUE((*model)->ForwardBackward(mb, 1.0, true, 99).ok());
        const std::vector<int64_t> passes = counted.lengths;
        counted.lengths.clear();
        int met = 0;
        Timers timers(1, TimingLogOption::kMinMax, nullptr, [&] {
          ++met;
          return tensor->Barrier();
        });
        auto dp = MakeLocalCommunicator();
        TrainStep step(model->get(), OptimizerConfig{}, Schedule(), dp.get());
        step.set_timers(&timers);
        auto r = step.ComputeGradients(mbs, 99);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<int64_t> want = passes;
        if (sp) want.push_back(total);
        EXPECT_EQ(counted.lengths, want) << "rank " << rank;
        EXPECT_EQ(timers.Elapsed("non-tensor-parallel-grads-all-reduce") > 0.0, sp) << "rank " << rank;
        EXPECT_EQ(timers.Elapsed("layernorm-grads-all-reduce"), 0.0);
        std::lock_guard<std::mutex> lock(mu);
        barriers[std::make_pair(T, sp)][static_cast<size_t>(rank)] = met;
      });
    }
  // The sum's timer starts at a level-1 barrier on every rank: one barrier more than without it.
  for (int T : {2, 4})
    for (int r = 0; r < T; ++r)
      EXPECT_EQ(barriers[std::make_pair(T, true)][static_cast<size_t>(r)],
                barriers[std::make_pair(T, false)][static_cast<size_t>(r)] + 1)
          << "T=" << T << " rank " << r;
}

}  // namespace
}  // namespace ptk
