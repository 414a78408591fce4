// ptk-convert's mixture-of-experts checkpoints in Megatron's `torch` format (--saver megatron, --loader megatron):
// each MoE layer's router (mlp.router.weight, whole on every tensor rank), its SequentialMLP experts
// (mlp.experts.local_experts.K.linear_fc1/linear_fc2, split over the tensor ranks as the dense MLP, SwiGLU's
// [gate; up] per rank), its pre-MLP norm apart (pre_mlp_layernorm.weight under either layer spec), the args that
// mark the experts; ptk -> megatron -> ptk gives back every weight and AdamW moment bit for bit at tensor x
// pipeline sizes 1x1 and 2x2; what ptk's MoE layers do not compute (grouped GEMM, expert parallelism, shared
// experts, ...) refused naming the flag, and so is a MoE checkpoint in the torch_dist format (naming common.pt).
// tests/support/check_moe_export_with_megatron_core.py loads the export
// in megatron-core itself.
#include <filesystem>
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

namespace ptk {
namespace {

// The Llama line with 4 SwiGLU experts of width 8 in 4 layers (or every other layer), 4 heads in 2 groups.
GPTConfig Moe(bool every_layer) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 24;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 100;
  c.padded_vocab_size = 128;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = every_layer;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 8;
  if (!every_layer) {
    c.moe_layer_pattern = {1, 0, 1, 0};
    c.moe_router_pre_softmax = true;
  }
  return c;
}

class MegatronMoe : public ::testing::Test {
 protected:
  void Save(const GPTConfig& c, const std::string& dir) {
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = *layout;
    params_.resize(static_cast<size_t>(layout_.num_params));
    layout_.InitWeights(5, params_);
    m1_.resize(params_.size());
    m2_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i] += 1e-3f * static_cast<float>(i % 97);
      m1_[i] = 1e-4f * static_cast<float>(i % 89) - 3e-3f;
      m2_[i] = 1e-6f * static_cast<float>(1 + i % 83);
    }
    TrainState st;
    st.iteration = 6;
    st.adam_step = 6;
    st.consumed_train_samples = 48;
    st.settings = {
        {"--vocab-size", "100"}, {"--moe-aux-loss-coeff", "0.01"}, {"--lr", "0.001"}, {"--global-batch-size", "8"}};
    ASSERT_TRUE(SaveCheckpoint(dir, layout_, params_, m1_, m2_, st, "[]").ok());
  }
  ParamLayout layout_;
  std::vector<float> params_, m1_, m2_;
};

