// The CUDA model's memory plan, checked on the CPU (no device needed): sizes from the
// configuration, alignment and no overlap, the parameters' place independent of the batch shape
// (a re-plan moves them verbatim), what recomputation and bf16 save, and the out-of-memory text.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "trainer/cuda/memory_plan.h"
#include "trainer/cuda/ops_cuda.h"
#include "trainer/gpt_model.h"

namespace ptk::cuda {
namespace {

GPTConfig Gpt2Small() {
  GPTConfig c;
  c.num_layers = 12;
  c.hidden_size = 768;
  c.num_attention_heads = 12;
  c.ffn_hidden_size = 3072;
  c.seq_length = c.max_position_embeddings = 1024;
  c.vocab_size = 50257;
  c.padded_vocab_size = 50304;
  return c;
}

MemoryPlan MustPlan(const GPTConfig& c, const PlanOptions& o) {
  auto layout = ParamLayout::Create(c);
  EXPECT_TRUE(layout.ok()) << layout.status();
  auto plan = PlanMemory(c, layout->num_params, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

TEST(CudaMemoryPlan, BuffersAreAlignedDisjointAndSizedFromTheConfig) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 16;
  const MemoryPlan m = MustPlan(c, o);
  const int64_t params = ParamLayout::Create(c)->num_params;
  EXPECT_EQ(params, 124475904);  // GPT-2 small with the padded vocabulary, tied output layer
  EXPECT_EQ(m[m.master].bytes, params * 4);
  EXPECT_EQ(m[m.compute].bytes, params * 2);
  EXPECT_EQ(m[m.grads].bytes, params * 4);
  EXPECT_EQ(m[m.qkv].bytes, 12 * 16 * 1024 * 3 * 768 * 2);
  EXPECT_EQ(m[m.attn_saved].bytes, 12 * 16 * 12 * 1024 * 4);  // softmax statistics only: no t x t matrix
  int64_t end = 0;
  for (const PlannedBuffer& b : m.buffers) {
    EXPECT_EQ(b.offset % MemoryPlan::kAlignment, 0) << b.name;
    EXPECT_GE(b.offset, end) << b.name << " overlaps the buffer before it";
    end = b.offset + b.bytes;
  }
  EXPECT_LE(end, m.total_bytes);
  // The logits never hold more than the given budget: the loss runs over chunks of rows.
  EXPECT_LE(m[m.logits].bytes, o.logits_budget_bytes);
  EXPECT_LT(m.logit_chunk_rows, m.n);
}

// The attention variants' buffers: --attention-output-gate's gate and pre-gate output per layer inside a pipeline
// slot's activations, the fused product's scratch (QKV and gate rows); --qk-l2-norm's raw product and rstd alone
// (RMSNorm's statistics even under LayerNorm, no parameter scratch); off-by-one's zeros per head; none without them.
TEST(CudaMemoryPlan, AttentionVariantsPlanTheirBuffers) {
  GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 128;
  const MemoryPlan plain = MustPlan(c, o);
  for (int b : {plain.gate, plain.att_pre, plain.qkv_fused, plain.dgate, plain.qkv_raw, plain.sink_zeros})
    EXPECT_EQ(b, -1);
  c.attention_output_gate = c.qk_l2_norm = true;
  c.softmax_type = "off-by-one";
  const MemoryPlan m = MustPlan(c, o);
  const int64_t n = 2 * 128, ct = 768, qw = 3 * 768;
  EXPECT_EQ(m[m.gate].bytes, 12 * n * ct * 4);
  EXPECT_EQ(m[m.att_pre].bytes, 12 * n * ct * 4);
  EXPECT_EQ(m[m.qkv_fused].bytes, n * (qw + ct) * 4);
  EXPECT_EQ(m[m.dgate].bytes, n * ct * 4);
  EXPECT_EQ(m[m.qkv_raw].bytes, 12 * n * qw * 4);
  EXPECT_EQ(m.qk_stats_per_layer, n * 24);  // rstd of 12 query and 12 key heads per token, no mean
  EXPECT_EQ(m.qk_scratch, -1);
  EXPECT_EQ(m[m.sink_zeros].bytes, 12 * 4);
  for (int b : {m.gate, m.att_pre}) {  // a pipeline slot's activations: resid through lnf_stats
    EXPECT_GT(m[b].offset, m[m.resid].offset);
    EXPECT_LT(m[b].offset, m[m.lnf_stats].offset);
  }
  c.softmax_type = "learnable";  // the offset is a parameter: no zeros
  EXPECT_EQ(MustPlan(c, o).sink_zeros, -1);
}

// Context parallelism: a rank plans its t = seq_length / C positions, probabilities of its queries over
// the whole samples (t x C t), and the group's buffers (positions, gathered rows, whole samples); in bf16 the
// same fp32 attention (its probabilities, not cuDNN's statistics) and the fp32 output and QKV gradient it
// converts; with sequence parallelism a tensor rank's share of the residual stream.
TEST(CudaMemoryPlan, ContextRanksPlanTheirRowsAndTheGroupsBuffers) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;  // a rank's 1024 / 4 positions
  const MemoryPlan one = MustPlan(c, o);
  EXPECT_EQ(one.cp_gathered, -1);
  EXPECT_EQ(one[one.attn_saved].bytes, 12 * 2 * 12 * 256 * 256 * 4);
  o.context = 4;
  o.attention_scratch_floats = 12 * 256 * 1024;
  const MemoryPlan m = MustPlan(c, o);
  EXPECT_EQ(m.context, 4);
  EXPECT_EQ(m.n, 2 * 256);
  EXPECT_EQ(m[m.qkv].bytes, one[one.qkv].bytes);  // a rank's own rows
  EXPECT_EQ(m[m.attn_saved].bytes, 12 * 2 * 12 * 256 * 1024 * 4);
  EXPECT_EQ(m[m.cp_positions].bytes, 1024 * 8);
  for (const int b : {m.cp_gathered, m.cp_whole, m.cp_dwhole}) EXPECT_EQ(m[b].bytes, 4 * 2 * 256 * 3 * 768 * 4);
  EXPECT_EQ(m.cp_rows, -1);  // fp32: the attention writes the activations themselves
  EXPECT_EQ(m.cp_dqkv, -1);
  o.precision = Precision::kBf16;
  const MemoryPlan h = MustPlan(c, o);
  EXPECT_TRUE(h.RowsAttention());
  EXPECT_EQ(h[h.qkv].bytes, m[m.qkv].bytes / 2);  // the activations in bf16
  EXPECT_EQ(h[h.attn_saved].bytes, m[m.attn_saved].bytes);
  EXPECT_EQ(h[h.attn_scratch].bytes, 12 * 256 * 1024 * 4);
  for (const int b : {h.cp_gathered, h.cp_whole, h.cp_dwhole}) EXPECT_EQ(h[b].bytes, m[m.cp_gathered].bytes);
  EXPECT_EQ(h[h.cp_rows].bytes, 2 * 256 * 768 * 4);
  EXPECT_EQ(h[h.cp_dqkv].bytes, 2 * 256 * 3 * 768 * 4);
  o.context = 1;
  EXPECT_FALSE(MustPlan(c, o).RowsAttention());  // one rank in bf16: cuDNN's
  auto layout = ParamLayout::Create(c);
  o.context = 4;
  o.tensor = 2;
  o.sequence_parallel = true;  // the residual stream: half a context rank's rows; QKV and the attention its whole
  const MemoryPlan sp = MustPlan(c, o);
  EXPECT_EQ(sp[sp.resid].bytes, 13 * 2 * 128 * 768 * 2);
  EXPECT_EQ(sp[sp.qkv].bytes, h[h.qkv].bytes / 2);  // its 6 of 12 heads
  EXPECT_EQ(sp[sp.cp_dqkv].bytes, 2 * 256 * 3 * 384 * 4);
  o.tensor = 1;
  o.sequence_parallel = false;
  o.context = 0;
  EXPECT_FALSE(PlanMemory(c, layout->num_params, o).ok());
}

// Context parallelism's cuDNN pairs (bf16/fp16 without attention dropout or query groups: PlanOptions::context_flash)
// keep every layer's merged log-sum-exps (2, b, heads, t/2) instead of the probabilities (with recompute too: the
// output and log-sum-exps are kept, nothing recomputed), the group's rows in bf16, the fp32 output, QKV gradient and
// key/value shares, and one pair's bf16 partials; no rows-attention scratch. fp32 ignores the flag; query groups
// are refused.
TEST(CudaMemoryPlan, ContextFlashPairsKeepLogSumExpsNotProbabilities) {
  GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;  // a rank's 1024 / 4 positions
  o.context = 4;
  o.attention_scratch_floats = 12 * 256 * 1024;
  const MemoryPlan rows = MustPlan(c, o);
  o.context_flash = true;
  const MemoryPlan fp32 = MustPlan(c, o);
  EXPECT_FALSE(fp32.context_flash);  // fp32: the rows attention
  EXPECT_EQ(fp32.total_bytes, rows.total_bytes);
  o.precision = Precision::kBf16;
  const MemoryPlan m = MustPlan(c, o);
  EXPECT_TRUE(m.context_flash);
  EXPECT_FALSE(m.RowsAttention());
  EXPECT_EQ(m[m.attn_saved].bytes, 12 * 2 * 12 * 256 * 4);  // layers x b x heads x t fp32
  EXPECT_EQ(m[m.attn_scratch].bytes, 0);
  EXPECT_EQ(m[m.cp_positions].bytes, 1024 * 8);
  EXPECT_EQ(m[m.cp_gathered].bytes, 4 * 2 * 256 * 3 * 768 * 2);  // bf16 rows of the whole samples
  for (const int b : {m.cp_whole, m.cp_dwhole}) EXPECT_EQ(m[b].bytes, 4 * 2 * 256 * 3 * 768 * 4);
  EXPECT_EQ(m[m.cp_rows].bytes, 2 * 256 * 768 * 4);
  EXPECT_EQ(m[m.cp_dqkv].bytes, 2 * 256 * 3 * 768 * 4);
  EXPECT_EQ(m[m.cp_part_out].bytes, 2 * 128 * 768 * 2);
  EXPECT_EQ(m[m.cp_part_kv].bytes, 2 * (2 * 128 * 768 * 2));
  EXPECT_EQ(m[m.cp_part_stats].bytes, 2 * 12 * 128 * 4);
  EXPECT_EQ(m.qkv_heads, -1);
  c.recompute_activations = true;
  const MemoryPlan r = MustPlan(c, o);
  EXPECT_EQ(r[r.attn_saved].bytes, m[m.attn_saved].bytes);
  c.recompute_activations = false;
  o.context_flash = false;  // bf16 with attention dropout or query groups: the rows attention's probabilities
  const MemoryPlan h = MustPlan(c, o);
  EXPECT_TRUE(h.RowsAttention());
  EXPECT_EQ(h.cp_part_out, -1);
  EXPECT_EQ(h[h.attn_saved].bytes, 12 * 2 * 12 * 256 * 1024 * 4);
  EXPECT_GT(h.total_bytes, m.total_bytes);
  o.context_flash = true;
  c.num_query_groups = 4;
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_FALSE(PlanMemory(c, layout->num_params, o).ok());
}

// Tensor parallelism: a rank's buffers hold its slices (heads, ffn columns, vocabulary rows) and
// the fp32 buffers of the group's sums; the rest (the residual stream, the LayerNorms) is whole.
TEST(CudaMemoryPlan, TensorRanksHoldTheirSlices) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 4;
  o.logits_budget_bytes = int64_t{1} << 40;  // every row in one chunk
  const MemoryPlan one = MustPlan(c, o);
  o.tensor = 2;
  auto layout = ParamLayout::Create(c, 2, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto planned = PlanMemory(c, layout->num_params, o);
  ASSERT_TRUE(planned.ok()) << planned.status();
  const MemoryPlan& two = *planned;
  for (int MemoryPlan::*b :
       {&MemoryPlan::qkv, &MemoryPlan::atty, &MemoryPlan::fc1, &MemoryPlan::gelu, &MemoryPlan::attn_saved,
        &MemoryPlan::logits, &MemoryPlan::dqkv, &MemoryPlan::datt, &MemoryPlan::dff})
    EXPECT_EQ(two[two.*b].bytes * 2, one[one.*b].bytes) << two[two.*b].name;
  for (int MemoryPlan::*b :
       {&MemoryPlan::resid, &MemoryPlan::ln1, &MemoryPlan::ln2, &MemoryPlan::lnf, &MemoryPlan::dln})
    EXPECT_EQ(two[two.*b].bytes, one[one.*b].bytes) << two[two.*b].name;
  EXPECT_EQ(one.tp_sum, -1);
  EXPECT_EQ(two[two.tp_sum].bytes, 4 * 1024 * 768 * 4);
  EXPECT_EQ(two[two.tp_xent].bytes, (2 + 3) * 4 * 1024 * 4);
  EXPECT_EQ(two[two.master].bytes, layout->num_params * 4);
  o.tensor = 5;  // 12 heads do not divide by 5
  EXPECT_FALSE(PlanMemory(c, layout->num_params, o).ok());
}

// --sequence-parallel: the residual stream, the residual after attention and the residual
// gradient hold this rank's half of the positions; the norms' outputs stay whole (gathered for
// the column-parallel products); a staging buffer for the gathers and reduce-scatters (fp32 rows
// and this rank's positions). A sequence the group does not divide is refused; without tensor
// parallelism the flag changes nothing.
TEST(CudaMemoryPlan, SequenceParallelShardsTheResidualStream) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 4;
  o.logits_budget_bytes = int64_t{1} << 40;
  o.tensor = 2;
  auto layout = ParamLayout::Create(c, 2, 0);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto tp = PlanMemory(c, layout->num_params, o);
  ASSERT_TRUE(tp.ok()) << tp.status();
  o.sequence_parallel = true;
  int64_t sp_grads = 0;
  for (const GradRange& g : SequenceParallelGradRanges(*layout)) sp_grads += g.size();
  o.non_tensor_parallel_grads = sp_grads;
  auto sp = PlanMemory(c, layout->num_params, o);
  ASSERT_TRUE(sp.ok()) << sp.status();
  const MemoryPlan &S = *sp, &P = *tp;
  EXPECT_TRUE(S.sequence_parallel);
  EXPECT_FALSE(P.sequence_parallel);
  EXPECT_EQ(P.sp_stage, -1);
  EXPECT_EQ(P.ntp_grads, -1);
  // The norms' weights and biases (12 layers' two and the final one) and the row-parallel biases.
  EXPECT_EQ(sp_grads, (2 * 12 + 1) * 2 * 768 + 12 * 2 * 768);
  EXPECT_EQ(S[S.ntp_grads].bytes, sp_grads * 4);
  for (int MemoryPlan::*b : {&MemoryPlan::resid, &MemoryPlan::resid_mid, &MemoryPlan::dresid})
    EXPECT_EQ(S[S.*b].bytes * 2, P[P.*b].bytes) << S[S.*b].name;
  for (int MemoryPlan::*b : {&MemoryPlan::ln1, &MemoryPlan::ln2, &MemoryPlan::lnf, &MemoryPlan::dln, &MemoryPlan::tmp,
                             &MemoryPlan::dtmp, &MemoryPlan::tp_sum})
    EXPECT_EQ(S[S.*b].bytes, P[P.*b].bytes) << S[S.*b].name;
  EXPECT_EQ(S[S.resid].bytes, 13 * 4 * 512 * 768 * 2);
  EXPECT_EQ(S[S.sp_stage].bytes, 4 * 1024 * 768 * 4 + 4 * 512 * 4);  // 8 KiB of positions: aligned
  EXPECT_NE(S[S.resid].name.find("this rank's positions"), std::string::npos);
  o.seq_length = 1023;
  auto odd = PlanMemory(c, layout->num_params, o);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("sequence length 1023 does not divide by tensor size 2"), std::string::npos)
      << odd.status();
  o.seq_length = 0;
  o.tensor = 1;
  const MemoryPlan one = MustPlan(c, o);
  EXPECT_FALSE(one.sequence_parallel);
  EXPECT_EQ(one.sp_stage, -1);
}

