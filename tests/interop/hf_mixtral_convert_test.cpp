// ptk-convert's MixtralForCausalLM mapping, without transformers (hf_mixtral_test.py runs the exported model in
// it): the router and each expert's w1/w3 (linear_fc1's [gate; up]) and w2 at their ptk offsets, Mixtral's
// state_dict order, config.json's keys, and every setting Mixtral cannot compute refused naming it; a MoE
// checkpoint's header read back whole by LoadPtkCheckpoint (a bad one refused naming the file). The import:
// ptk -> hf -> ptk gives back every weight bit for bit, a MixtralForCausalLM saved by transformers 4.44.2
// (tests/data/interop/mixtral_tiny, tests/support/gen_mixtral_hf_golden.py) imports and ptk's Forward gives its
// logits and loss, and what ptk cannot compute or a damaged directory is refused in one line naming the file
// and the key or tensor.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "interop/hf_mixtral.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/interop/hf_golden_logits.h"
#include "tests/test_util.h"
#include "trainer/backend.h"

namespace ptk::hf_detail {
namespace {

// Four SwiGLU experts of width 6 in each of 2 layers, top 2 after the softmax, the Llama line's dense parts.
GPTConfig Mixtral() { return ptk::testing::SmallMoeLlama(2); }

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
  const std::vector<ptk::testing::ExportRefusal> cases = {
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
  ptk::testing::ExpectExportRefusals(
      Mixtral(), CheckMixtralExportable,
      "dir/model_optim_rng.ptk: this mixture-of-experts model (--num-experts 4) is not one Hugging "
      "Face's MixtralForCausalLM computes: ",
      cases, /*one_line=*/false);
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

// The Mixtral shape with GPT-2's vocabulary (what the export's built-in tokenizer has), saved at iteration 5.
class HfMixtralRoundTrip : public ptk::testing::HfConvertFixture {
 protected:
  GPTConfig Saved(const std::string& dir, bool untie = true, int64_t topk = 2) {
    GPTConfig c = Mixtral();
    c.vocab_size = 50257;
    c.padded_vocab_size = 50304;
    c.untie_embeddings_and_output_weights = untie;
    c.moe_router_topk = topk;
    c.rotary_base = 500000;
    c.layernorm_epsilon = 1e-5;
    SaveModel(c, dir, 5,
              {{"--vocab-size", "50257"},
               {"--layernorm-epsilon", "1e-05"},
               {"--hidden-dropout", "0"},
               {"--attention-dropout", "0"},
               {"--moe-aux-loss-coeff", "0.01"}});
    return c;
  }
};

TEST_F(HfMixtralRoundTrip, PtkToHfToPtkGivesBackEveryWeightBitForBit) {
  for (bool untie : {true, false}) {
    const std::string tag = untie ? "u" : "t";
    const GPTConfig c = Saved(dir_ / ("ck" + tag), untie, untie ? 2 : 1);
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag))).ok());
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    EXPECT_NE(imp->train_flags.find(fmt::format("--num-experts 4 --moe-router-topk {} --moe-ffn-hidden-size 6 "
                                                "--moe-aux-loss-coeff 0.01",
                                                c.moe_router_topk)),
              std::string::npos)
        << imp->train_flags;
    EXPECT_NE(imp->train_flags.find("--ffn-hidden-size 6 "), std::string::npos) << imp->train_flags;
    EXPECT_NE(imp->train_flags.find("--disable-bias-linear"), std::string::npos) << imp->train_flags;
    auto back = LoadPtkCheckpoint(dir_ / ("back" + tag));
    ASSERT_TRUE(back.ok()) << back.status();
    const GPTConfig& b = back->config;
    EXPECT_EQ(b.num_experts, 4);
    EXPECT_EQ(b.moe_router_topk, c.moe_router_topk);
    EXPECT_EQ(b.moe_ffn(), 6);
    EXPECT_EQ(b.moe_aux_loss_coeff, 0.01);
    EXPECT_FALSE(b.moe_router_pre_softmax || b.moe_router_sigmoid);
    EXPECT_EQ(b.moe_layers(), 2);
    EXPECT_EQ(b.num_query_groups, 1);
    EXPECT_EQ(b.rotary_base, 500000);
    EXPECT_EQ(b.layernorm_epsilon, 1e-5);
    EXPECT_EQ(b.untie_embeddings_and_output_weights, untie);
    EXPECT_EQ(b.padded_vocab_size, 50304);
    ASSERT_NO_FATAL_FAILURE(ExpectRoundTripBitForBit(back->params, c.hidden_size, untie, tag));
  }
}

