// ptk-convert's LlamaForCausalLM mapping, without transformers (hf_llama_test.py runs the exported
// model in it): q/k/v split out of linear_qkv's query groups, gate/up out of linear_fc1, config.json's
// keys; export -> import -> export byte-identical; what HF's Llama cannot compute refused by the
// export, and what ptk cannot compute refused by the import, each naming the reason.
#include <filesystem>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "interop/hf_gpt2.h"
#include "interop/megatron.h"
#include "interop/safetensors.h"
#include "tests/interop/hf_convert_fixture.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using ptk::testing::ReadFile;
using ptk::testing::TempDir;
using ptk::testing::WriteFile;

// Llama 3's shape in small: 4 query heads of 4 channels in 2 groups, SwiGLU, RMSNorm, RoPE.
GPTConfig Llama(bool bias, bool untie) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 24;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  c.layernorm_epsilon = 1e-5;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.rotary_base = 500000;
  c.use_rope_scaling = true;
  c.swiglu = true;
  c.add_bias_linear = bias;
  c.untie_embeddings_and_output_weights = untie;
  return c;
}

class HfLlama : public ptk::testing::HfConvertFixture {
 protected:
  // A checkpoint of `c` at iteration 4.
  void Save(const GPTConfig& c, const std::string& dir) {
    SaveModel(c, dir, 4,
              {{"--layernorm-epsilon", "1e-05"},
               {"--hidden-dropout", "0"},
               {"--attention-dropout", "0"},
               {"--vocab-size", "50257"}});
  }
};

