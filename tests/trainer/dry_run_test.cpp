// ptk-train --dry-run's plan: the activation formula against the paper's Table 2, the memory of each
// stage by hand, the printed plan line for line, the refusals, and the cluster from the launcher's
// variables.
#include "trainer/dry_run.h"

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "common/status.h"
#include "trainer/param_layout.h"

namespace ptk {
namespace {

GPTConfig Model(int64_t layers, int64_t hidden, int64_t heads, int64_t seq, int64_t vocab) {
  GPTConfig c;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.seq_length = seq;
  c.vocab_size = vocab;
  return c;
}

// Korthikanti et al. 2022, Table 2 (2-byte activations, MLP of 4h), per layer and tensor rank.
TEST(ActivationBytesPerLayer, IsThePapersTableTwo) {
  GPTConfig c = Model(1, 4096, 32, 2048, 50257);
  const double s = 2048, b = 4, h = 4096, a = 32, sbh = s * b * h;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, 1, false, false, 2), sbh * (34 + 5 * a * s / h));
  for (double t : {2.0, 8.0}) {
    const int ti = static_cast<int>(t);
    EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, ti, false, false, 2), sbh * (10 + 24 / t + 5 * a * s / (h * t)));
    EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, ti, true, false, 2), sbh / t * (34 + 5 * a * s / h));
    EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, ti, false, true, 2), sbh * (10 + 24 / t));
    EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, ti, true, true, 2), sbh * 34 / t);
  }
  // Sequence parallelism without tensor parallelism changes nothing.
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, 1, true, false, 2), ActivationBytesPerLayer(c, 4, 1, false, false, 2));
  // fp32: the values take 4 bytes, the dropout masks (2sbh + as²b) stay 1.
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, 1, false, false, 4), sbh * 66 + 9 * a * s * s * b);
  // An MLP of F: sbh(18 + 4F/h) + 5as²b.
  c.ffn_hidden_size = 3 * 4096;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, 1, false, false, 2), sbh * (18 + 12) + 5 * a * s * s * b);
}

// Mixture of experts: each MoE layer's shared experts (width S) see every token once, fc1's and fc2's inputs 2sbS
// more (3sbS with SwiGLU), the layers' mean taken as the experts'.
TEST(ActivationBytesPerLayer, CountsTheSharedExperts) {
  GPTConfig c = Model(4, 1024, 8, 512, 50257);
  c.ffn_hidden_size = 4096;
  c.num_experts = 8;
  c.moe_ffn_hidden_size = 1024;
  c.moe_layer_pattern = {1, 0, 1, 0};
  const double s = 512, b = 2, v = 2, S = 768;
  const double plain = ActivationBytesPerLayer(c, 2, 1, false, false, 2);
  c.moe_shared_expert_intermediate_size = 768;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 2, 1, false, false, 2), plain + 0.5 * v * 2 * s * b * S);
  c.swiglu = true;
  c.moe_shared_expert_intermediate_size = 0;
  const double swiglu = ActivationBytesPerLayer(c, 2, 1, false, false, 2);
  c.moe_shared_expert_intermediate_size = 768;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 2, 1, false, false, 2), swiglu + 0.5 * v * 3 * s * b * S);
}

// --attention-output-gate: the gate's rows of the QKV product and the ungated attention output, 2sb x a·kv values
// more (split over the tensor ranks, as the rest of the attention); a sliding window and the softmax offsets keep
// the probabilities' as²b (Megatron's unfused softmax masks them).
TEST(ActivationBytesPerLayer, CountsTheOutputGateNotTheWindow) {
  GPTConfig c = Model(1, 4096, 32, 2048, 50257);
  const double s = 2048, b = 4, h = 4096, v = 2;
  const double plain = ActivationBytesPerLayer(c, 4, 1, false, false, 2);
  GPTConfig g = c;
  g.attention_output_gate = true;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(g, 4, 1, false, false, 2), plain + v * 2 * s * b * h);
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(g, 4, 2, false, true, 2),
                   ActivationBytesPerLayer(c, 4, 2, false, true, 2) + v * 2 * s * b * h / 2);
  g.num_query_groups = 8;  // the gate is per query head: grouped-query attention leaves it whole
  c.num_query_groups = 8;
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(g, 4, 1, false, false, 2),
                   ActivationBytesPerLayer(c, 4, 1, false, false, 2) + v * 2 * s * b * h);
  GPTConfig w = c;
  w.window_left = 128;
  w.softmax_type = "learnable";
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(w, 4, 1, false, false, 2),
                   ActivationBytesPerLayer(c, 4, 1, false, false, 2));
}

