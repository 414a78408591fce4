// What cuda_model_test's and cuda_llama_model_test's files share: the small models, deterministic
// synthetic micro-batches, the CUDA and CPU models made from the same weights, the relative L2
// distance, a schedule, one step and a loss curve on both backends compared; and the one-device
// reference of the pipeline tests (OneDevice).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "trainer/comm.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/cuda/cuda_gpt_model.h"
#include "trainer/train_step.h"

namespace ptk::cuda_model_test {

inline GPTConfig SmallConfig(bool dropout) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 256;
  c.seq_length = c.max_position_embeddings = 64;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  c.hidden_dropout = dropout ? 0.1 : 0.0;
  c.attention_dropout = dropout ? 0.1 : 0.0;
  return c;
}

// A small Llama-shaped model: RMSNorm, RoPE base 500000 with Llama 3.1's scaling, SwiGLU, 4 query
// heads of 32 channels in 2 groups (the attention's width, 128, is not the hidden size), an untied
// output layer, no biases, no dropout.
inline GPTConfig LlamaConfig() {
  GPTConfig c = SmallConfig(/*dropout=*/false);
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.rotary_base = 500000;
  c.use_rope_scaling = true;
  c.swiglu = true;
  c.ffn_hidden_size = 128;
  c.num_query_groups = 2;
  c.kv_channels = 32;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  return c;
}

// Qwen3's shape (--qk-layernorm: the run's norm over each query and key head before RoPE) on the
// Llama model above; LayerNorm (weights and biases) when `layernorm`.
inline GPTConfig Qwen3Config(bool layernorm) {
  GPTConfig c = LlamaConfig();
  c.qk_layernorm = true;
  if (layernorm) c.normalization = Normalization::kLayerNorm;
  return c;
}

// The query and key norms' weights and biases moved off their initial 1 and 0 (the same values on
// every model given), so that a weight read for the wrong head kind or a dropped bias shows. Under
// --apply-layernorm-1p every norm's, off their initial 0 (a weight read without its 1 + shows).
inline void PerturbQKNorms(GPTModel* model) {
  std::vector<float> p(static_cast<size_t>(model->num_params()));
  ASSERT_TRUE(model->ReadParams(p).ok());
  const bool one_p = model->config().apply_layernorm_1p;
  for (const ParamInfo& info : model->params_info()) {
    // (Multi-latent attention's latent norms: q_layernorm and kv_layernorm.)
    if (info.name.find("q_layernorm") == std::string::npos && info.name.find("k_layernorm") == std::string::npos &&
        info.name.find("kv_layernorm") == std::string::npos &&
        !(one_p && info.name.find("layernorm") != std::string::npos))
      continue;
    const bool bias = info.name.find(".bias") != std::string::npos,
               key = info.name.find("k_layernorm") != std::string::npos ||
                     info.name.find("kv_layernorm") != std::string::npos;
    for (int64_t i = 0; i < info.size; ++i)
      p[static_cast<size_t>(info.offset + i)] = static_cast<float>(
          (bias || one_p ? 0.0 : 1.0) +
          0.3 * std::sin(0.7 * static_cast<double>(i) + (key ? 1.3 : 0.0) + static_cast<double>(info.offset % 97)));
  }
  ASSERT_TRUE(model->WriteParams(p).ok());
}

