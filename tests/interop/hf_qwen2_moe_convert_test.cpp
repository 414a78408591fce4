// ptk-convert's Qwen2MoeForCausalLM mapping (a mixture of experts of the Llama line with gated shared experts),
// without transformers: the router, each expert's and the shared expert's gate_proj/up_proj (linear_fc1's
// [gate; up]) and down_proj, the shared expert's gate (Megatron's gate_weight) and the q, k, v biases
// (--add-qkv-bias: qkv_bias) at their ptk offsets in Qwen2-MoE's state_dict order, config.json's keys, and every
// setting Qwen2-MoE cannot compute refused naming it (shared experts without their gate among them). ptk -> hf ->
// ptk gives back every weight bit for bit and exported again the same files; a Qwen2MoeForCausalLM saved by
// transformers 4.51.3 (tests/data/interop/qwen2_moe_tiny, tests/support/gen_qwen2_moe_hf_golden.py) imports and
// ptk's Forward gives its logits and loss; what ptk cannot compute or a damaged directory is refused in one line
// naming the file and the key or tensor.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "interop/hf_qwen2_moe.h"
#include "interop/hf_qwen3_moe.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/interop/hf_golden_logits.h"
#include "tests/test_util.h"
#include "trainer/backend.h"

namespace ptk::hf_detail {
namespace {

// Three layers, the first dense (width 12), the others four SwiGLU experts of width 6, top 2, and a shared expert
// of width 10 with its sigmoid gate; q, k and v biased, 2 heads of hidden 8 in 1 group.
GPTConfig Qwen2Moe() {
  GPTConfig c = ptk::testing::SmallMoeLlama(3);
  c.add_qkv_bias = true;
  c.moe_layer_pattern = {0, 1, 1};
  c.moe_shared_expert_intermediate_size = 10;
  c.moe_shared_expert_gate = true;
  return c;
}

TEST(HfQwen2Moe, TheSharedExpertItsGateAndTheQkvBiasesLandInQwen2MoesNamesAndOrder) {
  const GPTConfig c = Qwen2Moe();
  EXPECT_STREQ(MoeArchitecture(c), "Qwen2MoeForCausalLM");
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params));
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i);  // each value its own offset
  std::vector<HfTensor> t = MoeTensorsOf(c);
  MapMoeParams(*layout, &params, &t, /*to_hf=*/true);
  std::map<std::string, const HfTensor*> by;
  std::vector<std::string> names;
  for (const HfTensor& x : t) {
    by[x.name] = &x;
    names.push_back(x.name);
  }
  const int64_t h = 8, s = 10;
  EXPECT_FALSE(by.count("model.layers.0.mlp.shared_expert_gate.weight"));  // a dense layer has none
  EXPECT_FALSE(by.count("model.layers.1.self_attn.o_proj.bias"));
  for (int l = 1; l < 3; ++l) {
    const LayerParams& lp = layout->layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ASSERT_TRUE(by.count(p + "mlp.shared_expert_gate.weight"));
    EXPECT_EQ(by[p + "mlp.shared_expert_gate.weight"]->shape, (std::vector<int64_t>{1, h}));
    EXPECT_EQ(by[p + "mlp.shared_expert_gate.weight"]->data.front(), static_cast<float>(lp.shared_gate));
    EXPECT_EQ(by[p + "mlp.shared_expert.gate_proj.weight"]->shape, (std::vector<int64_t>{s, h}));
    EXPECT_EQ(by[p + "mlp.shared_expert.gate_proj.weight"]->data.front(), static_cast<float>(lp.shared_fc1));
    EXPECT_EQ(by[p + "mlp.shared_expert.up_proj.weight"]->data.front(), static_cast<float>(lp.shared_fc1 + s * h));
    EXPECT_EQ(by[p + "mlp.shared_expert.down_proj.weight"]->shape, (std::vector<int64_t>{h, s}));
    EXPECT_EQ(by[p + "mlp.shared_expert.down_proj.weight"]->data.back(), static_cast<float>(lp.shared_fc2 + h * s - 1));
    // linear_qkv's bias per group: [q heads, k, v].
    ASSERT_TRUE(by.count(p + "self_attn.q_proj.bias"));
    EXPECT_EQ(by[p + "self_attn.q_proj.bias"]->data.front(), static_cast<float>(lp.qkv_b));
    EXPECT_EQ(by[p + "self_attn.k_proj.bias"]->data.front(), static_cast<float>(lp.qkv_b + 2 * 4));
    EXPECT_EQ(by[p + "self_attn.v_proj.bias"]->data.back(), static_cast<float>(lp.qkv_b + 4 * 4 - 1));
    EXPECT_EQ(by[p + "mlp.experts.3.up_proj.weight"]->data.front(),
              static_cast<float>(lp.experts + 3 * c.expert_floats() + 6 * h));
  }
  // Qwen2MoeSparseMoeBlock's order: gate, experts, shared_expert, shared_expert_gate; then the layer norms.
  auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_EQ(at("model.layers.1.mlp.shared_expert.gate_proj.weight"),
            at("model.layers.1.mlp.experts.3.down_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.shared_expert_gate.weight"),
            at("model.layers.1.mlp.shared_expert.down_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.input_layernorm.weight"), at("model.layers.1.mlp.shared_expert_gate.weight") + 1);
  EXPECT_EQ(at("model.layers.1.self_attn.q_proj.bias"), at("model.layers.1.self_attn.q_proj.weight") + 1);
}

