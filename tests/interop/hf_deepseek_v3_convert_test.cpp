// ptk-convert's DeepseekV3ForCausalLM mapping (multi-latent attention, sigmoid-routed experts with their expert
// bias, shared experts, the first layers dense), without transformers: every HF tensor at its ptk offset with its
// shape, DeepSeek-V3's state_dict order, config.json's keys, every setting DeepSeek-V3 cannot compute refused naming
// it (export) or naming config.json and the key (import); ptk -> hf -> ptk gives back every weight and expert bias bit
// for bit and, exported again, the same files. hf_deepseek_v3_test.py checks the logits against transformers.
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "interop/hf_deepseek_v3.h"
#include "interop/hf_qwen3_moe.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/test_util.h"

namespace ptk::hf_detail {
namespace {

// Three layers, the first dense (width 12), then four SwiGLU experts of width 6 in two groups (top 2 of one group),
// a shared expert twice their width; MLA with a query latent of 10, a key/value latent of 6, 4 + 4 query/key
// channels and 3 value channels per head, 2 heads of hidden 8; YaRN at factor 2 over a context of 8192.
GPTConfig Deepseek() {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 12;
  c.seq_length = 16;
  c.max_position_embeddings = 8192;
  c.vocab_size = 20;
  c.padded_vocab_size = 24;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.layernorm_epsilon = 1e-6;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.qk_layernorm = true;
  c.untie_embeddings_and_output_weights = true;
  c.multi_latent_attention = true;
  c.q_lora_rank = 10;
  c.kv_lora_rank = 6;
  c.qk_head_dim = 4;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 3;
  c.mla_yarn = true;
  c.rotary_scaling_factor = 2;
  c.mscale = 0.8;
  c.mscale_all_dim = 0.5;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 6;
  c.moe_router_sigmoid = true;
  c.moe_router_topk_scaling_factor = 2.5;
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_shared_expert_intermediate_size = 12;
  c.moe_layer_pattern = {0, 1, 1};
  return c;
}

TEST(HfDeepseekV3, EveryTensorLandsAtItsPtkOffsetInDeepseekV3sNamesShapesAndOrder) {
  const GPTConfig c = Deepseek();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params));
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i);  // each value its own offset
  std::vector<HfTensor> t = MoeTensorsOf(c);
  MapMoeParams(*layout, &params, &t, /*to_hf=*/true);
  std::map<std::string, const HfTensor*> by;
  std::vector<std::string> names;
  for (const HfTensor& x : t) by[x.name] = &x, names.push_back(x.name);
  // Each HF tensor is one Megatron tensor whole: its first and last element at that tensor's offsets.
  auto same = [&](const std::string& hf, const std::string& meg, std::vector<int64_t> shape, int64_t skip = 0) {
    ASSERT_TRUE(by.count(hf)) << hf;
    const ParamInfo* p = layout->Find(meg);
    ASSERT_NE(p, nullptr) << meg;
    EXPECT_EQ(by[hf]->shape, shape) << hf;
    EXPECT_EQ(by[hf]->data.front(), static_cast<float>(p->offset + skip)) << hf;
    EXPECT_EQ(by[hf]->data.back(), static_cast<float>(p->offset + skip + static_cast<int64_t>(by[hf]->data.size()) - 1))
        << hf;
  };
  for (int l = 0; l < 3; ++l) {
    const std::string a = "model.layers." + std::to_string(l) + ".self_attn.",
                      m = "decoder.layers." + std::to_string(l) + ".self_attention.";
    same(a + "q_a_proj.weight", m + "linear_q_down_proj.weight", {10, 8});
    same(a + "q_a_layernorm.weight", m + "q_layernorm.weight", {10});
    same(a + "q_b_proj.weight", m + "linear_q_up_proj.weight", {2 * 8, 10});              // per head [nope 4; rope 4]
    same(a + "kv_a_proj_with_mqa.weight", m + "linear_kv_down_proj.weight", {6 + 4, 8});  // [latent; rope]
    same(a + "kv_a_layernorm.weight", m + "kv_layernorm.weight", {6});
    same(a + "kv_b_proj.weight", m + "linear_kv_up_proj.weight", {2 * (4 + 3), 6});  // per head [k nope; v]
    same(a + "o_proj.weight", m + "linear_proj.weight", {8, 2 * 3});
    EXPECT_FALSE(by.count(a + "q_proj.weight"));
  }
  same("model.layers.0.mlp.gate_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight", {12, 8});
  same("model.layers.0.mlp.up_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight", {12, 8}, 12 * 8);
  same("model.layers.0.mlp.down_proj.weight", "decoder.layers.0.mlp.linear_fc2.weight", {8, 12});
  EXPECT_FALSE(by.count("model.layers.0.mlp.gate.weight"));
  for (int l = 1; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.", m = "decoder.layers." + std::to_string(l);
    same(p + "gate.weight", m + ".mlp.router.weight", {4, 8});
    ASSERT_TRUE(by.count(p + "gate.e_score_correction_bias"));
    EXPECT_EQ(by[p + "gate.e_score_correction_bias"]->shape, (std::vector<int64_t>{4}));
    for (int j = 0; j < 4; ++j) {
      const std::string e = p + "experts." + std::to_string(j) + ".",
                        meg = m + ".mlp.experts.local_experts." + std::to_string(j);
      same(e + "gate_proj.weight", meg + ".linear_fc1.weight", {6, 8});
      same(e + "up_proj.weight", meg + ".linear_fc1.weight", {6, 8}, 6 * 8);
      same(e + "down_proj.weight", meg + ".linear_fc2.weight", {8, 6});
    }
    same(p + "shared_experts.gate_proj.weight", m + ".mlp.shared_experts.linear_fc1.weight", {12, 8});
    same(p + "shared_experts.up_proj.weight", m + ".mlp.shared_experts.linear_fc1.weight", {12, 8}, 12 * 8);
    same(p + "shared_experts.down_proj.weight", m + ".mlp.shared_experts.linear_fc2.weight", {8, 12});
  }
  same("model.layers.2.input_layernorm.weight", "decoder.layers.2.input_layernorm.weight", {8});
  same("model.layers.2.post_attention_layernorm.weight", "decoder.layers.2.pre_mlp_layernorm.weight", {8});
  same("model.norm.weight", "decoder.final_layernorm.weight", {8});
  same("model.embed_tokens.weight", "embedding.word_embeddings.weight", {20, 8});  // the padded rows dropped
  same("lm_head.weight", "output_layer.weight", {20, 8});
  // DeepseekV3DecoderLayer's state_dict order: self_attn, then mlp (experts, gate's weight and buffer,
  // shared_experts), then the two norms.
  auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_EQ(at("model.layers.1.self_attn.q_a_layernorm.weight"), at("model.layers.1.self_attn.q_a_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.experts.0.gate_proj.weight"), at("model.layers.1.self_attn.o_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.gate.weight"), at("model.layers.1.mlp.experts.3.down_proj.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.gate.e_score_correction_bias"), at("model.layers.1.mlp.gate.weight") + 1);
  EXPECT_EQ(at("model.layers.1.mlp.shared_experts.gate_proj.weight"),
            at("model.layers.1.mlp.gate.e_score_correction_bias") + 1);
  EXPECT_EQ(at("model.layers.1.input_layernorm.weight"), at("model.layers.1.mlp.shared_experts.down_proj.weight") + 1);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(static_cast<int64_t>(t.size()), 1 + 7 * 3 + 3 + 2 * (12 + 2 + 3) + 3 * 2 + 2);
}