TEST_F(MegatronMoe, ExportWritesTheExpertsAsMegatronNamesAndSplitsThem) {
  testing::TempDir dir;
  Save(Moe(true), dir / "ck");
  ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
  o.target_tensor_parallel_size = 2;
  o.target_pipeline_parallel_size = 2;
  auto s = ExportToMegatron(o);
  ASSERT_TRUE(s.ok()) << s.status();
  auto f = torchfmt::TorchArchiveReader::Open(dir / "meg/iter_0000006/mp_rank_01_001/model_optim_rng.pt");
  ASSERT_TRUE(f.ok()) << f.status();
  const torchfmt::PyValue* model = (*f)->root().Get("model");
  ASSERT_NE(model, nullptr);
  auto shape = [&](const std::string& name) {
    const torchfmt::PyValue* t = model->Get(name);
    return t && t->kind == torchfmt::PyValue::Kind::kTensor ? t->tensor.shape : std::vector<int64_t>{};
  };
  // Stage 1's layers 2 and 3 are its 0 and 1; tensor rank 1 holds half of each expert's rows / columns.
  EXPECT_EQ(shape("decoder.layers.1.mlp.router.weight"), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(shape("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"), (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(shape("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"), (std::vector<int64_t>{16, 4}));
  EXPECT_EQ(shape("decoder.layers.1.pre_mlp_layernorm.weight"), (std::vector<int64_t>{16}));  // not fused
  EXPECT_EQ(shape("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(model->Get("decoder.layers.1.mlp.linear_fc1.weight"), nullptr);
  EXPECT_NE(model->Get("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1._extra_state"), nullptr);
  // Rank 1's fc1 rows: its half of the gate's rows, then its half of the up's.
  const LayerParams& lp = layout_.layers[3];
  const torchfmt::PyValue* fc1 = model->Get("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  auto rows = (*f)->ReadFloat(fc1->tensor, "fc1");
  ASSERT_TRUE(rows.ok());
  const int64_t e2 = lp.experts + 2 * Moe(true).expert_floats();
  EXPECT_EQ((*rows)[0], params_[static_cast<size_t>(e2 + 4 * 16)]);        // gate row 4
  EXPECT_EQ((*rows)[4 * 16], params_[static_cast<size_t>(e2 + 12 * 16)]);  // up row 4
  const torchfmt::PyValue* args = (*f)->root().Get("args");
  EXPECT_EQ(megatron::NumAttr(args, "num_experts"), 4.0);
  EXPECT_EQ(megatron::NumAttr(args, "moe_router_topk"), 2.0);
  EXPECT_EQ(megatron::NumAttr(args, "moe_ffn_hidden_size"), 8.0);
  EXPECT_EQ(megatron::NumAttr(args, "moe_aux_loss_coeff"), 0.01);
  EXPECT_EQ(megatron::NumAttr(args, "expert_model_parallel_size"), 1.0);
  EXPECT_EQ(megatron::StrAttr(args, "moe_router_load_balancing_type"), "aux_loss");
  EXPECT_FALSE(megatron::BoolAttr(args, "moe_grouped_gemm", true));
}

TEST_F(MegatronMoe, PtkToMegatronToPtkIsBitForBit) {
  for (bool every : {true, false})
    for (int64_t size : {1, 2})
      for (const char* impl : {"transformer_engine", "local"}) {
        SCOPED_TRACE(::testing::Message() << every << " " << size << " " << impl);
        testing::TempDir dir;
        const GPTConfig c = Moe(every);
        Save(c, dir / "ck");
        ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
        o.target_tensor_parallel_size = o.target_pipeline_parallel_size = size;
        o.saver_transformer_impl = impl;
        auto s = ExportToMegatron(o);
        ASSERT_TRUE(s.ok()) << s.status();
        auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_NE(back->train_flags.find(" --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 8 "
                                         "--moe-aux-loss-coeff 0.01"),
                  std::string::npos)
            << back->train_flags;
        EXPECT_EQ(back->train_flags.find("--moe-layer-freq \"[1,0,1,0]\"") != std::string::npos, !every);
        EXPECT_EQ(back->train_flags.find("--moe-router-pre-softmax") != std::string::npos, !every);
        auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
        ASSERT_TRUE(ck.ok()) << ck.status();
        EXPECT_EQ(ck->config.num_experts, 4);
        EXPECT_EQ(ck->config.moe_ffn(), 8);
        EXPECT_EQ(ck->config.moe_aux_loss_coeff, 0.01);
        const std::vector<int> pattern = every ? std::vector<int>{1, 1, 1, 1} : c.moe_layer_pattern;
        EXPECT_EQ(ck->config.moe_layer_pattern, pattern);
        EXPECT_EQ(ck->config.moe_router_pre_softmax, !every);
        EXPECT_TRUE(ck->params == params_);
        EXPECT_TRUE(ck->m1 == m1_);
        EXPECT_TRUE(ck->m2 == m2_);
        EXPECT_EQ(ck->state.adam_step, 6);
      }
}

TEST_F(MegatronMoe, WhatPtkCannotComputeIsRefusedNamingTheFlag) {
  testing::TempDir dir;
  Save(Moe(true), dir / "ck");
  ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
  o.target_use_distributed_optimizer = true;
  auto d = ExportToMegatron(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--target-use-distributed-optimizer is not written for MoE checkpoints yet"),
            std::string::npos)
      << d.status();
  EXPECT_FALSE(std::filesystem::exists(dir / "meg/iter_0000006"));
  o.target_use_distributed_optimizer = false;
  ASSERT_TRUE(ExportToMegatron(o).ok());
  // args a run of Megatron's MoE features ptk lacks would record: refused naming each flag.
  struct Case {
    const char* key;
    torchfmt::PyRef value;
    const char* flag;
  };
  const Case cases[] = {
      {"moe_grouped_gemm", torchfmt::MakeBool(true), "--moe-grouped-gemm"},
      {"expert_model_parallel_size", torchfmt::MakeInt(2), "--expert-model-parallel-size 2"},
      {"moe_shared_expert_intermediate_size", torchfmt::MakeInt(16), "--moe-shared-expert-intermediate-size 16"},
      {"moe_expert_capacity_factor", torchfmt::MakeFloat(1.5), "--moe-expert-capacity-factor 1.5"},
      {"moe_router_load_balancing_type", torchfmt::MakeStr("seq_aux_loss"),
       "--moe-router-load-balancing-type seq_aux_loss"},
  };
  for (const Case& k : cases) {
    torchfmt::PyRef written = torchfmt::MakeDict(), args = torchfmt::MakeDict();
    megatron::SetMoeArgs(Moe(true), 1, written.get());
    for (const auto& [key, v] : written->dict)  // the MoE args the export writes, one changed
      if (key->s != k.key) torchfmt::DictSet(args.get(), key, v);
    torchfmt::DictSet(args.get(), k.key, k.value);
    GPTConfig c = Moe(true);
    const absl::Status st = megatron::ReadMoeArgs(args.get(), "meg/args", 1, &c);
    ASSERT_FALSE(st.ok()) << k.flag;
    EXPECT_NE(st.message().find(std::string("meg/args: the mixture of experts was trained with ") + k.flag),
              std::string::npos)
        << st;
  }
  // As written, they read back as the model.
  torchfmt::PyRef args = torchfmt::MakeDict();
  megatron::SetMoeArgs(Moe(false), 1, args.get());
  GPTConfig c = Moe(false);
  c.num_experts = 0;
  c.moe_layer_pattern.clear();
  c.moe_router_pre_softmax = false;
  ASSERT_TRUE(megatron::ReadMoeArgs(args.get(), "meg/args", 1, &c).ok());
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.moe_layer_pattern, (std::vector<int>{1, 0, 1, 0}));
  EXPECT_TRUE(c.moe_router_pre_softmax);
}

// A torch_dist checkpoint whose args mark experts (tests/data/torch_dist_llama's, its common.pt's args given
// num_experts and the moe_* args): refused in one line naming common.pt, nothing written.
TEST(MegatronMoeDist, ATorchDistMixtureOfExpertsIsRefusedNamingCommonPt) {
  testing::TempDir dir;
  const std::string meg = dir / "meg";
  std::filesystem::copy(testing::SourceDir() + "/tests/data/torch_dist_llama/plain_bf16_tp1", meg,
                        std::filesystem::copy_options::recursive);
  const std::string common = meg + "/iter_0000003/common.pt";
  auto f = torchfmt::TorchArchiveReader::Open(common);
  ASSERT_TRUE(f.ok()) << f.status();
  const torchfmt::PyValue* args = (*f)->root().Get("args");
  ASSERT_TRUE(args && args->state && args->state->kind == torchfmt::PyValue::Kind::kDict);
  torchfmt::PyRef attrs = torchfmt::MakeDict();
  for (const auto& [key, v] : args->state->dict)
    if (key->s != "num_experts") torchfmt::DictSet(attrs.get(), key, v);
  GPTConfig c = Moe(true);
  c.moe_ffn_hidden_size = static_cast<int64_t>(*megatron::NumAttr(args, "ffn_hidden_size"));
  megatron::SetMoeArgs(c, 1, attrs.get());
  torchfmt::PyRef root = torchfmt::MakeDict();
  torchfmt::DictSet(root.get(), "args", torchfmt::MakeNamespace(attrs));
  torchfmt::DictSet(root.get(), "iteration", torchfmt::MakeInt(3));
  f->reset();
  ASSERT_TRUE(torchfmt::WriteTorchFile(common, *root, {}).ok());
  auto r = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", meg, dir / "out"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            common +
                ": a mixture-of-experts model (--num-experts 4) in the torch_dist format: ptk-convert reads MoE "
                "checkpoints in the torch format only (save with --ckpt-format torch)");
  EXPECT_FALSE(std::filesystem::exists(dir / "out/iter_0000003"));
}

}  // namespace
}  // namespace ptk
