// ptk-train's multi-token prediction depths in Megatron's `torch` format (--saver megatron, --loader megatron):
// megatron-core 0.16.1's MultiTokenPredictionBlock names after the decoder (mtp.layers.K.enorm, hnorm, eh_proj,
// transformer_layer.* named as a decoder layer under either spec, final_layernorm; then output_layer), the args
// (mtp_num_layers, mtp_loss_scaling_factor); ptk -> megatron -> ptk bit for bit (weights and AdamW moments, both specs,
// pipeline sizes 1 and 2, the Llama line, MoE and MLA too), the MTP settings and flags of the import; the names, shapes
// and order written are megatron-core's own (tests/data/interop/mtp_megatron_names.txt, written by
// tests/support/check_mtp_export_with_megatron_core.py, which also loads the export in megatron-core and compares its
// lm and MTP losses with ptk's), at tensor-parallel size 2 too (mtp_megatron_names_tp2.txt, each rank's shards);
// what is not written (the distributed optimizer, Hugging Face) refused naming the flag.
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "interop/hf_gpt2.h"
#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "interop/torch_format.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/run_settings.h"

namespace ptk {
namespace {

using torchfmt::PyValue;

// check_mtp_export_with_megatron_core.py's models, as ptk-train builds them from its flags; `moe` (experts on every
// layer, the depth's too) and `mla` (multi-latent attention) for the round trip only.
GPTConfig Mtp(const std::string& name) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 96;
  c.seq_length = 32;
  c.max_position_embeddings = 64;
  c.vocab_size = 500;
  c.padded_vocab_size = 512;
  c.mtp_num_layers = name == "gpt_tied" ? 2 : 1;
  c.mtp_loss_scaling_factor = name == "gpt_tied" ? 0.3 : 0.1;
  if (name == "gpt_tied") return c;
  c.normalization = Normalization::kRMSNorm;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.position_embedding = PositionEmbedding::kRope;
  c.untie_embeddings_and_output_weights = true;
  if (name == "moe") {  // the depth's layer a MoE layer, as the decoder's last
    c.num_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_shared_expert_intermediate_size = 32;
  }
  if (name == "mla") {
    c.multi_latent_attention = true;
    c.q_lora_rank = 24;
    c.kv_lora_rank = 16;
    c.qk_head_dim = 16;
    c.qk_pos_emb_head_dim = 8;
    c.v_head_dim = 12;
    c.qk_layernorm = true;
  }
  return c;
}

class MegatronMtp : public ::testing::Test {
 protected:
  void Save(const GPTConfig& c, const std::string& dir) {
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    params_.resize(static_cast<size_t>(layout->num_params));
    layout->InitWeights(5, params_);
    m1_.resize(params_.size());
    m2_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i] += 1e-3f * static_cast<float>(i % 97);
      m1_[i] = 1e-4f * static_cast<float>(i % 89) - 3e-3f;
      m2_[i] = 1e-6f * static_cast<float>(1 + i % 83);
    }
    TrainState st;
    st.iteration = 4;
    st.adam_step = 4;
    st.consumed_train_samples = 8;
    st.settings = {{"--vocab-size", "500"},
                   {"--lr", "0.003"},
                   {"--global-batch-size", "2"},
                   {"--mtp-num-layers", std::to_string(c.mtp_num_layers)},
                   {"--mtp-loss-scaling-factor", c.mtp_num_layers == 2 ? "0.3" : "0.1"}};
    if (c.mla())
      for (const auto& kv : MlaRunSettings(c)) st.settings.push_back(kv);
    if (c.moe())
      for (const auto& kv : MoeRunSettings(c)) st.settings.push_back(kv);
    ASSERT_TRUE(SaveCheckpoint(dir, *layout, params_, m1_, m2_, st, "[]").ok());
  }
  absl::StatusOr<ConvertSummary> Export(const std::string& dir, const char* impl, int64_t pp = 1, int64_t tp = 1,
                                        bool distopt = false) {
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir + "/ck", dir + "/meg");
    o.saver_transformer_impl = impl;
    o.target_pipeline_parallel_size = pp;
    o.target_tensor_parallel_size = tp;
    o.target_use_distributed_optimizer = distopt;
    return ExportToMegatron(o);
  }
  std::vector<float> params_, m1_, m2_;
};

constexpr char kRank[] = "meg/iter_0000004/mp_rank_00/model_optim_rng.pt";

