// ptk-train --dry-run end to end: the tutorials' jobs planned by one process with their own flags
// (Megatron's GPT-3 175B example on 1024 GPUs, the EKS tutorial's model at tensor 8), Megatron's
// refusals with one line and exit 2, one printing rank under a launcher, and the new flags refused
// in a real run.
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::RunCmd;

int CountOf(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The data and tokenizer paths are the cluster's, absent here: a dry run reads neither.
const std::string kData =
    " --data-path /fsx/gpt2/my-gpt2_text_document --vocab-file /fsx/gpt2/gpt2-vocab.json"
    " --merge-file /fsx/gpt2/gpt2-merges.txt --split 98,2,0";

// Azure's 04-gpt175B.sh (Megatron's GPT-3 175B example): 128 nodes of 8 GPUs.
TEST(DryRunCli, PlansTheGpt3175BExampleOn1024Gpus) {
  auto r =
      RunCmd("WORLD_SIZE=1024 LOCAL_WORLD_SIZE=8 " + testing::Tool("ptk-train") +
             " --dry-run --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048"
             " --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 512 --train-iters 1500"
             " --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16"
             " --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000"
             " --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel"
             " --use-distributed-optimizer --attention-backend auto --ckpt-format torch_dist" +
             kData);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\n > padded vocab (size: 50257) with 943 dummy tokens (new size: 51200)\n"
                          "> initialized tensor model parallel with size 8\n"
                          "> initialized pipeline model parallel with size 16\n"
                          "layout: 1024 ranks = tensor 8 x data 8 x pipeline 16"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("  tensor groups: 128 of 8 ranks: [0-7] [8-15] [16-23] ... [1016-1023]\n"),
            std::string::npos);
  EXPECT_NE(r.output.find("batch: global 512 = micro-batch 1 x 64 micro-batches x data-parallel 8\n"),
            std::string::npos);
  // One line per (tensor, pipeline) rank: 8 × 16.
  EXPECT_EQ(CountOf(r.output, " > number of parameters on (tensor, pipeline) model parallel rank ("), 128);
  for (int t : {0, 7}) {
    const std::string rank = " > number of parameters on (tensor, pipeline) model parallel rank (" + std::to_string(t);
    EXPECT_NE(r.output.find(rank + ", 0): 1463270400\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(rank + ", 8): 1359461376\n"), std::string::npos);
    EXPECT_NE(r.output.find(rank + ", 15): 1438129152\n"), std::string::npos);
  }
  EXPECT_NE(r.output.find("model: 174615846912 parameters"), std::string::npos);
  // The memory table: a row per stage, ZeRO-1 over the 8 data-parallel ranks.
  std::regex row(R"(\n +(\d+) +6 +(\d+) +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+)");
  int rows = 0;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), row); it != std::sregex_iterator(); ++it)
    EXPECT_EQ(std::stoi((*it)[1]), rows++);
  EXPECT_EQ(rows, 16);
  EXPECT_NE(r.output.find("the optimizer state over the 8 data-parallel ranks"), std::string::npos);
  EXPECT_NE(r.output.find("total: as this run is configured (--use-distributed-optimizer, no --recompute-activations);"
                          " the most loaded GPU is stage 0's"),
            std::string::npos);
  EXPECT_NE(r.output.find("note: --vocab-file /fsx/gpt2/gpt2-vocab.json is not on this machine"), std::string::npos);
  EXPECT_EQ(r.output.find("warning"), std::string::npos);
}