// The test hook of cuda_model_test's ChunkedLmHeadMatchesOneChunk (CudaModelOptions'
// logits_budget_bytes, passed on as PlanOptions::logits_budget_bytes): a budget of 100 rows of
// the padded vocabulary splits its 4x64 micro-batch (256 rows) into three balanced chunks, 86, 85
// and 85 (fewer rows than a tile: no tile rounding), in fp32 and bf16.
TEST(CudaMemoryPlan, LogitsBudgetSplitsTheHeadIntoBalancedChunks) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 256;
  c.seq_length = c.max_position_embeddings = 64;
  c.vocab_size = 1000;
  c.padded_vocab_size = 1024;
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    PlanOptions o;
    o.precision = p;
    o.micro_batch_size = 4;
    const MemoryPlan one = MustPlan(c, o);
    EXPECT_EQ(one.logit_chunk_rows, 256) << "the default budget: one chunk";
    o.logits_budget_bytes = 100 * 1024 * (p == Precision::kFp32 ? 4 : 2);
    const MemoryPlan m = MustPlan(c, o);
    EXPECT_EQ(m.logit_chunk_rows, 100);
    EXPECT_EQ(LogitChunks(m.n, m.logit_chunk_rows), (std::vector<int64_t>{86, 85, 85}));
    EXPECT_EQ(m[m.logits].bytes, o.logits_budget_bytes);
  }
}