TEST(HfQwen2Moe, ConfigJsonHoldsTheSharedExpertAndQkvBias) {
  GPTConfig c = Qwen2Moe();
  std::string j = MoeConfigJson(c, 19);
  for (const char* want :
       {"\"Qwen2MoeForCausalLM\"", "\"model_type\": \"qwen2_moe\"", "\"shared_expert_intermediate_size\": 10",
        "\"qkv_bias\": true", "\"num_experts\": 4", "\"moe_intermediate_size\": 6", "\"intermediate_size\": 12",
        "\"mlp_only_layers\": [\n    0\n  ]", "\"norm_topk_prob\": true", "\"use_sliding_window\": false"})
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  c.add_qkv_bias = false;
  EXPECT_NE(MoeConfigJson(c, 19).find("\"qkv_bias\": false"), std::string::npos);
}

TEST(HfQwen2Moe, WhatQwen2MoeCannotComputeIsRefusedNamingIt) {
  EXPECT_TRUE(CheckMoeExportable(Qwen2Moe(), "F").ok());
  const std::vector<ptk::testing::ExportRefusal> cases = {
      {[](GPTConfig* c) { c->moe_shared_expert_gate = false; },
       "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate (Qwen2-MoE scales its shared expert "
       "by sigmoid(shared_expert_gate), always)"},
      {[](GPTConfig* c) { c->moe_router_sigmoid = true; }, "--moe-router-score-function sigmoid"},
      {[](GPTConfig* c) { c->moe_router_topk_scaling_factor = 2.5; }, "--moe-router-topk-scaling-factor 2.5"},
      {[](GPTConfig* c) {
         c->moe_router_num_groups = 2;
         c->moe_router_group_topk = 1;
       },
       "--moe-router-group-topk 1"},
      {[](GPTConfig* c) { c->swiglu = false; }, "GELU MLPs without --swiglu"},
      {[](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }, "--normalization LayerNorm"},
      {[](GPTConfig* c) { c->rotary_percent = 0.5; }, "--rotary-percent 0.5"},
      {[](GPTConfig* c) { c->add_bias_linear = true; }, "linear biases (Qwen2-MoE biases q, k and v only"},
      {[](GPTConfig* c) { c->kv_channels = 8; }, "--kv-channels 8 with 2 heads of hidden size 8"},
  };
  ptk::testing::ExpectExportRefusals(
      Qwen2Moe(), CheckMoeExportable,
      "dir/model_optim_rng.ptk: this mixture-of-experts model (--num-experts 4 with shared "
      "experts) is not one Hugging Face's Qwen2MoeForCausalLM computes: ",
      cases, /*one_line=*/false);
}