// awsome-distributed-training's EKS PyTorchJob (TENSOR_PARALLEL=8, one worker of 8 GPUs): its log
// has "> number of parameters on (tensor, pipeline) model parallel rank (4, 0): 941594624".
TEST(DryRunCli, PlansTheEksTutorialsModelAtTensorEight) {
  auto r = RunCmd("WORLD_SIZE=8 RANK=0 LOCAL_WORLD_SIZE=8 " + testing::Tool("ptk-train") +
                  " --dry-run --tensor-model-parallel-size=8 --pipeline-model-parallel-size=1 --num-layers=36"
                  " --hidden-size=4096 --num-attention-heads=32 --seq-length=2048 --max-position-embeddings=2048"
                  " --micro-batch-size=1 --global-batch-size=288 --train-samples=146484375"
                  " --lr-decay-samples=126953125 --lr-warmup-samples=183105 --lr=6.0e-5 --min-lr=6.0e-6"
                  " --lr-decay-style=cosine --log-interval=1 --eval-iters=40 --eval-interval=1000 --clip-grad=1.0"
                  " --weight-decay=0.1 --adam-beta1=0.9 --adam-beta2=0.95 --init-method-std=0.006 --fp16"
                  " --recompute-activations" +
                  kData);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\n > padded vocab (size: 50257) with 943 dummy tokens (new size: 51200)\n"
                          "> initialized tensor model parallel with size 8\n"
                          "> initialized pipeline model parallel with size 1\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\n > number of parameters on (tensor, pipeline) model parallel rank (4, 0): 941594624\n"),
            std::string::npos);
  EXPECT_EQ(CountOf(r.output, ": 941594624\n"), 8);
  EXPECT_NE(r.output.find("batch: global 288 = micro-batch 1 x 288 micro-batches x data-parallel 1\n"),
            std::string::npos);
  EXPECT_NE(r.output.find("(no --use-distributed-optimizer, --recompute-activations)"), std::string::npos);
}

// Megatron's Llama 3 8B example's model flags (examples/llama), vocabulary 128256 (a multiple of
// 128: nothing padded at T=1): Hugging Face's Meta-Llama-3-8B has 8030261248 parameters; at T=8 each
// rank holds one query group, the vocabulary padded to 129024.
TEST(DryRunCli, PlansLlama3_8BWithItsParameterCount) {
  const std::string llama =
      " --dry-run --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32"
      " --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192"
      " --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000 --use-rope-scaling"
      " --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights"
      " --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 1 --global-batch-size 128 --bf16"
      " --lr 3e-4 --train-iters 100 --vocab-size 128256 --data-path /fsx/llama/text_document";
  auto r = RunCmd("WORLD_SIZE=8 " + testing::Tool("ptk-train") + llama);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 8030261248\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("model: 8030261248 parameters"), std::string::npos);
  EXPECT_NE(r.output.find("SwiGLU's gate, up and fc2 inputs 3sbF"), std::string::npos);
  // Qwen3's query and key norms (--qk-layernorm): 2 x 128 more per layer, whole on every tensor rank.
  auto qk = RunCmd("WORLD_SIZE=8 " + testing::Tool("ptk-train") + llama + " --qk-layernorm");
  ASSERT_EQ(qk.exit_code, 0) << qk.output;
  EXPECT_NE(qk.output.find("model parallel rank (0, 0): " + std::to_string(8030261248LL + 32 * 2 * 128) + "\n"),
            std::string::npos)
      << qk.output;
  r = RunCmd("WORLD_SIZE=16 " + testing::Tool("ptk-train") + llama +
             " --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --sequence-parallel");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 16 layers of 2h + 6·128·h + h·h/8 + 3·1792·h = 27271168 each, plus the first stage's vocabulary
  // slice 129024/8·h and the last stage's slice and final norm h.
  EXPECT_NE(r.output.find("rank (3, 0): " + std::to_string(16 * 27271168LL + 16128LL * 4096) + "\n"),
            std::string::npos);
  EXPECT_NE(r.output.find("rank (7, 1): " + std::to_string(16 * 27271168LL + 16128LL * 4096 + 4096) + "\n"),
            std::string::npos)
      << r.output;
}

