// Where ptk-convert's reader of distrib_optim.pt (StageDistribParams + DistribLayout, what the
// import of a --use-distributed-optimizer checkpoint reads through) finds each parameter of a
// pipeline stage, against megatron-core's own GPTModel and _ParamAndGradBuffer
// (tests/data/interop/megatron_distrib_layout.txt, written by
// tests/support/gen_distrib_layout_golden.py): the parameters' order and sizes and their offsets
// in the world tensors, for the Llama line (RMSNorm, SwiGLU's fused fc1, no biases, grouped-query
// attention, RoPE; untied, and tied over two stages; a tensor rank's shards at tensor size 2; at
// data-parallel size 3, whose bucket padding moves but is not saved) and GPT-3's tied over two
// stages, with one bucket and with small buckets; and interleaved runs (RankDistribBuffers: one grad
// buffer per model chunk of a pipeline rank, only chunk 0 of rank 0 bucketed) against megatron-core's
// own DistributedDataParallel chunks and DistributedOptimizer.get_parameter_state_dp_zero.
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "interop/megatron_common.h"
#include "interop/megatron_optim.h"
#include "interop/torch_format.h"
#include "tests/test_util.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

// The models of gen_distrib_layout_golden.py.
GPTConfig Model(const std::string& family, int64_t layers, bool tied) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = c.max_position_embeddings = 16;
  c.vocab_size = c.padded_vocab_size = 64;
  c.untie_embeddings_and_output_weights = !tied;
  if (family == "llama") {
    c.ffn_hidden_size = 24;
    c.num_query_groups = 2;
    c.normalization = Normalization::kRMSNorm;
    c.position_embedding = PositionEmbedding::kRope;
    c.swiglu = true;
    c.add_bias_linear = false;
  } else {
    c.ffn_hidden_size = 64;
  }
  return c;
}

struct Case {
  std::string name, family;
  int64_t layers = 0, stages = 0, stage = 0, bucket = 0, tp = 1;
  int64_t dp = 1;             // pads megatron-core's buckets to lcm(dp, 128), padding the file leaves out
  int64_t vp = 1, chunk = 0;  // an interleaved run's model chunks, and which one this is
  bool tied = false;
  std::vector<std::pair<std::string, int64_t>> params;  // named_parameters order, numel
  std::map<std::string, int64_t> offset;
  int64_t total = -1;
};

std::vector<Case> ReadGolden() {
  std::istringstream in(testing::ReadFile(testing::SourceDir() + "/tests/data/interop/megatron_distrib_layout.txt"));
  std::vector<Case> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string kind;
    f >> kind;
    if (kind == "case") {
      Case c;
      int tied = 0;
      f >> c.name >> c.family >> c.layers >> c.stages >> c.stage >> tied >> c.bucket >> c.tp >> c.dp >> c.vp >> c.chunk;
      c.tied = tied != 0;
      out.push_back(c);
    } else if (kind == "param" && !out.empty()) {
      std::string name;
      int64_t numel = 0, offset = 0;
      f >> name >> numel >> offset;
      out.back().params.emplace_back(name, numel);
      out.back().offset[name] = offset;
    } else if (kind == "total" && !out.empty()) {
      f >> out.back().total;
    } else {
      ADD_FAILURE() << "unexpected golden line: " << line;
    }
  }
  return out;
}

