// ptk-convert's multi-latent attention checkpoints in Megatron's `torch` format (--saver megatron, --loader megatron):
// megatron-core 0.16.1's MLASelfAttention names (linear_q_proj, or linear_q_down_proj and linear_q_up_proj;
// linear_kv_down_proj, linear_kv_up_proj; the latents' norms as q_layernorm / kv_layernorm under the local spec,
// fused into the up projections' layer_norm_weight under Transformer Engine's; linear_proj first, as MLA builds it),
// the args MLATransformerConfig is built from; ptk -> megatron -> ptk gives back every weight and AdamW moment bit for
// bit under both specs at pipeline sizes 1 and 2, with and without a q latent, with DeepSeek-style experts; the names
// and shapes written are megatron-core's own (tests/data/interop/mla_megatron_names.txt, written by
// tests/support/check_mla_export_with_megatron_core.py, which also loads the export in megatron-core and compares its
// logits with ptk's); the distributed optimizer's distrib_optim.pt both ways; what is not supported (torch_dist, YaRN
// settings other than megatron-core's defaults) and a checkpoint whose tensors disagree with its args are refused.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
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

using torchfmt::PyRef;
using torchfmt::PyValue;

// The models of check_mla_export_with_megatron_core.py's cases, as ptk-train builds them from its flags.
GPTConfig Mla(const std::string& name) {
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
  c.kv_lora_rank = 16;
  c.qk_head_dim = 16;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 12;
  if (name == "plain_rope") {  // linear_q_proj, no latent norms, LayerNorm, GELU, biases, learned positions, tied
    c.mla_yarn = false;
    c.rotary_base = 20000;
    return c;
  }
  c.q_lora_rank = 24;
  c.qk_layernorm = true;
  c.normalization = Normalization::kRMSNorm;
  c.layernorm_epsilon = 1e-6;
  c.swiglu = true;
  c.add_bias_linear = false;
  c.position_embedding = PositionEmbedding::kRope;
  c.rotary_scaling_factor = 4;
  c.mscale = 0.7;
  c.mscale_all_dim = 0.9;
  c.untie_embeddings_and_output_weights = true;
  if (name == "deepseek") {  // experts on the second layer, sigmoid-routed with the expert bias, shared experts
    c.num_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_layer_pattern = {0, 1};
    c.moe_router_sigmoid = true;
    c.moe_router_enable_expert_bias = true;
    c.moe_router_bias_update_rate = 0.05;
    c.moe_router_topk_scaling_factor = 2.5;
    c.moe_shared_expert_intermediate_size = 32;
    c.moe_aux_loss_coeff = 0.01;
  }
  return c;
}
const char* const kCases[] = {"lora_yarn", "plain_rope", "deepseek"};

// One entry of megatron-core's state_dict: kind (param, buffer, extra) and shape ("64x16", "-" for an extra state).
struct Entry {
  std::string kind, name, shape;
};
// The committed names of `name`'s case, in megatron-core's state_dict order.
std::vector<Entry> MegatronCoreNames(const std::string& name) {
  std::ifstream in(testing::SourceDir() + "/tests/data/interop/mla_megatron_names.txt");
  std::vector<Entry> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string c;
    Entry e;
    ls >> c >> e.kind >> e.name >> e.shape;
    if (c == name) out.push_back(e);
  }
  return out;
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "x" : "") + std::to_string(s[i]);
  return out.empty() ? "scalar" : out;
}

// Rewrites the rank file at `path`: `edit` gets a copy of its root dict (entries shared with the file's) to change;
// every tensor's storage carried over (fp32, as the export wrote them).
void RewriteRank(const std::string& path, const std::function<void(PyValue* root)>& edit) {
  auto reader = torchfmt::TorchArchiveReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<torchfmt::StorageBlob> blobs;
  std::function<void(const PyValue&)> walk = [&](const PyValue& v) {
    if (v.kind == PyValue::Kind::kTensor) {
      auto data = (*reader)->ReadFloat(v.tensor, "t");
      ASSERT_TRUE(data.ok()) << data.status();
      blobs.push_back(torchfmt::MakeBlob(v.tensor.storage_key, torchfmt::DType::kFloat32, data->data(),
                                         static_cast<int64_t>(data->size())));
    }
    for (const PyRef& item : v.items) walk(*item);
    for (const auto& [k, val] : v.dict) walk(*val);
    if (v.state) walk(*v.state);
  };
  walk((*reader)->root());
  PyRef root = torchfmt::MakeDict();
  for (const auto& [k, v] : (*reader)->root().dict) torchfmt::DictSet(root.get(), k, v);
  edit(root.get());
  ASSERT_TRUE(torchfmt::WriteTorchFile(path, *root, blobs).ok());
}