// Deterministic synthetic micro-batches: a learnable pattern (next token = f(previous)), some
// masked positions, so that the loss falls over a few dozen steps.
struct Batches {
  int64_t b = 4, t = 64;
  std::vector<std::vector<int32_t>> tokens, labels;
  std::vector<int32_t> positions;
  std::vector<float> mask;
  std::vector<std::vector<int64_t>> keys;
  Batches(int count, int64_t vocab, int64_t b_ = 4, int64_t t_ = 64) : b(b_), t(t_) {
    for (int64_t i = 0; i < b * t; ++i) {
      positions.push_back(static_cast<int32_t>(i % t));
      mask.push_back(i % 13 == 12 ? 0.0f : 1.0f);
    }
    uint64_t h = 12345;
    for (int k = 0; k < count; ++k) {
      std::vector<int32_t> tok(static_cast<size_t>(b * t)), lab(tok.size());
      for (int64_t r = 0; r < b; ++r) {
        h = h * 6364136223846793005ULL + 1442695040888963407ULL;
        int32_t x = static_cast<int32_t>((h >> 33) % static_cast<uint64_t>(vocab));
        for (int64_t j = 0; j < t; ++j) {
          tok[static_cast<size_t>(r * t + j)] = x;
          x = static_cast<int32_t>((x * 7 + 3) % vocab);
          lab[static_cast<size_t>(r * t + j)] = x;
        }
      }
      tokens.push_back(tok);
      labels.push_back(lab);
      std::vector<int64_t> k_keys;
      for (int64_t r = 0; r < b; ++r) k_keys.push_back(k * b + r);
      keys.push_back(k_keys);
    }
  }
  ModelBatch Get(int k) const {
    return ModelBatch{b,
                      t,
                      tokens[static_cast<size_t>(k)].data(),
                      labels[static_cast<size_t>(k)].data(),
                      positions.data(),
                      mask.data(),
                      keys[static_cast<size_t>(k)].data()};
  }
};

inline std::unique_ptr<GPTModel> Cuda(const GPTConfig& c, Precision p, bool deterministic = true,
                                      const cuda::CudaModelOptions& options = {}, bool profile = false) {
  auto m = cuda::CreateCudaGPTModel(c, p, 0, deterministic, 4, profile, options);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE((*m)->InitWeights(1234).ok());
  return std::move(*m);
}
inline std::unique_ptr<GPTModel> Cpu(const GPTConfig& c) {
  auto m = CpuGPTModel::Create(c);
  EXPECT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->InitWeights(1234).ok());
  return std::unique_ptr<GPTModel>(std::move(*m));
}

// ||a - b|| / ||b|| over a range.
inline double RelL2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline SchedulerConfig Schedule() {
  SchedulerConfig s;
  s.max_lr = 3e-3;
  s.min_lr = 3e-4;
  s.warmup_steps = 8;
  s.decay_steps = 200;
  s.decay_style = "cosine";
  s.start_wd = s.end_wd = 0.1;
  s.wd_incr_steps = 200;
  return s;
}

// One step on both backends from the same weights: the loss within loss_tol relative, every
// tensor's gradient within grad_tol (relative L2); the same layout (names, offsets) on both; in
// fp32 without dropout, evaluation (Forward) gives the training pass's loss. The CUDA model
// deterministic unless `deterministic` is false, with `options`.
inline void ExpectOneStepMatches(const GPTConfig& c, Precision p, double loss_tol, double grad_tol,
                                 const std::string& what, const cuda::CudaModelOptions& options = {},
                                 bool deterministic = true) {
  Batches data(1, c.vocab_size);
  auto cpu = Cpu(c);
  auto gpu = Cuda(c, p, deterministic, options);
  ASSERT_TRUE(gpu) << what;
  if (c.qk_layernorm || c.apply_layernorm_1p) {
    ASSERT_NO_FATAL_FAILURE(PerturbQKNorms(cpu.get()));
    ASSERT_NO_FATAL_FAILURE(PerturbQKNorms(gpu.get()));
  }
  ASSERT_EQ(gpu->num_params(), cpu->num_params()) << what;
  for (size_t i = 0; i < cpu->params_info().size(); ++i) {
    EXPECT_EQ(gpu->params_info()[i].name, cpu->params_info()[i].name) << what;
    EXPECT_EQ(gpu->params_info()[i].offset, cpu->params_info()[i].offset) << what;
  }
  ASSERT_TRUE(cpu->ZeroGrads().ok());
  ASSERT_TRUE(gpu->ZeroGrads().ok());
  const double scale = 1.0 / 200.0;
  auto a = cpu->ForwardBackward(data.Get(0), scale, /*train=*/true, 99);
  auto b = gpu->ForwardBackward(data.Get(0), scale, /*train=*/true, 99);
  ASSERT_TRUE(a.ok()) << what << ": " << a.status();
  ASSERT_TRUE(b.ok()) << what << ": " << b.status();
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NEAR(b->loss_sum / b->tokens, a->loss_sum / a->tokens, loss_tol * a->loss_sum / a->tokens)
      << what << " " << PrecisionName(p);
  std::vector<float> ga(static_cast<size_t>(cpu->num_params())), gb(ga.size());
  ASSERT_TRUE(cpu->ReadGrads(ga).ok());
  ASSERT_TRUE(gpu->ReadGrads(gb).ok());
  for (const ParamInfo& info : cpu->params_info())
    EXPECT_LE(RelL2(gb.data() + info.offset, ga.data() + info.offset, info.size), grad_tol)
        << info.name << ", " << what << " " << PrecisionName(p);
  // Evaluation (Forward) gives the training pass's loss.
  auto e = gpu->Forward(data.Get(0), nullptr);
  ASSERT_TRUE(e.ok()) << what << ": " << e.status();
  if (p == Precision::kFp32 && c.hidden_dropout == 0 && c.attention_dropout == 0) {
    EXPECT_NEAR(e->loss_sum / e->tokens, b->loss_sum / b->tokens, 1e-5 * b->loss_sum / b->tokens) << what;
  }
}