// --device cuda takes the Llama line (RMSNorm, RoPE, SwiGLU, query groups, no biases, untied), and
// Qwen3's query and key norms (--qk-layernorm, under RMSNorm and LayerNorm, tensor parallel too): a
// dry run plans it. Only a build without CUDA refuses, and then the device, never the model.
TEST(DryRunCli, TheCudaBackendTakesTheLlamaLine) {
  const std::string llama =
      " --dry-run --device cuda --bf16 --num-layers 2 --hidden-size 256 --num-attention-heads 8"
      " --group-query-attention --num-query-groups 2 --kv-channels 64 --seq-length 512"
      " --position-embedding-type rope --rotary-base 500000 --use-rope-scaling"
      " --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --micro-batch-size 1"
      " --global-batch-size 8 --lr 3e-4 --train-iters 10 --vocab-size 32000 --data-path /fsx/d_text_document";
  for (const std::string& extra :
       {std::string(" --normalization RMSNorm"), std::string(" --normalization RMSNorm --qk-layernorm"),
        std::string(" --qk-layernorm"),
        std::string(" --normalization RMSNorm --qk-layernorm --sequence-parallel"
                    " --tensor-model-parallel-size 2")}) {
    auto r = RunCmd("WORLD_SIZE=2 " + testing::Tool("ptk-train") + llama + extra);
    EXPECT_EQ(r.output.find("GPT-3 model only"), std::string::npos) << extra << ": " << r.output;
    EXPECT_EQ(r.output.find("CPU backend only"), std::string::npos) << extra << ": " << r.output;
    if (r.output.find("built without CUDA") != std::string::npos) {
      EXPECT_EQ(r.exit_code, 2) << r.output;
      continue;
    }
    ASSERT_EQ(r.exit_code, 0) << extra << ": " << r.output;
    EXPECT_NE(r.output.find("model: "), std::string::npos) << r.output;
  }
}

// Megatron's rotary variants (Llama 3.2 1B's --rope-scaling-factor 32, interleaved pairs, linear
// interpolation) plan as the model they are, with its parameter count (RoPE has no weights); a bad
// value is refused naming the flag, as a real run's.
TEST(DryRunCli, PlansTheRotaryVariants) {
  const std::string llama =
      " --dry-run --num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention"
      " --num-query-groups 2 --seq-length 512 --position-embedding-type rope --rotary-base 500000"
      " --normalization RMSNorm --swiglu --disable-bias-linear --micro-batch-size 1 --global-batch-size 8"
      " --lr 3e-4 --train-iters 10 --vocab-size 32000 --data-path /fsx/d_text_document";
  auto plain = RunCmd(testing::Tool("ptk-train") + llama);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const size_t at = plain.output.find("model: ");
  ASSERT_NE(at, std::string::npos) << plain.output;
  const std::string count = plain.output.substr(at, plain.output.find(' ', at + 7) - at);
  for (const std::string extra : {" --use-rope-scaling --rope-scaling-factor 32", " --rotary-interleaved",
                                  " --rotary-seq-len-interpolation-factor 4"}) {
    auto r = RunCmd(testing::Tool("ptk-train") + llama + extra);
    ASSERT_EQ(r.exit_code, 0) << extra << ": " << r.output;
    EXPECT_NE(r.output.find(count), std::string::npos) << extra << ": " << r.output;
  }
  for (const std::string bad :
       {" --use-rope-scaling --rope-scaling-factor 0", " --rotary-seq-len-interpolation-factor -1"}) {
    auto r = RunCmd(testing::Tool("ptk-train") + llama + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("usage error: --r"), std::string::npos) << bad << ": " << r.output;
  }
}