TEST_F(HfMixtralRoundTrip, ImportRefusesWhatPtkCannotComputeNamingTheFileAndKey) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ptk::testing::ReadFile(hf + "/config.json");
  const std::vector<ConfigEdit> bad = {
      {"\"sliding_window\": null", "\"sliding_window\": 8",
       "sliding_window 8: ptk's attention is causal over the whole sequence"},
      {"\"router_jitter_noise\": 0.0", "\"router_jitter_noise\": 0.01",
       "router_jitter_noise 0.01: ptk's router has no jitter"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\": ptk's experts are SwiGLU's"},
      {"\"use_cache\": true", "\"use_cache\": true, \"attention_bias\": true",
       "attention_bias true: ptk's mixture-of-experts layers have no biases"},
      {"\"use_cache\": true", "\"use_cache\": true, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}",
       "rope_scaling {\"rope_type\":\"linear\",\"factor\":2.0}: transformers 4.44's Mixtral has plain RoPE only"},
      {"\"use_cache\": true", "\"use_cache\": true, \"head_dim\": 8", "head_dim 8 is not hidden_size / "},
      {"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "num_experts_per_tok 5 is more than "},
      {"\"num_local_experts\": 4", "\"num_local_experts\": \"4\"", "num_local_experts"},
      {"\"router_aux_loss_coef\": 0.01", "\"router_aux_loss_coef\": -1", "router_aux_loss_coef"},
  };
  ExpectConfigEditsRefused(hf, config, bad);
  // A window no shorter than the positions masks nothing: the same model, with a note.
  ptk::testing::WriteFile(hf + "/config.json", Edited(config, "\"sliding_window\": null", "\"sliding_window\": 16"));
  auto w = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-window"));
  ASSERT_TRUE(w.ok()) << w.status();
  bool noted = false;
  for (const std::string& note : w->notes) noted |= note.find("sliding_window 16 is not below") == 0;
  EXPECT_TRUE(noted);
}

TEST_F(HfMixtralRoundTrip, ImportRefusesAMissingExpertAWrongShapeAndAMissingShard) {
  Saved(dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  HfTensors all;
  ASSERT_NO_FATAL_FAILURE(ReadTensors(hf + "/model.safetensors", &all));
  const std::string expert = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
  // One expert's w3 left out.
  ExpectImportRefused(hf, Without(all.entries, expert), "out-missing",
                      hf + "/model.safetensors: tensor " + expert + ": missing (config.json asks for shape [6, 8])");
  // The router with the wrong shape: 3 experts' rows of 4.
  std::vector<SafetensorsEntry> entries = all.entries;
  std::vector<float> gate(3 * 8, 0.5f);
  for (SafetensorsEntry& e : entries)
    if (e.name == "model.layers.0.block_sparse_moe.gate.weight") e = {e.name, {3, 8}, gate};
  ExpectImportRefused(hf, entries, "out-shape",
                      hf + "/model.safetensors: tensor model.layers.0.block_sparse_moe.gate.weight: shape [3, 8], "
                           "config.json asks for [4, 8]");
  // Sharded, one shard gone: refused naming the shard and a tensor the index puts there.
  const std::string hfs = dir_ / "hfs";
  ConvertOptions o = Opts("ptk", "hf", dir_ / "ck", hfs);
  o.max_shard_size = "1KB";
  ASSERT_TRUE(ExportToHf(o).ok());
  ASSERT_TRUE(std::filesystem::exists(hfs + "/model.safetensors.index.json"));
  std::string gone;
  for (const auto& e : std::filesystem::directory_iterator(hfs))
    if (e.path().filename().string().find("-of-") != std::string::npos &&
        (gone.empty() || e.path().filename().string() > gone))
      gone = e.path().filename().string();
  ASSERT_FALSE(gone.empty());
  std::filesystem::remove(hfs + "/" + gone);
  auto r = ImportFromHf(Opts("hf", "ptk", hfs, dir_ / "out-shard"));
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find(gone), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// tests/data/interop/mixtral_tiny: a MixtralForCausalLM transformers 4.44.2 made and saved (2 layers, hidden 16,
// 4 heads in 2 groups, 4 experts of 24, top 2, vocabulary 96), and its logits and loss on two sequences.
// Tolerance: 1e-4 on the logits (absolute; they are of order 1) and 1e-5 on the loss, as the other HF
// comparisons (hf_test_common.py's TOL): both compute in fp32, in other orders of summation (the largest
// difference seen is ~1e-6). Routing each token to one expert moves the logits by far more.
TEST(HfMixtralGolden, AMixtralSavedByTransformersImportsWithItsLogitsAndLoss) {
  ptk::testing::TempDir tmp;
  PtkCheckpoint ck;
  simdjson::dom::parser parser;
  simdjson::dom::element golden;
  ASSERT_NO_FATAL_FAILURE(
      ptk::testing::ImportHfGolden("mixtral_tiny", tmp,
                                   "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-aux-loss-coeff "
                                   "0.02",
                                   &ck, &parser, &golden));
  GPTConfig c = ck.config;
  EXPECT_EQ(c.num_query_groups, 2);
  EXPECT_EQ(c.rotary_base, 10000);
  EXPECT_EQ(c.padded_vocab_size, 96);
  // ptk's logits and loss for `config`; the largest logit difference.
  auto compare = [&](const GPTConfig& config, bool expect_equal) {
    return ptk::testing::WorstHfLogitDifference(golden, config, ck.params, 96, expect_equal);
  };
  const double worst = compare(c, true);
  EXPECT_LE(worst, 1e-4);
  std::printf("ptk's logits differ from transformers' by at most %.3g (tolerance 1e-4)\n", worst);
  // The test can tell: one expert per token instead of two moves the logits far past the tolerance.
  GPTConfig top1 = c;
  top1.moe_router_topk = 1;
  EXPECT_GT(compare(top1, false), 1e-2);
}

}  // namespace
}  // namespace ptk::hf_detail
