// ptk-convert's mixture-of-experts checkpoints in Megatron's `torch` format (--saver megatron, --loader megatron):
// each MoE layer's router (mlp.router.weight, whole on every tensor rank), its SequentialMLP experts
// (mlp.experts.local_experts.K.linear_fc1/linear_fc2, split over the tensor ranks as the dense MLP, SwiGLU's
// [gate; up] per rank), its pre-MLP norm apart (pre_mlp_layernorm.weight under either layer spec), the args that
// mark the experts; ptk -> megatron -> ptk gives back every weight and AdamW moment bit for bit at tensor x
// pipeline sizes 1x1 and 2x2, and so do shared experts (mlp.shared_experts.*), the routers' expert_bias and the
// training args of the z-loss, scaling, group-limited routing, token dropping and load-balancing types; what ptk's
// MoE layers do not compute (grouped GEMM, expert parallelism, input jitter, ...) refused naming the flag, and so is
// a MoE checkpoint in the torch_dist format (naming common.pt).
// tests/support/check_moe_export_with_megatron_core.py loads the export
// in megatron-core itself.
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "interop/hf_gpt2.h"
#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "interop/torch_format.h"
#include "tests/interop/convert_opts.h"
#include "tests/interop/distinct_state.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/run_settings.h"

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

// Moe(every_layer) with every MoE feature ptk-train computes beside it: gated shared experts of width 12, the
// z-loss, a top-k scaling factor, group-limited routing (2 groups, 1 chosen), token dropping at capacity 1.5 by
// position, and aux_loss with seq_aux_loss; or (every_layer false) sigmoid scores with the expert bias, ungated
// shared experts and global_aux_loss, dropping by probability.
GPTConfig MoeWithFeatures(bool every_layer) {
  GPTConfig c = Moe(every_layer);
  c.moe_shared_expert_intermediate_size = 12;
  c.moe_expert_capacity_factor = 1.5;
  if (every_layer) {
    c.moe_shared_expert_gate = true;
    c.moe_z_loss_coeff = 1e-3;
    c.moe_router_topk_scaling_factor = 2.5;
    c.moe_router_num_groups = 2;
    c.moe_router_group_topk = 1;
    c.moe_token_drop_position = true;
    c.moe_seq_aux_loss_coeff = 0.02;
  } else {
    c.moe_router_pre_softmax = false;
    c.moe_router_sigmoid = true;
    c.moe_router_enable_expert_bias = true;
    c.moe_router_bias_update_rate = 2e-3;
    c.moe_global_aux_loss_coeff = 0.03;
  }
  return c;
}

