// What a CPU run needs before its model is made (trainer/memory_estimate.h): the activation floats
// planned are the ones the model's pass allocates, for GPT-3's and the Llama line's shapes; the
// memory available is the least of MemAvailable, every cgroup's limit less its use and ulimit -v;
// a run that does not fit is refused in one line with both figures.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "common/system_memory.h"
#include "tests/test_util.h"
#include "tests/trainer/gloo_ranks.h"
#include "tests/trainer/small_gpt.h"
#include "tests/trainer/test_batches.h"
#include "trainer/cpu/cpu_gpt_model.h"
#include "trainer/memory_estimate.h"

namespace ptk {
namespace {

GPTConfig Gpt3() { return testing::SmallGpt(3, 32, 4, 16, 97, 97); }

GPTConfig Llama() {
  GPTConfig c = Gpt3();
  testing::SwitchToLlama(c, 2);
  return c;
}

// The plan is what a training pass sizes: every activation buffer of ActivationFloats.
TEST(MemoryEstimate, PlannedActivationsAreWhatThePassAllocates) {
  GPTConfig recompute = Gpt3();
  recompute.recompute_activations = true;
  GPTConfig shared = Gpt3();  // MoE layers (dense, MoE, MoE) with gated shared experts
  shared.add_bias_linear = false;
  shared.num_experts = 4;
  shared.moe_layer_pattern = {0, 1, 1};
  shared.moe_shared_expert_intermediate_size = 24;
  shared.moe_shared_expert_gate = true;
  for (const GPTConfig& c : {Gpt3(), recompute, Llama(), shared}) {
    auto model = CpuGPTModel::Create(c);
    ASSERT_TRUE(model.ok()) << model.status();
    testing::Batches batches(1, c.seq_length);
    ASSERT_TRUE((*model)->ForwardBackward(batches.Get(0), 1.0, /*train=*/true, 7).ok());
    EXPECT_EQ(CpuGPTModel::PlanActivationFloats((*model)->layout(), false, 2), (*model)->ActivationFloats());
    auto m = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 2, 4, /*checkpoints=*/true, 0, 1);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->params, (*model)->num_params());
    EXPECT_EQ(m->weights_and_optimizer, 16.0 * static_cast<double>((*model)->num_params()));
    EXPECT_EQ(m->checkpoint_copies, 12.0 * static_cast<double>((*model)->num_params()));
    EXPECT_EQ(m->activation_slots, 1);
    EXPECT_EQ(m->activations, 4.0 * static_cast<double>((*model)->ActivationFloats()) + 4.0 * 32 + 8.0 * 2);
  }
}

// Tensor parallelism splits each expert's ffn columns over the tensor ranks (Megatron's expert tensor parallelism:
// what it divides by the tensor size), the shared experts' too: a rank's plan is what its pass allocates, with and
// without sequence parallelism. The plan counted each expert's whole width on every tensor rank.
TEST(MemoryEstimate, ATensorRankPlansItsSliceOfTheExperts) {
  GPTConfig c = Gpt3();
  c.add_bias_linear = false;
  c.num_experts = 4;
  c.moe_layer_pattern = {0, 1, 1};
  c.moe_ffn_hidden_size = 48;
  c.moe_shared_expert_intermediate_size = 24;
  c.padded_vocab_size = 98;  // a multiple of the tensor size
  for (const bool sp : {false, true}) {
    std::vector<int64_t> planned(2, -1), allocated(2, -2);
    testing::RunRanks(2, [&](Communicator* tensor, int rank) {
      auto model = CpuGPTModel::Create(c, tensor, sp);
      ASSERT_TRUE(model.ok()) << model.status();
      testing::Batches batches(1, c.seq_length);
      ASSERT_TRUE((*model)->ForwardBackward(batches.Get(0), 1.0, /*train=*/true, 7).ok());
      allocated[static_cast<size_t>(rank)] = (*model)->ActivationFloats();
      planned[static_cast<size_t>(rank)] = CpuGPTModel::PlanActivationFloats((*model)->layout(), sp, 2);
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(planned[static_cast<size_t>(r)], allocated[static_cast<size_t>(r)]) << sp;
  }
}

// Expert parallelism: a rank's weights, gradients and moments are its own experts' (num_experts / E of each MoE
// layer) and the rest's, what its model allocates.
TEST(MemoryEstimate, AnExpertRankCountsItsOwnExpertsOnly) {
  GPTConfig c = Gpt3();
  c.add_bias_linear = false;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 48;
  auto whole = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 1, 1, /*checkpoints=*/true, 0, 1);
  auto mine = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 1, 1, /*checkpoints=*/true, 0, 1, 1, /*expert_size=*/2);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto layout = ParamLayout::Create(c, 1, 0, {}, 2, 0);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(mine->params, layout->num_params);
  EXPECT_EQ(mine->params, whole->params - 3 * 2 * c.expert_floats());  // 3 layers x the other rank's 2 experts
  EXPECT_EQ(mine->weights_and_optimizer, 16.0 * static_cast<double>(mine->params));
  EXPECT_EQ(mine->checkpoint_copies, 12.0 * static_cast<double>(mine->params));
}