TEST(DryRunCli, RefusesWhatMegatronRefusesWithOneLine) {
  const std::string model =
      testing::Tool("ptk-train") + " --dry-run --num-layers 36 --hidden-size 4096 --seq-length 2048 --lr 1e-4";
  struct Case {
    std::string env, flags, want;
  } cases[] = {
      {"WORLD_SIZE=12", "--num-attention-heads 32 --tensor-model-parallel-size 8",
       "usage error: the world size 12 is not divisible by tensor × pipeline model parallel size 8 × 1 = 8"},
      {"WORLD_SIZE=8", "--num-attention-heads 32 --tensor-model-parallel-size 8 --ffn-hidden-size 1001",
       "usage error: --ffn-hidden-size 1001 is not divisible by --tensor-model-parallel-size 8"},
      {"WORLD_SIZE=64", "--num-attention-heads 32 --tensor-model-parallel-size 64",
       "usage error: --num-attention-heads 32 is not divisible by --tensor-model-parallel-size 64"},
      {"WORLD_SIZE=40", "--num-attention-heads 32 --pipeline-model-parallel-size 5",
       "usage error: --num-layers 36 is not divisible by --pipeline-model-parallel-size 5"},
      {"WORLD_SIZE=8", "--num-attention-heads 32 --global-batch-size 12",
       "usage error: --global-batch-size 12 is not divisible by --micro-batch-size 1 times the data-parallel size 8"},
      {"WORLD_SIZE=8x", "--num-attention-heads 32", "usage error: environment: WORLD_SIZE=\"8x\" is not an integer"},
      {"WORLD_SIZE=8",
       "--num-attention-heads 32 --tensor-model-parallel-size 8 --group-query-attention --num-query-groups 4",
       "usage error: --num-query-groups 4 is not divisible by --tensor-model-parallel-size 8"},
      {"WORLD_SIZE=8", "--num-attention-heads 32 --num-experts 8",
       "usage error: --num-experts without --disable-bias-linear: ptk's MoE layers have no biases"},
      {"WORLD_SIZE=8", "--num-attention-heads 32 --num-experts 8 --disable-bias-linear --tensor-model-parallel-size 2",
       "usage error: --num-experts 8 with --tensor-model-parallel-size 2 needs --sequence-parallel (as Megatron: "
       "\"When using MoE and tensor parallelism, sequence parallelism must be used.\")"},
      {"WORLD_SIZE=8", "--num-attention-heads 32 --num-experts 8 --disable-bias-linear --expert-model-parallel-size 3",
       "usage error: --num-experts 8 is not divisible by --expert-model-parallel-size 3"},
      {"WORLD_SIZE=6", "--num-attention-heads 32 --num-experts 8 --disable-bias-linear --expert-model-parallel-size 4",
       "usage error: --expert-model-parallel-size 4: the data-parallel size 6"},
  };
  for (const Case& c : cases) {
    auto r = RunCmd(c.env + " " + model + " " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    // The one line, and the usage hint every tool prints after a usage error.
    EXPECT_EQ(r.output.find("ptk-train: " + c.want), 0u) << c.flags << "\n" << r.output;
    EXPECT_EQ(r.output.substr(r.output.find('\n') + 1), "Run with --help for more information.\n") << r.output;
  }
  // Uneven stages as Megatron splits them: 36 = 4 + 4 × 7 + 4 over 6 stages.
  auto r = RunCmd("WORLD_SIZE=48 " + model +
                  " --num-attention-heads 32 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 6"
                  " --decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 4 --sequence-parallel");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::regex row(R"(\n +(\d+) +(\d+) +(\d+) +[0-9.]+ )");
  std::string layers;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), row); it != std::sregex_iterator(); ++it)
    layers += (*it)[2].str() + " ";
  EXPECT_EQ(layers, "4 7 7 7 7 4 ");
}