// MoE layers: the experts' inputs k x sb rows of 2F (the layer's MLP), with a capacity factor at most E x capacity
// rows: E = 8, k = 2, sb = 8192 tokens, F = 0.5 gives 8 x ceil(2048 x 0.5) = 8192 rows, half of the dropless 16384.
TEST(ActivationBytesPerLayer, MoeLayersCountTheExpertsCapacity) {
  GPTConfig c = Model(1, 4096, 32, 2048, 50257);
  c.num_experts = 8;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 1024;
  const double sb = 2048 * 4, dense = ActivationBytesPerLayer(c, 4, 1, false, false, 2);
  c.moe_expert_capacity_factor = 0.5;
  EXPECT_DOUBLE_EQ(dense - ActivationBytesPerLayer(c, 4, 1, false, false, 2), 2.0 * 2 * (2 * sb - sb) * 1024);
  c.moe_expert_capacity_factor = 3;  // above k x sb rows: the dropless count
  EXPECT_DOUBLE_EQ(ActivationBytesPerLayer(c, 4, 1, false, false, 2), dense);
}

DryRunOptions Small() {
  DryRunOptions o;
  o.model = Model(4, 64, 8, 32, 1000);
  o.make_vocab_size_divisible_by = 8;
  o.tensor = 2;
  o.pipeline = 2;
  o.micro_batch_size = 2;
  o.global_batch_size = 16;
  o.precision = Precision::kBf16;
  o.cluster.world_size = 8;
  o.cluster.world_source = "WORLD_SIZE";
  o.cluster.gpus_per_node = 4;
  o.cluster.gpus_source = "--gpus-per-node";
  return o;
}

// By hand: h 64, T 2: a layer holds 6h² + 9.5h = 25184 parameters a rank; the vocabulary 1000
// padded to 1008, a slice of 504 × 64 = 32256; positions 32 × 64 = 2048; final LayerNorm 128.
// Activations per layer (s 32, b 2, sbh 4096, T 2, no sequence parallelism):
// sbh(10 + 24/2 + 5·8·32/(64·2)) = 131072 bytes, 90112 without the attention core.
// --context-parallel-size: each context rank holds s/C positions of a sample (Megatron's CP), so the
// activations of a stage are the same run's at C = 1 over C; ZeRO-1 shards over data × context ranks.
TEST(PlanDryRun, ContextRanksHoldTheirShareOfTheActivations) {
  DryRunOptions one = Small();
  one.cluster.world_size = 16;
  one.global_batch_size = 32;
  DryRunOptions cp = one;
  cp.context = 2;
  auto a = PlanDryRun(one), b = PlanDryRun(cp);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->data_parallel, 4);
  EXPECT_EQ(b->data_parallel, 2);
  EXPECT_EQ(b->context_parallel, 2);
  // Micro-batches per data rank double, so the in-flight count (min(P - p, m)) stays 2 and 1.
  for (size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(a->stages[p].in_flight, b->stages[p].in_flight);
    EXPECT_DOUBLE_EQ(b->stages[p].activations, a->stages[p].activations / 2);
    EXPECT_DOUBLE_EQ(b->stages[p].activations_recomputed, a->stages[p].activations_recomputed / 2);
    EXPECT_DOUBLE_EQ(b->stages[p].optimizer_zero1, a->stages[p].optimizer_zero1);  // over 2 x 2 = 4 ranks either way
  }
  auto report = DryRunReport(cp);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NE(report->find("layout: 16 ranks = tensor 2 x context 2 x data 2 x pipeline 2 (Megatron's rank order "
                         "tp-cp-ep-dp-pp: rank = t + 2*c + 4*d + 8*p)"),
            std::string::npos)
      << *report;
  EXPECT_NE(report->find("  context groups: 8 of 2 ranks: [0, 2] [1, 3] [4, 6] ... [13, 15]"), std::string::npos)
      << *report;
  cp.model.seq_length = 30;
  const absl::Status st = PlanDryRun(cp).status();
  EXPECT_TRUE(IsUsageError(st));
  EXPECT_EQ(StatusMessage(st), "--context-parallel-size 2: --seq-length 30 must be a multiple of 2 x 2 = 4");
}