// The chunks: as few as the buffer allows, balanced, whole tiles but for what n lacks of a tile
// at the end; never the old ragged tail (16384 rows under 2668-row chunks left 376).
TEST(CudaMemoryPlan, LogitChunksAreBalancedWholeTiles) {
  EXPECT_EQ(LogitChunks(16384, 16384), (std::vector<int64_t>{16384}));
  EXPECT_EQ(LogitChunks(16384, 100000), (std::vector<int64_t>{16384}));
  EXPECT_EQ(LogitChunks(0, 100), (std::vector<int64_t>{}));
  // 256 MiB of bf16 rows of 50304: 2668 rows, 20 tiles; 128 tiles in 7 chunks of 19 or 18.
  EXPECT_EQ(LogitChunks(16384, 2668), (std::vector<int64_t>{2432, 2432, 2304, 2304, 2304, 2304, 2304}));
  // n not a whole number of tiles: only the last chunk is short, by less than a tile.
  EXPECT_EQ(LogitChunks(1000, 512), (std::vector<int64_t>{512, 488}));
  EXPECT_EQ(LogitChunks(1100, 512), (std::vector<int64_t>{384, 384, 332}));
  for (int64_t n : {1, 127, 128, 129, 1000, 4097, 16384, 65536 + 17})
    for (int64_t cap : {1, 7, 100, 128, 200, 1000, 2668, 8192}) {
      const std::vector<int64_t> chunks = LogitChunks(n, cap);
      int64_t sum = 0, lo = n, hi = 0;
      for (int64_t r : chunks) {
        EXPECT_GE(r, 1);
        EXPECT_LE(r, cap);
        sum += r;
        lo = std::min(lo, r);
        hi = std::max(hi, r);
      }
      EXPECT_EQ(sum, n) << n << " " << cap;
      EXPECT_EQ(static_cast<int64_t>(chunks.size()),
                (n + cap - 1) / cap > 1 && cap >= kLogitRowTile
                    ? ((n + kLogitRowTile - 1) / kLogitRowTile + cap / kLogitRowTile - 1) / (cap / kLogitRowTile)
                    : (n + cap - 1) / cap)
          << n << " " << cap;
      if (chunks.size() > 1 && cap >= kLogitRowTile) {
        for (size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_EQ(chunks[i] % kLogitRowTile, 0) << n << " " << cap;
        EXPECT_LT(hi - lo, 2 * kLogitRowTile) << n << " " << cap;
      } else {
        EXPECT_LE(hi - lo, 1) << n << " " << cap;
      }
    }
}

// The budget from the device's free memory after the plan: GPT-2 124M at 16 x 1024 in bf16 on an
// 80 GB GPU (79 GiB free) keeps all 16384 rows of logits, one chunk; with only a few GiB free the
// logits take what the other buffers leave, in whole tiles, and the plan still fits.
TEST(CudaMemoryPlan, LogitsBudgetFromFreeMemory) {
  const GPTConfig c = Gpt2Small();
  const int64_t params = ParamLayout::Create(c)->num_params;
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 16;
  o.logits_budget_bytes = 0;
  const int64_t gib = int64_t{1} << 30;
  auto big = PlanMemoryWithin(c, params, o, 79 * gib);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->logit_chunk_rows, 16384);
  EXPECT_EQ(LogitChunks(big->n, big->logit_chunk_rows).size(), 1u);
  EXPECT_LE(big->total_bytes, 79 * gib - PlanHeadroomBytes(79 * gib));
  // The other buffers take `others`; give the plan that, 3000 rows of logits and the headroom
  // (1 GiB below 20 GiB free): 3000 rows round down to 23 tiles.
  PlanOptions tiny = o;
  tiny.logits_budget_bytes = 1;  // one row
  const MemoryPlan base = MustPlan(c, tiny);
  const int64_t row = c.padded_vocab_size * 2;
  const int64_t others = base.total_bytes - (base[base.logits].bytes + 255) / 256 * 256;
  const int64_t free_bytes = others + 3000 * row + gib;
  ASSERT_LT(free_bytes, 20 * gib);
  EXPECT_EQ(PlanHeadroomBytes(free_bytes), gib);
  auto mid = PlanMemoryWithin(c, params, o, free_bytes);
  ASSERT_TRUE(mid.ok()) << mid.status();
  EXPECT_EQ(mid->logit_chunk_rows, 23 * kLogitRowTile);
  EXPECT_LE(mid->total_bytes, free_bytes - gib);
  EXPECT_EQ(LogitChunks(mid->n, mid->logit_chunk_rows).size(), 6u);  // 128 tiles of at most 23
  // Too little for even the default budget: the default, and the caller reports out of memory.
  auto small = PlanMemoryWithin(c, params, o, others);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->logit_chunk_rows, kDefaultLogitsBudget / row);
  // A given budget is used as given.
  o.logits_budget_bytes = 100 * row;
  EXPECT_EQ(PlanMemoryWithin(c, params, o, 79 * gib)->logit_chunk_rows, 100);
}