TEST(DryRunCli, OneRankPrintsAndTensorBeyondANodeIsWarned) {
  const std::string run = testing::Tool("ptk-train") +
                          " --dry-run --num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32"
                          " --lr 1e-4 --tensor-model-parallel-size 8";
  auto r = RunCmd("WORLD_SIZE=16 RANK=3 " + run);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "");
  r = RunCmd("SLURM_STEP_NUM_TASKS=16 SLURM_PROCID=0 SLURM_GPUS_ON_NODE=4 " + run);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dry run: 16 ranks (SLURM_STEP_NUM_TASKS), 4 GPUs per node (SLURM_GPUS_ON_NODE)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\nwarning: --tensor-model-parallel-size 8 is more than the 4 GPUs of a node"),
            std::string::npos);
  // One process, no launcher: a world of one cannot hold tensor 8.
  r = RunCmd("env -u WORLD_SIZE -u RANK " + run);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the world size 1 is not divisible"), std::string::npos) << r.output;
}

// --decrease-batch-size-if-needed: the plan is the real run's, a global batch of 7 over 2 data ranks cut to 6 with
// the line the real run prints (iterations_to_skip_cli_test DecreaseBatchSizeIfNeededTrainsTheLargestMultiple), and
// its memory that of 3 micro-batches; without the flag, or with no micro-batch left, refused as the real run is.
TEST(DryRunCli, DecreaseBatchSizeIfNeededPlansTheBatchTheRunTrainsOn) {
  const std::string run = testing::Tool("ptk-train") +
                          " --dry-run --num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32"
                          " --lr 1e-4 --micro-batch-size 1 --pipeline-model-parallel-size 2";
  auto cut = RunCmd("WORLD_SIZE=4 " + run + " --global-batch-size 7 --decrease-batch-size-if-needed");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  EXPECT_NE(cut.output.find("\ndecreasing batch size from 7 to 6to keep divisiblity by micro_batch_size=1 * "
                            "data_parallel_size=2\n"),
            std::string::npos)
      << cut.output;
  EXPECT_NE(cut.output.find("batch: global 6 = micro-batch 1 x 3 micro-batches x data-parallel 2"), std::string::npos)
      << cut.output;
  // The plan of a global batch of 6 in all but the cut's line.
  auto six = RunCmd("WORLD_SIZE=4 " + run + " --global-batch-size 6");
  ASSERT_EQ(six.exit_code, 0) << six.output;
  std::string without = cut.output;
  const size_t line = without.find("decreasing batch size"), next = without.find("batch: global");
  ASSERT_TRUE(line != std::string::npos && next > line) << cut.output;
  without.erase(line, next - line);
  EXPECT_EQ(without, six.output);
  auto plain = RunCmd("WORLD_SIZE=4 " + run + " --global-batch-size 7");
  EXPECT_EQ(plain.exit_code, 2) << plain.output;
  EXPECT_EQ(plain.output.find("ptk-train: usage error: --global-batch-size 7 is not divisible by --micro-batch-size 1 "
                              "times the data-parallel size 2 (or give --decrease-batch-size-if-needed)\n"),
            0u)
      << plain.output;
  auto none = RunCmd("WORLD_SIZE=16 " + run + " --global-batch-size 7 --decrease-batch-size-if-needed");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("no micro-batch is left"), std::string::npos) << none.output;
  // With a ramp: refused, as the real run refuses it (iterations_to_skip_cli_test).
  auto ramp =
      RunCmd("WORLD_SIZE=4 " + run +
             " --global-batch-size 7 --decrease-batch-size-if-needed --rampup-batch-size 2 2 12 --train-samples 40");
  EXPECT_EQ(ramp.exit_code, 2) << ramp.output;
  EXPECT_NE(ramp.output.find("--decrease-batch-size-if-needed with --rampup-batch-size is not implemented"),
            std::string::npos)
      << ramp.output;
}

// A real run takes the stage flags with several stages only (Megatron's refusal).
TEST(DryRunCli, PipelineStageFlagsNeedSeveralStagesInARealRun) {
  auto r = RunCmd(testing::Tool("ptk-train") +
                  " --num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --lr 1e-4 --mock-data"
                  " --train-iters 1 --decoder-first-pipeline-num-layers 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("usage error: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                          "need --pipeline-model-parallel-size above 1"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace ptk