TEST(HfDeepseekV3, WithoutAQueryLatentTheQueriesAreQProj) {
  GPTConfig c = Deepseek();
  c.q_lora_rank = 0;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params));
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i);
  std::vector<HfTensor> t = MoeTensorsOf(c);
  MapMoeParams(*layout, &params, &t, /*to_hf=*/true);
  const auto q = std::find_if(t.begin(), t.end(),
                              [](const HfTensor& x) { return x.name == "model.layers.1.self_attn.q_proj.weight"; });
  ASSERT_NE(q, t.end());
  EXPECT_EQ(q->shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(q->data.front(),
            static_cast<float>(layout->Find("decoder.layers.1.self_attention.linear_q_proj.weight")->offset));
  for (const HfTensor& x : t) EXPECT_EQ(x.name.find("q_a_"), std::string::npos) << x.name;
  EXPECT_NE(MoeConfigJson(c, 19).find("\"q_lora_rank\": null"), std::string::npos);
}

TEST(HfDeepseekV3, ConfigJsonHoldsEveryKeyDeepseekV3ConfigReads) {
  GPTConfig c = Deepseek();
  std::string j = MoeConfigJson(c, 19);
  EXPECT_STREQ(MoeArchitecture(c), "DeepseekV3ForCausalLM");
  for (const char* want : {"\"DeepseekV3ForCausalLM\"",
                           "\"model_type\": \"deepseek_v3\"",
                           "\"attention_bias\": false",
                           "\"first_k_dense_replace\": 1",
                           "\"hidden_act\": \"silu\"",
                           "\"intermediate_size\": 12",
                           "\"kv_lora_rank\": 6",
                           "\"moe_intermediate_size\": 6",
                           "\"n_group\": 2",
                           "\"n_routed_experts\": 4",
                           "\"n_shared_experts\": 2",
                           "\"norm_topk_prob\": true",
                           "\"num_experts_per_tok\": 2",
                           "\"num_key_value_heads\": 2",
                           "\"q_lora_rank\": 10",
                           "\"qk_nope_head_dim\": 4",
                           "\"qk_rope_head_dim\": 4",
                           "\"rms_norm_eps\": 1e-06",
                           "\"rope_interleave\": true",
                           "\"routed_scaling_factor\": 2.5",
                           "\"topk_group\": 1",
                           "\"v_head_dim\": 3",
                           "\"tie_word_embeddings\": false",
                           "\"rope_type\": \"yarn\"",
                           "\"factor\": 2.0",
                           "\"mscale\": 0.8",
                           "\"mscale_all_dim\": 0.5",
                           "\"original_max_position_embeddings\": 4096",
                           "\"beta_fast\": 32.0",
                           "\"beta_slow\": 1.0",
                           "\"pretraining_tp\": 1",
                           "\"max_position_embeddings\": 8192"})
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  // ptk's concentration factor, mscale(2, 0.8) / mscale(2, 0.5), where transformers' default would be mscale(2, 1).
  EXPECT_NE(j.find("\"attention_factor\": 1.0200978761087955"), std::string::npos) << j;
  c.rotary_scaling_factor = 1;  // YaRN at factor 1 is plain RoPE: no rope_scaling
  c.moe_router_group_topk = 0;  // every expert one group
  c.moe_router_topk = 1;        // megatron-core does not renormalise one score
  c.moe_router_topk_scaling_factor = 0;
  c.moe_layer_pattern.clear();
  j = MoeConfigJson(c, 19);
  for (const char* want : {"\"rope_scaling\": null", "\"n_group\": 1", "\"topk_group\": 1", "\"norm_topk_prob\": false",
                           "\"routed_scaling_factor\": 1.0", "\"first_k_dense_replace\": 0"})
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  c.num_experts = 0;  // a dense MLA model: every layer before first_k_dense_replace
  c.moe_shared_expert_intermediate_size = 0;
  EXPECT_STREQ(MoeArchitecture(c), "DeepseekV3ForCausalLM");
  EXPECT_TRUE(MoeLine(c));
  EXPECT_NE(MoeConfigJson(c, 19).find("\"first_k_dense_replace\": 3"), std::string::npos);
  EXPECT_TRUE(CheckMoeExportable(c, "F").ok());
}