// Tensor parallelism: the vocabulary-parallel loss runs its collectives (the row maxima's all-gather,
// the sums' all-reduce, rows of the chunk each) per chunk of rows, so every rank of the tensor group
// cuts the same chunks whatever its own free memory: with logits_budget_bytes 0 the budget is the
// 256 MiB default, from the configuration alone. (Sized from each rank's free memory, a rank with a
// few GiB less than the other cut its LM head into other chunks, and the ranks' collectives no
// longer matched: a hang, or sums of other rows.)
TEST(CudaMemoryPlan, TensorRanksCutTheSameLogitChunksWhateverTheirFreeMemory) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 16;
  o.logits_budget_bytes = 0;
  o.tensor = 2;
  auto layout = ParamLayout::Create(c, 2, 0);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t gib = int64_t{1} << 30, row = c.padded_vocab_size / 2 * 2;
  std::vector<int64_t> rows;
  for (int64_t free_bytes : {79 * gib, 8 * gib, 5 * gib + gib / 3, gib / 2}) {
    auto plan = PlanMemoryWithin(c, layout->num_params, o, free_bytes);
    ASSERT_TRUE(plan.ok()) << plan.status();
    rows.push_back(plan->logit_chunk_rows);
  }
  for (int64_t r : rows) EXPECT_EQ(r, kDefaultLogitsBudget / row) << "free memory changed a tensor rank's chunks";
  // One rank (no tensor group): the free memory still sizes them, every row where they fit.
  o.tensor = 1;
  EXPECT_EQ(PlanMemoryWithin(c, ParamLayout::Create(c)->num_params, o, 79 * gib)->logit_chunk_rows, 16384);
}

// --use-distributed-optimizer: the parameter and gradient buffers padded to the shard layout (NCCL's
// equal pieces), the moments for the rank's shard only, and in bf16/fp16 the fp32 master too (the
// LayerNorms' fp32 parameters whole beside it); in fp32 the master is the weights, whole.
TEST(CudaMemoryPlan, DistributedOptimizerKeepsTheShardsMomentsAndMaster) {
  const GPTConfig c = Gpt2Small();
  const int64_t params = ParamLayout::Create(c)->num_params;
  auto shard = ParamShard::Create(params, 8, 7);
  ASSERT_TRUE(shard.ok());
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.padded_params = shard->padded_size;
  o.moment_params = shard->size();
  const MemoryPlan m = MustPlan(c, o);
  EXPECT_TRUE(m.master_sharded);
  EXPECT_EQ(m[m.master].bytes, shard->size() * 4);
  EXPECT_NE(m[m.master].name.find("this rank's shard"), std::string::npos);
  ASSERT_GE(m.ln_master, 0);
  EXPECT_EQ(m[m.ln_master].bytes, (4 * 12 + 2) * 768 * 4);
  EXPECT_EQ(m[m.compute].bytes, shard->padded_size * 2);
  EXPECT_EQ(m[m.grads].bytes, shard->padded_size * 4);
  EXPECT_EQ(m[m.exp_avg].bytes, shard->size() * 4);
  EXPECT_EQ(m[m.exp_avg_sq].bytes, shard->size() * 4);
  EXPECT_LT(shard->size() * 8, params);
  EXPECT_NE(m[m.exp_avg].name.find("this rank's shard"), std::string::npos);
  const MemoryPlan whole = MustPlan(c, PlanOptions{.precision = Precision::kBf16});
  EXPECT_FALSE(whole.master_sharded);
  EXPECT_EQ(whole.ln_master, -1);
  EXPECT_EQ(whole[whole.master].bytes, params * 4);
  // 7/8 of 12 bytes per parameter (master and moments), less the padding and the LayerNorms.
  EXPECT_LT(m.total_bytes, whole.total_bytes - 10 * params);
  EXPECT_NE(whole[whole.exp_avg].lower.find("--use-distributed-optimizer"), std::string::npos);
  // fp32: the master is what the products read; every rank keeps it whole.
  o.precision = Precision::kFp32;
  const MemoryPlan fp32 = MustPlan(c, o);
  EXPECT_FALSE(fp32.master_sharded);
  EXPECT_EQ(fp32.ln_master, -1);
  EXPECT_EQ(fp32[fp32.master].bytes, shard->padded_size * 4);
  EXPECT_EQ(fp32[fp32.exp_avg].bytes, shard->size() * 4);
  o.precision = Precision::kBf16;
  o.padded_params = params - 1;
  EXPECT_FALSE(PlanMemory(c, params, o).ok());
}