// Pipeline stages keep the activations of the micro-batches in flight: 1F1B's min(P - p, M).
TEST(MemoryEstimate, PipelineStagesKeepTheirMicroBatchesInFlight) {
  const GPTConfig c = Gpt3();
  PipelineStage first{.size = 3, .rank = 0, .first_layer = 0, .num_layers = 1};
  PipelineStage last{.size = 3, .rank = 2, .first_layer = 2, .num_layers = 1};
  auto a = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 8, false);
  auto b = EstimateCpuTrainingMemory(c, 1, 0, false, last, 2, 8, false);
  auto few = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 2, false);
  ASSERT_TRUE(a.ok() && b.ok() && few.ok());
  EXPECT_EQ(a->activation_slots, 3);
  EXPECT_EQ(b->activation_slots, 1);
  EXPECT_EQ(few->activation_slots, 2);
  EXPECT_EQ(a->checkpoint_copies, 0);
}

// Multi-token prediction: the depths' buffers (each a one-layer pass and its own vectors) counted on the stage that
// holds them, the last, and not on the first.
TEST(MemoryEstimate, MultiTokenPredictionCountsTheDepthsOnTheLastStage) {
  GPTConfig c = Gpt3();
  c.position_embedding = PositionEmbedding::kRope;
  GPTConfig mtp = c;
  mtp.mtp_num_layers = 2;
  PipelineStage first{.size = 2, .rank = 0, .first_layer = 0, .num_layers = 2};
  PipelineStage last{.size = 2, .rank = 1, .first_layer = 2, .num_layers = 1};
  auto a = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 8, false);
  auto b = EstimateCpuTrainingMemory(c, 1, 0, false, last, 2, 8, false);
  auto ma = EstimateCpuTrainingMemory(mtp, 1, 0, false, first, 2, 8, false);
  auto mb = EstimateCpuTrainingMemory(mtp, 1, 0, false, last, 2, 8, false);
  ASSERT_TRUE(a.ok() && b.ok() && ma.ok() && mb.ok());
  EXPECT_EQ(ma->activations, a->activations);
  auto layout = ParamLayout::Create(mtp, 1, 0, last);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t depths = CpuGPTModel::PlanMtpActivationFloats(*layout, 2);
  const int64_t n = 2 * c.seq_length, h = c.hidden_size;
  EXPECT_GT(depths, 2 * 9 * n * h);  // at least each depth's own vectors
  EXPECT_EQ(mb->activations, b->activations + 4.0 * static_cast<double>(depths));
  EXPECT_EQ(mb->params, layout->num_params);
}

// Under sequence parallelism a tensor rank's depths hold its t / T positions of their norms and layer (and the
// whole-sequence buffers of eh_proj's gather): the estimate counts the depths as a sequence-parallel run makes them.
TEST(MemoryEstimate, MultiTokenPredictionUnderSequenceParallelismCountsTheSequenceParallelDepths) {
  GPTConfig c = testing::SmallGpt(3, 32, 4, 16, 97, 98);  // the padded vocabulary split over the two ranks
  c.position_embedding = PositionEmbedding::kRope;
  GPTConfig mtp = c;
  mtp.mtp_num_layers = 2;
  const PipelineStage one;
  auto plain = EstimateCpuTrainingMemory(c, 2, 1, true, one, 2, 8, false);
  auto with = EstimateCpuTrainingMemory(mtp, 2, 1, true, one, 2, 8, false);
  ASSERT_TRUE(plain.ok() && with.ok()) << plain.status() << with.status();
  auto layout = ParamLayout::Create(mtp, 2, 1, one);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t sp = CpuGPTModel::PlanMtpActivationFloats(*layout, 2, true);
  EXPECT_NE(sp, CpuGPTModel::PlanMtpActivationFloats(*layout, 2, false));
  EXPECT_EQ(with->activations, plain->activations + 4.0 * static_cast<double>(sp));
}