TEST(HfDeepseekV3, WhatDeepseekV3CannotComputeIsRefusedNamingIt) {
  EXPECT_TRUE(CheckMoeExportable(Deepseek(), "F").ok());
  struct Case {
    void (*change)(GPTConfig*);
    const char* reason;
  };
  const Case cases[] = {
      {[](GPTConfig* c) { c->qk_layernorm = false; }, "without --qk-layernorm (DeepseekV3Attention always normalizes"},
      {[](GPTConfig* c) { c->layernorm_epsilon = 1e-5; }, "--norm-epsilon 1e-05 (DeepseekV3Attention's q_a_layernorm"},
      {[](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }, "--normalization LayerNorm"},
      {[](GPTConfig* c) { c->position_embedding = PositionEmbedding::kLearnedAbsolute; },
       "--position-embedding-type learned_absolute"},
      {[](GPTConfig* c) { c->swiglu = false; }, "GELU MLPs without --swiglu"},
      {[](GPTConfig* c) { c->add_qkv_bias = true; }, "linear biases"},
      {[](GPTConfig* c) { c->moe_router_sigmoid = false; }, "--moe-router-score-function softmax"},
      {[](GPTConfig* c) { c->moe_shared_expert_intermediate_size = 0; }, "no --moe-shared-expert-intermediate-size"},
      {[](GPTConfig* c) { c->moe_shared_expert_intermediate_size = 9; },
       "--moe-shared-expert-intermediate-size 9 (DeepSeek-V3's shared experts are n_shared_experts x"},
      {[](GPTConfig* c) { c->moe_shared_expert_gate = true; }, "--moe-shared-expert-gate"},
      {[](GPTConfig* c) {
         c->moe_layer_pattern = {1, 0, 1};
       },
       "--moe-layer-freq with dense layer 1 after MoE layer 0"},
      {[](GPTConfig* c) { c->moe_router_topk = 3; }, "--moe-router-topk 3 with --moe-router-group-topk 1"},
      {[](GPTConfig* c) { c->moe_router_num_groups = 4, c->moe_router_group_topk = 1; }, "1 expert(s) per group"},
      {[](GPTConfig* c) { c->max_position_embeddings = 5000; },
       "--rope-type yarn with --rotary-scaling-factor 2.0 and --max-position-embeddings 5000"},
      {[](GPTConfig* c) { c->mla_yarn = false; },
       "--rope-type rope with --rotary-scaling-factor 2.0 and --mscale-all-dim 0.5"},
  };
  for (const Case& k : cases) {
    GPTConfig c = Deepseek();
    k.change(&c);
    absl::Status st = CheckMoeExportable(c, "ck/x.ptk");
    ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << k.reason;
    const std::string msg(st.message());
    EXPECT_NE(msg.find(k.reason), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("ck/x.ptk: this multi-latent attention model is not one Hugging Face's DeepseekV3ForCausalLM "
                        "computes: ",
                        0),
              0u)
        << msg;
  }
  GPTConfig all = Deepseek();  // every group chosen: plain top k, whatever topk / group_topk
  all.moe_router_group_topk = 2;
  all.moe_router_topk = 3;
  EXPECT_TRUE(CheckMoeExportable(all, "F").ok());
  GPTConfig ctx = Deepseek();  // YaRN at ptk's original context: rope_scaling without original_max_position_embeddings
  ctx.max_position_embeddings = 4096;
  EXPECT_TRUE(CheckMoeExportable(ctx, "F").ok());
  EXPECT_EQ(MoeConfigJson(ctx, 19).find("original_max_position_embeddings"), std::string::npos);
}