TEST(PlanDryRun, MemoryOfEachStageByHand) {
  auto plan = PlanDryRun(Small());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->data_parallel, 2);
  EXPECT_EQ(plan->micro_batches, 4);
  EXPECT_EQ(plan->model.padded_vocab_size, 1008);
  ASSERT_EQ(plan->stages.size(), 2u);
  const StageMemory& s0 = plan->stages[0];
  EXPECT_EQ(s0.params, 2 * 25184 + 32256 + 2048);
  EXPECT_EQ(s0.in_flight, 2);
  EXPECT_DOUBLE_EQ(s0.weights, 2.0 * s0.params);
  EXPECT_DOUBLE_EQ(s0.gradients, 4.0 * s0.params);
  EXPECT_DOUBLE_EQ(s0.optimizer, 12.0 * s0.params);
  EXPECT_DOUBLE_EQ(s0.optimizer_zero1, 6.0 * s0.params);
  // 2 layers × 2 micro-batches, plus the embedding's ids and dropout mask (8sb + sbh) × 2 / T.
  EXPECT_DOUBLE_EQ(s0.activations, 4 * 131072.0 + 2 * (8 * 64 + 4096) / 2.0);
  EXPECT_DOUBLE_EQ(s0.activations_recomputed, 4 * 90112.0 + 2 * (8 * 64 + 4096) / 2.0);
  EXPECT_DOUBLE_EQ(s0.total, s0.weights + s0.gradients + s0.optimizer + s0.activations);
  const StageMemory& s1 = plan->stages[1];
  EXPECT_EQ(s1.params, 2 * 25184 + 32256 + 128);
  EXPECT_EQ(s1.in_flight, 1);
  // The output layer's input and fp32 logits: (4sbh + 4sb·1008) / T.
  EXPECT_DOUBLE_EQ(s1.activations, 2 * 131072.0 + (4 * 4096 + 4 * 64 * 1008) / 2.0);

  DryRunOptions o = Small();
  o.use_distributed_optimizer = true;
  o.model.recompute_activations = true;
  o.precision = Precision::kFp32;
  plan = PlanDryRun(o);
  ASSERT_TRUE(plan.ok());
  const StageMemory& f0 = plan->stages[0];
  EXPECT_DOUBLE_EQ(f0.weights, 4.0 * f0.params);
  EXPECT_DOUBLE_EQ(f0.optimizer, 8.0 * f0.params);  // fp32: the weights are the master copy
  EXPECT_DOUBLE_EQ(f0.total, f0.weights + f0.gradients + f0.optimizer / 2 + f0.activations_recomputed);
}