TEST_F(HfLlama, ExportSplitsMegatronsFusedLayersAsLlamaNamesThem) {
  Save(Llama(/*bias=*/true, /*untie=*/true), dir_ / "ck");
  auto s = ExportToHf(Opts("ptk", "hf", dir_ / "ck", dir_ / "hf"));
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string hf = dir_ / "hf";
  // 32 positions with Llama 3.1's scaling: transformers will warn, and the export says so.
  bool warned = false;
  for (const std::string& n : s->notes) warned |= n.find("transformers warns about rope_scaling") != std::string::npos;
  EXPECT_TRUE(warned);
  const int64_t C = 16, hd = 4, F = 24;
  const auto& lp = layout_.layers[1];
  std::vector<int64_t> shape;
  // linear_qkv's rows: group g = [q head 2g, q head 2g+1, k head g, v head g], each hd rows of C.
  const std::vector<float> q = Tensor(hf, "model.layers.1.self_attn.q_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{4 * hd, C}));
  const std::vector<float> k = Tensor(hf, "model.layers.1.self_attn.k_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{2 * hd, C}));
  const std::vector<float> v = Tensor(hf, "model.layers.1.self_attn.v_proj.weight");
  const std::vector<float> vb = Tensor(hf, "model.layers.1.self_attn.v_proj.bias");
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t d = 0; d < hd; ++d) {
      for (int64_t i = 0; i < C; ++i) {
        ASSERT_EQ(q[((2 * g + 1) * hd + d) * C + i], P(lp.qkv_w + ((4 * g + 1) * hd + d) * C + i));
        ASSERT_EQ(k[(g * hd + d) * C + i], P(lp.qkv_w + ((4 * g + 2) * hd + d) * C + i));
        ASSERT_EQ(v[(g * hd + d) * C + i], P(lp.qkv_w + ((4 * g + 3) * hd + d) * C + i));
      }
      ASSERT_EQ(vb[g * hd + d], P(lp.qkv_b + (4 * g + 3) * hd + d));
    }
  // linear_fc1's rows: [gate; up]. nn.Linear's (out, in) is Megatron's: nothing transposed.
  const std::vector<float> up = Tensor(hf, "model.layers.1.mlp.up_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{F, C}));
  EXPECT_EQ(up[5 * C + 3], P(lp.fc1_w + (F + 5) * C + 3));
  EXPECT_EQ(Tensor(hf, "model.layers.1.mlp.gate_proj.weight")[5 * C + 3], P(lp.fc1_w + 5 * C + 3));
  EXPECT_EQ(Tensor(hf, "model.layers.1.mlp.up_proj.bias")[7], P(lp.fc1_b + F + 7));
  EXPECT_EQ(Tensor(hf, "model.layers.1.mlp.down_proj.weight")[3 * F + 17], P(lp.fc2_w + 3 * F + 17));
  EXPECT_EQ(Tensor(hf, "model.layers.1.self_attn.o_proj.weight")[3 * C + 2], P(lp.proj_w + 3 * C + 2));
  EXPECT_EQ(Tensor(hf, "model.layers.1.post_attention_layernorm.weight")[2], P(lp.ln2_w + 2));
  EXPECT_EQ(Tensor(hf, "model.norm.weight")[2], P(layout_.lnf_w + 2));
  // The vocabulary: the real rows only, the output layer its own tensor.
  EXPECT_EQ(Tensor(hf, "lm_head.weight", &shape)[50256 * C + 1], P(layout_.out_w + 50256 * C + 1));
  EXPECT_EQ(shape, (std::vector<int64_t>{50257, C}));
  auto f = SafetensorsFile::Open(hf + "/model.safetensors");
  EXPECT_EQ((*f)->tensors().size(), 1u + 2u * 16u + 2u);  // per layer 7 weights, 7 biases, 2 norms
  const std::string config = ReadFile(hf + "/config.json");
  for (const char* want :
       {"\"LlamaForCausalLM\"", "\"model_type\": \"llama\"", "\"num_key_value_heads\": 2", "\"intermediate_size\": 24",
        "\"rms_norm_eps\": 1e-05", "\"rope_theta\": 500000.0", "\"rope_type\": \"llama3\"", "\"factor\": 8.0",
        "\"original_max_position_embeddings\": 8192", "\"tie_word_embeddings\": false", "\"attention_bias\": true",
        "\"mlp_bias\": true", "\"vocab_size\": 50257", "\"torch_dtype\": \"float32\"", "\"head_dim\": 4"})
    EXPECT_NE(config.find(want), std::string::npos) << want << "\n" << config;
}

TEST_F(HfLlama, ExportImportExportIsByteIdentical) {
  for (bool bias : {false, true}) {
    const std::string tag = bias ? "b" : "n";
    GPTConfig c = Llama(bias, /*untie=*/!bias);
    c.use_rope_scaling = bias;
    Save(c, dir_ / ("ck" + tag));
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag))).ok());
    auto imp = ImportFromHf(Opts("hf", "ptk", dir_ / ("hf" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    EXPECT_NE(imp->train_flags.find("--normalization RMSNorm"), std::string::npos) << imp->train_flags;
    EXPECT_NE(imp->train_flags.find("--group-query-attention --num-query-groups 2"), std::string::npos);
    EXPECT_EQ(imp->train_flags.find("--disable-bias-linear") == std::string::npos, bias) << imp->train_flags;
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("back" + tag), dir_ / ("hf2" + tag))).ok());
    for (const char* f : {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"})
      EXPECT_EQ(ReadFile(dir_ / ("hf" + tag + "/" + f)), ReadFile(dir_ / ("hf2" + tag + "/" + f))) << tag << " " << f;
    // The imported checkpoint is the model: every weight but the padded vocabulary rows.
    std::vector<float> params, m, v;
    TrainState st;
    ASSERT_TRUE(LoadCheckpoint(dir_ / ("back" + tag), 0, layout_, &params, &m, &v, &st).ok());
    for (int64_t i = 0; i < layout_.num_params; ++i) {
      const bool padded = (i >= layout_.wte + 50257 * 16 && i < layout_.wte + 50304 * 16) ||
                          (!bias && i >= layout_.out_w + 50257 * 16 && i < layout_.out_w + 50304 * 16);
      if (!padded) {
        ASSERT_EQ(params[i], P(i)) << i;
      }
    }
  }
}

