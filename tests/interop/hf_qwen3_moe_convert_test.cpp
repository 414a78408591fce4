// ptk-convert's Qwen3MoeForCausalLM mapping (a mixture of experts of the Llama line with --qk-layernorm), without
// transformers: the router and each expert's gate_proj/up_proj (linear_fc1's [gate; up]) and down_proj at their ptk
// offsets, the dense layers of --moe-layer-freq as mlp_only_layers, Qwen3-MoE's state_dict order, config.json's
// keys, and every setting Qwen3-MoE cannot compute refused naming it. ptk -> hf -> ptk gives back every weight bit
// for bit and exported again the same files; a Qwen3MoeForCausalLM saved by transformers 4.51.3
// (tests/data/interop/qwen3_moe_tiny, tests/support/gen_qwen3_moe_hf_golden.py) imports and ptk's Forward gives its
// logits and loss; what ptk cannot compute or a damaged directory is refused in one line naming the file and the
// key or tensor.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/file_io.h"
#include "interop/hf_mixtral.h"
#include "interop/hf_qwen3_moe.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/interop/hf_golden_logits.h"
#include "tests/test_util.h"
#include "trainer/backend.h"

namespace ptk::hf_detail {
namespace {

// Three layers, the first dense (width 12), the others four SwiGLU experts of width 6, top 2; query and key norms,
// head_dim 8 with 2 heads of hidden 8 (not hidden / heads).
GPTConfig Qwen3Moe() {
  GPTConfig c = ptk::testing::SmallMoeLlama(3);
  c.kv_channels = 8;
  c.qk_layernorm = true;
  c.moe_layer_pattern = {0, 1, 1};
  return c;
}

TEST(HfQwen3Moe, TheRouterExpertsAndDenseLayersLandInQwen3MoesNamesAndOrder) {
  const GPTConfig c = Qwen3Moe();
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
    EXPECT_EQ(x.name.find("block_sparse_moe"), std::string::npos) << x.name;
  }
  const int64_t h = 8, f = 6;
  // Layer 0 is dense: Qwen3MoeMLP of intermediate_size 12, linear_fc1's [gate; up].
  const LayerParams& l0 = layout->layers[0];
  ASSERT_TRUE(by.count("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_EQ(by["model.layers.0.mlp.gate_proj.weight"]->shape, (std::vector<int64_t>{12, h}));
  EXPECT_EQ(by["model.layers.0.mlp.up_proj.weight"]->data.front(), static_cast<float>(l0.fc1_w + 12 * h));
  EXPECT_EQ(by["model.layers.0.mlp.down_proj.weight"]->data.back(), static_cast<float>(l0.fc2_w + h * 12 - 1));
  EXPECT_FALSE(by.count("model.layers.0.mlp.gate.weight"));
  for (int l = 1; l < 3; ++l) {
    const LayerParams& lp = layout->layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
    EXPECT_FALSE(by.count(p + "gate_proj.weight"));
    ASSERT_TRUE(by.count(p + "gate.weight"));
    EXPECT_EQ(by[p + "gate.weight"]->shape, (std::vector<int64_t>{4, h}));
    EXPECT_EQ(by[p + "gate.weight"]->data[0], static_cast<float>(lp.router_w));
    for (int j = 0; j < 4; ++j) {
      const std::string e = p + "experts." + std::to_string(j) + ".";
      const std::string meg = "decoder.layers." + std::to_string(l) + ".mlp.experts.local_experts." + std::to_string(j);
      const int64_t fc1 = layout->Find(meg + ".linear_fc1.weight")->offset,
                    fc2 = layout->Find(meg + ".linear_fc2.weight")->offset;
      EXPECT_EQ(by[e + "gate_proj.weight"]->shape, (std::vector<int64_t>{f, h}));
      EXPECT_EQ(by[e + "down_proj.weight"]->shape, (std::vector<int64_t>{h, f}));
      EXPECT_EQ(by[e + "gate_proj.weight"]->data.front(), static_cast<float>(fc1));
      EXPECT_EQ(by[e + "up_proj.weight"]->data.front(), static_cast<float>(fc1 + f * h));
      EXPECT_EQ(by[e + "up_proj.weight"]->data.back(), static_cast<float>(fc1 + 2 * f * h - 1));
      EXPECT_EQ(by[e + "down_proj.weight"]->data.back(), static_cast<float>(fc2 + h * f - 1));
    }
  }
  // Qwen3-MoE's state_dict order: attention with its norms, then the MoE block (gate, each expert's gate_proj,
  // up_proj, down_proj), then the layer norms.
  auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_EQ(at("model.layers.1.mlp.gate.weight"), at("model.layers.1.self_attn.k_norm.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.experts.0.up_proj.weight"), at("model.layers.1.mlp.experts.0.gate_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.experts.0.down_proj.weight"), at("model.layers.1.mlp.experts.0.up_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.input_layernorm.weight"), at("model.layers.1.mlp.experts.3.down_proj.weight") + 1);
  EXPECT_EQ(names.back(), "lm_head.weight");
}

TEST(HfQwen3Moe, ConfigJsonHoldsTheExpertsAndDenseLayers) {
  GPTConfig c = Qwen3Moe();
  std::string j = MoeConfigJson(c, 19);
  for (const char* want :
       {"\"Qwen3MoeForCausalLM\"", "\"model_type\": \"qwen3_moe\"", "\"num_experts\": 4", "\"num_experts_per_tok\": 2",
        "\"moe_intermediate_size\": 6", "\"intermediate_size\": 12", "\"mlp_only_layers\": [\n    0\n  ]",
        "\"decoder_sparse_step\": 1", "\"norm_topk_prob\": true", "\"head_dim\": 8", "\"router_aux_loss_coef\": 0.01",
        "\"use_sliding_window\": false", "\"num_key_value_heads\": 1", "\"tie_word_embeddings\": false"})
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  c.moe_router_pre_softmax = true;  // the chosen softmax probabilities as they are: not renormalised
  c.moe_layer_pattern.clear();
  j = MoeConfigJson(c, 19);
  EXPECT_NE(j.find("\"norm_topk_prob\": false"), std::string::npos) << j;
  EXPECT_NE(j.find("\"mlp_only_layers\": []"), std::string::npos) << j;
  EXPECT_STREQ(MoeArchitecture(c), "Qwen3MoeForCausalLM");
  c.qk_layernorm = false;
  EXPECT_STREQ(MoeArchitecture(c), "MixtralForCausalLM");
}

TEST(HfQwen3Moe, WhatQwen3MoeCannotComputeIsRefusedNamingIt) {
  EXPECT_TRUE(CheckMoeExportable(Qwen3Moe(), "F").ok());
  GPTConfig pre = Qwen3Moe();
  pre.moe_router_pre_softmax = true;
  EXPECT_TRUE(CheckMoeExportable(pre, "F").ok());  // norm_topk_prob false
  const std::vector<ptk::testing::ExportRefusal> cases = {
      {[](GPTConfig* c) { c->moe_router_sigmoid = true; }, "--moe-router-score-function sigmoid"},
      {[](GPTConfig* c) { c->moe_router_topk_scaling_factor = 2.5; },
       "--moe-router-topk-scaling-factor 2.5 (Qwen3-MoE's probabilities are not scaled)"},
      {[](GPTConfig* c) {
         c->moe_router_num_groups = 2;
         c->moe_router_group_topk = 1;
       },
       "--moe-router-group-topk 1 (Qwen3-MoE routes among all experts"},
      {[](GPTConfig* c) { c->moe_shared_expert_intermediate_size = 8; },
       "--moe-shared-expert-intermediate-size 8 (Qwen3-MoE has no shared experts)"},
      {[](GPTConfig* c) { c->swiglu = false; }, "GELU MLPs without --swiglu"},
      {[](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }, "--normalization LayerNorm"},
      {[](GPTConfig* c) { c->position_embedding = PositionEmbedding::kNone; }, "--position-embedding-type none"},
      {[](GPTConfig* c) { c->rotary_percent = 0.5; }, "--rotary-percent 0.5"},
      {[](GPTConfig* c) {
         c->use_rope_scaling = true;
         c->rotary_seq_len_interpolation_factor = 2;
       },
       "--use-rope-scaling with --rotary-seq-len-interpolation-factor"},
      {[](GPTConfig* c) { c->add_qkv_bias = true; }, "linear biases"},
  };
  ptk::testing::ExpectExportRefusals(
      Qwen3Moe(), CheckMoeExportable,
      "dir/model_optim_rng.ptk: this mixture-of-experts model (--num-experts 4 --qk-layernorm) is "
      "not one Hugging Face's Qwen3MoeForCausalLM computes: ",
      cases, /*one_line=*/true);
}

// The Qwen3-MoE shape with GPT-2's vocabulary (what the export's built-in tokenizer has), saved at iteration 5.
class HfQwen3MoeRoundTrip : public ptk::testing::HfConvertFixture {
 protected:
  GPTConfig Saved(const std::string& dir, bool untie = true, bool pre_softmax = false, bool dense_first = true) {
    GPTConfig c = Qwen3Moe();
    c.vocab_size = 50257;
    c.padded_vocab_size = 50304;
    c.untie_embeddings_and_output_weights = untie;
    c.moe_router_pre_softmax = pre_softmax;
    if (!dense_first) c.moe_layer_pattern.clear();
    c.rotary_base = 1000000;
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

TEST_F(HfQwen3MoeRoundTrip, PtkToHfToPtkGivesBackEveryWeightBitForBit) {
  for (int k = 0; k < 2; ++k) {
    const bool untie = k == 0, pre = k == 0, dense_first = k == 0;
    const std::string tag = std::to_string(k);
    const GPTConfig c = Saved(dir_ / ("ck" + tag), untie, pre, dense_first);
    auto exp = ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag)));
    ASSERT_TRUE(exp.ok()) << exp.status();
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    const std::string& flags = imp->train_flags;
    EXPECT_NE(flags.find("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 6 --moe-aux-loss-coeff 0.01"),
              std::string::npos)
        << flags;
    EXPECT_NE(flags.find("--ffn-hidden-size 12 "), std::string::npos) << flags;
    EXPECT_NE(flags.find("--qk-layernorm"), std::string::npos) << flags;
    EXPECT_NE(flags.find("--kv-channels 8"), std::string::npos) << flags;
    EXPECT_EQ(flags.find("--moe-router-pre-softmax") != std::string::npos, pre) << flags;
    EXPECT_EQ(flags.find("--moe-layer-freq \"[0,1,1]\"") != std::string::npos, dense_first) << flags;
    auto back = LoadPtkCheckpoint(dir_ / ("back" + tag));
    ASSERT_TRUE(back.ok()) << back.status();
    const GPTConfig& b = back->config;
    EXPECT_EQ(b.num_experts, 4);
    EXPECT_EQ(b.moe_router_topk, 2);
    EXPECT_EQ(b.moe_ffn(), 6);
    EXPECT_EQ(b.ffn_hidden_size, 12);
    EXPECT_EQ(b.moe_aux_loss_coeff, 0.01);
    EXPECT_EQ(b.moe_router_pre_softmax, pre);
    EXPECT_FALSE(b.moe_router_sigmoid);
    EXPECT_EQ(b.moe_layers(), dense_first ? 2 : 3);
    EXPECT_FALSE(b.moe_layer(0) && dense_first);
    EXPECT_TRUE(b.qk_layernorm);
    EXPECT_EQ(b.head_dim(), 8);
    EXPECT_EQ(b.rotary_base, 1000000);
    EXPECT_EQ(b.untie_embeddings_and_output_weights, untie);
    ASSERT_NO_FATAL_FAILURE(ExpectRoundTripBitForBit(back->params, c.hidden_size, untie, tag));
  }
}

TEST_F(HfQwen3MoeRoundTrip, ASharedExpertModelIsRefusedWithNothingWritten) {
  GPTConfig c = Qwen3Moe();
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  c.moe_shared_expert_intermediate_size = 8;
  SaveModel(c, dir_ / "ck", 5, {{"--vocab-size", "50257"}});
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("--moe-shared-expert-intermediate-size 8 (Qwen3-MoE has no shared experts)"),
            std::string::npos)
      << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
}

TEST_F(HfQwen3MoeRoundTrip, ImportRefusesWhatPtkCannotComputeNamingTheFileAndKey) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ptk::testing::ReadFile(hf + "/config.json");
  const std::vector<ConfigEdit> bad = {
      {"\"use_sliding_window\": false", "\"use_sliding_window\": true",
       "use_sliding_window true: ptk's attention is causal over the whole sequence"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\": ptk's gated MLP is SwiGLU's"},
      {"\"attention_bias\": false", "\"attention_bias\": true", "attention_bias true: Qwen3-MoE's q, k, v and o"},
      {"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "num_experts_per_tok 5 is more than num_experts 4"},
      {"\"norm_topk_prob\": true", "\"norm_topk_prob\": 1", "norm_topk_prob is not true or false"},
      {"\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 0", "decoder_sparse_step"},
      {"\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 4",
       "decoder_sparse_step 4 and mlp_only_layers leave no layer a mixture of experts"},
      {"\"mlp_only_layers\": [\n    0\n  ]", "\"mlp_only_layers\": [3]",
       "mlp_only_layers entry 3 is not a layer number below num_hidden_layers 3"},
      {"\"mlp_only_layers\": [\n    0\n  ]", "\"mlp_only_layers\": 0", "mlp_only_layers is not a list"},
      {"\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2.0}",
       "rope_scaling {\"rope_type\":\"yarn\",\"factor\":2.0}"},
      {"\"router_aux_loss_coef\": 0.01", "\"router_aux_loss_coef\": -1", "router_aux_loss_coef"},
      {"\"model_type\": \"qwen3_moe\"", "\"model_type\": \"deepseek_v2\"",
       "model_type \"deepseek_v2\": ptk reads GPT-2 models"},
  };
  ExpectConfigEditsRefused(hf, config, bad);
}

TEST_F(HfQwen3MoeRoundTrip, ImportRefusesAMismatchedOrDamagedDirectoryNamingTheTensor) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ptk::testing::ReadFile(hf + "/config.json");
  // config.json says every layer is a mixture, the weights have a dense layer 0: its experts are missing.
  ptk::testing::WriteFile(hf + "/config.json",
                          Edited(config, "\"mlp_only_layers\": [\n    0\n  ]", "\"mlp_only_layers\": []"));
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-layers"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(hf + "/model.safetensors: tensor model.layers.0.mlp."), std::string::npos)
      << r.status();
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << r.status();
  ptk::testing::WriteFile(hf + "/config.json", config);
  // One expert's down_proj left out; then the router of the wrong shape.
  HfTensors all;
  ASSERT_NO_FATAL_FAILURE(ReadTensors(hf + "/model.safetensors", &all));
  const std::string expert = "model.layers.2.mlp.experts.1.down_proj.weight";
  ExpectImportRefused(hf, Without(all.entries, expert), "out-missing",
                      hf + "/model.safetensors: tensor " + expert + ": missing (config.json asks for shape [8, 6])");
  std::vector<SafetensorsEntry> entries = all.entries;
  std::vector<float> gate(3 * 8, 0.5f);
  for (SafetensorsEntry& e : entries)
    if (e.name == "model.layers.1.mlp.gate.weight") e = {e.name, {3, 8}, gate};
  ExpectImportRefused(hf, entries, "out-shape",
                      hf + "/model.safetensors: tensor model.layers.1.mlp.gate.weight: shape [3, 8], config.json asks "
                           "for [4, 8]");
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out-shape/iter_0000000"));
}