// The local spec's names, shapes and order are megatron-core's state_dict's, the MTP block's included.
TEST_F(MegatronMtp, ExportWritesMegatronCoresNamesAndShapes) {
  for (const std::string name : {"gpt_tied", "llama_untied"}) {
    SCOPED_TRACE(name);
    std::ifstream in(testing::SourceDir() + "/tests/data/interop/mtp_megatron_names.txt");
    std::vector<std::string> want_params;
    std::set<std::string> want_extras;
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::string c, kind, n, shape;
      ls >> c >> kind >> n >> shape;
      if (c != name) continue;
      if (kind == "param") want_params.push_back(n + " " + shape);
      if (kind == "extra") want_extras.insert(n);
    }
    ASSERT_GT(want_params.size(), 20u) << "mtp_megatron_names.txt has no case " << name;
    testing::TempDir dir;
    ASSERT_NO_FATAL_FAILURE(Save(Mtp(name), dir / "ck"));
    auto s = Export(dir.path(), "local");
    ASSERT_TRUE(s.ok()) << s.status();
    auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
    ASSERT_TRUE(f.ok()) << f.status();
    std::vector<std::string> params;
    std::set<std::string> extras;
    for (const auto& [k, v] : (*f)->root().Get("model")->dict) {
      if (k->s.ends_with("_extra_state")) {
        extras.insert(k->s);
        continue;
      }
      std::string shape;
      for (size_t i = 0; i < v->tensor.shape.size(); ++i) shape += (i ? "x" : "") + std::to_string(v->tensor.shape[i]);
      params.push_back(k->s + " " + shape);
    }
    EXPECT_EQ(params, want_params);
    EXPECT_EQ(extras, want_extras);
    const PyValue* args = (*f)->root().Get("args");
    EXPECT_EQ(megatron::NumAttr(args, "mtp_num_layers"), static_cast<double>(Mtp(name).mtp_num_layers));
    EXPECT_EQ(megatron::NumAttr(args, "mtp_loss_scaling_factor"), Mtp(name).mtp_loss_scaling_factor);
  }
}

// Transformer Engine's names: a depth's transformer_layer fuses its norms into linear_qkv and linear_fc1 as a decoder
// layer does; enorm, hnorm and final_layernorm keep theirs.
TEST_F(MegatronMtp, TransformerEngineNamesFuseTheDepthLayersNorms) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Save(Mtp("llama_untied"), dir / "ck"));
  ASSERT_TRUE(Export(dir.path(), "transformer_engine").ok());
  auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
  ASSERT_TRUE(f.ok()) << f.status();
  const PyValue* model = (*f)->root().Get("model");
  for (const char* name :
       {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.eh_proj._extra_state",
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight",
        "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight", "mtp.layers.0.final_layernorm.weight"})
    EXPECT_NE(model->Get(name), nullptr) << name;
  EXPECT_EQ(model->Get("mtp.layers.0.transformer_layer.input_layernorm.weight"), nullptr);
}

TEST_F(MegatronMtp, PtkToMegatronToPtkIsBitForBit) {
  for (const std::string name : {"gpt_tied", "llama_untied", "moe", "mla"})
    for (int64_t pp : {1, 2})
      for (const char* impl : {"transformer_engine", "local"}) {
        SCOPED_TRACE(::testing::Message() << name << " pp " << pp << " " << impl);
        testing::TempDir dir;
        const GPTConfig c = Mtp(name);
        ASSERT_NO_FATAL_FAILURE(Save(c, dir / "ck"));
        auto s = Export(dir.path(), impl, pp);
        ASSERT_TRUE(s.ok()) << s.status();
        auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
        ASSERT_TRUE(back.ok()) << back.status();
        const std::string flags = c.mtp_num_layers == 2 ? " --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"
                                                        : " --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1";
        EXPECT_NE(back->train_flags.find(flags), std::string::npos) << back->train_flags;
        auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
        ASSERT_TRUE(ck.ok()) << ck.status();
        EXPECT_EQ(ck->config.mtp_num_layers, c.mtp_num_layers);
        EXPECT_EQ(ck->config.mtp_loss_scaling_factor, c.mtp_loss_scaling_factor);
        EXPECT_TRUE(ck->params == params_);
        EXPECT_TRUE(ck->m1 == m1_);
        EXPECT_TRUE(ck->m2 == m2_);
        for (const auto& kv : std::vector<std::pair<std::string, std::string>>{
                 {"--mtp-num-layers", std::to_string(c.mtp_num_layers)},
                 {"--mtp-loss-scaling-factor", c.mtp_num_layers == 2 ? "0.3" : "0.1"}})  // as ptk-train records them
          EXPECT_NE(std::find(ck->state.settings.begin(), ck->state.settings.end(), kv), ck->state.settings.end())
              << kv.first;
      }
}

