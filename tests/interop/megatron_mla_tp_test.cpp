// Multi-latent attention checkpoints in Megatron's `torch` format at tensor-parallel size 2 and 4 (--saver megatron
// --target-tensor-parallel-size N, --loader megatron): each rank's mp_rank_TT file holds megatron-core 0.16.1's shard
// of every MLASelfAttention tensor: linear_q_proj, linear_q_up_proj and linear_kv_up_proj column-parallel (rows by
// heads), linear_proj row-parallel (columns), the latents' norms whole; the down projections whole on every rank under
// Transformer Engine's spec (TELinear, parallel_mode "duplicated") and split by rows under the local one
// (ColumnParallelLinear, its output gathered). Every shard is checked against the tensor-parallel size 1 export's
// whole tensor; ptk -> megatron (T=2) -> ptk gives back every weight and AdamW moment bit for bit (both specs, pipeline
// sizes 1 and 2, the distributed optimizer's distrib_optim.pt too); a T=2 import exported at T=4 is the direct T=4
// export; a local-spec target whose down projections do not divide over the ranks is refused. megatron-core loads the
// T=2 files at tensor size 2 and computes ptk's logits and loss:
// tests/support/check_mla_tp_export_with_megatron_core.py.
#include <filesystem>
#include <fstream>
#include <map>
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

// check_mla_export_with_megatron_core.py's models (megatron_mla_test.cpp's Mla): q latent + YaRN + SwiGLU, or
// linear_q_proj + LayerNorm + GELU + biases + tied embeddings; `deepseek` adds experts on the second layer.
GPTConfig Mla(const std::string& name, int64_t kv_lora_rank = 16) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 96;
  c.seq_length = 32;
  c.max_position_embeddings = 64;
  c.vocab_size = 500;
  c.padded_vocab_size = 512;
  c.multi_latent_attention = true;
  c.kv_lora_rank = kv_lora_rank;
  c.qk_head_dim = 16;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 12;
  if (name == "plain_rope") {
    c.mla_yarn = false;
    c.rotary_base = 20000;
    return c;
  }
  c.q_lora_rank = 24;
  c.qk_layernorm = true;
  c.normalization = Normalization::kRMSNorm;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.position_embedding = PositionEmbedding::kRope;
  c.untie_embeddings_and_output_weights = true;
  if (name == "deepseek") {
    c.num_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_layer_pattern = {0, 1};
    c.moe_router_sigmoid = true;
    c.moe_shared_expert_intermediate_size = 32;
  }
  return c;
}

// A rank file's model tensors by name: shape and fp32 values.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
std::map<std::string, Tensor> ReadModel(const std::string& path) {
  std::map<std::string, Tensor> out;
  auto f = torchfmt::TorchArchiveReader::Open(path);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return out;
  const PyValue* model = (*f)->root().Get("model");
  EXPECT_NE(model, nullptr) << path;
  if (!model) return out;
  for (const auto& [k, v] : model->dict) {
    if (v->kind != PyValue::Kind::kTensor) continue;
    auto data = (*f)->ReadFloat(v->tensor, k->s);
    EXPECT_TRUE(data.ok()) << data.status();
    if (data.ok()) out[k->s] = Tensor{v->tensor.shape, *data};
  }
  return out;
}

class MegatronMlaTp : public ::testing::Test {
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
    st.settings = {{"--vocab-size", "500"}, {"--lr", "0.003"}, {"--global-batch-size", "2"}};
    for (const auto& kv : MlaRunSettings(c)) st.settings.push_back(kv);
    if (c.moe())
      for (const auto& kv : MoeRunSettings(c)) st.settings.push_back(kv);
    ASSERT_TRUE(SaveCheckpoint(dir, *layout, params_, m1_, m2_, st, "[]").ok());
  }
  absl::StatusOr<ConvertSummary> Export(const std::string& from, const std::string& to, const char* impl, int64_t tp,
                                        int64_t pp = 1, bool distopt = false) {
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", from, to);
    o.saver_transformer_impl = impl;
    o.target_tensor_parallel_size = tp;
    o.target_pipeline_parallel_size = pp;
    o.target_use_distributed_optimizer = distopt;
    return ExportToMegatron(o);
  }
  std::vector<float> params_, m1_, m2_;
};

std::string Rank(const std::string& meg, int64_t t) {
  return meg + "/iter_0000004/" + megatron::RankDir(t, 0, 1) + "/model_optim_rng.pt";
}