// The LayerNorms' fp32 copy beside a sharded master: every LayerNorm tensor of the layout, once, in
// runs of neighbours that follow each other in the compact buffer.
TEST(CudaMemoryPlan, LayerNormRunsCoverEveryLayerNormParameterOnce) {
  for (bool untied : {false, true}) {
    GPTConfig c = Gpt2Small();
    c.untie_embeddings_and_output_weights = untied;
    auto layout = ParamLayout::Create(c);
    ASSERT_TRUE(layout.ok());
    const std::vector<LayerNormRun> runs = LayerNormRuns(*layout);
    EXPECT_EQ(runs.size(), 2u * 12 + 1);  // ln1 and ln2 of each layer, weight and bias adjacent; the final one
    int64_t compact = 0, previous_end = 0;
    for (const LayerNormRun& r : runs) {
      EXPECT_EQ(r.compact, compact);
      EXPECT_GE(r.begin, previous_end);
      compact += r.end - r.begin;
      previous_end = r.end;
    }
    EXPECT_EQ(compact, LayerNormParamCount(c));
    // Exactly the tensors whose names say LayerNorm.
    int64_t named = 0;
    for (const ParamInfo& p : layout->infos) {
      const bool norm = p.name.find("layernorm") != std::string::npos;
      bool inside = false;
      for (const LayerNormRun& r : runs) inside |= p.offset >= r.begin && p.offset + p.size <= r.end;
      EXPECT_EQ(inside, norm) << p.name;
      if (norm) named += p.size;
    }
    EXPECT_EQ(named, LayerNormParamCount(c));
  }
}

// The Llama line: the fused QKV at its query heads' and groups' widths, SwiGLU's fc1 twice the ffn
// and its output gradient, RoPE's fp32 tables, the heads-first copies of grouped-query attention in
// bf16 (cuDNN) only; RMSNorm's weights alone among the norms' parameters; at tensor size 2 a rank's
// query groups.
TEST(CudaMemoryPlan, LlamaLineBuffersFollowTheConfig) {
  GPTConfig c = Gpt2Small();
  c.num_layers = 2;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding = PositionEmbedding::kRope;
  c.swiglu = true;
  c.ffn_hidden_size = 2048;
  c.num_attention_heads = 16;
  c.num_query_groups = 4;
  c.kv_channels = 128;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;
  const int64_t n = 2 * 256, qkv = (16 + 2 * 4) * 128;
  const MemoryPlan fp32 = MustPlan(c, o);
  EXPECT_EQ(fp32[fp32.qkv].bytes, 2 * n * qkv * 4);
  EXPECT_EQ(fp32[fp32.dqkv].bytes, n * qkv * 4);
  EXPECT_EQ(fp32[fp32.atty].bytes, 2 * n * 16 * 128 * 4);
  EXPECT_EQ(fp32[fp32.fc1].bytes, 2 * n * 2 * 2048 * 4);
  EXPECT_EQ(fp32[fp32.gelu].bytes, 2 * n * 2048 * 4);
  EXPECT_EQ(fp32[fp32.dff].bytes, n * 2 * 2048 * 4);
  ASSERT_GE(fp32.dact, 0);
  EXPECT_EQ(fp32[fp32.dact].bytes, n * 2048 * 4);
  ASSERT_GE(fp32.rope_tables, 0);
  EXPECT_EQ(fp32[fp32.rope_tables].bytes, 2 * 256 * 64 * 4);
  EXPECT_EQ(fp32.qkv_heads, -1);  // fp32 attention reads Megatron's order itself
  o.precision = Precision::kBf16;
  const MemoryPlan bf16 = MustPlan(c, o);
  ASSERT_GE(bf16.qkv_heads, 0);
  ASSERT_GE(bf16.dqkv_heads, 0);
  EXPECT_EQ(bf16[bf16.qkv_heads].bytes, n * qkv * 2);
  EXPECT_EQ(bf16[bf16.dqkv_heads].bytes, n * qkv * 2);
  o.tensor = 2;
  const MemoryPlan tp = MustPlan(c, o);
  EXPECT_EQ(tp[tp.qkv].bytes, 2 * n * qkv / 2 * 2);
  o.tensor = 8;  // 16 heads do, 4 query groups do not split over 8 ranks
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok());
  EXPECT_FALSE(PlanMemory(c, layout->num_params, o).ok());
  // Multi-head attention in bf16: cuDNN reads Megatron's layout, no copies.
  c.num_query_groups = 0;
  o.tensor = 1;
  const MemoryPlan mha = MustPlan(c, o);
  EXPECT_EQ(mha.qkv_heads, -1);
  // RMSNorm: the weights alone, each layer's two and the final one, in runs that cover them once.
  const std::vector<LayerNormRun> runs = LayerNormRuns(*layout);
  int64_t compact = 0;
  for (const LayerNormRun& r : runs) {
    EXPECT_EQ(r.compact, compact);
    EXPECT_GE(r.begin, 0);
    compact += r.end - r.begin;
  }
  EXPECT_EQ(compact, LayerNormParamCount(c));
  EXPECT_EQ(LayerNormParamCount(c), (2 * 2 + 1) * 768);
  int64_t named = 0;
  for (const ParamInfo& p : layout->infos)
    if (p.name.find("layernorm") != std::string::npos) named += p.size;
  EXPECT_EQ(named, compact);
}