// With model chunks, Megatron's interleaved warm-up plus one, (P - p - 1) x 2 + (V - 1) x N + 1 virtual
// micro-batches: N the micro-batch group (--microbatch-group-size-per-virtual-pipeline-stage, by
// default P), at most V x M.
TEST(MemoryEstimate, InterleavedStagesKeepTheirGroupsInFlight) {
  GPTConfig c = Gpt3();
  c.num_layers = 4;
  const PipelineStage first = StageOf({2, 2}, 0, 2);
  auto by_default = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 8, false);
  auto threes = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 8, false, 3);
  auto whole = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 8, false, 8);
  ASSERT_TRUE(by_default.ok() && threes.ok() && whole.ok()) << by_default.status() << threes.status() << whole.status();
  EXPECT_EQ(by_default->activation_slots, 2 + 2 + 1);
  EXPECT_EQ(threes->activation_slots, 2 + 3 + 1);
  EXPECT_EQ(whole->activation_slots, 2 + 8 + 1);
  EXPECT_GT(whole->activations, by_default->activations);
}

AvailableMemory Available(int64_t bytes, const std::string& source) {
  AvailableMemory a;
  a.bytes = a.shared_bytes = bytes;
  a.source = a.shared_source = source;
  return a;
}

// Attention's work buffers are transient: 2 t^2 floats for each thread running a backward task (the
// (sequence, query group) pairs), counted once (not per layer nor per micro-batch in flight), in the
// total and named in the breakdown; a forward with attention dropout holds t^2 per (sequence, head) task.
TEST(MemoryEstimate, AttentionWorkBuffersArePerThreadWhileAttentionRuns) {
  GPTConfig c = Gpt3();  // 4 heads; micro-batches of 2: 8 backward tasks
  c.attention_dropout = 0;
  PipelineStage first{.size = 3, .rank = 0, .first_layer = 0, .num_layers = 2};
  for (const int64_t t : {16, 64, 8192}) {
    c.seq_length = c.max_position_embeddings = t;
    auto one = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 2, 4, false, 0, 1);
    ASSERT_TRUE(one.ok()) << one.status();
    const double per_thread = 2.0 * 4 * static_cast<double>(t * t);
    EXPECT_EQ(one->attention_work, per_thread);
    EXPECT_EQ(one->attention_threads, 1);
    EXPECT_EQ(one->total(), one->weights_and_optimizer + one->activations + per_thread);
    for (const int threads : {2, 3, 8, 20}) {
      auto m = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 2, 4, false, 0, threads);
      ASSERT_TRUE(m.ok()) << m.status();
      const int64_t running = std::min(threads, 8);  // no more threads than tasks hold a buffer
      EXPECT_EQ(m->attention_threads, running);
      EXPECT_EQ(m->total() - one->total(), per_thread * static_cast<double>(running - 1)) << t << " " << threads;
      EXPECT_EQ(m->activations, one->activations);
      // A pipeline stage of 2 layers keeping 3 micro-batches: still one set of buffers.
      auto staged = EstimateCpuTrainingMemory(c, 1, 0, false, first, 2, 4, false, 0, threads);
      ASSERT_TRUE(staged.ok()) << staged.status();
      EXPECT_EQ(staged->activation_slots, 3);
      EXPECT_EQ(staged->attention_work, m->attention_work);
    }
    // Two tensor ranks: each runs half the heads, 4 tasks.
    GPTConfig split = c;
    split.padded_vocab_size = 98;
    auto tp = EstimateCpuTrainingMemory(split, 2, 1, false, {}, 2, 4, false, 0, 8);
    ASSERT_TRUE(tp.ok()) << tp.status();
    EXPECT_EQ(tp->attention_work, 4 * per_thread);
  }
  // 512 MiB a thread at t = 8192, named in the refusal.
  const absl::Status st = CheckFitsInMemory(*EstimateCpuTrainingMemory(c, 1, 0, false, {}, 1, 1, false, 0, 1),
                                            Available(1000, "ulimit -v"));
  EXPECT_NE(std::string(st.message()).find("; 512.0 MiB for attention's work buffers while it runs (1 thread))"),
            std::string::npos)
      << st;
  // Grouped-query attention with dropout: forward's t^2 for each of 8 (sequence, head) tasks outweighs
  // backward's 2 t^2 for each of 2 (sequence, group) tasks.
  GPTConfig gqa = Llama();
  gqa.num_query_groups = 1;
  gqa.attention_dropout = 0.1;
  auto g = EstimateCpuTrainingMemory(gqa, 1, 0, false, {}, 2, 4, false, 0, 16);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->attention_threads, 8);
  EXPECT_EQ(g->attention_work, 4.0 * 16 * 16 * 8);
  gqa.attention_dropout = 0;
  EXPECT_EQ(EstimateCpuTrainingMemory(gqa, 1, 0, false, {}, 2, 4, false, 0, 16)->attention_work, 4.0 * 16 * 16 * 2 * 2);
}

