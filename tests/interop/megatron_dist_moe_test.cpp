// ptk-convert --loader megatron on torch_dist checkpoints of mixture-of-experts and multi-latent attention models
// that megatron-core 0.16.1 itself wrote (tests/data/torch_dist_moe/, tests/support/make_torch_dist_moe_fixture.py):
// SequentialMLP experts with sigmoid routing and the expert bias, a gated shared expert, layers MoE, dense, MoE, with
// the plain optimizer, at tensor size 1 and resharded by megatron-core to tensor size 2 and to expert size 2 (the
// model only); MLA with
// q_lora_rank and the latent norms. Each converts to the weights, AdamW moments and expert biases expected.json
// records (megatron-core's own model and optimizer) bit for bit, each reshard to exactly TP 1's; ptk-train --load
// resumes from it; damaged or mismatched copies are refused in one line naming the file and the key.
#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/hash.h"
#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "interop/torch_dist.h"
#include "interop/torch_format.h"
#include "tests/interop/megatron_dist_convert.h"
#include "tests/test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

using testing::Convert;
using testing::ConvertAndLoad;
using testing::Converted;
using testing::HexOf;
using testing::ReadFile;
using testing::Replace;
using testing::TempDir;
using testing::WriteFile;

std::string Fixture(const std::string& name) { return testing::SourceDir() + "/tests/data/torch_dist_moe/" + name; }

class TorchDistMoe : public ::testing::TestWithParam<std::string> {
 protected:
  TempDir dir_;
};