class HfDeepseekV3RoundTrip : public ptk::testing::HfConvertFixture {
 protected:
  // Deepseek() with GPT-2's vocabulary, saved at iteration 5 with each MoE layer's expert bias (distinct values).
  GPTConfig Saved(const std::string& dir, bool q_lora = true, bool yarn = true) {
    GPTConfig c = Deepseek();
    c.vocab_size = 50257;
    c.padded_vocab_size = 50304;
    if (!q_lora) c.q_lora_rank = 0;
    if (!yarn) c.mla_yarn = false, c.rotary_scaling_factor = 1, c.mscale = 1, c.mscale_all_dim = 0;
    auto layout = ParamLayout::Create(c);
    EXPECT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    params_.resize(static_cast<size_t>(layout_.num_params));
    layout_.InitWeights(5, params_);
    for (size_t i = 0; i < params_.size(); ++i) params_[i] += 1e-3f * static_cast<float>(i % 97);
    const std::vector<float> zeros(params_.size(), 0.0f);
    TrainState st;
    st.iteration = 5;
    st.settings = {{"--vocab-size", "50257"},
                   {"--layernorm-epsilon", "1e-06"},
                   {"--hidden-dropout", "0"},
                   {"--attention-dropout", "0"}};
    for (int l = 1; l < 3; ++l)
      st.buffers.emplace_back(ExpertBiasName(layout_, l), std::vector<float>{0.25f * l, -0.125f, 1e-3f, -0.5f * l});
    biases_ = st.buffers;
    EXPECT_TRUE(SaveCheckpoint(dir, layout_, params_, zeros, zeros, st, "[]").ok());
    return c;
  }
  ModelBuffers biases_;
};