// Sets `d`'s entry `key` to `v` (in its place, or added).
void Replace(PyValue* d, const std::string& key, PyRef v) {
  for (auto& [k, val] : d->dict)
    if (k->kind == PyValue::Kind::kStr && k->s == key) {
      val = std::move(v);
      return;
    }
  torchfmt::DictSet(d, key, std::move(v));
}

// A copy of dict `d` without the entry `skip`, with `set` entries added.
PyRef DictWithout(const PyValue& d, const std::string& skip, const std::vector<std::pair<std::string, PyRef>>& set) {
  PyRef out = torchfmt::MakeDict();
  for (const auto& [k, v] : d.dict)
    if (k->s != skip) torchfmt::DictSet(out.get(), k, v);
  for (const auto& [k, v] : set) torchfmt::DictSet(out.get(), k, v);
  return out;
}

class MegatronMla : public testing::DistinctCheckpointTest {
 protected:
  void Save(const GPTConfig& c, const std::string& dir) {
    TrainState st;
    st.iteration = 4;
    st.adam_step = 4;
    st.consumed_train_samples = 8;
    st.settings = {{"--vocab-size", "500"}, {"--lr", "0.003"}, {"--global-batch-size", "2"}};
    for (const auto& kv : MlaRunSettings(c)) st.settings.push_back(kv);
    if (c.moe()) {
      for (const auto& kv : MoeRunSettings(c)) st.settings.push_back(kv);
      st.buffers.emplace_back("decoder.layers.1.mlp.router.expert_bias", std::vector<float>{0.5f, -0.25f, 1e-3f, 0});
    }
    SaveDistinct(c, dir, st);
  }
  // Exports `name`'s model from dir/ck to dir/meg under `impl`'s names at pipeline size `pp`.
  void Export(const std::string& name, const testing::TempDir& dir, const char* impl, int64_t pp = 1) {
    ASSERT_NO_FATAL_FAILURE(Save(Mla(name), dir / "ck"));
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
    o.saver_transformer_impl = impl;
    o.target_pipeline_parallel_size = pp;
    auto s = ExportToMegatron(o);
    ASSERT_TRUE(s.ok()) << s.status();
  }
};

constexpr char kRank[] = "meg/iter_0000004/mp_rank_00/model_optim_rng.pt";

// The local spec's names, shapes and parameter order are megatron-core's state_dict's for each case (its
// _extra_state entries and the router's expert_bias buffer included).
TEST_F(MegatronMla, ExportWritesMegatronCoresNamesAndShapes) {
  for (const std::string name : kCases) {
    SCOPED_TRACE(name);
    const std::vector<Entry> want = MegatronCoreNames(name);
    ASSERT_GT(want.size(), 20u) << "tests/data/interop/mla_megatron_names.txt has no case " << name;
    testing::TempDir dir;
    ASSERT_NO_FATAL_FAILURE(Export(name, dir, "local"));
    auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
    ASSERT_TRUE(f.ok()) << f.status();
    const PyValue* model = (*f)->root().Get("model");
    ASSERT_NE(model, nullptr);
    std::vector<std::string> params, want_params;
    std::set<std::string> others, want_others;
    for (const auto& [k, v] : model->dict) {
      const bool extra = k->s.ends_with("_extra_state"), buffer = k->s.ends_with("router.expert_bias");
      const std::string entry = k->s + " " + (extra ? "-" : ShapeText(v->tensor.shape));
      if (extra || buffer) {
        others.insert(entry);
      } else {
        params.push_back(entry);
      }
    }
    for (const Entry& e : want) {
      if (e.kind == "param") {
        want_params.push_back(e.name + " " + e.shape);
      } else {
        want_others.insert(e.name + " " + e.shape);
      }
    }
    EXPECT_EQ(params, want_params);  // the order megatron-core's optimizer numbers them in
    EXPECT_EQ(others, want_others);
  }
}