TEST(MegatronDistribLayout, StagesLieInTheWorldTensorsWhereMegatronCoresGradBufferPutsThem) {
  const std::vector<Case> cases = ReadGolden();
  ASSERT_EQ(cases.size(), 46u);
  int llama = 0, tp2 = 0, dp3 = 0;
  for (const Case& g : cases) {
    if (g.vp > 1) continue;
    SCOPED_TRACE(g.name);
    llama += g.family == "llama";
    tp2 += g.tp == 2;
    dp3 += g.dp == 3;
    const GPTConfig c = Model(g.family, g.layers, g.tied);
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto params = megatron::MegParams(*layout, g.stages);
    ASSERT_TRUE(params.ok()) << params.status();
    const std::vector<megatron::DistribParam> mine = megatron::StageDistribParams(
        *params, g.stage, g.stages, /*te=*/false, g.tied && g.stages > 1, c.padded_vocab_size, g.tp, c.hidden_size);
    std::vector<std::pair<std::string, int64_t>> order;
    for (const megatron::DistribParam& p : mine) order.emplace_back(p.name, p.numel);
    EXPECT_EQ(order, g.params);
    std::map<std::string, int64_t> offset;
    const int64_t total =
        megatron::DistribLayout(mine, g.bucket > 0 ? std::optional<int64_t>(g.bucket) : std::nullopt, &offset);
    EXPECT_EQ(total, g.total);
    EXPECT_EQ(offset, g.offset);
  }
  EXPECT_EQ(llama, 18);
  EXPECT_EQ(tp2, 4);
  EXPECT_EQ(dp3, 4);
}

// An interleaved run: pipeline rank `stage`'s grad buffers as the import reads them (from the run's
// args: --overlap-grad-reduce with --ddp-bucket-size, or neither), each chunk's against megatron-core's.
TEST(MegatronDistribLayout, InterleavedChunksEachHaveTheGradBufferMegatronCoreSavesForThem) {
  int chunks = 0, bucketed = 0;
  for (const Case& g : ReadGolden()) {
    if (g.vp == 1) continue;
    SCOPED_TRACE(g.name);
    ++chunks;
    const GPTConfig c = Model(g.family, g.layers, g.tied);
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto params = megatron::MegParams(*layout, g.stages * g.vp);
    ASSERT_TRUE(params.ok()) << params.status();
    torchfmt::PyRef attrs = torchfmt::MakeDict();
    torchfmt::DictSet(attrs.get(), "overlap_grad_reduce", torchfmt::MakeBool(g.bucket > 0));
    if (g.bucket > 0) torchfmt::DictSet(attrs.get(), "ddp_bucket_size", torchfmt::MakeInt(g.bucket));
    const torchfmt::PyRef args = torchfmt::MakeNamespace(attrs);
    const std::vector<megatron::DistribBuffer> buffers =
        megatron::RankDistribBuffers(*params, g.stage, g.stages, g.vp, /*te=*/false, g.tied, c.padded_vocab_size,
                                     /*tp=*/1, c.hidden_size, args.get());
    ASSERT_EQ(buffers.size(), static_cast<size_t>(g.vp));
    const megatron::DistribBuffer& mine = buffers[static_cast<size_t>(g.chunk)];
    bucketed += mine.bucket_size.has_value();
    EXPECT_EQ(mine.bucket_size.has_value(), g.bucket > 0 && g.stage == 0 && g.chunk == 0);
    // The import keys an interleaved run's parameters "model{chunk}." + the chunk's own name.
    const std::string prefix = "model" + std::to_string(g.chunk) + ".";
    std::vector<std::pair<std::string, int64_t>> order;
    std::map<std::string, int64_t> offset, theirs;
    for (const megatron::DistribParam& p : mine.params) order.emplace_back(p.name, p.numel);
    for (const auto& [name, at] : g.offset) theirs[prefix + name] = at;
    std::vector<std::pair<std::string, int64_t>> want;
    for (const auto& [name, numel] : g.params) want.emplace_back(prefix + name, numel);
    EXPECT_EQ(order, want);
    EXPECT_EQ(megatron::DistribLayout(mine.params, mine.bucket_size, &offset), g.total);
    EXPECT_EQ(offset, theirs);
  }
  EXPECT_EQ(chunks, 24);
  EXPECT_EQ(bucketed, 2);  // chunk 0 of pipeline rank 0, in the two runs with a bucket size
}

}  // namespace
}  // namespace ptk