class MegatronMoe : public testing::DistinctCheckpointTest {
 protected:
  void Save(const GPTConfig& c, const std::string& dir) {
    TrainState st;
    st.iteration = 6;
    st.adam_step = 6;
    st.consumed_train_samples = 48;
    st.settings = {{"--vocab-size", "100"}, {"--lr", "0.001"}, {"--global-batch-size", "8"}};
    GPTConfig recorded = c;  // the training settings as ptk-train records them (aux_loss 0.01 unless the test's own)
    if (recorded.moe_aux_loss_coeff == 0) recorded.moe_aux_loss_coeff = 0.01;
    for (const auto& kv : MoeRunSettings(recorded)) st.settings.push_back(kv);
    for (int64_t l = 0; l < c.num_layers; ++l)  // the routers' expert biases, as CpuGPTModel::ReadBuffers names them
      if (c.moe_router_enable_expert_bias && c.moe_layer(l))
        st.buffers.emplace_back(fmt::format("decoder.layers.{}.mlp.router.expert_bias", l),
                                std::vector<float>{0.25f * static_cast<float>(l), -1e-3f, 3e-3f, 7.5e-4f});
    SaveDistinct(c, dir, st);
  }
  // `c` saved in dir/ck, exported to dir/meg at tensor and pipeline size `size` under `impl`'s names and imported
  // back into dir/back: the import's ptk-train flags in *flags. Call under ASSERT_NO_FATAL_FAILURE.
  void RoundTrip(const GPTConfig& c, const testing::TempDir& dir, int64_t size, const char* impl, std::string* flags) {
    Save(c, dir / "ck");
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
    o.target_tensor_parallel_size = o.target_pipeline_parallel_size = size;
    o.saver_transformer_impl = impl;
    auto s = ExportToMegatron(o);
    ASSERT_TRUE(s.ok()) << s.status();
    auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
    ASSERT_TRUE(back.ok()) << back.status();
    *flags = back->train_flags;
  }
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
        std::string flags;
        ASSERT_NO_FATAL_FAILURE(RoundTrip(c, dir, size, impl, &flags));
        EXPECT_NE(flags.find(" --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 8 "
                             "--moe-aux-loss-coeff 0.01"),
                  std::string::npos)
            << flags;
        EXPECT_EQ(flags.find("--moe-layer-freq \"[1,0,1,0]\"") != std::string::npos, !every);
        EXPECT_EQ(flags.find("--moe-router-pre-softmax") != std::string::npos, !every);
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

// Shared experts (SharedExpertMLP: linear_fc1 split by rows as the dense MLP's, SwiGLU's [gate; up] per rank,
// linear_fc2 by columns, gate_weight whole) and the routers' expert_bias (fp32, whole on every rank, the stage's
// layer numbers), under both layer specs' one name; the args Megatron-LM's arguments.py would record.
TEST_F(MegatronMoe, ExportWritesSharedExpertsExpertBiasesAndTheirArgs) {
  for (bool every : {true, false}) {
    SCOPED_TRACE(every);
    testing::TempDir dir;
    const GPTConfig c = MoeWithFeatures(every);
    Save(c, dir / "ck");
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
    o.target_tensor_parallel_size = o.target_pipeline_parallel_size = 2;
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
    // Stage 1's first layer is layer 2 (a MoE layer either way).
    const std::string e = "decoder.layers.0.mlp.shared_experts.";
    EXPECT_EQ(shape(e + "linear_fc1.weight"), (std::vector<int64_t>{12, 16}));  // 2 x 12 rows over 2 ranks
    EXPECT_EQ(shape(e + "linear_fc2.weight"), (std::vector<int64_t>{16, 6}));
    EXPECT_NE(model->Get(e + "linear_fc1._extra_state"), nullptr);
    EXPECT_EQ(shape(e + "gate_weight"), every ? (std::vector<int64_t>{1, 16}) : std::vector<int64_t>{});
    EXPECT_EQ(shape("decoder.layers.0.mlp.router.expert_bias"),
              every ? std::vector<int64_t>{} : (std::vector<int64_t>{4}));
    EXPECT_EQ(model->Get("decoder.layers.0.mlp.router.local_tokens_per_expert"), nullptr);  // not persistent
    // Rank 1's shared fc1 rows: its half of the gate's rows (6..11), then its half of the up's (18..23).
    const LayerParams& lp = layout_.layers[2];
    auto rows = (*f)->ReadFloat(model->Get(e + "linear_fc1.weight")->tensor, "fc1");
    ASSERT_TRUE(rows.ok());
    EXPECT_EQ((*rows)[0], params_[static_cast<size_t>(lp.shared_fc1 + 6 * 16)]);
    EXPECT_EQ((*rows)[6 * 16], params_[static_cast<size_t>(lp.shared_fc1 + 18 * 16)]);
    if (!every) {
      auto bias = (*f)->ReadFloat(model->Get("decoder.layers.0.mlp.router.expert_bias")->tensor, "bias");
      ASSERT_TRUE(bias.ok());
      EXPECT_EQ(*bias, buffers_[1].second);  // layer 2's, the second MoE layer's
    }
    const torchfmt::PyValue* args = (*f)->root().Get("args");
    using megatron::BoolAttr, megatron::NumAttr, megatron::StrAttr;
    EXPECT_EQ(NumAttr(args, "moe_shared_expert_intermediate_size"), 12.0);
    EXPECT_EQ(BoolAttr(args, "moe_shared_expert_gate", !every), every);
    EXPECT_EQ(NumAttr(args, "moe_expert_capacity_factor"), 1.5);
    EXPECT_EQ(StrAttr(args, "moe_token_drop_policy"), every ? "position" : "probs");
    EXPECT_EQ(StrAttr(args, "moe_router_dtype"), "fp32");
    if (every) {
      EXPECT_EQ(NumAttr(args, "moe_z_loss_coeff"), 1e-3);
      EXPECT_EQ(NumAttr(args, "moe_router_topk_scaling_factor"), 2.5);
      EXPECT_EQ(NumAttr(args, "moe_router_num_groups"), 2.0);
      EXPECT_EQ(NumAttr(args, "moe_router_group_topk"), 1.0);
      EXPECT_FALSE(BoolAttr(args, "moe_router_enable_expert_bias", true));
    } else {
      EXPECT_EQ(args->Get("moe_z_loss_coeff")->kind, torchfmt::PyValue::Kind::kNone);
      EXPECT_EQ(args->Get("moe_router_group_topk")->kind, torchfmt::PyValue::Kind::kNone);
      EXPECT_TRUE(BoolAttr(args, "moe_router_enable_expert_bias", false));
      EXPECT_EQ(NumAttr(args, "moe_router_bias_update_rate"), 2e-3);
    }
    // Two types: lists of as many (arguments.py's nargs='+', left as lists when longer than one).
    const torchfmt::PyValue* types = args->Get("moe_router_load_balancing_type");
    const torchfmt::PyValue* coeffs = args->Get("moe_aux_loss_coeff");
    ASSERT_TRUE(types && types->kind == torchfmt::PyValue::Kind::kList && types->items.size() == 2);
    ASSERT_TRUE(coeffs && coeffs->kind == torchfmt::PyValue::Kind::kList && coeffs->items.size() == 2);
    EXPECT_EQ(types->items[0]->s + " " + types->items[1]->s,
              every ? "aux_loss seq_aux_loss" : "aux_loss global_aux_loss");
    EXPECT_EQ(coeffs->items[0]->Number(), 0.01);
    EXPECT_EQ(coeffs->items[1]->Number(), every ? 0.02 : 0.03);
  }
}

TEST_F(MegatronMoe, EveryFeatureGoesPtkToMegatronToPtkBitForBit) {
  for (bool every : {true, false})
    for (int64_t size : {1, 2})
      for (const char* impl : {"transformer_engine", "local"}) {
        SCOPED_TRACE(::testing::Message() << every << " " << size << " " << impl);
        testing::TempDir dir;
        const GPTConfig c = MoeWithFeatures(every);
        std::string flags;
        ASSERT_NO_FATAL_FAILURE(RoundTrip(c, dir, size, impl, &flags));
        for (const char* flag :
             every ? std::vector<const char*>{" --moe-router-load-balancing-type aux_loss seq_aux_loss "
                                              "--moe-aux-loss-coeff 0.01 0.02",
                                              " --moe-z-loss-coeff 0.001", " --moe-router-topk-scaling-factor 2.5",
                                              " --moe-router-num-groups 2 --moe-router-group-topk 1",
                                              " --moe-shared-expert-intermediate-size 12 --moe-shared-expert-gate",
                                              " --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position"}
                   : std::vector<const char*>{
                         " --moe-router-load-balancing-type aux_loss global_aux_loss --moe-aux-loss-coeff 0.01 0.03",
                         " --moe-router-score-function sigmoid",
                         " --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.002",
                         " --moe-shared-expert-intermediate-size 12 --moe-expert-capacity-factor 1.5"})
          EXPECT_NE(flags.find(flag), std::string::npos) << flag << "\n" << flags;
        auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
        ASSERT_TRUE(ck.ok()) << ck.status();
        const GPTConfig& r = ck->config;
        EXPECT_EQ(r.moe_shared_expert_intermediate_size, 12);
        EXPECT_EQ(r.moe_shared_expert_gate, c.moe_shared_expert_gate);
        EXPECT_EQ(r.moe_z_loss_coeff, c.moe_z_loss_coeff);
        EXPECT_EQ(r.moe_router_topk_scaling_factor, c.moe_router_topk_scaling_factor);
        EXPECT_EQ(r.moe_router_num_groups, c.moe_router_num_groups);
        EXPECT_EQ(r.moe_router_group_topk, c.moe_router_group_topk);
        EXPECT_EQ(r.moe_expert_capacity_factor, 1.5);
        EXPECT_EQ(r.moe_token_drop_position, c.moe_token_drop_position);
        EXPECT_EQ(r.moe_aux_loss_coeff, 0.01);
        EXPECT_EQ(r.moe_seq_aux_loss_coeff, c.moe_seq_aux_loss_coeff);
        EXPECT_EQ(r.moe_global_aux_loss_coeff, c.moe_global_aux_loss_coeff);
        EXPECT_EQ(r.moe_router_sigmoid, c.moe_router_sigmoid);
        EXPECT_EQ(r.moe_router_enable_expert_bias, c.moe_router_enable_expert_bias);
        EXPECT_EQ(r.moe_router_bias_update_rate, c.moe_router_bias_update_rate);
        EXPECT_TRUE(ck->params == params_);
        EXPECT_TRUE(ck->m1 == m1_);
        EXPECT_TRUE(ck->m2 == m2_);
        EXPECT_EQ(ck->state.buffers, buffers_);
        EXPECT_EQ(ck->state.adam_step, 6);
        // The imported settings are ptk-train's own for the model: a resume compares them equal.
        GPTConfig recorded = c;
        recorded.moe_aux_loss_coeff = 0.01;
        for (const auto& kv : MoeRunSettings(recorded))
          EXPECT_NE(std::find(ck->state.settings.begin(), ck->state.settings.end(), kv), ck->state.settings.end())
              << kv.first << " " << kv.second;
      }
}

// An export whose expert bias is gone (or a bias beside a model without one) refused, nothing written.
TEST_F(MegatronMoe, AnExpertBiasMissingOrExtraIsRefused) {
  testing::TempDir dir;
  Save(MoeWithFeatures(false), dir / "ck");
  TrainState st;
  st.iteration = st.adam_step = 6;
  st.settings = {{"--vocab-size", "100"}};
  for (const auto& kv : MoeRunSettings(MoeWithFeatures(false))) st.settings.push_back(kv);
  st.buffers = {buffers_[0]};
  ASSERT_TRUE(SaveCheckpoint(dir / "ck2", layout_, params_, m1_, m2_, st, "[]").ok());
  auto e = ExportToMegatron(testing::ConvertOpts("ptk", "megatron", dir / "ck2", dir / "meg"));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("without its buffer decoder.layers.2.mlp.router.expert_bias"), std::string::npos)
      << e.status();
  EXPECT_FALSE(std::filesystem::exists(dir / "meg/iter_0000006"));
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
      {"moe_input_jitter_eps", torchfmt::MakeFloat(0.01), "--moe-input-jitter-eps 0.01"},
      {"moe_router_dtype", torchfmt::MakeStr("fp64"), "--moe-router-dtype fp64"},
      {"moe_token_drop_policy", torchfmt::MakeStr("random"), "--moe-token-drop-policy random"},
      {"moe_router_load_balancing_type", torchfmt::MakeStr("sinkhorn"), "--moe-router-load-balancing-type sinkhorn"},
      {"moe_router_load_balancing_type",
       torchfmt::MakeList({torchfmt::MakeStr("aux_loss"), torchfmt::MakeStr("seq_aux_loss")}),
       "--moe-router-load-balancing-type of 2 types with 1 --moe-aux-loss-coeff values"},
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
  // And the features beside: a Megatron-LM run's args (the pad to capacity, the overlap: the same math) read.
  for (bool every : {true, false}) {
    torchfmt::PyRef feat = torchfmt::MakeDict();
    const GPTConfig want = MoeWithFeatures(every);
    megatron::SetMoeArgs(want, 1, feat.get());
    torchfmt::DictSet(feat.get(), "moe_pad_expert_input_to_capacity", torchfmt::MakeBool(true));
    torchfmt::DictSet(feat.get(), "moe_shared_expert_overlap", torchfmt::MakeBool(true));
    GPTConfig got = Moe(true);
    got.num_experts = 0;
    const absl::Status st = megatron::ReadMoeArgs(feat.get(), "meg/args", 1, &got);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(megatron::MoeTrainFlags(got), megatron::MoeTrainFlags(want));
    EXPECT_EQ(MoeRunSettings(got), MoeRunSettings(want));
  }
}

// A torch_dist checkpoint whose args mark experts (tests/data/torch_dist_llama's, its common.pt's args given
// num_experts and the moe_* args): its dense keys refused in one line naming .metadata and the key, nothing written.
TEST(MegatronMoeDist, ADenseTorchDistCheckpointWhoseArgsSayMoeIsRefusedNamingTheKey) {
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
  // torch_dist's MoE keys are read (megatron_dist_moe_test): a dense checkpoint's keys are not the MoE model's.
  EXPECT_EQ(r.status().message(), meg +
                                      "/iter_0000003/.metadata: tensor decoder.layers.mlp.linear_fc1.weight: not a "
                                      "weight of the GPT model common.pt's args describe");
  EXPECT_FALSE(std::filesystem::exists(dir / "out/iter_0000003"));
}

}  // namespace
}  // namespace ptk