// Transformer Engine's spec (which megatron-core cannot build without TE, so read from get_gpt_layer_with_
// transformer_engine_spec): the input norm a TENorm of its own, the latents' norms in the up projections, the dense
// layer's pre-MLP norm in linear_fc1, the MoE layer's apart; named_parameters' order, each module's extra state.
TEST_F(MegatronMla, TransformerEngineNamesFuseTheLatentNormsIntoTheUpProjections) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Export("deepseek", dir, "transformer_engine"));
  auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
  ASSERT_TRUE(f.ok()) << f.status();
  const PyValue* model = (*f)->root().Get("model");
  std::vector<std::string> layer0, extras;
  for (const auto& [k, v] : model->dict) {
    if (!k->s.starts_with("decoder.layers.0.")) continue;
    (k->s.ends_with("_extra_state") ? extras : layer0).push_back(k->s.substr(17));
  }
  EXPECT_EQ(layer0, (std::vector<std::string>{
                        "input_layernorm.weight", "self_attention.linear_proj.weight",
                        "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
                        "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
                        "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.weight",
                        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}));
  EXPECT_EQ(std::set<std::string>(extras.begin(), extras.end()),
            (std::set<std::string>{
                "self_attention.core_attention._extra_state", "self_attention.linear_proj._extra_state",
                "self_attention.linear_q_down_proj._extra_state", "self_attention.linear_q_up_proj._extra_state",
                "self_attention.linear_kv_down_proj._extra_state", "self_attention.linear_kv_up_proj._extra_state",
                "mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"}));
  EXPECT_NE(model->Get("decoder.layers.1.pre_mlp_layernorm.weight"), nullptr);  // the MoE layer's TENorm
  EXPECT_EQ(model->Get("decoder.layers.0.self_attention.q_layernorm.weight"), nullptr);
  EXPECT_EQ(model->Get("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"), nullptr);
}

// The args Megatron-LM's core_transformer_config_from_args builds MLATransformerConfig from.
TEST_F(MegatronMla, ExportWritesTheArgsOfMlaTransformerConfig) {
  for (const std::string name : {"lora_yarn", "plain_rope"}) {
    SCOPED_TRACE(name);
    testing::TempDir dir;
    ASSERT_NO_FATAL_FAILURE(Export(name, dir, "local"));
    auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
    ASSERT_TRUE(f.ok()) << f.status();
    const PyValue* args = (*f)->root().Get("args");
    using megatron::BoolAttr, megatron::NumAttr, megatron::StrAttr;
    const bool lora = name == "lora_yarn";
    EXPECT_TRUE(BoolAttr(args, "multi_latent_attention", false));
    if (lora) {
      EXPECT_EQ(NumAttr(args, "q_lora_rank"), 24.0);
    } else {
      EXPECT_EQ(args->Get("q_lora_rank")->kind, PyValue::Kind::kNone);  // linear_q_proj
    }
    EXPECT_EQ(NumAttr(args, "kv_lora_rank"), 16.0);
    EXPECT_EQ(NumAttr(args, "qk_head_dim"), 16.0);
    EXPECT_EQ(NumAttr(args, "qk_pos_emb_head_dim"), 8.0);
    EXPECT_EQ(NumAttr(args, "v_head_dim"), 12.0);
    EXPECT_EQ(StrAttr(args, "rope_type"), lora ? "yarn" : "rope");
    EXPECT_EQ(NumAttr(args, "rotary_scaling_factor"), lora ? 4.0 : 1.0);
    EXPECT_EQ(NumAttr(args, "mscale"), lora ? 0.7 : 1.0);
    EXPECT_EQ(NumAttr(args, "mscale_all_dim"), lora ? 0.9 : 0.0);
    EXPECT_EQ(NumAttr(args, "rotary_base"), lora ? 10000.0 : 20000.0);
    EXPECT_EQ(BoolAttr(args, "qk_layernorm", !lora), lora);
    EXPECT_FALSE(BoolAttr(args, "group_query_attention", true));
  }
}