// --qk-layernorm: the QKV product before the norms and the norms' fp32 statistics per layer (mean
// and rstd per token and normalised head under LayerNorm, rstd alone under RMSNorm; this rank's heads
// and groups at tensor size 2), inside a pipeline slot; the backward's partial sums
// (QKNormBackwardScratch); the query and key norms among the norms' fp32 runs (ln_master), and at
// tensor size 2 the buffer their gradients' sum over the tensor group goes through. Nothing of it
// without the flag.
// --apply-layernorm-1p: one fp32 buffer of every norm parameter's 1 + gamma (LayerNormParamCount, ln_master's
// order), whatever the precision and the optimizer's sharding; none without it. --squared-relu plans what
// GELU does (the pre-activation and the activation, named for it).
TEST(CudaMemoryPlan, LayerNorm1pAndSquaredReluBuffersFollowTheConfig) {
  GPTConfig c = Gpt2Small();
  c.num_layers = 2;
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;
  const MemoryPlan plain = MustPlan(c, o);
  EXPECT_EQ(plain.norm_eff, -1);
  c.squared_relu = true;
  const MemoryPlan relu = MustPlan(c, o);
  EXPECT_EQ(relu.total_bytes, plain.total_bytes);
  EXPECT_EQ(relu[relu.gelu].name, "activations: MLP squared ReLU");
  c.apply_layernorm_1p = true;
  c.qk_layernorm = true;
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    o.precision = p;
    const MemoryPlan one_p = MustPlan(c, o);
    ASSERT_GE(one_p.norm_eff, 0);
    EXPECT_EQ(one_p[one_p.norm_eff].bytes, LayerNormParamCount(c) * 4);
    EXPECT_EQ(LayerNormParamCount(c), 2 * (5 * 768 + 2 * 2 * 64));  // weight and bias: 2 per layer + final, q/k
  }
}

TEST(CudaMemoryPlan, QKLayerNormBuffersFollowTheConfig) {
  GPTConfig c = Gpt2Small();
  c.num_layers = 2;
  c.num_attention_heads = 16;
  c.num_query_groups = 4;
  c.kv_channels = 128;
  const int64_t n = 2 * 256, qw = (16 + 2 * 4) * 128, L = 2;
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;
  const MemoryPlan plain = MustPlan(c, o);
  EXPECT_EQ(plain.qkv_raw, -1);
  EXPECT_EQ(plain.qk_stats, -1);
  EXPECT_EQ(plain.qk_scratch, -1);
  c.qk_layernorm = true;
  const AttentionShape shape{2, 256, 16, 128, 4};
  EXPECT_EQ(QKNormBackwardScratch(shape), (n / 64) * 4 * 128);  // 64-token blocks x (dwq, dbq, dwk, dbk)
  o.qk_norm_scratch_doubles = QKNormBackwardScratch(shape);
  for (Normalization norm : {Normalization::kLayerNorm, Normalization::kRMSNorm}) {
    c.normalization = norm;
    const int64_t k = norm == Normalization::kLayerNorm ? 2 : 1;
    for (Precision p : {Precision::kFp32, Precision::kBf16}) {
      o.precision = p;
      o.tensor = 1;
      const MemoryPlan m = MustPlan(c, o);
      const int64_t a = p == Precision::kFp32 ? 4 : 2;
      ASSERT_GE(m.qkv_raw, 0);
      EXPECT_EQ(m[m.qkv_raw].bytes, L * n * qw * a);
      EXPECT_EQ(m.qk_rows, 16 + 4);
      EXPECT_EQ(m.qk_stats_per_layer, k * n * 20);
      EXPECT_EQ(m[m.qk_stats].bytes, L * k * n * 20 * 4);
      EXPECT_EQ(m[m.qk_scratch].bytes, (n / 64) * 4 * 128 * 8);
      // A pipeline stage keeps them per micro-batch in flight: inside resid .. lnf_stats.
      EXPECT_GT(m.qkv_raw, m.resid);
      EXPECT_LT(m.qk_stats, m.lnf_stats);
      o.tensor = 2;
      const MemoryPlan two = MustPlan(c, o);
      EXPECT_EQ(two[two.qkv_raw].bytes * 2, m[m.qkv_raw].bytes);
      EXPECT_EQ(two.qk_rows, 10);
      EXPECT_EQ(two[two.qk_stats].bytes * 2, m[m.qk_stats].bytes);
      EXPECT_EQ(two.ntp_grads, -1);  // planned when the caller names the gradients to sum
    }
    // The norms' fp32 runs: ln1, ln2 and the final norm (hidden each), and each layer's query and
    // key norms (head_dim each), exactly the tensors named layernorm, LayerNormParamCount together;
    // at tensor rank 1 of 2 too (the norms are whole on every rank).
    for (int tensor : {1, 2}) {
      auto layout = ParamLayout::Create(c, tensor, tensor - 1);
      ASSERT_TRUE(layout.ok()) << layout.status();
      int64_t compact = 0;
      for (const LayerNormRun& r : LayerNormRuns(*layout)) {
        EXPECT_EQ(r.compact, compact);
        compact += r.end - r.begin;
      }
      EXPECT_EQ(compact, LayerNormParamCount(c));
      EXPECT_EQ(LayerNormParamCount(c), k * ((2 * 2 + 1) * 768 + 2 * 2 * 128));
      int64_t named = 0;
      for (const ParamInfo& p : layout->infos) {
        const bool norm_tensor = p.name.find("layernorm") != std::string::npos;
        bool inside = false;
        for (const LayerNormRun& r : LayerNormRuns(*layout))
          inside |= p.offset >= r.begin && p.offset + p.size <= r.end;
        EXPECT_EQ(inside, norm_tensor) << p.name;
        if (norm_tensor) named += p.size;
      }
      EXPECT_EQ(named, compact);
      // Tensor parallelism: the query and key norms' gradients summed over the group (each rank's
      // heads' share) through the planned buffer, without --sequence-parallel.
      if (tensor == 2) {
        int64_t sums = 0;
        for (const GradRange& g : NonTensorParallelGradRanges(*layout, false)) sums += g.size();
        EXPECT_EQ(sums, L * 2 * k * 128);
        o.tensor = 2;
        o.non_tensor_parallel_grads = sums;
        auto plan = PlanMemory(c, layout->num_params, o);
        ASSERT_TRUE(plan.ok()) << plan.status();
        ASSERT_GE(plan->ntp_grads, 0);
        EXPECT_EQ((*plan)[plan->ntp_grads].bytes, sums * 4);
        EXPECT_EQ(plan->sp_stage, -1);
        o.non_tensor_parallel_grads = 0;
      }
    }
  }
}

// bf16's softmax statistics: each sample's 16-byte aligned (FlashStatsStride), since with attention
// dropout every sample is a cuDNN call of its own. 3 heads x 37 positions: 112 floats a sample, not 111.
TEST(CudaMemoryPlan, FlashStatisticsLeaveEachSampleAligned) {
  GPTConfig c = Gpt2Small();
  c.num_layers = 2;
  c.num_attention_heads = 3;
  c.hidden_size = 192;
  c.seq_length = c.max_position_embeddings = 64;
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 3;
  o.seq_length = 37;
  const MemoryPlan m = MustPlan(c, o);
  EXPECT_EQ(m[m.attn_saved].bytes, 2 * 3 * 112 * 4);
  o.seq_length = 64;  // 3 x 64: a multiple of 4, as before
  const MemoryPlan even = MustPlan(c, o);
  EXPECT_EQ(even[even.attn_saved].bytes, 2 * 3 * 3 * 64 * 4);
}