TEST_F(HfLlama, ExportRefusesWhatLlamaForCausalLMCannotComputeNamingIt) {
  struct Case {
    const char* why;
    void (*edit)(GPTConfig*);
  };
  const Case cases[] = {
      {"--normalization LayerNorm", [](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }},
      {"--position-embedding-type learned_absolute",
       [](GPTConfig* c) { c->position_embedding = PositionEmbedding::kLearnedAbsolute; }},
      {"--position-embedding-type none", [](GPTConfig* c) { c->position_embedding = PositionEmbedding::kNone; }},
      {"--rotary-percent 0.5", [](GPTConfig* c) { c->rotary_percent = 0.5; }},
      {"no --swiglu", [](GPTConfig* c) { c->swiglu = false; }},
      {"--add-qkv-bias without the other linear biases", [](GPTConfig* c) { c->add_qkv_bias = true; }},
      {"--kv-channels 8 with 4 heads of hidden size 16", [](GPTConfig* c) { c->kv_channels = 8; }},
  };
  int n = 0;
  for (const Case& k : cases) {
    GPTConfig c = Llama(/*bias=*/false, /*untie=*/true);
    k.edit(&c);
    const std::string ck = dir_ / ("ck" + std::to_string(n)), hf = dir_ / ("hf" + std::to_string(n));
    ++n;
    Save(c, ck);
    auto r = ExportToHf(Opts("ptk", "hf", ck, hf));
    ASSERT_FALSE(r.ok()) << k.why;
    EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
    EXPECT_NE(r.status().message().find(k.why), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("LlamaForCausalLM"), std::string::npos) << r.status();
    EXPECT_FALSE(std::filesystem::exists(hf)) << k.why;
  }
}

// Megatron's format takes the Llama line, split over tensor and pipeline ranks, and gives it back.
// With --qk-layernorm (Qwen3's shape) too: args.qk_layernorm and each stage's
// self_attention.q_layernorm / k_layernorm, whole on every tensor rank.
TEST_F(HfLlama, MegatronShardsOfTheLlamaLineComeBackWhole) {
  for (bool qk : {false, true}) {
    const std::string tag = qk ? "q" : "l";
    GPTConfig c = Llama(false, true);
    if (qk) c.qk_layernorm = true, c.kv_channels = 8;
    Save(c, dir_ / ("ck" + tag));
    ConvertOptions to_meg = Opts("ptk", "megatron", dir_ / ("ck" + tag), dir_ / ("meg" + tag));
    to_meg.target_tensor_parallel_size = to_meg.target_pipeline_parallel_size = 2;
    auto meg = ExportToMegatron(to_meg);
    ASSERT_TRUE(meg.ok()) << meg.status();
    auto back = ImportFromMegatron(Opts("megatron", "ptk", dir_ / ("meg" + tag), dir_ / ("back" + tag)));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->config.qk_layernorm, qk);
    EXPECT_EQ(back->train_flags.find("--qk-layernorm") != std::string::npos, qk) << back->train_flags;
    std::vector<float> p, m, v;
    TrainState st;
    ASSERT_TRUE(LoadCheckpoint(dir_ / ("back" + tag), 4, layout_, &p, &m, &v, &st).ok());
    EXPECT_EQ(p, params_);
  }
}

// transformers 5 writes RoPE's base and scaling as one rope_parameters object (no rope_theta, no
// rope_scaling): read as transformers 4's keys are, never the default base of 10000 in silence.
TEST_F(HfLlama, ImportReadsTransformers5sRopeParameters) {
  Save(Llama(/*bias=*/false, /*untie=*/true), dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ReadFile(hf + "/config.json");
  ASSERT_NE(config.find("\"rope_theta\": 500000.0,"), std::string::npos) << config;
  const std::string no_theta = std::regex_replace(config, std::regex("\"rope_theta\": 500000\\.0,"), "");
  auto with_params = [&](const std::string& params_head) {
    return std::regex_replace(no_theta, std::regex("\"rope_scaling\": \\{"), "\"rope_parameters\": {" + params_head);
  };
  struct Case {
    std::string config;
    double base;
    bool scaling;
  };
  const Case good[] = {
      {with_params("\"rope_theta\": 500000.0, "), 500000, true},
      // Both forms, agreeing.
      {std::regex_replace(config, std::regex("\"rope_theta\": 500000\\.0,"),
                          "\"rope_theta\": 500000.0, \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": "
                          "500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                          "\"original_max_position_embeddings\": 8192},"),
       500000, true},
  };
  int n = 0;
  for (const Case& k : good) {
    WriteFile(hf + "/config.json", k.config);
    auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("good" + std::to_string(n++))));
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << k.config;
    EXPECT_EQ(r->config.rotary_base, k.base) << k.config;
    EXPECT_EQ(r->config.use_rope_scaling, k.scaling) << k.config;
  }
  // No scaling: rope_type "default" beside the base.
  std::string plain =
      std::regex_replace(no_theta, std::regex("\"rope_scaling\": \\{[^}]*\\}"),
                         "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0}");
  WriteFile(hf + "/config.json", plain);
  auto d = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "default"));
  ASSERT_TRUE(d.ok()) << d.status() << "\n" << plain;
  EXPECT_EQ(d->config.rotary_base, 1000000);
  EXPECT_FALSE(d->config.use_rope_scaling);
  struct Bad {
    std::string config, why;
  };
  const Bad bad[] = {
      {std::regex_replace(plain, std::regex("\"default\""), "\"linear\""), "rope_parameters {\"rope_type\":\"linear\""},
      {std::regex_replace(plain, std::regex("\"rope_theta\": 1000000\\.0"), "\"rope_theta\": -1"),
       "not an object with a positive rope_theta"},
      {std::regex_replace(plain, std::regex("\"rope_parameters\""), "\"rope_theta\": 10000.0, \"rope_parameters\""),
       "rope_theta 10000.0 and rope_parameters' rope_theta 1000000.0 differ"},
      {std::regex_replace(config, std::regex("\"rope_theta\": 500000\\.0,"),
                          "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0},"),
       "differ"},
  };
  for (const Bad& k : bad) {
    WriteFile(hf + "/config.json", k.config);
    auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("bad" + std::to_string(n++))));
    ASSERT_FALSE(r.ok()) << k.config;
    EXPECT_NE(r.status().message().find(k.why), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status();
  }
}

