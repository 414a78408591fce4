// The CUDA backend's multi-latent attention, its host side (trainer/cuda/mla_plan.h and the memory plan), on the
// CPU: a layer's buffers hold what the CPU layer keeps (cpu::MlaActivationFloats, less the norms' copies the CUDA
// layer aliases without the norms), aligned and disjoint; the core attention's shape is the CPU model's
// (MlaAttentionShape: the qk and v head widths, MLA's scale); the memory plan sizes QKV and the attention output by
// MLA's widths and keeps the latents per layer, no query/key-norm buffers and no RoPE tables of its own; the norms'
// runs cover the latent norms (LayerNormParamCount), so that bf16's fp32 norm weights and --apply-layernorm-1p read
// them from the parameter layout the CPU model (and a checkpoint) uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "trainer/cpu/cpu_activations.h"
#include "trainer/cpu/mla_cpu.h"
#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/mla_plan.h"

namespace ptk::cuda {
namespace {

GPTConfig MlaConfig(int64_t q_lora, bool norms, bool rms) {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.seq_length = c.max_position_embeddings = 32;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  c.normalization = rms ? Normalization::kRMSNorm : Normalization::kLayerNorm;
  c.multi_latent_attention = true;
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 6;
  c.qk_layernorm = norms;
  return c;
}

cpu::MlaSettings CpuSettings(const MlaShape& s, int64_t b) {
  cpu::MlaSettings c;
  c.b = b;
  c.t = s.t;
  c.hidden = s.c;
  c.heads = s.heads;
  c.q_lora = s.q_lora;
  c.kv_lora = s.kv_lora;
  c.qk = s.qk;
  c.pe = s.pe;
  c.v = s.v;
  c.norms = s.norms;
  c.rms = s.rms;
  return c;
}

const std::vector<std::tuple<int64_t, bool, bool>> kVariants = {
    {16, true, true}, {16, true, false}, {16, false, true}, {0, true, true}, {0, false, false}};

TEST(CudaMlaPlan, ALayerKeepsWhatTheCpuLayerKeeps) {
  for (const auto& [q_lora, norms, rms] : kVariants) {
    const std::string what = "q_lora " + std::to_string(q_lora) + (norms ? ", norms" : "") + (rms ? ", rms" : "");
    for (int64_t a : {4, 2}) {
      const MlaShape s = MlaShapeOf(MlaConfig(q_lora, norms, rms), 3, 32, 1, a);
      const MlaBuffers m = PlanMlaBuffers(s);
      const int64_t n = s.n;
      // The CPU keeps the norms' outputs as copies even without the norms; the CUDA layer reads the inputs there.
      const int64_t copies = norms ? 0 : n * (q_lora + s.kv_lora);
      EXPECT_EQ(m.saved_values + m.saved_stats + copies, cpu::MlaActivationFloats(CpuSettings(s, 3))) << what;
      EXPECT_EQ(m.saved_stats, norms ? (rms ? 1 : 2) * n * (q_lora > 0 ? 2 : 1) : 0) << what;
      // Every buffer aligned, within its region, and disjoint from the others (aliases are the same buffer).
      auto check = [&](std::vector<std::pair<int64_t, int64_t>> bufs, int64_t region, const char* name) {
        std::sort(bufs.begin(), bufs.end());
        bufs.erase(std::unique(bufs.begin(), bufs.end()), bufs.end());
        for (size_t i = 0; i < bufs.size(); ++i) {
          EXPECT_EQ(bufs[i].first % MemoryPlan::kAlignment, 0) << what << " " << name;
          EXPECT_LE(bufs[i].first + bufs[i].second, region) << what << " " << name;
          if (i > 0) {
            EXPECT_LE(bufs[i - 1].first + bufs[i - 1].second, bufs[i].first) << what << " " << name;
          }
        }
      };
      std::vector<std::pair<int64_t, int64_t>> saved = {
          {m.kvd, n * s.kv_down_rows() * a}, {m.kvc, n * s.kv_lora * a}, {m.kvn, n * s.kv_lora * a}};
      if (q_lora > 0) saved.insert(saved.end(), {{m.qd, n * q_lora * a}, {m.qn, n * q_lora * a}});
      for (int64_t stats : {m.q_stats, m.kv_stats})
        if (stats >= 0) saved.emplace_back(stats, (rms ? 1 : 2) * n * 4);
      EXPECT_EQ(m.q_stats >= 0, norms && q_lora > 0) << what;
      EXPECT_EQ(m.kv_stats >= 0, norms) << what;
      EXPECT_EQ(m.kvn == m.kvc, !norms) << what;
      check(saved, m.saved_bytes, "saved");
      std::vector<std::pair<int64_t, int64_t>> scratch = {{m.q, n * s.q_rows() * a},
                                                          {m.kvu, n * s.kv_up_rows() * a},
                                                          {m.dkvd, n * s.kv_down_rows() * a},
                                                          {m.dkvn, n * s.kv_lora * a},
                                                          {m.dkvc, n * s.kv_lora * a}};
      if (q_lora > 0) scratch.insert(scratch.end(), {{m.dqn, n * q_lora * a}, {m.dqd, n * q_lora * a}});
      EXPECT_EQ(m.dqn >= 0, q_lora > 0) << what;
      check(scratch, m.scratch_bytes, "scratch");
    }
  }
}

TEST(CudaMlaPlan, TheCoreAttentionIsTheCpuModels) {
  GPTConfig c = MlaConfig(16, true, true);
  c.mscale = c.mscale_all_dim = 0.707;
  c.rotary_scaling_factor = 40;
  const MlaShape s = MlaShapeOf(c, 2, 32, 1, 4);
  const AttentionShape got = s.attention(2, c.MlaSoftmaxScale()), want = MlaAttentionShape(c, 2, 32);
  EXPECT_EQ(std::tie(got.b, got.t, got.nh, got.hd, got.ng, got.vd),
            std::tie(want.b, want.t, want.nh, want.hd, want.ng, want.vd));
  EXPECT_EQ(got.scale, want.scale);
  EXPECT_NE(got.hd, got.v_dim());  // the qk head width (12) is not the v head width (6)
  EXPECT_EQ(got.qkv_width(), c.qkv_rows());
  const MlaDims d = s.dims();
  EXPECT_EQ(d.width(), got.qkv_width());
  EXPECT_EQ(d.kv_up_rows(), s.kv_up_rows());
}

TEST(CudaMlaPlan, TheMemoryPlanHoldsMlasBuffers) {
  for (const auto& [q_lora, norms, rms] : kVariants) {
    GPTConfig c = MlaConfig(q_lora, norms, rms);
    c.position_embedding = PositionEmbedding::kRope;  // MLA rotates with its own tables whatever this says
    for (Precision p : {Precision::kFp32, Precision::kBf16}) {
      PlanOptions o{.precision = p, .micro_batch_size = 2};
      auto plan = PlanMemory(c, 100000, o);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const MemoryPlan& m = *plan;
      const int64_t a = m.act_bytes, n = m.n, L = c.num_layers;
      EXPECT_EQ(m[m.qkv].bytes, L * n * c.qkv_rows() * a);
      EXPECT_EQ(c.qkv_rows(), 4 * (2 * 12 + 6));
      EXPECT_EQ(m[m.atty].bytes, L * n * 4 * 6 * a);
      EXPECT_EQ(m[m.datt].bytes, n * 4 * 6 * a);
      EXPECT_EQ(m[m.dqkv].bytes, n * c.qkv_rows() * a);
      const MlaBuffers b = PlanMlaBuffers(MlaShapeOf(c, 2, 32, 1, a));
      ASSERT_GE(m.mla_saved, 0);
      EXPECT_EQ(m.mla_saved_bytes, b.saved_bytes);
      EXPECT_EQ(m[m.mla_saved].bytes, L * b.saved_bytes);
      EXPECT_EQ(m[m.mla_scratch].bytes, b.scratch_bytes);
      EXPECT_EQ(m[m.mla_rope].bytes, 2 * 32 * 2 * 4);
      // The latents are a micro-batch's activations (a slot's), the rest not.
      EXPECT_GT(m[m.mla_saved].offset, m[m.resid].offset);
      EXPECT_LT(m[m.mla_saved].offset, m[m.lnf_stats].offset);
      EXPECT_EQ(m.rope_tables, -1);
      EXPECT_EQ(m.qkv_raw, -1);  // MLA's --qk-layernorm norms the latents, not the heads
      EXPECT_EQ(m.qk_stats, -1);
      EXPECT_EQ(m.qk_scratch, -1);
    }
  }
  auto dense = PlanMemory(MlaConfig(16, true, true), 100000, PlanOptions{});
  GPTConfig plain = MlaConfig(16, true, true);
  plain.multi_latent_attention = false;
  auto none = PlanMemory(plain, 100000, PlanOptions{});
  ASSERT_TRUE(dense.ok() && none.ok());
  EXPECT_EQ(none->mla_saved, -1);
  EXPECT_EQ(none->mla_scratch, -1);
}

TEST(CudaMlaPlan, TheNormRunsCoverTheLatentNorms) {
  for (const auto& [q_lora, norms, rms] : kVariants) {
    const GPTConfig c = MlaConfig(q_lora, norms, rms);
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const std::vector<LayerNormRun> runs = LayerNormRuns(*layout);
    int64_t total = 0;
    for (const LayerNormRun& r : runs) {
      EXPECT_EQ(r.compact, total);
      total += r.end - r.begin;
    }
    EXPECT_EQ(total, LayerNormParamCount(c));
    auto covered = [&](int64_t at, int64_t size) {
      for (const LayerNormRun& r : runs)
        if (at >= r.begin && at + size <= r.end) return true;
      return false;
    };
    int64_t latent = 0;
    for (const LayerParams& lp : layout->layers) {
      for (const auto& [at, size] :
           {std::pair{lp.mla_q_norm_w, q_lora}, std::pair{lp.mla_q_norm_b, q_lora},
            std::pair{lp.mla_kv_norm_w, c.kv_lora_rank}, std::pair{lp.mla_kv_norm_b, c.kv_lora_rank}}) {
        if (at < 0) continue;
        EXPECT_TRUE(covered(at, size)) << "latent norm at " << at;
        latent += size;
      }
    }
    const int64_t tensors = rms ? 1 : 2;
    EXPECT_EQ(latent, norms ? tensors * c.num_layers * (q_lora + c.kv_lora_rank) : 0);
  }
}

TEST(CudaMlaPlan, TheWidestLatentNormSizesTheNormScratch) {
  GPTConfig c = MlaConfig(96, true, true);
  EXPECT_EQ(MlaWidestNorm(c), 96);  // wider than the hidden size (64)
  c.qk_layernorm = false;
  EXPECT_EQ(MlaWidestNorm(c), 0);
  c.multi_latent_attention = false;
  c.qk_layernorm = true;
  EXPECT_EQ(MlaWidestNorm(c), 0);
}

}  // namespace
}  // namespace ptk::cuda