// Every tensor's weight and moments, and every router's expert bias, against expected.json's SHA-256 (little-endian
// fp32, as the generator hashes them); the iteration and Adam's step.
TEST_P(TorchDistMoe, ConvertsToMegatronCoresValuesBitForBit) {
  const std::string name = GetParam();
  Converted c = ConvertAndLoad(Fixture(name), dir_ / "ptk");
  ASSERT_TRUE(c.layout.has_value());
  simdjson::dom::parser parser;
  const simdjson::padded_string json = simdjson::padded_string(ReadFile(Fixture(name) + "/expected.json"));
  simdjson::dom::element exp = parser.parse(json);
  EXPECT_EQ(c.state.iteration, int64_t(exp["iteration"]));
  // moe_ep2 is the model only (saved without the optimizer: make_torch_dist_moe_fixture.py): its moments are zero.
  const bool moments = name != "moe_ep2";
  EXPECT_EQ(c.state.adam_step, moments ? int64_t(exp["adam_step"]) : 0);
  const GPTConfig& g = c.summary.config;
  if (name.rfind("moe", 0) == 0) {
    EXPECT_EQ(g.num_experts, 4);
    EXPECT_TRUE(g.moe_router_enable_expert_bias && g.moe_router_sigmoid && g.moe_shared_expert_gate);
    EXPECT_EQ(g.moe_layers(), 2);
  } else {
    EXPECT_TRUE(g.mla() && g.q_lora_rank == 8);
  }
  ASSERT_NO_FATAL_FAILURE(testing::ExpectTensorsAsRecorded(c, exp["tensors"], name, moments));
  simdjson::dom::object buffers = exp["buffers"];
  EXPECT_EQ(c.state.buffers.size(), buffers.size());
  for (const auto& [bname, values] : c.state.buffers) {
    simdjson::dom::element e;
    ASSERT_EQ(buffers[bname].get(e), simdjson::SUCCESS) << bname << " not in expected.json";
    EXPECT_EQ(HexOf(values.data(), static_cast<int64_t>(values.size())), std::string(std::string_view(e["sha256"])))
        << name << ": " << bname;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TorchDistMoe, ::testing::Values("moe_tp1", "moe_tp2", "moe_ep2", "mla_tp1"));

// megatron-core's reshards of the TP 1 checkpoint to tensor size 2 (the experts split over the tensor ranks) and to
// expert size 2 (each rank two whole experts): the same ptk checkpoint, every array equal.
TEST(TorchDistMoeTp, EachReshardEqualsTensorSizeOne) {
  TempDir dir;
  Converted one = ConvertAndLoad(Fixture("moe_tp1"), dir / "one");
  ASSERT_FALSE(one.w.empty());
  for (const std::string name : {"moe_tp2", "moe_ep2"}) {
    Converted two = ConvertAndLoad(Fixture(name), dir / name);
    EXPECT_EQ(one.w, two.w) << name;
    if (name == "moe_tp2") {  // moe_ep2: the model only
      EXPECT_EQ(one.m1, two.m1) << name;
      EXPECT_EQ(one.m2, two.m2) << name;
    }
    EXPECT_EQ(one.state.buffers, two.state.buffers) << name;
    EXPECT_EQ(one.summary.train_flags.substr(0, 200), two.summary.train_flags.substr(0, 200)) << name;
  }
  Converted ep = ConvertAndLoad(Fixture("moe_ep2"), dir / "ep");
  bool noted = false;  // the expert-parallel layout is named, not refused
  for (const std::string& note : ep.summary.notes)
    noted |= note.find("--expert-model-parallel-size 2") != std::string::npos;
  EXPECT_TRUE(noted);
}

// ptk-train --load of each converted checkpoint runs on from it: its flags are the model's, and it saves.
TEST(TorchDistMoeTp, PtkTrainResumesFromTheConversion) {
  TempDir dir;
  for (const std::string name : {"moe_tp2", "mla_tp1"}) {
    const std::string ptk = dir / (name + "-ptk"), out = dir / (name + "-resumed");
    Converted a = ConvertAndLoad(Fixture(name), ptk);
    ASSERT_TRUE(a.layout.has_value());
    const std::string cmd =
        testing::Tool("ptk-train") + " " + a.summary.train_flags +
        " --micro-batch-size 2 --global-batch-size 2 --train-iters 3 --lr 1e-2 --min-lr 1e-2"
        " --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8"
        " --clip-grad 1.0 --use-checkpoint-opt_param-scheduler --mock-data --eval-iters 0 --log-interval 1 --threads 1"
        " --load " +
        testing::ShellQuote(ptk) + " --save " + testing::ShellQuote(out);
    const testing::CommandResult r = testing::RunCmd(cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    Converted b;
    b.layout = a.layout;
    const absl::Status st = LoadCheckpoint(out, 3, *b.layout, &b.w, &b.m1, &b.m2, &b.state);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(b.state.adam_step, a.state.adam_step + 1) << name;
    EXPECT_NE(a.w, b.w) << name;
  }
}

void ExpectRefused(const std::string& name, const std::function<void(const std::string&)>& damage,
                   const std::vector<std::string>& needles) {
  testing::ExpectConvertRefused(Fixture(name), "iter_0000002", damage, needles);
}

TEST(TorchDistMoeRefused, AFlippedByteInAnExpertNamesTheFileOffsetAndKey) {
  ExpectRefused("moe_tp2",
                [](const std::string& d) {
                  auto ck = torchdist::DistCheckpoint::Open(d);
                  ASSERT_TRUE(ck.ok()) << ck.status();
                  const torchdist::Chunk& c =
                      (*ck)->tensors().at("decoder.layers.2.mlp.experts.experts.linear_fc1.weight").chunks.back();
                  std::string data = ReadFile(d + "/" + c.file);
                  // A byte of the tensor's data: the chunk archive's data/0 record, after its zip local header.
                  const size_t name = data.find("/data/0", c.offset);
                  const size_t header = data.rfind(std::string("PK\x03\x04", 4), name);
                  ASSERT_TRUE(name != std::string::npos && header != std::string::npos && header >= c.offset);
                  auto u16 = [&](size_t at) { return size_t(uint8_t(data[at])) | size_t(uint8_t(data[at + 1])) << 8; };
                  data[header + 30 + u16(header + 26) + u16(header + 28) + 5] ^= 0x40;
                  WriteFile(d + "/" + c.file, data);
                },
                {".distcp: byte ", "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"});
}

TEST(TorchDistMoeRefused, ATruncatedDataFileNamesIt) {
  ExpectRefused("mla_tp1", [](const std::string& d) { std::filesystem::resize_file(d + "/__0_0.distcp", 1000); },
                {"__0_0.distcp", "byte "});
}

TEST(TorchDistMoeRefused, AMissingExpertsKeyIsNamed) {
  // The routers' expert bias renamed away: the key is missing (and the renamed one is no weight of the model).
  ExpectRefused("moe_tp1",
                [](const std::string& d) {
                  Replace(d + "/.metadata", "decoder.layers.2.mlp.router.expert_bias",
                          "decoder.layers.2.mlp.router.expert_bxas");
                },
                {".metadata", "decoder.layers.2.mlp.router.expert_bxas", "not a weight"});
}

// common.pt's args with `key` set to `value` (the other entries of common.pt kept).
void RewriteArgs(const std::string& common, const std::string& key, torchfmt::PyRef value) {
  auto f = torchfmt::TorchArchiveReader::Open(common);
  ASSERT_TRUE(f.ok()) << f.status();
  const torchfmt::PyValue* args = (*f)->root().Get("args");
  ASSERT_TRUE(args && args->state && args->state->kind == torchfmt::PyValue::Kind::kDict);
  torchfmt::PyRef attrs = torchfmt::MakeDict();
  for (const auto& [k, v] : args->state->dict)
    if (k->s != key) torchfmt::DictSet(attrs.get(), k, v);
  torchfmt::DictSet(attrs.get(), key, std::move(value));
  torchfmt::PyRef root = torchfmt::MakeDict();
  for (const auto& [k, v] : (*f)->root().dict)
    torchfmt::DictSet(root.get(), k, k->s == "args" ? torchfmt::MakeNamespace(attrs) : v);
  f->reset();
  ASSERT_TRUE(torchfmt::WriteTorchFile(common, *root, {}).ok());
}

TEST(TorchDistMoeRefused, ArgsWithAnotherLayerPatternNameTheLayer) {
  // The args say every layer is MoE (--moe-layer-freq [1,1,1]): layer 1's dense MLP is no weight of that model.
  ExpectRefused("moe_tp1",
                [](const std::string& d) {
                  RewriteArgs(d + "/common.pt", "moe_layer_freq",
                              torchfmt::MakeList({torchfmt::MakeInt(1), torchfmt::MakeInt(1), torchfmt::MakeInt(1)}));
                },
                {".metadata", "tensor decoder.layers.1.mlp.linear_fc1.weight", "not a weight"});
}

TEST(TorchDistMoeRefused, AnotherExpertCountNamesTheKeyAndShape) {
  ExpectRefused("moe_tp1",
                [](const std::string& d) { RewriteArgs(d + "/common.pt", "num_experts", torchfmt::MakeInt(8)); },
                {".metadata", "decoder.layers.0.mlp.experts.experts.linear_fc1.weight", "shape [4, 16, 16]",
                 "[8, 16, 16]", "--num-experts 8"});
}

TEST(TorchDistMoeRefused, MultiTokenPredictionIsRefusedNamingCommonPt) {
  ExpectRefused("moe_tp1",
                [](const std::string& d) { RewriteArgs(d + "/common.pt", "mtp_num_layers", torchfmt::MakeInt(1)); },
                {"common.pt: a multi-token prediction model (--mtp-num-layers 1) in the torch_dist format"});
}

// The distributed optimizer's grad-buffer formats of a MoE model (its experts in grad buffers of the expert data
// group) are refused naming the object: a byte item renamed as dp_zero_gather_scatter's param_state.
TEST(TorchDistMoeRefused, TheGradBufferOptimizerStateOfAMoeModelIsNamed) {
  ExpectRefused("moe_tp1",
                [](const std::string& d) {
                  Replace(d + "/.metadata", "decoder.layers.0.mlp.experts.experts.linear_fc1._extra_state/shard_0_4",
                          "optimizer.distributed.dp_group_idx_0.param_state/shard_000000000000000");
                },
                {".metadata", "optimizer.distributed.dp_group_idx_0.param_state/shard_000000000000000",
                 "mixture-of-experts", "fully_reshardable"});
}

// A stacked key (a model whose layers are alike saves each parameter stacked over its layers) must hold exactly the
// layers that have the parameter: one missing, or one more, is refused naming the file, the key and the layer.
TEST(TorchDistMoeRefused, AStackedKeysLayersMustBeTheModels) {
  GPTConfig c;
  c.num_layers = 3;
  c.num_experts = 4;
  c.moe_layer_pattern = {1, 0, 1};
  EXPECT_TRUE(megatron::CheckStackedLayers(c, "f/.metadata", "k", {true, false, true}, {0, 2}).ok());
  const absl::Status missing = megatron::CheckStackedLayers(c, "f/.metadata", "k", {true, false, false}, {0, 2});
  EXPECT_EQ(
      missing.message(),
      "f/.metadata: tensor k: layer 2 missing (not saved), which common.pt's args make a mixture-of-experts layer "
      "with this parameter");
  const absl::Status extra = megatron::CheckStackedLayers(c, "f/.metadata", "k", {true, true, true}, {0, 2});
  EXPECT_EQ(extra.message(),
            "f/.metadata: tensor k: holds layer 1, which common.pt's args make a dense layer without this parameter "
            "(--moe-layer-freq)");
}

}  // namespace
}  // namespace ptk