// The lm loss of each of `steps` training steps over data's micro-batches (Schedule(), AdamW).
inline std::vector<double> Curve(GPTModel* model, const Batches& data, int steps, const LossScaleConfig& ls = {}) {
  auto comm = MakeLocalCommunicator();
  TrainStep opt(model, OptimizerConfig{0.9, 0.95, 1e-8, 1.0}, Schedule(), comm.get(), ls);
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    auto r = opt.Step({data.Get(i % 10)}, data.b, 7);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    losses.push_back(r->lm_loss());
  }
  return losses;
}

// A curve `got` within `tol` relative of `ref` at every step, and learning: its last loss below 0.7
// of its first.
inline void ExpectFollowsAndLearns(const std::vector<double>& got, const std::vector<double>& ref, double tol,
                                   const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], tol * ref[i]) << "step " << i + 1 << " " << what;
  EXPECT_LT(got.back(), 0.7 * got.front()) << what;
}

// The model-parallel tests' reference (cuda_pipeline_test, cuda_pipeline_interleaved_test): one device
// model's loss summed over `mbs` (each backward scaled by its `scales`, as TrainStep would), the first
// micro-batch's eval loss, and the gradients; grads empty where the model or a call failed (a test failure).
struct OneDeviceRun {
  LossSum loss, eval;
  std::vector<float> grads;
};
inline OneDeviceRun OneDevice(const GPTConfig& c, Precision p, const std::vector<ModelBatch>& mbs,
                              const std::vector<double>& scales) {
  OneDeviceRun ref;
  std::unique_ptr<GPTModel> m = Cuda(c, p);
  if (!m) return ref;
  EXPECT_TRUE(m->ZeroGrads().ok());
  for (size_t k = 0; k < mbs.size(); ++k) {
    auto l = m->ForwardBackward(mbs[k], scales[k], /*train=*/true, 99);
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return ref;
    ref.loss.loss_sum += l->loss_sum;
    ref.loss.tokens += l->tokens;
  }
  ref.grads.assign(static_cast<size_t>(m->num_params()), 0.0f);
  EXPECT_TRUE(m->ReadGrads(ref.grads).ok());
  auto e = m->Forward(mbs[0], nullptr);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) ref.eval = *e;
  return ref;
}

// `steps` training steps of `c` over `data` on the CPU, then on the device in fp32 and bf16: each device
// curve within `fp32_tol` / `bf16_tol` relative of the CPU's at every step, and learning. Returns the
// CPU's curve.
inline std::vector<double> ExpectCurvesFollowTheCpu(const GPTConfig& c, const Batches& data, int steps, double fp32_tol,
                                                    double bf16_tol, const std::string& what) {
  auto cpu = Cpu(c);
  const std::vector<double> ref = Curve(cpu.get(), data, steps);
  EXPECT_EQ(ref.size(), static_cast<size_t>(steps)) << what;
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    auto gpu = Cuda(c, p);
    EXPECT_TRUE(gpu) << what << " " << PrecisionName(p);
    if (!gpu) continue;
    ExpectFollowsAndLearns(Curve(gpu.get(), data, steps), ref, p == Precision::kFp32 ? fp32_tol : bf16_tol,
                           std::string(PrecisionName(p)) + what);
  }
  return ref;
}

}  // namespace ptk::cuda_model_test