class HfQwen2MoeRoundTrip : public ptk::testing::HfConvertFixture {
 protected:
  GPTConfig Saved(const std::string& dir, bool qkv_bias = true, bool pre_softmax = false, bool dense_first = true) {
    GPTConfig c = Qwen2Moe();
    c.vocab_size = 50257;
    c.padded_vocab_size = 50304;
    c.add_qkv_bias = qkv_bias;
    c.moe_router_pre_softmax = pre_softmax;
    if (!dense_first) c.moe_layer_pattern.clear();
    c.layernorm_epsilon = 1e-6;
    SaveModel(c, dir, 5,
              {{"--vocab-size", "50257"},
               {"--layernorm-epsilon", "1e-06"},
               {"--hidden-dropout", "0"},
               {"--attention-dropout", "0"},
               {"--moe-aux-loss-coeff", "0.01"}});
    return c;
  }
};

TEST_F(HfQwen2MoeRoundTrip, PtkToHfToPtkGivesBackEveryWeightBitForBit) {
  for (int k = 0; k < 2; ++k) {
    const bool on = k == 0;  // qkv biases, pre-softmax routing and a dense first layer; then none of them
    const std::string tag = std::to_string(k);
    const GPTConfig c = Saved(dir_ / ("ck" + tag), on, on, on);
    auto exp = ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag)));
    ASSERT_TRUE(exp.ok()) << exp.status();
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    const std::string& flags = imp->train_flags;
    EXPECT_NE(flags.find("--moe-shared-expert-intermediate-size 10 --moe-shared-expert-gate"), std::string::npos)
        << flags;
    EXPECT_EQ(flags.find("--add-qkv-bias") != std::string::npos, on) << flags;
    EXPECT_EQ(flags.find("--moe-router-pre-softmax") != std::string::npos, on) << flags;
    EXPECT_EQ(flags.find("--moe-layer-freq \"[0,1,1]\"") != std::string::npos, on) << flags;
    auto back = LoadPtkCheckpoint(dir_ / ("back" + tag));
    ASSERT_TRUE(back.ok()) << back.status();
    const GPTConfig& b = back->config;
    EXPECT_EQ(b.moe_shared_expert_intermediate_size, 10);
    EXPECT_TRUE(b.moe_shared_expert_gate);
    EXPECT_EQ(b.add_qkv_bias, on);
    EXPECT_FALSE(b.add_bias_linear);
    EXPECT_EQ(b.moe_router_pre_softmax, on);
    EXPECT_EQ(b.moe_layers(), on ? 2 : 3);
    EXPECT_FALSE(b.qk_layernorm);
    ASSERT_NO_FATAL_FAILURE(ExpectRoundTripBitForBit(back->params, c.hidden_size, /*untie=*/true, tag));
  }
}

TEST_F(HfQwen2MoeRoundTrip, AnUngatedSharedExpertIsRefusedWithNothingWritten) {
  GPTConfig c = Qwen2Moe();
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  c.moe_shared_expert_gate = false;
  SaveModel(c, dir_ / "ck", 5, {{"--vocab-size", "50257"}});
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("without --moe-shared-expert-gate"), std::string::npos) << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
}