// The local spec's T=2 export: each rank's parameters, names, shapes and order, are megatron-core's at tensor size 2
// (tests/data/interop/mtp_megatron_names_tp2.txt): eh_proj column-parallel, each depth's layer split as a decoder's.
TEST_F(MegatronMtp, EachRanksNamesAndShapesAreMegatronCoresAtTensorSize2) {
  for (const std::string name : {"gpt_tied", "llama_untied"})
    for (int64_t t = 0; t < 2; ++t) {
      SCOPED_TRACE(::testing::Message() << name << " rank " << t);
      std::ifstream in(testing::SourceDir() + "/tests/data/interop/mtp_megatron_names_tp2.txt");
      std::vector<std::string> want;
      for (std::string line; std::getline(in, line);) {
        std::istringstream ls(line);
        std::string c, kind, n, shape;
        int64_t r = -1;
        ls >> c >> r >> kind >> n >> shape;
        if (c == name && r == t && kind == "param") want.push_back(n + " " + shape);
      }
      ASSERT_GT(want.size(), 20u) << "mtp_megatron_names_tp2.txt has no " << name << " rank " << t;
      testing::TempDir dir;
      ASSERT_NO_FATAL_FAILURE(Save(Mtp(name), dir / "ck"));
      auto s = Export(dir.path(), "local", 1, 2);
      ASSERT_TRUE(s.ok()) << s.status();
      auto f = torchfmt::TorchArchiveReader::Open(
          dir / ("meg/iter_0000004/" + megatron::RankDir(t, 0, 1) + "/model_optim_rng.pt"));
      ASSERT_TRUE(f.ok()) << f.status();
      std::vector<std::string> got;
      for (const auto& [k, v] : (*f)->root().Get("model")->dict) {
        if (k->s.ends_with("_extra_state")) continue;
        std::string shape;
        for (size_t i = 0; i < v->tensor.shape.size(); ++i)
          shape += (i ? "x" : "") + std::to_string(v->tensor.shape[i]);
        got.push_back(k->s + " " + shape);
      }
      EXPECT_EQ(got, want);
    }
}

// ptk -> megatron at T=2 -> ptk: every weight and moment bit for bit (GPT, Llama, MoE; both specs).
TEST_F(MegatronMtp, PtkToMegatronAtTp2ToPtkIsBitForBit) {
  for (const std::string name : {"gpt_tied", "llama_untied", "moe"})
    for (const char* impl : {"transformer_engine", "local"}) {
      SCOPED_TRACE(::testing::Message() << name << " " << impl);
      testing::TempDir dir;
      ASSERT_NO_FATAL_FAILURE(Save(Mtp(name), dir / "ck"));
      auto s = Export(dir.path(), impl, 1, 2);
      ASSERT_TRUE(s.ok()) << s.status();
      auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
      ASSERT_TRUE(back.ok()) << back.status();
      auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
      ASSERT_TRUE(ck.ok()) << ck.status();
      EXPECT_EQ(ck->config.mtp_num_layers, Mtp(name).mtp_num_layers);
      EXPECT_TRUE(ck->params == params_);
      EXPECT_TRUE(ck->m1 == m1_);
      EXPECT_TRUE(ck->m2 == m2_);
    }
}

// What is not written, refused in one line naming the flag; nothing written.
TEST_F(MegatronMtp, WhatIsNotWrittenIsRefusedNamingTheFlag) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Save(Mtp("gpt_tied"), dir / "ck"));
  auto distopt = Export(dir.path(), "local", 1, 1, true);
  ASSERT_FALSE(distopt.ok());
  EXPECT_NE(distopt.status().message().find("(--mtp-num-layers 2) with --target-use-distributed-optimizer"),
            std::string::npos)
      << distopt.status();
  EXPECT_FALSE(std::filesystem::exists(dir / "meg/iter_0000004"));
  auto hf = RunConvert(testing::ConvertOpts("ptk", "hf", dir / "ck", dir / "hf"));
  ASSERT_FALSE(hf.ok());
  EXPECT_NE(hf.status().message().find("(--mtp-num-layers 2): ptk-convert does not export MTP checkpoints to Hugging "
                                       "Face"),
            std::string::npos)
      << hf.status();
}

}  // namespace
}  // namespace ptk
