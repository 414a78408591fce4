// The multi-tensor AdamW table, checked on the CPU (no device needed): every parameter a rank
// updates is in exactly one chunk, with its tensor's optimizer group (weight decay or none, --lr's or
// --decoupled-lr's rate; --apply-wd-to-qk-layernorm), whole and under ZeRO-1's shards (the union over the
// ranks is every parameter once), and no chunk crosses a tensor or exceeds kAdamWChunk.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "trainer/cuda/adamw_table.h"
#include "trainer/gpt_model.h"
#include "trainer/param_shard.h"

namespace ptk::cuda {
namespace {

GPTConfig Config(bool untied) {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 96;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 384;
  c.seq_length = c.max_position_embeddings = 128;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  c.untie_embeddings_and_output_weights = untied;
  return c;
}

// Megatron's rule (megatron-core 0.16.1's get_standard_config_overrides) from the names alone: no weight decay
// on 1-D tensors and biases, unless a query or key norm's under --apply-wd-to-qk-layernorm; the word
// embeddings and the output layer on the decoupled rate.
int MegatronGroup(const ParamInfo& p, bool apply_wd_qk) {
  const bool qk = p.name.find("q_layernorm.") != std::string::npos || p.name.find("k_layernorm.") != std::string::npos;
  const bool bias = p.name.size() >= 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
  const bool no_decay = (p.shape.size() == 1 || bias) && !(apply_wd_qk && qk);
  const bool decoupled = p.name == "embedding.word_embeddings.weight" || p.name == "output_layer.weight";
  return (decoupled ? 2 : 0) + (no_decay ? 1 : 0);
}

// covered[i] counts the chunks holding parameter i; each chunk's group must be its tensor's.
void Cover(const ParamLayout& layout, const std::vector<AdamWChunk>& table, std::vector<int>* covered,
           bool apply_wd_qk = false) {
  for (const AdamWChunk& k : table) {
    ASSERT_GE(k.size, 1);
    ASSERT_LE(k.size, kAdamWChunk);
    const ParamInfo* owner = nullptr;
    for (const ParamInfo& p : layout.infos)
      if (k.offset >= p.offset && k.offset < p.offset + p.size) owner = &p;
    ASSERT_NE(owner, nullptr) << k.offset;
    EXPECT_LE(k.offset + k.size, owner->offset + owner->size) << owner->name << ": a chunk crosses the tensor's end";
    EXPECT_EQ(k.group, MegatronGroup(*owner, apply_wd_qk)) << owner->name;
    for (int64_t i = k.offset; i < k.offset + k.size; ++i) ++(*covered)[static_cast<size_t>(i)];
  }
}

TEST(CudaAdamWTable, CoversEveryParameterOnceWhole) {
  for (bool untied : {false, true}) {
    auto layout = ParamLayout::Create(Config(untied));
    ASSERT_TRUE(layout.ok());
    const std::vector<AdamWChunk> table = AdamWTable(*layout, 0, layout->num_params, AdamWGroups{});
    std::vector<int> covered(static_cast<size_t>(layout->num_params), 0);
    Cover(*layout, table, &covered);
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "parameter " << i;
    // Three groups are present: weights decay, biases and LayerNorms do not, the embedding (tied: the
    // output layer too) on the decoupled rate; no decoupled tensor is 1-D.
    std::set<int> groups;
    for (const AdamWChunk& k : table) groups.insert(k.group);
    EXPECT_EQ(groups, (std::set<int>{0, 1, 2}));
    // The word embeddings (1024 x 96 = 98304) take 12 full chunks.
    EXPECT_GT(table.size(), layout->infos.size());
  }
}

// ZeRO-1: rank r's table covers its shard [begin, end) and nothing else; over the ranks, every
// parameter once (the padding of the last ranks in no chunk).
TEST(CudaAdamWTable, ShardsCoverEveryParameterOnceOverTheRanks) {
  auto layout = ParamLayout::Create(Config(false));
  ASSERT_TRUE(layout.ok());
  for (int world : {1, 2, 3, 8, 64}) {
    std::vector<int> covered(static_cast<size_t>(layout->num_params), 0);
    for (int rank = 0; rank < world; ++rank) {
      auto shard = ParamShard::Create(layout->num_params, world, rank);
      ASSERT_TRUE(shard.ok()) << shard.status();
      const std::vector<AdamWChunk> table = AdamWTable(*layout, shard->begin(), shard->end(), AdamWGroups{});
      for (const AdamWChunk& k : table) {
        EXPECT_GE(k.offset, shard->begin());
        EXPECT_LE(k.offset + k.size, shard->end());
      }
      Cover(*layout, table, &covered);
    }
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "parameter " << i << ", world " << world;
  }
}

// --qk-layernorm (LayerNorm: weights and biases; RMSNorm: weights alone) in the Llama line's shape,
// whole, at tensor rank 1 of 2 and under ZeRO-1: the query and key norms are in exactly one chunk
// each element (once per rule: covered twice over the two), with the other norms' group (no weight decay), or
// under --apply-wd-to-qk-layernorm the weights' (decayed), like every other parameter.
TEST(CudaAdamWTable, CoversTheQueryAndKeyNormsOnce) {
  for (Normalization norm : {Normalization::kLayerNorm, Normalization::kRMSNorm}) {
    GPTConfig c = Config(/*untied=*/true);
    c.qk_layernorm = true;
    c.normalization = norm;
    c.num_query_groups = 2;
    c.kv_channels = 32;  // wider than hidden / heads, as Qwen3's
    for (int tensor : {1, 2}) {
      auto layout = ParamLayout::Create(c, tensor, tensor - 1);
      ASSERT_TRUE(layout.ok()) << layout.status();
      int64_t norms = 0;
      for (const ParamInfo& p : layout->infos)
        if (p.name.find("q_layernorm") != std::string::npos || p.name.find("k_layernorm") != std::string::npos) {
          EXPECT_TRUE(p.no_weight_decay) << p.name;
          EXPECT_EQ(p.size, 32) << p.name;
          norms += p.size;
        }
      EXPECT_EQ(norms, 3 * 2 * (norm == Normalization::kLayerNorm ? 2 : 1) * 32);
      for (int world : {1, 3}) {
        std::vector<int> covered(static_cast<size_t>(layout->num_params), 0);
        for (int rank = 0; rank < world; ++rank) {
          auto shard = ParamShard::Create(layout->num_params, world, rank);
          ASSERT_TRUE(shard.ok()) << shard.status();
          for (bool apply_wd_qk : {false, true}) {
            AdamWGroups rule;
            rule.apply_wd_to_qk_layernorm = apply_wd_qk;
            Cover(*layout, AdamWTable(*layout, shard->begin(), shard->end(), rule), &covered, apply_wd_qk);
          }
        }
        for (size_t i = 0; i < covered.size(); ++i)
          ASSERT_EQ(covered[i], 2) << "parameter " << i << ", world " << world << ", tensor " << tensor;
      }
    }
  }
}

}  // namespace
}  // namespace ptk::cuda