// Expert parallelism (E = 2 of 4 data ranks, 4 experts): each rank holds 2 of each MoE layer's 4 experts (the
// router keeps all 4 rows), as its ParamLayout does; ZeRO-1 shards the dense state over the 4 data ranks and the
// experts' over the 2 expert-data ranks (Megatron's).
TEST(PlanDryRun, ExpertRanksCountTheirOwnExpertsOnly) {
  DryRunOptions o;
  o.model = Model(2, 64, 8, 32, 1000);
  o.model.num_experts = 4;
  o.model.moe_ffn_hidden_size = 48;
  o.model.add_bias_linear = false;
  o.make_vocab_size_divisible_by = 8;
  o.micro_batch_size = 1;
  o.global_batch_size = 4;
  o.cluster.world_size = 4;
  o.cluster.world_source = "WORLD_SIZE";
  o.cluster.gpus_per_node = 4;
  o.cluster.gpus_source = "--gpus-per-node";
  auto whole = PlanDryRun(o);
  ASSERT_TRUE(whole.ok()) << whole.status();
  o.expert = 2;
  o.use_distributed_optimizer = true;
  auto plan = PlanDryRun(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t expert = 2 * 48 * 64;  // fc1 and fc2 (GELU: no gate)
  const StageMemory &all = whole->stages[0], &mine = plan->stages[0];
  EXPECT_EQ(mine.params, all.params - 2 * 2 * expert);  // 2 layers x the 2 experts of the other rank
  auto layout = ParamLayout::Create(plan->model, 1, 0, {}, 2, 1);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(mine.params, layout->num_params);
  EXPECT_DOUBLE_EQ(mine.weights, 4.0 * mine.params);
  EXPECT_DOUBLE_EQ(mine.gradients, 4.0 * mine.params);
  EXPECT_DOUBLE_EQ(mine.optimizer, 8.0 * mine.params);
  const double local = 2 * 2 * expert;
  EXPECT_DOUBLE_EQ(mine.optimizer_zero1, 8.0 * ((mine.params - local) / 4 + local / 2));
  EXPECT_DOUBLE_EQ(mine.total, mine.weights + mine.gradients + mine.optimizer_zero1 + mine.activations);
  auto report = DryRunReport(o);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NE(report->find("the experts' over the 2 expert-data-parallel ranks; each rank holds 2 of the 4 experts"),
            std::string::npos)
      << *report;
}

// The interleaved schedule (V = 2 chunks of one layer, P = 2, 4 micro-batches): the same
// parameters per rank; stage p keeps (P - p - 1) * 2 + (V - 1) * P + 1 virtual micro-batches of one
// layer each, so the first stage holds Megatron's 1 + (P - 1) / (P V) times the 1F1B layers'
// activations (theoretical_memory_usage.py's interleaved penalty); micro-batches not a multiple of P
// are refused.
TEST(PlanDryRun, InterleavedScheduleKeepsMegatronsVirtualMicroBatches) {
  auto plain = PlanDryRun(Small());
  DryRunOptions o = Small();
  o.virtual_size = 2;
  auto plan = PlanDryRun(o);
  ASSERT_TRUE(plain.ok() && plan.ok()) << plan.status();
  const double embedding = 2 * (8 * 64 + 4096) / 2.0;  // the first stage's ids and dropout mask per micro-batch
  for (int p = 0; p < 2; ++p) {
    const StageMemory &s = plan->stages[static_cast<size_t>(p)], &was = plain->stages[static_cast<size_t>(p)];
    EXPECT_EQ(s.params, was.params);
    EXPECT_EQ(s.in_flight, (2 - p - 1) * 2 + 2 + 1);
  }
  EXPECT_EQ(plan->stages[1].activations, 3 * 131072.0 + (4 * 4096 + 4 * 64 * 1008) / 2.0);
  const double layers0 = plan->stages[0].activations - embedding * 5 / 4.0,
               plain0 = plain->stages[0].activations - embedding;
  EXPECT_DOUBLE_EQ(layers0 / plain0, 1 + (2 - 1) / (2.0 * 2));
  o.global_batch_size = 12;  // 3 micro-batches a step
  auto odd = PlanDryRun(o);
  ASSERT_FALSE(odd.ok());
  EXPECT_TRUE(IsUsageError(odd.status()));
  EXPECT_NE(odd.status().message().find("must be a multiple of it"), std::string::npos) << odd.status();
  auto report = DryRunReport(Small());
  o.global_batch_size = 16;
  auto interleaved = DryRunReport(o);
  ASSERT_TRUE(report.ok() && interleaved.ok());
  EXPECT_NE(interleaved->find("virtual micro-batches of its 2 chunks' layers each"), std::string::npos) << *interleaved;
}

// --microbatch-group-size-per-virtual-pipeline-stage N: the warm-up holds (V - 1) x N virtual
// micro-batches, not (V - 1) x P; the groups Megatron refuses are refused in its terms.
TEST(PlanDryRun, MicroBatchGroupsSetTheVirtualMicroBatchesInFlight) {
  DryRunOptions o = Small();
  o.virtual_size = 2;
  o.global_batch_size = 32;  // 8 micro-batches a step
  o.microbatch_group_size = 4;
  auto plan = PlanDryRun(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages[0].in_flight, 2 + 4 + 1);
  EXPECT_EQ(plan->stages[1].in_flight, 0 + 4 + 1);
  auto report = DryRunReport(o);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NE(report->find("micro-batch groups of N = 4"), std::string::npos) << *report;
  for (const auto& [group, says] :
       std::vector<std::pair<int, std::string>>{{1, "[PP=2, M=8]"}, {9, "[PP=2, M=8]"}, {7, "holds 1 (M mod N)"}}) {
    o.microbatch_group_size = group;
    auto refused = PlanDryRun(o);
    ASSERT_FALSE(refused.ok()) << group;
    EXPECT_TRUE(IsUsageError(refused.status()));
    EXPECT_NE(refused.status().message().find(says), std::string::npos) << refused.status();
    EXPECT_NE(refused.status().message().find("--global-batch-size 32"), std::string::npos) << refused.status();
  }
}

TEST(DryRunReport, PrintsMegatronsLinesTheLayoutAndTheMemory) {
  auto text = DryRunReport(Small());
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string head =
      "dry run: 8 ranks (WORLD_SIZE), 4 GPUs per node (--gpus-per-node); nothing is built, allocated or read\n"
      " > padded vocab (size: 1000) with 8 dummy tokens (new size: 1008)\n"
      "> initialized tensor model parallel with size 2\n"
      "> initialized pipeline model parallel with size 2\n"
      "layout: 8 ranks = tensor 2 x data 2 x pipeline 2 (Megatron's rank order tp-cp-ep-dp-pp: rank = t + 2*d + "
      "4*p)\n"
      "  rank 0 (t 0, d 0, p 0), rank 1 (t 1, d 0, p 0), rank 2 (t 0, d 1, p 0), rank 4 (t 0, d 0, p 1), rank 7 "
      "(t 1, d 1, p 1)\n"
      "  tensor groups: 4 of 2 ranks: [0-1] [2-3] [4-5] [6-7]\n"
      "  data groups: 4 of 2 ranks: [0, 2] [1, 3] [4, 6] [5, 7]\n"
      "  pipeline groups: 4 of 2 ranks: [0, 4] [1, 5] [2, 6] [3, 7]\n"
      "  embedding (first and last stage) groups: 4 of 2 ranks: [0, 4] [1, 5] [2, 6] [3, 7]\n"
      "  model-parallel (tensor x pipeline) groups: 2 of 4 ranks: [0-1, 4-5] [2-3, 6-7]\n"
      "batch: global 16 = micro-batch 2 x 4 micro-batches x data-parallel 2\n"
      " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 84672\n"
      " > number of parameters on (tensor, pipeline) model parallel rank (1, 0): 84672\n"
      " > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 82752\n"
      " > number of parameters on (tensor, pipeline) model parallel rank (1, 1): 82752\n"
      "model: 266624 parameters (2 tensor x 2 pipeline ranks)\n"
      "memory per GPU in GiB, bf16: weights 2 B, gradients 4 B, optimizer state 12 B per parameter (fp32 master "
      "weights and Adam's two moments); ZeRO-1 (--use-distributed-optimizer) shards the optimizer state over the 2 "
      "data-parallel ranks\n";
  EXPECT_EQ(text->substr(0, head.size()), head);
  EXPECT_NE(text->find("\n stage layers   parameters  weights gradients optimizer    ZeRO-1 activations recomputed"
                       "    total\n     0      2        84672     0.00      0.00      0.00      0.00        0.00"
                       "       0.00     0.00\n     1      2        82752 "),
            std::string::npos)
      << *text;
  EXPECT_NE(text->find("\ntotal: as this run is configured (no --use-distributed-optimizer, no "
                       "--recompute-activations); the most loaded GPU is stage 0's, 0.00 GiB\n"),
            std::string::npos)
      << *text;
  EXPECT_EQ(text->find("warning"), std::string::npos);

  // Abbreviated groups of a large world: the first three, "...", the last.
  DryRunOptions big = Small();
  big.model = Model(96, 12288, 96, 2048, 50257);
  big.make_vocab_size_divisible_by = 128;
  big.tensor = 8;
  big.pipeline = 16;
  big.global_batch_size = 0;
  big.cluster.world_size = 1024;
  text = DryRunReport(big);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("  data groups: 128 of 8 ranks: [0, 8, 16, ..., 56] [1, 9, 17, ..., 57] [2, 10, 18, ..., 58] "
                       "... [967, 975, 983, ..., 1023]\n"),
            std::string::npos)
      << *text;
  EXPECT_NE(text->find("  model-parallel (tensor x pipeline) groups: 8 of 128 ranks: [0-7, 64-71, 128-135, ..., "
                       "960-967] [8-15, 72-79, 136-143, ..., 968-975]"),
            std::string::npos);
  EXPECT_NE(text->find("warning: --tensor-model-parallel-size 8 is more than the 4 GPUs of a node"), std::string::npos);
}