TEST_F(HfQwen2MoeRoundTrip, ImportRefusesWhatPtkCannotComputeAndAMismatchedDirectory) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ptk::testing::ReadFile(hf + "/config.json");
  const std::vector<ConfigEdit> bad = {
      {"\"use_sliding_window\": false", "\"use_sliding_window\": true", "use_sliding_window true"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\""},
      {"\"use_cache\": true", "\"use_cache\": true, \"head_dim\": 8", "head_dim 8 is not hidden_size / "},
      {"\"shared_expert_intermediate_size\": 10", "\"shared_expert_intermediate_size\": 0",
       "shared_expert_intermediate_size"},
      {"\"qkv_bias\": true", "\"qkv_bias\": \"yes\"", "qkv_bias is not true or false"},
      {"\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 5", "leave no layer a mixture of experts"},
  };
  ExpectConfigEditsRefused(hf, config, bad);
  // qkv_bias false over weights with biases: the biases are tensors config.json has no place for.
  ptk::testing::WriteFile(hf + "/config.json", Edited(config, "\"qkv_bias\": true", "\"qkv_bias\": false"));
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-bias"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(hf + "/model.safetensors: tensor model.layers.0.self_attn."), std::string::npos)
      << r.status();
  // The shared expert's gate gone from the weights: missing, named.
  ptk::testing::WriteFile(hf + "/config.json", config);
  HfTensors all;
  ASSERT_NO_FATAL_FAILURE(ReadTensors(hf + "/model.safetensors", &all));
  const std::string gate = "model.layers.2.mlp.shared_expert_gate.weight";
  ExpectImportRefused(hf, Without(all.entries, gate), "out-gate",
                      hf + "/model.safetensors: tensor " + gate + ": missing (config.json asks for shape [1, 8])");
}

// tests/data/interop/qwen2_moe_tiny: a Qwen2MoeForCausalLM transformers 4.51.3 made and saved (3 layers, the first
// dense, hidden 16, 4 heads in 2 groups with q, k, v biases, 4 experts of 12, top 2, norm_topk_prob true, a shared
// expert of 10 with its gate, vocabulary 96), and its logits and loss on two sequences. Tolerance: 1e-4 on the
// logits and 1e-5 on the loss, as the other HF comparisons: both compute in fp32, in other orders of summation.
// Without the shared expert's gate (scale 1 instead of the sigmoid) the logits move by far more.
TEST(HfQwen2MoeGolden, AQwen2MoeSavedByTransformersImportsWithItsLogitsAndLoss) {
  ptk::testing::TempDir tmp;
  PtkCheckpoint ck;
  simdjson::dom::parser parser;
  simdjson::dom::element golden;
  ASSERT_NO_FATAL_FAILURE(
      ptk::testing::ImportHfGolden("qwen2_moe_tiny", tmp,
                                   "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 12 --moe-aux-loss-coeff "
                                   "0.02 --moe-layer-freq \"[0,1,1]\" --moe-shared-expert-intermediate-size 10 "
                                   "--moe-shared-expert-gate",
                                   &ck, &parser, &golden));
  const GPTConfig c = ck.config;
  EXPECT_TRUE(c.add_qkv_bias);
  EXPECT_FALSE(c.moe_router_pre_softmax);
  EXPECT_EQ(c.moe_layer_pattern, (std::vector<int>{0, 1, 1}));
  const double worst = ptk::testing::WorstHfLogitDifference(golden, c, ck.params, 96, true);
  EXPECT_LE(worst, 1e-4);
  std::printf("ptk's logits differ from transformers' by at most %.3g (tolerance 1e-4)\n", worst);
  // The test can tell: the shared expert ungated (its output added whole) moves the logits past the tolerance.
  GPTConfig ungated = c;
  ungated.moe_shared_expert_gate = false;
  auto full = ParamLayout::Create(c), less = ParamLayout::Create(ungated);
  ASSERT_TRUE(full.ok() && less.ok());
  std::vector<float> params;  // the same weights, each layer's gate_weight left out
  for (const ParamInfo& t : full->infos)
    if (t.name.find("shared_experts.gate_weight") == std::string::npos)
      params.insert(params.end(), ck.params.begin() + t.offset, ck.params.begin() + t.offset + t.size);
  ASSERT_EQ(static_cast<int64_t>(params.size()), less->num_params);
  EXPECT_GT(ptk::testing::WorstHfLogitDifference(golden, ungated, params, 96, false), 1e-2);
}

}  // namespace
}  // namespace ptk::hf_detail