// Megatron's --rope-scaling-factor is rope_scaling's llama3 factor, --rotary-seq-len-interpolation-factor
// its linear one (transformers 4's rope_scaling and 5's rope_parameters alike): exported and imported
// back as they were; both at once are no rope_scaling transformers has, and refused.
TEST_F(HfLlama, RopeScalingFactorAndLinearInterpolationRoundTrip) {
  struct Case {
    double factor, interpolation;
    const char* config;
  };
  const Case cases[] = {{32, 0, "\"factor\": 32.0,"}, {0, 4, "\"rope_type\": \"linear\""}, {0, 2.5, "\"factor\": 2.5"}};
  int n = 0;
  for (const Case& k : cases) {
    GPTConfig c = Llama(/*bias=*/false, /*untie=*/true);
    c.use_rope_scaling = k.factor > 0;
    c.rope_scaling_factor = k.factor > 0 ? k.factor : 8.0;
    c.rotary_seq_len_interpolation_factor = k.interpolation;
    const std::string at = dir_ / std::to_string(n++);
    Save(c, at + "/ck");
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", at + "/ck", at + "/hf")).ok());
    const std::string config = ReadFile(at + "/hf/config.json");
    EXPECT_NE(config.find(k.config), std::string::npos) << config;
    auto r = ImportFromHf(Opts("hf", "ptk", at + "/hf", at + "/back"));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->config.use_rope_scaling, c.use_rope_scaling);
    EXPECT_EQ(r->config.rope_scaling_factor, c.rope_scaling_factor);
    EXPECT_EQ(r->config.rotary_seq_len_interpolation_factor, k.interpolation);
    // transformers 5's form of the same.
    const std::string v5 =
        std::regex_replace(std::regex_replace(config, std::regex("\"rope_theta\": 500000\\.0,"), ""),
                           std::regex("\"rope_scaling\": \\{"), "\"rope_parameters\": {\"rope_theta\": 500000.0, ");
    WriteFile(at + "/hf/config.json", v5);
    auto r5 = ImportFromHf(Opts("hf", "ptk", at + "/hf", at + "/back5"));
    ASSERT_TRUE(r5.ok()) << r5.status() << "\n" << v5;
    EXPECT_EQ(r5->config.rope_scaling_factor, c.rope_scaling_factor);
    EXPECT_EQ(r5->config.rotary_seq_len_interpolation_factor, k.interpolation);
  }
  GPTConfig both = Llama(/*bias=*/false, /*untie=*/true);
  both.rotary_seq_len_interpolation_factor = 2;
  Save(both, dir_ / "both");
  auto r = ExportToHf(Opts("ptk", "hf", dir_ / "both", dir_ / "both-hf"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--use-rope-scaling with --rotary-seq-len-interpolation-factor"),
            std::string::npos)
      << r.status();
}