TEST(CudaMemoryPlan, ParametersKeepTheirPlaceWhateverTheBatchShape) {
  const GPTConfig c = Gpt2Small();
  PlanOptions small, large;
  small.micro_batch_size = 1;
  small.seq_length = 128;
  large.micro_batch_size = 8;
  const MemoryPlan a = MustPlan(c, small), b = MustPlan(c, large);
  for (int i : {a.master, a.compute, a.grads, a.exp_avg, a.exp_avg_sq}) {  // and ln_master, when there is one
    EXPECT_EQ(a[i].offset, b[i].offset) << a[i].name;
    EXPECT_EQ(a[i].bytes, b[i].bytes) << a[i].name;
  }
  EXPECT_GT(b.total_bytes, a.total_bytes);
}

// A pipeline stage plans its own layers' activations, P - s slots of them (slot 0 in the usual
// buffers, the others in pipeline_slots), the last stage each slot's final-norm gradient; the
// exchange with its neighbours needs no buffer of its own (PipelineExchangeBuffers).
TEST(CudaMemoryPlan, PipelineStageKeepsItsLayersActivationsPerSlot) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 2;
  const MemoryPlan whole = MustPlan(c, o);
  EXPECT_EQ(whole.pipeline_slots, -1);
  EXPECT_EQ(whole.pipeline_exchange, -1);
  o.layers = 3;  // a stage of 3 of the 12 layers, the first of 4: 4 slots
  o.pipeline_slots = 4;
  const MemoryPlan first = MustPlan(c, o);
  const int64_t n = 2 * 1024;
  EXPECT_EQ(first[first.qkv].bytes, 3 * n * 3 * 768 * 2);
  EXPECT_EQ(first[first.resid].bytes, 4 * n * 768 * 2);
  // A slot: the activations from resid through lnf_stats, aligned.
  const int64_t span = first[first.lnf_stats].offset + first[first.lnf_stats].bytes - first[first.resid].offset;
  EXPECT_GE(first.slot_bytes, span);
  EXPECT_LT(first.slot_bytes - span, MemoryPlan::kAlignment);
  EXPECT_EQ(first.slot_bytes % MemoryPlan::kAlignment, 0);
  EXPECT_LT(first.slot_bytes, whole.slot_bytes);
  EXPECT_EQ(first[first.pipeline_slots].bytes, 3 * first.slot_bytes);
  EXPECT_EQ(first[first.pipeline_head_grads].bytes, 0);  // not the last stage: no LM head
  EXPECT_EQ(first[first.logits].bytes, 0);
  // The direct exchange receives into and sends from the slots' residual streams and the residual
  // gradient: no buffer of its own.
  EXPECT_EQ(first[first.pipeline_exchange].bytes, 0);
  o.pipeline_slots = 1;  // the last stage: one micro-batch in flight, its head gradient kept
  o.pipeline_last = true;
  const MemoryPlan last = MustPlan(c, o);
  EXPECT_EQ(last[last.pipeline_slots].bytes, 0);
  EXPECT_EQ(last[last.pipeline_head_grads].bytes, n * 768 * 2);
  EXPECT_EQ(last[last.logits].bytes, whole[whole.logits].bytes);
  int64_t end = 0;
  for (const PlannedBuffer& b : first.buffers) {
    EXPECT_EQ(b.offset % MemoryPlan::kAlignment, 0) << b.name;
    EXPECT_GE(b.offset, end) << b.name << " overlaps the buffer before it";
    end = b.offset + b.bytes;
  }
  EXPECT_LE(end, first.total_bytes);
}

// The interleaved schedule (model chunks): a slot holds one chunk's layers, exactly a stage of that
// many layers' slot; the dropout streams stay the stage's; each slot gets an output gradient of its
// own for the direct exchange (none under the host exchange); layers that do not divide by the
// chunks, or chunks without slots, are refused.
TEST(CudaMemoryPlan, ModelChunksKeepOneChunksLayersPerSlot) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.precision = Precision::kBf16;
  o.micro_batch_size = 2;
  o.layers = 2;  // the activations of a chunk of 2 layers, as a stage of 2 layers keeps them
  o.pipeline_slots = 7;
  const MemoryPlan flat = MustPlan(c, o);
  o.layers = 6;  // a stage of 6 of the 12 layers in 3 chunks of 2
  o.pipeline_chunks = 3;
  const MemoryPlan chunks = MustPlan(c, o);
  const int64_t n = 2 * 1024;
  EXPECT_EQ(chunks.slot_layers, 2);
  EXPECT_EQ(chunks.slot_bytes, flat.slot_bytes);
  EXPECT_EQ(chunks[chunks.resid].bytes, 3 * n * 768 * 2);
  EXPECT_EQ(chunks[chunks.qkv].bytes, 2 * n * 3 * 768 * 2);
  EXPECT_EQ(chunks[chunks.pipeline_slots].bytes, 6 * chunks.slot_bytes);
  EXPECT_EQ(chunks[chunks.streams].bytes, StreamTableSize(6, 2) * 8);
  EXPECT_EQ(flat[flat.streams].bytes, StreamTableSize(2, 2) * 8);
  EXPECT_EQ(chunks[chunks.pipeline_output_grads].bytes, 7 * n * 768 * 2);
  EXPECT_EQ(flat[flat.pipeline_output_grads].bytes, 0);  // 1F1B: one gradient at a time, in dresid
  o.pipeline_host_exchange = true;
  const MemoryPlan host = MustPlan(c, o);
  EXPECT_EQ(host[host.pipeline_output_grads].bytes, 0);
  o.pipeline_host_exchange = false;
  o.sequence_parallel = true;  // the exchange is this tensor rank's rows
  o.tensor = 2;
  const MemoryPlan sp = MustPlan(c, o);
  EXPECT_EQ(sp[sp.pipeline_output_grads].bytes, 7 * (n / 2) * 768 * 2);
  o.sequence_parallel = false;
  o.tensor = 1;
  int64_t end = 0;
  for (const PlannedBuffer& b : chunks.buffers) {
    EXPECT_EQ(b.offset % MemoryPlan::kAlignment, 0) << b.name;
    EXPECT_GE(b.offset, end) << b.name << " overlaps the buffer before it";
    end = b.offset + b.bytes;
  }
  EXPECT_LE(end, chunks.total_bytes);
  o.pipeline_chunks = 4;  // 6 layers do not make 4 chunks
  EXPECT_FALSE(PlanMemory(c, 1000, o).ok());
  o.pipeline_chunks = 3;
  o.pipeline_slots = 0;
  EXPECT_FALSE(PlanMemory(c, 1000, o).ok());
}