TEST_F(HfDeepseekV3RoundTrip, PtkToHfToPtkGivesBackEveryWeightAndExpertBiasBitForBit) {
  for (int k = 0; k < 2; ++k) {
    const std::string tag = std::to_string(k);
    const GPTConfig c = Saved(dir_ / ("ck" + tag), /*q_lora=*/k == 0, /*yarn=*/k == 0);
    auto exp = ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag)));
    ASSERT_TRUE(exp.ok()) << exp.status();
    EXPECT_EQ(Tensor(dir_ / ("hf" + tag), "model.layers.2.mlp.gate.e_score_correction_bias"), biases_[1].second);
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    const std::string& flags = imp->train_flags;
    for (const std::string want :
         {"--multi-latent-attention --kv-lora-rank 6 --qk-head-dim 4 --qk-pos-emb-head-dim 4 --v-head-dim 3",
          "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 6 --moe-router-score-function sigmoid "
          "--moe-router-enable-expert-bias --moe-shared-expert-intermediate-size 12",
          "--moe-router-topk-scaling-factor 2.5", "--moe-router-num-groups 2 --moe-router-group-topk 1",
          "--moe-layer-freq \"[0,1,1]\"", "--qk-layernorm", "--norm-epsilon 1e-06", "--ffn-hidden-size 12 "})
      EXPECT_NE(flags.find(want), std::string::npos) << want << "\n" << flags;
    EXPECT_EQ(flags.find("--q-lora-rank 10") != std::string::npos, k == 0) << flags;
    EXPECT_EQ(
        flags.find("--rope-type yarn --q-lora-rank 10 --rotary-scaling-factor 2 --mscale 0.8 --mscale-all-dim 0.5") !=
            std::string::npos,
        k == 0)
        << flags;
    auto back = LoadPtkCheckpoint(dir_ / ("back" + tag));
    ASSERT_TRUE(back.ok()) << back.status();
    const GPTConfig& b = back->config;
    EXPECT_TRUE(b.mla());
    EXPECT_EQ(b.q_lora_rank, c.q_lora_rank);
    EXPECT_EQ(b.mla_yarn, c.mla_yarn);
    EXPECT_EQ(b.rotary_scaling_factor, c.rotary_scaling_factor);
    EXPECT_EQ(b.mscale, c.mscale);  // recovered from attention_factor, as written
    EXPECT_EQ(b.mscale_all_dim, c.mscale_all_dim);
    EXPECT_EQ(b.moe_shared_expert_intermediate_size, 12);
    EXPECT_EQ(b.moe_router_group_topk, 1);
    EXPECT_EQ(b.moe_router_topk_scaling_factor, 2.5);
    EXPECT_TRUE(b.moe_router_sigmoid);
    EXPECT_EQ(b.moe_layers(), 2);
    EXPECT_EQ(back->state.buffers, biases_);
    ASSERT_NO_FATAL_FAILURE(ExpectRoundTripBitForBit(back->params, c.hidden_size, /*untie=*/true, tag));
  }
}