TEST_F(MegatronMla, PtkToMegatronToPtkIsBitForBit) {
  for (const std::string name : kCases)
    for (int64_t pp : {1, 2})
      for (const char* impl : {"transformer_engine", "local"}) {
        SCOPED_TRACE(::testing::Message() << name << " pp " << pp << " " << impl);
        testing::TempDir dir;
        ASSERT_NO_FATAL_FAILURE(Export(name, dir, impl, pp));
        auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
        ASSERT_TRUE(back.ok()) << back.status();
        const GPTConfig c = Mla(name);
        for (const std::string& flag :
             {fmt::format(" --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
                          "--v-head-dim 12 --rope-type {}",
                          c.mla_yarn ? "yarn" : "rope"),
              std::string(c.q_lora_rank ? " --q-lora-rank 24" : " --rotary-base 20000"),
              std::string(c.mla_yarn ? " --rotary-scaling-factor 4 --mscale 0.7 --mscale-all-dim 0.9" : ""),
              std::string(c.qk_layernorm ? " --qk-layernorm" : ""),
              std::string(c.moe() ? " --moe-router-enable-expert-bias" : "")})
          EXPECT_NE(back->train_flags.find(flag), std::string::npos) << flag << "\n" << back->train_flags;
        auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
        ASSERT_TRUE(ck.ok()) << ck.status();
        const GPTConfig& r = ck->config;
        EXPECT_TRUE(r.mla());
        EXPECT_EQ(r.q_lora_rank, c.q_lora_rank);
        EXPECT_EQ(r.kv_lora_rank, 16);
        EXPECT_EQ(r.qk_head_dim, 16);
        EXPECT_EQ(r.qk_pos_emb_head_dim, 8);
        EXPECT_EQ(r.v_head_dim, 12);
        EXPECT_EQ(r.mla_yarn, c.mla_yarn);
        EXPECT_EQ(r.rotary_base, c.rotary_base);
        EXPECT_EQ(r.rotary_scaling_factor, c.rotary_scaling_factor);
        EXPECT_EQ(r.mscale, c.mscale);
        EXPECT_EQ(r.mscale_all_dim, c.mscale_all_dim);
        EXPECT_EQ(r.qk_layernorm, c.qk_layernorm);
        EXPECT_EQ(r.moe_layer_pattern, c.moe_layer_pattern);
        EXPECT_TRUE(ck->params == params_);
        EXPECT_TRUE(ck->m1 == m1_);
        EXPECT_TRUE(ck->m2 == m2_);
        EXPECT_EQ(ck->state.buffers, buffers_);
        EXPECT_EQ(ck->state.adam_step, 4);
        for (const auto& kv : MlaRunSettings(c))  // as ptk-train records them: its resume compares equal
          EXPECT_NE(std::find(ck->state.settings.begin(), ck->state.settings.end(), kv), ck->state.settings.end())
              << kv.first;
      }
}

// The distributed optimizer's distrib_optim.pt (megatron-core's grad buffer in named_parameters' reverse order, as
// check_mla_export_with_megatron_core.py loads it): ptk -> megatron -> ptk bit for bit from the fp32 params and
// moments there, both specs, pipeline sizes 1 and 2.
TEST_F(MegatronMla, DistributedOptimizerGoesPtkToMegatronToPtkBitForBit) {
  for (const std::string name : {"lora_yarn", "plain_rope"})
    for (int64_t pp : {1, 2})
      for (const char* impl : {"transformer_engine", "local"}) {
        SCOPED_TRACE(::testing::Message() << name << " pp " << pp << " " << impl);
        testing::TempDir dir;
        ASSERT_NO_FATAL_FAILURE(Save(Mla(name), dir / "ck"));
        ConvertOptions o = testing::ConvertOpts("ptk", "megatron", dir / "ck", dir / "meg");
        o.saver_transformer_impl = impl;
        o.target_pipeline_parallel_size = pp;
        o.target_use_distributed_optimizer = true;
        auto s = ExportToMegatron(o);
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_TRUE(std::filesystem::exists(
            dir / ("meg/iter_0000004/" + megatron::RankDir(0, pp - 1, pp) + "/distrib_optim.pt")));
        auto back = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
        ASSERT_TRUE(back.ok()) << back.status();
        auto ck = LoadPtkCheckpoint(dir / "back", 0, false, /*with_optimizer=*/true);
        ASSERT_TRUE(ck.ok()) << ck.status();
        EXPECT_TRUE(ck->params == params_);
        EXPECT_TRUE(ck->m1 == m1_);
        EXPECT_TRUE(ck->m2 == m2_);
        EXPECT_EQ(ck->state.adam_step, 4);
      }
}