// Each rank's shard of every MLA tensor, against the T=1 export's whole tensor: rows or columns of rank t, or all.
TEST_F(MegatronMlaTp, EachRankHoldsMegatronCoresShardOfEveryMlaTensor) {
  for (const char* impl : {"local", "transformer_engine"})
    for (const std::string name : {"lora_yarn", "plain_rope"}) {
      SCOPED_TRACE(::testing::Message() << name << " " << impl);
      testing::TempDir dir;
      ASSERT_NO_FATAL_FAILURE(Save(Mla(name), dir / "ck"));
      auto one = Export(dir / "ck", dir / "meg1", impl, 1);
      ASSERT_TRUE(one.ok()) << one.status();
      auto two = Export(dir / "ck", dir / "meg2", impl, 2);
      ASSERT_TRUE(two.ok()) << two.status();
      const std::map<std::string, Tensor> whole = ReadModel(Rank(dir / "meg1", 0));
      const bool te = std::string(impl) == "transformer_engine";
      // name within layer 0's self_attention -> split (-1 whole, 0 rows, 1 columns)
      std::map<std::string, int> want = {
          {"linear_kv_down_proj.weight", te ? -1 : 0}, {"linear_kv_up_proj.weight", 0}, {"linear_proj.weight", 1}};
      if (name == "lora_yarn") {
        want["linear_q_down_proj.weight"] = te ? -1 : 0;
        want["linear_q_up_proj.weight"] = 0;
        want[te ? "linear_q_up_proj.layer_norm_weight" : "q_layernorm.weight"] = -1;
        want[te ? "linear_kv_up_proj.layer_norm_weight" : "kv_layernorm.weight"] = -1;
      } else {
        want["linear_q_proj.weight"] = 0;
        want["linear_proj.bias"] = -1;  // RowParallelLinear's bias: whole
      }
      for (int64_t t = 0; t < 2; ++t) {
        const std::map<std::string, Tensor> shard = ReadModel(Rank(dir / "meg2", t));
        for (const auto& [part, split] : want) {
          SCOPED_TRACE(::testing::Message() << "rank " << t << " " << part);
          const std::string key = "decoder.layers.0.self_attention." + part;
          ASSERT_TRUE(whole.count(key) && shard.count(key));
          const Tensor &w = whole.at(key), &s = shard.at(key);
          std::vector<int64_t> shape = w.shape;
          if (split >= 0) shape[static_cast<size_t>(split)] /= 2;
          ASSERT_EQ(s.shape, shape);
          const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1, full_cols = w.data.size() / w.shape[0];
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t col = 0; col < cols; ++col) {
              const int64_t wr = split == 0 ? t * rows + r : r, wc = split == 1 ? t * cols + col : col;
              ASSERT_EQ(s.data[static_cast<size_t>(r * cols + col)], w.data[static_cast<size_t>(wr * full_cols + wc)])
                  << r << "," << col;
            }
        }
      }
    }
}

// megatron-core's state_dict at tensor size 2, per rank (tests/data/interop/mla_megatron_names_tp2.txt, written by
// check_mla_export_with_megatron_core.py): "name shape" of each parameter, in order, of case `name`'s rank.
std::vector<std::string> MegatronCoreNames(const std::string& name, int64_t rank) {
  std::ifstream in(testing::SourceDir() + "/tests/data/interop/mla_megatron_names_tp2.txt");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string c, kind, n, shape;
    int64_t r = -1;
    ls >> c >> r >> kind >> n >> shape;
    if (c == name && r == rank && kind == "param") out.push_back(n + " " + shape);
  }
  return out;
}

// The local spec's T=2 export: each rank's parameters, names, shapes and order, are megatron-core's own at tensor
// size 2.
TEST_F(MegatronMlaTp, EachRanksNamesAndShapesAreMegatronCoresAtTensorSize2) {
  for (const std::string name : {"lora_yarn", "plain_rope", "deepseek"}) {
    testing::TempDir dir;
    ASSERT_NO_FATAL_FAILURE(Save(Mla(name), dir / "ck"));
    ASSERT_TRUE(Export(dir / "ck", dir / "meg", "local", 2).ok());
    for (int64_t t = 0; t < 2; ++t) {
      SCOPED_TRACE(::testing::Message() << name << " rank " << t);
      const std::vector<std::string> want = MegatronCoreNames(name, t);
      ASSERT_GT(want.size(), 20u) << "mla_megatron_names_tp2.txt has no " << name << " rank " << t;
      auto f = torchfmt::TorchArchiveReader::Open(Rank(dir / "meg", t));
      ASSERT_TRUE(f.ok()) << f.status();
      std::vector<std::string> got;
      for (const auto& [k, v] : (*f)->root().Get("model")->dict) {
        if (k->s.ends_with("_extra_state") || k->s.ends_with("router.expert_bias")) continue;  // not parameters
        std::string shape;
        for (size_t i = 0; i < v->tensor.shape.size(); ++i)
          shape += (i ? "x" : "") + std::to_string(v->tensor.shape[i]);
        got.push_back(k->s + " " + shape);
      }
      EXPECT_EQ(got, want);
    }
  }
}