TEST(DryRunReport, RefusesWhatMegatronRefuses) {
  auto refused = [](DryRunOptions o, const std::string& want) {
    auto r = DryRunReport(o);
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(StatusMessage(r.status()).find(want), std::string_view::npos) << r.status();
  };
  DryRunOptions o = Small();
  o.cluster.world_size = 6;
  refused(o, "the world size 6 is not divisible by tensor × pipeline model parallel size 2 × 2 = 4");
  o = Small();
  o.tensor = 16;
  o.cluster.world_size = 32;
  refused(o, "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 16");
  o = Small();
  o.pipeline = 4;
  o.model.num_layers = 6;
  o.cluster.world_size = 16;
  refused(o, "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4");
  o.first_stage_layers = 3;  // 3 layers left for 3 stages: accepted
  EXPECT_TRUE(DryRunReport(o).ok());
  o = Small();
  o.global_batch_size = 6;
  refused(o, "--global-batch-size 6 is not divisible by --micro-batch-size 2 times the data-parallel size 2");
  o = Small();
  o.model.hidden_size = 60;  // not a multiple of the 8 heads
  refused(o, "num_attention_heads 8 does not divide hidden_size 60");
  o = Small();
  o.cluster.world_size = (1 << 20) + 4;
  refused(o, "WORLD_SIZE=1048580: --dry-run plans up to 1048576 ranks");
  // Sequence parallelism at T = 1 is accepted, with Megatron's note.
  o = Small();
  o.tensor = 1;
  o.sequence_parallel = true;
  auto r = DryRunReport(o);
  ASSERT_TRUE(r.ok());
  EXPECT_NE(r->find("note: --sequence-parallel without tensor parallelism: Megatron turns it off (T = 1)\n"),
            std::string::npos);
}

