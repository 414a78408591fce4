// ptk-convert's MixtralForCausalLM mapping, without transformers (hf_mixtral_test.py runs the exported model in
// it): the router and each expert's w1/w3 (linear_fc1's [gate; up]) and w2 at their ptk offsets, Mixtral's
// state_dict order, config.json's keys, and every setting Mixtral cannot compute refused naming it; a MoE
// checkpoint's header read back whole by LoadPtkCheckpoint (a bad one refused naming the file).
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "interop/hf_mixtral.h"
#include "tests/interop/hf_convert_fixture.h"

namespace ptk::hf_detail {
namespace {

// Four SwiGLU experts of width 6 in each of 2 layers, top 2 after the softmax, the Llama line's dense parts.
GPTConfig Mixtral() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.num_query_groups = 1;
  c.ffn_hidden_size = 12;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = 20;
  c.padded_vocab_size = 24;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 6;
  c.moe_aux_loss_coeff = 0.01;
  return c;
}

TEST(HfMixtral, TheRouterAndExpertsLandInMixtralsNamesAndOrder) {
  const GPTConfig c = Mixtral();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params));
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i);  // each value its own offset
  std::vector<HfTensor> t = MixtralTensorsOf(c);
  MapMixtralParams(*layout, &params, &t);
  std::map<std::string, const HfTensor*> by;
  std::vector<std::string> names;
  for (const HfTensor& x : t) {
    by[x.name] = &x;
    names.push_back(x.name);
    EXPECT_EQ(x.name.find(".mlp."), std::string::npos) << x.name;  // no dense MLP left
  }
  const int64_t h = 8, f = 6;
  for (int l = 0; l < 2; ++l) {
    const LayerParams& lp = layout->layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".block_sparse_moe.";
    ASSERT_TRUE(by.count(p + "gate.weight"));
    EXPECT_EQ(by[p + "gate.weight"]->shape, (std::vector<int64_t>{4, h}));
    EXPECT_EQ(by[p + "gate.weight"]->data[0], static_cast<float>(lp.router_w));
    ASSERT_EQ(layout->Find("decoder.layers." + std::to_string(l) + ".mlp.router.weight")->offset, lp.router_w);
    for (int j = 0; j < 4; ++j) {
      const std::string e = p + "experts." + std::to_string(j) + ".";
      const int64_t fc1 = layout
                              ->Find("decoder.layers." + std::to_string(l) + ".mlp.experts.local_experts." +
                                     std::to_string(j) + ".linear_fc1.weight")
                              ->offset;
      const int64_t fc2 = layout
                              ->Find("decoder.layers." + std::to_string(l) + ".mlp.experts.local_experts." +
                                     std::to_string(j) + ".linear_fc2.weight")
                              ->offset;
      EXPECT_EQ(by[e + "w1.weight"]->shape, (std::vector<int64_t>{f, h}));
      EXPECT_EQ(by[e + "w2.weight"]->shape, (std::vector<int64_t>{h, f}));
      EXPECT_EQ(by[e + "w1.weight"]->data.front(), static_cast<float>(fc1));          // gate: fc1's first rows
      EXPECT_EQ(by[e + "w3.weight"]->data.front(), static_cast<float>(fc1 + f * h));  // up: its last rows
      EXPECT_EQ(by[e + "w3.weight"]->data.back(), static_cast<float>(fc1 + 2 * f * h - 1));
      EXPECT_EQ(by[e + "w2.weight"]->data.back(), static_cast<float>(fc2 + h * f - 1));
    }
  }
  // Mixtral's state_dict order: attention, then the MoE block (gate, each expert's w1, w2, w3), then the norms.
  auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_EQ(at("model.layers.0.block_sparse_moe.gate.weight"), at("model.layers.0.self_attn.o_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.0.block_sparse_moe.experts.0.w2.weight"),
            at("model.layers.0.block_sparse_moe.experts.0.w1.weight") + 1);
  EXPECT_EQ(at("model.layers.0.input_layernorm.weight"), at("model.layers.0.block_sparse_moe.experts.3.w3.weight") + 1);
  EXPECT_EQ(names.back(), "lm_head.weight");
}

TEST(HfMixtral, ConfigJsonHoldsTheExpertsSettings) {
  const std::string j = MixtralConfigJson(Mixtral(), 19);
  for (const char* want : {"\"MixtralForCausalLM\"", "\"model_type\": \"mixtral\"", "\"num_local_experts\": 4",
                           "\"num_experts_per_tok\": 2", "\"intermediate_size\": 6", "\"router_aux_loss_coef\": 0.01",
                           "\"output_router_logits\": false", "\"sliding_window\": null", "\"num_key_value_heads\": 1",
                           "\"tie_word_embeddings\": false", "\"vocab_size\": 20"})
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
}