// --rotary-interleaved rotates channels (2i, 2i + 1), transformers' Llama (i, i + hd/2): the export
// permutes each query and key head's rows (HF's row i is ptk's 2i, row hd/2 + i ptk's 2i + 1; their
// biases alike; the value heads as they are), so that HF's model computes ptk's (hf_llama_test.py runs
// it); imported back it is the rotate-half model with the permuted rows.
TEST_F(HfLlama, InterleavedRotaryExportsWithPermutedQueryAndKeyRows) {
  GPTConfig c = Llama(/*bias=*/true, /*untie=*/true);
  c.rotary_interleaved = true;
  Save(c, dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const int64_t C = 16, hd = 4;
  const auto& lp = layout_.layers[1];
  const std::vector<float> q = Tensor(hf, "model.layers.1.self_attn.q_proj.weight"),
                           k = Tensor(hf, "model.layers.1.self_attn.k_proj.weight"),
                           v = Tensor(hf, "model.layers.1.self_attn.v_proj.weight"),
                           kb = Tensor(hf, "model.layers.1.self_attn.k_proj.bias");
  const int64_t from[] = {0, 2, 1, 3};  // HF's channel j is ptk's from[j]
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t j = 0; j < hd; ++j) {
      for (int64_t i = 0; i < C; ++i) {
        ASSERT_EQ(q[((2 * g + 1) * hd + j) * C + i], P(lp.qkv_w + ((4 * g + 1) * hd + from[j]) * C + i));
        ASSERT_EQ(k[(g * hd + j) * C + i], P(lp.qkv_w + ((4 * g + 2) * hd + from[j]) * C + i));
        ASSERT_EQ(v[(g * hd + j) * C + i], P(lp.qkv_w + ((4 * g + 3) * hd + j) * C + i));
      }
      ASSERT_EQ(kb[g * hd + j], P(lp.qkv_b + (4 * g + 2) * hd + from[j]));
    }
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "back"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->config.rotary_interleaved);
  // Qwen3's query and key norms weigh each head's channels: permuted as the rows they scale.
  GPTConfig qwen3 = Llama(/*bias=*/false, /*untie=*/true);
  qwen3.rotary_interleaved = true;
  qwen3.qk_layernorm = true;
  Save(qwen3, dir_ / "ck3");
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck3", dir_ / "hf3")).ok());
  const std::vector<float> qn = Tensor(dir_ / "hf3", "model.layers.1.self_attn.q_norm.weight"),
                           kn = Tensor(dir_ / "hf3", "model.layers.1.self_attn.k_norm.weight");
  for (int64_t j = 0; j < hd; ++j) {
    EXPECT_EQ(qn[j], P(layout_.layers[1].q_norm_w + from[j])) << j;
    EXPECT_EQ(kn[j], P(layout_.layers[1].k_norm_w + from[j])) << j;
  }
}

TEST_F(HfLlama, ImportRefusesALlamaPtkWouldComputeOtherwiseNamingTheKey) {
  Save(Llama(/*bias=*/false, /*untie=*/true), dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ReadFile(hf + "/config.json");
  struct Case {
    std::string from, to, why;
  };
  const Case bad[] = {
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act \"gelu\": ptk's gated MLP is SwiGLU's"},
      {"\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"", "rope_scaling {"},
      {"\"original_max_position_embeddings\": 8192", "\"original_max_position_embeddings\": 4096",
       "ptk computes Llama 3.x's (rope_type \"llama3\", a positive factor, low_freq_factor 1.0"},
      {"\"factor\": 8.0", "\"factor\": -8.0", "rope_scaling {"},
      {"\"attention_bias\": false", "\"attention_bias\": true",
       "attention_bias true with mlp_bias false: ptk's linear layers are biased all together"},
      {"\"head_dim\": 4", "\"head_dim\": 8", "head_dim 8 is not hidden_size / num_attention_heads (4)"},
      {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3",
       "num_key_value_heads 3 does not divide num_attention_heads 4"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"silu\", \"partial_rotary_factor\": 0.5",
       "partial_rotary_factor 0.5"},
      {"\"model_type\": \"llama\"", "\"model_type\": \"mistral\"",
       "model_type \"mistral\": ptk reads GPT-2 models (model_type \"gpt2\"), Llama models"},
  };
  int n = 0;
  for (const Case& k : bad) {
    ASSERT_NE(config.find(k.from), std::string::npos) << k.from;
    WriteFile(hf + "/config.json",
              std::regex_replace(config, std::regex(std::regex_replace(k.from, std::regex(R"([.\[\]{}()])"), R"(\$&)")),
                                 k.to, std::regex_constants::format_first_only));
    auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("out" + std::to_string(n++))));
    ASSERT_FALSE(r.ok()) << k.to;
    EXPECT_NE(r.status().message().find(k.why), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status();
  }
  // pretraining_tp only splits transformers' products: the same model, with a note.
  WriteFile(hf + "/config.json",
            std::regex_replace(config, std::regex("\"pretraining_tp\": 1"), "\"pretraining_tp\": 2"));
  auto tp = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-tp"));
  ASSERT_TRUE(tp.ok()) << tp.status();
  bool noted = false;
  for (const std::string& n : tp->notes) noted |= n.find("pretraining_tp 2: transformers splits its products") == 0;
  EXPECT_TRUE(noted);
  // Weights a Llama config does not name are refused naming the tensor.
  WriteFile(hf + "/config.json", config);
  auto f = SafetensorsFile::Open(hf + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<float>> kept;  // the entries' data (an entry only points at it)
  kept.reserve((*f)->tensors().size());
  for (const SafetensorsTensor& t : (*f)->tensors()) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") continue;
    kept.push_back(*(*f)->ReadFloat(t));
    entries.push_back({t.name, t.shape, kept.back()});
  }
  f->reset();
  ASSERT_TRUE(WriteSafetensors(hf + "/model.safetensors", entries, {{"format", "pt"}}).ok());
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-missing"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor model.layers.1.mlp.up_proj.weight: missing (config.json asks for "
                                      "shape [24, 16])"),
            std::string::npos)
      << r.status();
}

