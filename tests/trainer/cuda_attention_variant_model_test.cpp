// The CUDA model with Megatron's attention variants against the CPU model (gpu-labelled: exits 77 without a device;
// never run on a GPU yet): --attention-output-gate (Qwen3-Next's gated attention: the gate's rows in the QKV
// product, split off, sigmoid(gate) times the core attention's output), --qk-l2-norm (Llama 4's unit-weight
// query and key norm), the sliding window (--window-size W,0 on every layer and on a --window-attn-skip-freq
// pattern) and the softmax offset (--softmax-type off-by-one and learnable, fp32 only: bf16/fp16 refuse it), on the
// Llama-shaped model of cuda_llama_model_test (2 layers, 4 query heads in 2 groups, RMSNorm, RoPE, SwiGLU).
//
// Tolerances as cuda_llama_model_test states them: fp32 the loss within 1e-5 relative and every gradient within
// 1e-4 relative L2 (rounding only: the same algorithms, sums in other orders); bf16/fp16 one step within 1e-2 /
// 6e-2 (8-bit mantissas in the products and activations, cuDNN's attention); 30 steps within 1e-3 (fp32) and 5e-2
// (bf16) of the CPU's curve, and both learn.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/trainer/cuda_model_test_util.h"

namespace ptk {
namespace {

using namespace cuda_model_test;  // NOLINT

GPTConfig Gated(bool l2) {
  GPTConfig c = LlamaConfig();
  c.attention_output_gate = true;
  c.qk_l2_norm = l2;
  return c;
}

GPTConfig Windowed(int64_t window, std::vector<int> pattern) {
  GPTConfig c = LlamaConfig();
  c.window_left = window;
  c.window_pattern = std::move(pattern);
  return c;
}

TEST(CudaAttentionVariantModel, GateAndL2NormFp32StepMatchesTheCpu) {
  for (bool l2 : {false, true}) {
    const std::string what = l2 ? "--attention-output-gate --qk-l2-norm" : "--attention-output-gate";
    ExpectOneStepMatches(Gated(l2), Precision::kFp32, 1e-5, 1e-4, what);
    // Dropout, recomputed attention, one query group.
    GPTConfig c = Gated(l2);
    c.hidden_dropout = c.attention_dropout = 0.1;
    c.recompute_activations = true;
    c.num_query_groups = 1;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, what + ", dropout, recompute, one group");
  }
  GPTConfig l2_only = LlamaConfig();
  l2_only.qk_l2_norm = true;
  ExpectOneStepMatches(l2_only, Precision::kFp32, 1e-5, 1e-4, "--qk-l2-norm");
}

TEST(CudaAttentionVariantModel, GateAndL2NormHalfStepMatchesTheCpu) {
  for (Precision p : {Precision::kBf16, Precision::kFp16})
    ExpectOneStepMatches(Gated(true), p, 1e-2, 6e-2, "--attention-output-gate --qk-l2-norm");
}

TEST(CudaAttentionVariantModel, GateAndL2NormStepsFollowTheCpuCurve) {
  const GPTConfig c = Gated(true);
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, " gated, L2 norm");
}

// The window on every layer, and on the first only (a --window-attn-skip-freq pattern [1,0]); 64 positions.
TEST(CudaAttentionVariantModel, SlidingWindowStepMatchesTheCpu) {
  for (const auto& [c, what] : std::vector<std::pair<GPTConfig, std::string>>{
           {Windowed(7, {}), "--window-size 7,0"},
           {Windowed(0, {}), "--window-size 0,0"},
           {Windowed(16, {1, 0}), "--window-size 16,0 --window-attn-skip-freq [1,0]"}}) {
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, what);
    GPTConfig dropout = c;
    dropout.hidden_dropout = dropout.attention_dropout = 0.1;
    dropout.recompute_activations = true;
    ExpectOneStepMatches(dropout, Precision::kFp32, 1e-5, 1e-4, what + ", dropout, recompute");
    ExpectOneStepMatches(c, Precision::kBf16, 1e-2, 6e-2, what);
    ExpectOneStepMatches(c, Precision::kFp16, 1e-2, 6e-2, what);
  }
}

TEST(CudaAttentionVariantModel, SlidingWindowStepsFollowTheCpuCurve) {
  const GPTConfig c = Windowed(7, {});
  ExpectCurvesFollowTheCpu(c, Batches(10, c.vocab_size), 30, 1e-3, 5e-2, " window 7");
}

// The softmax offset, fp32 (the CUDA model's bf16/fp16 attention is cuDNN's, which ptk runs without it): the
// learnable offset's gradient is among those compared.
TEST(CudaAttentionVariantModel, SoftmaxOffsetFp32StepMatchesTheCpu) {
  for (const char* type : {"off-by-one", "learnable"}) {
    GPTConfig c = LlamaConfig();
    c.softmax_type = type;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, std::string("--softmax-type ") + type);
    c.window_left = 9;
    c.attention_dropout = 0.1;
    ExpectOneStepMatches(c, Precision::kFp32, 1e-5, 1e-4, std::string("--softmax-type ") + type + ", window 9");
  }
}

}  // namespace
}  // namespace ptk