// tests/data/interop/qwen3_moe_tiny: a Qwen3MoeForCausalLM transformers 4.51.3 made and saved (3 layers, the first
// dense, hidden 16, 4 heads of head_dim 8 in 2 groups, 4 experts of 12, top 2, norm_topk_prob false, vocabulary 96),
// and its logits and loss on two sequences. Tolerance: 1e-4 on the logits (absolute; they are of order 1) and 1e-5
// on the loss, as the other HF comparisons (hf_test_common.py's TOL): both compute in fp32, in other orders of
// summation. Renormalising the top 2's probabilities (norm_topk_prob true) moves the logits by far more.
TEST(HfQwen3MoeGolden, AQwen3MoeSavedByTransformersImportsWithItsLogitsAndLoss) {
  ptk::testing::TempDir tmp;
  PtkCheckpoint ck;
  simdjson::dom::parser parser;
  simdjson::dom::element golden;
  ASSERT_NO_FATAL_FAILURE(
      ptk::testing::ImportHfGolden("qwen3_moe_tiny", tmp,
                                   "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 12 --moe-aux-loss-coeff "
                                   "0.02 --moe-router-pre-softmax --moe-layer-freq \"[0,1,1]\"",
                                   &ck, &parser, &golden));
  const GPTConfig c = ck.config;
  EXPECT_EQ(c.num_query_groups, 2);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.ffn_hidden_size, 20);
  EXPECT_TRUE(c.qk_layernorm);
  EXPECT_TRUE(c.moe_router_pre_softmax);
  EXPECT_EQ(c.moe_layer_pattern, (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(c.padded_vocab_size, 96);
  // ptk's logits and loss for `config`; the largest logit difference.
  auto compare = [&](const GPTConfig& config, bool expect_equal) {
    return ptk::testing::WorstHfLogitDifference(golden, config, ck.params, 96, expect_equal);
  };
  const double worst = compare(c, true);
  EXPECT_LE(worst, 1e-4);
  std::printf("ptk's logits differ from transformers' by at most %.3g (tolerance 1e-4)\n", worst);
  // The test can tell: the top 2's probabilities renormalised (norm_topk_prob true) move the logits past it.
  GPTConfig renormalised = c;
  renormalised.moe_router_pre_softmax = false;
  EXPECT_GT(compare(renormalised, false), 1e-2);
}

}  // namespace
}  // namespace ptk::hf_detail