// --qk-layernorm in a Qwen3 shape (no biases, head_dim 8 wider than hidden / heads = 4): exported as
// Qwen3ForCausalLM (config.json's model_type "qwen3", q_norm / k_norm beside the projections), the
// export imported and exported again byte for byte with the same weights; what Qwen3ForCausalLM
// cannot hold refused by the export, what ptk cannot compute by the import, each in one line.
GPTConfig Qwen3(bool untie) {
  GPTConfig c = Llama(/*bias=*/false, untie);
  c.qk_layernorm = true;
  c.kv_channels = 8;
  c.use_rope_scaling = false;
  c.rotary_base = 1000000;
  return c;
}

TEST_F(HfLlama, Qwen3ExportImportExportIsByteIdentical) {
  for (bool untie : {false, true}) {
    const std::string tag = untie ? "u" : "t";
    Save(Qwen3(untie), dir_ / ("ck" + tag));
    auto ex = ExportToHf(Opts("ptk", "hf", dir_ / ("ck" + tag), dir_ / ("hf" + tag)));
    ASSERT_TRUE(ex.ok()) << ex.status();
    const std::string hf = dir_ / ("hf" + tag), config = ReadFile(hf + "/config.json");
    for (const char* want :
         {"\"Qwen3ForCausalLM\"", "\"model_type\": \"qwen3\"", "\"head_dim\": 8", "\"attention_bias\": false",
          "\"use_sliding_window\": false", "\"rope_theta\": 1000000.0", "\"num_key_value_heads\": 2"})
      EXPECT_NE(config.find(want), std::string::npos) << want << "\n" << config;
    EXPECT_EQ(config.find("mlp_bias"), std::string::npos) << config;
    std::vector<int64_t> shape;
    const auto& lp = layout_.layers[1];
    const std::vector<float> qn = Tensor(hf, "model.layers.1.self_attn.q_norm.weight", &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{8}));
    const std::vector<float> kn = Tensor(hf, "model.layers.1.self_attn.k_norm.weight");
    for (int64_t d = 0; d < 8; ++d) {
      EXPECT_EQ(qn[d], P(lp.q_norm_w + d));
      EXPECT_EQ(kn[d], P(lp.k_norm_w + d));
    }
    EXPECT_EQ(Tensor(hf, "model.layers.1.self_attn.q_proj.weight", &shape).size(), 4u * 8 * 16);
    auto imp = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("back" + tag)));
    ASSERT_TRUE(imp.ok()) << imp.status();
    EXPECT_NE(imp->train_flags.find("--kv-channels 8 --qk-layernorm"), std::string::npos) << imp->train_flags;
    ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / ("back" + tag), dir_ / ("hf2" + tag))).ok());
    for (const char* f : {"model.safetensors", "config.json"})
      EXPECT_EQ(ReadFile(dir_ / ("hf" + tag + "/" + f)), ReadFile(dir_ / ("hf2" + tag + "/" + f))) << tag << " " << f;
    std::vector<float> params, m, v;
    TrainState st;
    ASSERT_TRUE(LoadCheckpoint(dir_ / ("back" + tag), 0, layout_, &params, &m, &v, &st).ok());
    for (int64_t i = 0; i < layout_.num_params; ++i) {
      const bool padded = (i >= layout_.wte + 50257 * 16 && i < layout_.wte + 50304 * 16) ||
                          (untie && i >= layout_.out_w + 50257 * 16 && i < layout_.out_w + 50304 * 16);
      if (!padded) {
        ASSERT_EQ(params[i], P(i)) << i;
      }
    }
  }
}