// A context rank (--context-parallel-size C) holds seq_length / C positions of each sample: its
// activations are what CpuGPTModel sizes for them (the attention's probabilities t/C x t a head), the
// attention's work buffers t/C x t a thread; the weights and the optimizer state do not change.
TEST(MemoryEstimate, AContextRankHoldsItsPositionsActivations) {
  GPTConfig c = Gpt3();
  c.seq_length = c.max_position_embeddings = 256;
  auto one = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 2, 4, false, 0, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok());
  for (const int C : {2, 4}) {
    auto cp = EstimateCpuTrainingMemory(c, 1, 0, false, {}, 2, 4, false, 0, 1, C);
    ASSERT_TRUE(cp.ok()) << cp.status();
    EXPECT_EQ(cp->weights_and_optimizer, one->weights_and_optimizer);
    EXPECT_EQ(cp->attention_work, one->attention_work / C);
    const double tokens = 2.0 * 256 / C;  // the targets and the dropout streams
    EXPECT_EQ(cp->activations,
              4.0 * static_cast<double>(CpuGPTModel::PlanActivationFloats(*layout, false, 2, C)) + 4.0 * tokens + 16.0);
    // Dominated by the probabilities (3 layers x 2 x 4 heads x 256 x 256 / C): near 1/C of one rank's, plus the
    // gathered QKV and its gradient (the whole samples' rows, transient).
    EXPECT_LT(cp->activations, one->activations / C * 1.3) << C;
    std::printf("C=%d: %.3f of one rank's activations\n", C, cp->activations / one->activations);
  }
}

void Put(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  testing::WriteFile(path, text);
}