TEST(CudaMemoryPlan, Fp32KeepsProbabilitiesPerLayerUnlessRecomputed) {
  GPTConfig c = Gpt2Small();
  c.num_layers = 2;
  PlanOptions o;
  o.micro_batch_size = 2;
  o.seq_length = 256;
  const MemoryPlan kept = MustPlan(c, o);
  EXPECT_EQ(kept[kept.attn_saved].bytes, 2 * 2 * 12 * 256 * 256 * 4);
  EXPECT_EQ(kept[kept.compute].bytes, 0);  // fp32: the products read the master weights
  c.recompute_activations = true;
  const MemoryPlan recomputed = MustPlan(c, o);
  EXPECT_EQ(recomputed[recomputed.attn_saved].bytes, 2 * 12 * 256 * 256 * 4);
  EXPECT_LT(recomputed.total_bytes, kept.total_bytes);
}

TEST(CudaMemoryPlan, LargestNamesTheBiggestBuffersAndWhatShrinksThem) {
  GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.micro_batch_size = 8;  // fp32: 12 layers of 8 x 12 x 1024 x 1024 probabilities = 4.5 GiB
  const MemoryPlan m = MustPlan(c, o);
  const std::string largest = m.Largest(2);
  EXPECT_NE(largest.find("attention probabilities"), std::string::npos) << largest;
  EXPECT_NE(largest.find("4.50 GiB"), std::string::npos) << largest;
  EXPECT_NE(largest.find("--recompute-activations"), std::string::npos) << largest;
}

TEST(CudaMemoryPlan, RefusesShapesOutsideTheConfig) {
  const GPTConfig c = Gpt2Small();
  PlanOptions o;
  o.micro_batch_size = 0;
  EXPECT_FALSE(PlanMemory(c, 1, o).ok());
  o.micro_batch_size = 1;
  o.seq_length = 2048;
  EXPECT_FALSE(PlanMemory(c, 1, o).ok());
}

TEST(CudaMemoryPlan, FormatsBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3 << 20), "3.0 MiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.00 GiB");
}

// What a stage exchanges with its neighbours: the direct exchange's buffers are the slot's residual
// stream (its first and last layer, (n, hidden) each in the model's dtype, slot_bytes apart) and
// the residual gradient, already planned; the host exchange (the oracle, or a host communicator)
// adds the fp32 (n, hidden) staging its bf16/fp16 casts go through, nothing in fp32 (the copies go
// straight into the activations). The rest of the plan is the same either way.
TEST(CudaMemoryPlan, PipelineExchangeBuffers) {
  const GPTConfig c = Gpt2Small();
  const int64_t n = 2 * 1024, L = 3;
  for (Precision p : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
    SCOPED_TRACE(std::string(PrecisionName(p)));
    const int64_t a = p == Precision::kFp32 ? 4 : 2;
    PlanOptions o;
    o.precision = p;
    o.micro_batch_size = 2;
    o.layers = L;
    o.pipeline_slots = 3;
    const MemoryPlan direct = MustPlan(c, o);
    o.pipeline_host_exchange = true;
    const MemoryPlan host = MustPlan(c, o);
    EXPECT_EQ(direct[direct.pipeline_exchange].bytes, 0);
    EXPECT_EQ(host[host.pipeline_exchange].bytes, p == Precision::kFp32 ? 0 : n * 768 * 4);
    // The direct exchange's buffers: each slot's residual stream holds the input (layer 0) and the
    // output (layer L) of (n, hidden) in the model's dtype; the residual gradient one more.
    EXPECT_EQ(direct[direct.resid].bytes, (L + 1) * n * 768 * a);
    EXPECT_EQ(direct[direct.dresid].bytes, n * 768 * a);
    EXPECT_EQ(direct[direct.pipeline_slots].bytes, 2 * direct.slot_bytes);
    ASSERT_EQ(direct.buffers.size(), host.buffers.size());
    for (size_t i = 0; i < direct.buffers.size(); ++i) {
      if (static_cast<int>(i) != direct.pipeline_exchange) {
        EXPECT_EQ(direct.buffers[i].bytes, host.buffers[i].bytes) << direct.buffers[i].name;
      }
    }
    EXPECT_EQ(host.total_bytes - direct.total_bytes, p == Precision::kFp32 ? 0 : n * 768 * 4);
  }
}

// A pipeline stage's re-plan for a larger micro-batch (CudaGPTModelImpl::PlanStage): an input
// received into a slot whose forward pass has not run is carried across it, never lost; another
// slot's forward activations refuse it.
TEST(StageReplan, APlannedShapeNeedsNoReplan) {
  const StageReplan r = PlanStageReplan(4, 1024, 2, 512, 1, /*live=*/0b01, /*received=*/0b10).value();
  EXPECT_FALSE(r.replan);
  EXPECT_TRUE(r.carried.empty());
}

TEST(StageReplan, ReceivedSlotsAreCarriedAcrossTheReplan) {
  // Slot 0 received its (small) input; slot 2's larger micro-batch re-plans before slot 0's forward.
  const StageReplan r = PlanStageReplan(2, 512, 4, 256, 2, /*live=*/0, /*received=*/0b0001).value();
  EXPECT_TRUE(r.replan);
  EXPECT_EQ(r.b, 4);
  EXPECT_EQ(r.t, 512);  // the larger of each: every micro-batch seen so far still fits
  EXPECT_EQ(r.carried, (std::vector<int>{0}));
  // The slot itself, when it had already received (a second StageBuffers), and every other one.
  EXPECT_EQ(PlanStageReplan(1, 64, 1, 128, 3, 0, 0b1101).value().carried, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(PlanStageReplan(1, 64, 1, 128, 63, 0, uint64_t{1} << 63).value().carried, (std::vector<int>{63}));
}

TEST(StageReplan, OtherSlotsForwardActivationsRefuseIt) {
  const absl::StatusOr<StageReplan> r = PlanStageReplan(2, 512, 2, 1024, 1, /*live=*/0b101, /*received=*/0b10);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("a 2x1024 micro-batch is larger than the 2x512 planned while other "
                                      "micro-batches' activations are in flight (slots 0, 2)"),
            std::string::npos)
      << r.status();
  // The slot's own earlier forward is no obstacle: its next forward pass overwrites it.
  EXPECT_TRUE(PlanStageReplan(2, 512, 2, 1024, 1, /*live=*/0b10, 0).value().replan);
  EXPECT_FALSE(PlanStageReplan(2, 512, 0, 1024, 1, 0, 0).ok());
  EXPECT_FALSE(PlanStageReplan(2, 512, 2, 1024, 64, 0, 0).ok());
}

}  // namespace
}  // namespace ptk::cuda