// A Megatron MLA checkpoint whose tensors disagree with its args (kv_lora_rank 8 for a latent of 16; q_lora_rank None
// beside linear_q_down_proj), or which misses a tensor: refused naming the file and the tensor, nothing written.
TEST_F(MegatronMla, ImportRefusesTensorsThatDisagreeWithTheArgs) {
  struct Damage {
    std::string what, arg, tensor, message;
    PyRef value;
  };
  const std::string layer = "decoder.layers.0.self_attention.";
  const std::vector<Damage> damages = {
      {"kv_lora_rank 8", "kv_lora_rank", "",
       "tensor " + layer +
           "linear_kv_down_proj.weight: shape [24, 64], the "
           "checkpoint's args ask for [16, 64] on each of 1 tensor-parallel ranks",
       torchfmt::MakeInt(8)},
      {"q_lora_rank None", "q_lora_rank", "",
       "tensor " + layer +
           "linear_q_down_proj.weight: not a weight of the GPT "
           "model the checkpoint's args describe",
       torchfmt::MakeNone()},
      {"linear_kv_up_proj missing", "", layer + "linear_kv_up_proj.weight",
       "tensor " + layer + "linear_kv_up_proj.weight: missing", nullptr},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.what);
    testing::TempDir dir;
    ASSERT_NO_FATAL_FAILURE(Export("lora_yarn", dir, "local"));
    ASSERT_NO_FATAL_FAILURE(RewriteRank(dir / kRank, [&](PyValue* root) {
      if (!d.arg.empty())
        Replace(root, "args",
                torchfmt::MakeNamespace(DictWithout(*root->Get("args")->state, d.arg, {{d.arg, d.value}})));
      if (!d.tensor.empty()) Replace(root, "model", DictWithout(*root->Get("model"), d.tensor, {}));
    }));
    auto r = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back"));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(d.message), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(std::string(dir / kRank)), std::string::npos) << r.status();
    EXPECT_FALSE(std::filesystem::exists(dir / "back/iter_0000004"));
  }
}

// What ptk's MLA does not compute or the import does not read, each named.
TEST_F(MegatronMla, ImportRefusesWhatPtksMlaDoesNotRead) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Export("lora_yarn", dir, "local"));
  auto f = torchfmt::TorchArchiveReader::Open(dir / kRank);
  ASSERT_TRUE(f.ok()) << f.status();
  const PyValue& state = *(*f)->root().Get("args")->state;
  const ConvertOptions o = testing::ConvertOpts("megatron", "ptk", dir / "meg", dir / "back");
  const std::vector<std::pair<std::vector<std::pair<std::string, PyRef>>, std::string>> cases = {
      {{{"rope_type", torchfmt::MakeStr("mrope")}}, "--rope-type mrope"},
      {{{"beta_fast", torchfmt::MakeFloat(16)}}, "args.beta_fast 16 (ptk's YaRN: 32)"},
      {{{"yarn_original_max_position_embeddings", torchfmt::MakeInt(8192)}},
       "args.yarn_original_max_position_embeddings 8192 (ptk's YaRN: 4096)"},
      {{{"mla_down_proj_fusion", torchfmt::MakeBool(true)}}, "--mla-down-proj-fusion"},
  };
  for (const auto& [set, message] : cases) {
    SCOPED_TRACE(message);
    PyRef args = torchfmt::MakeNamespace(DictWithout(state, set[0].first, set));
    auto m = megatron::ModelFromArgs(args.get(), "meg/args", o, 1);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find(message), std::string::npos) << m.status();
  }
  auto tp2 = megatron::ModelFromArgs((*f)->root().Get("args"), "meg/args", o, 2);  // megatron_mla_tp_test reads it
  ASSERT_TRUE(tp2.ok()) << tp2.status();
  auto ok = megatron::ModelFromArgs((*f)->root().Get("args"), "meg/args", o, 1);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->config.mla());
}

// A torch_dist checkpoint whose args mark MLA (tests/data/torch_dist_llama's common.pt given multi_latent_attention):
// args no MLA model has (grouped queries), refused in one line naming common.pt, nothing written.
TEST(MegatronMlaDist, ATorchDistCheckpointWhoseArgsAreNoMlaModelIsRefusedNamingCommonPt) {
  testing::TempDir dir;
  const std::string meg = dir / "meg";
  std::filesystem::copy(testing::SourceDir() + "/tests/data/torch_dist_llama/plain_bf16_tp1", meg,
                        std::filesystem::copy_options::recursive);
  const std::string common = meg + "/iter_0000003/common.pt";
  ASSERT_NO_FATAL_FAILURE(RewriteRank(common, [&](PyValue* root) {
    Replace(root, "args",
            torchfmt::MakeNamespace(DictWithout(*root->Get("args")->state, "multi_latent_attention",
                                                {{"multi_latent_attention", torchfmt::MakeBool(true)}})));
  }));
  auto r = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", meg, dir / "out"));
  ASSERT_FALSE(r.ok());
  // torch_dist's MLA keys are read (megatron_dist_moe_test): these args (the Llama fixture's grouped queries) are no
  // MLA model.
  EXPECT_EQ(r.status().message(),
            common + ": multi_latent_attention with num_query_groups: MLA has a key and value per head");
  EXPECT_FALSE(std::filesystem::exists(dir / "out/iter_0000003"));
}

}  // namespace
}  // namespace ptk