TEST_F(HfLlama, Qwen3ExportAndImportRefuseWhatTheOtherCannotCompute) {
  struct Case {
    const char* why;
    void (*edit)(GPTConfig*);
  };
  const Case cases[] = {
      {"--normalization LayerNorm", [](GPTConfig* c) { c->normalization = Normalization::kLayerNorm; }},
      {"--qk-layernorm with biased linear layers (Qwen3ForCausalLM's MLP has no biases)",
       [](GPTConfig* c) { c->add_bias_linear = true; }},
      {"--qk-layernorm with --add-qkv-bias", [](GPTConfig* c) { c->add_qkv_bias = true; }},
  };
  int n = 0;
  for (const Case& k : cases) {
    GPTConfig c = Qwen3(/*untie=*/true);
    k.edit(&c);
    const std::string ck = dir_ / ("ck" + std::to_string(n)), hf = dir_ / ("hf" + std::to_string(n));
    ++n;
    Save(c, ck);
    auto r = ExportToHf(Opts("ptk", "hf", ck, hf));
    ASSERT_FALSE(r.ok()) << k.why;
    EXPECT_NE(r.status().message().find(k.why), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("Qwen3ForCausalLM (--qk-layernorm)"), std::string::npos) << r.status();
    EXPECT_FALSE(std::filesystem::exists(hf)) << k.why;
  }
  Save(Qwen3(/*untie=*/true), dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ReadFile(hf + "/config.json");
  for (const auto& [from, to, why] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"attention_bias\": false", "\"attention_bias\": true", "attention_bias true: Qwen3's q, k, v and o"},
           {"\"use_sliding_window\": false", "\"use_sliding_window\": true", "use_sliding_window true"}}) {
    ASSERT_NE(config.find(from), std::string::npos) << from;
    WriteFile(hf + "/config.json", std::regex_replace(config, std::regex(from), to));
    auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("out" + std::to_string(n++))));
    ASSERT_FALSE(r.ok()) << to;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status();
  }
  // A Qwen3 checkpoint without its norms' weights is refused naming the tensor.
  WriteFile(hf + "/config.json", config);
  auto f = SafetensorsFile::Open(hf + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<float>> kept;
  kept.reserve((*f)->tensors().size());
  for (const SafetensorsTensor& t : (*f)->tensors()) {
    if (t.name == "model.layers.0.self_attn.k_norm.weight") continue;
    kept.push_back(*(*f)->ReadFloat(t));
    entries.push_back({t.name, t.shape, kept.back()});
  }
  f->reset();
  ASSERT_TRUE(WriteSafetensors(hf + "/model.safetensors", entries, {{"format", "pt"}}).ok());
  auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / "out-missing"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor model.layers.0.self_attn.k_norm.weight: missing"), std::string::npos)
      << r.status();
}