// MemAvailable, then a cgroup v2 limit less its use (less the inactive page cache it can reclaim)
// when that is less; a parent's "max" is no limit.
TEST(SystemMemory, TheLeastOfMemAvailableAndTheCgroupLimits) {
  testing::TempDir root;
  Put(root / "proc/meminfo", "MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n");
  EXPECT_EQ(ReadAvailableMemory(root.path()).bytes, int64_t{8000000} * 1024);
  EXPECT_EQ(ReadAvailableMemory(root.path()).source, "MemAvailable in /proc/meminfo");
  EXPECT_EQ(ReadAvailableMemory(root.path()).shared_bytes, int64_t{8000000} * 1024);  // what a node's ranks share
  Put(root / "proc/self/cgroup", "0::/job/step\n");
  Put(root / "sys/fs/cgroup/memory.max", "max\n");
  Put(root / "sys/fs/cgroup/memory.current", "123\n");
  Put(root / "sys/fs/cgroup/job/memory.max", "4294967296\n");
  Put(root / "sys/fs/cgroup/job/memory.current", "3221225472\n");
  Put(root / "sys/fs/cgroup/job/memory.stat", "anon 100\ninactive_file 536870912\nactive_file 5\n");
  const AvailableMemory a = ReadAvailableMemory(root.path());
  EXPECT_EQ(a.bytes, int64_t{4294967296} - (int64_t{3221225472} - 536870912));
  EXPECT_EQ(a.source, "the cgroup limit 4.0 GiB (/sys/fs/cgroup/job) less its use");
  EXPECT_EQ(a.shared_bytes, a.bytes);
  EXPECT_EQ(a.shared_source, a.source);
  // cgroup v1: memory.limit_in_bytes (no limit: a number near 2^63) and memory.usage_in_bytes.
  testing::TempDir v1;
  Put(v1 / "proc/meminfo", "MemAvailable:    8000000 kB\n");
  Put(v1 / "proc/self/cgroup", "5:cpu,memory:/slurm/job1\n1:name=systemd:/\n");
  Put(v1 / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  Put(v1 / "sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n");
  Put(v1 / "sys/fs/cgroup/memory/slurm/job1/memory.limit_in_bytes", "2147483648\n");
  Put(v1 / "sys/fs/cgroup/memory/slurm/job1/memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(ReadAvailableMemory(v1.path()).bytes, int64_t{1073741824});
  testing::TempDir none;
  EXPECT_EQ(ReadAvailableMemory(none.path()).bytes, -1);  // nothing to check against
  EXPECT_GT(ReadAvailableMemory().bytes, 0);              // this machine's
}

TEST(MemoryEstimate, ARunThatDoesNotFitIsRefusedWithBothFigures) {
  CpuTrainingMemory need;
  need.params = 1000000;
  need.weights_and_optimizer = 16e6;
  need.activation_slots = 2;
  need.activations = 4e6;
  EXPECT_TRUE(CheckFitsInMemory(need, Available(20000000, "x")).ok());
  EXPECT_TRUE(CheckFitsInMemory(need, Available(-1, "")).ok());
  const absl::Status st = CheckFitsInMemory(need, Available(10000000, "MemAvailable in /proc/meminfo"));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(st.message()),
            "not enough memory: this rank needs 19.1 MiB (1000000 parameters: 15.3 MiB for the weights, gradients and "
            "AdamW moments; 3.8 MiB of activations for 2 micro-batches in flight), and 9.5 MiB is available "
            "(MemAvailable in /proc/meminfo); nothing was allocated: use a smaller model, --micro-batch-size or "
            "--seq-length, --recompute-activations, or more tensor or pipeline ranks");
  EXPECT_EQ(TheoreticalMemoryLine(need),
            "Theoretical memory footprints: weight and optimizer=15.26 MB, activation=3.81 MB, total=19.07 MB");
}

// Ranks on one machine share its memory: N ranks of 19.07 MiB each fit in 50 MB when N <= 2, and
// three are refused with the node's total, the count and where it comes from. ulimit -v is each
// process's own: it bounds one rank, not the node's sum. One rank keeps the message above.
TEST(MemoryEstimate, TheRanksOnOneNodeAreCheckedTogether) {
  CpuTrainingMemory need;
  need.params = 1000000;
  need.weights_and_optimizer = 16e6;
  need.activation_slots = 1;
  need.activations = 4e6;
  const AvailableMemory node = Available(50000000, "MemAvailable in /proc/meminfo");
  EXPECT_TRUE(CheckFitsInMemory(need, node, 1, "").ok());
  EXPECT_TRUE(CheckFitsInMemory(need, node, 2, "LOCAL_WORLD_SIZE").ok());
  const absl::Status st = CheckFitsInMemory(need, node, 3, "LOCAL_WORLD_SIZE");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(st.message()),
            "not enough memory on this node: its 3 ranks (LOCAL_WORLD_SIZE) need 57.2 MiB together, 19.1 MiB each "
            "(1000000 parameters: 15.3 MiB for the weights, gradients and AdamW moments; 3.8 MiB of activations for 1 "
            "micro-batch in flight), and 47.7 MiB is available (MemAvailable in /proc/meminfo); nothing was allocated: "
            "start fewer ranks on each node, or use a smaller model, --micro-batch-size or --seq-length, "
            "--recompute-activations, or more tensor or pipeline ranks");
  // ulimit -v at 25 MB for each process, 100 MB on the machine: four ranks fit, six do not.
  AvailableMemory limited = Available(100000000, "MemAvailable in /proc/meminfo");
  limited.bytes = 25000000;
  limited.source = "ulimit -v";
  EXPECT_TRUE(CheckFitsInMemory(need, limited, 4, "LOCAL_WORLD_SIZE").ok());
  EXPECT_EQ(CheckFitsInMemory(need, limited, 6, "LOCAL_WORLD_SIZE")
                .message()
                .rfind("not enough memory on this node: its 6 ranks", 0),
            0u);
  limited.bytes = 10000000;
  EXPECT_EQ(CheckFitsInMemory(need, limited, 2, "LOCAL_WORLD_SIZE")
                .message()
                .rfind("not enough memory: this rank needs 19.1 MiB", 0),
            0u);
  // Nothing shared could be read: only this rank's own limit.
  limited.shared_bytes = -1;
  limited.bytes = 25000000;
  EXPECT_TRUE(CheckFitsInMemory(need, limited, 64, "LOCAL_WORLD_SIZE").ok());
}

}  // namespace
}  // namespace ptk