// ptk -> megatron at T=2 -> ptk: every weight and moment bit for bit, with experts, both specs, pipeline sizes 1 and 2,
// and from the distributed optimizer's distrib_optim.pt (the dense models: MoE's is not written).
TEST_F(MegatronMlaTp, PtkToMegatronAtTp2ToPtkIsBitForBit) {
  for (const std::string name : {"lora_yarn", "plain_rope", "deepseek"})
    for (int64_t pp : {1, 2})
      for (const char* impl : {"transformer_engine", "local"})
        for (bool distopt : {false, true}) {
          if (distopt && name == "deepseek") continue;
          SCOPED_TRACE(::testing::Message() << name << " pp " << pp << " " << impl << (distopt ? " distopt" : ""));
          testing::TempDir dir;
          ASSERT_NO_FATAL_FAILURE(Save(Mla(name), dir / "ck"));
          auto s = Export(dir / "ck", dir / "meg", impl, 2, pp, distopt);
          ASSERT_TRUE(s.ok()) << s.status();
          ASSERT_TRUE(std::filesystem::exists(dir / ("meg/iter_0000004/" + megatron::RankDir(1, pp - 1, pp))));
          auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
          ASSERT_TRUE(back.ok()) << back.status();
          EXPECT_NE(back->train_flags.find("--multi-latent-attention"), std::string::npos) << back->train_flags;
          auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
          ASSERT_TRUE(ck.ok()) << ck.status();
          EXPECT_TRUE(ck->config.mla());
          EXPECT_TRUE(ck->params == params_);
          EXPECT_TRUE(ck->m1 == m1_);
          EXPECT_TRUE(ck->m2 == m2_);
        }
}

// A T=2 checkpoint imported and exported again at T=4 (ptk's checkpoint holds whole tensors: any T) is, tensor for
// tensor on each rank, the direct T=4 export.
TEST_F(MegatronMlaTp, ATp2ImportExportedAtTp4IsTheDirectTp4Export) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Save(Mla("lora_yarn"), dir / "ck"));
  ASSERT_TRUE(Export(dir / "ck", dir / "meg2", "local", 2).ok());
  ASSERT_TRUE(ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg2", dir / "back")).ok());
  auto via = Export(dir / "back", dir / "meg4via", "local", 4);
  ASSERT_TRUE(via.ok()) << via.status();
  ASSERT_TRUE(Export(dir / "ck", dir / "meg4", "local", 4).ok());
  for (int64_t t = 0; t < 4; ++t) {
    const auto a = ReadModel(Rank(dir / "meg4via", t)), b = ReadModel(Rank(dir / "meg4", t));
    ASSERT_EQ(a.size(), b.size());
    ASSERT_GT(a.size(), 10u);
    for (const auto& [k, v] : b) {
      ASSERT_TRUE(a.count(k)) << k;
      EXPECT_EQ(a.at(k).shape, v.shape) << k;
      EXPECT_TRUE(a.at(k).data == v.data) << k;
    }
  }
}

// The local spec splits the down projections' rows (kv_lora_rank 14 + qk_pos_emb_head_dim 8 = 22) over the ranks, as
// megatron-core's ColumnParallelLinear does: 22 rows over 4 ranks refused naming the flag, the tensor and the rows;
// Transformer Engine's spec keeps them whole and is written.
TEST_F(MegatronMlaTp, LocalSpecRefusesDownProjectionsThatDoNotSplit) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Save(Mla("lora_yarn", 14), dir / "ck"));
  auto s = Export(dir / "ck", dir / "meg", "local", 4);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--target-tensor-parallel-size 4 does not divide linear_kv_down_proj's 22 rows "
                                      "(kv_lora_rank 14 + qk_pos_emb_head_dim 8)"),
            std::string::npos)
      << s.status();
  EXPECT_FALSE(std::filesystem::exists(dir / "meg/iter_0000004"));
  auto te = Export(dir / "ck", dir / "meg", "transformer_engine", 4);
  ASSERT_TRUE(te.ok()) << te.status();
}

// A T=2 checkpoint missing rank 1's file (args.tensor_model_parallel_size 2): refused naming it, nothing written.
TEST_F(MegatronMlaTp, ImportRefusesAMissingRank) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Save(Mla("lora_yarn"), dir / "ck"));
  ASSERT_TRUE(Export(dir / "ck", dir / "meg", "local", 2).ok());
  std::filesystem::remove(Rank(dir / "meg", 1));
  auto r = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("mp_rank_01"), std::string::npos) << r.status();
  EXPECT_FALSE(std::filesystem::exists(dir / "back/iter_0000004"));
}

}  // namespace
}  // namespace ptk