// rope_scaling {"rope_type": "default"} (or the older "type") is transformers' plain RoPE, what ptk computes
// without --use-rope-scaling: read as none, for Llama and Qwen3 alike (it was refused as a scaling ptk lacks);
// beside a rope_parameters that scales, the two differ.
TEST_F(HfLlama, ImportReadsRopeScalingOfTypeDefaultAsPlainRope) {
  Save(Llama(/*bias=*/false, /*untie=*/true), dir_ / "ckl");
  Save(Qwen3(/*untie=*/true), dir_ / "ckq");
  const std::string hfl = dir_ / "hfl", hfq = dir_ / "hfq";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ckl", hfl)).ok());
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ckq", hfq)).ok());
  const std::string llama = ReadFile(hfl + "/config.json"), qwen3 = ReadFile(hfq + "/config.json");
  const std::regex scaling("\"rope_scaling\": (\\{[^}]*\\}|null)");
  ASSERT_TRUE(std::regex_search(llama, scaling)) << llama;
  ASSERT_TRUE(std::regex_search(qwen3, scaling)) << qwen3;
  int n = 0;
  for (const char* plain : {"{\"rope_type\": \"default\"}", "{\"type\": \"default\", \"factor\": 2.0}"}) {
    for (const auto& [hf, config, base] : {std::tuple{hfl, llama, 500000.0}, std::tuple{hfq, qwen3, 1000000.0}}) {
      const std::string edited = std::regex_replace(config, scaling, std::string("\"rope_scaling\": ") + plain);
      WriteFile(hf + "/config.json", edited);
      auto r = ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("out" + std::to_string(n++))));
      ASSERT_TRUE(r.ok()) << r.status() << "\n" << edited;
      EXPECT_FALSE(r->config.use_rope_scaling) << edited;
      EXPECT_EQ(r->config.rotary_base, base) << edited;
    }
  }
  const std::string both = std::regex_replace(
      llama, scaling,
      "\"rope_scaling\": {\"rope_type\": \"default\"}, \"rope_parameters\": {\"rope_type\": \"llama3\", "
      "\"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
      "\"original_max_position_embeddings\": 8192}");
  WriteFile(hfl + "/config.json", both);
  auto r = ImportFromHf(Opts("hf", "ptk", hfl, dir_ / "both"));
  ASSERT_FALSE(r.ok()) << both;
  EXPECT_NE(r.status().message().find("rope_scaling {\"rope_type\":\"default\"} and rope_parameters"),
            std::string::npos)
      << r.status();
}

// Qwen3Config's reading of what a config.json leaves out or sets to null, and of its attention kinds:
// num_key_value_heads absent is 32 (Qwen3Config's default; ptk took one per query head, which transformers
// does for null only: both against a model of 2 groups of 4 heads, refused by what they read); layer_types (newer
// transformers) other than "full_attention" refused; a sliding_window the positions reach past, with use_sliding_window
// false, noted (transformers 4.51 masks there).
TEST_F(HfLlama, Qwen3ImportReadsAbsentAndNullKeysAsQwen3ConfigDoes) {
  Save(Qwen3(/*untie=*/true), dir_ / "ck");
  const std::string hf = dir_ / "hf";
  ASSERT_TRUE(ExportToHf(Opts("ptk", "hf", dir_ / "ck", hf)).ok());
  const std::string config = ReadFile(hf + "/config.json");
  int n = 0;
  auto import = [&](const std::string& from, const std::string& to) {
    EXPECT_TRUE(std::regex_search(config, std::regex(from))) << from;
    WriteFile(hf + "/config.json", std::regex_replace(config, std::regex(from), to));
    return ImportFromHf(Opts("hf", "ptk", hf, dir_ / ("out" + std::to_string(n++))));
  };
  auto absent = import("\"num_key_value_heads\": 2,", "");
  ASSERT_FALSE(absent.ok());
  EXPECT_NE(absent.status().message().find("num_key_value_heads 32 does not divide num_attention_heads 4"),
            std::string::npos)
      << absent.status();
  auto null = import("\"num_key_value_heads\": 2,", "\"num_key_value_heads\": null,");  // 4, as heads
  ASSERT_FALSE(null.ok());
  EXPECT_NE(null.status().message().find("k_proj.weight: shape [16, 16], config.json asks for [32, 16]"),
            std::string::npos)
      << null.status();

  auto full = import("\"hidden_act\"", "\"layer_types\": [\"full_attention\", \"full_attention\"], \"hidden_act\"");
  ASSERT_TRUE(full.ok()) << full.status();
  auto sliding =
      import("\"hidden_act\"", "\"layer_types\": [\"full_attention\", \"sliding_attention\"], \"hidden_act\"");
  ASSERT_FALSE(sliding.ok());
  EXPECT_NE(sliding.status().message().find("layer_types[1] \"sliding_attention\": ptk's attention is causal"),
            std::string::npos)
      << sliding.status();

  auto noted = [](const absl::StatusOr<ConvertSummary>& s) {
    bool found = false;
    for (const std::string& n : s->notes) found |= n.find("sliding_window 16 with use_sliding_window false") == 0;
    return found;
  };
  auto window = import("\"sliding_window\": null", "\"sliding_window\": 16");  // 32 positions reach past 16
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_TRUE(noted(window));
  auto none = import("\"sliding_window\": null", "\"sliding_window\": null");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(noted(none));
}

}  // namespace
}  // namespace ptk