class EnvVars {
 public:
  EnvVars() {
    for (const char* v : kNames) unsetenv(v);
  }
  ~EnvVars() {
    for (const char* v : kNames) unsetenv(v);
  }
  static constexpr const char* kNames[] = {
      "WORLD_SIZE", "RANK", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE"};
};

TEST(DryRunClusterFromEnv, TakesTheLaunchersWorldAndGpusPerNode) {
  EnvVars env;
  auto c = DryRunClusterFromEnv(0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->world_size, 1);
  EXPECT_EQ(c->gpus_per_node, 0);
  setenv("WORLD_SIZE", "1024", 1);  // no RANK needed to plan
  setenv("SLURM_GPUS_ON_NODE", "4", 1);
  c = DryRunClusterFromEnv(0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->world_size, 1024);
  EXPECT_EQ(c->world_source, "WORLD_SIZE");
  EXPECT_EQ(c->rank, 0);
  EXPECT_EQ(c->gpus_per_node, 4);
  EXPECT_EQ(c->gpus_source, "SLURM_GPUS_ON_NODE");
  setenv("LOCAL_WORLD_SIZE", "8", 1);
  setenv("RANK", "5", 1);
  c = DryRunClusterFromEnv(0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->gpus_per_node, 8);
  EXPECT_EQ(c->gpus_source, "LOCAL_WORLD_SIZE");
  EXPECT_EQ(c->rank, 5);
  c = DryRunClusterFromEnv(2);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->gpus_per_node, 2);
  EXPECT_EQ(c->gpus_source, "--gpus-per-node");
  unsetenv("WORLD_SIZE");
  unsetenv("RANK");
  setenv("SLURM_STEP_NUM_TASKS", "16", 1);
  setenv("SLURM_PROCID", "3", 1);
  c = DryRunClusterFromEnv(0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->world_size, 16);
  EXPECT_EQ(c->world_source, "SLURM_STEP_NUM_TASKS");
  EXPECT_EQ(c->rank, 3);
  setenv("WORLD_SIZE", "8x", 1);
  c = DryRunClusterFromEnv(0);
  EXPECT_TRUE(IsUsageError(c.status()));
  EXPECT_EQ(StatusMessage(c.status()), "environment: WORLD_SIZE=\"8x\" is not an integer");
  setenv("WORLD_SIZE", "0", 1);
  c = DryRunClusterFromEnv(0);
  EXPECT_TRUE(IsUsageError(c.status()));
  EXPECT_EQ(StatusMessage(c.status()), "environment: WORLD_SIZE=0 is outside [1, 2147483647]");
  setenv("WORLD_SIZE", "4294967297", 1);
  EXPECT_TRUE(IsUsageError(DryRunClusterFromEnv(0).status()));
  setenv("WORLD_SIZE", "-3", 1);
  EXPECT_TRUE(IsUsageError(DryRunClusterFromEnv(0).status()));
}

}  // namespace
}  // namespace ptk