TEST_F(HfDeepseekV3RoundTrip, ARefusedExportWritesNothingAndMegatronWritesMla) {
  GPTConfig c = Deepseek();
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  c.qk_layernorm = false;
  SaveModel(c, dir_ / "ck", 5, {{"--vocab-size", "50257"}, {"--layernorm-epsilon", "1e-06"}});
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("--multi-latent-attention without --qk-layernorm"), std::string::npos)
      << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "hf"));
  // Megatron's MLA has no fixed latent norms: written under megatron-core's names (megatron_mla_test has the rest).
  auto m = RunConvert(Opts("ptk", "megatron", dir_ / "ck", dir_ / "meg"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(std::filesystem::exists(dir_ / "meg/iter_0000005/mp_rank_00/model_optim_rng.pt"));
}

TEST_F(HfDeepseekV3RoundTrip, ImportRefusesWhatPtkCannotComputeNamingConfigJsonAndTheKey) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ptk::testing::ReadFile(hf + "/config.json");
  const std::vector<ConfigEdit> bad = {
      {"\"attention_bias\": false", "\"attention_bias\": true", "attention_bias true: ptk's multi-latent attention"},
      {"\"rope_interleave\": true", "\"rope_interleave\": false", "rope_interleave false: ptk's multi-latent"},
      {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 1", "num_key_value_heads 1 is not"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\": ptk's gated MLP"},
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-05", "rms_norm_eps 1e-05: DeepseekV3Attention's latent"},
      {"\"norm_topk_prob\": true", "\"norm_topk_prob\": false", "norm_topk_prob false with num_experts_per_tok 2"},
      {"\"topk_group\": 1", "\"topk_group\": 3", "n_group 2 and topk_group 3"},
      {"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 1", "topk_group 1 with num_experts_per_tok 1"},
      {"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "num_experts_per_tok 5 is more than"},
      {"\"n_group\": 2", "\"n_group\": 3", "n_group 3 and topk_group 1 with n_routed_experts 4"},
      {"\"n_shared_experts\": 2", "\"n_shared_experts\": 0", "n_shared_experts 0"},
      {"\"first_k_dense_replace\": 1", "\"first_k_dense_replace\": -1", "first_k_dense_replace -1"},
      {"\"qk_rope_head_dim\": 4", "\"qk_rope_head_dim\": 3", "qk_rope_head_dim 3: the rotary channels"},
      {"\"rope_type\": \"yarn\"", "\"rope_type\": \"linear\"", "rope_scaling \"linear\""},
      {"\"beta_fast\": 32.0", "\"beta_fast\": 16.0", "rope_scaling's beta_fast and beta_slow"},
      {"\"original_max_position_embeddings\": 4096", "\"original_max_position_embeddings\": 2048",
       "rope_scaling yarn with factor 2.0, original context 2048.0"},
      {"\"max_position_embeddings\": 8192", "\"max_position_embeddings\": 12288", "and max_position_embeddings 12288"},
      {"\"mscale\": 0.8", "\"mscale\": \"a\"", "rope_scaling's mscale is not a number"},
  };
  ExpectConfigEditsRefused(hf, config, bad);
  // An attention_factor at YaRN's factor 1, where ptk's concentration factor is 1 (plain RoPE's export, edited).
  Saved(dir_ / "ck-rope", /*q_lora=*/true, /*yarn=*/false);
  const std::string plain = dir_ / "hf-rope";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck-rope", plain)).ok());
  ptk::testing::WriteFile(plain + "/config.json",
                          Edited(ptk::testing::ReadFile(plain + "/config.json"), "\"rope_scaling\": null",
                                 "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 1.0, "
                                 "\"attention_factor\": 1.5}"));
  auto f1 = ImportFromHf(Opts("hf", "ptk", plain, dir_ / "out-f1"));
  ASSERT_FALSE(f1.ok());
  EXPECT_NE(f1.status().message().find("config.json: rope_scaling's attention_factor 1.5 with factor 1.0"),
            std::string::npos)
      << f1.status();
  // A missing expert bias is a missing tensor, named.
  ptk::testing::WriteFile(hf + "/config.json",
                          Edited(config, "\"first_k_dense_replace\": 1", "\"first_k_dense_replace\": 0"));
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-dense0"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.layers.0.mlp."), std::string::npos) << r.status();
}

}  // namespace
}  // namespace ptk::hf_detail