TEST(HfMixtral, WhatMixtralCannotComputeIsRefusedNamingIt) {
  EXPECT_TRUE(CheckMixtralExportable(Mixtral(), "F").ok());
  struct Case {
    void (*change)(GPTConfig*);
    const char* reason;
  };
  const Case cases[] = {
      {[](GPTConfig* c) { c->moe_router_pre_softmax = true; }, "--moe-router-pre-softmax (Mixtral renormalises"},
      {[](GPTConfig* c) { c->moe_router_sigmoid = true; }, "--moe-router-score-function sigmoid"},
      {[](GPTConfig* c) { c->moe_router_topk_scaling_factor = 2.5; },
       "--moe-router-topk-scaling-factor 2.5 (Mixtral's probabilities are not scaled)"},
      {[](GPTConfig* c) {
         c->moe_router_num_groups = 2;
         c->moe_router_group_topk = 1;
       },
       "--moe-router-group-topk 1 (Mixtral routes among all experts"},
      {[](GPTConfig* c) {
         c->moe_layer_pattern = {0, 1};
       },
       "--moe-layer-freq [0,1] with dense layers"},
      {[](GPTConfig* c) { c->swiglu = false; }, "GELU experts without --swiglu"},
      {[](GPTConfig* c) {
         c->swiglu = false;
         c->squared_relu = true;
       },
       "squared-ReLU experts without --swiglu"},
      {[](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }, "--normalization LayerNorm"},
      {[](GPTConfig* c) { c->position_embedding = PositionEmbedding::kLearnedAbsolute; },
       "--position-embedding-type learned_absolute"},
      {[](GPTConfig* c) { c->rotary_percent = 0.5; }, "--rotary-percent 0.5"},
      {[](GPTConfig* c) { c->use_rope_scaling = true; }, "--use-rope-scaling (transformers 4.44's Mixtral"},
      {[](GPTConfig* c) { c->rotary_seq_len_interpolation_factor = 4; }, "--rotary-seq-len-interpolation-factor"},
      {[](GPTConfig* c) { c->add_qkv_bias = true; }, "linear biases"},
      {[](GPTConfig* c) { c->qk_layernorm = true; }, "--qk-layernorm"},
      {[](GPTConfig* c) { c->kv_channels = 8; }, "--kv-channels 8 with 2 heads of hidden size 8"},
  };
  for (const Case& k : cases) {
    GPTConfig c = Mixtral();
    k.change(&c);
    const absl::Status st = CheckMixtralExportable(c, "dir/model_optim_rng.ptk");
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << k.reason;
    const std::string msg(st.message());
    EXPECT_EQ(msg.rfind("dir/model_optim_rng.ptk: this mixture-of-experts model (--num-experts 4) is not one Hugging "
                        "Face's MixtralForCausalLM computes: ",
                        0),
              0u)
        << msg;
    EXPECT_NE(msg.find(k.reason), std::string::npos) << msg;
  }
}

class HfMixtralLoad : public ptk::testing::HfConvertFixture {};

TEST_F(HfMixtralLoad, TheCheckpointsExpertsAreReadBackAndABadHeaderIsRefused) {
  GPTConfig c = Mixtral();
  c.moe_router_topk = 3;
  c.moe_router_pre_softmax = true;
  c.moe_layer_pattern = {1, 0};
  const std::string dir = dir_ / "ck";
  SaveModel(c, dir, 2, {{"--vocab-size", "20"}, {"--moe-aux-loss-coeff", "0.05"}});
  auto ck = LoadPtkCheckpoint(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->config.num_experts, 4);
  EXPECT_EQ(ck->config.moe_router_topk, 3);
  EXPECT_EQ(ck->config.moe_ffn(), 6);
  EXPECT_TRUE(ck->config.moe_router_pre_softmax);
  EXPECT_FALSE(ck->config.moe_router_sigmoid);
  EXPECT_EQ(ck->config.moe_layer_pattern, (std::vector<int>{1, 0}));
  EXPECT_EQ(ck->config.moe_aux_loss_coeff, 0.05);
  EXPECT_EQ(ck->params, params_);
  // A header whose moe_layer_freq is no list of 0 and 1: refused naming the file (it was read as dense layers).
  auto text = ReadFileToString(ck->file);
  ASSERT_TRUE(text.ok());
  const size_t at = text->find("\"moe_layer_freq\": \"[1,0]\"");
  ASSERT_NE(at, std::string::npos);
  (*text)[at + std::string("\"moe_layer_freq\": \"[1,").size()] = 'x';
  ASSERT_TRUE(WriteFileAtomic(ck->file, *text).ok());
  auto bad = LoadPtkCheckpoint(dir);
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_NE(bad.status().message().find(ck->file + ": the header's description of the mixture of experts"),
            std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace ptk::hf_detail
